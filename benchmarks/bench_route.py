"""Routing metadata alone: the torch sort path against the three piece kernels (`triton_moe.route`).

    PYTHONPATH=. python benchmarks/bench_route.py      # GPU, seconds

Per (E, TK): host time per call (median of 50, no sync in between) and GPU time per call (ten
calls replayed from a CUDA graph), for each path; both paths are checked against the reference.
"""
import statistics
import time

import torch

from codegen import triton_moe as tm
from codegen.reference import torch_route

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


def main():
    saved = tm._PIECES_MAX_BUCKETS
    try:
        for E, TK in CASES:
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
