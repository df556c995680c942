"""MoE code written the naive way (an nn.ModuleList of experts looped in Python), compiled three ways.

Question: what does `backend="sonic"` buy a user who wrote their MoE as a Mixtral-style loop
(`torch.where` on the expert mask, each expert's Linears, `index_add_`) and changed nothing?

    python benchmarks/bench_naive.py --shapes mixtral,olmoe --out out/naive
    python benchmarks/bench_naive.py --spelling gathered --shapes gpt-oss-20b-64,gpt-oss-20b-256
    python benchmarks/bench_naive.py --spelling per-column --shapes olmoe

`--spelling per-column` loops over the top-k columns around the experts loop (K times E expert calls).
`--spelling gathered` times gpt-oss's reference `MLPBlock` instead (stacked weights and biases
gathered per token, `W1[ids, ...]`, and contracted by einsum; interleaved gate/up, clamped SwiGLU):
eager copies T K (3 n d) weight elements a step, and a step that does not fit is reported as OOM.

Providers, on the same module and inputs: eager (the loop as written), Inductor
(`torch.compile`, default mode) and sonic (`torch.compile(backend="sonic")`); both compiled ones
with `torch._dynamo.config.capture_dynamic_output_shape_ops = True`, without which the loop is
no single graph. Reported per shape: forward+backward median ms (`benchmarking.median_ms` over
about --iters steps), model TFLOPS (18 T K d n),
peak memory of a step, first-call (compile) time, the relative error of the output and of the
input gradient against eager, and how many regions sonic rewrote. bf16 on CUDA; with `--autocast`,
float32 parameters and inputs with every step under `torch.autocast("cuda", torch.bfloat16)`
(mixed-precision training as most users write it). Output: a table, results.json under --out.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import moe_compiler  # registers backend="sonic"
from moe_compiler import benchmarking
from moe_compiler.benchmarking import add_common_args, command_line, median_ms, print_table, write_json

# name -> (T, d, n, E, K): three real models' layers (the shared table's), a smoke size, gpt-oss decode batches
SHAPES = {
    **{name: benchmarking.SHAPES[name] for name in ("mixtral", "olmoe", "qwen3")},
    "tiny": (256, 64, 32, 4, 2),
    "gpt-oss-20b-64": (64, 2880, 2880, 32, 4),  # gpt-oss-20b layer sizes, a decode batch
    "gpt-oss-20b-256": (256, 2880, 2880, 32, 4),
}
PROVIDERS = ("eager", "inductor", "sonic")


class Expert(nn.Module):
    def __init__(self, d, n):
        super().__init__()
        self.w1 = nn.Linear(d, n, bias=False)
        self.w3 = nn.Linear(d, n, bias=False)
        self.w2 = nn.Linear(n, d, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class NaiveMoE(nn.Module):
    """The Mixtral-style loop that many MoE code bases still carry."""

    def __init__(self, d, n, E, K):
        super().__init__()
        self.gate = nn.Linear(d, E, bias=False)
        self.experts = nn.ModuleList(Expert(d, n) for _ in range(E))
        self.E, self.K = E, K

    def forward(self, x):
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float)
        w, ids = torch.topk(probs, self.K, dim=-1)
        w = (w / w.sum(-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(x)
        mask = F.one_hot(ids, num_classes=self.E).permute(2, 1, 0)
        for e in range(self.E):
            k, tok = torch.where(mask[e])
            y = self.experts[e](x[tok]) * w[tok, k, None]
            out.index_add_(0, tok, y.to(x.dtype))
        return out


class PerColumnMoE(NaiveMoE):
    """The same experts looped once per top-k column: `for k: for e: tok = torch.where(ids[:, k] == e)`."""

    def forward(self, x):
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float)
        w, ids = torch.topk(probs, self.K, dim=-1)
        w = (w / w.sum(-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(x)
        for k in range(self.K):
            for e in range(self.E):
                tok = torch.where(ids[:, k] == e)[0]
                out.index_add_(0, tok, self.experts[e](x[tok]) * w[tok, k, None])
        return out


class GatheredMoE(nn.Module):
    """gpt-oss's reference `MLPBlock` (openai/gpt-oss, torch/model.py), without its norm and residual."""

    def __init__(self, d, n, E, K):
        super().__init__()
        self.gate = nn.Linear(d, E)
        self.mlp1_weight = nn.Parameter(torch.empty(E, 2 * n, d))
        self.mlp1_bias = nn.Parameter(torch.empty(E, 2 * n))
        self.mlp2_weight = nn.Parameter(torch.empty(E, d, n))
        self.mlp2_bias = nn.Parameter(torch.empty(E, d))
        self.K = K

    def forward(self, x):
        experts = torch.topk(self.gate(x), k=self.K, dim=-1, sorted=True)
        weights, ids = F.softmax(experts.values, dim=1), experts.indices
        t = torch.einsum("beck,bk->bec", self.mlp1_weight[ids, ...], x) + self.mlp1_bias[ids, ...]
        glu, linear = t[..., ::2].clamp(min=None, max=7.0), t[..., 1::2].clamp(min=-7.0, max=7.0)
        t = glu * torch.sigmoid(1.702 * glu) * (linear + 1)
        t = torch.einsum("beck,bek->bec", self.mlp2_weight[ids, ...], t)
        t += self.mlp2_bias[ids, ...]
        return torch.einsum("bec,be->bc", t, weights)


SPELLINGS = {"loop": NaiveMoE, "per-column": PerColumnMoE, "gathered": GatheredMoE}


def build(name, model):
    if name == "eager":
        return model
    if name == "inductor":
        return torch.compile(model)
    return torch.compile(model, backend="sonic")


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def bench_shape(shape, providers, args, device, dtype):
    autocast = args.autocast
    if autocast:
        dtype = torch.float32

    T, d, n, E, K = shape
    torch.manual_seed(0)
    model = SPELLINGS[args.spelling](d, n, E, K).to(device=device, dtype=dtype)
    for p in model.parameters():
        nn.init.normal_(p, std=0.02)
    x = torch.randn(T, d, device=device, dtype=dtype)
    dy = torch.randn(T, d, device=device, dtype=dtype)
    rows, ref, ref_name = {}, None, None
    for name in providers:
        torch._dynamo.reset()
        fn = build(name, model)
        xg = x.clone().requires_grad_()
        leaves = [xg, *model.parameters()]

        def step():
            with torch.autocast(device, dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
                out = fn(xg)
            out.backward(dy)
            return out

        try:
            with moe_compiler.capture() as report:
                t0 = time.perf_counter()
                out = step()
                torch.cuda.synchronize()
                first = time.perf_counter() - t0
        except torch.cuda.OutOfMemoryError:
            for t in leaves:
                t.grad = None
            torch.cuda.empty_cache()
            rows[name] = None
            print(f"  {name:>9}: out of memory", flush=True)
            continue
        result = (out.detach(), xg.grad.detach().clone())
        if ref is None:  # errors are against the first provider that fits (eager, unless it ran out of memory)
            ref, ref_name = result, name
        for t in leaves:
            t.grad = None
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        ms = median_ms(step, args.iters, args.warmup, grad_to_none=leaves)
        rows[name] = dict(
            fwdbwd_ms=ms, tflops=18 * T * K * d * n / ms * 1e-9, peak_gib=peak, first_call_s=first,
            err_out=rel(result[0], ref[0]), err_dx=rel(result[1], ref[1]), err_against=ref_name,
            rewritten=sum(r.status == "rewritten" for r in report.records) if name == "sonic" else None,
        )
        print(f"  {name:>9}: {ms:8.2f} ms  {rows[name]['tflops']:6.1f} TFLOPS  peak {peak:6.2f} GiB  "
              f"first {first:6.1f} s  err out {rows[name]['err_out']:.1e} dx {rows[name]['err_dx']:.1e} (against {ref_name})",
              flush=True)

    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap, out="bench_naive", warmup=3, iters=20, shapes="mixtral,olmoe", providers=",".join(PROVIDERS),
                    iters_aliases=("--rep",), shapes_help=f"comma list of {list(SHAPES)}",
                    providers_help=f"comma list of {PROVIDERS}")
    ap.add_argument("--autocast", action="store_true", help="float32 model under torch.autocast(bfloat16)")
    ap.add_argument("--spelling", default="loop", choices=list(SPELLINGS),
                    help="loop: the Mixtral-style loop; per-column: K x E expert calls; gathered: gpt-oss's "
                         "reference MLPBlock")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_naive needs a CUDA device")
    providers = args.providers
    for p in providers:
        if p not in PROVIDERS:
            ap.error(f"unknown provider {p}; choose from {PROVIDERS}")
    for key in args.shapes:
        if key not in SHAPES:
            ap.error(f"unknown shape {key}; choose from {list(SHAPES)}")
    command = command_line(argv, __file__)
    print("command:", command, flush=True)
    torch._dynamo.config.capture_dynamic_output_shape_ops = True  # the loop is one graph only with it
    torch._dynamo.config.cache_size_limit = 64
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}"
          + ("; float32 model under autocast(bfloat16)" if args.autocast else "; bfloat16 model")
          + f"; spelling {args.spelling}")
    results = {}
    for key in args.shapes:
        print(f"{key} {SHAPES[key]}", flush=True)
        results[key] = bench_shape(SHAPES[key], providers, args, "cuda", torch.bfloat16)
    rows = []
    for key, by_provider in results.items():
        for name, r in by_provider.items():
            if r is None:
                rows.append([key, name, "OOM", *[None] * 7])
                continue
            vs = {other: by_provider[other]["fwdbwd_ms"] / r["fwdbwd_ms"] if by_provider.get(other) else None
                  for other in ("eager", "inductor")}
            rows.append([key, name, r["fwdbwd_ms"], r["tflops"], vs["eager"], vs["inductor"], r["peak_gib"],
                         r["first_call_s"], f"{r['err_out']:.1e} / {r['err_dx']:.1e}", r["rewritten"]])
    print_table(["shape", "provider", "fwd+bwd ms", "TFLOPS", "x eager", "x Inductor", "peak GiB", "first call s",
                 "rel err out / dx", "regions"], rows,
                {"fwd+bwd ms": ".2f", "TFLOPS": ".1f", "x eager": ".2f", "x Inductor": ".2f", "peak GiB": ".2f",
                 "first call s": ".1f"})
    path = write_json(os.path.join(args.out, "results.json"),
                      dict(spelling=args.spelling, autocast=args.autocast, shapes=SHAPES, results=results),
                      command=command)
    print(f"\nwrote {path}")
    return results


if __name__ == "__main__":
    main()
