"""ZeRO offload settings checked before DeepSpeed starts: where ``offload_param`` and ``offload_optimizer`` send the
parameters and the optimizer states (``cpu`` or ``nvme``), and whether this machine and the ZeRO stage can do it.

DeepSpeed 0.19.8 takes several contradictory settings without a word: ``offload_param`` under stage 1 or 2 is
ignored (only ZeRO-3 partitions the parameters), ``offload_optimizer`` to ``nvme`` under stage 1 or 2 keeps the
states in CPU memory, and an ``nvme_path`` that cannot be written or an async I/O op that cannot build fail only when
the engine starts, on every rank, deep in a traceback. :func:`offload_problems` names each in one line.

NVMe offload needs DeepSpeed's async I/O op (``AsyncIOBuilder``), JIT-built on first use from libaio's headers: on
Debian or Ubuntu ``apt-get install libaio-dev``. Built here (DeepSpeed 0.19.8, CPU accelerator) it took 6.7 minutes
on a loaded 2-core machine, once (cached under ``TORCH_EXTENSIONS_DIR``); without libaio it cannot build.
"""

from __future__ import annotations

import functools
import os
import tempfile
from pathlib import Path
from typing import Any

BLOCKS = ("offload_param", "offload_optimizer")
DEVICES = ("cpu", "nvme")


def offload_device(zero: dict[str, Any], block: str) -> str | None:
    """``"cpu"`` or ``"nvme"`` where ``zero_optimization[block]`` offloads, else None (no block, or device none).

    Example:
        >>> offload_device({"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/nvme"}}, "offload_param")
        'nvme'
    """
    settings = zero.get(block)
    device = settings.get("device") if isinstance(settings, dict) else None
    return device if device in DEVICES else None


def offload_problems(zero: dict[str, Any], stage: int) -> list[str]:
    """One line per offload setting of ``zero`` (a ``zero_optimization`` block) that cannot work at ZeRO ``stage``
    on this machine, each naming the field, the value and the fix; empty when all can.

    Example:
        >>> offload_problems({"offload_param": {"device": "cpu"}}, stage=2)  # doctest: +ELLIPSIS
        ["zero_optimization.offload_param.device='cpu' with stage 2: only ZeRO-3 partitions the parameters..."]
    """
    problems = []
    for block in BLOCKS:
        settings = zero.get(block)
        if settings is not None and not isinstance(settings, dict):
            problems.append(f'zero_optimization.{block}={settings!r} must be a JSON object such as {{"device": "cpu"}}')
            continue
        device = offload_device(zero, block)
        if device is None:
            continue
        field = f"zero_optimization.{block}"
        if block == "offload_param" and stage < 3:
            problems.append(
                f"{field}.device={device!r} with stage {stage}: only ZeRO-3 partitions the parameters, which this "
                f"moves (DeepSpeed would ignore it and keep the whole model on every GPU); set zero_optimization.stage "
                "to 3 or remove offload_param"
            )
        if block == "offload_optimizer" and device == "nvme" and stage < 3:
            problems.append(
                f"{field}.device='nvme' with stage {stage}: ZeRO-1/2 offload the optimizer to CPU memory only "
                "(DeepSpeed would keep it there without a word); use device 'cpu', or stage 3 for NVMe"
            )
        if device == "nvme" and isinstance(settings, dict):
            problems += _nvme_path_problems(field, settings.get("nvme_path"))
    if any(offload_device(zero, block) == "nvme" for block in BLOCKS):
        reason = aio_unavailable_reason()
        if reason is not None:
            which = " and ".join(f"zero_optimization.{b}" for b in BLOCKS if offload_device(zero, b) == "nvme")
            problems.append(
                f"{which}.device='nvme' needs DeepSpeed's async I/O op, which cannot build here ({reason}); "
                "install libaio (Debian/Ubuntu: apt-get install libaio-dev) or offload to device 'cpu'"
            )
    return problems


def _nvme_path_problems(field: str, path: Any) -> list[str]:
    where = f"{field}.nvme_path"
    if path is None or path == "":
        return [f"{where} is missing: device 'nvme' swaps to files in that directory; set it to one on a local NVMe "
                "drive"]  # fmt: skip
    if not isinstance(path, str):
        return [f"{where}={path!r} must be a directory path (a JSON string)"]
    folder = Path(path)
    if not folder.exists():
        return [f"{where}={path!r} does not exist: create it (mkdir -p {path}) on a local NVMe drive, or fix the path"]
    if not folder.is_dir():
        return [f"{where}={path!r} is not a directory: point it at a directory on a local NVMe drive"]
    try:  # what DeepSpeed will do: create files there (os.access says yes to root on a read-only filesystem)
        fd, probe = tempfile.mkstemp(prefix=".nvme-probe-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        return [f"{where}={path!r} is not writable (creating a file there failed: {exc.strerror or exc}): make it "
                "writable for the user that trains, or pick another directory"]  # fmt: skip
    return []


@functools.lru_cache(maxsize=1)
def aio_unavailable_reason() -> str | None:
    """Why DeepSpeed's async I/O op cannot build on this machine, or None when it can (or DeepSpeed is absent: the
    engine then names the extra to install). DeepSpeed's own check (``AsyncIOBuilder().is_compatible()``) compiles
    a test against libaio, about 2 s once."""
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder
    except ImportError:
        return None
    # Not under contextlib.redirect_stdout: its test compile duplicates the real stderr descriptor, and answers
    # False when sys.stderr has none.
    if AsyncIOBuilder().is_compatible(verbose=False):
        return None
    return "AsyncIOBuilder().is_compatible() is False: libaio's headers and library were not found"


def build_aio() -> str | None:
    """Build DeepSpeed's async I/O op now (JIT, minutes the first time; cached under ``TORCH_EXTENSIONS_DIR``) and
    return None, or return why it cannot build here (:func:`aio_unavailable_reason`). Call it once before launching
    ranks that offload to NVMe, so that they do not all build it at once."""
    reason = aio_unavailable_reason()
    if reason is None:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        AsyncIOBuilder().load(verbose=False)
    return reason
