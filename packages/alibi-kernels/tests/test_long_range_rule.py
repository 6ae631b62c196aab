"""The power of the GPU long-range test, shown on CPU with the same inputs and the same rules.

`tests/test_gpu_long_range.py` runs the Triton kernels on the last 1024 queries of 8192 keys with slopes 2^-0.5,
2^-4, 2^-8 and 0 (`attention_cases.long_range_inputs`) and checks the output and every gradient, slopes included,
with two rules against float64: the max-abs FlashAttention rule and its relative-norm companion. Here a kernel that
ignores every key more than 256 positions back (the float64 formula with those keys masked, rounded to the dtype) and
dK/dV 1% too large must fail them, and the float64 result rounded to the dtype must pass. The old GPU grid's slopes
(0.01..0.91) let such a truncated kernel pass: with slope 0.5 or 0.05 the keys 256 back weigh exp(-128) or exp(-12.8).
"""

from __future__ import annotations

import pytest
import torch
from attention_cases import (
    assert_norm_within_twice_torch_error,
    assert_within_twice_torch_error,
    forward_backward,
    long_range_inputs,
    reference_fwd_bwd,
)

from alibi_kernels import alibi_bias

WINDOW = 256
DTYPES = [torch.float16, torch.bfloat16]
NAMES = ("out", "dq", "dk", "dv", "dslopes")


def windowed_attention(q, k, v, s, *, causal, window=WINDOW):
    """float64 ALiBi attention that drops every key `window` or more positions behind the query: a truncated kernel."""
    hq, hkv, tq, tk = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    k, v = (t.repeat_interleave(hq // hkv, dim=1) for t in (k, v))  # (B, Hq, Tk, D)
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5  # (B, Hq, Tq, Tk)
    bias = alibi_bias(s[None], tq, tk, causal=causal, dtype=torch.float64, device="cpu")  # (1, Hq, Tq, Tk)
    distance = torch.arange(tk - tq, tk)[:, None] - torch.arange(tk)[None, :]  # pos_i - pos_j
    bias = bias.masked_fill(distance >= window, float("-inf"))
    return torch.softmax(scores + bias, dim=-1) @ v


@pytest.fixture(scope="module")
def cases():
    """Per dtype: the inputs, the float64 results, PyTorch's same-dtype results (outputs and all four gradients)."""
    out = {}
    for dtype in DTYPES:
        q, k, v, do, slopes = long_range_inputs(dtype)
        ref = reference_fwd_bwd(q, k, v, do, slopes, causal=True, slopes_grad=True)
        same = reference_fwd_bwd(q, k, v, do, slopes, causal=True, slopes_grad=True, compute_dtype=dtype)
        out[dtype] = (q, k, v, do, slopes, [ref[0], *ref[1]], [same[0], *same[1]])
    return out


def check(name, actual, ref, same):
    assert_within_twice_torch_error(name, actual, ref, same)
    assert_norm_within_twice_torch_error(name, actual, ref, same)


@pytest.mark.parametrize("dtype", DTYPES)
def test_float64_results_rounded_to_the_dtype_pass(cases, dtype):
    *_, ref, same = cases[dtype]
    for name, r, p in zip(NAMES, ref, same, strict=True):
        check(name, r.to(dtype if name != "dslopes" else torch.float32), r, p)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_kernel_truncated_to_the_last_256_keys_fails(cases, dtype):
    q, k, v, do, slopes, ref, same = cases[dtype]
    qd, kd, vd, dod = (t.double() for t in (q, k, v, do))
    out, grads = forward_backward(windowed_attention, qd, kd, vd, dod, slopes.double(), causal=True, slopes_grad=True)
    truncated = [out, *grads]
    for name, t, r, p in zip(NAMES, truncated, ref, same, strict=True):
        with pytest.raises(AssertionError, match="torch's own"):
            check(name, t.to(dtype if name != "dslopes" else torch.float32), r, p)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["dk", "dv"])
def test_gradients_one_percent_too_large_fail_the_norm_rule(cases, dtype, name):
    *_, ref, same = cases[dtype]
    i = NAMES.index(name)
    scaled = (ref[i] * 1.01).to(dtype)
    with pytest.raises(AssertionError, match="relative norm error"):
        assert_norm_within_twice_torch_error(name, scaled, ref[i], same[i])


def test_the_inputs_reach_far_the_shallow_heads_weigh_keys_beyond_256():
    """The last query of the 2^-8 and the 0-slope head put most of their weight more than 256 keys back."""
    q, k, v, _, slopes = long_range_inputs(torch.float32)
    scores = (q[0, 2:, -1:].double() @ k[0, 1:2].double().transpose(-1, -2)) * 64**-0.5  # heads 2, 3 share kv 1
    distance = torch.arange(8191, -1, -1, dtype=torch.float64)  # pos_i - pos_j of the last query
    probs = torch.softmax(scores + (-slopes[2:, None, None].double() * distance), dim=-1)  # (2, 1, Tk)
    far = probs[..., distance >= WINDOW].sum(-1).flatten()
    assert far[0] > 0.3 and far[1] > 0.9, far
