"""Every expert run on every token as two batched matmuls over stacked weights, gated by a [T, E] matrix.

Eager code it matches (transformers' Llama 4, `Llama4TextMoe`), shapes (T tokens, d hidden, E experts):

    vals, ids = torch.topk(logits, K, dim=1)                             # [T, K]
    gates = sigmoid(full_like(logits, -inf).scatter_(1, ids, vals))     # [T, E], zero outside the top-k
    rows = x.repeat(E, 1) * gates.t().reshape(-1, 1)                    # [E*T, d]: expert e's copy of token t
    h = torch.bmm(rows.view(E, -1, d), gate_up_proj)                    # [E, T, 2n], gate_up_proj [E, d, 2n]
    y = torch.bmm(act(h), down_proj)                                    # [E, T, d],  down_proj [E, n, d]
    out = y.view(-1, d).reshape(E, -1, d).sum(0)                        # [T, d]

and its variants: rows broadcast as [E, T, d] (`x.expand(E, T, d)`, `x.unsqueeze(0)`, each times
`gates.t().unsqueeze(-1)`), weights in nn.Linear's [E, out, in] orientation read through
`.transpose(1, 2)`, gate and up as two stacked parameters (`act(bmm(rows, Wg)) * bmm(rows, Wu)`),
and the gate on the expert outputs instead of the inputs (`(y * gates.t().unsqueeze(-1)).sum(0)`,
`gates.t().view(E, T)[..., None]`). Gated on the outputs, the projections may add stacked biases
broadcast over the tokens (`bmm(rows, W) + B[..., None, :]`: transformers 4.5x's gpt-oss on its
training path, with its interleaved clamped SwiGLU). Gated on both sides (GShard's dispatch and
combine without capacity: the rows masked by `F.one_hot(ids, E).sum(1)`, the outputs weighted by the
combine matrix, `einsum("etd,te->td", y, combine)` too) it is gated on the outputs, where the mask is
the indicator of the combine's own top-k ids: a chosen expert reads x * 1.
Computed token-major (`einsum("td,edf->tef", x, W)`, outputs [T, E, d] weighted by `gates[..., None]`
and summed over dim 1, or read at each token's top-k ids) it reaches this finder expert-major, the
outputs read through one transpose (`canonical_products.einsum_to_bmm`, `canonical_layout`,
`canonical_routing.gathered_outputs_to_gate_matrix`).
The same code written with einsum (`einsum("td,edn->etn", x, W)`, `einsum("te,etd->td", gates, y)`)
or with matmuls that broadcast x over the weights (`x @ W`) reaches this finder as these bmm and
product forms (`canonical.einsum_to_bmm`, `canonical.einsum_weighted_sum_to_product`,
`canonical.broadcast_matmul_to_bmm`). The gate matrix must be provably zero outside the top-k
(`dense_experts.sparse_gates`: top-k values scattered into zeros, or a sigmoid / exp / softmax of
values scattered into -inf).

It becomes the sparse computation, each expert running on its top-k tokens only (E / K times fewer
expert FLOPs: 16x for Llama 4 Scout):

    w = gates.gather(1, ids)                                            # [T, K]
    gate on the outputs:  out = moe_experts(x, ids, w, W1, W2)
    gate on the inputs:   rows = (x[:, None] * w[..., None]).reshape(-1, d)       # [T*K, d]
                          out = moe_experts(rows, ids.reshape(-1, 1), 1, W1, W2).view(T, K, d).sum(1)

Why it is the same function: an unchosen expert's gate is 0, so (gate on the outputs) its output
counts 0 times, or (gate on the inputs) it runs on a zero row, which an expert without biases maps
to zero: up = 0 makes a gated activation 0, and a non-gated one is checked to give act(0) = 0
(experts with biases map it to their biases, so biases are taken only with the gate on the outputs). The
gradients agree too: the unchosen entries of the gate matrix get a gradient only in the dense code,
and it ends at the constant zeros / -inf the top-k was scattered into. As in `dense_experts`, an
unchosen expert whose output is inf or nan gives nan in the dense code and not here.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from moe_compiler.codegen.activations import torch_activation

from .activation_probe import identify_activation, identify_pair_activation
from .common import (
    MoEMatch,
    NoMatch,
    RegionWalk,
    Rejection,
    arg,
    backward_slice,
    call_sizes,
    dtype_of,
    einsum_parts,
    expect,
    finish_match,
    getitem_of,
    is_call,
    is_getitem,
    module_path,
    same_shape,
    same_size,
    shape_of,
)
from .canonical_layout import swap_of
from .dense_experts import sparse_gates, sums_dim
from .module_list import projections_before, through_float_casts, topk_routing

IDIOM = "dense_bmm"
_VIEWS = ("view", "reshape")
_MUL = ("mul", "__mul__")


def find(gm: fx.GraphModule) -> list[MoEMatch | Rejection]:
    """Candidates: a bmm whose left operand is hidden states broadcast over a leading expert dim
    (gated or not): the up projection."""
    results: list[MoEMatch | Rejection] = []
    covered: set[fx.Node] = set()  # the gate and up bmms of a pair are one candidate, found from the first
    for node in gm.graph.nodes:
        source = _rows_source(node.args[0]) if is_call(node, "bmm") and len(shape_of(node)) == 3 else None
        if source is not None and node not in covered:
            try:
                match = _check(node, *source)
                covered |= match.region
                results.append(match)
            except NoMatch as exc:
                results.append(Rejection(IDIOM, module_path(node), str(exc)))
    return results


def _through_views(node, walk: RegionWalk | None = None):
    while is_call(node, *_VIEWS):
        if walk is not None:
            walk.mark(node)
        node = node.args[0]
    return node


def _rows_source(lhs) -> tuple[fx.Node, fx.Node | None] | None:
    """(the broadcast hidden states node, the gate factor or None) of a bmm's left operand, looked
    at without checking anything (the candidate filter)."""
    node = _through_views(lhs)
    if is_call(node, *_MUL) and len(node.args) == 2:
        for rows, factor in (node.args, node.args[::-1]):
            if _broadcast_x(rows, None) is not None:
                return rows, factor
        return None
    return (node, None) if _broadcast_x(node, None) is not None else None


def _broadcast_x(node, E, walk: RegionWalk | None = None) -> fx.Node | None:
    """x [T, d] from its copy per expert: x.repeat(E, 1) ([E*T, d], expert-major), x.repeat(E, 1, 1),
    x.expand(E, T, d), x.unsqueeze(0) / x[None] (optionally expanded). E None: any count."""
    def ok(count):
        return E is None or count == E

    chain = []
    if is_call(node, "repeat"):
        reps, src = call_sizes(node), node.args[0]
        if len(shape_of(src)) == 2 and tuple(reps[1:]) in ((1,), (1, 1)) and ok(reps[0]):
            if walk is not None:
                walk.mark(node)
            return src
        return None
    if is_call(node, "expand"):
        chain.append(node)
        sizes = call_sizes(node)
        if not sizes or not ok(sizes[0]):
            return None
        node = node.args[0]
    if is_call(node, "unsqueeze") and arg(node, 1, "dim") == 0:
        chain.append(node)
        node = node.args[0]
    elif getitem_of(node, None) is not None:
        chain.append(node)
        node = node.args[0]
    if not chain or len(shape_of(node)) != 2:
        return None
    if walk is not None:
        walk.mark(*chain)
    return node


def _gate_column(node, walk: RegionWalk) -> tuple[fx.Node, int]:
    """(gates [T, E], rank) for gates transposed to expert-major and given a trailing unit dim:
    gates.t().reshape(-1, 1) ([E*T, 1], rank 2) or gates.t().unsqueeze(-1) / [:, :, None] ([E, T, 1], rank 3)."""
    node = through_float_casts(node, walk)
    rank = len(shape_of(node))
    expect(rank in (2, 3) and shape_of(node)[-1] == 1, f"{getattr(node, 'name', node)} is not a gate column ([E*T, 1] or [E, T, 1])")
    walk.mark(node)
    if rank == 2:
        expect(is_call(node, *_VIEWS), "the gate column is not a reshape of the transposed gate matrix")
    else:
        expect(is_call(node, "unsqueeze") and arg(node, 1, "dim") in (-1, 2)
               or getitem_of(node, (slice(None), slice(None), None)) is not None
               or getitem_of(node, (Ellipsis, None)) is not None,
               "the gate column is not the transposed gate matrix unsqueezed last")
    node = through_float_casts(node.args[0], walk)
    if rank == 3 and is_call(node, *_VIEWS) and len(shape_of(node)) == 2 and same_shape(shape_of(node), shape_of(node.args[0])):
        walk.mark(node)  # gates.t().view(E, T): a view to the transposed matrix's own shape
        node = through_float_casts(node.args[0], walk)
    transposed = (is_call(node, "t") or (is_call(node, "transpose") and sorted(node.args[1:3]) in ([0, 1], [-2, -1], [-1, 0]))
                  or (is_call(node, "permute") and call_sizes(node) == (1, 0)))
    expect(transposed and len(shape_of(node)) == 2, "the gate column is not taken from the gate matrix transposed to [E, T]")
    walk.mark(node)
    return node.args[0], rank


def _stacked_weight(node, what: str, walk: RegionWalk) -> tuple[fx.Node, bool]:
    """(W, transposed): a 3-D weight read as [E, in, out] (transposed, like Llama 4's), or
    W.transpose(1, 2) / W.mT of an [E, out, in] one."""
    view = _transposed_view(node)
    if view is not None:
        walk.mark(view)
        node, transposed = view.args[0], False
    else:
        transposed = True
    expect(isinstance(node, fx.Node) and len(shape_of(node)) == 3, f"the {what} projection's weight is not a 3-D [E, ., .] tensor")
    return node, transposed


def _one_orientation(w1, w_up, w2, up_read, down_read, transposed: bool):
    """(w1, w_up, w2, transposed) in one orientation when the up and down weights are stored in two
    (a packed Linear's [E, f, d] beside [E, f, d]-read down weights, DBRX's storage): the weight the
    graph reads through `W.transpose(1, 2)` is handed to the op as that view ([E, in, out], strides
    only: the kernels address weights through their strides, nothing is copied)."""
    down_view = _transposed_view(down_read)  # the down weights stored [E, out, in], read transposed
    if down_view is not None:
        return w1, w_up, down_view, transposed
    up_view = _transposed_view(up_read) if up_read is not None else None
    expect(up_view is not None, "the two projections' weights are laid out differently, and neither is read "
                                "through a transpose of its own (separate gate and up weights)")
    return up_view, w_up, w2, not transposed


def _transposed_view(read) -> fx.Node | None:
    """`W.transpose(1, 2)` (or `W.mT`) of a weight: the view itself; else None."""
    if is_call(read, "transpose") and sorted(read.args[1:3]) in ([1, 2], [-2, -1]):
        return read
    if (isinstance(read, fx.Node) and read.op == "call_function" and getattr(read.target, "__name__", "") == "getattr"
            and read.args[1] == "mT"):
        return read
    return None


def _check(up: fx.Node, rows: fx.Node, factor: fx.Node | None) -> MoEMatch:
    """`rows`, `factor`: the up projection's broadcast hidden states and their gate factor or None
    (`_rows_source`)."""
    walk = RegionWalk()
    E = shape_of(up)[0]
    lhs, rhs = up.args[0], up.args[1]
    walk.mark(up)
    node = _through_views(lhs, walk)  # the gated product, or the broadcast rows themselves
    x = _broadcast_x(rows, E, walk)
    expect(x is not None, f"the up projection's rows are not the hidden states broadcast over E={E} experts")
    gates = None
    if factor is not None:
        gates, rank = _gate_column(factor, walk)
        expect(len(shape_of(rows)) == rank, "the gate column and the broadcast rows differ in rank")
        expect(dtype_of(node) == dtype_of(x), f"the gated rows are {dtype_of(node)}, the hidden states {dtype_of(x)}")
        walk.mark(node)
    T, d = shape_of(x)
    expect(len(shape_of(lhs)) == 3 and same_size(shape_of(lhs)[1], T) and shape_of(lhs)[2] == d,
           f"the up projection reads {shape_of(lhs)}, not [E={E}, T, d={d}]")
    down = _down_projection(up)
    a = walk.through(down.args[0])
    ups = projections_before(a, ops=("bmm",))
    w_up = None
    if len(ups) == 2 and up in ups:  # gate and up as two bmms over the same rows (separate stacked weights)
        other = ups[1] if ups[0] is up else ups[0]
        other_source = _rows_source(other.args[0])
        expect(other_source is not None and other_source[1] is factor and _broadcast_x(other_source[0], E) is x,
               "the gate and up projections read different rows")
        _through_views(other.args[0], walk)
        _broadcast_x(other_source[0], E, walk)
        walk.mark(other, *([_through_views(other.args[0])] if factor is not None else []))
        found = identify_pair_activation(ups[0], ups[1], a)
        expect(not isinstance(found, str), str(found))
        act, swapped = found
        gate, up_proj = (ups[1], ups[0]) if swapped else (ups[0], ups[1])
        w1, transposed = _stacked_weight(gate.args[1], "gate", walk)
        w_up, up_transposed = _stacked_weight(up_proj.args[1], "up", walk)
        expect(up_transposed == transposed, "the gate and up weights are laid out differently")
        b1 = None
        walk.mark(*backward_slice([a], stop=set(ups)), down)
    else:
        expect(ups == [up], f"the activation reads {len(ups)} bmm outputs, not the up projection's alone (or a gate/up pair)")
        w1, transposed = _stacked_weight(rhs, "up", walk)
        h, b1 = _biased(up, E, walk)
        act = identify_activation(h, a)
        expect(not isinstance(act, str), str(act))
        walk.mark(*backward_slice([a], stop={h}), down)
    w1_out = shape_of(up)[-1] * (1 if w_up is None else 2)
    w2, transposed2 = _stacked_weight(down.args[1], "down", walk)
    if transposed2 != transposed:  # one orientation for the op: one weight handed over as the view the bmm reads
        w1, w_up, w2, transposed = _one_orientation(w1, w_up, w2, rhs if w_up is None else None, down.args[1], transposed)
    y, b2 = _biased(down, E, walk)

    anchor, out_gates = _summed_over_experts(y, walk, E, T, d)
    expect(gates is not None or out_gates is not None, "the experts are not gated")
    if gates is not None and out_gates is not None:  # GShard's dispatch and combine: rows masked, outputs weighted
        out_support = sparse_gates(out_gates, RegionWalk())
        expect(_indicator_of(gates, walk) is out_support.ids,
               "the experts are gated on both their inputs and their outputs, and the input gate is not the "
               "0/1 indicator of the output gate's top-k ids")
        gates = None  # each chosen expert reads x itself (x * 1); the rest count 0 times
    if gates is not None:  # an unchosen expert runs on a zero row: it must map it to zero
        expect(b1 is None and b2 is None and (w_up is not None or _biased(up, E, RegionWalk())[1] is None),
               "experts with biases scaled on their inputs: an unchosen expert maps its zero row to its biases")
        zero = torch_activation(torch.zeros(1, w1_out, dtype=torch.float64), act["activation"], act["interleaved"],
                                act["alpha"], act["limit"])
        expect(bool((zero == 0).all()), f"{act['activation']}(0) is not 0: an unchosen expert would add to every token")
    gate_matrix = gates if gates is not None else out_gates
    support = sparse_gates(gate_matrix, walk)
    E_router, K = topk_routing(support.ids, walk)
    expect(E_router == E, f"the router ranks {E_router} experts, the weights hold {E}")
    expect(shape_of(gate_matrix)[1] == E and same_size(shape_of(gate_matrix)[0], T), f"the gate matrix {shape_of(gate_matrix)} is not [T, E={E}]")
    match = finish_match(IDIOM, up, walk, anchor, x, support.ids, gate_matrix, w1, w2, b1, b2, transposed, act,
                         E=E, K=K, T=T, d=d, w_up=w_up)
    match.gates, match.input_scaled = True, gates is not None
    if match.input_scaled:
        match.router_probs = None  # token rounding would give added rows a weight outside the gate's meaning
    return match


def _einsum_gated_sum(einsum: fx.Node, y: fx.Node, E, T, d, token_major: bool = False) -> fx.Node | None:
    """The [T, E] gates of `einsum("etd,te->td", y, gates)` (any letters, either order) on y [E, T, d]
    (token-major: `einsum("ted,te->td", y, gates)` on y [T, E, d]); else None."""
    parts = einsum_parts(einsum)
    if parts is None or y not in parts[1]:
        return None
    ins, operands, out = parts
    i = operands.index(y)
    g = operands[1 - i]
    want = (T, E, d) if token_major else (E, T, d)
    if len(ins[i]) != 3 or not (len(shape_of(y)) == 3 and all(same_size(a, b) for a, b in zip(shape_of(y), want))):
        return None
    t, e, dd = ins[i] if token_major else (ins[i][1], ins[i][0], ins[i][2])
    return g if isinstance(g, fx.Node) and ins[1 - i] == t + e and out == t + dd else None


def _indicator_of(gates: fx.Node, walk: RegionWalk) -> fx.Node | None:
    """ids when `gates` [T, E] is `F.one_hot(ids, E).sum(1)` (casts allowed) of top-k ids: 1 where a
    token chose the expert, 0 elsewhere (a token's top-k ids are distinct); else None."""
    total = through_float_casts(gates, walk)
    if not (is_call(total, "sum") and sums_dim(total, (1, -2))):
        return None
    hot = through_float_casts(total.args[0], walk)
    while is_call(hot, "to", "float", "half", "bfloat16", "type_as") and dtype_of(hot) is not None:
        hot = hot.args[0]  # one_hot's int64 to a float dtype: 0 and 1 stay exact
    if not (is_call(hot, "one_hot") and len(shape_of(hot)) == 3):
        return None
    ids = arg(hot, 0, "tensor")
    classes = arg(hot, 1, "num_classes", -1)
    if not (isinstance(ids, fx.Node) and is_call(getitem_of(ids, 1), "topk") and classes == shape_of(gates)[1]):
        return None
    walk.mark(total, hot, *[n for n in backward_slice([total.args[0]], stop={hot})])
    return ids


def _biased(product: fx.Node, E, walk: RegionWalk) -> tuple[fx.Node, fx.Node | None]:
    """(the projection's value, its [E, width] bias or None): `bmm(...) + B[..., None, :]` (also
    `B[:, None, :]`, `B[:, None]`, `B.unsqueeze(1)`, `B.view(E, 1, width)`; either order) when that add
    is the product's one reader and the broadcast bias is read by it alone; else (product, None)."""
    if len(product.users) != 1:
        return product, None
    (add,) = product.users
    if not (is_call(add, "add", "__add__") and len(add.args) == 2 and not add.kwargs):
        return product, None
    other = add.args[1] if add.args[0] is product else add.args[0]
    bias = _expert_rows(other)
    if bias is None or len(other.users) != 1:
        return product, None
    width = shape_of(product)[-1]
    if shape_of(bias) != (E, width) or dtype_of(bias) != dtype_of(product):
        return product, None
    walk.mark(add, other)
    return add, bias


def _expert_rows(node) -> fx.Node | None:
    """B [E, width] of B given a unit middle dim: `B[..., None, :]`, `B[:, None, :]`, `B[:, None]`,
    `B.unsqueeze(1)` / `unsqueeze(-2)`, `B.view(E, 1, width)` / `reshape`; else None."""
    if not isinstance(node, fx.Node) or not node.args or len(shape_of(node)) != 3 or shape_of(node)[1] != 1:
        return None
    src = node.args[0]
    if not isinstance(src, fx.Node) or len(shape_of(src)) != 2:
        return None
    if is_call(node, "unsqueeze") and arg(node, 1, "dim") in (1, -2):
        return src
    if is_call(node, *_VIEWS):
        return src
    if is_getitem(node) and node.args[1] in ((Ellipsis, None, slice(None)), (slice(None), None, slice(None)), (slice(None), None)):
        return src
    return None


def _down_projection(up: fx.Node) -> fx.Node:
    """The one bmm that the up projection's output reaches before any other bmm: the walk stops at
    each bmm it meets, so later layers (which read this layer's output) are never candidates."""
    downs, seen, todo = [], set(), list(up.users)
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        if is_call(node, "bmm"):
            downs.append(node)
        else:
            todo.extend(node.users)
    expect(len(downs) == 1, f"expected one down-projection bmm after the up projection, found {len(downs)}")
    expect(downs[0].args[1] not in seen, "the down projection's weight is computed from the up projection")
    return downs[0]


def _summed_over_experts(y: fx.Node, walk: RegionWalk, E, T, d) -> tuple[fx.Node, fx.Node | None]:
    """(the sum over the expert dim of the expert outputs y [E, T, d], [T, d]; the gate matrix
    applied to them on the way, or None): views and reshapes, at most one product with a gate
    column, then `.sum(0)` of an [E, T, d] tensor. Read token-major (`y.transpose(0, 1)`, [T, E, d],
    the form a token-major einsum takes: `canonical_products.einsum_to_bmm`), the gate column is
    `gates.unsqueeze(-1)` ([T, E, 1]) and the sum is over dim 1."""
    node, gates, token_major = y, None, False
    while True:
        reader = walk.only_reader(node)
        expect(reader is not None, f"the expert outputs ({node.name}) are read more than once")
        swap = swap_of(reader)
        if swap is not None and swap[1] == (0, 1) and len(shape_of(node)) == 3 and not token_major:
            token_major = True  # [T, E, d]: each token's outputs of every expert
        elif is_call(reader, *_VIEWS) and not token_major:
            shape = shape_of(reader)
            ok = (len(shape) == 2 and shape[1] == d) or (len(shape) == 3 and shape[0] == E and same_size(shape[1], T) and shape[2] == d)
            expect(ok, f"the expert outputs are viewed as {shape}, not [E*T, d] or [E={E}, T, d]")
        elif is_call(reader, *_MUL) and gates is None and len(reader.args) == 2:
            factor = reader.args[1] if reader.args[0] is node else reader.args[0]
            if token_major:
                gates = _token_gate_column(factor, walk)
                expect(len(shape_of(node)) == 3, "the gate column and the expert outputs differ in rank")
            else:
                gates, rank = _gate_column(factor, walk)
                expect(len(shape_of(node)) == rank, "the gate column and the expert outputs differ in rank")
        elif is_call(reader, "einsum") and gates is None and (found := _einsum_gated_sum(reader, node, E, T, d, token_major)) is not None:
            walk.mark(reader)  # einsum("etd,te->td", y, gates): left as written in bf16 (canonical_products)
            return reader, found
        elif is_call(reader, "sum"):
            shape = shape_of(node)
            e_dim = 1 if token_major else 0
            ok = len(shape) == 3 and shape[e_dim] == E and same_size(shape[1 - e_dim], T) and shape[2] == d
            expect(ok and sums_dim(reader, (e_dim,)),
                   f"the expert outputs {shape} are not summed over the experts (dim {e_dim} of "
                   f"{'[T, E=' + str(E) + ', d]' if token_major else '[E=' + str(E) + ', T, d]'})")
            walk.mark(reader)
            return reader, gates
        else:
            raise NoMatch(f"the expert outputs reach {reader.name}, not a sum over the experts")
        walk.mark(reader)
        node = reader


def _token_gate_column(node, walk: RegionWalk) -> fx.Node:
    """gates [T, E] given a trailing unit dim ([T, E, 1]: `gates.unsqueeze(-1)`, `gates[..., None]`,
    `gates[:, :, None]`), through float casts."""
    node = through_float_casts(node, walk)
    expect(len(shape_of(node)) == 3 and shape_of(node)[-1] == 1, f"{getattr(node, 'name', node)} is not a [T, E, 1] gate column")
    expect(is_call(node, "unsqueeze") and arg(node, 1, "dim") in (-1, 2)
           or getitem_of(node, (slice(None), slice(None), None)) is not None
           or getitem_of(node, (Ellipsis, None)) is not None,
           "the gate column is not the gate matrix unsqueezed last")
    walk.mark(node)
    gates = through_float_casts(node.args[0], walk)
    expect(len(shape_of(gates)) == 2, "the token-major gate column is not taken from a [T, E] gate matrix")
    return gates
