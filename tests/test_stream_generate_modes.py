"""Every generate mode through a SinkCache: beams, sampling, num_return_sequences, row selection, crop —
against DynamicCache before eviction, a float64 reference beam search after, and each row's solo stream."""

from __future__ import annotations

import pytest
import torch
from stream_reference import Reference, assert_beams_equal_default
from tiny_models import build

from sinklab.errors import InputError
from sinklab.stream import SinkCache, StreamSession

V = 97
GREEDY = dict(eos_token_id=None, pad_token_id=0, return_dict_in_generate=True)


def _tokens(n: int, seed: int = 3) -> torch.Tensor:
    return torch.randint(2, V, (n,), generator=torch.Generator().manual_seed(seed))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


@pytest.fixture(scope="module")
def model():
    return build("llama-gqa")


def test_beams_equal_dynamic_cache_while_nothing_is_evicted(model):
    ids = _tokens(6, seed=1)[None]
    gen = dict(num_beams=3, num_return_sequences=3, max_new_tokens=10, output_scores=True, **GREEDY)
    assert_beams_equal_default(model, ids, 2, 40, **gen)


def _reference_beams(model, prompt: list[int], num_beams: int, steps: int, num_sinks: int, window: int):
    """Beam search written out over the float64 StreamingLLM reference (one reference state per beam):
    keep the ``num_beams`` best sums of log-probabilities; every beam has the same length (no EOS)."""
    ref = Reference(model, num_sinks, window)
    for t in prompt[:-1]:
        ref.step(t)

    def snapshot():
        return ref.t, {k: list(v) for k, v in ref.store.items()}

    def restore(snap):
        ref.t, ref.store = snap[0], {k: list(v) for k, v in snap[1].items()}

    beams = [(0.0, [prompt[-1]], snapshot())]  # (score, tokens incl. the last fed, state before feeding it)
    for _ in range(steps):
        candidates = []
        for score, toks, snap in beams:
            restore(snap)
            logp = torch.log_softmax(ref.step(toks[-1]), -1)
            after = snapshot()
            top = torch.topk(logp, num_beams)
            candidates += [(score + float(v), toks + [int(i)], after) for v, i in zip(top.values, top.indices)]
        candidates.sort(key=lambda c: -c[0])
        beams = candidates[:num_beams]
    return [(b[0], b[1][1:]) for b in beams]


def test_beams_equal_a_float64_reference_beam_search_after_eviction(model):
    prompt = _tokens(6, seed=2).tolist()
    steps, beams = 14, 3  # 6 + 14 tokens through S + W = 2 + 5: evicting from the first step
    with torch.no_grad(), SinkCache(model, num_sinks=2, window=5) as cache:
        out = model.generate(torch.tensor([prompt]), cache=cache, num_beams=beams, num_return_sequences=beams,
                             max_new_tokens=steps, output_scores=True, length_penalty=0.0, **GREEDY)
    ref = _reference_beams(model, prompt, beams, steps, 2, 5)
    assert [r[1] for r in ref] == out.sequences[:, len(prompt):].tolist()
    torch.testing.assert_close(out.sequences_scores.double(), torch.tensor([r[0] for r in ref], dtype=torch.float64),
                               rtol=1e-4, atol=1e-4)


def test_seeded_sampling_equals_dynamic_cache_while_nothing_is_evicted(model):
    ids = _tokens(5, seed=4)[None]
    gen = dict(do_sample=True, temperature=0.8, top_k=20, max_new_tokens=20, **GREEDY)
    with torch.no_grad():
        torch.manual_seed(7)
        dense = model.generate(ids, **gen).sequences
        with SinkCache(model, num_sinks=2, window=40) as cache:
            torch.manual_seed(7)
            ours = model.generate(ids, cache=cache, **gen).sequences
    assert torch.equal(ours, dense)


def test_num_return_sequences_rows_equal_their_solo_streams(model):
    """Sampled rows through one SinkCache past eviction: each row's logits == that row streamed alone."""
    ids = _tokens(5, seed=5)[None]
    with torch.no_grad(), SinkCache(model, num_sinks=2, window=5) as cache:
        torch.manual_seed(3)
        out = model.generate(ids, cache=cache, do_sample=True, num_return_sequences=3, max_new_tokens=14,
                             output_logits=True, **GREEDY)
    rows = out.sequences[:, 5:]
    assert len({tuple(r) for r in rows.tolist()}) > 1  # different samples, so the rows really differ
    for r in range(3):
        with StreamSession(model, num_sinks=2, window=5) as s:
            solo = [s.feed(ids)] + [s.step(rows[r, i : i + 1]) for i in range(13)]
        worst = max(_rel(out.logits[i][r], solo[i][0]) for i in range(14))
        assert worst < 1e-5, (r, worst)


def test_batch_select_indices_keeps_a_row_that_continues_alone(model):
    a, b = _tokens(12, seed=6), _tokens(12, seed=7)
    follow = _tokens(10, seed=8)
    with StreamSession(model, num_sinks=2, window=5) as s:
        s.feed(torch.stack([a, b]))
        s.cache.batch_select_indices(torch.tensor([1]))
        kept = torch.stack([s.step(follow[i : i + 1]) for i in range(10)])
    with StreamSession(model, num_sinks=2, window=5) as s:
        s.feed(b[None])
        alone = torch.stack([s.step(follow[i : i + 1]) for i in range(10)])
    assert _rel(kept, alone) < 1e-5


def test_crop_takes_back_tokens_until_the_window_evicts(model):
    tokens, other = _tokens(9, seed=9), _tokens(4, seed=10)
    with StreamSession(model, num_sinks=2, window=12) as s:
        s.feed(tokens[None])
        s.cache.crop(-3)  # 9 − 3 = 6 tokens kept, nothing evicted yet (2 + 12 slots)
        cropped = s.feed(other[None], all_logits=True)
        assert s.cache.get_seq_length() == 10
    with StreamSession(model, num_sinks=2, window=12) as s:
        never = s.feed(torch.cat([tokens[:6], other])[None], all_logits=True)[:, 6:]
    assert _rel(cropped, never) < 1e-5
    with StreamSession(model, num_sinks=2, window=4) as s:
        s.feed(tokens[None])  # 9 tokens through 2 + 4 slots: 3 evicted
        with pytest.raises(InputError, match="cannot take back the last 2 tokens: the stream has already evicted "
                                             "tokens from its 4-token window"):
            s.cache.crop(-2)
        with pytest.raises(InputError, match=r"minus the number of columns to remove \(transformers ≥ 5\), got 3"):
            s.cache.crop(3)


def test_assisted_decoding_with_prompt_lookup_equals_greedy_before_eviction(model):
    ids = torch.cat([_tokens(6, seed=11)] * 2)[None]  # repeated text: prompt lookup finds candidates
    gen = dict(max_new_tokens=8, do_sample=False, **GREEDY)
    with torch.no_grad():
        dense = model.generate(ids, **gen).sequences
        with SinkCache(model, num_sinks=2, window=40) as cache:
            ours = model.generate(ids, cache=cache, prompt_lookup_num_tokens=3, **gen).sequences
        assert torch.equal(ours, dense)
        with SinkCache(model, num_sinks=2, window=4) as cache, pytest.raises(InputError, match="Assisted decoding"):
            model.generate(ids, cache=cache, prompt_lookup_num_tokens=3, **gen)


def test_refusals_say_what_to_do(model):
    with StreamSession(model, num_sinks=2, window=4) as s:
        s.feed(_tokens(3)[None])
        with pytest.raises(InputError, match=r"^this stream holds 1 rows but the model was given 2; change the number "
                                             r"of rows through the cache \(reorder_cache, batch_repeat_interleave, "
                                             r"batch_select_indices — generate\(\) does this for beams and "
                                             r"num_return_sequences\), or start a new SinkCache$"):
            s.feed(_tokens(6).view(2, 3))
        with pytest.raises(InputError, match=r"call it on the SinkCache \(cache.reorder_cache\(...\)\)"):
            s.cache.layers[0].reorder_cache(torch.tensor([0]))
