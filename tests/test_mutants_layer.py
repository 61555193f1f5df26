"""sinklab.stream.layer: the parts mutation testing found unchecked (docs/testing.md) — what a single cache layer of a
stream refuses, and what it reports to transformers."""

from __future__ import annotations

import pytest
import torch
from test_stream import _tokens, kw, model_for

from sinklab.errors import InputError
from sinklab.stream import SinkCache


@pytest.fixture
def layer_and_cache():
    model = model_for("llama-gqa")
    with torch.no_grad(), SinkCache(model, num_sinks=2, window=5) as cache:
        model(input_ids=_tokens(9, seed=51)[None], **kw(model, cache))
        yield cache.layers[0], cache


@pytest.mark.parametrize("call", [
    lambda layer: layer.reorder_cache(torch.tensor([0])),
    lambda layer: layer.batch_repeat_interleave(2),
    lambda layer: layer.batch_select_indices(torch.tensor([0])),
    lambda layer: layer.crop(-1),
], ids=["reorder_cache", "batch_repeat_interleave", "batch_select_indices", "crop"])
def test_a_layer_refuses_what_changes_the_whole_stream(layer_and_cache, call):
    """Row and crop operations belong to the stream that all layers share: on one layer they are refused, naming the
    method to call on the cache instead, and nothing changes."""
    layer, cache = layer_and_cache
    before = {k: v.clone() for k, v in cache.state.per_row().items()}
    keys = layer.keys.clone()
    with pytest.raises(InputError) as err:
        call(layer)
    name = err.value.args[0].split(" ", 1)[0]
    assert f"(cache.{name}(...))" in str(err.value) and "call it on the SinkCache" in str(err.value)
    assert torch.equal(layer.keys, keys) and cache.state.columns == 9
    for k, v in cache.state.per_row().items():
        assert torch.equal(v, before[k]), k


def test_a_layer_reports_an_unbounded_stream(layer_and_cache):
    """No maximum length (transformers reads -1 as none), however many tokens were fed; a reset is refused."""
    layer, cache = layer_and_cache
    assert layer.get_max_length() == -1 and layer.get_max_cache_shape() == -1
    assert layer.get_seq_length() == cache.state.columns == 9
    with pytest.raises(NotImplementedError, match="cannot be reset; create a new SinkCache"):
        layer.reset()


def test_mask_sizes_span_the_kept_columns_and_the_new_ones(layer_and_cache):
    """``get_mask_sizes(q)``: the last ``S + W`` columns fed (at most), then the ``q`` new ones, offset by those
    before them."""
    layer, cache = layer_and_cache
    assert layer.get_mask_sizes(1) == (7 + 1, 9 - 7)  # 2 sinks + 5 window of 9 fed
    assert layer.get_mask_sizes(3) == (7 + 3, 2)
    assert layer.get_mask_sizes(torch.tensor([0, 1])) == (7 + 1, 2)  # a cache_position tensor counts as one query
