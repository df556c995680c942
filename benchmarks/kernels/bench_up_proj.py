"""The up-projection kernel alone, per W1 layout, with and without its TMA weight path (GPU).

Question: what does a W1 layout cost the forward's largest GEMM? gpt-oss stores gate/up
interleaved and transposed ([E, d, 2n]); the layer benchmark's `ours-interleaved` provider ran its
forward at 293 TFLOPS against 497 for the same weights concatenated (H100, gpt-oss sizes).

    python benchmarks/kernels/bench_up_proj.py --shape gpt-oss
    python benchmarks/kernels/bench_up_proj.py --persistent-ab --shapes 7b-256,qwen3,olmoe
    python benchmarks/kernels/bench_up_proj.py --compile-only --shapes 7b-256   # no GPU: Triton 3.6 compiles for sm90

--persistent-ab times the persistent kernel (`codegen.launch.PERSISTENT_UP`) against one program per
tile, side by side at each shape: the up-projection (W1 concatenated and interleaved) and the dA'
GEMM with its activation-gradient pass (`triton_moe_dact`), and checks the outputs agree.
--compile-only compiles both kernels for sm90 at each shape and config, with the specializations a
launch gives them (sizes divisible by 16 marked so, unit strides as constants: without these the
gathered x loads compile to plain loads instead of cp.async), and reports shared memory,
registers, spills and the copies issued (cp.async for the gathered rows, TMA for the weights).

For each orientation (nn.Linear's [E, 2n, d], transposed [E, d, 2n]) and gate/up layout
(concatenated, interleaved): median time (`benchmarking.median_ms`) and TFLOPS of `codegen.forward.triton_moe_up` (gathered x,
H and A = SwiGLU(H) stored) through the TMA weight descriptor where the launcher takes one, and
with the descriptor refused (pointer loads), and how far apart the A's are. A concatenated W1
through TMA runs twice: one dot of width 2*BLOCK_N on a 4D tile (`codegen.launch.set_wide_up`, the
default), and two dots on separate gate and up tiles.
"""
from __future__ import annotations

import argparse
from typing import NamedTuple

import torch

from moe_compiler.benchmarking import SHAPES, add_common_args, command_line, median_ms


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap, shapes="7b-256,qwen3,olmoe", warmup=10, iters=100, iters_aliases=("--rep",),
                    shapes_help="with --persistent-ab or --compile-only")
    ap.add_argument("--shape", default="gpt-oss", help=f"one of {sorted(SHAPES)}")
    ap.add_argument("--persistent-ab", action="store_true", help="persistent kernel against one program per tile")
    ap.add_argument("--compile-only", action="store_true", help="compile for sm90 (no GPU) and report resources")
    args = ap.parse_args()
    if args.compile_only:
        return compile_only(args)
    if args.persistent_ab:
        return persistent_ab(args)
    from moe_compiler import codegen

    T, d, n, E, K = SHAPES[args.shape]
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, d, device="cuda", generator=gen).bfloat16()
    ids = torch.randn(T, E, device="cuda", generator=gen).topk(K, -1).indices
    rows, offs = codegen.routing.route(ids, E)
    w1 = (torch.randn(E, 2 * n, d, device="cuda", generator=gen) / d**0.5).bfloat16()
    flop = 2 * T * K * d * 2 * n
    with_desc, wide_up = codegen.launch._weight_desc, codegen.launch.WIDE_UP
    print(f"device: {torch.cuda.get_device_name()}; {args.shape} (T, d, n, E, K) = {(T, d, n, E, K)}")
    print("| W1 | gate/up | weight loads | us | TFLOPS |\n|---|---|---|---|---|")
    try:
        for transposed in (False, True):
            w = w1.transpose(1, 2).contiguous() if transposed else w1
            bank = codegen.launch._stacked_banks(w, w, transposed)[0]
            for interleaved in (False, True):
                outs = []
                for tma, wide in ((True, True), (True, False), (False, False))[0 if not interleaved else 1:]:
                    codegen.launch._weight_desc = with_desc if tma else (lambda *a, **k: (None, 0))
                    codegen.launch.set_wide_up(wide)
                    call = lambda: codegen.forward.triton_moe_up(  # noqa: E731
                        x, bank, None, rows, offs, n=n, top_k=K, activation="swiglu", interleaved=interleaved,
                        alpha=1.702, limit=7.0)
                    outs.append(call()[1].clone())
                    t = median_ms(call, args.iters, args.warmup) * 1e3
                    layout = "[E, d, 2n]" if transposed else "[E, 2n, d]"
                    loads = ("TMA, one wide dot" if wide else "TMA if taken") if tma else "pointers"
                    print(f"| {layout} | {'interleaved' if interleaved else 'concatenated'} | {loads} | {t:.0f} | "
                          f"{flop / t * 1e-6:.0f} |", flush=True)
                diff = max(((o.float() - outs[-1].float()).norm() / outs[-1].float().norm()).item() for o in outs)
                print(f"|  | A, TMA vs pointers: rel diff {diff:.1e} (the two may tune other tiles) | | | |")
    finally:
        codegen.launch._weight_desc = with_desc
        codegen.launch.set_wide_up(wide_up)


class UpInputs(NamedTuple):
    """A shape's bf16 inputs of the up-projection and the dA' GEMM (seed 0), W1 concatenated."""

    dims: tuple  # (T, d, n, E, K)
    x: torch.Tensor
    rows: torch.Tensor  # the routing's sorted rows and offsets
    offs: torch.Tensor
    w1: torch.Tensor  # [E, 2n, d]
    w2: torch.Tensor  # [E, d, n]
    s: torch.Tensor  # [TK] router weights, float32
    gen: torch.Generator  # for anything else the caller draws


def up_inputs(shape: str) -> UpInputs:
    from moe_compiler import codegen

    T, d, n, E, K = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, d, device="cuda", generator=gen).bfloat16()
    ids = torch.randn(T, E, device="cuda", generator=gen).topk(K, -1).indices
    rows, offs = codegen.routing.route(ids, E)
    w1 = (torch.randn(E, 2 * n, d, device="cuda", generator=gen) / d**0.5).bfloat16()
    w2 = (torch.randn(E, d, n, device="cuda", generator=gen) / n**0.5).bfloat16()
    s = torch.rand(T * K, device="cuda", generator=gen)
    return UpInputs((T, d, n, E, K), x, rows, offs, w1, w2, s, gen)


def persistent_ab(args):
    from moe_compiler import codegen

    print(f"device: {torch.cuda.get_device_name()}")
    print("| shape | GEMM | persistent us (TFLOPS) | per tile us (TFLOPS) | ratio | outputs |\n|---|---|---|---|---|---|")
    saved = codegen.launch.PERSISTENT_UP
    try:
        for shape in args.shapes:
            (T, d, n, E, K), x, rows, offs, w1, w2, s, _ = up_inputs(shape)
            up_flop, dact_flop = 2 * T * K * d * 2 * n, 2 * T * K * d * n
            b1 = codegen.launch._stacked_banks(w1, w2, False)
            calls = {}
            for interleaved in (False, True):
                calls["up, interleaved" if interleaved else "up, concatenated"] = (up_flop, (
                    lambda il=interleaved: codegen.forward.triton_moe_up(
                        x, b1[0], None, rows, offs, n=n, top_k=K, activation="swiglu", interleaved=il,
                        alpha=1.702, limit=7.0)))
            h = calls["up, concatenated"][1]()[0]
            calls["dA' + act grad"] = (dact_flop, lambda: codegen.backward.triton_moe_dact(
                x, b1[1], h, s, rows, offs, n=n, top_k=K, activation="swiglu", interleaved=False, alpha=1.702,
                limit=7.0))
            for gemm, (flop, call) in calls.items():
                t, outs = {}, {}
                for persistent in (True, False):
                    codegen.launch.set_persistent_up(persistent)
                    outs[persistent] = [o.clone() for o in call()]
                    t[persistent] = median_ms(call, args.iters, args.warmup) * 1e3
                same = all(torch.equal(a, b) for a, b in zip(outs[True], outs[False]))
                diff = max(((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()
                           for a, b in zip(outs[True], outs[False]))
                print(f"| {shape} | {gemm} | {t[True]:.0f} ({flop / t[True] * 1e-6:.0f}) | {t[False]:.0f} "
                      f"({flop / t[False] * 1e-6:.0f}) | {t[True] / t[False]:.3f} | "
                      f"{'bit-equal' if same else f'rel diff {diff:.1e}'} |", flush=True)
    finally:
        codegen.launch.set_persistent_up(saved)


def compile_sm90(fn, args: dict, constexprs: dict, *, num_warps: int, num_stages: int):
    """`fn` compiled for sm90 as a launch with these arguments would specialize it: `args` maps each
    runtime argument to a type string ("*bf16", "tensordesc<...>") or an example int / float.
    Ints equal to 1 become the constant 1 and ints divisible by 16 are marked so, as Triton does at
    a launch (except `do_not_specialize` ones); pointers are taken as 16-byte aligned."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    keep = set(getattr(fn, "do_not_specialize", ()) or ())
    keep |= {fn.arg_names[i] for i in keep if isinstance(i, int)}
    sig, attrs, consts = {}, {}, dict(constexprs)
    for i, name in enumerate(fn.arg_names):
        value = args.get(name)
        if name in consts or value is None:
            sig[name] = "constexpr"
            consts.setdefault(name, value)
        elif isinstance(value, str):
            sig[name] = value
            if value.startswith("*"):
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            sig[name] = "fp32"
        elif value == 1 and name not in keep:
            sig[name], consts[name] = "constexpr", 1
        else:
            sig[name] = "i32"
            if value % 16 == 0 and name not in keep:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def up_compile_args(T: int, d: int, n: int, E: int, K: int, *, gated: bool, dtype: str = "bf16") -> tuple[dict, dict]:
    """(argument types or example values, constexpr flags) of an up-projection (`gated`, W1
    concatenated) or dA' GEMM launch for `compile_sm90`, with no bias and no token map. The caller
    adds the weight operand (`w_desc` or `w1_ptr`), W_DESC and the tile's constexprs."""
    from moe_compiler import codegen

    args = dict(x_ptr=f"*{dtype}", b1_ptr=f"*{dtype}", sorted_rows_ptr="*i32", row_token_ptr="*i32",
                offsets_ptr="*i32", h_ptr=f"*{dtype}", a_ptr=f"*{dtype}", w_table_ptr="*i64",
                TK=T * K, d=d, n=n, E=E, stride_x_t=d, stride_x_d=1, stride_b1_e=0, stride_b1_o=1, alpha=1.702,
                limit=7.0, stride_w1_e=2 * n * d, stride_w1_o=d, stride_w1_i=1)
    flags = dict(top_k=K, ACTIVATION=0 if gated else codegen.launch._IDENTITY, GATED=gated, INTERLEAVED=False,
                 HAS_B1=False, STORE_H=gated, STORE_A=True, E_POW2=codegen.kernels.routing.e_pow2(E), TOKEN_MAP=False)
    return args, flags


def compile_only(args):
    """The up-projection (W1 concatenated as [E, 2, n, d]) and the dA' GEMM, per tile and persistent,
    compiled for sm90 at each config of their autotuners."""
    import re

    import triton
    from gluon_bench_common import ptxas_usage  # beside this file

    from moe_compiler import codegen
    from moe_compiler.codegen.kernels.grouped_gemm import _up_proj_kernel, _up_proj_persistent_kernel

    print(f"triton {triton.__version__}; command: {command_line()}")
    for shape in args.shapes:
        T, d, n, E, K = SHAPES[shape]
        for gemm, configs, w_desc, gated in (("up", codegen.launch._persistent_configs("up"), 3, True),
                                             ("dact", codegen.launch._persistent_configs("dact"), 1, False)):
            base_args, base_flags = up_compile_args(T, d, n, E, K, gated=gated)
            for c in configs:
                bn, bk = c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"]
                box = f"[1, 2, {bn}, {bk}]" if w_desc == 3 else f"[1, {bn}, {bk}]"
                flags = dict(base_flags, W_DESC=w_desc, **c.kwargs)
                for name, fn, extra in (("persistent", _up_proj_persistent_kernel, {}),
                                        ("per tile", _up_proj_kernel,
                                         dict(DOT_PRECISION="tf32", W_TABLE=False, W_ALIGN=1, FUSED_GU=False))):
                    head = f"{shape} {gemm} {name} {c.kwargs['BLOCK_M']}x{bn}x{bk}:{c.num_warps}:{c.num_stages}"
                    args_ = dict(base_args, **{("w_desc" if name == "persistent" else "w1_ptr"):
                                               f"tensordesc<bf16{box}>"})
                    try:
                        kernel = compile_sm90(fn, args_, dict(flags, **extra), num_warps=c.num_warps,
                                              num_stages=c.num_stages)
                    except Exception as exc:  # noqa: BLE001 - report and go on
                        print(head, "FAILED", f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:200]}")
                        continue
                    ptx = kernel.asm["ptx"]
                    print(head, ptxas_usage(kernel), f"cp.async {len(re.findall(r'cp[.]async[.]c[ag]', ptx))},",
                          f"TMA loads {ptx.count('cp.async.bulk.tensor')}", flush=True)


if __name__ == "__main__":
    main()
