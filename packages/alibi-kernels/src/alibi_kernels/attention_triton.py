"""The Triton backend: launches the forward and backward kernels inside one autograd Function.

On CUDA every kernel is autotuned per head-dim class (<= 64, <= 128, 256); the tuning key is a coarse sequence
length bucket (<= 512, <= 2048, longer), the head dim, causality, packed or not, and the dtypes.
ALIBI_KERNELS_AUTOTUNE=0 skips tuning and launches each class's first config. Under TRITON_INTERPRET=1 (CPU
tensors, tests) a single small tile is used, so the interpreter stays fast and the multi-block, diagonal and tail
paths are all exercised at small T.

Packed documents (`cu_seqlens`) run through the same kernels and the same autograd Function with VARLEN set: the
"batch" program index is the document, the grid's sequence axis covers max_seqlen, and a packed (total, H, D) tensor
is passed with a batch stride of 0 (the kernels add cu_seqlens[doc] times the token stride).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton

from alibi_kernels.triton_backward import alibi_bwd_dkdv_kernel, alibi_bwd_dq_kernel, backward_configs
from alibi_kernels.triton_forward import LOG2E, alibi_fwd_kernel, forward_configs
from alibi_kernels.validation import check_attention_inputs

__all__ = ["alibi_attention_triton", "triton_attention_checked", "triton_varlen_checked", "INTERPRETED"]

# triton.jit decides at import time whether kernels are interpreted; record that decision.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
_INTERPRETER_BLOCK = 32
_TUNE_KEY = ["T_BUCKET", "HEAD_DIM", "IS_CAUSAL", "VARLEN"]
_tuned: dict[tuple[str, int], object] = {}


def _autotune_enabled() -> bool:
    # ALIBI_KERNELS_AUTOTUNE=0 launches each head dim's first config without benchmarking: a test grid over many
    # shapes then compiles one config per shape instead of every candidate.
    return os.environ.get("ALIBI_KERNELS_AUTOTUNE", "1") != "0"


def _configs(name: str, block_d: int) -> list[triton.Config]:
    return forward_configs(block_d) if name == "fwd" else backward_configs(block_d)


def _kernel(name: str, block_d: int):
    """The kernel to launch: plain under the interpreter or without autotuning, else an autotuner."""
    raw = {"fwd": alibi_fwd_kernel, "dkdv": alibi_bwd_dkdv_kernel, "dq": alibi_bwd_dq_kernel}[name]
    if INTERPRETED or not _autotune_enabled():
        return raw
    cls = 64 if block_d <= 64 else (128 if block_d <= 128 else 256)
    if (name, cls) not in _tuned:
        _tuned[(name, cls)] = triton.autotune(configs=_configs(name, cls), key=_TUNE_KEY)(raw)
    return _tuned[(name, cls)]


def _launch_options(name: str, block_d: int, dtype: torch.dtype) -> dict:
    """Tile sizes passed explicitly when the kernel is not autotuned (the autotuner skips configs that do not fit)."""
    if INTERPRETED:
        return {"BLOCK_M": _INTERPRETER_BLOCK, "BLOCK_N": _INTERPRETER_BLOCK}
    if _autotune_enabled():
        return {}
    first = _configs(name, block_d)[0]
    options = {**first.kwargs, "num_warps": first.num_warps, "num_stages": first.num_stages}
    if dtype == torch.float32:
        # fp32 tiles take twice the shared memory of the 16-bit tiles the configs are sized for.
        options.update(BLOCK_N=min(options["BLOCK_N"], 32), num_stages=min(options["num_stages"], 2))
    return options


def _dot_options(dtype: torch.dtype) -> dict:
    return {
        # The interpreter's bf16 tl.dot is wrong (triton issue 11584): compute those dots in fp32 there.
        "UPCAST": INTERPRETED and dtype == torch.bfloat16,
        "DOT_PRECISION": "ieee" if dtype in (torch.float32, torch.float64) else "tf32",
    }


def _t_bucket(tq: int, tk: int) -> int:
    # Coarse autotuning buckets (short, medium, long): one tuning per bucket, not per power of two.
    t = max(tq, tk)
    return 512 if t <= 512 else (2048 if t <= 2048 else 8192)


@dataclass(frozen=True)
class _Layout:
    """How the kernels see one call: a (B, H, T, D) batch, or packed (total, H, D) documents (VARLEN)."""

    n_seq: int  # batch size, or number of documents
    q_len: int  # the kernels' Tq argument: Tq, or the total packed tokens (the row stride of Lse)
    k_len: int  # the kernels' Tk argument: Tk, or the total packed tokens (unused by the kernels)
    grid_q: int  # query rows the grid covers: Tq, or max_seqlen
    grid_k: int  # key rows the grid covers: Tk, or max_seqlen
    varlen: bool

    @staticmethod
    def of(q: torch.Tensor, k: torch.Tensor, cu_seqlens: torch.Tensor | None, max_seqlen: int | None) -> _Layout:
        if cu_seqlens is None:  # (B, H, T, D)
            return _Layout(q.shape[0], q.shape[2], k.shape[2], q.shape[2], k.shape[2], False)
        total = q.shape[0]  # (total, H, D)
        return _Layout(cu_seqlens.numel() - 1, total, total, max_seqlen, max_seqlen, True)

    def strides(self, t: torch.Tensor) -> tuple[int, int, int, int]:
        """(batch, head, token, dim) strides; packed tensors have no batch axis: the kernels add cu_seqlens[doc]."""
        if self.varlen:
            return (0, t.stride(1), t.stride(0), t.stride(2))
        return tuple(t.stride())  # type: ignore[return-value]

    def lse_shape(self, heads: int) -> tuple[int, int]:
        return (heads, self.q_len) if self.varlen else (self.n_seq * heads, self.q_len)


class _AlibiAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, slopes_2d, causal: bool, scale: float, cu_seqlens=None, max_seqlen=None):
        layout = _Layout.of(q, k, cu_seqlens, max_seqlen)
        if cu_seqlens is None:
            cu_seqlens = torch.empty(1, device=q.device, dtype=torch.int32)  # never read without VARLEN
        hq, hkv, d = q.shape[1], k.shape[1], q.shape[-1]
        slopes32 = slopes_2d.detach().to(torch.float32).contiguous()  # (1 or B, Hq)
        stride_sb = 0 if slopes32.shape[0] == 1 else slopes32.stride(0)
        out = torch.empty_like(q, memory_format=torch.contiguous_format)  # (B, Hq, Tq, D) or (total, Hq, D)
        lse = torch.empty(layout.lse_shape(hq), device=q.device, dtype=torch.float32)
        block_d = triton.next_power_of_2(d)
        common = {
            "HEAD_DIM": d,
            "BLOCK_D": block_d,
            "IS_CAUSAL": causal,
            "VARLEN": layout.varlen,
            **_dot_options(q.dtype),
        }
        t_bucket = _t_bucket(layout.grid_q, layout.grid_k)

        def grid(meta):
            return (triton.cdiv(layout.grid_q, meta["BLOCK_M"]), layout.n_seq * hq)

        if layout.grid_q > 0:  # packed inputs of only empty documents launch nothing
            st = layout.strides
            _kernel("fwd", block_d)[grid](
                q, k, v, slopes32, out, lse, cu_seqlens,
                *st(q), *st(k), *st(v), *st(out), stride_sb, slopes32.stride(1),
                hq, hq // hkv, layout.q_len, layout.k_len, scale * LOG2E, t_bucket,
                **common, **_launch_options("fwd", block_d, q.dtype),
            )  # fmt: skip
        ctx.save_for_backward(q, k, v, out, lse, slopes32, cu_seqlens)
        ctx.causal, ctx.scale, ctx.slopes_shape, ctx.layout = causal, scale, slopes_2d.shape, layout
        ctx.slopes_dtype = slopes_2d.dtype
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse, slopes32, cu_seqlens = ctx.saved_tensors
        layout: _Layout = ctx.layout
        hq, hkv, d = q.shape[1], k.shape[1], q.shape[-1]
        block_d = triton.next_power_of_2(d)
        stride_sb = 0 if slopes32.shape[0] == 1 else slopes32.stride(0)
        delta = (out.float() * do.float()).sum(-1)  # (B, Hq, Tq) or (total, Hq)
        delta = delta.t().contiguous() if layout.varlen else delta.reshape(lse.shape)  # lse's layout
        dq = torch.empty(q.shape, device=q.device, dtype=q.dtype)  # contiguous, as the kernels write it
        dk = torch.empty(k.shape, device=q.device, dtype=k.dtype)
        dv = torch.empty(v.shape, device=q.device, dtype=v.dtype)
        slope_grad = ctx.needs_input_grad[3]
        common = {
            "HEAD_DIM": d,
            "BLOCK_D": block_d,
            "IS_CAUSAL": ctx.causal,
            "VARLEN": layout.varlen,
            **_dot_options(q.dtype),
        }
        st = layout.strides
        strides = (*st(q), *st(k), *st(v), *st(do), stride_sb, slopes32.stride(1))
        scales = (ctx.scale, ctx.scale * LOG2E, _t_bucket(layout.grid_q, layout.grid_k))
        sizes = (layout.q_len, layout.k_len)

        def grid_kv(meta):
            return (triton.cdiv(layout.grid_k, meta["BLOCK_N"]), layout.n_seq * hkv)

        # Partial slope gradients, one per (sequence*head, query block); sized for the smallest candidate BLOCK_M.
        min_block_m = _INTERPRETER_BLOCK if INTERPRETED else 32
        dslope_parts = torch.zeros(
            (layout.n_seq * hq, triton.cdiv(layout.grid_q, min_block_m)), device=q.device, dtype=torch.float32
        )

        def grid_q(meta):
            return (triton.cdiv(layout.grid_q, meta["BLOCK_M"]), layout.n_seq * hq)

        if layout.grid_q > 0:
            _kernel("dkdv", block_d)[grid_kv](
                q, k, v, slopes32, do, lse, delta, dk, dv, cu_seqlens, *strides, hq, hkv, hq // hkv, *sizes,
                *scales, **common, **_launch_options("dkdv", block_d, q.dtype),
            )  # fmt: skip
            _kernel("dq", block_d)[grid_q](
                q, k, v, slopes32, do, lse, delta, dq, dslope_parts, cu_seqlens, dslope_parts.stride(0),
                *strides, hq, hq // hkv, *sizes, *scales,
                SLOPE_GRAD=slope_grad, **common, **_launch_options("dq", block_d, q.dtype),
            )  # fmt: skip

        dslopes = None
        if slope_grad:
            dslopes = dslope_parts.sum(-1).reshape(layout.n_seq, hq)
            if ctx.slopes_shape[0] == 1:
                dslopes = dslopes.sum(0, keepdim=True)
            dslopes = dslopes.to(ctx.slopes_dtype)
        return dq, dk, dv, dslopes, None, None, None, None


def alibi_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slopes: torch.Tensor | None = None,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """ALiBi attention with the fused Triton kernels (CUDA, or CPU under TRITON_INTERPRET=1).

    Same contract as `alibi_attention(..., backend="triton")`; gradients reach q, k, v and slopes that require
    grad (summed over the batch when one (Hq,) slope row is shared).

    Example (CUDA tensors; CPU tensors run when TRITON_INTERPRET=1 was set before the first import, as in the tests):
        >>> import torch
        >>> from alibi_kernels import alibi_attention_reference, triton_unavailable_reason
        >>> device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        >>> triton_unavailable_reason(device) is None
        True
        >>> q, k, v = torch.randn(3, 1, 4, 64, 32, device=device)  # (B, H, T, D) each
        >>> out = alibi_attention_triton(q, k, v)
        >>> out.shape, torch.allclose(out.double(), alibi_attention_reference(q, k, v), rtol=1e-5, atol=1e-5)
        (torch.Size([1, 4, 64, 32]), True)
    """
    shape, slopes_2d, scale = check_attention_inputs(q, k, v, slopes, causal, softmax_scale)
    return triton_attention_checked(q, k, v, slopes_2d, scale, causal)


def triton_attention_checked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slopes_2d: torch.Tensor, scale: float, causal: bool
) -> torch.Tensor:
    """The Triton path on inputs `check_attention_inputs` already validated (the dispatcher checks once)."""
    _check_runnable(q)
    return _AlibiAttention.apply(q, k, v, slopes_2d, causal, scale)


def triton_varlen_checked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    slopes_2d: torch.Tensor,
    scale: float,
    causal: bool,
) -> torch.Tensor:
    """Packed documents on the Triton path, inputs already checked by `check_varlen_inputs`: (total, Hq, D)."""
    _check_runnable(q)
    return _AlibiAttention.apply(q, k, v, slopes_2d, causal, scale, cu_seqlens.contiguous(), max_seqlen)


def _check_runnable(q: torch.Tensor) -> None:
    if q.device.type == "cpu" and not INTERPRETED:
        raise RuntimeError(
            "the Triton kernels were imported in compiled mode; CPU tensors need TRITON_INTERPRET=1 set before "
            "alibi_kernels.attention_triton is first imported"
        )
    if q.dtype == torch.float64:
        raise ValueError("backend='triton' supports float16, bfloat16 and float32 inputs, got torch.float64")
