"""Train a Hugging Face MoE model under transformers' expert-parallel plan on several GPUs:
backend="sonic" vs Inductor vs eager under the same plan, losses checked against a one-process run.

    torchrun --nproc-per-node 2 examples/ep_train.py --model qwen3_moe --scale real --layers 4   # 2 GPUs, NCCL
    torchrun --nproc-per-node 2 examples/ep_train.py --device cpu --sonic-compiler aot_eager      # CPU, gloo
    torchrun --nproc-per-node 2 examples/ep_train.py --plan data ...     # each rank its own rows (>= 5.20)

The plan is transformers' own: `from_pretrained(..., distributed_config=...)` with the expert
parallel degree equal to the world (`DistributedConfig(tp_size=N, ep_size=N)`; transformers 5.17:
`DistributedConfig(tp_size=N, enable_expert_parallel=True)`). Each rank keeps E / N experts; the
ranks share one batch (the attention is tensor-parallel over the same ranks). transformers >= 5.20
trains with its all-to-all dispatch (the routed tokens travel to their experts' rank and back) and
runs inference with the all-reduce one; 5.17 uses the all-reduce one for both (each rank runs its
experts on the whole batch, the ids of other ranks' experts marked as a sentinel, and an
all-reduce sums the ranks' outputs). Either way, under backend="sonic" every rank's experts run as
`sonic::moe_experts`, sentinel slots dropped on the device (docs/PATTERNS.md, expert parallelism).
`--plan data` (transformers >= 5.20) gives each rank its own rows instead: the dense parameters
FSDP-sharded over the ranks, every expert on one rank, the routed tokens exchanged all-to-all;
tokens/s per GPU then counts each rank's rows, and weak scaling (experts and rows per GPU held
constant) is a fair figure.

The model, its real sizes and the data are examples/hf_train.py's; rank 0 builds it with the run's
seed and saves it once into a temporary folder every rank loads the plan from. The whole model is
compiled, so transformers' mask code is traced too; with `--compile-scope layers` each decoder
layer is compiled on its own (`layer.compile(...)`, as examples/fsdp_train.py does), and the mask
code's packed-sequence check then syncs the host once a step (docs/MULTI_GPU.md); `--experts` sets the
expert count (weak scaling: experts per GPU held constant from 2 to 4 GPUs). Unless
`--no-reference`, rank 0 then replays each provider in one process (the same weights and data, no
plan) while the other ranks wait.

GPU: NCCL, one GPU per rank, `NCCL_NVLS_ENABLE=0`. CPU: gloo. Reported per provider: the loss per
step and its largest relative difference from the one-process run, tokens/s per GPU (the batch's
tokens / step time / GPUs; median step after the first, slowest rank), peak memory per GPU,
first-step (compile) time, graphs and graph breaks, MoE regions rewritten and sonic:: op calls
per step on every rank. Rank 0 prints the tables and writes a JSON file and a PNG into --out.
`--step-times` adds the host, enqueue, GPU-busy and wall ms and the syncs of one more fwd+bwd step
(the slowest rank's), `--profile` rank 0's top kernels of one more step, `--host-profile` rank 0's
cProfile of three more (and each rank's raw stats in --out); every rank takes the extra steps.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import shutil
import tempfile

import torch
import torch.distributed as dist
from fsdp_train import compile_kwargs, init_distributed, report, run_steps, summarize
from hf_train import add_training_args, build_model, resolve_training_args

from moe_compiler.benchmarking import command_line, progress_printer, save_figure, write_json


def expert_parallel_config(world: int, plan: str = "shared"):
    """transformers' expert-parallel plan over `world` ranks. "shared": the ranks share one batch
    (the attention tensor-parallel over them). "data": each rank brings its own rows (the dense
    parameters FSDP-sharded, every expert on one rank, routed tokens exchanged all-to-all;
    transformers >= 5.20)."""
    from transformers.distributed import DistributedConfig

    fields = {f.name for f in dataclasses.fields(DistributedConfig)}
    if plan == "data":
        if "ep_size" not in fields or "fsdp_size" not in fields:
            raise SystemExit("--plan data needs transformers >= 5.20 (DistributedConfig(fsdp_size=N, ep_size=N))")
        return DistributedConfig(fsdp_size=world, ep_size=world, ep_implementation="all_to_all")
    if "ep_size" in fields:
        return DistributedConfig(tp_size=world, ep_size=world)
    return DistributedConfig(tp_size=world, enable_expert_parallel=True)  # transformers 5.17


def save_model(args, rank: int) -> str:
    """Rank 0 builds the model (the run's seed) and saves it; every rank gets the folder."""
    folder = [None]
    if rank == 0:
        folder[0] = tempfile.mkdtemp(prefix="ep_train_")
        model = build_model(args.model, args.scale, args.layers, args.dtype, args.device, args.seed,
                            **({"num_experts": args.experts} if args.experts else {}))
        model.save_pretrained(folder[0])
        del model
        gc.collect()
    dist.broadcast_object_list(folder, src=0)
    return folder[0]


def prepare(provider: str, args, folder: str, world: int):
    """A fresh copy of the saved model under the expert-parallel plan (`world` > 1) or whole on this
    rank's device (the reference), each decoder layer compiled for `provider`."""
    from transformers import AutoModelForCausalLM

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    if world > 1:
        plan = expert_parallel_config(world, args.plan)
        model = AutoModelForCausalLM.from_pretrained(folder, distributed_config=plan, dtype=args.dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=args.dtype).to(args.device)
    model.config.use_cache = False
    model.train()
    kwargs = compile_kwargs(provider, args)
    if kwargs is not None and args.compile_scope == "model":
        return model, torch.compile(model, **kwargs)
    if kwargs is not None:
        for layer in model.model.layers:
            layer.compile(**kwargs)
    return model, model


def train(provider: str, args, batches, folder: str, rank: int, world: int, progress) -> dict:
    """This rank's run of one provider. Under the "shared" plan every rank trains on the whole batch,
    so a step counts the batch's tokens / GPUs for each; under "data" rank r trains on slice r of
    `world` of each batch's rows and counts those (the one-process run takes whole batches)."""
    model, run = prepare(provider, args, folder, world)
    label = f"{provider} EP x{world}" if world > 1 else f"{provider} 1-proc"
    if world > 1 and args.plan == "data":
        rows = [ids.tensor_split(world)[rank] for ids in batches]
        return run_steps(model, run, rows, args, label, progress, tokens=rows[0].numel())
    return run_steps(model, run, batches, args, label, progress, tokens=batches[0].numel() / world)


def draw_results(results: list[dict], path: str, title: str) -> bool:
    def draw(axes):
        names = [r["provider"] for r in results]
        axes[0].bar(names, [r["tokens_per_s_per_gpu"] for r in results])
        axes[0].set_title("tokens/s per GPU (higher is better)")
        axes[1].bar(names, [max(r["peak_gib"]) for r in results])
        axes[1].set_title("peak GiB per GPU (lower is better)")
        for r in results:
            steps = range(1, len(r["losses"]) + 1)
            axes[2].plot(steps, r["losses"], marker="o", label=f"{r['provider']} EP")
            if "reference_losses" in r:
                axes[2].plot(steps, r["reference_losses"], linestyle="--", label=f"{r['provider']} 1 process")
        axes[2].set_title("loss per step")
        axes[2].legend()

    return save_figure(path, draw, panels=3, size=(13, 3.8), title=title)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_training_args(parser, out="ep_train", batch_help="rows of the batch the ranks share (default: 8 real, 4 tiny)")
    parser.add_argument("--experts", type=int, default=None,
                        help="expert count, for families whose config calls it num_experts (default: the model's)")
    parser.add_argument("--no-reference", action="store_true", help="skip the one-process replay on rank 0")
    parser.add_argument("--plan", choices=("shared", "data"), default="shared",
                        help="the ranks share one batch (attention tensor-parallel), or each brings its own rows "
                             "(data parallel with all-to-all token dispatch; transformers >= 5.20)")
    parser.add_argument("--compile-scope", choices=("layers", "model"), default="model",
                        help="compile the whole model (its mask code traced), or each decoder layer (transformers' "
                             "packed-sequence check then syncs the host once a step)")
    args = parser.parse_args(argv)
    rank, world = init_distributed(args.device)  # first: on CUDA it picks this rank's GPU, where the batches go
    providers, batches = resolve_training_args(parser, args, tiny_batch=4)
    if rank == 0:
        print(f"{args.model} ({args.scale}, {args.layers} layers{f', {args.experts} experts' if args.experts else ''}), "
              f"{args.dtype}, {args.device} x{world} ({dist.get_backend()}), expert parallel x{world} "
              f"({'each rank its own rows' if args.plan == 'data' else 'the ranks share each batch'}), "
              f"batch {args.batch} x seq {args.seq}, {args.steps} steps")
    folder = save_model(args, rank)
    progress = progress_printer(args.steps) if rank == 0 else lambda *_, **__: None
    results = []
    try:  # no collective here on the way out: a rank that raised must not wait for the others
        for provider in providers:
            ranks = [None] * world
            dist.all_gather_object(ranks, train(provider, args, batches, folder, rank, world, progress))
            reference = None
            if not args.no_reference and rank == 0:
                reference = train(provider, args, batches, folder, 0, 1, progress)
            dist.barrier()
            results.append(summarize(provider, ranks, reference))
    finally:
        if rank == 0:
            shutil.rmtree(folder, ignore_errors=True)

    if rank == 0:
        report(results, args, world, label=f"EP x{world}")
        config = {k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in vars(args).items()}
        config.update(world_size=world, backend=dist.get_backend(), nccl_nvls_enable=os.environ.get("NCCL_NVLS_ENABLE"),
                      plan=repr(expert_parallel_config(world, args.plan)))
        command = command_line(argv, __file__, launcher=["torchrun", "--nproc-per-node", str(world)])
        stem = os.path.join(args.out, f"{args.model}_{args.scale}_ep{world}")
        write_json(stem + ".json", {"config": config, "results": results}, command=command, device=args.device)
        title = f"{args.model} {args.scale}, {args.layers} layers, EP x{world}, batch {args.batch}x{args.seq}, {args.dtype}"
        png = draw_results(results, stem + ".png", title)
        print(f"\nwrote {stem}.json" + (" and .png" if png else ""))
        print("reproduce:", command)
    dist.destroy_process_group()
    return results


if __name__ == "__main__":
    main()
