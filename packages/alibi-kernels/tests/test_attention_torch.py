"""The torch path against float64 on the full T x D x heads x causal grid; gradcheck, GQA, cache, chunking."""

from __future__ import annotations

import itertools

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

import alibi_kernels.attention_torch as attention_torch
from alibi_kernels import alibi_attention, alibi_attention_reference, bias_cache_info, clear_bias_cache

T_VALUES = [1, 17, 64, 100, 257]
D_VALUES = [16, 32, 64, 80, 128]
HEADS = [(1, 1), (4, 1), (6, 2), (12, 12)]
GRID = list(itertools.product(T_VALUES, D_VALUES, HEADS, [True, False]))


def torch_path(q, k, v, s, *, causal):
    return alibi_attention(q, k, v, s, causal=causal, backend="torch")


@pytest.mark.parametrize(("t", "d", "heads", "causal"), GRID)
def test_grid_fp32_forward_and_grads_match_float64(t, d, heads, causal):
    hq, hkv = heads
    idx = GRID.index((t, d, heads, causal))
    layout = "bthd" if idx % 2 else "bhtd"  # half the grid non-contiguous
    q, k, v, do, slopes = make_inputs(2, hq, hkv, t, t, d, layout=layout, per_batch_slopes=idx % 3 == 0, seed=idx)
    out, grads = forward_backward(torch_path, q, k, v, do, slopes, causal=causal)
    ref_out, ref_grads = reference_fwd_bwd(q, k, v, do, slopes, causal=causal)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_fp32_close("out", out, ref_out)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
        assert g.shape == r.shape, name
        assert_fp32_close(name, g, r, rtol=FP32_GRAD_RTOL)


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize(
    ("tq", "tk", "causal"),
    [
        (1, 17, True),
        (1, 257, True),
        (17, 64, True),
        (64, 100, True),
        (100, 257, False),
        (100, 17, False),
        (17, 1, False),
    ],
)
def test_tq_differs_from_tk(heads, tq, tk, causal):
    hq, hkv = heads
    q, k, v, do, slopes = make_inputs(2, hq, hkv, tq, tk, 32, layout="bthd", seed=tq * 1000 + tk)
    out, grads = forward_backward(torch_path, q, k, v, do, slopes, causal=causal)
    ref_out, ref_grads = reference_fwd_bwd(q, k, v, do, slopes, causal=causal)
    assert_fp32_close("out", out, ref_out)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
        assert_fp32_close(name, g, r, rtol=FP32_GRAD_RTOL)


def test_decoding_one_token_equals_last_row_of_full_attention():
    q, k, v, _, slopes = make_inputs(1, 6, 2, 40, 40, 64, seed=3)
    full = alibi_attention(q, k, v, slopes, backend="torch")
    step = alibi_attention(q[:, :, -1:], k, v, slopes, backend="torch")
    assert torch.allclose(step, full[:, :, -1:], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fault", [None, "half_math"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_on_cpu_is_fp32_math_rounded_once(dtype, fault, monkeypatch):
    # On CPU the torch path computes fp16/bf16 inputs in fp32 (faster there, and closer to float64), so the
    # same-dtype rule (2x PyTorch's own fp16/bf16 error) would hold trivially: what holds is bit equality with the
    # fp32 path on the same values, rounded once to the input dtype. Math in the input dtype breaks it.
    if fault == "half_math":
        monkeypatch.setattr("alibi_kernels.attention_torch._compute_dtype", lambda q: q.dtype)
    q, k, v, do, slopes = make_inputs(2, 6, 2, 100, 100, 64, dtype=dtype, layout="bthd", seed=7)
    out, grads = forward_backward(torch_path, q, k, v, do, slopes, causal=True)
    out32, grads32 = forward_backward(torch_path, q.float(), k.float(), v.float(), do.float(), slopes, causal=True)
    assert out.dtype == dtype and all(g.dtype == dtype for g in grads)
    same = [torch.equal(a, b.to(dtype)) for a, b in zip([out, *grads], [out32, *grads32], strict=True)]
    assert same == ([True] * 4 if fault is None else [False] * 4)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_half_precision_within_twice_torch_own_error(dtype):
    # On CUDA the torch path computes in the input dtype: the FlashAttention rule applies.
    q, k, v, do, slopes = (t.cuda() for t in make_inputs(2, 6, 2, 100, 100, 64, dtype=dtype, layout="bthd", seed=7))
    out, grads = forward_backward(torch_path, q, k, v, do, slopes, causal=True)
    ref_out, ref_grads = reference_fwd_bwd(q, k, v, do, slopes, causal=True)
    pt_out, pt_grads = reference_fwd_bwd(q, k, v, do, slopes, causal=True, compute_dtype=dtype)
    assert out.dtype == dtype
    assert_within_twice_torch_error("out", out, ref_out, pt_out)
    for name, g, r, p in zip(("dq", "dk", "dv"), grads, ref_grads, pt_grads, strict=True):
        assert g.dtype == dtype
        assert_within_twice_torch_error(name, g, r, p)


@pytest.mark.parametrize("causal", [True, False])
def test_gradcheck_float64_including_slopes(causal):
    # GQA (2 query heads per k/v head), Tq < Tk, per-batch slopes; small because gradcheck perturbs every element.
    q, k, v, _, slopes = make_inputs(2, 2, 1, 3, 5, 16, dtype=torch.float64, per_batch_slopes=True, seed=11)
    inputs = [t.detach().clone().requires_grad_(True) for t in (q, k, v, slopes.double())]

    def fn(q, k, v, s):
        return alibi_attention(q, k, v, s, causal=causal, backend="torch")

    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-6)


def test_slope_gradient_matches_reference():
    q, k, v, do, slopes = make_inputs(2, 6, 2, 64, 64, 32, seed=5)
    _, grads = forward_backward(torch_path, q, k, v, do, slopes, causal=True, slopes_grad=True)
    _, ref_grads = reference_fwd_bwd(q, k, v, do, slopes, causal=True, slopes_grad=True)
    assert grads[3].shape == slopes.shape
    assert_fp32_close("dslopes", grads[3], ref_grads[3], rtol=FP32_GRAD_RTOL)


def test_default_slopes_are_the_paper_slopes():
    q, k, v, _, _ = make_inputs(1, 12, 4, 9, 9, 16, seed=2)
    from alibi_kernels import alibi_slopes

    assert torch.equal(alibi_attention(q, k, v, backend="torch"), alibi_attention(q, k, v, alibi_slopes(12)))


def test_bias_is_cached_per_shape_and_slopes():
    clear_bias_cache()
    q, k, v, _, slopes = make_inputs(1, 4, 1, 17, 17, 16, seed=1)
    alibi_attention(q, k, v, slopes, backend="torch")
    alibi_attention(q, k, v, slopes, backend="torch")
    assert bias_cache_info()["misses"] == 1 and bias_cache_info()["hits"] == 1
    out_other = alibi_attention(q, k, v, slopes * 2, backend="torch")  # other slopes: a new entry, not a stale hit
    assert bias_cache_info()["misses"] == 2
    ref = alibi_attention_reference(q, k, v, slopes * 2)
    assert_fp32_close("out", out_other, ref)


def test_cache_is_bounded():
    clear_bias_cache()
    for t in range(1, attention_torch._CACHE_MAX_ENTRIES + 5):
        q, k, v, _, _ = make_inputs(1, 1, 1, t, t, 16, seed=t)
        alibi_attention(q, k, v, backend="torch")
    assert bias_cache_info()["size"] == attention_torch._CACHE_MAX_ENTRIES


@pytest.mark.parametrize("causal", [True, False])
def test_chunked_path_for_long_sequences_matches_reference(monkeypatch, causal):
    monkeypatch.setattr(attention_torch, "MAX_BIAS_ELEMENTS", 6 * 40 * 100)  # forces ~40-row chunks
    clear_bias_cache()
    q, k, v, do, slopes = make_inputs(1, 6, 2, 257, 300, 32, layout="bthd", per_batch_slopes=True, seed=9)
    out, grads = forward_backward(torch_path, q, k, v, do, slopes, causal=causal, slopes_grad=True)
    ref_out, ref_grads = reference_fwd_bwd(q, k, v, do, slopes, causal=causal, slopes_grad=True)
    assert bias_cache_info()["size"] == 0  # chunks build their own small bias, nothing is cached
    assert_fp32_close("out", out, ref_out)
    for name, g, r in zip(("dq", "dk", "dv", "dslopes"), grads, ref_grads, strict=True):
        assert_fp32_close(name, g, r, rtol=FP32_GRAD_RTOL)


def test_cpu_autocast_keeps_the_fp32_compute_path():
    q, k, v, _, slopes = make_inputs(2, 4, 2, 33, 33, 32, dtype=torch.bfloat16, seed=4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = alibi_attention(q, k, v, slopes, backend="torch")
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, alibi_attention(q, k, v, slopes, backend="torch"))
