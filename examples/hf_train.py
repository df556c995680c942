"""Train a Hugging Face MoE model a few steps: eager vs Inductor vs backend="sonic", side by side.

    python examples/hf_train.py --model qwen3_moe --scale tiny              # CPU, seconds
    python examples/hf_train.py --model qwen3_moe --scale real --layers 4   # H100: real layer sizes
    python examples/hf_train.py --model olmoe --scale real --layers 2 --steps 3 --step-times

The model is built from its config class with random weights (no downloads). `--scale real` uses
the published model's hidden, expert and intermediate sizes with fewer layers so one GPU holds it.
Every provider trains a fresh copy with the same seed, data and optimizer, one after the other
(only one model is in memory at a time). Reported per provider: loss per step (and agreement with
eager), tokens/s (median step after the first), peak memory, first-step (compile) time, and with
--step-times the host ms, GPU-busy ms and wall ms of one more fwd+bwd step, launched normally
(`moe_compiler.benchmarking.step_times`), its enqueue ms (`enqueue_ms`) and its synchronizing CUDA
calls; with --host-profile a cProfile of three more (the raw stats into --out). Writes a table,
a JSON file and, when matplotlib is importable, a PNG chart into --out.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings

import torch

from moe_compiler.benchmarking import (
    add_common_args,
    comma_list,
    command_line,
    count_host_syncs,
    enqueue_ms,
    host_profile,
    print_table,
    progress_printer,
    save_figure,
    step_times,
    sync,
    write_json,
)

# published sizes (hidden, expert intermediate, experts, top-k, ...) of each family
REAL = {
    "qwen3_moe": dict(  # Qwen3-30B-A3B
        hidden_size=2048, moe_intermediate_size=768, intermediate_size=6144, num_experts=128, num_experts_per_tok=8,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
    ),
    "olmoe": dict(  # OLMoE-1B-7B
        hidden_size=2048, intermediate_size=1024, num_experts=64, num_experts_per_tok=8,
        num_attention_heads=16, num_key_value_heads=16, vocab_size=50304,
    ),
    "mixtral": dict(  # Mixtral-8x7B
        hidden_size=4096, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
    ),
    "deepseek_v3": dict(  # DeepSeek-V3 (one layer of 256 experts is 11B parameters: use --layers 1)
        hidden_size=7168, moe_intermediate_size=2048, intermediate_size=18432, n_routed_experts=256,
        num_experts_per_tok=8, n_shared_experts=1, n_group=8, topk_group=4, routed_scaling_factor=2.5,
        num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512,
        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, vocab_size=129280, first_k_dense_replace=0,
    ),
    "llama4": dict(  # Llama 4 Scout (17B active, 16 experts, top-1); transformers runs all 16 on every token
        hidden_size=5120, intermediate_size=8192, intermediate_size_mlp=16384, num_local_experts=16,
        num_experts_per_tok=1, num_attention_heads=40, num_key_value_heads=8, head_dim=128, vocab_size=202048,
    ),
    "gpt_oss": dict(  # gpt-oss-20b
        hidden_size=2880, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4,
        num_attention_heads=64, num_key_value_heads=8, head_dim=64, vocab_size=201088,
    ),
}
PROVIDERS = ("eager", "inductor", "sonic")


def build_model(name: str, scale: str, layers: int, dtype: torch.dtype, device: str, seed: int, **config):
    """The model `name` at `scale` with `layers` decoder layers; `config`: further config fields."""
    from moe_compiler.testing import tiny_moe_model

    overrides = {"num_hidden_layers": layers}
    if scale == "real":
        overrides.update(REAL[name])
    overrides.update(config)
    with torch.device(device):
        model = tiny_moe_model(name, dtype, seed=seed, **overrides)
    model.config.use_cache = False  # training: no KV cache to build every step
    return model


def make_batches(vocab: int, steps: int, batch: int, seq: int, device: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, seq), generator=g).to(device) for _ in range(steps)]


def train(provider: str, args, batches, progress) -> dict:
    torch._dynamo.reset()
    model = build_model(args.model, args.scale, args.layers, args.dtype, args.device, args.seed)
    if getattr(args, "gradient_checkpointing", False):
        model.gradient_checkpointing_enable()
    model.train()
    if provider == "inductor":
        run = torch.compile(model)
    elif provider == "sonic":
        options = {"sonic.compiler": args.sonic_compiler, "sonic.token_rounding": args.token_rounding}
        run = torch.compile(model, backend="sonic", options=options)
    else:
        run = model
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    if args.device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    losses, times = [], []
    import moe_compiler

    with moe_compiler.capture() as report:
        _train_steps(run, opt, batches, args, provider, progress, losses, times)
    if args.profile:
        profile_step(run, opt, batches[-1], provider)
    if getattr(args, "host_profile", False):
        os.makedirs(args.out, exist_ok=True)
        host_profile_step(run, opt, batches[-1], provider, args.device,
                          dump=os.path.join(args.out, f"{provider}_host.prof"))
    tokens = batches[0].numel()
    steady = times[1:] or times
    result = {
        "provider": provider,
        "losses": losses,
        "first_step_s": times[0],
        "step_ms": statistics.median(steady) * 1e3,
        "tokens_per_s": tokens / statistics.median(steady),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else float("nan"),
        "moe_regions_rewritten": len(report.rewritten),
        "graphs": report.graphs,
    }
    if getattr(args, "step_times", False):
        result.update(fwd_bwd_step_times(run, opt, batches[-1], args.device))
    del run, model, opt
    return result


STEP_COLUMNS = ("step_host_ms", "step_enqueue_ms", "step_busy_ms", "step_wall_ms", "step_syncs")


def fwd_bwd_step_times(run, opt, ids, device) -> dict:
    """Host, GPU-busy and wall ms of one more fwd+bwd step (no optimizer step), launched normally;
    its enqueue ms (started on an idle GPU, until the host returns: host ms plus any wait inside,
    the figure a distributed step has where a GPU sleep cannot run ahead of its collectives) and its
    synchronizing CUDA calls."""
    def step():
        run(ids, labels=ids).loss.backward()

    def zero():
        opt.zero_grad(set_to_none=True)

    host, busy, wall = step_times(step, zero, iters=5, warmup=1, device=device)
    enqueue = enqueue_ms(step, iters=5, warmup=1, zero=zero, device=device)
    syncs = count_host_syncs(step, device)
    zero()
    return dict(step_host_ms=host, step_enqueue_ms=enqueue, step_busy_ms=busy, step_wall_ms=wall, step_syncs=syncs)


def host_profile_step(run, opt, ids, provider: str, device, show: bool = True, dump: str | None = None) -> None:
    """Three more fwd+bwd steps under cProfile, behind a GPU sleep: where the host's time goes, by
    own time and by cumulative time, printed where `show` (every rank of a distributed run takes
    the steps; one prints them) and its raw stats written to `dump`. A sync inside a step shows as
    time in the call that waits."""
    text = host_profile(lambda: run(ids, labels=ids).loss.backward(), lambda: opt.zero_grad(set_to_none=True),
                        iters=3, rows=30, sort=("tottime", "cumulative"), device=device, dump=dump)
    opt.zero_grad(set_to_none=True)
    if show:
        print(f"\n{provider}: three fwd+bwd steps under cProfile\n{text}")


def profile_step(run, opt, ids, provider: str, rows: int = 15, show: bool = True) -> None:
    """One more step under the profiler: where the time goes, by kernel (GPU) or op (CPU), printed
    where `show` (every rank of a distributed run takes the step; one prints it)."""
    with torch.profiler.profile() as prof:
        run(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(str(ids.device.type))
    if not show:
        return
    key = "cuda_time_total" if ids.is_cuda else "cpu_time_total"
    print(f"\n{provider}: one step by {key}\n"
          + prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=70))


def _train_steps(run, opt, batches, args, provider, progress, losses, times, before_step=None):
    """One timed optimizer step per batch; `before_step(step)` (e.g. clip gradients, set the learning
    rate) runs between the backward and opt.step(), inside the timed step."""
    for step, ids in enumerate(batches):
        sync(args.device)
        start = time.perf_counter()
        loss = run(ids, labels=ids).loss
        loss.backward()
        if before_step is not None:
            before_step(step)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(args.device)
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
        progress(provider, step, loss=losses[-1])


def add_training_args(parser, *, out: str, batch_help: str) -> None:
    """The model, data and run arguments every training example shares (hf_train, fsdp_train)."""
    add_common_args(parser, out=out, seed=0, device=True)
    parser.add_argument("--model", choices=sorted(REAL), default="qwen3_moe")
    parser.add_argument("--scale", choices=("tiny", "real"), default="tiny")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=None, help=batch_help)
    parser.add_argument("--seq", type=int, default=None, help="default: 2048 real, 32 tiny")
    parser.add_argument("--providers", "--provider", type=comma_list, default=",".join(PROVIDERS),
                        help=f"comma list of {PROVIDERS}")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--sonic-compiler", default="inductor", help="sonic.compiler (aot_eager for quick CPU runs)")
    parser.add_argument("--profile", action="store_true", help="print each provider's top kernels for one more step (rank 0's)")
    parser.add_argument("--host-profile", action="store_true",
                        help="print where the host's time goes in three more fwd+bwd steps, under cProfile (rank 0's)")
    parser.add_argument("--step-times", action="store_true",
                        help="also report host ms, GPU-busy ms and wall ms of one more fwd+bwd step, launched normally")


def resolve_training_args(parser, args, *, tiny_batch: int) -> tuple[list[str], list[torch.Tensor]]:
    """Fill the scale-dependent defaults into `args`; return (providers, the batches of every step)."""
    warnings.filterwarnings("ignore", message=".*lru_cache.*")
    real = args.scale == "real"
    args.batch = args.batch or (8 if real else tiny_batch)
    args.seq = args.seq or (2048 if real else 32)
    args.dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if args.device == "cuda" else torch.float32)
    providers = args.providers
    unknown = set(providers) - set(PROVIDERS)
    if unknown:
        parser.error(f"unknown providers {sorted(unknown)}; choose from {PROVIDERS}")
    vocab = REAL[args.model]["vocab_size"] if real else 128
    return providers, make_batches(vocab, args.steps, args.batch, args.seq, args.device, args.seed)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_training_args(parser, out="hf_train", batch_help="default: 8 real, 2 tiny")
    parser.add_argument("--token-rounding", default=None, choices=("nearest", "up", "down"),
                        help="sonic.token_rounding for the sonic provider (default: plain top-k)")
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help="model.gradient_checkpointing_enable() for every provider (recompute each layer in the backward)")
    args = parser.parse_args(argv)
    providers, batches = resolve_training_args(parser, args, tiny_batch=2)
    print(f"{args.model} ({args.scale}, {args.layers} layers), {args.dtype}, {args.device}, "
          f"batch {args.batch} x seq {args.seq}, {args.steps} steps"
          + (", gradient checkpointing" if args.gradient_checkpointing else ""))
    update = progress_printer(args.steps)
    results = [train(p, args, batches, update) for p in providers]

    base = next((r for r in results if r["provider"] == "eager"), results[0])
    inductor = next((r for r in results if r["provider"] == "inductor"), None)
    for r in results:
        r["max_rel_loss_diff"] = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(r["losses"], base["losses"]))
    step_cols = list(STEP_COLUMNS) if args.step_times else []
    print_table(
        ["provider", "tokens/s", "step ms", "x eager", "x inductor", "peak GiB", "first step s",
         "MoE regions rewritten", *(c.replace("_", " ") for c in step_cols), f"max loss diff vs {base['provider']}"],
        [[r["provider"], r["tokens_per_s"], r["step_ms"], r["tokens_per_s"] / base["tokens_per_s"],
          r["tokens_per_s"] / inductor["tokens_per_s"] if inductor else None, r["peak_gib"], r["first_step_s"],
          r["moe_regions_rewritten"], *(r.get(c) for c in step_cols), r["max_rel_loss_diff"]] for r in results],
        {"tokens/s": ".0f", "step ms": ".1f", "x eager": ".2f", "x inductor": ".2f", "peak GiB": ".2f",
         "first step s": ".1f", **{c.replace("_", " "): ".2f" for c in step_cols if c != "step_syncs"},
         f"max loss diff vs {base['provider']}": ".2e"})

    stem = os.path.join(args.out, f"{args.model}_{args.scale}")
    config = {k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in vars(args).items()}
    command = command_line(argv, __file__)
    write_json(stem + ".json", {"config": config, "results": results}, command=command, device=args.device)

    def draw(axes):
        names = [r["provider"] for r in results]
        axes[0].bar(names, [r["tokens_per_s"] for r in results])
        axes[0].set_title("tokens/s (higher is better)")
        axes[1].bar(names, [r["peak_gib"] for r in results])
        axes[1].set_title("peak GiB (lower is better)")
        for r in results:
            axes[2].plot(range(1, len(r["losses"]) + 1), r["losses"], marker="o", label=r["provider"])
        axes[2].set_title("loss per step")
        axes[2].legend()

    title = f"{args.model} {args.scale}, {args.layers} layers, batch {args.batch}x{args.seq}, {args.dtype}"
    png = save_figure(stem + ".png", draw, panels=3, size=(13, 3.8), title=title)
    print(f"\nwrote {stem}.json" + (" and .png" if png else ""))
    print("reproduce:", command)
    return results


if __name__ == "__main__":
    main()
