"""Named invariants shared by the tests: run eager vs compiled, compare with a reasoned tolerance."""
from __future__ import annotations

import torch

from moe_compiler.testing import closeness, rel_err  # noqa: F401  (the tolerance table lives there)


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
    ok, why = closeness(got, eager, truth, dtype)
    assert ok, f"{what}: {why}"


def profiled_op_names(fn) -> set[str]:
    with torch.profiler.profile() as prof:
        fn()
    return {evt.name for evt in prof.events()}

