"""Every bad input raises a ValueError that names the argument and the shapes found."""

from __future__ import annotations

import pytest
import torch
from attention_cases import NEEDS_INTERPRETER

from alibi_kernels import alibi_attention, alibi_attention_varlen


def qkv(b=2, hq=4, hkv=2, tq=8, tk=8, d=16, dtype=torch.float32):
    return (
        torch.randn(b, hq, tq, d, dtype=dtype),
        torch.randn(b, hkv, tk, d, dtype=dtype),
        torch.randn(b, hkv, tk, d, dtype=dtype),
    )


@pytest.mark.parametrize("backend", ["torch", "triton", "auto"])
@pytest.mark.parametrize(
    ("make", "pattern"),
    [
        (lambda: (torch.randn(4, 8, 16), *qkv()[1:]), r"q must have rank 4 .* got shape \(4, 8, 16\)"),
        (lambda: (qkv()[0], torch.randn(2, 2, 8, 16, 1), qkv()[2]), r"k must have rank 4"),
        (lambda: (*qkv()[:2], torch.randn(2, 2, 9, 16)), r"k and v must have the same shape .*\(2, 2, 9, 16\)"),
        (lambda: (qkv()[0], *qkv(b=3)[1:]), r"batch size mismatch: q \(2, 4, 8, 16\) has B=2, k \(3, 2, 8, 16\)"),
        (lambda: (qkv()[0], *qkv(d=32)[1:]), r"head dim mismatch: q \(2, 4, 8, 16\) has D=16, k .* D=32"),
        (lambda: qkv(hq=6, hkv=4), r"multiple of k/v heads.*Hq=6.*Hkv=4"),
        (lambda: qkv(d=8), r"head dim D=8 of q \(2, 4, 8, 8\) is outside 16..256"),
        (lambda: qkv(d=320), r"head dim D=320 .* outside 16..256"),
        (lambda: qkv(tq=9, tk=8), r"Tq must be <= Tk: q \(2, 4, 9, 16\) has Tq=9, k \(2, 2, 8, 16\) has Tk=8"),
        (lambda: qkv(tq=0), r"sequence lengths must be >= 1"),
        (lambda: (qkv()[0], qkv()[1].double(), qkv()[2]), r"share one dtype, got q torch.float32, k torch.float64"),
        (lambda: (qkv()[0].long(), *qkv()[1:]), r"q must be a floating-point tensor"),
        (lambda: (qkv()[0], qkv()[1].to("meta"), qkv()[2]), r"one device, got q on cpu, k on meta"),
    ],
)
def test_bad_tensors_raise_value_error_naming_them(backend, make, pattern):
    q, k, v = make()
    with pytest.raises(ValueError, match=pattern):
        alibi_attention(q, k, v, backend=backend)


@pytest.mark.parametrize(
    ("slopes", "pattern"),
    [
        (torch.ones(3), r"slopes must have shape \(Hq,\)=\(4,\) or \(B, Hq\)=\(2, 4\), got \(3,\)"),
        (torch.ones(4, 2), r"got \(4, 2\)"),
        (torch.ones(1, 2, 4), r"got \(1, 2, 4\)"),
        (torch.ones(4, dtype=torch.float16), r"slopes must be float32 or float64, got torch.float16"),
        (torch.ones(4, device="meta"), r"slopes must be on q's device cpu, got meta"),
        ([0.5] * 4, r"slopes must be a torch.Tensor"),
    ],
)
def test_bad_slopes_raise_value_error(slopes, pattern):
    with pytest.raises(ValueError, match=pattern):
        alibi_attention(*qkv(), slopes)


def test_non_causal_allows_more_queries_than_keys():
    q, k, v = qkv(tq=9, tk=4)
    assert alibi_attention(q, k, v, causal=False, backend="torch").shape == q.shape


def test_bad_backend_and_scale():
    with pytest.raises(ValueError, match=r"backend must be one of .*'cuda'"):
        alibi_attention(*qkv(), backend="cuda")
    with pytest.raises(ValueError, match=r"softmax_scale must be a positive number, got -1.0"):
        alibi_attention(*qkv(), softmax_scale=-1.0)


def test_triton_on_cpu_without_interpreter_says_why(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match=r"TRITON_INTERPRET=1.*backend='torch'"):
        alibi_attention(*qkv(), backend="triton")


def test_backend_check_looks_nothing_up_per_call(monkeypatch):
    # torch.compile traces the backend check on every call of the kernels; importlib's finder breaks its graph
    # (torch 2.11), so whether triton is installed is looked up once, at import.
    import importlib.util

    from alibi_kernels import triton_unavailable_reason

    def finder(*args):
        raise AssertionError("importlib.util.find_spec called per call")

    monkeypatch.setattr(importlib.util, "find_spec", finder)
    triton_unavailable_reason(torch.device("cuda"))
    alibi_attention(*qkv())


def test_auto_on_cpu_uses_the_torch_path_even_under_the_interpreter():
    q, k, v = qkv()
    assert torch.equal(alibi_attention(q, k, v), alibi_attention(q, k, v, backend="torch"))


def packed(total=10, hq=4, hkv=2, d=16, dtype=torch.float32):
    return (
        torch.randn(total, hq, d, dtype=dtype),
        torch.randn(total, hkv, d, dtype=dtype),
        torch.randn(total, hkv, d, dtype=dtype),
    )


CU = torch.tensor([0, 4, 10], dtype=torch.int32)

# The varlen Triton path asks whether Triton can run before it reads the offsets (it trusts them when max_seqlen is
# given, saving a device-to-host copy), so on CPU tensors its input checks are reached only under the interpreter.
VARLEN_BACKENDS = ["torch", pytest.param("triton", marks=NEEDS_INTERPRETER), "auto"]


@pytest.mark.parametrize("backend", VARLEN_BACKENDS)
@pytest.mark.parametrize(
    ("make", "pattern"),
    [
        (lambda: (*qkv(), CU), r"q must have rank 3 \(total_tokens, H, D\), got shape \(2, 4, 8, 16\)"),
        (lambda: (packed()[0], torch.randn(10, 2), packed()[2], CU), r"k must have rank 3 .* got shape \(10, 2\)"),
        (lambda: (*packed()[:2], torch.randn(10, 3, 16), CU), r"k and v must have the same shape \(total_tokens, Hkv"),
        (lambda: (packed()[0], *packed(total=12)[1:], CU), r"total_tokens mismatch: q \(10, 4, 16\) has 10 .* 12"),
        (lambda: (packed()[0], *packed(d=32)[1:], CU), r"head dim mismatch: q \(10, 4, 16\) has D=16, k .* D=32"),
        (lambda: (*packed(hq=6, hkv=4), CU), r"multiple of k/v heads.*Hq=6.*Hkv=4"),
        (lambda: (*packed(d=8), CU), r"head dim D=8 of q \(10, 4, 8\) is outside 16..256"),
        (lambda: (*packed(d=264), CU), r"head dim D=264 .* outside 16..256"),
        (
            lambda: (packed()[0], packed()[1].double(), packed()[2], CU),
            r"share one dtype, got q torch.float32, k",
        ),
        (lambda: (packed()[0], packed()[1].to("meta"), packed()[2], CU), r"one device, got q on cpu, k on meta"),
        (lambda: (*packed(), [0, 4, 10]), r"cu_seqlens must be a 1-D int32 or int64 torch.Tensor, got list"),
        (lambda: (*packed(), CU.float()), r"1-D int32 or int64 tensor, got shape \(3,\) dtype torch.float32"),
        (lambda: (*packed(), CU[None]), r"1-D int32 or int64 tensor, got shape \(1, 3\) dtype torch.int32"),
        (lambda: (*packed(), CU[:1]), r"at least 2 entries \(one document\), got shape \(1,\)"),
        (lambda: (*packed(), CU.to("meta")), r"cu_seqlens must be on q's device cpu, got meta"),
        (lambda: (*packed(), torch.tensor([2, 4, 10])), r"cu_seqlens must start at 0, got cu_seqlens\[0\]=2"),
        (
            lambda: (*packed(), torch.tensor([0, 6, 4, 10])),
            r"non-decreasing, got cu_seqlens\[2\]=4 < cu_seqlens\[1\]",
        ),
        (
            lambda: (*packed(), torch.tensor([0, 4, 9])),
            r"cu_seqlens\[-1\] must equal total_tokens: got 9, q \(10,",
        ),
        (lambda: (*packed(), CU, 5), r"max_seqlen=5 is smaller than the longest document \(6 tokens, document 1"),
        (lambda: (*packed(), CU, 6.0), r"max_seqlen must be an int or None, got float"),
        (lambda: (*packed(), CU, None, torch.ones(2, 4)), r"slopes must have shape \(Hq,\)=\(4,\), got \(2, 4\)"),
        (lambda: (*packed(), CU, None, torch.ones(4, dtype=torch.int32)), r"slopes must be float32 or float64"),
    ],
)
def test_varlen_bad_inputs_raise_value_error_naming_them(backend, make, pattern):
    if backend == "triton" and pattern.startswith("max_seqlen=5"):
        pytest.skip("with max_seqlen given, the Triton path trusts cu_seqlens (no device-to-host copy)")
    with pytest.raises(ValueError, match=pattern):
        alibi_attention_varlen(*make(), backend=backend)


@NEEDS_INTERPRETER[0]  # triton installed
@NEEDS_INTERPRETER[1]  # and the interpreter on
def test_varlen_triton_rejects_float64():
    with pytest.raises(ValueError, match=r"backend='triton' supports float16, bfloat16 and float32 .*float64"):
        alibi_attention_varlen(*packed(dtype=torch.float64), CU, backend="triton")


def test_varlen_bad_backend_and_triton_rejections(monkeypatch):
    with pytest.raises(ValueError, match=r"backend must be one of .*'cuda'"):
        alibi_attention_varlen(*packed(), CU, backend="cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match=r"TRITON_INTERPRET=1.*backend='torch'"):
        alibi_attention_varlen(*packed(), CU, backend="triton")


@pytest.mark.parametrize("max_seqlen", [None, -1])
def test_varlen_trusted_offsets_need_a_non_negative_max_seqlen(max_seqlen):
    from alibi_kernels.validation import check_varlen_inputs

    with pytest.raises(
        ValueError, match=rf"max_seqlen must be given and >= 0 when cu_seqlens is trusted, got {max_seqlen}"
    ):
        check_varlen_inputs(*packed(), CU, max_seqlen, None, None, read_offsets=False)
