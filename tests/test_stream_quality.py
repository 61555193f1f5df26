"""Stream quality measures (sinklab.evaluation.quality) against closed forms and transformers' own generate()."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import sinklab
from sinklab._compat import cache_kwarg_name
from sinklab.report.quality_figures import quality_figures, quality_tables
from sinklab.evaluation import quality
from sinklab.stream.session import sample_token

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny_lm():
    return sinklab.load_model("builtin:tiny-lm")


def test_distinct_ngrams_and_blocks_closed_form():
    assert quality.distinct_ngram_ratio([1, 2, 3, 4, 1, 2, 3, 4]) == 4 / 5  # (1,2,3,4) twice among 5 4-grams
    assert quality.distinct_ngram_ratio([7] * 10) == 1 / 7
    st = quality.block_stats([1, 2, 3, 4, 5, 1, 1, 1, 1, 1], [0.0, 2.0] * 5, block=5)
    assert st == {"end": [5, 10], "distinct": [1.0, 0.5], "mean_nll": [0.8, 1.2]}


def test_endless_generation_equals_seeded_sampling_with_a_dynamic_cache_before_eviction(tiny_lm):
    model, tok = tiny_lm.model, tiny_lm.tokenizer
    prompt = tok("The lighthouse keeper")["input_ids"]
    run = quality.endless_generation(model, prompt, 30, num_sinks=4, window=64, seed=3)
    gen, ids, cache = torch.Generator().manual_seed(3), torch.tensor([prompt]), DynamicCache(config=model.config)
    tokens, nll = [], []
    with torch.no_grad():
        logits = model(input_ids=ids, **{cache_kwarg_name(model): cache}).logits[:, -1]
        for _ in range(30):
            t = sample_token(logits, 0.7, 50, gen)
            tokens.append(int(t[0]))
            nll.append(float(-torch.log_softmax(logits[0].double(), -1)[tokens[-1]]))
            logits = model(input_ids=t[:, None], **{cache_kwarg_name(model): cache}).logits[:, -1]
    assert run.tokens == tokens
    torch.testing.assert_close(torch.tensor(run.nll), torch.tensor(nll), atol=1e-4, rtol=1e-5)


def test_fact_recall_dense_is_generate_and_methods_agree_while_nothing_is_evicted(tiny_lm):
    model, tok = tiny_lm.model, tiny_lm.tokenizer
    filler = torch.tensor(tok("The quick brown fox " * 80, add_special_tokens=False)["input_ids"])
    res = quality.fact_recall(model, tok, filler, [4, 200], num_sinks=4, window=100, facts=quality.FACTS[:2])
    answers = {(a["method"], a["distance"], a["key"]): a["answer"] for a in res.answers}
    for key, _ in quality.FACTS[:2]:  # d = 4: the whole prompt (< 100 tokens) fits in every cache: all agree
        assert len({answers[(m, 4, key)] for m in quality.RECALL_METHODS}) == 1
    key, value = quality.FACTS[0]
    ids = (tok(quality._PREAMBLE)["input_ids"] + tok(f"Note: the password for {key} is {value}.\n",
           add_special_tokens=False)["input_ids"] + filler[:200].tolist() +
           tok(f"\nQuestion: what is the password for {key}?\nAnswer: the password for {key} is",
               add_special_tokens=False)["input_ids"])
    assert len(ids) > 200 + 4 + 4  # the sinks, window and pinned streams evict there
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=3, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert answers[("dense", 200, key)] == tok.decode(out[0, len(ids):], skip_special_tokens=True)
    assert set(res.accuracy) == set(quality.RECALL_METHODS) and all(len(v) == 2 for v in res.accuracy.values())
    table = quality_tables({"recall": res.to_json()})
    assert "| 4 | " in table and "fact pinned" in table


def test_many_prompts_first_answer_equals_the_fresh_one(tiny_lm):
    model, tok = tiny_lm.model, tiny_lm.tokenizer
    rows = quality.many_prompts(model, tok, quality.PROMPTS[:3], num_sinks=4, window=24, max_new_tokens=6)
    first = rows[0]  # nothing evicted yet and the same context: the stream's answer is the fresh one
    assert first.evicted_before == 0 and first.stream_answer == first.fresh_answer
    assert first.stream_nll == pytest.approx(first.fresh_nll, abs=1e-6) and first.stream_nll > 0
    assert rows[-1].evicted_before > 0
    data = {"prompts": {"num_sinks": 4, "window": 24, "max_new_tokens": 6, "rows": [r.__dict__ for r in rows]}}
    assert set(quality_figures(data)) == {"prompts"}
    assert quality.PROMPTS[1] in quality_tables(data) and len(quality.PROMPTS) >= 30
