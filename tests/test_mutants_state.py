"""sinklab.stream.state: the parts mutation testing found unchecked (docs/testing.md), against the float64
StreamingLLM reference of tests/stream_reference.py (RoPE re-applied at slot positions every step)."""

from __future__ import annotations

from stream_reference import Reference
from test_stream import _rel, _tokens, model_for

from sinklab.stream import StreamSession


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
