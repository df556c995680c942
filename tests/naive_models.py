"""MoE layers written the naive way (an `nn.ModuleList` of experts), one knob per spelling.

`LoopMoE` loops over the experts in Python (Mixtral-style `torch.where` + `index_add_`);
`DenseMoE` runs every expert on every token and combines with a dense [T, E] gate matrix;
`StackedLoopMoE` is the loop over stacked [E, ., .] parameters sliced per expert (`W[e]`).
Shared by tests/test_naive_patterns.py; each variant names the eager spelling it produces.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def relu2(h):
    return F.relu(h).square()


class GatedExpert(nn.Module):
    """w2(act(w1(x)) * w3(x)), three Linears (Mixtral's names); bias: False, True (all three, as
    nn.Linear's default), "gate" (w1's alone) or "down" (w2's alone)."""

    def __init__(self, d, n, act=F.silu, bias=False, up_first=False):
        super().__init__()
        self.w1 = nn.Linear(d, n, bias=bias in (True, "gate"))
        self.w3 = nn.Linear(d, n, bias=bias is True)
        self.w2 = nn.Linear(n, d, bias=bias in (True, "down"))
        self.act, self.up_first = act, up_first

    def forward(self, x):
        if self.up_first:  # the up projection comes first in the graph
            return self.w2(self.w3(x) * self.act(self.w1(x)))
        return self.w2(self.act(self.w1(x)) * self.w3(x))


class FusedExpert(nn.Module):
    """One Linear(d, 2n) for gate and up, split by chunk or slicing, then w2."""

    def __init__(self, d, n, split="chunk", bias=False):
        super().__init__()
        self.n, self.split = n, split
        self.w13 = nn.Linear(d, 2 * n, bias=bias)
        self.w2 = nn.Linear(n, d, bias=bias)

    def forward(self, x):
        h = self.w13(x)
        if self.split == "chunk":
            g, u = h.chunk(2, dim=-1)
        else:
            g, u = h[..., : self.n], h[..., self.n:]
        return self.w2(F.silu(g) * u)


class PlainExpert(nn.Module):
    """w2(act(w1(x))): a non-gated expert."""

    def __init__(self, d, n, act=F.gelu, bias=False):
        super().__init__()
        self.w1 = nn.Linear(d, n, bias=bias)
        self.w2 = nn.Linear(n, d, bias=bias)
        self.act = act

    def forward(self, x):
        return self.w2(self.act(self.w1(x)))


def make_experts(kind, d, n, E, acts=None, bias=False):
    """bias: as the experts take it, or a list of one per expert."""
    biases = bias if isinstance(bias, list) else [bias] * E
    if kind in ("gated", "gated_up_first"):
        acts = acts or [F.silu] * E
        return nn.ModuleList(GatedExpert(d, n, act, b, kind == "gated_up_first") for act, b in zip(acts, biases))
    if kind in ("fused", "fused_slice"):
        return nn.ModuleList(FusedExpert(d, n, "chunk" if kind == "fused" else "slice", b) for b in biases)
    if kind == "plain":
        return nn.ModuleList(PlainExpert(d, n, act, b) for act, b in zip(acts or [F.gelu] * E, biases))
    if kind == "plain_relu2":
        return nn.ModuleList(PlainExpert(d, n, relu2, b) for b in biases)
    if kind == "plain_relu":  # nn.ReLU between two biased Linears: Switch Transformer's, T5's expert
        return nn.ModuleList(nn.Sequential(nn.Linear(d, n, bias=b), nn.ReLU(), nn.Linear(n, d, bias=b)) for b in biases)
    if kind == "plain_gelu_tanh":  # GPT-2's MLP: nn.GELU("tanh") between two Linears
        return nn.ModuleList(nn.Sequential(nn.Linear(d, n, bias=b), nn.GELU(approximate="tanh"), nn.Linear(n, d, bias=b))
                             for b in biases)
    raise ValueError(kind)


def stacked_param(E, out_features, in_features, orient):
    """An [E, out, in] expert weight ([E, in, out] for orient "in_out"), scaled as nn.Linear's."""
    shape = (E, in_features, out_features) if orient == "in_out" else (E, out_features, in_features)
    return nn.Parameter(torch.randn(shape) / in_features ** 0.5)


class Router(nn.Module):
    """softmax(gate(x)) in fp32 -> top-k -> renormalise, cast back to x's dtype."""

    def __init__(self, d, E, K):
        super().__init__()
        self.gate = nn.Linear(d, E, bias=False)
        self.E, self.K = E, K

    renormalize = True  # False: the top-k probabilities as they are (a top-1's renormalised weight is 1)
    selection = "topk"  # "sort": the first K of a descending sort; "argsort": its indices, the weights gathered

    def route(self, x):
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float)
        if self.selection == "sort":
            ranked, order = torch.sort(probs, dim=-1, descending=True)
            w, ids = ranked[..., :self.K], order[..., :self.K]
        elif self.selection == "argsort":
            ids = probs.argsort(dim=-1, descending=True)[:, :self.K]
            w = probs.gather(-1, ids)
        else:
            w, ids = torch.topk(probs, self.K, dim=-1)
        return probs, (w / w.sum(-1, keepdim=True) if self.renormalize else w).to(x.dtype), ids


class SparseMixerMoE(nn.Module):
    """PhiMoE's sparsemixer routing as it runs in eval: the largest logit (max with keepdim), its
    weight the softmax of the logits within a relative jitter band of it, read at its id; then the
    same for the largest of the others (the first scattered to -inf), the two ids concatenated;
    experts by a loop over `torch.where(one_hot[e])` with index_add.

    masking: "scatter" (the first id scattered to -inf, as PhiMoE), "none" (the second max over the
             logits as they are: the first expert twice, not a top-2; left alone)
    """

    def __init__(self, d=16, n=8, E=6, jitter=0.01, masking="scatter"):
        super().__init__()
        self.E, self.jitter, self.masking = E, jitter, masking
        self.gate = nn.Linear(d, E, bias=False)
        self.experts = make_experts("gated", d, n, E)

    def _pick(self, scores, masked):
        with torch.no_grad():
            top, ids = masked.max(dim=-1, keepdim=True)
            band = ((top - scores) / scores.abs().clamp(min=top)) > 2 * self.jitter
        return ids, F.softmax(masked.masked_fill(band, float("-inf")), dim=-1).gather(-1, ids)

    def forward(self, x):
        scores = self.gate(x)
        i1, w1 = self._pick(scores, scores)
        rest = torch.scatter(scores, -1, i1, float("-inf")) if self.masking == "scatter" else scores
        i2, w2 = self._pick(scores, rest)
        ids, w = torch.cat((i1, i2), dim=-1), torch.cat((w1, w2), dim=-1)
        out = torch.zeros_like(x)
        hot = F.one_hot(ids, self.E).permute(2, 0, 1)
        for e in range(self.E):
            tok, slot = torch.where(hot[e])
            out.index_add_(0, tok, self.experts[e](x[tok]) * w[tok, slot, None])
        return out


class LoopMoE(Router):
    """for e in range(E): rows of expert e, expert e on them, index_add into the output.

    where:   "one_hot" (torch.where(mask[e]) -> k, tok), "eq" (torch.where(ids == e) -> tok, k),
             "nonzero" (mask[e].nonzero(as_tuple=True)), "nonzero_columns" (p = (ids == e).nonzero():
             tok, k = p[:, 0], p[:, 1]), "argwhere_unbind" (tok, k = torch.argwhere(ids == e).unbind(1))
    scale:   "index_none" (w[tok, k, None]), "unsqueeze" (w[tok, k].unsqueeze(-1)),
             "slice" (w[tok, k][:, None]), "cast" (w[tok, k, None].to(x.dtype)), "none" (unscaled),
             "bool_mask" (w[ids == e].unsqueeze(-1)), "bool_mask_none" (w[ids == e, None]); with where="eq"
    combine: "inplace" (out.index_add_), "functional" (out = out.index_add(...)), "setitem_iadd"
             (out[tok] += y: Mistral's reference code), "setitem_add" (out[tok] = out[tok] + y),
             "setitem_iadd_read" (out[tok] += y, those rows also kept aside in a list: read elsewhere),
             "assign" (out[tok] = y: the sum only when K == 1), "index_put" (out.index_put_((tok,), y,
             accumulate=True)), "scatter_add" (out.scatter_add_(0, tok[:, None].expand(-1, d), y)),
             "scatter_add_functional" (out = out.scatter_add(0, tok.view(-1, 1).repeat(1, d), y))
    acc:     "zeros_like" or "zeros" (torch.zeros((T, d), dtype=..., device=...))
    rows:    "index" (x[tok]) or "none_reshape" (x[None, tok].reshape(-1, d): transformers 4.x's Mixtral)
    experts_used: the experts the loop visits (default all); read_inside: the loop reads `out`;
    spare_experts: experts beyond the router's E, in the ModuleList, the one_hot and the loop;
    top1_keepdim: top-1 as `p, ids = probs.max(dim=-1, keepdim=True)` ([T, 1], as a top-k of 1)
    mutate_input: after expert 1, write in place into "x", "x-view" (a slice of x), "x-view-augmented"
                  (`x.view(-1) *= 0.5`), "x-view-relu-inplace" (`F.relu(x[:, :4], inplace=True)`) or "weights"
    """

    def __init__(self, d=16, n=8, E=4, K=2, experts="gated", where="one_hot", scale="index_none",
                 combine="inplace", acc="zeros_like", acts=None, bias=False, experts_used=None,
                 read_inside=False, spare_experts=0, rows="index", top1_keepdim=False, mutate_input=None):
        super().__init__(d, E, 1 if top1_keepdim else K)
        self.rows, self.top1_keepdim = rows, top1_keepdim
        self.experts = make_experts(experts, d, n, E + spare_experts, acts, bias)
        self.where, self.scale, self.combine, self.acc = where, scale, combine, acc
        self.classes = E + spare_experts
        self.experts_used = list(range(self.classes)) if experts_used is None else experts_used
        self.read_inside = read_inside
        self.mutate_input = mutate_input

    def _rows(self, ids, mask, e):
        if self.where == "eq":
            return torch.where(ids == e)
        if self.where == "nonzero_columns":
            pairs = (ids == e).nonzero()
            return pairs[:, 0], pairs[:, 1]
        if self.where == "argwhere_unbind":
            tok, k = torch.argwhere(ids == e).unbind(1)
            return tok, k
        if self.where == "nonzero":
            k, tok = mask[e].nonzero(as_tuple=True)
        else:
            k, tok = torch.where(mask[e])
        return tok, k

    def _scale(self, w, tok, k, dtype, ids=None, e=None):
        if self.scale == "bool_mask":  # the [T, K] mask's True elements, row-major: w[tok, k] in where's order
            return w[ids == e].unsqueeze(-1)
        if self.scale == "bool_mask_none":
            return w[ids == e, None]
        if self.scale == "index_none":
            return w[tok, k, None]
        if self.scale == "unsqueeze":
            return w[tok, k].unsqueeze(-1)
        if self.scale == "slice":
            return w[tok, k][:, None]
        if self.scale == "cast":
            return w[tok, k, None].to(dtype)
        raise ValueError(self.scale)

    def forward(self, x):
        T, d = x.shape
        if self.top1_keepdim:
            w, ids = F.softmax(self.gate(x), dim=-1).max(dim=-1, keepdim=True)
        else:
            _, w, ids = self.route(x)
        if self.acc == "zeros":
            out = torch.zeros((T, d), dtype=x.dtype, device=x.device)
        else:
            out = torch.zeros_like(x)
        mask = F.one_hot(ids, num_classes=self.classes).permute(2, 1, 0)  # [E, K, T]
        kept = []
        for e in self.experts_used:
            tok, k = self._rows(ids, mask, e)
            y = self.experts[e](x[tok] if self.rows == "index" else x[None, tok].reshape(-1, d))
            if self.scale != "none":
                y = y * self._scale(w, tok, k, x.dtype, ids, e)
            if self.read_inside:
                y = y + out[tok]
            if self.combine == "functional":
                out = out.index_add(0, tok, y.to(x.dtype))
            elif self.combine in ("setitem_iadd", "setitem_iadd_read"):
                rows = out[tok]
                if self.combine == "setitem_iadd_read":
                    kept.append(rows.sum())
                rows += y.to(x.dtype)
                out[tok] = rows
            elif self.combine == "setitem_add":
                out[tok] = out[tok] + y.to(x.dtype)
            elif self.combine == "assign":
                out[tok] = y.to(x.dtype)
            elif self.combine == "index_put":
                out.index_put_((tok,), y.to(x.dtype), accumulate=True)
            elif self.combine == "scatter_add":
                out.scatter_add_(0, tok[:, None].expand(-1, d), y.to(x.dtype))
            elif self.combine == "scatter_add_functional":
                out = out.scatter_add(0, tok.view(-1, 1).repeat(1, d), y.to(x.dtype))
            else:
                out.index_add_(0, tok, y.to(x.dtype))
            if self.mutate_input == "x" and e == 1:
                x.mul_(0.5)  # the experts after this one read the halved rows
            elif self.mutate_input == "x-view" and e == 1:
                x[:, :4].zero_()
            elif self.mutate_input == "x-view-augmented" and e == 1:
                rows = x.view(-1)
                rows *= 0.5  # operator.imul on a view: writes into x as mul_ does
            elif self.mutate_input == "x-view-relu-inplace" and e == 1:
                F.relu(x[:, :4], inplace=True)  # what nn.ReLU(inplace=True) on a view of x does
            elif self.mutate_input == "weights" and e == 1:
                w.mul_(2.0)
        if kept:
            return out + sum(kept)
        return out


class StackedColumnsMoE(nn.Module):
    """Every expert on every token from stacked [E, d, n] / [E, n, d] parameters (`x @ W_up[e] +
    b_up[e]`), each weighted by its gate column of sigmoid top-k weights renormalised.

    column: "masked_fill" (w.masked_fill(ids != e, 0).sum(-1, keepdim=True)), "mul" ((w * (ids ==
            e)).sum(-1, keepdim=True))
    experts: "plain" (silu(x @ W_up[e] + b_up[e]) @ W_down[e] + b_down[e]), "gated" (silu(x @ W_gate[e])
             * (x @ W_up[e]) @ W_down[e], no biases)
    shift: expert e reads W_up[(e + shift) % E] (another expert's weights: never rewritten unless 0)
    """

    def __init__(self, d=16, n=8, E=4, K=2, column="masked_fill", experts="plain", shift=0):
        super().__init__()
        self.E, self.K, self.column, self.experts, self.shift = E, K, column, experts, shift
        self.gate = nn.Linear(d, E)
        self.w_up = nn.Parameter(torch.randn(E, d, n) / d ** 0.5)
        self.w_down = nn.Parameter(torch.randn(E, n, d) / n ** 0.5)
        if experts == "gated":
            self.w_gate = nn.Parameter(torch.randn(E, d, n) / d ** 0.5)
        else:
            self.b_up = nn.Parameter(torch.randn(E, n) * 0.1)
            self.b_down = nn.Parameter(torch.randn(E, d) * 0.1)

    def forward(self, x):
        w, ids = torch.sigmoid(self.gate(x)).topk(self.K, dim=-1)
        w = w / w.sum(dim=-1, keepdim=True)
        y = torch.zeros_like(x)
        for e in range(self.E):
            if self.column == "masked_fill":
                g = w.masked_fill(ids != e, 0.0).sum(dim=-1, keepdim=True)
            else:
                g = (w * (ids == e)).sum(dim=-1, keepdim=True)
            up = self.w_up[(e + self.shift) % self.E]
            if self.experts == "gated":
                out = (F.silu(x @ self.w_gate[e]) * (x @ up)) @ self.w_down[e]
            else:
                out = F.silu(x @ up + self.b_up[e]) @ self.w_down[e] + self.b_down[e]
            y = y + g * out
        return y


class OwnMatmulExpertsMoE(nn.Module):
    """Experts holding their own [d, n] / [n, d] parameters, applied as `gelu(x @ w_in + b_in) @ w_out
    + b_out`, every expert on every token weighted by its gate column `(w * (ids == e)).sum(-1,
    keepdim=True)`. The op takes [out, in] weights: left alone, with the reason."""

    def __init__(self, d=16, n=8, E=4, K=2):
        super().__init__()
        self.E, self.K = E, K
        self.gate = nn.Linear(d, E, bias=False)
        self.w_in = nn.ParameterList([nn.Parameter(torch.randn(d, n) / d ** 0.5) for _ in range(E)])
        self.b_in = nn.ParameterList([nn.Parameter(torch.zeros(n)) for _ in range(E)])
        self.w_out = nn.ParameterList([nn.Parameter(torch.randn(n, d) / n ** 0.5) for _ in range(E)])
        self.b_out = nn.ParameterList([nn.Parameter(torch.zeros(d)) for _ in range(E)])

    def forward(self, x):
        w, ids = self.gate(x).softmax(-1).topk(self.K, dim=-1)
        out = torch.zeros_like(x)
        for e in range(self.E):
            g = (w * (ids == e)).sum(dim=-1, keepdim=True)
            out = out + g * (F.gelu(x @ self.w_in[e] + self.b_in[e]) @ self.w_out[e] + self.b_out[e])
        return out


class PermutedTop1MoE(nn.Module):
    """Top-1 rows sorted by expert (`perm = torch.argsort(ids)`), each row's gate, up and down weights
    gathered (`W[ids[perm]]`) into per-row einsums, weighted, and put back by `scatter_add_` at perm
    into zeros: row-wise work on permuted rows, which the canonical form runs unpermuted."""

    def __init__(self, d=16, n=8, E=4):
        super().__init__()
        self.gate = nn.Linear(d, E, bias=False)
        self.gate_w = nn.Parameter(torch.randn(E, d, n) / d ** 0.5)
        self.up_w = nn.Parameter(torch.randn(E, d, n) / d ** 0.5)
        self.down_w = nn.Parameter(torch.randn(E, n, d) / n ** 0.5)

    def forward(self, x):
        p, e = self.gate(x).softmax(-1).topk(1, dim=-1)
        p, e = p.squeeze(-1), e.squeeze(-1)
        perm = torch.argsort(e)
        es, xs = e[perm], x[perm]
        g = torch.einsum("nd,ndf->nf", xs, self.gate_w[es])
        u = torch.einsum("nd,ndf->nf", xs, self.up_w[es])
        ys = torch.einsum("nf,nfd->nd", F.silu(g) * u, self.down_w[es]) * p[perm].unsqueeze(-1)
        out = torch.zeros_like(x)
        out.scatter_add_(0, perm.unsqueeze(-1).expand(-1, x.shape[1]), ys)
        return out


class SortedMaskLoopMoE(Router):
    """Slots sorted by expert (megablocks' and torchtitan's reorder): `perm = torch.sort(flat)[1]`, the
    tokens read at perm // K, a loop over the sorted ids' masks writing each expert's rows, the
    sorted weights applied, the rows put back at perm // K by index_add.

    loop:    "setitem" (out[es == e] = expert(xs[es == e])), "index_copy" (functional, megablocks':
             out = out.index_copy(0, rows, expert(xs[rows])), rows = nonzero(es == e).squeeze(-1)),
             "index_put" (out = out.index_put((rows,), ...))
    read:    "index_select" (x.index_select(0, perm // K)), "gather" (torch.gather with the rows expanded)
    experts: "list" (a ModuleList of gated experts), "packed" (megablocks' [E * n, d] parameters viewed
             [E, n, d], gelu(xs @ w1[e].t()) @ w2[e])
    masks:   "sorted" (es = flat[perm]), "unsorted" (flat itself over the sorted rows: not the routing,
             never rewritten)
    """

    def __init__(self, d=16, n=8, E=4, K=2, loop="setitem", read="index_select", experts="list", masks="sorted"):
        super().__init__(d, E, K)
        self.loop, self.read, self.kind, self.masks, self.n = loop, read, experts, masks, n
        if experts == "list":
            self.experts = make_experts("gated", d, n, E)
        else:
            self.w1 = nn.Parameter(torch.randn(E * n, d) / d ** 0.5)
            self.w2 = nn.Parameter(torch.randn(E * n, d) / n ** 0.5)

    def _expert(self, e, h):
        if self.kind == "list":
            return self.experts[e](h)
        w1, w2 = self.w1.view(self.E, self.n, -1), self.w2.view(self.E, self.n, -1)
        return F.gelu(h @ w1[e].t(), approximate="tanh") @ w2[e]

    def forward(self, x):
        _, w, ids = self.route(x)
        flat, K = ids.reshape(-1), self.K
        perm = torch.sort(flat, stable=True)[1]
        tok = perm // K
        if self.read == "gather":
            xs = torch.gather(x, 0, tok.reshape(-1, 1).expand(-1, x.shape[1]))
        else:
            xs = x.index_select(0, tok)
        es = flat[perm] if self.masks == "sorted" else flat
        out = xs.new_zeros(xs.shape[0], x.shape[1])
        for e in range(self.E):
            if self.loop == "setitem":
                out[es == e] = self._expert(e, xs[es == e])
            else:
                rows = torch.nonzero(es == e).squeeze(-1)
                y = self._expert(e, xs[rows])
                out = out.index_copy(0, rows, y) if self.loop == "index_copy" else out.index_put((rows,), y)
        ys = out * w.reshape(-1)[perm].unsqueeze(-1)
        return torch.zeros_like(x).index_add(0, tok, ys)


class OneHotTop1MoE(nn.Module):
    """Switch-style top-1 run densely: every expert on every token, combined by the 0/1 rows
    `F.one_hot(ids, E)` of the top-1 ids, the chosen probability applied after the combine.

    ids:     "argmax" (probs.argmax(-1)), "max" (probs.max(-1)[1]), "shifted" ((argmax + 1) % E: not
             the router's choice, never rewritten)
    combine: "slices" (out = out + mask[:, e:e+1] * experts[e](x)), "stack_first" (einsum over
             torch.stack(outs) [E, T, d])
    """

    def __init__(self, d=16, n=8, E=4, ids="argmax", combine="slices"):
        super().__init__()
        self.E, self.ids, self.combine = E, ids, combine
        self.gate = nn.Linear(d, E, bias=False)
        self.experts = make_experts("gated", d, n, E, None, False)

    def forward(self, x):
        probs = self.gate(x).softmax(-1)
        ids = probs.max(-1)[1] if self.ids == "max" else probs.argmax(-1)
        if self.ids == "shifted":
            ids = (ids + 1) % self.E
        p = probs.gather(-1, ids.unsqueeze(-1))
        mask = F.one_hot(ids, num_classes=self.E).to(x.dtype)
        if self.combine == "stack_first":
            out = torch.einsum("te,etd->td", mask, torch.stack([e(x) for e in self.experts]))
        else:
            out = torch.zeros_like(x)
            for e in range(self.E):
                out = out + mask[:, e:e + 1] * self.experts[e](x)
        return out * p


class ArgmaxTop2MoE(nn.Module):
    """fairseq's / DeepSpeed's top2gating without capacity: the argmax of the probabilities, then the
    argmax of the logits with the first expert masked to -inf; each slot's probability read through
    its one_hot and the two renormalised; the [T, E] combine matrix is the two slots' one_hots times
    their weights, summed.

    mask:    "masked_fill" (logits.masked_fill(one_hot.bool(), -inf)), "where" (torch.where(one_hot
             > 0, -inf, logits)), "scatter" (logits.scatter(-1, i1[:, None], -inf)), "unmasked" (the
             second argmax over the logits as they are: the first expert again, never rewritten)
    first:   "probs" (argmax of the softmax), "logits" (argmax of the logits), "other" (argmax of
             another router's logits: not the top-2 of these, never rewritten)
    combine: "loop" (rows where combine[:, e] > 0, index_add_), "dense" (every expert on every
             token, out = out + combine[:, e:e+1] * experts[e](x))
    weights: "renormalised" (g / (g1 + g2)), "shifted" (g - 0.3: may be negative, so the loop's
             combine > 0 selects rows the top-2 does not always give; the dense combine takes any
             weights)
    one_hot: "functional" (F.one_hot), "scatter" (fairseq's own: ones scattered into int64 zeros at
             the argmaxes taken with keepdim=True)
    """

    def __init__(self, d=16, n=8, E=6, mask="masked_fill", first="probs", combine="loop", weights="renormalised",
                 one_hot="functional"):
        super().__init__()
        self.E, self.mask, self.first, self.combine, self.weights = E, mask, first, combine, weights
        self.one_hot = one_hot
        self.gate = nn.Linear(d, E, bias=False)
        self.other = nn.Linear(d, E, bias=False) if first == "other" else None
        self.experts = make_experts("gated", d, n, E, None, False)

    def _one_hot(self, scores, ids):
        if self.one_hot == "scatter":
            return scores.new_zeros(scores.shape, dtype=torch.int64).scatter_(1, scores.argmax(1, keepdim=True), 1)
        return F.one_hot(ids, num_classes=self.E)

    def forward(self, x):
        logits = self.gate(x)
        gates = F.softmax(logits, dim=1)
        scores = {"probs": gates, "logits": logits}.get(self.first)
        i1 = torch.argmax(scores if scores is not None else self.other(x), dim=1)
        m1 = self._one_hot(scores if scores is not None else self.other(x), i1)
        if self.mask == "masked_fill":
            rest = logits.masked_fill(m1.bool(), float("-inf"))
        elif self.mask == "where":
            rest = torch.where(m1 > 0, float("-inf"), logits)
        elif self.mask == "scatter":
            rest = logits.scatter(-1, i1.unsqueeze(-1), float("-inf"))
        else:
            rest = logits
        i2 = torch.argmax(rest, dim=1)
        m2 = self._one_hot(rest, i2)
        g1, g2 = (gates * m1).sum(dim=1), (gates * m2).sum(dim=1)
        denom = torch.clamp(g1 + g2, min=torch.finfo(g1.dtype).eps)
        g1, g2 = g1 / denom, g2 / denom
        if self.weights == "shifted":
            g1, g2 = g1 - 0.3, g2 - 0.3
        combine = g1[:, None] * m1 + g2[:, None] * m2
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            if self.combine == "dense":
                out = out + combine[:, e:e + 1] * expert(x)
            else:
                idx = torch.nonzero(combine[:, e] > 0).squeeze(-1)
                out.index_add_(0, idx, combine[idx, e, None] * expert(x[idx]))
        return out


class DenseMoE(Router):
    """Every expert on every token, combined by a [T, E] gate matrix.

    gates:   "scatter" (zeros_like(probs).scatter(1, ids, w)), "scatter_" (in place on zeros),
             "one_hot" ((one_hot(ids, E) * w.unsqueeze(-1)).sum(1)), "probs" (softmax probs: not sparse),
             "softmax_neg_inf" (softmax of log w scattered into -inf: gathered from the gate matrix)
    combine: "stack_sum" ((gates.unsqueeze(-1) * stack(outs, 1)).sum(1)), "einsum", "slices"
             (out = out + gates[:, e:e+1] * experts[e](x)), "builtin_sum" (sum(gates[:, e, None] * ...)),
             "shared_slices" (out = shared(x), then out = out + gates[..., e:e+1] * experts[e](x)),
             "zeros_slices" (the same from torch.zeros_like(x)), "two_extra_slices" (from shared(x) + x:
             two terms that are no expert's, never rewritten), "where_columns" (no gate matrix: out =
             out + torch.where(ids == e, w, 0).sum(-1, keepdim=True) * experts[e](x), from the literal 0),
             experts stacked first (`torch.stack(outs)`, [E, T, d]): "first_einsum" (einsum("te,etd->td")),
             "first_sum" ((gates.t().unsqueeze(-1) * outs).sum(0)), "first_untransposed" ((gates.unsqueeze(-1)
             * outs).sum(0): another function, which broadcasts only where T == E), and stacked last
             (dim=-1, [T, d, E]): "last_sum" ((gates[:, None] * outs).sum(-1)), "last_einsum"
             (einsum("te,tde->td")); per slot and expert, no gate matrix: "slot_where" (out = out +
             torch.where((ids[:, k] == e)[:, None], w[:, k:k+1] * experts[e](x), 0) over k and e), and
             its variants that are another function: "slot_where_other_weight" (slot k weighted by
             slot K-1-k's weight), "slot_where_other_expert" (slot 1 runs expert e+1 where it holds e)
    """

    def __init__(self, d=16, n=8, E=4, K=2, experts="gated", gates="scatter", combine="stack_sum", acts=None,
                 bias=False):
        super().__init__(d, E, K)
        self.experts = make_experts(experts, d, n, E, acts, bias)
        self.gates, self.combine = gates, combine
        self.shared = GatedExpert(d, n) if combine in ("shared_slices", "two_extra_slices") else None

    def _gates(self, probs, w, ids):
        if self.gates == "scatter":
            return torch.zeros_like(probs, dtype=w.dtype).scatter(1, ids, w)
        if self.gates == "scatter_":
            gates = torch.zeros(probs.shape, dtype=w.dtype, device=w.device)
            gates.scatter_(1, ids, w)
            return gates
        if self.gates == "one_hot":
            return (F.one_hot(ids, self.E) * w.unsqueeze(-1)).sum(1)
        if self.gates == "softmax_neg_inf":  # softmax(log w) over the kept columns: the renormalised w
            return torch.full_like(probs, float("-inf"), dtype=w.dtype).scatter(1, ids, w.log()).softmax(dim=-1)
        if self.gates == "probs":
            return probs
        raise ValueError(self.gates)

    def forward(self, x):
        probs, w, ids = self.route(x)
        gates = self._gates(probs, w, ids).to(x.dtype)
        if self.combine == "where_columns":  # each expert's weight picked from the top-k slots holding it
            out = 0
            for e in range(self.E):
                out = out + torch.where(ids == e, w, torch.zeros_like(w)).sum(-1, keepdim=True) * self.experts[e](x)
            return out
        if self.combine == "builtin_sum":  # starts from the literal 0
            return sum(gates[:, e, None] * self.experts[e](x) for e in range(self.E))
        if self.combine in ("shared_slices", "zeros_slices", "two_extra_slices"):
            out = torch.zeros_like(x) if self.shared is None else self.shared(x)
            out = out + x if self.combine == "two_extra_slices" else out
            for e in range(self.E):
                out = out + gates[..., e:e + 1] * self.experts[e](x)
            return out
        if self.combine == "slices":
            out = self.experts[0](x) * gates[:, 0:1]
            for e in range(1, self.E):
                out = out + gates[:, e:e + 1] * self.experts[e](x)
            return out
        if self.combine.startswith("slot_where"):
            out = torch.zeros_like(x)
            for k in range(self.K):
                for e in range(self.E):
                    kw = self.K - 1 - k if self.combine == "slot_where_other_weight" else k
                    ee = (e + 1) % self.E if self.combine == "slot_where_other_expert" and k == 1 else e
                    term = w[:, kw:kw + 1].to(x.dtype) * self.experts[ee](x)
                    out = out + torch.where((ids[:, k] == e)[:, None], term, torch.zeros_like(term))
            return out
        if self.combine.startswith("first"):
            outs = torch.stack([expert(x) for expert in self.experts])  # [E, T, d]
            if self.combine == "first_einsum":
                return torch.einsum("te,etd->td", gates, outs)
            return ((gates.t() if self.combine == "first_sum" else gates).unsqueeze(-1) * outs).sum(0)
        if self.combine.startswith("last"):
            outs = torch.stack([expert(x) for expert in self.experts], dim=-1)  # [T, d, E]
            if self.combine == "last_einsum":
                return torch.einsum("te,tde->td", gates, outs)
            return (gates[:, None] * outs).sum(-1)
        outs = torch.stack([expert(x) for expert in self.experts], dim=1)  # [T, E, d]
        if self.combine == "einsum":
            return torch.einsum("te,ted->td", gates, outs)
        return (gates.unsqueeze(-1) * outs).sum(1)


class BatchedDenseMoE(Router):
    """`DenseMoE` on [B, S, d] hidden states that are never flattened: the router's [B, S, E] scores,
    a [B, S, E] gate matrix, every expert's [B, S, d] output.

    gates:   "scatter" (zeros_like(probs).scatter(-1, ids, w)), "one_hot" ((one_hot(ids, E) * w[..., None]).sum(-2))
    combine: "slices" (out = out + gates[..., e:e+1] * experts[e](x)), "stack_sum" ((gates[..., None] *
             stack(outs, -2)).sum(-2)), "einsum" (einsum("bse,bsed->bsd", gates, stack(outs, 2))),
             "shared_slices" (the slices from a shared expert's output), "colon_slices" (gates[:, e:e+1]:
             on [B, S, E] gates that picks sequence position e, not expert e: never rewritten)
    """

    def __init__(self, d=16, n=8, E=4, K=2, gates="scatter", combine="slices"):
        super().__init__(d, E, K)
        self.experts = make_experts("gated", d, n, E)
        self.gates, self.combine = gates, combine
        self.shared = GatedExpert(d, n) if combine == "shared_slices" else None

    def forward(self, x):
        probs = F.softmax(self.gate(x), dim=-1)
        w, ids = torch.topk(probs, self.K, dim=-1)
        if self.gates == "scatter":
            gates = torch.zeros_like(probs).scatter(-1, ids, w)
        else:
            gates = (F.one_hot(ids, self.E) * w[..., None]).sum(-2)
        if self.combine in ("slices", "shared_slices", "colon_slices"):
            out = torch.zeros_like(x) if self.shared is None else self.shared(x)
            for e in range(self.E):
                column = gates[:, e:e + 1] if self.combine == "colon_slices" else gates[..., e:e + 1]
                out = out + column * self.experts[e](x)
            return out
        outs = torch.stack([expert(x) for expert in self.experts], dim=-2)  # [B, S, E, d]
        if self.combine == "einsum":
            return torch.einsum("bse,bsed->bsd", gates, outs)
        return (gates[..., None] * outs).sum(-2)


class SplitLoopMoE(LoopMoE):
    """Routing and mask in forward, the loop in a helper method: without
    capture_dynamic_output_shape_ops, Dynamo compiles forward up to the call and returns the mask."""

    def forward(self, x):
        _, w, ids = self.route(x)
        mask = F.one_hot(ids, num_classes=self.E).permute(2, 1, 0)
        return self.loop(x, w, mask)

    def loop(self, x, w, mask):
        out = torch.zeros_like(x)
        for e in range(self.E):
            k, tok = torch.where(mask[e])
            out.index_add_(0, tok, self.experts[e](x[tok]) * w[tok, k, None])
        return out


class PerKLoopMoE(Router):
    """A loop over the ids' columns around the loop over experts (or inside it): the rows where
    `ids[:, k] == e`, expert e on them, scaled by column k of the weights, added to the output.

    order:   "k_outer" (for k: for e) or "e_outer" (for e: for k)
    where:   "where" (tok = torch.where(ids[:, k] == e)[0]), "nonzero" (.nonzero(as_tuple=True)[0]),
             "mask" (the boolean mask itself: x[m], w[m, k, None]; with combine="setitem_iadd"),
             "nonzero_squeeze" (m.nonzero().squeeze(-1)), "nonzero_flatten" (m.nonzero().flatten())
    scale:   "index_none" (w[tok, k, None]), "slice" (w[tok, k:k+1]), "unsqueeze" (w[tok, k].unsqueeze(-1)),
             "rows" (K = 1: the [T, 1] weights' rows, w.index_select(0, tok))
    combine: "inplace" (out.index_add_), "setitem_iadd" (out[tok] += y) or "setitem_iadd_inline"
             (out[tok] += expert(x[tok]) * w[...], one statement: the rows of out are read first)
    columns: the columns k visited (default all K); weight_shift: scale by column (k + shift) % K;
    twin_for: the column k whose experts are another ModuleList (other weights, same shapes);
    whole_too: an expert also added once over all its slots (`torch.where(ids == e)`), before the loops
    """

    def __init__(self, d=16, n=8, E=4, K=2, experts="gated", order="k_outer", where="where", scale="index_none",
                 combine="inplace", columns=None, weight_shift=0, twin_for=None, bias=False, whole_too=None):
        super().__init__(d, E, K)
        self.experts = make_experts(experts, d, n, E, bias=bias)
        self.twins = make_experts(experts, d, n, E, bias=bias) if twin_for is not None else None
        self.order, self.where, self.scale, self.combine = order, where, scale, combine
        self.columns = list(range(K)) if columns is None else columns
        self.weight_shift, self.twin_for, self.whole_too = weight_shift, twin_for, whole_too
        self.renormalize = K > 1

    def _add(self, out, x, w, ids, k, e):
        m = ids[:, k] == e
        if self.where == "mask":
            tok = m
        elif self.where == "nonzero":
            tok = m.nonzero(as_tuple=True)[0]
        elif self.where == "nonzero_squeeze":
            tok = m.nonzero().squeeze(-1)
        elif self.where == "nonzero_flatten":
            tok = m.nonzero().flatten()
        else:
            tok = torch.where(m)[0]
        experts = self.twins if k == self.twin_for else self.experts
        c = (k + self.weight_shift) % self.K

        def scaled():
            y = experts[e](x[tok])
            if self.scale == "slice":
                return y * w[tok, c:c + 1]
            if self.scale == "rows":
                return y * w.index_select(0, tok)
            if self.scale == "unsqueeze":
                return y * w[tok, c].unsqueeze(-1)
            return y * w[tok, c, None]

        if self.combine == "setitem_iadd_inline":  # out[tok] read before the expert runs
            out[tok] += scaled()
        elif self.combine == "setitem_iadd":
            y = scaled()
            out[tok] += y
        else:
            out.index_add_(0, tok, scaled())

    def forward(self, x):
        _, w, ids = self.route(x)
        out = torch.zeros_like(x)
        pairs = [(k, e) for k in self.columns for e in range(self.E)]
        if self.order == "e_outer":
            pairs = [(k, e) for e in range(self.E) for k in self.columns]
        if self.whole_too is not None:
            tok, k = torch.where(ids == self.whole_too)
            out.index_add_(0, tok, self.experts[self.whole_too](x[tok]) * w[tok, k, None])
        for k, e in pairs:
            self._add(out, x, w, ids, k, e)
        return out


class AnyHitLoopMoE(Router):
    """A loop that finds an expert's tokens as the rows of [T, K] ids holding it anywhere,
    `hit = ids == e; sel = hit.any(dim=-1)`, and each token's weight for it as the masked sum
    `(w * hit).sum(-1)`: the same tokens and weights as `torch.where(ids == e)` and `w[tok, k]`.

    rows:    "mask" (x[sel], out[sel] += ...), "where" (tok = torch.where(sel)[0]; index_add_),
             "nonzero" (tok = sel.nonzero().squeeze(-1); out[tok] += ...), "where-scatter_add"
             (out.scatter_add_(0, tok[:, None].expand(-1, d), y)), "nonzero_tuple-scatter_add" (tok =
             sel.nonzero(as_tuple=True)[0], scatter_add_)
    coef:    "whole" ((w * hit).sum(-1), read at the rows) or "rows" ((w[tok] * hit[tok]).sum(-1, keepdim=True):
             the rows first; with rows "where" and "where-scatter_add")
    rows "masked_scatter": x[sel] scaled by w[hit] (the [T, K] mask's elements: one per token), put
             back by `out + torch.zeros_like(x).masked_scatter(sel.unsqueeze(-1).expand_as(x), y)`
    """

    def __init__(self, d=16, n=8, E=4, K=2, rows="mask", experts="gated", bias=False, coef="whole"):
        super().__init__(d, E, K)
        self.experts = make_experts(experts, d, n, E, bias=bias)
        self.rows, self.coef = rows, coef

    def forward(self, x):
        _, w, ids = self.route(x)
        out = torch.zeros_like(x)
        for e in range(self.E):
            hit = ids == e
            sel = hit.any(dim=-1)
            coef = (w * hit).sum(-1)
            if self.rows == "mask":
                out[sel] += coef[sel, None] * self.experts[e](x[sel])
                continue
            if self.rows == "masked_scatter":
                y = self.experts[e](x[sel]) * w[hit].unsqueeze(-1)
                out = out + torch.zeros_like(x).masked_scatter(sel.unsqueeze(-1).expand_as(x), y)
                continue
            if self.rows == "nonzero_tuple-scatter_add":  # ERNIE-4.5's loop
                tok = sel.nonzero(as_tuple=True)[0]
            else:
                tok = sel.nonzero().squeeze(-1) if self.rows == "nonzero" else torch.where(sel)[0]
            if self.coef == "rows":
                y = self.experts[e](x[tok]) * (w[tok] * (ids[tok] == e)).sum(-1, keepdim=True)
            else:
                y = self.experts[e](x[tok]) * coef[tok].unsqueeze(-1)
            if self.rows == "where":
                out.index_add_(0, tok, y)
            elif self.rows in ("where-scatter_add", "nonzero_tuple-scatter_add"):
                out.scatter_add_(0, tok.unsqueeze(1).expand(-1, x.shape[1]), y)
            else:
                out[tok] += y
        return out


class SwitchLoopMoE(Router):
    """Top-1 routing by max (Switch Transformer): `p, ids = probs.max(dim=-1)`, then the loop of
    `LoopMoE` over [T] ids.

    where:   "eq" (tok, = torch.where(ids == e)), "nonzero" ((ids == e).nonzero(as_tuple=True)[0]),
             "mask" (the boolean mask m = ids == e itself: x[m], p[m], out[m])
    combine: "assign" (out[tok] = y), "assign_slice" (out[tok, :] = y), "iadd" (out[tok] += y),
             "index_add" (out.index_add_(0, tok, y))
    scale:   "index_none" (p[tok, None]), "unsqueeze" (p[tok].unsqueeze(-1))
    rows:    "plain" (x[tok]) or "slice" (x[tok, :]); keepdim: max(..., keepdim=True) (not [T] ids)
    """

    def __init__(self, d=16, n=8, E=4, experts="plain", where="eq", combine="assign", scale="index_none",
                 rows="plain", keepdim=False, bias=True):
        super().__init__(d, E, 1)
        self.experts = make_experts(experts, d, n, E, None, bias)
        self.where, self.combine, self.scale, self.rows, self.keepdim = where, combine, scale, rows, keepdim

    def forward(self, x):
        probs = F.softmax(self.gate(x), dim=-1)
        p, ids = probs.max(dim=-1, keepdim=True) if self.keepdim else probs.max(dim=-1)
        if self.keepdim:
            p, ids = p[:, 0], ids[:, 0]
        out = torch.zeros_like(x)
        for e in range(self.E):
            if self.where == "mask":
                tok = ids == e
            else:
                tok = torch.where(ids == e)[0] if self.where == "eq" else (ids == e).nonzero(as_tuple=True)[0]
            xe = x[tok] if self.rows == "plain" else x[tok, :]
            y = self.experts[e](xe) * (p[tok, None] if self.scale == "index_none" else p[tok].unsqueeze(-1))
            if self.combine == "assign":
                out[tok] = y
            elif self.combine == "assign_slice":
                out[tok, :] = y
            elif self.combine == "iadd":
                out[tok] += y
            else:
                out.index_add_(0, tok, y)
        return out


class DeepSeekRefMoE(nn.Module):
    """DeepSeek-V3's reference MoE (its inference `model.py`), less the skip of experts with no
    tokens (`bincount(...).tolist()`, which Dynamo cannot trace): softmax scores, top-k ids, the
    weights gathered from the scores, `y[idx] += expert(x[idx]) * weights[idx, top, None]` over
    `torch.where(indices == i)`, and a shared expert added after the loop."""

    def __init__(self, d=16, n=8, E=4, K=2):
        super().__init__()
        self.gate = nn.Linear(d, E, bias=False)
        self.experts = make_experts("gated", d, n, E)
        self.shared = GatedExpert(d, 2 * n)
        self.E, self.K = E, K

    def forward(self, x):
        scores = self.gate(x).softmax(dim=-1, dtype=torch.float32)
        indices = torch.topk(scores, self.K, dim=-1)[1]
        weights = scores.gather(1, indices).type_as(x)
        y = torch.zeros_like(x)
        for i in range(self.E):
            idx, top = torch.where(indices == i)
            y[idx] += self.experts[i](x[idx]) * weights[idx, top, None]
        return y + self.shared(x)


class StackedLoopMoE(Router):
    """The loop of `LoopMoE` over experts stored as stacked [E, ., .] parameters, each expert e
    reading the slices W[e] (`xe = x[tok]`, `out.index_add_(0, tok, y * w[tok, k, None])`).

    orient:  "T" (xe @ W[e].T, W [E, out, in]), "linear" (F.linear(xe, W[e]), W [E, out, in]),
             "in_out" (xe @ W[e], W [E, in, out])
    gate_up: "separate" (w1, w3: silu(xe w1) * (xe w3)), "fused" (one w13 of width 2n, chunked),
             "plain" (gelu(xe w1), non-gated), "halves" (one w13 [E, 2n, d] read as W[e, :n] for the
             gate and W[e, n:] for the up), "halves_swapped" (W[e][n:] the gate, W[e][:n] the up)
    down_orient: the down projection's orientation when it differs (a layout mismatch)
    index:   "own" (W[e]), "next" (W[(e + 1) % E]), "shuffled" (W[perm[e]], one fixed permutation)
    experts_used: the experts the loop visits (default all); mutate: clamp_ the down slice in place
    bias:    stacked [E, out] biases: F.linear(h, W[e], B[e]) (orient "linear"), else added, h @ W[e] + B[e];
             "next": B[(e + 1) % E]
    rows:    "getitem" (xe = x[tok]) or "index_select" (xe = x.index_select(0, tok))
    packed:  each weight stored as one 2-D [E * out, in] parameter (DBRX's), viewed as [E, out, in]
             (`W.view(E, -1, in)[e]`) where an expert reads it; "once": viewed once before the loop;
             "chunk": viewed and cut into E pieces before the loop, `W.view(E, -1, in).chunk(E, 0)`,
             each squeezed (`[e].squeeze(0)`, transformers 4.4x's DBRX); "unbind": `.unbind(0)`
    """

    def __init__(self, d=16, n=8, E=4, K=2, orient="T", gate_up="separate", down_orient=None, index="own",
                 experts_used=None, mutate=False, bias=False, rows="getitem", packed=False):
        super().__init__(d, E, K)
        self.packed = packed
        self.orient, self.down_orient, self.gate_up, self.index = orient, down_orient or orient, gate_up, index
        self.experts_used = list(range(E)) if experts_used is None else experts_used
        self.mutate = mutate
        self.perm = [(e * 3 + 1) % E for e in range(E)] if E != 3 else [1, 2, 0]

        self.n = n
        self.w1 = stacked_param(E, 2 * n if gate_up in ("fused", "halves", "halves_swapped") else n, d, orient)
        if gate_up == "separate":
            self.w3 = stacked_param(E, n, d, orient)
        self.w2 = stacked_param(E, d, n, self.down_orient)
        if packed:
            for name in ("w1", "w3", "w2"):
                if hasattr(self, name):
                    W = getattr(self, name)
                    setattr(self, name, nn.Parameter(W.detach().reshape(-1, W.shape[-1])))
        self.bias, self.rows = bias, rows
        if bias:
            for name in ("w1", "w3", "w2"):
                if hasattr(self, name):
                    in_out = (self.down_orient if name == "w2" else orient) == "in_out"
                    out = getattr(self, name).shape[2 if in_out else 1]
                    setattr(self, "b" + name[1], nn.Parameter(torch.randn(E, out) * 0.1))

    def _stack(self, W):
        if self.packed in ("once", "chunk", "unbind"):
            return self.views[id(W)]
        return W.view(self.E, -1, W.shape[-1]) if self.packed else W

    def _slice(self, W, e):
        W = self._stack(W)
        if self.index == "next":
            return W[(e + 1) % self.E]
        if self.index == "shuffled":
            return W[self.perm[e]]
        if self.packed == "chunk":
            return W.chunk(self.E, 0)[e].squeeze(0)
        if self.packed == "unbind":
            return W.unbind(0)[e]
        return W[e]

    def _half(self, W, e, which):
        """Rows [:n] ("low") or [n:] ("high") of W[e]: one index (halves) or two (halves_swapped);
        for [E, in, out] the columns."""
        n, W = self.n, self._stack(W)
        if self.orient == "in_out":
            return W[e, :, :n] if which == "low" else W[e, :, n:]
        if self.gate_up == "halves":
            return W[e, :n] if which == "low" else W[e, n:]
        return W[e][:n] if which == "low" else W[e][n:]

    def _project(self, h, W, e, orient, B=None, half=None):
        W_e = self._half(W, e, half) if half else self._slice(W, e)
        if B is not None and orient != "linear" and not half:
            B_e = B[(e + 1) % self.E] if self.bias == "next" else B[e]
            return (h @ W_e.T if orient == "T" else h @ W_e) + B_e
        if orient == "T":
            return h @ W_e.T
        if orient == "linear":
            if B is not None and half:  # the fused bias read in the same rows as its weight
                return F.linear(h, W_e, B[e, :self.n] if half == "low" else B[e, self.n:])
            if B is not None:
                return F.linear(h, W_e, B[(e + 1) % self.E] if self.bias == "next" else B[e])
            return F.linear(h, W_e)
        return h @ W_e

    def forward(self, x):
        _, w, ids = self.route(x)
        if self.packed in ("once", "chunk", "unbind"):
            self.views = {id(W): W.view(self.E, -1, W.shape[-1]) for W in (self.w1, getattr(self, "w3", None), self.w2)
                          if W is not None}
        out = torch.zeros_like(x)
        for e in self.experts_used:
            tok, k = torch.where(ids == e)
            xe = x.index_select(0, tok) if self.rows == "index_select" else x[tok]
            b1, b3, b2 = (getattr(self, name, None) for name in ("b1", "b3", "b2"))
            if self.gate_up == "separate":
                h = F.silu(self._project(xe, self.w1, e, self.orient, b1)) * self._project(xe, self.w3, e, self.orient, b3)
            elif self.gate_up == "fused":
                g, u = self._project(xe, self.w1, e, self.orient, b1).chunk(2, dim=-1)
                h = F.silu(g) * u
            elif self.gate_up in ("halves", "halves_swapped"):
                gate, up = ("low", "high") if self.gate_up == "halves" else ("high", "low")
                h = F.silu(self._project(xe, self.w1, e, self.orient, b1, half=gate)) * self._project(
                    xe, self.w1, e, self.orient, b1, half=up)
            else:
                h = F.gelu(self._project(xe, self.w1, e, self.orient, b1))
            if self.mutate:
                with torch.no_grad():
                    self._stack(self.w2)[e].clamp_(-0.5, 0.5)
            out.index_add_(0, tok, self._project(h, self.w2, e, self.down_orient, b2) * w[tok, k, None])
        return out


class BmmMoE(Router):
    """Every expert on every token as two `torch.bmm` over stacked weights, gated by a [T, E] matrix
    (transformers' Llama 4 is the default: repeat, sigmoid of top-k logits scattered into -inf,
    gate on the inputs, weights [E, in, out]).

    rows:    "repeat" (x.repeat(E, 1) [E*T, d], viewed [E, T, d]), "expand" (x.unsqueeze(0).expand(E, -1, -1)),
             "index_none" (x[None], broadcast by the gate column)
    gates:   "sigmoid_neg_inf" (sigmoid(full_like(logits, -inf).scatter_(1, ids, vals))), "softmax_neg_inf",
             "zeros_scatter" (renormalised softmax top-k scattered into zeros), "probs" (sigmoid(logits):
             not sparse), "big_neg" (sigmoid of a scatter into -1e4: not exactly zero)
    gate_on: "input", "output", "none", "both"
    orient:  "in_out" (W [E, in, out]) or "out_in" (W [E, out, in], read through .transpose(1, 2))
    act:     "swiglu" (chunk) or "gelu" (non-gated); column: "transposed" or "untransposed" (a wrong layout)
    bias:    an up-projection bias (an unchosen expert's zero row then maps to a nonzero output)
    gate_up: "fused" (one W1 [E, ., 2n], chunked) or "separate" (gate and up as two stacked parameters,
             two products: act(x Wg) * (x Wu))
    spelling: "bmm", or "einsum": every product an einsum ("td,edn->etn" on x itself, "etd,edn->etn"
             on gated rows, "etn,end->etd"; the letters follow `orient`) and the output gate
             `einsum("te,etd->td", gates, y)`, or "matmul": `x @ W` (x broadcast over the experts),
             `a @ W`, and the output gate `(y * gates.t()[:, :, None]).sum(0)`
    """

    def __init__(self, d=16, n=8, E=4, K=1, rows="repeat", gates="sigmoid_neg_inf", gate_on="input", orient="in_out",
                 act="swiglu", column="transposed", bias=False, gate_up="fused", spelling="bmm"):
        super().__init__(d, E, K)
        self.rows, self.gates, self.gate_on, self.orient = rows, gates, gate_on, orient
        self.act, self.column, self.gate_up, self.spelling = act, column, gate_up, spelling
        w1_out = 2 * n if act == "swiglu" else n

        def stacked(inp, out):
            shape = (E, inp, out) if orient == "in_out" else (E, out, inp)
            return nn.Parameter(torch.randn(shape) / inp ** 0.5)

        if gate_up == "separate":
            self.w_gate, self.w_up, self.w2 = stacked(d, n), stacked(d, n), stacked(n, d)
        else:
            self.w1, self.w2 = stacked(d, w1_out), stacked(n, d)
        self.b1 = nn.Parameter(torch.randn(E, w1_out) * 0.1) if bias else None

    def _gates(self, x):
        logits = self.gate(x)
        if self.gates in ("zeros_scatter", "probs"):
            probs, w, ids = self.route(x)
            return torch.zeros_like(probs, dtype=w.dtype).scatter(1, ids, w) if self.gates == "zeros_scatter" else torch.sigmoid(logits)
        vals, ids = torch.topk(logits, self.K, dim=1)
        fill = -1e4 if self.gates == "big_neg" else float("-inf")
        scores = torch.full_like(logits, fill).scatter_(1, ids, vals)
        if self.gates == "softmax_neg_inf":
            return scores.softmax(dim=-1)
        return torch.sigmoid(scores.float()).to(scores.dtype)

    def _weight(self, W):
        return W if self.orient == "in_out" else W.transpose(1, 2)

    def _product(self, rows, W):
        """rows [E, T, i] (or x [T, i]) times each expert's W read as [i, o]: [E, T, o]."""
        if self.spelling == "bmm":
            return torch.bmm(rows, self._weight(W))
        if self.spelling == "matmul":
            return rows @ self._weight(W)
        w = "eio" if self.orient == "in_out" else "eoi"
        return torch.einsum(f"{'eti' if rows.dim() == 3 else 'ti'},{w}->eto", rows, W)

    def _einsum_forward(self, x, gates):  # einsum or matmul products
        gated_in, gated_out = self.gate_on in ("input", "both"), self.gate_on in ("output", "both")
        rows = x.unsqueeze(0) * gates.t().unsqueeze(-1) if gated_in else x
        if self.gate_up == "separate":
            a = F.silu(self._product(rows, self.w_gate)) * self._product(rows, self.w_up)
        elif self.act == "swiglu":
            gate, up = self._product(rows, self.w1).chunk(2, dim=-1)
            a = up * F.silu(gate)
        else:
            a = F.gelu(self._product(rows, self.w1))
        y = self._product(a, self.w2)  # [E, T, d]
        if gated_out and self.spelling == "einsum":
            return torch.einsum("te,etd->td", gates, y)
        return (y * gates.t()[:, :, None]).sum(0) if gated_out else y.sum(dim=0)

    def forward(self, x):
        T, d = x.shape
        gates = self._gates(x).to(x.dtype)
        if self.spelling in ("einsum", "matmul"):
            return self._einsum_forward(x, gates)
        gated_in, gated_out = self.gate_on in ("input", "both"), self.gate_on in ("output", "both")
        col2 = (gates.t() if self.column == "transposed" else gates).reshape(-1, 1)  # [E*T, 1]
        col3 = gates.t().unsqueeze(-1)  # [E, T, 1]
        if self.rows == "repeat":
            rows = x.repeat(self.E, 1)
            rows = (rows * col2 if gated_in else rows).view(self.E, -1, d)
        else:
            rows = x.unsqueeze(0).expand(self.E, -1, -1) if self.rows == "expand" else x[None]
            rows = rows * col3 if gated_in else rows
        if self.gate_up == "separate":
            a = F.silu(torch.bmm(rows, self._weight(self.w_gate))) * torch.bmm(rows, self._weight(self.w_up))
        else:
            h = torch.bmm(rows, self._weight(self.w1))
            if self.b1 is not None:
                h = h + self.b1[:, None, :]
            if self.act == "swiglu":
                gate, up = h.chunk(2, dim=-1)
                a = up * F.silu(gate)
            else:
                a = F.gelu(h)
        y = torch.bmm(a, self._weight(self.w2))  # [E, T, d]
        if self.rows == "repeat":
            y = y.view(-1, d)
            y = (y * col2 if gated_out else y).reshape(self.E, -1, d)
        elif gated_out:
            y = y * col3
        return y.sum(dim=0)



class TiledBmmMoE(BmmMoE):
    """transformers 4.5x's Llama 4 spelling of `BmmMoE`'s default: router scores kept transposed [E, T]
    (the logits transposed, then transposed back for the top-k and the -inf fill), each expert's copy
    of the tokens read through arange(T) tiled E times, and the expert rows added back by that index.

    rows:    "gather" (`torch.gather(x, 0, idx.reshape(-1, 1).expand(-1, d))`), "index_select"
             (`x.index_select(0, idx.reshape(-1))`), "getitem" (`x[idx.reshape(-1)]`)
    combine: "scatter_add_" (in place, by the same [E*T, d] index), "index_add_" (by the flat index),
             "scatter_add" (functional)
    shared:  the combine adds into a shared expert's output (else into zeros)
    tile:    "expand" (`arange(T).view(1, -1).expand(E, -1)`), "repeat" (`.repeat(E, 1)`), or
             "shifted" (arange(T) rolled by one: rows of other tokens, never rewritten)
    """

    def __init__(self, d=16, n=8, E=4, K=1, rows="gather", combine="scatter_add_", shared=True, tile="expand"):
        super().__init__(d, n, E, K)
        self.rows_by, self.combine, self.tile = rows, combine, tile
        self.shared = GatedExpert(d, n) if shared else None

    def forward(self, x):
        T, d = x.shape
        logits = self.gate(x).transpose(0, 1)  # [E, T]
        vals, ids = torch.topk(logits.transpose(0, 1), self.K, dim=1)
        scores = torch.full_like(logits.transpose(0, 1), float("-inf")).scatter_(1, ids, vals).transpose(0, 1)
        index = torch.arange(T, device=x.device)
        if self.tile == "shifted":
            index = torch.roll(index, 1)
        index = index.view(1, -1)
        index = index.expand(scores.size(0), -1) if self.tile != "repeat" else index.repeat(scores.size(0), 1)
        scores = torch.sigmoid(scores.float()).to(x.dtype)
        wide = index.reshape(-1, 1).expand(-1, d)
        if self.rows_by == "gather":
            rows = torch.gather(input=x, dim=0, index=wide).to(x.device)
        elif self.rows_by == "index_select":
            rows = x.index_select(0, index.reshape(-1))
        else:
            rows = x[index.reshape(-1)]
        rows = rows * scores.reshape(-1, 1)
        gate, up = torch.bmm(rows.view(self.E, -1, d), self.w1).chunk(2, dim=-1)
        y = torch.bmm(up * F.silu(gate), self.w2).view(-1, d)
        out = self.shared(x) if self.shared is not None else torch.zeros_like(x)
        if self.combine == "scatter_add_":
            out.scatter_add_(dim=0, index=wide, src=y)
        elif self.combine == "index_add_":
            out.index_add_(0, index.reshape(-1), y)
        else:
            out = out.scatter_add(0, wide, y)
        return out

class RepeatLoopMoE(Router):
    """DeepSeek-MoE's (and DeepSeek-V2's) training-path loop over the token rows repeated K times:
    `xr = x.repeat_interleave(K, dim=0)`, `y = torch.empty_like(xr)`, `y[flat == e] =
    experts[e](xr[flat == e])` with `flat = ids.view(-1)`, then `(y.view(*w.shape, -1) *
    w.unsqueeze(-1)).sum(dim=1)`.

    spelling: "method" (x.repeat_interleave, ids.view(-1)), "function" (torch.repeat_interleave,
              ids.reshape(-1), one shared mask node per expert, zeros_like, w[..., None]), "assign"
              (y = torch.zeros(T * K, d), the rows scaled by w.reshape(-1, 1), then scatter_add_ into
              zeros by each row's token, `torch.arange(T).repeat_interleave(K)`), "assign_flat" (the
              rows scaled by w.flatten()[:, None], index_add_ into zeros_like(x)), "assign_tiled" (the
              same added back by `arange(T).repeat(K)`: row r to token r mod T, not an MoE),
              "slots" (no repeat: y = x.new_zeros(T * K, d), each expert's slots `pos = (flat ==
              e).nonzero().flatten()` read as x[pos // K] and written by y.index_copy_(0, pos, ...))
    ids_int32: the ids cast to int32 before they are flattened (BailingMoE's variant)
    tile:     how the method spelling copies each token K times: "repeat_interleave", "view_repeat"
              (`x.view(T, 1, d).repeat(1, K, 1).reshape(-1, d)`, vLLM's reference), "unsqueeze_expand"
              (`x.unsqueeze(1).expand(-1, K, -1).reshape(-1, d)`), "tiled" (`x.repeat(K, 1)`: row r is
              token r mod T, not an MoE)
    Knobs that break it (the negative grid): transposed_ids (flat of ids.t(): k-major slots),
    experts_used, read_flipped (experts read their rows of the repeated rows flipped), y_read (y's
    sum added to the output), sum_dim
    """

    def __init__(self, d=16, n=8, E=4, K=2, experts="gated", spelling="method", bias=False, ids_int32=False,
                 transposed_ids=False, experts_used=None, read_flipped=False, y_read=False, sum_dim=1, acts=None,
                 tile="repeat_interleave"):
        super().__init__(d, E, K)
        self.tile = tile
        self.experts = make_experts(experts, d, n, E, acts, bias)
        self.spelling, self.ids_int32, self.transposed_ids = spelling, ids_int32, transposed_ids
        self.experts_used = list(range(E)) if experts_used is None else experts_used
        self.read_flipped, self.y_read, self.sum_dim = read_flipped, y_read, sum_dim

    def forward(self, x):
        _, w, ids = self.route(x)
        ids = ids.to(torch.int32) if self.ids_int32 else ids
        if self.transposed_ids:
            flat = ids.t().reshape(-1)
        else:
            flat = ids.reshape(-1) if self.spelling == "function" else ids.view(-1)
        if self.spelling == "slots":
            y = x.new_zeros(x.shape[0] * self.K, x.shape[1])
            for e in self.experts_used:
                pos = (flat == e).nonzero().flatten()
                y.index_copy_(0, pos, self.experts[e](x[torch.div(pos, self.K, rounding_mode="floor")]))
            return (y.view(x.shape[0], self.K, -1) * w.unsqueeze(2)).sum(dim=self.sum_dim)
        if self.spelling == "function":
            xr = torch.repeat_interleave(x, self.K, dim=0)
            y = torch.zeros_like(xr)
        elif self.spelling.startswith("assign"):
            xr = x.repeat_interleave(self.K, dim=0)
            y = torch.zeros(xr.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
        else:
            T, d = x.shape
            xr = {"repeat_interleave": lambda: x.repeat_interleave(self.K, dim=0),
                  "view_repeat": lambda: x.view(T, 1, d).repeat(1, self.K, 1).reshape(-1, d),
                  "unsqueeze_expand": lambda: x.unsqueeze(1).expand(-1, self.K, -1).reshape(-1, d),
                  "tiled": lambda: x.repeat(self.K, 1)}[self.tile]()
            y = torch.empty_like(xr)
        rows = xr.flip(0) if self.read_flipped else xr
        for e in self.experts_used:
            if self.spelling == "function":
                m = flat == e
                y[m] = self.experts[e](rows[m])
            else:
                y[flat == e] = self.experts[e](rows[flat == e])
        if self.spelling.startswith("assign"):
            T, d = x.shape
            token = torch.arange(T, device=x.device)
            token = token.repeat(self.K) if self.spelling == "assign_tiled" else token.repeat_interleave(self.K)
            if self.spelling == "assign_flat":
                return torch.zeros_like(x).index_add_(0, token, y * w.flatten()[:, None])
            out = torch.zeros(T, d, dtype=x.dtype, device=x.device)
            out.scatter_add_(0, token.unsqueeze(-1).expand(-1, d), y * w.reshape(-1, 1))
            return out
        scale = w[..., None] if self.spelling == "function" else w.unsqueeze(-1)
        out = (y.view(*w.shape, -1) * scale).sum(dim=self.sum_dim)
        return out + y.sum() if self.y_read else out


class GatheredMoE(Router):
    """gpt-fast's Mixtral (`ConditionalFeedForward`): every projection gathers the stacked weights
    of each token's experts, `W[ids]` [T, K, ., .], and contracts them by einsum, then the combine
    `einsum("tai,ta->ti", y, w)`.

    gate_up: "separate" (w1, w3 [E, n, d]: silu(g) * u), "fused" (w13 [E, 2n, d], chunked),
             "cut" (w13 [E, 2n, d] gathered, then `W13[ids].chunk(2, dim)` into gate and up weights:
             SGLang's and vLLM's native MoE), "cut-split" (the same by `.split(n, dim)`), "cut-sections"
             (by `.split([n, n], dim)`),
             "plain" (gelu, non-gated)
    orient:  "out_in" (W [E, out, in]: "ti,taoi->tao"), "in_out" (W [E, in, out]: "ti,taio->tao")
    combine: "einsum", "einsum_w_first" ("ta,tai->ti"), "mul_sum" ((y * w.unsqueeze(-1)).sum(1)),
             "index_none_sum" ((y * w[..., None]).sum(dim=1))
    letters: other einsum letters for the same products
    products: how each projection multiplies (not with the "cut" layouts):
             "einsum"; "matmul" (`rows[:, None, None, :] @ W[ids]` over 4-D gathers, squeezed);
             "bmm_flat" (`torch.bmm(x[:, None].expand(T, K, d).reshape(T * K, 1, d), W[ids.reshape(-1)])`);
             "bmm_flat_t" (`torch.bmm(W[flat], x.repeat_interleave(K, 0).unsqueeze(-1)).squeeze(-1)`, the
             weights' output dim first); "bmm_tiled" (as bmm_flat_t with the rows `x.repeat(K, 1)`: slot
             (t, k) reads row (t K + k) mod T, not x[t]: not an MoE, the negative)
    combine "flat": `(y.reshape(-1, d) * w.reshape(-1, 1)).view(T, K, d).sum(1)`
    flat_down_bias: (products "bmm_flat") a down bias gathered by the flat ids and added to the flat
             rows: `(torch.bmm(a, W2[flat]).squeeze(1) + B2[flat]).view(T, K, d)`
    Knobs that break it (the negative grid): down_ids ("flipped": the down projection gathers with
    ids.flip(-1)), up_rows ("scaled": the up projection reads 2 x), y_read (y's sum added to the
    output), sum_dim (the combine sums over d), down_orient (the down weights in the other
    orientation), gather_read (the gathered W1[ids] also feeds the output), gate_bias
    (separate gate/up only: `+ B[ids]` on the gate projection, an unsupported layout), cut_swapped (the
    second half of the cut W13[ids] is the gate), cut_read (the cut's first half also feeds the output)
    """

    def __init__(self, d=16, n=8, E=4, K=2, gate_up="separate", orient="out_in", combine="einsum", letters=False,
                 down_ids=None, up_rows=None, y_read=False, sum_dim=None, down_orient=None, gather_read=False,
                 gate_bias=False, cut_swapped=False, cut_read=False, products="einsum", flat_down_bias=False):
        super().__init__(d, E, K)
        self.down_bias = nn.Parameter(torch.randn(E, d) * 0.1) if flat_down_bias else None
        self.gate_up, self.orient, self.combine, self.letters = gate_up, orient, combine, letters
        self.down_ids, self.up_rows, self.y_read, self.sum_dim = down_ids, up_rows, y_read, sum_dim
        self.down_orient, self.gather_read, self.products = down_orient or orient, gather_read, products
        self.gate_bias = nn.Parameter(torch.randn(E, n) * 0.1) if gate_bias else None
        self.cut_swapped, self.cut_read, self.n = cut_swapped, cut_read, n

        self.w1 = stacked_param(E, 2 * n if gate_up in ("fused", "cut", "cut-split", "cut-sections") else n, d, orient)
        if gate_up == "separate":
            self.w3 = stacked_param(E, n, d, orient)
        self.w2 = stacked_param(E, d, n, self.down_orient)

    def _product(self, rows, W, ids, orient):
        """rows [T, i] or [T, K, i] times each slot's expert matrix of W, by `self.products`: [T, K, o]."""
        T, K = ids.shape
        if self.products == "matmul":
            r = rows[:, None, None, :] if rows.dim() == 2 else rows.unsqueeze(2)
            g = W[ids].transpose(-1, -2) if orient == "out_in" else W[ids]  # [T, K, i, o]
            return (r @ g).squeeze(2)
        flat = ids.reshape(-1)
        if self.products == "bmm_flat":
            i = rows.shape[-1]
            r = rows[:, None, :].expand(T, K, i).reshape(T * K, 1, i) if rows.dim() == 2 else rows.reshape(T * K, 1, i)
            g = W[flat].transpose(1, 2) if orient == "out_in" else W[flat]  # [T K, i, o]
            return torch.bmm(r, g).view(T, K, -1)
        if rows.dim() == 2:
            r = (rows.repeat_interleave(K, dim=0) if self.products == "bmm_flat_t" else rows.repeat(K, 1)).unsqueeze(-1)
        else:
            r = rows.reshape(T * K, -1, 1)
        g = W[flat] if orient == "out_in" else W[flat].transpose(1, 2)  # [T K, o, i]
        return torch.bmm(g, r).squeeze(-1).view(T, K, -1)

    def _up(self, x, W, ids, gathered=None):
        """x times W[ids] (or the given gathered halves) by `self.products`."""
        if self.products != "einsum":
            return self._product(x, W, ids, self.orient)
        gathered = W[ids] if gathered is None else gathered
        eq = {("out_in", False): "ti,taoi -> tao", ("in_out", False): "ti,taio->tao",
              ("out_in", True): "bh,bkfh->bkf", ("in_out", True): "bh,bkhf->bkf"}[self.orient, self.letters]
        return torch.einsum(eq, x, gathered)

    def forward(self, x):
        _, w, ids = self.route(x)
        rows = 2 * x if self.up_rows == "scaled" else x
        w1 = self.w1[ids] if self.products == "einsum" else None  # [T, K, ., .]
        if self.gate_up == "separate":
            g = self._up(rows, self.w1, ids, w1)
            u = self._up(x, self.w3, ids)
            a = F.silu(g if self.gate_bias is None else g + self.gate_bias[ids]) * u
        elif self.gate_up == "fused":
            g, u = self._up(x, self.w1, ids, w1).chunk(2, dim=-1)
            a = F.silu(g) * u
        elif self.gate_up in ("cut", "cut-split", "cut-sections"):
            dim = 2 if self.orient == "out_in" else 3  # the output dim of W13[ids]
            sizes = {"cut-split": self.n, "cut-sections": [self.n, self.n]}
            halves = w1.chunk(2, dim=dim) if self.gate_up == "cut" else w1.split(sizes[self.gate_up], dim=dim)
            g_w, u_w = halves[::-1] if self.cut_swapped else halves
            a = F.silu(self._up(x, None, ids, g_w)) * self._up(x, None, ids, u_w)
            if self.cut_read:
                a = a + halves[0].sum()
        else:
            a = F.gelu(self._up(x, self.w1, ids, w1))
        down_ids = ids.flip(-1) if self.down_ids == "flipped" else ids
        if self.down_bias is not None:
            T, K = ids.shape
            flat = down_ids.reshape(-1)
            g = self.w2[flat].transpose(1, 2) if self.down_orient == "out_in" else self.w2[flat]
            y = (torch.bmm(a.reshape(T * K, 1, -1), g).squeeze(1) + self.down_bias[flat]).view(T, K, -1)
        elif self.products != "einsum":
            y = self._product(a, self.w2, down_ids, self.down_orient)
        else:
            eq = "tao,taio->tai" if self.down_orient == "out_in" else "tao,taoi->tai"
            y = torch.einsum(eq, a, self.w2[down_ids])
        if self.sum_dim is not None:
            out = (y * w.unsqueeze(-1)).sum(self.sum_dim)
        elif self.combine == "einsum":
            out = torch.einsum("tai,ta->ti", y, w)
        elif self.combine == "einsum_w_first":
            out = torch.einsum("ta,tai->ti", w, y)
        elif self.combine == "mul_sum":
            out = (y * w.unsqueeze(-1)).sum(1)
        elif self.combine == "flat":
            T, K, d = y.shape
            out = (y.reshape(-1, d) * w.reshape(-1, 1)).view(T, K, d).sum(1)
        else:
            out = (y * w[..., None]).sum(dim=1)
        if self.y_read:
            out = out + y.sum()
        if self.gather_read:
            out = out + w1.sum()
        return out


class BatchedGatheredMoE(Router):
    """`GatheredMoE` on [B, S, d] hidden states that are never flattened: the [B, S, K] ids gather
    [B, S, K, ., .] weights, `einsum("bsd,bskod->bsko", x, W1[ids])`.

    gate_up: "separate" (w1, w3 [E, n, d]), "fused" (w13 [E, 2n, d], the product chunked)
    combine: "einsum" (`einsum("bskd,bsk->bsd", y, w)`), "mul_sum" (`(y * w.unsqueeze(-1)).sum(2)`)
    """

    def __init__(self, d=16, n=8, E=4, K=2, gate_up="separate", combine="einsum"):
        super().__init__(d, E, K)
        self.gate_up, self.combine = gate_up, combine
        self.w1 = stacked_param(E, 2 * n if gate_up == "fused" else n, d, "out_in")
        if gate_up == "separate":
            self.w3 = stacked_param(E, n, d, "out_in")
        self.w2 = stacked_param(E, d, n, "out_in")

    def forward(self, x):
        probs = F.softmax(self.gate(x), dim=-1)
        w, ids = torch.topk(probs, self.K, dim=-1)  # [B, S, K]
        if self.gate_up == "fused":
            g, u = torch.einsum("bsd,bskod->bsko", x, self.w1[ids]).chunk(2, dim=-1)
        else:
            g = torch.einsum("bsd,bskod->bsko", x, self.w1[ids])
            u = torch.einsum("bsd,bskod->bsko", x, self.w3[ids])
        y = torch.einsum("bsko,bskdo->bskd", F.silu(g) * u, self.w2[ids])
        if self.combine == "einsum":
            return torch.einsum("bskd,bsk->bsd", y, w)
        return (y * w.unsqueeze(-1)).sum(2)


def oai_swiglu(h, alpha=1.702, limit=7.0):
    """gpt-oss's reference activation on interleaved gate/up columns."""
    glu, linear = h[..., ::2].clamp(min=None, max=limit), h[..., 1::2].clamp(min=-limit, max=limit)
    return glu * torch.sigmoid(alpha * glu) * (linear + 1)


class GptOssReferenceMoE(nn.Module):
    """gpt-oss's reference `MLPBlock` (openai/gpt-oss, torch/model.py): top-k of the gate's logits
    then softmax, one interleaved gate/up parameter [E, 2n, d] and its bias gathered per token
    (`W[ids, ...]`), `einsum("beck,bk->bec", W1[ids], x) + B1[ids]`, the clamped SwiGLU, the down
    einsum, `y += B2[ids]`, and the combine einsum.

    down_bias: "iadd" (`y += B2[ids]`), "add" (`B2[ids] + y`), "none"
    Knobs that break it: bias_ids ("flipped": the up bias gathered by ids.flip(-1)), bias_read (the
    gathered up bias also feeds the output)
    """

    def __init__(self, d=16, n=8, E=4, K=2, down_bias="iadd", bias_ids=None, bias_read=False):
        super().__init__()
        self.K, self.down_bias, self.bias_ids, self.bias_read = K, down_bias, bias_ids, bias_read
        self.gate = nn.Linear(d, E)
        self.mlp1_weight = stacked_param(E, 2 * n, d, "out_in")
        self.mlp1_bias = nn.Parameter(torch.randn(E, 2 * n) * 0.1)
        self.mlp2_weight = stacked_param(E, d, n, "out_in")
        self.mlp2_bias = nn.Parameter(torch.randn(E, d) * 0.1)

    def forward(self, x):
        experts = torch.topk(self.gate(x), k=self.K, dim=-1, sorted=True)
        weights, ids = F.softmax(experts.values, dim=1), experts.indices
        b1 = self.mlp1_bias[ids.flip(-1) if self.bias_ids == "flipped" else ids, ...]
        t = torch.einsum("beck,bk->bec", self.mlp1_weight[ids, ...], x) + b1
        t = oai_swiglu(t)
        t = torch.einsum("beck,bek->bec", self.mlp2_weight[ids, ...], t)
        if self.down_bias == "iadd":
            t += self.mlp2_bias[ids, ...]
        elif self.down_bias == "add":
            t = self.mlp2_bias[ids, :, ] + t
        out = torch.einsum("bec,be->bc", t, weights)
        return out + b1.sum() if self.bias_read else out



class GptOssDenseMoE(nn.Module):
    """transformers 4.5x's gpt-oss experts on their training path: every expert on every token by bmm
    over [E, d, 2n] / [E, n, d] weights, each with a stacked bias broadcast over the tokens
    (`B[..., None, :]`), the interleaved clamped SwiGLU (`oai_swiglu`), and the outputs weighted by
    the router's [T, E] scores (top-k softmax scattered into zeros) transposed to [E, T]:
    `(y * scores.transpose(0, 1).view(E, T)[..., None]).sum(0)`.

    gate_on: "output" (as transformers), "input" (the rows scaled instead: with biases an unchosen
             expert adds its biases, never rewritten)
    """

    def __init__(self, d=16, n=8, E=4, K=2, gate_on="output"):
        super().__init__()
        self.E, self.K, self.gate_on = E, K, gate_on
        self.gate = nn.Linear(d, E)  # the router
        self.gate_up_proj = stacked_param(E, 2 * n, d, "in_out")  # [E, d, 2n]
        self.gate_up_proj_bias = nn.Parameter(torch.randn(E, 2 * n) * 0.1)
        self.down_proj = stacked_param(E, d, n, "in_out")  # [E, n, d]
        self.down_proj_bias = nn.Parameter(torch.randn(E, d) * 0.1)

    def forward(self, x):
        T, d = x.shape
        logits = self.gate(x)
        top, ids = torch.topk(logits, self.K, dim=-1)
        scores = torch.zeros_like(logits).scatter_(1, ids, F.softmax(top, dim=1, dtype=top.dtype))
        rows = x.repeat(self.E, 1)
        if self.gate_on == "input":
            rows = rows * scores.transpose(0, 1).reshape(-1, 1)
        rows = rows.view(self.E, -1, d)
        h = torch.bmm(rows, self.gate_up_proj) + self.gate_up_proj_bias[..., None, :]
        y = torch.bmm(oai_swiglu(h), self.down_proj) + self.down_proj_bias[..., None, :]
        if self.gate_on == "output":
            y = y * scores.transpose(0, 1).view(self.E, T)[..., None]  # [E, T, 1]
        return y.sum(dim=0)


class DispatchCombineMoE(Router):
    """GShard / Mesh-TensorFlow style without capacity (ported from JAX code): one_hot of the top-k ids,
    a 0/1 dispatch matrix `one_hot.sum(1)` that masks each expert's copy of the tokens
    (`einsum("te,td->etd", dispatch, x)`), ReLU experts by einsum over stacked [E, d, n] / [E, n, d]
    weights, and the outputs weighted by the combine matrix `einsum("tk,tke->te", w, one_hot)`:
    `einsum("etd,te->td", y, combine)`.

    dispatch_k: the dispatch mask from a top-k of its own with this k (k < K leaves a chosen expert
             reading zeros: never rewritten)
    """

    def __init__(self, d=16, n=8, E=4, K=2, dispatch_k=None):
        super().__init__(d, E, K)
        self.dispatch_k = dispatch_k
        self.wi = stacked_param(E, n, d, "in_out")  # [E, d, n]
        self.wo = stacked_param(E, d, n, "in_out")  # [E, n, d]

    def forward(self, x):
        probs, w, ids = self.route(x)
        one_hot = F.one_hot(ids, self.E).to(x.dtype)  # [T, K, E]
        combine = torch.einsum("tk,tke->te", w.to(x.dtype), one_hot)
        if self.dispatch_k is not None:
            one_hot = F.one_hot(torch.topk(probs, self.dispatch_k, dim=-1).indices, self.E).to(x.dtype)
        dispatch = one_hot.sum(axis=1)
        rows = torch.einsum("te,td->etd", dispatch, x)
        h = torch.relu(torch.einsum("etd,edn->etn", rows, self.wi))
        y = torch.einsum("etn,end->etd", h, self.wo)
        return torch.einsum("etd,te->td", y, combine)

# Library ops a combine may call (torchtitan 0.3 adds its experts' rows back with its own
# `torchtitan::deterministic_scatter_add`: a scatter_add along dim 0, its gradient a gather), written
# here in our words, and two that must not be taken for a scatter_add: one whose gradient leaves src
# out, one that keeps each row's largest value.
def _define_library_ops():
    lib = "sonic_test"
    if hasattr(torch.ops, lib) and hasattr(getattr(torch.ops, lib), "rows_scatter_add"):
        return

    def define(name, forward, src_grad):
        op = torch.library.custom_op(f"{lib}::{name}", forward, mutates_args=())
        op.register_fake(lambda out, index, src: torch.empty_like(out))

        def setup(ctx, inputs, output):
            ctx.save_for_backward(inputs[1])

        def backward(ctx, grad):
            (index,) = ctx.saved_tensors
            return grad, None, src_grad(grad, index)

        op.register_autograd(backward, setup_context=setup)

    def add_rows(out: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        return out.scatter_add(0, index, src)

    def max_rows(out: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        return out.scatter_reduce(0, index, src, "amax")

    define("rows_scatter_add", add_rows, lambda grad, index: grad.gather(0, index))
    define("rows_scatter_add_no_src_grad", add_rows, lambda grad, index: torch.zeros_like(grad.gather(0, index)))
    define("rows_scatter_max", max_rows, lambda grad, index: grad.gather(0, index))


_define_library_ops()


class SortedGroupedMoE(Router):
    """torchtitan's MoE spelling (without its padding wrapper): tokens sorted by expert with
    argsort, counts by histc, `torch._grouped_mm` over them, and a scatter_add back.

    gate_up: "separate" (w1, w3 [E, n, d]: silu(g) * u), "fused" (w13 [E, 2n, d], chunked)
    score_before: the routing weights scale the sorted rows before the experts (torchtitan's default)
    rows: "gather" (torch.gather of the expanded tokens), "index" (x[tok])
    sort: "argsort" (stable), "sort" (torch.sort of the ids, counts of its values, max=E-1)
    combine: "scatter_add" (into zeros_like), "scatter_add_" (in place), "index_add", "shared" (into a
             shared expert's output), "unsort" (`u = zeros_like(y); u[perm] = y; u.view(T, K, d).sum(1)`),
             "scatter_reduce" (`zeros_like(x).scatter_reduce(0, index, y, "sum", include_self=False)`),
             "unsort_einsum" / "unsort_mul_sum" (the unscaled rows un-sorted as "unsort" does, then weighted
             per slot: `einsum("tkd,tk->td", u.view(T, K, d), w)` / `(u.view(T, K, d) * w.unsqueeze(-1)).sum(1)`),
             or the name of a `sonic_test::` library op called as op(zeros_like(x), index, y) (torchtitan 0.3)
    casts: torchtitan's `.bfloat16()` on the rows and weights (no-ops on a bf16 model)
    offsets: "dtype" (`torch.cumsum(counts, 0, dtype=torch.int32)`), "cast" (`counts.cumsum(0).to(torch.int32)`)
    counts: "histc" (of the flat ids, or of the sorted ids with sort="sort"), or "mask_sum": a routing
            mask `zeros_like(scores, dtype=bool).scatter_(-1, ids, True)` summed over the tokens (torchtitan 0.3)
    count_buffer: in training, the counts also added into a buffer under no_grad (torchtitan 0.3's
            `tokens_per_expert` for its load-balancing bias)
    orient: "out_in" (weights [E, out, in], transposed for grouped_mm), "in_out" ([E, in, out] handed to
            grouped_mm as they are: torchtune's GroupedExperts, gate [E, d, n], up [E, d, n], down [E, n, d])
    experts: "grouped_mm", or "for_loop": the sorted rows split by `counts.tolist()` and one matmul per
            expert and projection, concatenated (torchtitan's `_run_experts_for_loop` with out_in weights,
            which splits `rows[:sum(sizes)]`; torchtune's GroupedExperts loop with in_out weights, which
            splits the rows themselves); Dynamo traces it whole with `capture_scalar_outputs`
    Knobs that break it (the negative grid): histc_max (another histc range), tok_k (perm // another K),
    scatter_rows ("perm": the rows scattered by perm, not perm // K), descending
    """

    def __init__(self, d=16, n=8, E=4, K=2, gate_up="separate", score_before=False, rows="gather", sort="argsort",
                 combine="scatter_add", casts=False, histc_max=None, tok_k=None, scatter_rows=None, descending=False,
                 offsets="dtype", orient="out_in", experts="grouped_mm", counts="histc", count_buffer=False):
        super().__init__(d, E, K)
        self.casts, self.offsets, self.orient, self.experts, self.counts = casts, offsets, orient, experts, counts
        self.gate_up, self.score_before, self.rows, self.sort, self.combine = gate_up, score_before, rows, sort, combine
        self.histc_max, self.tok_k, self.scatter_rows, self.descending = histc_max, tok_k, scatter_rows, descending
        self.n = n
        self.w1 = stacked_param(E, 2 * n if gate_up in ("fused", "halves", "halves_swapped") else n, d, orient)
        if gate_up == "separate":
            self.w3 = stacked_param(E, n, d, orient)
        self.w2 = stacked_param(E, d, n, orient)
        if combine == "shared":
            self.shared = GatedExpert(d, n)
        if count_buffer:
            self.register_buffer("tokens_per_expert", torch.zeros(E, dtype=torch.float32), persistent=False)

    def forward(self, x):
        T, d = x.shape
        scores, w, ids = self.route(x)
        if self.counts == "mask_sum":
            counts = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, ids, True).sum(dim=0)
            if self.training and hasattr(self, "tokens_per_expert"):
                with torch.no_grad():
                    self.tokens_per_expert.add_(counts)
            perm = torch.argsort(ids.view(-1), stable=True, descending=self.descending)
        elif self.sort == "sort":
            ids_sorted, perm = torch.sort(ids.view(-1), descending=self.descending)
            counts = torch.histc(ids_sorted.float(), bins=self.E, min=0, max=self.E - 1)
        else:
            counts = torch.histc(ids.view(-1).float(), bins=self.E, min=0, max=self.histc_max or self.E)
            perm = torch.argsort(ids.view(-1), stable=True, descending=self.descending)
        tok = perm // (self.tok_k or self.K)
        index = tok.reshape(-1, 1).expand(-1, d)
        rows = torch.gather(x, dim=0, index=index) if self.rows == "gather" else x[tok]
        w_sorted = w.view(-1)[perm]
        if self.score_before:
            rows = (rows.to(torch.float32) * w_sorted.reshape(-1, 1)).to(x.dtype)
        if self.offsets == "cast":
            offs = counts.cumsum(0).to(torch.int32)
        else:
            offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        B = (lambda w: w) if self.orient == "in_out" else (lambda w: w.transpose(-2, -1))  # B[e] [in, out]
        if self.experts == "for_loop":
            y = self._for_loop(rows, counts, B).type_as(x)
        elif self.gate_up == "separate" and self.casts:  # torchtitan's _run_experts_grouped_mm, bf16 casts and all
            h = F.silu(torch._grouped_mm(rows.bfloat16(), self.w1.bfloat16().transpose(-2, -1), offs=offs))
            h = h * torch._grouped_mm(rows.bfloat16(), self.w3.bfloat16().transpose(-2, -1), offs=offs)
        elif self.gate_up == "separate":
            h = F.silu(torch._grouped_mm(rows, B(self.w1), offs=offs))
            h = h * torch._grouped_mm(rows, B(self.w3), offs=offs)
        else:
            g, u = torch._grouped_mm(rows, B(self.w1), offs=offs).chunk(2, dim=-1)
            h = F.silu(g) * u
        if self.experts != "for_loop":
            w2 = self.w2.bfloat16() if self.casts else self.w2
            y = torch._grouped_mm(h, B(w2), offs=offs).type_as(x)
        if self.combine in ("unsort_einsum", "unsort_mul_sum"):
            unsorted = torch.zeros_like(y)
            unsorted[perm] = y
            slots = unsorted.view(T, self.K, d)
            if self.combine == "unsort_einsum":
                return torch.einsum("tkd,tk->td", slots, w)
            return (slots * w.unsqueeze(-1)).sum(1)
        if not self.score_before:
            y = (y.to(torch.float32) * w_sorted.reshape(-1, 1)).to(x.dtype)
        if self.scatter_rows == "perm":
            index = perm.reshape(-1, 1).expand(-1, d) % T
        if self.combine == "scatter_add_":
            out = torch.zeros_like(x)
            out.scatter_add_(0, index, y)
            return out
        if self.combine == "index_add":
            return torch.zeros_like(x).index_add(0, tok, y)
        if self.combine == "scatter_reduce":
            return torch.zeros_like(x).scatter_reduce(0, index, y, "sum", include_self=False)
        if hasattr(torch.ops.sonic_test, self.combine):
            return getattr(torch.ops.sonic_test, self.combine)(torch.zeros_like(x), index, y)
        if self.combine == "unsort":
            unsorted = torch.zeros_like(y)
            unsorted[perm] = y
            return unsorted.view(T, self.K, d).sum(1)
        base = self.shared(x) if self.combine == "shared" else torch.zeros_like(x)
        return base.scatter_add(dim=0, index=index, src=y)

    def _for_loop(self, rows, counts, B):
        sizes = counts.to(torch.int64).tolist()
        blocks = torch.split(rows[: sum(sizes)] if self.orient == "out_in" else rows, sizes, dim=0)
        outs = []
        for e, block in enumerate(blocks):
            if self.gate_up == "separate":
                h = F.silu(block @ B(self.w1[e])) * (block @ B(self.w3[e]))
            else:
                g, u = (block @ B(self.w1[e])).chunk(2, dim=-1)
                h = F.silu(g) * u
            outs.append(h @ B(self.w2[e]))
        return torch.cat(outs, dim=0)


class GroupedRowsExperts(nn.Module):
    """Experts over rows already grouped by expert, as torchtitan's and torchtune's GroupedExperts
    run after a dispatch that happened elsewhere (all-to-all, a padding wrapper): forward(rows,
    num_rows_per_expert) with three (or two) `torch._grouped_mm` over the counts' offsets, no router.

    gate_up: "separate" (w1, w3: silu(g) * u) or "fused" (w13 chunked in two)
    orient: "out_in" (torchtitan: [E, n, d], transposed in the call) or "in_out" (torchtune: [E, d, n])
    offsets: "dtype" (cumsum(counts, 0, dtype=int32)) or "cast" (counts.cumsum(0).to(int32))
    casts: fp32 parameters cast to bf16 at each call and the output cast back (torchtitan 0.2.0)
    """

    def __init__(self, d=16, n=8, E=4, gate_up="separate", orient="out_in", offsets="dtype", casts=False):
        super().__init__()
        self.gate_up, self.orient, self.offsets, self.casts = gate_up, orient, offsets, casts
        width = 2 * n if gate_up == "fused" else n

        def stacked(rows, cols):
            shape = (E, rows, cols) if orient == "out_in" else (E, cols, rows)
            return nn.Parameter(torch.randn(*shape) / cols ** 0.5)

        self.w1, self.w2 = stacked(width, d), stacked(d, n)
        self.w3 = stacked(n, d) if gate_up == "separate" else None

    def _mm(self, rows, w, offs):
        w = w.bfloat16() if self.casts else w
        return torch._grouped_mm(rows, w.transpose(-2, -1) if self.orient == "out_in" else w, offs=offs)

    def forward(self, rows, counts):
        if self.offsets == "dtype":
            offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        else:
            offs = counts.cumsum(0).to(torch.int32)
        x = rows.bfloat16() if self.casts else rows
        if self.gate_up == "separate":
            h = F.silu(self._mm(x, self.w1, offs)) * self._mm(x, self.w3, offs)
        else:
            g, u = self._mm(x, self.w1, offs).chunk(2, dim=-1)
            h = F.silu(g) * u
        out = self._mm(h, self.w2, offs)
        return out.type_as(rows)


class MembershipLoopMoE(Router):
    """A loop that finds an expert's tokens by counting or by its gate column, and reads each token's
    weight from a [T, E] gate matrix at (rows, column):

    rows:    "count" (`F.one_hot(ids, E)[:, :, e].sum(1) > 0`), "count_after" (`F.one_hot(ids,
             E).sum(1)[:, e] >= 1`), "eq_count" (`0 < (ids == e).sum(-1)`), "any" (`F.one_hot(ids,
             E)[..., e].any(-1)`), "gate" (`gates[:, e] != 0`)
    gates:   "one_hot" ((one_hot(ids) * w.unsqueeze(-1)).sum(1)), "scatter" (w scattered into
             zeros), "softmax_neg_inf" (the top-k logits scattered into -inf, then a softmax)
    weight:  "rows_column" (`gates[tok, e:e+1]`), "rows_int" (`gates[tok, e].unsqueeze(-1)`),
             "index_select" (`gates[:, e].index_select(0, tok)[:, None]`)
    experts: "gated" (nn.Linear), or "addmm" (stacked [E, d, n] parameters and biases,
             `torch.addmm(b1[e], rows, W1[e])`)
    """

    def __init__(self, d=16, n=8, E=4, K=2, rows="count", gates="one_hot", weight="rows_column", experts="gated"):
        super().__init__(d, E, K)
        self.rows, self.gates, self.weight, self.kind = rows, gates, weight, experts
        if experts == "addmm":
            self.W1, self.W2 = stacked_param(E, n, d, "in_out"), stacked_param(E, d, n, "in_out")
            self.b1, self.b2 = nn.Parameter(torch.randn(E, n) * 0.1), nn.Parameter(torch.randn(E, d) * 0.1)
        else:
            self.experts = make_experts(experts, d, n, E)

    def expert(self, e, rows):
        if self.kind == "addmm":
            return torch.addmm(self.b2[e], F.gelu(torch.addmm(self.b1[e], rows, self.W1[e])), self.W2[e])
        return self.experts[e](rows)

    def forward(self, x):
        logits = self.gate(x)
        if self.gates == "softmax_neg_inf":
            top, ids = logits.topk(self.K, dim=-1)
            gates = torch.full_like(logits, float("-inf")).scatter(-1, ids, top).softmax(dim=-1)
        else:
            _, w, ids = self.route(x)
            if self.gates == "one_hot":
                gates = (F.one_hot(ids, self.E) * w.unsqueeze(-1)).sum(dim=1)
            else:
                gates = x.new_zeros(x.shape[0], self.E).scatter(1, ids, w)
        out = torch.zeros_like(x)
        for e in range(self.E):
            if self.rows == "count":
                member = F.one_hot(ids, self.E)[:, :, e].sum(1) > 0
            elif self.rows == "count_after":
                member = F.one_hot(ids, self.E).sum(1)[:, e] >= 1
            elif self.rows == "eq_count":
                member = 0 < (ids == e).sum(-1)
            elif self.rows == "any":
                member = F.one_hot(ids, self.E)[..., e].any(-1)
            else:
                member = gates[:, e] != 0
            tok = member.nonzero().squeeze(-1)
            if self.weight == "rows_column":
                coef = gates[tok, e:e + 1]
            elif self.weight == "rows_int":
                coef = gates[tok, e].unsqueeze(-1)
            else:
                coef = gates[:, e].index_select(0, tok)[:, None]
            out = out.index_add(0, tok, self.expert(e, x[tok]) * coef)
        return out


class ScaledAfterLoopMoE(Router):
    """Top-1 routing whose loop writes each expert's raw outputs and scales the whole result by the
    router's probability after the loop: `out[m] = expert(x[m])` ... `out * p[:, None]`.

    write:  "mask" (out[ids == e] = y), "where" (out[tok] = y), "index_add_" (out.index_add_(0, tok, y)),
            "index_add" (out = out.index_add(0, tok, y))
    scale:  "view" (p.view(-1, 1)), "unsqueeze" (p.unsqueeze(-1)), "none" (p[:, None])
    """

    def __init__(self, d=16, n=8, E=4, write="mask", scale="view", experts="plain_relu"):
        super().__init__(d, E, 1)
        self.experts = make_experts(experts, d, n, E, bias=True)
        self.write, self.scale = write, scale

    def forward(self, x):
        p, ids = torch.softmax(self.gate(x), dim=-1).max(dim=-1)
        out = x.new_zeros(x.shape)
        for e in range(self.E):
            mask = ids == e
            if self.write == "mask":
                out[mask] = self.experts[e](x[mask])
                continue
            tok = torch.where(mask)[0]
            if self.write == "where":
                out[tok] = self.experts[e](x[tok])
            elif self.write == "index_add_":
                out.index_add_(0, tok, self.experts[e](x[tok]))
            else:
                out = out.index_add(0, tok, self.experts[e](x[tok]))
        column = {"view": lambda: p.view(-1, 1), "unsqueeze": lambda: p.unsqueeze(-1), "none": lambda: p[:, None]}
        return out * column[self.scale]()


class TokenMajorMoE(Router):
    """Every expert on every token computed token-major ([T, E, .]: `einsum("td,edf->tef", x, W)`),
    then weighted by a gate matrix or read at each token's top-k ids.

    gate_up: "separate" (silu(x Wg) * (x Wu), two stacked parameters), "fused" (one [E, d, 2f],
             chunked), "plain" (gelu(x W1)) or "packed" (relu(x W1)^2 with every expert's W1 packed
             in one biased `nn.Linear(d, E * f)`, its output viewed [T, E, f])
    orient:  "in_out" (W [E, in, out]: "td,edf->tef") or "out_in" (W [E, out, in]: "td,efd->tef")
    combine: "gates_einsum" (`einsum("te,ted->td", G, y)`, G the top-k weights scattered into zeros),
             "gates_product" (`(y * G[..., None]).sum(1)`), "gather_index" (`y[arange(T)[:, None], ids]`
             weighted and summed over K), "gather" (`torch.gather(y, 1, ids[..., None].expand(...))`),
             "gather_other" (the outputs read at the ids of the next token: not the op)
    view:    view the up projection's [T, E, 2f] output as [T, E * 2f] and back (a reader of the
             einsum's own contiguous layout, which the expert-major bmm's transpose lacks)
    """

    def __init__(self, d=16, n=8, E=4, K=2, gate_up="separate", orient="in_out", combine="gates_einsum", view=False):
        super().__init__(d, E, K)
        self.gate_up, self.orient, self.combine, self.view = gate_up, orient, combine, view
        up = 2 * n if gate_up == "fused" else n
        self.w1 = stacked_param(E, up, d, orient) if gate_up != "packed" else nn.Linear(d, E * n)
        self.w3 = stacked_param(E, n, d, orient) if gate_up == "separate" else None
        self.w2 = stacked_param(E, d, n, orient)

    def _product(self, a, W):
        """a [T, i] or [T, E, i] times each expert's W: [T, E, o]."""
        w = "eio" if self.orient == "in_out" else "eoi"
        return torch.einsum(f"{'ti' if a.dim() == 2 else 'tei'},{w}->teo", a, W)

    def forward(self, x):
        T = x.shape[0]
        probs, w, ids = self.route(x)
        h = self.w1(x).view(T, self.E, -1) if self.gate_up == "packed" else self._product(x, self.w1)
        if self.view:
            h = h.view(T, -1).view(T, self.E, -1)
        if self.gate_up == "separate":
            a = F.silu(h) * self._product(x, self.w3)
        elif self.gate_up == "fused":
            g, u = h.chunk(2, dim=-1)
            a = F.silu(g) * u
        elif self.gate_up == "packed":
            a = relu2(h)
        else:
            a = F.gelu(h)
        y = self._product(a, self.w2)  # [T, E, d]
        if self.combine.startswith("gates"):
            G = torch.zeros_like(probs, dtype=w.dtype).scatter(1, ids, w)
            if self.combine == "gates_einsum":
                return torch.einsum("te,ted->td", G, y)
            return (y * G[..., None]).sum(1)
        if self.combine == "gather":
            picked = torch.gather(y, 1, ids.unsqueeze(-1).expand(-1, -1, y.shape[-1]))
        else:
            rows = torch.arange(T, device=x.device)[:, None]
            picked = y[rows, ids.roll(1, 0) if self.combine == "gather_other" else ids]
        return (picked * w.unsqueeze(-1)).sum(dim=1)


class CapacityDispatchMoE(Router):
    """Switch/GShard-style dispatch through [T, E, C] one-hot slot tensors: each token's position
    among its expert's tokens (a running count over the tokens), buffers [E, C, d] filled by an
    einsum, stacked experts on the buffers, and a combine einsum weighted by the top-1 gate.

    capacity: "tokens" (C = T: no token can be dropped), "half" (C = T // 2) or a number (C itself):
              positions past C dropped by a mask, which the op honours as its kept slots
    dropped:  "zero" (a dropped token gets nothing from the experts), "passthrough" (it keeps its
              input, as transformers' Switch Transformers does: not the op), "misrouted" (the combine
              is not masked by the capacity: a dropped token reads its expert's last row, not the op)
    bias:     stacked [E, f] and [E, d] biases on the projections (an empty slot maps to them; its
              combine weight is 0); "rows": kept as [E, 1, f] and [E, 1, d] (tutel's), added as they are
    dispatch: "mask" (the one-hot slots), "positive" (GShard's `combine > 0`: the slots whose weight is
              positive, the same where gates never are negative or zero)
    gate_from: "probs" (softmax probabilities: never negative), "logits" (the raw score: a negative
              gate's token is not dispatched under "positive", so that layer is not the op)
    """

    def __init__(self, d=16, n=8, E=4, capacity="tokens", bias=True, dispatch="mask", gate_from="probs", dropped="zero"):
        super().__init__(d, E, 1)
        self.capacity, self.dispatch, self.gate_from, self.dropped = capacity, dispatch, gate_from, dropped
        self.wi = stacked_param(E, n, d, "in_out")
        self.wo = stacked_param(E, d, n, "in_out")
        rows = (1,) if bias == "rows" else ()
        self.bi = nn.Parameter(torch.randn(E, *rows, n) * 0.1) if bias else None
        self.bo = nn.Parameter(torch.randn(E, *rows, d) * 0.1) if bias else None

    def forward(self, x):
        T = x.shape[0]
        row = lambda b: b if b.dim() == 3 else b[:, None]  # noqa: E731  (each expert's bias, over its C rows)
        probs = F.softmax(self.gate(x), dim=-1)
        top = torch.argmax(probs, dim=-1)
        scores = probs if self.gate_from == "probs" else self.gate(x)
        gate = scores.gather(-1, top[:, None]).squeeze(-1)
        mask = F.one_hot(top, self.E).to(x.dtype)  # [T, E]
        C = T if self.capacity == "tokens" else T // 2 if self.capacity == "half" else self.capacity
        position = ((torch.cumsum(mask, dim=0) - 1.0) * mask).sum(-1).long()  # [T]
        kept = (position < C).to(x.dtype)
        slot = F.one_hot(position.clamp(max=C - 1), C).to(x.dtype)
        dispatch = mask[:, :, None] * (slot * kept[:, None])[:, None, :]  # [T, E, C]
        combine = (mask[:, :, None] * slot[:, None, :] if self.dropped == "misrouted" else dispatch) * gate[:, None, None]
        if self.dispatch == "positive":
            dispatch = (combine > 0).to(x.dtype)
        buffers = torch.einsum("tec,td->ecd", dispatch, x)
        h = torch.einsum("ecd,edf->ecf", buffers, self.wi)
        h = F.gelu(h + row(self.bi) if self.bi is not None else h)
        y = torch.einsum("ecf,efd->ecd", h, self.wo)
        y = y + row(self.bo) if self.bo is not None else y
        out = torch.einsum("tec,ecd->td", combine, y)
        if self.dropped == "passthrough":
            out = out + (1 - kept)[:, None] * x
        return out


class AssignedRowsSwitchMoE(nn.Module):
    """Switch Transformers' earlier layer: tokens kept as [B, S, d]; each token's argmax expert as a
    one_hot, its position among its sequence's tokens for that expert (a cumsum over S) kept up to
    the capacity; each expert's rows assigned into a buffer of zeros, `out[sel] = expert(x[sel])`,
    and the buffer scaled by the largest probability after the loop.

    capacity: positions kept (16 tokens a sequence over 4 experts: 3 drops some on these inputs)
    into:     "zeros" (a fresh buffer of zeros), "input" (x.clone(): a dropped token keeps its input,
              not the op), "shared" (zeros, also summed over d into the output: not the op)
    """

    def __init__(self, d=16, n=8, E=4, capacity=3, into="zeros"):
        super().__init__()
        self.E, self.capacity, self.into = E, capacity, into
        self.classifier = nn.Linear(d, E, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d, n, bias=False), nn.ReLU(), nn.Linear(n, d, bias=False))
                                     for _ in range(E))

    def forward(self, x):
        probs = F.softmax(self.classifier(x), dim=-1)
        chosen = F.one_hot(torch.argmax(probs, dim=-1), num_classes=self.E)  # [B, S, E]
        chosen = chosen * (torch.cumsum(chosen, dim=-2) <= self.capacity)
        scale = torch.max(probs, dim=-1).values.unsqueeze(-1)
        out = x.clone() if self.into == "input" else torch.zeros_like(x)
        for e in range(self.E):
            sel = chosen[:, :, e].bool()
            out[sel] = self.experts[e](x[sel])
        if self.into == "shared":
            return scale * out + out.sum(-1, keepdim=True)
        return scale * out


class MaskedRowsAddedMoE(nn.Module):
    """makeMoE's sparse layer (the tutorial's, in eval): a top-k of the logits scattered into -inf
    and softmaxed ([B, S, E] gates, zero off the top-k), each expert's rows picked by the flat view
    of its [B, S] hit mask, weighted by its gate column, and added in place into a buffer of zeros
    through the [B, S] mask itself; the buffer is the result.

    read:  "end" (the buffer read after the loop only), "between" (its sum read after expert 0 too,
           added to the output: an in-place combine read half-way, not the op)
    """

    def __init__(self, d=16, n=8, E=4, K=2, read="end"):
        super().__init__()
        self.E, self.K, self.read = E, K, read
        self.gate = nn.Linear(d, E)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d, n), nn.ReLU(), nn.Linear(n, d)) for _ in range(E))

    def forward(self, x):
        logits = self.gate(x)
        top, ids = logits.topk(self.K, dim=-1)
        gates = F.softmax(torch.full_like(logits, float("-inf")).scatter(-1, ids, top), dim=-1)
        out = torch.zeros_like(x)
        rows, flat_gates = x.view(-1, x.shape[-1]), gates.view(-1, self.E)
        early = 0
        for e, expert in enumerate(self.experts):
            hit = (ids == e).any(dim=-1)
            flat = hit.view(-1)
            out[hit] += expert(rows[flat]) * flat_gates[flat, e].unsqueeze(1)
            if self.read == "between" and e == 0:
                early = out.sum()
        return out + early


class CapacityTop2MoE(Router):
    """GShard's top-2 with a capacity C: each expert's first choices counted over the tokens, its
    second choices counted after all of them, slots at a position >= C dropped (nothing added);
    [E, C, d] buffers filled by a dispatch einsum, stacked SwiGLU experts, a combine einsum with
    the renormalised top-2 weights.

    masks:   "expert" (each slot's [T, E] one_hot masked by the capacity), "token" (each slot's [T]
             kept flag built from its position)
    counts:  "int" (one_hot's int64), "float" (the one_hots as floats: float counts compared with C)
    combine: "kept" (dropped slots weigh 0), "unmasked" (with masks "token", the combine weighs
             every slot: a dropped one reads its expert's last buffer row; not the op)
    """

    def __init__(self, d=16, n=8, E=4, capacity=4, masks="expert", counts="int", combine="kept"):
        super().__init__(d, E, 2)
        self.capacity, self.masks, self.counts, self.combine = capacity, masks, counts, combine
        self.w13 = stacked_param(E, 2 * n, d, "in_out")  # [E, d, 2n]
        self.w2 = stacked_param(E, d, n, "in_out")  # [E, n, d]

    def forward(self, x):
        _, w, ids = self.route(x)
        C, E = self.capacity, self.E
        first, second = F.one_hot(ids[:, 0], E), F.one_hot(ids[:, 1], E)  # [T, E] int64
        if self.counts == "float":
            first, second = first.float(), second.float()
        at_first = torch.cumsum(first, dim=0) - 1
        at_second = torch.cumsum(second, dim=0) - 1 + first.sum(0, keepdim=True)
        if self.masks == "expert":
            first, second = first * (at_first < C), second * (at_second < C)
            kept = [first.sum(1), second.sum(1)]
        else:
            kept = [((at_first * first).sum(1) < C).long(), ((at_second * second).sum(1) < C).long()]
        dispatch = combine = 0
        for mask, at, keep, k in zip((first, second), (at_first, at_second), kept, range(2)):
            position = F.one_hot((at * mask).sum(1).long().clamp(max=C - 1), C)  # [T, C]
            slots = (mask * keep[:, None])[:, :, None] * position[:, None, :]  # [T, E, C]
            dispatch = dispatch + slots.to(x.dtype)
            weighed = slots if self.combine == "kept" else mask[:, :, None] * position[:, None, :]
            combine = combine + weighed.to(x.dtype) * w[:, k, None, None]
        buffers = torch.einsum("tec,td->ecd", dispatch, x)
        g, u = torch.einsum("ecd,edf->ecf", buffers, self.w13).chunk(2, dim=-1)
        y = torch.einsum("ecf,efd->ecd", F.silu(g) * u, self.w2)
        return torch.einsum("tec,ecd->td", combine, y)


class SlotGatherMoE(Router):
    """A loop over the K routing slots, each gathering every token's expert weights (`W[ids[:, k]]`,
    [T, ., .]) into batched products, summed over the slots with the slot's weight.

    weights: "own" (slot k's weight) or "swapped" (slot k's output weighted by another slot's
             weight: not the op)
    clamp:   the gate clamped at this value before the silu (a threshold random probes may not
             cross: not an activation the op computes)
    down:    "in_out" (as the first projection), "out_in" (the down weights in the other orientation)
    """

    def __init__(self, d=16, n=8, E=4, K=2, weights="own", clamp=None, down="in_out"):
        super().__init__(d, E, K)
        self.weights, self.clamp, self.down = weights, clamp, down
        self.w13 = stacked_param(E, 2 * n, d, "in_out")  # [E, d, 2n]
        self.w2 = stacked_param(E, d, n, down)  # [E, n, d]; "out_in" (the other orientation): [E, d, n]

    def forward(self, x):
        _, w, ids = self.route(x)
        out = x.new_zeros(x.shape)
        for k in range(self.K):
            e = ids[:, k]
            g, u = torch.einsum("td,tdf->tf", x, self.w13[e]).chunk(2, dim=-1)
            g = g.clamp(max=self.clamp) if self.clamp is not None else g
            y = torch.einsum("tf,tfd->td" if self.down == "in_out" else "tf,tdf->td", F.silu(g) * u, self.w2[e])
            slot = (k + 1) % self.K if self.weights == "swapped" else k
            out = out + w[:, slot, None] * y
        return out


class CapacityListMoE(Router):
    """Capacity-limited dispatch into [E, C, d] buffers run by a ModuleList of experts (fairseq's,
    DeepSpeed's and GShard's MOELayer with Linear experts): each slot's position among its expert's
    slots (first choices counted before second ones), slots at a position >= C dropped.

    K:        1 (Switch, DeepSpeed top1gating) or 2 (GShard top-2)
    capacity: C; T or more drops nothing
    weights:  "gate_matrix" (the softmax probabilities times each slot's kept one_hot, [T, E], as
              DeepSpeed's combine weights), "columns" (one [T] weight per slot, renormalised over
              the two before any drop, as written per slot), "dense" (the probabilities unmasked:
              a dropped slot's token still weighs its expert's row at position 0: not the op)
    experts:  "chunk" (the buffers chunked along E and zipped with the experts, outputs cat),
              "index" (buffers[e] per expert, outputs stacked), "shifted" (expert e runs on expert
              e + 1's buffer: not the op)
    act:      "gelu" (Linear, GELU, Linear with biases), "swiglu" (gate, up and down Linears, no bias)
    """

    def __init__(self, d=16, n=8, E=4, K=2, capacity=4, weights="gate_matrix", experts="chunk", act="gelu"):
        super().__init__(d, E, K)
        self.capacity, self.weights, self.layout, self.act = capacity, weights, experts, act
        if act == "gelu":
            self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d, n), nn.GELU(), nn.Linear(n, d)) for _ in range(E))
        else:
            self.experts = nn.ModuleList(GatedExpert(d, n) for _ in range(E))

    def forward(self, x):
        E, C = self.E, self.capacity
        probs = F.softmax(self.gate(x), dim=-1)
        ids = probs.topk(self.K, dim=-1).indices
        masks = [F.one_hot(ids[:, k], E) for k in range(self.K)]  # [T, E] int64 per slot
        before = 0
        dispatch = combine = 0
        columns = [(probs * m).sum(-1) for m in masks]
        total = sum(columns)
        for k, mask in enumerate(masks):
            at = torch.cumsum(mask, dim=0) - 1 + before  # each token's position among its expert's slots
            before = before + mask.sum(0, keepdim=True)
            mask = mask * torch.lt(at, C)
            where = F.one_hot((at * mask).sum(-1), C).float()  # [T, C]
            slots = torch.einsum("te,tc->tec", mask.float(), where)
            dispatch = dispatch + slots
            if self.weights == "gate_matrix":
                combine = combine + torch.einsum("te,tc->tec", probs * mask.float(), where)
            elif self.weights == "columns":
                combine = combine + (columns[k] / total)[:, None, None] * slots
            else:
                combine = combine + torch.einsum("te,tc->tec", probs * masks[k].float(), where)
        buffers = torch.einsum("tec,td->ecd", dispatch.to(x.dtype), x)
        if self.layout == "chunk":
            outs = torch.cat([expert(b) for b, expert in zip(buffers.chunk(E, dim=0), self.experts)], dim=0)
        else:
            shift = 1 if self.layout == "shifted" else 0
            outs = torch.stack([self.experts[e](buffers[(e + shift) % E]) for e in range(E)])
        return torch.einsum("tec,ecd->td", combine.to(x.dtype), outs)


class SlotPriorityCapacityMoE(Router):
    """Top-k slots flattened token by token, each slot's position among its expert's slots counted
    over the flat slots (token-major priority), slots at a position >= C dropped: rows added into a
    flat [E * C + 1, d] buffer at e * C + position (a dropped slot's at the spare last row), stacked
    SwiGLU experts by bmm on the [E, C, d] view, a zero row appended for the spare, each slot's row
    read back by index_select, weighted and summed per token.

    spill: False, or True (a dropped slot's row is added into its expert's last row instead of the
           spare: the token kept there computes on a sum of two rows; not the op)
    """

    def __init__(self, d=16, n=8, E=4, K=2, capacity=4, spill=False):
        super().__init__(d, E, K)
        self.capacity, self.spill = capacity, spill
        self.w1 = stacked_param(E, n, d, "in_out")  # [E, d, n]
        self.w3 = stacked_param(E, n, d, "in_out")
        self.w2 = stacked_param(E, d, n, "in_out")  # [E, n, d]

    def forward(self, x):
        _, w, ids = self.route(x)
        E, C, K = self.E, self.capacity, self.K
        slots = ids.flatten()  # token-major: token t's K slots at t * K ...
        counts = torch.cumsum(F.one_hot(slots, E), dim=0)  # [T * K, E]
        position = counts.gather(1, slots[:, None]).squeeze(1) - 1
        kept = position < C
        spare = torch.full_like(slots, E * C)
        row = torch.where(kept, slots * C + position, (slots + 1) * C - 1 if self.spill else spare)
        rows = x.repeat_interleave(K, dim=0)
        buffer = x.new_zeros(E * C + 1, x.shape[1]).index_add(0, row, rows)
        experts_in = buffer[:E * C].view(E, C, -1)
        y = torch.bmm(F.silu(torch.bmm(experts_in, self.w1)) * torch.bmm(experts_in, self.w3), self.w2)
        y = torch.cat([y.reshape(E * C, -1), y.new_zeros(1, y.shape[-1])])
        out = y.index_select(0, row) * w.flatten()[:, None]
        return out.view(-1, K, out.shape[-1]).sum(1)


class SortedRowsGatheredMoE(Router):
    """DeepSeek-V2's `moe_infer` over gathered weights: the flat slots sorted by expert, each sorted
    slot's token `x[perm // K]` through its expert's gathered weights (einsum over `W[ids]`), the
    rows put back into `torch.empty_like` at perm, then scaled in place:
    `rows.view(T, K, -1).type(x.dtype).mul_(w.unsqueeze(-1)).sum(1)`.

    scaled: "in_place" (as above), "read_too" (the scaled rows' storage also feeds the output, so the
            write is seen twice: the in-place scale stays, and so does the layer)
    """

    def __init__(self, d=16, n=8, E=4, K=2, scaled="in_place"):
        super().__init__(d, E, K)
        self.scaled = scaled
        self.w1 = stacked_param(E, n, d, "out_in")  # [E, n, d]
        self.w3 = stacked_param(E, n, d, "out_in")
        self.w2 = stacked_param(E, d, n, "out_in")  # [E, d, n]

    def forward(self, x):
        _, w, ids = self.route(x)
        perm = ids.view(-1).argsort()
        tokens, experts = x[perm // self.K], ids.view(-1)[perm]
        g = torch.einsum("rd,rnd->rn", tokens, self.w1[experts])
        u = torch.einsum("rd,rnd->rn", tokens, self.w3[experts])
        y = torch.einsum("rn,rdn->rd", F.silu(g) * u, self.w2[experts])
        rows = torch.empty_like(y)
        rows[perm] = y
        view = rows.view(*ids.shape, -1).type(x.dtype)
        out = view.mul_(w.unsqueeze(-1)).sum(dim=1)
        return out + rows.sum(0) if self.scaled == "read_too" else out


class GroupedTokensMoE(Router):
    """Tokens kept in [G, S] groups, never flattened (Mesh-TensorFlow's and T5X's layout): a top-2
    over [G, S, E] scores, each group's positions counted over its own tokens (second choices after
    every first one), slots at a position >= C dropped, [E, G, C, d] buffers filled and read back
    by 4-D einsums, stacked GELU experts with biases.

    capacity: C per expert and group (S or more drops nothing)
    K:        2, or 1 (T5X's Switch: the argmax, weighted by the `amax` of the probabilities)
    """

    def __init__(self, d=16, n=8, E=4, capacity=1, K=2):
        super().__init__(d, E, K)
        self.capacity = capacity
        self.wi = stacked_param(E, n, d, "in_out")  # [E, d, n]
        self.wo = stacked_param(E, d, n, "in_out")  # [E, n, d]
        self.bi = nn.Parameter(torch.randn(E, n) * 0.1)
        self.bo = nn.Parameter(torch.randn(E, d) * 0.1)

    def forward(self, x):
        x = x.view(3, -1, x.shape[-1])  # [G, S, d]
        probs = F.softmax(self.gate(x), dim=-1)
        if self.K == 1:
            ids, w = probs.argmax(-1, keepdim=True), torch.amax(probs, dim=-1, keepdim=True)
        else:
            w, ids = torch.topk(probs, 2, dim=-1)
            w = w / w.sum(-1, keepdim=True)
        E, C = self.E, self.capacity
        seen = 0
        dispatch = combine = 0
        for k in range(self.K):
            mask = F.one_hot(ids[..., k], E)  # [G, S, E]
            at = torch.cumsum(mask, dim=1) - 1 + seen
            seen = seen + mask.sum(1, keepdim=True)
            mask = mask * (at < C)
            slots = mask[..., None] * F.one_hot((at * mask).sum(-1), C)[..., None, :]  # [G, S, E, C]
            dispatch = dispatch + slots.to(x.dtype)
            combine = combine + slots.to(x.dtype) * w[..., k, None, None]
        buffers = torch.einsum("gsec,gsd->egcd", dispatch, x)
        h = F.gelu(torch.einsum("egcd,edn->egcn", buffers, self.wi) + self.bi[:, None, None])
        y = torch.einsum("egcn,end->egcd", h, self.wo) + self.bo[:, None, None]
        return torch.einsum("gsec,egcd->gsd", combine, y).reshape(-1, x.shape[-1])


class EveryTokenListMoE(Router):
    """A ModuleList of experts each run on every token, expert e's output scaled by its weight
    summed over the slots (`w[:, j] * (ids[:, j] == e)`, Python's sum over j) and added up.

    combine: "slots" (as above), "next_expert" (expert e's output weighted by expert e + 1's
             weight: not the op)
    """

    def __init__(self, d=16, n=8, E=4, K=2, combine="slots"):
        super().__init__(d, E, K)
        self.combine = combine
        self.experts = nn.ModuleList(GatedExpert(d, n) for _ in range(E))

    def forward(self, x):
        _, w, ids = self.route(x)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            chosen = (e + 1) % self.E if self.combine == "next_expert" else e
            weight = sum(w[:, j] * (ids[:, j] == chosen).to(x.dtype) for j in range(self.K))
            out = out + weight[:, None] * expert(x)
        return out
