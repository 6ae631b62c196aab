"""`lmtrain train` as users start it: a budgeted run re-planned inside one loop that keeps its best checkpoint, a
run directory that is never overwritten by accident, and the deepspeed launcher's --local_rank flag."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import read_metrics, run_lmtrain

from lmtrain.planner import RULE
from trainloop.budget import BUDGET


def test_budgeted_run_replans_in_one_loop_and_keeps_the_best(prepared, tmp_path):
    run = tmp_path / "run"
    result = run_lmtrain("train", "--data", str(prepared), "--out", str(run), "--preset", "tiny", "--time-budget", "25",
                         "--json")  # fmt: skip
    summary = json.loads(result.stdout.strip().splitlines()[-1])["summary"]
    info = json.loads((run / "run.json").read_text())
    assert info["schedule"] == "budget"
    # The plan read the passes over the data off the measured speed and chose the rule's regularisation for them. How
    # many passes 25 s buy depends on the machine and its load (0.98 in one CI run beside other sessions).
    _, dropout, weight_decay = [row for row in RULE if info["plan"]["passes"] >= row[0]][-1]
    assert info["plan"]["passes"] > 0 and "lmtrain: plan: the budget buys about" in result.stdout
    assert (info["model_config"]["dropout"], info["train_config"]["weight_decay"]) == (dropout, weight_decay)
    assert info["train_config"]["early_stopping_patience"] > 0
    assert f"stopped: {summary['stopped'] or 'planned end'} at step {summary['step']}, best at step" in result.stdout
    plans = summary["budget_plans"]
    assert plans == json.loads((run / "summary.json").read_text())["budget_plans"]
    # The first re-plan (at 20% of the budget) comes before early stopping can (patience + 1 evaluations, a quarter of
    # the budget at least); whether the run is still going at a later one depends on the machine's speed and load.
    assert 1 <= len(plans) <= len(BUDGET.replan_at)
    assert [p["at_step"] for p in plans] == sorted(p["at_step"] for p in plans)
    assert result.stdout.count("re-planned at step") == len(plans)
    assert result.stdout.count("torch engine") == 1  # one fit()
    lrs = {r["step"]: r["lr"] for r in read_metrics(run) if "lr" in r}
    peak = max(lrs, key=lambda step: (lrs[step], -step))  # the first step at the highest rate
    before_peak = [lr for step, lr in sorted(lrs.items()) if step <= peak]
    after_peak = [lr for step, lr in sorted(lrs.items()) if step >= peak]
    assert before_peak == sorted(before_peak)  # warmup: never down
    assert after_peak == sorted(after_peak, reverse=True)  # warmup, stable, decay: never up again
    # The stable phase is the configured rate exactly: from one step past warmup (a logged step may carry the rate of
    # the step before) to one step before the earliest decay any plan set.
    cfg = info["train_config"]
    assert lrs[peak] == pytest.approx(cfg["lr"])
    stable_end = min(p["decay_from"] for p in plans)
    assert all(lr == pytest.approx(cfg["lr"]) for step, lr in lrs.items() if cfg["warmup_steps"] < step < stable_end)
    if summary["step"] > plans[-1]["decay_from"] + 1:
        assert lrs[max(lrs)] < max(lrs.values())  # the planned decay happened
    evals = [r for r in read_metrics(run) if "eval_loss" in r]
    assert len(evals) >= 2, "timed evaluations during a budgeted run"
    best = json.loads((run / "checkpoints" / "best.json").read_text())
    assert best["value"] == min(e["eval_loss"] for e in evals) and summary["best"]["step"] == best["step"]
    assert (run / "checkpoints" / best["checkpoint"] / "manifest.json").is_file()


def test_a_fresh_run_refuses_a_run_directory_with_checkpoints(prepared, tmp_path):
    run = tmp_path / "run"
    args = [
        "train",
        "--data",
        str(prepared),
        "--out",
        str(run),
        "--preset",
        "tiny",
        "--max-steps",
        "3",
        "--set",
        "log_every=1",
    ]
    run_lmtrain(*args, "--local_rank=0")  # as the deepspeed launcher appends it
    again = run_lmtrain(*args, check=False)
    assert again.returncode == 2 and "Traceback" not in again.stderr
    assert len(again.stderr.strip().splitlines()) == 1 and "--overwrite" in again.stderr and "--resume" in again.stderr
    assert (run / "checkpoints" / "step_00000003").is_dir()
    run_lmtrain(*args, "--overwrite", "--local-rank", "0")
    assert [r["step"] for r in read_metrics(run) if "loss" in r][-1] == 3


def test_train_on_a_blend_of_two_corpora(prepared, texts, tmp_path):
    import shutil
    import subprocess
    import sys

    from conftest import child_env

    data = tmp_path / "data"
    shutil.copytree(prepared, data)
    train, val = texts
    # A second corpus encoded with the data directory's tokenizer, then a 3:1 blend with the prepared split.
    tokbin = str(Path(sys.executable).with_name("tokbin"))
    encode = [tokbin, "encode", "--tokenizer", str(data / "tokenizer.model"), "--input", str(val), "--output",
              str(data / "second.bin"), "--quiet"]  # fmt: skip
    subprocess.run(encode, check=True, env=child_env(), capture_output=True)
    meta = json.loads((data / "meta.json").read_text())
    spec = data / "mix.json"
    spec.write_text(json.dumps({"sources": [{"path": meta["train"]["file"], "weight": 3}, {"path": "second.bin",
                                                                                       "weight": 1}]}))  # fmt: skip
    run = tmp_path / "run"
    run_lmtrain("train", "--data", str(spec), "--out", str(run), "--preset", "tiny", "--max-steps", "4",
                "--set", "log_every=1")  # fmt: skip
    assert [r["step"] for r in read_metrics(run) if "loss" in r] == [1, 2, 3, 4]
    assert json.loads((run / "run.json").read_text())["data"] == str(spec.resolve())
    # Sources encoded with another tokenizer are refused before anything trains.
    other = tmp_path / "other"
    run_lmtrain("prepare", "--text", str(train), "--out", str(other), "--vocab-size", "400")
    shutil.copy(other / json.loads((other / "meta.json").read_text())["train"]["file"], data / "foreign.bin")
    spec.write_text(json.dumps({"sources": [{"path": "foreign.bin", "weight": 1}]}))
    bad = run_lmtrain("train", "--data", str(spec), "--out", str(tmp_path / "bad"), "--preset", "tiny", check=False)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "tokenizer" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1


def test_train_on_shards_written_by_prepare(texts, tmp_path):
    train, _ = texts
    data = tmp_path / "data"
    # Without --val-text, prepare holds out documents (blank-line blocks) by hash: shards end at document ends.
    run_lmtrain("prepare", "--text", str(train), "--out", str(data), "--vocab-size", "512", "--shard-mb", "0.05")
    meta = json.loads((data / "meta.json").read_text())
    shards = json.loads((data / meta["train"]["file"] / "manifest.json").read_text())["shards"]
    assert len(shards) > 1
    run = tmp_path / "run"
    run_lmtrain("train", "--data", str(data), "--out", str(run), "--preset", "tiny", "--max-steps", "3",
                "--set", "log_every=1", "--document-attention")  # fmt: skip
    assert [r["step"] for r in read_metrics(run) if "loss" in r] == [1, 2, 3]
    run_lmtrain("doctor", "--data", str(data))  # exits non-zero on any FAIL, a shard directory's check included
