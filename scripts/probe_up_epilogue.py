"""What the up-projection's and dA' GEMM's epilogues cost, and whether two resident programs an SM
hide them (GPU).

    PYTHONPATH=. python scripts/probe_up_epilogue.py --shapes 7b-256,qwen3 --rounds 3

The persistent up-projection (W1 concatenated, as the layer benchmark holds it) runs one program an
SM on a 128x256 accumulator (8 warps); between a tile's H and A stores and the next tile's first
wgmma no MMA runs. With a 128x128 tile on 4 warps (<= 256 registers a thread, <= 113 KB of shared
memory), two programs fit an SM, and one's epilogue may run under the other's wgmmas. Timed from
CUDA graphs of 10 calls each, in alternating rounds, us a call:

- the kernels as tuned; the same storing only A or only H (what each store costs, by difference);
- a pinned config (`--configs`, M x N x K : warps : stages; N of A's columns) as the persistent
  kernel on 1 and on 2 programs an SM (`--programs`), and as one program per tile;
- torch._grouped_mm on x's rows gathered beforehand, storing H only: a library grouped GEMM of the
  same size with no gather and no activation, for scale;
- the dA' GEMM with its activation-gradient pass (`triton_moe_dact`) the same ways.

Every output is checked bit-equal to the tuned kernels' where the K order is the same (BLOCK_K
equal), else within bf16 rounding.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

from bench_route import gpu_us  # noqa: E402
from bench_up_proj import up_inputs  # noqa: E402

from moe_compiler.codegen import triton_moe  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="7b-256,qwen3")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--configs", default="128x64x64:4:3,128x64x64:4:2,128x64x32:4:4",
                    help="up-projection configs; the dA' GEMM runs each with twice its N (it has no gate half)")
    ap.add_argument("--programs", default="1,2", help="persistent programs an SM")
    args = ap.parse_args()
    print(f"device: {torch.cuda.get_device_name()}; command: python " + " ".join(sys.argv))
    for shape in args.shapes.split(","):
        probe(shape, args)


class Pinned:
    """Within it: the persistent and per-tile tuners of both GEMMs held to one config (`spec`; None:
    as tuned), PERSISTENT_UP = `persistent`, and the persistent kernels on `per_sm` programs an SM.
    Each pinning keeps its config lists (the tuned launches are keyed by their identity) and gives
    the tuners their caches back on exit, so no call inside a CUDA-graph capture autotunes."""

    TUNERS = ("_up_persistent", "_dact_persistent", "_up_tma", "_dact_tma")
    SMS = None

    def __init__(self, spec: str | None, persistent: bool, per_sm: int = 1):
        self.persistent, self.per_sm, self.configs = persistent, per_sm, None
        if spec is not None:
            dims, warps, stages = spec.split(":")
            m, bn, bk = map(int, dims.split("x"))
            self.configs = {}
            for name in self.TUNERS:
                kw = dict(BLOCK_M=m, BLOCK_N=bn if name.startswith("_up") else 2 * bn, BLOCK_K=bk,
                          GROUP_M=triton_moe._GROUP_M)
                if name.endswith("_tma"):
                    kw["FUSED_GU"] = False
                self.configs[name] = [triton.Config(kw, num_warps=int(warps), num_stages=int(stages),
                                                    pre_hook=triton_moe._w_block_hook)]

    def __enter__(self):
        if Pinned.SMS is None:
            Pinned.SMS = triton_moe._programs(torch.device("cuda"))
        tuners = {name: getattr(triton_moe, name) for name in self.TUNERS}
        self.saved = {name: (t.configs, dict(t.cache)) for name, t in tuners.items()}
        self.saved_programs, self.saved_persistent = triton_moe._programs, triton_moe.PERSISTENT_UP
        if self.configs is not None:
            for name, tuner in tuners.items():
                tuner.configs = self.configs[name]
                tuner.cache.clear()
        triton_moe._programs = lambda device: Pinned.SMS * self.per_sm
        triton_moe.PERSISTENT_UP = self.persistent
        return self

    def __exit__(self, *exc):
        for name, (configs, cache) in self.saved.items():
            tuner = getattr(triton_moe, name)
            tuner.configs = configs
            tuner.cache.clear()
            tuner.cache.update(cache)
        triton_moe._programs = self.saved_programs
        triton_moe.PERSISTENT_UP = self.saved_persistent


def probe(shape: str, args):
    (T, d, n, E, K), x, rows, offs, w1, w2, s, gen = up_inputs(shape)
    dout = torch.randn(T, d, device="cuda", generator=gen).bfloat16()
    bank1, bank2 = triton_moe._stacked_banks(w1, w2, False)
    flags = dict(n=n, top_k=K, activation="swiglu", interleaved=False, alpha=1.702, limit=7.0)
    x_rows = x[(rows // K).long()]
    w1_t = w1.transpose(1, 2)
    ends = offs[1:].to(torch.int32)

    def up(store_h=True, store_a=True):
        return triton_moe.triton_moe_up(x, bank1, None, rows, offs, store_h=store_h, store_a=store_a, **flags)

    h_ref = up()[0]

    def dact():
        return triton_moe.triton_moe_dact(dout, bank2, h_ref, s, rows, offs, **flags)

    tuned = Pinned(None, True)
    variants = {  # name: (pinning, call)
        "up, as tuned": (tuned, up),
        "up, as tuned, A only": (tuned, lambda: up(store_h=False)),
        "up, as tuned, H only": (tuned, lambda: up(store_a=False)),
        "up, torch._grouped_mm on pre-gathered rows (H only)": (tuned, lambda: torch._grouped_mm(x_rows, w1_t,
                                                                                                  offs=ends)),
        "dA' + act grad, as tuned": (tuned, dact),
    }
    for spec in filter(None, args.configs.split(",")):
        for per_sm in map(int, args.programs.split(",")):
            variants[f"up, {spec}, persistent x{per_sm}"] = (Pinned(spec, True, per_sm), up)
            variants[f"dA' + act grad, {spec}, persistent x{per_sm}"] = (Pinned(spec, True, per_sm), dact)
        variants[f"up, {spec}, per tile"] = (Pinned(spec, False), up)
        variants[f"dA' + act grad, {spec}, per tile"] = (Pinned(spec, False), dact)
    outs, failed = {}, set()
    for name, (pin, call) in variants.items():  # first calls: autotune and compile outside the graphs
        try:
            with pin:
                out = call()
                outs[name] = [t.clone() for t in (out if isinstance(out, tuple) else (out,))]
        except Exception as exc:  # noqa: BLE001 - a config that does not fit: report, go on
            failed.add(name)
            print(f"{shape} {name}: FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:200]}", flush=True)
    for name in outs:
        base = "up, as tuned" if name.startswith("up") else "dA' + act grad, as tuned"
        if name == base or "grouped_mm" in name or " only" in name:
            continue
        same = all(torch.equal(a, b) for a, b in zip(outs[name], outs[base]))
        diff = max(((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()
                   for a, b in zip(outs[name], outs[base]))
        print(f"{shape} {name}: {'bit-equal' if same else f'rel diff {diff:.1e}'} to {base}", flush=True)
    times = {name: [] for name in outs}
    for _ in range(args.rounds):
        for name in times:
            pin, call = variants[name]
            with pin:
                times[name].append(gpu_us(call))
    print(f"\n{shape} (T {T}, d {d}, n {n}, E {E}, K {K}), us a call from CUDA graphs, each round:\n")
    print("| call | rounds | median | GEMM TFLOPS |\n|---|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        flop = 2 * T * K * d * n * (1 if name.startswith("dA'") else 2)
        print(f"| {name} | {' / '.join(f'{t:.1f}' for t in ts)} | {med:.1f} | {flop / med * 1e-6:.0f} |", flush=True)


if __name__ == "__main__":
    main()
