"""Backend plumbing: options, the entry point, Inductor's cache salt, docs that stay true."""
from __future__ import annotations

import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch

from moe_compiler.backend import inductor_patches, source_hash
from moe_compiler.options import DEFAULT_PATTERNS, SonicOptions, field_names, split_options

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_split_options():
    ours, rest = split_options({"sonic.compiler": "eager", "max_autotune": True})
    assert ours == SonicOptions(compiler="eager") and rest == {"max_autotune": True}


def test_unknown_sonic_option_lists_valid_ones():
    with pytest.raises(ValueError, match=r"unknown option\(s\) sonic.tile_size; valid sonic options: sonic.enabled"):
        split_options({"sonic.tile_size": 128})


@pytest.mark.parametrize("bad", [{"compiler": "tvm"}, {"patterns": ("nope",)}, {"debug": "yes"}])
def test_option_validation(bad):
    with pytest.raises((ValueError, TypeError)):
        SonicOptions(**bad)


def test_options_are_hashable_and_frozen():
    opts = SonicOptions(patterns=",".join(DEFAULT_PATTERNS))
    assert hash(opts) == hash(SonicOptions()) and opts.patterns == DEFAULT_PATTERNS
    with pytest.raises(Exception):
        opts.debug = True


def test_readme_documents_every_option():
    readme = (ROOT / "README.md").read_text()
    for name in field_names():
        assert f"`sonic.{name}`" in readme, f"README does not document sonic.{name}"


def test_backend_is_registered_through_the_entry_point():
    """A fresh process that never imports moe_compiler gets backend="sonic" from the entry point."""
    code = textwrap.dedent(
        """
        import sys, torch
        f = torch.compile(lambda x: torch.relu(x) + 1, backend="sonic", options={"sonic.compiler": "eager"})
        assert torch.equal(f(torch.tensor([-1.0, 2.0])), torch.tensor([1.0, 3.0]))
        assert "moe_compiler" in sys.modules  # imported lazily by Dynamo's registry, not by us
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]
    assert "sonic" in torch._dynamo.list_backends(exclude_tags=())


def test_cache_salt_tracks_sources(tmp_path, monkeypatch):
    """The Inductor cache key changes whenever one of our sources changes."""
    from moe_compiler import backend

    patch = inductor_patches({}, None)["post_grad_custom_post_pass"]
    assert source_hash() in str(patch.uuid())
    dirs = [tmp_path / pkg for pkg in ("moe_compiler", "patterns", "codegen")]
    for d in dirs:
        d.mkdir()
        (d / "a.py").write_text("x = 1\n")
    monkeypatch.setattr(backend, "_package_dirs", lambda: dirs)
    backend.source_hash.cache_clear()
    try:
        before = backend.source_hash()
        (tmp_path / "codegen" / "a.py").write_text("x = 2\n")
        backend.source_hash.cache_clear()
        assert backend.source_hash() != before
    finally:
        monkeypatch.undo()
        backend.source_hash.cache_clear()


def test_user_custom_pass_is_kept():
    calls = []

    class UserPass:
        def __call__(self, graph):
            calls.append(graph)

        def uuid(self):
            return "user-pass"

    salted = inductor_patches({"post_grad_custom_post_pass": UserPass()}, None)["post_grad_custom_post_pass"]
    graph = torch.fx.Graph()
    salted(graph)
    assert calls == [graph] and "user-pass" in str(salted.uuid())


def test_mode_goes_to_inductor():
    patches = inductor_patches({"triton.cudagraphs": False}, "max-autotune-no-cudagraphs")
    assert patches["max_autotune"] is True and patches["triton.cudagraphs"] is False
    assert inductor_patches({}, None).keys() == {"post_grad_custom_post_pass"}
