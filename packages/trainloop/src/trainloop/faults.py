"""Fault types and the recognition of failed collectives (a dead or hung peer rank)."""

from __future__ import annotations

import signal
import threading
from typing import Any

import torch.distributed as dist


class NonFiniteLossError(RuntimeError):
    """Raised after ``max_consecutive_skips`` steps in a row had a non-finite loss or gradient norm."""


class CollectiveError(RuntimeError):
    """A collective operation failed: another rank most likely died or hung. Resuming from the latest checkpoint
    (torchrun ``--max-restarts``) continues the run."""


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
