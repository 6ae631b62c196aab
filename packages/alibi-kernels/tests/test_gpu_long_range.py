"""GPU tests (marker `gpu`) that catch long-range errors and check every launchable config, not only config 0.

Long range: the last 1024 queries of 8192 keys (and all 8192 queries, full grid only) with slopes 2^-0.5, 2^-4,
2^-8 and 0 (`attention_cases.long_range_inputs`), fp16 and bf16, the output and the gradients of q, k, v and the
slopes, each against float64 by the max-abs FlashAttention rule and its relative-norm companion.
`tests/test_long_range_rule.py` shows on CPU, with the same inputs and rules, that a kernel truncated to the last
256 keys fails both (by 17x to 190x) and that dK or dV 1% too large fails the norm rule.

Every config: for fp16, bf16 and fp32 at head dims 64, 128 and 256, the i-th config `launch_configs` returns for
this GPU is pinned for each kernel (the last one where a kernel has fewer), on B = 2, 4 query heads over 2 k/v
heads, Tq = 300 of Tk = 333 keys (partial tiles everywhere), causal, with slope gradients.
"""

from __future__ import annotations

import os

import pytest
import torch
from attention_cases import (
    FP32_GRAD_RTOL,
    assert_fp32_close,
    assert_norm_within_twice_torch_error,
    assert_within_twice_torch_error,
    forward_backward,
    long_range_inputs,
    make_inputs,
    reference_fwd_bwd,
    same_kernels,
)

from alibi_kernels import alibi_attention
from alibi_kernels.launch_configs import KERNELS, candidate_configs, has_measured_tiles, launch_configs

pytestmark = pytest.mark.gpu

QUICK = os.environ.get("ALIBI_KERNELS_GPU_GRID", "full") == "quick"
NAMES = ("out", "dq", "dk", "dv", "dslopes")
LONG_TQ = [1024] if QUICK else [1024, 8192]


def triton_path(q, k, v, s, *, causal):
    return alibi_attention(q, k, v, s, causal=causal, backend="triton")


def check_half(name, actual, ref, same):
    assert_within_twice_torch_error(name, actual, ref, same)
    assert_norm_within_twice_torch_error(name, actual, ref, same)


@pytest.mark.parametrize("tq", LONG_TQ)
@pytest.mark.parametrize(
    "dtype", [pytest.param(d, marks=same_kernels(f"{d}-D64")) for d in (torch.float16, torch.bfloat16)]
)
def test_gpu_long_range_with_slope_gradients(dtype, tq):
    q, k, v, do, slopes = (t.cuda() for t in long_range_inputs(dtype, tq=tq))
    out, grads = forward_backward(triton_path, q, k, v, do, slopes, causal=True, slopes_grad=True)
    ref_out, ref_grads = reference_fwd_bwd(q, k, v, do, slopes, causal=True, slopes_grad=True)
    pt_out, pt_grads = reference_fwd_bwd(q, k, v, do, slopes, causal=True, slopes_grad=True, compute_dtype=dtype)
    for name, a, r, p in zip(NAMES, [out, *grads], [ref_out, *ref_grads], [pt_out, *pt_grads], strict=True):
        check_half(name, a, r, p)


def device_configs(dtype, head_dim):
    """What launch_configs allows on this GPU, per kernel (every candidate on a GPU without measured tiles)."""
    from alibi_kernels.attention_triton import _device_limits

    capability, smem, _ = _device_limits(torch.device("cuda"))
    if not has_measured_tiles(capability):
        return {k: list(candidate_configs(k, dtype, head_dim)) for k in KERNELS}
    return {
        k: launch_configs(k, capability=capability, smem_per_block=smem, dtype=dtype, head_dim=head_dim)
        for k in KERNELS
    }


PER_CONFIG = [
    (dtype, d, i)
    for dtype in (torch.float16, torch.bfloat16, torch.float32)
    for d in (64, 128, 256)
    for i in range(max(len(candidate_configs(k, dtype, d)) for k in KERNELS))
]


@pytest.mark.parametrize(
    ("dtype", "d", "i"), [pytest.param(*c, marks=same_kernels(f"config-{c[0]}-D{c[1]}")) for c in PER_CONFIG]
)
def test_gpu_every_launchable_config(dtype, d, i):
    from alibi_kernels.attention_triton import pinned_configs

    configs = device_configs(dtype, d)
    if all(i >= len(c) for c in configs.values()):
        pytest.skip(f"no kernel has a config #{i} that fits this GPU for {dtype} at D={d}")
    pinned = {k: c[min(i, len(c) - 1)] for k, c in configs.items()}
    q, k, v, do, slopes = (t.cuda() for t in make_inputs(2, 4, 2, 300, 333, d, dtype=dtype, seed=i + d))
    with pinned_configs(**pinned):
        out, grads = forward_backward(triton_path, q, k, v, do, slopes, causal=True, slopes_grad=True)
    ref_out, ref_grads = reference_fwd_bwd(q, k, v, do, slopes, causal=True, slopes_grad=True)
    label = ", ".join(f"{k} {c}" for k, c in pinned.items())
    if dtype == torch.float32:
        assert_fp32_close(f"out ({label})", out, ref_out)
        for name, g, r in zip(NAMES[1:], grads, ref_grads, strict=True):
            assert_fp32_close(f"{name} ({label})", g, r, rtol=FP32_GRAD_RTOL)
        return
    pt_out, pt_grads = reference_fwd_bwd(q, k, v, do, slopes, causal=True, slopes_grad=True, compute_dtype=dtype)
    for name, a, r, p in zip(NAMES, [out, *grads], [ref_out, *ref_grads], [pt_out, *pt_grads], strict=True):
        check_half(f"{name} ({label})", a, r, p)
