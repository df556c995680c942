"""The ops' `nograd` overloads (codegen/nograd.py): same results as `default`, picked only where no
gradient can flow (eager wrappers and the rewrite), and refusing a call that wants one."""
from __future__ import annotations

import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code
from torch.utils._python_dispatch import TorchDispatchMode

import moe_compiler  # noqa: F401  (registers the backend)
from moe_compiler.codegen import moe_experts, moe_experts_list, route
from moe_compiler.backend import sonic_backend

from .test_op import make_inputs

FLAGS = ("swiglu", False, False, 1.702, 7.0)
ROUTE_ARGS = (2, "softmax", False, True, 0.0, 1.0, 1, 1, float("-inf"), torch.float32)


class _Overloads(TorchDispatchMode):
    """Records the `sonic::` overloads that reach the backend kernels."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "sonic":
            self.seen.append(f"{func._schema.name}.{func._overloadname}")
        return func(*args, **(kwargs or {}))


def _stacked():
    x, ids, w, w1, w2, b1, b2 = make_inputs(bias=True)
    return x, ids, w, w1, w2, b1, b2


def _lists(w1, w2):
    n = w1.shape[1] // 2
    return list(w1[:, :n]), list(w1[:, n:]), list(w2)


def test_nograd_overloads_compute_what_default_does():
    x, ids, w, w1, w2, b1, b2 = _stacked()
    args = (x, ids, w, w1, w2, b1, b2, *FLAGS, False)
    for a, b in zip(torch.ops.sonic.moe_experts.default(*args), torch.ops.sonic.moe_experts.nograd(*args)):
        assert torch.equal(a, b)
    gate, up, down = _lists(w1, w2)
    largs = (x, ids, w, gate, up, down, b1, b2, "swiglu", False, 1.702, 7.0, False)
    for a, b in zip(torch.ops.sonic.moe_experts_list.default(*largs), torch.ops.sonic.moe_experts_list.nograd(*largs)):
        assert torch.equal(a, b)
    logits = torch.randn(9, 6, dtype=torch.float64)
    for a, b in zip(torch.ops.sonic.route.default(logits, None, *ROUTE_ARGS),
                    torch.ops.sonic.route.nograd(logits, None, *ROUTE_ARGS)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("leaf", ["x", "w1", "weights", "list_weight", "logits"])
def test_nograd_refuses_a_call_that_wants_a_gradient(leaf):
    x, ids, w, w1, w2, b1, b2 = _stacked()
    gate, up, down = _lists(w1, w2)
    logits = torch.randn(9, 6, dtype=torch.float64)
    {"x": x, "w1": w1, "weights": w, "list_weight": up[2], "logits": logits}[leaf].requires_grad_()
    calls = {
        "logits": lambda: torch.ops.sonic.route.nograd(logits, None, *ROUTE_ARGS),
        "list_weight": lambda: torch.ops.sonic.moe_experts_list.nograd(x, ids, w, gate, up, down, b1, b2, "swiglu",
                                                                      False, 1.702, 7.0, False),
    }
    call = calls.get(leaf, lambda: torch.ops.sonic.moe_experts.nograd(x, ids, w, w1, w2, b1, b2, *FLAGS, False))
    with pytest.raises(RuntimeError, match="has no gradient, and this call wants one"):
        call()
    with torch.no_grad():
        call()  # the same call where no gradient can flow


def test_the_packet_resolves_to_default():
    """`torch.ops.sonic.<op>(...)` picks `default` (first in resolution order), so it keeps its gradient."""
    x, ids, w, w1, w2, b1, b2 = _stacked()
    w1.requires_grad_()
    out = torch.ops.sonic.moe_experts(x, ids, w, w1, w2, b1, b2, *FLAGS, False)[0]
    assert torch.autograd.grad(out.sum(), w1)[0].abs().sum() > 0
    logits = torch.randn(9, 6, dtype=torch.float64, requires_grad=True)
    weights, _ = torch.ops.sonic.route(logits, None, *ROUTE_ARGS)
    assert torch.autograd.grad(weights[:, 0].sum(), logits)[0].abs().sum() > 0


def test_eager_wrappers_pick_the_overload():
    x, ids, w, w1, w2, b1, b2 = _stacked()
    w1.requires_grad_()
    gate, up, down = _lists(w1.detach(), w2)
    logits = torch.randn(9, 6, dtype=torch.float64, requires_grad=True)

    def run():
        moe_experts(x, ids, w, w1, w2, b1, b2)
        moe_experts_list(x, ids, w, gate, up, down)  # no list tensor wants a gradient
        route(logits, 2)

    with _Overloads() as grad_on:
        run()
    with torch.no_grad(), _Overloads() as grad_off:
        run()
    assert grad_on.seen == ["sonic::moe_experts.default", "sonic::moe_experts_list.nograd", "sonic::route.default"]
    assert grad_off.seen == ["sonic::moe_experts.nograd", "sonic::moe_experts_list.nograd", "sonic::route.nograd"]


def _compiled_targets(model, run):
    """The `sonic::` targets of every graph the backend rewrote while `run(compiled)` ran."""
    targets = []

    def spy(gm, example_inputs):
        fn = sonic_backend(gm, example_inputs, options={"sonic.compiler": "aot_eager"})
        targets.extend(sorted(str(n.target) for n in gm.graph.nodes
                              if n.op == "call_function" and str(n.target).startswith("sonic.")))
        return fn

    torch._dynamo.reset()
    run(torch.compile(model, backend=spy))
    return targets


class _Block(torch.nn.Module):
    """The model's logits under a grad-mode block inside the compiled frame itself."""

    def __init__(self, model, block):
        super().__init__()
        self.model, self.block = model, block

    def forward(self, ids):
        if self.block is None:
            return self.model(ids).logits
        with self.block():
            return self.model(ids).logits


@pytest.mark.parametrize("mode", ["train", "no_grad", "frozen", "no_grad_block", "enable_grad_block"])
def test_rewrite_picks_the_overload(mode):
    """The rewrite emits `nograd` only where the traced program shows no gradient can flow; where one
    can (a training step, or an `enable_grad` block inside a frame entered under no_grad), outputs and
    gradients equal eager's."""
    from moe_compiler.testing import tiny_moe_model

    model = tiny_moe_model("qwen3_moe", num_hidden_layers=1)
    if mode == "frozen":
        model.requires_grad_(False)
    block = {"no_grad_block": torch.no_grad, "enable_grad_block": torch.enable_grad}.get(mode)
    wrapped = _Block(model, block)
    ids = torch.randint(0, model.config.vocab_size, (2, 5))

    def run(m):
        if mode in ("no_grad", "enable_grad_block"):
            with torch.no_grad():
                return m(ids)
        return m(ids)

    want = run(wrapped)
    got = []
    targets = _compiled_targets(wrapped, lambda compiled: got.append(run(compiled)))
    torch.testing.assert_close(got[0], want, rtol=2e-5, atol=2e-5)
    wants_grad = mode in ("train", "enable_grad_block")
    overload = "default" if wants_grad else "nograd"
    assert targets == [f"sonic.moe_experts.{overload}", f"sonic.route.{overload}"], targets
    assert got[0].requires_grad == wants_grad
    if wants_grad:
        params = [p for p in model.parameters() if p.requires_grad]
        for a, b in zip(torch.autograd.grad(got[0].sum(), params), torch.autograd.grad(want.sum(), params)):
            torch.testing.assert_close(a, b, rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("use_nograd", [True, False])
def test_compiled_training_step_calls_nograd(use_nograd, monkeypatch):
    """Through Inductor, a training step's forward and backward graphs call every `sonic::` op (the
    router, the experts, the split backward's parts) through `nograd`: AOTAutograd has differentiated
    them, so custom_op's Python layers would only cost host time. `nograd.USE_NOGRAD = False` keeps
    `default`. Outputs and gradients equal eager's either way."""
    from moe_compiler.codegen import nograd
    from moe_compiler.testing import tiny_moe_model

    monkeypatch.setattr(nograd, "USE_NOGRAD", use_nograd)
    torch._dynamo.reset()
    model = tiny_moe_model("qwen3_moe", num_hidden_layers=1)
    ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    params = [p for p in model.parameters() if p.requires_grad]
    want = model(ids).logits
    want_grads = torch.autograd.grad(want.sum(), params)
    compiled = torch.compile(model, backend="sonic", options={"sonic.fallback": False})
    got = []
    _, code = run_and_get_code(lambda: got.append(compiled(ids).logits))  # the forward's code
    got = got[0]
    got_grads, bwd_code = run_and_get_code(lambda: torch.autograd.grad(got.sum(), params))
    calls = re.findall(r"torch\.ops\.sonic\.(\w+)\.(\w+)\(", "\n".join(code + bwd_code))
    overload = "nograd" if use_nograd else "default"
    assert {"moe_experts", "route", "route_backward",
            *(f"moe_experts_backward_{part}" for part in ("act", "dw2", "dw1", "dx"))} == {op for op, _ in calls}, calls
    assert {o for _, o in calls} == {overload}, calls
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=2e-4, atol=2e-5)


@pytest.mark.gpu
def test_gpu_inference_graph_runs_nograd_kernels():
    """On CUDA through Inductor (the Triton kernels, bf16): a no_grad forward compiles to the `nograd`
    overloads and matches eager as closely as eager matches float32."""
    from moe_compiler.testing import closeness, tiny_moe_model

    model = tiny_moe_model("qwen3_moe", num_hidden_layers=2).cuda()
    truth_model = tiny_moe_model("qwen3_moe", num_hidden_layers=2).cuda()
    model.to(torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (3, 17), device="cuda")
    targets = []

    def spy(gm, example_inputs):
        fn = sonic_backend(gm, example_inputs)
        targets.extend(str(n.target) for n in gm.graph.nodes if str(n.target).startswith("sonic."))
        return fn

    with torch.no_grad():
        truth = truth_model(ids).logits
        want = model(ids).logits
        got = torch.compile(model, backend=spy)(ids).logits
    assert sorted(set(targets)) == ["sonic.moe_experts.nograd", "sonic.route.nograd"], targets
    ok, why = closeness(got.float(), want.float(), truth, dtype=torch.bfloat16)
    assert ok, why


def test_nograd_opcheck():
    """The overloads' fakes, schemas and AOT dispatch agree with their implementations (no autograd
    registration to check: they have none by design, and no input here wants a gradient)."""
    x, ids, w, w1, w2, b1, b2 = _stacked()
    x, w, w1, w2, b1, b2 = (t.float() for t in (x, w, w1, w2, b1, b2))
    gate, up, down = _lists(w1, w2)
    utils = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.sonic.moe_experts.nograd, (x, ids, w, w1, w2, b1, b2, *FLAGS, False),
                          test_utils=utils)
    torch.library.opcheck(torch.ops.sonic.moe_experts_list.nograd,
                          (x, ids, w, gate, up, down, b1, b2, "swiglu", False, 1.702, 7.0, False), test_utils=utils)
    torch.library.opcheck(torch.ops.sonic.route.nograd, (torch.randn(9, 6), None, *ROUTE_ARGS), test_utils=utils)
