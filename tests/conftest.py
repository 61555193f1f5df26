"""Shared test set-up: deterministic torch, offline hub, tiny models built from configs in code."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# A stream told nothing decodes eagerly in the tests (and in the CLI runs they start): the default path compiles with
# inductor on a CPU, minutes with an empty compile cache. Tests of the default itself set the variable they need.
os.environ["SINKLAB_COMPILE"] = "0"

import pytest  # noqa: E402
import torch  # noqa: E402

# One process: two intra-op threads. Under pytest-xdist (`make test`): the cores shared out between the workers.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(2 if _WORKERS == 1 else max(1, (os.cpu_count() or 1) // _WORKERS))


def pytest_collection_modifyitems(config, items):
    """Tests marked ``long`` first (in their collection order): under pytest-xdist the workers take the queue from
    the front, so a long test starts early instead of running alone while the other workers have finished."""
    items.sort(key=lambda item: item.get_closest_marker("long") is None)


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of tiny-model tests: they gain nothing from a second one, and on a busy
    2-core machine two threads spin against each other (measured: docs/testing.md).
    Use with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="session")
def minilm():
    import sinklab

    return sinklab.load_model("builtin:minilm")


@pytest.fixture(scope="session")
def smollm2():
    """builtin:smollm2 (SmolLM2-135M-Instruct, dequantised Q4_1), converted once by the set-up and cached."""
    import sinklab

    loaded = sinklab.load_model("builtin:smollm2")
    loaded.model.requires_grad_(False)
    return loaded


@pytest.fixture(scope="session")
def gemma3():
    """builtin:gemma3 (Gemma 3 270M base, dequantised Q4_K_M), joined and converted once by the set-up and cached."""
    import sinklab

    loaded = sinklab.load_model("builtin:gemma3")
    loaded.model.requires_grad_(False)
    return loaded


@pytest.fixture(scope="module")
def vlm_model():
    """``vlm_model(TYPE)``: the sweep's tiny random vision-language model of that type, built once per module."""
    from sinklab.testing import vlm_conformance

    cache: dict = {}

    def get(model_type: str):
        if model_type not in cache:
            cache[model_type] = vlm_conformance.build(model_type).model
        return cache[model_type]

    return get
