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

from ..ints import pow2


def e_pow2(E: int) -> int:
    """E_POW2, the width of the schedule's per-expert vectors: E rounded up to a power of two (>= 2)."""
    return max(2, pow2(E))


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


@triton.jit(do_not_specialize=["S", "T"])
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
# each, in three launches (counts per piece, their prefix over the pieces, placement) instead of the
# torch path's sort, scatter and cumsum (about a dozen launches, each a host round trip on the step).
# A piece is one tile: its counts are a histogram, and its slots sorted by (bucket, slot) stand in
# bucket order, so a slot's rank among the piece's slots of its bucket is its sorted position less the
# piece's slots of the buckets before.

_KEY_SHIFT = tl.constexpr(16)  # a sort key: bucket << 16 | the slot's index in its piece (CHUNK <= 2**15)
_DEAD = tl.constexpr(0x7FFF)  # the bucket of the slots past TK in a sort key: after every real bucket (<= 512)


@triton.jit
def _piece_ids(ids_ptr, piece, TK, E, PADDED: tl.constexpr, CHUNK: tl.constexpr):
    """(the piece's slots, live, bucket of each): `_chunk_ids` over piece `piece`'s CHUNK slots."""
    start = piece * CHUNK
    return _chunk_ids(ids_ptr, start, tl.minimum(start + CHUNK, TK), E, PADDED, CHUNK)


@triton.jit(do_not_specialize=["TK", "n_pieces"], debug=True)
def _route_count_kernel(ids_ptr, counts_ptr, start_ptr, TK, E, n_pieces, PADDED: tl.constexpr,
                        B_POW2: tl.constexpr, CHUNK: tl.constexpr):
    """Program b, over slots [b CHUNK, (b + 1) CHUNK): counts[e, b] = its bucket-e slots, start[e, b]
    = its slots of the buckets before e (both [B_POW2, n_pieces]: a bucket's row is contiguous for
    the prefix kernel)."""
    piece = tl.program_id(0)
    _, live, ids = _piece_ids(ids_ptr, piece, TK, E, PADDED, CHUNK)
    n_buckets = E + 1 if PADDED else E
    tl.device_assert(((ids >= 0) & (ids < n_buckets)) | ~live, "expert id out of range")
    counts = tl.histogram(ids, B_POW2, mask=live)
    at = tl.arange(0, B_POW2) * n_pieces + piece
    tl.store(counts_ptr + at, counts)
    tl.store(start_ptr + at, tl.cumsum(counts, 0) - counts)


@triton.jit(do_not_specialize=["n_pieces"])
def _route_prefix_kernel(counts_ptr, start_ptr, offsets_ptr, n_pieces, E, BLOCK_P: tl.constexpr):
    """Program e, bucket e (B_POW2 programs): start[e, b] becomes (the bucket-e slots in the pieces
    before b) - start[e, b], so that a slot's row is offsets[e] + start[e, b] + its sorted position in
    piece b. On the way, offsets [E+1]: start[e, b] as the count kernel left it holds piece b's slots
    of the buckets before e, so its sum over the pieces is offsets[e] (the exclusive prefix of the
    buckets' totals), and program E - 1 adds its own total for offsets[E]. No program reads another's
    results: one pass, not a second one over every bucket's counts."""
    e = tl.program_id(0)
    carry = 0
    before = 0
    for p0 in range(0, n_pieces, BLOCK_P):
        piece = p0 + tl.arange(0, BLOCK_P)
        live = piece < n_pieces
        at = e * n_pieces + piece
        c = tl.load(counts_ptr + at, mask=live, other=0)
        first = tl.load(start_ptr + at, mask=live, other=0)
        tl.store(start_ptr + at, carry + tl.cumsum(c, 0) - c - first, mask=live)
        carry += tl.sum(c, 0)
        before += tl.sum(first, 0)
    if e < E:
        tl.store(offsets_ptr + e, before)
    if e == E - 1:
        tl.store(offsets_ptr + E, before + carry)


@triton.jit(do_not_specialize=["TK", "n_pieces"])
def _route_place_kernel(ids_ptr, start_ptr, offsets_ptr, sorted_rows_ptr, TK, E, n_pieces,
                        PADDED: tl.constexpr, B_POW2: tl.constexpr, CHUNK: tl.constexpr, SORT: tl.constexpr,
                        BLOCK: tl.constexpr):
    """Program b: piece b's slots sorted by (bucket, slot); the one at sorted position p, bucket e
    (padding: E, after every expert), goes to row offsets[e] + start[e, b] + p.

    SORT False (the interpreter, whose `tl.sort` takes seconds a piece): the same rows by
    `_place_chunk`'s [BLOCK, buckets] ranks, BLOCK slots at a time, from each bucket's first row
    offsets[e] + start[e, b] + (the piece's slots of the buckets before e)."""
    piece = tl.program_id(0)
    if SORT:
        _, live, ids = _piece_ids(ids_ptr, piece, TK, E, PADDED, CHUNK)
        local = tl.arange(0, CHUNK)
        keys = tl.sort((tl.where(live, ids, _DEAD) << _KEY_SHIFT) | local, 0)
        bucket = keys >> _KEY_SHIFT
        real = bucket != _DEAD
        row = (tl.load(start_ptr + bucket * n_pieces + piece, mask=real, other=0)
               + tl.load(offsets_ptr + bucket, mask=real, other=0) + local)
        tl.store(sorted_rows_ptr + row, piece * CHUNK + (keys & 0xFFFF), mask=real)
    else:
        _, live, ids = _piece_ids(ids_ptr, piece, TK, E, PADDED, CHUNK)
        counts = tl.histogram(ids, B_POW2, mask=live)
        bucket = tl.arange(0, B_POW2)
        placed = (tl.load(start_ptr + bucket * n_pieces + piece) + tl.load(offsets_ptr + bucket, mask=bucket <= E, other=0)
                  + tl.cumsum(counts, 0) - counts)
        end = tl.minimum((piece + 1) * CHUNK, TK)
        for start in range(piece * CHUNK, end, BLOCK):
            slot, live, ids = _chunk_ids(ids_ptr, start, end, E, PADDED, BLOCK)
            placed = _place_chunk(slot, live, ids, bucket, placed, sorted_rows_ptr)
