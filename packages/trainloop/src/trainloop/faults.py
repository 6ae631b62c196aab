"""Fault types and the recognition of failed collectives (a dead or hung peer rank)."""

from __future__ import annotations

import torch.distributed as dist


class NonFiniteLossError(RuntimeError):
    """Raised after ``max_consecutive_skips`` steps in a row had a non-finite loss or gradient norm."""


def collective_failure(exc: BaseException) -> bool:
    """True for errors raised by a collective whose peer died or timed out (gloo, nccl, torch DistError)."""
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(
        k in text for k in ("gloo", "connection closed", "connection reset", "timed out", "timeout", "nccl")
    )
