"""Does the GPU run a step slower when the steps come back to back? (GPU)

    python scripts/probe_clocks.py --shape 7b-256 --providers ours-compiled

The eager step's GPU busy time (`bench_layer.py --kernel-time`) came out 3-11% below the time of
the same step replayed from a CUDA graph (docs/NOTES.md). The kernels are the same, so the guess is
the clock: a gapless replay keeps the GPU at full power, while an eager step idles it between
host-bound launches.

The layer's fwd+bwd step is captured in a CUDA graph and replayed in phases that alternate:
`--replays` replays back to back (as `bench_layer.py --cuda-graph` times them), then as many with
an idle gap of `--gap-ms` before each (`torch.cuda._sleep` on the stream, outside the timed
events). CUDA events time each replay. nvidia-smi samples the SM clock, the power draw and the
clock-event reasons every 50 ms alongside. Per phase: the median replay, the first and last tenth's
medians, and the median SM clock and power of the samples taken in it.
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

from bench_layer import SHAPES, graphed, layer_inputs, provider_step  # noqa: E402

_FIELDS = "timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active"


def start_sampler(path):
    """nvidia-smi writing a CSV line every 50 ms to `path`, or None where it cannot."""
    for fields in (_FIELDS, _FIELDS.replace("clocks_event_reasons", "clocks_throttle_reasons")):
        out = open(path, "w")
        proc = subprocess.Popen(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits", "-lms", "50"],
                                stdout=out, stderr=subprocess.STDOUT)
        time.sleep(0.5)
        if proc.poll() is None:
            return proc
        out.close()
    print("no nvidia-smi sampling here", flush=True)
    return None


def samples_between(path, t0, t1):
    """[(sm MHz, watts, reasons)] of the sampler's lines stamped in [t0, t1] (epoch seconds)."""
    rows = []
    for line in open(path):
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 5:
            continue
        try:
            stamp = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            rows.append((stamp, float(parts[1]), float(parts[2]), parts[4]))
        except ValueError:
            continue
    return [r[1:] for r in rows if t0 <= r[0] <= t1]


def timed_phase(replay, n, gap_cycles):
    """Per-replay ms of `n` replays, each after an idle gap of `gap_cycles` GPU cycles (0: none)."""
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for s, e in zip(starts, ends):
        if gap_cycles:
            torch.cuda._sleep(gap_cycles)
        s.record()
        replay()
        e.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="7b-256")
    ap.add_argument("--providers", default="ours-compiled")
    ap.add_argument("--replays", type=int, default=400, help="replays a phase")
    ap.add_argument("--rounds", type=int, default=3, help="pairs of phases (back to back, with gaps)")
    ap.add_argument("--gap-ms", type=float, default=3.0, help="idle time before each replay of a gap phase")
    args = ap.parse_args()
    T, d, n, E, K = shape = SHAPES[args.shape]
    master, x, dy = layer_inputs(shape)
    # cycles a ms: the device's clock in kHz, or the H100's boost clock where torch does not say
    clock_khz = getattr(torch.cuda.get_device_properties(0), "clock_rate", 1.98e6)
    gap_cycles = int(args.gap_ms * clock_khz)
    log = os.path.join(tempfile.mkdtemp(), "smi.csv")
    sampler = start_sampler(log)
    flop = 18 * T * K * d * n
    try:
        for provider in args.providers.split(","):
            run = provider_step(provider, master, shape, x, dy)
            run.step()  # compile and tune outside the capture
            replay = graphed(run.step, run.zero)
            timed_phase(replay, 20, 0)
            for r in range(args.rounds):
                for name, cycles in (("back to back", 0), (f"{args.gap_ms:g} ms gaps", gap_cycles)):
                    t0 = time.time()
                    ms = timed_phase(replay, args.replays, cycles)
                    t1 = time.time()
                    tenth = max(1, len(ms) // 10)
                    med = statistics.median(ms)
                    line = (f"{provider} {args.shape} round {r} {name:>12}: median {med:.3f} ms "
                            f"({flop / med * 1e-9:.1f} TFLOPS), first tenth {statistics.median(ms[:tenth]):.3f}, "
                            f"last tenth {statistics.median(ms[-tenth:]):.3f}")
                    got = samples_between(log, t0, t1) if sampler else []
                    if got:
                        line += (f"; SM clock median {statistics.median(g[0] for g in got):.0f} MHz "
                                 f"(min {min(g[0] for g in got):.0f}), power median "
                                 f"{statistics.median(g[1] for g in got):.0f} W, reasons {sorted({g[2] for g in got})}")
                    print(line, flush=True)
            del replay, run
            torch.cuda.empty_cache()
    finally:
        if sampler:
            sampler.terminate()


if __name__ == "__main__":
    main()
