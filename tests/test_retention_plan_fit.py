"""The auto plan's budgets fitted on a calibration text: recall curves against a naive float64 count, the greedy fit
against brute force, a plan fitted twice is the same, and a stream with the fitted per-head budgets against the
float64 reference."""

from __future__ import annotations

import itertools

import pytest
import torch

from sinklab.models import tiny_llama
from sinklab.scan import scan_inputs
from sinklab.stream import SinkCache
from sinklab.evaluation.calibration import calibrate_plan, fit_budgets, recall_curves
from sinklab.stream.plan import load_plan, plan_from_scan
from sinklab.stream.policy import SnapKV
from tests.retention_reference import RetentionReference

pytestmark = pytest.mark.usefixtures("one_thread")


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 30000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _plan(model):
    ids = torch.randint(0, 30000, (2, 160), generator=torch.Generator().manual_seed(0))
    scan = scan_inputs(model, [{"input_ids": ids, "attention_mask": torch.ones_like(ids)}],
                       [[str(i) for i in range(160)]] * 2, split=False)
    return plan_from_scan(model, scan, num_sinks=4, window=60, recent=8)


def test_recall_curves_match_a_naive_count():
    g = torch.Generator().manual_seed(1)
    hkv, context, observe, later, sinks, recent, kernel = 2, 40, 6, 5, 3, 4, 5
    n = context + later
    w = torch.rand(hkv, observe + later, n, generator=g, dtype=torch.float64)
    for r in range(observe + later):  # causal: query at n - (observe + later) + r sees keys up to itself
        w[:, r, n - (observe + later) + r + 1:] = 0
    curves = recall_curves(w, context, observe, SnapKV(recent=recent, kernel=kernel), sinks)
    energy = recall_curves(w, context, observe, SnapKV(recent=recent, kernel=kernel), sinks, power=2)
    for h in range(hkv):
        mean = w[h, :observe, :context].mean(0).tolist()
        half = kernel // 2
        score = [sum(mean[max(0, j - half):j + half + 1]) / len(mean[max(0, j - half):j + half + 1])
                 for j in range(context)]
        protected = [j < sinks or j >= context - recent for j in range(context)]
        # the sinks and newest tokens first (newest first among them), then the best-scored
        order = sorted(range(context), key=lambda j: (not protected[j], -j if protected[j] else -score[j]))
        mass = w[h, observe:, :context].sum(0).tolist()
        squares = (w[h, observe:, :context] ** 2).sum(0).tolist()
        for b in (1, sinks + recent, 12, 25, context):
            want = sum(mass[j] for j in order[:b]) / sum(mass)
            assert float(curves[h, b - 1]) == pytest.approx(want, rel=1e-9, abs=1e-12), (h, b)
            assert float(energy[h, b - 1]) == pytest.approx(sum(squares[j] for j in order[:b]), rel=1e-9), (h, b)


def test_fit_budgets_finds_the_best_split_of_concave_curves():
    g = torch.Generator().manual_seed(2)
    curves = []
    for n in (9, 12, 7):
        inc = torch.rand(n, generator=g, dtype=torch.float64).sort(descending=True).values
        curves.append(inc.cumsum(0) / inc.sum())
    total, least = 18, 2
    fitted = fit_budgets(curves, total, least, step=1)
    assert sum(fitted) == total and min(fitted) >= least
    value = lambda bs: sum(float(c[b - 1]) for c, b in zip(curves, bs))  # noqa: E731
    best = max(value(bs) for bs in itertools.product(*(range(least, c.shape[0] + 1) for c in curves))
               if sum(bs) == total)
    assert value(fitted) == pytest.approx(best, rel=1e-12)


def test_a_plan_fitted_twice_is_the_same_and_keeps_the_total(tmp_path):
    model = tiny_llama(seed=1)
    plan = _plan(model)
    text = _ids(200, seed=4)
    a = calibrate_plan(model, plan, text, context=150)
    b = calibrate_plan(tiny_llama(seed=1), _plan(tiny_llama(seed=1)), text, context=150)
    assert a == b
    assert a.total_tokens == plan.total_tokens
    assert a.budgets != plan.budgets  # the fit moves budget between heads
    assert min(x for row in a.budgets for x in row) >= plan.num_sinks + plan.recent
    assert a.source["calibration"]["context"] == 150
    assert a.summary()["calibrated"] and not plan.summary()["calibrated"]
    assert load_plan(a.save(tmp_path / "plan.json")) == a  # the fitted budgets are saved in the plan
    flat = [x for row in a.uniform().budgets for x in row]
    assert set(flat) == {plan.num_sinks + plan.window}  # the ablation: same plan, uniform budgets
    wider = a.with_budget(4, 120)  # a fitted plan re-budgeted keeps each head's share, scaled
    old = [x for row in a.budgets for x in row]
    new = [x for row in wider.budgets for x in row]
    assert sum(new) == len(new) * 124
    for x, y, bx, by in zip(old, new, old[1:], new[1:]):
        assert abs(y - x * sum(new) / sum(old)) <= 2
        if bx > x + 1:
            assert by >= y


def test_auto_with_fitted_budgets_matches_the_float64_reference():
    """A prompt compressed by the fitted plan's per-head budgets, then decoding past them: same logits and the very
    same kept tokens in every head as the float64 reference given the same budgets."""
    model = tiny_llama(seed=1)
    plan = calibrate_plan(model, _plan(model), _ids(200, seed=4), context=150)
    ref = RetentionReference(model, "snapkv", plan.num_sinks, plan.budgets, plan.recent, window=32, kernel=7)
    ids = _ids(170, seed=9)
    with torch.no_grad(), SinkCache(model, policy="auto", plan=plan) as cache:
        ours = model(input_ids=torch.tensor([ids[:150]]), cache=cache).logits[0]
        torch.testing.assert_close(ours.double(), ref.forward(ids[:150]), rtol=1e-4, atol=1e-4)
        ref.window = 1  # one query per decode step
        for tok in ids[150:]:
            ours = model(input_ids=torch.tensor([[tok]]), cache=cache).logits[0, -1]
            torch.testing.assert_close(ours.double(), ref.forward([tok])[-1], rtol=1e-4, atol=1e-4)
        for i, layer in enumerate(cache.layers):
            assert layer.kept_indices() == [sorted(h) for h in ref.kept(i)], f"layer {i}"
            assert layer.kept_tokens()[0].tolist() == [min(b, 170) for b in plan.budgets[i]]


def test_sliding_window_layers_are_fitted_too():
    """A Gemma-3-like model (a sliding layer of 24 tokens, then a full one) at 16 tokens per head: both layers are
    fitted, the total is kept, no sliding head gets more than its window can use, and the prompt's forward under the
    fitted plan is still the model's own."""
    import transformers as tf

    cfg = tf.Gemma3TextConfig(vocab_size=30522, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=24,
                              layer_types=["sliding_attention", "full_attention"], max_position_embeddings=512)
    torch.manual_seed(0)
    model = tf.Gemma3ForCausalLM(cfg).eval()
    ids = torch.randint(0, 30000, (2, 160), generator=torch.Generator().manual_seed(0))
    scan = scan_inputs(model, [{"input_ids": ids, "attention_mask": torch.ones_like(ids)}],
                       [[str(i) for i in range(160)]] * 2, split=False)
    plan = plan_from_scan(model, scan, num_sinks=4, window=12, recent=4)
    assert all(row is not None for row in plan.budgets)  # the sliding layer is budgeted at 16 < 24
    fitted = calibrate_plan(model, plan, _ids(120, seed=4), context=90)
    assert fitted.source["calibration"]["layers"] == [0, 1]
    assert fitted.total_tokens == plan.total_tokens and fitted.budgets != plan.budgets
    assert max(fitted.budgets[0]) <= 24  # a sliding head never holds more than its window
    prompt = torch.tensor([_ids(60, seed=5)])
    with torch.no_grad():
        dense = model(prompt).logits
        with SinkCache(model, policy="auto", plan=fitted) as cache:
            torch.testing.assert_close(model(input_ids=prompt, cache=cache).logits, dense, rtol=1e-4, atol=1e-4)
