"""The deterministic K-way gather-sum (step 4 and the end of step 7 of DESIGN.md).

    out[t] = sum_k s[t, k] * Y[t*K + k]      (forward combine, HAS_WEIGHTS)
    dX[t]  = sum_k dX~[t*K + k]              (backward, no weights)

Y and dX~ are stored in slot order by `_scatter_gemm_kernel`, so each token's K rows are one
contiguous [K, d] block. The sum runs in float32 in a fixed k order: no atomics, bitwise repeatable.
"""
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["T"])
def _gather_sum_kernel(
    y_ptr,  # [T*K, d] x.dtype, contiguous, slot order
    s_ptr,  # [T*K] router weights (any float dtype), contiguous; read when HAS_WEIGHTS
    out_ptr,  # [T, d] out dtype, contiguous
    T, d, top_k,
    HAS_WEIGHTS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Grid: (cdiv(T, BLOCK_T), cdiv(d, BLOCK_D))."""
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    t_mask = toks < T
    mask = t_mask[:, None] & (cols < d)[None, :]
    toks64 = toks.to(tl.int64)
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for k in range(0, top_k):
        slot = toks64 * top_k + k
        y = tl.load(y_ptr + slot[:, None] * d + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_WEIGHTS:
            s = tl.load(s_ptr + slot, mask=t_mask, other=0.0).to(tl.float32)
            y = y * s[:, None]
        acc += y
    tl.store(out_ptr + toks64[:, None] * d + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)
