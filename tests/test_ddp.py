"""DistributedDataParallel + backend="sonic": one gloo process on the CPU, tiny Qwen3-MoE, fp32.

Under DDP, Dynamo's DDPOptimizer (`torch._dynamo.config.optimize_ddp`, on by default) splits the
graph at gradient-bucket boundaries and hands the backend each piece: an expert weight larger than
a bucket puts a split inside its MoE region. The backend then leaves the halves untouched and says
what to change; with the option off it gets whole graphs and rewrites every layer.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

import moe_compiler
from moe_compiler.testing import count_moe_layers, tiny_moe_model

from .helpers import assert_close_to_eager, compile_sonic, loss_and_grads


@pytest.fixture
def ddp_model(tmp_path):
    from torch.nn.parallel import DistributedDataParallel

    if not dist.is_available():
        pytest.skip("torch.distributed is not built in")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        # each expert projection [8, 2048, 64] fp32 is 4 MiB, more than the 1 MiB buckets: a split
        # falls between the up and the down projection of every layer
        model = tiny_moe_model("qwen3_moe", moe_intermediate_size=1024)
        yield model, DistributedDataParallel(model, bucket_cap_mb=1)
    finally:
        dist.destroy_process_group()


def _ids(model):
    return torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))


def _check(compiled, ddp, ids):
    eager = loss_and_grads(ddp, ids)
    with moe_compiler.capture() as report:
        got = loss_and_grads(compiled, ids)
    assert_close_to_eager(got[0], eager[0], what="logits")
    assert got[1].keys() == eager[1].keys()
    for name in eager[1]:
        assert_close_to_eager(got[1][name], eager[1][name], what=f"grad {name}")
    return report


def test_split_regions_stay_untouched_with_a_hint(ddp_model):
    model, ddp = ddp_model
    report = _check(compile_sonic(ddp), ddp, _ids(model))
    assert not report.rewritten and report.rejected, str(report)
    assert all(r.hint and "optimize_ddp = False" in r.reason for r in report.rejected), str(report)


def test_whole_graphs_are_rewritten(ddp_model):
    model, ddp = ddp_model
    with torch._dynamo.config.patch(optimize_ddp=False):
        report = _check(compile_sonic(ddp), ddp, _ids(model))
    assert len(report.rewritten) == count_moe_layers(model) and not report.rejected, str(report)
