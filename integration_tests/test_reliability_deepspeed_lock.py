"""A DeepSpeed JIT build killed midway leaves torch's extension lock behind (a file that records no owner); every
later `lmtrain train --engine deepspeed` then waited on it forever without a word. It now stops at once with one
line naming the lock and the `rm` that clears it, on one rank and on each rank of a torchrun job that gets there
before torchrun stops it, and leaves the lock for the user to remove."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import child_env, lmtrain_cmd

pytest.importorskip("deepspeed")


def _stale_lock(root):
    (root / "deepspeed_shm_comm").mkdir(parents=True)
    lock = root / "deepspeed_shm_comm" / "lock"
    lock.touch()  # what a killed build leaves: no process holds it open
    return lock


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_stale_extension_lock_stops_a_deepspeed_start_in_one_line(prepared, tmp_path, nproc):
    lock = _stale_lock(tmp_path / "torch_extensions")
    args = ["train", "--data", str(prepared), "--out", str(tmp_path / "run"), "--preset", "tiny", "--engine",
            "deepspeed", "--max-steps", "2", "--no-progress"]  # fmt: skip
    command = lmtrain_cmd(*args)
    if nproc > 1:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
                   "0", "-m", "lmtrain", *args]  # fmt: skip
    env = child_env(TORCH_EXTENSIONS_DIR=str(tmp_path / "torch_extensions"))
    try:  # without the check every rank waits on the lock forever: the bound is far above a refused start
        proc = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail("the DeepSpeed start waited on the stale extension lock")
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("lmtrain train: error: ")]
    # Each rank checks on its own; torchrun stops the others when the first exits, sometimes before they print.
    assert proc.returncode != 0 and 1 <= len(errors) <= nproc, proc.stderr[-4000:]
    assert all(f"stale lock of a torch extension build that was killed: {lock}" in e for e in errors), errors
    assert all(f"rm {lock}" in e for e in errors)
    assert "[rank0]: Traceback" not in proc.stderr and lock.exists()
