"""A library's own op, proven by evaluation to compute a known torch op, becomes that op.

Libraries wrap plain tensor ops in custom ops of their own: torchtitan 0.3 combines the experts'
rows with `torchtitan::deterministic_scatter_add(out, index, src)`, a `scatter_add` along dim 0
run with deterministic algorithms. Dynamo traces such an op as one opaque node, and no finder can
see what it adds where. `opaque_op_to_torch` asks the op itself: it runs the op and each candidate
below on probe tensors shaped as the node's arguments, and replaces the node by the candidate when
both its value and its gradients agree on every probe:

    lib::op(out [T, D], index int [N, D], src [N, D]) -> [T, D]   ==  torch.scatter_add(out, 0, index, src)
    lib::op(out [T, D], index int [N], src [N, D])    -> [T, D]   ==  torch.index_add(out, 0, index, src)

Probes: float64 values (the op's own dtype where it refuses float64, then equality must be exact),
indices drawn from the rows of `out` with repeats, all on one row, and an index expanded along the
columns as the libraries build it; the gradients of `out` and `src` against a random cotangent.
Only a call whose `out` is a fresh zeros tensor (a combine's shape) is probed, so an op with
effects elsewhere (a collective of a library's own) is never run at compile time. An op that
mutates its inputs, fails a probe, or has no autograd formula where a gradient is asked stays as it
is. The probes run where the node's tensors live, at tiny sizes, once per node.

A node left as it is says why in `node.meta[REFUSED]` (`refusal`), which the finders' rejections
quote. A replaced node keeps its original call in `node.meta[ORIGINAL]`: where no rewritten region takes
it, the pass driver puts the library's op back (`restore_opaque_ops`), so the graph keeps the
library's op (and its determinism) outside the regions the sonic op replaces.
"""
from __future__ import annotations

import logging

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from .common import ZEROS, example_value, insert_call, is_call

log = logging.getLogger("moe_compiler")

ORIGINAL = "sonic_opaque_original"
REFUSED = "sonic_opaque_refused"
_TORCH_NAMESPACES = {"aten", "prims", "prim", "sonic", "higher_order", "_c10d_functional", "c10d", "inductor"}
_PROBE_ROWS, _PROBE_COLS = 5, 3  # `out` of a probe; index and src take 2 * rows + 1 rows (repeats)


def _library_op(target) -> bool:
    """A torch.library op of a namespace outside torch's own (a library's, or a user's)."""
    if isinstance(target, torch._ops.OpOverloadPacket):
        namespace = target._qualified_op_name.split("::")[0]
    elif isinstance(target, torch._ops.OpOverload):
        namespace = target.namespace
    else:
        return False
    return namespace not in _TORCH_NAMESPACES


def _mutates(target) -> bool:
    overloads = [target] if isinstance(target, torch._ops.OpOverload) else [
        getattr(target, name) for name in target.overloads()]
    return any(a.alias_info is not None and a.alias_info.is_write for o in overloads for a in o._schema.arguments)


def _candidates(out, index, src):
    """(name, torch function of (out, index, src)) the node's argument shapes allow."""
    if out.dim() != 2 or src.dim() != 2 or src.shape[1] != out.shape[1] or index.dtype.is_floating_point:
        return []
    if index.dim() == 2 and index.shape == src.shape:
        return [("scatter_add", lambda o, i, s: torch.scatter_add(o, 0, i, s), torch.scatter_add)]
    if index.dim() == 1 and index.shape[0] == src.shape[0]:
        return [("index_add", lambda o, i, s: torch.index_add(o, 0, i, s), torch.index_add)]
    return []


def _probes(out, index, dtype):
    """(out, index, src) probe triples on `out`'s device: [R, C] rows, indices with repeats, all on
    one row, and expanded along the columns (a stride-0 index, as `tok.reshape(-1, 1).expand(-1, C)`)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    R, C, N = _PROBE_ROWS, _PROBE_COLS, 2 * _PROBE_ROWS + 1
    device = out.device
    rows = [torch.randint(0, R, (N,), generator=g), torch.full((N,), R - 1), torch.arange(N) % R]
    triples = []
    for r in rows:
        r = r.to(device=device, dtype=index.dtype)
        idx = r.reshape(-1, 1).expand(-1, C) if index.dim() == 2 else r
        for contiguous in ((True, False) if index.dim() == 2 else (True,)):
            triples.append((torch.randn(R, C, generator=g).to(device, dtype),
                            idx.contiguous() if contiguous else idx,
                            torch.randn(N, C, generator=g).to(device, dtype)))
    return triples


def _value_and_grads(fn, out, index, src, cotangent):
    with torch.enable_grad():
        out, src = out.detach().requires_grad_(), src.detach().requires_grad_()
        value = fn(out, index, src)
        grads = torch.autograd.grad(value, (out, src), cotangent)
    return value.detach(), grads


def _agrees(target, fn, example_args, dtype) -> str | None:
    """None when `target` and `fn` agree in value and gradients on every probe in `dtype`, else why not."""
    out, index, _ = example_args
    for o, i, s in _probes(out, index, dtype):
        cotangent = torch.randn_like(o)
        try:
            got = _value_and_grads(target, o, i, s, cotangent)
        except Exception as exc:  # a dtype, device or autograd formula the op does not have
            return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        want = _value_and_grads(fn, o, i, s, cotangent)
        for what, a, b in zip(("its value", "its gradient of out", "its gradient of src"), (got[0], *got[1]),
                              (want[0], *want[1])):
            if a.shape != b.shape or a.dtype != b.dtype:
                return f"{what} is {tuple(a.shape)} {a.dtype}, not {tuple(b.shape)} {b.dtype}"
            same = torch.allclose(a, b, rtol=1e-12, atol=1e-12) if dtype == torch.float64 else torch.equal(a, b)
            if not same:
                return f"{what} differs on a probe ({dtype})"
    return None


def opaque_op_to_torch(gm: fx.GraphModule, node: fx.Node, order: dict) -> str | None:
    """A library op call that computes `scatter_add` or `index_add` of its arguments (proven on
    probes, see the module docstring) -> that torch function, its original call kept in meta."""
    if node.op != "call_function" or not _library_op(node.target) or node.kwargs or len(node.args) != 3:
        return None
    if not all(isinstance(a, fx.Node) for a in node.args) or _mutates(node.target):
        return None
    if not is_call(node.args[0], *ZEROS):  # a combine into fresh zeros; any other op is never run here
        return None
    args = [example_value(a) for a in node.args]
    result = example_value(node)
    if not all(isinstance(a, torch.Tensor) for a in (*args, result)):
        return None
    out, index, src = args
    if result.shape != out.shape or result.dtype != out.dtype or src.dtype != out.dtype:
        return None
    if not out.dtype.is_floating_point:
        return None
    refusals = []
    for name, fn, torch_fn in _candidates(out, index, src):
        with unset_fake_temporarily():  # real probe tensors, whatever mode the backend runs under
            why = _agrees(node.target, fn, args, torch.float64)
            if why is not None and why.startswith(("RuntimeError", "NotImplementedError", "TypeError")):
                why = _agrees(node.target, fn, args, out.dtype)  # an op that refuses float64: its own dtype, exactly
        if why is not None:
            log.debug("%s: %s is not %s (%s)", node.name, node.target, name, why)
            refusals.append(f"not {name}: {why}")
            continue
        new = insert_call(gm, node, torch_fn, (node.args[0], 0, node.args[1], node.args[2]))
        new.meta[ORIGINAL] = node.target
        node.replace_all_uses_with(new)
        return f"{node.name} ({node.target}) is {name} along dim 0"
    if refusals:
        node.meta[REFUSED] = f"{node.target} is a library op, {'; '.join(refusals)}"
    return None


def refusal(node) -> str:
    """' (why a library op was not taken for a torch op)' for a node `opaque_op_to_torch` probed
    and left, else ''."""
    why = node.meta.get(REFUSED) if isinstance(node, fx.Node) else None
    return f" ({why})" if why else ""


def restore_opaque_ops(gm: fx.GraphModule) -> int:
    """Put each library op `opaque_op_to_torch` replaced back where no rewritten region took it;
    the number put back."""
    restored = 0
    for node in list(gm.graph.nodes):
        original = node.meta.get(ORIGINAL)
        if original is not None:  # (out, 0, index, src) as the graph holds them now -> (out, index, src)
            out, _, index, src = node.args
            node.target, node.args = original, (out, index, src)
            del node.meta[ORIGINAL]
            restored += 1
    return restored
