"""sinklab.stream.state: the parts mutation testing found unchecked (docs/testing.md), against the float64
StreamingLLM reference of tests/stream_reference.py (RoPE re-applied at slot positions every step)."""

from __future__ import annotations

import pytest
import torch
from stream_reference import Reference
from test_stream import _left_padded_pair, _rel, _tokens, kw, model_for
from test_variants_everywhere import variant_model

from sinklab.errors import InputError
from sinklab.rope import RopeSpec
from sinklab.stream import SinkCache, StreamSession
from sinklab.stream.state import MAX_CAPACITY, StreamState


def test_chunks_after_rebases_and_chunks_longer_than_the_window_match_the_reference():
    """Prefill-style chunks (3, 9 and 4 tokens at a time) after several re-bases — their virtual positions are
    counted from the moved base — and a 9-token chunk, longer than the 5-token window, that keeps only its last 5
    free tokens: every position's logits == the float64 reference fed one token at a time."""
    model = model_for("llama-gqa")
    num_sinks, window = 2, 5
    ref = Reference(model, num_sinks, window)
    tokens = _tokens(60, seed=31)
    worst, at = 0.0, 0
    with StreamSession(model, num_sinks=num_sinks, window=window, rebase_every=7) as s:
        for size in (3, 9, 4, 3, 9, 4, 3, 9, 4, 3, 9):
            out = s.feed(tokens[None, at:at + size], all_logits=True)[0]
            for i in range(size):
                worst = max(worst, _rel(out[i], ref.step(int(tokens[at + i]))))
            at += size
        assert s.state.rebases >= 3, s.state.rebases
        assert int(s.state.base.min()) > 0  # chunks after a moved base
    assert worst < 1e-4, worst


def _stream_state(s):
    return {k: v.clone() for k, v in s.state.per_row().items()}


def test_a_saved_stream_resumes_where_it_stopped(tmp_path):
    """Saved after several re-bases and loaded into a new session: the same per-row state, the same host counters
    (``span``, which decides the next re-base, and ``rows_alike``, which picks the one-slot decode write), and the
    same logits as the stream that was never interrupted."""
    model = model_for("llama-gqa")
    tokens = _tokens(50, seed=41)
    with StreamSession(model, num_sinks=2, window=5, rebase_every=7) as whole:
        whole.feed(tokens[None, :6])
        for i in range(6, 30):
            whole.step(tokens[i:i + 1])
        saved = _stream_state(whole)
        span, alike, rebases = whole.state.span, whole.state.rows_alike, whole.state.rebases
        whole.save(tmp_path / "s.safetensors")
        after = [whole.step(tokens[i:i + 1]) for i in range(30, 50)]
    assert rebases >= 3 and alike is True
    with StreamSession.load(model, tmp_path / "s.safetensors") as resumed:
        assert resumed.state.span == span and resumed.state.rows_alike is True
        for name, value in _stream_state(resumed).items():
            assert torch.equal(value, saved[name]), name
        again = [resumed.step(tokens[i:i + 1]) for i in range(30, 50)]
    assert max(_rel(a, b) for a, b in zip(again, after, strict=True)) < 1e-6


def test_ring_keys_record_the_virtual_position_they_are_rotated_at():
    """After re-bases, each ring slot's ``s_o`` is the virtual position its key is rotated at now: the stream index
    counted from the current base (the re-base rotates the ring keys back by the shift and records it); an anchored
    slot keeps the position it arrived at."""
    model = model_for("llama-gqa")
    tokens = _tokens(40, seed=43)
    with StreamSession(model, num_sinks=2, window=5, rebase_every=7) as s:
        s.feed(tokens[None, :6])
        anchored = s.state.s_o[:, :2].clone()
        for i in range(6, 40):
            s.step(tokens[i:i + 1])
        st = s.state
        assert st.rebases >= 3 and int(st.base.min()) > 0
        ring = slice(st.anchor_capacity, st.capacity)
        want = st.start_position + st.s_sidx[:, ring] - st.base[:, None]
        assert bool(st.s_valid[:, ring].all()) and bool((st.s_o[:, ring] == want).all())
        assert bool((st.s_o[:, :2] == anchored).all())


def test_crop_on_a_batch_of_two_takes_back_anchored_and_free_tokens_per_row():
    """``SinkCache.crop(-n)`` on two rows (different tokens): each row's counters lose exactly ``n`` tokens, the
    anchored ones among them too, and decoding on equals a stream that never saw them."""
    model = model_for("llama-gqa")
    ids = torch.stack([_tokens(8, seed=45), _tokens(8, seed=46)])
    nxt = torch.stack([_tokens(4, seed=47), _tokens(4, seed=48)])
    for fed, n in ((3, 2), (8, 3)):  # inside the 4 sinks (anchored tokens go); then free ones
        runs = []
        for crop in (True, False):
            with torch.no_grad(), SinkCache(model, num_sinks=4, window=8) as c:
                if crop:
                    model(input_ids=ids[:, :fed], **kw(model, c))
                    c.crop(-n)
                else:
                    model(input_ids=ids[:, :fed - n], **kw(model, c))
                st = c.state
                held = {k: torch.where(st.s_valid, v, -1) for k, v in st.per_row().items() if k.startswith("s_")}
                runs.append((st.n_real.tolist(), st.n_anchor.tolist(), st.n_free.tolist(), st.columns, held,
                             model(input_ids=nxt, **kw(model, c)).logits))
        (real, anchor, free, columns, held, logits), ref = runs
        assert real == [fed - n] * 2 and anchor == [min(4, fed - n)] * 2 and free == [max(0, fed - n - 4)] * 2
        assert (real, anchor, free, columns) == ref[:4]
        for name, value in held.items():
            assert torch.equal(value, ref[4][name]), name
        assert _rel(logits, ref[5]) < 1e-6


def test_cache_tokens_of_a_padded_batch_is_the_fullest_row():
    """Two left-padded rows (9 and 14 real tokens) in a 20-token budget: the cache holds 14 tokens per row at most,
    not the 23 of both rows together."""
    model = model_for("llama-gqa")
    _, _, ids, mask = _left_padded_pair()
    with StreamSession(model, num_sinks=4, window=16) as s:
        s.feed(ids, mask)
        assert s.cache_tokens() == 14
        assert s.state.s_valid.sum(1).tolist() == [9, 14]


@pytest.mark.parametrize("rebase_every, window", [(7, 5), (3, 5)], ids=["keep-fewer-than-every", "every-below-keep"])
def test_rebases_happen_exactly_when_a_position_would_pass_rebase_every(rebase_every, window):
    """Decode steps past ``rebase_every``: the closed form of the re-base rule, step by step. Token ``t`` would sit at
    virtual position ``t − base``; when that passes ``rebase_every`` the base moves to ``max(t − keep, 0)`` (``keep``
    = the window) first. Each step's virtual position and the re-base count equal it."""
    model = model_for("llama-gqa")
    tokens = _tokens(30, seed=53)
    base, rebases, want, got = 0, 0, [], []
    with StreamSession(model, num_sinks=1, window=window, rebase_every=rebase_every) as s:
        s.feed(tokens[None, :1])
        for t in range(1, 30):
            if t - base > rebase_every:
                base, rebases = max(t - window, 0), rebases + 1
            want.append((t - base, rebases))
            s.step(tokens[t:t + 1])
            got.append((int(s.state.view.q_v[0, 0]), s.state.rebases))
    assert got == want


def test_a_kv_bias_row_in_a_padded_batch_equals_its_solo_stream():
    """The masked decode step (a left-padded batch) of a kv-bias variant — whose learned key has no position, so its
    score needs each query's cache-slot position from the step's view — past eviction: each row equals the same
    tokens streamed alone (the one-slot decode step)."""
    model, _ = variant_model("kv-bias", seed=1)
    model = model.float()
    a, b = _tokens(6, seed=63) % 50 + 2, _tokens(10, seed=64) % 50 + 2
    ids = torch.zeros(2, 10, dtype=torch.long)
    mask = torch.zeros(2, 10, dtype=torch.long)
    ids[0, 4:], mask[0, 4:] = a, 1
    ids[1], mask[1] = b, 1
    follow = _tokens(12, seed=65) % 50 + 2

    def run(batch, attention_mask):
        out = []
        with torch.no_grad(), SinkCache(model, num_sinks=2, window=5) as cache:
            model(input_ids=batch, attention_mask=attention_mask, cache=cache)
            m = attention_mask
            for t in follow:
                m = torch.cat([m, torch.ones(m.shape[0], 1, dtype=m.dtype)], 1)
                step = torch.full((batch.shape[0], 1), int(t))
                out.append(model(input_ids=step, attention_mask=m, cache=cache).logits[:, -1])
        return torch.stack(out, 1)

    both = run(ids, mask)
    for row, solo in ((0, a), (1, b)):
        alone = run(solo[None], torch.ones(1, len(solo), dtype=torch.long))[0]
        assert _rel(both[row], alone) < 1e-4, (row, _rel(both[row], alone))


def test_per_row_tensors_have_their_dtypes_and_empty_slots_hold_no_token():
    """The per-row state is integers (``s_valid`` booleans); a slot that holds no token has stream index -1, the
    "none" of :meth:`StreamBudget.is_anchored` — also after a chunk that leaves slots empty."""
    model = model_for("llama-gqa")
    with StreamSession(model, num_sinks=4, window=8) as s:
        s.feed(_tokens(6, seed=66)[None])
        st = s.state
        for name, value in st.per_row().items():
            assert value.dtype == (torch.bool if name == "s_valid" else torch.long), name
        assert int(st.s_valid.sum()) == 6
        assert bool((st.s_sidx[~st.s_valid] == -1).all()) and bool((st.s_sidx[st.s_valid] >= 0).all())
        assert not bool(st.is_anchored(st.s_sidx[~st.s_valid]).any())


def test_budget_counts_each_anchored_token_once_and_the_attention_rope_defaults_to_the_cache_rope():
    """Pinned spans inside the sinks add no slot, a span that runs past them adds only its tokens past them, a span
    after them adds all of its own; without its own rotation, the attention's key turns like the cached one."""
    cases = {((0, 2),): 4, ((2, 6),): 6, ((1, 3), (8, 11)): 7, (): 4}
    for pinned, anchors in cases.items():
        st = StreamState(num_sinks=4, window=5, pinned=list(pinned))
        assert (st.anchor_capacity, st.capacity) == (anchors, anchors + 5), pinned
    spec = RopeSpec(inv_freq=torch.ones(2, dtype=torch.float64))
    assert StreamState(num_sinks=2, window=5, rope=spec).attn_rope is spec


def test_rebase_interval_and_capacity_bounds():
    """The automatic re-base interval is ``max(4 · keep, 2048)`` with ``keep`` the largest window of the stream's
    budgets (a given interval is kept as is); a stream state compiles no plan unless asked; the largest buffer
    accepted is exactly ``MAX_CAPACITY`` slots per row (nothing is allocated before the first forward)."""
    model = model_for("llama-gqa")
    for window, every, want in ((8, None, 2048), (700, None, 2800), (8, 50, 50)):
        with SinkCache(model, num_sinks=2, window=window, rebase_every=every) as c:
            assert (c.state.rebase_every, c.state.rebase_keep) == (want, window)
    st = StreamState(num_sinks=4, window=1000)
    assert (st.rebase_every, st.rebase_keep, st.compile_plan) == (4000, 1000, False)
    assert StreamState(num_sinks=4, window=1000, rebase_every=50).rebase_every == 50
    assert StreamState(num_sinks=0, window=MAX_CAPACITY).capacity == MAX_CAPACITY
    with pytest.raises(InputError, match="more than any memory holds"):
        StreamState(num_sinks=1, window=MAX_CAPACITY)


def test_a_full_window_that_has_evicted_nothing_can_still_be_cropped():
    """Exactly ``S + W`` tokens fill the sinks and the window without evicting one: crop still takes tokens back, and
    the cropped stream equals one that never saw them; one token more evicts the oldest free token and crop refuses."""
    model = model_for("llama-gqa")
    tokens, other = _tokens(6, seed=71), _tokens(3, seed=72)
    with StreamSession(model, num_sinks=2, window=4) as s:
        s.feed(tokens[None])  # 2 sinks + 4 free tokens: the window is full, nothing evicted
        assert not s.state.evicted()
        s.cache.crop(-2)
        cropped = s.feed(other[None], all_logits=True)
    with StreamSession(model, num_sinks=2, window=4) as s:
        never = s.feed(torch.cat([tokens[:4], other])[None], all_logits=True)[:, 4:]
    assert _rel(cropped, never) < 1e-5
    with StreamSession(model, num_sinks=2, window=4) as s:
        s.feed(torch.cat([tokens, other[:1]])[None])
        assert s.state.evicted()
        with pytest.raises(InputError, match="already evicted tokens from its 4-token window"):
            s.cache.crop(-2)


def test_padding_columns_after_a_rows_real_tokens_write_nothing():
    """A later chunk left-padded in one row (fewer new free tokens than the window): its padding columns follow the
    row's earlier real tokens and fall on the ring slot of its newest kept one, which they must leave alone. Each
    row's logits over the next decode steps equal the same real tokens streamed alone."""
    model = model_for("llama-gqa")
    first, follow = _tokens(14, seed=73).view(2, 7), _tokens(8, seed=74).view(4, 2)
    second = _tokens(6, seed=75).view(2, 3)
    mask = torch.ones(2, 3, dtype=torch.long)
    mask[1, :2] = 0  # row 1: two padding columns, then one real token

    def run(rows, chunk, chunk_mask, steps):
        with StreamSession(model, num_sinks=2, window=4) as s:
            s.feed(rows)
            s.feed(chunk, chunk_mask)
            return torch.stack([s.step(t) for t in steps], 1)

    both = run(first, second, mask, follow)
    for row, real in ((0, second[0]), (1, second[1, 2:])):
        alone = run(first[row:row + 1], real[None], None, follow[:, row:row + 1])[0]
        assert _rel(both[row], alone) < 1e-4, (row, _rel(both[row], alone))


def test_a_scored_stream_keeps_its_rows_from_one_forward_to_the_next():
    """A score-based policy's state (rows made once, on the first forward) over forwards of 3, 2, 1 and 1 tokens that
    evict nothing: every position's logits equal the model's own full-attention forward over the whole sequence."""
    model = model_for("llama-gqa")
    tokens = _tokens(7, seed=76)
    with torch.no_grad():
        dense = model(input_ids=tokens[None]).logits[0]
        got, at = [], 0
        with SinkCache(model, num_sinks=1, window=12, policy="tova") as cache:
            for size in (3, 2, 1, 1):
                got.append(model(input_ids=tokens[None, at:at + size], **kw(model, cache)).logits[0])
                at += size
            assert cache.state.batch == 1 and cache.state.n_real.tolist() == [7]
    assert _rel(torch.cat(got), dense) < 1e-4, _rel(torch.cat(got), dense)


def test_a_loaded_state_lives_on_the_device_of_the_saved_tensors():
    """``load_state_dict`` makes the rows where the saved tensors are (the meta device standing in for an
    accelerator), moves the rotary frequencies of the cache and of the attention there once, and takes back the host
    counters."""
    model = model_for("llama-gqa")
    with StreamSession(model, num_sinks=2, window=4) as s:
        s.feed(_tokens(9, seed=77)[None])
        saved = s.state.state_dict()
        fresh = StreamState(2, 4, rope=s.state.rope)
    fresh.load_state_dict({k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in saved.items()})
    assert {v.device.type for v in fresh.per_row().values()} == {"meta"} and fresh.device.type == "meta"
    assert fresh.rope.inv_freq.device.type == "meta" and fresh.attn_rope.inv_freq is fresh.rope.inv_freq
    assert (fresh.columns, fresh.span, fresh.rebases) == (saved["columns"], saved["span"], saved["rebases"])


def test_a_stream_state_checks_what_its_constructor_is_given():
    """The state refuses what its constructor is given directly (the config checks the same before a cache builds
    one): a negative start position, a re-base interval below 1 and a reversed pinned span, each by name; an interval
    of 1 is accepted."""
    with pytest.raises(InputError, match=r"^start_position must be an integer ≥ 0, got -1$"):
        StreamState(num_sinks=2, window=4, start_position=-1)
    with pytest.raises(InputError, match=r"^rebase_every must be an integer ≥ 1 \(tokens between re-bases\) or None "
                                         r"\(automatic\), got 0$"):
        StreamState(num_sinks=2, window=4, rebase_every=0)
    with pytest.raises(InputError, match=r"^pinned span \(3, 1\) must satisfy 0 ≤ start < end \(half-open\)$"):
        StreamState(num_sinks=2, window=4, pinned=[(3, 1)])
    assert StreamState(num_sinks=2, window=4, rebase_every=1).rebase_every == 1
