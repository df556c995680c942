"""What the two `nn.ModuleList` idioms (expert_loop, dense_experts) share.

Experts written as modules reach the graph as plain `F.linear` calls on each expert's own weight
placeholders. One expert, from the rows it reads to its output [rows, d]:

    separate gate/up  y = linear(act(linear(rows, W1)) * linear(rows, W3), W2)   W1, W3 [n, d]; W2 [d, n]
    fused gate/up     y = linear(act(chunk(linear(rows, W13))), W2)               W13 [2n, d] (either layout)
    non-gated         y = linear(act(linear(rows, W1)), W2)                       W1 [n, d]

The activation is probed, never read off op names (`activation_probe`), and every expert must
probe to the same one. The routing must be a top-k over the last dim of [T, E] scores: that is
what makes the ids distinct per token and in [0, E), which the rewrite relies on.

`finish_list_match` is `common.finish_match` for the list form: `sonic::moe_experts_list` gets
the weight placeholders as they are (no stacking).

Stacked experts (`stacked=True`, the loop idiom): each projection may instead read `W[e]`, a slice
of one [E, ., .] parameter, as `F.linear(rows, W[e])` / `rows @ W[e].T` ([E, out, in], nn.Linear's
orientation) or `rows @ W[e]` ([E, in, out]). Which one is read off the graph (a transpose or not),
never off the shapes: with d == n both are square. `finish_expert_match` checks that expert e
reads slice e of one parameter per projection, all in one orientation, none mutated, and then
passes the parameters themselves to `sonic::moe_experts` (w1 = gate/up or fused gate_up, w2 = down;
`transposed` for [E, in, out]); gate and up in two stacked parameters go to
`sonic::moe_experts_list` as the slices `W[e]` (views: the list kernels read each where it is).

Biases: an expert's Linears may carry them (nn.Linear's default), and a stacked expert may read
`F.linear(rows, W[e], B[e])` with B [E, out]. Gate and up are biased together or not at all; the
down projection on its own. Linear experts' bias vectors go to the list op stacked
(`MoEMatch.expert_bias_lists`: the rewrite stacks them in the graph, E (w1_out + d) elements);
stacked experts pass B itself to `sonic::moe_experts` (no copy).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from .activation_probe import identify_activation, identify_pair_activation
from .common import (
    MoEMatch,
    NoMatch,
    RegionWalk,
    arg,
    backward_slice,
    check_closed,
    check_stacked_biases,
    dtype_of,
    expect,
    getitem_of,
    is_call,
    is_int,
    is_getitem,
    module_path,
    shape_of,
    site_fields,
    writes_in_place,
)

_CAST_METHODS = ("to", "float", "half", "bfloat16", "double", "type_as", "contiguous")
_LINEAR = ("linear",)
_MATMUL = ("matmul", "mm", "__matmul__")
# view ops through which a mutation would still reach a stacked parameter
_VIEW_OPS = ("getitem", "getattr", "t", "transpose", "permute", "view", "reshape", "select", "narrow", "unsqueeze",
             "squeeze", "expand", "as_strided", "flatten", "unflatten", "view_as", "unbind", "split", "chunk", "detach",
             "contiguous", "swapaxes", "movedim", "diagonal", "to", "type_as", "float", "double", "half", "bfloat16",
             "expand_as", "alias", "split_with_sizes", "tensor_split", "unfold", "ravel", "adjoint", "conj",
             "resolve_conj", "resolve_neg", "moveaxis", "mT", "mH")


@dataclasses.dataclass(frozen=True)
class Slice:
    """`W[e]` of a stacked [E, ., .] parameter W, as one projection reads it."""

    base: fx.Node  # W, a graph input
    index: int  # e
    transposed: bool  # read as [in, out] (`rows @ W[e]`), not [out, in] (`F.linear(rows, W[e])`, `rows @ W[e].T`)
    part: bool = False  # a range of W[e]'s rows (`W[e, :n]`, `W[e][n:]`: a fused gate_up read in halves)


@dataclasses.dataclass
class ExpertMLP:
    """One expert's projections, as graph inputs, and its probed activation."""

    rows: fx.Node  # what the expert reads: [rows, d]
    w_gate: fx.Node  # [n, d] (separate or non-gated) or [2n, d] (fused gate/up); a stacked slice W[e] as it is
    w_up: fx.Node | None  # [n, d] when gate and up are separate Linears
    w_down: fx.Node  # [d, n]
    act: dict  # activation, interleaved, alpha, limit
    # (gate, up, down) slices when the weights are W[e] of stacked parameters, else None
    slices: tuple[Slice, Slice | None, Slice] | None = None
    # the Linears' biases (1-D graph inputs, or the B[e] slices of stacked experts), None where absent
    biases: tuple[fx.Node | None, fx.Node | None, fx.Node | None] = (None, None, None)

    @property
    def layout(self) -> str:
        return "separate" if self.w_up is not None else "single"

    @property
    def biased(self) -> tuple[bool, bool]:
        """(the up side has biases, the down projection has one)"""
        return self.biases[0] is not None, self.biases[2] is not None


def through_float_casts(node, walk: RegionWalk):
    """Skip `.to(<float dtype>)`, `.float()`... casts that keep a float tensor float: they round,
    never change what is computed."""
    while is_call(node, *_CAST_METHODS):
        src, out = dtype_of(node.args[0]), dtype_of(node)
        if src is None or out is None or not src.is_floating_point or not out.is_floating_point:
            break
        if node.target == "to" and any(isinstance(a, (str, torch.device)) for a in (*node.args[1:], *node.kwargs.values())):
            break  # a device move is not a cast
        walk.mark(node)
        node = node.args[0]
    return node


def is_weight(node) -> bool:
    """A graph input (a parameter Dynamo lifted, or a get_attr): read in place, never computed."""
    return isinstance(node, fx.Node) and node.op in ("placeholder", "get_attr")


def biased_matmul(node) -> tuple[fx.Node, fx.Node] | None:
    """(product, bias) when `node` is `rows @ W[e] + B[e]` (either order of the add): a matmul's
    result plus a slice B[e] of a stacked [E, out] parameter, the bias added as its own op."""
    if not (is_call(node, "add", "__add__") and len(node.args) == 2 and not node.kwargs):
        return None
    for product, bias in (node.args, node.args[::-1]):
        if is_call(product, *_MATMUL) and _slice_of(bias, dims=2) is not None \
                and shape_of(node) == shape_of(product):
            return product, bias
    return None


def _linear(node, what: str, walk: RegionWalk | None = None) -> tuple[fx.Node, fx.Node, Slice | None, fx.Node | None]:
    """(input, weight, slice, bias) of `F.linear(input, weight, bias?)`, rejecting computed weights
    and biases.

    With a walk (stacked experts allowed), also `F.linear(input, W[e], B[e]?)`, `input @ W[e].T` and
    `input @ W[e]`: then the weight is the slice node `W[e]` and `slice` says which of W and e (the
    bias B[e] must slice the same e)."""
    projection = _LINEAR + (_MATMUL if walk is not None else ())
    added = biased_matmul(node) if walk is not None else None
    if added is not None:  # rows @ W[e] + B[e]: the product, its bias checked below as F.linear's is
        walk.mark(node, added[0])
        node, bias = added
    if walk is not None and added is None and is_call(node, "add", "__add__") \
            and any(is_call(a, *_MATMUL) for a in node.args):
        raise NoMatch(f"{what} is a matmul plus a bias that is not a slice B[e] of a stacked [E, out] parameter "
                      f"(`h @ W + b` is taken over slices W[e], B[e] of stacked parameters only)")
    expect(is_call(node, *projection), f"{what} is not an nn.Linear/F.linear call" + (" or a matmul" if walk else ""))
    if added is None:
        bias = None
    if is_call(node, *_LINEAR):
        inp, weight, bias, transposed = arg(node, 0, "input"), arg(node, 1, "weight"), arg(node, 2, "bias"), False
    else:
        expect(len(node.args) == 2 and not node.kwargs, f"{what} is a matmul with extra arguments")
        inp, weight, transposed = node.args[0], node.args[1], True  # rows @ W: W is [in, out]
    if walk is not None and not is_weight(weight):
        inner = _transposed_2d(weight)
        if inner is not None:  # rows @ W[e].T, F.linear(rows, W[e].T)
            walk.mark(weight)
            weight, transposed = inner, not transposed
        found = _slice_of(weight)
        expect(found is not None, f"{what} weight is neither a parameter of the expert nor a slice W[e] (or rows W[e, a:b]) of a stacked [E, ., .] parameter")
        walk.mark(weight)
        if bias is not None:
            found_bias = _slice_of(bias, dims=2)
            expect(found_bias is not None and found_bias[1] == found[1],
                   f"{what} bias is not the slice B[{found[1]}] of a stacked [E, out] parameter, as its weight is of {found[0].name}")
            walk.mark(bias)
        return inp, weight, Slice(found[0], found[1], transposed, found[2]), bias
    expect(not transposed, f"{what} multiplies by a parameter that is not a slice W[e] of stacked experts")
    expect(is_weight(weight) and len(shape_of(weight)) == 2, f"{what} weight is not a parameter of the expert")
    expect(bias is None or (is_weight(bias) and len(shape_of(bias)) == 1), f"{what} bias is not a 1-D parameter of the expert")
    return inp, weight, None, bias


def _transposed_2d(node) -> fx.Node | None:
    """t when `node` is `t.T`, `t.mT`, `t.t()`, `t.transpose(0, 1)` or `t.permute(1, 0)` of a 2-D t."""
    if not isinstance(node, fx.Node) or node.op not in ("call_function", "call_method"):
        return None
    src = node.args[0] if node.args else None
    if not isinstance(src, fx.Node) or len(shape_of(src)) != 2:
        return None
    if is_call(node, "getattr") and len(node.args) == 2 and node.args[1] in ("T", "mT"):
        return src
    if is_call(node, "t") and len(node.args) == 1 and not node.kwargs:
        return src
    if is_call(node, "transpose", "swapaxes") and not node.kwargs and len(node.args) == 3:
        dims = node.args[1:]
        if all(isinstance(i, int) and not isinstance(i, bool) for i in dims) and {i % 2 for i in dims} == {0, 1}:
            return src
    if is_call(node, "permute") and not node.kwargs:
        dims = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (tuple, list)) else node.args[1:]
        if all(isinstance(i, int) and not isinstance(i, bool) for i in dims) and tuple(i % 2 for i in dims) == (1, 0):
            return src
    return None


def _slice_of(node, dims: int = 3) -> tuple[fx.Node, int, bool] | None:
    """(W, e, part) when `node` is `W[e]`: a constant integer index into dim 0 of a graph input W of
    `dims` dimensions (3 for weights, 2 for biases); or, with part True, a constant range of W[e]'s
    first dim, `W[e, a:b]` or `W[e][a:b]` (a fused gate_up parameter read in halves)."""
    if not is_getitem(node):
        return None
    base, index = node.args
    part = False
    if isinstance(index, tuple) and len(index) == 2 and _constant_range(index[1]):
        index, part = index[0], True  # W[e, a:b]
    elif _constant_range(index) and is_getitem(base):
        base, index, part = base.args[0], base.args[1], True  # W[e][a:b]
    if not (is_weight(base) or _split_weight(base)) or len(shape_of(base)) != dims or not is_int(index):
        return None
    return base, index, part


def _split_weight(node) -> bool:
    """`P.view(E, a, b)` (or `reshape`, `unflatten(0, (E, a))`) of a graph input P [E * a, b]: each
    expert's rows of one packed parameter (DBRX's experts), a view read in place."""
    if not is_call(node, "view", "reshape", "unflatten") or node.kwargs or not node.args:
        return False
    P = node.args[0]
    if not is_weight(P) or len(shape_of(P)) != 2 or len(shape_of(node)) != 3:
        return False
    if is_call(node, "unflatten") and node.args[1:2] not in ((0,), (-2,)):
        return False
    E, a, b = shape_of(node)
    return all(is_int(v) for v in (E, a, b)) and shape_of(P) == (E * a, b)


def _constant_range(index) -> bool:
    """A slice a:b with constant (or absent) ends and no step."""
    return (isinstance(index, slice) and index.step is None
            and all(v is None or (isinstance(v, int) and not isinstance(v, bool)) for v in (index.start, index.stop)))


def expert_mlp(y: fx.Node, walk: RegionWalk, e: int, stacked: bool = False) -> ExpertMLP:
    """The expert whose output is `y` ([rows, d], casts already skipped), checked.

    `stacked`: projections may also be matmuls with slices W[e] of stacked parameters (see above)."""
    what = f"expert {e}"
    slicing = walk if stacked else None
    a, w_down, s_down, b_down = _linear(y, f"{what}'s down projection", slicing)
    a = through_float_casts(a, walk)
    walk.mark(y)
    ups = projections_before(a, _LINEAR + (_MATMUL if stacked else ()))
    if stacked:  # a product whose one use adds its bias B[e]: the projection ends at that add
        ups = [next(iter(n.users)) if len(n.users) == 1 and biased_matmul(next(iter(n.users))) else n for n in ups]
    expect(ups, f"{what} has no projection before its down projection")
    rows = {arg((biased_matmul(n) or (n,))[0], 0, "input") for n in ups}  # the product's rows
    expect(len(rows) == 1, f"{what}'s projections read different inputs")
    expect(len(ups) in (1, 2), f"{what} has {len(ups)} projections of its input; 1 (fused or non-gated) or 2 (gate, up) are matched")
    found_ups = [_linear(n, f"{what}'s up projection", slicing) for n in ups]
    weights, slices, biases = ([f[i] for f in found_ups] for i in (1, 2, 3))
    expect(a not in ups, f"{what} has no activation between its projections")
    if len(ups) == 1:
        act = identify_activation(ups[0], a)
        expect(not isinstance(act, str), f"{what}: {act}")
        (w_gate, s_gate, b_gate), w_up, s_up, b_up = (weights[0], slices[0], biases[0]), None, None, None
    else:
        found = identify_pair_activation(ups[0], ups[1], a)
        expect(not isinstance(found, str), f"{what}: {found}")
        act, swapped = found
        if swapped:
            weights, slices, biases = weights[::-1], slices[::-1], biases[::-1]
        (w_gate, w_up), (s_gate, s_up), (b_gate, b_up) = weights, slices, biases
        expect((b_gate is None) == (b_up is None), f"{what} has a bias on one of its gate and up projections only")
    kinds = {s is None for s, w in ((s_gate, w_gate), (s_up, w_up), (s_down, w_down)) if w is not None}
    expect(len(kinds) == 1, f"{what} mixes Linear weights and slices of stacked parameters")
    walk.mark(*ups, *backward_slice([a], stop=set(ups)))
    return ExpertMLP(rows.pop(), w_gate, w_up, w_down, act, None if kinds == {True} else (s_gate, s_up, s_down),
                     (b_gate, b_up, b_down))


def projections_before(a: fx.Node, ops=_LINEAR) -> list[fx.Node]:
    """The projection nodes A is computed from, in graph order (the walk stops at each of them)."""
    found, seen, todo = [], set(), [a]
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        if is_call(node, *ops):
            found.append(node)
        else:
            todo.extend(node.all_input_nodes)
    order = {n: i for i, n in enumerate(a.graph.nodes)}
    return sorted(found, key=order.get)


def same_experts(experts: list[ExpertMLP]) -> None:
    """Every expert has the layout and the activation of expert 0 (the op applies one to all)."""
    first = experts[0]
    for e, ex in enumerate(experts[1:], 1):
        expect(ex.layout == first.layout, f"expert {e} has a {ex.layout} gate/up layout, expert 0 a {first.layout} one")
        expect(ex.act == first.act, f"expert {e}'s activation ({ex.act['activation']}) differs from expert 0's ({first.act['activation']})")
        expect(ex.biased == first.biased, f"expert {e} has biases on (up, down) = {ex.biased}, expert 0 on {first.biased}")


def topk_routing(topk_ids: fx.Node, walk: RegionWalk, token_dims: int = 1) -> tuple[int, int]:
    """(E, K) of `torch.topk(scores [T, E], K, dim=-1).indices`: distinct ids in [0, E) per token.
    `token_dims`: how many leading dims the scores' tokens take ([B, S, E]: 2)."""
    topk = getitem_of(topk_ids, 1)
    expect(is_call(topk, "topk"), "expert ids are not the indices of a torch.topk")
    scores, K = arg(topk, 0, "input"), arg(topk, 1, "k")
    shape = shape_of(scores)
    expect(len(shape) == token_dims + 1 and arg(topk, 2, "dim", -1) in (-1, token_dims),
           "top-k does not rank [T, E] scores over the experts")
    expect(isinstance(K, int) and isinstance(shape[-1], int), "top-k width or expert count is not static")
    expect(shape_of(topk_ids) == (*shape[:-1], K), f"top-k ids are not [T, K={K}]")
    return shape[-1], K


def top_k_or_max_routing(ids: fx.Node, walk: RegionWalk) -> tuple[int, int, bool]:
    """(E, K, flat) of expert ids: `topk_routing`'s [T, K] top-k indices, or (flat)
    the [T] indices of `scores.max(dim=-1)` over [T, E] scores, one expert per token (Switch
    Transformer's top-1), which the rewrite hands the op as [T, 1]; with keepdim=True they are
    [T, 1] already, a top-k of 1."""
    top1 = getitem_of(ids, 1)
    if not is_call(top1, "max"):
        return (*topk_routing(ids, walk), False)
    scores, dim, keepdim = arg(top1, 0, "input"), arg(top1, 1, "dim"), arg(top1, 2, "keepdim", False)
    shape = shape_of(scores)
    expect(isinstance(dim, int) and not isinstance(dim, bool) and len(shape) == 2 and dim in (-1, 1)
           and keepdim in (True, False) and len(top1.args) + len(top1.kwargs) <= 3,
           "expert ids are a max that does not rank [T, E] scores over the experts")
    expect(isinstance(shape[1], int), "expert count is not static")
    expect(shape_of(ids) == ((shape[0], 1) if keepdim else (shape[0],)),
           f"top-1 expert ids are not [T{', 1' if keepdim else ''}]")
    return shape[1], 1, not keepdim


def same_weights(a: ExpertMLP, b: ExpertMLP) -> bool:
    """Two calls of one expert: the same projections (the same graph inputs, or the same slices W[e]
    of the same stacked parameters, a slice node of its own at each call), biases and activation."""
    def key(node):
        if is_getitem(node) and is_int(node.args[1]):
            return node.args[0], node.args[1]
        return node
    parts = lambda ex: [key(n) for n in (ex.w_gate, ex.w_up, ex.w_down, *ex.biases)]  # noqa: E731
    return parts(a) == parts(b) and a.slices == b.slices and a.act == b.act


def ranked_over(topk_ids: fx.Node, E: int) -> bool:
    """Whether the ids are a top-k over E experts' scores in this graph, so every one lies in [0, E)
    (none is an expert-parallel sentinel)."""
    try:
        ranked, _ = topk_routing(topk_ids, RegionWalk())
    except NoMatch:
        return False
    return ranked == E


def finish_list_match(idiom, site, walk, anchor, anchors, x, topk_ids, topk_weights, experts: list[ExpertMLP], *,
                      E, K, T, d, accumulator=None, extra_region=(), shape_only=(), gates=False, added_to=None,
                      token_dims=False) -> MoEMatch:
    """Legality shared by the list idioms (dtypes, shapes, a closed region), then the typed match.

    `anchors` are the nodes whose backward slice is the region (every in-place add of a combine);
    `extra_region` are nodes nothing in that slice reads but that go with it (the runtime asserts
    Dynamo adds on `torch.where`'s sizes); `shape_only` are nodes that read their input only for
    its shape (`zeros_like`), so the region does not extend past them. `gates`: topk_weights is a
    [T, E] gate matrix to gather the weights from (`MoEMatch.gates`). `added_to`: a tensor outside
    the region that the combine adds the experts' sum to (`MoEMatch.added_to`). `token_dims`: x, the
    routing and the anchor keep two or more leading token dims (`MoEMatch.token_dims`).
    """
    from moe_compiler.codegen.activations import GATED

    same_experts(experts)
    act = experts[0].act
    x_dtype = _routing_dtypes(x, topk_ids, topk_weights)
    expect(len(experts) == E, f"{len(experts)} experts for E={E}")
    w_down = shape_of(experts[0].w_down)
    expect(len(w_down) == 2 and w_down[0] == d, f"down projection {w_down} does not map to d={d}")
    n = w_down[1]
    gated = GATED[act["activation"]]
    want_gate = (n if (experts[0].w_up is not None or not gated) else 2 * n, d)
    for e, ex in enumerate(experts):
        b_gate, b_up, b_down = ex.biases
        for node, want, name in ((ex.w_gate, want_gate, "gate weight"), (ex.w_up, (n, d), "up weight"),
                                 (ex.w_down, (d, n), "down weight"), (b_gate, want_gate[:1], "gate bias"),
                                 (b_up, (n,), "up bias"), (b_down, (d,), "down bias")):
            if node is None:
                continue
            expect(shape_of(node) == want, f"expert {e}'s {name} is {shape_of(node)}, not {want}")
            expect(dtype_of(node) == x_dtype, f"expert {e}'s {name} ({dtype_of(node)}) and the hidden states ({x_dtype}) differ in dtype")

    w_gate = [ex.w_gate for ex in experts]
    w_up = [ex.w_up for ex in experts] if experts[0].w_up is not None else []
    w_down = [ex.w_down for ex in experts]
    # the biases by projection, each list empty where the experts have none (same_experts: all alike)
    bias_lists = tuple([ex.biases[role] for ex in experts] if experts[0].biases[role] is not None else []
                       for role in range(3))
    inputs = {x, topk_ids, topk_weights, *w_gate, *w_up, *w_down, *(b for group in bias_lists for b in group)}
    inputs |= {added_to} if added_to is not None else set()
    region = _closed_region(walk, anchors, inputs, extra_region, shape_only)
    return _expert_match(idiom, site, anchor, region, x, topk_ids, topk_weights, act, x_dtype, accumulator,
                         shape={"T": T, "d": d, "n": n, "E": E, "K": K}, expert_lists=(w_gate, w_up, w_down),
                         expert_bias_lists=bias_lists if any(bias_lists) else None, gates=gates, added_to=added_to,
                         token_dims=token_dims)


def _expert_match(idiom, site, anchor, region, x, topk_ids, topk_weights, act, x_dtype, accumulator, *, shape,
                  **weights) -> MoEMatch:
    """The MoEMatch of the loop/dense idioms; `weights` are expert_lists=... or w1=, w2=, transposed=."""
    T, E = shape["T"], shape["E"]
    return MoEMatch(
        idiom=idiom,
        anchor=anchor,
        region=region,
        x=x,
        topk_ids=topk_ids,
        topk_weights=topk_weights,
        activation=act["activation"],
        interleaved=act["interleaved"],
        alpha=act["alpha"],
        limit=act["limit"],
        shape=shape,
        dtype=x_dtype,
        **site_fields(site, topk_ids, topk_weights, T, E, experts_module=module_path(site) + ".experts"),
        accumulator=accumulator,
        **weights,
    )


def _routing_dtypes(x, topk_ids, topk_weights) -> torch.dtype:
    x_dtype = dtype_of(x)
    expect(x_dtype is not None and x_dtype.is_floating_point, "hidden states are not floating point")
    expect(dtype_of(topk_weights) is not None and dtype_of(topk_weights).is_floating_point, "routing weights are not floating point")
    expect(dtype_of(topk_ids) is not None and not dtype_of(topk_ids).is_floating_point, "expert ids are not integers")
    return x_dtype


def _closed_region(walk, anchors, inputs, extra_region, shape_only) -> set[fx.Node]:
    stop = set(inputs) | {inp for node in shape_only for inp in node.all_input_nodes}
    region = backward_slice(anchors, stop=stop) | set(extra_region)
    check_closed(region, walk)
    return region


def finish_expert_match(idiom, site, walk, anchor, anchors, x, topk_ids, topk_weights, experts: list[ExpertMLP], *,
                        E, K, T, d, accumulator=None, extra_region=(), shape_only=(), gates=False, added_to=None,
                        token_dims=False) -> MoEMatch:
    """`finish_list_match` for experts that are Linears; for slices W[e] of stacked parameters
    (`experts[e]` must read slice e), `sonic::moe_experts` on the parameters themselves, or the
    list op on the slices when gate and up are two parameters. `gates`, `added_to`, `token_dims`
    as `finish_list_match` takes them."""
    kw = dict(E=E, K=K, T=T, d=d, accumulator=accumulator, extra_region=extra_region, shape_only=shape_only,
              gates=gates, added_to=added_to, token_dims=token_dims)
    stacked = {ex.slices is not None for ex in experts}
    expect(len(stacked) == 1, "some experts are Linear modules, others slices of stacked parameters")
    if stacked == {False}:
        return finish_list_match(idiom, site, walk, anchor, anchors, x, topk_ids, topk_weights, experts, **kw)
    from moe_compiler.codegen.activations import GATED

    same_experts(experts)
    expect(len(experts) == E, f"{len(experts)} experts for E={E}")
    parts = (any(one is not None and one.part for ex in experts for one in ex.slices)
             or any(b is not None and _slice_of(b, dims=2)[2] for ex in experts for b in ex.biases))
    w1, w_up, w2, transposed, swapped = _stacked_params(experts, E)
    b1, b2 = _stacked_biases(experts, E)
    if parts:  # ranges of W[e]: the list op on those views (never on W itself, whose other rows they leave out)
        expect(not transposed and not swapped, "ranges of stacked [E, in, out] weight slices are not supported")
        return finish_list_match(idiom, site, walk, anchor, anchors, x, topk_ids, topk_weights, experts, **kw)
    if w_up is not None and not transposed and not swapped:
        # the list op on the slices W[e] themselves: views of the stacked parameters, read where they are
        # (bias slices B[e], if any, are stacked by the rewrite as Linear biases are)
        return finish_list_match(idiom, site, walk, anchor, anchors, x, topk_ids, topk_weights, experts, **kw)

    act = experts[0].act
    x_dtype = _routing_dtypes(x, topk_ids, topk_weights)
    expect(x_dtype == dtype_of(w1) == dtype_of(w2), f"hidden states ({x_dtype}) and expert weights ({dtype_of(w1)}, {dtype_of(w2)}) differ in dtype")
    s1, s2 = shape_of(w1), shape_of(w2)
    w1_in, w1_out = (s1[1], s1[2]) if transposed else (s1[2], s1[1])
    n, w2_out = (s2[1], s2[2]) if transposed != swapped else (s2[2], s2[1])
    expect(w1_in == d and w2_out == d, f"stacked expert weights {s1} / {s2} do not map d={d}")
    if w_up is not None:  # [E, in, out] gate and up: the rewrite hands the list op each W[e].t() (views)
        expect(experts[0].biases[0] is None and experts[0].biases[1] is None,
               "biases on separate stacked gate and up parameters are not supported")
        expect(shape_of(w_up) == s1 and dtype_of(w_up) == x_dtype, f"up weights {shape_of(w_up)} are not shaped as the gate's {s1}")
        w1_out *= 2
    expect(w1_out == (2 * n if GATED[act["activation"]] else n), f"up-projection width {w1_out} does not fit n={n}")
    check_stacked_biases(b1, b2, E=E, w1_out=w1_out, d=d, x_dtype=x_dtype)
    inputs = {x, topk_ids, topk_weights, w1, w2} | {b for b in (b1, b2, w_up, added_to) if b is not None}
    region = _closed_region(walk, anchors, inputs, extra_region, shape_only)
    return _expert_match(idiom, site, anchor, region, x, topk_ids, topk_weights, act, x_dtype, accumulator,
                         shape={"T": T, "d": d, "n": n, "E": E, "K": K}, w1=w1, w2=w2, b1=b1, b2=b2,
                         transposed=transposed, w_up=w_up, w2_swapped=swapped, gates=gates, added_to=added_to,
                         token_dims=token_dims)


def _stacked_biases(experts: list[ExpertMLP], E: int) -> tuple[fx.Node | None, fx.Node | None]:
    """(up bias B1, down bias B2) of stacked experts, each None where the experts have none: expert
    e's bias is B[e] of one [E, out] parameter per projection (`_linear` matched its index to the
    weight's), not modified in the graph. With gate and up in two parameters the list op takes the
    slices instead (stacked by the rewrite), so only the down bias is looked at here then."""
    found = []
    for role, name in ((0, "up"), (2, "down")):
        biases = [ex.biases[role] for ex in experts]
        if biases[0] is None:
            found.append(None)
            continue
        bases = {_slice_of(b, dims=2)[0] for b in biases}
        expect(len(bases) == 1, f"experts read their {name} biases from different stacked parameters")
        base = bases.pop()
        expect(shape_of(base)[0] == E, f"stacked {name} bias {base.name} {shape_of(base)} does not hold the router's E={E} experts")
        mutation = _mutation_of(base)
        expect(mutation is None, f"stacked bias {base.name} is modified in the graph (by {getattr(mutation, 'name', '')}): the op would read it once")
        found.append(base)
    return found[0], found[1]


def _stacked_params(experts: list[ExpertMLP], E: int) -> tuple[fx.Node, fx.Node | None, fx.Node, bool, bool]:
    """(gate W, up W or None, down W, transposed, down swapped): expert e reads slice e of one
    [E, ., .] parameter per projection, the gate and up slices in one orientation (`transposed`),
    the down slices in one (the other: `down swapped`, DBRX's storage), and no parameter is
    modified in the graph."""
    bases, orientations = [], []
    for role, name in enumerate(("gate", "up", "down")):
        found = [ex.slices[role] for ex in experts]
        if found[0] is None:  # no separate up projection (same_experts: none has one)
            bases.append(None)
            continue
        for e, one in enumerate(found):
            expect(one.index == e, f"expert {e}'s {name} projection reads {one.base.name}[{one.index}], not slice {e} of its stacked weight")
        base = {one.base for one in found}
        expect(len(base) == 1, f"experts read their {name} projections from different stacked parameters")
        bases.append(base.pop())
        orientations.append({one.transposed for one in found})
        expect(len(orientations[-1]) == 1, f"the {name} slices are read both as [out, in] (F.linear(x, W[e]), x @ W[e].T) "
               "and as [in, out] (x @ W[e])")
        expect(shape_of(bases[-1])[0] == E, f"stacked {name} weight {bases[-1].name} {shape_of(bases[-1])} does not hold the router's E={E} experts")
    up_side = set().union(*orientations[:-1])
    expect(len(up_side) == 1, "stacked gate and up weights are read both as [out, in] (F.linear(x, W[e]), x @ W[e].T) "
           "and as [in, out] (x @ W[e]): the op takes one layout for them")
    for base in dict.fromkeys(b for b in bases if b is not None):
        mutation = _mutation_of(base)
        expect(mutation is None, f"stacked weight {base.name} is modified in the graph (by {getattr(mutation, 'name', '')}): the op would read it once")
    gate, up, down = bases
    transposed = up_side.pop()
    return gate, up, down, transposed, orientations[-1] != {transposed}


def _mutation_of(base: fx.Node) -> fx.Node | None:
    """An in-place node on `base` or on a view of it, anywhere in the graph (for a packed parameter
    viewed per expert, `_split_weight`, on the parameter or any view of it)."""
    seen, todo = set(), [base.args[0] if _split_weight(base) else base]
    while todo:
        node = todo.pop()
        for user in node.users:
            if user in seen:
                continue
            seen.add(user)
            mutated = (bool(user.args) and user.args[0] is node) or any(user.kwargs.get(k) is node for k in ("input", "self"))
            if (writes_in_place(user) and mutated) or "out" in user.kwargs:
                return user
            if is_call(user, *_VIEW_OPS):
                todo.append(user)
    return None
