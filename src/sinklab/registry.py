"""The metric registry: one row per per-layer summary, picked up by the CLI table, scan.json and the report.

A row names a metric, says what it is, and reduces a scan's statistics to one value per layer with the
pure functions of :mod:`sinklab.metrics`. Add a metric by adding a function there and a row here.

The registry sits below the analyses: it reads any object with the fields and methods of
:class:`ScanStatistics` (which :class:`sinklab.scan.ScanResult` provides) and never imports the scan.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from . import metrics

__all__ = ["MetricRow", "REGISTRY", "per_layer_table", "ScanStatistics"]


class ScanStatistics(Protocol):
    """What a registry row reads (shapes: ``S`` samples, ``L`` layers, ``H`` heads, ``T`` positions)."""

    column_min: Tensor  # (S, L, H, T)
    routed_fraction: Tensor  # (S, L, H, T)
    value_norm: Tensor  # (S, L, H, T)
    value_norm_out: Tensor  # (S, L, H, T)
    update_spectrum: Tensor  # (S, L, H, r)
    common_mode: Tensor  # (S, L, H)
    learned_sink_mass: Tensor  # (S, L, H)
    hidden_norm: Tensor  # (S, L+1, T)
    hidden_max_abs: Tensor  # (S, L+1, T)
    hidden_median_abs: Tensor  # (S, L+1)
    token_mask: Tensor  # (S, T)
    qk_spectrum: Tensor  # (L, H, dh)
    meta: dict  # meta["thresholds"]: the scan's thresholds

    def sink_rate_per_layer(self, position: int = 0, eps: float | None = None) -> Tensor: ...

    def dominant_columns(self) -> Tensor: ...

    def sink_strength(self) -> Tensor: ...


@dataclass(frozen=True)
class MetricRow:
    """One per-layer summary: ``compute(result) -> [L]`` float64 tensor."""

    name: str
    title: str
    description: str
    compute: Callable[[ScanStatistics], Tensor]
    fmt: str = "{:.2f}"
    terminal: bool = False  # also shown in the CLI's table (all rows go to JSON and the report)
    hidden: bool = False  # read off the block outputs (defined for every layer), not off attention


def _nanmean(x: Tensor, dims: tuple[int, ...]) -> Tensor:
    return x.double().nanmean(dim=dims)


def _sink_strength(r: ScanStatistics) -> Tensor:
    return _nanmean(r.sink_strength(), (0, 2))


def _top_position(r: ScanStatistics) -> Tensor:
    dom = r.dominant_columns()  # (S, L, H)
    return torch.stack([dom[:, layer].flatten().mode().values for layer in range(dom.shape[1])]).double()


def _top_position_share(r: ScanStatistics) -> Tensor:
    dom = r.dominant_columns()
    top = _top_position(r).long()
    return (dom == top[None, :, None]).double().mean(dim=(0, 2)) * 100.0


def _eps_sink_pct(r: ScanStatistics) -> Tensor:
    hit = metrics.is_eps_sink(r.column_min, r.meta["thresholds"]["eps_event"]).any(-1)  # (S, L, H)
    return hit.double().mean(dim=(0, 2)) * 100.0


def _relaxed_sink_pct(r: ScanStatistics) -> Tensor:
    hit = metrics.is_relaxed_sink(r.routed_fraction, r.meta["thresholds"]["relaxed_share"]).any(-1)
    return hit.double().mean(dim=(0, 2)) * 100.0


def _value_ratio(r: ScanStatistics, norms: Tensor) -> Tensor:
    ratio = metrics.value_norm_ratio(norms.double(), r.dominant_columns(), r.token_mask[:, None, None, :])
    return _nanmean(ratio, (0, 2))


def _srank(r: ScanStatistics) -> Tensor:
    return _nanmean(metrics.stable_rank_from_singular_values(r.update_spectrum), (0, 2))


def _rank1(r: ScanStatistics) -> Tensor:
    return _nanmean(metrics.rank1_energy_from_singular_values(r.update_spectrum), (0, 2))


def _qk_ratio(r: ScanStatistics) -> Tensor:
    return metrics.sigma_ratio(r.qk_spectrum.double()).nanmean(dim=1)


def _hidden_norm_ratio0(r: ScanStatistics) -> Tensor:
    norms = r.hidden_norm[:, 1:].double()  # (S, L, T) block outputs
    rest = norms[..., 1:].nanmedian(dim=-1).values
    return (norms[..., 0] / rest).nanmean(dim=0)


def _massive(r: ScanStatistics) -> Tensor:
    t = r.meta["thresholds"]
    flag = metrics.is_massive(
        r.hidden_max_abs[:, 1:].double(), r.hidden_median_abs[:, 1:].double(),
        abs_threshold=t["massive_abs"], ratio=t["massive_ratio"],
    )
    return flag.double().sum(-1).mean(0)


def _max_act(r: ScanStatistics) -> Tensor:
    return r.hidden_max_abs[:, 1:].double().nan_to_num(0.0).amax(dim=(0, 2))


def _high_norm(r: ScanStatistics) -> Tensor:
    flag = metrics.high_norm_tokens(r.hidden_norm[:, 1:].double(), r.token_mask[:, None, :], k=r.meta["thresholds"]["high_norm_k"])
    return flag.double().sum(-1).mean(0)


def _learned_sink(r: ScanStatistics) -> Tensor:
    return _nanmean(r.learned_sink_mass, (0, 2))


REGISTRY: list[MetricRow] = [
    MetricRow("sink_rate_0", "Sink^ε(0) %", "share of heads with column mass at position 0 > ε (Gu et al. Sink_1)",
              lambda r: r.sink_rate_per_layer(0), "{:.1f}", terminal=True),
    MetricRow("sink_strength", "strength", "mean over samples and heads of the dominant column's mass", _sink_strength, terminal=True),
    MetricRow("top_position", "top pos", "most common dominant key position", _top_position, "{:.0f}", terminal=True),
    MetricRow("top_position_pct", "top pos %", "share of (sample, head) whose dominant column is the top position",
              _top_position_share, "{:.0f}", terminal=True),
    MetricRow("eps_sink_pct", "ε-sink %", "share of (sample, head) with a strict ε-sink event (min_i A_is ≥ 1−ε)",
              _eps_sink_pct, "{:.0f}"),
    MetricRow("relaxed_sink_pct", "relaxed %", "share of (sample, head) where ≥ 90 % of queries put ≥ 0.5 on one column",
              _relaxed_sink_pct, "{:.0f}"),
    MetricRow("value_norm_ratio", "‖v‖ ratio", "head-space value-norm ratio at the dominant column",
              lambda r: _value_ratio(r, r.value_norm)),
    MetricRow("value_norm_ratio_out", "‖W_O v‖ ratio", "output-space value-norm ratio at the dominant column",
              lambda r: _value_ratio(r, r.value_norm_out), terminal=True),
    MetricRow("update_stable_rank", "srank", "stable rank of the head's output-space update", _srank, terminal=True),
    MetricRow("update_rank1_energy", "rank-1 E", "σ₁²/Σσ² of the head's output-space update", _rank1),
    MetricRow("common_mode", "common", "common-mode fraction of the head's update", lambda r: _nanmean(r.common_mode, (0, 2))),
    MetricRow("qk_sigma_ratio", "QK σ₁/σ₂", "mean over heads of σ₁/σ₂ of Wq_hᵀ·Wk_h", _qk_ratio),
    MetricRow("hidden_norm_ratio_0", "‖x₀‖/med", "position 0's hidden norm over the median of the others (block output)",
              _hidden_norm_ratio0, terminal=True, hidden=True),
    MetricRow("massive_tokens", "massive", "tokens per sample with a massive activation (|a|>100, ≥1000× median)", _massive, hidden=True),
    MetricRow("max_activation", "max |a|", "largest |activation| in the block output", _max_act, "{:.1f}", terminal=True, hidden=True),
    MetricRow("high_norm_tokens", "high-norm", "tokens per sample with norm > median + k·1.4826·MAD", _high_norm, hidden=True),
    MetricRow("learned_sink_mass", "learned sink", "mean 1 − Σ_j A_ij: attention on learned slots, not tokens (sink logit, softmax₁, kv-bias)", _learned_sink, "{:.3f}", terminal=True),
]


def per_layer_table(result: ScanStatistics) -> dict[str, list[float | None]]:
    """``{metric name: [value per layer]}`` for every registry row (NaN → ``None``)."""
    kinds = getattr(result, "layer_kinds", None) or []
    table = {}
    for row in REGISTRY:
        values = row.compute(result).double().tolist()
        table[row.name] = [None if v != v or v in (float("inf"), float("-inf"))
                           or (not row.hidden and i < len(kinds) and kinds[i] != "attention") else float(v)
                           for i, v in enumerate(values)]
    return table
