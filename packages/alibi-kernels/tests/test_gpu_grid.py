"""GPU tests (marker `gpu`): the Triton kernels in fp16 and bf16 up to T = 4096 against float64.

Grid: T in {1, 17, 64, 100, 257, 1024, 4096} x D in {16, 32, 64, 80, 128} x Hq/Hkv in {1/1, 4/1, 6/2, 12/12} x
causal or not x fp16/bf16 (ALIBI_KERNELS_GPU_GRID=quick: T in {1, 100, 4096}, D in {16, 80, 128}, 144 cases).
Tolerance: the FlashAttention rule, error vs float64 at most twice PyTorch's own same-dtype math error
(tests/test_tolerance_rule.py shows on CPU that this rule rejects wrong outputs at T = 4096).
`tools/gpu_check_kernels.py` runs them with ALIBI_KERNELS_AUTOTUNE=0 (one config per kernel and specialisation);
test_gpu_autotuned_configs_bf16 and the benchmark exercise the autotuned configs.
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch
from attention_cases import (
    FP32_GRAD_RTOL,
    assert_fp32_close,
    assert_within_twice_torch_error,
    forward_backward,
    make_inputs,
    reference_fwd_bwd,
    same_kernels,
)

from alibi_kernels import alibi_attention

pytestmark = pytest.mark.gpu

# ALIBI_KERNELS_GPU_GRID=quick keeps the extremes and a padded head dim, for a GPU check on a short time budget.
QUICK = os.environ.get("ALIBI_KERNELS_GPU_GRID", "full") == "quick"
T_VALUES = [1, 100, 4096] if QUICK else [1, 17, 64, 100, 257, 1024, 4096]
D_VALUES = [16, 80, 128] if QUICK else [16, 32, 64, 80, 128]
HEADS = [(1, 1), (4, 1), (6, 2), (12, 12)]
GRID = list(itertools.product(T_VALUES, D_VALUES, HEADS, [True, False], [torch.float16, torch.bfloat16]))
AUTOTUNED_D = [64, 128, 256] if QUICK else [64, 96, 128, 256]


def to_cuda(*tensors):
    return [t.cuda() for t in tensors]


def triton_path(q, k, v, s, *, causal):
    return alibi_attention(q, k, v, s, causal=causal, backend="triton")


def grid_inputs(t, d, heads, causal, dtype, device="cuda"):
    """q, k, v, grad-output and slopes of one GRID case: every other case non-contiguous, a third per-batch slopes."""
    idx = GRID.index((t, d, heads, causal, dtype))
    layout = "bthd" if idx % 2 else "bhtd"
    b = 2 if t <= 257 else 1
    inputs = make_inputs(b, *heads, t, t, d, dtype=dtype, layout=layout, per_batch_slopes=idx % 3 == 0, seed=idx)
    return [x.to(device) for x in inputs]  # .to keeps the strides of the transposed views


@pytest.mark.parametrize(
    ("t", "d", "heads", "causal", "dtype"), [pytest.param(*c, marks=same_kernels(f"{c[4]}-D{c[1]}")) for c in GRID]
)
def test_gpu_grid_half_precision(t, d, heads, causal, dtype):
    q, k, v, do, slopes = grid_inputs(t, d, heads, causal, dtype)
    out, grads = forward_backward(triton_path, q, k, v, do, slopes, causal=causal)
    ref_out, ref_grads = reference_fwd_bwd(q, k, v, do, slopes, causal=causal)
    pt_out, pt_grads = reference_fwd_bwd(q, k, v, do, slopes, causal=causal, compute_dtype=dtype)
    assert out.dtype == dtype
    assert_within_twice_torch_error("out", out, ref_out, pt_out)
    for name, g, r, p in zip(("dq", "dk", "dv"), grads, ref_grads, pt_grads, strict=True):
        assert_within_twice_torch_error(name, g, r, p)


@pytest.mark.parametrize(("tq", "tk"), [(1, 4096), (100, 1024), (257, 4096)])
def test_gpu_tq_differs_from_tk_fp32_with_slope_grad(tq, tk):
    q, k, v, do, slopes = to_cuda(*make_inputs(1, 6, 2, tq, tk, 64, layout="bthd", seed=tq + tk))
    out, grads = forward_backward(triton_path, q, k, v, do, slopes, causal=True, slopes_grad=True)
    ref_out, ref_grads = reference_fwd_bwd(q, k, v, do, slopes, causal=True, slopes_grad=True)
    assert_fp32_close("out", out, ref_out)
    for name, g, r in zip(("dq", "dk", "dv", "dslopes"), grads, ref_grads, strict=True):
        assert_fp32_close(name, g, r, rtol=FP32_GRAD_RTOL)


@pytest.mark.parametrize("d", [pytest.param(d, marks=same_kernels(f"autotune-D{d}")) for d in AUTOTUNED_D])
def test_gpu_autotuned_configs_bf16(monkeypatch, d):
    monkeypatch.setenv("ALIBI_KERNELS_AUTOTUNE", "1")
    q, k, v, do, slopes = to_cuda(*make_inputs(2, 8, 2, 1024, 1024, d, dtype=torch.bfloat16, seed=d))
    out, grads = forward_backward(triton_path, q, k, v, do, slopes, causal=True)
    ref_out, ref_grads = reference_fwd_bwd(q, k, v, do, slopes, causal=True)
    pt_out, pt_grads = reference_fwd_bwd(q, k, v, do, slopes, causal=True, compute_dtype=torch.bfloat16)
    assert_within_twice_torch_error("out", out, ref_out, pt_out)
    for name, g, r, p in zip(("dq", "dk", "dv"), grads, ref_grads, pt_grads, strict=True):
        assert_within_twice_torch_error(name, g, r, p)


def test_gpu_auto_backend_is_triton_and_matches_torch_path():
    q, k, v, _, slopes = to_cuda(*make_inputs(2, 8, 8, 512, 512, 64, dtype=torch.bfloat16, seed=3))
    auto = alibi_attention(q, k, v, slopes)
    torch_path = alibi_attention(q, k, v, slopes, backend="torch")
    triton = alibi_attention(q, k, v, slopes, backend="triton")
    assert torch.equal(auto, triton)
    assert (auto.float() - torch_path.float()).abs().max().item() < 2e-2
