"""Name the activation between the up- and down-projection by running it, not by spelling it.

The same SwiGLU reaches the graph as `silu(g) * u`, `g * sigmoid(g) * u`, `chunk` or slicing,
gpt-oss's clamped form with its constants... Rather than match each spelling, the sub-graph from
H to A is copied into a small function, evaluated in float64 on random probe rows (wide enough to
cross gpt-oss's clamp limits), and compared with each activation the kernels implement. Only an
exact match (float64 round-off) names it; anything else is rejected with the reason.
"""
from __future__ import annotations

import itertools
import math

import torch
import torch.fx as fx

from moe_compiler.codegen.activations import GATED, torch_activation

from .common import CAST_METHODS, backward_slice, dtype_of, example_value

_PROBE_ROWS = 64
_DEFAULT_OAI = (1.702, 7.0)


def activation_subgraph(h: fx.Node | tuple[fx.Node, ...], a: fx.Node) -> set[fx.Node] | str:
    """Nodes computing A from H alone (or from each of several projections `h`), or the reason
    they do not."""
    hs = h if isinstance(h, tuple) else (h,)
    nodes = backward_slice([a], stop=set(hs))
    for node in nodes:
        if node.op != "call_function" and node.op != "call_method":
            return f"activation reads {node.op} {node.name}, not only the up-projection output"
        for inp in node.all_input_nodes:
            if inp not in hs and inp not in nodes:
                return f"activation node {node.name} also reads {inp.name}"
    read = {i for n in nodes for i in n.all_input_nodes}
    if any(a is not one and one not in read for one in hs):
        return "activation does not read the up-projection output" if len(hs) == 1 else "activation does not read both projections"
    return nodes


def _as_function(h: fx.Node | tuple[fx.Node, ...], a: fx.Node, nodes: set[fx.Node]):
    hs = h if isinstance(h, tuple) else (h,)
    graph = fx.Graph()
    env = {one: graph.placeholder(f"h{i}") for i, one in enumerate(hs)}
    for node in hs[0].graph.nodes:  # graph order is a topological order
        if node in nodes:
            env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(env[a])
    return fx.GraphModule(torch.nn.Module(), graph)


def _float_constants(nodes: set[fx.Node]) -> list[float]:
    found = []
    for node in nodes:
        for value in itertools.chain(node.args, node.kwargs.values()):
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value not in found:
                found.append(float(value))
    return found


def _tolerance(nodes: set[fx.Node]) -> float:
    """float64 round-off, unless the sub-graph itself casts to a narrower dtype."""
    eps = 1e-10
    for node in nodes:
        dtype = dtype_of(node)
        if dtype is not None and dtype.is_floating_point and dtype != torch.float64:
            if node.op == "call_method" and node.target in CAST_METHODS:
                eps = max(eps, 4 * torch.finfo(dtype).eps)
    return eps


def identify_activation(h: fx.Node, a: fx.Node) -> dict | str:
    """{'activation', 'interleaved', 'alpha', 'limit'} for the sub-graph H -> A, or a rejection reason."""
    nodes = activation_subgraph(h, a)
    if isinstance(nodes, str):
        return nodes
    h_val, a_val = example_value(h), example_value(a)
    if not isinstance(h_val, torch.Tensor) or not isinstance(a_val, torch.Tensor):
        return "no shape information on the activation"
    ops = sorted({str(n.target) if n.op == "call_method" else getattr(n.target, "__name__", str(n.target)) for n in nodes})
    return name_activation(
        _as_function(h, a, nodes),
        int(h_val.shape[-1]),
        int(a_val.shape[-1]),
        constants=_float_constants(nodes),
        tol=_tolerance(nodes),
        ops=ops,
    )


def identify_pair_activation(h_first: fx.Node, h_second: fx.Node, a: fx.Node) -> tuple[dict, bool] | str:
    """Gate and up as two separate projections (`act(w1(x)) * w3(x)`): probe the sub-graph
    (h_gate, h_up) -> A as the concatenated layout H = [h_gate | h_up].

    Which of the two is the gate is not known from the graph, so both orders are probed; returns
    (the activation, True when `h_second` is the gate) or a rejection reason.
    """
    nodes = activation_subgraph((h_first, h_second), a)
    if isinstance(nodes, str):
        return nodes
    vals = [example_value(n) for n in (h_first, h_second, a)]
    if not all(isinstance(v, torch.Tensor) for v in vals):
        return "no shape information on the activation"
    n1, n2, n = (int(v.shape[-1]) for v in vals)
    if not n1 == n2 == n:
        return f"gate and up projections are {n1} and {n2} wide and the activation {n}: not a gated pair"
    fn = _as_function((h_first, h_second), a, nodes)
    ops = sorted({str(nd.target) if nd.op == "call_method" else getattr(nd.target, "__name__", str(nd.target)) for nd in nodes})
    reason = ""
    for swapped in (False, True):
        def concatenated(hcat, swapped=swapped):
            gate, up = hcat[:, :n], hcat[:, n:]
            return fn(up, gate) if swapped else fn(gate, up)

        act = name_activation(concatenated, 2 * n, n, constants=_float_constants(nodes), tol=_tolerance(nodes), ops=ops)
        if isinstance(act, str):
            reason = act
        elif not act["interleaved"]:  # separate projections are the concatenated layout by construction
            return act, swapped
    return reason


def name_activation(fn, w1_out: int, n: int, constants=(), tol: float = 1e-10, ops=()) -> dict | str:
    """Probe `fn: H [rows, w1_out] -> A [rows, n]` and name it among the op's activations.

    `constants` (the numbers the sub-graph or module holds) are candidate (alpha, limit) values for
    the clamped SwiGLUs (gpt-oss's defaults are always tried). Half the probe rows are scaled past
    the largest of them, so a clamp or threshold anywhere in `fn` is crossed: a silu(min(g, 100)) * u
    must not pass for a plain SwiGLU. Returns a rejection reason when nothing matches within `tol`.
    """
    big = max((abs(c) for c in constants if math.isfinite(c)), default=0.0)
    try:
        gen = torch.Generator().manual_seed(0)
        probe = torch.randn(_PROBE_ROWS, w1_out, generator=gen, dtype=torch.float64) * 6.0
        probe[_PROBE_ROWS // 2:] *= max(1.0, big / 3.0)  # past every constant, in float64 range
        # a GraphModule's forward itself: its __call__ prints a failing line's traceback to stderr
        got = (fn.forward if isinstance(fn, fx.GraphModule) else fn)(probe)
    except Exception as exc:  # an op that cannot run on a probe is not an activation we know
        return f"activation could not be evaluated on a probe ({type(exc).__name__}: {exc})"
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != (_PROBE_ROWS, n):
        return f"activation maps [rows, {w1_out}] to {getattr(got, 'shape', type(got))}, not [rows, {n}]"
    got = got.double()
    candidates = []
    for name, gated in GATED.items():
        if (w1_out == 2 * n) != gated:
            continue
        layouts = (False, True) if gated else (False,)
        params = [_DEFAULT_OAI]
        if name == "swiglu_oai":
            params += [(al, li) for al in constants for li in constants if li > 0 and (al, li) != _DEFAULT_OAI]
        elif name == "swiglu_clamp":  # no alpha: the limit alone
            params = [(_DEFAULT_OAI[0], li) for li in dict.fromkeys([_DEFAULT_OAI[1], *constants]) if li > 0]
        elif name == "swiglu_softcap":  # (gate cap, up cap), both from the sub-graph's constants
            params = [(ga, uc) for ga in constants for uc in constants if ga > 0 and uc > 0]
        for interleaved, (alpha, limit) in itertools.product(layouts, params):
            candidates.append((name, interleaved, alpha, limit))
    for name, interleaved, alpha, limit in candidates:
        want = torch_activation(probe, name, interleaved, alpha, limit)
        if torch.allclose(got, want, rtol=tol, atol=tol):
            return {"activation": name, "interleaved": interleaved, "alpha": alpha, "limit": limit}
    detail = f" (ops: {', '.join(ops)})" if ops else ""
    return f"unsupported activation{detail}; supported: {', '.join(GATED)}"
