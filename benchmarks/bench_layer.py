"""One MoE layer (router linear + top-k + softmax over k + SwiGLU experts), providers side by side.

Question: how fast, and how much memory, is `codegen.ops.moe_experts` against SonicMoE, Liger,
torch `_grouped_mm` (eager and Inductor max-autotune) and the per-expert loop, on the same inputs?

    python benchmarks/bench_layer.py --shapes 7b-256,qwen3 \\
        --providers ours,ours-fused-router,sonic,liger,grouped_mm --out out/bench
    python benchmarks/bench_layer.py --shapes tiny --providers ours,grouped_mm --iters 10 --step-times  # smoke

Per shape and provider: forward, backward and forward+backward model TFLOPS (6TKdn, 12TKdn, 18TKdn:
router FLOPs not counted; backward time = fwd+bwd time - fwd time), activation memory (bytes held
after the forward, the output included), peak memory over a fwd+bwd step (above the inputs), max
relative error of (out, dx) against an fp32 layer on the same routing, and the first call's time
(compile + autotune + run, in this process: the Triton disk cache may make later shapes cheaper).
Times are `moe_compiler.benchmarking.median_ms` (do_bench's median over about --iters calls after
--warmup ones). Output: a table on stdout, results.json and (when matplotlib imports) tflops.png
under --out.
`--rounds R` times the providers R times over, in turn, at each shape (`sonic,ours` x 3 is
sonic, ours, sonic, ours, sonic, ours): single rounds of one provider differ by up to ~3% on an
H100, so ratios should come from medians. The summary table (and results.json's "summary")
gives each provider's medians and their ratios to `--baseline` (default sonic).
`--cuda-graph` adds the fwd+bwd step replayed from a CUDA graph: its GPU time without the host's
launch cost (an H100 host takes 3-5 ms to enqueue one 7b-256 step of ours, against ~4.2 ms of GPU
work, so eager timings can include host waits).
`--kernel-time` adds the GPU's busy time in an eager step: the union of the device's kernel, copy and
fill intervals over profiled steps (torch.profiler), idle gaps left out. It is the GPU-time figure
of a provider that cannot be captured in a CUDA graph (Liger syncs on the host in its forward:
`.item()` sizes its tile grid), and it is taken the same way for every provider that runs.
`--step-times` adds, per provider, the three figures of a normally launched fwd+bwd step
(`benchmarking.step_times`): host ms (enqueueing one step while the GPU is kept busy ahead), GPU-busy
ms and wall ms (CUDA events around each step). host near wall means the step is bound by its
launches; busy near wall, by the GPU. A provider that syncs on the host has no host figure.
Peers run when importable (SonicMoE, Liger: see ../shared/peers/README.md; never vendored here).

The router: SonicMoE runs its own (a fused softmax-top-k kernel, plus an aux loss); every other
provider runs it as eager torch ops (`torch.topk`, then softmax over the k kept logits), except
"ours-fused-router": `sonic::route`, the one op backend="sonic" fuses that router into in a model.
So "ours-fused-router" against "sonic" compares what each gives a user; "ours" isolates our experts
op behind torch's top-k (147 us of a 7b-256 step on the H100, against SonicMoE's 6).
"ours-compiled" is that layer through `torch.compile(backend="sonic")` (Inductor around our ops, and
x's gradient through the router folded into the experts' dX gather-sum, `moe_compiler.grad_fold`);
"ours-compiled-nofold" the same without the fold (`sonic.fold_input_grad=False`);
"ours-compiled-per-tile-up" the same with one program per tile in the up-projection and dA' GEMMs
(`codegen.launch.set_persistent_up(False)`) instead of the persistent kernel; "ours-compiled-wide-keys"
with the router's top-k on int64 keys (`codegen.router.NARROW_KEYS = False`) where bf16 logits
would give int32 ones; "ours-compiled-slot-order" with the Gluon scatter GEMMs storing Y and dX~ in
slot order (`codegen.forward.set_scatter_tiles(False)`) instead of TILE order; "ours-compiled-default-ops" with
the compiled graphs calling our ops' `default` overloads, through custom_op's Python layers
(`codegen.nograd.USE_NOGRAD = False`), instead of `nograd`; "ours-compiled-triton-launch" with every kernel
launched through Triton's `kernel[grid]` (`codegen.direct_launch.ENABLED = False`) instead of the cached
compiled kernel's launcher; "ours-compiled-no-plans" with every op call running its implementation
(`codegen.plans.ENABLED = False`) instead of replaying the launch plan recorded at its signature.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from moe_compiler.benchmarking import (
    SHAPE_GROUPS,
    SHAPES,  # name -> (T, d, n, E, K); gpt-oss runs SwiGLU here, not its clamped variant
    add_common_args,
    bar_chart,
    busy_ms,
    command_line,
    graph_ms,
    host_profile,
    median_ms,
    print_table,
    resolve_shapes,
    step_times,
    write_json,
)
from moe_compiler.codegen.ops import moe_experts, moe_experts_list
from moe_compiler.codegen.reference import torch_moe_experts
from moe_compiler.codegen.router import route as sonic_route
PROVIDERS = ("ours", "ours-fused-router", "ours-ptr", "ours-triton-wgrad", "ours-two-dot-up", "ours-fixed-order",
             "ours-no-gluon", "ours-interleaved", "ours-list", "ours-compiled", "ours-compiled-nofold",
             "ours-compiled-per-tile-up", "ours-compiled-wide-keys", "ours-compiled-slot-order",
             "ours-compiled-default-ops", "ours-compiled-triton-launch", "ours-compiled-no-plans", "sonic", "liger",
             "grouped_mm", "compile", "loop")
LOOP_MAX_TK = 64 * 1024  # the per-expert loop only at small shapes (it syncs and crawls)


# ------------------------------------------------------------------------------------------- layers


def route(x, wr, K):
    """SonicMoE's router: top-k on the logits, softmax over the k kept values."""
    logits = x @ wr.t()
    vals, ids = torch.topk(logits, K, dim=-1)
    return ids, torch.softmax(vals.float(), dim=-1).to(x.dtype)


def route_fused(x, wr, K):
    """`route` as one `sonic::route` op: what backend="sonic" makes of that router in a model."""
    w, ids = sonic_route(x @ wr.t(), K, topk_first=True, compute_dtype=torch.float32)
    return ids, w.to(x.dtype)


def layer_ours(p, x, K):
    ids, w = route(x, p["wr"], K)
    return moe_experts(x, ids, w, p["w1"], p["w2"])


def layer_ours_fused_router(p, x, K):
    """Our experts op behind `sonic::route` instead of the eager router."""
    ids, w = route_fused(x, p["wr"], K)
    return moe_experts(x, ids, w, p["w1"], p["w2"])


def layer_ours_list(p, x, K):
    """Our op over per-expert tensors (an nn.ModuleList of gate/up/down Linears), read in place."""
    ids, w = route(x, p["wr"], K)
    E = len([k for k in p if k.startswith("down.")])
    pick = lambda part: [p[f"{part}.{e}"] for e in range(E)]  # noqa: E731
    return moe_experts_list(x, ids, w, pick("gate"), pick("up"), pick("down"))


def layer_liger(p, x, K):
    from liger_kernel.ops.fused_moe import LigerFusedMoEFunction

    ids, w = route(x, p["wr"], K)
    return LigerFusedMoEFunction.apply(x, p["w1"], p["w2"], ids.to(torch.int32), w)


def layer_grouped_mm(p, x, K):
    """transformers v5's default `grouped_mm` experts, written out: sort, gather, 2 grouped mm, combine."""
    ids, w = route(x, p["wr"], K)
    T, d = x.shape
    E = p["w1"].shape[0]
    flat = ids.reshape(-1)
    perm = torch.argsort(flat, stable=True)
    xg = x[perm // K]
    offs = torch.cumsum(torch.histc(flat.float(), bins=E, min=0, max=E - 1), 0).to(torch.int32)
    h = torch._grouped_mm(xg, p["w1"].transpose(1, 2), offs=offs)
    g, u = h.chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(g) * u, p["w2"].transpose(1, 2), offs=offs)
    y = y * w.reshape(-1)[perm].unsqueeze(-1)
    out = torch.empty_like(y)
    out[perm] = y
    return out.view(T, K, d).sum(1)


def layer_loop(p, x, K):
    ids, w = route(x, p["wr"], K)
    return torch_moe_experts(x, ids, w, p["w1"], p["w2"])


def make_sonic(p, E, K, d, n):
    from sonicmoe import MoE
    from sonicmoe.enums import ActivationType

    moe = MoE(E, K, d, n, activation_function=ActivationType.SWIGLU, add_bias=False, std=0.02)
    moe = moe.to(device="cuda", dtype=p["w1"].dtype)
    with torch.no_grad():
        moe.router.weight.copy_(p["wr"])
        g, u = p["w1"].chunk(2, dim=1)  # ours: concatenated; SonicMoE: interleaved (g0, u0, g1, u1, ...)
        moe.c_fc.weight.copy_(torch.stack((g, u), dim=2).reshape_as(p["w1"]))
        moe.c_proj.weight.copy_(p["w2"])
    return moe


# ------------------------------------------------------------------------------------------ harness


def build_provider(name, master, shape):
    T, d, n, E, K = shape
    params = {k: v.detach().clone().requires_grad_() for k, v in master.items()}
    if name in ("ours", "ours-ptr", "ours-triton-wgrad", "ours-two-dot-up", "ours-fixed-order", "ours-no-gluon"):
        return (lambda x: layer_ours(params, x, K)), params
    if name == "ours-interleaved":  # W1's gate and up rows alternating (gpt-oss's layout), same values
        g, u = master["w1"].detach().chunk(2, dim=1)
        params = dict(params, w1=torch.stack((g, u), dim=2).reshape(E, 2 * n, d).requires_grad_())
        return (lambda x: moe_experts(x, *route(x, params["wr"], K), params["w1"], params["w2"], interleaved=True)), params
    if name == "ours-fused-router":
        return (lambda x: layer_ours_fused_router(params, x, K)), params
    if name == "ours-list":  # each expert's weights in its own tensor, as nn.Linear holds them
        w1, w2 = master["w1"].detach(), master["w2"].detach()
        params = {"wr": master["wr"].detach().clone().requires_grad_()}
        for e in range(E):
            params[f"gate.{e}"] = w1[e, :n].clone().requires_grad_()
            params[f"up.{e}"] = w1[e, n:].clone().requires_grad_()
            params[f"down.{e}"] = w2[e].clone().requires_grad_()
        return (lambda x: layer_ours_list(params, x, K)), params
    if name == "liger":
        import liger_kernel.ops.fused_moe  # noqa: F401  (ImportError -> provider skipped)

        return (lambda x: layer_liger(params, x, K)), params
    if name == "grouped_mm":
        return (lambda x: layer_grouped_mm(params, x, K)), params
    if name in ("ours-compiled", "ours-compiled-nofold", "ours-compiled-per-tile-up", "ours-compiled-wide-keys",
                "ours-compiled-slot-order", "ours-compiled-default-ops", "ours-compiled-triton-launch",
                "ours-compiled-no-plans"):
        import moe_compiler  # noqa: F401  (registers backend="sonic" without the entry point too)

        fold = name != "ours-compiled-nofold"
        torch._dynamo.reset()  # the other compiled provider's graph is for the same code object
        fn = torch.compile(layer_ours_fused_router, backend="sonic", dynamic=False,
                           options={"sonic.fold_input_grad": fold})
        return (lambda x: fn(params, x, K)), params
    if name == "compile":
        fn = torch.compile(layer_grouped_mm, mode="max-autotune-no-cudagraphs", dynamic=False)
        return (lambda x: fn(params, x, K)), params
    if name == "loop":
        return (lambda x: layer_loop(params, x, K)), params
    if name == "sonic":
        moe = make_sonic(master, E, K, d, n)
        return (lambda x: moe(x)[0]), dict(moe.named_parameters())
    raise ValueError(name)


def layer_inputs(shape, seed=0):
    """(master weights {wr, w1, w2}, x, dy) of the layer at `shape`, bf16 on the GPU, drawn in that
    order from one seeded generator."""
    T, d, n, E, K = shape
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rnd = lambda *s, std: (torch.randn(*s, device="cuda", generator=gen) * std).to(torch.bfloat16)  # noqa: E731
    master = {"wr": rnd(E, d, std=d**-0.5), "w1": rnd(E, 2 * n, d, std=d**-0.5), "w2": rnd(E, d, n, std=n**-0.5)}
    return master, rnd(T, d, std=1.0), rnd(T, d, std=1.0)


def fp32_reference(master, x, dy, K):
    """(out, dx) of the layer in fp32 on the bf16 run's routing (top-k ids picked in bf16)."""
    with torch.no_grad():
        ids, _ = route(x, master["wr"], K)
    p = {k: v.float() for k, v in master.items()}
    x32 = x.detach().float().requires_grad_()
    vals = (x32 @ p["wr"].t()).gather(1, ids)
    out = torch_moe_experts(x32, ids, torch.softmax(vals, -1), p["w1"], p["w2"])
    (dx,) = torch.autograd.grad(out, x32, dy.float())
    return out.detach(), dx


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def bench_one(name, master, shape, x, dy, ref, args):
    """One provider's figures; ours-ptr runs our op with pointer loads instead of TMA, ours-triton-wgrad
    with our weight-gradient kernel pinned (`ours` measures it against torch._grouped_mm),
    ours-two-dot-up with the up-projection's gate and up tiles in two dots (`codegen.launch.set_wide_up`,
    which tunes that kernel again, so neither side runs the other's config), ours-fixed-order with the
    backward's products in one fixed order (`codegen.backward.BACKWARD_STEPS`) whatever the shape,
    ours-no-gluon without the Gluon kernels (the choices measured afresh among the others)."""
    from moe_compiler import codegen
    from moe_compiler.codegen import direct_launch, nograd, plans, router, wgrad_choice

    use_plans = plans.ENABLED
    plans.ENABLED = use_plans and not name.endswith("-no-plans")
    plans.forget()  # each provider records its own plans, under its own switches
    use_nograd = nograd.USE_NOGRAD
    nograd.USE_NOGRAD = use_nograd and not name.endswith("-default-ops")
    direct = direct_launch.ENABLED
    direct_launch.ENABLED = direct and not name.endswith("-triton-launch")
    saved = (codegen.launch.USE_TMA, wgrad_choice.PINNED, codegen.launch.WIDE_UP, codegen.backward.backward_order,
             codegen.launch.GLUON_TRITON_VERSIONS, dict(codegen.launch._GLUON), dict(wgrad_choice._CHOSEN),
             codegen.launch.PERSISTENT_UP, codegen.forward.SCATTER_TILES)
    if name.endswith("-per-tile-up"):
        codegen.launch.set_persistent_up(False)
    codegen.forward.set_scatter_tiles(saved[8] and not name.endswith("-slot-order"))
    narrow_keys = router.NARROW_KEYS
    router.NARROW_KEYS = narrow_keys and not name.endswith("-wide-keys")
    if name == "ours-no-gluon":
        codegen.launch.GLUON_TRITON_VERSIONS = ()
        codegen.launch._GLUON.clear()
        wgrad_choice._CHOSEN.clear()
    if name == "ours-fixed-order":
        fixed = codegen.backward.BACKWARD_STEPS
        codegen.backward.backward_order = lambda **sizes: (fixed, codegen.backward.backward_peak(fixed, **sizes))
    codegen.launch.USE_TMA = saved[0] and name != "ours-ptr"
    wgrad_choice.PINNED = "triton" if name == "ours-triton-wgrad" else saved[1]
    flip = (name == "ours-two-dot-up") == saved[2]
    if flip:
        codegen.launch.set_wide_up(not saved[2])
    try:
        result = _bench_one(name, master, shape, x, dy, ref, args)
        if name == "ours":
            result["wgrad_choice"] = {str(k[:5]): v for k, v in wgrad_choice.chosen().items()}
        return result
    finally:
        if flip:
            codegen.launch.set_wide_up(saved[2])
        codegen.launch.USE_TMA, wgrad_choice.PINNED = saved[:2]
        codegen.backward.backward_order = saved[3]
        if name.endswith("-per-tile-up"):
            codegen.launch.set_persistent_up(saved[7])
        codegen.forward.set_scatter_tiles(saved[8])
        router.NARROW_KEYS = narrow_keys
        nograd.USE_NOGRAD = use_nograd
        direct_launch.ENABLED = direct
        plans.ENABLED = use_plans
        plans.forget()
        if name == "ours-no-gluon":
            codegen.launch.GLUON_TRITON_VERSIONS = saved[4]
            codegen.launch._GLUON.clear()
            codegen.launch._GLUON.update(saved[5])
            wgrad_choice._CHOSEN.clear()
            wgrad_choice._CHOSEN.update(saved[6])


class ProviderStep(NamedTuple):
    """A provider's layer on its own copy of x: `step()` runs forward and backward (gradients
    accumulate into `leaves`, x's copy and the parameters); `zero()` drops them."""

    fn: Callable
    xg: torch.Tensor
    leaves: list
    zero: Callable
    step: Callable


def provider_step(name, master, shape, x, dy) -> ProviderStep:
    fn, params = build_provider(name, master, shape)
    xg = x.detach().clone().requires_grad_()
    leaves = [xg, *params.values()]

    def zero():
        for t in leaves:
            t.grad = None

    def step():
        fn(xg).backward(dy)

    return ProviderStep(fn, xg, leaves, zero, step)


def _bench_one(name, master, shape, x, dy, ref, args):
    T, d, n, E, K = shape
    fn, xg, leaves, zero, step = provider_step(name, master, shape, x, dy)

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn(xg)
    out.backward(dy)
    torch.cuda.synchronize()
    first_call = time.perf_counter() - t0
    errors = {"out": rel(out, ref[0]), "dx": rel(xg.grad, ref[1])}
    del out
    zero()

    # activation memory: what the forward keeps alive until backward (output included)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    out = fn(xg)
    torch.cuda.synchronize()
    act_bytes = torch.cuda.memory_allocated() - base
    del out
    zero()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak_bytes = torch.cuda.max_memory_allocated() - base
    zero()

    def fwd():
        fn(xg)

    t_fwd = median_ms(fwd, args.iters, args.warmup, grad_to_none=leaves)
    t_all = median_ms(step, args.iters, args.warmup, grad_to_none=leaves)
    t_bwd = max(t_all - t_fwd, 1e-6)
    flop = T * K * d * n
    extra = {}
    if args.cuda_graph:  # the step's GPU time alone: replayed from a CUDA graph, no host launch cost
        try:
            t_graph = graph_ms(step, zero, args.iters, args.warmup)
            extra.update(graph_fwdbwd_ms=t_graph, graph_fwdbwd_tflops=18 * flop / t_graph * 1e-9)
        except Exception as exc:  # a provider that cannot be captured keeps its other figures
            print(f"  {name}: no CUDA graph ({type(exc).__name__}: {str(exc)[:120]})", flush=True)
    if args.kernel_time:
        t_busy = busy_ms(step, zero)
        extra.update(busy_fwdbwd_ms=t_busy, busy_fwdbwd_tflops=18 * flop / t_busy * 1e-9)
    if args.step_times:  # host, GPU-busy and wall ms of a normally launched step
        host, busy, wall = step_times(step, zero, iters=min(args.iters, 20), warmup=min(args.warmup, 3))
        extra.update(step_host_ms=host, step_busy_ms=busy, step_wall_ms=wall)
    if args.host_profile:  # where the host's time of a step goes (cProfile slows it: shares, not times)
        print(f"  {name}: cProfile of 10 steps enqueued behind a GPU sleep", flush=True)
        print(host_profile(step, zero, rows=args.host_profile, sort=("tottime", "cumulative")), flush=True)
    return dict(
        **extra,
        fwd_ms=t_fwd, bwd_ms=t_bwd, fwdbwd_ms=t_all,
        fwd_tflops=6 * flop / t_fwd * 1e-9, bwd_tflops=12 * flop / t_bwd * 1e-9, fwdbwd_tflops=18 * flop / t_all * 1e-9,
        act_gib=act_bytes / 2**30, peak_gib=peak_bytes / 2**30, max_rel_err=max(errors.values()), errors=errors,
        first_call_s=first_call,
    )


def launch_order(events, steps, min_us=10.0, device=None):
    """(name, us) of the last of `steps` profiled steps' kernels in the order they started, those of
    at least `min_us`: which call a kernel serves, where one kernel serves several (a peer's GEMMs)."""
    from torch.autograd import DeviceType

    device = DeviceType.CUDA if device is None else device
    kernels = sorted((e for e in events if e.device_type == device), key=lambda e: e.time_range.start)
    last = kernels[len(kernels) - len(kernels) // steps:]
    return [(e.name, e.time_range.elapsed_us()) for e in last if e.time_range.elapsed_us() >= min_us]


def breakdown(master, shape, x, dy, provider="ours", steps=5):
    """Per-kernel CUDA time of a provider's fwd+bwd (torch.profiler) and, for ours, what each
    autotuner picked."""
    from torch.profiler import ProfilerActivity, profile

    from moe_compiler import codegen

    T, d, n, E, K = shape
    run = provider_step(provider, master, shape, x, dy)

    def step():  # as the timed steps run: gradients dropped first, so none is accumulated (an add)
        run.zero()
        run.step()

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    rows = [(e.key, e.count // steps, e.device_time_total / steps) for e in prof.key_averages() if e.device_time_total > 0]
    rows.sort(key=lambda r: -r[2])
    flop = T * K * d * n
    gemm_flop = {"_up_proj_kernel": 6 * flop,  # forward up-proj + backward dA' (same kernel)
                 "_scatter_gemm_kernel": 6 * flop, "_scatter_gemm_tma_kernel": 6 * flop,  # Y and dX~
                 "_wgrad_kernel": 6 * flop}  # dW2 and dW1
    total = sum(r[2] for r in rows)
    print(f"  breakdown of {provider} ({steps} fwd+bwd steps, us per step; total {total:.0f} us):")
    for name, calls, us in rows[:20]:
        extra = f"  {gemm_flop[name] / us * 1e-6:.0f} TFLOPS" if name in gemm_flop else ""
        print(f"    {us:8.1f} us  x{calls:<2} {name[:90]}{extra}")
    step_kernels = launch_order(prof.events(), steps, min_us=0.0)
    small = [us for _, us in step_kernels if us < 10.0]
    print(f"  one step of {provider}: {len(step_kernels)} kernels, {len(small)} of them under 10 us "
          f"({sum(small):.0f} us together); in launch order, those of 10 us or more:")
    for i, (name, us) in enumerate((name, us) for name, us in step_kernels if us >= 10.0):
        print(f"    {i:3d} {us:8.1f} us  {name[:100]}")
    print("  under 10 us: " + "; ".join(f"{name[:48]} {us:.1f}" for name, us in step_kernels if us < 10.0))
    if not provider.startswith("ours"):
        return
    for tname in ("_up", "_scatter", "_dact", "_wgrad", "_up_tma", "_scatter_tma", "_dact_tma", "_wgrad_tma"):
        tuner = getattr(codegen.launch, tname)
        timings = getattr(tuner, "configs_timings", None) or {}
        best = sorted(((t if isinstance(t, float) else t[0]), str(c)) for c, t in timings.items())[:4]
        print(f"    {tname}: " + "; ".join(f"{t * 1e3:.0f}us {c}" for t, c in best))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap, out="bench_layer", warmup=10, iters=100, rounds=1, seed=0, shapes="7b-256",
                    providers="ours,ours-fused-router,sonic,liger,grouped_mm", iters_aliases=("--rep",),
                    shapes_help=f"comma list of {sorted(SHAPES)} or {sorted(SHAPE_GROUPS)}",
                    providers_help=f"comma list of {PROVIDERS}")
    ap.add_argument("--min-steps", type=int, default=1, help="at least this many timed calls per figure, whatever --iters")
    ap.add_argument("--breakdown", action="store_true",
                    help="also print the per-kernel times of ours, ours-* and sonic, and our tuned configs")
    ap.add_argument("--cuda-graph", action="store_true",
                    help="also time the fwd+bwd step replayed from a CUDA graph (its GPU time alone)")
    ap.add_argument("--kernel-time", action="store_true",
                    help="also report the GPU's busy time in an eager fwd+bwd step (torch.profiler): the "
                         "GPU-time figure of providers that cannot be captured in a CUDA graph")
    ap.add_argument("--step-times", action="store_true",
                    help="also report host ms, GPU-busy ms and wall ms of a normally launched fwd+bwd step")
    ap.add_argument("--host-profile", type=int, default=0, metavar="ROWS",
                    help="also print the top ROWS functions by own time of 10 enqueued fwd+bwd steps (cProfile)")
    ap.add_argument("--baseline", default="sonic", help="the provider the summary's ratios divide by")
    args = ap.parse_args(argv)
    args.iters = max(args.iters, args.min_steps)
    command = command_line(argv, __file__)
    print("command:", command, flush=True)
    try:
        shapes = resolve_shapes(args.shapes)
    except ValueError as exc:
        ap.error(str(exc))
    providers = args.providers
    for p in providers:
        if p not in PROVIDERS:
            ap.error(f"unknown provider {p}; choose from {PROVIDERS}")
    # the compiled providers (compile, sonic) add one Dynamo entry per shape to the same code object:
    # past the default limit of 8 the remaining shapes would silently run eagerly
    torch._dynamo.config.recompile_limit = 64
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}", flush=True)

    results = []
    for sname in shapes:
        T, d, n, E, K = shape = SHAPES[sname]
        master, x, dy = layer_inputs(shape, args.seed)
        ref = fp32_reference(master, x, dy, K)
        torch.cuda.empty_cache()
        for rnd_i, prov in ((i, p) for i in range(args.rounds) for p in providers):
            if prov == "loop" and T * K > LOOP_MAX_TK:
                continue
            try:
                r = bench_one(prov, master, shape, x, dy, ref, args)
            except ImportError as exc:
                print(f"  skip {prov}: {exc}", flush=True)
                continue
            except torch.OutOfMemoryError as exc:
                print(f"  skip {prov} at {sname}: out of memory ({exc})", flush=True)
                torch.cuda.empty_cache()
                continue
            except Exception as exc:  # a peer failing must not lose the other providers' numbers
                print(f"  skip {prov} at {sname}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                torch.cuda.empty_cache()
                continue
            r.update(shape=sname, T=T, d=d, n=n, E=E, K=K, provider=prov, round=rnd_i)
            results.append(r)
            print(f"{sname:>10} {prov:>10}: fwd {r['fwd_tflops']:6.1f}  bwd {r['bwd_tflops']:6.1f}  "
                  f"fwd+bwd {r['fwdbwd_tflops']:6.1f} TFLOPS  act {r['act_gib']:.2f} GiB  peak {r['peak_gib']:.2f} GiB"
                  f"  err {r['max_rel_err']:.1e}  first {r['first_call_s']:.1f}s"
                  + (f"  graph fwd+bwd {r['graph_fwdbwd_tflops']:6.1f}" if "graph_fwdbwd_tflops" in r else "")
                  + (f"  busy fwd+bwd {r['busy_fwdbwd_tflops']:6.1f}" if "busy_fwdbwd_tflops" in r else "")
                  + (f"  step host/busy/wall ms {_ms(r['step_host_ms'])}/{_ms(r['step_busy_ms'])}/"
                     f"{_ms(r['step_wall_ms'])}" if "step_wall_ms" in r else "")
                  + (f"  wgrad {r['wgrad_choice']}" if r.get("wgrad_choice") else ""), flush=True)
            torch.cuda.empty_cache()
        if args.breakdown:
            for prov in [p for p in dict.fromkeys(providers) if p.startswith("ours") or p == "sonic"] or ["ours"]:
                breakdown(master, shape, x, dy, prov)
        del master, x, dy, ref
        torch.cuda.empty_cache()

    summary = summarize(results, args.baseline)
    path = write_json(os.path.join(args.out, "results.json"), dict(results=results, summary=summary), command=command)
    print_results(results)
    print_summary(summary, args.baseline)
    graphs = all("graph_fwdbwd_tflops" in row for row in summary)
    png = plot(summary, args.out, "graph_fwdbwd_tflops" if graphs else "fwdbwd_tflops")
    print(f"\nwrote {path}" + (" and tflops.png" if png else ""))
    return results


def _ms(value):
    return "-" if value is None else f"{value:.3f}"


_SUMMARIZED = ("fwdbwd_tflops", "graph_fwdbwd_tflops", "busy_fwdbwd_tflops", "peak_gib", "act_gib",
               "step_host_ms", "step_busy_ms", "step_wall_ms")


def summarize(results, baseline):
    """One row per (shape, provider), in first-seen order: the median over its rounds of each figure
    in _SUMMARIZED, the rounds it ran, and the ratio of its medians (eager and graph TFLOPS) to
    those of `baseline` at that shape (absent where the baseline did not run)."""
    rows = {}
    for r in results:
        rows.setdefault((r["shape"], r["provider"]), []).append(r)
    summary = []
    for (shape, prov), runs in rows.items():
        row = dict(shape=shape, provider=prov, rounds=len(runs))
        for key in _SUMMARIZED:
            values = [r[key] for r in runs if r.get(key) is not None]
            if values:
                row[key] = statistics.median(values)
                row[key + "_all"] = values
        summary.append(row)
    for row in summary:
        base = next((b for b in summary if b["shape"] == row["shape"] and b["provider"] == baseline), None)
        for key in ("fwdbwd_tflops", "graph_fwdbwd_tflops", "busy_fwdbwd_tflops"):
            if base is not None and key in row and base.get(key):
                row[key.replace("tflops", "ratio")] = row[key] / base[key]
    return summary


def print_summary(summary, baseline):
    """The medians over rounds and their ratios to `baseline`: printed where some provider ran more
    than one round or a ratio exists."""
    if not any(row["rounds"] > 1 for row in summary) and not any("fwdbwd_ratio" in row for row in summary):
        return
    graphs = any("graph_fwdbwd_tflops" in row for row in summary)
    busy = any("busy_fwdbwd_tflops" in row for row in summary)
    steps = any("step_wall_ms" in row for row in summary)
    columns = ["shape", "provider", "rounds", "fwd+bwd TFLOPS", "ratio"]
    keys = ["shape", "provider", "rounds", "fwdbwd_tflops", "fwdbwd_ratio"]
    if graphs:
        columns += ["CUDA graph", "ratio"]
        keys += ["graph_fwdbwd_tflops", "graph_fwdbwd_ratio"]
    if busy:
        columns += ["GPU busy", "ratio"]
        keys += ["busy_fwdbwd_tflops", "busy_fwdbwd_ratio"]
    if steps:
        columns += ["step host ms", "step busy ms", "step wall ms"]
        keys += ["step_host_ms", "step_busy_ms", "step_wall_ms"]
    columns.append("peak GiB")
    keys.append("peak_gib")
    formats = {c: ".3f" if k.endswith(("ratio", "_ms")) else ".2f" if k.endswith("gib") else ".1f"
               for c, k in zip(columns, keys) if k not in ("shape", "provider", "rounds")}
    print_table(columns, [[row.get(k) for k in keys] for row in summary], formats,
                title=f"medians over rounds; ratios to {baseline}'s medians")


def print_results(results):
    """One row per timed (shape, provider, round)."""
    graphs = any("graph_fwdbwd_tflops" in r for r in results)
    steps = any("step_wall_ms" in r for r in results)
    columns = ["shape", "provider", "fwd", "bwd", "fwd+bwd TFLOPS", *(["CUDA graph"] if graphs else []),
               *(["step host ms", "step busy ms", "step wall ms"] if steps else []),
               "act GiB", "peak GiB", "max rel err", "first call s"]
    keys = ["shape", "provider", "fwd_tflops", "bwd_tflops", "fwdbwd_tflops",
            *(["graph_fwdbwd_tflops"] if graphs else []),
            *(["step_host_ms", "step_busy_ms", "step_wall_ms"] if steps else []),
            "act_gib", "peak_gib", "max_rel_err", "first_call_s"]
    spec = {"fwd_tflops": ".0f", "bwd_tflops": ".0f", "fwdbwd_tflops": ".0f", "graph_fwdbwd_tflops": ".0f",
            "step_host_ms": ".3f", "step_busy_ms": ".3f", "step_wall_ms": ".3f", "act_gib": ".2f", "peak_gib": ".2f",
            "max_rel_err": ".1e", "first_call_s": ".1f"}
    print_table(columns, [[r.get(k) for k in keys] for r in results],
                {c: spec[k] for c, k in zip(columns, keys) if k in spec})


def plot(rows, out, key="fwdbwd_tflops"):
    """rows' `key` (fwd+bwd TFLOPS: eager, or "graph_fwdbwd_tflops") per shape and provider, one row
    each: a bar chart in out/tflops.png (False when matplotlib does not import)."""
    ylabel = "fwd+bwd TFLOPS (18TKdn / time)" + (", CUDA graph" if key.startswith("graph") else "")
    return bar_chart(os.path.join(out, "tflops.png"), rows, key, ylabel=ylabel)


if __name__ == "__main__":
    main()
