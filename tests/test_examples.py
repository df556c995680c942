"""The examples run end to end on the CPU (tiny scale): they are what users try first."""
from __future__ import annotations

import pathlib
import sys

import pytest

pytest.importorskip("transformers")

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"
sys.path.insert(0, str(EXAMPLES))


def test_hf_train_tiny(tmp_path):
    import hf_train

    results = hf_train.main([
        "--model", "olmoe", "--scale", "tiny", "--steps", "3", "--providers", "eager,sonic",
        "--sonic-compiler", "aot_eager", "--device", "cpu", "--out", str(tmp_path),
    ])
    eager, sonic = results
    assert sonic["moe_regions_rewritten"] == 2 and eager["moe_regions_rewritten"] == 0
    assert sonic["max_rel_loss_diff"] <= 1e-5
    assert (tmp_path / "olmoe_tiny.json").exists()


@pytest.mark.parametrize("cache,dtype", [("dynamic", "float32"), ("static", "float32"), ("dynamic", "bfloat16")])
def test_hf_generate_tiny(cache, dtype, capsys):
    """float32: eager's tokens; bfloat16: the teacher-forced logits as close to float32 as eager's."""
    import hf_generate

    assert hf_generate.main(["--model", "mixtral", "--new-tokens", "6", "--device", "cpu", "--sonic-compiler", "aot_eager",
                             "--cache", cache, "--repeats", "1", "--dtype", dtype]) == 0
    assert ("teacher-forced logits" in capsys.readouterr().out) == (dtype == "bfloat16")


def test_sweep_hf_families_runs(capsys):
    """The family sweep end to end on one family it must rewrite, fuse and match eager on."""
    sys.path.insert(0, str(EXAMPLES.parent / "scripts"))
    import sweep_hf_families

    assert sweep_hf_families.main(["mixtral"]) == 0
    out = capsys.readouterr().out
    assert "mixtral" in out and "equal" in out and "rewritten 2" in out and "fused (MixtralExperts)" in out, out


def test_sweep_rewrites_deepseek_v4_clamped_swiglu():
    """DeepSeek-V4's experts (silu(min(g, limit)) * clamp(u, +-limit)) are named swiglu_clamp and
    rewritten, one hash-routed and one top-k layer, loss and every gradient equal to eager."""
    sys.path.insert(0, str(EXAMPLES.parent / "scripts"))
    import sweep_hf_families

    result = sweep_hf_families.run("deepseek_v4")
    assert result["status"] == "equal" and result["rewritten"] == 2, result
