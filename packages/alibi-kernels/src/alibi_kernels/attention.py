"""`alibi_attention`: the public entry point, which checks inputs and picks a backend."""

from __future__ import annotations

import importlib.util
import os

import torch

from alibi_kernels.attention_torch import torch_attention_checked
from alibi_kernels.validation import check_attention_inputs

__all__ = ["alibi_attention", "BACKENDS", "triton_unavailable_reason"]

BACKENDS = ("auto", "triton", "torch")


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_unavailable_reason(device: torch.device) -> str | None:
    """Why the Triton backend cannot run on `device`, or None if it can.

    Example:
        >>> triton_unavailable_reason(torch.device("cpu")) is None or True
        True
    """
    if importlib.util.find_spec("triton") is None:
        return "the `triton` package is not installed (pip install triton; Linux only)"
    if device.type == "cuda":
        return None
    if device.type == "cpu":
        if _interpreting():
            return None
        return (
            "Triton kernels need CUDA tensors; CPU tensors run only under the Triton interpreter "
            "(set TRITON_INTERPRET=1 before importing triton, slow, for tests) or use backend='torch'"
        )
    return f"Triton kernels need CUDA tensors, got a tensor on {device}; use backend='torch'"


def alibi_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slopes: torch.Tensor | None = None,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Attention with ALiBi positions: softmax(q k^T * scale - slope_h * (pos_i - pos_j)) v.

    q: (B, Hq, Tq, D); k, v: (B, Hkv, Tk, D) with Hq % Hkv == 0 (GQA/MQA without copying k/v) and 16 <= D <= 256.
    Queries are aligned to the end of the keys (pos_i = i + Tk - Tq), so KV-cache decoding with Tq = 1 works;
    when causal, keys with pos_j > pos_i are masked (and Tq <= Tk is required). `slopes` is None
    (alibi_slopes(Hq)), (Hq,) or (B, Hq), float32/float64; gradients flow to q, k, v and to slopes that require
    grad. `softmax_scale` defaults to D**-0.5. `backend`: "triton" (CUDA, or CPU under TRITON_INTERPRET=1),
    "torch" (SDPA with a cached additive bias), "auto" (Triton on CUDA, else torch). Output: (B, Hq, Tq, D),
    q's dtype.

    Example:
        >>> q = torch.randn(1, 4, 10, 32); k = v = torch.randn(1, 1, 10, 32)
        >>> alibi_attention(q, k, v).shape
        torch.Size([1, 4, 10, 32])
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    shape, slopes_2d, scale = check_attention_inputs(q, k, v, slopes, causal, softmax_scale)
    if backend == "auto":
        use_triton = q.device.type == "cuda" and triton_unavailable_reason(q.device) is None
        backend = "triton" if use_triton else "torch"
    if backend == "torch":
        return torch_attention_checked(q, k, v, shape, slopes_2d, scale, causal)
    reason = triton_unavailable_reason(q.device)
    if reason is not None:
        raise RuntimeError(f"backend='triton' cannot run here: {reason}")
    from alibi_kernels.attention_triton import triton_attention_checked

    return triton_attention_checked(q, k, v, slopes_2d, scale, causal)
