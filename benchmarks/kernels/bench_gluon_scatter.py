"""The Gluon (sm90, warp-specialized, ping-pong) scatter GEMM against our Triton one (H100; Triton 3.6).

    python benchmarks/kernels/bench_gluon_scatter.py --shapes 7b-256,qwen3,olmoe
    python benchmarks/kernels/bench_gluon_scatter.py --shapes 7b-256 --tiles auto,128x128x64x6
    python benchmarks/kernels/bench_gluon_scatter.py --compile-only   # no GPU needed: sm90 cubins, registers
    python benchmarks/kernels/bench_gluon_scatter.py --shapes "" --gemms Y --small-grids 2   # one small case

The table in `gluon_scatter.default_tile`'s docstring comes from (`auto` is the last of these tiles)
    python benchmarks/kernels/bench_gluon_scatter.py --skip-small --shapes 7b-256,qwen3,olmoe \
        --tiles 128x128x64x4x8x232x40x4,128x128x64x6x8x232x40x4,128x128x64x4x8x232x40x1

Per shape (T, d, n, E, K), on top-k routing of random logits, the two scatter GEMMs of a SwiGLU layer:
    Y   [TK, d] = A [TK, n] @ W2[e]^T     (forward down-projection; W2 [E, d, n]: w_layout 1)
    dX~ [TK, d] = dH [TK, 2n] @ W1[e]     (backward input gradient; W1 [E, 2n, d]: w_layout 2)
both stored in slot order, by `codegen.forward.triton_moe_scatter_gemm` (the autotuned persistent TMA
Triton kernel) and `gluon_scatter_gemm` per --tiles config: max |gluon - triton|, whether they are
equal to the bit, the relative error of each against a float32 torch reference (--no-ref skips
it), median times (`benchmarking.median_ms`: do_bench over about --iters calls), TFLOPS (2 TK k_dim
n_dim flops) and the time ratio. First a small case with uneven and empty experts (T=300, E=8,
K=2: expert 5 never chosen, expert 3 with fewer rows than BLOCK_M, TK = 600 not a multiple of it,
k_dim and n_dim not multiples of the tile, a bias on Y), against the float32 reference, out pre-filled with NaN so that an unwritten row
shows, on the full grid and on a 2-CTA grid (many items per CTA: the ring wraps, both consumers
alternate). Each case is caught on its own: one failure prints and the rest still run.

--tiles: `auto` (gluon_scatter.default_tile) or [coop:]MxNxKxS[xG[xC[xL[xW]]]] = BLOCK_M x BLOCK_N x
BLOCK_K x STAGES, GROUP_M, consumer / loader registers, loader warps (see gluon_scatter.ScatterTile);
"coop:" the cooperative schedule (both consumer warpgroups on one item, e.g. coop:128x256x64x3).
--gemms picks Y and/or dX~; --small-grids the small case's grids (each its own process isolates a
kernel fault: a launch failure poisons the CUDA context for every case after it).
"""
from __future__ import annotations

import traceback

import torch
from gluon_bench_common import (  # beside this file
    bench_and_tabulate, compare_and_time, make_parser, rel_err, report_compile, routed_shape, say, say_versions)

from moe_compiler.codegen.kernels import gluon_scatter as gs

GEMMS = ("Y", "dX~")
W_LAYOUT = {"Y": 1, "dX~": 2}


def resolve(tile, w_layout):
    """A --tiles entry as the ScatterTile it runs: `auto` (None) is the default tile."""
    return gs.default_tile(w_layout) if tile is None else tile


def tile_name(tile, w_layout):
    return f"auto={resolve(tile, w_layout)}" if tile is None else str(tile)


def compile_only(tiles):
    for gemm in GEMMS:
        wl = W_LAYOUT[gemm]
        for tile in tiles:
            for has_bias in (False, True):
                head = f"[compile sm90] {gemm} (w_layout {wl}, bias {has_bias}) {tile_name(tile, wl)}:"
                report_compile(head, lambda: gs.compile_sm90(w_layout=wl, has_bias=has_bias, tile=resolve(tile, wl)))


# ------------------------------------------------------------------------------------------ GPU runs
def operands(gemm, T, d, n, E, K, gen, std=1.0):
    """(inp, w, w_layout, k_dim): Y reads A [TK, n] and W2 [E, d, n]; dX~ reads dH [TK, 2n] and W1 [E, 2n, d]."""
    rnd = lambda *s, std: (torch.randn(*s, device="cuda", generator=gen) * std).to(torch.bfloat16)  # noqa: E731
    if gemm == "Y":
        return rnd(T * K, n, std=std), rnd(E, d, n, std=n ** -0.5), 1, n
    return rnd(T * K, 2 * n, std=std), rnd(E, 2 * n, d, std=d ** -0.5), 2, 2 * n


def reference(inp, w, w_layout, bias, sorted_rows, offsets):
    """float32 [TK, n_dim] in slot order, from the bf16 operands upcast."""
    off = offsets.tolist()
    n_dim = w.shape[1] if w_layout == 1 else w.shape[2]
    out = torch.zeros(inp.shape[0], n_dim, device=inp.device, dtype=torch.float32)
    slots = sorted_rows.long()
    for e in range(len(off) - 1):
        lo, hi = off[e], off[e + 1]
        if hi == lo:
            continue
        b = w[e].float().t() if w_layout == 1 else w[e].float()
        y = inp[lo:hi].float() @ b
        if bias is not None:
            y += bias[e].float()
        out[slots[lo:hi]] = y
    return out


def run_triton(inp, w, w_layout, bias, sorted_rows, offsets, n_dim):
    from moe_compiler import codegen

    s = w.stride()
    if w_layout == 1:  # W2 [E, d, n] as a Bank (e, out=d, in=n); B[e] = W2[e]^T read through (e, k=n, n=d) strides
        return codegen.forward.triton_moe_scatter_gemm(inp, codegen.launch.Bank(w, tuple(s)), (s[0], s[2], s[1]), bias,
                                                  sorted_rows, offsets, n_dim=n_dim)
    bank = codegen.launch.Bank(w, tuple(s))  # W1 [E, 2n, d]: B[e] = W1[e], (e, k, n) strides as stored
    return codegen.forward.triton_moe_scatter_gemm(inp, bank, bank.strides, bias, sorted_rows, offsets, n_dim=n_dim)


def run_gluon(inp, w, w_layout, bias, sorted_rows, offsets, n_dim, tile, out=None, num_programs=None):
    return gs.gluon_scatter_gemm(inp, w, w_layout, bias, sorted_rows, offsets, n_dim=n_dim, out=out,
                                 num_programs=num_programs, **resolve(tile, w_layout).kwargs())


def gluon_on_nan(inp, w, w_layout, bias, sorted_rows, offsets, n_dim, tile, num_programs=None):
    """The Gluon output written over a NaN-filled tensor (an unwritten row shows), synchronized."""
    out = torch.full((inp.shape[0], n_dim), float("nan"), device="cuda", dtype=inp.dtype)
    run_gluon(inp, w, w_layout, bias, sorted_rows, offsets, n_dim, tile, out=out, num_programs=num_programs)
    torch.cuda.synchronize()
    return out


def small_case(tiles, gemms=GEMMS, grids=(None, 2)):
    """Uneven expert sizes, one empty expert, one smaller than BLOCK_M, ragged k_dim / n_dim, a bias."""
    from moe_compiler import codegen

    T, d, n, E, K = 300, 320, 96, 8, 2
    gen = torch.Generator(device="cuda").manual_seed(1)
    weight = torch.tensor([8.0, 1, 3, 0.5, 2, 0, 6, 1], device="cuda")  # expert 5 never chosen, 3 rarely
    ids = torch.multinomial(weight.expand(T, E), K, replacement=False, generator=gen)
    sorted_rows, offsets = codegen.routing.route(ids, E)
    say(f"[small] T={T} d={d} n={n} E={E} K={K}: rows per expert {offsets.diff().tolist()}")
    for gemm in gemms:
        inp, w, wl, k_dim = operands(gemm, T, d, n, E, K, gen)
        bias = (torch.randn(E, d, device="cuda", generator=gen) * 0.1).to(torch.bfloat16) if gemm == "Y" else None
        ref = reference(inp, w, wl, bias, sorted_rows, offsets)
        for tile in tiles:
            for progs in grids:
                head = f"[small] {gemm} (k_dim {k_dim}, n_dim {d}, bias {bias is not None}) {tile_name(tile, wl)} grid {progs or 'SMs'}:"
                try:
                    out = gluon_on_nan(inp, w, wl, bias, sorted_rows, offsets, d, tile, num_programs=progs)
                    err = (out.float() - ref).abs().max().item()
                    tol = 2e-2 * ref.abs().max().item()  # bf16 rounding of the fp32 sums
                    nan = out.isnan().any(1).sum().item()
                    ok = err <= tol and nan == 0
                    say(f"{head} {'PASS' if ok else 'FAIL'} max|gluon - ref32| {err:.3g} (tol {tol:.3g}), "
                        f"rows with NaN {nan}, rel err {rel_err(out, ref):.3g}")
                except Exception:  # noqa: BLE001
                    say(f"{head} ERROR"), traceback.print_exc()
        try:
            out = run_triton(inp, w, wl, bias, sorted_rows, offsets, d)
            say(f"[small] {gemm} triton: rel err {rel_err(out, ref):.3g}")
        except Exception:  # noqa: BLE001
            say(f"[small] {gemm} triton ERROR"), traceback.print_exc()


def bench_shape(name, tiles, warmup, iters, with_ref, gemms=GEMMS):
    (T, d, n, E, K), sorted_rows, offsets, gen = routed_shape(name)
    TK = T * K
    rows = []
    for gemm in gemms:
        inp, w, wl, k_dim = operands(gemm, T, d, n, E, K, gen)
        args = (inp, w, wl, None, sorted_rows, offsets, d)
        rows += compare_and_time(
            name, gemm, f"(k_dim={k_dim}, n_dim={d})", 2 * TK * k_dim * d,
            run_triton=lambda: run_triton(*args),
            reference=(lambda: reference(inp, w, wl, None, sorted_rows, offsets)) if with_ref else None,
            tiles=tiles, tile_name=lambda tile: tile_name(tile, wl),
            gluon_on_nan=lambda tile: gluon_on_nan(*args, tile),
            run_gluon=lambda tile, out: run_gluon(*args, tile, out=out),
            warmup=warmup, iters=iters)
    return rows


def main():
    ap = make_parser(
        __doc__, "comma list of `auto` or [coop:]MxNxKxS[xG[xC[xL[xW]]]] Gluon configs",
        (["--gemms"], dict(default=",".join(GEMMS), help="comma list of Y, dX~")),
        (["--small-grids"], dict(default="sms,2", help="grids of the small case: `sms` (one CTA per SM) or a count")))
    args = ap.parse_args()
    shapes = args.shapes
    gemms = [g for g in args.gemms.split(",") if g]
    grids = [None if g == "sms" else int(g) for g in args.small_grids.split(",") if g]
    tiles = [None if t == "auto" else gs.ScatterTile.parse(t) for t in args.tiles.split(",") if t]
    say_versions(gs)
    if args.compile_only:
        compile_only(tiles)
        return
    say(f"device: {torch.cuda.get_device_name()}")
    for tile in tiles:  # the registers of what will run (the launcher compiles the same code)
        for gemm in gemms:
            wl = W_LAYOUT[gemm]
            report_compile(f"[compile] {gemm} {tile_name(tile, wl)}:",
                           lambda: gs.compile_sm90(w_layout=wl, tile=resolve(tile, wl)), last_line=False)
    if not args.skip_small:
        small_case(tiles, gemms, grids)
    bench_and_tabulate(shapes, lambda name: bench_shape(name, tiles, args.warmup, args.iters, not args.no_ref, gemms))


if __name__ == "__main__":
    main()
