"""The deterministic gather-sum over each token's slots (step 4 and the end of step 7 of DESIGN.md).

    out[t] = sum_k s[t, k] * Y[t*K + k]      (forward combine, HAS_WEIGHTS)
    dX[t]  = sum_k dX~[t*K + k]              (backward, no weights)

Y and dX~ are stored in slot order by `_scatter_gemm_kernel`, so each token's slots are one
contiguous block of rows: [t*K, t*K + K) for [T, K] routing, [token_offsets[t], token_offsets[t+1])
in the slot form (SLOTS), where padding slots (id -1) were never written and are skipped. The sum
runs in float32 in a fixed slot order: no atomics, bitwise repeatable.
"""
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["T"])
def _gather_sum_kernel(
    y_ptr,  # [TK, d] x.dtype, contiguous, slot order
    s_ptr,  # [TK] router weights (any float dtype), contiguous; read when HAS_WEIGHTS
    ids_ptr,  # [TK] int expert id per slot (-1: padding); read when SLOTS
    token_offsets_ptr,  # [T+1] int32, first slot of each token; read when SLOTS
    out_ptr,  # [T, d] out dtype, contiguous
    T, d, top_k,
    HAS_WEIGHTS: tl.constexpr, SLOTS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Grid: (cdiv(T, BLOCK_T), cdiv(d, BLOCK_D))."""
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    t_mask = toks < T
    toks64 = toks.to(tl.int64)
    if SLOTS:
        first = tl.load(token_offsets_ptr + toks, mask=t_mask, other=0).to(tl.int64)
        count = tl.load(token_offsets_ptr + toks + 1, mask=t_mask, other=0).to(tl.int64) - first
        n_slots = tl.max(count, 0)
    else:
        first = toks64 * top_k
        count = tl.full((BLOCK_T,), top_k, tl.int64)
        n_slots = top_k
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for k in range(0, n_slots):
        slot = first + k
        live = t_mask & (k < count)
        if SLOTS:
            live = live & (tl.load(ids_ptr + slot, mask=live, other=-1) >= 0)
        mask = live[:, None] & (cols < d)[None, :]
        y = tl.load(y_ptr + slot[:, None] * d + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_WEIGHTS:
            s = tl.load(s_ptr + slot, mask=live, other=0.0).to(tl.float32)
            y = y * s[:, None]
        acc += y
    mask = t_mask[:, None] & (cols < d)[None, :]
    tl.store(out_ptr + toks64[:, None] * d + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)
