"""The Triton backend: launches the forward and backward kernels, as custom operators that torch.compile keeps whole.

On CUDA each kernel is autotuned per dtype and head-dim class (<= 64, <= 128, 256) over the candidates of
`launch_configs.py`, pruned first to those whose shared memory fits the device (Triton's `prune_configs_by`); the
tuning key is a coarse sequence length bucket (<= 512, <= 2048, longer), the head dim, causality, packed or not,
the slope gradient (dQ) and the dtypes. ALIBI_KERNELS_AUTOTUNE=0 skips tuning and launches the best candidate that
fits. A device that no candidate fits gets one `LaunchConfigError` naming the device, the kernel, the dtype, the head
dim and the fix, never Triton's "out of resources". Under TRITON_INTERPRET=1 (CPU tensors, tests) a single small
tile is used, so the interpreter stays fast and the multi-block, diagonal and tail paths are all exercised at small T.

Packed documents (`cu_seqlens`) run through the same kernels with VARLEN set: the
"batch" program index is the document, the grid's sequence axis covers max_seqlen, and a packed (total, H, D) tensor
is passed with a batch stride of 0 (the kernels add cu_seqlens[doc] times the token stride).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import triton
from triton.runtime.errors import OutOfResources

from alibi_kernels.launch_configs import (
    LaunchConfigError,
    TileConfig,
    candidate_configs,
    has_measured_tiles,
    launch_configs,
)
from alibi_kernels.triton_backward import alibi_bwd_dkdv_kernel, alibi_bwd_dq_kernel
from alibi_kernels.triton_forward import LOG2E, alibi_fwd_kernel
from alibi_kernels.validation import check_attention_inputs

__all__ = [
    "INTERPRETED",
    "KernelLaunch",
    "alibi_attention_triton",
    "captured_launches",
    "pinned_configs",
    "triton_attention_checked",
    "triton_documents_checked",
    "triton_varlen_checked",
]

# triton.jit decides at import time whether kernels are interpreted; record that decision.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
_INTERPRETER_TILE = TileConfig(32, 32, 4, 1)
RAW_KERNELS = {"fwd": alibi_fwd_kernel, "dkdv": alibi_bwd_dkdv_kernel, "dq": alibi_bwd_dq_kernel}
# The autotuning key: the dtypes of the tensor arguments are added by Triton itself.
_TUNE_KEY = {
    "fwd": ["T_BUCKET", "HEAD_DIM", "IS_CAUSAL", "VARLEN"],
    "dkdv": ["T_BUCKET", "HEAD_DIM", "IS_CAUSAL", "VARLEN"],
    "dq": ["T_BUCKET", "HEAD_DIM", "IS_CAUSAL", "VARLEN", "SLOPE_GRAD"],
}
_tuned: dict[tuple[str, torch.dtype, int], Any] = {}
_picked: dict[tuple, TileConfig] = {}  # no-autotune path: (kernel, device, dtype, constants) -> the config that ran


@dataclass(frozen=True)
class KernelLaunch:
    """One kernel launch as this package makes it: the positional arguments and the compile-time constants."""

    kernel: str  # "fwd", "dkdv" or "dq"
    args: tuple  # positional kernel arguments, in the kernel's order
    constants: dict  # HEAD_DIM, BLOCK_D, IS_CAUSAL, VARLEN, UPCAST, DOT_PRECISION (and SLOPE_GRAD for dq)
    dtype: torch.dtype  # dtype of q, k, v


_captured: contextvars.ContextVar[list[KernelLaunch] | None] = contextvars.ContextVar(
    "alibi_kernels_captured_launches", default=None
)


@contextlib.contextmanager
def captured_launches() -> Iterator[list[KernelLaunch]]:
    """Record the kernel launches made inside the block instead of running them (for compile checks without a GPU).

    The outputs of a captured call are uninitialised; only the recorded launches mean anything.
    """
    launches: list[KernelLaunch] = []
    token = _captured.set(launches)
    try:
        yield launches
    finally:
        _captured.reset(token)


_pinned: contextvars.ContextVar[dict[str, TileConfig] | None] = contextvars.ContextVar(
    "alibi_kernels_pinned_configs", default=None
)


@contextlib.contextmanager
def pinned_configs(**configs: TileConfig) -> Iterator[None]:
    """Launch the named kernels ("fwd", "dkdv", "dq") with the given tiles inside the block: no autotuning, no fit
    check. The tests and the GPU check run every launchable config this way; under the interpreter only the tile
    sizes matter (warps and stages are a compiler's).

    Example:
        >>> from alibi_kernels.launch_configs import TileConfig
        >>> with pinned_configs(fwd=TileConfig(16, 32, 4, 1)):
        ...     pass  # alibi_attention(..., backend="triton") here runs the forward with 16 x 32 tiles
    """
    unknown = sorted(set(configs) - set(RAW_KERNELS))
    if unknown:
        raise ValueError(f"pinned_configs takes the kernels {tuple(RAW_KERNELS)}, got {unknown}")
    token = _pinned.set({**(_pinned.get() or {}), **configs})
    try:
        yield
    finally:
        _pinned.reset(token)


def _autotune_enabled() -> bool:
    # ALIBI_KERNELS_AUTOTUNE=0 launches the best config that fits without benchmarking: a test grid over many
    # shapes then compiles one config per shape instead of every candidate.
    return os.environ.get("ALIBI_KERNELS_AUTOTUNE", "1") != "0"


def _device_limits(device: torch.device) -> tuple[tuple[int, int], int, str]:
    """(compute capability, opt-in shared memory per block, name) of a CUDA device: the limit Triton's launcher
    checks a compiled kernel against."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    smem = getattr(props, "shared_memory_per_block_optin", None)
    if smem is None:
        smem = triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"]
    return (props.major, props.minor), int(smem), props.name


def _device_configs(kernel: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> list[TileConfig]:
    """The candidates that fit `device`; a clear error when none does. Capabilities without measured tiles (newer
    GPUs) try every candidate and rely on the launch-time check."""
    capability, smem, name = _device_limits(device)
    if not has_measured_tiles(capability):
        return list(candidate_configs(kernel, dtype, head_dim))
    fitting = launch_configs(kernel, capability=capability, smem_per_block=smem, dtype=dtype, head_dim=head_dim)
    if not fitting:
        raise LaunchConfigError(_no_fit_message(kernel, name, capability, smem, dtype, head_dim))
    return fitting


def _no_fit_message(kernel, name, capability, smem, dtype, head_dim) -> str:
    return (
        f"alibi-kernels: no {kernel} tile fits {name} (sm_{capability[0]}{capability[1]}, {smem} bytes of shared "
        f"memory per block) for {dtype} at head dim {head_dim}; use bfloat16/float16 inputs or backend='torch'"
    )


def _prune(kernel: str, dtype: torch.dtype, head_dim: int) -> Callable:
    """Triton's early_config_prune: drop the configs that cannot launch on the current device before tuning."""

    def prune(configs, named_args, **kwargs):
        device = named_args["Q"].device
        fitting = set(_device_configs(kernel, device, dtype, head_dim))
        kept = [c for c in configs if _tile_of(c) in fitting]
        return kept

    return prune


def _tile_of(config: triton.Config) -> TileConfig:
    return TileConfig(config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_warps, config.num_stages)


def _autotuner(kernel: str, dtype: torch.dtype, head_dim: int):
    """One autotuner per kernel, dtype and head-dim class, pruned by what fits the device."""
    d_class = 64 if head_dim <= 64 else (128 if head_dim <= 128 else 256)
    key = (kernel, dtype, d_class)
    if key not in _tuned:
        configs = [
            triton.Config({"BLOCK_M": c.block_m, "BLOCK_N": c.block_n}, num_warps=c.num_warps, num_stages=c.num_stages)
            for c in candidate_configs(kernel, dtype, head_dim)
        ]
        prune = {"early_config_prune": _prune(kernel, dtype, head_dim)}
        _tuned[key] = triton.autotune(configs=configs, key=_TUNE_KEY[kernel], prune_configs_by=prune)(
            RAW_KERNELS[kernel]
        )
    return _tuned[key]


def _launch(kernel: str, grid: Callable, args: tuple, constants: dict, dtype: torch.dtype) -> None:
    """Launch `kernel` with the best config that fits the device (autotuned unless ALIBI_KERNELS_AUTOTUNE=0)."""
    captured = _captured.get()
    if captured is not None:
        captured.append(KernelLaunch(kernel, args, dict(constants), dtype))
        return
    pinned = (_pinned.get() or {}).get(kernel)
    if pinned is not None or INTERPRETED:  # one small tile: the interpreter stays fast, every multi-block path runs
        RAW_KERNELS[kernel][grid](*args, **constants, **(pinned or _INTERPRETER_TILE).launch_kwargs())
        return
    device, head_dim = args[0].device, constants["HEAD_DIM"]
    if _autotune_enabled():
        try:
            _autotuner(kernel, dtype, head_dim)[grid](*args, **constants)
        except OutOfResources as exc:  # the measured table does not hold for this Triton version
            capability, smem, name = _device_limits(device)
            raise LaunchConfigError(_no_fit_message(kernel, name, capability, smem, dtype, head_dim)) from exc
        return
    key = (kernel, device, dtype, tuple(sorted(constants.items())))
    configs = [_picked[key]] if key in _picked else _device_configs(kernel, device, dtype, head_dim)
    for config in configs:
        try:
            RAW_KERNELS[kernel][grid](*args, **constants, **config.launch_kwargs())
        except OutOfResources:
            continue
        _picked[key] = config
        return
    capability, smem, name = _device_limits(device)
    raise LaunchConfigError(_no_fit_message(kernel, name, capability, smem, dtype, head_dim))


def min_block_m(kernel: str, dtype: torch.dtype, head_dim: int) -> int:
    """The smallest query tile `kernel` may launch with: sizes the per-query-block slope-gradient buffer."""
    pinned = (_pinned.get() or {}).get(kernel)
    if pinned is not None:
        return pinned.block_m
    if INTERPRETED:
        return _INTERPRETER_TILE.block_m
    return min(c.block_m for c in candidate_configs(kernel, dtype, head_dim))


def _dot_options(dtype: torch.dtype) -> dict:
    return {
        # Under Triton 3.9's interpreter a bf16 tl.dot returns wrong values: compute those dots in fp32 there.
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
        if max_seqlen is None:
            raise ValueError("a packed call needs max_seqlen (check_varlen_inputs gives it)")
        return _Layout(cu_seqlens.numel() - 1, total, total, max_seqlen, max_seqlen, True)

    def strides(self, t: torch.Tensor) -> tuple[int, int, int, int]:
        """(batch, head, token, dim) strides; packed tensors have no batch axis: the kernels add cu_seqlens[doc]."""
        if self.varlen:
            return (0, t.stride(1), t.stride(0), t.stride(2))
        return tuple(t.stride())  # type: ignore[return-value]

    def lse_shape(self, heads: int) -> tuple[int, int]:
        return (heads, self.q_len) if self.varlen else (self.n_seq * heads, self.q_len)


def _constants(layout: _Layout, q: torch.Tensor, causal: bool) -> dict:
    """The compile-time arguments every kernel of one call shares."""
    d = q.shape[-1]
    return {"HEAD_DIM": d, "BLOCK_D": triton.next_power_of_2(d), "IS_CAUSAL": causal, "VARLEN": layout.varlen,
            **_dot_options(q.dtype)}  # fmt: skip


def _kernel_offsets(q: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    # The kernels take a cu_seqlens argument whether or not they are VARLEN; a dense call's is never read.
    return torch.empty(1, device=q.device, dtype=torch.int32) if cu_seqlens is None else cu_seqlens


def _forward(q, k, v, slopes_2d, causal: bool, scale: float, cu_seqlens=None, max_seqlen=None):
    """Run the forward kernel: (out, lse), out contiguous in q's layout, lse float32 as the backward reads it."""
    layout = _Layout.of(q, k, cu_seqlens, max_seqlen)
    cu_seqlens = _kernel_offsets(q, cu_seqlens)
    hq, hkv = q.shape[1], k.shape[1]
    slopes32 = slopes_2d.detach().to(torch.float32).contiguous()  # (1 or B, Hq)
    stride_sb = 0 if slopes32.shape[0] == 1 else slopes32.stride(0)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)  # (B, Hq, Tq, D) or (total, Hq, D)
    lse = torch.empty(layout.lse_shape(hq), device=q.device, dtype=torch.float32)
    common = _constants(layout, q, causal)
    t_bucket = _t_bucket(layout.grid_q, layout.grid_k)

    def grid(meta):
        return (triton.cdiv(layout.grid_q, meta["BLOCK_M"]), layout.n_seq * hq)

    if layout.grid_q > 0:  # packed inputs of only empty documents launch nothing
        st = layout.strides
        args = (
            q, k, v, slopes32, out, lse, cu_seqlens,
            *st(q), *st(k), *st(v), *st(out), stride_sb, slopes32.stride(1),
            hq, hq // hkv, layout.q_len, layout.k_len, scale * LOG2E, t_bucket,
        )  # fmt: skip
        _launch("fwd", grid, args, common, q.dtype)
    return out, lse


def _backward(do, q, k, v, out, lse, slopes_2d, causal: bool, scale: float, slope_grad: bool, cu_seqlens, max_seqlen):
    """Run the two backward kernels: (dq, dk, dv, dslopes), dslopes in slopes_2d's shape and dtype (None unless
    `slope_grad`)."""
    layout = _Layout.of(q, k, cu_seqlens, max_seqlen)
    cu_seqlens = _kernel_offsets(q, cu_seqlens)
    slopes32 = slopes_2d.detach().to(torch.float32).contiguous()
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[-1]
    stride_sb = 0 if slopes32.shape[0] == 1 else slopes32.stride(0)
    delta = (out.float() * do.float()).sum(-1)  # (B, Hq, Tq) or (total, Hq)
    delta = delta.t().contiguous() if layout.varlen else delta.reshape(lse.shape)  # lse's layout
    dq = torch.empty(q.shape, device=q.device, dtype=q.dtype)  # contiguous, as the kernels write it
    dk = torch.empty(k.shape, device=q.device, dtype=k.dtype)
    dv = torch.empty(v.shape, device=q.device, dtype=v.dtype)
    common = _constants(layout, q, causal)
    st = layout.strides
    strides = (*st(q), *st(k), *st(v), *st(do), stride_sb, slopes32.stride(1))
    scales = (scale, scale * LOG2E, _t_bucket(layout.grid_q, layout.grid_k))
    sizes = (layout.q_len, layout.k_len)

    def grid_kv(meta):
        return (triton.cdiv(layout.grid_k, meta["BLOCK_N"]), layout.n_seq * hkv)

    # Partial slope gradients, one per (sequence*head, query block); sized for the smallest candidate BLOCK_M.
    smallest = min_block_m("dq", q.dtype, d)
    dslope_parts = torch.zeros(
        (layout.n_seq * hq, triton.cdiv(layout.grid_q, smallest)), device=q.device, dtype=torch.float32
    )

    def grid_q(meta):
        return (triton.cdiv(layout.grid_q, meta["BLOCK_M"]), layout.n_seq * hq)

    if layout.grid_q > 0:
        dkdv_args = (
            q, k, v, slopes32, do, lse, delta, dk, dv, cu_seqlens, *strides, hq, hkv, hq // hkv, *sizes, *scales,
        )  # fmt: skip
        _launch("dkdv", grid_kv, dkdv_args, common, q.dtype)
        dq_args = (
            q, k, v, slopes32, do, lse, delta, dq, dslope_parts, cu_seqlens, dslope_parts.stride(0),
            *strides, hq, hq // hkv, *sizes, *scales,
        )  # fmt: skip
        _launch("dq", grid_q, dq_args, {**common, "SLOPE_GRAD": slope_grad}, q.dtype)

    dslopes = None
    if slope_grad:
        dslopes = dslope_parts.sum(-1).reshape(layout.n_seq, hq)
        if slopes_2d.shape[0] == 1:
            dslopes = dslopes.sum(0, keepdim=True)
        dslopes = dslopes.to(slopes_2d.dtype)
    return dq, dk, dv, dslopes


# Every call of the Triton path (`alibi_attention` with or without document_starts, `alibi_attention_varlen`) is one
# custom operator for the forward and one for the backward: torch.compile records each call as one node of its graph
# and never traces the launch code, which reads tensor metadata and, for documents, the offsets on the host (a graph
# break were it traced). Document offsets are computed inside the forward operator (one device-to-host copy per
# call) and handed to the backward as outputs: cu_seqlens (padded to B * T + 1 entries for document_starts) and, on
# the host, (documents, longest document); a dense call's are empty.
_EMPTY = (0,)


@torch.library.custom_op("alibi_kernels::triton_attention", mutates_args=())
def _attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slopes_2d: torch.Tensor,
    document_starts: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    max_seqlen: int,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, lse, cu_seqlens, counts). Dense: q (B, Hq, Tq, D). Documents: q (B * T, Hq, D), rows packed one after
    the other, and document_starts (B, T). Packed: q (total, Hq, D), cu_seqlens (int32, checked) and max_seqlen."""
    if document_starts is None and cu_seqlens is None:
        out, lse = _forward(q, k, v, slopes_2d, causal, scale)
        return out, lse, q.new_empty(_EMPTY, dtype=torch.int32), torch.empty(_EMPTY, dtype=torch.int64)
    if cu_seqlens is None:
        from alibi_kernels.attention import starts_to_offsets

        assert document_starts is not None
        cu_seqlens, max_seqlen = starts_to_offsets(document_starts)
        offsets = torch.full((q.shape[0] + 1,), q.shape[0], device=q.device, dtype=torch.int32)
        offsets[: cu_seqlens.numel()] = cu_seqlens
    else:
        offsets = cu_seqlens.clone()  # an operator's output may not alias its input
    out, lse = _forward(q, k, v, slopes_2d, causal, scale, cu_seqlens, max_seqlen)
    return out, lse, offsets, torch.tensor([cu_seqlens.numel() - 1, max_seqlen], dtype=torch.int64)


@_attention_op.register_fake
def _(q, k, v, slopes_2d, document_starts, cu_seqlens, max_seqlen, causal, scale):
    hq = q.shape[1]
    if document_starts is None and cu_seqlens is None:
        lse = q.new_empty((q.shape[0] * hq, q.shape[2]), dtype=torch.float32)
        offsets = q.new_empty(_EMPTY, dtype=torch.int32), torch.empty(_EMPTY, dtype=torch.int64)
    else:
        lse = q.new_empty((hq, q.shape[0]), dtype=torch.float32)
        size = q.shape[0] + 1 if cu_seqlens is None else cu_seqlens.shape[0]
        offsets = q.new_empty((size,), dtype=torch.int32), torch.empty((2,), dtype=torch.int64)
    return torch.empty_like(q, memory_format=torch.contiguous_format), lse, *offsets


@torch.library.custom_op("alibi_kernels::triton_attention_backward", mutates_args=())
def _attention_backward_op(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    slopes_2d: torch.Tensor,
    cu_seqlens: torch.Tensor,
    counts: torch.Tensor,
    causal: bool,
    scale: float,
    slope_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dslopes); dslopes is empty unless `slope_grad`."""
    offsets: tuple[torch.Tensor | None, int | None] = (None, None)
    if counts.numel():
        documents, max_seqlen = (int(c) for c in counts.tolist())  # a host tensor: no device read
        offsets = cu_seqlens[: documents + 1], max_seqlen
    dq, dk, dv, dslopes = _backward(do, q, k, v, out, lse, slopes_2d, causal, scale, slope_grad, *offsets)
    return dq, dk, dv, dslopes if dslopes is not None else slopes_2d.new_empty(_EMPTY)


@_attention_backward_op.register_fake
def _(do, q, k, v, out, lse, slopes_2d, cu_seqlens, counts, causal, scale, slope_grad):
    dslopes = torch.empty_like(slopes_2d) if slope_grad else slopes_2d.new_empty(_EMPTY)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dslopes


def _setup_context(ctx, inputs, output):
    q, k, v, slopes_2d, _, _, _, causal, scale = inputs
    out, lse, cu_seqlens, counts = output
    ctx.save_for_backward(q, k, v, out, lse, slopes_2d, cu_seqlens, counts)
    ctx.causal, ctx.scale = causal, scale


def _attention_grad(ctx, do, *_):
    q, k, v, out, lse, slopes_2d, cu_seqlens, counts = ctx.saved_tensors
    slope_grad = ctx.needs_input_grad[3]
    dq, dk, dv, dslopes = _attention_backward_op(
        do.contiguous(), q, k, v, out, lse, slopes_2d, cu_seqlens, counts, ctx.causal, ctx.scale, slope_grad
    )
    return dq, dk, dv, dslopes if slope_grad else None, None, None, None, None, None


_attention_op.register_autograd(_attention_grad, setup_context=_setup_context)


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
    return triton_call(q, k, v, slopes_2d, causal, scale)


def triton_documents_checked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    document_starts: torch.Tensor,
    slopes_2d: torch.Tensor,
    scale: float,
    causal: bool,
) -> torch.Tensor:
    """`alibi_attention(document_starts=...)` on the Triton path, inputs already checked: each row's documents
    packed for the varlen kernels inside one operator. (B, Hq, T, D)."""
    _check_runnable(q)
    b, hq, t, d = q.shape
    qp, kp, vp = (x.transpose(1, 2).reshape(b * t, x.shape[1], d) for x in (q, k, v))  # (B * T, H, D), row after row
    out = _attention_op(qp, kp, vp, slopes_2d, document_starts, None, 0, causal, scale)[0]
    return out.reshape(b, t, hq, d).transpose(1, 2)


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
    return triton_call(q, k, v, slopes_2d, causal, scale, cu_seqlens, max_seqlen)


def triton_call(q, k, v, slopes_2d, causal: bool, scale: float, cu_seqlens=None, max_seqlen=None) -> torch.Tensor:
    """The operator on checked inputs, dense or (with cu_seqlens and max_seqlen) packed: what the public functions
    call, and what compile_fit and tools/gpu_check_kernels.py capture the launches of."""
    if cu_seqlens is None:
        return _attention_op(q, k, v, slopes_2d, None, None, 0, causal, scale)[0]
    if max_seqlen is None:
        raise ValueError("a packed call needs max_seqlen (check_varlen_inputs gives it)")
    cu_seqlens = cu_seqlens.to(torch.int32).contiguous()
    return _attention_op(q, k, v, slopes_2d, None, cu_seqlens, max_seqlen, causal, scale)[0]


def _check_runnable(q: torch.Tensor) -> None:
    if q.device.type == "cpu" and not INTERPRETED:
        raise RuntimeError(
            "the Triton kernels were imported in compiled mode; CPU tensors need TRITON_INTERPRET=1 set before "
            "alibi_kernels.attention_triton is first imported"
        )
    if q.dtype == torch.float64:
        raise ValueError("backend='triton' supports float16, bfloat16 and float32 inputs, got torch.float64")
