"""Quickstart: compile a tiny random Qwen3-MoE with backend="sonic" and check it against eager.

    python examples/quickstart.py [--model qwen3_moe|olmoe|mixtral] [--device cpu|cuda]

Builds the model from its config class (no downloads), runs one forward+backward eagerly
(transformers' default grouped_mm experts) and one under torch.compile(backend="sonic"), checks
that loss and every gradient agree, prints what the backend rewrote and both timings.
"""
from __future__ import annotations

import argparse
import time
import warnings

import torch

import moe_compiler
from moe_compiler.testing import MODELS, closeness, count_moe_layers, tiny_moe_model


def step(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels=ids).loss
    loss.backward()
    grads = {n.removeprefix("_orig_mod."): p.grad for n, p in model.named_parameters()}
    return loss.detach(), grads


def timed(fn, device, repeat=3):
    times = []
    for _ in range(repeat):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def main():
    # transformers' version checks are lru_cache'd; Dynamo warns once per call site. Noise here.
    warnings.filterwarnings("ignore", message=".*lru_cache.*")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=MODELS, default="qwen3_moe")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=64, help="sequence length (batch 2)")
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = tiny_moe_model(args.model, dtype).to(args.device)
    ids = torch.randint(0, model.config.vocab_size, (2, args.tokens), device=args.device)
    print(f"{args.model}: {count_moe_layers(model)} MoE layers, {dtype}, {args.device}\n")

    print(moe_compiler.explain(model, ids), "\n")

    eager_loss, eager_grads = step(model, ids)
    compiled = torch.compile(model, backend="sonic")
    start = time.perf_counter()
    sonic_loss, sonic_grads = step(compiled, ids)
    compile_s = time.perf_counter() - start

    truth = None
    if dtype != torch.float32:  # judge low precision against an fp32 copy, as the tests do
        fp32 = tiny_moe_model(args.model, torch.float32).to(args.device)
        fp32.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
        truth = step(fp32, ids)
    checks = {"loss": closeness(sonic_loss, eager_loss, truth and truth[0], dtype)}
    for name, grad in sonic_grads.items():
        checks[f"grad {name}"] = closeness(grad, eager_grads[name], truth and truth[1][name], dtype)
    failed = {k: why for k, (ok, why) in checks.items() if not ok}
    print(f"loss: eager {eager_loss.item():.6f}  sonic {sonic_loss.item():.6f}")
    print(f"{len(checks) - len(failed)}/{len(checks)} of loss and gradients within tolerance", *(f"\n  {k}: {w}" for k, w in failed.items()))
    eager_s = timed(lambda: step(model, ids), args.device)
    sonic_s = timed(lambda: step(compiled, ids), args.device)
    print(f"fwd+bwd step: eager {eager_s * 1e3:.1f} ms, sonic {sonic_s * 1e3:.1f} ms (first sonic call incl. compile: {compile_s:.1f} s)")
    ok = not failed
    print("OK: sonic matches eager" if ok else "MISMATCH: sonic differs from eager")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
