"""Writes that must not happen, and writes the filesystem refuses: a run never writes through a symbolic or hard
link; EFBIG (the file size limit) and EROFS (a read-only filesystem) during a save are one error naming the file
and the fix, as ENOSPC is; a checkpoint whose weights file is not safetensors is refused in one line."""

from __future__ import annotations

import errno
import os
import pickle
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from tiny_model import SeqData, TinyLM

import trainloop.engine_torch as engine_torch
from trainloop import CheckpointStore, TrainConfig, Trainer
from trainloop.checkpoint import CheckpointError, LinkedFileError, load_model_weights, open_guarded, open_new
from trainloop.faults import DiskFullError, WriteFailedError, write_errno

VICTIM = "someone else's notes\n"


def _symlink(target: Path, victim: Path) -> None:
    target.symlink_to(victim)


def _hardlink(target: Path, victim: Path) -> None:
    os.link(victim, target)


def _fifo(target: Path, victim: Path) -> None:
    os.mkfifo(target)


LINKS = [("symbolic link", _symlink), ("hard link", _hardlink), ("fifo", _fifo)]
OPENERS = [
    ("open_new (emptied)", lambda p: open_new(p)),
    ("open_guarded append", lambda p: open_guarded(p, "a", append=True)),
    ("open_guarded binary", lambda p: open_guarded(p, "wb")),
]


@pytest.mark.parametrize("opener", [o[1] for o in OPENERS], ids=[o[0] for o in OPENERS])
@pytest.mark.parametrize("make", [m[1] for m in LINKS], ids=[m[0] for m in LINKS])
def test_a_write_never_goes_through_a_link(tmp_path, make, opener):
    victim = tmp_path / "victim.txt"
    victim.write_text(VICTIM)
    target = tmp_path / "metrics.jsonl"
    make(target, victim)
    with pytest.raises(LinkedFileError) as info:
        opener(target)
    assert str(target) in str(info.value) and len(str(info.value).splitlines()) == 1
    assert "remove it" in str(info.value)
    assert victim.read_text() == VICTIM and victim.stat().st_nlink in (1, 2)


def test_a_plain_file_is_written_with_the_umask_mode(tmp_path):
    old = os.umask(0o027)
    try:
        with open_new(tmp_path / "new.json") as f:
            f.write("{}")
        (tmp_path / "old.jsonl").write_text("first\n")
        with open_guarded(tmp_path / "old.jsonl", "a", append=True) as f:
            f.write("second\n")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "new.json").stat().st_mode) == 0o640
    assert (tmp_path / "old.jsonl").read_text() == "first\nsecond\n"


def _cfg(**kw):
    base = dict(lr=1e-2, max_steps=4, micro_batch=4, save_every=2, log_every=1, progress=False, tensorboard=False)
    return TrainConfig(**(base | kw))


def _fit(run_dir, resume=False, **kw):
    torch.manual_seed(0)
    return Trainer(TinyLM(), _cfg(**kw), SeqData(4), run_dir=run_dir).fit(resume=resume)


@pytest.mark.parametrize("name", ["metrics.jsonl", "checkpoints/best.json", "loss.png"])
@pytest.mark.parametrize("make", [m[1] for m in LINKS[:2]], ids=[m[0] for m in LINKS[:2]])
def test_a_file_a_run_replaces_is_refused_when_it_is_a_link(tmp_path, make, name):
    from trainloop.plotting import plot_metrics

    run = tmp_path / "run"
    _fit(run, max_steps=2, eval_every=2)
    victim = tmp_path / "victim.txt"
    victim.write_text(VICTIM)
    (run / name).unlink(missing_ok=True)
    make(run / name, victim)
    with pytest.raises(CheckpointError, match="remove"):  # a symbolic link out of the run: refused on start
        if name == "loss.png":
            plot_metrics(run / "metrics.jsonl", run / name)
        elif name == "checkpoints/best.json":
            CheckpointStore(run).mark_best(2, "eval_loss", 1.0)
        else:
            _fit(run, resume=True, max_steps=4, eval_every=2)
    assert victim.read_text() == VICTIM


# A write refused during a save, at the rank state file of step 4: the errno and what the message must say.
WRITE_FAULTS = [
    ("EFBIG", errno.EFBIG, WriteFailedError, ["file size limit", "ulimit -f"]),
    ("EROFS", errno.EROFS, WriteFailedError, ["read-only filesystem", "writable filesystem"]),
    ("ENOSPC", errno.ENOSPC, DiskFullError, ["no space left on device", "free some space"]),
]


@pytest.mark.parametrize(("code", "kind", "said"), [w[1:] for w in WRITE_FAULTS], ids=[w[0] for w in WRITE_FAULTS])
def test_a_refused_write_during_a_save_is_one_line_naming_the_file(tmp_path, monkeypatch, code, kind, said):
    _fit(tmp_path, max_steps=2)
    real = engine_torch.save_torch

    def refused(obj, path):
        if "tmp-step_00000004" in str(path):
            raise OSError(code, os.strerror(code), str(path))
        real(obj, path)

    monkeypatch.setattr(engine_torch, "save_torch", refused)
    with pytest.raises(kind) as info:
        _fit(tmp_path, resume=True, max_steps=4)
    message = str(info.value)
    assert len(message.splitlines()) == 1 and info.value.errno == code
    assert ".tmp-step_00000004" in message and all(s in message for s in said), message
    assert "resume from the newest complete checkpoint" in message
    if kind is WriteFailedError:  # what lmtrain turns into its one-line error
        assert isinstance(info.value, CheckpointError)
    assert CheckpointStore(tmp_path).find_resumable()[0].name == "step_00000002"


WRAPPED = [
    ("safetensors EFBIG", RuntimeError("Error while serializing: I/O error: File too large (os error 27)"),
     errno.EFBIG),
    ("safetensors EROFS", RuntimeError("I/O error: Read-only file system (os error 30)"), errno.EROFS),
    ("EACCES", OSError(errno.EACCES, "Permission denied"), None),
]  # fmt: skip


@pytest.mark.parametrize(("exc", "code"), [w[1:] for w in WRAPPED], ids=[w[0] for w in WRAPPED])
def test_write_errno_reads_wrapped_errors(exc, code):
    assert write_errno(exc) == code


RLIMIT_SCRIPT = """
import resource, sys
sys.path.insert(0, {tests!r})
from tiny_model import SeqData, TinyLM
from trainloop import TrainConfig, Trainer
from trainloop.checkpoint import CheckpointError
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))  # the model's weights are 9 KB
cfg = TrainConfig(lr=1e-2, max_steps=2, micro_batch=4, save_every=2, progress=False, tensorboard=False)
try:
    Trainer(TinyLM(), cfg, SeqData(4), run_dir={run!r}).fit()
except CheckpointError as exc:
    print("REFUSED", exc)
"""


def test_the_file_size_limit_of_the_process_is_one_line(tmp_path):
    script = RLIMIT_SCRIPT.format(tests=str(Path(__file__).parent), run=str(tmp_path / "run"))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("REFUSED ")]
    assert proc.returncode == 0 and len(lines) == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "file too large writing" in lines[0] and "4.1 KB (ulimit -f)" in lines[0], lines[0]


PAYLOADS = [
    ("pickle", pickle.dumps({"weight": [1.0, 2.0]})),
    ("junk", b"\x00" * 64),
    ("empty", b""),
]


@pytest.mark.parametrize("payload", [p[1] for p in PAYLOADS], ids=[p[0] for p in PAYLOADS])
def test_weights_that_are_not_safetensors_are_refused_in_one_line(tmp_path, payload):
    (tmp_path / "model.safetensors").write_bytes(payload)
    with pytest.raises(CheckpointError) as info:
        load_model_weights(tmp_path)
    message = str(info.value)
    assert len(message.splitlines()) == 1 and "not a safetensors file" in message and str(tmp_path) in message
