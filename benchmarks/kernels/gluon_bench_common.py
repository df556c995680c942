"""What `bench_gluon_wgrad.py` and `bench_gluon_scatter.py` share: the shapes, the command line, the
register report of a kernel compiled for sm90 (`ptxas_usage`), a shape's routing, the per-GEMM comparison of the Gluon
kernel against the Triton one (`compare_and_time`) and the results table.

A results row: (shape, GEMM, gluon tile, triton us, triton TFLOPS, gluon us, gluon TFLOPS,
gluon/triton time, max |gluon - triton|, bit-equal).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
import traceback

import torch

from moe_compiler.benchmarking import SHAPES, add_common_args, command_line, median_ms, print_table


def say(*args):
    print(*args, flush=True)


def rel_err(x, ref):
    return ((x.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def make_parser(doc, tiles_help, *extra):
    """The shared options; `extra`: (flags, kwargs) pairs of a script's own, listed after --tiles."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap, shapes="7b-256,qwen3,olmoe", warmup=10, iters=100, iters_aliases=("--rep",),
                    shapes_help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--tiles", default="auto", help=tiles_help)
    for flags, kwargs in extra:
        ap.add_argument(*flags, **kwargs)
    ap.add_argument("--no-ref", action="store_true", help="skip the float32 torch reference of the big shapes")
    ap.add_argument("--skip-small", action="store_true", help="skip the uneven/empty-expert correctness case")
    ap.add_argument("--compile-only", action="store_true", help="compile for sm90 (no GPU needed) and report registers")
    return ap


def say_versions(kernels):
    """The versions, whether the Gluon kernel module `kernels` can build its kernel, the command."""
    import triton

    say(f"triton {triton.__version__}, torch {torch.__version__}, gluon available: {kernels.HAS_GLUON}"
        + ("" if kernels.HAS_GLUON else f" ({kernels.GLUON_IMPORT_ERROR})"))
    say("command: " + command_line())


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


def report_compile(head, compile_sm90, *, last_line=True):
    """`head` and the `ptxas_usage` of `compile_sm90()`, or FAILED and the error (its last line only
    with `last_line`); a failure does not stop the caller."""
    try:
        say(head, ptxas_usage(compile_sm90()))
    except Exception as exc:  # noqa: BLE001 - report and go on
        why = (str(exc).strip().splitlines()[-1] if str(exc) else '') if last_line else exc
        say(head, "FAILED", f"{type(exc).__name__}: {why}")


def routed_shape(name):
    """Shape `name` on top-k routing of random logits, its header said: ((T, d, n, E, K), sorted_rows,
    offsets, gen), `gen` (seed 0, past the logits) to draw the operands with."""
    from moe_compiler import codegen

    T, d, n, E, K = SHAPES[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randn(T, E, device="cuda", generator=gen).topk(K, -1).indices
    sorted_rows, offsets = codegen.routing.route(ids, E)
    sizes = offsets.diff()
    say(f"\n[{name}] T={T} d={d} n={n} E={E} K={K} TK={T * K}; rows per expert min {sizes.min().item()} "
        f"max {sizes.max().item()}")
    return (T, d, n, E, K), sorted_rows, offsets, gen


def compare_and_time(name, gemm, dims, flop, run_triton, reference, tiles, tile_name, gluon_on_nan, run_gluon,
                     warmup, iters):
    """One GEMM of shape `name`: the Triton kernel's time, its error against the float32 reference,
    then per Gluon tile the difference to the Triton output and the time. Returns the table rows.

    run_triton(): the Triton output (called once, then timed); reference(): float32, or None to
    skip it; gluon_on_nan(tile): the Gluon output over NaN, synchronized; run_gluon(tile, out): the
    timed Gluon call writing `out`; tile_name(tile): its label. `dims` names the GEMM's sizes. Times
    are `median_ms` over about `iters` calls."""
    label = f"[{name}] {gemm}"
    try:
        out_t = run_triton()
        t_triton = median_ms(run_triton, iters, warmup) * 1e3
        say(f"{label} {dims} triton: {t_triton:.1f} us, {flop / t_triton * 1e-6:.1f} TFLOPS")
    except Exception:  # noqa: BLE001
        say(f"{label} triton ERROR"), traceback.print_exc()
        return []
    ref = None
    if reference is not None:
        try:
            ref = reference()
            say(f"{label} triton rel err vs fp32 ref {rel_err(out_t, ref):.3g}")
        except Exception:  # noqa: BLE001
            say(f"{label} reference ERROR"), traceback.print_exc()
    rows = []
    for tile in tiles:
        head = f"{label} gluon {tile_name(tile)}:"
        try:
            out_g = gluon_on_nan(tile)
            diff = (out_g.float() - out_t.float()).abs().max().item()
            same = torch.equal(out_g, out_t)
            extra = f", rel err vs fp32 ref {rel_err(out_g, ref):.3g}" if ref is not None else ""
            say(f"{head} max|gluon - triton| {diff:.3g}, bit-equal {same}{extra}")
            t = median_ms(lambda: run_gluon(tile, out_g), iters, warmup) * 1e3
            say(f"{head} {t:.1f} us, {flop / t * 1e-6:.1f} TFLOPS, gluon/triton time {t / t_triton:.3f}")
            rows.append((name, gemm, tile_name(tile), t_triton, flop / t_triton * 1e-6, t, flop / t * 1e-6,
                         t / t_triton, diff, same))
        except Exception:  # noqa: BLE001
            say(f"{head} ERROR"), traceback.print_exc()
    del ref
    torch.cuda.empty_cache()
    return rows


def bench_and_tabulate(shapes, bench_shape):
    """`bench_shape(name)` (its rows) per shape, a failing shape reported and skipped; then the table."""
    rows = []
    for name in shapes:
        try:
            rows += bench_shape(name)
        except Exception:  # noqa: BLE001
            say(f"[{name}] ERROR"), traceback.print_exc()
    print_table(["shape", "GEMM", "gluon tile", "triton us", "triton TFLOPS", "gluon us", "gluon TFLOPS",
                 "gluon/triton time", "max abs diff", "bit-equal"], rows,
                {"triton us": ".1f", "triton TFLOPS": ".1f", "gluon us": ".1f", "gluon TFLOPS": ".1f",
                 "gluon/triton time": ".3f", "max abs diff": ".3g"})
