"""Hopper (sm90) scatter GEMM in Gluon, a candidate beside `grouped_gemm._scatter_gemm_tma_kernel`
that `wgrad_choice` times at each key's first call (`codegen.forward.triton_moe_scatter_gemm`).

    out[sorted_rows[r]] = In[r] @ B[e] (+ bias[e])   for expert e's rows r in [offsets[e], offsets[e+1])

float32 accumulate, stored in out's dtype into out [TK, n_dim] in SLOT order (row r of the product
goes to row sorted_rows[r]), or with `out_tiles` in TILE order (each M tile's rows as one box by
TMA; what the op uses, its gather-sums reading each slot's row through the map the same launch
writes: `gluon_scatter_gemm(row_map=...)`).
In [TK, k_dim] is contiguous, in expert order. B[e] [k_dim, n_dim] is
a stacked weight read by TMA through its strides, in one of two layouts (`W_LAYOUT`, the W_DESC
codes of `codegen.launch._weight_desc`):
    1: w [E, n_dim, k_dim], k contiguous, B[e] = w[e]^T   (forward Y = A W2[e]^T: W2 [E, d, n])
    2: w [E, k_dim, n_dim], n contiguous, B[e] = w[e]     (backward dX~ = dH W1[e]: W1 [E, 2n, d])
(T tokens, d hidden, n expert intermediate, E experts, K top-k, TK = T K rows.)

Persistent (one CTA per SM) over the work items (M tile, N tile) of all experts, an expert owning
cdiv(rows_e, BLOCK_M) M tiles, enumerated on the device from `offsets` (no host sync) and walked in
`_grouped_order` (GROUP_M M tiles down each N tile, so the CTAs in flight share weight tiles in L2),
with stride = the grid. Warp specialized, three partitions:
  * loader (LOADER_WARPS = 1 warp, worker): per K step of each work item, the In tile
    [BLOCK_M, BLOCK_K] and the weight tile by TMA into one STAGES-deep ring shared by both
    consumers, filled in item order, one mbarrier expect-tx per slot.
  * two consumer warpgroups (the default partition and a 4-warp worker), ping-ponging the CTA's
    work items: consumer c takes its items j = c, c + 2, ... Each keeps its own [BLOCK_M, BLOCK_N]
    fp32 accumulator (128 x 128: 128 registers a thread), issues `warpgroup_mma` over the slots of
    its item (one wgmma in flight, a slot released on `empty` once the wgmma after it is issued and
    the one reading it done), then runs the epilogue: + bias[e], -> out dtype, a layout conversion
    to 16-byte row vectors and pointer stores to rows sorted_rows[r] (rows past the expert's end
    masked). The MMAs come in turns (`turn` mbarriers, CUTLASS's ping-pong order): consumer c
    starts item j's wgmmas once the other has issued item j-1's, so while one stores, the other
    multiplies. That overlap is the point: the forward's k_dim = n = 256 is 4 K steps of 64, about
    as long as one tile's scattered stores.
Why two consumer warpgroups and not one MMA partition handing its accumulator to an epilogue
partition through shared memory: the hand-off costs a 64 KB (bf16 128x256) staging buffer and a
second barrier pair per tile, and the conversion to store vectors goes through shared memory anyway;
ping-pong keeps each accumulator in the registers of the warps that store it, and Gluon 3.6 runs
wgmma in a 4-warp worker partition as in the default one.

The cooperative schedule (`ScatterTile.coop`, "gluon-coop" in `candidate_tiles`): both consumer
warpgroups take every item, each BLOCK_M / 2 of its rows (a 128x256 item: one m64n256 wgmma per K
step each, on a slice of the In tile and the whole weight tile), so a slot holds one weight tile for
twice the rows and is released when both have arrived (`empty`'s count is 2); no turns (both walk the
same items in order, and neither can run a lap ahead of the other: the loader refills a slot only
once both released it). The epilogue then stalls the tensor cores, once an item, which only long
reductions amortize (`candidate_tiles`).

Ring iteration `it = j * ksteps + k` (item j of this CTA, K step k; ksteps = cdiv(k_dim, BLOCK_K)
is the same for every item) names the slot (it % STAGES) and its phase, so the three partitions
agree on the ring without talking. The turns are also what keeps that sound: an mbarrier wait only
knows a phase's parity, so a consumer that reached item j while the slot's load for iteration
it - STAGES (the other consumer's item) had not landed yet would take the phase before as its own
and read a stale slot, then release it twice. Without the turns the 7b-256 shape (thousands of
items per CTA) died with "unspecified launch failure" on the H100 while the small case passed; with
them, when consumer c waits on item j's slots, every load of items < j has landed. An expert's last M tile may run past the expert: its In box reads
the next expert's rows (or zeros past TK); they are computed and never stored. The K tail past
k_dim reads zeros on both operands (the weight descriptor is 3-D: the tail never reaches into the
next expert's rows).

Written against Triton 3.6's Gluon (`triton.experimental.gluon`, experimental). Importing this
module never fails (the guarded import is `gluon_common`'s, shared with `gluon_wgrad` with the
layouts): `HAS_GLUON` says whether the kernel can be built, `GLUON_IMPORT_ERROR` why not.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..direct_launch import launch
from ..ints import cdiv
from .gluon_common import (GLUON_IMPORT_ERROR, HAS_GLUON, TensorDescriptor, bf16_desc_type, compile_for_sm90,
                           copy_layout, fence_async_shared, gl, gluon, is_sm90, mbarrier, shared_layout, tma,
                           warpgroup_mma, warpgroup_mma_wait, wgmma_acc_layout)
from .routing import e_pow2


@dataclass(frozen=True)
class ScatterTile:
    """One launch configuration; `parse("128x128x64x4")` reads BLOCK_M x BLOCK_N x BLOCK_K x STAGES."""

    block_m: int = 128  # rows per work item: two m64 wgmmas of one consumer warpgroup
    block_n: int = 128  # columns per work item: the wgmma N; the accumulator takes block_m*block_n/128 fp32 regs a thread
    block_k: int = 64  # reduction per ring slot (64 bf16 = one 128-byte swizzle row)
    stages: int = 4  # ring depth: 4 x (128x64 + 64x128) bf16 = 128 KB (+ 2 x 8 KB of epilogue conversion scratch);
    # 6 was 1-22% slower except at 7b-256 Y (H100)
    group_m: int = 8  # M tiles walked together down each N tile (`_grouped_order`): L2 reuse of weight tiles
    consumer_regs: int = 232  # registers per consumer thread of the worker warpgroup (setmaxnreg); the default
    # partition gets the rest of the 12-warp pool: (12 x 32 x 168 - 128 x (consumer_regs + loader_regs)) / 128 = 232
    loader_regs: int = 40  # registers per loader thread (setmaxnreg): TMA issue and the tile lookup only
    loader_warps: int = 1  # TMA issue needs one; 1 beat 4 by 2-10% (H100, `bench_gluon_scatter.py`, 7b-256 dX~ 555 vs 615 us)
    maxnreg: int | None = None  # kernel-wide register cap; None: 65536 / 12 warps, rounded down to 8
    coop: bool = False  # cooperative: both consumer warpgroups on every item, BLOCK_M / 2 rows each, one
    # weight tile shared (spec prefix "coop:"); else ping-pong, a whole item per warpgroup in turns

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name}={v}: a power of two >= 16 (Gluon tensor shapes)")
        rows = self.block_m // 2 if self.coop else self.block_m  # a consumer warpgroup's rows
        if rows not in (64, 128):
            raise ValueError(f"block_m={self.block_m}: a consumer's {rows} rows are not one or two m64 wgmmas"
                             f" ({'128 or 256, cooperative' if self.coop else '64 or 128'})")
        if rows * self.block_n // 128 > 128:
            raise ValueError(f"{self.block_m}x{self.block_n}: the accumulator takes > 128 registers a thread")
        if self.block_n > 256:
            raise ValueError(f"block_n={self.block_n}: a wgmma is at most 256 wide")
        if self.loader_warps not in (1, 2, 4):
            raise ValueError(f"loader_warps={self.loader_warps}: 1, 2 or 4")
        if self.stages < 2 or self.group_m < 1:
            raise ValueError(f"stages={self.stages}, group_m={self.group_m}")
        for name in ("consumer_regs", "loader_regs"):
            v = getattr(self, name)
            if v % 8 or not 24 <= v <= 256:
                raise ValueError(f"{name}={v}: a multiple of 8 in [24, 256]")

    @staticmethod
    def parse(spec: str) -> "ScatterTile":
        """'[coop:]MxNxKxS[xG[xC[xL[xW]]]]': BLOCK_M, BLOCK_N, BLOCK_K, STAGES, GROUP_M, consumer /
        loader registers, loader warps; "coop:" the cooperative schedule."""
        body = spec.lower()
        coop = body.startswith("coop:")
        body = body.removeprefix("coop:")
        keys = ("block_m", "block_n", "block_k", "stages", "group_m", "consumer_regs", "loader_regs", "loader_warps")
        try:
            parts = [int(v) for v in body.split("x")]
        except ValueError:
            parts = []
        if not 4 <= len(parts) <= len(keys):
            raise ValueError(f"tile spec {spec!r}: [coop:]MxNxKxS[xG[xC[xL[xW]]]]")
        return ScatterTile(**dict(zip(keys, parts)), coop=coop)

    def __str__(self):
        return (f"{'coop:' if self.coop else ''}{self.block_m}x{self.block_n}x{self.block_k}x{self.stages}"
                f"x{self.group_m}x{self.consumer_regs}x{self.loader_regs}x{self.loader_warps}")

    def kwargs(self) -> dict:
        """The fields as `gluon_scatter_gemm(**tile)` takes them."""
        return {f: getattr(self, f) for f in self.__dataclass_fields__}

    def shared_bytes(self, out_tiles: bool) -> int:
        """Shared memory of the ring, plus (out_tiles) one bf16 output box per consumer; barriers aside."""
        ring = self.stages * (self.block_m + self.block_n) * self.block_k * 2
        rows = self.block_m // 2 if self.coop else self.block_m
        return ring + (2 * rows * self.block_n * 2 if out_tiles else 0)

    def kernel_maxnreg(self) -> int:
        # 4 + 4 consumer warps + the loader's 1-4; registers are handed out by warpgroup: 12 warps
        return self.maxnreg or 65536 // (32 * 12) // 8 * 8


def weight_block(tile: ScatterTile, w_layout: int) -> list[int]:
    """The weight descriptor's box: [1, BLOCK_N, BLOCK_K] over w [E, n_dim, k_dim] (layout 1), else
    [1, BLOCK_K, BLOCK_N] over w [E, k_dim, n_dim]."""
    return [1, tile.block_n, tile.block_k] if w_layout == 1 else [1, tile.block_k, tile.block_n]


if HAS_GLUON:

    @gluon.constexpr_function
    def _expert_layout(num_warps):
        return gl.BlockedLayout([1], [32], [num_warps], [0])

    @gluon.jit
    def _add(a, b):
        return a + b

    @gluon.jit
    def _m_schedule(offsets_ptr, E, BLOCK_M: gl.constexpr, E_POW2: gl.constexpr):
        """(first row, end row, M tiles, inclusive cumsum of the M tiles) of every expert as
        E_POW2-wide vectors: `routing._tile_schedule`, in this partition's warps."""
        e_idx = gl.arange(0, E_POW2, layout=_expert_layout(gl.num_warps()))
        live = e_idx < E
        lo = gl.load(offsets_ptr + e_idx, mask=live, other=0)
        hi = gl.load(offsets_ptr + e_idx + 1, mask=live, other=0)
        tiles = (hi - lo + BLOCK_M - 1) // BLOCK_M
        return lo, hi, tiles, gl.associative_scan(tiles, 0, _add)

    @gluon.jit
    def _work_item(lo, hi, tiles, cum, item, num_m, num_n,
                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, E_POW2: gl.constexpr):
        """(expert, first row, the expert's end row, first column, M tile) of work item `item`: its M
        tile and N tile in `_grouped_order`, the M tile's expert and rows as `routing._tile_lookup`
        finds them. The M tile counts over all experts (an expert's tiles follow the ones before)."""
        in_group = GROUP_M * num_n
        first = (item // in_group) * GROUP_M
        size = gl.minimum(num_m - first, GROUP_M)
        local = item % in_group
        tile = first + local % size
        col0 = (local // size) * BLOCK_N
        e_idx = gl.arange(0, E_POW2, layout=_expert_layout(gl.num_warps()))
        expert = gl.sum((cum <= tile).to(gl.int32), 0)
        this = e_idx == expert
        row0 = gl.sum(gl.where(this, lo + (tile - (cum - tiles)) * BLOCK_M, 0), 0)
        row_end = gl.sum(gl.where(this, hi, 0), 0)
        return expert, row0, row_end, col0, tile

    @gluon.jit
    def _num_items(offsets_ptr, n_dim, E, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, E_POW2: gl.constexpr):
        """(schedule vectors, M tiles, N tiles, this CTA's work items)."""
        lo, hi, tiles, cum = _m_schedule(offsets_ptr, E, BLOCK_M, E_POW2)
        num_m = gl.sum(tiles, 0)
        num_n = gl.cdiv(n_dim, BLOCK_N)
        nprog = gl.num_programs(0)
        # items pid, pid + nprog, ... below num_m * num_n (pid < nprog, so the numerator stays > 0)
        mine = (num_m * num_n - gl.program_id(0) + nprog - 1) // nprog
        return lo, hi, tiles, cum, num_m, num_n, mine

    @gluon.jit
    def _scatter_loader(
        in_desc, w_desc, a_bufs, w_bufs, ready, empty, offsets_ptr, k_dim, n_dim, E,
        W_LAYOUT: gl.constexpr, E_POW2: gl.constexpr,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
        STAGES: gl.constexpr,
    ):
        """Worker partition (LOADER_WARPS warps): both operands of every K step by TMA, in item order."""
        SLOT_BYTES: gl.constexpr = in_desc.block_type.nbytes + w_desc.block_type.nbytes
        lo, hi, tiles, cum, num_m, num_n, mine = _num_items(offsets_ptr, n_dim, E, BLOCK_M, BLOCK_N, E_POW2)
        ksteps = gl.cdiv(k_dim, BLOCK_K)
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        it = 0
        for j in range(mine):
            expert, row0, _, col0, _ = _work_item(lo, hi, tiles, cum, pid + j * nprog, num_m, num_n,
                                               BLOCK_M, BLOCK_N, GROUP_M, E_POW2)
            for k in range(ksteps):
                slot = it % STAGES
                mbarrier.wait(empty.index(slot), ((it // STAGES) & 1) ^ 1)  # fresh barriers: phase 1 is done
                bar = ready.index(slot)
                mbarrier.expect(bar, SLOT_BYTES)
                tma.async_copy_global_to_shared(in_desc, [row0, k * BLOCK_K], bar, a_bufs.index(slot))
                if W_LAYOUT == 1:
                    tma.async_copy_global_to_shared(w_desc, [expert, col0, k * BLOCK_K], bar, w_bufs.index(slot))
                else:
                    tma.async_copy_global_to_shared(w_desc, [expert, k * BLOCK_K, col0], bar, w_bufs.index(slot))
                it += 1

    @gluon.jit
    def _scatter_consumer(
        a_bufs, w_bufs, ready, empty, turn, bias_ptr, sorted_rows_ptr, offsets_ptr, out_ptr, out_desc, c_bufs,
        rows_ptr, TK, k_dim, n_dim, E, stride_bias_e,
        HAS_BIAS: gl.constexpr, W_LAYOUT: gl.constexpr, E_POW2: gl.constexpr,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
        STAGES: gl.constexpr, COOP: gl.constexpr, ROLE: gl.constexpr, PROBE: gl.constexpr, OUT_TILES: gl.constexpr,
    ):
        """One consumer warpgroup (ROLE 0: the default partition, 1: a worker). Ping-pong: the whole
        of items ROLE, ROLE + 2, ... Cooperative (COOP): rows ROLE * BLOCK_M / 2 .. of every item.
        PROBE (a diagnostic, `gluon_scatter_gemm(probe=...)`; 0 in use): 1 skips the epilogue behind
        a branch never taken at run time (the MMAs stay), 2 skips the wgmmas (the loads, the ring's
        handshakes and the stores of zeros stay).
        OUT_TILES: the items in an M tile's first column also write each of their rows' slot's entry of
        the row map (its row in TILE order), and consumer 0 the padding slots' -1 (`_unmapped_slots`)."""
        NUM_WARPS: gl.constexpr = gl.num_warps()
        ROWS: gl.constexpr = BLOCK_M // 2 if COOP else BLOCK_M  # this warpgroup's rows of an item
        ROW0: gl.constexpr = ROLE * ROWS if COOP else 0
        FIRST: gl.constexpr = 0 if COOP else ROLE
        STEP: gl.constexpr = 1 if COOP else 2
        acc_layout: gl.constexpr = wgmma_acc_layout(BLOCK_N, NUM_WARPS)
        out_layout: gl.constexpr = copy_layout(ROWS, BLOCK_N, NUM_WARPS)
        lo, hi, tiles, cum, num_m, num_n, mine = _num_items(offsets_ptr, n_dim, E, BLOCK_M, BLOCK_N, E_POW2)
        ksteps = gl.cdiv(k_dim, BLOCK_K)
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        n = 0  # this consumer's items so far
        for j in range(FIRST, mine, STEP):
            expert, row0, row_end, col0, tile = _work_item(lo, hi, tiles, cum, pid + j * nprog, num_m, num_n,
                                                     BLOCK_M, BLOCK_N, GROUP_M, E_POW2)
            # the epilogue's slots, loaded before the MMAs so their latency hides behind them
            rows = row0 + ROW0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, out_layout))
            row_ok = rows < row_end
            if not OUT_TILES:
                slots = gl.load(sorted_rows_ptr + rows, mask=row_ok, other=0)
            else:
                # the row map's entries of this consumer's rows, written by the M tile's first column
                map_at = gl.arange(0, ROWS, layout=_expert_layout(NUM_WARPS))
                map_ok = (row0 + ROW0 + map_at < row_end) & (col0 == 0)
                map_slots = gl.load(sorted_rows_ptr + row0 + ROW0 + map_at, mask=map_ok, other=0)
            acc = gl.zeros([ROWS, BLOCK_N], gl.float32, acc_layout)
            it0 = j * ksteps
            if not COOP:
                # MMA turns: item j's wgmmas start once the other consumer has issued item j-1's (its
                # arrival on turn[ROLE]); consumer 0's first wait is on a fresh barrier's phase 1 (done)
                mbarrier.wait(turn.index(ROLE), (n & 1) ^ (1 - ROLE))
            for k in range(ksteps):
                it = it0 + k
                slot = it % STAGES
                mbarrier.wait(ready.index(slot), (it // STAGES) & 1)
                a = a_bufs.index(slot)  # [BLOCK_M, BLOCK_K]
                if COOP:
                    a = a.slice(ROW0, ROWS)  # this warpgroup's rows: [ROWS, BLOCK_K]
                if W_LAYOUT == 1:
                    b = w_bufs.index(slot).reshape([BLOCK_N, BLOCK_K]).permute((1, 0))  # K-major B
                else:
                    b = w_bufs.index(slot).reshape([BLOCK_K, BLOCK_N])  # N-major B
                if PROBE != 2:
                    acc = warpgroup_mma(a, b, acc, is_async=True)
                    acc, _, _ = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a, b))
                # the previous step's wgmma is done: its slot goes back to the loader (cooperative:
                # once both consumers arrived, the barrier's count)
                mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1, pred=k > 0)
            if not COOP:
                mbarrier.arrive(turn.index(1 - ROLE), count=1)  # item j+1's MMAs may follow ours
            if PROBE != 2:
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            mbarrier.arrive(empty.index((it0 + ksteps - 1) % STAGES), count=1)
            n += 1
            if OUT_TILES:
                # the tile's rows as one box at row tile * BLOCK_M of the tile-padded output, by TMA:
                # the previous item's store has read this consumer's buffer before it is written again
                if HAS_BIAS:
                    acc = _plus_bias(acc, bias_ptr, expert, col0, n_dim, stride_bias_e, BLOCK_N, acc_layout)
                c_buf = c_bufs.index(ROLE)
                tma.store_wait(0)
                gl.thread_barrier()
                c_buf.store(acc.to(out_desc.dtype))
                fence_async_shared()  # the generic-proxy writes, before the async proxy reads them
                gl.thread_barrier()
                tma.async_copy_shared_to_global(out_desc, [tile * BLOCK_M + ROW0, col0], c_buf)
                gl.store(rows_ptr + map_slots, tile * BLOCK_M + ROW0 + map_at, mask=map_ok)
            elif PROBE == 1:
                if k_dim < 0:  # never at run time: the accumulator must still be computed
                    _scatter_epilogue(acc, bias_ptr, out_ptr, slots, row_ok, expert, col0, n_dim, stride_bias_e,
                                      HAS_BIAS, BLOCK_N, acc_layout, out_layout)
            else:
                _scatter_epilogue(acc, bias_ptr, out_ptr, slots, row_ok, expert, col0, n_dim, stride_bias_e,
                                  HAS_BIAS, BLOCK_N, acc_layout, out_layout)
        if OUT_TILES:
            if ROLE == 0:
                _unmapped_slots(sorted_rows_ptr, offsets_ptr, rows_ptr, TK, E, ROWS)
            tma.store_wait(0)  # the last store has read shared memory before the kernel ends

    @gluon.jit
    def _unmapped_slots(sorted_rows_ptr, offsets_ptr, rows_ptr, TK, E, BLOCK: gl.constexpr):
        """The row map's -1 for the slots that no tile holds: the slot form's padding slots, sorted
        from offsets[E] to TK (none when TK == offsets[E]), BLOCK at a time over the CTAs."""
        layout: gl.constexpr = _expert_layout(gl.num_warps())
        at = gl.arange(0, BLOCK, layout=layout)
        first = gl.load(offsets_ptr + E) + gl.program_id(0) * BLOCK
        for r0 in range(first, TK, gl.num_programs(0) * BLOCK):
            live = r0 + at < TK
            slot = gl.load(sorted_rows_ptr + r0 + at, mask=live, other=0)
            gl.store(rows_ptr + slot, gl.full([BLOCK], -1, gl.int32, layout), mask=live)

    @gluon.jit
    def _plus_bias(acc, bias_ptr, expert, col0, n_dim, stride_bias_e, BLOCK_N: gl.constexpr,
                   acc_layout: gl.constexpr):
        bcols = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
        bias = gl.load(bias_ptr + expert.to(gl.int64) * stride_bias_e + bcols, mask=bcols < n_dim, other=0.0)
        return acc + bias.to(gl.float32)[None, :]

    @gluon.jit
    def _scatter_epilogue(acc, bias_ptr, out_ptr, slots, row_ok, expert, col0, n_dim, stride_bias_e,
                          HAS_BIAS: gl.constexpr, BLOCK_N: gl.constexpr, acc_layout: gl.constexpr,
                          out_layout: gl.constexpr):
        """+ bias[e], -> out dtype, 16-byte row vectors, stored to the item's rows' slots."""
        if HAS_BIAS:
            acc = _plus_bias(acc, bias_ptr, expert, col0, n_dim, stride_bias_e, BLOCK_N, acc_layout)
        out = gl.convert_layout(acc.to(out_ptr.dtype.element_ty), out_layout)
        cols = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, out_layout))
        ptrs = out_ptr + slots.to(gl.int64)[:, None] * n_dim + cols[None, :]
        gl.store(ptrs, out, mask=row_ok[:, None] & (cols < n_dim)[None, :])

    @gluon.jit(do_not_specialize=["TK"])
    def _gluon_scatter_kernel(
        in_desc,  # TMA descriptor over In [TK, k_dim] bf16 (contiguous, expert order), block [BLOCK_M, BLOCK_K]
        w_desc,  # TMA descriptor over w: [E, n_dim, k_dim] (W_LAYOUT 1) or [E, k_dim, n_dim] (2) bf16, block `weight_block`
        bias_ptr,  # [E, n_dim] bf16, unit column stride, read when HAS_BIAS
        sorted_rows_ptr,  # [TK] int32: the slot (out row) of each expert-ordered row
        offsets_ptr,  # [E+1] int32: expert e's rows are offsets[e] .. offsets[e+1]
        out_ptr,  # [TK, n_dim] bf16, contiguous, SLOT order (not OUT_TILES)
        out_desc,  # OUT_TILES: TMA descriptor over out [rows, n_dim], block [consumer rows, BLOCK_N]; else unused
        rows_ptr,  # OUT_TILES: [TK] int32, written: the row of out that holds each slot's product (-1: none)
        TK, k_dim, n_dim, E, stride_bias_e,
        HAS_BIAS: gl.constexpr, W_LAYOUT: gl.constexpr, E_POW2: gl.constexpr,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
        STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr, LOADER_WARPS: gl.constexpr,
        COOP: gl.constexpr, PROBE: gl.constexpr = 0, OUT_TILES: gl.constexpr = False,
    ):
        """Grid: (number of SMs,), persistent; num_warps = 4 (the default partition: consumer 0).
        OUT_TILES: out in TILE order instead of slot order: M tile t's rows at rows t * BLOCK_M.., by
        TMA from one [consumer rows, BLOCK_N] shared buffer per consumer (`gluon_scatter_gemm`), and
        rows_ptr[s] = the row that holds slot s's product (`slot_rows_in_tiles`, in the same launch)."""
        dtype: gl.constexpr = in_desc.dtype
        a_bufs = gl.allocate_shared_memory(dtype, [STAGES] + in_desc.block_type.shape, in_desc.layout)
        w_bufs = gl.allocate_shared_memory(dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        if OUT_TILES:
            c_bufs = gl.allocate_shared_memory(out_desc.dtype, [2] + out_desc.block_type.shape, out_desc.layout)
        else:
            c_bufs = turn  # not read
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)  # the loader's expect-tx arrival
            mbarrier.init(empty.index(i), count=2 if COOP else 1)  # the consumer(s) that read the slot
        for i in gl.static_range(2):
            mbarrier.init(turn.index(i), count=1)  # the other consumer, done issuing an item's wgmmas
        fence_async_shared()  # the initialized barriers, before the TMA unit signals them
        gl.warp_specialize([
            (_scatter_consumer, (a_bufs, w_bufs, ready, empty, turn, bias_ptr, sorted_rows_ptr, offsets_ptr, out_ptr,
                                 out_desc, c_bufs, rows_ptr, TK, k_dim, n_dim, E, stride_bias_e, HAS_BIAS, W_LAYOUT,
                                 E_POW2, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, COOP, 0, PROBE, OUT_TILES)),
            (_scatter_consumer, (a_bufs, w_bufs, ready, empty, turn, bias_ptr, sorted_rows_ptr, offsets_ptr, out_ptr,
                                 out_desc, c_bufs, rows_ptr, TK, k_dim, n_dim, E, stride_bias_e, HAS_BIAS, W_LAYOUT,
                                 E_POW2, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, COOP, 1, PROBE, OUT_TILES)),
            (_scatter_loader, (in_desc, w_desc, a_bufs, w_bufs, ready, empty, offsets_ptr, k_dim, n_dim, E,
                               W_LAYOUT, E_POW2, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES)),
        ], [4, LOADER_WARPS], [CONSUMER_REGS, LOADER_REGS])


def default_tile(w_layout: int, k_dim: int | None = None) -> ScatterTile:
    """128x128x64 per consumer warpgroup, a 4-stage ring, one loader warp (40 registers), GROUP_M 8.
    H100, time against the Triton kernel's (`bench_gluon_scatter.py --tiles
    auto,128x128x64x6x8x232x40x4,128x128x64x4x8x232x40x4`, one process, all bit-equal to it):
        this tile:        7b-256 Y 0.844 dX~ 0.825, Qwen3 Y 0.975 dX~ 0.980, OLMoE Y 0.951 dX~ 1.040
        4 loader warps:          0.892     0.913           0.979     1.104          0.973     1.061
        6 stages, 4 warps:       0.851     0.907           1.182     1.225          1.034     1.171
    Both layouts take the same tile; the arguments are there for a per-GEMM choice later."""
    return ScatterTile()


SHARED_LIMIT = 232448  # bytes of shared memory a block may take on the H100 (227 KB)
COOP_TILE = ScatterTile(block_m=128, block_n=256, block_k=64, stages=3, coop=True)
COOP_MIN_K = 1024  # the reduction length from which `candidate_tiles` offers COOP_TILE
COOP_MIN_K_TILES = 512  # the same with TILE-order output (TMA stores)


def candidate_tiles(w_layout: int, k_dim: int, out_tiles: bool = False) -> dict[str, ScatterTile]:
    """The tiles `codegen.forward` offers `wgrad_choice` to time at a scatter GEMM's first call: the
    ping-pong default as "gluon", and from k_dim >= COOP_MIN_K the cooperative 128x256 tile as
    "gluon-coop" (from COOP_MIN_K_TILES for a TILE-order output: with TMA stores its epilogue
    stalls the tensor cores less; H100, 2026-11-25, docs/DESIGN.md, us, ping-pong /
    cooperative in TILE order: 7b-256 dX~ (k_dim 512) 530.0 / 510.3, 1.4b-256 dX~ 457.5 / 455.8,
    7b-256 Y (k_dim 256) 331.7 / 340.3).

    The cooperative tile loads 25% fewer operand bytes per flop (one 64x256 weight tile for two
    m64n256 wgmmas, against a 64x128 one per 128x128 item), but its epilogue stops the tensor cores
    (both warpgroups store at once), once an item: it pays only where an item has many K steps.
    H100, time against the Triton kernel's (`bench_gluon_scatter.py --tiles auto,coop:128x256x64x3`,
    one process, bit-equal), ping-pong / cooperative:
        k_dim 256:  7b-256 Y 1.026 / 1.179,   1.4b-256 Y 1.000 / 1.256
        k_dim 512:  7b-256 dX~ 1.071 / 1.148, 1.4b-256 dX~ 0.939 / 1.033
        k_dim 768:  Qwen3 Y 0.954 / 1.047
        k_dim 1024: OLMoE Y 0.991 / 0.899
        k_dim 1536: Qwen3 dX~ 0.960 / 0.896
        k_dim 2048: OLMoE dX~ 1.129 / 0.950
    Below COOP_MIN_K it lost at every shape, so it is not compiled and timed there."""
    tiles = {"gluon": default_tile(w_layout, k_dim)}
    if k_dim >= (COOP_MIN_K_TILES if out_tiles else COOP_MIN_K):
        tiles["gluon-coop"] = COOP_TILE
    return tiles


def supports(inp, w, w_layout: int, bias=None, *, n_dim: int) -> str | None:
    """None if `gluon_scatter_gemm` runs these operands, else why not."""
    import torch

    if not HAS_GLUON:
        return f"no Gluon: {GLUON_IMPORT_ERROR}"
    if not is_sm90(inp):
        return "not a Hopper (sm90) device"
    if inp.dtype != torch.bfloat16 or w.dtype != inp.dtype or (bias is not None and bias.dtype != inp.dtype):
        return f"bf16 operands only, got {inp.dtype}, {w.dtype}{'' if bias is None else ', ' + str(bias.dtype)}"
    if w_layout not in (1, 2):
        return f"w_layout={w_layout}: 1 ([E, n_dim, k_dim]) or 2 ([E, k_dim, n_dim])"
    if inp.dim() != 2 or not inp.is_contiguous():
        return "inp must be a contiguous [TK, k_dim] tensor"
    TK, k_dim = inp.shape
    if w.dim() != 3:
        return f"w must be [E, ., .], got {tuple(w.shape)}"
    want = (n_dim, k_dim) if w_layout == 1 else (k_dim, n_dim)
    if tuple(w.shape[1:]) != want:
        return f"w {tuple(w.shape)} is not [E, {want[0]}, {want[1]}] (w_layout {w_layout})"
    if w.stride(2) != 1 or any(s * 2 % 16 for s in w.stride()[:2]) or w.data_ptr() % 16:
        return f"TMA needs w's last dim contiguous and 16-byte strides, got {w.stride()}"
    if k_dim % 8 or n_dim % 8 or k_dim == 0 or TK == 0:
        return f"k_dim={k_dim}, n_dim={n_dim}: multiples of 8 (16-byte rows), TK={TK} > 0"
    if bias is not None and (tuple(bias.shape) != (w.shape[0], n_dim) or bias.stride(1) != 1):
        return f"bias must be [E, n_dim] with unit column stride, got {tuple(bias.shape)}"
    return None


def tile_rows(TK: int, E: int, block_m: int) -> int:
    """Rows of a TILE-order output (`gluon_scatter_gemm(out_tiles=True)`): BLOCK_M for each M tile,
    at most cdiv(TK, BLOCK_M) + E tiles (each expert's last one partial), sized with no host sync."""
    return (cdiv(TK, block_m) + E) * block_m


def slot_rows_in_tiles(sorted_rows, offsets, block_m: int):
    """[TK] int32: the row of a TILE-order output that holds slot s's product, on the device (no host
    sync). Expert e's r-th row (expert order) lies in its M tile r // BLOCK_M, the expert's tiles
    following the cdiv(rows, BLOCK_M) tiles of the experts before it. Padding slots (the slot form's,
    sorted past offsets[E]) get -1."""
    import torch

    sizes = offsets.diff()
    tiles_before = torch.cumsum((sizes + block_m - 1) // block_m, 0) - (sizes + block_m - 1) // block_m
    r = torch.arange(sorted_rows.numel(), device=sorted_rows.device, dtype=torch.int32)
    expert = torch.searchsorted(offsets[1:], r, right=True).clamp(max=sizes.numel() - 1)
    row = torch.where(r < offsets[-1], tiles_before[expert] * block_m + r - offsets[expert], -1)
    rows = torch.empty_like(sorted_rows)
    rows[sorted_rows.long()] = row.to(rows.dtype)
    return rows


def gluon_scatter_gemm(inp, w, w_layout, bias, sorted_rows, offsets, *, n_dim, num_programs=None, out=None, probe=0,
                       out_tiles=False, row_map=None, **tile):
    """out [TK, n_dim] in SLOT order: out[sorted_rows[r]] = inp[r] @ B[e] (+ bias[e]).

    w: the stacked weight, [E, n_dim, k_dim] read as B[e] = w[e]^T (w_layout 1), or [E, k_dim, n_dim]
    read as B[e] = w[e] (w_layout 2). bias: [E, n_dim] or None. `tile`: ScatterTile fields
    (block_m=..., ...); none: `default_tile`. `num_programs`: the persistent grid (default: the SM
    count). `out`: a [TK, n_dim] tensor to write (default: a new one, as `triton_moe_scatter_gemm`).
    `probe`: a diagnostic that gives wrong results (`_scatter_consumer`'s PROBE), for timings only.
    `out_tiles`: out [tile_rows(TK, E, BLOCK_M), n_dim] in TILE order instead, every M tile's BLOCK_M
    rows stored as whole boxes by TMA (rows past an expert's end hold products of no slot); slot s's
    row is `slot_rows_in_tiles(sorted_rows, offsets, BLOCK_M)[s]`, and the same launch writes that
    map into `row_map` ([TK] int32; a scratch one where None), -1 for the padding slots.
    """
    import torch

    cfg = ScatterTile(**tile) if tile else default_tile(w_layout, inp.shape[1])
    why = supports(inp, w, w_layout, bias, n_dim=n_dim)
    assert why is None, why
    if out_tiles and cfg.shared_bytes(True) > SHARED_LIMIT:
        raise ValueError(f"tile {cfg}: {cfg.shared_bytes(True)} bytes of shared memory with TILE-order output "
                         f"boxes, over the H100's {SHARED_LIMIT} a block (fewer stages)")
    TK, k_dim = inp.shape
    E = offsets.numel() - 1
    assert w.shape[0] == E and sorted_rows.numel() == TK
    assert sorted_rows.dtype == torch.int32 and offsets.dtype == torch.int32
    out_rows = tile_rows(TK, E, cfg.block_m) if out_tiles else TK
    if out is None:
        out = inp.new_empty(out_rows, n_dim)
    assert out.shape == (out_rows, n_dim) and out.is_contiguous() and out.dtype == inp.dtype
    if out_tiles and row_map is None:
        row_map = torch.empty(TK, dtype=torch.int32, device=inp.device)
    assert not out_tiles or (row_map.shape == (TK,) and row_map.dtype == torch.int32 and row_map.is_contiguous())
    in_block = [cfg.block_m, cfg.block_k]
    in_desc = TensorDescriptor.from_tensor(inp, in_block, shared_layout(in_block, gl.bfloat16))
    out_desc = in_desc  # not read
    if out_tiles:
        out_block = [cfg.block_m // 2 if cfg.coop else cfg.block_m, cfg.block_n]
        out_desc = TensorDescriptor.from_tensor(out, out_block, shared_layout(out_block, gl.bfloat16))
    w_block = weight_block(cfg, w_layout)
    w_desc = TensorDescriptor.from_tensor(w, w_block, shared_layout(w_block, gl.bfloat16))
    if num_programs is None:
        num_programs = torch.cuda.get_device_properties(inp.device).multi_processor_count
    upper = (cdiv(TK, cfg.block_m) + E) * cdiv(n_dim, cfg.block_n)  # >= the real work items
    grid = (max(1, min(num_programs, upper)),)
    launch(_gluon_scatter_kernel, grid,
        in_desc, w_desc, inp if bias is None else bias, sorted_rows, offsets, out, out_desc,
        row_map if out_tiles else sorted_rows, TK, k_dim, n_dim, E, 0 if bias is None else bias.stride(0),
        HAS_BIAS=bias is not None, W_LAYOUT=w_layout, E_POW2=e_pow2(E),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, STAGES=cfg.stages,
        CONSUMER_REGS=cfg.consumer_regs, LOADER_REGS=cfg.loader_regs, LOADER_WARPS=cfg.loader_warps, COOP=cfg.coop,
        PROBE=probe, OUT_TILES=out_tiles, num_warps=4, maxnreg=cfg.kernel_maxnreg(),
    )
    return out


def compile_sm90(*, w_layout: int, E: int = 128, has_bias: bool = False, tile: ScatterTile | None = None,
                 capability: int = 90, probe: int = 0, out_tiles: bool = False):
    """Compile the kernel for sm90 without a GPU (triton.compile on a GPUTarget); returns the
    CompiledKernel (`.asm["ptx"]`, `.asm["cubin"]`, `.metadata.shared`). Argument specialization as
    the launcher's would be (16-divisible pointers, k_dim and n_dim)."""
    tile = tile or default_tile(w_layout)
    signature = {
        "in_desc": bf16_desc_type([tile.block_m, tile.block_k]), "w_desc": bf16_desc_type(weight_block(tile, w_layout)),
        "bias_ptr": "*bf16", "sorted_rows_ptr": "*i32", "offsets_ptr": "*i32", "out_ptr": "*bf16",
        "out_desc": bf16_desc_type([tile.block_m // 2 if tile.coop else tile.block_m, tile.block_n] if out_tiles
                                   else [tile.block_m, tile.block_k]),
        "rows_ptr": "*i32", "TK": "i32", "k_dim": "i32", "n_dim": "i32", "E": "i32", "stride_bias_e": "i32",
    }
    constexprs = dict(HAS_BIAS=has_bias, W_LAYOUT=w_layout, E_POW2=e_pow2(E), BLOCK_M=tile.block_m,
                      BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, GROUP_M=tile.group_m, STAGES=tile.stages,
                      CONSUMER_REGS=tile.consumer_regs, LOADER_REGS=tile.loader_regs, LOADER_WARPS=tile.loader_warps,
                      COOP=tile.coop, PROBE=probe, OUT_TILES=out_tiles)
    divisible = ["bias_ptr", "sorted_rows_ptr", "offsets_ptr", "out_ptr", "rows_ptr", "k_dim", "n_dim", "stride_bias_e"]
    return compile_for_sm90(_gluon_scatter_kernel, signature, constexprs, divisible, num_warps=4,
                            maxnreg=tile.kernel_maxnreg(), capability=capability)
