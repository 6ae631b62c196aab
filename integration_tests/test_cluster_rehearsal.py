"""The cluster kit's real launch (tools/cluster-3090/launch.sh, not --dry-run) rehearsed on CPU: two "nodes" of two
ranks on this machine, ZeRO-2 with the kit's DeepSpeed config adapted to CPU, gpumon on every node; one node is
killed with SIGKILL, both are started again and resume, and the result is evaluated on two ranks.

launch.sh --cpu-rehearsal swaps only what CPUs need: gloo, DS_ACCELERATOR=cpu, the tiny preset for the 1.3B config,
and the kit's ds_config.json without fp16 and with train_batch_size for 2 x 2 ranks.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import child_env, read_metrics
from test_distributed import free_port, kill_tree, torchrun

import gpumon

pytestmark = pytest.mark.slow

LAUNCH = Path(__file__).resolve().parents[1] / "tools" / "cluster-3090" / "launch.sh"
STEPS, SAVE_EVERY = 40, 5
# Every start of every node runs this same command, as on the cluster (the kit adds --resume itself).
TRAIN = ["--max-steps", str(STEPS), "--set", f"save_every={SAVE_EVERY}", "--set", "log_every=1",
         "--set", "dist_timeout_s=60", "--gpumon"]  # fmt: skip


def train_steps(run: Path) -> list[int]:
    return [r["step"] for r in read_metrics(run) if "loss" in r]


def recordings(run: Path) -> dict[Path, gpumon.Recording | None]:
    """Each gpumon file of the run: its reader, or None while its header is not written yet."""
    out = {}
    for path in sorted(run.glob("gpumon.*.csv")):
        try:
            out[path] = gpumon.Recording(path)
        except gpumon.RecordingError:
            out[path] = None
    return out


def samples(rec: gpumon.Recording) -> int:
    return sum(kind == "s" for _, kind, _, _, _ in rec.rows())


def test_two_nodes_kill_one_resume_and_evaluate(prepared, texts, tmp_path):
    t0, cpu0 = time.monotonic(), cpu_of_children()
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("127.0.0.1 slots=2\nlocalhost slots=2\n")  # two names, one machine
    run = tmp_path / "run"
    env = child_env(MASTER_PORT=str(free_port()), PATH=f"{Path(sys.executable).parent}:{child_env()['PATH']}")
    env.pop("MASTER_ADDR", None)
    cmd = ["bash", str(LAUNCH), "--data", str(prepared), "--out", str(run), "--hostfile", str(hostfile),
           "--cpu-rehearsal", "--max-restarts", "0", "--join-timeout", "120", "--", *TRAIN]  # fmt: skip
    logs: list[Path] = []

    def node(name: str) -> subprocess.Popen:
        logs.append(tmp_path / f"{name}.log")
        with open(logs[-1], "w") as log:
            return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)

    def wait_for(ready, what: str, procs: list[subprocess.Popen], timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            assert all(p.poll() is None for p in procs), f"a node exited before {what}: {tail(logs)}"
            assert time.monotonic() < deadline, f"timed out waiting for {what}: {tail(logs)}"
            time.sleep(0.1)

    # 1. Two nodes; the first started hosts the rendezvous store, the second is the one that dies.
    first = node("first")
    time.sleep(2)
    second = node("second")
    procs = [first, second]
    try:
        wait_for(lambda: max(train_steps(run), default=0) > SAVE_EVERY, "a checkpoint and a step past it", procs)
        recs = recordings(run)
        assert len(recs) == 2 and all(r is not None and samples(r) > 0 for r in recs.values()), list(recs)
        killed_cpu = tree_cpu(second.pid)  # never waited for: counted here
        kill_tree(second.pid)
        killed_at = max(train_steps(run))
        assert killed_at < STEPS, "the run ended before the kill: raise STEPS"
        first.wait(timeout=180)
    finally:
        for proc in procs:
            kill_tree(proc.pid)
            proc.wait()
    first_log = logs[0].read_text()
    assert first.returncode != 0, first_log[-3000:]
    assert "lost contact with the other ranks" in first_log, first_log[-3000:]
    before = {path: path.stat().st_size for path in recordings(run)}

    # 2. Both nodes again, the same command: they resume from the newest complete checkpoint and finish.
    first, second = node("first-again"), None
    time.sleep(2)
    second = node("second-again")
    try:
        for proc in (first, second):
            proc.wait(timeout=600)
    finally:
        for proc in (first, second):
            kill_tree(proc.pid)
            proc.wait()
    assert first.returncode == 0 and second.returncode == 0, tail(logs[2:])
    steps = train_steps(run)
    assert steps == list(range(1, STEPS + 1)), steps  # no step twice, none missing
    resumed = [ln for ln in logs[2].read_text().splitlines() if "resumed from" in ln]
    assert resumed and f"step_{killed_at // SAVE_EVERY * SAVE_EVERY:08d}" in resumed[0], tail(logs[2:])
    manifest = json.loads((run / "checkpoints" / f"step_{STEPS:08d}" / "manifest.json").read_text())
    assert manifest["world_size"] == 4 and {f"rank{r}.pt" for r in range(4)} <= set(manifest["files"])

    # One recording per node and start: the first start's files kept, the second start's two complete.
    recs = recordings(run)
    assert set(before) < set(recs) and len(recs) == 4, list(recs)
    assert all(path.stat().st_size >= size for path, size in before.items())
    for path in set(recs) - set(before):
        assert recs[path].trailer is not None and samples(recs[path]) > 0, path

    # 3. Evaluate on two ranks ("--" ends torchrun's options: it would take --run for its --run-path).
    _, val = texts
    ev = subprocess.run(
        torchrun("--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                 "-m", "--", "lmtrain", "eval", "--run", str(run), "--text", str(val), "--json", "--context", "32"),
        capture_output=True, text=True, timeout=600, env=child_env(),
    )  # fmt: skip
    assert ev.returncode == 0, ev.stdout[-3000:] + ev.stderr[-3000:]
    figures = json.loads(ev.stdout.strip().splitlines()[-1])
    assert figures["ranks"] == 2 and figures["tokens"] > 0 and math.isfinite(figures["loss"]), figures
    # For the record (pytest -s): the CPU time of every process the rehearsal started, the killed node's included.
    cpu = cpu_of_children() - cpu0 + killed_cpu
    print(f"rehearsal: {time.monotonic() - t0:.0f} s wall, {cpu:.0f} s CPU, load average {os.getloadavg()[0]:.1f}")


def tree_cpu(pid: int) -> float:
    """CPU seconds so far of a process and everything under it."""
    root = psutil.Process(pid)
    total = 0.0
    for proc in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            times = proc.cpu_times()
            total += times.user + times.system
    return total


def cpu_of_children() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def tail(logs: list[Path]) -> str:
    return "".join(f"\n--- {p.name}\n{p.read_text()[-2500:]}" for p in logs if p.exists())
