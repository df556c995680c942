"""The deterministic gather-sum over each token's slots (step 4 and the end of step 7 of DESIGN.md).

    out[t] = sum_k s[t, k] * Y[t*K + k]      (forward combine, HAS_WEIGHTS)
    dX[t]  = sum_k dX~[t*K + k]              (backward, no weights)
    dX[t] += sum_j L[t, j] R[j]              (backward, HAS_PRODUCT: another [T, J] @ [J, d] term of
                                              x's gradient, the router's, added before the one rounding)

Each token's slots are [t*K, t*K + K) for [T, K] routing, [token_offsets[t], token_offsets[t+1])
in the slot form (SLOTS), where padding slots (id -1) were never written and are skipped. Y and
dX~ hold slot s's row at row s (slot order, `_scatter_gemm_kernel`), or at row row_map[s]
(ROW_MAP: TILE order, `gluon_scatter_gemm(out_tiles=True)`, the map written by that launch). The
sum runs in float32 in a fixed order: no atomics, bitwise repeatable.
"""
import triton
import triton.language as tl


@triton.jit
def _weighted_row(y_ptr, s_ptr, row_map_ptr, slot, live, cols, d, HAS_WEIGHTS: tl.constexpr, ROW_MAP: tl.constexpr):
    """(s[slot]) * y[slot's row, cols] in float32, zeros where not `live`."""
    mask = live[:, None] & (cols < d)[None, :]
    row = slot
    if ROW_MAP:
        row = tl.load(row_map_ptr + slot, mask=live, other=0).to(tl.int64)
    y = tl.load(y_ptr + row[:, None] * d + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_WEIGHTS:
        s = tl.load(s_ptr + slot, mask=live, other=0.0).to(tl.float32)
        y = y * s[:, None]
    return y


@triton.jit
def _token_rows_sum(acc, y_ptr, s_ptr, ids_ptr, token_offsets_ptr, row_map_ptr, toks, t_mask, cols, d,
                    TOP_K: tl.constexpr, HAS_WEIGHTS: tl.constexpr, SLOTS: tl.constexpr, ROW_MAP: tl.constexpr):
    """acc + the (weighted) sum of each token's rows of y, in float32 and a fixed slot order."""
    if SLOTS:
        first = tl.load(token_offsets_ptr + toks, mask=t_mask, other=0).to(tl.int64)
        count = tl.load(token_offsets_ptr + toks + 1, mask=t_mask, other=0).to(tl.int64) - first
        n_slots = tl.max(count, 0)
        for k in range(0, n_slots):
            slot = first + k
            live = t_mask & (k < count)
            live = live & (tl.load(ids_ptr + slot, mask=live, other=-1) >= 0)
            acc += _weighted_row(y_ptr, s_ptr, row_map_ptr, slot, live, cols, d, HAS_WEIGHTS, ROW_MAP)
    else:
        first = toks.to(tl.int64) * TOP_K
        for k in tl.static_range(TOP_K):
            acc += _weighted_row(y_ptr, s_ptr, row_map_ptr, first + k, t_mask, cols, d, HAS_WEIGHTS, ROW_MAP)
    return acc


@triton.jit(do_not_specialize=["T"])
def _gather_sum_kernel(
    y_ptr,  # [rows, d] x.dtype, contiguous: slot order, or TILE order (ROW_MAP)
    s_ptr,  # [TK] router weights (any float dtype), contiguous; read when HAS_WEIGHTS
    ids_ptr,  # [TK] int expert id per slot (-1: padding); read when SLOTS
    token_offsets_ptr,  # [T+1] int32, first slot of each token; read when SLOTS
    row_map_ptr,  # [TK] int32, y's row of each slot; read when ROW_MAP
    out_ptr,  # [T, d] out dtype, contiguous
    T, d,
    TOP_K: tl.constexpr,  # K of [T, K] routing (the slot form reads each token's count instead)
    HAS_WEIGHTS: tl.constexpr, SLOTS: tl.constexpr, ROW_MAP: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Grid: (cdiv(T, BLOCK_T), cdiv(d, BLOCK_D)). With [T, K] routing the K slots' loop is unrolled
    (K a constexpr), so all K row loads of a token are in flight together."""
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    t_mask = toks < T
    acc = _token_rows_sum(tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32), y_ptr, s_ptr, ids_ptr, token_offsets_ptr,
                          row_map_ptr, toks, t_mask, cols, d, TOP_K, HAS_WEIGHTS, SLOTS, ROW_MAP)
    mask = t_mask[:, None] & (cols < d)[None, :]
    tl.store(out_ptr + toks.to(tl.int64)[:, None] * d + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _row_map_tile(row_map_ptr, tb, T, ks, TOP_K: tl.constexpr, BLOCK_T: tl.constexpr):
    """[K_POW2, BLOCK_T] int32: the y rows of token block tb's slots (token t's k-th slot is t*K + k),
    zeros past T or TOP_K."""
    toks = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    live = (ks < TOP_K)[:, None] & (toks < T)[None, :]
    return tl.load(row_map_ptr + toks.to(tl.int64)[None, :] * TOP_K + ks[:, None], mask=live, other=0)


@triton.jit
def _mapped_rows_sum(acc, y_ptr, rows, ks, t_mask, cols, d, TOP_K: tl.constexpr):
    """acc + the sum of each token's K rows of y, their row numbers given ([K_POW2, BLOCK_T],
    `_row_map_tile`), in float32. All K_POW2 * BLOCK_T rows arrive in one 2D load, k-major, then
    fold over k. The 2D load keeps its coalesced layout (rows dealt round-robin to the warps), so
    when BLOCK_T is a multiple of the rows one pass of that layout spans (16 at most with 8 warps
    and BLOCK_D >= 128), a token's K rows sit in one thread's registers and the fold needs no
    shared memory (checked in the sm90 TTGIR of every launch of `gather_sum_product_launch`, Triton
    3.6 and 3.9). Summed k by k into the dot's accumulator instead (up to `ed62791`), each row
    tile went through shared memory into the dot's layout, between barriers that kept one row load
    in flight at a time: 290 against 251 us at the 7b-256 shape on the H100."""
    K_POW2: tl.constexpr = rows.shape[0]
    BLOCK_T: tl.constexpr = rows.shape[1]
    live = tl.reshape((ks < TOP_K)[:, None] & t_mask[None, :], (K_POW2 * BLOCK_T,))
    flat = tl.reshape(rows, (K_POW2 * BLOCK_T,)).to(tl.int64)
    y = tl.load(y_ptr + flat[:, None] * d + cols[None, :], mask=live[:, None] & (cols < d)[None, :], other=0.0)
    return acc + tl.sum(tl.reshape(y.to(tl.float32), (K_POW2, BLOCK_T, cols.shape[0])), 0)


@triton.jit
def _product_rows(l_rows, rhs, rhs_ptr, js, t_mask, cols, c_mask, J, stride_lj, stride_rj, stride_rd,
                  BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_J: tl.constexpr, R_RESIDENT: tl.constexpr,
                  DOT_PRECISION: tl.constexpr):
    """L[toks] @ R[:, cols] in float32: `rhs` is R's resident tile (R_RESIDENT), else R is read in
    BLOCK_J chunks from rhs_ptr."""
    if R_RESIDENT:
        lhs = tl.load(l_rows + js[None, :] * stride_lj, mask=t_mask[:, None] & (js < J)[None, :], other=0.0)
        return tl.dot(lhs, rhs, input_precision=DOT_PRECISION)
    prod = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for j0 in range(0, J, BLOCK_J):
        j_mask = (j0 + js) < J
        lhs = tl.load(l_rows + (j0 + js)[None, :] * stride_lj, mask=t_mask[:, None] & j_mask[None, :], other=0.0)
        part = tl.load(rhs_ptr + (j0 + js)[:, None].to(tl.int64) * stride_rj + cols[None, :] * stride_rd,
                       mask=j_mask[:, None] & c_mask[None, :], other=0.0)
        prod = tl.dot(lhs, part, prod, input_precision=DOT_PRECISION)
    return prod


@triton.jit(do_not_specialize=["T"])
def _gather_sum_product_kernel(
    y_ptr, ids_ptr, token_offsets_ptr, row_map_ptr,  # as _gather_sum_kernel's (no weights: the backward's dX~)
    lhs_ptr, rhs_ptr,  # L [T, J] and R [J, d], any strides
    out_ptr,  # [T, d] out dtype, contiguous
    T, d, J,
    stride_lt, stride_lj, stride_rj, stride_rd,
    TOP_K: tl.constexpr, SLOTS: tl.constexpr, ROW_MAP: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_J: tl.constexpr,
    R_RESIDENT: tl.constexpr,  # J <= BLOCK_J: R's [J, BLOCK_D] tile is loaded once per program
    PRODUCT_FIRST: tl.constexpr,  # the dot before the row loads (else after)
    DOT_PRECISION: tl.constexpr,
    K_POW2: tl.constexpr,  # TOP_K rounded up to a power of two: the width of a token block's row-map tile
    PREFETCH: tl.constexpr,  # ROW_MAP and not SLOTS only: load the next token block's map entries a block ahead
):
    """out[t] = sum of token t's rows of y + L[t] @ R. Grid: (programs over token blocks,
    cdiv(d, BLOCK_D)); a program takes token blocks pid, pid + grid0, ... . tl.dot needs BLOCK_T and
    BLOCK_J of at least 16. With [T, K] routing and a row map, a program loads the next token
    block's row-map entries while it sums the current block's rows, so a block's row loads wait on
    no map load of their own."""
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    c_mask = cols < d
    js = tl.arange(0, BLOCK_J)
    rhs = js  # (unread unless R_RESIDENT)
    if R_RESIDENT:
        rhs = tl.load(rhs_ptr + js[:, None].to(tl.int64) * stride_rj + cols[None, :] * stride_rd,
                      mask=(js < J)[:, None] & c_mask[None, :], other=0.0)
    ks = tl.arange(0, K_POW2)
    if PREFETCH:
        next_rows = _row_map_tile(row_map_ptr, tl.program_id(0), T, ks, TOP_K, BLOCK_T)
    for tb in range(tl.program_id(0), tl.cdiv(T, BLOCK_T), tl.num_programs(0)):
        toks = tb * BLOCK_T + tl.arange(0, BLOCK_T)
        t_mask = toks < T
        l_rows = lhs_ptr + toks.to(tl.int64)[:, None] * stride_lt
        if PRODUCT_FIRST:
            prod = _product_rows(l_rows, rhs, rhs_ptr, js, t_mask, cols, c_mask, J, stride_lj, stride_rj, stride_rd,
                                 BLOCK_T, BLOCK_D, BLOCK_J, R_RESIDENT, DOT_PRECISION)
        acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
        if SLOTS:
            acc = _token_rows_sum(acc, y_ptr, y_ptr, ids_ptr, token_offsets_ptr, row_map_ptr, toks, t_mask, cols, d,
                                  TOP_K, False, SLOTS, ROW_MAP)
        else:
            if PREFETCH:
                rows = next_rows
                next_rows = _row_map_tile(row_map_ptr, tb + tl.num_programs(0), T, ks, TOP_K, BLOCK_T)
            elif ROW_MAP:
                rows = _row_map_tile(row_map_ptr, tb, T, ks, TOP_K, BLOCK_T)
            else:  # slot order: token t's k-th row is t*K + k
                rows = toks[None, :].to(tl.int64) * TOP_K + ks[:, None]
            acc = _mapped_rows_sum(acc, y_ptr, rows, ks, t_mask, cols, d, TOP_K)
        if not PRODUCT_FIRST:
            prod = _product_rows(l_rows, rhs, rhs_ptr, js, t_mask, cols, c_mask, J, stride_lj, stride_rj, stride_rd,
                                 BLOCK_T, BLOCK_D, BLOCK_J, R_RESIDENT, DOT_PRECISION)
        acc += prod
        mask = t_mask[:, None] & c_mask[None, :]
        tl.store(out_ptr + toks.to(tl.int64)[:, None] * d + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=mask)
