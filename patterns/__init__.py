"""FX matchers, one module per source idiom: find -> check -> rewrite into `sonic::moe_experts`.

Nothing here launches a kernel; `patterns.common.rewrite` inserts a call of `codegen.moe_experts`.
"""
