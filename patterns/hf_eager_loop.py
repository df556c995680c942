"""transformers' eager experts loop (`experts_implementation="eager"`): never rewritten, explained.

Eager code whose fragments reach the backend:

    expert_mask = one_hot(top_k_index, num_classes=E).permute(2, 1, 0)   # [E, K, T]
    expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()   # graph break here
    for expert_idx in expert_hit: ...                                     # a Python loop, per-expert graphs

The loop runs over data-dependent experts and can never be one graph (FINDINGS.md section 1), so
the expert weights never reach one graph. This finder only recognises the expert-mask fragment and
reports a rejection whose reason tells the user what to do instead.
"""
from __future__ import annotations

import torch.fx as fx

from .common import Rejection, is_call, module_path

IDIOM = "hf_eager_loop"
HINT = (
    "transformers' eager experts loop cannot be one graph (its loop over the experts hit is data-dependent); "
    "use experts_implementation='grouped_mm' (the default) or 'sonic' (after moe_compiler.register_hf_experts())"
)


def find(gm: fx.GraphModule) -> list[Rejection]:
    found = []
    for node in gm.graph.nodes:
        if not is_call(node, "one_hot"):
            continue
        permuted = [u for u in node.users if is_call(u, "permute")]
        reduced = [u for p in permuted for u in p.users if is_call(u, "sum")]
        if any(is_call(u, "greater", "gt", "__gt__") for r in reduced for u in r.users):
            found.append(Rejection(IDIOM, module_path(node), HINT, hint=True))
    return found
