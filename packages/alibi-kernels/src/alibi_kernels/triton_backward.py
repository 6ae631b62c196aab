"""Triton backward kernels for ALiBi attention, recomputing probabilities from the saved log-sum-exp.

Two kernels, as in FlashAttention-2: `alibi_bwd_dkdv_kernel` owns a block of keys of one k/v head and loops over
the query heads of its GQA group and over the query blocks that can see those keys (the ones below the causal
diagonal), accumulating dK and dV in fp32 registers (no atomics, no per-head buffers);
`alibi_bwd_dq_kernel` owns a block of queries and loops over the visible key blocks, accumulating dQ and,
when asked, this block's share of the slope gradient sum_ij dS_ij * (pos_j - pos_i).
With P = softmax(S) and Delta_i = sum_d dO_id * O_id: dS = P * (dP - Delta), dQ = scale dS K, dK = scale dS^T Q,
dV = P^T dO.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def alibi_bwd_dkdv_kernel(
    Q,  # (B, Hq, Tq, D) queries, any strides
    K,  # (B, Hkv, Tk, D) keys, any strides
    V,  # (B, Hkv, Tk, D) values, any strides
    Slopes,  # (B or 1, Hq) fp32
    DO,  # (B, Hq, Tq, D) gradient of the output, any strides
    Lse,  # (B * Hq, Tq) fp32, log2 units, from the forward
    Delta,  # (B * Hq, Tq) fp32 rowsum(dO * O)
    DK,  # (B, Hkv, Tk, D) output, contiguous
    DV,  # (B, Hkv, Tk, D) output, contiguous
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
    Tq,
    Tk,
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
):
    start_n = tl.program_id(0) * BLOCK_N
    bhkv = tl.program_id(1)
    b = (bhkv // HKV).to(tl.int64)
    hkv = (bhkv % HKV).to(tl.int64)
    offset = Tk - Tq
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    kv_mask = (offs_n[:, None] < Tk) & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(K + b * stride_kb + hkv * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                mask=kv_mask, other=0.0)  # fmt: skip
    v = tl.load(V + b * stride_vb + hkv * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                mask=kv_mask, other=0.0)  # fmt: skip
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    # Causal: only queries with pos_i >= start_n see these keys; start at the query block holding that row.
    if IS_CAUSAL:  # noqa: SIM108 (a constexpr branch reads clearer than a ternary in a kernel)
        lo = (tl.maximum(start_n - offset, 0) // BLOCK_M) * BLOCK_M
    else:
        lo = 0
    for g in range(0, GROUP):
        h = hkv * GROUP + g
        bh = b * H + h
        slope2 = tl.load(Slopes + b * stride_sb + h * stride_sh).to(tl.float32) * 1.4426950408889634
        q_base = Q + b * stride_qb + h * stride_qh
        do_base = DO + b * stride_dob + h * stride_doh
        for start_m in range(lo, Tq, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            row_ok = offs_m < Tq
            q_mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
            q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd, mask=q_mask, other=0.0)
            do = tl.load(do_base + offs_m[:, None] * stride_dom + offs_d[None, :] * stride_dod, mask=q_mask, other=0.0)
            if UPCAST:
                q = q.to(tl.float32)
                do = do.to(tl.float32)
            lse = tl.load(Lse + bh * Tq + offs_m, mask=row_ok, other=0.0)
            delta = tl.load(Delta + bh * Tq + offs_m, mask=row_ok, other=0.0)
            pos_i = offs_m + offset
            qk_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)  # (BLOCK_N, BLOCK_M)
            distance_t = (offs_n[:, None] - pos_i[None, :]).to(tl.float32)
            p_t = tl.math.exp2(qk_t * qk_scale + slope2 * distance_t - lse[None, :])
            visible = (offs_n[:, None] < Tk) & row_ok[None, :]
            if IS_CAUSAL:
                visible = visible & (distance_t <= 0)
            p_t = tl.where(visible, p_t, 0.0)
            dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
            dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # (BLOCK_N, BLOCK_M)
            ds_t = p_t * (dp_t - delta[None, :])
            dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
    dk = dk * sm_scale
    out_off = bhkv.to(tl.int64) * Tk * HEAD_DIM + offs_n[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(DK + out_off, dk.to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + out_off, dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def alibi_bwd_dq_kernel(
    Q,  # (B, Hq, Tq, D) queries, any strides
    K,  # (B, Hkv, Tk, D) keys, any strides
    V,  # (B, Hkv, Tk, D) values, any strides
    Slopes,  # (B or 1, Hq) fp32
    DO,  # (B, Hq, Tq, D) gradient of the output, any strides
    Lse,  # (B * Hq, Tq) fp32, log2 units
    Delta,  # (B * Hq, Tq) fp32
    DQ,  # (B, Hq, Tq, D) output, contiguous
    DSlope,  # (B * Hq, >= cdiv(Tq, BLOCK_M)) fp32 partial slope gradients (written only if SLOPE_GRAD)
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
    Tq,
    Tk,
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
):
    pid_m = tl.program_id(0)
    start_m = pid_m * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    hkv = h // GROUP
    offset = Tk - Tq
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    pos_i = offs_m + offset
    row_ok = offs_m < Tq
    q_mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                mask=q_mask, other=0.0)  # fmt: skip
    do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dom + offs_d[None, :] * stride_dod,
                 mask=q_mask, other=0.0)  # fmt: skip
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse = tl.load(Lse + bh * Tq + offs_m, mask=row_ok, other=0.0)
    delta = tl.load(Delta + bh * Tq + offs_m, mask=row_ok, other=0.0)
    slope2 = tl.load(Slopes + b * stride_sb + h * stride_sh).to(tl.float32) * 1.4426950408889634
    k_base = K + b * stride_kb + hkv * stride_kh
    v_base = V + b * stride_vb + hkv * stride_vh

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    dslope = tl.zeros([BLOCK_M], dtype=tl.float32)
    if IS_CAUSAL:  # noqa: SIM108
        hi = tl.minimum(Tk, start_m + BLOCK_M + offset)
    else:
        hi = Tk
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kv_mask = (offs_n[:, None] < Tk) & (offs_d[None, :] < HEAD_DIM)
        k = tl.load(k_base + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)
        v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N)
        distance = (offs_n[None, :] - pos_i[:, None]).to(tl.float32)
        p = tl.math.exp2(qk * qk_scale + slope2 * distance - lse[:, None])
        visible = (offs_n[None, :] < Tk) & row_ok[:, None]
        if IS_CAUSAL:
            visible = visible & (distance <= 0)
        p = tl.where(visible, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
        if SLOPE_GRAD:
            dslope += tl.sum(ds * distance, 1)
    dq = dq * sm_scale
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
