"""`lmtrain demo --finetune --base DIR`: no pretraining, LoRA on the standard library's instruction pairs from a
Hugging Face base model (a tiny random Llama written by transformers here), the held-out response loss and BLEU-4
before and after; `smollm2` names the directory tools/smollm2_base.py builds; every bad base is one line."""

from __future__ import annotations

import re

import pytest
from hf_base import write_qwen2_base

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from lmtrain.cli import main  # noqa: E402
from lmtrain.run_record import read_run_record  # noqa: E402


def test_demo_fine_tunes_a_llama_base_and_scores_it_before_and_after(tmp_path, capsys, monkeypatch):
    pytest.importorskip("sacrebleu")
    monkeypatch.setenv("LMTRAIN_PROBE_CACHE", str(tmp_path / "probes.json"))
    base = write_qwen2_base(tmp_path / "llama", architecture="llama")
    out = tmp_path / "demo"
    status = main(["demo", "--finetune", "--base", str(base), "--out", str(out), "--finetune-budget", "8",
                   "--no-progress"])  # fmt: skip
    printed = capsys.readouterr().out
    assert status == 0, printed
    assert f"base: {base} (LlamaForCausalLM, 2 layers, width 64, vocab " in printed and "no pretraining" in printed
    assert not (out / "run").exists() and not (out / "data").exists()  # nothing pretrained
    loss = re.search(r"held-out response loss: (\d+\.\d+) before -> (\d+\.\d+) after (\d+) steps", printed)
    assert loss is not None, printed
    before, after, steps = float(loss[1]), float(loss[2]), int(loss[3])
    assert steps >= 1 and before != after  # the adapters moved
    assert re.search(r"BLEU-4 on 24 held-out prompts \(greedy\): \d+\.\d+ before -> \d+\.\d+ after", printed)
    record = read_run_record(out / "finetune")
    assert record.base["architecture"] == "LlamaForCausalLM" and record.finetune["lora"]["r"] == 16
    assert record.finetune["batching"] == "pad"
    assert (out / "generations-before.jsonl").is_file() and (out / "generations-after.jsonl").is_file()


def _error(capsys, *argv: str) -> str:
    status = main(["demo", *argv])
    out, err = capsys.readouterr()
    assert status == 2 and "Traceback" not in err
    (line,) = err.strip().splitlines()
    return line


def test_smollm2_without_its_directory_says_how_to_build_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("LMTOOLS_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    line = _error(capsys, "--finetune", "--base", "smollm2", "--out", str(tmp_path / "d"))
    assert line.startswith(f"lmtrain demo: error: --base smollm2: {tmp_path}/cache/smollm2-135m-instruct does not hold")
    assert "python tools/smollm2_base.py" in line and not (tmp_path / "d").exists()


def test_smollm2_names_the_built_directory(tmp_path, monkeypatch):
    from lmtrain.demo import resolve_base

    built = tmp_path / "cache" / "smollm2-135m-instruct"
    built.mkdir(parents=True)
    (built / "config.json").write_text("{}")
    monkeypatch.setenv("LMTOOLS_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    assert resolve_base("smollm2") == built and resolve_base(str(tmp_path)) == tmp_path


@pytest.mark.parametrize("case", ["no --finetune", "no config.json", "a run", "no tokenizer.json"])
def test_a_bad_base_is_one_line_and_writes_nothing(tmp_path, capsys, case):
    base = tmp_path / "base"
    base.mkdir()
    argv = ["--finetune", "--base", str(base), "--out", str(tmp_path / "d")]
    if case == "no --finetune":
        argv.remove("--finetune")
        words = "needs --finetune"
    elif case == "no config.json":
        words = "holds no config.json: expected a Hugging Face model directory"
    elif case == "a run":
        (base / "run.json").write_text("{}")
        words = "holds an lmtrain run (run.json)"
    else:
        (base / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "vocab_size": 64, '
                                          '"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, '
                                          '"num_attention_heads": 4}')  # fmt: skip
        words = "no tokenizer.json"
    line = _error(capsys, *argv)
    assert line.startswith("lmtrain demo: error: --") and words in line, line
    assert not (tmp_path / "d").exists()
