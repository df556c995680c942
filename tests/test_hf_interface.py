"""experts_implementation="sonic": transformers' experts call our op directly, eager and compiled."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import moe_compiler
from moe_compiler.testing import ALL_MODELS, tiny_moe_model

from .helpers import (
    assert_close_to_eager,
    compile_sonic,
    loss_and_grads,
    profiled_op_names,
)


@pytest.fixture(autouse=True, scope="module")
def registered():
    moe_compiler.register_hf_experts()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("name", ALL_MODELS)
def test_sonic_experts_implementation(name, compiled):
    model = tiny_moe_model(name)
    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(0))
    want = loss_and_grads(model, ids)
    model.config._experts_implementation = "sonic"
    run = compile_sonic(model, compiler="aot_eager") if compiled else model
    got = loss_and_grads(run, ids)
    assert_close_to_eager(got[0], want[0], what="logits")
    for pname in want[1]:
        assert_close_to_eager(got[1][pname], want[1][pname], what=pname)
    assert any(n.startswith("sonic::moe_experts") for n in profiled_op_names(lambda: run(ids)))


def test_gpt_oss_layout_is_probed():
    model = tiny_moe_model("gpt_oss")
    model.config._experts_implementation = "sonic"
    model(torch.randint(0, 128, (1, 4)))
    spec = model.model.layers[0].mlp.experts._sonic_spec
    assert spec == {"activation": "swiglu_oai", "interleaved": True, "alpha": 1.702, "limit": 7.0, "transposed": True}
