"""transformers' eager experts loop (`experts_implementation="eager"`): never rewritten, explained.

Eager code whose fragments reach the backend:

    expert_mask = one_hot(top_k_index, num_classes=E).permute(2, 1, 0)   # [E, K, T]
    expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()   # graph break here
    for expert_idx in expert_hit: ...                                     # a Python loop, per-expert graphs

The loop runs over data-dependent experts and can never be one graph (FINDINGS.md section 1), so
the expert weights never reach one graph. This finder only recognises the expert-mask fragment and
reports a rejection whose reason tells the user what to do instead, where transformers offers
something else: only Experts classes decorated with `use_experts_implementation` have other
implementations. Some families write the loop into an undecorated class (DBRX, LongCat-Flash and
Step3.7 in transformers 5.24), which has no other. The graph break usually makes the loop's
fragment a frame of its own, with no module stack to tell the class by, so the reason names both
cases.
"""
from __future__ import annotations

import torch.fx as fx

from .common import Rejection, is_call, module_path

IDIOM = "hf_eager_loop"
HINT = (
    "transformers' eager experts loop cannot be one graph (its loop over the experts hit is data-dependent); "
    "use experts_implementation='grouped_mm' (the default) or 'sonic' (after moe_compiler.register_hf_experts()). "
    "That works for Experts classes transformers decorates with use_experts_implementation; an undecorated "
    "class (DBRX, LongCat-Flash, Step3.7 in transformers 5.24) has no other implementation, and is left as it is"
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
