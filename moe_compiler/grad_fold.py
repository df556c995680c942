"""x's gradient in one pass: the router's term folded into the experts' dX gather-sum.

A MoE block reads its input x twice: the router's logits L = x @ Wr^T and the experts. So the
backward graph adds two [T, d] gradients,

    dx = sonic::moe_experts_backward(...)[0] + dL @ Wr        (dL: the logits' gradient)

an `mm` that writes [T, d] and an `add` that reads both and writes [T, d] again: ~110 us of the
7b-256 layer's step on an H100, paid by every implementation that leaves autograd to add them. dL
needs d_topk_weights, an output of that same backward op, so the sum cannot go inside it as it
stands. This pass (an Inductor post-grad pass, run on every backward graph `backend="sonic"`
compiles) splits the op into its four parts (`codegen.ops`: act -> dH, A', d_topk_weights; dW2;
dW1; dX; the list form, `sonic::moe_experts_list_backward`, into its own four), and hands dL and Wr
to the dX part, whose gather-sum adds dL @ Wr before it rounds:

    dh, a, ds = act(...);  dw2 = dw2(a);  dw1 = dw1(dh);  dx = dx(dh, dL, Wr)

The parts go in the order `codegen.backward.backward_order` finds holds the fewest bytes, as the
one op runs them. It folds only what it can prove: the other addend is an `mm` [T, J] @ [J, d] read
by nothing else, of x's gradient's dtype, whose inputs do not depend on the op's dx or weight
gradients (through views only, on either side). Any such term is a term of x's gradient, so
whichever one it finds (a shared expert's, when its inner size is small enough) the sum is the
same. Anything else stays as it was, with the reason logged at INFO on the "moe_compiler" logger.
"""
from __future__ import annotations

import logging
import operator

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

log = logging.getLogger("moe_compiler")

MAX_FOLD_J = 512  # the widest [T, J] @ [J, d] term the gather-sum takes (routers have J = E experts)
_VIEWS = ("view.default", "reshape.default", "_unsafe_view.default")


class NoFold(Exception):
    pass


def _is(node, name: str) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and str(node.target) == name


def _is_view(node) -> bool:
    return any(_is(node, f"aten.{v}") for v in _VIEWS)


def _val(node):
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    if not isinstance(val, torch.Tensor):
        raise NoFold(f"{node} carries no tensor metadata")
    return val


def _through_views_down(node: fx.Node) -> tuple[fx.Node, list[fx.Node]]:
    """(the first node past a chain of single-user views of `node`, [node, the views])."""
    chain = [node]
    while len(node.users) == 1:
        (user,) = node.users
        if not _is_view(user):
            return user, chain
        chain.append(user)
        node = user
    raise NoFold(f"{node} has {len(node.users)} readers")


def _same(a, b) -> bool:
    """a == b for sizes that may be symbolic (dynamic T): provable without a new guard."""
    return statically_known_true(a == b)


def _hint(size) -> int:
    """A size's value in the example this graph was traced with (for choosing an order only)."""
    return size if isinstance(size, int) else size.node.hint


def _ancestors(roots) -> set[fx.Node]:
    seen, stack = set(), [r for r in roots if isinstance(r, fx.Node)]
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(node.all_input_nodes)
    return seen


def _outputs(bwd: fx.Node) -> dict[int, fx.Node]:
    outs = {}
    for user in bwd.users:
        if not (user.op == "call_function" and user.target is operator.getitem):
            raise NoFold(f"{user} reads the backward's output tuple as a whole")
        if user.args[1] in outs:
            raise NoFold(f"two reads of output {user.args[1]}")
        outs[user.args[1]] = user
    return outs


def _find_term(bwd: fx.Node, outs: dict[int, fx.Node]) -> tuple[fx.Node, fx.Node, fx.Node, list[fx.Node]]:
    """(add, L, R, the nodes the fold leaves dead): the add of dx and L @ R this op's dx can take in."""
    if 0 not in outs:
        raise NoFold("dx is not read")
    add, dx_chain = _through_views_down(outs[0])  # add: x's gradient summed (or the graph's output, no sum)
    if _is(add, "aten.addmm.default") and add.args[0] is dx_chain[-1] and len(add.args) == 3 \
            and all(add.kwargs.get(k, 1) == 1 for k in ("alpha", "beta")) and set(add.kwargs) <= {"alpha", "beta"}:
        term_chain, (lhs, rhs) = [], add.args[1:]  # Inductor has already made the mm and add one addmm
        product = _val(add)
    else:
        if not _is(add, "aten.add.Tensor") or add.kwargs or len(add.args) != 2:
            raise NoFold(f"dx goes to {add.target}, not a plain add or addmm")
        other = add.args[1] if add.args[0] is dx_chain[-1] else add.args[0]
        term_chain = [other]
        while _is_view(term_chain[-1]) and len(term_chain[-1].users) == 1:
            term_chain.append(term_chain[-1].args[0])
        mm = term_chain[-1]
        if not _is(mm, "aten.mm.default") or len(mm.users) != 1:
            raise NoFold(f"x's other gradient term is {getattr(mm, 'target', mm)}, not an mm read once")
        lhs, rhs = mm.args
        product = _val(mm)
    dx, summed = _val(outs[0]), _val(add)
    T, d = dx.shape
    J = _val(lhs).shape[1]
    if not (_same(product.shape[0], T) and _same(product.shape[1], d) and _same(summed.numel(), T * d)):
        raise NoFold(f"the term [{', '.join(map(str, product.shape))}] is not dx's [{T}, {d}]")
    if not (product.dtype == dx.dtype == summed.dtype == _val(lhs).dtype == _val(rhs).dtype):
        raise NoFold(f"dtypes differ: dx {dx.dtype}, L {_val(lhs).dtype}, R {_val(rhs).dtype}, sum {summed.dtype}")
    if _hint(J) > MAX_FOLD_J:  # a cost bound, not a correctness one: the kernel takes any J
        raise NoFold(f"the term's inner size {J} (here {_hint(J)}) is over {MAX_FOLD_J}")
    if _ancestors([lhs, rhs]) & ({n for i, n in outs.items() if i != 1} | set(dx_chain)):
        raise NoFold("the term depends on this op's dx or weight gradients")
    return add, lhs, rhs, [*reversed(dx_chain), *term_chain]  # each before the nodes it reads


def _order(x, E: int, dh_shape, a_shape) -> tuple[str, ...]:
    """The parts' order `backward_order` picks at the traced example's sizes (the one op picks per call)."""
    from moe_compiler.codegen.backward import backward_order, backward_sizes, scatter_rows

    T, d, TK, w1_out, n = (_hint(v) for v in (*x.shape, dh_shape[0], dh_shape[1], a_shape[1]))
    elem = x.element_size()
    sizes = backward_sizes(T=T, d=d, TK=TK, w1_out=w1_out, n=n, elem=elem, dw1=E * w1_out * d * elem,
                           dw2=E * d * n * elem, dx_rows=scatter_rows(TK, E, x))
    return backward_order(**sizes)[0]


def _parts(bwd: fx.Node):
    """(the split ops, the arguments they share, E, the number of the op's flags) of a backward op:
    `sonic::moe_experts_backward` (stacked weights and biases) or its list form (per-expert weights,
    stacked biases, the weight gradients stacked)."""
    sonic = torch.ops.sonic
    if bwd.target is sonic.moe_experts_backward.default:
        grad_out, x, ids, weights, w1, w2, b1, b2 = bwd.args[:8]
        ops = (sonic.moe_experts_backward_act, sonic.moe_experts_backward_dw2, sonic.moe_experts_backward_dw1,
               sonic.moe_experts_backward_dx)
        return ops, (x, ids, weights, w1, w2, b1, b2), _val(w1).shape[0], 5
    grad_out, x, ids, weights, w_gate, w_up, w_down, b1, b2 = bwd.args[:9]
    ops = (sonic.moe_experts_list_backward_act, sonic.moe_experts_list_backward_dw2,
           sonic.moe_experts_list_backward_dw1, sonic.moe_experts_list_backward_dx)
    return ops, (x, ids, weights, w_gate, w_up, w_down, b1, b2), len(w_gate), 4


def _fold(graph: fx.Graph, bwd: fx.Node, outs: dict[int, fx.Node], term, fake_mode) -> None:
    add, lhs, rhs, dead = term
    (act_op, dw2_op, dw1_op, dx_op), inputs, E, n_flags = _parts(bwd)
    grad_out = bwd.args[0]
    h, sorted_rows, offsets, *flags = bwd.args[len(inputs) + 1:]
    kwargs = dict(bwd.kwargs)
    if len(flags) > n_flags:
        kwargs["slot_token"] = flags.pop()

    def call(target, args, kw, where):
        with graph.inserting_before(where):
            node = graph.call_function(target, args, kw)
        with fake_mode:
            node.meta["val"] = target(*fx.map_arg(args, _val), **fx.map_arg(kw, _val))
        return node

    def item(node, i, where):
        with graph.inserting_before(where):
            got = graph.call_function(operator.getitem, (node, i))
        got.meta["val"] = node.meta["val"][i]
        return got

    act = call(act_op.default, bwd.args, bwd.kwargs, bwd)
    dh, a_scaled, ds = (item(act, i, bwd) for i in range(3))
    routing = (sorted_rows, offsets, *flags)
    parts = {
        "dw2": (dw2_op.default, (grad_out, *inputs, a_scaled, *routing), kwargs),
        "dw1": (dw1_op.default, (*inputs, dh, *routing), kwargs),
        "dx": (dx_op.default, (*inputs, dh, *routing), dict(kwargs, dx_lhs=lhs, dx_rhs=rhs)),
    }
    made = {}
    for step in _order(_val(inputs[0]), E, dh.meta["val"].shape, a_scaled.meta["val"].shape):
        made[step] = call(*parts[step], add)
    dx = made["dx"]
    if tuple(_val(add).shape) != tuple(dx.meta["val"].shape):
        dx = call(torch.ops.aten.view.default, (dx, list(_val(add).shape)), {}, add)
    add.replace_all_uses_with(dx)
    # outputs (dx, ds, dw1, dw2, db1, db2), in both forms; the parts give (dw, db) pairs
    replacement = {1: ds, 2: (made["dw1"], 0), 3: (made["dw2"], 0), 4: (made["dw1"], 1), 5: (made["dw2"], 1)}
    for i, old in outs.items():
        if i == 0:
            continue
        new = replacement[i]
        old.replace_all_uses_with(new if isinstance(new, fx.Node) else item(*new, add))
    graph.erase_node(add)
    for node in [*dead, *(out for i, out in outs.items() if i != 0), bwd]:
        graph.erase_node(node)


def fold_input_grads(graph: fx.Graph) -> int:
    """Fold every foldable x-gradient term into its `sonic::moe_experts_backward` (or the list form's
    `sonic::moe_experts_list_backward`); returns how many."""
    targets = (torch.ops.sonic.moe_experts_backward.default, torch.ops.sonic.moe_experts_list_backward.default)
    bwds = [n for n in graph.nodes if n.op == "call_function" and n.target in targets]
    if not bwds:
        return 0
    fake_mode = next((n.meta["val"].fake_mode for n in graph.nodes
                      if isinstance(n.meta.get("val"), torch.Tensor) and hasattr(n.meta["val"], "fake_mode")), None)
    if fake_mode is None:
        log.info("x's gradient: not folded (the graph carries no fake tensors)")
        return 0
    folded = 0
    for bwd in bwds:
        try:
            outs = _outputs(bwd)
            term = _find_term(bwd, outs)
        except NoFold as why:
            log.info("x's gradient of %s: not folded (%s)", bwd.name, why)
            continue
        _fold(graph, bwd, outs, term, fake_mode)
        folded += 1
        log.info("x's gradient of %s: its mm term (the router's, in a MoE block) folded into the dX gather-sum",
                 bwd.name)
    if folded:
        from torch._inductor.pattern_matcher import stable_topological_sort

        stable_topological_sort(graph)
        graph.lint()
    return folded
