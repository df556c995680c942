"""Routing metadata alone: the torch sort path against the three piece kernels (`codegen.routing.route`).

    python benchmarks/kernels/bench_route.py      # GPU, seconds
    python benchmarks/kernels/bench_route.py --chunks 256,512,1024,2048 --cases paper

Per (E, TK): host time per call (`benchmarking.host_ms`: each call enqueued behind a GPU sleep,
median of --iters) and GPU time per call (`benchmarking.graph_ms`: ten calls replayed from a CUDA
graph), for each path; both paths are checked against the reference. `--chunks`: instead, the
piece kernels' GPU time at each CHUNK (slots a piece; `_route_chunk` picks one), beside the one
`_route_chunk` picks. `--cases paper`: the (E, TK = T K) of `moe_compiler.benchmarking.SHAPES` (the
paper's twelve shapes and real models' layers). `--small`: the one-program kernel (two tile
lengths) against the piece kernels at small TK (`codegen.routing._small_route_block`).
"""
import argparse

import torch

from moe_compiler.benchmarking import SHAPES, add_common_args, comma_list, graph_ms, host_ms
from moe_compiler.codegen.reference import torch_route

CASES = [(128, 196608), (64, 131072), (256, 65536), (128, 32768)]


def host_us(fn, args) -> float:
    return host_ms(fn, iters=args.iters, warmup=args.warmup) * 1e3


def gpu_us(fn, args) -> float:
    return graph_ms(fn, iters=args.iters, warmup=args.warmup, calls=10) * 1e3


def chunk_sweep(cases, chunks, args):
    """GPU us per call of the piece kernels at each CHUNK, each result checked against the reference."""
    from moe_compiler import codegen

    picked = codegen.routing._route_chunk
    try:
        for E, TK in cases:
            ids = torch.randint(0, E, (TK, 1), device="cuda")
            ref = torch_route(ids, E)
            buckets = codegen.routing.route_buckets(E)
            row = []
            for chunk in chunks:
                codegen.routing._route_chunk = lambda *_, c=chunk: c
                assert all(torch.equal(a, b) for a, b in zip(codegen.routing.route(ids, E), ref)), (E, TK, chunk)
                row.append(f"{chunk} {gpu_us(lambda: codegen.routing.route(ids, E), args):.1f}")
            print(f"E={E} TK={TK} (picked {picked(TK, buckets)}): GPU us/call by chunk: {', '.join(row)}", flush=True)
    finally:
        codegen.routing._route_chunk = picked


def small_sweep(args):
    """Host and GPU us per call of the one-program kernel (BLOCK 8192 // buckets up to 1024, and up to
    64) and of the piece kernels at small TK, each forced, each checked against the reference; and
    the path `route` takes."""
    from moe_compiler import codegen

    chosen = codegen.routing._small_route_block
    forced = {"one program, BLOCK <= 1024": lambda TK, b, dev: max(16, min(1024, 8192 // b)),
              "one program, BLOCK <= 64": lambda TK, b, dev: max(16, min(64, 8192 // b)),
              "pieces": lambda TK, b, dev: None}
    try:
        for E in (8, 16, 64, 128, 256):
            for TK in (4, 32, 64, 256, 2048, 16384):
                buckets = codegen.routing.route_buckets(E)
                if TK * buckets > codegen.routing._SMALL_ROUTE_WORK:
                    continue
                ids = torch.randint(0, E, (TK, 1), device="cuda")
                ref = torch_route(ids, E)
                res = {}
                for name, rule in forced.items():
                    codegen.routing._small_route_block = rule
                    assert all(torch.equal(a, b) for a, b in zip(codegen.routing.route(ids, E), ref)), (name, E, TK)
                    call = lambda: codegen.routing.route(ids, E)  # noqa: E731
                    res[name] = f"host {host_us(call, args):.0f} GPU {gpu_us(call, args):.1f}"
                path = "one program" if chosen(TK, buckets, ids.device) else "pieces"
                print(f"E={E} TK={TK} (route: {path}): us/call " + "; ".join(f"{k} {v}" for k, v in res.items()),
                      flush=True)
    finally:
        codegen.routing._small_route_block = chosen


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap, warmup=20, iters=50)
    ap.add_argument("--chunks", type=comma_list, default="", help="comma list of CHUNK sizes (powers of two, 256-4096)")
    ap.add_argument("--cases", default="default", choices=["default", "paper"])
    ap.add_argument("--small", action="store_true")
    args = ap.parse_args()
    if args.small:
        small_sweep(args)
        return
    cases = CASES
    if args.cases == "paper":
        cases = sorted({(E, T * K) for T, d, n, E, K in SHAPES.values()})
    if args.chunks:
        chunk_sweep(cases, [int(c) for c in args.chunks], args)
        return
    from moe_compiler import codegen

    saved = codegen.routing._PIECES_MAX_BUCKETS
    try:
        for E, TK in cases:
            ids = torch.randint(0, E, (TK, 1), device="cuda")
            ref = torch_route(ids, E)
            res = {}
            for name, cap in (("sort", 0), ("pieces", saved)):
                codegen.routing._PIECES_MAX_BUCKETS = cap
                got = codegen.routing.route(ids, E)
                assert all(torch.equal(a, b) for a, b in zip(got, ref)), (name, E, TK)
                res[name] = (host_us(lambda: codegen.routing.route(ids, E), args), gpu_us(lambda: codegen.routing.route(ids, E), args))
            print(f"E={E} TK={TK}: host us/call sort {res['sort'][0]:.0f} pieces {res['pieces'][0]:.0f}; "
                  f"GPU us/call sort {res['sort'][1]:.1f} pieces {res['pieces'][1]:.1f}", flush=True)
    finally:
        codegen.routing._PIECES_MAX_BUCKETS = saved


if __name__ == "__main__":
    main()
