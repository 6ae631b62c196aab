"""`lmtrain eval --prompts`: every bad input is one line before any generation runs (a file that is not UTF-8 or is
nested too deeply, a temperature or top-k that cannot sample, an output that is a directory, missing, read-only, or
the prompts file itself under any name); --limit is honoured; chat prompts may carry the reference in a `reference`
field; the BLEU signature is sacrebleu's own."""

from __future__ import annotations

import argparse
import errno
import json
import os

import pytest
from trained_runs import tiny_run

import lmtrain.generation_eval as generation_eval
from lmtrain.cli import main
from lmtrain.errors import LmtrainError

pytest.importorskip("sacrebleu", reason="the eval extra (sacrebleu, rouge-score) is not installed")
pytest.importorskip("rouge_score", reason="the eval extra (sacrebleu, rouge-score) is not installed")

PROMPT = {"prompt": "def f(x):\n", "reference": "    return x\n"}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return tiny_run(tmp_path_factory)


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(PROMPT | {"prompt": f"def f{i}(x):\n"}) + "\n" for i in range(10)))
    return path


def _no_generation(monkeypatch):
    def refused(*args, **kwargs):
        raise AssertionError("generated before the bad input was refused")

    monkeypatch.setattr(generation_eval, "generate_answers", refused)


def _deep(tmp_path, prompts):
    prompts.write_text('{"prompt": ' + "[" * 100_000 + "]" * 100_000 + ', "reference": "x"}\n')
    return {}


def _latin1(tmp_path, prompts):
    prompts.write_bytes(b'{"prompt": "caf\xe9", "reference": "x"}\n')
    return {}


def _gen_dir(tmp_path, prompts):
    (tmp_path / "gen").mkdir()
    return {"--generations": str(tmp_path / "gen")}


def _gen_missing_dir(tmp_path, prompts):
    return {"--generations": str(tmp_path / "nowhere" / "gen.jsonl")}


def _gen_same(tmp_path, prompts):
    return {"--generations": str(prompts)}


def _gen_hardlink(tmp_path, prompts):
    os.link(prompts, tmp_path / "also.jsonl")
    return {"--generations": str(tmp_path / "also.jsonl")}


def _gen_symlink(tmp_path, prompts):
    (tmp_path / "link.jsonl").symlink_to(prompts)
    return {"--generations": str(tmp_path / "link.jsonl")}


def _gen_relative(tmp_path, prompts):
    return {"--generations": str(tmp_path / "sub" / ".." / prompts.name)}


def _flag(flag, value):
    return lambda tmp_path, prompts: {flag: value}


# (case, what makes the input bad (flags it returns), words of the one-line error)
BAD = [
    ("100k nested brackets", _deep, "nested deeper than the parser goes"),
    ("not UTF-8", _latin1, "expected UTF-8 JSONL"),
    ("temperature nan", _flag("--temperature", "nan"), "--temperature must be a finite number >= 0"),
    ("temperature -1", _flag("--temperature", "-1"), "--temperature must be a finite number >= 0"),
    ("temperature inf", _flag("--temperature", "inf"), "--temperature must be a finite number >= 0"),
    ("top-k 0", _flag("--top-k", "0"), "--top-k must be an integer >= 1"),
    ("top-k -2", _flag("--top-k", "-2"), "--top-k must be an integer >= 1"),
    ("max-new-tokens 0", _flag("--max-new-tokens", "0"), "--max-new-tokens must be an integer >= 1"),
    ("generations is a directory", _gen_dir, "is a directory"),
    ("generations in a missing directory", _gen_missing_dir, "does not exist"),
    ("generations is the prompts file", _gen_same, "is --prompts"),
    ("generations is a hard link of the prompts", _gen_hardlink, "(the same file)"),
    ("generations is a symbolic link to the prompts", _gen_symlink, "(the same file)"),
    ("generations is the prompts by another path", _gen_relative, "(the same file)"),
]


@pytest.mark.parametrize(("bad", "said"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_is_one_line_before_any_generation(run, prompts, tmp_path, capsys, monkeypatch, bad, said):
    flags = {"--generations": str(tmp_path / "gen.jsonl"), "--max-new-tokens": "2"} | bad(tmp_path, prompts)
    content = prompts.read_bytes()
    _no_generation(monkeypatch)
    capsys.readouterr()
    argv = ["eval", "--run", str(run), "--prompts", str(prompts), *[x for kv in flags.items() for x in kv]]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("lmtrain eval: error: ") and said in err[0], err
    assert prompts.read_bytes() == content  # the input is never replaced
    assert not (tmp_path / "gen.jsonl").exists()


def test_a_read_only_output_is_one_line_before_any_generation(run, prompts, tmp_path, monkeypatch):
    import trainloop.checkpoint

    def read_only(path, mode="w"):
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr(trainloop.checkpoint, "open_new", read_only)
    _no_generation(monkeypatch)
    with pytest.raises(LmtrainError, match="read-only filesystem: cannot write .*gen.jsonl"):
        generation_eval.evaluate_prompts(run, prompts, tmp_path / "gen.jsonl", max_new_tokens=2)


# --limit: a count, or a share of the prompts (rounded up), as for --tasks
LIMITS = [(5, 5), (10, 10), (50, 10), (0.25, 3), (None, 10)]


@pytest.mark.parametrize(("limit", "n"), LIMITS)
def test_limit_takes_the_first_prompts(run, prompts, tmp_path, limit, n):
    result = generation_eval.evaluate_prompts(run, prompts, tmp_path / "gen.jsonl", max_new_tokens=2, limit=limit)
    rows = (tmp_path / "gen.jsonl").read_text().splitlines()
    assert result["count"] == n and len(rows) == n
    assert [json.loads(r)["prompt"] for r in rows] == [f"def f{i}(x):\n" for i in range(n)]


@pytest.mark.parametrize("limit", [float("nan"), float("inf"), -1, 0, 2.5])
def test_a_limit_that_is_no_count_or_share_is_refused(run, prompts, tmp_path, monkeypatch, limit):
    _no_generation(monkeypatch)
    with pytest.raises(LmtrainError, match="--limit"):
        generation_eval.evaluate_prompts(run, prompts, tmp_path / "gen.jsonl", max_new_tokens=2, limit=limit)


def _args(run, prompts, out, **kw):
    base = dict(run=str(run), prompts=str(prompts), generations=str(out), checkpoint="best", max_new_tokens=2,
                temperature=0.0, generation_seed=None, top_k=None, device=None, json=False, limit=None)  # fmt: skip
    return argparse.Namespace(**(base | kw))


def test_the_command_honours_limit_and_prints_sacrebleus_signature(run, prompts, tmp_path, capsys):
    assert generation_eval.run_prompts(_args(run, prompts, tmp_path / "gen.jsonl", limit=5.0)) == 0
    out = capsys.readouterr().out
    assert "5 prompts" in out and "(sacrebleu nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:" in out, out
    assert "|True" not in out
    assert len((tmp_path / "gen.jsonl").read_text().splitlines()) == 5


def test_the_cli_prints_no_boolean_as_the_bleu_signature(run, prompts, tmp_path, capsys):
    argv = ["eval", "--run", str(run), "--prompts", str(prompts), "--generations", str(tmp_path / "g.jsonl"),
            "--max-new-tokens", "2"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "BLEU-4" in out and "nrefs:1|" in out and "|True" not in out, out


def test_chat_prompts_may_carry_the_reference_in_a_field(run, tmp_path):
    path = tmp_path / "heldout.jsonl"
    rows = [{"messages": [{"role": "system", "content": "Answer in code."}, {"role": "user", "content": "def f(x):"}],
             "reference": "return x"}, {"messages": [{"role": "user", "content": "q"}], "reference": "a"}]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = generation_eval.evaluate_prompts(run, path, tmp_path / "gen.jsonl", max_new_tokens=2)
    written = [json.loads(r) for r in (tmp_path / "gen.jsonl").read_text().splitlines()]
    assert result["count"] == 2 and [w["reference"] for w in written] == ["return x", "a"]
    assert written[0]["prompt"] == rows[0]["messages"]  # every turn is the prompt, none taken as the answer


def test_a_final_assistant_turn_and_a_reference_field_are_refused_together(run, tmp_path):
    path = tmp_path / "both.jsonl"
    row = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "reference": "b"}
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(LmtrainError, match="both a final assistant turn and a 'reference'"):
        generation_eval.read_prompts(path)
