"""Triton forward kernel: causal ALiBi attention with online softmax, the bias computed from the slopes in-kernel.

One program handles BLOCK_M query rows of one (batch, query head). Scores are kept in log2 units
(scale and slope pre-multiplied by log2(e)) so the softmax uses exp2. Fully visible key blocks run without any
mask; only the blocks that cross the causal diagonal or the end of the keys are masked; blocks above the diagonal
are never visited. Head dims that are not powers of two are padded to BLOCK_D with masked loads.
With VARLEN the same kernel runs packed documents (cu_seqlens): program axis 1 is (document, head), rows start at
cu_seqlens[doc], each document is its own sequence (positions from 0, no attention across documents).
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def load_tile(
    base,  # pointer to row 0, column 0 of the tile's matrix
    offs_r,  # (R,) row indices
    offs_d,  # (BLOCK_D,) head-dim indices
    stride_r,  # stride between rows
    stride_d,  # stride along the head dim
    n_rows,  # rows at or past this index read as 0 (only with ROW_MASK)
    ROW_MASK: tl.constexpr,  # the tile may cross the end of the rows
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Load an (R, BLOCK_D) tile; masks only what can be out of bounds, so full power-of-two tiles load unmasked."""
    ptrs = base + offs_r[:, None] * stride_r + offs_d[None, :] * stride_d
    if ROW_MASK:
        if BLOCK_D == HEAD_DIM:
            tile = tl.load(ptrs, mask=offs_r[:, None] < n_rows, other=0.0)
        else:
            tile = tl.load(ptrs, mask=(offs_r[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM), other=0.0)
    else:
        if BLOCK_D == HEAD_DIM:  # noqa: SIM108 (constexpr branches, kept parallel to the masked ones)
            tile = tl.load(ptrs)
        else:
            tile = tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    return tile


@triton.jit
def _fwd_inner(
    acc,  # (BLOCK_M, BLOCK_D) fp32 running numerator
    l_i,  # (BLOCK_M,) fp32 running denominator
    m_i,  # (BLOCK_M,) fp32 running max, log2 units
    q,  # (BLOCK_M, BLOCK_D) query tile
    k_base,  # pointer to K[b, hkv, 0, 0]
    v_base,  # pointer to V[b, hkv, 0, 0]
    stride_kn,  # K stride along keys
    stride_kd,  # K stride along the head dim
    stride_vn,  # V stride along keys
    stride_vd,  # V stride along the head dim
    pos_i,  # (BLOCK_M,) int32 query positions (i + Tk - Tq)
    offs_d,  # (BLOCK_D,) head-dim offsets
    start,  # first key of the range (a multiple of BLOCK_N)
    stop,  # one past the last key of the range
    slope2,  # fp32 slope * log2(e)
    qk_scale,  # fp32 softmax scale * log2(e)
    Tk,  # number of keys
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MASKED: tl.constexpr,  # apply the key-bound and causal masks (diagonal and tail blocks only)
    IS_CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr,  # compute the dots in fp32 (bf16 under the interpreter)
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs: TF32 would cost ~1e-3 relative error
):
    for start_n in range(start, stop, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = load_tile(k_base, offs_n, offs_d, stride_kn, stride_kd, Tk, MASKED, HEAD_DIM, BLOCK_D)
        v = load_tile(v_base, offs_n, offs_d, stride_vn, stride_vd, Tk, MASKED, HEAD_DIM, BLOCK_D)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N)
        distance = (offs_n[None, :] - pos_i[:, None]).to(tl.float32)  # pos_j - pos_i, <= 0 when visible
        s = qk * qk_scale + slope2 * distance
        if MASKED:
            visible = offs_n[None, :] < Tk
            if IS_CAUSAL:
                visible = visible & (offs_n[None, :] <= pos_i[:, None])
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


# Triton compiles one kernel per specialisation of its int arguments (value 1, divisible by 16). Sizes, head counts
# and slope strides only feed masks and scalar index arithmetic here: specialising them would only multiply the
# compilations (every decoding step's length class, GQA ratio 1 or not) for no faster code. The tensor strides stay
# specialised (aligned vector loads). The backward kernels leave the same arguments unspecialised.
@triton.jit(do_not_specialize=["H", "GROUP", "Tq", "Tk", "T_BUCKET", "stride_sb", "stride_sh"])
def alibi_fwd_kernel(
    Q,  # (B, Hq, Tq, D) queries, any strides
    K,  # (B, Hkv, Tk, D) keys, any strides
    V,  # (B, Hkv, Tk, D) values, any strides
    Slopes,  # (B or 1, Hq) fp32 slopes; stride_sb = 0 broadcasts one row over the batch
    Out,  # (B, Hq, Tq, D) output, any strides
    Lse,  # (B * Hq, Tq) fp32 log-sum-exp in log2 units, saved for the backward; (Hq, total) with VARLEN
    CuSeqlens,  # (documents + 1,) int document boundaries in the token axis; read only with VARLEN
    stride_qb,
    stride_qh,
    stride_qm,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_vd,
    stride_ob,
    stride_oh,
    stride_om,
    stride_od,
    stride_sb,
    stride_sh,
    H,  # query heads
    GROUP,  # query heads per k/v head (GQA): hkv = h // GROUP
    Tq,  # number of queries; with VARLEN the total packed tokens (the row stride of Lse)
    Tk,  # number of keys; unused with VARLEN (each document attends to itself)
    qk_scale,  # softmax scale * log2(e)
    T_BUCKET,  # coarse bucket of max(Tq, Tk) (max_seqlen with VARLEN): only an autotuning key
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM rounded up to a power of two
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    VARLEN: tl.constexpr,  # packed documents: b is the document, strides *_b are 0, rows start at cu_seqlens[b]
):
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)  # int64 base offsets: B * H * T * D may exceed 2^31
    h = (bh % H).to(tl.int64)
    hkv = h // GROUP
    seq0 = b * 0  # first token of the sequence in the token axis
    lse_row = Lse + bh.to(tl.int64) * Tq
    if VARLEN:
        seq0 = tl.load(CuSeqlens + b).to(tl.int64)
        lse_row = Lse + h * Tq + seq0
        Tq = (tl.load(CuSeqlens + b + 1) - seq0).to(tl.int32)
        Tk = Tq
        if start_m >= Tq:  # the grid covers max_seqlen; shorter documents have nothing here
            return
    offset = Tk - Tq
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    pos_i = offs_m + offset

    slope2 = tl.load(Slopes + b * stride_sb + h * stride_sh).to(tl.float32) * 1.4426950408889634
    q_mask = (offs_m[:, None] < Tq) & (offs_d[None, :] < HEAD_DIM)
    q_base = Q + b * stride_qb + seq0 * stride_qm + h * stride_qh
    q = load_tile(q_base, offs_m, offs_d, stride_qm, stride_qd, Tq, True, HEAD_DIM, BLOCK_D)
    if UPCAST:
        q = q.to(tl.float32)
    k_base = K + b * stride_kb + seq0 * stride_kn + hkv * stride_kh
    v_base = V + b * stride_vb + seq0 * stride_vn + hkv * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if IS_CAUSAL:
        # Keys before the block's first query position are visible to every row: no mask there.
        n_full = ((start_m + offset + 1) // BLOCK_N) * BLOCK_N
        hi = tl.minimum(Tk, start_m + BLOCK_M + offset)
    else:
        n_full = (Tk // BLOCK_N) * BLOCK_N
        hi = Tk
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd, pos_i, offs_d,
        0, n_full, slope2, qk_scale, Tk,
        BLOCK_N, HEAD_DIM, BLOCK_D, False, IS_CAUSAL, UPCAST, DOT_PRECISION,
    )  # fmt: skip
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd, pos_i, offs_d,
        n_full, hi, slope2, qk_scale, Tk,
        BLOCK_N, HEAD_DIM, BLOCK_D, True, IS_CAUSAL, UPCAST, DOT_PRECISION,
    )  # fmt: skip

    acc = acc / l_i[:, None]
    row_ok = offs_m < Tq
    tl.store(lse_row + offs_m, m_i + tl.math.log2(l_i), mask=row_ok)
    o_base = Out + b * stride_ob + seq0 * stride_om + h * stride_oh
    o_ptrs = o_base + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od
    tl.store(o_ptrs, acc.to(Out.dtype.element_ty), mask=q_mask)


def forward_configs(block_d: int) -> list[triton.Config]:
    """Autotuning candidates per head dim (GPU only): smaller tiles for large D to fit shared memory."""
    if block_d <= 64:
        shapes = [(128, 64, 4, 3), (128, 128, 8, 3), (64, 64, 4, 4), (128, 32, 4, 4)]
    elif block_d <= 128:
        shapes = [(128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3), (128, 32, 4, 3)]
    else:
        shapes = [(64, 64, 4, 2), (128, 32, 8, 2), (64, 32, 4, 2), (32, 32, 4, 2)]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in shapes]
