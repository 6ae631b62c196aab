"""A sharded FSDP checkpoint whose files were altered is refused in one line on every rank, before any file outside
the checkpoint is opened: a storage path leading out of it (``../../elsewhere/x.distcp``), junk, a pickle of
something else, an empty metadata file, a damaged data file."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import subprocess
from pathlib import Path

import pytest
from launch import command, env
from torch.distributed.checkpoint.filesystem import _StorageInfo

from trainloop.checkpoint import CheckpointError

STEP = "checkpoints/step_00000002"
ARGS = {"engine": "fsdp", "model": "blocks", "save_every": 2}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("dcp") / "run"
    proc = subprocess.run(command("train_tiny.py", {**ARGS, "max_steps": 2, "run_dir": str(run_dir)}), env=env(),
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


def _rewrite_metadata(ckpt: Path, change) -> None:
    path = ckpt / "dcp" / ".metadata"
    metadata = pickle.loads(path.read_bytes())  # our own file, written a moment ago
    metadata.storage_data = {k: change(v) for k, v in metadata.storage_data.items()}
    path.write_bytes(pickle.dumps(metadata))


def _outside(ckpt: Path) -> None:
    elsewhere = ckpt.parents[2] / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    shutil.copy(ckpt / "dcp" / "__0_0.distcp", elsewhere / "x.distcp")  # a valid file: only the path gives it away
    rel = os.path.relpath(elsewhere / "x.distcp", ckpt / "dcp")
    _rewrite_metadata(ckpt, lambda v: _StorageInfo(rel, v.offset, v.length))


def _absolute(ckpt: Path) -> None:
    _outside(ckpt)
    _rewrite_metadata(ckpt, lambda v: _StorageInfo(str(ckpt.parents[2] / "elsewhere" / "x.distcp"), v.offset,
                                                   v.length))  # fmt: skip


def _negative_offset(ckpt: Path) -> None:
    _rewrite_metadata(ckpt, lambda v: _StorageInfo(v.relative_path, -8, v.length))


def _transforms(ckpt: Path) -> None:
    _rewrite_metadata(ckpt, lambda v: _StorageInfo(v.relative_path, v.offset, v.length, ["zstd"]))


def _write(name: str, data: bytes):
    return lambda ckpt: (ckpt / "dcp" / name).write_bytes(data)


# (case, tampering, what the refusal names)
TAMPERED = [
    ("storage path outside", _outside, "outside the checkpoint directory"),
    ("absolute storage path", _absolute, "outside the checkpoint directory"),
    ("negative offset", _negative_offset, "expected counts"),
    ("transforms", _transforms, "this engine writes none"),
    ("junk metadata", _write(".metadata", b"\x00junk" * 10), "refused to load"),
    ("pickled dict as metadata", _write(".metadata", pickle.dumps({"a": 1})), "holds a dict"),
    ("empty metadata", _write(".metadata", b""), "refused to load"),
    ("junk data file", _write("__0_0.distcp", b"junk" * 100), "unreadable sharded checkpoint"),
]


def _tampered_copy(saved: Path, dst: Path, tamper) -> Path:
    shutil.copytree(saved, dst)
    ckpt = dst / STEP
    tamper(ckpt)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    for rel in manifest["files"]:  # made consistent, as whoever altered the files would
        data = (ckpt / rel).read_bytes()
        manifest["files"][rel] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    return dst


def _resume(run_dir: Path, nproc: int = 1) -> subprocess.CompletedProcess:
    args = {**ARGS, "max_steps": 4, "run_dir": str(run_dir), "resume": True, "refusals": True,
            "watch_open": "elsewhere"}  # fmt: skip
    return subprocess.run(command("train_tiny.py", args, nproc), env=env(), capture_output=True, text=True,
                          timeout=300)  # fmt: skip


@pytest.mark.parametrize(("tamper", "named"), [t[1:] for t in TAMPERED], ids=[t[0] for t in TAMPERED])
def test_an_altered_sharded_checkpoint_is_refused_in_one_line(saved, tmp_path, tamper, named):
    proc = _resume(_tampered_copy(saved, tmp_path / "run", tamper))
    refused = [ln for ln in proc.stdout.splitlines() if ln.startswith("REFUSED 0 ")]
    assert proc.returncode == 3 and len(refused) == 1, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert named in refused[0] and "Traceback" not in refused[0], refused[0]
    assert "OPENED" not in proc.stdout  # nothing outside the checkpoint was read
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


def test_two_ranks_refuse_alike_without_tracebacks(saved, tmp_path):
    proc = _resume(_tampered_copy(saved, tmp_path / "run", _outside), nproc=2)
    refused = sorted(ln.split(" ", 2)[1] for ln in proc.stdout.splitlines() if ln.startswith("REFUSED "))
    assert refused == ["0", "1"], proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "OPENED" not in proc.stdout
    # torchrun reports the ranks' exit status 3 with a traceback of its own; the ranks print none.
    for rank_said in ("[rank0]: Traceback", "[rank1]: Traceback", "AssertionError", "EOFError", "CheckpointException"):
        assert rank_said not in proc.stderr, proc.stderr[-3000:]


def test_check_storage_paths_accepts_the_files_dcp_writes(saved):
    from trainloop.fsdp_checkpoint import check_storage_paths

    metadata = pickle.loads((saved / STEP / "dcp" / ".metadata").read_bytes())
    check_storage_paths(metadata, saved / STEP / "dcp", saved / STEP / "dcp" / ".metadata")
    metadata.storage_data = {k: _StorageInfo("sub/../../x.distcp", 0, 1) for k in metadata.storage_data}
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        check_storage_paths(metadata, saved / STEP / "dcp", saved / STEP / "dcp" / ".metadata")
