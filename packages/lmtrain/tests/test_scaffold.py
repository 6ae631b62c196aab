"""Every command that trains goes through one scaffold (lmtrain.scaffold): the same settings give the same run
record in `train` and `finetune`, a budget sizes a fine-tune's schedule as it sizes a pretraining run's, a resumed
fine-tune keeps what it started with and says what a new --set changes, and the run levers reach every recipe."""

import json
import re

import pytest
from trained_runs import tiny_run

from lmtrain.cli import main
from lmtrain.run_record import read_run_record

COMMON = ["--max-steps", "2", "--set", "lr=1e-3", "--set", "cpu_threads=1", "--set", "precision=bf16",
          "--set", "micro_batch=2", "--set", "cpu_matmul_probe=false", "--no-progress"]  # fmt: skip


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    run = tiny_run(tmp_path_factory)
    pairs = tmp_path_factory.mktemp("scaffold") / "pairs.jsonl"
    rows = [{"prompt": f"def f{i}(x):\n", "response": f"    return {i} * x\n", "group": f"m{i % 7}"} for i in range(40)]
    pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"run": run, "data": run.parent / "data", "pairs": pairs}


def _finetune(made, out, *flags):
    return main(["finetune", "--from", f"{made['run']}:latest", "--data", str(made["pairs"]), "--out", str(out),
                 "--seq-len", "32", "--lora-r", "4", *flags])  # fmt: skip


def test_the_same_settings_give_the_same_record_in_train_and_finetune(made, tmp_path):
    assert main(["train", "--data", str(made["data"]), "--out", str(tmp_path / "t"), "--preset", "tiny", *COMMON]) == 0
    assert _finetune(made, tmp_path / "f", *COMMON) == 0
    pre, fine = read_run_record(tmp_path / "t"), read_run_record(tmp_path / "f")
    assert (pre.command, fine.command) == ("train", "finetune")
    same = ("format", "schedule", "world_size", "cpu_threads", "cpu_matmul", "recipe", "tokenizer_sha256", "eos_id")
    assert {k: getattr(pre, k) for k in same} == {k: getattr(fine, k) for k in same}
    for name in ("lr", "precision", "max_steps", "t_max", "micro_batch", "grad_accum", "engine", "time_budget_s"):
        assert pre.train_config[name] == fine.train_config[name], name
    assert set(pre.to_json()) == set(fine.to_json())


def test_a_time_budget_sizes_a_finetunes_schedule(made, tmp_path):
    out = tmp_path / "f"
    assert _finetune(made, out, "--time-budget", "12", "--set", "micro_batch=2", "--set", "warmup_steps=2",
                     "--set", "cpu_threads=1", "--no-progress") == 0  # fmt: skip
    record = read_run_record(out)
    assert record.schedule == "budget" and record.train_config["schedule"] == "wsd"
    assert record.train_config["time_budget_s"] is not None and record.train_config["time_budget_s"] <= 12
    rates = [r["lr"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "lr" in r]
    assert rates and rates[-1] < record.train_config["lr"]  # the decay ended with the budget


def test_a_resumed_finetune_keeps_its_settings_and_says_what_set_changes(made, tmp_path, capsys):
    out = tmp_path / "f"
    assert _finetune(made, out, "--max-steps", "2", "--set", "micro_batch=2", "--set", "save_every=1",
                     "--set", "cpu_threads=1") == 0  # fmt: skip
    capsys.readouterr()
    again = ["--lora-r", "8", "--max-steps", "3", "--resume", "--set", "lr=5e-4", "--no-progress"]
    assert main(["finetune", "--from", f"{made['run']}:latest", "--data", str(made["pairs"]), "--out", str(out),
                 *again]) == 0  # fmt: skip
    said = capsys.readouterr().out
    record = read_run_record(out)
    assert record.finetune["lora"]["r"] == 4 and record.train_config["lr"] == 5e-4
    assert "--set changes the resumed run's train.lr: 0.0002 -> 0.0005" in said, said


def test_compile_and_gpumon_reach_a_finetune(made, tmp_path, monkeypatch, capsys):
    pytest.importorskip("gpumon")
    import lmcore

    compiled = []
    monkeypatch.setattr(lmcore, "compile_model", lambda model, **kw: compiled.append(type(model).__name__) or model)
    assert _finetune(made, tmp_path / "f", "--max-steps", "1", "--set", "micro_batch=2", "--compile", "--gpumon",
                     "--set", "cpu_threads=1", "--no-progress") == 0  # fmt: skip
    assert compiled == ["GPT"] and list((tmp_path / "f").glob("gpumon*.csv"))


def test_a_finetune_too_short_to_learn_says_so(made, tmp_path, capsys):
    capsys.readouterr()
    assert _finetune(made, tmp_path / "f", "--set", "micro_batch=8", "--set", "cpu_threads=1", "--no-progress") == 0
    out = capsys.readouterr().out
    assert re.search(r"warning: \d optimizer step\(s\) of 8 rows over \d+ training samples .* too few to learn", out)
    assert _finetune(made, tmp_path / "g", "--max-steps", "60", "--set", "micro_batch=8", "--set", "cpu_threads=1",
                     "--set", "eval_every=0", "--set", "save_every=0", "--no-progress") == 0  # fmt: skip
    assert "too few to learn" not in capsys.readouterr().out


def test_the_loops_refusals_speak_in_flags(made, tmp_path, capsys):
    argv = ["train", "--data", str(made["data"]), "--out", str(tmp_path / "r"), "--preset", "tiny", "--max-steps", "2",
            "--set", "save_every=2", "--set", "cpu_threads=1", "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "already holds checkpoints" in err and "(--resume)" in err and "(--overwrite)" in err, err
    assert "=True" not in err
