"""A command that would take memory or time far past what the machine has says so before starting, in one line, and
`--force` goes anyway: a model too large for the host, a LoRA rank of a million, a prompt of 100 KB."""

import json

import pytest
from trained_runs import tiny_run

from lmtrain.cli import main


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return tiny_run(tmp_path_factory)


def _one_line(capsys, argv, *words):
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and all(w in err for w in words) and "Traceback" not in err, err


def test_a_model_past_the_hosts_memory_is_refused_before_it_is_built(run, tmp_path, capsys, monkeypatch):
    config = tmp_path / "big.json"
    config.write_text(json.dumps({"n_layer": 400, "n_head": 128, "d_model": 16384, "vocab_size": 400}))
    argv = ["train", "--data", str(run.parent / "data"), "--out", str(tmp_path / "big"), "--model-config",
            str(config), "--max-steps", "1", "--set", "cpu_threads=1"]  # fmt: skip
    _one_line(capsys, argv, "GiB of host memory", "trainable parameters", "--force")
    assert not (tmp_path / "big").exists()


def test_adapters_past_the_hosts_memory_are_refused(run, tmp_path, capsys, monkeypatch):
    import psutil

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"q{i}", "response": f"a{i}"}) + "\n" for i in range(40)))

    class Small:
        available = 2**30  # 1 GiB: a rank of a million needs far more

    monkeypatch.setattr(psutil, "virtual_memory", lambda: Small())
    argv = ["finetune", "--from", f"{run}:latest", "--data", str(pairs), "--out", str(tmp_path / "ft"),
            "--lora-r", "1000000", "--max-steps", "1", "--set", "cpu_threads=1"]  # fmt: skip
    _one_line(capsys, argv, "GiB of host memory", "frozen", "lower LoRA rank")
    assert not (tmp_path / "ft").exists()


def test_a_prompt_far_past_the_context_is_refused_unless_forced(run, tmp_path, capsys):
    prompt = "x = 1\n" * 20_000  # 120 KB
    _one_line(capsys, ["generate", "--run", str(run), "--prompt", prompt, "--max-new-tokens", "1"],
              "--prompt:", "tokens, past the 128", "--force")  # fmt: skip
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "short", "reference": "a"}) + "\n"
                       + json.dumps({"prompt": prompt[:100_000], "reference": "b"}) + "\n")  # fmt: skip
    pytest.importorskip("sacrebleu")
    pytest.importorskip("rouge_score")
    _one_line(capsys, ["eval", "--run", str(run), "--prompts", str(prompts), "--max-new-tokens", "1"],
              "(prompt 2)", "--force")  # fmt: skip
    short = "x = 1\n" * 5  # inside 4 training contexts: no refusal, no --force needed
    assert main(["generate", "--run", str(run), "--prompt", short, "--max-new-tokens", "1"]) == 0
