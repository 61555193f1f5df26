"""The retention grid's cells (sinklab.evaluation.retention, run by benchmarks/retention.py): its prompts are the
same for the same seed, its interval is Wilson's, its budgets and held entries are counted over every layer and head, and one compressed cache answers every question as a fresh
compression would."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DynamicCache

from sinklab.evaluation import retention as grid
from sinklab.models import tiny_llama
from sinklab.stream import SinkCache

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tokenizer_and_filler(smollm2):
    return smollm2.tokenizer, grid.filler_ids(smollm2.tokenizer)


@pytest.mark.parametrize("task", grid.TASKS)
def test_the_cell_generator_makes_the_same_prompts_for_the_same_seed(tokenizer_and_filler, task):
    tok, filler = tokenizer_and_filler
    a = [grid.make_cell(tok, filler, task, 600, s) for s in range(3)]
    b = [grid.make_cell(tok, filler, task, 600, s) for s in range(3)]
    assert a == b
    assert a[0] != a[1] and a[1] != a[2]  # another seed, another prompt
    for cell in a:
        assert len(cell["context_ids"]) == 600
        if task == "ppl":
            assert len(cell["continuation_ids"]) == grid.PPL_TOKENS
            continue
        text = tok.decode(cell["context_ids"])
        assert len(cell["questions"]) == {"needle": 1, "multikey": 4, "vartrack": 1}[task]
        assert 0 <= cell["aware"] < len(cell["questions"])
        for q in cell["questions"]:  # every answer is written in the context, once per needle
            assert text.count(q["answer"]) == 1, (task, q["answer"])


def test_wilson_interval_matches_the_closed_form():
    # Published 95 % Wilson intervals (Newcombe 1998, table I): 0/10, 5/10, 10/10 and 81/263.
    assert grid.wilson(0, 10) == pytest.approx([0.0, 0.2775], abs=1e-4)
    assert grid.wilson(5, 10) == pytest.approx([0.2366, 0.7634], abs=1e-4)
    assert grid.wilson(10, 10) == pytest.approx([0.7225, 1.0], abs=1e-4)
    assert grid.wilson(81, 263) == pytest.approx([0.2553, 0.3662], abs=1e-4)
    assert grid.wilson(0, 0) is None


def test_uniform_budget_counts_every_layer_with_what_it_holds():
    # Two global layers of 2048 tokens and four sliding layers of 511, one head each (Gemma-3-like).
    holds = [(1, 2048)] * 2 + [(1, 511)] * 4
    dense = 2 * 2048 + 4 * 511
    for fraction in (0.1, 0.25, 0.5):
        b = grid.uniform_budget(holds, fraction * dense)
        total = lambda x: sum(h * min(x, t) for h, t in holds)  # noqa: E731
        # no other budget comes nearer the target
        assert all(abs(total(b) - fraction * dense) <= abs(total(x) - fraction * dense) for x in range(1, 2049))
    assert grid.uniform_budget(holds, 0.25 * dense) == math.floor(0.25 * dense / 6 + 0.5)  # below 511: all alike


def test_held_entries_and_bytes_are_measured_on_the_cache():
    model = tiny_llama(seed=1)
    cfg = model.config
    ids = torch.randint(0, 1000, (1, 50), generator=torch.Generator().manual_seed(0))
    heads, dh = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    with torch.no_grad():
        dense = DynamicCache(config=cfg)
        model(input_ids=ids, cache=dense)
        assert grid.held(dense) == (cfg.num_hidden_layers * heads * 50, cfg.num_hidden_layers * heads * 50 * 2 * dh * 4)
        for policy in ("streaming", "snapkv"):
            with SinkCache(model, num_sinks=4, window=36, policy=policy) as cache:
                model(input_ids=ids, cache=cache)
                n = cfg.num_hidden_layers * heads * 40
                assert grid.held(cache) == (n, n * 2 * dh * 4), policy


def _tiny_plan(model):
    from sinklab.scan import scan_inputs
    from sinklab.stream.plan import plan_from_scan

    ids = torch.randint(0, 1000, (2, 160), generator=torch.Generator().manual_seed(0))
    scan = scan_inputs(model, [{"input_ids": ids, "attention_mask": torch.ones_like(ids)}],
                       [[str(i) for i in range(160)]] * 2, split=False)
    return plan_from_scan(model, scan, num_sinks=4, window=36, recent=8)


@pytest.mark.parametrize("method", ["dense", "snapkv", "streaming", "auto"])
def test_one_compressed_cache_answers_every_question_as_a_fresh_compression(method):
    """The agnostic regime compresses once and asks each question of a copy: each answer equals the one from
    compressing the context anew and asking that question alone."""
    model = tiny_llama(seed=1)
    g = torch.Generator().manual_seed(3)
    ctx = torch.randint(0, 1000, (80,), generator=g).tolist()
    questions = [{"question_ids": torch.randint(0, 1000, (5,), generator=g).tolist(), "answer": "x"}
                 for _ in range(3)]
    cell = {"context_ids": ctx, "questions": questions, "aware": 0}
    plan = _tiny_plan(model) if method == "auto" else None
    words = lambda text, add_special_tokens: {"input_ids": [7, 8, 9]}  # noqa: E731  # the instruction's tokens
    new = grid.make_cache(model, method, 40, plan, words)
    together = grid.run_prompt(model, cell, "agnostic", new)["generated"]
    alone = [grid.run_prompt(model, {**cell, "questions": [q]}, "agnostic", new)["generated"][0] for q in questions]
    assert together == alone
    assert len({tuple(x) for x in together}) > 1  # the questions lead to different answers
