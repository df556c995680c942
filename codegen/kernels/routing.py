"""The per-expert M-tile schedule, computed inside each grouped-GEMM program (no host sync), and the
one-program routing kernel of small batches (`_route_small_kernel`).

Rows are in expert order: expert e owns rows [offsets[e], offsets[e+1]). With tiles of BLOCK_M rows,
expert e needs cdiv(count_e, BLOCK_M) tiles, so sum_e cdiv(count_e, BLOCK_M) <= cdiv(TK, BLOCK_M) + E.
The launchers size the grid from that upper bound (host integers only); a program whose tile index
lies past the real total finds expert == E and exits. Persistent kernels (one program per SM)
instead loop over exactly the real tiles, read from the same schedule. Computing the schedule in the program (an
E-wide cumsum, E <= a few hundred) keeps BLOCK_M an autotuning parameter: no schedule tensor per tile
size, and nothing for the host to wait on.
"""
import triton
import triton.language as tl


def e_pow2(E: int) -> int:
    """E_POW2, the width of the schedule's per-expert vectors: E rounded up to a power of two (>= 2)."""
    return max(2, triton.next_power_of_2(E))


@triton.jit
def _tile_schedule(offsets_ptr, E, BLOCK_M: tl.constexpr, E_POW2: tl.constexpr):
    """(first row, end row, M tiles, inclusive cumsum of the M tiles) of every expert, as E_POW2-wide
    vectors (offsets_ptr: [E+1] int32, the exclusive prefix of the per-expert row counts)."""
    e_idx = tl.arange(0, E_POW2)
    in_range = e_idx < E
    lo = tl.load(offsets_ptr + e_idx, mask=in_range, other=0)
    hi = tl.load(offsets_ptr + e_idx + 1, mask=in_range, other=0)
    tiles = (hi - lo + BLOCK_M - 1) // BLOCK_M
    return lo, hi, tiles, tl.cumsum(tiles, 0)


@triton.jit
def _tile_lookup(lo, hi, tiles, cum, tile, BLOCK_M: tl.constexpr, E_POW2: tl.constexpr):
    """(expert, first row of this tile, end row of the expert) for M-tile number `tile` of the
    schedule; expert == E when `tile` lies past the last real tile."""
    e_idx = tl.arange(0, E_POW2)
    expert = tl.sum((cum <= tile).to(tl.int32), 0)
    this = e_idx == expert
    first_tile = tl.sum(tl.where(this, cum - tiles, 0), 0)
    row_lo = tl.sum(tl.where(this, lo, 0), 0)
    row_hi = tl.sum(tl.where(this, hi, 0), 0)
    return expert, row_lo + (tile - first_tile) * BLOCK_M, row_hi


@triton.jit
def _expert_tile(offsets_ptr, E, tile, BLOCK_M: tl.constexpr, E_POW2: tl.constexpr):
    """(expert, first row of this tile, end row of the expert) for M-tile number `tile`; expert == E
    means `tile` is past the last real tile (the caller returns)."""
    lo, hi, tiles, cum = _tile_schedule(offsets_ptr, E, BLOCK_M, E_POW2)
    return _tile_lookup(lo, hi, tiles, cum, tile, BLOCK_M, E_POW2)


@triton.jit
def _chunk_ids(ids_ptr, start, end, E, PADDED: tl.constexpr, BLOCK: tl.constexpr):
    """(slots, live, bucket of each slot) for the BLOCK slots from `start` below `end`; PADDED: a
    padding slot (id -1) is bucket E."""
    slot = start + tl.arange(0, BLOCK)
    live = slot < end
    ids = tl.load(ids_ptr + slot, mask=live, other=0)
    if PADDED:
        ids = tl.where(ids == -1, E, ids)
    return slot, live, ids.to(tl.int32)


@triton.jit
def _chunk_counts(live, ids, bucket, n_buckets):
    """The chunk's bucket counts; an id out of range fails the device assert (kernels with debug=True)."""
    tl.device_assert(((ids >= 0) & (ids < n_buckets)) | ~live, "expert id out of range")
    return tl.sum(((ids[:, None] == bucket[None, :]) & live[:, None]).to(tl.int32), 0)


@triton.jit
def _place_chunk(slot, live, ids, bucket, placed, sorted_rows_ptr):
    """Each slot to row placed[bucket] + its rank among the chunk's slots of that bucket; -> the
    buckets' next free rows."""
    hit = ((ids[:, None] == bucket[None, :]) & live[:, None]).to(tl.int32)
    row = tl.sum(hit * (tl.cumsum(hit, 0) - 1 + placed[None, :]), 1)  # inclusive rank - 1, per bucket
    tl.store(sorted_rows_ptr + row, slot.to(tl.int32), mask=live)
    return placed + tl.sum(hit, 0)


@triton.jit
def _store_offsets(offsets_ptr, bucket, counts, prefix, E):
    """offsets [E+1]: the buckets' exclusive prefix, then the experts' total. The total is stored on
    its own: with E a power of two and no padding bucket, there is no bucket E to carry it."""
    tl.store(offsets_ptr + bucket, prefix, mask=bucket < E)
    tl.store(offsets_ptr + E, tl.sum(tl.where(bucket < E, counts, 0), 0))


@triton.jit(do_not_specialize=["TK"], debug=True)
def _route_small_kernel(ids_ptr, sorted_rows_ptr, offsets_ptr, TK, E,
                        PADDED: tl.constexpr, B_POW2: tl.constexpr, BLOCK: tl.constexpr):
    """The routing metadata of a few hundred slots in one program: a stable counting sort.

    Same contract as `codegen.reference.torch_route`: sorted_rows [TK] lists the flat slots in
    expert order, token order inside an expert; offsets [E+1] is the exclusive prefix of the counts.
    PADDED: id -1 is a padding slot, bucket E, sorted last and not counted. Two passes over the ids
    in chunks of BLOCK: the per-expert counts, then each slot's place = its expert's offset + the
    expert's slots already placed + its rank among the chunk's slots of that expert. One launch
    instead of the torch path's sort, scatter and cumsum: what decode-size batches pay for is
    launches, not bandwidth. An id out of range fails the device assert (`debug=True` keeps it).
    """
    bucket = tl.arange(0, B_POW2)
    n_buckets = E + 1 if PADDED else E
    counts = tl.zeros([B_POW2], dtype=tl.int32)
    for start in range(0, TK, BLOCK):
        _, live, ids = _chunk_ids(ids_ptr, start, TK, E, PADDED, BLOCK)
        counts += _chunk_counts(live, ids, bucket, n_buckets)
    placed = tl.cumsum(counts, 0) - counts  # exclusive prefix: the first row of each bucket
    _store_offsets(offsets_ptr, bucket, counts, placed, E)
    for start in range(0, TK, BLOCK):
        slot, live, ids = _chunk_ids(ids_ptr, start, TK, E, PADDED, BLOCK)
        placed = _place_chunk(slot, live, ids, bucket, placed, sorted_rows_ptr)


@triton.jit
def _slot_check_kernel(ids_ptr, token_ptr, ok_ptr, S, T, PAD: tl.constexpr, BLOCK: tl.constexpr):
    """Grid: (cdiv(S, BLOCK),); ok_ptr[0] holds 1 before the launch. It stays 1 when the slot
    form's tokens (flat [S], contiguous) are nondecreasing and every real slot's token lies in
    [0, T) (a padding slot, id PAD, may carry any token >= 0); a program that finds a slot breaking
    that stores 0 (every such store writes the same value). `codegen.reference.slot_tokens_ok` in
    one launch instead of ten; one program per block, since one program walking all the slots took
    ~50 us at 82k slots (H100)."""
    s = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = s < S
    tok = tl.load(token_ptr + s, mask=live, other=0)
    prev = tl.load(token_ptr + s - 1, mask=live & (s > 0), other=0)
    real = tl.load(ids_ptr + s, mask=live, other=PAD) != PAD
    bad = live & ((tok < 0) | (real & (tok >= T)) | ((s > 0) & (tok < prev)))
    if tl.sum(bad.to(tl.int32), 0) > 0:
        tl.store(ok_ptr, 0)


# The routing of larger batches: the same stable counting sort over CHUNK-slot pieces, one program
# each, in three launches (counts per piece, their prefix, placement) instead of the torch path's
# sort, scatter and cumsum (about a dozen launches, each a host round trip on the step).


@triton.jit(do_not_specialize=["TK"], debug=True)
def _route_count_kernel(ids_ptr, counts_ptr, TK, E, PADDED: tl.constexpr, B_POW2: tl.constexpr,
                        CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Program b: counts[b, :] = the bucket counts of slots [b CHUNK, (b + 1) CHUNK)."""
    piece = tl.program_id(0)
    bucket = tl.arange(0, B_POW2)
    n_buckets = E + 1 if PADDED else E
    end = tl.minimum((piece + 1) * CHUNK, TK)
    counts = tl.zeros([B_POW2], dtype=tl.int32)
    for start in range(piece * CHUNK, end, BLOCK):
        _, live, ids = _chunk_ids(ids_ptr, start, end, E, PADDED, BLOCK)
        counts += _chunk_counts(live, ids, bucket, n_buckets)
    tl.store(counts_ptr + piece * B_POW2 + bucket, counts)


@triton.jit
def _route_prefix_kernel(counts_ptr, offsets_ptr, n_pieces, E, B_POW2: tl.constexpr, BLOCK_P: tl.constexpr):
    """One program: counts[b, e] becomes the number of bucket-e slots in the pieces before b (in
    place), and offsets [E+1] the exclusive prefix of the buckets' totals."""
    bucket = tl.arange(0, B_POW2)
    carry = tl.zeros([B_POW2], dtype=tl.int32)
    for p0 in range(0, n_pieces, BLOCK_P):
        piece = p0 + tl.arange(0, BLOCK_P)
        ptrs = counts_ptr + piece[:, None] * B_POW2 + bucket[None, :]
        live = (piece < n_pieces)[:, None]
        c = tl.load(ptrs, mask=live, other=0)
        tl.store(ptrs, carry[None, :] + tl.cumsum(c, 0) - c, mask=live)
        carry += tl.sum(c, 0)
    _store_offsets(offsets_ptr, bucket, carry, tl.cumsum(carry, 0) - carry, E)


@triton.jit(do_not_specialize=["TK"])
def _route_place_kernel(ids_ptr, before_ptr, offsets_ptr, sorted_rows_ptr, TK, E, PADDED: tl.constexpr,
                        B_POW2: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Program b: each slot of piece b goes to row offsets[e] + (bucket-e slots of earlier pieces)
    + (its rank among this piece's bucket-e slots), e its bucket (padding: E, after every expert)."""
    piece = tl.program_id(0)
    bucket = tl.arange(0, B_POW2)
    end = tl.minimum((piece + 1) * CHUNK, TK)
    placed = (tl.load(before_ptr + piece * B_POW2 + bucket)
              + tl.load(offsets_ptr + bucket, mask=bucket <= E, other=0))
    for start in range(piece * CHUNK, end, BLOCK):
        slot, live, ids = _chunk_ids(ids_ptr, start, end, E, PADDED, BLOCK)
        placed = _place_chunk(slot, live, ids, bucket, placed, sorted_rows_ptr)
