"""``sinklab.scan``: run a model over texts (or prepared inputs) and collect sink statistics."""

from __future__ import annotations

import math
import platform
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from . import _compat, distributed, metrics, vision_inputs
from ._version import __version__
from .capture import AttentionCapture, CaptureBatch, CaptureConfig
from .errors import InputError
from .checks import check_batch_size, check_model, check_vocab, check_weights, used_token_ids
from .registry import REGISTRY, per_layer_table
from .texts import default_texts, tokenize_windows
from .variants import register_count, register_labels

__all__ = ["ScanResult", "scan", "scan_inputs", "scan_images", "scan_vision_tower", "SCHEMA_VERSION", "DEFAULT_THRESHOLDS", "DOMINANT_RULE", "check_thresholds",
           "ShortSequenceWarning", "short_sequence_warnings"]

#: scan.json schema. 2: a head's dominant column must be seen by max(8, ⌈T/8⌉) queries (no end-of-sequence
#: false sinks in causal models); warnings for sequences too short for Sink^ε.
SCHEMA_VERSION = "sinklab.scan/2"

#: How the dominant column is chosen (written into scan.json and diagnosis.json).
DOMINANT_RULE = ("argmax of the column mass over keys seen by at least max(8, ceil(T/8)) real queries "
                 "(T = the sample's real tokens; capped at the most-seen key's count)")

DEFAULT_THRESHOLDS = {
    "eps": 0.3,  # sink-rate ε (Gu et al.)
    "eps_event": 0.2,  # strict ε-sink event: min_i A_is ≥ 1 − eps_event
    "relaxed_share": 0.9,  # relaxed rule: share of queries with A_is ≥ 0.5
    "route_threshold": 0.5,
    "massive_abs": 100.0,
    "massive_ratio": 1000.0,
    "high_norm_k": 5.0,  # norm > median + k · 1.4826 · MAD
}

_PER_SAMPLE = (
    "column_mass", "column_min", "routed_fraction", "candidate_attention", "value_norm", "value_norm_out",
    "update_norm", "update_spectrum", "common_mode", "learned_sink_mass", "hidden_norm", "hidden_max_abs",
    "hidden_max_dim", "hidden_median_abs", "token_mask", "column_queries", "local_mass",
)


@dataclass
class ScanResult:
    """Per-sample sink statistics of one model. ``S`` samples, ``L`` layers, ``H`` heads, ``T`` positions.

    Per-position arrays are NaN where a sample has no token. See :class:`~sinklab.capture.CaptureBatch`
    for every field's meaning; ``tokens`` holds each sample's token strings and ``meta`` the
    provenance written into ``scan.json``.
    """

    column_mass: Tensor  # (S, L, H, T)
    column_min: Tensor  # (S, L, H, T)
    routed_fraction: Tensor  # (S, L, H, T)
    candidate_attention: Tensor  # (S, L, H, T, K)
    value_norm: Tensor  # (S, L, H, T)
    value_norm_out: Tensor  # (S, L, H, T)
    update_norm: Tensor  # (S, L, H, T)
    update_spectrum: Tensor  # (S, L, H, r)
    common_mode: Tensor  # (S, L, H)
    learned_sink_mass: Tensor  # (S, L, H)
    column_queries: Tensor  # (S, L, T) real queries that see each key
    hidden_norm: Tensor  # (S, L+1, T)
    hidden_max_abs: Tensor  # (S, L+1, T)
    hidden_max_dim: Tensor  # (S, L+1, T)
    hidden_median_abs: Tensor  # (S, L+1)
    token_mask: Tensor  # (S, T)
    attention_maps: Tensor | None  # (L, H, m, m) for sample 0
    qk_spectrum: Tensor  # (L, H, dh)
    output_space: list[bool]
    tokens: list[list[str]]
    candidates: tuple[int, ...]
    meta: dict = field(default_factory=dict)
    gate: Tensor | None = None  # (S, L, H, T) mean output gate per query and head (None: the model has no gate)
    layer_kinds: list[str] = field(default_factory=list)  # per layer: attention | recurrent | feedforward
    local_mass: Tensor | None = None  # (S, L, H, T) each query's attention on its last meta["local_window"] keys
    modality: Tensor | None = None  # (S, T) int8 vision_inputs.MODALITIES code per position (−1 padding); None: text
    group_mass: Tensor | None = None  # (S, L, H, T) each key's attention summed over the text queries (with modality)
    images: list | None = None  # a vision-language scan's PIL images (for its figure; not in the JSON)

    # ------------------------------------------------------------------ shape helpers
    @property
    def num_samples(self) -> int:
        return self.column_mass.shape[0]

    @property
    def num_layers(self) -> int:
        return self.column_mass.shape[1]

    @property
    def num_heads(self) -> int:
        return self.column_mass.shape[2]

    @property
    def seq_len(self) -> int:
        return self.column_mass.shape[3]

    @property
    def attention_layers(self) -> list[int]:
        """The layers with an attention map (all of them, except a hybrid's recurrent and MLP-only layers)."""
        kinds = self.layer_kinds or ["attention"] * self.num_layers
        return [i for i, kind in enumerate(kinds) if kind == "attention"]

    # ------------------------------------------------------------------ derived metrics
    def sink_rate(self, position: int = 0, eps: float | None = None) -> float:
        """Sink^ε at ``position`` in percent over the attention layers' heads (mean over samples; reported with
        ``meta['seq_len']``)."""
        return float(self.sink_rate_per_layer(position, eps)[self.attention_layers].mean())

    def sink_rate_per_layer(self, position: int = 0, eps: float | None = None) -> Tensor:
        """``[L]`` Sink^ε at ``position`` per layer, in percent (NaN for a layer without attention)."""
        eps = self.meta["thresholds"]["eps"] if eps is None else eps
        attn = self.attention_layers
        out = torch.full((self.num_layers,), math.nan, dtype=torch.float64)
        out[attn] = metrics.sink_rate_per_layer(self.column_mass[:, attn], position, eps)
        return out

    def gate_statistics(self, position: int = 0) -> dict[str, Tensor] | None:
        """:func:`sinklab.metrics.gate_statistics` of the sink at ``position`` (a candidate position), ``[L, H]`` each;
        None when the model has no output gate."""
        if self.gate is None:
            return None
        if position not in self.candidates:
            raise InputError(f"position {position} is not a candidate of this scan ({list(self.candidates)})")
        attention = self.candidate_attention[..., self.candidates.index(position)]
        return metrics.gate_statistics(self.gate, attention, self.meta["thresholds"]["route_threshold"],
                                       first_query=position + 1)

    def eligible_columns(self) -> Tensor:
        """``[S, L, 1, T]`` keys seen by enough queries to be a head's dominant column (:data:`DOMINANT_RULE`)."""
        n = self.token_mask.sum(-1)[:, None].expand(self.column_queries.shape[:2])  # (S, L)
        return metrics.eligible_columns(self.column_queries, n)[:, :, None]

    def dominant_columns(self) -> Tensor:
        """``[S, L, H]`` position of each head's largest column mass among the eligible keys, per sample."""
        return metrics.dominant_columns(self.column_mass, self.eligible_columns())

    def sink_strength(self) -> Tensor:
        """``[S, L, H]`` the dominant column's mass (Fesser et al.'s sink strength)."""
        return self.column_mass.double().gather(-1, self.dominant_columns()[..., None])[..., 0].float()

    def token_label(self, sample: int, position: int) -> str:
        toks = self.tokens[sample]
        return toks[position] if 0 <= position < len(toks) else f"#{position}"

    def top_sink(self) -> tuple[int, str]:
        """The most common dominant position over all samples, attention layers and heads, and its token in sample 0."""
        pos = int(self.dominant_columns()[:, self.attention_layers].flatten().mode().values)
        return pos, self.token_label(0, pos)

    def per_layer(self) -> dict[str, list[float | None]]:
        """Registry table: ``{metric: [value per layer]}``."""
        return per_layer_table(self)

    # ------------------------------------------------------------------ modality split (vision-language scans)
    def _modality(self) -> Tensor:
        if self.modality is None:
            raise InputError("this scan has no image positions (scan a vision-language model with images: "
                             "sinklab.scan.scan_images, or `sinklab scan MODEL --image FILE`)")
        return self.modality

    def modality_sink_strength(self, modality: str) -> Tensor:
        """``[S, L, H]`` each head's largest column mass among the eligible keys of ``modality`` (``text``,
        ``image`` or ``image-special``; :func:`sinklab.metrics.modality_sink_strength`)."""
        codes = self._modality()
        select = codes == vision_inputs.MODALITIES.index(modality)
        return metrics.modality_sink_strength(self.column_mass, self.eligible_columns(), select)

    def modality_sink_rate(self, modality: str, eps: float | None = None) -> Tensor:
        """``[L]`` percent of heads with an ε-sink among ``modality``'s keys (NaN for layers without attention)."""
        eps = self.meta["thresholds"]["eps"] if eps is None else eps
        out = torch.full((self.num_layers,), math.nan, dtype=torch.float64)
        attn = self.attention_layers
        out[attn] = metrics.modality_sink_rate(self.modality_sink_strength(modality)[:, attn], eps)
        return out

    def visual_sink_share(self, eps: float | None = None) -> Tensor:
        """``[S, L, H]`` share of the text queries' attention to the image that lands on visual sink tokens
        (:func:`sinklab.metrics.visual_sink_share`)."""
        eps = self.meta["thresholds"]["eps"] if eps is None else eps
        if self.group_mass is None:
            raise InputError("this scan did not keep the text queries' attention (scan with modality codes)")
        image = self._modality() == vision_inputs.IMAGE
        return metrics.visual_sink_share(self.group_mass, self.column_mass, self.eligible_columns(), image, eps)

    def top_sinks(self, sample: int = 0, k: int = 5) -> list[dict]:
        """Sample ``sample``'s ``k`` positions that are the dominant column of the most attention heads, each with
        its modality and, for an image patch, its index, row and column."""
        codes = self._modality()[sample]
        dominant = self.dominant_columns()[sample, self.attention_layers].flatten()  # (L'·H,)
        counts = torch.bincount(dominant, minlength=self.seq_len)
        spans = vision_inputs.image_spans(codes, [tuple(g) if g else None for g in
                                                  self.meta.get("image_grids", [[]] * self.num_samples)[sample]])
        out = []
        for pos in counts.argsort(descending=True, stable=True)[:k].tolist():
            if counts[pos] == 0:
                break
            code = int(codes[pos])
            out.append({"position": pos, "token": self.token_label(sample, pos),
                        "modality": vision_inputs.MODALITIES[code] if code >= 0 else "padding",
                        "patch": vision_inputs.patch_label(spans, pos),
                        "heads": int(counts[pos]), "share": float(counts[pos]) / dominant.numel()})
        return out

    def modality_summary(self) -> dict:
        """JSON-ready modality split: token counts, sink rate and mean sink strength per layer for text and image
        keys, the visual sink share per layer, and sample 0's top sinks."""
        codes = self._modality()
        attn = self.attention_layers

        def per_layer(x: Tensor) -> list:  # (S, L, H) → mean over samples and heads per layer
            return [_finite(float(v)) for v in x.double().nanmean((0, 2))]

        summary: dict[str, Any] = {
            "positions": {name: int((codes == i).sum()) for i, name in enumerate(vision_inputs.MODALITIES)},
            "eps": self.meta["thresholds"]["eps"],
            "sink_rate": {}, "sink_strength": {},
            "image_grids": self.meta.get("image_grids"),
        }
        for name in ("text", "image"):
            rate = self.modality_sink_rate(name)
            summary["sink_rate"][name] = {"per_layer": [_finite(float(v)) for v in rate],
                                          "mean": _finite(float(rate[attn].nanmean()))}
            summary["sink_strength"][name] = per_layer(self.modality_sink_strength(name))
        if self.group_mass is not None:
            summary["visual_sink_share"] = per_layer(self.visual_sink_share())
        summary["top_sinks"] = self.top_sinks(0)
        return summary

    # ------------------------------------------------------------------ output
    def to_json(self) -> dict:
        """JSON-ready dict: schema, provenance, per-layer registry table, sink rates, per-sample arrays."""
        n_first = min(self.seq_len, 8)
        rates = {str(p): _finite(self.sink_rate(p)) for p in range(n_first)}
        pos, label = self.top_sink()
        return {
            "schema": SCHEMA_VERSION,
            "meta": self.meta,
            "metrics": [{"name": r.name, "title": r.title, "description": r.description} for r in REGISTRY],
            "per_layer": self.per_layer(),
            "sink_rate": {"eps": self.meta["thresholds"]["eps"], "seq_len": self.meta["seq_len"], "by_position": rates},
            "top_sink": {"position": pos, "token": label},
            "dominant_rule": DOMINANT_RULE,
            "tokens": self.tokens,
            "column_mass": _nested(self.column_mass),
            "dominant_columns": self.dominant_columns().tolist(),
            "sink_strength": _nested(self.sink_strength()),
            "qk_sigma_ratio": _nested(metrics.sigma_ratio(self.qk_spectrum.double())),
            "layer_kinds": self.layer_kinds or ["attention"] * self.num_layers,
            **({"gate": {name: _nested(value) for name, value in gates.items()}}
               if (gates := self.gate_statistics()) is not None else {}),
            **({"modality": self.modality_summary()} if self.modality is not None else {}),
        }



def layer_label(layer: int, kind: str) -> str:
    """How tables and figures name a layer: its number, with ``rec`` / ``mlp`` for a hybrid's layer without
    attention (``recurrent`` / ``feedforward`` in :attr:`ScanResult.layer_kinds`)."""
    return str(layer) if kind == "attention" else f"{layer} {_SHORT_KINDS.get(kind, kind)}"


_SHORT_KINDS = {"recurrent": "rec", "feedforward": "mlp"}


def _finite(x: float) -> float | None:
    return float(x) if x is not None and math.isfinite(x) else None


def _nested(t: Tensor) -> list:
    """Tensor → nested lists with NaN/inf as ``None`` (valid JSON), 4 significant digits."""
    flat: list = [None if not math.isfinite(v) else float(f"{v:.4g}") for v in t.double().flatten().tolist()]
    for size in reversed(t.shape[1:]):
        flat = [flat[i : i + size] for i in range(0, len(flat), size)]
    return flat


def _pad_cat(parts: list[Tensor], dim: int, width: int, fill: float) -> Tensor:
    padded = []
    for p in parts:
        missing = width - p.shape[dim]
        if missing > 0:
            shape = list(p.shape)
            shape[dim] = missing
            p = torch.cat([p, torch.full(shape, fill, dtype=p.dtype)], dim=dim)
        padded.append(p)
    return torch.cat(padded, dim=0)


def _merge(batches: list[CaptureBatch], width: int | None = None) -> dict:
    width = max(b.token_mask.shape[-1] for b in batches) if width is None else width
    position_dim = {"candidate_attention": 3, "hidden_norm": 2, "hidden_max_abs": 2, "hidden_max_dim": 2, "token_mask": 1,
                    "column_queries": 2}
    merged: dict[str, Any] = {}
    for name in _PER_SAMPLE:
        parts = [getattr(b, name) for b in batches]
        if name in ("update_spectrum", "common_mode", "learned_sink_mass", "hidden_median_abs"):
            merged[name] = torch.cat(parts, dim=0)
            continue
        dim = position_dim.get(name, 3)
        fill = {"hidden_max_dim": -1, "token_mask": False, "column_queries": 0}.get(name, math.nan)
        merged[name] = _pad_cat(parts, dim, width, fill)
    merged["attention_maps"] = batches[0].attention_maps
    merged["qk_spectrum"] = batches[0].qk_spectrum
    merged["output_space"] = batches[0].output_space
    merged["layer_kinds"] = batches[0].layer_kinds
    gates = [b.gate for b in batches]  # one model: all batches have a gate or none has
    merged["gate"] = _pad_cat(gates, 3, width, math.nan) if gates[0] is not None else None  # type: ignore[arg-type]
    groups = [b.group_mass for b in batches]
    merged["group_mass"] = _pad_cat(groups, 3, width, math.nan) if all(g is not None for g in groups) else None  # type: ignore[arg-type]
    return merged


def _merge_ranks(batches: list[CaptureBatch], start: int, total: int) -> dict:
    """:func:`_merge` of this process's batches; under a launcher, every rank's rows gathered (same on all ranks).

    This rank's batches hold samples ``start …``; ``total`` samples in all. Per-sample statistics are
    gathered exactly (:func:`sinklab.distributed.gather_rows`), so every statistic over samples is then
    computed by the same code as in one process; sample 0's attention maps come from rank 0.
    """
    if not distributed.active():
        return _merge(batches)
    width = int(distributed.all_reduce(torch.tensor([max(b.token_mask.shape[-1] for b in batches)]), "max"))
    merged = _merge(batches, width)
    optional = tuple(name for name in ("gate", "group_mass") if merged[name] is not None)
    for name in _PER_SAMPLE + optional:
        merged[name] = distributed.gather_rows(merged[name], start, total)
    merged["attention_maps"] = distributed.broadcast_object(merged["attention_maps"] if start == 0 else None)
    return merged


def split_batches(batches: Iterable[dict[str, Tensor]]) -> tuple[list[dict[str, Tensor]], range, int, dict]:
    """Every batch, the range of batch indices this process computes, its first sample, and the split's ``meta``.

    One process: all batches, no ``meta``. Under a launcher: contiguous whole batches per rank
    (:func:`sinklab.distributed.batch_shares`), so each sample is computed in the batch it has in one process.
    """
    batches = list(batches)
    if not distributed.active():
        return batches, range(len(batches)), 0, {}
    sizes = [int(next(iter(b.values())).shape[0]) for b in batches]
    shares = distributed.batch_shares(sizes)
    first, stop = shares[distributed.rank()]
    starts = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    info = {"distributed": {"world_size": distributed.world_size(),
                            "split": "contiguous whole batches per rank (each sample in its one-process batch)",
                            "batches_per_rank": [[a, b] for a, b in shares],
                            "samples_per_rank": [[starts[a], starts[b]] for a, b in shares]}}
    return batches, range(first, stop), starts[first], info


def model_meta(model: nn.Module, source: str | None, revision: str | None, **extra) -> dict:
    """What a result's ``meta`` records about the model and the run (source, class, dtype, versions …)."""
    import transformers

    config = getattr(model, "config", None)
    param = next(model.parameters(), None)
    return {
        "model": source or getattr(config, "_name_or_path", None) or type(model).__name__,
        "model_class": type(model).__name__,
        "model_type": getattr(config, "model_type", None),
        "revision": revision,
        "dtype": str(param.dtype).replace("torch.", "") if param is not None else None,
        "versions": {
            "sinklab": __version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
        },
        **extra,
    }


#: Progress callback: ``progress(phase, advance, total)`` — ``advance`` units of ``total`` done in ``phase``
#: (scan: ``"scan"``, samples; diagnose adds ``"edits"``, edited passes).
Progress = Callable[[str, int, int], None]


def check_thresholds(thresholds: dict | None) -> dict:
    """:data:`DEFAULT_THRESHOLDS` updated with ``thresholds``; unknown keys or values out of range → InputError."""
    thresholds = dict(thresholds or {})
    unknown = sorted(set(thresholds) - set(DEFAULT_THRESHOLDS))
    if unknown:
        raise InputError(f"unknown scan threshold(s) {unknown}; known: {sorted(DEFAULT_THRESHOLDS)}")
    thresholds = {**DEFAULT_THRESHOLDS, **thresholds}
    for key in ("eps", "eps_event", "route_threshold"):
        if not 0.0 <= thresholds[key] <= 1.0:
            raise InputError(f"threshold {key} must be in [0, 1], got {thresholds[key]}")
    if not 0.0 < thresholds["relaxed_share"] <= 1.0:
        raise InputError(f"threshold relaxed_share must be in (0, 1], got {thresholds['relaxed_share']}")
    return thresholds


def capture_config(candidates: tuple[int, ...], map_len: int, thresholds: dict) -> CaptureConfig:
    """The :class:`CaptureConfig` of a scan."""
    return CaptureConfig(candidates=tuple(candidates), map_len=map_len, route_threshold=thresholds["route_threshold"])


def scan_result(results: list[CaptureBatch], tokens: list[list[str]], *, candidates: tuple[int, ...],
                thresholds: dict, meta: dict | None = None, start: int = 0,
                modality: Tensor | None = None) -> ScanResult:
    """Merge the capture batches of one scan into a :class:`ScanResult` (with its ``meta``).

    Under a launcher ``results`` are this rank's batches, whose first sample is ``start``; every rank gets
    the whole result (see :func:`_merge_ranks`).
    """
    if not results:
        raise InputError("no inputs to scan")
    merged = _merge_ranks(results, start, len(tokens))
    seq_len = merged["token_mask"].shape[-1]
    notes = short_sequence_warnings(merged["token_mask"], merged["column_queries"], thresholds["eps"])
    for note in notes:
        warnings.warn(note, ShortSequenceWarning, stacklevel=3)
    info = {"thresholds": thresholds, "seq_len": seq_len, "num_samples": merged["column_mass"].shape[0],
            "candidates": list(candidates), "hidden_state_index_0": "input of block 0 (embeddings)",
            "output_space": merged["output_space"], "dominant_rule": DOMINANT_RULE, "warnings": notes,
            "layer_kinds": merged["layer_kinds"], "local_window": CaptureConfig.local_window, **(meta or {})}
    if modality is not None and modality.shape[-1] < seq_len:
        modality = torch.cat([modality, modality.new_full((modality.shape[0], seq_len - modality.shape[-1]), -1)], -1)
    if modality is None:
        merged["group_mass"] = None
    return ScanResult(**merged, tokens=tokens, candidates=tuple(candidates), meta=info, modality=modality)


class ShortSequenceWarning(UserWarning):
    """The samples are too short for the sink rate to mean anything (see :func:`short_sequence_warnings`)."""


def short_sequence_warnings(token_mask: Tensor, column_queries: Tensor, eps: float) -> list[str]:
    """Warnings for samples too short for ``Sink^ε``: ``token_mask`` ``[S, T]``, ``column_queries`` ``[S, L, T]``.

    A head that spreads its attention evenly gives position 0 a column mass of ``H_N/N`` in a causal model
    (``1/N`` otherwise); a sample is too short when that exceeds ``ε/2``, since then Sink_0^ε counts even
    unremarkable heads (4 causal tokens: 0.52 > ε = 0.3 — "every head sinks"). The needed length is
    :func:`sinklab.metrics.min_meaningful_length` (26 tokens causal, 7 bidirectional at ε = 0.3;
    Gu et al. use 64).
    """
    if not 0.0 < eps <= 1.0:
        return []
    lengths = token_mask.sum(-1)  # (S,)
    first = column_queries[:, :, 0]  # (S, L) queries that see key 0
    last = column_queries.gather(-1, (lengths - 1).clamp_min(0)[:, None, None].expand(-1, column_queries.shape[1], 1))[..., 0]
    causal = bool((first > last).any()) or bool((lengths <= 1).all())
    need = metrics.min_meaningful_length(eps, causal)
    short = lengths < need
    if not bool(short.any()):
        return []
    n = int(lengths[short].min())
    kind = "causal" if causal else "bidirectional"
    return [f"{int(short.sum())} of {lengths.numel()} samples have fewer than {need} tokens (shortest: {n}). "
            f"At {n} tokens uniform {kind} attention alone gives position 0 a column mass of "
            f"{metrics.uniform_column_mass(n, causal):.2f} (ε = {eps}), so Sink^ε and the sink counts are not "
            f"meaningful; give at least {need} tokens per sample (Gu et al. use 64)."]


def scan_inputs(
    model: nn.Module,
    batches: Iterable[dict[str, Tensor]],
    tokens: list[list[str]],
    *,
    candidates: tuple[int, ...] = (0, 1, 2, 3),
    map_len: int = 64,
    thresholds: dict | None = None,
    progress: Progress | None = None,
    meta: dict | None = None,
    split: bool = True,
    modality: list[Tensor] | None = None,
) -> ScanResult:
    """Scan prepared model inputs (e.g. ``pixel_values`` for a ViT) and return a :class:`ScanResult`.

    ``batches`` yields keyword dicts for ``model(**batch)``; ``tokens`` labels every sample's positions.
    ``progress("scan", n, len(tokens))`` is called after each batch of ``n`` samples. Under ``torchrun`` /
    ``accelerate launch`` (:mod:`sinklab.distributed`) each rank scans its share of the batches and every
    rank returns the whole result; ``split=False`` scans every batch in this process without collectives.
    ``modality``: one ``[B, T]`` code tensor per batch (:data:`sinklab.vision_inputs.MODALITIES`) for a
    vision-language model's inputs: the result then splits its statistics by modality (:meth:`ScanResult.
    modality_summary`), and the text queries' attention is kept apart (:attr:`ScanResult.group_mass`).
    """
    check_model(model, "scan_inputs")
    if not split:
        with distributed.local():
            return scan_inputs(model, batches, tokens, candidates=candidates, map_len=map_len, thresholds=thresholds,
                               progress=progress, meta=meta, modality=modality)
    thresholds = check_thresholds(thresholds)
    batches, mine, start, info = split_batches(batches)
    groups = [query_groups(modality, len(batches))[i] for i in mine]
    batches, meta = [batches[i] for i in mine], {**(meta or {}), **info}
    results: list[CaptureBatch] = []
    with distributed.together("scan"):
        check_weights(model, used_token_ids(batches))  # no LM head: the embedding only at the rows looked up
        with AttentionCapture(model, capture_config(candidates, map_len, thresholds)) as cap:
            for batch, group in zip(batches, groups):
                results.append(cap.run(query_group=group, **batch))  # type: ignore[arg-type]  # model inputs
                if progress is not None:
                    progress("scan", results[-1].token_mask.shape[0], len(tokens))
    if results and "recurrent" in results[0].layer_kinds and "input_ids" in batches[0]:
        meta["recurrent_state_bytes"] = {str(k): v for k, v in
                                         _compat.recurrent_state_bytes(model, batches[0]["input_ids"]).items()}
    return scan_result(results, tokens, candidates=candidates, thresholds=thresholds, meta=meta, start=start,
                       modality=joined_codes(modality))


def query_groups(modality: list[Tensor] | None, count: int) -> list[Tensor | None]:
    """Per batch of ``count``, the text queries (``[B, T]`` bool) whose attention a vision-language scan keeps apart,
    or None; ``modality`` must hold one code tensor per batch."""
    if modality is not None and len(modality) != count:
        raise InputError(f"modality: one code tensor per batch ({count}), got {len(modality)}")
    return [None] * count if modality is None else [(m == vision_inputs.TEXT).to(torch.bool) for m in modality]


def joined_codes(modality: list[Tensor] | None) -> Tensor | None:
    """Every batch's ``[B, T]`` modality codes as one ``[S, T]`` tensor, padded with −1 to the widest batch."""
    if modality is None:
        return None
    width = max(int(m.shape[-1]) for m in modality)
    return torch.cat([torch.cat([m.cpu(), m.new_full((m.shape[0], width - m.shape[-1]), -1).cpu()], -1)
                      for m in modality])


def image_inputs(model: nn.Module, images: list, text: str, *, processor: Any = None, text_ids: list[int] | None = None,
                 bos: int | None = None, source: str | None = None,
                 revision: str | None = None) -> tuple[vision_inputs.VisionInputs, dict]:
    """A vision-language model's inputs for ``images`` and ``text`` (its processor's, or built from the config with
    ``text_ids``, after ``bos`` when given) and the run's ``meta``: what :func:`scan_images`,
    :func:`sinklab.diagnose.diagnose_images` and :func:`sinklab.circuit.circuit_images` share."""
    vision_inputs.check_vision_model(model, "images")
    if not images:
        raise InputError("no image given")
    if processor is not None:
        inputs = vision_inputs.processor_inputs(model, processor, images, text)
        tokenizer_class = type(getattr(processor, "tokenizer", processor)).__name__
    else:
        if text_ids is None:
            raise InputError("without a processor, an image run needs text_ids (the text's token ids)")
        if len(images) != 1:
            raise InputError("without a processor, an image run takes one image (a processor places several)")
        inputs = vision_inputs.config_inputs(model, images[0], text_ids, bos=bos)
        tokenizer_class = None
    meta = model_meta(model, source, revision, corpus="user images and text", tokenizer_class=tokenizer_class,
                      images=len(images), image_token_id=vision_inputs.image_token_id(model.config),
                      image_grids=[[list(g) if g else None for g in grids] for grids in inputs.grids],
                      vision_tower="not scanned in this run (scan_vision_tower scans it as an encoder)")
    return inputs, meta


def scan_images(
    model: nn.Module,
    images: list,
    text: str = "Describe the image.",
    *,
    processor: Any = None,
    text_ids: list[int] | None = None,
    candidates: tuple[int, ...] = (0, 1, 2, 3),
    map_len: int = 64,
    thresholds: dict | None = None,
    source: str | None = None,
    revision: str | None = None,
    progress: Progress | None = None,
) -> ScanResult:
    """Scan a vision-language model on ``images`` (``PIL.Image``\\ s; :func:`sinklab.vision_inputs.load_images`) and a
    text, one sample, with every statistic split by modality (:meth:`ScanResult.modality_summary`).

    With the model's ``processor`` (``AutoProcessor``), it builds the prompt and pixels as for generation
    (:func:`sinklab.vision_inputs.processor_inputs`); without one (a tiny random model) the first image's pixels
    come from the vision config and the text is ``text_ids`` (:func:`sinklab.vision_inputs.config_inputs`). The
    language model's attention is captured; the vision tower runs on its own attention, not scanned
    (:func:`scan_vision_tower` scans it as an encoder).
    """
    inputs, meta = image_inputs(model, images, text, processor=processor, text_ids=text_ids, source=source,
                                revision=revision)
    result = scan_inputs(model, inputs.batches, inputs.tokens, candidates=candidates, map_len=map_len,
                         thresholds=thresholds, progress=progress, meta=meta, modality=inputs.modality)
    result.images = list(images)
    return result


def scan_vision_tower(
    model: nn.Module,
    images: list,
    *,
    processor: Any = None,
    candidates: tuple[int, ...] = (0, 1, 2, 3),
    map_len: int = 64,
    thresholds: dict | None = None,
    source: str | None = None,
    revision: str | None = None,
    progress: Progress | None = None,
) -> ScanResult:
    """Scan a vision-language model's vision tower as an encoder on ``images`` (one sample each): bidirectional
    attention over its patch tokens (and class token where it has one), the high-norm patch tokens in
    ``hidden_norm`` / ``hidden_max_abs``. The pixels come from the model's ``processor`` (its image preprocessor)
    or, without one, from the vision config's image size. Towers that take flattened patches or tiles instead of
    one picture per image are refused with what would lift it (:func:`sinklab.vision_inputs.tower_inputs`).
    """
    inputs = vision_inputs.tower_inputs(model, images, processor)
    meta = model_meta(inputs.tower, source, revision, corpus="user images", images=len(images),
                      component=f"vision tower ({type(inputs.tower).__name__}) of {type(model).__name__}",
                      patch_grid=list(inputs.grid))
    return scan_inputs(inputs.tower, inputs.batches, inputs.tokens, candidates=candidates, map_len=map_len,
                       thresholds=thresholds, progress=progress, meta=meta)


def text_batches(model: nn.Module, tokenizer, texts: str | list[str] | None, *, seq_len: int, samples: int,
                 batch_size: int, seed: int = 0, source: str | None = None, revision: str | None = None,
                 first_batch: int | None = None) -> tuple[list[dict[str, Tensor]], list[list[str]], dict]:
    """Texts (default: the pydoc corpus) → model-ready batches on the input device, token strings, provenance.

    Shared by :func:`scan` and :func:`sinklab.diagnose`: windows of ``seq_len`` tokens, vocabulary check,
    and the ``meta`` that goes into the JSON outputs. ``first_batch`` makes the first batch exactly that
    many samples (diagnose's edit samples), the rest go in batches of ``batch_size``.
    """
    check_model(model)
    if isinstance(texts, str):
        texts = [texts]
    corpus = "user text" if texts is not None else "pydoc_data.topics (Python standard library documentation)"
    texts = default_texts() if texts is None else texts
    check_batch_size(batch_size)
    windows = tokenize_windows(tokenizer, texts, seq_len, samples, seed=seed)
    check_vocab(model, tokenizer, windows.input_ids)
    device = _compat.input_device(model)
    n = windows.input_ids.shape[0]
    head = min(first_batch, n) if first_batch else 0
    bounds = ([(0, head)] if head else []) + [(a, min(n, a + batch_size)) for a in range(head, n, batch_size)]
    batches = []
    for a, b in bounds:  # each batch trimmed to its longest sample
        width = int(windows.attention_mask[a:b].sum(-1).max())
        batches.append({"input_ids": windows.input_ids[a:b, :width].to(device),
                        "attention_mask": windows.attention_mask[a:b, :width].to(device)})
    meta = model_meta(model, source, revision, seed=seed, requested_seq_len=seq_len, corpus=corpus,
                       tokenizer_added_bos=windows.added_bos, tokenizer_class=type(tokenizer).__name__)
    tokens = windows.tokens
    registers = register_count(model)
    if registers:  # the variant's register tokens sit in front of every sample
        tokens = [register_labels(registers) + list(t) for t in tokens]
        meta["registers"] = registers
    return batches, tokens, meta


def scan(
    model: nn.Module,
    tokenizer,
    texts: str | list[str] | None = None,
    *,
    seq_len: int = 64,
    samples: int = 16,
    batch_size: int = 8,
    candidates: tuple[int, ...] = (0, 1, 2, 3),
    map_len: int = 64,
    thresholds: dict | None = None,
    seed: int = 0,
    source: str | None = None,
    revision: str | None = None,
    progress: Progress | None = None,
) -> ScanResult:
    """Scan ``model`` on ``texts`` (default: English paragraphs shipped with Python) for attention sinks.

    Texts are cut into at most ``samples`` windows of ``seq_len`` tokens (the tokenizer's special tokens
    included, right-padded); ``seed`` 0 takes them in order, another seed shuffles the texts and offsets
    each window start (see :func:`sinklab.texts.tokenize_windows`). Nothing of size L×H×T×T is materialised: statistics are reduced per query
    chunk inside the attention function. Returns a :class:`ScanResult`; ``result.sink_rate(0)`` is Gu
    et al.'s Sink_1^ε at this ``seq_len``.
    """
    batches, tokens, meta = text_batches(model, tokenizer, texts, seq_len=seq_len, samples=samples,
                                         batch_size=batch_size, seed=seed, source=source, revision=revision)
    return scan_inputs(model, batches, tokens, candidates=candidates, map_len=map_len,
                       thresholds=thresholds, progress=progress, meta=meta)

