"""MoE code that no finder reads, found by what it computes: the last finder, and the one that
reads no spelling at all.

For each top-k (or max) over [T, E] router scores whose ids reach two or three stacked [E, ., .]
weights, or the `linear` calls of E experts (two or three Linears each, on rows the ids
dispatched), and that no finder took, it forms hypotheses of what the code computes and keeps the
first that evaluation confirms:

    x        the [T, d] hidden states the router reads, which the expert code reads as well
    weights  a [T, K] float tensor computed from the router's values ([T] for a top-1); K [T]
             columns, one per slot, read as `stack(columns, 1)[:, k]`; or a [T, E] matrix the op
             reads at the ids (the probabilities the router ranks), filled outside them in the
             evaluation so that a region reading it there differs
    experts  which stacked weight is the first projection (gate and up: two of one shape), which
             the down projection, in which orientation (the down one possibly the other way round),
             with [E, width] biases where their widths fit; or the Linears' weights as per-expert
             lists, each expert's in the order first read, expert by expert or role by role
    act      every activation the op computes of that width (the gated ones both concatenated and
             interleaved; gpt-oss's with the region's own numbers as alpha and limit)
    anchor   a node of x's shape that depends on every expert weight: the first whose value the op
             computes
    kept     where the region counts each expert's tokens and compares a count with a bound (a
             capacity): None, or the region's own nodes that say which slots it keeps, which the
             op honours by dropping the others (`MoEMatch.slot_keep`)

Tokens kept in two or more leading dims ([B, S, d], [G, S, E] scores) are read through those dims
and handed to the op as [T, .] views. The region is everything between those inputs and the
anchor. It must write nothing in place (but the fill of a permutation's inverse it reads, which
runs with it), read nothing else, keep what the experts compute to itself (a value read elsewhere
would stay and be computed twice), hold no threshold on float values that random inputs may never
cross (a clamp, a comparison with a number other than 0: a clamp at 7.0 would pass for a plain
SwiGLU where no probe value reaches 7; counts computed from the ids alone are routings' business)
and no op whose gradient need not be its value's derivative (a library op, a detach: the
evaluation compares values only), and `verify` must evaluate it (float64, random and adversarial
routings: an idle expert, every token on one expert, tied weights) equal to the op's reference for
one hypothesis. Nothing structural is trusted: a hypothesis is only a guess at the op's arguments,
and the evaluation decides. The crowded routing drops slots at any capacity below T, so a wrong
kept-slot guess, or a combine that still weighs a dropped slot, differs. It runs on the CPU
whatever the graph's device: a wrong guess may index out of range, which the CPU reports as an
error and a CUDA kernel as a device-side assert that ends the process's use of the GPU. A region
too large for the CPU, in a graph on CUDA (a capacity layer at a model's size), is split: its
routing part (all it computes from neither the hidden states nor the expert weights) runs on the
CPU, the rest on the GPU, reading only indices the CPU computed and proved in range
(`verify.placed`, `indices`). A region too large for that too is left alone.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import operator

import torch
import torch.fx as fx

from moe_compiler.codegen.activations import GATED

from .common import (ZEROS, MoEMatch, NoMatch, RegionWalk, Rejection, arg, backward_slice, dtype_of, example_value,
                     expect, finish_match, insert_call, is_call, is_getitem, module_path, op_name, same_shape, same_size,
                     shape_of, storage_of, writes_in_place)
from .module_list import ExpertMLP, finish_list_match
from .unmatched import _COMPARE, _feeding, _forward, _routers, counts_over_tokens

IDIOM = "evaluated"
_MAX_CANDIDATES = 4  # of x, of the weights, of the anchors: hypotheses stay in the hundreds


def find(gm: fx.GraphModule) -> list[MoEMatch | Rejection]:
    results: list[MoEMatch | Rejection] = []
    # a region computed under torch.no_grad shows no trace of it in its own nodes (the switch is a
    # node no value reads): the pass driver's `check_grad_mode_unchanged` leaves such a match alone
    for ids, E, router in _routers(gm):
        reached = _forward(ids)
        if any(str(n.target).startswith("sonic.") for n in reached):
            continue  # another finder rewrote these experts
        scoring = set(_feeding([router])) | {router}
        products = reached + [n for n in _feeding(reached) if n not in reached and n not in scoring]
        params = _params(products, E)
        stacked = [p for p in params if len(shape_of(p)) == 3 and not _row_bias(p)]
        # Linears on dispatched rows (what the ids reach), else on every token (what feeds the combine)
        linears = (_linear_weights(reached, E) or _linear_weights(products, E)) if len(stacked) not in (2, 3) else None
        if len(stacked) not in (2, 3) and linears is None:
            continue  # no experts this finder reads (stacked [E, ., .] weights, or E experts' Linears on routed rows)
        try:
            results.append(_search(router, ids, E, reached, scoring, params, linears))
        except NoMatch as exc:
            results.append(Rejection(IDIOM, module_path(router), str(exc)))
    return results


def _params(nodes: list[fx.Node], E: int) -> list[fx.Node]:
    """Graph inputs of shape [E, ., .] or [E, .] that the nodes read, in graph order."""
    found = []
    for node in nodes:
        for inp in node.all_input_nodes:
            shape = shape_of(inp)
            if inp.op in ("placeholder", "get_attr") and len(shape) in (2, 3) and shape[0] == E and inp not in found:
                found.append(inp)
    return found


def _row_bias(p: fx.Node) -> bool:
    """An [E, 1, width] parameter: a bias kept with a unit row dim (tutel's batched_fc1_bias),
    added to each expert's [C, width] rows; the op reads it as its [E, width] view."""
    shape = shape_of(p)
    return len(shape) == 3 and shape[1] == 1


def _search(router: fx.Node, ids: fx.Node, E: int, reached: list[fx.Node], scoring: set[fx.Node],
            params: list[fx.Node], linears: tuple | None) -> MoEMatch:
    # the token dims: the scores' leading dims ([T], or [B, S] where the code never flattens them)
    tok = tuple(shape_of(arg(router, 0, "input"))[:-1])
    shape = tuple(shape_of(ids))
    top1 = _leads(shape, tok, 0)
    expect(dtype_of(ids) in (torch.int32, torch.int64) and (top1 or _leads(shape, tok, 1)),
           "the ids are not [T, K] or [T] (or [B, S, K])")
    token_dims = len(tok) > 1
    T, K = math.prod(tok), 1 if top1 else shape[-1]
    stacked = [p for p in params if len(shape_of(p)) == 3 and not _row_bias(p)]
    biases = [p for p in params if len(shape_of(p)) == 2 or _row_bias(p)]
    xs = _hidden_states(scoring, reached, tok)
    expect(xs, "no [T, d] hidden states read by both the router and the experts")
    # what each expert weight reaches, for every hypothesis
    forward = {p: set(_forward(p)) for p in (stacked if linears is None else linears[0])}
    weights = _weights(router, ids, forward, tok, K, top1)
    columns = _slot_columns(router, ids, forward, tok, K) if not (top1 or token_dims) else []
    gate_matrices = _gate_matrices(router, forward, tok, E) if K != E else []
    expect(weights or columns or gate_matrices, f"no [T, {K}] float weights computed from the router's values")
    keeps = _keeps(ids, reached, forward, tok, K, E, top1)
    tried, unevaluated = 0, None
    for candidate in [*weights, *columns, *gate_matrices]:
        with _as_weights(router.graph.owning_module, candidate) as stacked_w:
            w = stacked_w.node
            for x in xs:
                d = shape_of(x)[-1]
                guesses = (_stacked_guesses(stacked, biases, d) if linears is None else _list_guesses(*linears, E, d))
                for guess, anchor, keep in itertools.product(list(guesses), _anchors(reached, x, forward), keeps):
                    acts = guess.acts(anchor)
                    if not acts:
                        continue  # widths no activation of the op has
                    tried += len(acts)
                    match = _match(router, anchor, x, ids, w, guess, acts[0], E=E, K=K, T=T, d=d, top1=top1,
                                   forward=forward, keep=keep, gates=candidate in gate_matrices,
                                   token_dims=token_dims)
                    if match is None:
                        continue
                    found = _evaluate(match, acts)
                    if isinstance(found, MoEMatch):
                        stacked_w.kept = True
                        return found
                    if found.startswith("too large"):
                        unevaluated = found
    if unevaluated is not None:
        raise NoMatch(f"the region is {unevaluated}, and this finder has no structural proof to rest on: left alone")
    expect(tried, "no hypothesis fits the shapes: no x-shaped node computed from every stacked weight with "
                  "weights' widths the op takes")
    raise NoMatch(f"no hypothesis evaluated equal to the op ({tried} tried: hidden states, routing weights, expert "
                  f"weights' roles and orientations, activations, outputs)")


def _evaluate(match: MoEMatch, acts: list[dict]) -> MoEMatch | str:
    """The match, verified, where the region evaluates equal to the op with one of `acts`; else why
    not. The region runs once; each activation's op is compared with it (on the CPU: see above)."""
    from .verify import first_equal, verify

    found = first_equal(match, acts, on_cpu=True)  # each act: the MoEMatch fields it sets
    if not isinstance(found, dict):
        return found
    outcome = verify(match, on_cpu=True)  # the winner's record, as every finder's
    match.verified = f"found by evaluation: {outcome}"
    return match


def _leads(shape, tok: tuple, extra: int) -> bool:
    """Whether `shape` is the token dims `tok` and `extra` dims more."""
    return len(shape) == len(tok) + extra and same_shape(tuple(shape[:len(tok)]), tok)


def _hidden_states(scoring: set[fx.Node], reached: list[fx.Node], tok: tuple) -> list[fx.Node]:
    """[T, d] float tensors the router's scores are computed from (graph inputs too) that the expert
    side (what the ids reach, and what that reads, less the router) reads as well."""
    expert_side = (set(reached) | set(_feeding(reached))) - scoring
    read = {i for n in expert_side for i in n.all_input_nodes}
    routed = scoring | {i for n in scoring for i in n.all_input_nodes}
    graph = next(iter(scoring)).graph
    found = [n for n in graph.nodes if n in read and n in routed and _leads(shape_of(n), tok, 1)
             and dtype_of(n) is not None and dtype_of(n).is_floating_point]
    return found[:_MAX_CANDIDATES]


def _weights(router: fx.Node, ids: fx.Node, forward: dict, tok: tuple, K: int, top1: bool) -> list[fx.Node]:
    """[T, K] (top-1: [T]) float nodes computed from the router's outputs and from no expert weight
    (`forward`: what each stacked weight reaches), the latest first (renormalised weights come after
    the raw top-k values)."""
    expert_side = set().union(*forward.values())
    found = [n for n in _forward(router) if n not in expert_side and n is not ids
             and (_leads(shape_of(n), tok, 0) if top1 else _leads(shape_of(n), tok, 1) and shape_of(n)[-1] == K)
             and dtype_of(n) is not None and dtype_of(n).is_floating_point]
    return found[::-1][:_MAX_CANDIDATES]


def _keeps(ids: fx.Node, reached: list[fx.Node], forward: dict, tok: tuple, K: int, E: int, top1: bool) -> list:
    """What a capacity-limited router keeps, as `MoEMatch.slot_keep` hypotheses: None (every slot
    kept) first; then, where the region counts each expert's tokens (a cumsum over the tokens) and
    compares a count with a bound, the comparisons and the nodes nearest after them, computed from
    the ids alone and from no expert weight: [T] per token, [T, K] per slot ([T * K] flattened),
    [T, E] read at each slot's id. Each for every slot, and (K > 1) K of them from K comparisons in graph order, one
    per slot (GShard's: the second choices counted after all first ones)."""
    expert_side = set().union(*forward.values())
    per_comparison = []
    for comparison in _capacity_comparisons(reached):
        found = []
        for node in [comparison, *_forward(comparison)]:
            shape = shape_of(node)
            if node in expert_side or not shape or not _of_ids_alone(node, ids):
                continue
            kind = ("token" if _leads(shape, tok, 0)
                    else "flat" if len(shape) == 1 and len(tok) == 1 and K > 1 and same_size(shape[0], tok[0] * K)
                    else "expert" if _leads(shape, tok, 1) and shape[-1] == E
                    else "slot" if _leads(shape, tok, 1) and shape[-1] == K and not top1 else None)
            if kind is not None:
                found.append((node, kind))
            if len(found) == 3:
                break
        per_comparison.append(found)
    singles = [(f,) for found in per_comparison for f in found][:_MAX_CANDIDATES]
    per_slot = []
    if K > 1:
        for chosen in itertools.combinations(per_comparison, K):
            per_slot += [keep for keep in itertools.product(*chosen) if all(kind in ("token", "expert") for _, kind in keep)]
    return [None, *singles, *per_slot[:2 * _MAX_CANDIDATES]]


def _capacity_comparisons(reached: list[fx.Node]) -> list[fx.Node]:
    """Comparisons (<, <=, >, >=) that running counts over the tokens (a cumsum over a dim before
    the last, the experts') reach, in graph order: where capacity-limited routing drops the slots
    past a bound."""
    counts = [n for n in reached if is_call(n, "cumsum") and counts_over_tokens(n)]
    found = {u for c in counts for u in _forward(c) if is_call(u, *_COMPARE)}
    return [n for n in reached if n in found]


def _of_ids_alone(node: fx.Node, ids: fx.Node) -> bool:
    """Whether `node` is computed from `ids`, numbers and sizes alone (no other tensor the graph
    takes or holds): what routings, not random values, decide."""
    cone = backward_slice([node], stop={ids})
    return not any(n.op in ("placeholder", "get_attr") and isinstance(example_value(n), torch.Tensor) for n in cone)


def _slot_columns(router: fx.Node, ids: fx.Node, forward: dict, tok: tuple, K: int) -> list[tuple[fx.Node, ...]]:
    """K [T] float nodes computed from the router's outputs and from no expert weight, in graph
    order, one per slot: weights a top-k gating keeps per slot (GShard's `g1`, `g2`), among the
    latest such nodes."""
    expert_side = set().union(*forward.values())
    found = [n for n in _forward(router) if n not in expert_side and n is not ids and n.users
             and _leads(shape_of(n), tok, 0) and dtype_of(n) is not None and dtype_of(n).is_floating_point]
    return list(itertools.combinations(found[-_MAX_CANDIDATES:], K))


def _gate_matrices(router: fx.Node, forward: dict, tok: tuple, E: int) -> list[fx.Node]:
    """[T, E] float matrices the op may read its weights from at the ids: the scores the router
    ranks, then [T, E] float nodes computed from the router's outputs and from no expert weight
    (DeepSpeed's `gates * mask`), the latest first. Evaluated filled outside the ids too
    (`MoEMatch.gates_dense`): a region that reads them there is no hypothesis's."""
    expert_side = set().union(*forward.values())
    ranked = arg(router, 0, "input")
    found = [n for n in [ranked, *[n for n in _forward(router) if n not in expert_side][::-1]]
             if isinstance(n, fx.Node) and dtype_of(n) is not None and dtype_of(n).is_floating_point
             and _leads(shape_of(n), tok, 1) and shape_of(n)[-1] == E]
    return found[:_MAX_CANDIDATES - 1]


@dataclasses.dataclass
class _Weights:
    node: fx.Node  # the [T, K] weights
    kept: bool = False  # the graph keeps the stack built for them


@contextlib.contextmanager
def _as_weights(gm: fx.GraphModule, candidate):
    """The [T, K] weights node of a candidate: the node itself, or for K per-slot [T] columns a
    `torch.stack(columns, 1)` put into the graph after them, every other read of column k becoming
    a read of `stack[:, k]` (the same values; a column computed after another's first read is
    computed before it where its inputs allow, and reads before the stack stay), so the region reads
    the weights as the op does. The
    graph goes back as it was on leaving, unless the hypothesis it served is kept."""
    if isinstance(candidate, fx.Node):
        yield _Weights(candidate)
        return
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    first_read = min((u for column in candidate for u in column.users), key=order.__getitem__)
    moved = []
    if all(order[i] < order[first_read] for column in candidate for i in column.all_input_nodes):
        # a column computed after another's first read (GShard's loop over the slots): computed
        # before that read instead, from the same inputs
        for column in candidate:
            if order[column] > order[first_read]:
                moved.append((column, column.prev))
                first_read.prepend(column)
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
    last = max(candidate, key=order.__getitem__)
    stack = insert_call(gm, last.next, torch.stack, (list(candidate), 1))
    reads = []
    for k, column in enumerate(candidate):
        read = insert_call(gm, stack.next, operator.getitem, (stack, (slice(None), k)))
        for user in [u for u in column.users if u is not stack and order.get(u, len(order)) > order[last]]:
            user.replace_input_with(column, read)
        reads.append((read, column))
    weights = _Weights(stack)
    try:
        yield weights
    finally:
        if not weights.kept:
            for read, column in reads:
                read.replace_all_uses_with(column)
                gm.graph.erase_node(read)
            gm.graph.erase_node(stack)
            for column, before in reversed(moved):
                before.append(column)


def _anchors(reached: list[fx.Node], x: fx.Node, forward: dict) -> list[fx.Node]:
    """Nodes of x's shape computed from every stacked weight (`forward`: what each reaches), the
    latest first (a sum built up over slots or experts is complete at its last step; a node past the
    MoE, a residual add, fails the evaluation and costs one try); then the last write in place into
    a buffer of zeros of x's shape that every expert writes into (an in-place combine: the buffer
    is the result, `MoEMatch.accumulator`)."""
    on_all = set.intersection(*forward.values())
    sx = shape_of(x)
    found, last_write = [], {}
    for node in reached:
        shape = shape_of(node)
        if node in on_all and writes_in_place(node) and node.args and is_call(node.args[0], *ZEROS) \
                and same_shape(shape_of(node.args[0]), sx):
            last_write[node.args[0]] = node
        if node not in on_all or not shape or dtype_of(node) is None or not dtype_of(node).is_floating_point:
            continue
        if same_shape(shape, sx):
            found.append(node)
    return found[::-1][:2 * _MAX_CANDIDATES] + list(last_write.values())[:2]


@dataclasses.dataclass
class _Guess:
    """One guess at the expert weights' roles: stacked (w1, w_up, w2 in one orientation, stacked
    biases) or per-expert lists (each expert's Linears: gate, up, down, their biases)."""

    inputs: tuple  # every weight and bias node the op would read
    w1_out: int  # the first projection's width (gate and up together)
    n: int  # the down projection's input width
    separate: bool  # gate and up are two weights
    stacked: tuple | None = None  # (w1, w_up, w2, transposed, b1, b2, w2 swapped)
    lists: tuple | None = None  # ((gate, up, down) weight lists, (gate, up, down) bias lists or None)

    def acts(self, anchor: fx.Node) -> list[dict]:
        """Every activation the op computes at these widths: gated ones where the first projection
        is twice the down projection's input (interleaved too where gate and up are one weight),
        the others where they are equal; gpt-oss's with the region's own numbers."""
        if self.w1_out == 2 * self.n:
            names = [(a, inter) for a in GATED if GATED[a] and a not in ("swiglu_clamp", "swiglu_softcap")
                     for inter in ((False,) if self.separate else (False, True))]
        elif self.w1_out == self.n and not self.separate:
            names = [(a, False) for a in GATED if not GATED[a]]
        else:
            return []
        numbers = _numbers(anchor)
        acts = []
        for activation, interleaved in names:
            pairs = [(1.702, 7.0)]
            if activation == "swiglu_oai":
                pairs += [(a, lim) for a in numbers for lim in numbers if a != lim][:8]
            acts += [dict(activation=activation, interleaved=interleaved, alpha=alpha, limit=limit) for alpha, limit in pairs]
        return acts

    def finish(self, router, walk, anchor, x, ids, w, act, *, E, K, T, d, token_dims=False, extra_region=(),
               accumulator=None) -> MoEMatch:
        if self.stacked is not None:
            w1, w_up, w2, transposed, b1, b2, swapped = self.stacked
            return finish_match(IDIOM, router, walk, anchor, x, ids, w, w1, w2, b1, b2, transposed, act, E=E, K=K,
                                T=T, d=d, w_up=w_up, token_dims=token_dims, w2_swapped=swapped)
        (gate, up, down), bias_lists = self.lists
        bias = lambda role, e: bias_lists[role][e] if bias_lists is not None and bias_lists[role] else None  # noqa: E731
        experts = [ExpertMLP(rows=x, w_gate=gate[e], w_up=up[e] if up else None, w_down=down[e], act=act,
                             biases=(bias(0, e), bias(1, e), bias(2, e))) for e in range(E)]
        return finish_list_match(IDIOM, router, walk, anchor, [anchor], x, ids, w, experts, E=E, K=K, T=T, d=d,
                                 token_dims=token_dims, extra_region=extra_region, accumulator=accumulator)


def _stacked_guesses(stacked: list[fx.Node], biases: list[fx.Node], d: int):
    """Guesses over stacked weights: w1 [E, w1_out, d] (transposed: [E, d, w1_out]) and w2 [E, d, n]
    ([E, n, d]) in one orientation or (`w2_swapped`) in the other, with [E, width] biases where their
    widths fit."""
    for order in itertools.permutations(stacked):
        if len(order) == 2:
            (w1, w2), w_up = order, None
        else:
            w1, w_up, w2 = order
            if shape_of(w1) != shape_of(w_up):
                continue
        s1, s2 = shape_of(w1), shape_of(w2)
        for transposed, swapped in itertools.product((False, True), (False, True)):
            # swapped: the down weights in the other orientation than the first (megablocks' [E, f, d] pair)
            w1_in, w1_out = (s1[1], s1[2]) if transposed else (s1[2], s1[1])
            n, w2_out = (s2[1], s2[2]) if transposed != swapped else (s2[2], s2[1])
            if w1_in != d or w2_out != d:
                continue
            w1_out *= 2 if w_up is not None else 1
            up_biases = [None] + [b for b in biases if shape_of(b)[-1] == w1_out and w_up is None]
            down_biases = [None] + [b for b in biases if shape_of(b)[-1] == d]
            for b1, b2 in itertools.product(up_biases, down_biases):
                inputs = tuple(p for p in (w1, w_up, w2, b1, b2) if p is not None)
                yield _Guess(inputs, w1_out, n, w_up is not None, stacked=(w1, w_up, w2, transposed, b1, b2, swapped))


def _linear_weights(nodes: list[fx.Node], E: int) -> tuple[list[fx.Node], dict] | None:
    """(weights, bias of each) of the `linear` calls among `nodes` (a ModuleList's experts on
    dispatched rows, or on every token): 2-D graph inputs in the order first read, each with the
    call's own bias or None; None unless there are two or three per expert."""
    weights, bias_of = [], {}
    for node in nodes:
        if not is_call(node, "linear") or len(node.args) < 2:
            continue
        weight, bias = node.args[1], arg(node, 2, "bias")
        if isinstance(weight, fx.Node) and weight.op in ("placeholder", "get_attr") and len(shape_of(weight)) == 2 \
                and weight not in bias_of:
            weights.append(weight)
            bias_of[weight] = bias if isinstance(bias, fx.Node) and bias.op in ("placeholder", "get_attr") else None
    return (weights, bias_of) if len(weights) in (2 * E, 3 * E) else None


def _list_guesses(weights: list[fx.Node], bias_of: dict, E: int, d: int):
    """Guesses over E experts' Linear weights, read in one of two orders: expert by expert (each
    expert's first projections, then its down projection) or role by role (every expert's gate,
    then every up, then every down); shapes as `moe_experts_list` takes them ([out, in])."""
    roles = len(weights) // E
    for grouping in ("expert", "role"):
        groups = [weights[j::roles] if grouping == "expert" else weights[j * E:(j + 1) * E] for j in range(roles)]
        if any(len({shape_of(w) for w in group}) != 1 for group in groups):
            continue
        *firsts, down = groups
        (w1_out, w1_in), (down_out, n) = shape_of(firsts[0][0]), shape_of(down[0])
        if w1_in != d or down_out != d or (roles == 3 and shape_of(firsts[1][0]) != (n, d)):
            continue
        bias_lists = [[bias_of[w] for w in group] for group in groups]
        if any(None in group and any(b is not None for b in group) for group in bias_lists):
            continue  # some experts biased, some not
        bias_lists = [group if group[0] is not None else [] for group in bias_lists]
        lists = (firsts[0], firsts[1] if roles == 3 else [], down)
        biases = ((bias_lists[0], bias_lists[1] if roles == 3 else [], bias_lists[-1])
                  if any(bias_lists) else None)
        inputs = tuple(weights) + tuple(b for group in bias_lists for b in group)
        yield _Guess(inputs, w1_out * (2 if roles == 3 else 1), n, roles == 3, lists=(lists, biases))


def _numbers(anchor: fx.Node) -> list[float]:
    """Float literals the code before the anchor uses (gpt-oss's alpha and clamp limit among them)."""
    found = []
    for node in anchor.graph.nodes:
        for a in (*node.args, *node.kwargs.values()):
            if isinstance(a, float) and a > 0 and a not in found:
                found.append(a)
        if node is anchor:
            break
    return found[:6]


_CLAMPS = ("clamp", "clamp_", "clamp_min", "clamp_max", "clip", "hardtanh", "threshold", "nan_to_num", "minimum",
           "maximum", "fmin", "fmax", "isinf", "isnan", "isfinite")
_COMPARISONS = ("lt", "le", "gt", "ge", "eq", "ne", "__lt__", "__le__", "__gt__", "__ge__", "__eq__", "__ne__")


_GRADIENT_EDITS = ("detach", "detach_", "requires_grad_", "_set_grad_enabled", "set_grad_enabled", "no_grad",
                   "enable_grad", "inference_mode", "stop_gradient")


def _own_gradient(nodes: set[fx.Node]) -> fx.Node | None:
    """A node whose gradient need not be the derivative of its value: a library's own op (a
    namespace but aten's or prims'), a higher-order op (an autograd.Function, a checkpoint), a
    detach or a grad-mode switch. The evaluation compares values only, so a region holding one is
    no hypothesis: its training step could differ from the op's."""
    for node in nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        target = node.target
        name = op_name(target) if node.op == "call_function" else target
        library = isinstance(target, torch._ops.HigherOrderOperator) or (
            isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket))
            and not name.startswith(("aten::", "prims::")))
        if name in _GRADIENT_EDITS or library:
            return node
    return None


def _untested_threshold(nodes: set[fx.Node], ids: fx.Node | None = None) -> fx.Node | None:
    """A node whose float result turns on a threshold random inputs may never cross: a clamp, a
    min/max or a nan/inf test of float values, or a comparison of float values with anything but
    0 (relu-like zeros are crossed by every random input). The evaluation cannot vouch for such a
    region (a clamp at 7.0 passes for a plain SwiGLU where no value reaches 7), so it is no
    hypothesis; comparisons of integers (positions, counts, ids), or of floats computed from the ids
    alone (a running count of one_hot floats), are what the routings exercise."""
    for node in nodes:
        floats = [a for a in node.all_input_nodes if dtype_of(a) is not None and dtype_of(a).is_floating_point
                  and not (ids is not None and _of_ids_alone(a, ids))]
        if not floats:
            continue
        if is_call(node, *_CLAMPS):
            numbers = [a for a in (*node.args[1:], *node.kwargs.values()) if isinstance(a, (int, float))]
            if not numbers or any(v != 0 for v in numbers) or len(floats) > 1:
                return node
        if is_call(node, *_COMPARISONS):
            others = [a for a in node.args if not (isinstance(a, fx.Node) and a in floats)]
            if len(floats) > 1 or any(not isinstance(a, (int, float)) or a != 0 for a in others):
                return node
    return None


def _inverse_permutation_writes(region: set[fx.Node]) -> set[fx.Node]:
    """The writes that fill a permutation's inverse the region reads (`inv = torch.empty_like(perm);
    inv[perm] = torch.arange(N)`, the canonical un-sort), with their arange: part of the region, run
    with it in the evaluation."""
    found = set()
    for inv in region:
        if not is_call(inv, "empty_like") or not isinstance(inv.args[0], fx.Node):
            continue
        for write in inv.users:
            rows = write.args[2] if is_call(write, "setitem") and len(write.args) == 3 else None
            if write.args[:2] == (inv, inv.args[0]) and is_call(rows, "arange") and len(rows.args) == 1 \
                    and same_size(shape_of(rows)[0], shape_of(inv)[0]):
                found |= {write, rows}
    return found


def _fresh_writes(region: set[fx.Node], anchor: fx.Node, inputs: set[fx.Node],
                  accumulator: fx.Node | None = None) -> tuple[set[fx.Node], set[fx.Node]]:
    """Writes in place into a tensor of zeros the region makes and alone reads (`out =
    torch.zeros_like(x); out[tok] = expert(x[tok])`, `out[tok] += y`), with all they read: part
    of the region, run with it in the evaluation and gone with it after the rewrite. The
    `accumulator` (written last by the anchor) is read after it too: those reads get the op's result.
    (the nodes to add to the region, every write in place so vouched for)"""
    found: set[fx.Node] = set()
    writes_ok: set[fx.Node] = set()
    order: dict[fx.Node, int] = {}
    todo = list(region)
    while todo:
        buf = todo.pop()
        writes = [u for u in buf.users if _writes_into(u, buf)] if is_call(buf, *ZEROS) else []
        if not writes:
            continue
        read = set().union(*(backward_slice([w], stop=inputs) | {w} for w in writes))
        if any(writes_in_place(n) and n not in writes and not _writes_into_copy(n, buf) for n in read):
            continue  # another write rides along: not one into this buffer's rows
        if buf is accumulator:
            order = order or {n: i for i, n in enumerate(anchor.graph.nodes)}
        if any(u not in region | found | read | {anchor} and not (buf is accumulator and order[u] > order[anchor])
               for u in buf.users):
            continue  # read elsewhere: the writes stay, and so would the experts they hold
        new = read - region - found
        found |= new
        writes_ok |= {n for n in read if writes_in_place(n)}
        todo += list(new)
    return found, writes_ok


def _writes_into(node: fx.Node, buf: fx.Node) -> bool:
    return writes_in_place(node) and bool(node.args) and node.args[0] is buf


def _writes_into_copy(node: fx.Node, buf: fx.Node) -> bool:
    """`buf[tok] += y`'s add: into the rows `buf[tok]` read (a copy, by a tensor index), which the
    setitem then writes back."""
    target = node.args[0] if node.args else None
    index = target.args[1] if is_getitem(target) else None
    by_tensor = isinstance(index, fx.Node) or (isinstance(index, (tuple, list)) and any(isinstance(i, fx.Node) for i in index))
    return (writes_in_place(node) and is_getitem(target) and target.args[0] is buf and by_tensor
            and storage_of(target) != storage_of(buf))


def _match(router, anchor, x, ids, w, guess: _Guess, act, *, E, K, T, d, top1, forward: dict,
           keep: tuple | None = None, gates: bool = False, token_dims: bool = False) -> MoEMatch | None:
    """The MoEMatch of one hypothesis, or None where it is not even well formed (shapes, dtypes, a
    region that writes in place or reads past its inputs is settled by the evaluation). `gates`: w
    is a [T, E] matrix the op reads at the ids (`MoEMatch.gates_dense`)."""
    inputs = {x, ids, w, *guess.inputs}
    region = backward_slice([anchor], stop=inputs)
    if not region:
        return None
    accumulator = anchor.args[0] if writes_in_place(anchor) and anchor.args and is_call(anchor.args[0], *ZEROS) else None
    fresh, writes_ok = _fresh_writes(region, anchor, inputs, accumulator)
    region |= fresh
    if any(writes_in_place(n) and n not in writes_ok for n in region | {anchor}) or not inputs - {x} <= {
            i for n in region | {anchor} for i in n.all_input_nodes}:
        return None  # a hypothesis whose inputs the region does not all read is not the op's
    if keep is not None and not all(node in region for node, _ in keep):
        return None  # kept slots the region does not read are no capacity of its
    if _untested_threshold(region | {anchor}, ids) is not None or _own_gradient(region | {anchor}) is not None:
        return None
    # what the experts compute must be read by the region alone: else it stays in the graph for its
    # other reader, and the op would compute the experts a second time
    computed = set().union(*(forward[p] for p in guess.inputs if p in forward))
    if any(u not in region for n in (region & computed) - {anchor} for u in n.users):
        return None
    writes = _inverse_permutation_writes(region)
    region |= writes
    walk = RegionWalk()
    walk.mark(*region, anchor)
    try:
        match = guess.finish(router, walk, anchor, x, ids, w, act, E=E, K=K, T=T, d=d, token_dims=token_dims,
                             extra_region=fresh, accumulator=accumulator)
    except NoMatch:
        return None
    match.accumulator = accumulator
    match.region |= region  # the writes into fresh zeros, and all they read, go with it
    match.flat_top1, match.slot_keep = top1, keep
    match.gates = match.gates_dense = gates
    return match
