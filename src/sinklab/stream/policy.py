"""What each attention head of a stream keeps: retention policies behind one contract.

:class:`Recency` (StreamingLLM: the sinks, the pinned spans and the ``W`` newest, the ring buffer of
:class:`~sinklab.stream.state.StreamState`) or a :class:`ScoredPolicy` (the sinks, pinned spans and ``recent`` newest,
then the best-scored others, from an :class:`Observation` of each forward). A new policy: one subclass of
:class:`ScoredPolicy` and one row in :data:`POLICIES` (docs/retention.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import InputError, check_int

__all__ = ["Observation", "RetentionPolicy", "Recency", "ScoredPolicy", "SnapKV", "Prescored", "TOVA", "KeyNorm",
           "POLICIES", "get_policy", "policy_names"]


@dataclass
class Observation:
    """What a score-based policy sees of ``N`` candidates (a layer's kept tokens, then the forward's new ones):
    ``weights`` ``[B, Hkv, w, N]`` float32, the last ``w`` queries' attention averaged per key-value head (None unless
    ``needs_weights``); ``keys``/``values`` as stored; ``real`` ``[B, Hkv, N]`` (False: empty or padding); ``order``, the
    candidates by stream index, real ones first (what :func:`along_stream` pools along); ``index`` ``[B, Hkv, N]``, each
    candidate's stream index (-1: empty), and ``layer``, the model's layer index (None outside a stream)."""

    weights: Tensor | None
    keys: Tensor
    values: Tensor
    real: Tensor
    order: Tensor
    index: Tensor | None = None
    layer: int | None = None


def along_stream(scores: Tensor, obs: Observation, fn) -> Tensor:
    """Apply ``fn`` (``[B·Hkv, 1, N] → same``) to ``scores`` ``[B, Hkv, N]`` laid out in stream order, and put the
    result back at each candidate's place."""
    b, h, n = scores.shape
    ordered = scores.gather(-1, obs.order)
    ordered = torch.where(obs.real.gather(-1, obs.order), ordered, torch.zeros_like(ordered))
    out = fn(ordered.reshape(b * h, 1, n)).reshape(b, h, n)
    return torch.empty_like(out).scatter_(-1, obs.order, out)


class RetentionPolicy:
    """The contract every policy meets: a ``name`` and whether it scores (``scored``)."""

    name: str = ""
    scored: bool = False
    needs_weights: bool = False


@dataclass
class Recency(RetentionPolicy):
    """StreamingLLM (Xiao et al., 2024): the sinks, the pinned spans and the most recent tokens; no scores."""

    name = "streaming"


@dataclass
class ScoredPolicy(RetentionPolicy):
    """A policy that keeps the best-scored tokens (higher = kept) besides the sinks, pinned spans and ``recent``.

    ``window`` is the number of last queries whose attention weights :meth:`score` receives (1: the newest query
    only). ``recent`` newest tokens are always kept (at least 1: the token just written)."""

    recent: int = 8
    window: int = 1
    scored: bool = field(default=True, init=False)

    def __post_init__(self) -> None:
        check_int("recent", self.recent, 1, " (the newest tokens a score-based policy always keeps)")
        check_int("window", self.window, 1, " (queries whose attention scores the keys)")

    def score(self, obs: Observation) -> Tensor:
        """``[B, Hkv, N]`` float: how much each candidate is worth keeping."""
        raise NotImplementedError


@dataclass
class SnapKV(ScoredPolicy):
    """SnapKV (Li et al., 2024): the attention of an observation window of the last queries, averaged, then pooled
    over neighbouring tokens so a selected token brings its context. While decoding past the budget the window is
    the queries of each forward (one per step)."""

    name = "snapkv"
    needs_weights = True
    recent: int = 32
    window: int = 32
    kernel: int = 7

    def score(self, obs: Observation) -> Tensor:
        mean = obs.weights.mean(2)  # type: ignore[union-attr]  # (B, Hkv, N); needs_weights: given
        k = self.kernel
        if k <= 1:
            return mean

        def pool(x: Tensor) -> Tensor:
            return F.avg_pool1d(x, k, stride=1, padding=k // 2, count_include_pad=False)
        # The mean over the real neighbours only: empty slots after the newest token are not neighbours.
        return along_stream(mean, obs, pool) / along_stream(obs.real.float(), obs, pool).clamp_min(1e-12)


@dataclass
class Prescored(SnapKV):
    """SnapKV whose scores for the stream's first tokens are given: ``given[layer]`` ``[Hkv, T]`` scores stream
    indices ``0 … T−1`` of that layer (e.g. :func:`sinklab.stream.prefill.reconstruction_scores`, query-agnostic),
    used the first time the layer scores them; every other candidate, and every later forward, is scored by SnapKV.
    The given scores are dropped once each layer used them; the stream then saves as a SnapKV stream."""

    given: dict[int, Tensor] = field(default_factory=dict)

    def score(self, obs: Observation) -> Tensor:
        own = super().score(obs)
        scores = self.given.pop(obs.layer, None) if obs.layer is not None else None
        if scores is None or obs.index is None:
            return own
        t = scores.shape[-1]
        inside = (obs.index >= 0) & (obs.index < t)
        picked = scores.to(own)[None].expand(obs.index.shape[0], -1, -1).gather(-1, obs.index.clamp(0, t - 1))
        return torch.where(inside, picked, own)

    def as_row(self) -> SnapKV:
        """The row of :data:`POLICIES` this policy saves as."""
        return SnapKV(recent=self.recent, window=self.window, kernel=self.kernel)


@dataclass
class TOVA(ScoredPolicy):
    """TOVA (Oren et al., 2024): evict the token the newest query attends to least (the H2O family without the
    accumulation)."""

    name = "tova"
    needs_weights = True

    def score(self, obs: Observation) -> Tensor:
        return obs.weights[:, :, -1]  # type: ignore[index]  # needs_weights: given


@dataclass
class KeyNorm(ScoredPolicy):
    """Key norm (Devoto et al., 2024): keys of small L2 norm draw the most attention, so keep the smallest norms.
    Needs no attention weights (runs beside the fused kernel). Rotation keeps a key's norm, so the stored
    (rotated) keys give the same scores as the model's own."""

    name = "knorm"

    def score(self, obs: Observation) -> Tensor:
        return -obs.keys.float().norm(dim=-1)


#: Every policy by name: ``SinkCache(model, policy=NAME)`` and ``--policy NAME``. ``auto`` is built from a plan
#: (:mod:`sinklab.stream.plan`): per-head budgets from the scan, scored with SnapKV.
POLICIES: dict[str, type[RetentionPolicy]] = {
    "streaming": Recency,
    "snapkv": SnapKV,
    "tova": TOVA,
    "knorm": KeyNorm,
}


def policy_names() -> list[str]:
    return [*POLICIES, "auto"]


def get_policy(policy) -> RetentionPolicy:
    """A policy object from a name in :data:`POLICIES` or an object (returned as is)."""
    if isinstance(policy, RetentionPolicy):
        return policy
    if policy is None:
        return Recency()
    if isinstance(policy, str) and policy in POLICIES:
        return POLICIES[policy]()
    raise InputError(f"unknown retention policy {policy!r}; the policies are: {', '.join(policy_names())} "
                     "(or a sinklab.stream.policy.RetentionPolicy object)")
