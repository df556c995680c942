"""Decode steps of an HF MoE model (DynamicCache, no CUDA graphs): eager, Inductor and sonic side by side.

    python benchmarks/bench_decode.py --model qwen3_moe --layers 4 --batch 4
    python benchmarks/bench_decode.py --op-only --batch 1,4,16 --profile   # the op alone
    python benchmarks/bench_decode.py --op-only --batch 1 --iters 10       # smoke test

A decode step runs a few tokens through every layer; its MoE layer is bound by the host enqueueing
launches, not by the GPU. Part 1 times the `sonic::moe_experts` forward alone (no grad) at the
model's layer sizes, through its default overload and its `nograd` one (codegen/nograd.py): host us
a call (`benchmarking.host_ms`: each call enqueued behind a GPU sleep, so the host never waits) and
GPU us a call (CUDA events around --iters calls queued behind a GPU sleep), with `--profile` the top
functions by own time. Part 2 calls the two overloads alternately (one of each per pair, behind one
GPU sleep), so that the host's drift between rows does not enter their difference. Part 3 times
whole decode steps: each provider's `model.forward` (compiled where it is one) is run over the same
prompt and the same `--steps` new positions, once to warm up (compiles, cuDNN's plan per KV length)
and `--rounds` times timed, step by step; the median step is reported, and the tokens each provider
picks are compared with the first provider's. Output: the tables and decode.json under --out.
"""
from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))

from hf_train import REAL, build_model  # noqa: E402  (the examples' model builder and real sizes)

from moe_compiler.benchmarking import (  # noqa: E402
    add_common_args,
    command_line,
    comma_list,
    host_ms,
    host_profile,
    print_table,
    write_json,
)

SLEEP_CYCLES = int(2e9)  # about one second of GPU sleep ahead of a batch of calls


@functools.cache
def _auto_path() -> tuple:
    """The op's own (DECODE_MAX_SLOTS, DECODE_SLOTS_PER_EXPERT), read before `use_path` changes them."""
    from moe_compiler import codegen

    return codegen.decode.DECODE_MAX_SLOTS, codegen.decode.DECODE_SLOTS_PER_EXPERT


def use_path(path: str) -> None:
    """The op's forward path: "decode" (the two-launch decode path at every token count), "grouped"
    (the grouped kernels at every token count) or "auto" (what the op picks)."""
    from moe_compiler import codegen

    paths = {"decode": (10**6, float("inf")), "grouped": (0, 0.0), "auto": _auto_path()}
    codegen.decode.DECODE_MAX_SLOTS, codegen.decode.DECODE_SLOTS_PER_EXPERT = paths[path]


def _sizes(model_name: str) -> tuple[int, int, int, int]:
    cfg = REAL[model_name]
    n = cfg.get("moe_intermediate_size", cfg.get("intermediate_size"))
    E = cfg.get("num_experts", cfg.get("num_local_experts", cfg.get("n_routed_experts")))
    return cfg["hidden_size"], n, E, cfg["num_experts_per_tok"]


def _op_args(model_name: str, seed: int):
    """`args(T)`: `sonic::moe_experts` arguments (no grad, bf16, CUDA) at the model's layer sizes, over
    one set of random weights, with T new random tokens and their softmax top-k routing each call."""
    d, n, E, K = _sizes(model_name)
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(seed)
    w1 = torch.randn(E, 2 * n, d, device=dev, generator=g).mul_(d**-0.5).to(dt)
    w2 = torch.randn(E, d, n, device=dev, generator=g).mul_(n**-0.5).to(dt)

    def args(T: int) -> tuple:
        x = torch.randn(T, d, device=dev, generator=g).to(dt)
        w, ids = torch.randn(T, E, device=dev, generator=g).softmax(-1).topk(K, dim=-1)
        return (x, ids, w.to(dt), w1, w2, None, None, "swiglu", False, False, 1.702, 7.0, False)

    return args


def queued_gpu_us(call, calls: int, rounds: int = 5) -> float:
    """GPU us a call: CUDA events around `calls` calls queued behind a GPU sleep (the GPU never
    waits for the host between them), median of `rounds`."""
    gpu = []
    for _ in range(rounds):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(SLEEP_CYCLES)
        s.record()
        for _ in range(calls):
            call()
        e.record()
        torch.cuda.synchronize()
        gpu.append(s.elapsed_time(e) * 1e3 / calls)
    return statistics.median(gpu)


def op_host_and_gpu(model_name: str, batches: list[int], calls: int, profile: bool) -> list[dict]:
    from moe_compiler import codegen

    d, n, E, K = _sizes(model_name)
    op_args = _op_args(model_name, seed=0)
    print(f"## the op alone: {model_name} layer sizes d={d} n={n} E={E} K={K}, bf16, no grad, "
          f"{torch.cuda.get_device_name()}", flush=True)
    rows = []
    for T, (path, overload) in ((T, row) for T in batches
                                for row in (("grouped", "nograd"), ("decode", "default"), ("decode", "nograd"))):
        use_path(path)
        row = dict(tokens=T, slots=T * K, path=path, overload=overload, host_us=None, gpu_us=None)
        rows.append(row)
        if path == "decode" and not codegen.decode.decode_path(T * K, E, False, None):
            row["path"] = "decode: past its slot limit"
            continue
        op, args = getattr(torch.ops.sonic.moe_experts, overload), op_args(T)

        def call():
            return op(*args)

        with torch.no_grad():
            row["host_us"] = host_ms(call, iters=calls, warmup=20) * 1e3
            row["gpu_us"] = queued_gpu_us(call, calls)
            print(f"  {T} tokens, {path}, {overload}: host {row['host_us']:.1f} us, GPU {row['gpu_us']:.1f} us",
                  flush=True)
            if profile and path == "decode" and overload == "nograd":
                print("```\n" + host_profile(call, iters=calls, rows=25)[-6000:] + "\n```", flush=True)
    print_table(["tokens", "slots", "path", "overload", "host us / call", "GPU us / call"],
                [list(r.values()) for r in rows], {"host us / call": ".1f", "GPU us / call": ".1f"})
    return rows


def overload_pairs(model_name: str, batches: list[int], calls: int) -> list[dict]:
    """Host us of the op's default and `nograd` overloads, called alternately (one of each per pair,
    behind one GPU sleep), so that the host's drift between rows does not enter the difference."""
    op_args = _op_args(model_name, seed=1)
    use_path("auto")
    rows = []
    for T in batches:
        args = op_args(T)
        ops = (torch.ops.sonic.moe_experts.default, torch.ops.sonic.moe_experts.nograd)
        with torch.no_grad():
            for _ in range(20):
                for op in ops:
                    op(*args)
            torch.cuda.synchronize()
            torch.cuda._sleep(2 * SLEEP_CYCLES)
            times = ([], [])
            for _ in range(calls):
                for i, op in enumerate(ops):
                    t0 = time.perf_counter()
                    op(*args)
                    times[i].append((time.perf_counter() - t0) * 1e6)
            torch.cuda.synchronize()
        rows.append(dict(tokens=T, default_us=statistics.median(times[0]), nograd_us=statistics.median(times[1]),
                         pair_diff_us=statistics.median(a - b for a, b in zip(*times))))
    print_table(["tokens", "default", "nograd", "median of (default - nograd) a pair"],
                [list(r.values()) for r in rows],
                {"default": ".1f", "nograd": ".1f", "median of (default - nograd) a pair": ".1f"},
                title=f"## the overloads called alternately: {calls} pairs, host us a call (auto path)")
    return rows


def decode_steps(model, fwd, prompt, steps: int) -> tuple[list[float], torch.Tensor]:
    """Prefill `prompt`, then `steps` greedy decode steps through `fwd`; (ms per step, tokens)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        out = fwd(input_ids=prompt, past_key_values=cache, use_cache=True)
        tok = out.logits[:, -1:].argmax(-1)
        times, picked = [], [tok]
        for _ in range(steps):
            torch.cuda.synchronize()
            start = time.perf_counter()
            out = fwd(input_ids=tok, past_key_values=cache, use_cache=True)
            tok = out.logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
            picked.append(tok)
    return times, torch.cat(picked, 1)


def model_decode(args, batch: int) -> list[dict]:
    from moe_compiler.codegen import nograd

    model = build_model(args.model, "real", args.layers, torch.bfloat16, "cuda", seed=0).eval()
    model.config.use_cache = True
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (batch, args.prompt), generator=g).cuda()
    rows, first_tokens = [], None
    for provider in args.providers:
        torch._dynamo.reset()
        use_path("grouped" if provider == "sonic-grouped" else "auto")
        nograd.USE_NOGRAD = provider != "sonic-default"
        if provider == "eager":
            fwd = model.forward
        elif provider == "inductor":
            fwd = torch.compile(model.forward)
        else:  # sonic-unfused: the router kept as the model writes it (sonic.fuse_router False)
            fwd = torch.compile(model.forward, backend="sonic",
                                options={"sonic.fuse_router": provider != "sonic-unfused"})
        start = time.perf_counter()
        decode_steps(model, fwd, prompt, args.steps)  # warm-up: compiles, one SDPA plan per KV length
        first = time.perf_counter() - start
        times = []
        for _ in range(args.rounds):
            t, tokens = decode_steps(model, fwd, prompt, args.steps)
            times += t
        if first_tokens is None:
            first_tokens = tokens
        rows.append(dict(provider=provider, median_ms=statistics.median(times), min_ms=min(times), first_run_s=first,
                         tokens_equal=(tokens == first_tokens).float().mean().item()))
        print(f"  {provider}: {rows[-1]['median_ms']:.3f} ms a step", flush=True)
    nograd.USE_NOGRAD = True
    use_path("auto")
    print_table(["provider", "median ms / step", "min", "first-run s", f"tokens equal to {args.providers[0]}'s"],
                [[r["provider"], r["median_ms"], r["min_ms"], r["first_run_s"], f"{r['tokens_equal']:.1%}"]
                 for r in rows], {"median ms / step": ".3f", "min": ".3f", "first-run s": ".1f"},
                title=f"## decode steps: {args.model}, {args.layers} layers, batch {batch}, prompt {args.prompt}, "
                      f"{args.steps} steps, DynamicCache, no CUDA graphs")
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap, out="bench_decode", iters=100, rounds=3, iters_aliases=("--calls",),
                    providers="eager,inductor,sonic,sonic-grouped",
                    iters_help="op calls per figure (the pairs of part 2: four times as many)",
                    providers_help="sonic-grouped: sonic with the decode path off; sonic-unfused: sonic with "
                                   "sonic.fuse_router False; sonic-default: sonic with every op call the default "
                                   "overload (codegen.nograd.USE_NOGRAD False)")
    ap.add_argument("--model", choices=sorted(REAL), default="qwen3_moe")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=comma_list, default="4", help="decode batch (comma list for --op-only)")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=32, help="decode steps a round")
    ap.add_argument("--op-only", action="store_true")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args(argv)
    command = command_line(argv, __file__)
    print("command:", command, flush=True)
    batches = [int(b) for b in args.batch]
    results = dict(op=op_host_and_gpu(args.model, batches, args.iters, args.profile),
                   pairs=overload_pairs(args.model, batches, 4 * args.iters))
    use_path("auto")
    if not args.op_only:
        results["decode"] = model_decode(args, batches[0])
    path = write_json(os.path.join(args.out, "decode.json"), dict(model=args.model, **results), command=command)
    print(f"\nwrote {path}")
    return results


if __name__ == "__main__":
    main()
