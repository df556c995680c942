"""Backward grouped GEMMs (steps 5-6 of DESIGN.md); dX~ reuses the forward `_scatter_gemm_kernel`.

    _dact_kernel:  dA' = gather(dO) @ W2[e]   (reduction over d), then in the epilogue, from H:
                   A = act(H);  dS[r] = <dA'[r], A[r]>;  dH = act'(H) * s * dA';  A' = s * A
    _wgrad_kernel: dW[e] = Lhs_e^T Rhs_e, the reduction running over expert e's rows only:
                   dW2[e] = gather(dO)^T A'   and   dW1[e] = dH^T gather(x)
                   (+ the bias gradient as column sums of Lhs: db2 = sum s dO, db1 = sum dH)

Only x, H, the routing and the router weights come from the forward; A is recomputed. Everything
is deterministic: each output element is written by exactly one program, no atomics.
"""
import triton
import triton.language as tl

from .activation import _act_bwd
from .routing import _expert_tile


@triton.jit(do_not_specialize=["TK"])
def _dact_kernel(
    dout_ptr,  # [T, d] x.dtype, strides (stride_do_t, stride_do_d)
    w2_ptr,  # expert weights x.dtype read as W2[e] [d, n] through strides (e, d, n)
    h_ptr,  # [TK, w1_out] x.dtype, contiguous, expert order (pre-activation, from the forward)
    s_ptr,  # [TK] router weights (any float dtype), slot order
    sorted_rows_ptr,  # [TK] int32, flat slot of each expert-ordered row
    offsets_ptr,  # [E+1] int32
    dh_ptr,  # [TK, w1_out] x.dtype, contiguous, expert order, H's gate/up layout
    a_scaled_ptr,  # [TK, n] x.dtype, contiguous, expert order: A' = s * A
    ds_ptr,  # [TK] float32, slot order: dS = <dA', A>
    TK, d, n, E, top_k,
    stride_do_t, stride_do_d,
    stride_w2_e, stride_w2_d, stride_w2_n,
    alpha, limit,
    ACTIVATION: tl.constexpr, GATED: tl.constexpr, INTERLEAVED: tl.constexpr,
    E_POW2: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Grid: (cdiv(TK, BLOCK_M) + E,). Program = one M tile of one expert, looping over ALL n columns.

    Owning whole rows lets the program finish dS = sum over n in registers: no partial sums in memory,
    no second reduction pass, no atomics.
    """
    tile = tl.program_id(0)
    expert, row_start, row_end = _expert_tile(offsets_ptr, E, tile, BLOCK_M, E_POW2)
    if expert >= E:
        return
    w1_out = n * (1 + GATED)

    rows = row_start + tl.arange(0, BLOCK_M)
    row_mask = rows < row_end
    rows64 = rows.to(tl.int64)
    slots = tl.load(sorted_rows_ptr + rows, mask=row_mask, other=0)
    tokens = (slots // top_k).to(tl.int64)
    s = tl.load(s_ptr + slots, mask=row_mask, other=0.0).to(tl.float32)
    ks = tl.arange(0, BLOCK_K)
    w_base = w2_ptr + expert.to(tl.int64) * stride_w2_e
    out_dtype = dh_ptr.dtype.element_ty

    ds = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for n0 in range(0, n, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_mask = cols < n
        do_ptrs = dout_ptr + tokens[:, None] * stride_do_t + ks[None, :] * stride_do_d  # [BM, BK]
        w_ptrs = w_base + ks[:, None] * stride_w2_d + cols[None, :] * stride_w2_n  # [BK, BN]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, d, BLOCK_K):
            k_mask = (k0 + ks) < d
            dog = tl.load(do_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
            acc = tl.dot(dog, w, acc, input_precision=DOT_PRECISION)
            do_ptrs += BLOCK_K * stride_do_d
            w_ptrs += BLOCK_K * stride_w2_d

        if GATED:
            if INTERLEAVED:
                gate_cols = 2 * cols
                up_cols = 2 * cols + 1
            else:
                gate_cols = cols
                up_cols = cols + n
        else:
            gate_cols = cols
            up_cols = cols
        mask = row_mask[:, None] & col_mask[None, :]
        g = tl.load(h_ptr + rows64[:, None] * w1_out + gate_cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if GATED:
            u = tl.load(h_ptr + rows64[:, None] * w1_out + up_cols[None, :], mask=mask, other=0.0).to(tl.float32)
        else:
            u = g
        a, dg, du = _act_bwd(g, u, acc * s[:, None], alpha, limit, ACTIVATION)
        ds += tl.sum(tl.where(mask, acc * a, 0.0), 1)
        tl.store(dh_ptr + rows64[:, None] * w1_out + gate_cols[None, :], dg.to(out_dtype), mask=mask)
        if GATED:
            tl.store(dh_ptr + rows64[:, None] * w1_out + up_cols[None, :], du.to(out_dtype), mask=mask)
        tl.store(a_scaled_ptr + rows64[:, None] * n + cols[None, :], (a * s[:, None]).to(out_dtype), mask=mask)
    tl.store(ds_ptr + slots, ds, mask=row_mask)


@triton.jit(do_not_specialize=["TK"])
def _wgrad_kernel(
    lhs_ptr,  # rows -> dW's P axis, x.dtype: [T, P] read at token rows (GATHER_LHS) or [TK, P] expert order
    rhs_ptr,  # rows -> dW's Q axis, x.dtype: [T, Q] read at token rows (GATHER_RHS) or [TK, Q] expert order
    s_ptr,  # [TK] router weights, slot order; read when BIAS_SCALED
    sorted_rows_ptr,  # [TK] int32
    offsets_ptr,  # [E+1] int32
    dw_ptr,  # [E, P, Q] weight dtype through strides (e, p, q): transposed layouts swap them
    db_ptr,  # [E, P] contiguous, bias dtype; written when BIAS_GRAD
    TK, P, Q, E, top_k,
    stride_lhs_r, stride_lhs_c, stride_rhs_r, stride_rhs_c,
    stride_dw_e, stride_dw_p, stride_dw_q,
    GATHER_LHS: tl.constexpr, GATHER_RHS: tl.constexpr, BIAS_GRAD: tl.constexpr,
    BIAS_SCALED: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr,
):
    """Grid: (E * cdiv(P, BLOCK_P) * cdiv(Q, BLOCK_Q),). dW[e][p, q] = sum_{r in e} Lhs[r, p] Rhs[r, q].

    The reduction length is expert e's row count (read on the device); an empty expert writes zeros.
    The bias gradient rides on the programs with pid_q == 0: db[e][p] = sum_r (s_r) Lhs[r, p].
    """
    pid = tl.program_id(0)
    num_p = tl.cdiv(P, BLOCK_P)
    num_q = tl.cdiv(Q, BLOCK_Q)
    expert = pid // (num_p * num_q)
    rest = pid % (num_p * num_q)
    pid_p = rest // num_q
    pid_q = rest % num_q
    lo = tl.load(offsets_ptr + expert)
    hi = tl.load(offsets_ptr + expert + 1)

    ps = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    qs = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    p_mask = ps < P
    q_mask = qs < Q
    acc = tl.zeros((BLOCK_P, BLOCK_Q), dtype=tl.float32)
    db = tl.zeros((BLOCK_P,), dtype=tl.float32)
    for r0 in range(lo, hi, BLOCK_M):
        rows = r0 + tl.arange(0, BLOCK_M)
        row_mask = rows < hi
        if GATHER_LHS or GATHER_RHS or BIAS_SCALED:
            slots = tl.load(sorted_rows_ptr + rows, mask=row_mask, other=0)
            tokens = (slots // top_k).to(tl.int64)
        if GATHER_LHS:
            lhs_rows = tokens
        else:
            lhs_rows = rows.to(tl.int64)
        if GATHER_RHS:
            rhs_rows = tokens
        else:
            rhs_rows = rows.to(tl.int64)
        lhs_t = tl.load(  # [BP, BM]: Lhs^T tile
            lhs_ptr + lhs_rows[None, :] * stride_lhs_r + ps[:, None] * stride_lhs_c,
            mask=p_mask[:, None] & row_mask[None, :], other=0.0,
        )
        rhs = tl.load(  # [BM, BQ]
            rhs_ptr + rhs_rows[:, None] * stride_rhs_r + qs[None, :] * stride_rhs_c,
            mask=row_mask[:, None] & q_mask[None, :], other=0.0,
        )
        acc = tl.dot(lhs_t, rhs, acc, input_precision=DOT_PRECISION)
        if BIAS_GRAD:
            if pid_q == 0:
                if BIAS_SCALED:
                    s = tl.load(s_ptr + slots, mask=row_mask, other=0.0).to(tl.float32)
                    db += tl.sum(lhs_t.to(tl.float32) * s[None, :], 1)
                else:
                    db += tl.sum(lhs_t.to(tl.float32), 1)

    dw_ptrs = dw_ptr + expert.to(tl.int64) * stride_dw_e + ps[:, None] * stride_dw_p + qs[None, :] * stride_dw_q
    tl.store(dw_ptrs, acc.to(dw_ptr.dtype.element_ty), mask=p_mask[:, None] & q_mask[None, :])
    if BIAS_GRAD:
        if pid_q == 0:
            tl.store(db_ptr + expert.to(tl.int64) * P + ps, db.to(db_ptr.dtype.element_ty), mask=p_mask)
