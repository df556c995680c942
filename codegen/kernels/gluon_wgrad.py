"""Hopper (sm90) weight gradient in Gluon, a candidate beside `backward._wgrad_kernel` that
`wgrad_choice` times at each key's first call (`codegen.backward._weight_grad`).

    dW[e][p, q] = sum over expert e's rows r in [offsets[e], offsets[e+1]) of Lhs[r, p] Rhs[r, q]

float32 accumulate, stored in dw's dtype through (e, p, q) strides. One operand is gathered: a
[T, .] tensor read at row token(r) = sorted_rows[r] // K; the other is [TK, .] in expert order
(row r). The two uses in a SwiGLU layer's backward (T tokens, d hidden, n expert intermediate,
E experts, K top-k, TK = T K rows):
    dW1[e] [2n, d] = dH_e^T gather(x)_e     Lhs = dH [TK, 2n] expert order, Rhs = x [T, d] gathered
    dW2[e] [d, n]  = gather(dO)_e^T A'_e    Lhs = dO [T, d] gathered,      Rhs = A' [TK, n] expert order

SonicMoE-style kernel, one CTA per SM (persistent), warp specialized:
  * loader partition (LOADER_WARPS warps): fills a STAGES-deep shared-memory ring. The
    expert-ordered operand's [BLOCK_M, .] tile comes by TMA (mbarrier expect-tx; see below for an
    expert's last chunk), the gathered one's by cp.async (16-byte pointer copies), its rows outside
    the step's zero-filled.
    Each cp.async thread signals the slot's `ready` mbarrier with `cp.async.mbarrier.arrive.noinc`
    (fires when that thread's copies have landed), so `ready` expects LOADER_WARPS*32 arrivals + the
    TMA's expect-tx arrival. Token indices are loaded one step ahead, across tile boundaries too.
  * consumer (default partition, num_warps = 4 or 8: one or two warpgroups): waits on `ready`,
    fences the generic proxy (cp.async writes) against the async proxy (wgmma reads), issues
    `warpgroup_mma(Lhs_tile^T, Rhs_tile)` (Lhs^T as a permuted shared-memory view), keeps one
    wgmma in flight (wait(1)) and releases the previous slot on its `empty` mbarrier; then the
    epilogue (fp32 -> dw dtype, 16-byte stores through dw's strides).
Output tiles (e, p-tile, q-tile), q fastest, are walked with stride = the grid, so the CTAs running
at once share an expert's rows in L2. An expert with no rows gets zeros.

An expert's last chunk of rows is usually partial. Its TMA box is shifted back to end at the
expert's end, and the rows in it that the step before added are zero in the gathered tile: the box
reads the expert's own rows only. (Masking that chunk by cp.async instead, or only for small
experts, made the kernel 25-30% slower: a runtime branch around the TMA in the loader costs that
even where it is never taken; H100, `bench_gluon_wgrad.py`.) An expert of fewer than BLOCK_M rows
has no room to shift: its box reaches into the next experts' rows, whose products vanish because
the gathered rows there are zero, unless they hold inf or NaN (0 * inf = NaN), which then also
makes this expert's dW NaN. Such a value in dH or A' makes dX~ = dH W1 or the forward's output
non-finite as well, and with it every gradient upstream; the Triton kernel masks both operands.

Gluon (`triton.experimental.gluon`) is experimental: written against Triton 3.6. `gluon_common`
holds the guarded Gluon import and the layouts shared with `gluon_scatter`: importing this module
never fails; `HAS_GLUON` says whether the kernel can be built, `GLUON_IMPORT_ERROR` why not.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..direct_launch import launch
from ..ints import cdiv
from .gluon_common import GLUON_IMPORT_ERROR, HAS_GLUON, TensorDescriptor, gl, gluon
from .gluon_common import bf16_desc_type, compile_for_sm90, copy_layout, is_sm90, shared_layout, wgmma_acc_layout
from .gluon_common import async_copy, fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait


@dataclass(frozen=True)
class WgradTile:
    """One launch configuration; `parse("128x128x64x4")` reads BLOCK_P x BLOCK_Q x BLOCK_M x STAGES."""

    block_p: int = 128  # dW rows per tile (Lhs columns): the wgmma M side, 64 per consumer warpgroup at least
    block_q: int = 128  # dW columns per tile (Rhs columns): the wgmma N side, <= 256
    block_m: int = 64  # reduction rows per ring slot (the wgmma K side of one step)
    stages: int = 4  # ring depth: 4 x (64x128 + 64x128) bf16 = 128 KB of shared memory
    num_warps: int = 4  # consumer warps: 4 = one warpgroup (acc 128 fp32 regs/thread at 128x128), 8 = two
    loader_warps: int = 4  # cp.async issuers; 4 = one warpgroup (register reallocation is per warpgroup)
    loader_regs: int = 56  # registers per loader thread (setmaxnreg); the consumer gets the rest
    maxnreg: int | None = None  # kernel-wide register cap; None: 65536 / all threads, rounded down to 8

    def __post_init__(self):
        for name in ("block_p", "block_q", "block_m"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name}={v}: a power of two >= 16")
        if self.block_q > 256:
            raise ValueError(f"block_q={self.block_q}: one wgmma is at most 256 wide")
        if self.num_warps not in (4, 8) or self.block_p < 16 * self.num_warps:
            raise ValueError(f"num_warps={self.num_warps}, block_p={self.block_p}: 4 or 8 warps, 16 rows each")
        if self.loader_warps not in (1, 2, 4) or self.stages < 2:
            raise ValueError(f"loader_warps={self.loader_warps}, stages={self.stages}")
        if self.loader_regs % 8 or not 24 <= self.loader_regs <= 256:
            raise ValueError(f"loader_regs={self.loader_regs}: a multiple of 8 in [24, 256]")


    @staticmethod
    def parse(spec: str) -> "WgradTile":
        """'PxQxMxS[xW[xR]]': BLOCK_P, BLOCK_Q, BLOCK_M, STAGES, consumer warps, loader registers."""
        parts = [int(v) for v in spec.lower().split("x")]
        keys = ("block_p", "block_q", "block_m", "stages", "num_warps", "loader_regs")
        if not 4 <= len(parts) <= len(keys):
            raise ValueError(f"tile spec {spec!r}: PxQxMxS[xW[xR]]")
        return WgradTile(**dict(zip(keys, parts)))

    def __str__(self):
        return f"{self.block_p}x{self.block_q}x{self.block_m}x{self.stages}x{self.num_warps}x{self.loader_regs}"

    def kwargs(self) -> dict:
        """The fields as `gluon_wgrad(**tile)` takes them."""
        return {f: getattr(self, f) for f in self.__dataclass_fields__}

    def kernel_maxnreg(self) -> int:
        warps = self.num_warps + 4 * cdiv(self.loader_warps, 4)  # warps are allocated by warpgroup
        return self.maxnreg or min(256, 65536 // (32 * warps) // 8 * 8)


if HAS_GLUON:

    @gluon.jit
    def _tile_coords(tile, num_p, num_q):
        """(expert, p-tile, q-tile) of output tile `tile`, q fastest."""
        per_expert = num_p * num_q
        rest = tile % per_expert
        return tile // per_expert, rest // num_q, rest % num_q

    @gluon.jit
    def _tile_rows(offsets_ptr, tile, num_tiles, num_p, num_q):
        """(lo, hi): tile's expert's rows; (0, 0) for a tile past the end."""
        e, _, _ = _tile_coords(gl.minimum(tile, num_tiles - 1), num_p, num_q)
        lo = gl.load(offsets_ptr + e)
        hi = gl.load(offsets_ptr + e + 1)
        live = tile < num_tiles
        return gl.where(live, lo, 0), gl.where(live, hi, 0)

    @gluon.jit
    def _chunk_tokens(sorted_rows_ptr, r0, hi, TOP_K: gl.constexpr, BLOCK_M: gl.constexpr,
                      layout: gl.constexpr):
        """token(r) = sorted_rows[r] // K for rows r0 .. r0 + BLOCK_M (0 from `hi` on)."""
        rows = r0 + gl.arange(0, BLOCK_M, layout=layout)
        return gl.load(sorted_rows_ptr + rows, mask=rows < hi, other=0) // TOP_K

    @gluon.jit
    def _chunk_start(r0, lo, hi, BLOCK_M: gl.constexpr):
        """The first row of the tiles of the step that adds rows r0 .. min(r0 + BLOCK_M, hi): r0,
        except for an expert's partial last chunk when the expert has BLOCK_M rows or more:
        hi - BLOCK_M, so the TMA box ends at the expert's end (its rows below r0, which the step
        before added, are masked out of the gathered tile)."""
        return gl.where((r0 + BLOCK_M > hi) & (hi - lo >= BLOCK_M), hi - BLOCK_M, r0)

    @gluon.jit
    def _wgrad_loader(
        dense_desc, gath_ptr, sorted_rows_ptr, offsets_ptr, dense_bufs, gath_bufs, ready, empty,
        P, Q, E, stride_gath_r,
        TOP_K: gl.constexpr, GATHER_LHS: gl.constexpr,
        BLOCK_P: gl.constexpr, BLOCK_Q: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
    ):
        """Worker partition: per ring slot, the dense tile by TMA and the gathered tile by cp.async."""
        BLOCK_G: gl.constexpr = BLOCK_P if GATHER_LHS else BLOCK_Q  # gathered tile width
        layout: gl.constexpr = copy_layout(BLOCK_M, BLOCK_G, gl.num_warps())
        row_layout: gl.constexpr = gl.SliceLayout(1, layout)
        DENSE_BYTES: gl.constexpr = dense_desc.block_type.nbytes
        G = P if GATHER_LHS else Q  # the gathered operand's width
        num_p = gl.cdiv(P, BLOCK_P)
        num_q = gl.cdiv(Q, BLOCK_Q)
        num_tiles = E * num_p * num_q
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        cols = gl.arange(0, BLOCK_G, layout=gl.SliceLayout(0, layout))
        lo, hi = _tile_rows(offsets_ptr, pid, num_tiles, num_p, num_q)
        tok = _chunk_tokens(sorted_rows_ptr, lo, hi, TOP_K, BLOCK_M, row_layout)
        it = 0
        for tile in range(pid, num_tiles, nprog):
            _, tp, tq = _tile_coords(tile, num_p, num_q)
            lo, hi = _tile_rows(offsets_ptr, tile, num_tiles, num_p, num_q)
            nlo, nhi = _tile_rows(offsets_ptr, tile + nprog, num_tiles, num_p, num_q)
            if GATHER_LHS:
                dense_col = tq * BLOCK_Q
                gcols = tp * BLOCK_P + cols
            else:
                dense_col = tp * BLOCK_P
                gcols = tq * BLOCK_Q + cols
            col_ok = gcols < G
            nsteps = gl.cdiv(hi - lo, BLOCK_M)
            for k in range(nsteps):
                r0 = lo + k * BLOCK_M  # the first row this step adds
                last = k == nsteps - 1
                start = _chunk_start(r0, lo, hi, BLOCK_M)  # the first row of its tiles
                # the next step's tokens (the next tile's first chunk after the last step), loaded
                # before this step's slot wait so the index load's latency hides behind it
                nstart = _chunk_start(r0 + BLOCK_M, lo, hi, BLOCK_M)
                tok_next = _chunk_tokens(sorted_rows_ptr, gl.where(last, nlo, nstart), gl.where(last, nhi, hi),
                                         TOP_K, BLOCK_M, row_layout)
                slot = it % STAGES
                mbarrier.wait(empty.index(slot), ((it // STAGES) & 1) ^ 1)  # fresh barriers: phase 1 is done
                bar = ready.index(slot)
                mbarrier.expect(bar, DENSE_BYTES)
                tma.async_copy_global_to_shared(dense_desc, [start, dense_col], bar, dense_bufs.index(slot))
                rows = start + gl.arange(0, BLOCK_M, layout=row_layout)
                ptrs = gath_ptr + tok.to(gl.int64)[:, None] * stride_gath_r + gcols[None, :]
                # zero-filled: rows an earlier step added (a shifted last chunk), rows past the expert's end
                async_copy.async_copy_global_to_shared(gath_bufs.index(slot), ptrs,
                                                       mask=((rows >= r0) & (rows < hi))[:, None] & col_ok[None, :])
                async_copy.mbarrier_arrive(bar, increment_count=False)
                tok = tok_next
                it += 1
            if nsteps == 0:  # an empty expert: its step never advanced `tok` to the next tile's
                tok = _chunk_tokens(sorted_rows_ptr, nlo, nhi, TOP_K, BLOCK_M, row_layout)

    @gluon.jit
    def _wgrad_consumer(
        dense_bufs, gath_bufs, ready, empty, offsets_ptr, dw_ptr,
        P, Q, E, stride_dw_e, stride_dw_p, stride_dw_q,
        GATHER_LHS: gl.constexpr,
        BLOCK_P: gl.constexpr, BLOCK_Q: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
    ):
        """Default partition: wgmma over the ring, one MMA in flight, then each tile's epilogue."""
        NUM_WARPS: gl.constexpr = gl.num_warps()
        acc_layout: gl.constexpr = wgmma_acc_layout(BLOCK_Q, NUM_WARPS)
        out_layout: gl.constexpr = copy_layout(BLOCK_P, BLOCK_Q, NUM_WARPS)
        if GATHER_LHS:
            lhs_bufs = gath_bufs
            rhs_bufs = dense_bufs
        else:
            lhs_bufs = dense_bufs
            rhs_bufs = gath_bufs
        num_p = gl.cdiv(P, BLOCK_P)
        num_q = gl.cdiv(Q, BLOCK_Q)
        num_tiles = E * num_p * num_q
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        it = 0
        for tile in range(pid, num_tiles, nprog):
            e, tp, tq = _tile_coords(tile, num_p, num_q)
            lo, hi = _tile_rows(offsets_ptr, tile, num_tiles, num_p, num_q)
            nsteps = gl.cdiv(hi - lo, BLOCK_M)
            acc = gl.zeros([BLOCK_P, BLOCK_Q], gl.float32, acc_layout)
            for k in range(nsteps):
                slot = it % STAGES
                mbarrier.wait(ready.index(slot), (it // STAGES) & 1)
                # cp.async wrote the gathered tile through the generic proxy; wgmma reads through the async one
                fence_async_shared()
                lhs_t = lhs_bufs.index(slot).permute((1, 0))  # [BLOCK_P, BLOCK_M]: Lhs^T, an MN-major A
                rhs = rhs_bufs.index(slot)  # [BLOCK_M, BLOCK_Q]
                acc = warpgroup_mma(lhs_t, rhs, acc, is_async=True)
                acc, _, _ = warpgroup_mma_wait(num_outstanding=1, deps=(acc, lhs_t, rhs))
                # the previous step's wgmma is done: its slot goes back to the loader
                mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1, pred=k > 0)
                it += 1
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1, pred=nsteps > 0)

            out = gl.convert_layout(acc.to(dw_ptr.dtype.element_ty), out_layout)
            ps = tp * BLOCK_P + gl.arange(0, BLOCK_P, layout=gl.SliceLayout(1, out_layout))
            qs = tq * BLOCK_Q + gl.arange(0, BLOCK_Q, layout=gl.SliceLayout(0, out_layout))
            ptrs = dw_ptr + e.to(gl.int64) * stride_dw_e + ps[:, None] * stride_dw_p + qs[None, :] * stride_dw_q
            gl.store(ptrs, out, mask=(ps < P)[:, None] & (qs < Q)[None, :])

    @gluon.jit
    def _gluon_wgrad_kernel(
        dense_desc,  # TMA descriptor over the expert-ordered operand [TK, X] bf16, block [BLOCK_M, BLOCK_X]
        gath_ptr,  # [T, Y] bf16, row stride stride_gath_r, unit column stride: read at rows token(r)
        sorted_rows_ptr,  # [TK] int32: token(r) = sorted_rows[r] // TOP_K (the slot form: row_token, TOP_K 1)
        offsets_ptr,  # [E+1] int32: expert e's rows are offsets[e] .. offsets[e+1]
        dw_ptr,  # [E, P, Q] bf16 through strides (e, p, q)
        P, Q, E, stride_gath_r,
        stride_dw_e, stride_dw_p, stride_dw_q,
        TOP_K: gl.constexpr, GATHER_LHS: gl.constexpr,
        BLOCK_P: gl.constexpr, BLOCK_Q: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
        LOADER_WARPS: gl.constexpr, LOADER_REGS: gl.constexpr,
    ):
        """Grid: (number of SMs,), persistent. GATHER_LHS: Lhs = the gathered operand [T, P] and
        Rhs = the dense [TK, Q] (dW2); else Lhs = the dense [TK, P], Rhs = the gathered [T, Q] (dW1)."""
        BLOCK_G: gl.constexpr = BLOCK_P if GATHER_LHS else BLOCK_Q
        dtype: gl.constexpr = dense_desc.dtype
        dense_bufs = gl.allocate_shared_memory(dtype, [STAGES] + dense_desc.block_type.shape, dense_desc.layout)
        gath_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_G],
                                              gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_G], dtype))
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            # every loader thread's cp.async.mbarrier.arrive.noinc + the expect-tx arrival of the TMA
            mbarrier.init(ready.index(i), count=LOADER_WARPS * 32 + 1)
            mbarrier.init(empty.index(i), count=1)
        fence_async_shared()  # the initialized barriers, before the TMA unit signals them
        gl.warp_specialize([
            (_wgrad_consumer, (dense_bufs, gath_bufs, ready, empty, offsets_ptr, dw_ptr,
                               P, Q, E, stride_dw_e, stride_dw_p, stride_dw_q,
                               GATHER_LHS, BLOCK_P, BLOCK_Q, BLOCK_M, STAGES)),
            (_wgrad_loader, (dense_desc, gath_ptr, sorted_rows_ptr, offsets_ptr, dense_bufs, gath_bufs, ready, empty,
                             P, Q, E, stride_gath_r, TOP_K, GATHER_LHS, BLOCK_P, BLOCK_Q, BLOCK_M, STAGES)),
        ], [LOADER_WARPS], [LOADER_REGS])


def default_tile(gather_lhs: bool) -> WgradTile:
    """The gathered side 128 wide, the TMA side 256, two consumer warpgroups, 4 stages, 88 loader
    registers. H100 (`bench_gluon_wgrad.py --tiles auto,128x256x64x4x8x88,256x128x64x4x8x88`), time
    against the Triton kernel's, one process:
        dW1 256x128: 0.75-0.79 (7b-256), 0.88 (Qwen3), 0.86 (OLMoE);  128x256: 0.94, 0.97, 1.00
        dW2 128x256: 0.80, 0.76, 0.75;                                256x128: 0.94, 0.92, 0.94
    128x128 with one warpgroup was slower than the Triton kernel (7b-256 dW1 779 against 734 us), and
    loader registers matter: dW1 128x256x64x3 with 40 / 56 / 88 registers took 964 / 679 / 578 us."""
    return WgradTile(block_p=128 if gather_lhs else 256, block_q=256 if gather_lhs else 128, block_m=64, stages=4,
                     num_warps=8, loader_regs=88)


def dense_block(tile: WgradTile, gather_lhs: bool) -> list[int]:
    """The TMA operand's tile: [BLOCK_M, BLOCK_Q] when Lhs is gathered, else [BLOCK_M, BLOCK_P]."""
    return [tile.block_m, tile.block_q if gather_lhs else tile.block_p]


def supports(lhs, rhs, *, gather_lhs, dw) -> str | None:
    """None if `gluon_wgrad` runs these operands, else why not."""
    if not HAS_GLUON:
        return f"no Gluon: {GLUON_IMPORT_ERROR}"
    if not is_sm90(lhs):
        return "not a Hopper (sm90) device"
    if lhs.dtype != rhs.dtype or lhs.dtype.itemsize != 2 or dw.dtype.itemsize != 2:
        return f"16-bit operands and dw only, got {lhs.dtype}, {rhs.dtype}, {dw.dtype}"
    if not (lhs.is_contiguous() and rhs.is_contiguous()):
        return "contiguous operands only"
    if lhs.shape[1] % 64 or rhs.shape[1] % 64:
        return f"P, Q must be multiples of 64, got {lhs.shape[1]}, {rhs.shape[1]}"
    return None


def gluon_wgrad(lhs, rhs, *, gather_lhs, sorted_rows, offsets, top_k, dw, dw_strides, row_token=None,
                num_programs=None, **tile):
    """dW[e] [P, Q] = sum over expert e's rows of Lhs[r]^T Rhs[r], written into `dw` via (e, p, q) strides.

    gather_lhs: Lhs is [T, P] read at each row's token and Rhs [TK, Q] in expert order (dW2);
    else Lhs [TK, P] in expert order and Rhs [T, Q] gathered (dW1). A row's token is
    sorted_rows[r] // top_k, or row_token[r] (int32 [TK], the slot form). No bias gradient
    (`triton_moe_wgrad` covers it). `tile`: WgradTile fields (block_p=..., ...); none:
    `default_tile(gather_lhs)`. `num_programs`: the persistent grid (default: the SM count). Returns dw.
    """
    import torch

    why = supports(lhs, rhs, gather_lhs=gather_lhs, dw=dw)
    assert why is None, why
    cfg = WgradTile(**tile) if tile else default_tile(gather_lhs)
    P, Q = lhs.shape[1], rhs.shape[1]
    E = offsets.numel() - 1
    TK = sorted_rows.numel()
    dense, gath = (rhs, lhs) if gather_lhs else (lhs, rhs)
    assert dense.shape[0] == TK, f"the expert-ordered operand has {dense.shape[0]} rows, routing {TK}"
    assert sorted_rows.dtype == torch.int32 and offsets.dtype == torch.int32
    if row_token is not None:
        assert row_token.dtype == torch.int32 and row_token.shape == sorted_rows.shape
        sorted_rows, top_k = row_token, 1  # token(r) = row_token[r] // 1
    assert tuple(dw.shape) in ((E, P, Q), (E, Q, P)) and len(dw_strides) == 3
    block = dense_block(cfg, gather_lhs)
    layout = shared_layout(block, gl.bfloat16 if dense.dtype == torch.bfloat16 else gl.float16)
    dense_desc = TensorDescriptor.from_tensor(dense, block, layout)
    if num_programs is None:
        num_programs = torch.cuda.get_device_properties(lhs.device).multi_processor_count
    tiles = E * cdiv(P, cfg.block_p) * cdiv(Q, cfg.block_q)
    grid = (max(1, min(num_programs, tiles)),)
    launch(_gluon_wgrad_kernel, grid,
        dense_desc, gath, sorted_rows, offsets, dw,
        P, Q, E, gath.stride(0), *dw_strides,
        TOP_K=top_k, GATHER_LHS=gather_lhs,
        BLOCK_P=cfg.block_p, BLOCK_Q=cfg.block_q, BLOCK_M=cfg.block_m, STAGES=cfg.stages,
        LOADER_WARPS=cfg.loader_warps, LOADER_REGS=cfg.loader_regs,
        num_warps=cfg.num_warps, maxnreg=cfg.kernel_maxnreg(),
    )
    return dw


def compile_sm90(*, gather_lhs: bool, P: int, Q: int, top_k: int, tile: WgradTile | None = None, capability: int = 90):
    """Compile the kernel for sm90 without a GPU (triton.compile on a GPUTarget); returns the
    CompiledKernel (`.asm["ptx"]`, `.asm["cubin"]`, `.n_regs`, `.n_spills` once loaded). Argument
    specialization as the launcher's would be (16-divisible pointers and sizes, stride_dw_q = 1)."""
    tile = tile or default_tile(gather_lhs)
    signature = {
        "dense_desc": bf16_desc_type(dense_block(tile, gather_lhs)),
        "gath_ptr": "*bf16", "sorted_rows_ptr": "*i32", "offsets_ptr": "*i32", "dw_ptr": "*bf16",
        "P": "i32", "Q": "i32", "E": "i32", "stride_gath_r": "i32", "stride_dw_e": "i32", "stride_dw_p": "i32",
    }
    constexprs = dict(stride_dw_q=1, TOP_K=top_k, GATHER_LHS=gather_lhs, BLOCK_P=tile.block_p, BLOCK_Q=tile.block_q,
                      BLOCK_M=tile.block_m, STAGES=tile.stages, LOADER_WARPS=tile.loader_warps,
                      LOADER_REGS=tile.loader_regs)
    divisible = ["gath_ptr", "sorted_rows_ptr", "offsets_ptr", "dw_ptr", "P", "Q", "stride_gath_r", "stride_dw_e",
                 "stride_dw_p"]
    return compile_for_sm90(_gluon_wgrad_kernel, signature, constexprs, divisible, num_warps=tile.num_warps,
                            maxnreg=tile.kernel_maxnreg(), capability=capability)
