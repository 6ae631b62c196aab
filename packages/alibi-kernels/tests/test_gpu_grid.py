"""GPU tests (marker `gpu`): the issue's grid in fp16 and bf16 up to T = 4096, Triton against float64.

Tolerance: the FlashAttention rule, error vs float64 at most twice PyTorch's own same-dtype math error.
`tools/gpu_check_kernels.py` runs them with ALIBI_KERNELS_AUTOTUNE=0 (one config per head dim, so the grid
compiles each shape once); the benchmark exercises the autotuned configs.
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
)

from alibi_kernels import alibi_attention

pytestmark = pytest.mark.gpu

# ALIBI_KERNELS_GPU_GRID=quick keeps the extremes and a padded head dim, for a GPU check on a short time budget.
QUICK = os.environ.get("ALIBI_KERNELS_GPU_GRID", "full") == "quick"
T_VALUES = [1, 100, 4096] if QUICK else [1, 17, 64, 100, 257, 1024, 4096]
D_VALUES = [16, 80, 128] if QUICK else [16, 32, 64, 80, 128]
HEADS = [(1, 1), (4, 1), (6, 2), (12, 12)]
GRID = list(itertools.product(T_VALUES, D_VALUES, HEADS, [True, False], [torch.float16, torch.bfloat16]))


def to_cuda(*tensors):
    return [t.cuda() for t in tensors]


def triton_path(q, k, v, s, *, causal):
    return alibi_attention(q, k, v, s, causal=causal, backend="triton")


@pytest.mark.parametrize(("t", "d", "heads", "causal", "dtype"), GRID)
def test_gpu_grid_half_precision(t, d, heads, causal, dtype):
    hq, hkv = heads
    idx = GRID.index((t, d, heads, causal, dtype))
    b = 2 if t <= 257 else 1
    layout = "bthd" if idx % 2 else "bhtd"
    q, k, v, do, slopes = to_cuda(
        *make_inputs(b, hq, hkv, t, t, d, dtype=dtype, layout=layout, per_batch_slopes=idx % 3 == 0, seed=idx)
    )
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


@pytest.mark.parametrize("d", [64, 96, 128, 256])
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
