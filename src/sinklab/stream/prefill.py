"""A prompt compressed before any question is seen: which of its tokens the model needs to say it again.

:func:`reconstruction_scores` scores every prompt token, per layer and key-value head, by the most attention any
query gives it while the model is fed ``prompt ⧺ instruction ⧺ prompt`` (the idea of KVzip, Kim et al., 2025: a
cache that can reconstruct its context keeps what any later question may ask of it). :func:`compressed_prompt`
prefills a score-based :class:`~sinklab.stream.SinkCache` with those scores (:class:`~sinklab.stream.policy.
Prescored`), per-head budgets from a plan where one is given; later forwards score by SnapKV. With a plan, each head
keeps the union of what the reconstruction and SnapKV's own scoring of the prompt rank highest
(:func:`united_scores`): the first keeps far facts, the second what the next tokens read; on a model with
sliding-window layers the few global layers keep one such set together (:func:`shared_scores`). docs/retention.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import Tensor, nn

from .. import _compat
from ..errors import InputError, check_int
from .cache import SinkCache
from .plan import RetentionPlan
from .policy import Observation, Prescored, ScoredPolicy, SnapKV

__all__ = ["reconstruction_scores", "prompt_scores", "united_scores", "windowed_plan", "has_sliding_layers", "budgets_from_scores", "hybrid_budgets", "shared_scores", "compressed_prompt"]


#: How far SnapKV's ranking leads the reconstruction ranking in a compressed prompt's kept sets
#: (:func:`united_scores`; docs/retention.md has the measurements it was chosen from).
SNAPKV_LEAD = 0.1


class _MostAttention(ScoredPolicy):
    """Keeps everything; while ``active``, records per layer the most attention (over the forward's queries, averaged
    over the query heads of each key-value head) on stream indices ``0 … length−1``."""

    name = "reconstruction"

    def __init__(self, window: int, length: int) -> None:
        super().__init__(recent=1, window=window)
        self.length = length
        self.needs_weights = False  # the attention weights are computed only while recording (``active``)
        self.best: dict[int, Tensor] = {}
        #: While set, the forward's scores by this SnapKV (its last queries' pooled attention) are recorded instead,
        #: into :attr:`snapped`.
        self.snapkv: SnapKV | None = None
        self.snapped: dict[int, Tensor] = {}

    @property
    def active(self) -> bool:
        return self.needs_weights

    @active.setter
    def active(self, on: bool) -> None:
        self.needs_weights = on

    def score(self, obs: Observation) -> Tensor:
        if self.active and obs.layer is not None and obs.index is not None:
            if self.snapkv is not None:
                self.snapped[obs.layer] = self._by_index(self.snapkv.score(obs)[0], obs.index[0])
            else:
                most = self._by_index(obs.weights[0].amax(1), obs.index[0])  # type: ignore[index]  # needs_weights
                prev = self.best.get(obs.layer)
                self.best[obs.layer] = most if prev is None else torch.maximum(prev, most)
        return torch.zeros(obs.real.shape, dtype=torch.float32, device=obs.real.device)

    def _by_index(self, values: Tensor, idx: Tensor) -> Tensor:
        """``values`` ``[Hkv, N]`` (≥ 0) of the candidates at stream indices ``idx`` ``[Hkv, N]`` (-1: empty), laid out
        on indices ``0 … length−1`` (the most where several candidates share one; 0 where none is)."""
        inside = (idx >= 0) & (idx < self.length)
        return torch.zeros(values.shape[0], self.length, dtype=torch.float32).scatter_reduce(
            -1, idx.clamp(0, self.length - 1), torch.where(inside, values.float(), torch.zeros_like(values.float())),
            "amax")


@torch.no_grad()
def reconstruction_scores(model: nn.Module, prompt: Sequence[int], instruction: Sequence[int], *,
                          num_sinks: int = 4, chunk: int = 512) -> dict[int, Tensor]:
    """Per score-based layer (by the model's layer index), ``[Hkv, T]`` float32: the most attention any query of the
    repeated prompt gives each of the ``T`` prompt tokens, with ``prompt ⧺ instruction`` prefilled and the repeated
    prompt fed ``chunk`` tokens at a time (so the weights held at once are ``chunk × (2T + len(instruction))`` per
    head). ``instruction``: the tokens that ask for the prompt again (e.g. "Repeat the previous context:")."""
    return prompt_scores(model, prompt, instruction, num_sinks=num_sinks, chunk=chunk, snapkv=False)[0]


@torch.no_grad()
def prompt_scores(model: nn.Module, prompt: Sequence[int], instruction: Sequence[int], *, num_sinks: int = 4,
                  chunk: int = 512, snapkv: bool = True) -> tuple[dict[int, Tensor], dict[int, Tensor]]:
    """:func:`reconstruction_scores`, and from the same passes SnapKV's scores of the prompt (its last queries'
    pooled attention, :class:`~sinklab.stream.policy.SnapKV` with its defaults): both per layer, ``[Hkv, T]``
    (``snapkv=False``: the second empty, its weights not computed)."""
    prompt, instruction = [int(t) for t in prompt], [int(t) for t in instruction]
    if not prompt:
        raise InputError("scoring a prompt needs a non-empty prompt")
    check_int("chunk", chunk, 1)
    total = 2 * len(prompt) + len(instruction)
    recorder = _MostAttention(window=chunk, length=len(prompt))
    cache = SinkCache(model, num_sinks=num_sinks, window=max(total, num_sinks + 1), policy=recorder)
    try:
        recorder.snapkv = SnapKV() if snapkv else None
        recorder.window, recorder.active = SnapKV.window, snapkv
        model(input_ids=torch.tensor([prompt]), cache=cache, logits_to_keep=1)
        recorder.snapkv, recorder.window, recorder.active = None, chunk, False
        if instruction:
            model(input_ids=torch.tensor([instruction]), cache=cache, logits_to_keep=1)
        recorder.active = True
        for at in range(0, len(prompt), chunk):
            model(input_ids=torch.tensor([prompt[at:at + chunk]]), cache=cache, logits_to_keep=1)
    finally:
        cache.close()
    return recorder.best, recorder.snapped


def has_sliding_layers(windows: Sequence[int | None]) -> bool:
    """Whether a model whose layers have these sliding windows (None: global attention) has any sliding layer."""
    return any(w is not None for w in windows)


def budgets_from_scores(scores: dict[int, Tensor], plan: RetentionPlan, length: int,
                        windows: Sequence[int | None] | None = None) -> list[list[int] | None]:
    """The plan's total over the layers ``scores`` covers, shared out by the scores themselves: every head keeps its
    sinks and ``plan.recent`` newest tokens, and the rest of the total goes to the best-scored other tokens of any of
    those heads (a token the model needs wins wherever it is). Layers without scores keep the plan's budgets.
    ``windows``: the model's own sliding window per layer (None: global attention); a model with sliding-window
    layers gets :func:`hybrid_budgets` instead."""
    if windows is not None and has_sliding_layers(windows):
        return hybrid_budgets(plan, length, windows)
    layers = [i for i in sorted(scores) if plan.budgets[i] is not None]
    budgets = [list(b) if b is not None else None for b in plan.budgets]
    if not layers:
        return budgets
    idx = torch.arange(length)
    protected = (idx < plan.num_sinks) | (idx >= length - plan.recent)
    floor = int(protected.sum())
    pool = torch.stack([scores[i][:, :length].float() for i in layers])  # (layers, Hkv, T)
    pool = pool.masked_fill(protected, float("-inf"))
    total = sum(sum(b) for i in layers if (b := plan.budgets[i]) is not None)
    free = total - floor * pool.shape[0] * pool.shape[1]
    k = max(0, min(free, int((~protected).sum()) * pool.shape[0] * pool.shape[1]))
    won = torch.zeros(pool.numel(), dtype=torch.long)
    won[torch.topk(pool.flatten(), k).indices] = 1
    counts = won.view(pool.shape).sum(-1)  # (layers, Hkv)
    for row, i in enumerate(layers):
        budgets[i] = [floor + int(c) for c in counts[row]]
    return budgets


def hybrid_budgets(plan: RetentionPlan, length: int, windows: Sequence[int | None]) -> list[list[int] | None]:
    """Budgets for a model with sliding-window layers (Gemma 2/3 …): the plan's total is the same share of every
    layer's own dense size — a sliding layer never sees past its window, so it keeps that share of its window (its
    newest tokens, SnapKV within them) — and the global layers split what is left equally, head by head. A global
    layer is where a far-back token (a needle) can be read at all, and the scores alone hand most of the total to
    the many sliding layers."""
    heads = {i: len(b) for i, b in enumerate(plan.budgets) if b is not None}
    total = sum(sum(b) for b in plan.budgets if b is not None)
    dense = sum(min(length, windows[i] or length) * h for i, h in heads.items())
    floor, share = plan.num_sinks + plan.recent, total / max(dense, 1)
    budgets: list[list[int] | None] = [None] * len(plan.budgets)
    for i, h in heads.items():
        window = windows[i]
        if window is not None:
            budgets[i] = [max(floor, int(share * min(length, window)))] * h
    rest = total - sum(sum(b) for b in budgets if b is not None)
    global_heads = sum(h for i, h in heads.items() if windows[i] is None)
    for i, h in heads.items():
        if windows[i] is None:
            budgets[i] = [max(floor, rest // max(global_heads, 1))] * h
    return budgets


def windowed_plan(model: nn.Module, plan: RetentionPlan, length: int) -> RetentionPlan:
    """``plan`` with its budgets split by window (:func:`hybrid_budgets`) for an ``length``-token prompt when ``model``
    has sliding-window layers; ``plan`` itself otherwise. ``SinkCache(model, policy="auto", plan=windowed_plan(model,
    plan, len(prompt)))`` is SnapKV over that split."""
    check_int("length", length, 1)
    windows = _compat.layer_sliding_windows(model)
    if not has_sliding_layers(windows):
        return plan
    return replace(plan, budgets=hybrid_budgets(plan, length, windows),
                   source={**plan.source, "budgets": f"split by window for {length} tokens"})


def shared_scores(scores: dict[int, Tensor], windows: Sequence[int | None]) -> dict[int, Tensor]:
    """One kept set for the global layers of a model with sliding-window layers: each global layer's scores are
    replaced by the most, over the global layers, of each layer's scores scaled to its own largest: global layers
    that each keep their own best tokens keep different parts of what a question reads (docs/retention.md, "Gemma 3:
    sliding layers, one kept set"). A model without sliding layers, or whose global layers differ in heads, keeps
    its scores."""
    glob = [i for i in sorted(scores) if windows[i] is None]
    if not glob or not has_sliding_layers(windows) or len({tuple(scores[i].shape) for i in glob}) != 1:
        return scores
    scaled = torch.stack([scores[i].float() / scores[i].float().amax(-1, keepdim=True).clamp_min(1e-30) for i in glob])
    one = scaled.amax(0)
    return {**scores, **{i: one.clone() for i in glob}}


def united_scores(first: dict[int, Tensor], second: dict[int, Tensor], lead: float = 0.0) -> dict[int, Tensor]:
    """Per layer of ``first``, each token's rank among its head's tokens by either score, as a share of the head's
    tokens (``0`` worst, ``1`` best), the better of the two — ``first``'s lowered by ``lead`` — so a budget keeps the
    tokens near the top of either list: the union of two kept sets of one size (``lead > 0``: ``second`` first).
    Layers missing from ``second`` keep ``first``'s scores."""
    def share(x: Tensor) -> Tensor:
        return torch.argsort(torch.argsort(x.float(), dim=-1, stable=True), dim=-1).float() / max(x.shape[-1] - 1, 1)

    return {i: torch.maximum(share(s) - lead, share(second[i])) if i in second else s for i, s in first.items()}


@torch.no_grad()
def compressed_prompt(model: nn.Module, prompt: Sequence[int], instruction: Sequence[int], *, num_sinks: int = 4,
                      window: int | None = None, plan: RetentionPlan | None = None, spread: bool = True,
                      chunk: int = 512) -> tuple[SinkCache, Tensor]:
    """A :class:`SinkCache` holding ``prompt`` compressed by :func:`reconstruction_scores` — each head's sinks, its
    newest tokens and the best-scored others up to its budget — and the logits of the prompt's last token. Budgets:
    ``num_sinks + window`` tokens for every head, or a plan's total shared out by the scores
    (:func:`budgets_from_scores`; ``spread=False``: the plan's own per-head budgets). With a plan, the tokens each
    head keeps are ranked by :func:`united_scores` of the reconstruction and SnapKV's (SnapKV leading by
    :data:`SNAPKV_LEAD`), on a model with sliding-window layers one set over the global layers
    (:func:`shared_scores`). Later forwards score by SnapKV."""
    if (plan is None) == (window is None):
        raise InputError("give either window (one budget for every head) or plan (per-head budgets)")
    prompt = [int(t) for t in prompt]
    sinks = plan.num_sinks if plan is not None else num_sinks
    windows = _compat.layer_sliding_windows(model)
    scores, snapped = prompt_scores(model, prompt, instruction, num_sinks=sinks, chunk=chunk, snapkv=plan is not None)
    if plan is not None:
        if spread:  # the budgets follow the reconstruction scores; the kept tokens, either scorer's best
            budgets = budgets_from_scores(shared_scores(scores, windows), plan, len(prompt), windows)
            plan = replace(plan, budgets=budgets, source={**plan.source, "budgets": "reconstruction scores"})
        scores = shared_scores(united_scores(scores, snapped, SNAPKV_LEAD), windows)
        cache = SinkCache(model, policy=Prescored(recent=plan.recent, given=scores), plan=plan)
    else:
        cache = SinkCache(model, num_sinks=num_sinks, window=window, policy=Prescored(given=scores))
    logits = model(input_ids=torch.tensor([prompt]), cache=cache, logits_to_keep=1).logits[0, -1]
    return cache, logits
