"""Shared test setup: the `gpu` marker skips without CUDA; hypothesis profiles for CI and local runs."""
import os

import pytest
import torch

try:
    from hypothesis import HealthCheck, settings

    settings.register_profile(
        "ci",
        deadline=None,
        derandomize=True,
        max_examples=25,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    settings.register_profile("dev", deadline=None, max_examples=50)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
except ImportError:  # hypothesis is a test extra; tests that need it import it themselves
    pass


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles its own models: transformers' shared forward wrapper would otherwise hit
    Dynamo's recompile limit (8 per code object) across tests and silently run eagerly."""
    torch._dynamo.reset()
    yield
