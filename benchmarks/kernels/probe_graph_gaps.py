"""Where a provider's CUDA-graph step goes: its kernels' time against the step's span (GPU).

    python benchmarks/kernels/probe_graph_gaps.py --shape 7b-256 --providers ours-compiled,sonic
    python benchmarks/kernels/probe_graph_gaps.py --shape tiny --providers ours --replays 3   # smoke

The layer's fwd+bwd step (benchmarks/bench_layer.py's providers) is captured in a CUDA graph and
replayed --replays times back to back, the last one under torch.profiler. For it: the span from the first kernel's start to the
last one's end, the sum of kernel times, and every idle gap between two kernels of at least
--min-gap us with the kernels on either side. Question: the graph step is slower than the sum of
its kernels; how much of that is idle time between kernels, and where is it?
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

from moe_compiler.benchmarking import SHAPES, comma_list, graphed

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: bench_layer
from bench_layer import layer_inputs, provider_step  # noqa: E402  (its providers and inputs)


def probe(provider, shape, master, x, dy, replays, min_gap, verbose):
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    run = provider_step(provider, master, shape, x, dy)
    run.step()  # compile and tune outside the capture
    replay = graphed(run.step, run.zero)
    for _ in range(replays - 1):  # back to back before the profiled one, as a timed run replays them
        replay()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        replay()
        torch.cuda.synchronize()
    last = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)
    span = last[-1].time_range.end - last[0].time_range.start
    busy = sum(e.time_range.elapsed_us() for e in last)
    print(f"{provider}: {len(last)} kernels, span {span:.0f} us, kernels {busy:.0f} us, idle {span - busy:.0f} us",
          flush=True)
    for a, b in zip(last, last[1:]):
        gap = b.time_range.start - a.time_range.end
        if gap >= min_gap:
            print(f"  {gap:6.1f} us idle after {a.name[:60]} ({a.time_range.elapsed_us():.0f} us), "
                  f"before {b.name[:60]}", flush=True)
    if verbose:
        for e in last:
            print(f"    {e.time_range.start - last[0].time_range.start:8.1f} {e.time_range.elapsed_us():8.1f} us  {e.name[:90]}")
    small = sorted(b.time_range.start - a.time_range.end for a, b in zip(last, last[1:]))
    if small:
        print(f"  gaps: median {small[len(small) // 2]:.1f} us, smallest {small[0]:.1f}, largest {small[-1]:.1f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="7b-256", help=f"one of {sorted(SHAPES)}")
    ap.add_argument("--providers", type=comma_list, default="ours-compiled,sonic",
                    help="comma list of benchmarks/bench_layer.py's providers")
    ap.add_argument("--replays", type=int, default=20, help="replayed back to back, the last one profiled")
    ap.add_argument("--verbose", action="store_true", help="every kernel: start, us, name")
    ap.add_argument("--min-gap", type=float, default=3.0)
    args = ap.parse_args()
    shape = SHAPES[args.shape]
    master, x, dy = layer_inputs(shape)
    for provider in args.providers:
        try:
            probe(provider, shape, master, x, dy, args.replays, args.min_gap, args.verbose)
        except ImportError as exc:
            print(f"{provider}: skipped ({exc})")


if __name__ == "__main__":
    main()
