"""SIGTERM never costs the run: during the final evaluation, and to one rank of two, the ranks agree, save, exit 0.
One Ctrl-C (SIGINT) does the same; a second one stops at once.

Each case runs the real script in subprocesses (gloo on CPU for two ranks) and signals it once it is where the case
needs it. The bounds on waiting are far above what the cases need (seconds) and far below what a stuck run would
take (a 10-minute evaluation, a 10-minute collective timeout), so a pass means the run did not wait them out.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from launch import command
from watch import Watched

from trainloop.checkpoint import CheckpointStore, verify_checkpoint

SCRIPT = "train_signals.py"


def _start(args: dict, nproc: int = 1) -> Watched:
    return Watched(command(SCRIPT, args, nproc))


def _summaries(run: Watched) -> dict[int, dict]:
    """rank -> the SUMMARY line that rank printed."""
    out = {}
    for line in run.lines:
        if line.startswith("SUMMARY "):
            _, rank, payload = line.split(" ", 2)
            out[int(rank)] = json.loads(payload)
    return out


def test_sigterm_during_the_final_evaluation_still_saves_and_exits_zero(tmp_path):
    # 300 evaluation batches of 2 s each: only an evaluation that stops on the signal ends within the bound.
    args = {"run_dir": str(tmp_path), "max_steps": 4, "eval_sleep_s": 2.0, "eval_batches_n": 300}
    run = _start(args)
    run.wait_for("EVAL 0 4", start=True)
    run.proc.send_signal(signal.SIGTERM)
    assert run.finish(timeout=120) == 0, run.output()[-4000:]
    summary = _summaries(run)[0]
    assert summary["step"] == 4 and summary["eval"] is None and summary["stopped"] == "SIGTERM"
    ckpt, skipped = CheckpointStore(tmp_path).find_resumable(verify="full")
    assert ckpt is not None and ckpt.name == "step_00000004" and not skipped
    assert "evaluation at step 4 stopped by a signal" in run.output()


def test_sigterm_to_one_rank_of_two_stops_both_at_the_same_step(tmp_path):
    args = {"run_dir": str(tmp_path), "max_steps": 100000, "t_max": 1000}
    run = _start(args, nproc=2)
    pid = int(run.wait_for("PID 1 ", start=True).split()[2])
    # Rank 0 prints a step's line only after that step's all-reduce, which rank 1 enters after installing its signal
    # handlers: from this line on, rank 1 handles SIGTERM however far behind rank 0 a loaded machine keeps it.
    run.wait_for("] step 2 |")
    signalled = time.monotonic()
    os.kill(pid, signal.SIGTERM)  # rank 1 only: torchrun and rank 0 never see it
    assert run.finish(timeout=120) == 0, run.output()[-4000:]
    waited = time.monotonic() - signalled
    summaries = _summaries(run)
    assert set(summaries) == {0, 1}, run.output()[-4000:]
    assert summaries[1]["stopped"] == "SIGTERM" and summaries[0]["stopped"] == "signal on another rank"
    assert summaries[0]["step"] == summaries[1]["step"] < 100000
    ckpt = CheckpointStore(tmp_path).step_dir(summaries[0]["step"])
    assert verify_checkpoint(ckpt, verify="full") is None
    assert (ckpt / "rank0.pt").is_file() and (ckpt / "rank1.pt").is_file()
    assert waited < 120  # never the collective timeout (600 s by default)


def test_sigterm_to_one_rank_during_the_final_evaluation(tmp_path):
    # Rank 1 is signalled while both evaluate slowly; both must drop the evaluation and save the same checkpoint.
    args = {"run_dir": str(tmp_path), "max_steps": 3, "eval_sleep_s": 2.0, "eval_batches_n": 300}
    run = _start(args, nproc=2)
    pid = int(run.wait_for("PID 1 ", start=True).split()[2])
    run.wait_for("EVAL 1 3", start=True)
    os.kill(pid, signal.SIGTERM)
    assert run.finish(timeout=120) == 0, run.output()[-4000:]
    summaries = _summaries(run)
    assert set(summaries) == {0, 1}, run.output()[-4000:]
    assert summaries[0]["eval"] is None and summaries[1]["eval"] is None
    assert summaries[0]["step"] == summaries[1]["step"] == 3
    assert verify_checkpoint(CheckpointStore(tmp_path).step_dir(3), verify="full") is None


def _sigint_once(tmp_path, fault):
    """One Ctrl-C during the final evaluation: the evaluation stops, the step is saved, the run exits 0."""
    args = {"run_dir": str(tmp_path), "max_steps": 4, "eval_sleep_s": 2.0, "eval_batches_n": 300}
    run = _start(args | ({"fault": fault} if fault else {}))
    run.wait_for("EVAL 0 4", start=True)
    run.proc.send_signal(signal.SIGINT)
    code = run.finish(timeout=120)
    assert code == 0, (code, run.output()[-4000:])
    summary = _summaries(run)[0]
    assert summary["step"] == 4 and summary["eval"] is None and summary["stopped"] == "SIGINT"
    ckpt, skipped = CheckpointStore(tmp_path).find_resumable(verify="full")
    assert ckpt is not None and ckpt.name == "step_00000004" and not skipped


def _sigint_twice(tmp_path, fault):
    """A second Ctrl-C stops at once: KeyboardInterrupt in the middle of an evaluation batch that has 10 s to go,
    no summary and no checkpoint of the interrupted step."""
    args = {"run_dir": str(tmp_path), "max_steps": 4, "eval_sleep_s": 10.0, "eval_batches_n": 300}
    run = _start(args | ({"fault": fault} if fault else {}))
    run.wait_for("EVAL 0 4", start=True)
    run.proc.send_signal(signal.SIGINT)
    run.wait_for("SIGNAL 0 SIGINT", start=True)  # handled: the next one is a second Ctrl-C, not the same one
    run.proc.send_signal(signal.SIGINT)
    code = run.finish(timeout=120)
    # Python ends an unhandled KeyboardInterrupt with SIGINT (-2); with some installed packages the same exit reads
    # as status 1. Either way it is a failure status, with the traceback, no summary and no checkpoint.
    assert code in (-signal.SIGINT, 1), (code, run.output()[-4000:])
    assert "KeyboardInterrupt" in run.output() and not _summaries(run)
    assert not CheckpointStore(tmp_path).step_dir(4).exists()


@pytest.mark.parametrize("fault", [None, "sigint_stops_at_once"])
def test_sigint_once_saves_and_exits_zero(tmp_path, fault):
    if fault is None:
        _sigint_once(tmp_path, fault)
    else:  # a first Ctrl-C that raised at once would lose the step: the check fails on it
        with pytest.raises(AssertionError):
            _sigint_once(tmp_path, fault)


@pytest.mark.parametrize("fault", [None, "second_sigint_ignored"])
def test_second_sigint_stops_at_once(tmp_path, fault):
    if fault is None:
        _sigint_twice(tmp_path, fault)
    else:  # a second Ctrl-C taken as the first: the run finishes the batch, saves, exits 0; the check fails on it
        with pytest.raises(AssertionError):
            _sigint_twice(tmp_path, fault)


# SIGTERM once fit() has returned: the run is finished and its checkpoint saved; what the script still does (here,
# 6 s of finishing work) must complete, and the process exit 0, alone and as rank 1 of 2 (torchrun then reports the
# job as failed if that rank died of the signal).
AFTER_FIT = [("alone", 1, 0), ("rank 1 of 2", 2, 1)]


@pytest.mark.parametrize(("nproc", "rank"), [c[1:] for c in AFTER_FIT], ids=[c[0] for c in AFTER_FIT])
def test_sigterm_after_fit_lets_the_script_finish_and_exit_zero(tmp_path, nproc, rank):
    run = _start({"run_dir": str(tmp_path), "max_steps": 3, "after_fit_s": 6.0}, nproc=nproc)
    pid = int(run.wait_for(f"PID {rank} ", start=True).split()[2])
    run.wait_for(f"FINISHED {rank}", start=True)
    os.kill(pid, signal.SIGTERM)
    code = run.finish(timeout=120)
    assert code == 0, (code, run.output()[-4000:])
    summaries = _summaries(run)
    assert set(summaries) == set(range(nproc)) and all(s["step"] == 3 for s in summaries.values()), run.output()
    assert all(s["stopped"] is None for s in summaries.values())  # the run ended as planned
    assert "SIGTERM after the run finished" in "".join(run.err_lines)
    assert verify_checkpoint(CheckpointStore(tmp_path).step_dir(3), verify="full") is None


def test_a_second_sigterm_after_fit_ends_the_process_as_before(tmp_path):
    run = _start({"run_dir": str(tmp_path), "max_steps": 3, "after_fit_s": 60.0})
    run.wait_for("FINISHED 0", start=True)
    run.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 60
    while "SIGTERM after the run finished" not in "".join(run.err_lines) and time.monotonic() < deadline:
        time.sleep(0.05)
    run.proc.send_signal(signal.SIGTERM)
    assert run.finish(timeout=60) == -signal.SIGTERM
    assert not _summaries(run)


FORKED = """
import multiprocessing, sys, time
sys.path.insert(0, {tests!r})
from tiny_model import SeqData, TinyLM
from trainloop import TrainConfig, Trainer
cfg = TrainConfig(lr=1e-2, max_steps=2, micro_batch=4, progress=False, tensorboard=False)
Trainer(TinyLM(), cfg, SeqData(4), run_dir={run!r}).fit()
ctx = multiprocessing.get_context("fork")
started = ctx.Event()


def work():
    started.set()
    time.sleep(120)


child = ctx.Process(target=work)
child.start()
started.wait(60)  # a signal that arrives while the child is being forked is lost whatever its handler
child.terminate()  # what Pool.terminate does to its workers
child.join(60)
print("CHILD", child.exitcode)
child.kill()
"""


def test_a_process_forked_after_fit_still_ends_on_sigterm(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    script = FORKED.format(tests=str(Path(__file__).parent), run=str(tmp_path / "run"))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert f"CHILD {-signal.SIGTERM}" in proc.stdout, proc.stdout + proc.stderr[-3000:]


POOLS = """
import multiprocessing, sys
sys.path.insert(0, {tests!r})
from tiny_model import SeqData, TinyLM
from trainloop import TrainConfig, Trainer
cfg = TrainConfig(lr=1e-2, max_steps=2, micro_batch=4, progress=False, tensorboard=False)
Trainer(TinyLM(), cfg, SeqData(4), run_dir={run!r}).fit()
for i in range(60):  # Pool.__exit__ terminates the workers, some of them still starting
    with multiprocessing.get_context("fork").Pool(2) as pool:
        pool.map(abs, [-1])
print("POOLS DONE")
"""


def test_pools_made_after_fit_terminate_while_their_workers_start(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    script = POOLS.format(tests=str(Path(__file__).parent), run=str(tmp_path / "run"))
    try:  # a worker that lost its SIGTERM while starting makes Pool.join wait forever
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired:
        pytest.fail("a pool made after fit() never finished terminating")
    assert "POOLS DONE" in proc.stdout, proc.stdout + proc.stderr[-3000:]
