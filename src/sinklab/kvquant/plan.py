"""Which cached tokens stay in full precision: the protection plan and sink detection (pure tensor functions)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..errors import InputError, check_int, check_spans
from ..metrics import eligible_columns

__all__ = ["Protection", "sink_positions", "PROTECTIONS", "SINK_EPS", "SINK_SHARE"]

#: Protection names the analysis compares: nothing kept, the first ``S`` tokens, the detected sinks.
PROTECTIONS = ("none", "first", "detected")

#: Sink detection for the quantization plan: a position is a sink when it receives more than ``SINK_EPS`` of the
#: attention in at least ``SINK_SHARE`` of the layer×head pairs. ε = 0.2 (not the 0.3 of the scans): Gemma 3 in
#: a window without ``<bos>`` has delimiter sinks that reach 0.2–0.3 in a few heads only, and keeping them exact
#: in every layer lowers the 2-bit error there (measured on windows the benchmark does not score: docs/kv-quant.md).
SINK_EPS = 0.2
SINK_SHARE = 0.1


@dataclass(frozen=True)
class Protection:
    """Stream positions kept in full precision: the first ``first`` tokens, half-open ``spans`` and ``positions``.

    >>> Protection(first=1, spans=((5, 7),), positions=(9,)).mask(torch.arange(10)).nonzero().flatten().tolist()
    [0, 5, 6, 9]
    """

    first: int = 0
    spans: tuple[tuple[int, int], ...] = ()
    positions: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        check_int("the number of first tokens to protect", self.first)
        if any(p < 0 for p in self.positions):
            raise InputError(f"protected positions must be ≥ 0, got {sorted(self.positions)}")
        object.__setattr__(self, "spans", tuple(check_spans(self.spans, "protected", overlapping=True)))
        object.__setattr__(self, "positions", tuple(sorted({int(p) for p in self.positions})))

    def mask(self, positions: Tensor) -> Tensor:
        """Boolean ``[N]``: which of the stream ``positions`` ``[N]`` are protected."""
        out = positions < self.first
        for start, end in self.spans:
            out |= (positions >= start) & (positions < end)
        if self.positions:
            out |= torch.isin(positions, torch.tensor(self.positions, device=positions.device))
        return out

    def describe(self) -> str:
        parts = [f"first {self.first}"] if self.first else []
        parts += [f"span {a}–{b - 1}" for a, b in self.spans]
        if self.positions:
            parts.append("positions " + ", ".join(map(str, self.positions)))
        return "; ".join(parts) or "nothing"


def sink_positions(column_mass: Tensor, column_queries: Tensor, eps: float = SINK_EPS,
                   share: float = SINK_SHARE, limit: int = 8) -> list[int]:
    """Positions that receive more than ``eps`` of the attention in at least ``share`` of the heads.

    Parameters
    ----------
    column_mass:
        ``[L, H, T]`` mean attention each key receives from the queries that see it (one sample).
    column_queries:
        ``[L, T]`` (or ``[T]``) number of real queries that see each key; keys seen by too few queries
        (the last ones of a causal sequence, see :func:`sinklab.metrics.eligible_columns`) never count.
    eps:
        Column-mass threshold of a sinking head.
    share:
        Fraction of the ``L × H`` layer-head pairs that must sink on a position.
    limit:
        At most this many positions, the most shared first.

    Returns
    -------
    Sorted positions.
    """
    queries = column_queries if column_queries.dim() == 2 else column_queries.expand(column_mass.shape[0], -1)
    eligible = eligible_columns(queries, queries.amax(-1))  # (L, T)
    sinking = (column_mass.nan_to_num(0.0) > eps) & eligible[:, None, :]  # (L, H, T)
    rate = sinking.double().mean(dim=(0, 1))  # (T,)
    order = torch.argsort(rate, descending=True, stable=True)[:limit]
    return sorted(int(p) for p in order if float(rate[p]) >= share and float(rate[p]) > 0)
