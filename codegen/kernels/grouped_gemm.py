"""Forward grouped GEMMs over expert-ordered rows (SonicMoE dataflow, steps 2-3 of DESIGN.md).

    _up_proj_kernel:      H = gather(x) @ W1[e]^T + b1[e];  A = act(H)          (gate and up together)
    _scatter_gemm_kernel: Y[slot(r)] = In[r] @ B[e] + bias[e]                   (down-proj; also dX~)

Rows r are in expert order (`sorted_rows[r]` = flat slot t*K + k, token t = slot // K; in the slot
form, TOKEN_MAP, the token of row r is read from `row_token[r]`). Weights are
addressed through (expert, out, in) strides, so the transposed (gpt-oss) layouts and non-contiguous
weights need no copy. With W_TABLE the experts are separate tensors (an `nn.ModuleList` of Linears):
expert e's matrix starts `w_table[e]` elements from the weight pointer, and a gated W1's up rows
start `w_table[E + e]` elements from it (another tensor, or the same one further on); nothing is
stacked. Gated H is stored in the layout W1 produces it: concatenated (gate = cols
[0, n), up = [n, 2n)) or interleaved (gate = even cols, up = odd cols).
Row offsets are widened to int64 before they meet a stride: TK * d passes 2^31 at the large shapes.
"""
import triton
import triton.language as tl

from .activation import _act_fwd
from .routing import _expert_tile


@triton.jit
def _row_tokens(rows, mask, sorted_rows_ptr, row_token_ptr, top_k, TOKEN_MAP: tl.constexpr):
    """int64 token of each expert-ordered row: slot // K for [T, K] routing; in the slot form the
    launcher's precomputed row_token (one load either way, no dependent gather in the loop)."""
    if TOKEN_MAP:
        return tl.load(row_token_ptr + rows, mask=mask, other=0).to(tl.int64)
    return (tl.load(sorted_rows_ptr + rows, mask=mask, other=0) // top_k).to(tl.int64)


@triton.jit
def _table_offset(w_table_ptr, index, W_ALIGN: tl.constexpr):
    """Entry `index` of a per-expert offset table, with the alignment the launcher checked: without
    it the compiler cannot prove the weight rows 16-byte aligned and loads them element by element
    (2.5x slower GEMMs, measured on the H200)."""
    off = tl.load(w_table_ptr + index)
    if W_ALIGN > 1:
        off = tl.multiple_of(off, W_ALIGN)
    return off


@triton.jit
def _grouped_order(pid, TK, E, num_n, BLOCK_M: tl.constexpr, GROUP_M: tl.constexpr):
    """(M tile, N tile) of program `pid`, GROUP_M M tiles at a time for each N tile (L2 reuse).

    Row-major order (all N tiles of one M tile, then the next) keeps few M tiles in flight, so at a
    large n every program streams a different slice of the expert's weight from HBM once per M tile
    (Mixtral's n = 14336: ~112 N tiles per M tile). Walking GROUP_M M tiles down each N tile lets
    the programs in flight share each weight tile. GROUP_M = 1 is row-major.
    """
    num_m = tl.cdiv(TK, BLOCK_M) + E  # the grid's upper bound on M tiles
    in_group = GROUP_M * num_n
    first = (pid // in_group) * GROUP_M
    size = tl.minimum(num_m - first, GROUP_M)
    local = pid % in_group
    return first + local % size, local // size


@triton.jit(do_not_specialize=["TK"])
def _up_proj_kernel(
    x_ptr,  # [T, d] x.dtype, strides (stride_x_t, stride_x_d)
    w1_ptr,  # [E, w1_out, d] (or [E, d, w1_out] transposed) x.dtype, strides (e, out, in)
    b1_ptr,  # [E, w1_out] x.dtype, read when HAS_B1
    sorted_rows_ptr,  # [TK] int32, flat slot of each expert-ordered row
    row_token_ptr,  # [TK] int32, token of each expert-ordered row; read when TOKEN_MAP (else slot // top_k)
    offsets_ptr,  # [E+1] int32, expert row offsets
    h_ptr,  # [TK, w1_out] x.dtype, contiguous, expert order; written when STORE_H
    a_ptr,  # [TK, n] x.dtype, contiguous, expert order; written when STORE_A
    w_table_ptr,  # [2E] int64 element offsets from w1_ptr (gate rows, then up rows), read when W_TABLE
    TK, d, n, E, top_k,
    stride_x_t, stride_x_d,
    stride_w1_e, stride_w1_o, stride_w1_i,
    stride_b1_e, stride_b1_o,
    alpha, limit,
    ACTIVATION: tl.constexpr, GATED: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_B1: tl.constexpr,
    STORE_H: tl.constexpr, STORE_A: tl.constexpr, E_POW2: tl.constexpr, DOT_PRECISION: tl.constexpr,
    TOKEN_MAP: tl.constexpr, W_TABLE: tl.constexpr, W_ALIGN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FUSED_GU: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """Grid: ((cdiv(TK, BLOCK_M) + E) * cdiv(n, BLOCK_N),). Program = (M tile of one expert, N tile),
    in `_grouped_order`.

    An N tile covers columns j..j+BLOCK_N of A, i.e. the matching gate AND up columns of H, so the
    activation runs in the epilogue on float32 accumulators. FUSED_GU (gated only) loads the gate and
    up rows of W1 as ONE [BLOCK_K, 2*BLOCK_N] tile, columns alternating gate/up, and issues one dot of
    width 2*BLOCK_N (the x tile is read from shared memory once per step instead of twice); the
    accumulator is split back into gate and up in the epilogue.
    """
    tile, pid_n = _grouped_order(tl.program_id(0), TK, E, tl.cdiv(n, BLOCK_N), BLOCK_M, GROUP_M)
    expert, row_start, row_end = _expert_tile(offsets_ptr, E, tile, BLOCK_M, E_POW2)
    if expert >= E:
        return
    w1_out = n * (1 + GATED)

    rows = row_start + tl.arange(0, BLOCK_M)
    row_mask = rows < row_end
    tokens = _row_tokens(rows, row_mask, sorted_rows_ptr, row_token_ptr, top_k, TOKEN_MAP)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n
    # H columns (its layout) and W1 rows of the gate and up halves; the up rows are counted from
    # up_off, the gate rows from gate_off (element offsets from w1_ptr)
    if GATED and INTERLEAVED:
        gate_cols = 2 * cols
        up_cols = 2 * cols + 1
        w_up_rows = up_cols
    elif GATED:
        gate_cols = cols
        up_cols = cols + n
        w_up_rows = cols
    else:
        gate_cols = cols
        up_cols = cols
        w_up_rows = cols
    if W_TABLE:
        gate_off = _table_offset(w_table_ptr, expert, W_ALIGN)
        up_off = _table_offset(w_table_ptr, E + expert, W_ALIGN)
    else:
        gate_off = expert.to(tl.int64) * stride_w1_e
        up_off = gate_off
        if GATED and not INTERLEAVED:
            up_off += n * stride_w1_o  # (gate_off is int64)
    ks = tl.arange(0, BLOCK_K)

    x_ptrs = x_ptr + tokens[:, None] * stride_x_t + ks[None, :] * stride_x_d  # [BM, BK]
    wg_ptrs = w1_ptr + gate_off + gate_cols[None, :].to(tl.int64) * stride_w1_o + ks[:, None] * stride_w1_i  # [BK, BN]
    wu_ptrs = w1_ptr + up_off + w_up_rows[None, :].to(tl.int64) * stride_w1_o + ks[:, None] * stride_w1_i

    if FUSED_GU and GATED:
        c2 = tl.arange(0, 2 * BLOCK_N)
        j2 = pid_n * BLOCK_N + c2 // 2  # A column of each fused column; even: gate, odd: up
        is_up = (c2 % 2).to(tl.int64)
        if INTERLEAVED:
            w_rows = 2 * j2 + (c2 % 2)
        else:
            w_rows = j2
        j2_mask = j2 < n
        w_offs = gate_off + is_up * (up_off - gate_off) + w_rows.to(tl.int64) * stride_w1_o  # [2BN]
        w_ptrs = w1_ptr + w_offs[None, :] + ks[:, None] * stride_w1_i  # [BK, 2BN]
        acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
        for k0 in range(0, d, BLOCK_K):
            k_mask = (k0 + ks) < d
            xa = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_mask[:, None] & j2_mask[None, :], other=0.0)
            acc = tl.dot(xa, w, acc, input_precision=DOT_PRECISION)
            x_ptrs += BLOCK_K * stride_x_d
            w_ptrs += BLOCK_K * stride_w1_i
        acc_g, acc_u = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N, 2)))
    else:
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, d, BLOCK_K):
            k_mask = (k0 + ks) < d
            xa = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            wg = tl.load(wg_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
            acc_g = tl.dot(xa, wg, acc_g, input_precision=DOT_PRECISION)
            if GATED:
                wu = tl.load(wu_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
                acc_u = tl.dot(xa, wu, acc_u, input_precision=DOT_PRECISION)
                wu_ptrs += BLOCK_K * stride_w1_i
            x_ptrs += BLOCK_K * stride_x_d
            wg_ptrs += BLOCK_K * stride_w1_i

    if HAS_B1:
        b_base = b1_ptr + expert.to(tl.int64) * stride_b1_e
        acc_g += tl.load(b_base + gate_cols * stride_b1_o, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_u += tl.load(b_base + up_cols * stride_b1_o, mask=col_mask, other=0.0).to(tl.float32)[None, :]

    out_dtype = h_ptr.dtype.element_ty
    mask = row_mask[:, None] & col_mask[None, :]
    rows64 = rows.to(tl.int64)
    h_g = acc_g.to(out_dtype)
    h_u = acc_u.to(out_dtype)
    if STORE_H:
        tl.store(h_ptr + rows64[:, None] * w1_out + gate_cols[None, :], h_g, mask=mask)
        if GATED:
            tl.store(h_ptr + rows64[:, None] * w1_out + up_cols[None, :], h_u, mask=mask)
    if STORE_A:
        # act() reads H as stored (rounded to x.dtype), exactly what the backward will recompute from
        a = _act_fwd(h_g.to(tl.float32), h_u.to(tl.float32), alpha, limit, ACTIVATION)
        tl.store(a_ptr + rows64[:, None] * n + cols[None, :], a.to(out_dtype), mask=mask)


@triton.jit(do_not_specialize=["TK"])
def _scatter_gemm_kernel(
    in_ptr,  # [TK, k_dim] x.dtype, contiguous, expert order (A for the down-proj, dH for dX~)
    w_ptr,  # expert weights x.dtype read as B[e] [k_dim, n_dim] through strides (e, k, n)
    bias_ptr,  # [E, n_dim] x.dtype, read when HAS_BIAS
    sorted_rows_ptr,  # [TK] int32, flat slot of each expert-ordered row
    offsets_ptr,  # [E+1] int32
    out_ptr,  # [TK, n_dim] x.dtype, contiguous, SLOT order (row t*K+k): Y for the combine, dX~
    w_table_ptr,  # [2E] int64 element offsets from w_ptr, read when W_TABLE (see SPLIT_K)
    TK, k_dim, n_dim, E, k_split,
    stride_w_e, stride_w_k, stride_w_n,
    stride_bias_e,
    HAS_BIAS: tl.constexpr, E_POW2: tl.constexpr, DOT_PRECISION: tl.constexpr,
    W_TABLE: tl.constexpr, SPLIT_K: tl.constexpr, W_ALIGN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """Grid: ((cdiv(TK, BLOCK_M) + E) * cdiv(n_dim, BLOCK_N),). out[slot(r)] = in[r] @ B[e] (+ bias[e]).

    Storing in slot order lets the gather-sum read each token's K rows contiguously. SPLIT_K (dX~
    with a gated W1 kept as separate gate and up tensors): rows k >= k_split of B[e] are the up
    tensor's rows k - k_split, counted from w_table[E + e].
    """
    tile, pid_n = _grouped_order(tl.program_id(0), TK, E, tl.cdiv(n_dim, BLOCK_N), BLOCK_M, GROUP_M)
    expert, row_start, row_end = _expert_tile(offsets_ptr, E, tile, BLOCK_M, E_POW2)
    if expert >= E:
        return

    rows = row_start + tl.arange(0, BLOCK_M)
    row_mask = rows < row_end
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_dim
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = in_ptr + rows.to(tl.int64)[:, None] * k_dim + ks[None, :]
    if W_TABLE:
        w_base = w_ptr + _table_offset(w_table_ptr, expert, W_ALIGN)
    else:
        w_base = w_ptr + expert.to(tl.int64) * stride_w_e
    w_ptrs = w_base + ks[:, None] * stride_w_k + cols[None, :] * stride_w_n
    if SPLIT_K:  # extra offset of the rows past k_split: the up tensor's start minus the gate's
        up_shift = _table_offset(w_table_ptr, E + expert, W_ALIGN) - _table_offset(w_table_ptr, expert, W_ALIGN)
        up_shift -= k_split * stride_w_k

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        k_mask = (k0 + ks) < k_dim
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        if SPLIT_K:
            shift = tl.where((k0 + ks) >= k_split, up_shift, 0)
            w = tl.load(w_ptrs + shift[:, None], mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        else:
            w = tl.load(w_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_w_k
    if HAS_BIAS:
        bias = tl.load(bias_ptr + expert.to(tl.int64) * stride_bias_e + cols, mask=col_mask, other=0.0)
        acc += bias.to(tl.float32)[None, :]

    slots = tl.load(sorted_rows_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    out_ptrs = out_ptr + slots[:, None] * n_dim + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])
