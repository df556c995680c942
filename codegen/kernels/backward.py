"""Backward kernels (steps 5-6 of DESIGN.md). dA' = gather(dO) @ W2[e] runs on the forward
`_up_proj_kernel` (identity activation); dX~ = dH @ W1[e] on the forward `_scatter_gemm_kernel`.

    _act_grad_kernel: from dA' and H:  A = act(H);  dS[r] = <dA'[r], A[r]>;  dH = act'(H) * s * dA';
                      A' = s * A
    _wgrad_kernel: dW[e] = Lhs_e^T Rhs_e, the reduction running over expert e's rows only:
                   dW2[e] = gather(dO)^T A'   and   dW1[e] = dH^T gather(x)
                   (+ the bias gradient as column sums of Lhs: db2 = sum s dO, db1 = sum dH)

Only x, H, the routing and the router weights come from the forward; A is recomputed. Everything
is deterministic: each output element is written by exactly one program, no atomics.
"""
import triton
import triton.language as tl

from .activation import _act_bwd
from .grouped_gemm import _row_tokens


@triton.jit(do_not_specialize=["TK"])
def _act_grad_kernel(
    da_ptr,  # [TK, n] x.dtype, contiguous, expert order: dA' = gather(dO) @ W2[e]
    h_ptr,  # [TK, w1_out] x.dtype, contiguous, expert order (pre-activation, from the forward)
    s_ptr,  # [TK] router weights (any float dtype), slot order
    sorted_rows_ptr,  # [TK] int32, flat slot of each expert-ordered row
    offsets_ptr,  # [E+1] int32; rows from offsets[E] on are padding (slot form): dH and A' get zeros there
    dh_ptr,  # [TK, w1_out] x.dtype, contiguous, expert order, H's gate/up layout
    a_scaled_ptr,  # [TK, n] x.dtype, contiguous, expert order: A' = s * A (may be da_ptr: written in place)
    ds_ptr,  # [TK] float, slot order: dS = <dA', A>, summed in float32 (padding slots are not written)
    TK, n, E,
    alpha, limit,
    ACTIVATION: tl.constexpr, GATED: tl.constexpr, INTERLEAVED: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Grid: (cdiv(TK, BLOCK_R),). The dA' GEMM's epilogue as its own memory-bound pass.

    A program owns BLOCK_R whole rows, so dS = sum over n finishes in registers (no partial sums,
    no atomics). Why not inside the dA' GEMM: the fused epilogue (H gate/up, A, dG, dU, dS next to
    the accumulator) spilled ~4 KB of stack per thread and ran the GEMM at 115 TFLOPS on the H100
    at (T, d, n, E, K) = (24576, 1536, 256, 128, 8); the extra dA' round trip costs ~2 TK n bytes.
    """
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < tl.load(offsets_ptr + E)
    # dH and A' are stored on every row, the slot form's padding rows (past offsets[E]) as zeros:
    # the weight-gradient kernels reduce over whole boxes of expert-ordered rows, and a box may run
    # past the last expert's end (the Gluon wgrad's, for an expert of fewer than BLOCK_M rows), where
    # a zero-filled gathered row times unwritten memory (NaN) would give NaN.
    out_rows = rows < TK
    rows64 = rows.to(tl.int64)
    slots = tl.load(sorted_rows_ptr + rows, mask=row_mask, other=0)
    s = tl.load(s_ptr + slots, mask=row_mask, other=0.0).to(tl.float32)
    w1_out = n * (1 + GATED)
    out_dtype = dh_ptr.dtype.element_ty
    ds = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for c0 in range(0, n, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        mask = row_mask[:, None] & (cols < n)[None, :]
        out_mask = out_rows[:, None] & (cols < n)[None, :]
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
        da = tl.load(da_ptr + rows64[:, None] * n + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if GATED and INTERLEAVED:  # H's gate/up pairs read (and dH's written) as one contiguous tile
            pair_cols = 2 * c0 + tl.arange(0, 2 * BLOCK_C)
            pair_mask = row_mask[:, None] & (pair_cols < w1_out)[None, :]
            out_pair_mask = out_rows[:, None] & (pair_cols < w1_out)[None, :]
            h = tl.load(h_ptr + rows64[:, None] * w1_out + pair_cols[None, :], mask=pair_mask, other=0.0)
            g, u = tl.split(tl.reshape(h.to(tl.float32), (BLOCK_R, BLOCK_C, 2)))
        else:
            g = tl.load(h_ptr + rows64[:, None] * w1_out + gate_cols[None, :], mask=mask, other=0.0).to(tl.float32)
            if GATED:
                u = tl.load(h_ptr + rows64[:, None] * w1_out + up_cols[None, :], mask=mask, other=0.0).to(tl.float32)
            else:
                u = g
        a, dg, du = _act_bwd(g, u, da * s[:, None], alpha, limit, ACTIVATION)
        ds += tl.sum(tl.where(mask, da * a, 0.0), 1)
        # A' may be written over dA' (the launcher passes one buffer for both): every thread's loads
        # of this tile come before any thread's stores, whatever layouts the compiler gives them
        tl.debug_barrier()
        # padding rows: da, h and s load as 0, so dg, du and a * s are 0 (every activation maps 0 to a finite value)
        if GATED and INTERLEAVED:
            dh = tl.reshape(tl.join(dg, du), (BLOCK_R, 2 * BLOCK_C))
            tl.store(dh_ptr + rows64[:, None] * w1_out + pair_cols[None, :], dh.to(out_dtype), mask=out_pair_mask)
        else:
            tl.store(dh_ptr + rows64[:, None] * w1_out + gate_cols[None, :], dg.to(out_dtype), mask=out_mask)
            if GATED:
                tl.store(dh_ptr + rows64[:, None] * w1_out + up_cols[None, :], du.to(out_dtype), mask=out_mask)
        tl.store(a_scaled_ptr + rows64[:, None] * n + cols[None, :], (a * s[:, None]).to(out_dtype), mask=out_mask)
    tl.store(ds_ptr + slots, ds.to(ds_ptr.dtype.element_ty), mask=row_mask)


@triton.jit
def _chunk_tokens(r0, hi, sorted_rows_ptr, row_token_ptr, top_k: tl.constexpr, TOKEN_MAP: tl.constexpr,
                  BLOCK_M: tl.constexpr):
    """The tokens of rows r0 .. r0 + BLOCK_M (0 past `hi`)."""
    rows = r0 + tl.arange(0, BLOCK_M)
    return _row_tokens(rows, rows < hi, sorted_rows_ptr, row_token_ptr, top_k, TOKEN_MAP)


@triton.jit
def _wgrad_chunk(
    acc, db, r0, hi, tokens, lhs_ptr, rhs_ptr, s_ptr, sorted_rows_ptr, row_token_ptr, top_k: tl.constexpr, pid_p, pid_q, P, Q,
    stride_lhs_r, stride_lhs_c, stride_rhs_r, stride_rhs_c,
    GATHER_LHS: tl.constexpr, GATHER_RHS: tl.constexpr, LHS_DESC: tl.constexpr, RHS_DESC: tl.constexpr,
    BIAS_GRAD: tl.constexpr, BIAS_SCALED: tl.constexpr, DOT_PRECISION: tl.constexpr, TOKEN_MAP: tl.constexpr,
    TAIL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr,
):
    """acc += Lhs[r0:r0+BLOCK_M, P tile]^T Rhs[r0:r0+BLOCK_M, Q tile] over the rows below `hi` (and
    db += the weighted column sums of Lhs). A *_DESC operand arrives by TMA; its rows past `hi`
    (the next expert's) are zeroed in registers on the TAIL chunk, the only one that has any.
    `tokens`: the token of each of the chunk's rows (`_chunk_tokens`), read when an operand is gathered."""
    rows = r0 + tl.arange(0, BLOCK_M)
    row_mask = rows < hi
    ps = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    qs = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    if LHS_DESC:
        lhs = lhs_ptr.load([r0, pid_p * BLOCK_P])  # [BM, BP]
        if TAIL:
            lhs = tl.where(row_mask[:, None], lhs, 0.0)
        lhs_t = lhs.T
    else:
        lhs_rows = tokens if GATHER_LHS else rows.to(tl.int64)
        lhs_t = tl.load(  # [BP, BM]: Lhs^T tile
            lhs_ptr + lhs_rows[None, :] * stride_lhs_r + ps[:, None] * stride_lhs_c,
            mask=(ps < P)[:, None] & row_mask[None, :], other=0.0,
        )
    if RHS_DESC:
        rhs = rhs_ptr.load([r0, pid_q * BLOCK_Q])  # [BM, BQ]
        if TAIL:
            rhs = tl.where(row_mask[:, None], rhs, 0.0)
    else:
        rhs_rows = tokens if GATHER_RHS else rows.to(tl.int64)
        rhs = tl.load(
            rhs_ptr + rhs_rows[:, None] * stride_rhs_r + qs[None, :] * stride_rhs_c,
            mask=row_mask[:, None] & (qs < Q)[None, :], other=0.0,
        )
    acc = tl.dot(lhs_t, rhs, acc, input_precision=DOT_PRECISION)
    if BIAS_GRAD:
        if pid_q == 0:
            if BIAS_SCALED:
                slots = tl.load(sorted_rows_ptr + rows, mask=row_mask, other=0)
                s = tl.load(s_ptr + slots, mask=row_mask, other=0.0).to(tl.float32)
                db += tl.sum(lhs_t.to(tl.float32) * s[None, :], 1)
            else:
                db += tl.sum(lhs_t.to(tl.float32), 1)
    return acc, db


@triton.jit(do_not_specialize=["TK"])
def _wgrad_kernel(
    lhs_ptr,  # rows -> dW's P axis, x.dtype: [T, P] read at token rows (GATHER_LHS) or [TK, P] expert order
    rhs_ptr,  # rows -> dW's Q axis, x.dtype: [T, Q] read at token rows (GATHER_RHS) or [TK, Q] expert order
    s_ptr,  # [TK] router weights, slot order; read when BIAS_SCALED
    sorted_rows_ptr,  # [TK] int32
    row_token_ptr,  # [TK] int32, token of each expert-ordered row; read when TOKEN_MAP
    offsets_ptr,  # [E+1] int32
    dw_ptr,  # [E, P, Q] weight dtype through strides (e, p, q): transposed layouts swap them
    db_ptr,  # [E, P] contiguous, bias dtype; written when BIAS_GRAD
    TK, P, Q, E, top_k: tl.constexpr,
    stride_lhs_r, stride_lhs_c, stride_rhs_r, stride_rhs_c,
    stride_dw_e, stride_dw_p, stride_dw_q,
    GATHER_LHS: tl.constexpr, GATHER_RHS: tl.constexpr, BIAS_GRAD: tl.constexpr,
    BIAS_SCALED: tl.constexpr, DOT_PRECISION: tl.constexpr, TOKEN_MAP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr,
    LHS_DESC: tl.constexpr = False, RHS_DESC: tl.constexpr = False,
):
    """Grid: (E * cdiv(P, BLOCK_P) * cdiv(Q, BLOCK_Q),). dW[e][p, q] = sum_{r in e} Lhs[r, p] Rhs[r, q].

    The reduction length is expert e's row count (read on the device); an empty expert writes zeros.
    The bias gradient rides on the programs with pid_q == 0: db[e][p] = sum_r (s_r) Lhs[r, p].
    LHS_DESC / RHS_DESC: that (expert-ordered, never gathered) operand is a TMA descriptor over
    [TK, P] / [TK, Q] with block [BLOCK_M, BLOCK_P] / [BLOCK_M, BLOCK_Q]; the whole chunks run
    unmasked and the last partial chunk masks it in registers.
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

    acc = tl.zeros((BLOCK_P, BLOCK_Q), dtype=tl.float32)
    db = tl.zeros((BLOCK_P,), dtype=tl.float32)
    # the whole chunks (all of them without a descriptor: pointer loads mask their rows), then the
    # descriptor's masked tail. Each chunk's tokens are loaded one chunk ahead, so the gathered rows'
    # addresses never wait on an index load of the same step: dW1 926 -> 690 us, dW2 423 -> 382 us
    # at the 7b-256 shape (H200), bit-identical results.
    end = hi
    if LHS_DESC or RHS_DESC:
        end = lo + ((hi - lo) // BLOCK_M) * BLOCK_M
    tokens = _chunk_tokens(lo, hi, sorted_rows_ptr, row_token_ptr, top_k, TOKEN_MAP, BLOCK_M)
    for r0 in range(lo, end, BLOCK_M):
        next_tokens = _chunk_tokens(r0 + BLOCK_M, hi, sorted_rows_ptr, row_token_ptr, top_k, TOKEN_MAP, BLOCK_M)
        acc, db = _wgrad_chunk(
            acc, db, r0, hi, tokens, lhs_ptr, rhs_ptr, s_ptr, sorted_rows_ptr, row_token_ptr, top_k, pid_p, pid_q, P, Q,
            stride_lhs_r, stride_lhs_c, stride_rhs_r, stride_rhs_c, GATHER_LHS, GATHER_RHS, LHS_DESC, RHS_DESC,
            BIAS_GRAD, BIAS_SCALED, DOT_PRECISION, TOKEN_MAP, False, BLOCK_M, BLOCK_P, BLOCK_Q)
        tokens = next_tokens
    if end < hi:  # `tokens` holds this chunk's (loaded by the last whole chunk, or before the loop)
        acc, db = _wgrad_chunk(
            acc, db, end, hi, tokens, lhs_ptr, rhs_ptr, s_ptr, sorted_rows_ptr, row_token_ptr, top_k, pid_p, pid_q, P, Q,
            stride_lhs_r, stride_lhs_c, stride_rhs_r, stride_rhs_c, GATHER_LHS, GATHER_RHS, LHS_DESC, RHS_DESC,
            BIAS_GRAD, BIAS_SCALED, DOT_PRECISION, TOKEN_MAP, True, BLOCK_M, BLOCK_P, BLOCK_Q)

    ps = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    qs = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    p_mask = ps < P
    q_mask = qs < Q
    dw_ptrs = dw_ptr + expert.to(tl.int64) * stride_dw_e + ps[:, None] * stride_dw_p + qs[None, :] * stride_dw_q
    tl.store(dw_ptrs, acc.to(dw_ptr.dtype.element_ty), mask=p_mask[:, None] & q_mask[None, :])
    if BIAS_GRAD:
        if pid_q == 0:
            tl.store(db_ptr + expert.to(tl.int64) * P + ps, db.to(db_ptr.dtype.element_ty), mask=p_mask)
