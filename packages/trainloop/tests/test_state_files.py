"""The files a run leaves behind: a torn metrics.jsonl does not stop a resume, state files are replaced atomically,
every file follows the umask, and a full disk during a save is one error naming the path and the space needed."""

from __future__ import annotations

import errno
import json
import os
import stat

import pytest
import torch
from tiny_model import SeqData, TinyLM, eval_batches

import trainloop.checkpoint as checkpoint
from trainloop import CheckpointStore, TrainConfig, Trainer
from trainloop.faults import DiskFullError, disk_full
from trainloop.metrics_logging import MetricsLogger, read_metrics


def _cfg(**kw):
    base = dict(lr=1e-2, max_steps=4, micro_batch=4, save_every=2, log_every=1, progress=False, tensorboard=False)
    base.update(kw)
    return TrainConfig(**base)


def _fit(run_dir, resume=False, model=None, **kw):
    torch.manual_seed(0)
    trainer = Trainer(model or TinyLM(), _cfg(**kw), SeqData(4), run_dir=run_dir, eval_data=lambda: eval_batches())
    return trainer.fit(resume=resume)


def test_a_torn_last_metrics_line_is_dropped_and_reported_on_resume(tmp_path, capsys):
    _fit(tmp_path, max_steps=4)
    metrics = tmp_path / "metrics.jsonl"
    with open(metrics, "a") as f:
        f.write('{"step": 5, "loss": 1.2')  # the write a power cut interrupted
    capsys.readouterr()
    assert _fit(tmp_path, resume=True, max_steps=6)["step"] == 6
    err = capsys.readouterr().err
    warnings = [ln for ln in err.splitlines() if "metrics.jsonl" in ln]
    assert len(warnings) == 1 and "ignored line" in warnings[0] and "not a complete JSON record" in warnings[0]
    records, bad = read_metrics(metrics)
    assert not bad
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5, 6]


def test_read_metrics_names_every_bad_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1}\n[1, 2]\n\n{"step": 2}\n\xff\xfe\n{"step": 3')
    records, bad = read_metrics(path)
    assert [r["step"] for r in records] == [1, 2] and bad == [2, 5, 6]


def test_the_resume_rewrite_of_metrics_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    original = "".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 6))
    path.write_text(original)

    def no_space(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)
    with pytest.raises(OSError, match="No space"):
        MetricsLogger(tmp_path, enabled=True, tensorboard=False, resume_step=3)
    assert path.read_text() == original  # the failed rewrite left the old file whole
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]  # and no temporary file


def test_best_pointer_is_replaced_atomically(tmp_path, monkeypatch):
    _fit(tmp_path, max_steps=2, eval_every=2)
    store = CheckpointStore(tmp_path)
    before = (store.root / "best.json").read_text()

    real_open = checkpoint.open_new

    class Torn:  # writes half of what it is given, then the disk is full
        def __init__(self, path, mode="w"):
            self.f = real_open(path, mode)

        def __enter__(self):
            return self

        def write(self, text):
            self.f.write(text[: len(text) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")

        def __exit__(self, *exc):
            self.f.close()

    monkeypatch.setattr(checkpoint, "open_new", Torn)
    with pytest.raises(OSError):
        store.mark_best(2, "eval_loss", 0.5)
    assert (store.root / "best.json").read_text() == before


@pytest.mark.parametrize("mask", [0o022, 0o027])
def test_every_file_of_a_run_follows_the_umask(tmp_path, mask):
    old = os.umask(mask)
    try:
        _fit(tmp_path, max_steps=4, eval_every=2)
    finally:
        os.umask(old)
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any(p.name == "model.safetensors" for p in files)  # written by safetensors through a temporary file
    wrong = {str(p.relative_to(tmp_path)): oct(stat.S_IMODE(p.stat().st_mode)) for p in files
             if stat.S_IMODE(p.stat().st_mode) != 0o666 & ~mask}  # fmt: skip
    assert not wrong, f"expected {oct(0o666 & ~mask)} under umask {oct(mask)}"
    dirs = [p for p in tmp_path.rglob("*") if p.is_dir()]
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o777 & ~mask for p in dirs)


def _full_at_save_torch(monkeypatch):
    """The checkpoint's torch state file: its write raises ENOSPC, as write() does on a full disk."""
    import trainloop.engine_torch as engine_torch

    real = engine_torch.save_torch

    def full(obj, path):
        if "tmp-step_00000004" in str(path):
            with open(path, "wb") as f:
                f.write(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")
        real(obj, path)

    monkeypatch.setattr(engine_torch, "save_torch", full)


class _FillingFile:
    """A file on a disk with ``room`` bytes left: a write that does not fit raises ENOSPC, as write() does."""

    def __init__(self, f, room):
        self._f, self._room = f, room

    def write(self, data):
        n = memoryview(data).nbytes
        if n > self._room:
            raise OSError(errno.ENOSPC, "No space left on device")
        self._room -= n
        return self._f.write(data)

    def __getattr__(self, name):  # flush, fileno, close
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


def _full_inside_torch_save(monkeypatch):
    """The disk fills in the middle of torch.save's zip writer (a real torch.save): it raises its own RuntimeError
    ("unexpected pos ...", or "PytorchStreamWriter failed writing file ...") over the write's OSError."""
    real = checkpoint.open_new

    def filling(path, mode="w"):
        f = real(path, mode)
        return _FillingFile(f, 700) if "tmp-step_00000004" in str(path) and str(path).endswith(".pt") else f

    monkeypatch.setattr(checkpoint, "open_new", filling)


@pytest.mark.parametrize("fault", [_full_at_save_torch, _full_inside_torch_save], ids=["at a write", "in torch.save"])
def test_a_full_disk_during_a_save_names_the_path_and_the_space(tmp_path, monkeypatch, fault):
    _fit(tmp_path, max_steps=2)  # a complete checkpoint to size the next one by
    size = sum(e["bytes"] for e in json.loads((tmp_path / "checkpoints/step_00000002/manifest.json").read_text())[
        "files"].values())  # fmt: skip
    fault(monkeypatch)
    with pytest.raises(DiskFullError) as info:
        _fit(tmp_path, resume=True, max_steps=4)
    message = str(info.value)
    assert len(message.splitlines()) == 1 and info.value.errno == errno.ENOSPC
    assert str(tmp_path / "checkpoints" / ".tmp-step_00000004") in message
    assert f"{size / 1000:.1f} KB" in message and "the size of checkpoint step 2" in message
    assert "free there now" in message and "resume from the newest complete checkpoint" in message
    assert CheckpointStore(tmp_path).find_resumable()[0].name == "step_00000002"


def _raised_over(error, context):
    """``error`` as Python raises it in an ``except`` block handling ``context``."""
    try:
        try:
            raise context
        except OSError:
            raise error  # noqa: B904 - the implicit context is what torch's writer leaves
    except BaseException as exc:
        return exc


def _safetensors_full():
    from safetensors import SafetensorError

    return SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")


ENOSPC = OSError(errno.ENOSPC, "No space left on device")
ZIP_POS = "[enforce fail at inline_container.cc:672] . unexpected pos 642 vs 598"
ZIP_RECORD = "[enforce fail at inline_container.cc:588] . PytorchStreamWriter failed writing file data/0: file write " \
             "failed"  # fmt: skip
DISK_FULL = [
    ("ENOSPC", lambda: ENOSPC, True),
    ("EDQUOT", lambda: OSError(errno.EDQUOT, "Disk quota exceeded"), True),
    ("safetensors", _safetensors_full, True),
    ("torch.save over the write's ENOSPC", lambda: _raised_over(RuntimeError(ZIP_POS), ENOSPC), True),
    ("torch.save's own write", lambda: RuntimeError(ZIP_RECORD), True),
    ("EACCES", lambda: OSError(errno.EACCES, "Permission denied"), False),
    ("torch.save over an EIO", lambda: _raised_over(RuntimeError(ZIP_POS), OSError(errno.EIO, "I/O error")), False),
    ("reading a damaged zip", lambda: RuntimeError("[enforce fail at inline_container.cc:318] . PytorchStreamReader "
                                                   "failed reading zip archive: failed finding central directory"),
     False),
    ("a number like the code", lambda: RuntimeError("loss is nan (os error 280)"), False),
]  # fmt: skip


@pytest.mark.parametrize(("make", "full"), [r[1:] for r in DISK_FULL], ids=[r[0] for r in DISK_FULL])
def test_disk_full_recognises_wrapped_errors(make, full):
    assert disk_full(make()) is full
