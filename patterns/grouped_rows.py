"""Experts over rows that arrive already grouped by expert: two or three `torch._grouped_mm` calls
over one offsets tensor, with no router in the region. This is what runs after a dispatch that
happened elsewhere: torchtitan's `GroupedExperts` behind its expert-parallel all-to-all or its
padding wrapper, torchtune's, or any code that groups its rows itself.

Eager code it matches, shapes (R rows, d hidden, n expert width, E experts):

    offs = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)   # [E], or any [E] int32
    h = F.silu(grouped_mm(x, W1.transpose(-2, -1), offs=offs)) * grouped_mm(x, W3.transpose(-2, -1), offs=offs)
    out = grouped_mm(h, W2.transpose(-2, -1), offs=offs)                    # [R, d] (or one W13, chunked)

grouped_mm runs expert e on rows offs[e-1]:offs[e] (from 0 for e = 0) and writes no row past
offs[-1]. That is the op in the slot form with one slot per row: row r's expert is the number of
offsets <= r (`searchsorted(offs, r, right=True)`), a row past the last offset is a padding slot
(its output is zeros, where grouped_mm leaves it unwritten), every weight 1 and each slot its own
token (`codegen.ops.slots_from_offsets`). The offsets are read as they are: how the rows were
counted, sorted or sent is outside the region and stays in the graph.

It runs after the idioms that see a router (`hf_grouped_mm`, `sorted_grouped_mm`): when one of them
rewrites the whole layer, its grouped_mm calls are gone; when one leaves a layer alone, the experts
inside it can still be rewritten here, the rest of the layer staying as written.
"""
from __future__ import annotations

import torch.fx as fx

from .common import (
    MoEMatch,
    NoMatch,
    RegionWalk,
    Rejection,
    arg,
    expect,
    finish_match,
    is_call,
    module_path,
    shape_of,
)
from .hf_grouped_mm import grouped_calls
from .sorted_grouped_mm import grouped_experts, grouped_input

IDIOM = "grouped_rows"


def find(gm: fx.GraphModule) -> list[MoEMatch | Rejection]:
    results = []
    for offs, calls in grouped_calls(gm).items():
        try:
            results.append(_check(offs, calls))
        except NoMatch as exc:
            results.append(Rejection(IDIOM, module_path(calls[0]), str(exc)))
    return results


def _check(offs, calls: list[fx.Node]) -> MoEMatch:
    expect(isinstance(offs, fx.Node), "grouped_mm without offsets (a batched product) is not an experts layer")
    expect(len(calls) in (2, 3), f"expected two or three grouped_mm calls sharing offsets, found {len(calls)}")
    *ups, down = calls
    expect(all(arg(c, 4, "out_dtype") is None for c in calls), "grouped_mm with an out_dtype is not matched")
    E = shape_of(offs)[0] if len(shape_of(offs) or ()) == 1 else None
    expect(isinstance(E, int), "grouped_mm offsets are not a static [E] tensor")  # int32: finish_match
    walk = RegionWalk()
    x = grouped_input(calls, walk)
    expect(len(shape_of(x)) == 2, f"the grouped rows are {shape_of(x)}, not [R, d]")
    R, d = shape_of(x)
    w1, w_up, w2, transposed, act = grouped_experts(calls, walk)
    anchor = walk.forward(down)  # casts after it stay in the graph, reading the op's output
    while is_call(anchor, "type_as"):  # a no-op one reads another tensor for its dtype: it stays too
        anchor = anchor.args[0]
    return finish_match(IDIOM, ups[0], walk, anchor, x, offs, None, w1, w2, None, None, transposed, act,
                        E=E, K=1, T=R, d=d, w_up=w_up, group_offsets=True)
