"""Fitting an ``auto`` plan's budgets on a calibration text: one forward of the model through a
:class:`~sinklab.stream.SinkCache` that records each scored layer's attention, then per key-value head what its
output would lose at each budget under SnapKV (:func:`recall_curves`) and the plan's total shared out greedily where
it loses the least (:func:`fit_budgets`). A measurement of a stream, so it lives beside the other ones
(:mod:`sinklab.evaluation`), not in the stream; the plan itself is :class:`sinklab.stream.plan.RetentionPlan`.
docs/retention.md has the rules in full.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace

import torch
from torch import Tensor, nn

from .. import _compat
from ..errors import InputError, check_int
from ..stream.cache import SinkCache
from ..stream.plan import RetentionPlan
from ..stream.policy import Observation, ScoredPolicy, SnapKV

__all__ = ["calibrate_plan", "fit_budgets", "recall_curves"]


class _Recorder(ScoredPolicy):
    """Scores nothing (every candidate alike) and keeps, per scored layer in call order, the attention weights of
    the forward's last ``window`` queries (``[Hkv, w, N]``, candidates in stream order)."""

    name = "calibration"
    needs_weights = True

    def __init__(self, window: int) -> None:
        super().__init__(recent=1, window=window)
        self.weights: list[Tensor] = []
        self.spread: list[Tensor] = []  # per layer (Hkv,): the values' mean squared distance from their mean

    def score(self, obs: Observation) -> Tensor:
        w = obs.weights[0]  # type: ignore[index]  # (Hkv, w, N); needs_weights: given
        real = int(obs.real[0, 0].sum())  # the real candidates come first in stream order; then empty slots
        self.weights.append(w.gather(-1, obs.order[0][:, None, :].expand_as(w))[..., :real].double())
        v = obs.values[0].double()[:, obs.order[0, 0, :real]]  # (Hkv, real, dv) (every head holds every token)
        self.spread.append((v - v.mean(1, keepdim=True)).pow(2).sum(-1).mean(1))
        return torch.zeros(obs.real.shape, dtype=torch.float32, device=obs.real.device)


def recall_curves(weights: Tensor, context: int, observe: int, scorer: ScoredPolicy, num_sinks: int,
                  power: int = 1) -> Tensor:
    """``[Hkv, context]``: for each key-value head, the share of the later queries' attention on the context that a
    head keeping ``b`` context tokens (entry ``b − 1``) still holds, when it keeps its ``num_sinks`` sinks and the
    ``scorer.recent`` newest context tokens, then the best-scored by ``scorer`` from the ``observe`` queries that
    end the context. ``power=2``: the kept sum of squared weights instead, not normalised — what a head's output
    loses when it drops keys whose values scatter independently around its output is the dropped sum of ``a²``
    (times the values' spread), so a broad head (many small weights) loses little per dropped key.

    ``weights`` ``[Hkv, Q, N]``: the attention of the last ``Q`` queries of a text of ``N`` tokens (float64, keys in
    stream order), the first ``observe`` of them ending the ``context`` (``N − Q + observe == context``), the rest
    after it."""
    hkv, q, n = weights.shape
    if n - q + observe != context:
        raise InputError(f"{q} queries over {n} tokens do not end a {context}-token context after {observe} of them")
    seen = weights[:, :observe, :context]  # (Hkv, observe, context): the scorer's window
    later = weights[:, observe:, :context].pow(power).sum(1)  # (Hkv, context): per context key, over later queries
    idx = torch.arange(context)
    obs = Observation(seen[None].float(), torch.zeros(1, hkv, context, 1), torch.zeros(1, hkv, context, 1),
                      torch.ones(1, hkv, context, dtype=torch.bool), idx.expand(1, hkv, context).contiguous())
    scores = scorer.score(obs)[0].double()  # (Hkv, context)
    protected = (idx < num_sinks) | (idx >= context - scorer.recent)
    prio = torch.where(protected, torch.full_like(scores, float("inf")), scores)
    newest_first = idx.flip(0).expand(hkv, context)  # ties go to the newer token, as the stream breaks them
    ranked = newest_first.gather(-1, torch.argsort(prio.gather(-1, newest_first), dim=-1, descending=True,
                                                   stable=True))
    kept = later.gather(-1, ranked).cumsum(-1)
    return kept / later.sum(-1, keepdim=True).clamp_min(1e-300) if power == 1 else kept


def fit_budgets(curves: list[Tensor], total: int, least: int, step: int = 8) -> list[int]:
    """Budgets (tokens per head, ``least`` at the fewest, at most each curve's length) that sum to ``total`` and
    take, ``step`` tokens at a time, where the recall curve ``curves[h]`` (``[n_h]``: recall at ``b`` tokens, entry
    ``b − 1``) gains the most — a greedy fit of ``Σ_h recall_h(b_h)``. Deterministic: ties go to the lower head."""
    sizes = [int(c.shape[0]) for c in curves]
    budgets = [min(least, n) for n in sizes]
    left = total - sum(budgets)
    if left < 0:
        raise InputError(f"a total of {total} tokens cannot give {len(curves)} heads {least} each")
    at = lambda h, b: float(curves[h][b - 1]) if b > 0 else 0.0  # noqa: E731
    while left > 0:
        best, gain = -1, -1.0
        for h in range(len(curves)):
            if budgets[h] >= sizes[h]:
                continue
            nxt = min(sizes[h], budgets[h] + step, budgets[h] + left)
            g = (at(h, nxt) - at(h, budgets[h])) / (nxt - budgets[h])
            if g > gain:
                best, gain = h, g
        if best < 0:  # every head holds its whole context
            break
        nxt = min(sizes[best], budgets[best] + step, budgets[best] + left)
        left -= nxt - budgets[best]
        budgets[best] = nxt
    return budgets


@torch.no_grad()
def calibrate_plan(model: nn.Module, plan: RetentionPlan, ids: Tensor | list[int], context: int, *,
                   observe: int = 32) -> RetentionPlan:
    """The plan with its budgets fitted on a calibration text: per key-value head, how much of the later queries'
    attention on a ``context``-token prefix survives at each budget under the plan's scorer (SnapKV, the sinks and
    the newest tokens kept) — as the kept sum of squared weights times the spread of the head's values, the part of
    its output a dropped key would have moved —, then the total the plan holds shared out where it keeps the most
    (:func:`recall_curves` with ``power=2``, :func:`fit_budgets`). One forward of ``ids`` (``context`` + the later
    tokens).

    Sliding-window layers the plan budgets are fitted with the others (their queries see only their window, so a
    budget past it gains nothing). The fitted budgets hold for prompts of about ``context`` tokens;
    ``source["calibration"]`` records what they were fitted on."""
    ids = torch.as_tensor(ids, dtype=torch.long).reshape(1, -1)
    n = int(ids.shape[1])
    check_int("context", context, plan.num_sinks + plan.recent + observe)
    check_int("observe", observe, 1)
    if n <= context:
        raise InputError(f"the calibration text ({n} tokens) must run past its context ({context} tokens)")
    plan.check_model(model)
    recorder = _Recorder(window=n - context + observe)
    # Every layer the plan budgets is scored, a sliding one too: the calibration window is below the narrowest
    # budgeted sliding window (a prompt in one forward sees all of itself, so the budget changes no weight).
    windows = _compat.layer_sliding_windows(model)
    sliding = [w for w, b in zip(windows, plan.budgets) if w is not None and b is not None]
    window = min([n] + [w - plan.num_sinks - 1 for w in sliding])
    if window < 1:
        raise InputError(f"a sliding window of {min(sliding)} tokens leaves no room beside {plan.num_sinks} sinks")
    cache = SinkCache(model, num_sinks=plan.num_sinks, window=window, policy=recorder)
    try:
        model(input_ids=ids, cache=cache, logits_to_keep=1)
        scored = [i for i, s in enumerate(cache.layer_states) if s is not None and s.scored]
    finally:
        cache.close()
    scorer = SnapKV(recent=plan.recent)
    layers = [i for i in scored if plan.budgets[i] is not None]
    # (a sliding layer keeps no sinks: SinkCache's default, sliding_sinks=False)
    curves = {i: recall_curves(w, context, observe, scorer, plan.num_sinks if windows[i] is None else 0, power=2)
              * spread[:, None] for i, w, spread in zip(scored, recorder.weights, recorder.spread) if i in layers}
    # a sliding head never holds more than its window: its curve (and so its budget) stops there
    flat = [c if windows[i] is None else c[:windows[i]] for i in layers for c in curves[i]]
    total = sum(b for i in layers for b in plan.budgets[i] or ())
    fitted = fit_budgets(flat, total, plan.num_sinks + plan.recent)
    budgets = [list(b) if b is not None else None for b in plan.budgets]
    for k, i in enumerate(layers):
        budgets[i] = fitted[k * plan.kv_heads:(k + 1) * plan.kv_heads]
    calibration = {"tokens": n, "context": context, "observe": observe, "layers": layers, "objective": "a² × spread",
                   "ids_sha1": hashlib.sha1(json.dumps(ids[0].tolist()).encode()).hexdigest()[:12]}
    return replace(plan, budgets=budgets, source={**plan.source, "calibration": calibration})
