"""The Gluon kernels' host side on the CPU (the weight gradient, the scatter GEMM): tile specs, what
they refuse, when the op offers them, and (with Triton 3.6, the version they are written for) that
they compile for sm90 without a GPU. Their results are checked on the GPU in tests/test_kernels.py
(`test_gpu_gluon_*`)."""
from __future__ import annotations

import pytest
import torch
import triton

from moe_compiler.codegen.kernels import gluon_scatter as gs
from moe_compiler.codegen.kernels import gluon_wgrad as gw


def test_tile_specs_round_trip_and_bad_specs_raise():
    tile = gw.WgradTile.parse("128x256x64x4x8x88")
    assert (tile.block_p, tile.block_q, tile.block_m, tile.stages, tile.num_warps, tile.loader_regs) == (
        128, 256, 64, 4, 8, 88)
    assert gw.WgradTile.parse(str(tile)) == tile
    assert gw.default_tile(True).block_q == gw.default_tile(False).block_p == 256  # the TMA side is the wide one
    for bad in ("128x128x64", "128x96x64x4", "128x512x64x4", "128x128x64x1", "64x128x64x4x8", "128x128x64x4x4x90"):
        with pytest.raises(ValueError):
            gw.WgradTile.parse(bad)


def test_supports_says_why_not_on_the_cpu():
    a = torch.empty(64, 64, dtype=torch.bfloat16)
    why = gw.supports(a, a, gather_lhs=True, dw=torch.empty(1, 64, 64, dtype=torch.bfloat16))
    assert why is not None and ("Hopper" in why or "Gluon" in why)


def test_backward_never_offers_it_off_hopper():
    from moe_compiler import codegen
    from moe_compiler.codegen import wgrad_choice

    assert "gluon" in wgrad_choice.PROVIDERS
    a = torch.empty(64, 64, dtype=torch.bfloat16)
    out = codegen.backward.GradBuffer(torch.empty(1, 64, 64, dtype=torch.bfloat16, device="meta"), False)
    assert codegen.backward._gluon_wgrad(a, a, out, gather_lhs=True, db=None) is None


@pytest.mark.skipif(not (gw.HAS_GLUON and triton.__version__.startswith("3.6.")),
                    reason="the kernel is written for Triton 3.6's Gluon")
@pytest.mark.parametrize("gather_lhs", [False, True], ids=["dW1", "dW2"])
def test_compiles_for_sm90_without_a_gpu(gather_lhs):
    P, Q = (512, 1536) if not gather_lhs else (1536, 256)
    kernel = gw.compile_sm90(gather_lhs=gather_lhs, P=P, Q=Q, top_k=8)
    assert kernel.asm["cubin"] and "wgmma" in kernel.asm["ptx"] and "cp.async.mbarrier.arrive" in kernel.asm["ptx"]


def test_scatter_tile_specs_and_refusals():
    tile = gs.ScatterTile.parse(str(gs.default_tile(1)))
    assert tile == gs.default_tile(1)
    with pytest.raises(ValueError):
        gs.ScatterTile.parse("128x128")
    inp = torch.empty(64, 64, dtype=torch.bfloat16)
    why = gs.supports(inp, torch.empty(2, 64, 64, dtype=torch.bfloat16), 1, n_dim=64)
    assert why is not None and ("Hopper" in why or "Gluon" in why)


def test_cooperative_scatter_tile_specs():
    tile = gs.ScatterTile.parse("coop:128x256x64x3")
    assert tile.coop and (tile.block_m, tile.block_n, tile.stages) == (128, 256, 3)
    assert gs.ScatterTile.parse(str(tile)) == tile and str(tile).startswith("coop:")
    assert gs.ScatterTile.parse(str(gs.COOP_TILE)) == gs.COOP_TILE
    assert not gs.ScatterTile.parse("128x128x64x4").coop
    # a consumer's rows: half the item's when cooperative (64 or 128), so 64-row items are refused,
    # 256-row ones taken; ping-pong the other way round; either way <= 128 accumulator registers
    for bad in ("coop:64x128x64x4", "128x256x64x4", "256x128x64x4", "coop:256x256x64x2", "coop:128x512x64x2",
                "coop128x256x64x3", "coop:128x256"):
        with pytest.raises(ValueError):
            gs.ScatterTile.parse(bad)
    assert gs.ScatterTile.parse("coop:256x128x64x3").block_m == 256


def test_cooperative_scatter_tile_offered_from_a_long_reduction():
    short, long = gs.candidate_tiles(1, gs.COOP_MIN_K - 8), gs.candidate_tiles(2, gs.COOP_MIN_K)
    assert list(short) == ["gluon"] and list(long) == ["gluon", "gluon-coop"]
    assert long["gluon-coop"] == gs.COOP_TILE and not long["gluon"].coop
    # with a TILE-order output (TMA stores) it is offered from COOP_MIN_K_TILES
    assert list(gs.candidate_tiles(1, gs.COOP_MIN_K_TILES - 8, out_tiles=True)) == ["gluon"]
    assert list(gs.candidate_tiles(2, gs.COOP_MIN_K_TILES, out_tiles=True)) == ["gluon", "gluon-coop"]


@pytest.mark.skipif(not (gs.HAS_GLUON and triton.__version__.startswith("3.6.")),
                    reason="the kernel is written for Triton 3.6's Gluon")
@pytest.mark.parametrize("w_layout,has_bias", [(1, True), (2, False)])
def test_scatter_compiles_for_sm90_without_a_gpu(w_layout, has_bias):
    kernel = gs.compile_sm90(w_layout=w_layout, has_bias=has_bias)
    assert kernel.asm["cubin"] and "wgmma" in kernel.asm["ptx"]


@pytest.mark.skipif(not (gs.HAS_GLUON and triton.__version__.startswith("3.6.")),
                    reason="the kernel is written for Triton 3.6's Gluon")
@pytest.mark.parametrize("w_layout", [1, 2])
def test_cooperative_scatter_compiles_for_sm90_without_a_gpu(w_layout):
    kernel = gs.compile_sm90(w_layout=w_layout, has_bias=True, tile=gs.COOP_TILE)
    ptx = kernel.asm["ptx"]
    assert kernel.asm["cubin"] and "m64n256k16" in ptx and "m64n128k16" not in ptx  # one wgmma per consumer
    assert kernel.metadata.shared <= 232448  # the H100's shared memory per block


def test_slot_rows_in_tiles_places_each_slot_in_its_tile():
    """Slot s's row in a TILE-order output: the tiles of expert e follow the cdiv(rows, BLOCK_M)
    tiles of every expert before it (an empty expert has none), row r of the expert at
    tile * BLOCK_M + r % BLOCK_M; all within `tile_rows`, no two slots on one row."""
    from moe_compiler.codegen.reference import torch_route

    gen = torch.Generator().manual_seed(2)
    T, E, K, BM = 50, 6, 2, 8
    ids = torch.multinomial(torch.tensor([5.0, 1, 0, 3, 2, 1]).expand(T, E), K, generator=gen)
    sorted_rows, offsets = (t.to(torch.int32) for t in torch_route(ids, E))
    got = gs.slot_rows_in_tiles(sorted_rows, offsets, BM)
    want, first_tile = torch.empty_like(got), 0
    for e in range(E):
        lo, hi = offsets[e].item(), offsets[e + 1].item()
        for r in range(lo, hi):
            want[sorted_rows[r]] = (first_tile + (r - lo) // BM) * BM + (r - lo) % BM
        first_tile += (hi - lo + BM - 1) // BM
    assert offsets[3] == offsets[2]  # expert 2 empty
    assert torch.equal(got, want)
    assert got.unique().numel() == T * K and got.max() < gs.tile_rows(T * K, E, BM)
    padded = ids.clone()
    padded[::7, 1] = -1  # the slot form's padding: sorted last, in no expert, no row
    sorted_rows, offsets = (t.to(torch.int32) for t in torch_route(padded, E))
    got = gs.slot_rows_in_tiles(sorted_rows, offsets, BM)
    pad = (padded.flatten() == -1)
    assert (got[pad] == -1).all() and (got[~pad] >= 0).all() and got[~pad].unique().numel() == (~pad).sum()


def test_scatter_tile_shared_memory_with_output_boxes():
    """The TILE-order output adds one bf16 box per consumer to the ring: 4 stages of 256x128 rows
    (cooperative) no longer fit the H100's 227 KB, 3 do."""
    assert gs.default_tile(1).shared_bytes(False) == 4 * 2 * 128 * 64 * 2
    assert gs.default_tile(1).shared_bytes(True) == 4 * 2 * 128 * 64 * 2 + 2 * 128 * 128 * 2
    assert gs.ScatterTile.parse("coop:256x128x64x4").shared_bytes(True) > gs.SHARED_LIMIT
    assert gs.ScatterTile.parse("coop:256x128x64x3").shared_bytes(True) <= gs.SHARED_LIMIT


@pytest.mark.skipif(not (gs.HAS_GLUON and triton.__version__.startswith("3.6.")),
                    reason="the kernel is written for Triton 3.6's Gluon")
@pytest.mark.parametrize("tile", ["default", "coop:128x256x64x3"])
def test_scatter_tile_order_compiles_for_sm90_without_a_gpu(tile):
    """TILE order stores by TMA (one 2-D bulk store a consumer, waited on before its buffer is
    written again); the only pointer stores are the row map's 4-byte ones (the slot-order output's
    are 16-byte vectors); the shared memory fits."""
    import re

    cfg = gs.default_tile(1) if tile == "default" else gs.ScatterTile.parse(tile)
    kernel = gs.compile_sm90(w_layout=1, has_bias=True, tile=cfg, out_tiles=True)
    ptx = kernel.asm["ptx"]
    assert "cp.async.bulk.tensor.2d.global.shared" in ptx
    assert set(re.findall(r"st\.global[.\w]*", ptx)) == {"st.global.b32"}
    assert "cp.async.bulk.wait_group.read" in ptx
    assert kernel.metadata.shared <= gs.SHARED_LIMIT
