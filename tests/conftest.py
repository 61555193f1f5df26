"""Shared test set-up: deterministic torch, offline hub, tiny models built from configs in code."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(2)


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
