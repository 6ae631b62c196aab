"""Plain, materialised ALiBi attention: the yardstick every backend is tested against.

It builds the full (B, Hq, Tq, Tk) score matrix, so it is only meant for tests and small benchmarks.
"""

from __future__ import annotations

import torch

from alibi_kernels.validation import check_attention_inputs, check_varlen_inputs

__all__ = ["alibi_attention_reference", "alibi_attention_varlen_reference", "alibi_bias"]


def alibi_bias(
    slopes: torch.Tensor, q_len: int, k_len: int, *, causal: bool, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The additive score bias -slope * (pos_i - pos_j), -inf above the diagonal when causal.

    slopes: (S, H) with S = 1 or B. Returns (S, H, Tq, Tk) in `dtype`; queries sit at pos_i = i + Tk - Tq.
    Positions and the product are computed in float32 (float64 when `dtype` is float64) and rounded to `dtype`
    once: bf16 holds integers exactly only up to 256 and fp16 up to 2048, so positions built in those dtypes
    merge neighbouring positions and lose the bias's local slope.

    Example:
        >>> alibi_bias(torch.tensor([[0.5]]), 2, 3, causal=True, dtype=torch.float32, device="cpu")[0, 0]
        tensor([[-0.5000,  0.0000,    -inf],
                [-1.0000, -0.5000,  0.0000]])
    """
    build = torch.float64 if dtype == torch.float64 else torch.float32
    pos_i = torch.arange(k_len - q_len, k_len, device=device, dtype=build)  # (Tq,)
    pos_j = torch.arange(k_len, device=device, dtype=build)  # (Tk,)
    distance = pos_j[None, :] - pos_i[:, None]  # (Tq, Tk), <= 0 on and below the diagonal
    bias = slopes.to(device=device, dtype=build)[:, :, None, None] * distance  # (S, H, Tq, Tk)
    if causal:
        bias = bias.masked_fill(distance > 0, float("-inf"))
    return bias.to(dtype)


def alibi_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slopes: torch.Tensor | None = None,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """ALiBi attention computed the obvious way in `compute_dtype` (float64 by default); returns compute_dtype.

    With `compute_dtype=q.dtype` it is "PyTorch's own same-dtype math", the baseline of the FlashAttention
    tolerance rule. GQA repeats k/v per query head here (clarity over memory).

    Example:
        >>> q = k = v = torch.randn(1, 2, 4, 16)
        >>> alibi_attention_reference(q, k, v).shape
        torch.Size([1, 2, 4, 16])
    """
    shape, slopes_2d, scale = check_attention_inputs(q, k, v, slopes, causal, softmax_scale)
    q, k, v = (t.to(compute_dtype) for t in (q, k, v))
    k = k.repeat_interleave(shape.group, dim=1)  # (B, Hq, Tk, D)
    v = v.repeat_interleave(shape.group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # (B, Hq, Tq, Tk)
    bias = alibi_bias(slopes_2d, shape.q_len, shape.k_len, causal=causal, dtype=compute_dtype, device=q.device)
    probs = torch.softmax(scores + bias, dim=-1)
    return torch.matmul(probs, v)  # (B, Hq, Tq, D)


def alibi_attention_varlen_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    slopes: torch.Tensor | None = None,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Packed documents the obvious way: `alibi_attention_reference` on each document alone; returns compute_dtype.

    q: (total, Hq, D), k/v: (total, Hkv, D), document i = rows cu_seqlens[i]:cu_seqlens[i+1]. Output (total, Hq, D).

    Example:
        >>> q = k = v = torch.randn(7, 2, 16)
        >>> alibi_attention_varlen_reference(q, k, v, torch.tensor([0, 3, 7])).shape
        torch.Size([7, 2, 16])
    """
    shape, slopes_2d, scale = check_varlen_inputs(q, k, v, cu_seqlens, None, slopes, softmax_scale)
    out = torch.zeros(q.shape, dtype=compute_dtype, device=q.device)
    for start, stop in shape.documents():
        if stop > start:
            q_doc, k_doc, v_doc = (t[start:stop].transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # (1, H, T, D)
            out_doc = alibi_attention_reference(
                q_doc, k_doc, v_doc, slopes_2d[0], causal=causal, softmax_scale=scale, compute_dtype=compute_dtype
            )
            out[start:stop] = out_doc[0].transpose(0, 1)
    return out  # (total, Hq, D)
