"""The per-expert M-tile schedule, computed inside each grouped-GEMM program (no host sync).

Rows are in expert order: expert e owns rows [offsets[e], offsets[e+1]). With tiles of BLOCK_M rows,
expert e needs cdiv(count_e, BLOCK_M) tiles, so sum_e cdiv(count_e, BLOCK_M) <= cdiv(TK, BLOCK_M) + E.
The launchers size the grid from that upper bound (host integers only); a program whose tile index
lies past the real total finds expert == E and exits. Computing the schedule in the program (an
E-wide cumsum, E <= a few hundred) keeps BLOCK_M an autotuning parameter: no schedule tensor per tile
size, and nothing for the host to wait on.
"""
import triton
import triton.language as tl


@triton.jit
def _expert_tile(offsets_ptr, E, tile, BLOCK_M: tl.constexpr, E_POW2: tl.constexpr):
    """(expert, first row of this tile, end row of the expert) for M-tile number `tile`.

    offsets_ptr: [E+1] int32, exclusive prefix of the per-expert row counts.
    expert == E means `tile` is past the last real tile (the caller returns).
    """
    e_idx = tl.arange(0, E_POW2)
    in_range = e_idx < E
    lo = tl.load(offsets_ptr + e_idx, mask=in_range, other=0)
    hi = tl.load(offsets_ptr + e_idx + 1, mask=in_range, other=0)
    tiles = (hi - lo + BLOCK_M - 1) // BLOCK_M
    cum = tl.cumsum(tiles, 0)  # inclusive: tiles of experts 0..e
    expert = tl.sum((cum <= tile).to(tl.int32), 0)
    this = e_idx == expert
    first_tile = tl.sum(tl.where(this, cum - tiles, 0), 0)
    row_lo = tl.sum(tl.where(this, lo, 0), 0)
    row_hi = tl.sum(tl.where(this, hi, 0), 0)
    return expert, row_lo + (tile - first_tile) * BLOCK_M, row_hi
