"""A stream reaches the decoder stack under either cache keyword.

A causal LM's head hands ``past_key_values=`` down to its stack through ``**kwargs``; a stack that reads only the new
name (``cache=``, e.g. Ergo) ignored it and built a ``DynamicCache`` of its own while the stream's attention was
switched on, which ended in an ``IndexError`` inside the attention once the stream evicted. The stream now renames
the argument for such a stack (``_compat.route_cache_argument``).
"""

from __future__ import annotations

import pytest
import torch

from sinklab.stream import SinkCache
from sinklab.testing import tiny


def _stream_logits(model, keyword: str, ids: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    cache = SinkCache(model, num_sinks=4, window=8)
    rows = []
    with torch.no_grad():
        rows.append(model(ids, **{keyword: cache}).logits[:, -1])
        for t in range(steps.shape[1]):
            rows.append(model(steps[:, t:t + 1], **{keyword: cache}).logits[:, -1])
    cache.close()
    return torch.stack(rows, 1)


@pytest.mark.parametrize("prefer_full", [True, False], ids=["global-nope-layer", "sliding-rope-layer"])
def test_past_key_values_reaches_a_stack_that_reads_cache(prefer_full):
    model = tiny.build("ergo", layers=1, prefer_full=prefer_full).model
    assert "past_key_values" not in type(model.model).forward.__code__.co_varnames  # the case under test
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 100, (1, 20), generator=gen)  # past S + W = 12: the prefill already evicts
    steps = torch.randint(0, 100, (1, 12), generator=gen)
    new = _stream_logits(model, "cache", ids, steps)
    old = _stream_logits(model, "past_key_values", ids, steps)
    torch.testing.assert_close(old, new, rtol=0, atol=0)


def test_the_cache_keyword_is_routed_only_where_the_forward_lacks_it():
    from sinklab import _compat

    class TakesCache(torch.nn.Module):
        def forward(self, input_ids=None, cache=None, **kwargs):  # noqa: D401
            return None

    class TakesBoth(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, cache=None, **kwargs):
            return None

    kwargs = {"past_key_values": "c"}
    _compat.route_cache_argument(TakesCache(), kwargs)
    assert kwargs == {"cache": "c"}
    kwargs = {"past_key_values": "c"}
    _compat.route_cache_argument(TakesBoth(), kwargs)
    assert kwargs == {"past_key_values": "c"}
    kwargs = {"cache": "c"}
    _compat.route_cache_argument(TakesCache(), kwargs)
    assert kwargs == {"cache": "c"}
