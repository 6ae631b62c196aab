"""A run killed with SIGKILL (at a random step, and once in the middle of a checkpoint save) and resumed with
--resume ends with the same metrics.jsonl losses as a run that was never interrupted."""

from __future__ import annotations

import math
import os
import random
import signal
import subprocess
import time
from pathlib import Path

from conftest import child_env, lmtrain_cmd, read_metrics, run_lmtrain, train_losses

MAX_STEPS = 40
TRAIN_ARGS = ["--preset", "tiny", "--max-steps", str(MAX_STEPS), "--set", "save_every=10", "--set", "log_every=1",
              "--set", "precision=fp32", "--set", "lr=0.01", "--set", "keep_last=2"]  # fmt: skip

# Fault injection: make each checkpoint save linger after its first files are written, so that the test can kill
# the process while the checkpoint directory is incomplete. Loaded through sitecustomize in the child only.
SLOW_SAVE = """
import time
import trainloop.trainer as _trainer

_original = _trainer.save_torch


def _slow_save_torch(obj, path):
    _original(obj, path)
    time.sleep(3.0)


_trainer.save_torch = _slow_save_torch
"""


def start(data: Path, run: Path, *extra: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        lmtrain_cmd("train", "--data", str(data), "--out", str(run), *TRAIN_ARGS, *extra),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env or child_env(),
    )  # fmt: skip


def kill_when(proc: subprocess.Popen, ready, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None:
            raise AssertionError(f"the run ended before {what}: {proc.stderr.read()[-3000:]}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def test_resume_after_sigkill_matches_uninterrupted_run(prepared, tmp_path):
    reference = tmp_path / "reference"
    run_lmtrain("train", "--data", str(prepared), "--out", str(reference), *TRAIN_ARGS)
    expected = train_losses(reference)
    assert sorted(expected) == list(range(1, MAX_STEPS + 1))

    run = tmp_path / "killed"
    # 1. SIGKILL at a random step between two checkpoints.
    kill_step = random.Random(os.environ.get("PYTEST_SEED", "lmtrain")).randint(12, 28)
    proc = start(prepared, run)
    kill_when(proc, lambda: max(train_losses(run), default=0) >= kill_step, f"step {kill_step}")
    killed_at = max(train_losses(run))

    # 2. Resume, and SIGKILL again while the next checkpoint is being written.
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SLOW_SAVE)
    env = child_env(PYTHONPATH=os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")]))
    proc = start(prepared, run, "--resume", env=env)
    checkpoints = run / "checkpoints"
    kill_when(proc, lambda: any(p.name.startswith(".tmp-") for p in checkpoints.iterdir()), "a checkpoint save")
    partial = [p for p in checkpoints.iterdir() if p.name.startswith(".tmp-")]
    assert partial, "the kill should leave an incomplete checkpoint behind"

    # 3. Resume to the end: the incomplete checkpoint is skipped, the previous complete one restored.
    result = run_lmtrain("train", "--data", str(prepared), "--out", str(run), *TRAIN_ARGS, "--resume")
    assert "skipping incomplete checkpoint" in result.stdout + result.stderr
    got = train_losses(run)
    assert sorted(got) == sorted(expected), f"killed at {killed_at}: steps differ"
    for step, loss in expected.items():
        assert math.isclose(got[step], loss, rel_tol=1e-6, abs_tol=1e-7), (step, got[step], loss)
    assert len([r for r in read_metrics(run) if "loss" in r]) == MAX_STEPS, "no duplicated records"
