"""sinklab.stream.layer: the parts mutation testing found unchecked (docs/testing.md) — what a single cache layer of a
stream refuses, and what it reports to transformers."""

from __future__ import annotations

import pytest
import torch
from test_stream import _rel, _tokens, kw, model_for

from sinklab.errors import InputError
from sinklab.stream import SinkCache


@pytest.fixture
def layer_and_cache():
    model = model_for("llama-gqa")
    with torch.no_grad(), SinkCache(model, num_sinks=2, window=5) as cache:
        model(input_ids=_tokens(9, seed=51)[None], **kw(model, cache))
        yield cache.layers[0], cache


@pytest.mark.parametrize("name, call", [
    ("reorder_cache", lambda layer: layer.reorder_cache(torch.tensor([0]))),
    ("batch_repeat_interleave", lambda layer: layer.batch_repeat_interleave(2)),
    ("batch_select_indices", lambda layer: layer.batch_select_indices(torch.tensor([0]))),
    ("crop", lambda layer: layer.crop(-1)),
], ids=["reorder_cache", "batch_repeat_interleave", "batch_select_indices", "crop"])
def test_a_layer_refuses_what_changes_the_whole_stream(layer_and_cache, name, call):
    """Row and crop operations belong to the stream that all layers share: on one layer they are refused, naming the
    method to call on the cache instead, and nothing changes."""
    layer, cache = layer_and_cache
    before = {k: v.clone() for k, v in cache.state.per_row().items()}
    keys = layer.keys.clone()
    with pytest.raises(InputError) as err:
        call(layer)
    assert str(err.value) == (f"{name} changes state that all layers of a stream share: call it on the SinkCache "
                              f"(cache.{name}(...)), not on one of its layers")
    assert torch.equal(layer.keys, keys) and cache.state.columns == 9
    for k, v in cache.state.per_row().items():
        assert torch.equal(v, before[k]), k


def test_a_layer_reports_an_unbounded_stream(layer_and_cache):
    """No maximum length (transformers reads -1 as none), however many tokens were fed; a reset is refused."""
    layer, cache = layer_and_cache
    assert layer.get_max_length() == -1 and layer.get_max_cache_shape() == -1
    assert layer.get_seq_length() == cache.state.columns == 9
    # the buffers' dtype and device, as transformers' cache layers report them
    assert layer.dtype == layer.keys.dtype == torch.float32 and layer.device == layer.keys.device == torch.device("cpu")
    with pytest.raises(NotImplementedError, match=r"^a SinkCache cannot be reset; create a new SinkCache$"):
        layer.reset()


def test_mask_sizes_span_the_kept_columns_and_the_new_ones(layer_and_cache):
    """``get_mask_sizes(q)``: the last ``S + W`` columns fed (at most), then the ``q`` new ones, offset by those
    before them."""
    layer, cache = layer_and_cache
    assert layer.get_mask_sizes(1) == (7 + 1, 9 - 7)  # 2 sinks + 5 window of 9 fed
    assert layer.get_mask_sizes(3) == (7 + 3, 2)
    assert layer.get_mask_sizes(torch.tensor([0, 1])) == (7 + 1, 2)  # a cache_position tensor counts as one query


def test_mask_sizes_inside_a_compiled_forward_are_the_whole_buffer(layer_and_cache, monkeypatch):
    """Inside a compiled forward the size may not depend on the host counter (torch.compile would specialise on it):
    every slot of the buffer (sinks + window = 7) and the new queries, from offset 0."""
    layer, _ = layer_and_cache
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert layer.get_mask_sizes(1) == (7 + 1, 0) and layer.get_mask_sizes(3) == (7 + 3, 0)


def test_the_compiled_and_eager_anchor_rotations_agree(monkeypatch):
    """``_anchors_rotated`` has two branches: eagerly it keeps the anchored keys' partner dimensions between steps,
    inside a compiled forward it rotates in one expression. Both give the same keys, on a GPT-J-style interleaved
    rotary layout too (taken here by faking ``is_compiling``)."""
    for name in ("llama-gqa", "gptj-interleaved"):
        model = model_for(name) if name == "llama-gqa" else _gptj()
        with torch.no_grad(), SinkCache(model, num_sinks=3, window=4) as cache:
            model(input_ids=_tokens(12, seed=55)[None], **kw(model, cache))
            model(input_ids=_tokens(1, seed=56)[None], **kw(model, cache))  # a decode step: the view has factors
            layer, view = cache.layers[0], cache.state.view
            assert view.anchor_c is not None and layer.rope.interleaved == (name == "gptj-interleaved")
            eager = layer._anchors_rotated(view.anchor_c, view.anchor_s)
            monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
            compiled = layer._anchors_rotated(view.anchor_c, view.anchor_s)
            monkeypatch.undo()
        assert compiled.shape == eager.shape == layer.anchor_keys.shape
        assert torch.allclose(compiled, eager, rtol=0, atol=1e-6)
        assert not torch.allclose(eager, layer.anchor_keys, atol=1e-3)  # they did move


def _gptj():
    """GPT-J: interleaved pairs on a partial rotary width (as in tests/test_stream.py)."""
    import transformers as tf

    cfg = tf.GPTJConfig(vocab_size=101, n_embd=32, n_layer=1, n_head=4, rotary_dim=4, n_positions=256)
    cfg._attn_implementation = "eager"
    torch.manual_seed(2)
    return tf.GPTJForCausalLM(cfg).eval()


def test_reordered_rows_rotate_their_own_anchored_keys():
    """Two rows with different anchored tokens, swapped (``batch_select_indices``, as beam search does) after a decode
    step: the next steps equal a stream fed the rows in the swapped order — the kept partner dimensions of the old
    row order are not reused."""
    model = model_for("llama-gqa")
    ids = torch.stack([_tokens(10, seed=57), _tokens(10, seed=58)])
    nxt = torch.stack([_tokens(3, seed=59), _tokens(3, seed=60)])
    runs = []
    for swap_late in (True, False):
        with torch.no_grad(), SinkCache(model, num_sinks=3, window=4) as cache:
            first = ids if swap_late else ids.flip(0)
            model(input_ids=first, **kw(model, cache))
            model(input_ids=(nxt if swap_late else nxt.flip(0))[:, :1], **kw(model, cache))
            if swap_late:
                cache.batch_select_indices(torch.tensor([1, 0]))
            rest = nxt.flip(0)[:, 1:]
            runs.append(torch.stack([model(input_ids=rest[:, i:i + 1], **kw(model, cache)).logits[:, -1]
                                     for i in range(rest.shape[1])]))
    assert torch.allclose(runs[0], runs[1], rtol=0, atol=1e-5), (runs[0] - runs[1]).abs().max()


def test_buffers_are_marked_static_for_cuda_graphs(layer_and_cache):
    """The buffers are written in place at a fixed address: marked static for torch.compile (CUDA graphs replay over
    them), again after rows are selected (new tensors)."""
    layer, cache = layer_and_cache
    for t in (layer.keys, layer.values, layer.anchor_keys):
        assert getattr(t, "_dynamo_static_input_type", None) == "unguarded"
    layer.select_rows(torch.tensor([0, 0]))
    assert layer.keys.shape[0] == 2
    for t in (layer.keys, layer.values, layer.anchor_keys):
        assert getattr(t, "_dynamo_static_input_type", None) == "unguarded"


def test_a_closed_stream_refuses_a_write():
    model = model_for("llama-gqa")
    cache = SinkCache(model, num_sinks=2, window=5)
    with torch.no_grad():
        model(input_ids=_tokens(4, seed=61)[None], **kw(model, cache))
    cache.close()
    k = torch.zeros(1, cache.layers[0].keys.shape[1], 1, cache.layers[0].keys.shape[-1])
    with pytest.raises(InputError, match=r"^this SinkCache was closed; create a new one$"):
        cache.layers[0].update(k, k)


def test_layer_buffers_that_do_not_fit_say_so(monkeypatch):
    """The layer's own buffers (4-D: rows, heads, slots, width) failing to allocate: an InputError naming the slots
    per row, not an allocator traceback."""
    model = model_for("llama-gqa")
    zeros = torch.zeros

    def failing(*size, **kwargs):
        if len(size) == 4:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory")
        return zeros(*size, **kwargs)

    with torch.no_grad(), SinkCache(model, num_sinks=2, window=5) as cache:
        monkeypatch.setattr(torch, "zeros", failing)
        with pytest.raises(InputError, match=r"\(7 slots per row: sinks \+ pinned tokens \+ window\) do not fit"):
            model(input_ids=_tokens(4, seed=62)[None], **kw(model, cache))


def test_a_cache_saved_before_its_first_forward_holds_nothing_and_loads_as_new():
    """Before the first forward a layer's ``state_dict`` is empty (its buffers do not exist yet); such a cache's
    ``state_dict`` loaded into another leaves that one fresh: it then streams what the model computes with full
    attention (nothing evicted)."""
    model = model_for("llama-gqa")
    tokens = _tokens(6, seed=81)
    with torch.no_grad():
        dense = model(input_ids=tokens[None]).logits
        with SinkCache(model, num_sinks=2, window=8) as empty:
            assert [layer.state_dict() for layer in empty.layers] == [{}] * len(empty.layers)
            saved = empty.state_dict()
        with SinkCache(model, num_sinks=2, window=8) as cache:
            cache.load_state_dict(saved)
            assert not any(layer.is_initialized for layer in cache.layers)
            got = model(input_ids=tokens[None], **kw(model, cache)).logits
    assert _rel(got, dense) < 1e-4, _rel(got, dense)
