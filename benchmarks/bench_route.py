"""Routing metadata alone: the torch sort path against the three piece kernels (`triton_moe.route`).

    PYTHONPATH=. python benchmarks/bench_route.py      # GPU, seconds
    PYTHONPATH=. python benchmarks/bench_route.py --chunks 256,512,1024,2048 --cases paper

Per (E, TK): host time per call (median of 50, no sync in between) and GPU time per call (ten
calls replayed from a CUDA graph), for each path; both paths are checked against the reference.
`--chunks`: instead, the piece kernels' GPU time at each CHUNK (slots a piece; `_route_chunk`
picks one), beside the one `_route_chunk` picks. `--cases paper`: the (E, TK = T K) of the paper's
twelve shapes and the two models' (benchmarks/bench_layer.py's SHAPES). `--small`: the one-program
kernel (two tile lengths) against the piece kernels at small TK (`triton_moe._small_route_block`).
"""
import argparse
import os
import statistics
import sys
import time

import torch

from moe_compiler.codegen import triton_moe as tm
from moe_compiler.codegen.reference import torch_route

CASES = [(128, 196608), (64, 131072), (256, 65536), (128, 32768)]


def host_us(fn, calls=50, ahead_cycles=0):
    """Median host us of `fn` over `calls` calls after 20 warm-ups. `ahead_cycles` > 0: a GPU sleep
    of that many cycles is enqueued first, so the host never waits on the GPU while timed."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    if ahead_cycles:
        torch.cuda._sleep(ahead_cycles)
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def gpu_us(fn, calls=10):
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def chunk_sweep(cases, chunks):
    """GPU us per call of the piece kernels at each CHUNK, each result checked against the reference."""
    picked = tm._route_chunk
    try:
        for E, TK in cases:
            ids = torch.randint(0, E, (TK, 1), device="cuda")
            ref = torch_route(ids, E)
            buckets = tm.route_buckets(E)
            row = []
            for chunk in chunks:
                tm._route_chunk = lambda *_, c=chunk: c
                assert all(torch.equal(a, b) for a, b in zip(tm.route(ids, E), ref)), (E, TK, chunk)
                row.append(f"{chunk} {gpu_us(lambda: tm.route(ids, E)):.1f}")
            print(f"E={E} TK={TK} (picked {picked(TK, buckets)}): GPU us/call by chunk: {', '.join(row)}", flush=True)
    finally:
        tm._route_chunk = picked


def small_sweep():
    """Host and GPU us per call of the one-program kernel (BLOCK 8192 // buckets up to 1024, and up to
    64) and of the piece kernels at small TK, each forced, each checked against the reference; and
    the path `route` takes."""
    chosen = tm._small_route_block
    forced = {"one program, BLOCK <= 1024": lambda TK, b, dev: max(16, min(1024, 8192 // b)),
              "one program, BLOCK <= 64": lambda TK, b, dev: max(16, min(64, 8192 // b)),
              "pieces": lambda TK, b, dev: None}
    try:
        for E in (8, 16, 64, 128, 256):
            for TK in (4, 32, 64, 256, 2048, 16384):
                buckets = tm.route_buckets(E)
                if TK * buckets > tm._SMALL_ROUTE_WORK:
                    continue
                ids = torch.randint(0, E, (TK, 1), device="cuda")
                ref = torch_route(ids, E)
                res = {}
                for name, rule in forced.items():
                    tm._small_route_block = rule
                    assert all(torch.equal(a, b) for a, b in zip(tm.route(ids, E), ref)), (name, E, TK)
                    call = lambda: tm.route(ids, E)  # noqa: E731
                    res[name] = f"host {host_us(call):.0f} GPU {gpu_us(call):.1f}"
                path = "one program" if chosen(TK, buckets, ids.device) else "pieces"
                print(f"E={E} TK={TK} (route: {path}): us/call " + "; ".join(f"{k} {v}" for k, v in res.items()),
                      flush=True)
    finally:
        tm._small_route_block = chosen


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", default="", help="comma list of CHUNK sizes (powers of two, 256-4096)")
    ap.add_argument("--cases", default="default", choices=["default", "paper"])
    ap.add_argument("--small", action="store_true")
    args = ap.parse_args()
    if args.small:
        small_sweep()
        return
    cases = CASES
    if args.cases == "paper":
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from bench_layer import SHAPES

        cases = sorted({(E, T * K) for T, d, n, E, K in SHAPES.values()})
    if args.chunks:
        chunk_sweep(cases, [int(c) for c in args.chunks.split(",")])
        return
    saved = tm._PIECES_MAX_BUCKETS
    try:
        for E, TK in cases:
            ids = torch.randint(0, E, (TK, 1), device="cuda")
            ref = torch_route(ids, E)
            res = {}
            for name, cap in (("sort", 0), ("pieces", saved)):
                tm._PIECES_MAX_BUCKETS = cap
                got = tm.route(ids, E)
                assert all(torch.equal(a, b) for a, b in zip(got, ref)), (name, E, TK)
                res[name] = (host_us(lambda: tm.route(ids, E)), gpu_us(lambda: tm.route(ids, E)))
            print(f"E={E} TK={TK}: host us/call sort {res['sort'][0]:.0f} pieces {res['pieces'][0]:.0f}; "
                  f"GPU us/call sort {res['sort'][1]:.1f} pieces {res['pieces'][1]:.1f}", flush=True)
    finally:
        tm._PIECES_MAX_BUCKETS = saved


if __name__ == "__main__":
    main()
