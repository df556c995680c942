"""Verification by evaluation: a candidate region is rewritten only if, run on its own, it computes
what the op computes.

A finder proves a region's structure; this step checks its value. The region's nodes (everything
between the op's inputs and the anchor) are copied into a graph of their own and evaluated in
float64 on random inputs at the graph's own sizes, under several routings chosen to break code that
is right only on easy ones:

    random       each token's K experts drawn at random, weights of both signs (of one sign where
                 the graph's weights are never negative: `nonnegative`)
    idle         the first and the last expert get no token (when E - 2 >= K)
    crowded      one expert is among every token's K (all tokens on it for K = 1)
    ordered      each token's ids in descending order, all weights equal (ties)
    sentinel     (regions that drop ids >= E) random ids with about a third of the slots E, one
                 token's every slot among them

Rows grouped by expert upstream (`MoEMatch.group_offsets`) get offsets instead of ids: random
counts with an eighth of the rows past the last offset (padding), the first and last expert
idle, every row on one expert, and equal counts.

Each result is compared with `codegen.reference.torch_moe_experts` on the same float64 inputs
(per-expert lists stacked, gate and up concatenated, the [T, K] weights gathered from a gate
matrix, input-scaled rows summed per token, a shared expert's output added) and must agree to
float64 rounding. Casts between float dtypes evaluate as float64: the rounding they would do is the
op's dtype policy (see `common.settle_autocast`), not what the region computes. Products with no
float64 kernel (`torch._grouped_mm`) run as a per-group matmul.

A region that raises is rejected. One whose estimated cost exceeds `MAX_FLOPS` or `MAX_BYTES`
(on CUDA also half the free memory), or that runs out of memory, keeps the finder's structural
proof alone, and the report says so. A region that must be evaluated on the CPU (`on_cpu`: a
guess, which may index out of range) but is too large for it, in a graph on CUDA, is split
(`placed`): what it computes from the routing alone (ids, weights, counts, masks, positions) runs
on the CPU, the rest (every value computed from the hidden states or the expert weights) on the
GPU, and each index the GPU part reads is one the CPU computed and `indices.check` proves in range
first. Results are cached by the region's structure, so the 48 identical layers of a
model graph are evaluated once.
"""
from __future__ import annotations

import contextlib
import logging

import torch
import torch.fx as fx

from . import indices
from .common import PRODUCTS, MoEMatch, NoMatch, backward_slice, example_value, is_call, shape_of, writes_in_place

log = logging.getLogger("moe_compiler")

MAX_FLOPS = {"cpu": 2e10, "cuda": 2e13}  # per region, all routings together
MAX_BYTES = {"cpu": 4 << 30, "cuda": 24 << 30}  # float64 inputs and intermediates; on CUDA also <= half the free memory
RTOL = 1e-9  # float64 rounding over sums of at most a few thousand terms stays far below this
ROUTINGS = ("random", "idle", "crowded", "ordered")
_FLOAT_CASTS = ("float", "half", "bfloat16", "double")
_CACHE_SIZE = 256  # region structures remembered; a model has a handful
_cache: dict[str, str] = {}


def verify(match: MoEMatch, on_cpu: bool = False) -> str:
    """Raise NoMatch unless the region computes the op's value; what the report says of the check.
    `on_cpu`: evaluate on the CPU whatever device the graph runs on, every device the region names
    read as the CPU (a region that is only a guess may index out of range: on the CPU that raises,
    where a CUDA kernel's device-side assert would end the process's use of the GPU)."""
    region = placed(match, on_cpu)
    if isinstance(region, str):
        log.info("sonic.verify: %s not evaluated (%s): structural checks only", match.module, region)
        return f"structural only (evaluation would take {region})"
    key = region.signature()
    if key in _cache:
        outcome = _cache[key]
    else:
        if len(_cache) >= _CACHE_SIZE:
            _cache.clear()
        try:
            with _nondeterministic_allowed():
                outcome = _cache[key] = region.evaluate()
        except torch.OutOfMemoryError:  # the estimate was short: no verdict, the structural proof stands
            log.info("sonic.verify: %s not evaluated: out of memory", match.module)
            return "structural only (out of memory evaluating it)"
    if outcome != "equal":
        raise NoMatch(f"evaluated against the op, the region differs: {outcome}")
    where = " (the routing's part on the CPU, the rest on the GPU)" if region.on_host is not None else ""
    return f"evaluated equal on {len(_routings(match))} routings{where}"


def first_equal(match: MoEMatch, variants: list[dict], on_cpu: bool = False) -> dict | str:
    """The first of `variants` (fields of the match that change only the op's reference: the
    activation and its parameters) whose op the region evaluates equal to, set on the match; or
    why none is. The region runs once, on the routings `verify` uses; a region too large to
    evaluate says so."""
    region = placed(match, on_cpu)
    if isinstance(region, str):
        return f"too large to evaluate ({region})"
    with _nondeterministic_allowed():
        runs = region.run()
        if isinstance(runs, str):
            return runs
        for variant in variants:
            for field, value in variant.items():
                setattr(match, field, value)
            if region.compare(runs) == "equal":
                return variant
    return "no variant equal"


def placed(match: MoEMatch, on_cpu: bool = False) -> _Region | str:
    """The region, placed where it is evaluated: on its graph's device (on the CPU with `on_cpu`),
    or, too large for the CPU, split between the CPU and its graph's GPU; or its cost, where it
    is too large for either."""
    region = _Region(match, on_cpu)
    cost, size = region.estimate()
    if region.fits(cost, size):
        return region
    value = example_value(match.x)
    if on_cpu and isinstance(value, torch.Tensor) and value.device.type == "cuda":
        split = _Region(match, split=True)
        if split.refusal is None and split.fits_split():
            return split
    return f"{cost / 1e9:.3g} GFLOP"


def _routings(match: MoEMatch) -> tuple[str, ...]:
    """The routings a region is evaluated on: the sentinel one too where it drops ids >= E."""
    return ROUTINGS + (("sentinel",) if match.sentinels is not None else ())


@contextlib.contextmanager
def _nondeterministic_allowed():
    """`torch.use_deterministic_algorithms(True)` makes CUDA's index_add and scatters raise; the
    evaluation's float64 result does not depend on their order, so it runs with the setting off,
    restored after."""
    enabled, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    if enabled:
        torch.use_deterministic_algorithms(False)
    try:
        yield
    finally:
        if enabled:
            torch.use_deterministic_algorithms(True, warn_only=warn_only)


class _Region:
    """The region's nodes as a graph of their own, inputs first in a fixed order."""

    def __init__(self, match: MoEMatch, on_cpu: bool = False, split: bool = False):
        self.match, self.on_cpu = match, on_cpu
        self.nonnegative_weights = not match.group_offsets and nonnegative(match.topk_weights)
        named = [*match.op_inputs(), *([match.added_to] if match.added_to is not None else [])]
        self.inputs: list[fx.Node] = list(dict.fromkeys(named))
        ours = len(self.inputs)
        members = (match.region | {match.anchor}) - set(self.inputs)
        kept = [node for node, _ in match.slot_keep or ()]  # capacity: the region's own kept-slot nodes, output too
        members |= backward_slice(kept, stop=set(self.inputs))
        members |= _computed_from_inputs(members, set(self.inputs))
        self.nodes = nodes = [n for n in match.anchor.graph.nodes if n in members]
        self.inputs += [i for n in nodes for i in n.all_input_nodes if i not in members and i not in self.inputs]
        # a tensor the region reads that is none of the op's inputs: its value is not ours to choose
        self.foreign = [i for i in self.inputs[ours:] if isinstance(example_value(i), torch.Tensor)
                        and any(u in members and not _reads_shape_only(u, i) for u in i.users)]
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for i, node in enumerate(self.inputs):
            env[node] = graph.placeholder(f"in{i}")
        for i, node in enumerate(nodes):
            if node.op == "placeholder":  # a size Dynamo lifted (s0): an input like the others
                env[node] = graph.placeholder(f"size{i}")
                self.inputs.append(node)
                continue
            env[node] = graph.create_node(node.op, node.target, fx.node.map_arg(node.args, env.__getitem__),
                                          fx.node.map_arg(node.kwargs, env.__getitem__), name=f"n{i}")
        # an in-place combine: the accumulator's value once every add ran (the anchor returns None)
        result = env[match.accumulator if match.accumulator is not None else match.anchor]
        graph.output((result, *(env[node] for node in kept)) if kept else result)
        self.module = fx.GraphModule(match.anchor.graph.owning_module or torch.nn.Module(), graph)
        value = example_value(match.x)
        self.device = value.device if isinstance(value, torch.Tensor) and not on_cpu else torch.device("cpu")
        self.on_host: set[fx.Node] | None = None  # split: the region graph's nodes run on the CPU
        self.on_gpu: set[fx.Node] = set()  # split: the graph's nodes (and inputs) evaluated on the GPU
        self.refusal: str | None = None  # split: why it cannot be
        if split:
            self._split(env)
        self.routing_device = torch.device("cpu") if split else self.device

    def _split(self, env: dict[fx.Node, fx.Node]) -> None:
        """Place each node: on the GPU what reads the hidden states or the expert weights (every
        tensor input but the routing's ids and weights) and the float tensors made from no tensor
        (`torch.zeros(T, d)`), on the CPU the rest."""
        routing = {self.match.topk_ids, self.match.topk_weights}
        on_gpu = {n for n in self.inputs if n not in routing and isinstance(example_value(n), torch.Tensor)}
        for node in self.nodes:
            made = example_value(node)
            reads = [i for i in node.all_input_nodes if isinstance(example_value(i), torch.Tensor)]
            if any(i in on_gpu for i in reads) or (not reads and isinstance(made, torch.Tensor)
                                                    and made.is_floating_point()):
                on_gpu.add(node)
                if writes_in_place(node) and node.args and node.args[0] not in on_gpu:
                    self.refusal = f"{node.name} writes on the GPU into a value computed on the CPU"
        self.on_gpu = on_gpu
        self.on_host = {env[n] for n in self.nodes if n not in on_gpu}

    def signature(self) -> str:
        fields = {k: str(getattr(self.match, k)) for k in ("activation", "interleaved", "transposed", "alpha",
                                                             "limit", "gates", "gates_dense", "input_scaled", "flat_top1",
                                                             "sentinels", "group_offsets")}
        fields["slot_keep"] = str([kind for _, kind in self.match.slot_keep or ()])
        fields["nonnegative_weights"] = str(self.nonnegative_weights)
        metas = [(tuple(map(_concrete, shape_of(n))), str(getattr(example_value(n), "dtype", type(example_value(n)))))
                 for n in self.inputs]
        return repr((self.module.code, metas, sorted(fields.items()), str(self.device), self.on_host is not None))

    def fits(self, cost: float, size: float) -> bool:
        """Whether an evaluation of `estimate`'s cost and size is within the limits of the region's
        device (on CUDA also half its free memory)."""
        device = self.device.type if self.device.type in MAX_FLOPS else "cuda"
        room = MAX_BYTES[device]
        if self.device.type == "cuda":
            room = min(room, torch.cuda.mem_get_info(self.device)[0] // 2)
        return cost <= MAX_FLOPS[device] and size <= room

    def fits_split(self) -> bool:
        """Whether the split region's CPU part fits the CPU's limits and the rest the GPU's (and
        half its free memory)."""
        host = [n for n in self.nodes if n not in self.on_gpu]
        routing = [n for n in self.inputs if n in (self.match.topk_ids, self.match.topk_weights)]
        host_cost, host_size = self.estimate(host, routing)
        gpu_cost, gpu_size = self.estimate([n for n in self.nodes if n in self.on_gpu],
                                           [n for n in self.inputs if n not in routing])
        room = MAX_BYTES["cuda"]
        if self.device.type == "cuda":
            room = min(room, torch.cuda.mem_get_info(self.device)[0] // 2)
        return host_cost <= MAX_FLOPS["cpu"] and host_size <= MAX_BYTES["cpu"] and gpu_cost <= MAX_FLOPS["cuda"] \
            and gpu_size <= room

    def estimate(self, nodes: list[fx.Node] | None = None, inputs: list[fx.Node] | None = None) -> tuple[float, float]:
        """(float64 multiply-adds x2 over every routing, bytes of the float64 inputs), of the whole
        region or of `nodes` reading `inputs`."""
        nodes = self.nodes if nodes is None else nodes
        inputs = self.inputs if inputs is None else inputs
        T, K, E = (_concrete(self.match.shape[k]) for k in ("T", "K", "E"))
        per_expert = max(1, T * K // max(E, 1))
        flops = 0.0
        for node in nodes:
            if is_call(node, *PRODUCTS):
                out = shape_of(node)
                first = shape_of(node.args[0]) if node.args else ()
                numel = 1
                for s in out:
                    numel *= _concrete(s, per_expert)
                flops += 2 * numel * (_concrete(first[-1], per_expert) if first else 1)
        largest = max((_numel(n, per_expert) for n in nodes), default=0)
        size = sum(8 * _numel(n) for n in inputs) + 3 * 8 * largest  # a few intermediates live at once
        return flops * len(_routings(self.match)), float(size)

    def evaluate(self) -> str:
        """'equal', or the first routing on which the region and the op differ, with the error."""
        runs = self.run()
        if isinstance(runs, str):
            return runs
        return self.compare(runs)

    def run(self) -> list | str:
        """[(routing, the inputs, the region's result)] on every routing, or why it cannot run."""
        if self.foreign:
            return f"it reads {self.foreign[0].name}, which is not one of the op's inputs"
        generator = torch.Generator().manual_seed(0)
        try:  # everything but the routing, drawn once on the region's device
            on_device = torch.Generator(device=self.device).manual_seed(0)
            fixed = {node: _random_like(node, on_device, self.device) for node in self.inputs
                     if node is not self.match.topk_ids and node is not self.match.topk_weights}
        except Exception as exc:
            return f"its inputs cannot be made ({type(exc).__name__}: {str(exc)[:200]})"
        runs = []
        for routing in _routings(self.match):
            try:
                values = self._inputs(routing, generator, fixed)
                runs.append((routing, values, _Float64(self.module, self.on_cpu, self.on_host, self.device).run(*values)))
            except (NoMatch, torch.OutOfMemoryError):
                raise
            except indices.Unprovable as exc:  # the GPU part would read an index the CPU did not check
                return f"too large to evaluate on the CPU, and on the GPU {exc}"
            except Exception as exc:  # a region that cannot run on its own is not one we can vouch for
                return f"it cannot be evaluated on its own ({type(exc).__name__}: {str(exc)[:200]})"
        return runs

    def compare(self, runs: list) -> str:
        """'equal', or the first routing of `run`'s results on which the op (as the match now says)
        differs, with the error."""
        for routing, values, got in runs:
            kept = None
            if self.match.slot_keep is not None:  # (the result, the kept-slot values the reference drops by)
                got, *kept = got
            if self.on_host is not None:  # split: the reference runs on the GPU, with the CPU's values moved there
                values, kept = _moved(values, self.device), _moved(kept, self.device)
            try:
                want = self._reference(values, kept)
            except (NoMatch, torch.OutOfMemoryError):
                raise
            except Exception as exc:
                return f"the op's reference cannot be computed ({type(exc).__name__}: {str(exc)[:200]})"
            if not isinstance(got, torch.Tensor) or got.shape != want.shape:
                return f"{routing} routing: result {getattr(got, 'shape', type(got))} is not {tuple(want.shape)}"
            scale = want.abs().max().item() if want.numel() else 0.0
            err = (got.to(torch.float64) - want).abs().max().item() if want.numel() else 0.0
            if not err <= RTOL * max(scale, 1e-30):
                return f"{routing} routing: max error {err:.3g} against values up to {scale:.3g}"
        return "equal"

    def _inputs(self, routing: str, generator: torch.Generator, fixed: dict) -> list:
        m = self.match
        T, K, E = (_concrete(m.shape[k]) for k in ("T", "K", "E"))
        if m.group_offsets:
            offsets = _offsets(routing, T, E, generator).to(example_value(m.topk_ids).dtype)
            return [_laid_out_as(m.topk_ids, offsets.to(self.routing_device)) if node is m.topk_ids else fixed[node]
                    for node in self.inputs]
        ids, weights = _routing(routing, T, K, E, generator)
        if self.nonnegative_weights:  # the graph never gives negative weights: the region need not take them
            weights = weights.abs()
        if routing == "sentinel":
            ids = torch.where(torch.rand(T, K, generator=generator) < 1 / 3, E, ids)
            ids[0] = E
        values = []
        for node in self.inputs:
            if node is m.topk_ids:
                value = ids.reshape(T) if m.flat_top1 else ids
                value = value.to(example_value(node).dtype)
            elif node is m.topk_weights:
                value = weights.reshape(T) if m.flat_top1 else weights
                if m.gates:  # a [T, E] gate matrix, zero outside the chosen experts (or not: `gates_dense`)
                    base = torch.zeros(T, E, dtype=torch.float64)
                    if m.gates_dense:
                        base = torch.randn(T, E, generator=generator, dtype=torch.float64)
                        base = base.abs() if self.nonnegative_weights else base
                    value = base.scatter_(1, ids, weights)
            else:
                values.append(fixed[node])
                continue
            if m.token_dims:  # [T, .] -> the node's [B, S, .]
                value = value.reshape(tuple(_concrete(s) for s in shape_of(node)))
            values.append(_laid_out_as(node, value.to(self.routing_device)))
        return values

    def _reference(self, values: list, kept: list | None = None) -> torch.Tensor:
        """What the op computes on the same inputs, in float64; `kept`: the values of the region's
        kept-slot nodes (`MoEMatch.slot_keep`), whose other slots add nothing."""
        from moe_compiler.codegen.ops import kept_slot_ids
        from moe_compiler.codegen.reference import torch_moe_experts

        m = self.match
        at = {node: value for node, value in zip(self.inputs, values)}
        if m.token_dims:  # the op's [T, .] views of x and the routing ([T] of a top-1's); its result viewed back below
            at[m.x] = at[m.x].reshape(-1, at[m.x].shape[-1])
            for n, flat in ((m.topk_ids, m.flat_top1), (m.topk_weights, m.flat_top1 and not m.gates)):
                at[n] = at[n].reshape(-1) if flat else at[n].reshape(-1, at[n].shape[-1])
        x = at[m.x]
        if m.group_offsets:  # row r runs the expert whose group holds it (E past the last group: dropped below)
            offsets = at[m.topk_ids]
            rows = torch.arange(x.shape[0], device=x.device, dtype=offsets.dtype)
            ids = torch.searchsorted(offsets, rows, right=True).unsqueeze(1)
            weights = torch.ones(x.shape[0], 1, dtype=torch.float64, device=x.device)
        else:
            ids, weights = at[m.topk_ids], at[m.topk_weights]
        if m.flat_top1:  # [T] ids (and weights, unless a gate matrix holds them) as [T, 1]
            ids, weights = ids.unsqueeze(-1), weights if m.gates else weights.unsqueeze(-1)
        if m.gates:
            weights = torch.gather(weights, 1, ids)
        w1, w2, b1, b2 = (at.get(n) for n in (m.w1, m.w2, m.b1, m.b2))
        b1, b2 = (b.squeeze(1) if b is not None and b.dim() == 3 else b for b in (b1, b2))  # [E, 1, w] biases
        if m.w2_swapped:
            w2 = w2.transpose(1, 2)
        if m.expert_lists is not None:
            gate, up, down = ([at[n] for n in group] for group in m.expert_lists)
            w1 = torch.stack([torch.cat(pair, 0) for pair in zip(gate, up)] if up else gate)
            w2 = torch.stack(down)
            if m.expert_bias_lists is not None:
                bg, bu, bd = ([at[n] for n in group] for group in m.expert_bias_lists)
                b1 = torch.stack([torch.cat(pair) for pair in zip(bg, bu)] if bu else bg) if bg else None
                b2 = torch.stack(bd) if bd else None
        elif m.w_up is not None:
            w1 = torch.cat([w1, at[m.w_up]], 2 if m.transposed else 1)
        flags = dict(activation=m.activation, interleaved=m.interleaved, transposed=m.transposed, alpha=m.alpha,
                     limit=m.limit)
        ids = ids.long()
        if kept is not None:
            ids = kept_slot_ids(ids, [(value, kind) for value, (_, kind) in zip(kept, m.slot_keep)], w1.shape[0],
                                token_dims=m.token_dims)
        if m.sentinels == "drop" or m.group_offsets or kept is not None:  # a dropped slot adds nothing: weight 0 on a real expert, exactly
            keep = ids < w1.shape[0]
            ids, weights = torch.where(keep, ids, 0), torch.where(keep, weights, 0)
        elif m.sentinels == "clamp":
            ids = ids.clamp(0, w1.shape[0] - 1)
        if m.input_scaled:
            T, K = ids.shape
            rows = (x.unsqueeze(1) * weights.unsqueeze(-1)).reshape(T * K, -1)
            ones = torch.ones(T * K, 1, dtype=torch.float64, device=x.device)
            out = torch_moe_experts(rows, ids.reshape(T * K, 1), ones, w1, w2, b1, b2, **flags)
            out = out.reshape(T, K, -1).sum(1)
        else:
            out = torch_moe_experts(x, ids, weights, w1, w2, b1, b2, **flags)
        if m.token_dims:
            result = m.anchor if m.accumulator is None else m.accumulator  # (an in-place combine's anchor is a write)
            out = out.reshape(tuple(_concrete(s) for s in shape_of(result)))
        return out if m.added_to is None else at[m.added_to] + out


_SHAPE_ONLY = ("zeros_like", "empty_like", "ones_like", "full_like", "new_zeros", "new_empty", "new_ones", "new_full",
               "size", "dim", "sym_size")


def _reads_shape_only(user: fx.Node, value: fx.Node) -> bool:
    """`user` reads `value` for its shape, dtype or device alone (`torch.zeros_like(probs)`)."""
    return is_call(user, *_SHAPE_ONLY) and user.args[:1] == (value,) and value not in user.args[1:] \
        and value not in user.kwargs.values()


def _computed_from_inputs(members: set[fx.Node], inputs: set[fx.Node]) -> set[fx.Node]:
    """Nodes outside the region that it reads and that are computed from the op's inputs and
    constants alone (`torch.arange(TK)` made once and shared, a bias gathered by the sorted ids
    before its in-place add): evaluated with the region, from the same inputs."""
    found: set[fx.Node] = set()
    changed = True
    while changed:
        changed = False
        for node in {i for n in members | found for i in n.all_input_nodes} - members - found - inputs:
            todo, cone = [node], set()
            while todo:
                current = todo.pop()
                if current in cone or current in inputs or current in members or current in found:
                    continue
                if current.op in ("placeholder", "get_attr", "output") or writes_in_place(current):
                    break
                cone.add(current)
                todo += current.all_input_nodes
            else:
                found |= cone
                changed = True
    return found


# values never negative, whatever their input (their input's sign where it is kept)
_NONNEGATIVE = ("softmax", "sigmoid", "exp", "relu", "abs", "one_hot", "sqrt", "rsqrt", "square")
_SIGN_KEPT = ("to", "float", "half", "bfloat16", "double", "type_as", "contiguous", "clone", "view", "reshape",
              "flatten", "unsqueeze", "squeeze", "expand", "expand_as", "transpose", "permute", "t", "narrow",
              "gather", "index_select", "sum", "mean", "amax", "cumsum", "topk", "sort", "max", "detach")
_OF_TWO = ("mul", "__mul__", "div", "__truediv__", "truediv", "add", "__add__", "true_divide")


def nonnegative(node, depth: int = 24) -> bool:
    """Whether a float tensor node of the graph is never negative (or NaN): built by ops that give
    nonnegative values (softmax, sigmoid, exp, relu, one_hot...), ops that keep their input's sign
    (casts, views, gathers and selections, sums, the values of a top-k or sort), or products,
    quotients and sums of nonnegative operands and nonnegative constants. The router's top-k weights
    usually are: a region is then evaluated on nonnegative weights only, the only ones it is given."""
    if isinstance(node, (int, float)) and not isinstance(node, bool):
        return node >= 0
    if not isinstance(node, fx.Node) or depth <= 0 or node.op not in ("call_function", "call_method"):
        return False
    import operator

    if node.op == "call_function" and (node.target is operator.getitem or (
            node.target is getattr and node.args[1:] == ("values",))):
        return nonnegative(node.args[0], depth - 1)  # a selection, or the values of a top-k / sort / max
    if is_call(node, *_NONNEGATIVE):
        return True
    low = (node.args[1] if len(node.args) > 1 else node.kwargs.get("min")) if is_call(node, "clamp", "clamp_min") else None
    high = (node.args[2] if len(node.args) > 2 else node.kwargs.get("max")) if is_call(node, "clamp") else None
    if isinstance(low, (int, float)) and not isinstance(low, bool) and (high is None or (
            isinstance(high, (int, float)) and high >= 0)):  # clamp(min=a, max=b) with b < a gives b
        return low >= 0 or nonnegative(node.args[0], depth - 1)
    if is_call(node, *_SIGN_KEPT):
        return bool(node.args) and nonnegative(node.args[0], depth - 1)
    if is_call(node, *_OF_TWO) and len(node.args) == 2 and not node.kwargs:
        return all(nonnegative(a, depth - 1) for a in node.args)
    if is_call(node, "cat", "stack") and node.args and isinstance(node.args[0], (list, tuple)):
        return all(nonnegative(a, depth - 1) for a in node.args[0])
    return False


def _routing(routing: str, T: int, K: int, E: int, generator: torch.Generator):
    """([T, K] int64 ids, distinct per token, in [0, E); [T, K] float64 weights) of one routing."""
    order = torch.argsort(torch.rand(T, E, generator=generator), dim=1)
    if routing == "idle" and E - 2 >= K:  # experts 0 and E-1 get nothing
        order = 1 + torch.argsort(torch.rand(T, E - 2, generator=generator), dim=1)
    ids = order[:, :K]
    if routing == "crowded":  # expert c among every token's K experts, at a random column
        c = E // 2
        has = (ids == c).any(1, keepdim=True)
        col = torch.randint(0, K, (T, 1), generator=generator)
        ids = torch.where(has, ids, ids.scatter(1, col, c))
    weights = torch.randn(T, K, generator=generator, dtype=torch.float64)
    if routing == "ordered":
        ids = ids.sort(dim=1, descending=True).values
        weights = torch.full((T, K), 0.5, dtype=torch.float64)
    return ids, weights


def _offsets(routing: str, R: int, E: int, generator: torch.Generator) -> torch.Tensor:
    """[E] int64 end offsets of R rows grouped by expert (grouped_mm's offs) for one routing."""
    if routing == "random":  # an eighth of the rows past the last offset: padding
        counts = torch.bincount(torch.randint(0, E, (R - R // 8,), generator=generator), minlength=E)
    elif routing == "idle" and E >= 3:  # the first and last expert get no row
        counts = torch.bincount(torch.randint(1, E - 1, (R,), generator=generator), minlength=E)
    elif routing == "crowded":  # every row on one expert
        counts = torch.zeros(E, dtype=torch.int64)
        counts[E // 2] = R
    else:  # equal groups, the remainder past the last offset
        counts = torch.full((E,), R // E, dtype=torch.int64)
    return torch.cumsum(counts, 0)


def _laid_out_as(node: fx.Node, value: torch.Tensor) -> torch.Tensor:
    """`value` with the strides the graph's tensor has (a region's views may rely on them)."""
    fake = example_value(node)
    if not isinstance(fake, torch.Tensor):
        return value.contiguous()
    try:
        if tuple(_concrete(s) for s in fake.shape) != tuple(value.shape):
            return value.contiguous()
        strides = tuple(_concrete(s) for s in fake.stride())
        out = torch.empty_strided(value.shape, strides, dtype=value.dtype, device=value.device)
    except Exception:  # unbacked strides, overlapping layouts: the plain layout
        return value.contiguous()
    return out.copy_(value)


def _random_like(node: fx.Node, generator: torch.Generator, device: torch.device):
    """A random float64 (or integer/bool) tensor shaped and laid out as `node`'s value, on `device`."""
    value = example_value(node)
    if not isinstance(value, torch.Tensor):
        return _concrete(value)
    shape = tuple(_concrete(s) for s in value.shape)
    if value.dtype.is_floating_point:
        fan_in = shape[-1] if shape else 1
        out = torch.randn(shape, generator=generator, dtype=torch.float64, device=device) / max(fan_in, 1) ** 0.5
    elif value.dtype == torch.bool:
        out = torch.rand(shape, generator=generator, device=device) < 0.5
    else:
        out = torch.randint(0, 2, shape, generator=generator, device=device).to(value.dtype)
    return _laid_out_as(node, out)


def _concrete(size, unknown: int | None = None) -> int:
    """A size as an int: the hint of a symbolic one; `unknown` (or an error) for an unbacked one."""
    if isinstance(size, int):
        return size
    hint = getattr(getattr(size, "node", None), "hint", None)
    if hint is not None:
        return int(hint)
    if unknown is not None:
        return unknown
    raise NoMatch(f"size {size} has no value to evaluate the region at")


def _numel(node: fx.Node, unknown: int = 1) -> int:
    value = example_value(node)
    if not isinstance(value, torch.Tensor):
        return 0
    count = 1
    for s in value.shape:
        count *= _concrete(s, unknown)
    return count


class _Float64(fx.Interpreter):
    """Runs a region with every float dtype read as float64, and `_grouped_mm` as per-group matmuls;
    `on_cpu`: every device it names read as the CPU, and a move to CUDA refused. `on_host` (split):
    those nodes run so, the others on `device`, each reading the CPU's values moved there once,
    after `indices.check` proved the indices among them in range."""

    def __init__(self, module, on_cpu: bool = False, on_host: set[fx.Node] | None = None, device=None):
        super().__init__(module)
        self.on_cpu, self.on_host, self.device = on_cpu, on_host, device
        self.moved: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # (id, version) of a CPU value: (it, its GPU copy)

    def run_node(self, n: fx.Node):
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        args, kwargs = _as_float64((args, kwargs))
        on_cpu = self.on_cpu
        if self.on_host is not None and n.op in ("call_function", "call_method"):
            on_cpu = n in self.on_host
            if not on_cpu:
                if not is_call(n, *_GROUPED_MM):  # (the per-group matmul reads offs on the host)
                    indices.check(n, args, kwargs)
                args, kwargs = self._to_device((args, kwargs))
        if on_cpu:
            if n.op == "call_method" and n.target == "cuda":
                raise RuntimeError("the region moves a tensor to CUDA")
            args, kwargs = _to_cpu_devices((args, kwargs))
        if n.op == "call_function" and is_call(n, *_GROUPED_MM):
            return _grouped_mm(*args, **kwargs)
        if n.op == "call_method" and n.target in _FLOAT_CASTS and isinstance(args[0], torch.Tensor) \
                and args[0].is_floating_point() and len(args) == 1 and not kwargs:
            return args[0]  # .float(), .bfloat16()...: float64 stays float64
        if n.op in ("call_function", "call_method", "call_module", "get_attr"):
            with self._set_current_node(n):
                return getattr(self, n.op)(n.target, args, kwargs)
        return super().run_node(n)


    def _to_device(self, tree):
        if isinstance(tree, torch.Tensor) and tree.device.type == "cpu":
            key = (id(tree), tree._version)  # a value written in place since its last move moves again
            if key not in self.moved:
                self.moved[key] = (tree, tree.to(self.device))
            return self.moved[key][1]
        if isinstance(tree, (list, tuple)):
            return type(tree)(self._to_device(t) for t in tree)
        if isinstance(tree, dict):
            return {k: self._to_device(v) for k, v in tree.items()}
        return tree


_GROUPED_MM = ("_grouped_mm", "aten::_grouped_mm", "transformers::grouped_mm_fallback")


def _moved(tree, device):
    """Every tensor in `tree` on `device`."""
    if isinstance(tree, torch.Tensor):
        return tree.to(device)
    if isinstance(tree, (list, tuple)):
        return type(tree)(_moved(t, device) for t in tree)
    return tree


def _to_cpu_devices(tree):
    """Every device among call arguments (a torch.device, or a string naming one) as the CPU."""
    if isinstance(tree, torch.device):
        return torch.device("cpu")
    if isinstance(tree, str) and tree.split(":")[0] in ("cuda", "cpu", "meta", "xpu", "mps"):
        return "cpu"
    if isinstance(tree, (list, tuple)):
        return type(tree)(_to_cpu_devices(t) for t in tree)
    if isinstance(tree, dict):
        return {k: _to_cpu_devices(v) for k, v in tree.items()}
    return tree


def _as_float64(tree):
    """Every float dtype among call arguments becomes float64; float tensors too."""
    if isinstance(tree, torch.dtype):
        return torch.float64 if tree.is_floating_point else tree
    if isinstance(tree, torch.Tensor):
        return tree.to(torch.float64) if tree.is_floating_point() and tree.dtype != torch.float64 else tree
    if isinstance(tree, (list, tuple)):
        return type(tree)(_as_float64(t) for t in tree)
    if isinstance(tree, dict):
        return {k: _as_float64(v) for k, v in tree.items()}
    return tree


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None = None, bias=None, out_dtype=None):
    """torch._grouped_mm's value: 2D a [M, k] x 3D b [G, k, n] with offs (rows offs[g-1]:offs[g] use
    b[g]); 3D x 3D is a bmm."""
    if bias is not None:
        raise NoMatch("grouped_mm with a bias")
    if a.dim() == 3 and b.dim() == 3:
        return torch.bmm(a, b)
    if a.dim() != 2 or b.dim() != 3 or offs is None:
        raise NoMatch(f"grouped_mm of {a.dim()}D x {b.dim()}D operands")
    out = a.new_zeros(a.shape[0], b.shape[-1])
    start = 0
    for g, end in enumerate(offs.tolist()):
        out[start:end] = a[start:end] @ b[g]
        start = end
    return out


