"""What the pattern stage (canonical forms, finders, verification, rewrite) costs a model graph.

    python benchmarks/bench_pattern_stage.py                       # 48 layers, six families, CPU
    python benchmarks/bench_pattern_stage.py --models qwen3_moe --layers 8

Each family's tiny random-weight causal LM (`moe_compiler.testing.tiny_moe_model`) with `--layers`
layers is traced by Dynamo under no_grad, and `moe_compiler.passes.run_passes` runs on each graph
it hands over, timed. Reported per model: graphs, regions rewritten, seconds in the pattern stage.
"""
from __future__ import annotations

import argparse
import time

import torch

import moe_compiler
from moe_compiler.options import SonicOptions
from moe_compiler.passes import run_passes
from moe_compiler.testing import MODELS, tiny_moe_model


def pattern_stage(name: str, layers: int, tokens: int) -> tuple[int, int, float]:
    """(graphs, regions rewritten, seconds in run_passes) for one model traced once."""
    model = tiny_moe_model(name, num_hidden_layers=layers)
    ids = torch.randint(0, 100, (1, tokens))
    seconds: list[float] = []

    def timed(gm, example_inputs):
        start = time.perf_counter()
        run_passes(gm, SonicOptions())
        seconds.append(time.perf_counter() - start)
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad(), moe_compiler.capture() as report:
        torch.compile(model, backend=timed)(ids)
    return len(seconds), len(report.rewritten), sum(seconds)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    print("| model | layers | graphs | regions rewritten | pattern stage s |\n|---|---|---|---|---|")
    for name in args.models.split(","):
        graphs, rewritten, seconds = pattern_stage(name, args.layers, args.tokens)
        print(f"| {name} | {args.layers} | {graphs} | {rewritten} | {seconds:.2f} |", flush=True)


if __name__ == "__main__":
    main()
