"""The device and dtype of `--device` and `--dtype`, shared by eval, generate and the harness."""

from __future__ import annotations

import torch

from lmtrain.errors import LmtrainError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_device(name: str | None) -> torch.device:
    """The device of `--device NAME`: None is cuda when torch sees a GPU, else cpu; a GPU that is not there is a
    one-line LmtrainError.

    Example:
        >>> resolve_device("cpu")
        device(type='cpu')
    """
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise LmtrainError(f"--device {name!r}: expected cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise LmtrainError(f"--device {name}: no CUDA device is visible to torch on this machine; use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise LmtrainError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif device.type != "cpu":
        raise LmtrainError(f"--device {name!r}: expected cpu, cuda or cuda:N")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The torch dtype of `--dtype NAME` (fp32, bf16, fp16) on `device`; fp16 on the CPU is refused in one line
    (CPU half-precision matmuls are slow and the torch attention path computes in fp32 there anyway).

    Example:
        >>> resolve_dtype("bf16", torch.device("cpu"))
        torch.bfloat16
    """
    if name not in DTYPES:
        raise LmtrainError(f"--dtype {name!r}: expected one of {', '.join(DTYPES)}")
    if name == "fp16" and device.type == "cpu":
        raise LmtrainError("--dtype fp16 needs a GPU: on the CPU use --dtype bf16 or fp32")
    return DTYPES[name]
