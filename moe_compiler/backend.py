"""`torch.compile(model, backend="sonic")`: rewrite MoE regions, then hand the graph to Inductor."""
from __future__ import annotations

import functools
import hashlib
import pathlib
from typing import Any, Mapping

import torch
import torch.fx as fx

from .grad_fold import fold_input_grads
from .options import split_options
from .passes import run_passes

_SALT_HOOK = "post_grad_custom_post_pass"


def _package_dirs() -> list[pathlib.Path]:
    """The folders of our three packages: beside each other in a checkout, nested when installed."""
    import moe_compiler
    import moe_compiler.codegen
    import moe_compiler.patterns

    packages = (moe_compiler, moe_compiler.patterns, moe_compiler.codegen)
    return [pathlib.Path(m.__file__).resolve().parent for m in packages]


@functools.cache
def source_hash() -> str:
    """sha256 of every .py file of our three packages: a code change is a new cache key."""
    # installed, moe_compiler's folder holds the other two: each file is hashed once
    files = {path: path.relative_to(root.parent) for root in _package_dirs() for path in root.rglob("*.py")}
    digest = hashlib.sha256()
    for path in sorted(files):
        digest.update(str(files[path]).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def call_nograd_overloads(graph: fx.Graph) -> int:
    """Point every `sonic::<op>.default` call of a compiled (post-grad) graph at `sonic::<op>.nograd`
    (codegen/nograd.py); returns how many. AOTAutograd has differentiated the graph already, so the
    custom op's Python autograd and checking layers around each call would only cost host time: at
    7b-256 on the H100 they took the largest share of the enqueue time of a step (cProfile, `bench_layer.py
    --host-profile`). The graphs run with grad mode off, where `nograd` takes every call."""
    from moe_compiler.codegen import nograd

    if not nograd.USE_NOGRAD:
        return 0
    count = 0
    for node in graph.nodes:
        target = node.target
        if (node.op == "call_function" and isinstance(target, torch._ops.OpOverload) and target.namespace == "sonic"
                and target._overloadname == "default" and "nograd" in target.overloadpacket.overloads()):
            node.target = target.overloadpacket.nograd
            count += 1
    return count


def _post_grad_pass(user_pass=None, fold_input_grad: bool = True):
    """Our Inductor post-grad pass: `grad_fold` on each graph (when on), the `nograd` overloads
    (`call_nograd_overloads`), then the user's pass.

    It also salts the FX graph cache key: our op bodies and autograd formulas are not in Inductor's
    cache key (FINDINGS.md section 2), so without this a warm cache would serve a graph built
    against old kernels. The hook takes one pass in torch 2.11; a pass the user set there is
    wrapped and still runs.
    """
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class SonicPostGrad(CustomGraphPass):
        def __call__(self, graph):
            if fold_input_grad:
                fold_input_grads(graph)
            call_nograd_overloads(graph)
            if user_pass is not None:
                user_pass(graph)

        def uuid(self):
            from moe_compiler.codegen import nograd

            inner = user_pass.uuid() if user_pass is not None and hasattr(user_pass, "uuid") else None
            return ("moe_compiler", source_hash(), fold_input_grad, nograd.USE_NOGRAD, inner)

    return SonicPostGrad()


def inductor_patches(inductor_options: Mapping[str, Any], mode: str | None, fold_input_grad: bool = True) -> dict[str, Any]:
    patches: dict[str, Any] = {}
    if mode not in (None, "default"):
        patches.update(torch._inductor.list_mode_options(mode))
    patches.update(inductor_options)
    patches[_SALT_HOOK] = _post_grad_pass(patches.get(_SALT_HOOK), fold_input_grad)
    return patches


def sonic_backend(gm: fx.GraphModule, example_inputs, *, options: Mapping[str, Any] | None = None, mode: str | None = None):
    """The `sonic` Dynamo backend. Options named `sonic.<field>` configure us (see SonicOptions);
    everything else, and `mode`, goes to Inductor's compile_fx."""
    sonic_options, inductor_options = split_options(options)
    run_passes(gm, sonic_options)
    if sonic_options.compiler == "eager":
        return gm.forward
    if sonic_options.compiler == "aot_eager":
        from torch._dynamo.backends.debugging import aot_eager

        return aot_eager(gm, example_inputs)
    from torch._inductor.compile_fx import compile_fx

    patches = inductor_patches(inductor_options, mode, fold_input_grad=sonic_options.enabled and sonic_options.fold_input_grad)
    return compile_fx(gm, example_inputs, config_patches=patches)
