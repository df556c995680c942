"""The Gluon (sm90, warp-specialized) weight gradient against our Triton one (H100; Triton 3.6).

    python benchmarks/kernels/bench_gluon_wgrad.py --shapes 7b-256,qwen3,olmoe
    python benchmarks/kernels/bench_gluon_wgrad.py --shapes 7b-256 --tiles 128x128x64x4,128x256x64x3x8
    python benchmarks/kernels/bench_gluon_wgrad.py --compile-only   # no GPU needed: sm90 cubins, registers

Per shape (T, d, n, E, K), on top-k routing of random logits, the two weight gradients of a
SwiGLU layer's backward:
    dW1[e] [2n, d] = dH_e^T gather(x)_e       (`gather_lhs=False`)
    dW2[e] [d, n]  = gather(dO)_e^T A'_e      (`gather_lhs=True`)
by `codegen.backward.triton_moe_wgrad` (the autotuned Triton kernel) and `gluon_wgrad` per --tiles config:
max |gluon - triton|, whether they are equal to the bit, the relative error of each against a
float32 torch reference (--no-ref skips it), median times (`benchmarking.median_ms`: do_bench over
about --iters calls), TFLOPS (2 TK P Q flops) and the time ratio. First a small case with uneven and empty experts (T=300, E=8,
K=2, expert 5 never chosen) against the float32 reference, dw pre-filled with NaN so that an
unwritten tile shows. Each case is caught on its own: one failure prints and the rest still run.

--tiles: `auto` (gluon_wgrad's default_tile: 256x128 for dW1, 128x256 for dW2, x64x4x8x88) or
PxQxMxS[xW[xR]] = BLOCK_P x BLOCK_Q x BLOCK_M (rows per ring slot) x STAGES, consumer warps (4: one
warpgroup, 8: two; default 4), loader registers (default 56).
"""
from __future__ import annotations

import traceback

import torch
from gluon_bench_common import (SHAPES, bench_and_tabulate, compare_and_time, make_parser, rel_err,
                                report_compile, routed_shape, say, say_versions)

from moe_compiler.codegen.kernels import gluon_wgrad as gw

GEMMS = ("dW1", "dW2")


def gemm_dims(gemm, d, n):
    """(P, Q, gather_lhs) of dW1 / dW2."""
    return (2 * n, d, False) if gemm == "dW1" else (d, n, True)


def compile_only(shapes, tiles):
    for name in shapes:
        T, d, n, E, K = SHAPES[name]
        for gemm in GEMMS:
            P, Q, gather_lhs = gemm_dims(gemm, d, n)
            for tile in tiles:
                head = (f"[compile sm90] {name} {gemm} (P={P}, Q={Q}, gather_lhs={gather_lhs}) "
                        f"{tile_name(tile, gather_lhs)}:")
                report_compile(head, lambda: gw.compile_sm90(gather_lhs=gather_lhs, P=P, Q=Q, top_k=K,
                                                             tile=resolve(tile, gather_lhs)))


# ------------------------------------------------------------------------------------------ GPU runs
def reference(lhs, rhs, gather_lhs, sorted_rows, offsets, K):
    """float32 [E, P, Q]: per expert, Lhs_e^T Rhs_e from the bf16 operands upcast."""
    tokens = sorted_rows.long() // K
    off = offsets.tolist()
    E = len(off) - 1
    out = torch.zeros(E, lhs.shape[1], rhs.shape[1], device=lhs.device, dtype=torch.float32)
    for e in range(E):
        lo, hi = off[e], off[e + 1]
        if hi == lo:
            continue
        rows = tokens[lo:hi]
        a = (lhs[rows] if gather_lhs else lhs[lo:hi]).float()
        b = (rhs[lo:hi] if gather_lhs else rhs[rows]).float()
        out[e] = a.t() @ b
    return out


def run_triton(lhs, rhs, gather_lhs, routing, dw):
    from moe_compiler import codegen

    return codegen.backward.triton_moe_wgrad(lhs, rhs, gather_lhs=gather_lhs, gather_rhs=not gather_lhs, dw=dw,
                                       dw_strides=dw.stride(), **routing)


def resolve(tile, gather_lhs):
    """A --tiles entry as the WgradTile it runs: `auto` (None) is the GEMM's default tile."""
    return gw.default_tile(gather_lhs) if tile is None else tile


def run_gluon(lhs, rhs, gather_lhs, routing, dw, tile):
    return gw.gluon_wgrad(lhs, rhs, gather_lhs=gather_lhs, dw=dw, dw_strides=dw.stride(), **routing,
                          **resolve(tile, gather_lhs).kwargs())


def gluon_on_nan(lhs, rhs, gather_lhs, routing, tile, shape):
    """The Gluon dW written over a NaN-filled tensor (an unwritten element shows), synchronized."""
    dw = torch.full(shape, float("nan"), device="cuda", dtype=torch.bfloat16)
    run_gluon(lhs, rhs, gather_lhs, routing, dw, tile)
    torch.cuda.synchronize()
    return dw


def tile_name(tile, gather_lhs):
    return f"auto={resolve(tile, gather_lhs)}" if tile is None else str(tile)


def small_case(tiles):
    """Uneven expert sizes, one empty expert, P/Q not multiples of 128 (dims multiples of 64)."""
    from moe_compiler import codegen

    T, d, n, E, K = 300, 192, 64, 8, 2
    gen = torch.Generator(device="cuda").manual_seed(1)
    weight = torch.tensor([8.0, 1, 3, 0.5, 2, 0, 6, 1], device="cuda")  # expert 5 never chosen
    ids = torch.multinomial(weight.expand(T, E), K, replacement=False, generator=gen)
    sorted_rows, offsets = codegen.routing.route(ids, E)
    say(f"[small] T={T} d={d} n={n} E={E} K={K}: rows per expert {offsets.diff().tolist()}")
    routing = dict(sorted_rows=sorted_rows, offsets=offsets, top_k=K)
    rnd = lambda *s: torch.randn(*s, device="cuda", generator=gen).to(torch.bfloat16)  # noqa: E731
    x, do, dh, a_s = rnd(T, d), rnd(T, d), rnd(T * K, 2 * n), rnd(T * K, n)
    operands = {"dW1": (dh, x), "dW2": (do, a_s)}
    for gemm in GEMMS:
        P, Q, gather_lhs = gemm_dims(gemm, d, n)
        lhs, rhs = operands[gemm]
        ref = reference(lhs, rhs, gather_lhs, sorted_rows, offsets, K)
        for tile in tiles:
            head = f"[small] {gemm} {tile_name(tile, gather_lhs)}:"
            try:
                dw = gluon_on_nan(lhs, rhs, gather_lhs, routing, tile, (E, P, Q))
                err = (dw.float() - ref).abs().max().item()
                tol = 2e-2 * ref.abs().max().item()  # bf16 rounding of the fp32 sums
                empty_ok = bool((dw[5] == 0).all())
                ok = err <= tol and empty_ok and not dw.isnan().any()
                say(f"{head} {'PASS' if ok else 'FAIL'} max|gluon - ref32| {err:.3g} (tol {tol:.3g}), "
                    f"empty expert all zero: {empty_ok}, rel err {rel_err(dw, ref):.3g}")
            except Exception:  # noqa: BLE001
                say(f"{head} ERROR"), traceback.print_exc()
        try:
            dw = torch.full((E, P, Q), float("nan"), device="cuda", dtype=torch.bfloat16)
            run_triton(lhs, rhs, gather_lhs, routing, dw)
            say(f"[small] {gemm} triton: rel err {rel_err(dw, ref):.3g}")
        except Exception:  # noqa: BLE001
            say(f"[small] {gemm} triton ERROR"), traceback.print_exc()


def bench_shape(name, tiles, warmup, iters, with_ref):
    (T, d, n, E, K), sorted_rows, offsets, gen = routed_shape(name)
    TK = T * K
    routing = dict(sorted_rows=sorted_rows, offsets=offsets, top_k=K)
    rnd = lambda *s: torch.randn(*s, device="cuda", generator=gen).to(torch.bfloat16)  # noqa: E731
    x, do, dh, a_s = rnd(T, d), rnd(T, d), rnd(TK, 2 * n), rnd(TK, n)
    operands = {"dW1": (dh, x), "dW2": (do, a_s)}
    rows = []
    for gemm in GEMMS:
        P, Q, gather_lhs = gemm_dims(gemm, d, n)
        lhs, rhs = operands[gemm]
        dw_t = torch.empty(E, P, Q, device="cuda", dtype=torch.bfloat16)
        rows += compare_and_time(
            name, gemm, f"(P={P}, Q={Q})", 2 * TK * P * Q,
            run_triton=lambda: run_triton(lhs, rhs, gather_lhs, routing, dw_t),
            reference=(lambda: reference(lhs, rhs, gather_lhs, sorted_rows, offsets, K)) if with_ref else None,
            tiles=tiles, tile_name=lambda tile: tile_name(tile, gather_lhs),
            gluon_on_nan=lambda tile: gluon_on_nan(lhs, rhs, gather_lhs, routing, tile, (E, P, Q)),
            run_gluon=lambda tile, dw: run_gluon(lhs, rhs, gather_lhs, routing, dw, tile),
            warmup=warmup, iters=iters)
    return rows


def main():
    ap = make_parser(__doc__, "comma list of `auto` or PxQxMxS[xW[xR]] Gluon configs")
    args = ap.parse_args()
    shapes = args.shapes
    tiles = [None if t == "auto" else gw.WgradTile.parse(t) for t in args.tiles.split(",") if t]
    say_versions(gw)
    if args.compile_only:
        compile_only(shapes, tiles)
        return
    say(f"device: {torch.cuda.get_device_name()}")
    for tile in tiles:  # the registers of what will run (the launcher compiles the same code)
        for gemm in GEMMS:
            P, Q, gather_lhs = gemm_dims(gemm, *SHAPES[shapes[0]][1:3])
            report_compile(f"[compile] {gemm} {tile_name(tile, gather_lhs)}:",
                           lambda: gw.compile_sm90(gather_lhs=gather_lhs, P=P, Q=Q, top_k=8,
                                                   tile=resolve(tile, gather_lhs)), last_line=False)
    if not args.skip_small:
        small_case(tiles)
    bench_and_tabulate(shapes, lambda name: bench_shape(name, tiles, args.warmup, args.iters, not args.no_ref))


if __name__ == "__main__":
    main()
