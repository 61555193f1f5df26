"""A prompt compressed by reconstruction scores: the scores against the model's own eager attention weights over
``prompt ⧺ instruction ⧺ prompt``, the kept set against its definition, and the compressed stream against the
float64 retention reference."""

from __future__ import annotations

import copy

import pytest
import torch

from sinklab.errors import InputError
from sinklab.models import tiny_llama
from sinklab.scan import scan_inputs
from sinklab.stream import SinkCache
from sinklab.stream.plan import plan_from_scan
from sinklab.stream.policy import Prescored, SnapKV
from sinklab.stream.prefill import (SNAPKV_LEAD, budgets_from_scores, compressed_prompt, prompt_scores,
                                    reconstruction_scores, united_scores)

pytestmark = pytest.mark.usefixtures("one_thread")


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 30000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return tiny_llama().eval()


@torch.no_grad()
def _naive_scores(model, prompt, instruction):
    """Per layer ``[Hkv, T]``: the most attention, over the repeated prompt's queries, of the query heads of each
    key-value head averaged, on each prompt token (float64, from the model's own eager weights)."""
    ids = torch.tensor([prompt + instruction + prompt])
    twin = copy.deepcopy(model)
    twin.set_attn_implementation("eager")
    att = twin(input_ids=ids, output_attentions=True).attentions
    t = len(prompt)
    hkv = model.config.num_key_value_heads
    out = {}
    for i, a in enumerate(att):
        a = a[0].double()  # (H, N, N)
        a = a.view(hkv, a.shape[0] // hkv, *a.shape[1:]).mean(1)  # (Hkv, N, N)
        out[i] = a[:, -t:, :t].amax(1)
    return out


@pytest.mark.parametrize("chunk", [7, 64])
def test_reconstruction_scores_match_the_models_own_attention(model, chunk):
    prompt, instruction = _ids(40, 1), _ids(5, 2)
    got = reconstruction_scores(model, prompt, instruction, num_sinks=2, chunk=chunk)
    want = _naive_scores(model, prompt, instruction)
    assert sorted(got) == sorted(want)
    for i in want:
        torch.testing.assert_close(got[i].double(), want[i], atol=2e-6, rtol=1e-4)


def test_prompt_scores_give_snapkv_of_the_prompt_from_the_same_passes(model):
    """The second part: the prompt's last ``window`` queries' attention (query heads of each key-value head averaged),
    averaged, then a mean over the ``kernel`` neighbours (fewer at the ends), from the model's own eager weights."""
    prompt, instruction = _ids(60, 8), _ids(5, 9)
    recon, snapped = prompt_scores(model, prompt, instruction, num_sinks=2)
    assert recon.keys() == reconstruction_scores(model, prompt, instruction, num_sinks=2).keys() == snapped.keys()
    twin = copy.deepcopy(model)
    twin.set_attn_implementation("eager")
    with torch.no_grad():
        att = twin(input_ids=torch.tensor([prompt]), output_attentions=True).attentions
    hkv, w, k = model.config.num_key_value_heads, SnapKV().window, SnapKV().kernel
    for i, a in enumerate(att):
        a = a[0].double()
        mean = a.view(hkv, a.shape[0] // hkv, *a.shape[1:]).mean(1)[:, -w:].mean(1)  # (Hkv, T)
        want = torch.stack([mean[:, max(0, j - k // 2):j + k // 2 + 1].mean(-1) for j in range(len(prompt))], -1)
        torch.testing.assert_close(snapped[i].double(), want, atol=2e-6, rtol=1e-4)


def test_compressed_prompt_keeps_sinks_newest_and_best_scored(model):
    prompt, instruction = _ids(120, 3), _ids(4, 4)
    sinks, window = 3, 50
    cache, _ = compressed_prompt(model, prompt, instruction, num_sinks=sinks, window=window)
    scores = reconstruction_scores(model, prompt, instruction, num_sinks=sinks)
    recent = SnapKV().recent
    try:
        for i, layer in enumerate(cache.layers):
            for h, kept in enumerate(layer.kept_indices()):
                protected = set(range(sinks)) | set(range(len(prompt) - min(recent, window), len(prompt)))
                rest = sorted((j for j in range(len(prompt)) if j not in protected),
                              key=lambda j: (-float(scores[i][h, j]), -j))
                want = sorted(protected | set(rest[:sinks + window - len(protected)]))
                assert kept == want, (i, h)
    finally:
        cache.close()


def test_compressed_prompt_with_a_plan_matches_the_float64_reference(model):
    from tests.retention_reference import RetentionReference

    ids = torch.randint(0, 30000, (2, 160), generator=torch.Generator().manual_seed(0))
    scan = scan_inputs(model, [{"input_ids": ids, "attention_mask": torch.ones_like(ids)}],
                       [[str(i) for i in range(160)]] * 2, split=False)
    plan = plan_from_scan(model, scan, num_sinks=4, window=30, recent=8)
    prompt, instruction, later = _ids(70, 5), _ids(4, 6), _ids(12, 7)
    cache, logits = compressed_prompt(model, prompt, instruction, plan=plan)
    try:
        got = [logits] + [model(input_ids=torch.tensor([[t]]), cache=cache).logits[0, -1] for t in later]
        kept = [layer.kept_indices() for layer in cache.layers]
        budgets = cache.config.plan.budgets
    finally:
        cache.close()
    assert budgets != plan.budgets and sum(map(sum, budgets)) == sum(map(sum, plan.budgets))
    # The budgets follow the reconstruction scores; the kept tokens, the union of the reconstruction's and SnapKV's
    # rankings (both checked against the eager weights above); then SnapKV per step.
    recon, snapped = prompt_scores(model, prompt, instruction, num_sinks=plan.num_sinks)
    assert budgets == budgets_from_scores(recon, plan, len(prompt))
    ref = RetentionReference(model, "snapkv", num_sinks=plan.num_sinks, budget=budgets, recent=plan.recent,
                             window=SnapKV().window)
    ref.given = united_scores(recon, snapped, SNAPKV_LEAD)
    want = [ref.forward(prompt)[-1]] + [ref.forward([t])[-1] for t in later]
    assert kept == [ref.kept(i) for i in range(len(kept))]
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, atol=5e-4, rtol=1e-3)


def test_budgets_from_scores_give_the_total_to_the_best_scored_tokens_of_any_head():
    """Against a sort of every (layer, head, token) by score: the floors (sinks, newest) plus each head's share of
    the best-scored others, the plan's total kept; a layer without scores keeps the plan's budgets."""
    from dataclasses import replace

    from sinklab.stream.plan import RetentionPlan

    g = torch.Generator().manual_seed(4)
    length, sinks, recent = 30, 2, 3
    plan = RetentionPlan("llama", 3, 2, sinks, 10, recent, 8, 0.9, [[12, 12], [12, 12], [9, 15]],
                         [[0.0, 0.0]] * 3, [[False, False]] * 3)
    scores = {0: torch.rand(2, length, generator=g), 2: torch.rand(2, length, generator=g)}
    got = budgets_from_scores(scores, plan, length)
    entries = sorted(((float(scores[i][h, t]), i, h) for i in (0, 2) for h in range(2)
                      for t in range(sinks, length - recent)), reverse=True)
    free = 12 + 12 + 9 + 15 - 4 * (sinks + recent)
    want = {(i, h): sinks + recent for i in (0, 2) for h in range(2)}
    for _, i, h in entries[:free]:
        want[(i, h)] += 1
    assert got == [[want[(0, 0)], want[(0, 1)]], [12, 12], [want[(2, 0)], want[(2, 1)]]]
    assert sum(got[0]) + sum(got[2]) == 12 + 12 + 9 + 15
    assert budgets_from_scores({}, plan, length) == plan.budgets
    assert budgets_from_scores(scores, replace(plan, budgets=[None, [12, 12], None]), length) == [None, [12, 12], None]


def test_a_model_with_sliding_layers_shares_its_budget_by_window_and_one_kept_set_over_its_global_layers():
    """Sliding-window layers keep the plan's share of their own window, the global layers split the rest equally
    (written out here for a 4-layer layout), the total kept; and every global layer gets the same scores: the most,
    over the global layers, of each layer's scores over its own largest (a loop here). Without sliding layers
    neither changes anything."""
    from sinklab.stream.plan import RetentionPlan
    from sinklab.stream.prefill import shared_scores

    length, windows = 64, [16, None, 16, None]
    plan = RetentionPlan("gemma3", 4, 1, 2, 10, 2, 8, 0.9, [[20], [20], [20], [20]], [[0.0]] * 4, [[False]] * 4)
    got = budgets_from_scores({}, plan, length, windows)
    share = 80 / (16 + 64 + 16 + 64)  # the plan's total over every layer's dense size
    sliding = int(share * 16)
    assert got == [[sliding], [(80 - 2 * sliding) // 2], [sliding], [(80 - 2 * sliding) // 2]]
    assert sum(b[0] for b in got) == 80
    g = torch.Generator().manual_seed(5)
    scores = {i: torch.rand(1, length, generator=g) * (i + 1) for i in range(4)}
    shared = shared_scores(scores, windows)
    for t in range(length):
        want = max(float(scores[i][0, t]) / float(scores[i][0].max()) for i in (1, 3))
        assert float(shared[1][0, t]) == pytest.approx(want) and float(shared[3][0, t]) == pytest.approx(want)
    assert torch.equal(shared[0], scores[0]) and torch.equal(shared[2], scores[2])  # sliding layers: their own
    assert shared_scores(scores, [None] * 4) is scores
    assert budgets_from_scores({}, plan, length, [None] * 4) == plan.budgets


def test_windowed_plan_splits_by_window_only_where_the_model_has_sliding_layers(model):
    """A plan for a model with a sliding layer takes :func:`hybrid_budgets` at the prompt's length (its one local
    and one global layer: Gemma 3 shrunk); a model without sliding layers keeps the very plan."""
    from sinklab import _compat
    from sinklab.stream.plan import RetentionPlan
    from sinklab.stream.prefill import hybrid_budgets, windowed_plan
    from sinklab.testing import tiny

    gemma = tiny.build("gemma3_text").model
    windows = _compat.layer_sliding_windows(gemma)
    assert windows[0] is not None and windows[1] is None
    heads = gemma.config.num_key_value_heads
    plan = RetentionPlan("gemma3_text", 2, heads, 2, 10, 2, 8, 0.9, [[12] * heads] * 2, [[0.0] * heads] * 2,
                         [[False] * heads] * 2)
    split = windowed_plan(gemma, plan, 40)
    assert split.budgets == hybrid_budgets(plan, 40, windows) != plan.budgets
    assert "40 tokens" in split.source["budgets"]
    llama_plan = RetentionPlan("llama", model.config.num_hidden_layers, model.config.num_key_value_heads, 2, 10, 2,
                               8, 0.9, [[12] * model.config.num_key_value_heads] * model.config.num_hidden_layers,
                               [[0.0] * model.config.num_key_value_heads] * model.config.num_hidden_layers,
                               [[False] * model.config.num_key_value_heads] * model.config.num_hidden_layers)
    assert windowed_plan(model, llama_plan, 40) is llama_plan
    with pytest.raises(InputError):
        windowed_plan(model, llama_plan, 0)


def test_a_model_with_sliding_layers_compresses_its_global_layer_by_the_united_scores():
    """Gemma 3 shrunk (one sliding, one global layer): the global layer keeps its sinks, its ``recent`` newest and the
    best others by :func:`united_scores` of the reconstruction and SnapKV (SnapKV leading by ``SNAPKV_LEAD``), made
    one set by :func:`shared_scores` — the kept set written out here from the scores themselves."""
    from sinklab import _compat
    from sinklab.stream.plan import RetentionPlan
    from sinklab.stream.prefill import shared_scores
    from sinklab.testing import tiny

    gemma = tiny.build("gemma3_text").model.eval()
    windows = _compat.layer_sliding_windows(gemma)
    heads = gemma.config.num_key_value_heads
    plan = RetentionPlan("gemma3_text", 2, heads, 2, 10, 2, 8, 0.9, [[12] * heads] * 2, [[0.0] * heads] * 2,
                         [[False] * heads] * 2)
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, gemma.config.vocab_size, (40,), generator=g).tolist()
    instruction = torch.randint(0, gemma.config.vocab_size, (3,), generator=g).tolist()
    cache, _ = compressed_prompt(gemma, prompt, instruction, plan=plan)
    try:
        kept, budgets = cache.layers[1].kept_indices(), cache.config.plan.budgets[1]
    finally:
        cache.close()
    recon, snapped = prompt_scores(gemma, prompt, instruction, num_sinks=2)
    scores = shared_scores(united_scores(recon, snapped, SNAPKV_LEAD), windows)[1]
    assert not torch.equal(scores, recon[1])
    for h in range(heads):
        protected = {0, 1, len(prompt) - 2, len(prompt) - 1}
        rest = sorted((j for j in range(len(prompt)) if j not in protected), key=lambda j: (-float(scores[h, j]), -j))
        assert kept[h] == sorted(protected | set(rest[:budgets[h] - len(protected)])), h


def test_united_scores_keep_the_top_of_either_ranking():
    """Each token scores the better of its two rank shares (a loop over every token), the first lowered by
    ``lead``; a budget of ``k`` then keeps the tokens in the top of either list (written out for one head)."""

    g = torch.Generator().manual_seed(7)
    first = {0: torch.rand(2, 30, generator=g), 1: torch.rand(2, 30, generator=g)}
    second = {0: torch.rand(2, 30, generator=g)}
    for lead in (0.0, 0.1):
        got = united_scores(first, second, lead)
        for h in range(2):
            for t in range(30):
                r1 = sum(float(x) < float(first[0][h, t]) for x in first[0][h]) / 29
                r2 = sum(float(x) < float(second[0][h, t]) for x in second[0][h]) / 29
                assert float(got[0][h, t]) == pytest.approx(max(r1 - lead, r2))
        assert got[1] is first[1]  # a layer the second scores miss: its own
    top = set(torch.topk(united_scores(first, second)[0][0], 10).indices.tolist())
    best1 = set(torch.topk(first[0][0], 5).indices.tolist())
    best2 = set(torch.topk(second[0][0], 5).indices.tolist())
    assert best1 | best2 <= top


def test_prescored_saves_as_snapkv_and_bad_arguments_are_refused(model):
    pol = Prescored(recent=4, given={0: torch.ones(2, 5)})
    assert pol.as_row() == SnapKV(recent=4)
    with pytest.raises(InputError, match="either window"):
        compressed_prompt(model, _ids(10, 0), _ids(2, 0))
    with pytest.raises(InputError, match="non-empty"):
        reconstruction_scores(model, [], [1])
    cache = SinkCache(model, num_sinks=2, window=8, policy=Prescored(given={}))
    cache.close()
