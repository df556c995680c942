"""Decode steps of an HF MoE model (DynamicCache, no CUDA graphs): eager, Inductor and sonic side by side.

    PYTHONPATH=. python benchmarks/bench_decode.py --model qwen3_moe --layers 4 --batch 4
    PYTHONPATH=. python benchmarks/bench_decode.py --op-only --batch 1,4,16 --profile   # the op alone

A decode step runs a few tokens through every layer; its MoE layer is bound by the host enqueueing
launches, not by the GPU. Part 1 times the `sonic::moe_experts` forward alone (no grad) at the
model's layer sizes, through its default overload and its `nograd` one (codegen/nograd.py): host us
a call (the median call enqueued behind a GPU sleep, so the host never waits) and GPU us a call
(CUDA events around a batch of calls), with `--profile` the top functions by own time. Part 2 times whole decode steps: each provider's `model.forward` (compiled where it is
one) is run over the same prompt and the same `--steps` new positions, once to warm up (compiles,
cuDNN's plan per KV length) and `--rounds` times timed, step by step; the median step is reported,
and the tokens each provider picks are compared with the first provider's.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))

from bench_route import host_us  # noqa: E402  (the host timing loop, with a GPU sleep ahead)
from hf_train import REAL, build_model  # noqa: E402

from moe_compiler.codegen import nograd, triton_moe  # noqa: E402

_PATHS = {  # the op's forward path: (DECODE_MAX_SLOTS, DECODE_SLOTS_PER_EXPERT)
    "decode": (10**6, float("inf")),  # the two-launch decode path at every token count
    "grouped": (0, 0.0),  # the grouped kernels at every token count
    "auto": (triton_moe.DECODE_MAX_SLOTS, triton_moe.DECODE_SLOTS_PER_EXPERT),  # what the op picks
}


def use_path(path: str) -> None:
    triton_moe.DECODE_MAX_SLOTS, triton_moe.DECODE_SLOTS_PER_EXPERT = _PATHS[path]


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


def op_host_and_gpu(model_name: str, batches: list[int], calls: int, profile: bool) -> None:
    d, n, E, K = _sizes(model_name)
    op_args = _op_args(model_name, seed=0)
    print(f"## the op alone: {model_name} layer sizes d={d} n={n} E={E} K={K}, bf16, no grad, "
          f"{torch.cuda.get_device_name()}")
    print("| tokens | slots | path | overload | host us / call | GPU us / call |")
    print("|---|---|---|---|---|---|")
    rows = (("grouped", "nograd"), ("decode", "default"), ("decode", "nograd"))
    for T, (path, overload) in ((T, row) for T in batches for row in rows):
        use_path(path)
        if path == "decode" and not triton_moe.decode_path(T * K, E, False, None):
            print(f"| {T} | {T * K} | decode: past its slot limit | {overload} | - | - |")
            continue
        op, args = getattr(torch.ops.sonic.moe_experts, overload), op_args(T)

        def call():
            return op(*args)

        with torch.no_grad():
            # a GPU sleep ahead of the calls, well past them: the host never waits on the GPU
            host = host_us(call, calls, ahead_cycles=int(2e9))
            gpu = []
            for _ in range(5):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda._sleep(int(2e9))
                s.record()
                for _ in range(calls):
                    call()
                e.record()
                torch.cuda.synchronize()
                gpu.append(s.elapsed_time(e) * 1e3 / calls)
            print(f"| {T} | {T * K} | {path} | {overload} | {host:.1f} | {statistics.median(gpu):.1f} |",
                  flush=True)
            if profile and path == "decode" and overload == "nograd":
                prof = cProfile.Profile()
                torch.cuda._sleep(int(2e9))
                prof.enable()
                for _ in range(calls):
                    call()
                prof.disable()
                torch.cuda.synchronize()
                buf = io.StringIO()
                pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
                print("```\n" + buf.getvalue()[-6000:] + "\n```", flush=True)


def overload_pairs(model_name: str, batches: list[int], calls: int) -> None:
    """Host us of the op's default and `nograd` overloads, called alternately (one of each per pair,
    behind a GPU sleep), so that the lent hosts' drift between rows does not enter the difference."""
    op_args = _op_args(model_name, seed=1)
    print(f"\n## the overloads called alternately: {calls} pairs, host us a call (auto path)")
    print("| tokens | default | nograd | median of (default - nograd) a pair |")
    print("|---|---|---|---|")
    use_path("auto")
    for T in batches:
        args = op_args(T)
        ops = (torch.ops.sonic.moe_experts.default, torch.ops.sonic.moe_experts.nograd)
        with torch.no_grad():
            for _ in range(20):
                for op in ops:
                    op(*args)
            torch.cuda.synchronize()
            torch.cuda._sleep(int(4e9))
            times = ([], [])
            for _ in range(calls):
                for i, op in enumerate(ops):
                    t0 = time.perf_counter()
                    op(*args)
                    times[i].append((time.perf_counter() - t0) * 1e6)
            torch.cuda.synchronize()
        diff = statistics.median(a - b for a, b in zip(*times))
        print(f"| {T} | {statistics.median(times[0]):.1f} | {statistics.median(times[1]):.1f} | {diff:.1f} |",
              flush=True)


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


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(REAL), default="qwen3_moe")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", default="4", help="decode batch (comma list for --op-only)")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--providers", default="eager,inductor,sonic,sonic-grouped",
                    help="sonic-grouped: sonic with the decode path off (SONIC_MOE_DECODE_MAX_SLOTS=0); "
                         "sonic-unfused: sonic with sonic.fuse_router False; sonic-default: sonic with every op "
                         "call the default overload (codegen.nograd.USE_NOGRAD False)")
    ap.add_argument("--op-only", action="store_true")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    op_host_and_gpu(args.model, batches, args.calls, args.profile)
    overload_pairs(args.model, batches, 4 * args.calls)
    use_path("auto")
    if args.op_only:
        return
    model = build_model(args.model, "real", args.layers, torch.bfloat16, "cuda", seed=0).eval()
    model.config.use_cache = True
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (batches[0], args.prompt), generator=g).cuda()
    print(f"\n## decode steps: {args.model}, {args.layers} layers, batch {batches[0]}, prompt {args.prompt}, "
          f"{args.steps} steps, DynamicCache, no CUDA graphs")
    providers = args.providers.split(",")
    print(f"| provider | median ms / step | min | first-run s | tokens equal to {providers[0]}'s |")
    print("|---|---|---|---|---|")
    first_tokens = None
    for provider in providers:
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
        agree = (tokens == first_tokens).float().mean().item()
        print(f"| {provider} | {statistics.median(times):.3f} | {min(times):.3f} | {first:.1f} | {agree:.1%} |",
              flush=True)


if __name__ == "__main__":
    main()
