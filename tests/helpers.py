"""Named invariants shared by the tests: run eager vs compiled, compare with a reasoned tolerance."""
from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from unittest import mock

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



def run_interpreted_child(test_file: str, *pytest_args: str, timeout: int) -> dict[str, int]:
    """Run `test_file`'s non-GPU tests in a child pytest with TRITON_INTERPRET=1 (Triton reads the
    flag at import, so it cannot change in this process); assert it passed; return its counts
    ({"passed": .., "skipped": .., "failed": ..} as the summary line gives them)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-m", "not gpu", "-p", "no:cacheprovider", *pytest_args,
         os.path.abspath(test_file)],
        cwd=root, env=env, capture_output=True, text=True, timeout=timeout,
    )
    summary = (proc.stdout.strip().splitlines() or [""])[-1]
    assert proc.returncode == 0, (
        f"interpreted tests of {os.path.basename(test_file)} failed ({summary}):\n{proc.stdout[-6000:]}\n{proc.stderr[-2000:]}")
    return {word: int(num) for num, word in re.findall(r"(\d+) (passed|skipped|failed)", summary)}


@contextlib.contextmanager
def nan_filled_buffers():
    """Inside: every floating tensor made by `torch.empty_like` or `Tensor.new_empty` starts as NaN, so
    a kernel that reads memory it never wrote shows it (fresh memory tends to hold zeros)."""
    empty_like, new_empty = torch.empty_like, torch.Tensor.new_empty

    def nan_like(t, *args, **kwargs):
        out = empty_like(t, *args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    def new_nan(t, *size, **kwargs):
        out = new_empty(t, *size, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    with mock.patch.object(torch, "empty_like", nan_like), mock.patch.object(torch.Tensor, "new_empty", new_nan):
        yield
