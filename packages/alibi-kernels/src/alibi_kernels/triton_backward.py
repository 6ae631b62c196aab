"""Triton backward kernels for ALiBi attention, recomputing probabilities from the saved log-sum-exp.

Two kernels, as in FlashAttention-2: `alibi_bwd_dkdv_kernel` owns a block of keys of one k/v head and loops over
the query heads of its GQA group and over the query blocks that can see those keys (the ones below the causal
diagonal), accumulating dK and dV in fp32 registers (no atomics, no per-head buffers);
`alibi_bwd_dq_kernel` owns a block of queries and loops over the visible key blocks, accumulating dQ and,
when asked, this block's share of the slope gradient sum_ij dS_ij * (pos_j - pos_i).
With P = softmax(S) and Delta_i = sum_d dO_id * O_id: dS = P * (dP - Delta), dQ = scale dS K, dK = scale dS^T Q,
dV = P^T dO.
With VARLEN both kernels run packed documents, as the forward does (see `alibi_fwd_kernel`): Lse and Delta are then
(Hq, total) and dQ, dK, dV are contiguous (total, H, D).
"""

from __future__ import annotations

import triton
import triton.language as tl

from alibi_kernels.triton_forward import load_tile


@triton.jit
def _dkdv_inner(
    dk,  # (BLOCK_N, BLOCK_D) fp32 accumulator
    dv,  # (BLOCK_N, BLOCK_D) fp32 accumulator
    k,  # (BLOCK_N, BLOCK_D) key tile
    v,  # (BLOCK_N, BLOCK_D) value tile
    offs_n,  # (BLOCK_N,) key positions
    offs_d,  # (BLOCK_D,) head-dim offsets
    q_base,  # pointer to Q[b, h, 0, 0]
    do_base,  # pointer to DO[b, h, 0, 0]
    lse_base,  # pointer to Lse[b * Hq + h, 0]
    delta_base,  # pointer to Delta[b * Hq + h, 0]
    stride_qm,
    stride_qd,
    stride_dom,
    stride_dod,
    start,  # first query row (a multiple of BLOCK_M)
    offset,  # Tk - Tq: pos_i = i + offset
    slope2,  # slope * log2(e)
    qk_scale,  # softmax scale * log2(e)
    Tq,
    Tk,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # One loop over every query block, each tile masked. Three copies of this loop (masked diagonal, unmasked
    # middle, masked tail, as the forward and dQ kernels have) kept three sets of loop state live beside k, v, dK
    # and dV and spilled registers in every config; one copy spills in none of the 16-bit candidates at head dims
    # 64 and 128 on sm_80..sm_90 (tests/test_launch_fit.py), for a few integer ops per score.
    for start_m in range(start, Tq, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = load_tile(q_base, offs_m, offs_d, stride_qm, stride_qd, Tq, True, HEAD_DIM, BLOCK_D)
        do = load_tile(do_base, offs_m, offs_d, stride_dom, stride_dod, Tq, True, HEAD_DIM, BLOCK_D)
        if UPCAST:
            q = q.to(tl.float32)
            do = do.to(tl.float32)
        lse = tl.load(lse_base + offs_m, mask=offs_m < Tq, other=0.0)
        delta = tl.load(delta_base + offs_m, mask=offs_m < Tq, other=0.0)
        pos_i = offs_m + offset
        qk_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)  # (BLOCK_N, BLOCK_M)
        distance_t = (offs_n[:, None] - pos_i[None, :]).to(tl.float32)
        p_t = tl.math.exp2(qk_t * qk_scale + slope2 * distance_t - lse[None, :])
        visible = (offs_n[:, None] < Tk) & (offs_m[None, :] < Tq)
        if IS_CAUSAL:
            visible = visible & (distance_t <= 0)
        p_t = tl.where(visible, p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # (BLOCK_N, BLOCK_M)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit(do_not_specialize=["H", "HKV", "GROUP", "Tq", "Tk", "T_BUCKET", "stride_sb", "stride_sh"])  # see forward
def alibi_bwd_dkdv_kernel(
    Q,  # (B, Hq, Tq, D) queries, any strides
    K,  # (B, Hkv, Tk, D) keys, any strides
    V,  # (B, Hkv, Tk, D) values, any strides
    Slopes,  # (B or 1, Hq) fp32
    DO,  # (B, Hq, Tq, D) gradient of the output, any strides
    Lse,  # (B * Hq, Tq) fp32, log2 units, from the forward; (Hq, total) with VARLEN
    Delta,  # (B * Hq, Tq) fp32 rowsum(dO * O); (Hq, total) with VARLEN
    DK,  # (B, Hkv, Tk, D) output, contiguous; (total, Hkv, D) with VARLEN
    DV,  # (B, Hkv, Tk, D) output, contiguous; (total, Hkv, D) with VARLEN
    CuSeqlens,  # (documents + 1,) int document boundaries; read only with VARLEN
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
    stride_dob,
    stride_doh,
    stride_dom,
    stride_dod,
    stride_sb,
    stride_sh,
    H,  # query heads
    HKV,  # k/v heads
    GROUP,  # query heads per k/v head
    Tq,  # queries; with VARLEN the total packed tokens (the row stride of Lse and Delta)
    Tk,  # keys; unused with VARLEN
    sm_scale,  # softmax scale (natural units)
    qk_scale,  # softmax scale * log2(e)
    T_BUCKET,  # autotuning key only
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,  # query rows per step
    BLOCK_N: tl.constexpr,  # keys owned by this program
    IS_CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    VARLEN: tl.constexpr,  # packed documents: b is the document, strides *_b are 0, rows start at cu_seqlens[b]
):
    start_n = tl.program_id(0) * BLOCK_N
    bhkv = tl.program_id(1)
    b = (bhkv // HKV).to(tl.int64)
    hkv = (bhkv % HKV).to(tl.int64)
    seq0 = b * 0  # first token of the sequence in the token axis
    lse_b = b * H * Tq  # Lse/Delta offset of (sequence, head 0); head h adds h * Tq
    lse_h = Tq
    if VARLEN:
        seq0 = tl.load(CuSeqlens + b).to(tl.int64)
        lse_b = seq0
        Tq = (tl.load(CuSeqlens + b + 1) - seq0).to(tl.int32)
        Tk = Tq
        if start_n >= Tk:  # the grid covers max_seqlen; shorter documents have nothing here
            return
    offset = Tk - Tq
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    k_base = K + b * stride_kb + seq0 * stride_kn + hkv * stride_kh
    v_base = V + b * stride_vb + seq0 * stride_vn + hkv * stride_vh
    k = load_tile(k_base, offs_n, offs_d, stride_kn, stride_kd, Tk, True, HEAD_DIM, BLOCK_D)
    v = load_tile(v_base, offs_n, offs_d, stride_vn, stride_vd, Tk, True, HEAD_DIM, BLOCK_D)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    lo = 0
    if IS_CAUSAL:  # query rows before start_n - offset see none of these keys
        lo = (tl.maximum(start_n - offset, 0) // BLOCK_M) * BLOCK_M
    for g in range(0, GROUP):
        h = hkv * GROUP + g
        slope2 = tl.load(Slopes + b * stride_sb + h * stride_sh).to(tl.float32) * 1.4426950408889634
        q_base = Q + b * stride_qb + seq0 * stride_qm + h * stride_qh
        do_base = DO + b * stride_dob + seq0 * stride_dom + h * stride_doh
        lse_base = Lse + lse_b + h * lse_h
        delta_base = Delta + lse_b + h * lse_h
        dk, dv = _dkdv_inner(
            dk, dv, k, v, offs_n, offs_d, q_base, do_base, lse_base, delta_base, stride_qm, stride_qd, stride_dom,
            stride_dod, lo, offset, slope2, qk_scale, Tq, Tk,
            BLOCK_M, HEAD_DIM, BLOCK_D, IS_CAUSAL, UPCAST, DOT_PRECISION,
        )  # fmt: skip
    dk = dk * sm_scale
    kv_mask = (offs_n[:, None] < Tk) & (offs_d[None, :] < HEAD_DIM)
    if VARLEN:
        out_off = (seq0 + offs_n[:, None]) * (HKV * HEAD_DIM) + hkv * HEAD_DIM + offs_d[None, :]
    else:
        out_off = bhkv.to(tl.int64) * Tk * HEAD_DIM + offs_n[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(DK + out_off, dk.to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + out_off, dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _dq_inner(
    dq,  # (BLOCK_M, BLOCK_D) fp32 accumulator
    dslope,  # (BLOCK_M,) fp32 accumulator of sum_j dS_ij * (pos_j - pos_i)
    q,  # (BLOCK_M, BLOCK_D) query tile
    do,  # (BLOCK_M, BLOCK_D) output-gradient tile
    lse,  # (BLOCK_M,) log2 units
    delta,  # (BLOCK_M,)
    offs_m,  # (BLOCK_M,) query rows
    pos_i,  # (BLOCK_M,) query positions
    offs_d,
    k_base,  # pointer to K[b, hkv, 0, 0]
    v_base,  # pointer to V[b, hkv, 0, 0]
    stride_kn,
    stride_kd,
    stride_vn,
    stride_vd,
    start,  # first key of the range (a multiple of BLOCK_N)
    stop,  # end of the range
    slope2,
    qk_scale,
    Tq,
    Tk,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MASKED: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    SLOPE_GRAD: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    for start_n in range(start, stop, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = load_tile(k_base, offs_n, offs_d, stride_kn, stride_kd, Tk, MASKED, HEAD_DIM, BLOCK_D)
        v = load_tile(v_base, offs_n, offs_d, stride_vn, stride_vd, Tk, MASKED, HEAD_DIM, BLOCK_D)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N)
        distance = (offs_n[None, :] - pos_i[:, None]).to(tl.float32)
        p = tl.math.exp2(qk * qk_scale + slope2 * distance - lse[:, None])
        if MASKED:
            visible = (offs_n[None, :] < Tk) & (offs_m[:, None] < Tq)
            if IS_CAUSAL:
                visible = visible & (distance <= 0)
            p = tl.where(visible, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
        if SLOPE_GRAD:
            dslope += tl.sum(ds * distance, 1)
    return dq, dslope


@triton.jit(do_not_specialize=["stride_dsl", "H", "GROUP", "Tq", "Tk", "T_BUCKET", "stride_sb", "stride_sh"])
def alibi_bwd_dq_kernel(
    Q,  # (B, Hq, Tq, D) queries, any strides
    K,  # (B, Hkv, Tk, D) keys, any strides
    V,  # (B, Hkv, Tk, D) values, any strides
    Slopes,  # (B or 1, Hq) fp32
    DO,  # (B, Hq, Tq, D) gradient of the output, any strides
    Lse,  # (B * Hq, Tq) fp32, log2 units; (Hq, total) with VARLEN
    Delta,  # (B * Hq, Tq) fp32; (Hq, total) with VARLEN
    DQ,  # (B, Hq, Tq, D) output, contiguous; (total, Hq, D) with VARLEN
    DSlope,  # (B * Hq, >= cdiv(Tq, BLOCK_M)) fp32 partial slope gradients (written only if SLOPE_GRAD)
    CuSeqlens,  # (documents + 1,) int document boundaries; read only with VARLEN
    stride_dsl,  # DSlope row stride
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
    stride_dob,
    stride_doh,
    stride_dom,
    stride_dod,
    stride_sb,
    stride_sh,
    H,
    GROUP,
    Tq,  # queries; with VARLEN the total packed tokens (the row stride of Lse and Delta)
    Tk,  # keys; unused with VARLEN
    sm_scale,
    qk_scale,
    T_BUCKET,  # autotuning key only
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,  # query rows owned by this program
    BLOCK_N: tl.constexpr,  # keys per step
    IS_CAUSAL: tl.constexpr,
    SLOPE_GRAD: tl.constexpr,  # also accumulate sum dS * (pos_j - pos_i) for learnable slopes
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    VARLEN: tl.constexpr,  # packed documents: b is the document, strides *_b are 0, rows start at cu_seqlens[b]
):
    pid_m = tl.program_id(0)
    start_m = pid_m * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    hkv = h // GROUP
    seq0 = b * 0  # first token of the sequence in the token axis
    lse_off = bh * Tq
    if VARLEN:
        seq0 = tl.load(CuSeqlens + b).to(tl.int64)
        lse_off = h * Tq + seq0
        Tq = (tl.load(CuSeqlens + b + 1) - seq0).to(tl.int32)
        Tk = Tq
        if start_m >= Tq:  # the grid covers max_seqlen; shorter documents have nothing here
            return
    offset = Tk - Tq
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    pos_i = offs_m + offset
    row_ok = offs_m < Tq
    q_base = Q + b * stride_qb + seq0 * stride_qm + h * stride_qh
    do_base = DO + b * stride_dob + seq0 * stride_dom + h * stride_doh
    q = load_tile(q_base, offs_m, offs_d, stride_qm, stride_qd, Tq, True, HEAD_DIM, BLOCK_D)
    do = load_tile(do_base, offs_m, offs_d, stride_dom, stride_dod, Tq, True, HEAD_DIM, BLOCK_D)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse = tl.load(Lse + lse_off + offs_m, mask=row_ok, other=0.0)
    delta = tl.load(Delta + lse_off + offs_m, mask=row_ok, other=0.0)
    slope2 = tl.load(Slopes + b * stride_sb + h * stride_sh).to(tl.float32) * 1.4426950408889634
    k_base = K + b * stride_kb + seq0 * stride_kn + hkv * stride_kh
    v_base = V + b * stride_vb + seq0 * stride_vn + hkv * stride_vh

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    dslope = tl.zeros([BLOCK_M], dtype=tl.float32)
    # Key blocks every row of this block sees run unmasked; a partial row block (past Tq) masks everything, so
    # padded rows cannot overflow exp2 with a large non-causal bias.
    if IS_CAUSAL:
        n_full = ((start_m + offset + 1) // BLOCK_N) * BLOCK_N
        hi = tl.minimum(Tk, start_m + BLOCK_M + offset)
    else:
        n_full = (Tk // BLOCK_N) * BLOCK_N
        hi = Tk
    n_full = tl.where(start_m + BLOCK_M > Tq, 0, n_full)
    dq, dslope = _dq_inner(
        dq, dslope, q, do, lse, delta, offs_m, pos_i, offs_d, k_base, v_base, stride_kn, stride_kd, stride_vn,
        stride_vd, 0, n_full, slope2, qk_scale, Tq, Tk,
        BLOCK_N, HEAD_DIM, BLOCK_D, False, IS_CAUSAL, SLOPE_GRAD, UPCAST, DOT_PRECISION,
    )  # fmt: skip
    dq, dslope = _dq_inner(
        dq, dslope, q, do, lse, delta, offs_m, pos_i, offs_d, k_base, v_base, stride_kn, stride_kd, stride_vn,
        stride_vd, n_full, hi, slope2, qk_scale, Tq, Tk,
        BLOCK_N, HEAD_DIM, BLOCK_D, True, IS_CAUSAL, SLOPE_GRAD, UPCAST, DOT_PRECISION,
    )  # fmt: skip
    dq = dq * sm_scale
    q_mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    if VARLEN:
        dq_off = (seq0 + offs_m[:, None]) * (H * HEAD_DIM) + h * HEAD_DIM + offs_d[None, :]
    else:
        dq_off = bh * Tq * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(DQ + dq_off, dq.to(DQ.dtype.element_ty), mask=q_mask)
    if SLOPE_GRAD:
        tl.store(DSlope + bh * stride_dsl + pid_m, tl.sum(dslope, 0))


def backward_configs(block_d: int) -> list[triton.Config]:
    """Autotuning candidates per head dim (GPU only), shared by the dK/dV and the dQ kernels."""
    if block_d <= 64:
        shapes = [(64, 64, 4, 3), (32, 128, 8, 3), (128, 64, 8, 3), (64, 128, 8, 2)]
    elif block_d <= 128:
        shapes = [(64, 64, 4, 2), (32, 128, 8, 2), (128, 64, 8, 2), (64, 128, 8, 2)]
    else:
        shapes = [(32, 64, 4, 1), (64, 32, 4, 1), (32, 32, 4, 1), (64, 64, 8, 1)]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in shapes]
