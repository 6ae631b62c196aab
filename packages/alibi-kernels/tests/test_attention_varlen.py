"""`alibi_attention_varlen` (packed documents, cu_seqlens) on both backends against a float64 per-document reference.

Documents of 1, 17, 64, 0 and 100 tokens cover a one-token document, tails, a multiple of the interpreter's 32-row
tile, an empty document and several tiles; [5] is a single short document. Triton runs under the interpreter.
"""

from __future__ import annotations

import os

import pytest
import torch
from attention_cases import (
    FP32_GRAD_RTOL,
    NEEDS_INTERPRETER,
    assert_fp32_close,
    assert_within_twice_torch_error,
    forward_backward,
    same_kernels,
)

from alibi_kernels import alibi_attention, alibi_attention_varlen, alibi_attention_varlen_reference

MIXED = [1, 17, 64, 0, 100]
NAMES = ("dq", "dk", "dv", "dslopes")


def make_packed(lengths, hq, hkv, d, *, dtype=torch.float32, strided=False, seed=0, device="cpu"):
    """Packed q, k, v, grad-output (total, H, D), slopes (Hq,) and int32 cu_seqlens; `strided` gives non-contiguous
    views: q and the grad-output as slices of wider tensors, k and v as transposes of (H, total, D)."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)

    def rand(h, kind):
        if not strided:
            return torch.randn(total, h, d, generator=gen).to(dtype)
        if kind == "kv":
            return torch.randn(h, total, d, generator=gen).to(dtype).transpose(0, 1)
        return torch.randn(total, 2 * h, d + 8, generator=gen).to(dtype)[:, ::2, 3 : 3 + d]

    q, k, v, do = rand(hq, "q"), rand(hkv, "kv"), rand(hkv, "kv"), rand(hq, "q")
    slopes = torch.rand(hq, generator=gen) * 0.9 + 0.01
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return [t.to(device) for t in (q, k, v, do, slopes, cu)]


def varlen_path(cu, backend, max_seqlen=None):
    def fn(q, k, v, s, *, causal):
        return alibi_attention_varlen(q, k, v, cu, max_seqlen, s, causal=causal, backend=backend)

    return fn


def reference_varlen(q, k, v, do, slopes, cu, *, causal, slopes_grad=False, compute_dtype=torch.float64):
    def ref(q, k, v, s, *, causal):
        return alibi_attention_varlen_reference(q, k, v, cu, s, causal=causal, compute_dtype=compute_dtype)

    qc, kc, vc, doc = (t.detach().to(compute_dtype) for t in (q, k, v, do))
    return forward_backward(ref, qc, kc, vc, doc, slopes.double(), causal=causal, slopes_grad=slopes_grad)


def check_against_reference(backend, lengths, hq, hkv, d, causal, dtype, strided, slopes_grad, seed):
    q, k, v, do, slopes, cu = make_packed(lengths, hq, hkv, d, dtype=dtype, strided=strided, seed=seed)
    fn = varlen_path(cu, backend)
    out, grads = forward_backward(fn, q, k, v, do, slopes, causal=causal, slopes_grad=slopes_grad)
    ref_out, ref_grads = reference_varlen(q, k, v, do, slopes, cu, causal=causal, slopes_grad=slopes_grad)
    assert out.shape == q.shape and out.dtype == dtype
    for name, g, r in zip(NAMES, grads, ref_grads, strict=False):
        assert g.shape == r.shape and g.dtype == (slopes.dtype if name == "dslopes" else dtype), name
    if dtype == torch.float32:
        assert_fp32_close("out", out, ref_out)
        for name, g, r in zip(NAMES, grads, ref_grads, strict=False):
            assert_fp32_close(name, g, r, rtol=FP32_GRAD_RTOL)
    else:
        pt_out, pt_grads = reference_varlen(q, k, v, do, slopes, cu, causal=causal, slopes_grad=slopes_grad,
                                            compute_dtype=dtype)  # fmt: skip
        assert_within_twice_torch_error("out", out, ref_out, pt_out)
        for name, g, r, p in zip(NAMES, grads, ref_grads, pt_grads, strict=False):
            assert_within_twice_torch_error(name, g, r, p)


# (lengths, Hq, Hkv, D, causal, dtype, strided, slopes_grad)
TRITON_CASES = [
    (MIXED, 1, 1, 16, True, torch.float32, False, True),
    (MIXED, 4, 1, 80, False, torch.float32, True, False),
    (MIXED, 6, 2, 16, True, torch.float16, True, False),
    ([5], 6, 2, 16, True, torch.float32, True, True),
    ([5], 1, 1, 80, False, torch.float32, False, False),
    ([17, 40], 4, 1, 16, False, torch.bfloat16, False, False),
]
TORCH_CASES = [
    (lengths, hq, hkv, d, causal, torch.float32, (i + hq) % 2 == 0, causal and d == 16)
    for i, lengths in enumerate([MIXED, [5]])
    for hq, hkv in ((1, 1), (4, 1), (6, 2))
    for d in (16, 80)
    for causal in (True, False)
] + [(MIXED, 6, 2, 80, True, torch.float16, True, False), (MIXED, 4, 1, 16, False, torch.bfloat16, False, False)]


def case_id(case):
    lengths, hq, hkv, d, causal, dtype, strided, sg = case
    docs = "-".join(map(str, lengths))
    return f"docs{docs}-H{hq}/{hkv}-D{d}-{'causal' if causal else 'full'}-{str(dtype)[6:]}" + (
        ("-strided" if strided else "") + ("-slopegrad" if sg else "")
    )


@pytest.mark.parametrize("case", TORCH_CASES, ids=[case_id(c) for c in TORCH_CASES])
def test_torch_path_matches_float64_reference(case):
    check_against_reference("torch", *case, seed=TORCH_CASES.index(case))


@pytest.mark.parametrize("case", [pytest.param(c, marks=NEEDS_INTERPRETER, id=case_id(c)) for c in TRITON_CASES])
def test_triton_matches_float64_reference(case):
    check_against_reference("triton", *case, seed=100 + TRITON_CASES.index(case))


BACKENDS = [pytest.param("torch", id="torch"), pytest.param("triton", marks=NEEDS_INTERPRETER, id="triton")]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("backend", BACKENDS)
def test_documents_are_isolated(backend, causal):
    """New tokens in document 1 change nothing in documents 0 and 2, outputs and gradients (bit for bit)."""
    q, k, v, do, slopes, cu = make_packed([20, 33, 40], 2, 1, 16, seed=3)
    fn = varlen_path(cu, backend)
    out, grads = forward_backward(fn, q, k, v, do, slopes, causal=causal)
    q2, k2, v2 = (t.clone() for t in (q, k, v))
    for t in (q2, k2, v2):
        t[20:53] = torch.randn(33, *t.shape[1:])  # document 1 only
    out2, grads2 = forward_backward(fn, q2, k2, v2, do, slopes, causal=causal)
    others = torch.cat([torch.arange(0, 20), torch.arange(53, 93)])
    assert torch.equal(out[others], out2[others])
    for name, g, g2 in zip(NAMES, grads, grads2, strict=False):
        assert torch.equal(g[others], g2[others]), name
    assert not torch.allclose(out[20:53], out2[20:53])  # the changed document did change


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("backend", BACKENDS)
def test_positions_restart_in_each_document(backend, causal):
    """Document 2 packed after others gives what alibi_attention gives on it alone as a (1, H, T, D) batch."""
    q, k, v, _, slopes, cu = make_packed([7, 33, 40], 6, 2, 16, strided=True, seed=4)
    packed = alibi_attention_varlen(q, k, v, cu, None, slopes, causal=causal, backend=backend)
    alone = alibi_attention(
        *(t[40:80].transpose(0, 1).unsqueeze(0) for t in (q, k, v)), slopes, causal=causal, backend=backend
    )  # (1, Hq, 40, D)
    assert torch.allclose(packed[40:80], alone[0].transpose(0, 1), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_int64_cu_seqlens_and_a_larger_max_seqlen_give_the_same_result(backend):
    q, k, v, _, slopes, cu = make_packed([9, 0, 40], 4, 1, 16, seed=5)
    base = alibi_attention_varlen(q, k, v, cu, None, slopes, backend=backend)
    other = alibi_attention_varlen(q, k, v, cu.long(), 100, slopes, backend=backend)  # extra grid rows return
    assert torch.equal(base, other)


@pytest.mark.parametrize("backend", BACKENDS)
def test_only_empty_documents(backend):
    q, k, v, do, slopes, _ = make_packed([0], 2, 1, 16)
    cu = torch.tensor([0, 0, 0], dtype=torch.int32)
    out, grads = forward_backward(varlen_path(cu, backend), q, k, v, do, slopes, causal=True)
    assert out.shape == (0, 2, 16) and grads[0].shape == (0, 2, 16)


@pytest.mark.parametrize("causal", [True, False])
def test_gradcheck_float64_torch_path_including_slopes(causal):
    q, k, v, _, slopes, cu = make_packed([2, 0, 3], 2, 1, 16, dtype=torch.float64, strided=True, seed=6)
    inputs = [t.detach().clone().requires_grad_(True) for t in (q, k, v, slopes.double())]

    def fn(q, k, v, s):
        return alibi_attention_varlen(q, k, v, cu, None, s, causal=causal, backend="torch")

    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cu_seqlens_is_read_back_except_on_triton_with_max_seqlen(backend, monkeypatch):
    # a device-to-host copy per call (per layer, in a model) stalls a GPU; flash-attn trusts cu_seqlens instead
    q, k, v, _, slopes, cu = make_packed([9, 0, 40], 4, 1, 16, seed=8)
    expected = alibi_attention_varlen(q, k, v, cu, None, slopes, backend=backend)
    reads = []
    tolist = torch.Tensor.tolist

    def watched(self):
        reads.append(self.data_ptr() == cu.data_ptr())
        return tolist(self)

    monkeypatch.setattr(torch.Tensor, "tolist", watched)
    assert torch.equal(alibi_attention_varlen(q, k, v, cu, 40, slopes, backend=backend), expected)
    assert any(reads) == (backend == "torch")
    reads.clear()
    alibi_attention_varlen(q, k, v, cu, None, slopes, backend=backend)
    assert any(reads)  # without max_seqlen both backends read and check the offsets


def test_auto_on_cpu_uses_the_torch_path():
    q, k, v, _, slopes, cu = make_packed([3, 12], 4, 2, 16, seed=7)
    auto = alibi_attention_varlen(q, k, v, cu, None, slopes)
    assert torch.equal(auto, alibi_attention_varlen(q, k, v, cu, None, slopes, backend="torch"))


# ---------------------------------------------------------------- GPU (marker `gpu`; tools/gpu_check_kernels.py)
GPU_QUICK = os.environ.get("ALIBI_KERNELS_GPU_GRID", "full") == "quick"
GPU_DOCS = [1, 17, 1000, 0, 4096, 300]
GPU_GRID = [
    (hq, hkv, d, causal, dtype)
    for hq, hkv in ((4, 1), (6, 2))
    for d in ((80, 128) if GPU_QUICK else (64, 80, 128))
    for causal in (True, False)
    for dtype in (torch.float16, torch.bfloat16)
]


def gpu_varlen_inputs(hq, hkv, d, causal, dtype, device="cuda"):
    """Packed inputs of one GPU_GRID case: q, k, v, grad-output, slopes, cu_seqlens. Half the cases are strided, so
    that each dtype and each causality gets both layouts."""
    idx = GPU_GRID.index((hq, hkv, d, causal, dtype))
    strided = (idx + idx // 2) % 2 == 1  # idx % 2 is the dtype, idx // 2 % 2 the causality
    return make_packed(GPU_DOCS, hq, hkv, d, dtype=dtype, strided=strided, seed=idx, device=device)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("hq", "hkv", "d", "causal", "dtype"),
    [pytest.param(*c, marks=same_kernels(f"varlen-{c[4]}-D{c[2]}")) for c in GPU_GRID],
)
def test_gpu_varlen_half_precision(hq, hkv, d, causal, dtype):
    q, k, v, do, slopes, cu = gpu_varlen_inputs(hq, hkv, d, causal, dtype)
    out, grads = forward_backward(varlen_path(cu, "triton"), q, k, v, do, slopes, causal=causal)
    ref_out, ref_grads = reference_varlen(q, k, v, do, slopes, cu, causal=causal)
    pt_out, pt_grads = reference_varlen(q, k, v, do, slopes, cu, causal=causal, compute_dtype=dtype)
    assert out.dtype == dtype
    assert_within_twice_torch_error("out", out, ref_out, pt_out)
    for name, g, r, p in zip(NAMES, grads, ref_grads, pt_grads, strict=False):
        assert_within_twice_torch_error(name, g, r, p)


@pytest.mark.gpu
def test_gpu_varlen_fp32_with_slope_grad_and_int64_cu_seqlens():
    q, k, v, do, slopes, cu = make_packed([100, 0, 2048, 513], 6, 2, 64, strided=True, seed=1, device="cuda")
    out, grads = forward_backward(varlen_path(cu.long(), "triton"), q, k, v, do, slopes, causal=True, slopes_grad=True)
    ref_out, ref_grads = reference_varlen(q, k, v, do, slopes, cu, causal=True, slopes_grad=True)
    assert_fp32_close("out", out, ref_out)
    for name, g, r in zip(NAMES, grads, ref_grads, strict=True):
        assert_fp32_close(name, g, r, rtol=FP32_GRAD_RTOL)


@pytest.mark.gpu
@pytest.mark.parametrize("autotune", ["0", pytest.param("1", marks=same_kernels("autotune-varlen"))])
def test_gpu_varlen_document_equals_alibi_attention_alone(monkeypatch, autotune):
    monkeypatch.setenv("ALIBI_KERNELS_AUTOTUNE", autotune)
    q, k, v, _, slopes, cu = make_packed([300, 4096, 1000], 8, 2, 128, dtype=torch.bfloat16, seed=2, device="cuda")
    packed = alibi_attention_varlen(q, k, v, cu, None, slopes, backend="triton")
    alone = alibi_attention(*(t[300:4396].transpose(0, 1).unsqueeze(0) for t in (q, k, v)), slopes, backend="triton")
    assert (packed[300:4396].float() - alone[0].transpose(0, 1).float()).abs().max().item() < 1e-2
    assert torch.equal(alibi_attention_varlen(q, k, v, cu, None, slopes), packed)  # auto is Triton on CUDA
