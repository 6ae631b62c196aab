"""Fault types and their recognition: failed collectives (a dead or hung peer rank), a full disk."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainloop.checkpoint import CheckpointError


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


class WriteFailedError(OSError, CheckpointError):
    """A write the filesystem refused for good, not for lack of space: the file size limit (EFBIG, ``ulimit -f``)
    or a read-only filesystem (EROFS). The message names the path, the cause and the fix."""


# The errors of a write that the run cannot get past by itself: the disk or quota is full, the file size limit is
# reached, the filesystem is read-only.
WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS)


def write_errno(exc: BaseException) -> int | None:
    """The errno of :data:`WRITE_ERRNOS` a failed write ended with, also when a library wrapped it, else None.

    safetensors raises ``SafetensorError("... No space left on device (os error 28)")``; torch.save's zip writer
    raises a RuntimeError ("PytorchStreamWriter failed writing file ...", "unexpected pos ...") with the OSError of
    the failed write as its context, or alone where the write was torch's own (then a full disk is assumed, the
    usual cause). An OSError of another kind in the chain (EIO, say) gives None.

    Example:
        >>> import errno
        >>> write_errno(OSError(errno.EFBIG, "File too large")) == errno.EFBIG
        True
        >>> write_errno(RuntimeError("File too large (os error 27)")) == errno.EFBIG, write_errno(ValueError("x"))
        (True, None)
    """
    chain: list[BaseException] = []
    link: BaseException | None = exc
    while link is not None and link not in chain:
        chain.append(link)
        link = link.__cause__ or link.__context__
    errors = [e for e in chain if isinstance(e, OSError) and e.errno is not None]
    if errors:
        return errors[0].errno if errors[0].errno in WRITE_ERRNOS else None
    texts = [str(e) for e in chain]
    for code in WRITE_ERRNOS:
        if any(f"os error {code})" in text for text in texts):
            return code
    if isinstance(exc, RuntimeError) and any(k in texts[0] for k in _ZIP_WRITER_FAILURES):
        return errno.ENOSPC
    return None


def disk_full(exc: BaseException) -> bool:
    """True for a write that failed with ENOSPC (or EDQUOT, a full quota), also when a library wrapped it
    (:func:`write_errno`)."""
    return write_errno(exc) in (errno.ENOSPC, errno.EDQUOT)


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


def write_failed_error(exc: BaseException, code: int, store: Any, step: int) -> WriteFailedError:
    """The one-line error for a write refused with EFBIG (the file size limit) or EROFS (a read-only filesystem) at
    ``step``: the file, the cause, the fix."""
    tmp = store.tmp_dir(step)
    where = Path(exc.filename) if isinstance(exc, OSError) and exc.filename else (tmp if tmp.is_dir() else None)
    where = where or store.run_dir
    partial = f"; {tmp.name} is an incomplete checkpoint that resume skips (delete it)" if tmp.is_dir() else ""
    if code == errno.EFBIG:
        import resource

        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        shown = "unlimited" if limit == resource.RLIM_INFINITY else _size(limit)
        message = (
            f"file too large writing {where} at step {step}: the file size limit of this process is {shown} "
            f"(ulimit -f); raise it (ulimit -f unlimited) and resume from the newest complete checkpoint"
        )
    else:
        message = (
            f"read-only filesystem: cannot write {where} at step {step}; put the run directory on a writable "
            "filesystem (or remount it read-write) and resume from the newest complete checkpoint"
        )
    error = WriteFailedError(message + partial)
    error.errno = code
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
    KeyboardInterrupt at once. Handlers are installed only from the main thread, as Python requires.

    When the run has finished (:meth:`finish`), a SIGTERM no longer ends the process with status -15: the run's last
    checkpoint is saved, and what the process still does (writing adapters, a summary) finishes, so a job that a
    scheduler or a launcher signals just then still exits 0 on every rank. That first SIGTERM is reported on stderr;
    a second one acts as it would have (the handler found before). A handler the program installed itself is put
    back as it was, and :meth:`restore` (``Trainer.close()``) puts back the one found before in any case.

    A process forked from this one (a multiprocessing pool's worker, which ``Pool.terminate`` ends with SIGTERM)
    inherits these handlers: there they act as the handler found before, at once.
    """

    def __init__(self) -> None:
        self.received: str | None = None
        self.after_finish: str | None = None  # the signal that arrived once the run had finished, if any
        self._state = "none"  # "installed" (during fit), "deferring" (after it), "none"
        self._pid = os.getpid()

    def _forked(self, signum: int) -> bool:
        """In a forked child: put the handler found before back and deliver the signal to it."""
        if os.getpid() == self._pid:
            return False
        signal.signal(signum, _FOUND.get(signum, signal.SIG_DFL))
        signal.raise_signal(signum)
        return True

    def _handle(self, signum: int, frame: Any) -> None:
        if self._forked(signum):
            return
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signal.Signals(signum).name

    def _finished(self, signum: int, frame: Any) -> None:
        if self._forked(signum):
            return
        if self.after_finish is not None:  # the second one: as if we had never been there
            signal.signal(signum, _FOUND.get(signum, signal.SIG_DFL))
            signal.raise_signal(signum)
            return
        self.after_finish = signal.Signals(signum).name
        os.write(2, f"trainloop: {self.after_finish} after the run finished (its last checkpoint is saved): finishing "
                    "what is left, then exiting; send it again to stop at once\n".encode())  # fmt: skip

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        _watch_forks()
        self._pid = os.getpid()
        for s in _SIGNALS:
            found = signal.signal(s, self._handle)
            if not isinstance(getattr(found, "__self__", None), StopSignals):  # not left by an earlier fit's finish
                _FOUND[s] = found
        self._state = "installed"

    def finish(self) -> None:
        """The run is over: SIGINT gets its handler back; SIGTERM, where it had the default handler (which ends the
        process with status -15), is deferred until the process ends or :meth:`restore` (class docstring)."""
        if self._state != "installed":
            return
        self._state = "deferring"
        for s in _SIGNALS:
            found = _FOUND.get(s, signal.SIG_DFL)
            signal.signal(s, self._finished if s == signal.SIGTERM and found in (signal.SIG_DFL, None) else found)

    def restore(self) -> None:
        """Put back the handlers found before :meth:`install` (a run that failed, or ``Trainer.close()``)."""
        if self._state == "none" or threading.current_thread() is not threading.main_thread():
            return
        self._state = "none"
        for s in _SIGNALS:
            signal.signal(s, _FOUND.get(s, signal.SIG_DFL))


_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# The handlers the process had before any StopSignals installed its own.
_FOUND: dict[int, Any] = {}
# Forks while a StopSignals handler is installed: the signals are blocked across fork(), and the child gets the
# handlers found before, then its mask back. A Python handler alone would not do: a signal that reaches the child
# while it starts is dropped with Python's pending signals after the fork, and a pool worker that Pool.terminate
# signals just then would live on (and Pool.join wait for it forever).
_MASK_BEFORE_FORK: list[set[int]] = []
_FORKS_WATCHED = False


def _ours_installed() -> bool:
    return any(isinstance(getattr(signal.getsignal(s), "__self__", None), StopSignals) for s in _SIGNALS)


def _before_fork() -> None:
    if _ours_installed():
        _MASK_BEFORE_FORK.append(set(signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)))


def _after_fork_in_parent() -> None:
    if _MASK_BEFORE_FORK:
        signal.pthread_sigmask(signal.SIG_SETMASK, _MASK_BEFORE_FORK.pop())


def _after_fork_in_child() -> None:
    if _MASK_BEFORE_FORK:
        for s in _SIGNALS:
            if isinstance(getattr(signal.getsignal(s), "__self__", None), StopSignals):
                signal.signal(s, _FOUND.get(s, signal.SIG_DFL))
        signal.pthread_sigmask(signal.SIG_SETMASK, _MASK_BEFORE_FORK.pop())


def _watch_forks() -> None:
    global _FORKS_WATCHED
    if not _FORKS_WATCHED and hasattr(os, "register_at_fork"):
        os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                            after_in_child=_after_fork_in_child)  # fmt: skip
        _FORKS_WATCHED = True
