"""Named invariants shared by the tests: run eager vs compiled, compare with a reasoned tolerance."""
from __future__ import annotations

import torch

import moe_compiler

# Relative-norm tolerance when the compiled model runs in the same dtype as its eager twin and both
# are compared directly (fp32: only summation order differs). Lower precisions are judged against
# an fp32 copy of the model instead: err(sonic) <= LOW_PRECISION_FACTOR * err(eager) + floor.
FP32_RTOL = 2e-5
LOW_PRECISION_FACTOR = 2.0
LOW_PRECISION_FLOOR = {torch.float16: 2e-3, torch.bfloat16: 1e-2}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=ids)
    out.loss.backward()
    grads = {
        n.removeprefix("_orig_mod."): p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None
    }
    return out.logits.detach(), grads


def compile_sonic(model, **options):
    opts = {"sonic.fallback": False, **{f"sonic.{k}": v for k, v in options.items()}}
    return torch.compile(model, backend="sonic", options=opts)


def assert_close_to_eager(got, eager, truth=None, dtype=torch.float32, what=""):
    """fp32: got ~ eager directly. fp16/bf16: got is as close to the fp32 truth as eager is."""
    if truth is None or dtype == torch.float32:
        err = rel_err(got, eager)
        assert err <= FP32_RTOL, f"{what}: rel err {err:.2e} vs eager > {FP32_RTOL}"
        return
    ours, theirs = rel_err(got, truth), rel_err(eager, truth)
    bound = LOW_PRECISION_FACTOR * theirs + LOW_PRECISION_FLOOR[dtype]
    assert ours <= bound, f"{what}: err(sonic, fp32)={ours:.2e} > {LOW_PRECISION_FACTOR}*err(eager, fp32)={theirs:.2e} + floor"


def profiled_op_names(fn) -> set[str]:
    with torch.profiler.profile() as prof:
        fn()
    return {evt.name for evt in prof.events()}


__all__ = ["moe_compiler"]
