"""Greedy `model.generate` under backend="sonic" against eager: same tokens, throughput, compiles.

    python examples/hf_generate.py --model qwen3_moe --scale tiny                       # CPU
    python examples/hf_generate.py --model qwen3_moe --scale real --layers 4            # H100
    python examples/hf_generate.py --model qwen3_moe --scale real --layers 4 --cache static

`--cache dynamic` (transformers' default DynamicCache): the model's forward is compiled with
`backend="sonic"`; prefill goes through transformers' default grouped_mm experts and decoding
(batched_mm on the GPU) through the same fused op. `--cache static`: transformers' StaticCache, and
generate compiles the decoding step itself with `CompileConfig(backend="sonic")`, whose default mode
"reduce-overhead" replays it as a CUDA graph; eager runs the same cache with `disable_compile=True`.

Reported: whether the greedy tokens equal eager's (and the fraction that do), prefill and decode
tokens/s (medians of --iters timed runs), and how many graphs were compiled: it must not grow with
the number of generated tokens. The verdict in float32: the same tokens as eager. In bfloat16 the
kernels round differently from cuBLAS, and a random model's near-tied logits make greedy tokens
part ways after the first differing one, so the verdict there is teacher-forced instead: the
compiled forward and eager read eager's whole sequence, and the compiled logits must be as close
to a float32 copy of the model as eager's are (`moe_compiler.testing.closeness`, the tests' rule). Every timed run follows a warm-up of the same length: cuDNN's SDPA
builds a plan for each new KV length (about 4 ms per layer on an H200, eager and compiled alike), so
a first pass would time plan building rather than decoding.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings

import torch
from hf_train import REAL, build_model  # the same model builder as training

import moe_compiler
from moe_compiler.benchmarking import add_common_args, print_table, sync
from moe_compiler.testing import closeness


def timed_generate(model, prompt, new_tokens, device, repeats=1, **generate_kwargs):
    """(tokens, prefill seconds, decode seconds): medians over `repeats` runs; decode is a full
    generate's time less a prefill's."""
    prefills, decodes = [], []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        with torch.no_grad():
            model(prompt)  # prefill alone
        sync(device)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                 **generate_kwargs)
        sync(device)
        prefills.append(prefill)
        decodes.append(max(time.perf_counter() - start - prefill, 1e-9))
    return out, statistics.median(prefills), statistics.median(decodes)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(REAL), default="qwen3_moe")
    parser.add_argument("--scale", choices=("tiny", "real"), default="tiny")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=None, help="prompt length (default 512 real, 16 tiny)")
    parser.add_argument("--new-tokens", type=int, default=32)
    add_common_args(parser, iters=3, device=True, iters_aliases=("--repeats",),
                    iters_help="timed runs of each provider (after one warm-up run); medians reported")
    parser.add_argument("--sonic-compiler", default="inductor")
    parser.add_argument("--cache", choices=("dynamic", "static"), default="dynamic")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                        help="default bfloat16 on cuda, float32 on cpu")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message=".*lru_cache.*")
    real = args.scale == "real"
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device == "cuda" else "float32"))
    model = build_model(args.model, args.scale, args.layers, dtype, args.device, seed=0).eval()
    vocab = model.config.vocab_size
    prompt_len = args.prompt or (512 if real else 16)
    prompt = torch.randint(0, vocab, (args.batch, prompt_len), generator=torch.Generator().manual_seed(0)).to(args.device)

    eager_kwargs, sonic_kwargs = {}, {}
    sonic_options = {"sonic.compiler": args.sonic_compiler}
    if args.cache == "static":
        from transformers import CompileConfig

        eager_kwargs = dict(cache_implementation="static", disable_compile=True)
        # generate compiles the decoding step itself; "reduce-overhead" (CUDA graphs) is Inductor's, so a
        # debugging compiler gets no mode. On the CPU generate compiles only when told to.
        compile_config = (CompileConfig(backend="sonic") if args.sonic_compiler == "inductor"
                          else CompileConfig(backend="sonic", mode=None, options=sonic_options))
        compile_config._compile_all_devices = args.device != "cuda" or None
        sonic_kwargs = dict(cache_implementation="static", compile_config=compile_config)

    truth_model = copy.deepcopy(model).float() if dtype != torch.float32 else None  # before compiling
    run = lambda n, repeats=1, **kw: timed_generate(model, prompt, n, args.device, repeats, **kw)  # noqa: E731
    run(args.new_tokens, **eager_kwargs)  # warm-up: kernels, allocator, one SDPA plan per KV length
    eager_out, eager_prefill, eager_decode = run(args.new_tokens, args.iters, **eager_kwargs)

    if args.cache == "dynamic":
        model.forward = torch.compile(model.forward, backend="sonic", options=sonic_options)
    with moe_compiler.capture() as warm:
        run(4, **sonic_kwargs)  # compiles prefill, then decode until shapes go dynamic
        run(args.new_tokens, **sonic_kwargs)
    with moe_compiler.capture() as steady:
        sonic_out, sonic_prefill, sonic_decode = run(args.new_tokens, args.iters, **sonic_kwargs)
    with moe_compiler.capture() as longer:  # a static cache is sized by the length: a longer one is a new shape
        run(2 * args.new_tokens if args.cache == "dynamic" else args.new_tokens, **sonic_kwargs)

    same = torch.equal(sonic_out, eager_out)
    new_ids = lambda out: out[:, prompt_len:]  # noqa: E731
    agree = (new_ids(sonic_out) == new_ids(eager_out)).float().mean().item() if sonic_out.shape == eager_out.shape else 0.0
    new = args.batch * args.new_tokens
    prefill_tokens = args.batch * prompt_len
    print(f"{args.model} ({args.scale}, {args.layers} layers) {dtype} {args.device}, {args.cache} cache: "
          f"batch {args.batch}, prompt {prompt_len}, {args.new_tokens} new tokens")
    print(f"greedy tokens identical to eager: {same} ({agree:.1%} of positions equal)")
    print_table(["", "prefill tokens/s", "decode tokens/s"],
                [["eager", prefill_tokens / eager_prefill, new / eager_decode],
                 ["sonic", prefill_tokens / sonic_prefill, new / sonic_decode]],
                {"prefill tokens/s": ".0f", "decode tokens/s": ".1f"})
    print(f"decode speed vs eager: {eager_decode / sonic_decode:.2f}x")
    print(f"graphs compiled: warm-up {warm.graphs} ({len(warm.rewritten)} MoE regions rewritten), "
          f"then {steady.graphs} for {args.new_tokens} tokens, {longer.graphs} for "
          f"{(2 if args.cache == 'dynamic' else 1) * args.new_tokens} more")
    if truth_model is None:
        close = same
    else:
        forward = model.forward if args.cache == "dynamic" else torch.compile(model.forward, backend="sonic",
                                                                              options=sonic_options)
        with torch.no_grad():
            got = forward(input_ids=eager_out).logits.float()
            want = type(model).forward(model, input_ids=eager_out).logits.float()
            truth = truth_model(input_ids=eager_out).logits
        close, why = closeness(got, want, truth, dtype=dtype)
        print(f"teacher-forced logits over eager's tokens: {why}")
    ok = close and steady.graphs == 0 and longer.graphs == 0
    what = "tokens differ" if truth_model is None else "logits further from float32 than eager's"
    print("OK" if ok else f"FAILED: {what}, or compiles grow with the number of generated tokens")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
