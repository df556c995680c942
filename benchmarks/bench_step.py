"""The step a training loop sees: host, GPU-busy and wall ms of a normally launched fwd+bwd step of
Hugging Face's Qwen3-MoE block, compiled with backend="sonic" (launch plans on and off) and with
Inductor, side by side in one process.

    python benchmarks/bench_step.py --shapes 7b-256,qwen3,olmoe --rounds 2
    python benchmarks/bench_step.py --shapes tiny --device cpu --iters 3   # smoke (CPU: wall only)
    python benchmarks/bench_step.py --shapes 4096x2048x768x128x8           # any (T, d, n, E, K)

The block is transformers' `Qwen3MoeSparseMoeBlock` at each shape (T, d, n, E, K), bf16 (fp32 on
the CPU), random weights, input [1, T, d]; a step drops the gradients, runs the block and
`out.backward(dy)`. Figures (`moe_compiler.benchmarking.step_times`): host ms (enqueueing one step
while the GPU is kept busy ahead), GPU-busy ms (the union of the step's kernel intervals, profiler)
and wall ms (CUDA events around each step), medians over --iters steps; TFLOPS = 18 T K d n over
each. Providers:
  sonic           torch.compile(block, backend="sonic"): each op call replays its launch plan
                  (`codegen.plans`) once its signature was recorded
  sonic-no-plans  the same, every op call running its implementation (`codegen.plans.ENABLED = False`)
  sonic-triton-launch  plans whose launches go through Triton's compiled launcher, not the kernels'
                  C launch with kept descriptor encodings (`codegen.plans.RAW_LAUNCH = False`)
  inductor        torch.compile(block) (Inductor, its default mode)
`--rounds R` measures the providers R times over, in turn; the table gives each one's medians and
wall / busy. `--paired-host` (CUDA) also times the host of raw launches against Triton's launcher on
one compiled block: both plan sets are recorded, then swapped in between blocks of 10 steps
enqueued behind a GPU sleep, 12 blocks each in alternating order (host differences between rounds
are larger than this one). Output: the table on stdout, results.json under --out.
"""
from __future__ import annotations

import argparse
import statistics

import torch

from moe_compiler.benchmarking import (
    add_common_args,
    command_line,
    print_table,
    resolve_shapes,
    shape_dims,
    step_times,
    write_json,
)

PROVIDERS = ("sonic", "sonic-no-plans", "sonic-triton-launch", "inductor")


def build_block(shape, device, dtype, seed=0):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    T, d, n, E, K = shape
    config = Qwen3MoeConfig(hidden_size=d, moe_intermediate_size=n, num_experts=E, num_experts_per_tok=K,
                            norm_topk_prob=True)
    config._experts_implementation = "grouped_mm"  # a model's default; a lone block has none set
    torch.manual_seed(seed)
    block = Qwen3MoeSparseMoeBlock(config)
    with torch.no_grad():  # the experts start empty in transformers 5: random weights of a trained scale
        for p in block.parameters():
            p.normal_(0.0, p.shape[-1] ** -0.5)
    return block.to(device=device, dtype=dtype)


def provider_step(name, block, x, dy):
    """(step, zero) of one provider on its own copy of x."""
    import moe_compiler  # noqa: F401  (registers backend="sonic")

    torch._dynamo.reset()
    compiled = torch.compile(block) if name == "inductor" else torch.compile(block, backend="sonic")
    xg = x.detach().clone().requires_grad_()
    leaves = [xg, *block.parameters()]

    def zero():
        for t in leaves:
            t.grad = None

    def step():
        compiled(xg).backward(dy)

    return step, zero


def measure(name, block, x, dy, iters) -> dict:
    from moe_compiler.codegen import plans

    plans.ENABLED = name != "sonic-no-plans"
    plans.RAW_LAUNCH = name != "sonic-triton-launch"
    plans.forget()
    try:
        step, zero = provider_step(name, block, x, dy)
        for _ in range(plans.RECORD_AT + 3):  # compile, tune, choose, record
            zero()
            step()
        times = step_times(step, zero, iters=iters, warmup=3, device=x.device)
        return dict(times._asdict(), plans=plans.stats())
    finally:
        plans.ENABLED = plans.RAW_LAUNCH = True
        plans.forget()


def paired_host(block, x, dy, blocks=12, steps=10) -> dict:
    """Host ms a step with plans replaying raw launches and Triton's launcher, alternated in one process."""
    import time

    from moe_compiler.codegen import plans

    step, zero = provider_step("sonic", block, x, dy)
    sets = {}
    try:
        for raw in (True, False):
            plans.RAW_LAUNCH = raw
            plans.forget()
            for _ in range(plans.RECORD_AT + 3):
                zero()
                step()
            torch.cuda.synchronize()
            sets[raw] = (dict(plans._PLANS), plans._GENERATION)
        host = {True: [], False: []}
        for b in range(blocks):
            for raw in ((True, False) if b % 2 == 0 else (False, True)):
                plans._PLANS.clear()
                plans._PLANS.update(sets[raw][0])
                plans._GENERATION = sets[raw][1]
                zero()
                step()
                torch.cuda.synchronize()
                torch.cuda._sleep(steps * 20_000_000)  # ~10 ms of GPU time a step: the GPU stays busy ahead
                start = time.perf_counter()
                for _ in range(steps):
                    zero()
                    step()
                host[raw].append((time.perf_counter() - start) / steps * 1e3)
                torch.cuda.synchronize()
    finally:
        plans.RAW_LAUNCH = True
        plans.forget()
    return dict(raw_host_ms=statistics.median(host[True]), triton_launch_host_ms=statistics.median(host[False]),
                median_pair_difference_ms=statistics.median(a - b for a, b in zip(host[True], host[False])))


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap, out="bench_step", iters=20, rounds=1, seed=0, device=True, shapes="7b-256",
                    providers=",".join(PROVIDERS), providers_help=f"comma list of {PROVIDERS}")
    ap.add_argument("--paired-host", action="store_true",
                    help="also time raw launches against Triton's launcher, plan sets swapped in one process")
    args = ap.parse_args(argv)
    for p in args.providers:
        if p not in PROVIDERS:
            ap.error(f"unknown provider {p}; choose from {PROVIDERS}")
    try:
        shapes = resolve_shapes(args.shapes)
    except ValueError as exc:
        ap.error(str(exc))
    command = command_line(argv, __file__)
    print("command:", command, flush=True)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch._dynamo.config.recompile_limit = 64
    rows, results = [], []
    for sname in shapes:
        T, d, n, E, K = shape = shape_dims(sname)
        block = build_block(shape, device, dtype, args.seed)
        g = torch.Generator(device=device).manual_seed(args.seed)
        x = torch.randn(1, T, d, generator=g, device=device, dtype=dtype)
        dy = torch.randn(1, T, d, generator=g, device=device, dtype=dtype)
        got = {p: [] for p in args.providers}
        for rnd in range(args.rounds):
            for p in args.providers:
                r = measure(p, block, x, dy, args.iters)
                r.update(shape=sname, provider=p, round=rnd)
                results.append(r)
                got[p].append(r)
                figures = "  ".join(f"{k[:-3]} {'-' if r[k] is None else format(r[k], '.3f')}"
                                    for k in ("host_ms", "busy_ms", "wall_ms"))
                print(f"{sname:>8} {p:>15} round {rnd}: {figures} ms  plans {r['plans']}", flush=True)
        if args.paired_host and device.type == "cuda":
            r = paired_host(block, x, dy)
            results.append(dict(r, shape=sname, provider="paired-host"))
            print(f"{sname:>8} paired host: raw launches {r['raw_host_ms']:.3f} ms, Triton's launcher "
                  f"{r['triton_launch_host_ms']:.3f} ms, median difference {r['median_pair_difference_ms']:.3f} ms",
                  flush=True)
        flop = 18 * T * K * d * n
        for p, rs in got.items():
            host, busy, wall = (_median([r[k] for r in rs]) for k in ("host_ms", "busy_ms", "wall_ms"))
            tflops = lambda ms: None if not ms else flop / ms * 1e-9  # noqa: E731
            rows.append([sname, p, host, busy, wall, tflops(busy), tflops(wall),
                         None if not busy else wall / busy])
    columns = ["shape", "provider", "host ms", "busy ms", "wall ms", "busy TFLOPS", "wall TFLOPS", "wall / busy"]
    print_table(columns, rows, {c: ".3f" for c in columns[2:5]} | {c: ".0f" for c in columns[5:7]}
                | {"wall / busy": ".2f"})
    path = write_json(f"{args.out}/results.json", dict(results=results, summary=[dict(zip(columns, r)) for r in rows]),
                      command=command, device=device)
    print("wrote", path)


if __name__ == "__main__":
    main()
