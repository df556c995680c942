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
no single graph. Reported per shape: forward+backward median ms, model TFLOPS (18 T K d n),
peak memory of a step, first-call (compile) time, the relative error of the output and of the
input gradient against eager, and how many regions sonic rewrote. bf16 on CUDA; with `--autocast`,
float32 parameters and inputs with every step under `torch.autocast("cuda", torch.bfloat16)`
(mixed-precision training as most users write it).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import moe_compiler  # noqa: E402,F401  (registers backend="sonic")

# name -> (T, d, n, E, K)
SHAPES = {
    "mixtral": (8192, 4096, 14336, 8, 2),  # Mixtral-8x7B layer sizes
    "olmoe": (16384, 2048, 1024, 64, 8),  # OLMoE-1B-7B layer sizes
    "qwen3": (16384, 2048, 768, 128, 8),  # Qwen3-30B-A3B layer sizes
    "tiny": (256, 64, 32, 4, 2),  # smoke test (CPU)
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
    from triton.testing import do_bench

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
        ms = do_bench(step, warmup=args.warmup, rep=args.rep, grad_to_none=leaves, return_mode="median")
        rows[name] = dict(
            fwdbwd_ms=ms, tflops=18 * T * K * d * n / ms * 1e-9, peak_gib=peak, first_call_s=first,
            err_out=rel(result[0], ref[0]), err_dx=rel(result[1], ref[1]), err_against=ref_name,
            rewritten=sum(r.status == "rewritten" for r in report.records) if name == "sonic" else None,
        )
        print(f"  {name:>9}: {ms:8.2f} ms  {rows[name]['tflops']:6.1f} TFLOPS  peak {peak:6.2f} GiB  "
              f"first {first:6.1f} s  err out {rows[name]['err_out']:.1e} dx {rows[name]['err_dx']:.1e} (against {ref_name})",
              flush=True)

    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="mixtral,olmoe", help=f"comma list of {list(SHAPES)}")
    ap.add_argument("--providers", default=",".join(PROVIDERS))
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rep", type=int, default=30)
    ap.add_argument("--out", default=None, help="folder for results.json")
    ap.add_argument("--autocast", action="store_true", help="float32 model under torch.autocast(bfloat16)")
    ap.add_argument("--spelling", default="loop", choices=list(SPELLINGS),
                    help="loop: the Mixtral-style loop; gathered: gpt-oss's reference MLPBlock")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_naive needs a CUDA device")
    providers = args.providers.split(",")
    assert all(p in PROVIDERS for p in providers), providers
    torch._dynamo.config.capture_dynamic_output_shape_ops = True  # the loop is one graph only with it
    torch._dynamo.config.cache_size_limit = 64
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}"
          + ("; float32 model under autocast(bfloat16)" if args.autocast else "; bfloat16 model")
          + f"; spelling {args.spelling}")
    results = {}
    for key in args.shapes.split(","):
        print(f"{key} {SHAPES[key]}", flush=True)
        results[key] = bench_shape(SHAPES[key], providers, args, "cuda", torch.bfloat16)
    print("\n| shape | provider | fwd+bwd ms | TFLOPS | x eager | x Inductor | peak GiB | first call s | rel err out / dx | regions |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for key, rows in results.items():
        for name, r in rows.items():
            if r is None:
                print(f"| {key} | {name} | OOM | | | | | | | |")
                continue
            vs = lambda other: f"{rows[other]['fwdbwd_ms'] / r['fwdbwd_ms']:.2f}" if rows.get(other) else "-"  # noqa: E731
            print(f"| {key} | {name} | {r['fwdbwd_ms']:.2f} | {r['tflops']:.1f} | {vs('eager')} | {vs('inductor')} | "
                  f"{r['peak_gib']:.2f} | {r['first_call_s']:.1f} | {r['err_out']:.1e} / {r['err_dx']:.1e} | "
                  f"{r['rewritten'] if r['rewritten'] is not None else '-'} |")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump({"command": " ".join(sys.argv), "device": torch.cuda.get_device_name(), "spelling": args.spelling, "shapes": SHAPES,
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
