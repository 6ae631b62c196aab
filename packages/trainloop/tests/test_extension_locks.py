"""A torch extension-build lock left by a killed build is found and named in one line; a DeepSpeed start stops with
that line instead of waiting on the lock forever; a lock a live build holds is left alone."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from trainloop import extension_locks
from trainloop.extension_locks import STALE_AFTER_S, find_extension_locks, stale_extension_lock_message


def _lock(root, op="deepspeed_shm_comm", age_s=0.0):
    (root / op).mkdir(parents=True, exist_ok=True)
    path = root / op / "lock"
    path.touch()
    if age_s:
        then = time.time() - age_s
        os.utime(path, (then, then))
    return path


def _held(path):
    """A process holding ``path`` open, as torch's FileBaton does for the whole build."""
    code = f"import os, sys, time; fd = os.open({str(path)!r}, os.O_RDONLY); print('held', flush=True); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


# (case, filesystem type, lock age, held by a live process, stale?)
CASES = [
    ("killed build, local disk", "ext4", 0.0, False, True),
    ("build in progress, local disk", "ext4", 0.0, True, False),
    ("build in progress for long", "ext4", 2 * STALE_AFTER_S, True, False),
    ("network filesystem, recent", "nfs4", 60.0, False, False),  # maybe another node's build in progress
    ("network filesystem, old", "nfs4", 2 * STALE_AFTER_S, False, True),
]


@pytest.mark.parametrize(("fs", "age", "held", "stale"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_lock_is_stale_when_no_build_holds_it(tmp_path, monkeypatch, fs, age, held, stale):
    monkeypatch.setattr(extension_locks, "_filesystem_type", lambda path: fs)
    path = _lock(tmp_path, age_s=age)
    holder = _held(path) if held else None
    try:
        [lock] = find_extension_locks(tmp_path)
        message = stale_extension_lock_message(tmp_path)
    finally:
        if holder is not None:
            holder.kill()
            holder.wait()
    assert lock.path == path and lock.stale is stale
    assert (holder.pid in lock.holders) if held else not lock.holders
    if stale:
        assert str(path) in message and f"rm {path}" in message and len(message.splitlines()) == 1
    else:
        assert message is None


def test_no_lock_no_message(tmp_path):
    (tmp_path / "cpu_adam").mkdir()
    assert find_extension_locks(tmp_path) == [] and stale_extension_lock_message(tmp_path) is None
    assert stale_extension_lock_message(tmp_path / "missing") is None


def test_the_default_root_is_torchs_own(monkeypatch):
    from torch.utils.cpp_extension import _get_build_directory

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setattr("torch.utils.cpp_extension.os.makedirs", lambda *a, **k: None)  # look, do not create
    assert extension_locks.extensions_root() / "deepspeed_shm_comm" == type(extension_locks.extensions_root())(
        _get_build_directory("deepspeed_shm_comm", verbose=False)
    )


START = """
from trainloop.config import ConfigError
from trainloop.distributed import setup_distributed
try:
    setup_distributed("deepspeed", 60)
except ConfigError as exc:
    print("REFUSED", exc)
"""


def test_a_deepspeed_start_names_the_stale_lock_instead_of_waiting_on_it(tmp_path):
    pytest.importorskip("deepspeed")
    path = _lock(tmp_path)
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(name, None)
    try:  # without the check DeepSpeed's op build waits on the lock forever: the bound is far above a start
        proc = subprocess.run([sys.executable, "-c", START], env=env, capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired:
        pytest.fail("the DeepSpeed start waited on the stale lock")
    refused = [ln for ln in proc.stdout.splitlines() if ln.startswith("REFUSED ")]
    assert len(refused) == 1 and str(path) in refused[0] and "stale lock" in refused[0], proc.stdout + proc.stderr
    assert path.exists()  # reported, never removed behind the user's back
