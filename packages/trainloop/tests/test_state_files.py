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


def test_a_full_disk_during_a_save_names_the_path_and_the_space(tmp_path, monkeypatch):
    import trainloop.engine_torch as engine_torch

    _fit(tmp_path, max_steps=2)  # a complete checkpoint to size the next one by
    size = sum(e["bytes"] for e in json.loads((tmp_path / "checkpoints/step_00000002/manifest.json").read_text())[
        "files"].values())  # fmt: skip
    real = engine_torch.save_torch

    def full(obj, path):
        if "tmp-step_00000004" in str(path):
            with open(path, "wb") as f:
                f.write(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")  # what write() raises on a full disk
        real(obj, path)

    monkeypatch.setattr(engine_torch, "save_torch", full)
    with pytest.raises(DiskFullError) as info:
        _fit(tmp_path, resume=True, max_steps=4)
    message = str(info.value)
    assert len(message.splitlines()) == 1 and info.value.errno == errno.ENOSPC
    assert str(tmp_path / "checkpoints" / ".tmp-step_00000004") in message
    assert f"{size / 1000:.1f} KB" in message and "the size of checkpoint step 2" in message
    assert "free there now" in message and "resume from the newest complete checkpoint" in message
    assert CheckpointStore(tmp_path).find_resumable()[0].name == "step_00000002"


def test_disk_full_recognises_wrapped_errors():
    from safetensors import SafetensorError

    assert disk_full(OSError(errno.ENOSPC, "No space left on device"))
    assert disk_full(OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert disk_full(SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"))
    assert not disk_full(OSError(errno.EACCES, "Permission denied"))
    assert not disk_full(RuntimeError("loss is nan (os error 280)"))
