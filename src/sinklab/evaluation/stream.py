"""Per-token NLL over a long text, every method on the same positions (StreamingLLM, Xiao et al., arXiv:2309.17453).

Four ways to model a long text, all at the same total cache size ``C = S + W``:

* ``dense`` — full attention over everything so far (no eviction; past the model's trained positions
  this is the baseline the StreamingLLM paper reports to fail);
* ``window`` — a sliding window of ``C`` tokens without sinks (``S = 0``): collapses once the first tokens
  are evicted;
* ``recompute`` — a sliding window with re-computation: each scored token re-encodes its last ``C``
  tokens from scratch at positions ``0 … C − 1`` (exact but O(C) per token, so usually strided);
* ``sinks`` — StreamingLLM: ``S`` sinks + a window of ``W = C − S``, for every sink count asked for
  (``sinks=(0, 1, 2, 4, 8)`` is the paper's ablation at equal cache size).

Token ``t`` is *scored* by the NLL of ``ids[t]`` given ``ids[:t]``. The scored positions start at
``C + 1``, the first token whose context has lost a token to eviction, and run to the end of the text
(every ``stride``-th one). Every method is scored on exactly those positions. Dense and the streams use
chunked prefill (exact per query: equal to feeding the tokens one by one) and compute the LM head only
at scored positions; recompute encodes one window per scored position, several windows per forward.
"""

from __future__ import annotations

import inspect
import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from .. import _compat
from ..errors import InputError, check_int, is_int
from ..stream.cache import SinkCache
from ..stream.policy import POLICIES

__all__ = ["METHODS", "METHOD_TABLE", "Curve", "EvalPlan", "Method", "Run", "StreamEval", "binned_nll", "dense_nll",
           "check_methods", "check_sinks", "evaluate_stream", "recompute_nll", "stream_nll"]

_AUTO_RECOMPUTE_POSITIONS = 128  # auto stride: at most this many recompute windows
Progress = Callable[[str, int], None]  # (phase label, units of work done since the last call)
Advance = Callable[[int], None]  # units of work done since the last call


@dataclass(frozen=True)
class Run:
    """One curve to compute: a method and, for the streams, its sinks ``S`` and window ``W`` (``S + W = C``)."""

    label: str
    method: str
    num_sinks: int | None = None
    window: int | None = None
    same_as: str | None = None  # label of an identical run whose NLLs are reused (sinks S=0 is the window)
    policy: str = "streaming"  # the retention policy of a stream (sinklab.stream.policy)


@dataclass(frozen=True)
class Method:
    """One way to model a long text: a row of :data:`METHOD_TABLE` (a new method is one row).

    ``runs(plan)`` lists its curves in a plan; ``nll(model, ids, positions, run, plan, advance)`` scores one
    curve (NLL ``[P]`` at ``positions``); ``per_position``: it encodes one window of ``C`` tokens per scored
    position (recompute) instead of feeding the text once.
    """

    name: str
    runs: Callable[[EvalPlan], list[Run]]
    nll: Callable[[nn.Module, Tensor, Tensor, Run, EvalPlan, Advance | None], Tensor]
    per_position: bool = False


def _sink_runs(plan: EvalPlan) -> list[Run]:
    c = plan.cache_size
    return [Run(f"sinks S={s}", "sinks", s, c - s, "window" if s == 0 and "window" in plan.methods else None)
            for s in plan.sinks]


def _policy_runs(plan: EvalPlan) -> list[Run]:
    s = max(plan.sinks)
    return [Run(f"{p} S={s}", "policies", s, plan.cache_size - s, policy=p) for p in plan.policies]


def _stream(model: nn.Module, ids: Tensor, positions: Tensor, run: Run, plan: EvalPlan, advance: Advance | None) -> Tensor:
    return stream_nll(model, ids, positions, run.num_sinks, run.window, plan.chunk_size, advance,  # type: ignore[arg-type]
                      policy=run.policy)  # (a streamed run has its S and W)


#: method name → :class:`Method`, in table order (the order of the plan's methods and of the results).
METHOD_TABLE: dict[str, Method] = {m.name: m for m in (
    Method("dense", lambda plan: [Run("dense", "dense")],
           lambda model, ids, pos, run, plan, advance: dense_nll(model, ids, pos, plan.chunk_size, advance)),  # type: ignore[has-type]
    Method("window", lambda plan: [Run("window", "window", 0, plan.cache_size)], _stream),
    Method("recompute", lambda plan: [Run("recompute", "recompute")],
           lambda model, ids, pos, run, plan, advance: recompute_nll(model, ids, pos, plan.cache_size, advance=advance),  # type: ignore[has-type]
           per_position=True),
    Method("sinks", _sink_runs, _stream),
    Method("policies", _policy_runs, _stream),
)}
METHODS = tuple(METHOD_TABLE)


def check_methods(names: Sequence[str]) -> tuple[str, ...]:
    """Method names (a sequence such as ``("dense", "sinks")``), returned in :data:`METHODS` order; unknown or no
    names raise."""
    names = _sequence("methods", names, "method names such as ('dense', 'sinks')")
    unknown = sorted(set(names) - set(METHODS))
    if unknown or not names:
        raise InputError(f"methods: unknown or empty {unknown or list(names)!r}; choose from {', '.join(METHODS)}")
    return tuple(m for m in METHODS if m in names)


def check_sinks(counts: Sequence[int]) -> tuple[int, ...]:
    """Sink counts (a sequence such as ``(0, 1, 2, 4, 8)``), duplicates dropped, order kept; none, a negative
    count or a non-integer raise."""
    counts = _sequence("sinks", counts, "sink counts such as (0, 1, 2, 4, 8)")
    if not counts or not all(is_int(s) and s >= 0 for s in counts):
        raise InputError(f"sinks needs one or more counts ≥ 0, got {counts!r}")
    return tuple(dict.fromkeys(int(s) for s in counts))


def _sequence(name: str, value, meaning: str) -> tuple:
    """``value`` as a tuple; a string (a comma list is the command line's to split) is an error."""
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise InputError(f"{name} is a sequence of {meaning}, got {value!r}")
    return tuple(value)


@dataclass(frozen=True)
class EvalPlan:
    """What to evaluate; validated on construction (so a CLI can check it before loading a model).

    Parameters
    ----------
    methods:
        A subset of :data:`METHODS`.
    sinks:
        Sink counts for ``sinks``; each runs with window ``cache_size − S``.
    cache_size:
        ``C``, the total tokens every bounded method keeps (sinks + window, window-only, recompute).
    stride:
        Score every ``stride``-th position; ``None`` picks 1, or with ``recompute`` the smallest stride that
        keeps recompute at ≤ 128 windows.
    start:
        First scored position; ``None`` is ``C + 1`` (the first token that lost context to eviction).
    chunk_size:
        Tokens per forward in the chunked prefill of dense and the streams.
    policies:
        Score-based retention policies (``snapkv``, ``tova``, ``knorm``) streamed at ``S = max(sinks)``,
        ``W = cache_size − S`` beside the others (the ``policies`` method, added when any is given).
    """

    methods: Sequence[str] = METHODS
    sinks: Sequence[int] = (4,)
    cache_size: int = 1024
    stride: int | None = None
    start: int | None = None
    chunk_size: int = 256
    policies: Sequence[str] = ()

    def __post_init__(self) -> None:
        policies = _sequence("policies", self.policies, "policy names such as ('snapkv', 'tova')")
        named = [p for p in POLICIES if p != "streaming"]
        wrong = [p for p in policies if p not in named]
        if wrong:
            raise InputError(f"policies: {', '.join(map(repr, wrong))} cannot be evaluated here; choose from "
                             f"{', '.join(named)} (streaming is the sinks method; auto needs a plan: "
                             "SinkCache(plan=...) or sinklab stream)")
        object.__setattr__(self, "policies", policies)
        methods = _sequence("methods", self.methods, "method names such as ('dense', 'sinks')")
        if policies and "policies" not in methods:
            methods = (*methods, "policies")
        object.__setattr__(self, "methods", check_methods(methods))
        object.__setattr__(self, "sinks", check_sinks(self.sinks))
        check_int("the cache size S + W", self.cache_size, 2)
        if max(self.sinks) >= self.cache_size:
            raise InputError(f"every sink count must leave a window: S < S + W = {self.cache_size}, got {max(self.sinks)}")
        if self.stride is not None:
            check_int("stride", self.stride, 1)
        if self.start is not None:
            check_int("the first scored position", self.start, 1)
        check_int("chunk_size", self.chunk_size, 1)

    @property
    def first(self) -> int:
        return self.cache_size + 1 if self.start is None else self.start

    def positions(self, num_tokens: int) -> Tensor:
        """Scored target positions ``[P]`` for a text of ``num_tokens`` tokens (the same for every method)."""
        if num_tokens <= self.first:
            raise InputError(
                f"the text has {num_tokens} tokens but scoring starts at position {self.first} (after the first "
                f"eviction at cache size {self.cache_size}): give a longer text or a smaller cache")
        return torch.arange(self.first, num_tokens, self.resolved_stride(num_tokens))

    def resolved_stride(self, num_tokens: int) -> int:
        if self.stride is not None:
            return self.stride
        if "recompute" not in self.methods:
            return 1
        return max(1, math.ceil((num_tokens - self.first) / _AUTO_RECOMPUTE_POSITIONS))

    def runs(self) -> list[Run]:
        """The curves, in table order; ``sinks S=0`` reuses ``window`` when both are asked for."""
        return [run for m in self.methods for run in METHOD_TABLE[m].runs(self)]

    def work(self, num_tokens: int) -> int:
        """Units of work (tokens encoded) of the whole evaluation: the progress bar's total."""
        pos = self.positions(num_tokens)
        fed = int(pos[-1])  # dense and streams encode ids[:last scored position]
        total = 0
        for run in self.runs():
            if run.same_as is None:
                total += len(pos) if METHOD_TABLE[run.method].per_position else fed
        return total


@dataclass
class Curve:
    """Per-token NLL of one run at the plan's positions."""

    run: Run
    nll: Tensor  # (P,) float32, nats
    seconds: float
    tokens_encoded: int

    @property
    def mean_nll(self) -> float:
        return float(self.nll.double().mean())

    @property
    def ppl(self) -> float:
        return math.exp(min(self.mean_nll, 700.0))


@dataclass
class StreamEval:
    """Result of :func:`evaluate_stream`: every curve on the same ``positions``."""

    plan: EvalPlan
    num_tokens: int
    positions: Tensor  # (P,) scored target positions
    curves: list[Curve]
    trained_positions: int | None = None  # the model's max_position_embeddings, if it has one
    meta: dict = field(default_factory=dict)
    quality: dict = field(default_factory=dict)  # sinklab.evaluation.quality.evaluate_quality's tables, when run

    def curve(self, label: str) -> Curve:
        return next(c for c in self.curves if c.run.label == label)

    def to_json(self, bins: int | None = None) -> dict:
        """JSON-ready dict; ``bins`` for the binned curves defaults to one per 8 scored tokens, at most 48."""
        pos = self.positions
        bins = bins or min(48, max(1, pos.numel() // 8))
        stride = self.plan.resolved_stride(self.num_tokens)
        curves = {}
        for c in self.curves:
            centres, means = binned_nll(pos, c.nll, bins)
            curves[c.run.label] = {
                "method": c.run.method, "num_sinks": c.run.num_sinks, "window": c.run.window, "same_as": c.run.same_as,
                "scored": int(c.nll.numel()), "mean_nll": c.mean_nll, "ppl": c.ppl, "seconds": c.seconds,
                "seconds_per_scored_token": c.seconds / max(1, c.nll.numel()), "tokens_encoded": c.tokens_encoded,
                "binned": {"position": centres, "mean_nll": means},
                "nll": [round(float(x), 4) for x in c.nll],
            }
        return {
            "format": "sinklab.eval_stream/2",
            "num_tokens": self.num_tokens, "cache_size": self.plan.cache_size, "sinks": list(self.plan.sinks),
            "methods": list(self.plan.methods), "chunk_size": self.plan.chunk_size,
            "positions": {"first": int(pos[0]), "last": int(pos[-1]), "stride": stride, "count": int(pos.numel()),
                          "windows_spanned": (int(pos[-1]) - int(pos[0]) + 1) / self.plan.cache_size},
            "trained_positions": self.trained_positions,
            "scored_positions": pos.tolist(),
            "curves": curves,
            **({"quality": self.quality} if self.quality else {}),
            **self.meta,
        }


def binned_nll(positions: Tensor, nll: Tensor, bins: int = 48) -> tuple[list[float], list[float]]:
    """Mean NLL in ``bins`` equal-count bins of consecutive scored positions: (bin centre positions, means)."""
    n = int(positions.numel())
    if n == 0:
        return [], []
    edges = torch.linspace(0, n, min(bins, n) + 1).round().long().tolist()
    centres, means = [], []
    for a, b in itertools.pairwise(edges):
        if b > a:
            centres.append(float(positions[a:b].double().mean()))
            means.append(float(nll[a:b].double().mean()))
    return centres, means


# ---------------------------------------------------------------------------------------------- methods
def _nll(logits: Tensor, targets: Tensor) -> Tensor:
    return torch.nn.functional.cross_entropy(logits.float(), targets.to(logits.device), reduction="none").cpu()


def _keeps_logits(model: nn.Module) -> bool:
    return "logits_to_keep" in inspect.signature(model.forward).parameters


def _chunked_nll(model: nn.Module, ids: Tensor, positions: Tensor, chunk_size: int, cache,
                 advance: Callable[[int], None] | None) -> Tensor:
    """Feed ``ids[:positions[-1]]`` in chunks through ``cache``; NLL of ``ids[t]`` for each ``t`` in ``positions``.

    ``cache=None`` is dense attention: the first forward creates the model's own cache, later ones extend it.
    """
    device = _compat.input_device(model)
    name = _compat.cache_kwarg_name(model)
    keep = _keeps_logits(model)
    end = int(positions[-1])  # the query predicting ids[end] is token end − 1
    out = []
    for c0 in range(0, end, chunk_size):
        c1 = min(end, c0 + chunk_size)
        want = positions[(positions >= c0 + 1) & (positions <= c1)]  # targets predicted inside this chunk
        local = want - 1 - c0  # (k,) query index within the chunk
        kwargs = {"input_ids": ids[None, c0:c1].to(device), "use_cache": True}
        if cache is not None:
            kwargs[name] = cache
        if keep:  # the LM head only where a token is scored (one dummy row when none is)
            kwargs["logits_to_keep"] = local.to(device) if local.numel() else torch.tensor([c1 - c0 - 1], device=device)
        output = model(**kwargs)
        logits = output.logits[0]  # (k, V), or (c1 − c0, V) without logits_to_keep
        if not keep:
            logits = logits[local.to(logits.device)]
        if local.numel():
            out.append(_nll(logits[: local.numel()], ids[want]))
        if cache is None:
            cache = _compat.output_cache(output)
        if advance:
            advance(c1 - c0)
    return torch.cat(out)


@torch.no_grad()
def dense_nll(model: nn.Module, ids: Tensor, positions: Tensor, chunk_size: int = 256,
              advance: Callable[[int], None] | None = None) -> Tensor:
    """NLL ``[P]`` at ``positions`` with full attention over everything before (chunked prefill, no eviction)."""
    return _chunked_nll(model, ids, positions, chunk_size, None, advance)


@torch.no_grad()
def stream_nll(model: nn.Module, ids: Tensor, positions: Tensor, num_sinks: int, window: int, chunk_size: int = 256,
               advance: Callable[[int], None] | None = None, policy: str = "streaming") -> Tensor:
    """NLL ``[P]`` at ``positions`` with a StreamingLLM cache of ``num_sinks`` sinks + ``window`` (chunks are exact),
    or another retention ``policy`` at the same budget."""
    with SinkCache(model, num_sinks=num_sinks, window=window, policy=policy) as cache:
        return _chunked_nll(model, ids, positions, chunk_size, cache, advance)


@torch.no_grad()
def recompute_nll(model: nn.Module, ids: Tensor, positions: Tensor, context: int, batch_tokens: int = 8192,
                  advance: Callable[[int], None] | None = None) -> Tensor:
    """NLL ``[P]`` at ``positions``, each from a fresh forward over its last ``context`` tokens (positions 0 … C−1).

    Windows of full length are batched (``batch_tokens`` tokens per forward); ``advance`` counts windows.
    """
    device = _compat.input_device(model)
    keep = _keeps_logits(model)
    out = []
    per_batch = max(1, batch_tokens // context)
    full = positions[positions >= context]
    short = positions[positions < context]
    for t in short.tolist():  # only when scoring starts before the cache is full (not the default plan)
        logits = model(input_ids=ids[None, :t].to(device), use_cache=False).logits[0, -1:]
        out.append(_nll(logits, ids[t : t + 1]))
        if advance:
            advance(1)
    for b0 in range(0, full.numel(), per_batch):
        targets = full[b0 : b0 + per_batch]  # (B,)
        rows = targets[:, None] - context + torch.arange(context)  # (B, C) token indices of each window
        kwargs = {"input_ids": ids[rows].to(device), "use_cache": False}
        if keep:
            kwargs["logits_to_keep"] = 1
        logits = model(**kwargs).logits[:, -1]  # (B, V)
        out.append(_nll(logits, ids[targets]))
        if advance:
            advance(targets.numel())
    return torch.cat(out)


def evaluate_stream(model: nn.Module, ids: Tensor, plan: EvalPlan | None = None, *,
                    progress: Progress | None = None) -> StreamEval:
    """Score every run of ``plan`` on the same positions of ``ids`` (``[N]`` token ids).

    ``progress(label, n)`` is called as work is done; the total is ``plan.work(N)``.
    """
    plan = plan or EvalPlan()
    if ids.dim() != 1:
        raise InputError(f"eval-stream needs a 1-D token sequence, got shape {tuple(ids.shape)}")
    ids = ids.long().cpu()
    positions = plan.positions(ids.numel())
    model.eval()
    curves: list[Curve] = []
    for run in plan.runs():
        if run.same_as is not None:
            twin = next(c for c in curves if c.run.label == run.same_as)
            curves.append(Curve(run, twin.nll, 0.0, 0))
            continue
        advance = (lambda n, label=run.label: progress(label, n)) if progress else None
        method = METHOD_TABLE[run.method]
        t0 = time.perf_counter()
        nll = method.nll(model, ids, positions, run, plan, advance)
        if not bool(torch.isfinite(nll).all()):
            raise InputError(f"{run.label}: non-finite NLL (the model produced NaN/inf logits)")
        encoded = positions.numel() * plan.cache_size if method.per_position else int(positions[-1])
        curves.append(Curve(run, nll, time.perf_counter() - t0, encoded))
    trained = _compat.config_get(model.config, "max_position_embeddings", "n_positions", default=None)
    return StreamEval(plan, int(ids.numel()), positions, curves, int(trained) if trained else None)
