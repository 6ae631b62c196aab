"""Multi-process training: 2 ranks with DeepSpeed ZeRO-2 (gloo, bf16), and two 'nodes' on one machine."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import child_env, read_metrics, run_lmtrain

pytest.importorskip("deepspeed")

# bf16 losses of the same run on 2 ranks, resumed on 1, against one process started and resumed alike. The corpus is
# the running Python's standard library, so the figures move with the Python: at most 3.3e-4 relative on 3.11; on 3.12,
# 9.0e-3 at step 14 (its gradient norm doubles at step 13, and bf16's rounding differences grow with it), where the
# same runs in fp32 differ by 4.1e-6. A resume that re-read trained-on windows (tokbin's re-split before its fix) was
# 7.5% off. The fp32 resume across world sizes is held to 1e-5 by trainloop's test_world_size_resume.py.
BF16_RTOL = 2e-2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args]


def test_two_ranks_deepspeed_zero2_bf16(prepared, texts, tmp_path):
    ds_config = tmp_path / "ds.json"
    ds_config.write_text(json.dumps({
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2, "contiguous_gradients": True, "overlap_comm": True},
    }))  # fmt: skip
    run = tmp_path / "run"
    cmd = torchrun(
        "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        "-m", "lmtrain", "train", "--data", str(prepared), "--out", str(run), "--preset", "tiny",
        "--deepspeed", str(ds_config), "--max-steps", "12", "--set", "precision=bf16", "--set", "log_every=2",
        "--set", "lr=0.01", "--set", "micro_batch=4",
    )  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=child_env())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = [r for r in read_metrics(run) if "loss" in r]
    assert [r["step"] for r in records] == [2, 4, 6, 8, 10, 12]
    assert records[-1]["loss"] < records[0]["loss"]
    run_info = json.loads((run / "run.json").read_text())
    assert run_info["world_size"] == 2 and run_info["train_config"]["engine"] == "deepspeed"
    # The consolidated checkpoint loads in one process: evaluate it.
    _, val = texts
    ev = run_lmtrain("eval", "--run", str(run), "--text", str(val), "--json", "--context", "32")
    assert json.loads(ev.stdout.strip().splitlines()[-1])["tokens"] > 0
    # One process resumes it: DeepSpeed's universal checkpoint re-partitions the optimizer state, the accumulation
    # doubles to keep the global batch of 8 rows, and the data stream is re-split.
    resumed = run_lmtrain(
        "train", "--data", str(prepared), "--out", str(run), "--preset", "tiny", "--deepspeed", str(ds_config),
        "--max-steps", "16", "--resume", "--set", "precision=bf16", "--set", "log_every=2", "--set", "micro_batch=4",
    )  # fmt: skip
    assert "resuming a run of 2 rank(s) on 1: grad_accum 1 -> 2 keeps the global batch of 8 rows" in resumed.stdout
    assert [r["step"] for r in read_metrics(run) if "loss" in r] == [2, 4, 6, 8, 10, 12, 14, 16]
    # The same two commands in one process (the global batch of 8 rows as 2 x 4, then resumed the same way): the
    # 2-rank steps and the steps resumed from them follow it within bf16's tolerance (the ranks' reduction order and
    # bf16 rounding differ). Both runs were planned for 12 steps and extended to 16 on resume, so their schedules
    # are the same.
    reference = tmp_path / "reference"
    for steps, again in (("12", ()), ("16", ("--resume",))):
        run_lmtrain(
            "train", "--data", str(prepared), "--out", str(reference), "--preset", "tiny",
            "--deepspeed", str(ds_config), "--max-steps", steps, *again, "--set", "precision=bf16",
            "--set", "log_every=2", "--set", "lr=0.01", "--set", "micro_batch=4", "--set", "grad_accum=2",
        )  # fmt: skip
    ref = {r["step"]: r["loss"] for r in read_metrics(reference) if "loss" in r}
    got = {r["step"]: r["loss"] for r in read_metrics(run) if "loss" in r}
    far = [(s, got[s], ref[s]) for s in ref if abs(got[s] - ref[s]) > BF16_RTOL * abs(ref[s])]
    assert sorted(ref) == sorted(got) == [2, 4, 6, 8, 10, 12, 14, 16] and not far, (far, got, ref)
    manifest = json.loads((run / "checkpoints" / "step_00000016" / "manifest.json").read_text())
    assert manifest["world_size"] == 1 and json.loads((run / "run.json").read_text())["world_size"] == 1


def test_lost_node_fails_the_other_with_a_clear_error(prepared, tmp_path):
    port = free_port()
    run = tmp_path / "run"
    timeout_s = 30

    def node(name: str) -> subprocess.Popen:
        cmd = torchrun(
            "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "lost-node", "--max-restarts", "0",
            "-m", "lmtrain", "train", "--data", str(prepared), "--out", str(run), "--preset", "tiny",
            "--max-steps", "100000", "--set", "log_every=1", "--set", f"dist_timeout_s={timeout_s}",
        )  # fmt: skip
        log = open(tmp_path / f"{name}.log", "w")  # noqa: SIM115 - closed with the process below
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env())

    first = node("first")
    time.sleep(2)  # the first agent hosts the rendezvous store; the second node is the one that dies
    second = node("second")
    try:
        deadline = time.monotonic() + 300
        while not any(r.get("step", 0) >= 3 for r in read_metrics(run)):
            assert first.poll() is None and second.poll() is None, "a node exited before training: " + _logs(tmp_path)
            assert time.monotonic() < deadline, "the two nodes did not start training: " + _logs(tmp_path)
            time.sleep(0.5)
        kill_tree(second.pid)
        killed_at = time.monotonic()
        # The survivor's next collective fails (connection closed) or times out after dist_timeout_s.
        first.wait(timeout=timeout_s + 90)
        waited = time.monotonic() - killed_at
    finally:
        for proc in (first, second):
            kill_tree(proc.pid)
            proc.wait()
    log = (tmp_path / "first.log").read_text()
    assert first.returncode != 0, log[-3000:]
    assert "lost contact with the other ranks" in log, log[-3000:]
    assert "--resume" in log
    assert waited < timeout_s + 90


def kill_tree(pid: int) -> None:
    """SIGKILL a torchrun agent and every process under it, as a node that loses power would.

    torchrun starts each worker in a session of its own, so killing the agent's process group would leave the
    workers running (and the job healthy).
    """
    try:
        root = psutil.Process(pid)
        procs = [*root.children(recursive=True), root]
    except psutil.NoSuchProcess:
        return
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.send_signal(signal.SIGKILL)


def _logs(tmp_path: Path) -> str:
    return "".join(f"\n--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(tmp_path.glob("*.log")))


def test_two_ranks_zero3_with_parameters_and_optimizer_on_nvme_train_as_plain_zero3(prepared, tmp_path):
    """`lmtrain train --deepspeed FILE` with offload_param and offload_optimizer on NVMe, as a user's config gives
    them: the losses of plain ZeRO-3 on the same 2 ranks, with both kinds of state written to the swap directory."""
    from trainloop.offload import build_aio

    reason = build_aio()  # JIT-built once here (minutes), not by both ranks at once
    if reason is not None:
        pytest.skip(f"DeepSpeed's async I/O op cannot build here: {reason} (apt-get install libaio-dev)")
    swap = tmp_path / "swap"
    swap.mkdir()
    # Width 1024: every weight partition is above DeepSpeed's 1 MiB minimum for a swapped tensor. 16 buffers of 4M
    # elements: a block gathers more partitions at once than the 4 buffers that sufficed for trainloop's own test
    # (DeepSpeed's "Not enough buffers" otherwise); max_in_cpu 0 keeps the parameter partitions on the drive.
    offload = {"device": "nvme", "nvme_path": str(swap), "buffer_count": 16}
    zero = {"stage": 3, "offload_param": {**offload, "buffer_size": 4 * 2**20, "max_in_cpu": 0},
            "offload_optimizer": {**offload, "buffer_count": 4}}  # fmt: skip

    def train(name: str, config: dict) -> subprocess.CompletedProcess:
        ds_config = tmp_path / f"{name}.json"
        ds_config.write_text(json.dumps(config))
        cmd = torchrun(
            "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
            "-m", "lmtrain", "train", "--data", str(prepared), "--out", str(tmp_path / name), "--preset", "tiny",
            "--set", "d_model=1024", "--deepspeed", str(ds_config), "--max-steps", "6", "--set", "log_every=1",
            "--set", "micro_batch=4", "--set", "lr=0.001",
        )  # fmt: skip
        return subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=child_env())

    losses = {}
    for name, config in (("plain", {"zero_optimization": {"stage": 3}}), ("nvme", {"zero_optimization": zero})):
        result = train(name, config)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        losses[name] = {r["step"]: r["loss"] for r in read_metrics(tmp_path / name) if "loss" in r}
    swapped = {p.relative_to(swap).parts[1] for p in swap.rglob("*.swp")}
    assert swapped == {"float32params", "optimizer"}, swapped  # both kinds of state went through the files
    assert sorted(losses["nvme"]) == [1, 2, 3, 4, 5, 6]
    # Measured: equal to the last bit (fp32, the same reduction order); the bound is 1e-5.
    assert losses["nvme"] == pytest.approx(losses["plain"], rel=1e-5), losses
    # Too few swap buffers: DeepSpeed's bare assertion, named as the field and its fix on each rank.
    few = {"zero_optimization": {**zero, "offload_param": {**zero["offload_param"], "buffer_count": 4}}}
    failed = train("few", few)
    assert failed.returncode != 0
    assert "lmtrain train: error: zero_optimization.offload_param.buffer_count=4 is too few" in failed.stderr
    assert "AssertionError" not in failed.stderr, failed.stderr[-3000:]
