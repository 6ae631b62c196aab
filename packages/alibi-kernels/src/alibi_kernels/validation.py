"""Input checks shared by every backend: one ValueError per problem, naming the argument and the shapes found."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from alibi_kernels.slopes import alibi_slopes

__all__ = ["AttentionShape", "check_attention_inputs", "MIN_HEAD_DIM", "MAX_HEAD_DIM"]

MIN_HEAD_DIM = 16
MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class AttentionShape:
    """The sizes of one call, checked: q (B, Hq, Tq, D), k/v (B, Hkv, Tk, D)."""

    batch: int
    q_heads: int
    kv_heads: int
    q_len: int
    k_len: int
    head_dim: int

    @property
    def group(self) -> int:
        """Query heads per key/value head (1 for plain multi-head attention)."""
        return self.q_heads // self.kv_heads

    @property
    def offset(self) -> int:
        """pos_i = i + offset: queries are aligned to the end of the keys."""
        return self.k_len - self.q_len


@functools.lru_cache(maxsize=32)
def _default_slopes(n_heads: int, device: torch.device) -> torch.Tensor:
    # One (1, Hq) tensor per head count and device: no host-to-device copy per call. Never mutated by the backends.
    return alibi_slopes(n_heads).to(device).unsqueeze(0)


def _shape(t: torch.Tensor) -> str:
    return str(tuple(t.shape))


def check_attention_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slopes: torch.Tensor | None,
    causal: bool,
    softmax_scale: float | None,
) -> tuple[AttentionShape, torch.Tensor, float]:
    """Validate one call and return (shape, slopes as (B, Hq) or (1, Hq), scale).

    Raises ValueError naming the argument and the shapes found. `slopes=None` becomes alibi_slopes(Hq) on q's
    device; given slopes keep their dtype (float32 or float64) so a gradient can flow back to them.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have rank 4 (B, H, T, D), got shape {_shape(t)}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape (B, Hkv, Tk, D), got k {_shape(k)} and v {_shape(v)}")
    b, hq, tq, d = q.shape
    bk, hkv, tk, dk = k.shape
    if bk != b:
        raise ValueError(f"batch size mismatch: q {_shape(q)} has B={b}, k {_shape(k)} has B={bk}")
    if dk != d:
        raise ValueError(f"head dim mismatch: q {_shape(q)} has D={d}, k {_shape(k)} has D={dk}")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(
            f"q heads must be a multiple of k/v heads (GQA/MQA): q {_shape(q)} has Hq={hq}, k {_shape(k)} has Hkv={hkv}"
        )
    if not MIN_HEAD_DIM <= d <= MAX_HEAD_DIM:
        raise ValueError(f"head dim D={d} of q {_shape(q)} is outside {MIN_HEAD_DIM}..{MAX_HEAD_DIM}")
    if tq < 1 or tk < 1:
        raise ValueError(f"sequence lengths must be >= 1: q {_shape(q)} has Tq={tq}, k {_shape(k)} has Tk={tk}")
    if causal and tq > tk:
        raise ValueError(
            f"causal attention aligns queries to the end of the keys, so Tq must be <= Tk: "
            f"q {_shape(q)} has Tq={tq}, k {_shape(k)} has Tk={tk}"
        )
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k, v must be on one device, got q on {q.device}, k on {k.device}, v on {v.device}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")

    if slopes is None:
        slopes_2d = _default_slopes(hq, q.device)  # (1, Hq)
    else:
        if not isinstance(slopes, torch.Tensor):
            raise ValueError(f"slopes must be a torch.Tensor of shape ({hq},) or ({b}, {hq}), got {type(slopes)}")
        if slopes.shape == (hq,):
            slopes_2d = slopes.unsqueeze(0)
        elif slopes.shape == (b, hq):
            slopes_2d = slopes
        else:
            raise ValueError(f"slopes must have shape (Hq,)=({hq},) or (B, Hq)=({b}, {hq}), got {_shape(slopes)}")
        if slopes.device != q.device:
            raise ValueError(f"slopes must be on q's device {q.device}, got {slopes.device}")
        if slopes.dtype not in (torch.float32, torch.float64):
            raise ValueError(f"slopes must be float32 or float64, got {slopes.dtype}")

    if softmax_scale is None:
        scale = d**-0.5
    else:
        scale = float(softmax_scale)
        if not scale > 0:
            raise ValueError(f"softmax_scale must be a positive number, got {softmax_scale!r}")
    shape = AttentionShape(batch=b, q_heads=hq, kv_heads=hkv, q_len=tq, k_len=tk, head_dim=d)
    return shape, slopes_2d, scale
