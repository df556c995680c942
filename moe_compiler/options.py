"""`sonic.*` options: one frozen, hashable dataclass, validated where it is built."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

PATTERNS = ("hf_grouped_mm", "sorted_grouped_mm", "grouped_rows", "hf_batched_mm", "hf_eager_loop", "expert_loop",
            "dense_experts", "dense_bmm", "repeat_loop", "gathered_weights", "evaluated")  # every idiom the pass driver knows, in the order it runs them
# The idioms run unless `sonic.patterns` names others. `grouped_rows` (experts over rows grouped
# upstream) is opt-in: its rewrite is exact, but there the op has no gather or scatter to fuse, and
# torch's grouped GEMMs are faster (docs/PATTERNS.md, grouped rows).
DEFAULT_PATTERNS = tuple(p for p in PATTERNS if p != "grouped_rows")
COMPILERS = ("inductor", "aot_eager", "eager")
ROUNDING_MODES = ("nearest", "up", "down")  # codegen.token_rounding.MODES (kept import-free here)
PREFIX = "sonic."


@dataclasses.dataclass(frozen=True)
class SonicOptions:
    # False: run no pattern at all, plain Inductor; the A/B switch for "is the rewrite at fault?"
    enabled: bool = True
    # Which idioms to look for; a subset narrows the search when one pattern misbehaves, and
    # `PATTERNS` (every one) adds the opt-in `grouped_rows`.
    patterns: tuple[str, ...] = DEFAULT_PATTERNS
    # What compiles the rewritten graph. "eager"/"aot_eager" start in milliseconds instead of
    # Inductor's seconds: for debugging and for CPU tests of the rewrite itself.
    compiler: str = "inductor"
    # Lint the graph after every pass step; catches a broken rewrite at its source (slower).
    debug: bool = False
    # An exception inside a pattern leaves that graph untouched with a logged warning instead of
    # failing the user's step. Tests turn it off so a pattern bug fails loudly.
    fallback: bool = True
    # Tile-aware token rounding in training graphs: None (plain top-k), "nearest", "up" or "down".
    # See codegen.token_rounding and the README; evaluation graphs always route plain top-k.
    token_rounding: str | None = None
    # Replace the router in front of each rewritten MoE (softmax/sigmoid, top-k, renormalise, bias,
    # group-limited top-k, scale) with one fused `sonic::route` (codegen.router): one kernel instead
    # of ~5-20 small ops, and an analytic backward. Off: the router stays as the model wrote it.
    fuse_router: bool = True
    # In compiled backward graphs, add x's other gradient term (the router's dL @ Wr) inside the
    # experts' dX gather-sum instead of as an mm and an add (`moe_compiler.grad_fold`).
    fold_input_grad: bool = True
    # Evaluate every candidate region against the op's reference in float64 on random and adversarial
    # routings before rewriting it (`patterns.verify`); off keeps the finders' structural proof alone.
    verify: bool = True

    def __post_init__(self):
        patterns = self.patterns
        if isinstance(patterns, str):
            patterns = tuple(p.strip() for p in patterns.split(",") if p.strip())
        object.__setattr__(self, "patterns", tuple(patterns))
        unknown = [p for p in self.patterns if p not in PATTERNS]
        if unknown:
            raise ValueError(f"unknown sonic.patterns {unknown}; known: {', '.join(PATTERNS)}")
        if self.compiler not in COMPILERS:
            raise ValueError(f"sonic.compiler must be one of {COMPILERS}, got {self.compiler!r}")
        if self.token_rounding not in (None, *ROUNDING_MODES):
            raise ValueError(f"sonic.token_rounding must be None or one of {ROUNDING_MODES}, got {self.token_rounding!r}")
        for name in ("enabled", "debug", "fallback", "fuse_router", "fold_input_grad", "verify"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"sonic.{name} must be a bool, got {getattr(self, name)!r}")


def field_names() -> list[str]:
    return [f.name for f in dataclasses.fields(SonicOptions)]


def split_options(options: Mapping[str, Any] | None) -> tuple[SonicOptions, dict[str, Any]]:
    """("sonic.*" -> SonicOptions, everything else -> Inductor's config patches)."""
    ours, rest = {}, {}
    for key, value in (options or {}).items():
        if key.startswith(PREFIX):
            ours[key[len(PREFIX):]] = value
        else:
            rest[key] = value
    unknown = sorted(set(ours) - set(field_names()))
    if unknown:
        valid = ", ".join(PREFIX + n for n in field_names())
        raise ValueError(f"unknown option(s) {', '.join(PREFIX + u for u in unknown)}; valid sonic options: {valid}")
    return SonicOptions(**ours), rest
