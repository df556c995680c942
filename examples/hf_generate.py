"""Greedy `model.generate` under backend="sonic" against eager: same tokens, throughput, compiles.

    python examples/hf_generate.py --model qwen3_moe --scale tiny            # CPU
    python examples/hf_generate.py --model qwen3_moe --scale real --layers 4 # H100

The model's forward is compiled with `backend="sonic"`; prefill goes through transformers' default
grouped_mm experts and decoding (batched_mm on the GPU) through the same fused op. Reported: whether
the greedy tokens equal eager's, prefill tokens/s, decode tokens/s, and how many graphs were
compiled: it must not grow with the number of generated tokens.
"""
from __future__ import annotations

import argparse
import sys
import time
import warnings

import torch

import moe_compiler

sys.path.insert(0, __import__("os").path.dirname(__file__))
from hf_train import REAL, build_model, sync  # noqa: E402  (same model builder as training)


def timed_generate(model, prompt, new_tokens, device):
    sync(device)
    start = time.perf_counter()
    with torch.no_grad():
        model(prompt)  # prefill alone
    sync(device)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    out = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    sync(device)
    total = time.perf_counter() - start
    return out, prefill, max(total - prefill, 1e-9)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(REAL), default="qwen3_moe")
    parser.add_argument("--scale", choices=("tiny", "real"), default="tiny")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=None, help="prompt length (default 512 real, 16 tiny)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--sonic-compiler", default="inductor")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message=".*lru_cache.*")
    real = args.scale == "real"
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = build_model(args.model, args.scale, args.layers, dtype, args.device, seed=0).eval()
    vocab = model.config.vocab_size
    prompt_len = args.prompt or (512 if real else 16)
    prompt = torch.randint(0, vocab, (args.batch, prompt_len), generator=torch.Generator().manual_seed(0)).to(args.device)

    timed_generate(model, prompt, 4, args.device)  # warm-up (kernels, allocator)
    eager_out, eager_prefill, eager_decode = timed_generate(model, prompt, args.new_tokens, args.device)

    model.forward = torch.compile(model.forward, backend="sonic", options={"sonic.compiler": args.sonic_compiler})
    with moe_compiler.capture() as warm:
        timed_generate(model, prompt, 4, args.device)  # compiles prefill, then decode until shapes go dynamic
    with moe_compiler.capture() as steady:
        sonic_out, sonic_prefill, sonic_decode = timed_generate(model, prompt, args.new_tokens, args.device)
    with moe_compiler.capture() as longer:
        timed_generate(model, prompt, 2 * args.new_tokens, args.device)

    same = torch.equal(sonic_out, eager_out)
    new = args.batch * args.new_tokens
    prefill_tokens = args.batch * prompt_len
    print(f"{args.model} ({args.scale}, {args.layers} layers) {dtype} {args.device}: batch {args.batch}, prompt {prompt_len}, {args.new_tokens} new tokens")
    print(f"greedy tokens identical to eager: {same}")
    print("| | prefill tokens/s | decode tokens/s |")
    print("|---|---|---|")
    print(f"| eager | {prefill_tokens / eager_prefill:.0f} | {new / eager_decode:.1f} |")
    print(f"| sonic | {prefill_tokens / sonic_prefill:.0f} | {new / sonic_decode:.1f} |")
    print(f"decode speed vs eager: {eager_decode / sonic_decode:.2f}x")
    print(f"graphs compiled: warm-up {warm.graphs} ({len(warm.rewritten)} MoE regions rewritten), "
          f"then {steady.graphs} for {args.new_tokens} tokens, {longer.graphs} for {2 * args.new_tokens} tokens")
    ok = same and longer.graphs <= steady.graphs
    print("OK" if ok else "FAILED: tokens differ or compiles grow with the number of generated tokens")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
