"""Resume on another number of ranks: 2 -> 1 and 1 -> 2, DeepSpeed ZeRO-2 and ZeRO-3 (alone and with its parameters
offloaded to the host; through DeepSpeed's universal checkpoint) and plain torch, on CPU gloo ranks. The data stream
is re-split (the test data gives each global batch's rows to the ranks), so the continued losses match an
uninterrupted run up to float reduction order."""

import json
import shutil

import pytest
from launch import run

ZERO2 = {"zero_optimization": {"stage": 2}}
DS_CONFIGS = {
    "deepspeed": ZERO2,
    "deepspeed-zero3": {"zero_optimization": {"stage": 3}},
    "deepspeed-zero3-param-offload": {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}},
}
# Measured: the continued losses differ from the uninterrupted run's by at most ~1e-7 relative (summation order of
# a different number of ranks); the bound leaves room for other machines.
RTOL = 1e-5


def _losses(run_dir):
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if "loss" in r}


def _resume(tmp_path, engine, before, after, fault=None):
    """An 8-step run on `before` ranks, and the same run stopped after step 4 and resumed on `after` ranks."""
    args = {"engine": engine.split("-")[0], "max_steps": 8, "save_every": 4, "keep_last": 5}
    if engine in DS_CONFIGS:
        args["ds_config"] = DS_CONFIGS[engine]
    reference = tmp_path / "reference"
    run("train_tiny.py", {**args, "run_dir": str(reference)}, nproc=before)
    resumed = tmp_path / "resumed"
    shutil.copytree(reference, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_00000008")  # as if the run had stopped after step 4
    faulty = {"fault": fault} if fault else {}
    out = run("train_tiny.py", {**args, **faulty, "run_dir": str(resumed), "resume": True}, nproc=after)
    assert f"written by {before} rank(s); resuming on {after}" in out.stdout
    assert "resumed from" in out.stdout and "step 4" in out.stdout
    ref, got = _losses(reference), _losses(resumed)
    assert sorted(got) == list(range(1, 9))
    return resumed, ref, got


def _continued(ref, got):
    """The steps after the resume (5-8) whose loss is farther than RTOL from the uninterrupted run's."""
    return [(s, got[s], ref[s]) for s in range(5, 9) if abs(got[s] - ref[s]) > RTOL * abs(ref[s])]


@pytest.mark.slow
@pytest.mark.parametrize(
    "engine, before, after",
    [
        ("deepspeed", 2, 1),
        ("deepspeed", 1, 2),
        ("torch", 2, 1),
        ("deepspeed-zero3", 2, 1),
        ("deepspeed-zero3", 1, 2),
        ("deepspeed-zero3-param-offload", 2, 1),
    ],  # fmt: skip
    ids=lambda v: str(v),
)
def test_resume_on_another_world_size_continues_the_run(tmp_path, engine, before, after):
    resumed, ref, got = _resume(tmp_path, engine, before, after)
    assert _continued(ref, got) == []
    assert not list((resumed / "checkpoints").glob(".universal-*")), "the converted copy is removed after loading"
    manifest = json.loads((resumed / "checkpoints" / "step_00000008" / "manifest.json").read_text())
    assert manifest["world_size"] == after


@pytest.mark.slow
def test_a_resume_that_drops_the_optimizer_state_is_caught(tmp_path):
    # The broken twin: 2 -> 1 with AdamW's moments dropped at load; the comparison above must reject it.
    # Step 5's loss comes before the first step taken with the fresh moments; every later one moves.
    _, ref, got = _resume(tmp_path, "torch", 2, 1, fault="optimizer_state_dropped")
    assert [s for s, _, _ in _continued(ref, got)] == [6, 7, 8]
