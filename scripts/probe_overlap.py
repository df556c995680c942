"""Would the backward gain from running its memory-bound dX gather-sum on a second stream beside a
weight-gradient GEMM (GPU)? The gather-sum is the one the compiled backward runs: TILE-order dX~ rows
through their row map, with the router's term (dL @ Wr, `grad_fold`) folded in. Times, at each
shape, that gather-sum alone (its launch, and one token block a program), dW1 and dW2 alone (the
measured choices), the gather-sum then dW1 (and dW1 + dW2) one after the other, and beside them on
a side stream (joined by events, no host sync); then the Gluon weight gradients on 0-24 fewer SMs
than the GPU has, alone and with the gather-sum beside them. Median us, triton.testing.do_bench.

    PYTHONPATH=. python scripts/probe_overlap.py --shapes 7b-256,1.4b-256

H100, thirty-third session (docs/BENCHMARKS.md): beside dW1 alone, or beside a Gluon GEMM on fewer
SMs, nothing was gained (-50 to +13 us; the GEMM slows as much as the overlap hides, as the
seventeenth session found with the plain gather-sum). Beside dW1 then dW2 on all SMs, 7b-256 saved
43.7 us (1148.6 -> 1104.9) and 1.4b-256 nothing (-3.2): not wired in (the backward would have to
hold dX~'s rows through both weight gradients).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

from bench_layer import SHAPES  # noqa: E402

from moe_compiler.codegen import triton_moe as tm  # noqa: E402


def _time(fn, rep):
    return do_bench(fn, warmup=25, rep=rep, return_mode="median") * 1e3


def probe(shape, rep):
    T, d, n, E, K = shape
    dev, dt = "cuda", torch.bfloat16
    torch.manual_seed(0)
    x = torch.randn(T, d, device=dev, dtype=dt)
    w1 = (torch.randn(E, 2 * n, d, device=dev) / d ** 0.5).to(dt)
    w2 = (torch.randn(E, d, n, device=dev) / n ** 0.5).to(dt)
    ids = torch.randn(T, E, device=dev).topk(K, -1).indices
    w = torch.rand(T, K, device=dev).softmax(-1).to(dt)
    flags = dict(activation="swiglu", interleaved=False, alpha=1.702, limit=7.0)
    _, h, sorted_rows, offsets = tm.triton_moe_experts_fwd(x, ids, w, w1, w2, None, None, transposed=False,
                                                           save_h=True, **flags)
    W1, W2 = tm._stacked_banks(w1, w2, False)
    dy = torch.randn(T, d, device=dev, dtype=dt)
    s_flat = w.reshape(-1)
    routing = dict(sorted_rows=sorted_rows, offsets=offsets, top_k=K, row_token=None)
    dh, a_scaled, _ = tm.triton_moe_dact(dy, W2, h, s_flat, n=n, **routing, **flags)
    # dX as the compiled backward runs it: TILE-order dX~ rows, the router's term (dL @ Wr) folded in
    dx_rows, rows = tm.triton_moe_scatter_gemm(dh, W1, W1.strides, None, sorted_rows, offsets, n_dim=d,
                                               split=W1.split, row_map=True)
    product = (torch.randn(T, E, device=dev, dtype=dt) * 1e-3, torch.randn(E, d, device=dev, dtype=dt))
    base = tm.gather_sum_product_launch(d, E, K)
    launches = {"": base, " (block a program)": base._replace(waves=0)}

    def gs(launch=base):
        return lambda: tm.triton_moe_gather_sum(dx_rows, None, T, K, dt, product=product, launch=launch,
                                                row_map=rows)

    def dw1():
        return tm._weight_grad(dh, x, tm.GradBuffer(w1, False), gather_lhs=False, gather_rhs=True, db=None, **routing)

    def dw2():
        return tm._weight_grad(dy, a_scaled, tm.GradBuffer(w2, False), gather_lhs=True, gather_rhs=False, db=None,
                               s_flat=s_flat, **routing)

    side = torch.cuda.Stream()

    def overlapped(sum_fn, *gemms, gemm_first=False):
        """The gather-sum on `side` beside `gemms` on the current stream, both from the same point of
        it; `gemm_first`: the GEMMs are enqueued before the gather-sum."""
        def fn():
            main = torch.cuda.current_stream()
            side.wait_stream(main)
            if gemm_first:
                for g in gemms:
                    g()
            with torch.cuda.stream(side):
                out = sum_fn()
            if not gemm_first:
                for g in gemms:
                    g()
            main.wait_stream(side)
            out.record_stream(main)
        return fn

    def serial(*fns):
        def fn():
            for f in fns:
                f()
        return fn

    dw1(), dw2()  # the measured choices, before timing
    torch.cuda.synchronize()
    ref = gs()()
    with torch.cuda.stream(side):
        side.wait_stream(torch.cuda.current_stream())
        again = gs()()
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(ref, again)
    rows_us = {f"gather-sum dX{k}": _time(gs(v), rep) for k, v in launches.items()}
    rows_us.update({"dW1": _time(dw1, rep), "dW2": _time(dw2, rep)})
    for name, gemms in (("dW1", (dw1,)), ("dW1+dW2", (dw1, dw2))):
        rows_us[f"gs ; {name}"] = _time(serial(gs(), *gemms), rep)
        rows_us[f"gs || {name}"] = _time(overlapped(gs(), *gemms), rep)
    gluon = tm._gluon_module("gluon_wgrad", x)
    if gluon is None:
        return rows_us
    sms = tm._programs(x.device)

    def gluon_dw(which, programs):
        if which == "dW1":
            args, out = (dh, x), tm.GradBuffer(w1, False)
            kw = dict(gather_lhs=False)
        else:
            args, out = (dy, a_scaled), tm.GradBuffer(w2, False)
            kw = dict(gather_lhs=True)

        def fn():
            dw, strides = out.empty(x.device)
            return gluon.gluon_wgrad(*args, **kw, sorted_rows=sorted_rows, offsets=offsets, top_k=K, dw=dw,
                                     dw_strides=strides, num_programs=programs)
        return fn

    for free in (0, 4, 8, 12, 16, 24):
        g1, g2 = gluon_dw("dW1", sms - free), gluon_dw("dW2", sms - free)
        rows_us[f"gluon dW1 on {sms - free} SMs"] = _time(g1, rep)
        rows_us[f"gluon dW2 on {sms - free} SMs"] = _time(g2, rep)
        for k, v in launches.items():
            rows_us[f"gs{k} || gluon dW1/{sms - free}"] = _time(overlapped(gs(v), g1, gemm_first=True), rep)
            rows_us[f"gs{k} || gluon dW1+dW2/{sms - free}"] = _time(overlapped(gs(v), g1, g2, gemm_first=True), rep)
    return rows_us


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="7b-256")
    ap.add_argument("--rep", type=int, default=200)
    args = ap.parse_args()
    for name in args.shapes.split(","):
        rows = probe(SHAPES[name], args.rep)
        print(f"{name} {SHAPES[name]}", flush=True)
        for k, us in rows.items():
            print(f"  {k:40s} {us:9.1f} us", flush=True)
        for g in ("dW1", "dW1+dW2"):
            s, o = rows[f"gs ; {g}"], rows[f"gs || {g}"]
            print(f"  overlap with {g} (the choice, all SMs): saves {s - o:.1f} us", flush=True)
        serial = {"dW1": rows["gs ; dW1"], "dW1+dW2": rows["gs ; dW1+dW2"]}
        for k in [k for k in rows if " || gluon" in k]:
            which = k.split(" || gluon ")[1].split("/")[0]
            print(f"  {k}: saves {serial[which] - rows[k]:.1f} us against gs ; {which} (the choice)", flush=True)


if __name__ == "__main__":
    main()
