"""Does tile-aware token rounding hurt training? A small byte-level MoE LM trained from scratch per mode.

    python examples/token_rounding_quality.py --out $OUT                     # GPU (bf16), ~5 min on an H100
    python examples/token_rounding_quality.py --device cpu --steps 5 --tiny  # smoke test, seconds

One Qwen3-MoE (random init from its config, no download) with a byte vocabulary (256) trains once
per mode with the same seed, initial weights, data order and optimizer:

    topk         torch.compile(model, backend="sonic")                                          plain top-k
    <mode>       torch.compile(model, backend="sonic", options={"sonic.token_rounding": mode})  up, down, nearest
    topk-reseed  (opt-in, --modes) top-k from another initial seed: the run-to-run noise under the target

Rounding applies to training graphs only; evaluation (model.eval() under no_grad) routes plain top-k,
so the validation loss judges every mode's weights under the same routing. It is computed by the
compiled model and, as a cross-check that evaluation is not rounded, by the eager model.
Text: the Python documentation shipped with the interpreter (`pydoc_data.topics`; the stdlib's *.py
sources when it is missing), UTF-8 bytes, the last 10% held out for validation. Batches are random
windows drawn once from a seeded generator (the same for every mode).

Reported per mode: final train loss (mean of the last 10% of steps), validation loss, both relative
to top-k, steps/s (median step after the first), first-step (compile) time, and how the backend
routed each MoE region in the training and evaluation graphs. Target: final losses within 1% of
top-k (PASS; FAIL when worse by more; BETTER when lower by more). Writes a table, a JSON file and,
when matplotlib is importable, a PNG of the loss curves into --out.

Default sizes (GPU): hidden 512, 4 layers, 64 experts, top-4, expert intermediate 256, batch 16 x
512 tokens: T*K/E = 512 rows per expert and layer, so rounding to the 128-row tile moves each
expert's count by up to a quarter.
"""
from __future__ import annotations

import argparse
import collections
import math
import pathlib
import statistics
import sysconfig
import time
import warnings

import torch
from hf_train import _train_steps  # hf_train's timed step loop

from moe_compiler.benchmarking import (
    add_common_args,
    command_line,
    comma_list,
    print_table,
    progress_printer,
    save_figure,
    write_json,
)

MODES = ("topk", "up", "down", "nearest")
# top-k again from another initial seed (same data): how far two top-k runs land apart, the noise
# floor under the 1% target. Opt-in (one more run).
RESEED = "topk-reseed"
ROUNDING = {"up", "down", "nearest"}
TARGET = 0.01  # |final loss / top-k's - 1| within this passes
# (hidden, layers, heads, kv heads, head_dim, experts, top-k, expert intermediate, batch, seq)
SIZES = {
    "default": dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                    num_experts=64, num_experts_per_tok=4, moe_intermediate_size=256, batch=16, seq=512),
    # CPU smoke: T*K/E = 6 * 128 * 2 / 8 = 192 rows per expert, between two 128-row tiles
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, batch=6, seq=128),
}


def load_text() -> tuple[bytes, str]:
    """(UTF-8 bytes, where they came from): text that ships with Python, no download."""
    try:
        from pydoc_data.topics import topics

        return "\n\n".join(topics[k] for k in sorted(topics)).encode(), "pydoc_data.topics"
    except ImportError:  # some distributions strip pydoc_data
        stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
        return "\n\n".join(p.read_text(errors="replace") for p in sorted(stdlib.glob("*.py"))).encode(), "stdlib *.py"


def make_data(size: dict, steps: int, val_batches: int, seed: int, device: str):
    """(train batches, validation batches, what the data is): each batch [batch, seq] int64 byte ids;
    validation: the first `val_batches` batches of consecutive windows of the held-out bytes."""
    data, source = load_text()
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    split = int(0.9 * tokens.numel())
    train, val = tokens[:split], tokens[split:]
    batch, seq = size["batch"], size["seq"]
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, train.numel() - seq, (steps, batch), generator=g)
    window = torch.arange(seq)
    train_batches = [train[s[:, None] + window].to(device) for s in starts]
    windows = val[: val.numel() // seq * seq].view(-1, seq)
    val = [windows[i:i + batch].to(device) for i in range(0, windows.shape[0] - batch + 1, batch)][:val_batches]
    return train_batches, val, dict(source=source, bytes=tokens.numel(), train_bytes=split,
                                            val_tokens=sum(b.numel() for b in val))


def build_model(size: dict, dtype, device: str, seed: int):
    from moe_compiler.testing import tiny_moe_model

    config = {k: v for k, v in size.items() if k not in ("batch", "seq")}
    with torch.device(device):
        return tiny_moe_model("qwen3_moe", dtype, seed=seed, vocab_size=256, max_position_embeddings=size["seq"],
                              intermediate_size=4 * size["hidden_size"], norm_topk_prob=True, use_cache=False,
                              **config)


def lr_at(step: int, steps: int, lr: float) -> float:
    """Linear warm-up over 5% of the steps, then cosine decay to 10% of lr."""
    warm = max(1, steps // 20)
    if step < warm:
        return lr * (step + 1) / warm
    progress = (step - warm) / max(1, steps - warm)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def routing_summary(report) -> dict:
    """{how the backend routed a region: count} over the rewritten regions of a capture."""
    return dict(collections.Counter(r.details.get("token_rounding", "off") for r in report.rewritten))


def evaluate(run, batches) -> float:
    with torch.no_grad():
        return statistics.fmean(run(ids, labels=ids).loss.item() for ids in batches)


def train(mode: str, args, size, batches, val_batches, progress) -> dict:
    import moe_compiler

    wall = time.perf_counter()
    torch._dynamo.reset()
    model = build_model(size, args.dtype, args.device, args.seed + (mode == RESEED))
    model.train()
    options = {"sonic.compiler": args.sonic_compiler}
    if mode in ROUNDING:
        options["sonic.token_rounding"] = mode
    run = torch.compile(model, backend="sonic", options=options)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    losses, times = [], []

    def before_step(step):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, len(batches), args.lr)

    with moe_compiler.capture() as train_report:
        _train_steps(run, opt, batches, args, mode, progress, losses, times, before_step)
    model.eval()
    with moe_compiler.capture() as eval_report:
        val_loss = evaluate(run, val_batches)
    val_loss_eager = evaluate(model, val_batches)
    tail = max(1, len(losses) // 10)
    result = {
        "mode": mode,
        "losses": losses,
        "final_train_loss": statistics.fmean(losses[-tail:]),
        "val_loss": val_loss,
        "val_loss_eager": val_loss_eager,
        "first_step_s": times[0],
        "steps_per_s": 1 / statistics.median(times[1:] or times),
        "train_routing": routing_summary(train_report),
        "eval_routing": routing_summary(eval_report),
        "wall_s": time.perf_counter() - wall,  # build, compile, train and both evaluations
    }
    if mode in ROUNDING and result["train_routing"].get(mode, 0) == 0:
        print(f"warning: no MoE region was rounded in {mode!r}'s training graphs ({result['train_routing']}): "
              f"is sonic.token_rounding wired into the backend?", flush=True)
    return result


def verdict(*rels: float) -> str:
    """FAIL: a loss worse than top-k's by more than TARGET; PASS: all within; BETTER: the rest."""
    if any(rel > TARGET for rel in rels):
        return "FAIL"
    return "PASS" if all(abs(rel) <= TARGET for rel in rels) else "BETTER"


def moving_average(values, width):
    x = torch.tensor(values, dtype=torch.float64)
    return x.unfold(0, width, 1).mean(1) if len(x) >= width else x


def plot(results, path, title) -> bool:
    """Loss curves, their difference to top-k's and the validation losses: a PNG at `path` (False
    when matplotlib does not import)."""
    width = max(1, len(results[0]["losses"]) // 25)  # per-step byte losses are noisy: moving average
    base = moving_average(results[0]["losses"], width)
    steps = range(width, width + len(base))

    def draw(axes):
        curves, diffs, bars = axes
        for r in results:
            smooth = moving_average(r["losses"], width)
            curves.plot(steps, smooth.tolist(), label=f"{r['mode']} ({r['final_train_loss']:.4f})")
            diffs.plot(steps, (100 * (smooth / base - 1)).tolist(), label=r["mode"])
        curves.set(xlabel="step", ylabel=f"train loss (moving average of {width})")
        curves.legend()
        diffs.axhspan(-100 * TARGET, 100 * TARGET, color="gray", alpha=0.15)
        diffs.set(xlabel="step", ylabel="train loss vs topk, %")
        diffs.legend()
        bars.bar([r["mode"] for r in results], [r["val_loss"] for r in results])
        for bound in (1 - TARGET, 1 + TARGET):
            bars.axhline(results[0]["val_loss"] * bound, color="gray", linestyle="--", linewidth=0.8)
        vals = [r["val_loss"] for r in results]
        bars.set_ylim(min(vals) * (0.97 - TARGET), max(vals) * (1.01 + TARGET))
        bars.set_title(f"validation (top-k routing), --: ±{TARGET:.0%}", fontsize=10)

    return save_figure(path, draw, panels=3, size=(15, 4), title=title, gridspec_kw={"width_ratios": [3, 3, 2]})


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, out="token_rounding_quality", seed=0, device=True)
    parser.add_argument("--modes", type=comma_list, default=",".join(MODES),
                        help=f"comma list of {MODES} and {RESEED!r} (noise floor); topk is the baseline")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--tiny", action="store_true", help="CPU-sized model and batch (smoke test)")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--val-batches", type=int, default=None, help="validation batches; default 8 (tiny: 2)")
    parser.add_argument("--lr", type=float, default=2e-3, help="peak AdamW learning rate")
    parser.add_argument("--sonic-compiler", default="inductor", help="sonic.compiler (aot_eager for quick CPU runs)")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message=".*lru_cache.*")
    args.dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if args.device == "cuda" else torch.float32)
    modes = list(args.modes)
    order = (*MODES, RESEED)
    if set(modes) - set(order) or "topk" not in modes:
        parser.error(f"--modes must name topk and any of {order[1:]}, got {modes}")
    modes.sort(key=order.index)
    size = SIZES["tiny" if args.tiny else "default"]

    args.val_batches = args.val_batches or (2 if args.tiny else 8)
    batches, val_batches, data = make_data(size, args.steps, args.val_batches, args.seed, args.device)
    T = size["batch"] * size["seq"]
    print(f"qwen3_moe {size['num_hidden_layers']} layers, hidden {size['hidden_size']}, E={size['num_experts']} "
          f"K={size['num_experts_per_tok']} n={size['moe_intermediate_size']}, {args.dtype}, {args.device}; "
          f"T={T} tokens/step (T*K/E = {T * size['num_experts_per_tok'] / size['num_experts']:.0f}), "
          f"{args.steps} steps; text: {data['source']} ({data['bytes']} bytes)", flush=True)
    update = progress_printer(args.steps)
    results = [train(m, args, size, batches, val_batches, update) for m in modes]

    base = results[0]
    rows = []
    for r in results:
        r["rel_train"] = r["final_train_loss"] / base["final_train_loss"] - 1
        r["rel_val"] = r["val_loss"] / base["val_loss"] - 1
        r["verdict"] = verdict(r["rel_train"], r["rel_val"])
        routing = " / ".join(", ".join(f"{how.split()[0]} x{n}" for how, n in r[key].items()) or "-"
                             for key in ("train_routing", "eval_routing"))
        rows.append([r["mode"], r["final_train_loss"], f"{r['rel_train']:+.2%}", r["val_loss"], f"{r['rel_val']:+.2%}",
                     r["val_loss_eager"], r["steps_per_s"], r["first_step_s"], r["wall_s"], routing,
                     r["verdict"] if r is not base else "baseline"])
    print_table(["mode", "final train loss", "Δ train", "val loss", "Δ val", "val (eager)", "steps/s", "first step s",
                 "wall s", "MoE regions' routing (train / eval)", f"verdict (≤{TARGET:.0%})"], rows,
                {"final train loss": ".4f", "val loss": ".4f", "val (eager)": ".4f", "steps/s": ".2f",
                 "first step s": ".1f", "wall s": ".0f"})

    out = pathlib.Path(args.out)
    config = {k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in vars(args).items()}
    command = command_line(argv, __file__)
    payload = {"config": config, "size": size, "data": data, "target": TARGET, "results": results}
    write_json(out / "token_rounding_quality.json", payload, command=command, device=args.device)
    title = (f"qwen3_moe byte LM, E={size['num_experts']} K={size['num_experts_per_tok']}, T={T}/step, "
             f"{args.steps} steps, {args.dtype}")
    png = plot(results, out / "token_rounding_quality.png", title)
    print(f"\nwrote {out / 'token_rounding_quality.json'}" + (" and .png" if png else " (no matplotlib: no PNG)"))
    print("reproduce:", command)
    return results


if __name__ == "__main__":
    main()
