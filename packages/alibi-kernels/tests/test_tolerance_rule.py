"""The half-precision rule itself, on CPU at T = 4096: it accepts a correct output and rejects wrong ones.

The rule (`assert_within_twice_torch_error`) bounds a kernel's error vs float64 by twice the error of PyTorch's
own same-dtype math. It only means something if that baseline error is small against the output: a baseline that
built its positions in bf16 (exact integers only up to 256) or fp16 (up to 2048) merged neighbouring positions at
T = 4096, its own error exceeded the largest output (3.18 vs 2.95 here), and an all-zeros output passed.

Sizes: B = 1, two heads (slopes 0.5 and 0.01, the steep and shallow ends of the GPU grid's random slopes), D = 16,
forward only, causal, Tq = Tk = 4096. The materialised float64 reference is then about 3 s on one core; inputs are
exact in both fp16 and bf16, so one float64 reference serves both dtypes.
"""

from __future__ import annotations

import pytest
import torch
from attention_cases import assert_within_twice_torch_error

from alibi_kernels import alibi_attention_reference, alibi_bias
from alibi_kernels.attention_torch import _bias_block

T, D = 4096, 16
SLOPES = torch.tensor([0.5, 0.01])  # head 0: the last few keys dominate; head 1: hundreds of keys share the weight
DTYPES = [torch.float16, torch.bfloat16]


@pytest.fixture(scope="module")
def case():
    """q, k, v (float64, exact in fp16 and bf16), the float64 output, and PyTorch's same-dtype output per dtype."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, T, D, generator=gen).to(torch.bfloat16).double() for _ in range(3))
    for t in (q, k, v):
        t[t.abs() < 2**-14] = 0.0  # below fp16's normal range a bf16 value may not be exact in fp16
    ref = alibi_attention_reference(q, k, v, SLOPES, causal=True)  # (1, 2, T, D) float64
    same_dtype = {dt: alibi_attention_reference(q, k, v, SLOPES, causal=True, compute_dtype=dt) for dt in DTYPES}
    return q, k, v, ref, same_dtype


@pytest.mark.parametrize("dtype", DTYPES)
def test_same_dtype_baseline_error_is_small_against_the_output(case, dtype):
    _, _, _, ref, same_dtype = case
    base = (same_dtype[dtype].double() - ref).abs().max().item()
    assert base < 0.02 * ref.abs().max().item(), f"torch's own {dtype} error {base:.3g} vs max |ref| {ref.abs().max()}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_rule_accepts_the_float64_output_rounded_to_the_dtype(case, dtype):
    _, _, _, ref, same_dtype = case
    assert_within_twice_torch_error("out", ref.to(dtype), ref, same_dtype[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rule_rejects_all_zeros(case, dtype):
    _, _, _, ref, same_dtype = case
    with pytest.raises(AssertionError, match="torch's own error"):
        assert_within_twice_torch_error("out", torch.zeros_like(ref, dtype=dtype), ref, same_dtype[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rule_rejects_one_row_whose_causal_mask_drops_its_own_key(case, dtype):
    """The last row of the steep head (position 4095) attending to keys 0..4094 only: a mask off by one."""
    q, k, v, ref, same_dtype = case
    row = alibi_attention_reference(q[:, :1, -1:], k[:, :1, :-1], v[:, :1, :-1], SLOPES[:1], causal=True)  # (1,1,1,D)
    wrong = ref.clone()
    wrong[:, :1, -1:] = row  # queries align to the end of the keys: the same biases, one key fewer
    with pytest.raises(AssertionError, match="torch's own error"):
        assert_within_twice_torch_error("out", wrong.to(dtype), ref, same_dtype[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rule_rejects_noise_of_three_percent_of_the_largest_output(case, dtype):
    _, _, _, ref, same_dtype = case
    gen = torch.Generator().manual_seed(1)
    noise = (torch.rand(ref.shape, generator=gen, dtype=torch.float64) * 2 - 1) * 0.03 * ref.abs().max()
    with pytest.raises(AssertionError, match="torch's own error"):
        assert_within_twice_torch_error("out", (ref + noise).to(dtype), ref, same_dtype[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_is_built_in_float32_and_rounded_once(dtype):
    """Both bias builders (the reference's and the torch path's) at positions 4032..4095 of 4096 keys."""
    slopes = torch.tensor([[0.5, 0.01, 0.3]])  # (1, H)
    rows = 64
    exact = alibi_bias(slopes.double(), rows, T, causal=True, dtype=torch.float64, device="cpu")  # (1, 3, 64, T)
    expected = exact.float().to(dtype)  # float32, as the kernels compute it, then one rounding
    assert torch.equal(alibi_bias(slopes, rows, T, causal=True, dtype=dtype, device="cpu"), expected)
    assert torch.equal(_bias_block(slopes, T - rows, rows, T, True, dtype), expected)
