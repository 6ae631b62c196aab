"""Fault types and their recognition: failed collectives (a dead or hung peer rank), a full disk."""

from __future__ import annotations

import errno
import shutil
import signal
import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


class NonFiniteLossError(RuntimeError):
    """Raised after ``max_consecutive_skips`` steps in a row had a non-finite loss or gradient norm."""


class CollectiveError(RuntimeError):
    """A collective operation failed: another rank most likely died or hung. Resuming from the latest checkpoint
    (torchrun ``--max-restarts``) continues the run."""


class DiskFullError(OSError):
    """A write failed for lack of space; the message names the path, the space a checkpoint needs and what is free."""


# What torch.save's zip writer raises when a write under it fails (a full disk, in practice): the record it was
# writing ("PytorchStreamWriter failed writing file data/0: file write failed"), or, when the file object's write
# raised, the position it then finds ("[enforce fail at inline_container.cc:...] . unexpected pos 642 vs 598").
_ZIP_WRITER_FAILURES = ("PytorchStreamWriter failed writing file", "] . unexpected pos ")


def disk_full(exc: BaseException) -> bool:
    """True for a write that failed with ENOSPC (or EDQUOT, a full quota), also when a library wrapped it:
    safetensors raises ``SafetensorError("... No space left on device (os error 28)")``; torch.save's zip writer
    raises a RuntimeError ("PytorchStreamWriter failed writing file ...", "unexpected pos ...") with the OSError
    of the failed write as its context, or alone where the write was torch's own. An OSError of another kind in the
    chain (EIO, say) is not a full disk."""
    codes = (errno.ENOSPC, errno.EDQUOT)
    chain: list[BaseException] = []
    link: BaseException | None = exc
    while link is not None and link not in chain:
        chain.append(link)
        link = link.__cause__ or link.__context__
    errors = [e for e in chain if isinstance(e, OSError) and e.errno is not None]
    if errors:
        return errors[0].errno in codes
    texts = [str(e) for e in chain]
    if any(f"os error {code})" in text for text in texts for code in codes):
        return True
    return isinstance(exc, RuntimeError) and any(k in texts[0] for k in _ZIP_WRITER_FAILURES)


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def checkpoint_bytes(store: Any, module: torch.nn.Module) -> tuple[int, str]:
    """(bytes one checkpoint of this run takes, how that was found): the newest complete checkpoint's manifest,
    else an estimate from the parameters (fp32 weights and AdamW's two fp32 moments: 12 bytes each)."""
    from trainloop.checkpoint import read_manifest  # checkpoint imports nothing from here; keep it one-way

    for step in reversed(store.steps()):
        manifest, _ = read_manifest(store.step_dir(step))
        if manifest is not None:
            sizes = [e.get("bytes") for e in manifest["files"].values() if isinstance(e, dict)]
            counted = [b for b in sizes if isinstance(b, int)]
            if sizes and len(counted) == len(sizes):
                return sum(counted), f"the size of checkpoint step {step}"
    n = sum(p.numel() for p in module.parameters())
    return 12 * n, f"estimated as 12 bytes per parameter for {n:,} parameters"


def disk_full_error(exc: BaseException, store: Any, module: torch.nn.Module, step: int) -> DiskFullError:
    """The one-line error for a full disk met at ``step``: the file being written (or the checkpoint directory),
    the space a checkpoint takes, what is free there, and the fix."""
    tmp = store.tmp_dir(step)
    path = Path(exc.filename) if isinstance(exc, OSError) and exc.filename else (tmp if tmp.is_dir() else None)
    where = path or store.run_dir
    needed, how = checkpoint_bytes(store, module)
    probe = where if where.exists() else store.run_dir
    try:
        free = f"{_size(shutil.disk_usage(probe).free)} free there now"
    except OSError:
        free = "free space unknown"
    partial = f"; {tmp.name} is an incomplete checkpoint that resume skips (delete it)" if tmp.is_dir() else ""
    error = DiskFullError(
        f"no space left on device writing {where} at step {step}: a checkpoint of this run takes about "
        f"{_size(needed)} ({how}), {free}; free some space (older runs, or a lower TrainConfig.keep_last) and "
        f"resume from the newest complete checkpoint{partial}"
    )
    error.errno = errno.ENOSPC
    return error


def collective_failure(exc: BaseException) -> bool:
    """True for errors raised by a collective whose peer died or timed out (gloo, nccl, torch DistError)."""
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(
        k in text for k in ("gloo", "connection closed", "connection reset", "timed out", "timeout", "nccl")
    )


class StopSignals:
    """SIGTERM/SIGINT set a flag the loop reads after each step (save, then exit cleanly); a second Ctrl-C raises
    KeyboardInterrupt at once. Handlers are installed only from the main thread, as Python requires."""

    def __init__(self) -> None:
        self.received: str | None = None
        self._old: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signal.Signals(signum).name

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            self._old = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}

    def restore(self) -> None:
        for s, handler in self._old.items():
            signal.signal(s, handler)
        self._old = {}
