"""Long-run proof: ≥ 400 steps with a small ``rebase_every`` (8), so positions are re-based dozens of times,
against the independent float64 reference (tests/stream_reference.py) — batch 1 on the one-token fast
path, a left-padded batch whose rows re-base at different steps (and equal their solo runs), pinned spans
with the kv-bias and gated variants, and a model with its own sliding window."""

from __future__ import annotations

import pytest
import torch

from sinklab.stream import StreamSession
from sinklab.variants import apply_variant

from stream_reference import Reference
from tiny_models import V, build
from variant_reference import tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS, REBASE = 420, 8


def _tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(2, V, (n,), generator=torch.Generator().manual_seed(seed))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def _reference(model, sinks: int, window: int, tokens: torch.Tensor, pinned=()) -> torch.Tensor:
    ref = Reference(model, sinks, window, pinned)
    return torch.stack([ref.step(int(t)) for t in tokens])


def test_batch_of_one_rebases_every_8_steps_and_matches_the_reference():
    """The one-token fast path (uniform rows): 420 decode steps, ≈ 50 re-bases."""
    model = build("llama-gqa")
    tokens = _tokens(STEPS, seed=21)
    with StreamSession(model, num_sinks=4, window=6, rebase_every=REBASE) as s:
        ours = [s.feed(tokens[None, :10], all_logits=True)[0]]
        ours += [s.step(tokens[i:i + 1]) for i in range(10, STEPS)]
        base = int(s.state.base[0])
        assert s.cache_tokens() == 10
    assert base >= STEPS - 6 - REBASE  # re-based all along: the newest window always sits at small positions
    ours = torch.cat(ours)
    theirs = _reference(model, 4, 6, tokens)
    assert _rel(ours, theirs) < 1e-4
    assert float((ours[10:] - theirs[10:]).abs().max()) < 1e-4


def test_left_padded_batch_rebases_per_row_and_each_row_equals_its_solo_run():
    """Rows of different lengths re-base at different steps; each row == the reference and its solo run."""
    model = build("qwen2")
    a, b = _tokens(STEPS - 7, seed=22), _tokens(STEPS, seed=23)
    ids = torch.zeros(2, 12, dtype=torch.long)
    mask = torch.zeros(2, 12, dtype=torch.long)
    ids[0, 7:], mask[0, 7:] = a[:5], 1
    ids[1], mask[1] = b[:12], 1
    follow = torch.stack([a[5:], b[12:]], 1)  # (STEPS − 12, 2)
    with StreamSession(model, num_sinks=2, window=5, rebase_every=REBASE) as s:
        first = s.feed(ids, mask, all_logits=True)
        steps = [s.step(follow[i]) for i in range(follow.shape[0])]
        bases = s.state.base.tolist()
    assert bases[0] != bases[1] and min(bases) > 300  # each row re-based on its own count
    for row, (prompt, pad) in enumerate(((a, 7), (b, 0))):
        ours = torch.cat([first[row, pad:], torch.stack([x[row] for x in steps])])
        assert _rel(ours, _reference(model, 2, 5, prompt)) < 1e-4
        with StreamSession(model, num_sinks=2, window=5, rebase_every=REBASE, chunk_size=16) as solo:
            alone = solo.feed(prompt[None], all_logits=True)[0]
        assert _rel(ours, alone) < 1e-5


def test_pinned_spans_with_kv_bias_and_gate_over_a_long_chunked_stream():
    """kv-bias slot + output gate + two pinned spans, fed in chunks of 7 (re-bases inside chunks)."""
    model = tiny_llama(layers=2)
    model.config.max_position_embeddings = 256
    apply_variant(model, "kv-bias+gated")
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():  # move the variant's parameters off their initial values
        for name, p in model.named_parameters():
            if "sinklab_" in name:
                p.add_(torch.randn(p.shape, generator=gen) * 0.7)
    pinned = [(9, 12), (100, 103)]
    tokens = _tokens(STEPS, seed=24)
    with StreamSession(model, num_sinks=2, window=5, pinned=pinned, rebase_every=REBASE, chunk_size=7) as s:
        ours = s.feed(tokens[None], all_logits=True)[0]
        assert s.cache_tokens() == 2 + 3 + 3 + 5
        assert int(s.state.base[0]) > 300
    theirs = _reference(model, 2, 5, tokens, pinned)
    assert _rel(ours, theirs) < 1e-4
    unpinned = _reference(model, 2, 5, tokens[:140])  # the pins matter: without them the logits differ
    assert float((unpinned[110:] - theirs[110:140]).abs().max()) > 1e-2


def test_sliding_window_model_over_a_long_stream():
    """Mistral's own sliding window (5) keeps its native last-5 rule while the stream re-bases under it."""
    model = build("mistral-sliding")
    tokens = _tokens(STEPS, seed=25)
    with StreamSession(model, num_sinks=2, window=6, rebase_every=REBASE, chunk_size=9) as s:
        ours = s.feed(tokens[None], all_logits=True)[0]
        assert int(s.state.base[0]) > 300
    assert _rel(ours, _reference(model, 2, 6, tokens)) < 1e-4
