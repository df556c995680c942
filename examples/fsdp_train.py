"""Train a Hugging Face MoE model under FSDP2 on several GPUs: backend="sonic" vs Inductor vs eager,
with the losses checked against a single-process run on the same data.

    torchrun --nproc-per-node 2 examples/fsdp_train.py --model qwen3_moe --scale real --layers 4   # 2 GPUs, NCCL
    torchrun --nproc-per-node 2 examples/fsdp_train.py --device cpu --sonic-compiler aot_eager      # CPU, gloo

The model, its real sizes and the data are examples/hf_train.py's. The composition is the standard
FSDP2 recipe: each decoder layer is compiled on its own (`layer.compile(backend=...)`), then
`fully_shard` wraps every decoder layer and then the root; embedding, final norm, LM head and loss
run eagerly. Why per layer (torch 2.13 CPU, gloo, 2 ranks, tiny Qwen3-MoE):
- FSDP2's forward hooks are `torch._dynamo.disable`d (torch 2.13 always; older torch while
  `torch._dynamo.config.skip_fsdp_hooks` is True, its default). Compiling the whole sharded model
  breaks the graph around every layer's hooks (2 layers: 5 graphs, 2 breaks; `--compile-scope model`
  shows it, still correct). Per layer, the hooks run outside the compiled call: one graph, no break.
- Every layer runs the same code, so one compiled graph serves them all: each rank's backend
  rewrites ONE MoE region and `sonic::moe_experts` runs once per layer per step (both reported).
  That needs `use_cache=False` (set on the config here): with transformers' DynamicCache, Dynamo
  guards on `self_attn.layer_idx` and recompiles per layer, and past its recompile limit (8) the
  later layers run eagerly without a word (10 layers: 8 graphs, 8 regions rewritten).
- Sharding each experts module on its own too (`fully_shard(layer.mlp.experts)`) puts hooks
  between router and experts: 2 layers give 5 graphs and 4 breaks; the experts' own graph is still
  rewritten (its router then shows as unknown) and the losses still match.

Data: the global batch of `--batch` rows is the one hf_train draws; rank r trains on the r-th slice
of its rows. Each rank holds as many tokens as the others, so the mean of the per-rank mean losses
is the global-batch loss and FSDP's gradient average is the global-batch gradient: the per-step
losses equal a single-process run on the whole batch (fp32: up to rounding; bf16: up to bf16
noise). Unless `--no-reference`, rank 0 replays each provider in one process (same seed, same
compile, no FSDP) while the other ranks wait.

GPU: NCCL, one GPU per rank, and `NCCL_NVLS_ENABLE=0` (NVLink multicast stays off; set here with
setdefault before the process group starts, so the environment can still override it). CPU: gloo.
Without torchrun the script runs as a world of one. Reported per provider: the global loss per
step and its largest relative difference from the single-process run, tokens/s per GPU (median
step after the first, slowest rank), peak memory per GPU, first-step (compile) time, graphs and
graph breaks, MoE regions rewritten and sonic:: op calls per step on every rank. Rank 0 prints the
tables and writes a JSON file into --out.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics

import torch
import torch.distributed as dist
from hf_train import (  # the same model, data and step measurements
    STEP_COLUMNS,
    _train_steps,
    add_training_args,
    build_model,
    fwd_bwd_step_times,
    host_profile_step,
    profile_step,
    resolve_training_args,
)
from torch.distributed.fsdp import fully_shard

from moe_compiler.benchmarking import command_line, print_table, progress_printer, write_json

SONIC_OPS = ("sonic::moe_experts", "sonic::moe_experts_backward")


def init_distributed(device: str) -> tuple[int, int]:
    """(rank, world size): torchrun's environment, or a world of one without it."""
    backend = "gloo"
    if device == "cuda":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off (docstring)
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "nccl"
    if "RANK" in os.environ:
        device_id = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else None
        dist.init_process_group(backend, device_id=device_id)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size()


def compile_kwargs(provider: str, args) -> dict | None:
    if provider == "eager":
        return None
    # no fullgraph=True: a break is counted and reported (0 per layer here) rather than fatal
    return {} if provider == "inductor" else {"backend": "sonic", "options": {"sonic.compiler": args.sonic_compiler}}


def prepare(provider: str, args, shard: bool):
    """(model, callable): a fresh model (same seed), compiled for `provider`, FSDP2-sharded if `shard`."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = build_model(args.model, args.scale, args.layers, args.dtype, args.device, args.seed)
    model.config.use_cache = False  # a KV cache makes Dynamo recompile per layer (docstring)
    model.train()
    kwargs = compile_kwargs(provider, args)
    if kwargs is not None and args.compile_scope == "layers":
        for layer in model.model.layers:
            layer.compile(**kwargs)
    if shard:
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    if kwargs is not None and args.compile_scope == "model":
        return model, torch.compile(model, **kwargs)
    return model, model


def sonic_op_calls(run, model, ids) -> dict[str, int]:
    """How often each sonic:: op ran in one forward + backward (no optimizer step)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run(ids, labels=ids).loss.backward()
    model.zero_grad(set_to_none=True)
    names = [evt.name for evt in prof.events()]
    return {op: names.count(op) for op in SONIC_OPS}


def train(provider: str, args, batches, rank: int, world: int, progress, shard: bool = True) -> dict:
    """This rank's share of one provider's run: slice `rank` of `world` of each global batch's rows
    (the single-process reference: rank 0 of 1, not sharded)."""
    model, run = prepare(provider, args, shard)
    rows = [ids.tensor_split(world)[rank] for ids in batches]
    label = f"{provider} x{world}" if shard else f"{provider} 1-proc"
    return run_steps(model, run, rows, args, label, progress, tokens=rows[0].numel())


def param_groups(model) -> list[dict]:
    """The model's parameters in groups of one kind each: plain tensors, and DTensors by mesh and
    placements. The multi-tensor (foreach) optimizer step refuses a list that mixes DTensors with
    plain tensors, which transformers' expert-parallel plan leaves side by side."""
    from torch.distributed.tensor import DTensor

    groups: dict = {}
    for p in model.parameters():
        key = (id(p.device_mesh), p.placements) if isinstance(p, DTensor) else None
        groups.setdefault(key, []).append(p)
    return [{"params": params} for params in groups.values()]


def run_steps(model, run, batches, args, label: str, progress, *, tokens: float, foreach: bool | None = None) -> dict:
    """Train `model` (called through `run`) one step per batch; this rank's losses, step times,
    peak memory, graphs and breaks, MoE regions rewritten and sonic:: op calls per step. `tokens`:
    the tokens a step counts for this rank (tokens/s per GPU); `foreach`: SGD's. Drops the model
    afterwards."""
    import moe_compiler
    from moe_compiler.codegen import plans

    opt = torch.optim.SGD(param_groups(model), lr=args.lr, foreach=foreach)
    plans.forget()  # the launch plans reported below are this run's own
    if args.device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    losses, times = [], []
    with moe_compiler.capture() as report:
        _train_steps(run, opt, batches, args, label, progress, losses, times)
        calls = sonic_op_calls(run, model, batches[0])
    counters = torch._dynamo.utils.counters
    result = {
        "losses": losses,
        "step_s": times,
        "tokens": tokens,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else float("nan"),
        "graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
        "moe_regions_rewritten": len(report.rewritten),
        "sonic_op_calls": calls,
        "launch_plans": plans.describe(),
    }
    if args.step_times:  # every rank takes these steps: the collectives need them all
        result.update(fwd_bwd_step_times(run, opt, batches[-1], args.device))
    if args.profile:
        profile_step(run, opt, batches[-1], label, show=dist.get_rank() == 0)
    if args.host_profile:
        os.makedirs(args.out, exist_ok=True)
        host_profile_step(run, opt, batches[-1], label, args.device, show=dist.get_rank() == 0,
                          dump=os.path.join(args.out, f"{label.replace(' ', '_')}_rank{dist.get_rank()}_host.prof"))
    del run, model, opt
    torch._dynamo.reset()  # drop the compiled layers before the next model is built
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return result


def summarize(provider: str, ranks: list[dict], reference: dict | None) -> dict:
    """One provider's result from every rank's share: the global loss is the mean of the rank
    losses, a step lasts as long as its slowest rank."""
    steps = len(ranks[0]["losses"])
    step_s = [max(r["step_s"][i] for r in ranks) for i in range(steps)]
    steady = statistics.median(step_s[1:] or step_s)
    losses = [statistics.fmean(r["losses"][i] for r in ranks) for i in range(steps)]
    out = {
        "provider": provider,
        "losses": losses,
        "rank_losses": [r["losses"] for r in ranks],
        "first_step_s": step_s[0],
        "step_ms": steady * 1e3,
        "step_ms_each": [t * 1e3 for t in step_s],
        "tokens_per_s_per_gpu": ranks[0]["tokens"] / steady,
        "peak_gib": [r["peak_gib"] for r in ranks],
        **{key: [r[key] for r in ranks] for key in ("graphs", "graph_breaks", "moe_regions_rewritten", "sonic_op_calls",
                                                    "launch_plans")},
    }
    for key in STEP_COLUMNS:  # --step-times: the slowest rank's (the most syncs)
        if key in ranks[0]:  # None on the CPU
            out[key] = max((r[key] for r in ranks if r[key] is not None), default=None)
    if reference is not None:
        out["reference_losses"] = reference["losses"]
        out["reference_peak_gib"] = reference["peak_gib"]
        out["max_rel_loss_diff"] = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, reference["losses"]))
    return out


def report(results: list[dict], args, world: int, label: str | None = None) -> None:
    """The provider table and the per-step table (losses, and each step's ms on the slowest rank);
    `label` names the sharded runs (FSDP xN)."""
    label = label or f"FSDP x{world}"
    base = next((r for r in results if r["provider"] == "eager"), results[0])
    inductor = next((r for r in results if r["provider"] == "inductor"), None)
    step_cols = [c for c in STEP_COLUMNS if c in results[0]]
    print_table(
        ["provider", "tokens/s per GPU", "step ms", f"x {base['provider']}", "x inductor", "peak GiB per GPU",
         "first step s", "graphs / breaks", "MoE regions rewritten per rank", "sonic::moe_experts calls per step",
         "max rel loss diff vs 1 process", *(c.replace("_", " ") for c in step_cols)],
        [[r["provider"], r["tokens_per_s_per_gpu"], r["step_ms"],
          r["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"],
          r["tokens_per_s_per_gpu"] / inductor["tokens_per_s_per_gpu"] if inductor else None, max(r["peak_gib"]),
          r["first_step_s"], f"{max(r['graphs'])} / {max(r['graph_breaks'])}", str(r["moe_regions_rewritten"]),
          str([c[SONIC_OPS[0]] for c in r["sonic_op_calls"]]), r.get("max_rel_loss_diff"),
          *(r.get(c) for c in step_cols)] for r in results],
        {"tokens/s per GPU": ".0f", "step ms": ".1f", f"x {base['provider']}": ".2f", "x inductor": ".2f",
         "peak GiB per GPU": ".2f", "first step s": ".1f", "max rel loss diff vs 1 process": ".2e",
         **{c.replace("_", " "): ".2f" for c in step_cols if c != "step_syncs"}})
    names = [(r["provider"], label, r["losses"]) for r in results]
    names += [(r["provider"], "1 process", r["reference_losses"]) for r in results if "reference_losses" in r]
    times = [(f"{r['provider']} ms", r["step_ms_each"]) for r in results]  # the slowest rank's
    print_table(["step", *(f"{p} {how}" for p, how, _ in names), *(name for name, _ in times)],
                [[step, *(losses[step] for _, _, losses in names), *(ms[step] for _, ms in times)]
                 for step in range(args.steps)],
                {**{f"{p} {how}": ".6f" for p, how, _ in names}, **{name: ".1f" for name, _ in times}})
    for r in results:
        if any(r["launch_plans"]):
            print(f"{r['provider']} launch plans per rank: {r['launch_plans']}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_training_args(parser, out="fsdp_train",
                      batch_help="global rows, split across ranks (default: 8 real, 4 tiny)")
    parser.add_argument("--compile-scope", choices=("layers", "model"), default="layers",
                        help="compile each decoder layer (the recipe) or the whole sharded model")
    parser.add_argument("--no-reference", action="store_true", help="skip the single-process replay on rank 0")
    args = parser.parse_args(argv)
    providers, batches = resolve_training_args(parser, args, tiny_batch=4)

    rank, world = init_distributed(args.device)
    if args.batch % world:
        parser.error(f"--batch {args.batch} does not split evenly across {world} ranks")
    if rank == 0:
        print(f"{args.model} ({args.scale}, {args.layers} layers), {args.dtype}, {args.device} x{world} "
              f"({dist.get_backend()}), global batch {args.batch} x seq {args.seq}, {args.steps} steps, "
              f"compile scope {args.compile_scope}")
    progress = progress_printer(args.steps) if rank == 0 else lambda *_, **__: None
    results = []
    for provider in providers:
        ranks = [None] * world
        dist.all_gather_object(ranks, train(provider, args, batches, rank, world, progress))
        reference = None
        if not args.no_reference and rank == 0:
            reference = train(provider, args, batches, 0, 1, progress, shard=False)
        dist.barrier()
        results.append(summarize(provider, ranks, reference))

    if rank == 0:
        report(results, args, world)
        config = {k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in vars(args).items()}
        config.update(
            world_size=world, backend=dist.get_backend(), nccl_nvls_enable=os.environ.get("NCCL_NVLS_ENABLE"),
            skip_fsdp_hooks=getattr(torch._dynamo.config, "skip_fsdp_hooks", None),
        )
        command = command_line(argv, __file__, launcher=["torchrun", "--nproc-per-node", str(world)])
        path = write_json(os.path.join(args.out, f"{args.model}_{args.scale}_fsdp{world}.json"),
                          {"config": config, "results": results}, command=command, device=args.device)
        print(f"\nwrote {path}")
        print("reproduce:", command)
    dist.destroy_process_group()
    return results


if __name__ == "__main__":
    main()
