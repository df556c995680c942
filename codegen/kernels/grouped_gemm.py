"""Forward grouped GEMMs over expert-ordered rows (SonicMoE dataflow, steps 2-3 of DESIGN.md).

    _up_proj_kernel:      H = gather(x) @ W1[e]^T + b1[e];  A = act(H)          (gate and up together)
    _up_proj_persistent_kernel: the same, one program per SM over all tiles (weights by TMA)
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
from .routing import _expert_tile, _tile_lookup, _tile_schedule


@triton.jit
def _row_tokens(rows, mask, sorted_rows_ptr, row_token_ptr, top_k: tl.constexpr, TOKEN_MAP: tl.constexpr):
    """int64 token of each expert-ordered row: slot // K for [T, K] routing; in the slot form the
    launcher's precomputed row_token (one load either way, no dependent gather in the loop).
    K is a compile-time constant: a division by a run-time K cost the weight-gradient kernel, which
    maps rows to tokens at every step of its reduction, 6-10% of its time (H200, 7b-256 shape)."""
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
def _w_tile(w_desc, expert, col0, k0, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, W_DESC: tl.constexpr):
    """The [BLOCK_K, BLOCK_N] tile B[e][k0:, col0:] of a stacked weight through its TMA descriptor
    (out-of-range rows and columns read as zeros). W_DESC 1: the descriptor is over [E, N, K] (K
    contiguous, nn.Linear's [out, in]); 2: over [E, K, N] (N contiguous)."""
    if W_DESC == 1:
        return w_desc.load([expert, col0, k0]).reshape(BLOCK_N, BLOCK_K).T
    return w_desc.load([expert, k0, col0]).reshape(BLOCK_K, BLOCK_N)


@triton.jit
def _grouped_order(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """(M tile, N tile) of program `pid`, GROUP_M M tiles at a time for each N tile (L2 reuse).

    Row-major order (all N tiles of one M tile, then the next) keeps few M tiles in flight, so at a
    large n every program streams a different slice of the expert's weight from HBM once per M tile
    (Mixtral's n = 14336: ~112 N tiles per M tile). Walking GROUP_M M tiles down each N tile lets
    the programs in flight share each weight tile. GROUP_M = 1 is row-major. num_m: the M tiles
    (the grid's upper bound cdiv(TK, BLOCK_M) + E, or a persistent kernel's exact count).
    """
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
    TK, d, n, E, top_k: tl.constexpr,
    stride_x_t, stride_x_d,
    stride_w1_e, stride_w1_o, stride_w1_i,
    stride_b1_e, stride_b1_o,
    alpha, limit,
    ACTIVATION: tl.constexpr, GATED: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_B1: tl.constexpr,
    STORE_H: tl.constexpr, STORE_A: tl.constexpr, E_POW2: tl.constexpr, DOT_PRECISION: tl.constexpr,
    TOKEN_MAP: tl.constexpr, W_TABLE: tl.constexpr, W_ALIGN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FUSED_GU: tl.constexpr,
    GROUP_M: tl.constexpr, W_DESC: tl.constexpr = 0,
):
    """Grid: ((cdiv(TK, BLOCK_M) + E) * cdiv(n, BLOCK_N),). Program = (M tile of one expert, N tile),
    in `_grouped_order`.

    An N tile covers columns j..j+BLOCK_N of A, i.e. the matching gate AND up columns of H, so the
    activation runs in the epilogue on float32 accumulators. FUSED_GU (gated only) loads the gate and
    up rows of W1 as ONE [BLOCK_K, 2*BLOCK_N] tile, columns alternating gate/up, and issues one dot of
    width 2*BLOCK_N (the x tile is read from shared memory once per step instead of twice); the
    accumulator is split back into gate and up in the epilogue.

    W_DESC (stacked weights): w1_ptr is a TMA descriptor over the weights (see `_w_tile`).
    Concatenated gate/up: W_DESC 1 / 2, each step issues two dots (gate, up) on the tiles as the
    copy engine lands them; W_DESC 3 (the descriptor over [E, 2, n, d]), one copy lands both tiles
    and one dot of width 2*BLOCK_N runs on them. Interleaved: one dot on a [BLOCK_K, 2*BLOCK_N]
    tile of consecutive W1 rows, whose columns alternate gate/up as H's do.

    Interleaved gate/up with one 2*BLOCK_N-wide accumulator (FUSED_GU or W_DESC): its columns are
    H's own, so H is stored from it as one contiguous tile; gate and up are split apart only for the
    activation (each pair of columns sits in one thread's registers). Storing H's gate and up halves
    separately, at a stride of two elements, ran the up-projection at half the concatenated layout's
    speed (H100, gpt-oss sizes, `benchmarks/kernels/bench_up_proj.py`).
    """
    tile, pid_n = _grouped_order(tl.program_id(0), tl.cdiv(TK, BLOCK_M) + E, tl.cdiv(n, BLOCK_N), GROUP_M)
    expert, row_start, row_end = _expert_tile(offsets_ptr, E, tile, BLOCK_M, E_POW2)
    if expert >= E:
        return

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
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tokens[:, None] * stride_x_t + ks[None, :] * stride_x_d  # [BM, BK]
    if W_DESC == 0:
        if W_TABLE:
            gate_off = _table_offset(w_table_ptr, expert, W_ALIGN)
            up_off = _table_offset(w_table_ptr, E + expert, W_ALIGN)
        else:
            gate_off = expert.to(tl.int64) * stride_w1_e
            up_off = gate_off
            if GATED and not INTERLEAVED:
                up_off += n * stride_w1_o  # (gate_off is int64)
        wg_ptrs = w1_ptr + gate_off + gate_cols[None, :].to(tl.int64) * stride_w1_o + ks[:, None] * stride_w1_i
        wu_ptrs = w1_ptr + up_off + w_up_rows[None, :].to(tl.int64) * stride_w1_o + ks[:, None] * stride_w1_i

    if W_DESC == 3:  # concatenated, the descriptor over [E, 2, n, d]: one [BLOCK_K, 2*BLOCK_N] tile, gate then up
        acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
        for k0 in range(0, d, BLOCK_K):
            k_mask = (k0 + ks) < d
            xa = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            w = w1_ptr.load([expert, 0, pid_n * BLOCK_N, k0]).reshape(2 * BLOCK_N, BLOCK_K).T
            acc = tl.dot(xa, w, acc, input_precision=DOT_PRECISION)
            x_ptrs += BLOCK_K * stride_x_d
        acc_g, acc_u = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N)), (0, 2, 1)))
    elif W_DESC != 0 and GATED and INTERLEAVED:
        acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
        for k0 in range(0, d, BLOCK_K):
            k_mask = (k0 + ks) < d
            xa = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            w = _w_tile(w1_ptr, expert, 2 * pid_n * BLOCK_N, k0, 2 * BLOCK_N, BLOCK_K, W_DESC)
            acc = tl.dot(xa, w, acc, input_precision=DOT_PRECISION)
            x_ptrs += BLOCK_K * stride_x_d
    elif W_DESC != 0:
        col0 = pid_n * BLOCK_N
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, d, BLOCK_K):
            k_mask = (k0 + ks) < d
            xa = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            wg = _w_tile(w1_ptr, expert, col0, k0, BLOCK_N, BLOCK_K, W_DESC)
            acc_g = tl.dot(xa, wg, acc_g, input_precision=DOT_PRECISION)
            if GATED:  # concatenated: the up rows start n further on
                wu = _w_tile(w1_ptr, expert, col0 + n, k0, BLOCK_N, BLOCK_K, W_DESC)
                acc_u = tl.dot(xa, wu, acc_u, input_precision=DOT_PRECISION)
            x_ptrs += BLOCK_K * stride_x_d
    elif FUSED_GU and GATED:
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
        if not INTERLEAVED:  # concatenated H: its gate and up halves are stored apart
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

    if GATED and INTERLEAVED and (W_DESC != 0 or FUSED_GU):  # one accumulator, H's own columns
        acc_g = acc
        acc_u = acc
    else:  # (unread: the epilogue takes the split accumulators)
        acc = acc_g
    _up_epilogue(acc, acc_g, acc_u, expert, rows, row_mask, pid_n, n, b1_ptr, stride_b1_e, stride_b1_o, h_ptr, a_ptr,
                 alpha, limit, ACTIVATION, GATED, INTERLEAVED, INTERLEAVED and (W_DESC != 0 or FUSED_GU), HAS_B1,
                 STORE_H, STORE_A, BLOCK_M, BLOCK_N)


@triton.jit(do_not_specialize=["TK"])
def _up_proj_persistent_kernel(
    x_ptr,  # [T, d] x.dtype, strides (stride_x_t, stride_x_d)
    w_desc,  # TMA descriptor over the stacked W1 (W_DESC 1 / 2 / 3, see `_up_proj_kernel`)
    b1_ptr,  # [E, w1_out] x.dtype, read when HAS_B1
    sorted_rows_ptr,  # [TK] int32, flat slot of each expert-ordered row
    row_token_ptr,  # [TK] int32, read when TOKEN_MAP
    offsets_ptr,  # [E+1] int32, expert row offsets
    h_ptr,  # [TK, w1_out] x.dtype, contiguous, expert order; written when STORE_H
    a_ptr,  # [TK, n] x.dtype, contiguous, expert order; written when STORE_A
    TK, d, n, E, top_k: tl.constexpr,
    stride_x_t, stride_x_d,
    stride_b1_e, stride_b1_o,
    alpha, limit,
    ACTIVATION: tl.constexpr, GATED: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_B1: tl.constexpr,
    STORE_H: tl.constexpr, STORE_A: tl.constexpr, E_POW2: tl.constexpr, TOKEN_MAP: tl.constexpr,
    W_DESC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """`_up_proj_kernel` for weights read by TMA in one dot per K step (a gated W1 concatenated as
    [E, 2, n, d] (W_DESC 3) or interleaved, or a non-gated one: the dA' GEMM), as a persistent
    kernel: one program per SM walks exactly the real (M tile, N tile) pairs, the tile loop
    flattened into the K loop (`_scatter_gemm_tma_kernel`), so the next tile's loads are in flight
    while this one's epilogue stores H and A. Its x rows are gathered by pointer loads, their
    tokens read at each tile's first K step.

    One program per tile left every SM idle through each tile's prologue and epilogue: with one
    128x256 tile resident per SM, that is ~3 us of stores and first loads to ~22 us of K loop at
    the 7b-256 shape.
    """
    WIDTH: tl.constexpr = BLOCK_N * (1 + GATED)
    lo, hi, tiles, cum = _tile_schedule(offsets_ptr, E, BLOCK_M, E_POW2)
    num_m = tl.sum(tiles, 0)
    num_n = tl.cdiv(n, BLOCK_N)
    stride = tl.num_programs(0)
    tile_c = tl.program_id(0) - stride  # the epilogue's own tile counter (kept apart for the pipeliner)
    ks = tl.arange(0, BLOCK_K)
    for tile_id in tl.range(tl.program_id(0), num_m * num_n, stride, flatten=True):
        tile, pid_n = _grouped_order(tile_id, num_m, num_n, GROUP_M)
        expert, row_start, row_end = _tile_lookup(lo, hi, tiles, cum, tile, BLOCK_M, E_POW2)
        rows = row_start + tl.arange(0, BLOCK_M)
        row_mask = rows < row_end
        tokens = _row_tokens(rows, row_mask, sorted_rows_ptr, row_token_ptr, top_k, TOKEN_MAP)
        x_ptrs = x_ptr + tokens[:, None] * stride_x_t + ks[None, :] * stride_x_d  # [BM, BK]
        acc = tl.zeros((BLOCK_M, WIDTH), dtype=tl.float32)
        for k0 in range(0, d, BLOCK_K):
            xa = tl.load(x_ptrs, mask=row_mask[:, None] & ((k0 + ks) < d)[None, :], other=0.0)
            if W_DESC == 3:
                w = w_desc.load([expert, 0, pid_n * BLOCK_N, k0]).reshape(WIDTH, BLOCK_K).T
            else:  # interleaved gate/up: 2 BLOCK_N consecutive W1 rows; non-gated: BLOCK_N
                w = _w_tile(w_desc, expert, pid_n * WIDTH, k0, WIDTH, BLOCK_K, W_DESC)
            acc = tl.dot(xa, w, acc)
            x_ptrs += BLOCK_K * stride_x_d

        tile_c += stride
        tile, pid_n = _grouped_order(tile_c, num_m, num_n, GROUP_M)
        expert, row_start, row_end = _tile_lookup(lo, hi, tiles, cum, tile, BLOCK_M, E_POW2)
        rows = row_start + tl.arange(0, BLOCK_M)
        row_mask = rows < row_end
        if GATED and not INTERLEAVED:
            acc_g, acc_u = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N)), (0, 2, 1)))
        else:
            acc_g = acc
            acc_u = acc
        _up_epilogue(acc, acc_g, acc_u, expert, rows, row_mask, pid_n, n, b1_ptr, stride_b1_e, stride_b1_o, h_ptr,
                     a_ptr, alpha, limit, ACTIVATION, GATED, INTERLEAVED, GATED and INTERLEAVED, HAS_B1, STORE_H,
                     STORE_A, BLOCK_M, BLOCK_N)


@triton.jit
def _up_epilogue(acc, acc_g, acc_u, expert, rows, row_mask, pid_n, n, b1_ptr, stride_b1_e, stride_b1_o, h_ptr, a_ptr,
                 alpha, limit, ACTIVATION: tl.constexpr, GATED: tl.constexpr, INTERLEAVED: tl.constexpr,
                 WIDE_H: tl.constexpr, HAS_B1: tl.constexpr, STORE_H: tl.constexpr, STORE_A: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The up-projection's epilogue: + b1[e], H stored, A = act(H) stored, for the tile of rows
    `rows` and A columns pid_n * BLOCK_N + [0, BLOCK_N). WIDE_H (interleaved gated H): `acc` holds
    H's own columns 2j .. 2j + 2 BLOCK_N and is stored as one tile; otherwise acc_g / acc_u hold the
    gate and up columns (both the one accumulator of a non-gated W1), stored apart in H's layout."""
    w1_out = n * (1 + GATED)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n
    if GATED and INTERLEAVED:
        gate_cols = 2 * cols
        up_cols = 2 * cols + 1
    elif GATED:
        gate_cols = cols
        up_cols = cols + n
    else:
        gate_cols = cols
        up_cols = cols
    out_dtype = h_ptr.dtype.element_ty
    mask = row_mask[:, None] & col_mask[None, :]
    rows64 = rows.to(tl.int64)
    b_base = b1_ptr + expert.to(tl.int64) * stride_b1_e
    if WIDE_H:
        h_cols = 2 * pid_n * BLOCK_N + tl.arange(0, 2 * BLOCK_N)
        h_col_mask = h_cols < w1_out
        if HAS_B1:
            acc += tl.load(b_base + h_cols * stride_b1_o, mask=h_col_mask, other=0.0).to(tl.float32)[None, :]
        h = acc.to(out_dtype)
        if STORE_H:
            h_mask = row_mask[:, None] & h_col_mask[None, :]
            tl.store(h_ptr + rows64[:, None] * w1_out + h_cols[None, :], h, mask=h_mask)
        h_g, h_u = tl.split(tl.reshape(h, (BLOCK_M, BLOCK_N, 2)))
    else:
        if HAS_B1:
            acc_g += tl.load(b_base + gate_cols * stride_b1_o, mask=col_mask, other=0.0).to(tl.float32)[None, :]
            if GATED:
                acc_u += tl.load(b_base + up_cols * stride_b1_o, mask=col_mask, other=0.0).to(tl.float32)[None, :]
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


@triton.jit
def _scatter_store(acc, expert, rows, row_mask, cols, col_mask, bias_ptr, stride_bias_e, sorted_rows_ptr, out_ptr,
                   n_dim, HAS_BIAS: tl.constexpr):
    """The scatter GEMMs' epilogue: + bias[e], then row r of the tile to its slot's row of out."""
    if HAS_BIAS:
        bias = tl.load(bias_ptr + expert.to(tl.int64) * stride_bias_e + cols, mask=col_mask, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    slots = tl.load(sorted_rows_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    out_ptrs = out_ptr + slots[:, None] * n_dim + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


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
    tile, pid_n = _grouped_order(tl.program_id(0), tl.cdiv(TK, BLOCK_M) + E, tl.cdiv(n_dim, BLOCK_N), GROUP_M)
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
    _scatter_store(acc, expert, rows, row_mask, cols, col_mask, bias_ptr, stride_bias_e, sorted_rows_ptr, out_ptr,
                   n_dim, HAS_BIAS)


@triton.jit(do_not_specialize=["TK"])
def _scatter_gemm_tma_kernel(
    in_desc,  # TMA descriptor over in [TK, k_dim] x.dtype (contiguous, expert order), block [BLOCK_M, BLOCK_K]
    w_desc,  # TMA descriptor over the stacked weights (see `_w_tile`: W_DESC 1 [E, n_dim, k_dim], 2 [E, k_dim, n_dim])
    bias_ptr,  # [E, n_dim] x.dtype, read when HAS_BIAS
    sorted_rows_ptr,  # [TK] int32, flat slot of each expert-ordered row
    offsets_ptr,  # [E+1] int32
    out_ptr,  # [TK, n_dim] x.dtype, contiguous, SLOT order
    TK, k_dim, n_dim, E,
    stride_bias_e,
    HAS_BIAS: tl.constexpr, E_POW2: tl.constexpr, W_DESC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """`_scatter_gemm_kernel` for stacked weights as a persistent kernel: one program per SM walks
    exactly the real (M tile, N tile) pairs, both operands arriving by TMA, and the tile loop is
    flattened into the K loop so the next tile's loads are in flight during this tile's epilogue.
    That overlap is the point: with fine-grained experts the reduction is short (k_dim = n = 256 in
    the down-projection: four K steps), and one tile per program left the tensor cores idle through
    every prologue and scattered store.

    The A tile of an expert's last M tile may run into the next expert's rows (or past TK, read as
    zeros); those rows are computed and never stored.
    """
    lo, hi, tiles, cum = _tile_schedule(offsets_ptr, E, BLOCK_M, E_POW2)
    num_m = tl.sum(tiles, 0)
    num_n = tl.cdiv(n_dim, BLOCK_N)
    stride = tl.num_programs(0)
    tile_c = tl.program_id(0) - stride  # the epilogue's own tile counter (kept apart for the pipeliner)
    for tile_id in tl.range(tl.program_id(0), num_m * num_n, stride, flatten=True):
        tile, pid_n = _grouped_order(tile_id, num_m, num_n, GROUP_M)
        expert, row_start, row_end = _tile_lookup(lo, hi, tiles, cum, tile, BLOCK_M, E_POW2)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, k_dim, BLOCK_K):
            a = in_desc.load([row_start, k0])
            w = _w_tile(w_desc, expert, pid_n * BLOCK_N, k0, BLOCK_N, BLOCK_K, W_DESC)
            acc = tl.dot(a, w, acc)

        tile_c += stride
        tile, pid_n = _grouped_order(tile_c, num_m, num_n, GROUP_M)
        expert, row_start, row_end = _tile_lookup(lo, hi, tiles, cum, tile, BLOCK_M, E_POW2)
        rows = row_start + tl.arange(0, BLOCK_M)
        row_mask = rows < row_end
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < n_dim
        _scatter_store(acc, expert, rows, row_mask, cols, col_mask, bias_ptr, stride_bias_e, sorted_rows_ptr,
                       out_ptr, n_dim, HAS_BIAS)
