"""`lmtrain train` as a scheduler and a careless user treat it: a second run into the same directory, SIGKILL, SIGTERM
in the middle of the final evaluation, SIGTERM to one rank of a torchrun job."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest
from conftest import child_env, lmtrain_cmd, read_metrics, run_lmtrain

from trainloop.checkpoint import CheckpointStore, verify_checkpoint

TINY = ["--preset", "tiny", "--set", "log_every=1", "--set", "precision=fp32"]

# Fault injection for the child only (loaded through sitecustomize): every validation batch of `lmtrain train` takes
# two seconds and announces itself, so the test can signal the run in the middle of its final evaluation.
SLOW_EVAL = """
import time
import lmtrain.train_run as _train_run

_val_batches = _train_run.val_batches


def _slow_val_batches(*args, **kwargs):
    batches = _val_batches(*args, **kwargs)

    def slow():
        for batch in batches():
            print("EVAL_BATCH", flush=True)
            time.sleep(2.0)
            yield batch

    return slow


_train_run.val_batches = _slow_val_batches
"""


def kill_tree(proc: subprocess.Popen) -> None:
    with contextlib.suppress(psutil.NoSuchProcess):
        root = psutil.Process(proc.pid)
        for p in [*root.children(recursive=True), root]:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
    proc.wait()


class Lines:
    """Collect a process's output lines in a thread, so a test can wait for one without blocking on the pipe."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc, self.lines = proc, []
        self.thread = threading.Thread(target=lambda: self.lines.extend(proc.stdout), daemon=True)
        self.thread.start()

    def wait_for(self, needle: str, timeout: float = 300) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            hit = next((ln for ln in list(self.lines) if needle in ln), None)
            if hit is not None:
                return hit
            if self.proc.poll() is not None and not self.thread.is_alive():
                break
            time.sleep(0.05)
        kill_tree(self.proc)
        raise AssertionError(f"never saw {needle!r}:\n{''.join(self.lines)[-3000:]}")

    def text(self) -> str:
        self.thread.join(timeout=30)
        return "".join(self.lines)


def start(*args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(lmtrain_cmd(*args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env or child_env())  # fmt: skip


def test_a_second_run_into_the_same_directory_is_refused_and_a_killed_one_releases_it(prepared, tmp_path):
    run = tmp_path / "run"
    first = start("train", "--data", str(prepared), "--out", str(run), *TINY, "--max-steps", "100000",
                  "--set", "save_every=2")  # fmt: skip
    try:
        Lines(first).wait_for("step 3 |")
        second = run_lmtrain("train", "--data", str(prepared), "--out", str(run), *TINY, "--max-steps", "3",
                             "--resume", check=False)  # fmt: skip
        assert second.returncode == 2 and "Traceback" not in second.stderr
        assert len(second.stderr.strip().splitlines()) == 1, second.stderr
        assert f"in use by `lmtrain train` (pid {first.pid} on host {socket.gethostname()}" in second.stderr
        prep = run_lmtrain("prepare", "--text", str(prepared / "val.txt"), "--out", str(run), check=False)
        assert prep.returncode == 2 and f"pid {first.pid}" in prep.stderr  # prepare takes the same lock
    finally:
        kill_tree(first)  # SIGKILL: no chance to unlock anything
    steps = CheckpointStore(run).steps()
    assert steps
    again = run_lmtrain("train", "--data", str(prepared), "--out", str(run), *TINY, "--max-steps", str(steps[-1] + 2),
                        "--resume", "--json")  # fmt: skip
    assert json.loads(again.stdout.strip().splitlines()[-1])["summary"]["step"] == steps[-1] + 2


def test_sigterm_during_the_final_evaluation_ends_with_a_checkpoint_and_status_0(prepared, tmp_path):
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SLOW_EVAL)
    env = child_env(PYTHONPATH=os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")]))
    run = tmp_path / "run"
    # Some 200 two-second evaluation batches: only an evaluation that stops on the signal ends within the bound below.
    proc = start("train", "--data", str(prepared), "--out", str(run), *TINY, "--max-steps", "3", "--json",
                 "--set", "micro_batch=1", "--set", "eval_batches=400", env=env)  # fmt: skip
    lines = Lines(proc)
    try:
        lines.wait_for("EVAL_BATCH")
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=180)
    finally:
        kill_tree(proc)
    out = lines.text()
    assert code == 0, out[-3000:]
    assert "evaluation at step 3 stopped by a signal" in out
    summary = json.loads(out.strip().splitlines()[-1])["summary"]
    assert summary["stopped"] == "SIGTERM" and summary["step"] == 3 and summary["eval"] is None
    assert verify_checkpoint(CheckpointStore(run).step_dir(3), verify="full") is None
    assert max(r["step"] for r in read_metrics(run)) == 3


@pytest.mark.slow
def test_sigterm_to_one_rank_of_a_torchrun_job(prepared, tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(_free_port()), "-m", "lmtrain", "train", "--data", str(prepared), "--out", str(run), *TINY,
           "--max-steps", "100000", "--json"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env())
    lines = Lines(proc)
    try:
        lines.wait_for("step 3 |")
        ranks = {}
        for child in psutil.Process(proc.pid).children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                env = child.environ()
                if "RANK" in env and "lmtrain" in " ".join(child.cmdline()):
                    ranks[int(env["RANK"])] = child
        assert set(ranks) == {0, 1}, ranks
        ranks[1].send_signal(signal.SIGTERM)  # rank 1 alone: torchrun and rank 0 never see it
        code = proc.wait(timeout=180)
    finally:
        kill_tree(proc)
    out = lines.text()
    assert code == 0, out[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])["summary"]
    assert summary["stopped"] == "signal on another rank"  # rank 0's summary
    ckpt = CheckpointStore(run).step_dir(summary["step"])
    assert verify_checkpoint(ckpt, verify="full") is None and (ckpt / "rank1.pt").is_file()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
