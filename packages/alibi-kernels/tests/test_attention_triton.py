"""The Triton kernels under the interpreter (CPU) on a covering subset of the torch path's grid.

Every value of every axis appears at least once: T in {1, 17, 64, 100, 257}, D in {16, 32, 64, 80, 128} (plus 24
and 256 for padding and the upper bound), heads 1/1, 4/1, 6/2, 12/12, causal and not, Tq != Tk, non-contiguous
inputs and grad outputs, per-batch slopes, slope gradients, fp32/fp16/bf16. T*T*H stays small: the interpreter
runs every program instance in Python.
"""

from __future__ import annotations

import pytest
import torch
from attention_cases import (
    FP32_GRAD_RTOL,
    NEEDS_INTERPRETER,
    assert_fp32_close,
    assert_within_twice_torch_error,
    forward_backward,
    make_inputs,
    reference_fwd_bwd,
)

from alibi_kernels import alibi_attention
from alibi_kernels.launch_configs import KERNELS, TileConfig, candidate_configs

pytestmark = NEEDS_INTERPRETER

# (B, Hq, Hkv, Tq, Tk, D, causal, dtype, layout, per_batch_slopes, slopes_grad)
CASES = [
    (2, 12, 12, 1, 1, 16, True, torch.float32, "bthd", False, False),
    (2, 6, 2, 17, 17, 32, False, torch.float32, "bhtd", True, True),
    (1, 4, 1, 64, 64, 64, True, torch.float16, "bthd", False, False),
    (1, 1, 1, 100, 100, 80, True, torch.float32, "bthd", False, True),
    (1, 1, 1, 257, 257, 128, True, torch.float32, "bhtd", False, False),
    (1, 4, 1, 100, 100, 128, False, torch.bfloat16, "bthd", True, False),
    (1, 4, 1, 1, 257, 64, True, torch.float32, "bthd", False, False),  # KV-cache decoding
    (2, 6, 2, 17, 100, 80, True, torch.float32, "bthd", True, True),  # chunked prefill, Tq < Tk
    (1, 1, 1, 100, 17, 32, False, torch.float16, "bhtd", False, False),  # Tq > Tk, non-causal
    (1, 12, 12, 17, 17, 24, True, torch.float32, "bthd", False, False),  # D=24 padded to 32
    (1, 2, 1, 17, 64, 256, False, torch.float32, "bthd", False, False),  # largest head dim
    (1, 6, 2, 64, 64, 16, True, torch.bfloat16, "bthd", False, True),
]


def triton_path(q, k, v, s, *, causal):
    return alibi_attention(q, k, v, s, causal=causal, backend="triton")


def case_id(case):
    b, hq, hkv, tq, tk, d, causal, dtype, layout, pbs, sg = case
    return f"B{b}-H{hq}/{hkv}-T{tq}x{tk}-D{d}-{'causal' if causal else 'full'}-{str(dtype)[6:]}-{layout}" + (
        "-slopegrad" if sg else ""
    )


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_triton_matches_float64_reference(case):
    b, hq, hkv, tq, tk, d, causal, dtype, layout, per_batch, slopes_grad = case
    q, k, v, do, slopes = make_inputs(
        b, hq, hkv, tq, tk, d, dtype=dtype, layout=layout, per_batch_slopes=per_batch, seed=CASES.index(case)
    )
    out, grads = forward_backward(triton_path, q, k, v, do, slopes, causal=causal, slopes_grad=slopes_grad)
    ref_out, ref_grads = reference_fwd_bwd(q, k, v, do, slopes, causal=causal, slopes_grad=slopes_grad)
    assert out.shape == q.shape and out.dtype == dtype
    names = ("dq", "dk", "dv", "dslopes")
    if dtype == torch.float32:
        assert_fp32_close("out", out, ref_out)
        for name, g, r in zip(names, grads, ref_grads, strict=False):
            assert g.shape == r.shape, name
            assert_fp32_close(name, g, r, rtol=FP32_GRAD_RTOL)
    else:
        pt_out, pt_grads = reference_fwd_bwd(q, k, v, do, slopes, causal=causal, slopes_grad=slopes_grad,
                                             compute_dtype=dtype)  # fmt: skip
        assert_within_twice_torch_error("out", out, ref_out, pt_out)
        for name, g, r, p in zip(names, grads, ref_grads, pt_grads, strict=False):
            assert_within_twice_torch_error(name, g, r, p)


def test_triton_and_torch_paths_agree_on_decoding_steps():
    q, k, v, _, slopes = make_inputs(1, 6, 2, 33, 33, 32, seed=21)
    full = alibi_attention(q, k, v, slopes, backend="torch")
    for t in (1, 16, 33):
        step = alibi_attention(q[:, :, t - 1 : t], k[:, :, :t], v[:, :, :t], slopes, backend="triton")
        assert torch.allclose(step, full[:, :, t - 1 : t], rtol=1e-5, atol=1e-6), t


def test_triton_rejects_float64():
    q, k, v, _, _ = make_inputs(1, 1, 1, 4, 4, 16, dtype=torch.float64)
    with pytest.raises(ValueError, match="float64"):
        alibi_attention(q, k, v, backend="triton")


# Every (BLOCK_M, BLOCK_N) any kernel may launch with on a GPU (warps and stages do not exist in the interpreter).
TILE_SHAPES = sorted(
    {
        (c.block_m, c.block_n)
        for kernel in KERNELS
        for dtype in (torch.bfloat16, torch.float32)
        for d in (64, 128, 256)
        for c in candidate_configs(kernel, dtype, d)
    }
)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(("block_m", "block_n"), TILE_SHAPES, ids=[f"{m}x{n}" for m, n in TILE_SHAPES])
def test_every_candidate_tile_shape_matches_float64(block_m, block_n, causal):
    """Each tile shape of every kernel, pinned for all three: partial row and key tiles, Tq < Tk, GQA, slopes."""
    from alibi_kernels.attention_triton import pinned_configs

    tile = TileConfig(block_m, block_n, 4, 1)
    q, k, v, do, slopes = make_inputs(1, 4, 2, 70, 150, 32, layout="bthd", seed=block_m + block_n)
    with pinned_configs(fwd=tile, dkdv=tile, dq=tile):
        out, grads = forward_backward(triton_path, q, k, v, do, slopes, causal=causal, slopes_grad=True)
    ref_out, ref_grads = reference_fwd_bwd(q, k, v, do, slopes, causal=causal, slopes_grad=True)
    assert_fp32_close("out", out, ref_out)
    for name, g, r in zip(("dq", "dk", "dv", "dslopes"), grads, ref_grads, strict=True):
        assert_fp32_close(name, g, r, rtol=FP32_GRAD_RTOL)


def test_pinned_configs_rejects_an_unknown_kernel():
    from alibi_kernels.attention_triton import pinned_configs

    message = r"pinned_configs takes the kernels \('fwd', 'dkdv', 'dq'\), got \['bwd'\]"
    with pytest.raises(ValueError, match=message), pinned_configs(bwd=TileConfig(32, 32, 4, 1)):
        pass


def test_t_bucket():
    import alibi_kernels.attention_triton as at

    assert at._t_bucket(1, 512) == 512 and at._t_bucket(513, 513) == 2048 and at._t_bucket(1, 4096) == 8192
