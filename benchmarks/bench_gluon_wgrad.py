"""The Gluon (sm90, warp-specialized) weight gradient against our Triton one (H100; Triton 3.6).

    PYTHONPATH=. python benchmarks/bench_gluon_wgrad.py --shapes 7b-256,qwen3,olmoe
    PYTHONPATH=. python benchmarks/bench_gluon_wgrad.py --shapes 7b-256 --tiles 128x128x64x4,128x256x64x3x8
    PYTHONPATH=. python benchmarks/bench_gluon_wgrad.py --compile-only   # no GPU needed: sm90 cubins, registers

Per shape (T, d, n, E, K), on top-k routing of random logits, the two weight gradients of a
SwiGLU layer's backward:
    dW1[e] [2n, d] = dH_e^T gather(x)_e       (`gather_lhs=False`)
    dW2[e] [d, n]  = gather(dO)_e^T A'_e      (`gather_lhs=True`)
by `triton_moe.triton_moe_wgrad` (the autotuned Triton kernel) and `gluon_wgrad` per --tiles config:
max |gluon - triton|, whether they are equal to the bit, the relative error of each against a
float32 torch reference (--no-ref skips it), median times (triton.testing.do_bench), TFLOPS
(2 TK P Q flops) and the time ratio. First a small case with uneven and empty experts (T=300, E=8,
K=2, expert 5 never chosen) against the float32 reference, dw pre-filled with NaN so that an
unwritten tile shows. Each case is caught on its own: one failure prints and the rest still run.

--tiles: `auto` (gluon_wgrad's default_tile: 256x128 for dW1, 128x256 for dW2, x64x4x8x88) or
PxQxMxS[xW[xR]] = BLOCK_P x BLOCK_Q x BLOCK_M (rows per ring slot) x STAGES, consumer warps (4: one
warpgroup, 8: two; default 4), loader registers (default 56).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from codegen.kernels import gluon_wgrad as gw  # noqa: E402

# name: (T, d, n, E, K), as in bench_layer.SHAPES
SHAPES = {
    "7b-256": (24576, 1536, 256, 128, 8),
    "qwen3": (16384, 2048, 768, 128, 8),
    "olmoe": (16384, 2048, 1024, 64, 8),
}
GEMMS = ("dW1", "dW2")


def say(*args):
    print(*args, flush=True)


def ptxas_usage(kernel) -> str:
    """'regs R, spills S/L bytes' of a compiled kernel, by ptxas -v on its PTX (sm_90a)."""
    from triton.backends.nvidia.compiler import get_ptxas

    ptx = kernel.asm["ptx"]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        out = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", f.name, "-o", os.devnull],
                             capture_output=True, text=True).stderr
    regs = re.search(r"Used (\d+) registers", out)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out)
    setmax = sorted({int(v) for v in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)})
    return (f"regs {regs.group(1) if regs else '?'} (setmaxnreg {setmax}), spills "
            f"{spills.group(1) if spills else '?'}/{spills.group(2) if spills else '?'} B, "
            f"smem {kernel.metadata.shared} B, cubin {len(kernel.asm['cubin'])} B")


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
                try:
                    say(head, ptxas_usage(gw.compile_sm90(gather_lhs=gather_lhs, P=P, Q=Q, top_k=K, tile=resolve(tile, gather_lhs))))
                except Exception as exc:  # noqa: BLE001 - report and go on
                    say(head, "FAILED", f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc) else ''}")


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


def rel_err(x, ref):
    return ((x.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def run_triton(lhs, rhs, gather_lhs, routing, dw):
    from codegen import triton_moe

    return triton_moe.triton_moe_wgrad(lhs, rhs, gather_lhs=gather_lhs, gather_rhs=not gather_lhs, dw=dw,
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
    from codegen import triton_moe

    T, d, n, E, K = 300, 192, 64, 8, 2
    gen = torch.Generator(device="cuda").manual_seed(1)
    weight = torch.tensor([8.0, 1, 3, 0.5, 2, 0, 6, 1], device="cuda")  # expert 5 never chosen
    ids = torch.multinomial(weight.expand(T, E), K, replacement=False, generator=gen)
    sorted_rows, offsets = triton_moe.route(ids, E)
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


def bench_shape(name, tiles, warmup, rep, with_ref):
    from triton.testing import do_bench

    from codegen import triton_moe

    T, d, n, E, K = SHAPES[name]
    TK = T * K
    gen = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randn(T, E, device="cuda", generator=gen).topk(K, -1).indices
    sorted_rows, offsets = triton_moe.route(ids, E)
    sizes = offsets.diff()
    say(f"\n[{name}] T={T} d={d} n={n} E={E} K={K} TK={TK}; rows per expert min {sizes.min().item()} "
        f"max {sizes.max().item()}")
    routing = dict(sorted_rows=sorted_rows, offsets=offsets, top_k=K)
    rnd = lambda *s: torch.randn(*s, device="cuda", generator=gen).to(torch.bfloat16)  # noqa: E731
    x, do, dh, a_s = rnd(T, d), rnd(T, d), rnd(TK, 2 * n), rnd(TK, n)
    operands = {"dW1": (dh, x), "dW2": (do, a_s)}
    rows = []
    for gemm in GEMMS:
        P, Q, gather_lhs = gemm_dims(gemm, d, n)
        lhs, rhs = operands[gemm]
        flop = 2 * TK * P * Q
        try:
            dw_t = torch.empty(E, P, Q, device="cuda", dtype=torch.bfloat16)
            run_triton(lhs, rhs, gather_lhs, routing, dw_t)
            t_triton = do_bench(lambda: run_triton(lhs, rhs, gather_lhs, routing, dw_t), warmup=warmup, rep=rep,
                                return_mode="median") * 1e3
            say(f"[{name}] {gemm} (P={P}, Q={Q}) triton: {t_triton:.1f} us, {flop / t_triton * 1e-6:.1f} TFLOPS")
        except Exception:  # noqa: BLE001
            say(f"[{name}] {gemm} triton ERROR"), traceback.print_exc()
            continue
        ref = None
        if with_ref:
            try:
                ref = reference(lhs, rhs, gather_lhs, sorted_rows, offsets, K)
                say(f"[{name}] {gemm} triton rel err vs fp32 ref {rel_err(dw_t, ref):.3g}")
            except Exception:  # noqa: BLE001
                say(f"[{name}] {gemm} reference ERROR"), traceback.print_exc()
        for tile in tiles:
            head = f"[{name}] {gemm} gluon {tile_name(tile, gather_lhs)}:"
            try:
                dw_g = gluon_on_nan(lhs, rhs, gather_lhs, routing, tile, (E, P, Q))
                diff = (dw_g.float() - dw_t.float()).abs().max().item()
                same = torch.equal(dw_g, dw_t)
                extra = f", rel err vs fp32 ref {rel_err(dw_g, ref):.3g}" if ref is not None else ""
                say(f"{head} max|gluon - triton| {diff:.3g}, bit-equal {same}{extra}")
                t = do_bench(lambda: run_gluon(lhs, rhs, gather_lhs, routing, dw_g, tile), warmup=warmup, rep=rep,
                             return_mode="median") * 1e3
                say(f"{head} {t:.1f} us, {flop / t * 1e-6:.1f} TFLOPS, gluon/triton time {t / t_triton:.3f}")
                rows.append((name, gemm, tile_name(tile, gather_lhs), t_triton, flop / t_triton * 1e-6, t, flop / t * 1e-6,
                             t / t_triton, diff, same))
            except Exception:  # noqa: BLE001
                say(f"{head} ERROR"), traceback.print_exc()
        del ref
        torch.cuda.empty_cache()
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="7b-256,qwen3,olmoe", help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--tiles", default="auto", help="comma list of `auto` or PxQxMxS[xW[xR]] Gluon configs")
    ap.add_argument("--warmup", type=int, default=25)
    ap.add_argument("--rep", type=int, default=100)
    ap.add_argument("--no-ref", action="store_true", help="skip the float32 torch reference of the big shapes")
    ap.add_argument("--skip-small", action="store_true", help="skip the uneven/empty-expert correctness case")
    ap.add_argument("--compile-only", action="store_true", help="compile for sm90 (no GPU needed) and report registers")
    args = ap.parse_args()
    shapes = [s for s in args.shapes.split(",") if s]
    tiles = [None if t == "auto" else gw.WgradTile.parse(t) for t in args.tiles.split(",") if t]
    import triton

    say(f"triton {triton.__version__}, torch {torch.__version__}, gluon available: {gw.HAS_GLUON}"
        + ("" if gw.HAS_GLUON else f" ({gw.GLUON_IMPORT_ERROR})"))
    say("command: PYTHONPATH=. python " + " ".join(sys.argv))
    if args.compile_only:
        compile_only(shapes, tiles)
        return
    say(f"device: {torch.cuda.get_device_name()}")
    for tile in tiles:  # the registers of what will run (the launcher compiles the same code)
        for gemm in GEMMS:
            try:
                P, Q, gather_lhs = gemm_dims(gemm, *SHAPES[shapes[0]][1:3])
                say(f"[compile] {gemm} {tile_name(tile, gather_lhs)}: "
                    + ptxas_usage(gw.compile_sm90(gather_lhs=gather_lhs, P=P, Q=Q, top_k=8, tile=resolve(tile, gather_lhs))))
            except Exception as exc:  # noqa: BLE001
                say(f"[compile] {gemm} {tile_name(tile, gather_lhs)}: FAILED {type(exc).__name__}: {exc}")
    if not args.skip_small:
        small_case(tiles)
    rows = []
    for name in shapes:
        try:
            rows += bench_shape(name, tiles, args.warmup, args.rep, not args.no_ref)
        except Exception:  # noqa: BLE001
            say(f"[{name}] ERROR"), traceback.print_exc()
    say("\n| shape | GEMM | gluon tile | triton us | triton TFLOPS | gluon us | gluon TFLOPS | gluon/triton time "
        "| max abs diff | bit-equal |")
    say("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        say(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.1f} | {r[4]:.1f} | {r[5]:.1f} | {r[6]:.1f} | {r[7]:.3f} "
            f"| {r[8]:.3g} | {r[9]} |")


if __name__ == "__main__":
    main()
