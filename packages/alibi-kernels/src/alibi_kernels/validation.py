"""Input checks shared by every backend: one ValueError per problem, naming the argument and the shapes found."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from alibi_kernels.slopes import alibi_slopes

__all__ = [
    "AttentionShape",
    "VarlenShape",
    "check_attention_inputs",
    "check_document_starts",
    "check_varlen_inputs",
    "MIN_HEAD_DIM",
    "MAX_HEAD_DIM",
]

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


@dataclass(frozen=True)
class VarlenShape:
    """The sizes of one packed call, checked: q (total, Hq, D), k/v (total, Hkv, D), documents cu_seqlens[i]:[i+1]."""

    total: int
    q_heads: int
    kv_heads: int
    head_dim: int
    cu_seqlens: tuple[int, ...] | None  # host copy of the document boundaries; None when they were trusted
    max_seqlen: int  # the grid's sequence length: the given max_seqlen, or the longest document

    @property
    def group(self) -> int:
        """Query heads per key/value head."""
        return self.q_heads // self.kv_heads

    def documents(self) -> list[tuple[int, int]]:
        """(start, stop) token range of every document, empty ones included."""
        if self.cu_seqlens is None:
            raise ValueError("VarlenShape.documents(): the boundaries were trusted, not copied to the host")
        return list(zip(self.cu_seqlens[:-1], self.cu_seqlens[1:], strict=True))


@functools.lru_cache(maxsize=32)
def _default_slopes(n_heads: int, device: torch.device) -> torch.Tensor:
    # One (1, Hq) tensor per head count and device: no host-to-device copy per call. Never mutated by the backends.
    return alibi_slopes(n_heads).to(device).unsqueeze(0)


def _shape(t: torch.Tensor) -> str:
    return str(tuple(t.shape))


def _check_tensors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str, kv_layout: str) -> None:
    """Type, rank, floating point, k/v shapes equal, head counts and head dim; the layouts name the axes."""
    rank = len(layout.split(", "))
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != rank:
            raise ValueError(f"{name} must have rank {rank} ({layout}), got shape {_shape(t)}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape ({kv_layout}), got k {_shape(k)} and v {_shape(v)}")
    hq, d, hkv, dk = q.shape[1], q.shape[-1], k.shape[1], k.shape[-1]  # heads are axis 1 in both layouts
    if dk != d:
        raise ValueError(f"head dim mismatch: q {_shape(q)} has D={d}, k {_shape(k)} has D={dk}")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(
            f"q heads must be a multiple of k/v heads (GQA/MQA): q {_shape(q)} has Hq={hq}, k {_shape(k)} has Hkv={hkv}"
        )
    if not MIN_HEAD_DIM <= d <= MAX_HEAD_DIM:
        raise ValueError(f"head dim D={d} of q {_shape(q)} is outside {MIN_HEAD_DIM}..{MAX_HEAD_DIM}")


def _check_device_and_dtype(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k, v must be on one device, got q on {q.device}, k on {k.device}, v on {v.device}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")


def _slopes_2d(slopes: torch.Tensor | None, hq: int, batch: int | None, device: torch.device) -> torch.Tensor:
    """slopes as (1, Hq) or (B, Hq); `batch=None` allows only (Hq,) (packed documents share one slope row)."""
    if slopes is None:
        return _default_slopes(hq, device)  # (1, Hq)
    shapes = f"({hq},)" if batch is None else f"({hq},) or ({batch}, {hq})"
    if not isinstance(slopes, torch.Tensor):
        raise ValueError(f"slopes must be a torch.Tensor of shape {shapes}, got {type(slopes)}")
    if slopes.shape == (hq,):
        slopes_2d = slopes.unsqueeze(0)
    elif batch is not None and slopes.shape == (batch, hq):
        slopes_2d = slopes
    elif batch is None:
        raise ValueError(f"slopes must have shape (Hq,)=({hq},), got {_shape(slopes)}")
    else:
        raise ValueError(f"slopes must have shape (Hq,)=({hq},) or (B, Hq)=({batch}, {hq}), got {_shape(slopes)}")
    if slopes.device != device:
        raise ValueError(f"slopes must be on q's device {device}, got {slopes.device}")
    if slopes.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"slopes must be float32 or float64, got {slopes.dtype}")
    return slopes_2d


def _softmax_scale(softmax_scale: float | None, d: int) -> float:
    if softmax_scale is None:
        return d**-0.5
    scale = float(softmax_scale)
    if not scale > 0:
        raise ValueError(f"softmax_scale must be a positive number, got {softmax_scale!r}")
    return scale


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
    _check_tensors(q, k, v, "B, H, T, D", "B, Hkv, Tk, D")
    b, hq, tq, d = q.shape
    bk, hkv, tk, _ = k.shape
    if bk != b:
        raise ValueError(f"batch size mismatch: q {_shape(q)} has B={b}, k {_shape(k)} has B={bk}")
    if tq < 1 or tk < 1:
        raise ValueError(f"sequence lengths must be >= 1: q {_shape(q)} has Tq={tq}, k {_shape(k)} has Tk={tk}")
    if causal and tq > tk:
        raise ValueError(
            f"causal attention aligns queries to the end of the keys, so Tq must be <= Tk: "
            f"q {_shape(q)} has Tq={tq}, k {_shape(k)} has Tk={tk}"
        )
    _check_device_and_dtype(q, k, v)
    slopes_2d = _slopes_2d(slopes, hq, b, q.device)
    scale = _softmax_scale(softmax_scale, d)
    shape = AttentionShape(batch=b, q_heads=hq, kv_heads=hkv, q_len=tq, k_len=tk, head_dim=d)
    return shape, slopes_2d, scale


def check_document_starts(
    document_starts: torch.Tensor, shape: AttentionShape, slopes_2d: torch.Tensor, causal: bool, device: torch.device
) -> None:
    """Validate `alibi_attention`'s `document_starts`: (B, T) integers on q's device, causal self-attention, one slope
    row. Its values are not read (a host copy would stall the device and break a compiled graph)."""
    expected = (shape.batch, shape.q_len)
    if not isinstance(document_starts, torch.Tensor):
        raise ValueError(f"document_starts must be a (B, T)={expected} integer tensor, got {type(document_starts)}")
    if document_starts.shape != expected or document_starts.is_floating_point() or document_starts.is_complex():
        raise ValueError(
            f"document_starts must be a (B, T)={expected} integer tensor, got shape "
            f"{_shape(document_starts)} and dtype {document_starts.dtype}"
        )
    if document_starts.device != device:
        raise ValueError(f"document_starts must be on q's device {device}, got {document_starts.device}")
    if not causal or shape.q_len != shape.k_len:
        raise ValueError(
            "document_starts needs causal self-attention (causal=True, Tq == Tk), got "
            f"causal={causal}, Tq={shape.q_len}, Tk={shape.k_len}"
        )
    if slopes_2d.shape[0] != 1:
        raise ValueError(f"document_starts needs one slope row (Hq,), got slopes of shape {_shape(slopes_2d)}")


def check_varlen_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int | None,
    slopes: torch.Tensor | None,
    softmax_scale: float | None,
    read_offsets: bool = True,
) -> tuple[VarlenShape, torch.Tensor, float]:
    """Validate one packed call and return (shape, slopes as (1, Hq), scale).

    Reads cu_seqlens on the host once (one device-to-host copy on CUDA) to check it and to find the longest document.
    With `read_offsets=False` (a given max_seqlen on the Triton path) its values are trusted and not read: the
    shape's `cu_seqlens` is then None.
    """
    _check_tensors(q, k, v, "total_tokens, H, D", "total_tokens, Hkv, D")
    total, hq, d = q.shape
    if k.shape[0] != total:
        raise ValueError(f"total_tokens mismatch: q {_shape(q)} has {total} tokens, k {_shape(k)} has {k.shape[0]}")
    _check_device_and_dtype(q, k, v)
    if not isinstance(cu_seqlens, torch.Tensor):
        raise ValueError(f"cu_seqlens must be a 1-D int32 or int64 torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"cu_seqlens must be a 1-D int32 or int64 tensor, got shape {_shape(cu_seqlens)} dtype {cu_seqlens.dtype}"
        )
    if cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must hold at least 2 entries (one document), got shape {_shape(cu_seqlens)}")
    if cu_seqlens.device != q.device:
        raise ValueError(f"cu_seqlens must be on q's device {q.device}, got {cu_seqlens.device}")
    if max_seqlen is not None and (isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int)):
        raise ValueError(f"max_seqlen must be an int or None, got {type(max_seqlen).__name__}")
    slopes_2d = _slopes_2d(slopes, hq, None, q.device)
    scale = _softmax_scale(softmax_scale, d)
    if not read_offsets:
        if max_seqlen is None or max_seqlen < 0:
            raise ValueError(f"max_seqlen must be given and >= 0 when cu_seqlens is trusted, got {max_seqlen}")
        return VarlenShape(total, hq, k.shape[1], d, None, max_seqlen), slopes_2d, scale
    bounds = tuple(cu_seqlens.tolist())
    if bounds[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got cu_seqlens[0]={bounds[0]}")
    lengths = [stop - start for start, stop in zip(bounds[:-1], bounds[1:], strict=True)]
    for i, n in enumerate(lengths):
        if n < 0:
            raise ValueError(
                f"cu_seqlens must be non-decreasing, got "
                f"cu_seqlens[{i + 1}]={bounds[i + 1]} < cu_seqlens[{i}]={bounds[i]}"
            )
    if bounds[-1] != total:
        raise ValueError(f"cu_seqlens[-1] must equal total_tokens: got {bounds[-1]}, q {_shape(q)} has {total} tokens")
    longest = max(lengths)
    if max_seqlen is None:
        max_seqlen = longest
    elif max_seqlen < longest:
        raise ValueError(
            f"max_seqlen={max_seqlen} is smaller than the longest document "
            f"({longest} tokens, document {lengths.index(longest)} of cu_seqlens)"
        )
    shape = VarlenShape(total, hq, k.shape[1], d, bounds, max_seqlen)
    return shape, slopes_2d, scale
