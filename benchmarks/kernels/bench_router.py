"""The fused router's forward kernel alone (`sonic::route` on CUDA): 16-bit against int64 keys, and
its launch (tokens per program, warps), side by side on the same logits (GPU).

    python benchmarks/kernels/bench_router.py
    python benchmarks/kernels/bench_router.py --cases 7b-256,qwen3 --blocks 16,32,64 --warps 2,4,8

Each case is (T, E, k, router form, logits dtype, compute dtype). Where every value the kernel
ranks is a bf16 (top-k on bf16 logits, or scores computed in bf16), its keys are int32 instead of
int64 (`codegen.router._key_kind`); `narrow_keys=False` keeps int64 keys. Per case and launch: the
median us of a call (forward with each key width, and the backward) from CUDA graphs of --calls
calls (`benchmarking.graph_ms`: a call this short is host-bound when launched one by one), and
whether both key widths gave the same ids and weights bit for bit. Logits: randn in bf16 with a NaN in every 97th row.
"""
from __future__ import annotations

import argparse

import torch

from moe_compiler.benchmarking import add_common_args, comma_list, graph_ms
from moe_compiler.codegen.router import _blocks, _key_kind, triton_router_bwd, triton_router_fwd

FULL = dict(score="softmax", topk_first=False, renorm=False, eps=0.0, scale=1.0, n_group=1, topk_group=1,
            fill=float("-inf"))
CASES = {  # name: (T, E, k, router keywords, compute dtype)
    "7b-256": (24576, 128, 8, dict(topk_first=True), torch.float32),  # bench_layer's router, gpt-oss's form
    "1.4b-256": (40960, 128, 8, dict(topk_first=True), torch.float32),
    "30b-256": (32768, 256, 16, dict(topk_first=True), torch.float32),
    "qwen3": (16384, 128, 8, dict(renorm=True), torch.float32),  # softmax in fp32: int64 keys either way
    "qwen3-bf16": (16384, 128, 8, dict(renorm=True), torch.bfloat16),  # the same scores kept in bf16
}


def run_case(name, blocks, warps, args):
    def gpu_us(fn):
        return graph_ms(fn, iters=args.iters, warmup=args.warmup, calls=args.calls) * 1e3

    T, E, k, kw, compute = CASES[name]
    full = {**FULL, **kw}
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(T, E, device="cuda", generator=gen).bfloat16()
    logits[::97, 3] = float("nan")
    route_args = (None, k, full["score"], full["topk_first"], full["renorm"], full["eps"], full["scale"],
                  full["n_group"], full["topk_group"], full["fill"], compute)
    narrow_kind = _key_kind(logits, compute, full["topk_first"], full["n_group"], full["fill"])
    print(f"{name}: T={T} E={E} k={k} {kw} compute {compute}; keys {'int32' if narrow_kind else 'int64'}", flush=True)
    g = torch.randn(T, k, device="cuda", generator=gen).to(compute)
    ids = triton_router_fwd(logits, *route_args)[1]
    default = _blocks(T, E, k, None, None), _blocks(T, E, k, None, None, forward=False,
                                                    gathered=full["topk_first"] or full["score"] == "sigmoid")
    launches = [(None, None)] + [(b, w) for b in blocks for w in warps]
    for block_t, nw in launches:
        times, outs = {}, {}
        for narrow in (False, True):
            def call(narrow=narrow):
                return triton_router_fwd(logits, *route_args, block_t=block_t, narrow_keys=narrow, num_warps=nw)
            outs[narrow] = call()
            times[narrow] = gpu_us(call)
        bits = torch.int16 if compute != torch.float32 else torch.int32
        same = torch.equal(outs[False][1], outs[True][1]) and torch.equal(outs[False][0].view(bits),
                                                                          outs[True][0].view(bits))
        bwd_args = (k, full["score"], full["topk_first"], full["renorm"], full["eps"], full["scale"], compute)
        def backward():
            return triton_router_bwd(g, logits, ids, *bwd_args, block_t=block_t, num_warps=nw)
        backward()  # compiled before the capture
        bwd = gpu_us(backward)
        head = (f"default (forward BLOCK_T {default[0][0]}, warps {default[0][4]}; backward {default[1][0]}, "
                f"{default[1][4]})" if block_t is None
                else f"BLOCK_T {block_t:3d} warps {nw}")
        print(f"  {head}: forward int64 keys {times[False]:7.1f} us, narrow {times[True]:7.1f} us  "
              f"(x{times[False] / times[True]:.2f}; {'bit-equal' if same else 'DIFFERENT'}); backward {bwd:7.1f} us",
              flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap, warmup=10, iters=100)
    ap.add_argument("--cases", type=comma_list, default=",".join(CASES), help=f"comma list of {sorted(CASES)}")
    ap.add_argument("--blocks", type=comma_list, default="16,32,64", help="tokens per program (BLOCK_T)")
    ap.add_argument("--warps", type=comma_list, default="2,4,8")
    ap.add_argument("--calls", type=int, default=20, help="calls per CUDA graph")
    args = ap.parse_args()
    for name in args.cases:
        run_case(name, [int(b) for b in args.blocks], [int(w) for w in args.warps], args)


if __name__ == "__main__":
    main()
