"""Tile-aware token rounding in one MoE layer: forward+backward time of plain top-k vs rounded routing.

Question (issue 5): how much faster is a training step of the layer when every expert's token count
is a multiple of the GEMM M tile (`codegen.round_routing`, M_TILE rows: no padded tile) than plain
top-k, and how many (token, expert) pairs does each rounding mode route instead of T*K?

    python benchmarks/bench_token_rounding.py --out $OUT                    # GPU, both shapes, < 3 min on an H100
    python benchmarks/bench_token_rounding.py --shapes tiny --device cpu    # smoke test (pure-torch reference), seconds

Layer, as a softmax-routed model trains it: logits = x Wr (Wr [d, E]), probs = softmax(logits in
fp32), top-k, weights renormalized over the k and cast to x's dtype; SwiGLU experts through
`codegen.moe_experts`. Providers, on the same x, dy and weights:

    topk            moe_experts(x, ids [T, K], weights [T, K], W1, W2)
    round-<mode>    round_routing(probs, ids, weights, tile=M_TILE, mode) -> moe_experts(..., slot_token=)
                    for mode in up, down, nearest

The timed step is router + (rounding) + experts, forward and backward (dx, dWr, dW1, dW2, through
the router and the rounding): the router work is identical in every provider. Per provider: median
step ms over --iters steps after --warmup steps (`benchmarking.wall_ms`: a CUDA event pair per step,
perf_counter on the CPU; a step whose launches take the host longer than the GPU's work times the
host), with --cuda-graph the step replayed from a CUDA graph (`benchmarking.graph_ms`: the GPU's
time alone), with --host-profile the host's ms per step (`benchmarking.host_ms`) and a cProfile of
it, speedup vs topk, routed pairs (real slots) vs T*K,
slots (the static capacity `slot_capacity` the kernels are launched over), the padded-tile rows
sum_e (ceil(c_e / M) * M - c_e) as a fraction of the rows the GEMMs compute, host syncs seen in one
step (torch.cuda sync debug mode), and the first call's time (compile + autotune in this process:
the autotuners are keyed without T but with top_k, which is 1 in the slot form, so topk pays the
[T, K] kernels' tuning and the first rounding provider that of the slot-form kernels).
TFLOPS are nominal, 18 T K d n / time with top-k's T*K for every provider, so they compare times.
Output: a table, token_rounding.json and (when matplotlib imports) tflops.png under --out.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from moe_compiler.benchmarking import (
    add_common_args,
    bar_chart,
    command_line,
    count_host_syncs,
    graph_ms,
    host_ms,
    host_profile,
    print_table,
    resolve_shapes,
    sync,
    wall_times_ms,
    write_json,
)
from moe_compiler.codegen import wgrad_choice
from moe_compiler.codegen.ops import moe_experts
from moe_compiler.codegen.token_rounding import M_TILE, round_routing, slot_capacity

# name -> (T, d, n, E, K)
SHAPES = {
    "d4096-e256": (16384, 4096, 1024, 256, 4),
    "d1536-e128": (16384, 1536, 1024, 128, 2),
    "tiny": (1024, 64, 32, 8, 2),  # CPU smoke test: T*K/E = 256 rows per expert, so M_TILE=128 rounding moves counts
}
DEFAULT_SHAPES = "d4096-e256,d1536-e128"
# "topk-slots": plain top-k handed to the op in the slot form (no rounding): the slot path's own cost
PROVIDERS = {"topk": None, "topk-slots": "slots", "round-up": "up", "round-down": "down", "round-nearest": "nearest"}


def softmax_route(x, wr, K):
    """(probs fp32 [T, E], ids [T, K], weights [T, K] in x's dtype): softmax, top-k, renormalize."""
    probs = torch.softmax((x @ wr).float(), dim=-1)
    top, ids = torch.topk(probs, K, dim=-1)
    return probs, ids, (top / top.sum(-1, keepdim=True)).to(x.dtype)


def routing(x, wr, K, mode, keep_every_token=True):
    """(ids, weights, slot_token or None): the router, then plain, slot-form or rounded routing."""
    probs, ids, weights = softmax_route(x, wr, K)
    if mode is None:
        return ids, weights, None
    if mode == "slots":
        return ids.reshape(-1), weights.reshape(-1), torch.arange(ids.numel(), device=ids.device) // K
    return round_routing(probs, ids, weights, tile=M_TILE, mode=mode, keep_every_token=keep_every_token)


def _layer(params, x, K, mode, keep_every_token=True):
    ids, weights, slot_token = routing(x, params["wr"], K, mode, keep_every_token)
    out = moe_experts(x, ids, weights, params["w1"], params["w2"], slot_token=slot_token)
    return out, ids.reshape(-1)


# --compile: what torch.compile (Inductor) covers. "layer" (the default on the GPU): router,
# rounding and the experts op in one graph, as backend="sonic" leaves them in a model, so the op's
# forward and backward run as extern calls of the compiled graphs. "routing": the router and
# rounding only, the op called eagerly through its autograd wrapper (more host work per step).
# "none": all eager (the CPU default). Each
# (shape, provider, grad mode) is a compiled entry of one code object: past Dynamo's default limit
# of 8 the rest would silently run eagerly, so main() raises it.
_compiled_routing = torch.compile(routing, dynamic=False)
_compiled_layer = torch.compile(_layer, dynamic=False)
COMPILE_SCOPES = ("layer", "routing", "none")


def layer(params, x, K, mode, keep_every_token=True, compile_scope="none"):
    """(out [T, d], expert id of every routed slot): the MoE layer with plain or rounded routing."""
    if compile_scope == "layer":
        return _compiled_layer(params, x, K, mode, keep_every_token)
    route = _compiled_routing if compile_scope == "routing" else routing
    ids, weights, slot_token = route(x, params["wr"], K, mode, keep_every_token)
    out = moe_experts(x, ids, weights, params["w1"], params["w2"], slot_token=slot_token)
    return out, ids.reshape(-1)


def expert_counts(slot_ids, E):
    real = slot_ids[slot_ids >= 0].long()
    return torch.bincount(real, minlength=E)


def padded_rows(counts, tile=M_TILE):
    """Rows of the last, partial M tile of every expert: sum_e ceil(c_e / tile) * tile - c_e."""
    return int(((-counts) % tile).sum())


def bench_provider(name, params, x, dy, shape, args):
    T, d, n, E, K = shape
    mode = PROVIDERS[name]
    xg = x.detach().clone().requires_grad_()
    leaves = [xg, *params.values()]

    def zero():
        for t in leaves:
            t.grad = None

    keep = not args.drop_orphans

    def step():
        out, _ = layer(params, xg, K, mode, keep, args.compile)
        out.backward(dy)

    sync(args.device)
    t0 = time.perf_counter()
    step()
    sync(args.device)
    first_call_s = time.perf_counter() - t0
    zero()
    with torch.no_grad():
        _, slot_ids = layer(params, xg, K, mode, keep, args.compile)
    counts = expert_counts(slot_ids, E)
    pairs = int(counts.sum())
    pad = padded_rows(counts)
    host_syncs = count_host_syncs(step, args.device)
    cuda = args.device.type == "cuda"
    if args.profile and cuda:
        zero()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            step()
            sync(args.device)
        print(f"\n{name}: the GPU kernels of one step\n"
              + prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70))
    host = None
    if args.host_profile and cuda:
        host = host_ms(step, zero=zero, device=args.device)
        print(f"\n{name}: host {host:.3f} ms per step; under cProfile, 10 steps:\n"
              + host_profile(step, zero, rows=30, sort=("tottime", "cumtime")), flush=True)
    times = wall_times_ms(step, args.iters, args.warmup, zero, args.device)
    zero()
    ms = statistics.median(times)
    graph = None
    if args.cuda_graph and cuda:
        graph = graph_ms(step, zero, args.iters, args.warmup)
        zero()
    return dict(
        provider=name, mode=mode, fwdbwd_ms=ms, min_ms=min(times), iters=len(times), graph_ms=graph,
        fwdbwd_tflops=18 * T * K * d * n / ms * 1e-9,
        pairs=pairs, topk_pairs=T * K, slots=slot_ids.numel(),
        capacity=T * K if mode in (None, "slots") else slot_capacity(T, E, K, M_TILE, mode),
        pad_rows=pad, pad_fraction=pad / max(pairs + pad, 1),
        counts_off_tile=int((counts % M_TILE != 0).sum()), counts=counts.tolist(),
        host_syncs=host_syncs, first_call_s=first_call_s, host_ms=host,
    )


def make_inputs(shape, device, dtype, seed):
    """The same weights, x and dy for every provider (std: unit-scale activations and logits)."""
    T, d, n, E, _ = shape
    gen = torch.Generator(device=device).manual_seed(seed)

    def rnd(*size, std):
        return (torch.randn(*size, device=device, dtype=dtype, generator=gen) * std).requires_grad_()

    params = {"wr": rnd(d, E, std=d**-0.5), "w1": rnd(E, 2 * n, d, std=d**-0.5), "w2": rnd(E, d, n, std=n**-0.5)}
    x = rnd(T, d, std=1.0).detach()
    dy = rnd(T, d, std=1.0).detach()
    return params, x, dy


def print_results(results):
    columns = ["shape", "provider", "fwd+bwd ms", "x topk", "CUDA graph ms", "x topk", "pairs / T*K", "slots",
               "padded rows", "off-tile experts", "host syncs", "first call s"]
    rows = [[r["shape"], r["provider"], r["fwdbwd_ms"], r["speedup_vs_topk"], r["graph_ms"],
             r.get("graph_speedup_vs_topk"),
             f"{r['pairs']} / {r['topk_pairs']} ({r['pairs'] / r['topk_pairs'] - 1:+.2%})",
             r["slots"], f"{r['pad_rows']} ({r['pad_fraction']:.2%})", f"{r['counts_off_tile']}/{r['E']}",
             r["host_syncs"], r["first_call_s"]] for r in results]
    print_table(columns, rows, {"fwd+bwd ms": ".3f", "x topk": ".3f", "CUDA graph ms": ".3f", "first call s": ".1f"})


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap, out="bench_token_rounding", warmup=5, iters=30, seed=0, device=True, shapes=DEFAULT_SHAPES,
                    providers=",".join(PROVIDERS), shapes_help=f"comma list of {sorted(SHAPES)}",
                    providers_help=f"comma list of {list(PROVIDERS)}",
                    iters_help="timed steps per provider (after the first call and --warmup steps)")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--drop-orphans", action="store_true",
                    help="round_routing(keep_every_token=False): a token whose experts all round it away is dropped "
                         "instead of kept by its best expert (whose count then leaves the tile multiple)")
    ap.add_argument("--profile", action="store_true", help="print each provider's GPU kernel times for one step")
    ap.add_argument("--host-profile", action="store_true",
                    help="print each provider's host ms per step (enqueued behind a GPU sleep) and a cProfile")
    ap.add_argument("--cuda-graph", action="store_true",
                    help="also time each provider's step replayed from a CUDA graph (GPU time, no launch cost)")
    ap.add_argument("--compile", choices=COMPILE_SCOPES, default=None,
                    help="what Inductor compiles: the whole layer, the routing only, or nothing "
                         "(default: layer on cuda, none on cpu)")
    args = ap.parse_args(argv)
    command = command_line(argv, __file__)
    print("command:", command, flush=True)
    args.device = torch.device(args.device)
    torch._dynamo.config.recompile_limit = 64  # see COMPILE_SCOPES: one entry per shape and provider
    if args.compile is None:
        args.compile = "layer" if args.device.type == "cuda" else "none"
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if args.device.type == "cuda" else torch.float32)
    try:
        shapes = resolve_shapes(args.shapes, SHAPES)
    except ValueError as exc:
        ap.error(str(exc))
    providers = list(dict.fromkeys(args.providers))
    for p in providers:
        if p not in PROVIDERS:
            ap.error(f"unknown provider {p}; choose from {list(PROVIDERS)}")
    device_name = torch.cuda.get_device_name(args.device) if args.device.type == "cuda" else "cpu"
    print(f"device: {device_name}; torch {torch.__version__}; {dtype}; M_TILE {M_TILE}", flush=True)

    results = []
    for sname in shapes:
        T, d, n, E, K = shape = SHAPES[sname]
        params, x, dy = make_inputs(shape, args.device, dtype, args.seed)
        for prov in providers:
            r = bench_provider(prov, params, x, dy, shape, args)
            r.update(shape=sname, T=T, d=d, n=n, E=E, K=K, dtype=str(dtype))
            results.append(r)
            graph = "" if r["graph_ms"] is None else f" (graph {r['graph_ms']:.3f} ms)"
            graph += "" if r["host_ms"] is None else f" (host {r['host_ms']:.3f} ms)"
            print(f"{sname:>11} {prov:>13}: {r['fwdbwd_ms']:8.3f} ms{graph}  pairs {r['pairs']} / {T * K}  "
                  f"padded rows {r['pad_rows']} ({r['pad_fraction']:.2%})  first {r['first_call_s']:.1f}s", flush=True)
        del params, x, dy
        if args.device.type == "cuda":
            torch.cuda.empty_cache()
    for r in results:
        base = next((b for b in results if b["shape"] == r["shape"] and b["provider"] == "topk"), None)
        r["speedup_vs_topk"] = base["fwdbwd_ms"] / r["fwdbwd_ms"] if base else float("nan")
        if base and r["graph_ms"] is not None:
            r["graph_speedup_vs_topk"] = base["graph_ms"] / r["graph_ms"]

    print_results(results)
    choices = {str(k[:6]): v for k, v in wgrad_choice.chosen().items()}  # (P, Q, E, K, slot form, gathered lhs)
    print(f"weight gradients ({wgrad_choice.PINNED}): {choices}")
    payload = dict(tile=M_TILE, compile=args.compile, keep_every_token=not args.drop_orphans,
                   wgrad=wgrad_choice.PINNED, wgrad_choice=choices, results=results)
    path = write_json(os.path.join(args.out, "token_rounding.json"), payload, command=command,
                      device=args.device)
    png = bar_chart(os.path.join(args.out, "tflops.png"), results, "fwdbwd_tflops",
                    ylabel="fwd+bwd TFLOPS (nominal: 18 T K d n / time)")
    print(f"\nwrote {path}" + (" and tflops.png" if png else ""))
    return results


if __name__ == "__main__":
    main()
