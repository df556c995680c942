"""How much MoE code the backend reaches: a folder of layers it has never seen, each compiled with
backend="sonic" on the CPU and compared with eager.

    python benchmarks/bench_heldout.py DIR              # every DIR/[a-z]NN_*.py
    python benchmarks/bench_heldout.py DIR l04 l17      # the files whose names hold these

Each file defines `IS_MOE` (True: a sparse top-k mixture a user expects rewritten; False: a
lookalike that must be left alone), `DESCRIPTION`, and `make()` returning `(module, x)` in float32
(the module's forward returns the output, or a tuple that starts with it). The held-out sets are
written by someone who does not read this project's code and are kept outside the repository, so
the code is not tuned to them. Per file: rewritten regions, the output's and the input gradient's
relative error against eager (a fixed cotangent), and the rejections' reasons. A line is
"OK"/"MISS" for an MoE layer rewritten or not, "ok"/"REWRITTEN" for a lookalike left alone or
rewritten (a rewritten lookalike equal to eager computes what the op computes after all; one that
differs is a wrong rewrite), "ERR" for a layer that fails to compile.
"""
from __future__ import annotations

import argparse
import glob
import importlib.util
import os

import torch

import moe_compiler


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _output_and_grad(fn, x):
    x = x.detach().clone().requires_grad_(True)
    y = _first(fn(x))
    cotangent = torch.linspace(-1, 1, y.numel()).view_as(y)
    return y.detach(), torch.autograd.grad((y * cotangent).sum(), x)[0]


def _error(got, want) -> float:
    return ((got - want).norm() / want.norm().clamp_min(1e-12)).item()


def check(path: str) -> str:
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    layer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(layer)
    module, x = layer.make()
    torch._dynamo.reset()
    want = _output_and_grad(module, x)
    # per-expert loops trace as one graph only with these (global settings this package never changes)
    flags = {"capture_dynamic_output_shape_ops": True, "capture_scalar_outputs": True}
    with torch._dynamo.config.patch(**flags), moe_compiler.capture() as report:
        got = _output_and_grad(torch.compile(module, backend="sonic"), x)
    n = len(report.rewritten)
    if layer.IS_MOE:
        tag = "OK" if n else "MISS"
    else:
        tag = "REWRITTEN" if n else "ok"
    reasons = "; ".join(f"{r.idiom}: {r.reason[:160]}" for r in report.rejected)
    return (f"{tag:9} {os.path.basename(path)[:-3]:40} rewritten={n} out={_error(got[0], want[0]):.1e} "
            f"grad={_error(got[1], want[1]):.1e}  {reasons[:400]}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder")
    parser.add_argument("only", nargs="*", help="run the files whose names hold one of these")
    args = parser.parse_args()
    paths = sorted(glob.glob(os.path.join(args.folder, "[a-z][0-9]*.py")))
    tags: dict[str, int] = {}
    for path in paths:
        if args.only and not any(o in os.path.basename(path) for o in args.only):
            continue
        try:
            line = check(path)
        except Exception as exc:  # noqa: BLE001 - a layer that does not compile is a result too
            line = f"{'ERR':9} {os.path.basename(path)[:-3]:40} {type(exc).__name__}: {str(exc)[:300]}"
        tags[line.split()[0]] = tags.get(line.split()[0], 0) + 1
        print(line, flush=True)
    print(" ".join(f"{tag}={count}" for tag, count in sorted(tags.items())))


if __name__ == "__main__":
    main()
