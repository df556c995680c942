"""What verification by evaluation (`patterns/verify.py`) costs the first call at a new shape.

    python benchmarks/bench_verify.py                          # 7b-256, Qwen3, OLMoE on the GPU
    python benchmarks/bench_verify.py --shapes tiny --device cpu   # smoke test

For each shape, transformers' `Qwen3MoeSparseMoeBlock` (bf16, its default grouped_mm experts) is
compiled with backend="sonic" twice, verification on (first, so it pays the cold compile) and off,
and one forward+backward is run. Reported: the first call's wall time, the seconds spent inside
`verify` and what it found, the regions rewritten, and the peak GPU memory of the call (the float64
evaluation is transient memory during compilation). Output: the table and verify.json under --out.
"""
from __future__ import annotations

import argparse
import time

import torch

import moe_compiler
from moe_compiler import benchmarking, passes
from moe_compiler.patterns import verify as verify_module

SHAPES = {"7b-256": benchmarking.SHAPES["7b-256"], "qwen3": (16384, 2048, 768, 128, 8),
          "olmoe": (16384, 2048, 1024, 64, 8), "tiny": (64, 32, 16, 8, 2)}


def qwen3_block(d, n, E, K, device):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(hidden_size=d, moe_intermediate_size=n, num_experts=E, num_experts_per_tok=K,
                            norm_topk_prob=True)
    config._experts_implementation = "grouped_mm"  # what from_pretrained/from_config would set
    return Qwen3MoeSparseMoeBlock(config).to(device, torch.bfloat16)


def first_call(shape, device, verify_on: bool) -> dict:
    T, d, n, E, K = shape
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    timings = []

    def timed(match, **kwargs):
        sync()
        start = time.perf_counter()
        outcome = real(match, **kwargs)
        sync()
        timings.append((time.perf_counter() - start, outcome))
        return outcome

    real, passes.verify = passes.verify, timed
    try:
        torch._dynamo.reset()
        verify_module._cache.clear()
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        torch.manual_seed(0)
        x = torch.randn(1, T, d, device=device, dtype=torch.bfloat16, requires_grad=True)
        block = torch.compile(qwen3_block(d, n, E, K, device), backend="sonic", options={"sonic.verify": verify_on})
        sync()
        start = time.perf_counter()
        with moe_compiler.capture() as report:
            out = block(x)
            (out[0] if isinstance(out, tuple) else out).float().sum().backward()
        sync()
        wall = time.perf_counter() - start
    finally:
        passes.verify = real
    return {"verify": verify_on, "first_call_s": wall, "verify_s": sum(t for t, _ in timings),
            "outcome": "; ".join(o for _, o in timings) or "-", "rewritten": len(report.rewritten),
            "peak_gb": torch.cuda.max_memory_allocated() / 1e9 if device == "cuda" else float("nan")}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    benchmarking.add_common_args(parser, out="verify", device=True, shapes="7b-256,qwen3,olmoe",
                                 shapes_help=f"comma list of {', '.join(SHAPES)}")
    args = parser.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    for name in args.shapes:
        for verify_on in (True, False):
            row = {"shape": name, **first_call(SHAPES[name], device, verify_on)}
            rows.append(row)
            print(row, flush=True)
    columns = ("shape", "verify", "first_call_s", "verify_s", "peak_gb", "rewritten", "outcome")
    benchmarking.print_table(columns, [[row[c] for c in columns] for row in rows],
                             {"first_call_s": ".2f", "verify_s": ".3f", "peak_gb": ".1f"},
                             title="first fwd+bwd call of a compiled Qwen3MoeSparseMoeBlock, bf16")
    print(benchmarking.write_json(f"{args.out}/verify.json", {"rows": rows}, device=device))


if __name__ == "__main__":
    main()
