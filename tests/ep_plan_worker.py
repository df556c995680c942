"""Two CPU processes (gloo) running a tiny Qwen3-MoE under transformers' expert-parallel plan with
backend="sonic", against a one-process eager run of the same weights and data.

    python -m tests.ep_plan_worker OUT_DIR PORT

Writes OUT_DIR/rank{r}.json per rank: regions rewritten, `sonic::` forward calls per layer, the
max difference of the logits (inference: the all-reduce plan) and of the loss and of this rank's
expert gradients (training: the all-to-all plan) from the one-process run. Used by
tests/test_expert_parallel.py; a script of its own because the plan needs a process group per rank.
"""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

RANKS = 2
LAYERS = 2
EXPERT_PARAMS = ("gate_up_proj", "down_proj")


def _config():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                          num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                          num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1, max_position_embeddings=64,
                          norm_topk_prob=True)


def _ids():
    return torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))


def _expert_grads(model) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        if name.rsplit(".", 1)[-1] in EXPERT_PARAMS and p.grad is not None:
            grad = p.grad
            out[name.removeprefix("_orig_mod.")] = grad.to_local() if hasattr(grad, "to_local") else grad
    return out


def _reference(model_dir: str) -> dict:
    from transformers import Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(_ids()).logits
    out = model(_ids(), labels=_ids())
    out.loss.backward()
    return {"logits": logits, "loss": out.loss.detach(), "grads": _expert_grads(model)}


def _forward_calls(fn) -> int:
    """`sonic::moe_experts*` forward calls (not the backward's) while `fn` runs."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    names = [e.name for e in prof.events()]
    return sum(1 for n in names if n.startswith("sonic::moe_experts") and "backward" not in n)


def _run(rank: int, out_dir: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(RANKS),
                      LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=RANKS)
    try:
        import moe_compiler
        from transformers import Qwen3MoeForCausalLM
        from transformers.distributed import DistributedConfig

        ref = torch.load(os.path.join(out_dir, "reference.pt"))
        # one batch shared by both ranks (tp_size = ep_size): the all-reduce plan at inference,
        # the all-to-all plan in training (transformers' "auto" EP implementation)
        plan = DistributedConfig(tp_size=RANKS, ep_size=RANKS)
        model = Qwen3MoeForCausalLM.from_pretrained(os.path.join(out_dir, "model"), distributed_config=plan,
                                                    dtype=torch.float32)
        compiled = torch.compile(model, backend="sonic", options={"sonic.fallback": False})
        with torch.no_grad(), moe_compiler.capture() as report:
            logits = compiled(_ids()).logits
        with torch.no_grad():
            infer_calls = _forward_calls(lambda: compiled(_ids()))
        with moe_compiler.capture() as train_report:
            out = compiled(_ids(), labels=_ids())
            out.loss.backward()
        train_calls = _forward_calls(lambda: compiled(_ids(), labels=_ids()))
        grads = _expert_grads(model)
        local = model.model.layers[0].mlp.experts.num_experts
        grad_err = max(float((g - ref["grads"][name][rank * local:(rank + 1) * local]).abs().max())
                       for name, g in grads.items())
        result = {
            "infer_rewritten": len(report.rewritten), "infer_rejected": len(report.rejected),
            "infer_calls": infer_calls, "logits_err": float((logits - ref["logits"]).abs().max()),
            "train_rewritten": len(train_report.rewritten), "train_rejected": len(train_report.rejected),
            "train_calls": train_calls, "loss_err": float((out.loss.detach() - ref["loss"]).abs()),
            "expert_grads": len(grads), "grad_err": grad_err,
            "grad_scale": max(float(g.abs().max()) for g in ref["grads"].values()),
            "dropped": sorted({r.details["router"] for r in report.rewritten}),
        }
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


def main(out_dir: str, port: int) -> None:
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(0)
    Qwen3MoeForCausalLM(_config()).save_pretrained(os.path.join(out_dir, "model"))
    torch.save(_reference(os.path.join(out_dir, "model")), os.path.join(out_dir, "reference.pt"))
    mp.spawn(_run, args=(out_dir, port), nprocs=RANKS)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
