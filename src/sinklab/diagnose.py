"""``sinklab.diagnose``: *why* each sink exists — adaptive NOP vs broadcast — confirmed by causal value edits.

Per sample, each head's dominant column (largest column mass) counts as a sink when it passes the
chosen rule (column mass > 0.3 by default; the strict ε-sink and relaxed 90 %/0.5 rules are options).
Each sink becomes a :class:`SinkRecord` classified with Fesser et al.'s thresholds (arXiv:2606.08105):
NOP if the output-space value-norm ratio ``r_out ≤ 0.2``; broadcast if ``r_out ≥ 0.5`` and the
head update's stable rank ``≤ 1.5``; otherwise unclassified. Causal value edits (zero the sink value,
the head's mean sink value, a donor's sink value, an ordinary token's value, remove the column, and a
control) run through :class:`~sinklab.capture.ValueEdit` on the real model (:mod:`sinklab.edits`).
"""

from __future__ import annotations

import math
import string
from collections import Counter
from collections.abc import Iterable
from typing import Any
from dataclasses import asdict, dataclass, field

from torch import Tensor, nn

from . import distributed, metrics
from .capture import AttentionCapture
from .checks import check_weights, used_token_ids
from .edits import EDITS, EditResult, KeptBatch, causal_edits
from .errors import InputError, check_int
from .recommend import Recommendation, recommend
from .scan import (Progress, ScanResult, capture_config, check_thresholds, image_inputs, joined_codes, query_groups,
                   scan_result, split_batches, text_batches)

__all__ = ["SCHEMA_VERSION", "DEFAULT_RULES", "EDIT_LAYERS", "EDIT_SAMPLES", "SinkRecord", "Diagnosis", "diagnose",
           "diagnose_images", "diagnose_inputs", "spread_layers", "token_roles"]

#: diagnosis.json schema. 2: dominant columns need max(8, ⌈T/8⌉) visible queries; per-layer rows grouped
#: by role and position (top_sink); edits on the first edit_samples samples, final hidden states only.
SCHEMA_VERSION = "sinklab.diagnose/2"

DEFAULT_RULES = {
    "rule": "mass",  # mass | strict | relaxed: what makes a head's dominant column a sink
    "sink_mass": 0.3,  # rule "mass": column mass > sink_mass (Gu et al.'s ε)
    "eps_event": 0.2,  # rule "strict": min_i A_is ≥ 1 − eps_event
    "relaxed_share": 0.9,  # rule "relaxed": ≥ this share of queries put ≥ 0.5 on the column
    "nop_max_ratio": 0.2,  # NOP: output-space value-norm ratio ≤ this
    "broadcast_min_ratio": 0.5,  # broadcast: ratio ≥ this …
    "broadcast_max_srank": 1.5,  # … and stable rank of the head update ≤ this
}

#: Causal edits, in report order. ``control`` zeroes a random non-sink value.

ROLES = ("bos", "cls", "sep", "first", "register", "punct", "patch", "other")


@dataclass
class SinkRecord:
    """One sink: a head's dominant column in one sample that passes the rule."""

    sample: int
    layer: int
    head: int
    token_index: int  # 0-based position
    token: str
    role: str  # one of ROLES
    kind: str  # nop | broadcast | unclassified
    strength: float  # column mass at the sink
    routed_fraction: float  # share of the queries that see it with A_is ≥ 0.5
    value_norm_ratio: float  # head space
    value_norm_ratio_out: float  # output space (W_O^h, × LayerScale)
    stable_rank: float  # of the head's output-space update
    rank1_energy: float
    common_mode: float
    qk_sigma_ratio: float  # σ₁/σ₂ of Wq_hᵀ·Wk_h


def _plain(token: str) -> str:
    return token.replace("##", "").replace("Ġ", "").replace("▁", "").strip()


def token_roles(tokens: list[str], special: dict[str, str | None]) -> list[str]:
    """Role of every position of one sample: bos / cls / sep / first / register / punct / patch / other.

    ``special`` maps ``bos``, ``cls``, ``sep``, ``eos`` to the tokenizer's token strings (or None).
    Vision labels from :func:`sinklab.scan_inputs` use ``[CLS]``, ``reg<i>`` and ``patch<i>``.
    """
    roles = []
    for i, tok in enumerate(tokens):
        plain = _plain(tok)
        if special.get("bos") is not None and tok == special["bos"] and special.get("bos") != special.get("cls"):
            role = "bos"
        elif tok == special.get("cls") or tok == "[CLS]":
            role = "cls"
        elif tok in (special.get("sep"), special.get("eos")) and tok is not None:
            role = "sep"
        elif tok.startswith("reg") and tok[3:].isdigit():
            role = "register"
        elif tok.startswith("patch") and tok[5:].isdigit():
            role = "patch"
        elif i == 0:
            role = "first"
        elif plain and all(ch in string.punctuation for ch in plain):
            role = "punct"
        else:
            role = "other"
        roles.append(role)
    return roles


def _check_rules(rules: dict) -> dict:
    unknown = set(rules) - set(DEFAULT_RULES)
    if unknown:
        raise InputError(f"unknown diagnosis rule(s) {sorted(unknown)}; known: {sorted(DEFAULT_RULES)}")
    merged = {**DEFAULT_RULES, **rules}
    if merged["rule"] not in ("mass", "strict", "relaxed"):
        raise InputError(f"rule must be 'mass', 'strict' or 'relaxed', got {merged['rule']!r}")
    for key in ("sink_mass", "eps_event", "relaxed_share", "nop_max_ratio", "broadcast_min_ratio"):
        if not 0.0 <= float(merged[key]) <= 1.0:
            raise InputError(f"threshold {key} must be in [0, 1], got {merged[key]}")
    if merged["nop_max_ratio"] > merged["broadcast_min_ratio"]:
        raise InputError("nop_max_ratio must not exceed broadcast_min_ratio")
    if not math.isfinite(float(merged["broadcast_max_srank"])) or merged["broadcast_max_srank"] < 1.0:
        raise InputError(f"broadcast_max_srank must be ≥ 1, got {merged['broadcast_max_srank']}")
    return merged


def _sink_mask(scan: ScanResult, rules: dict) -> Tensor:
    """``[S, L, H]``: the head's dominant column passes the rule."""
    dom = scan.dominant_columns()[..., None]
    if rules["rule"] == "mass":
        return scan.sink_strength() > rules["sink_mass"]
    if rules["rule"] == "strict":
        return metrics.is_eps_sink(scan.column_min.gather(-1, dom)[..., 0], rules["eps_event"])
    return metrics.is_relaxed_sink(scan.routed_fraction.gather(-1, dom)[..., 0], rules["relaxed_share"])


def sink_records(scan: ScanResult, rules: dict, special: dict[str, str | None]) -> list[SinkRecord]:
    """Classify every sink of ``scan`` (see the module docstring)."""
    dom = scan.dominant_columns()  # (S, L, H)
    sinks = _sink_mask(scan, rules)
    mask = scan.token_mask[:, None, None, :]
    r_head = metrics.value_norm_ratio(scan.value_norm.double(), dom, mask)
    r_out = metrics.value_norm_ratio(scan.value_norm_out.double(), dom, mask)
    srank = metrics.stable_rank_from_singular_values(scan.update_spectrum)
    rank1 = metrics.rank1_energy_from_singular_values(scan.update_spectrum)
    kinds = metrics.classify_sink(r_out, srank, nop_max_ratio=rules["nop_max_ratio"],
                                  broadcast_min_ratio=rules["broadcast_min_ratio"],
                                  broadcast_max_srank=rules["broadcast_max_srank"])
    strength = scan.sink_strength()
    routed = scan.routed_fraction.gather(-1, dom[..., None])[..., 0]
    qk = metrics.sigma_ratio(scan.qk_spectrum.double())
    roles = [token_roles(t, special) for t in scan.tokens]
    records = []
    for s, layer, head in sinks.nonzero().tolist():
        pos = int(dom[s, layer, head])
        records.append(SinkRecord(
            sample=s, layer=layer, head=head, token_index=pos, token=scan.token_label(s, pos),
            role=roles[s][pos] if pos < len(roles[s]) else "other",
            kind=metrics.SINK_KINDS[int(kinds[s, layer, head])], strength=float(strength[s, layer, head]),
            routed_fraction=float(routed[s, layer, head]), value_norm_ratio=float(r_head[s, layer, head]),
            value_norm_ratio_out=float(r_out[s, layer, head]), stable_rank=float(srank[s, layer, head]),
            rank1_energy=float(rank1[s, layer, head]), common_mode=float(scan.common_mode[s, layer, head]),
            qk_sigma_ratio=float(qk[layer, head]),
        ))
    return records


# ----------------------------------------------------------------------------- the diagnosis
@dataclass
class Diagnosis:
    """Sink records, per-layer/per-head summaries and causal edits of one model."""

    scan: ScanResult
    records: list[SinkRecord]
    rules: dict
    edits: list[EditResult] = field(default_factory=list)
    recommendation: Recommendation | None = None  # computed by diagnose_inputs, with the model in hand

    @property
    def found(self) -> bool:
        """False when no head's dominant column passed the rule ("no sinks found")."""
        return bool(self.records)

    def per_layer(self) -> list[dict]:
        """Per layer: share of (sample, head) that sink, counts per class, the dominant class, where it sinks.

        Sinks are grouped by role and position (``top_sink`` e.g. ``"first@0"``, ``"punct@63"``), not by the
        token string: without a BOS token the first token is an arbitrary word that differs per sample.
        ``top_token`` is the most common token string at that place (for display only).
        """
        s, n_layers, h = self.scan.num_samples, self.scan.num_layers, self.scan.num_heads
        kinds = self.scan.layer_kinds or ["attention"] * n_layers
        gates = self.scan.gate_statistics()
        out = []
        for layer in range(n_layers):
            recs = [r for r in self.records if r.layer == layer]
            gate = {} if gates is None or kinds[layer] != "attention" else \
                {f"mean_{k}": _mean_or_none(v[layer]) for k, v in gates.items()}
            counts = Counter(r.kind for r in recs)
            places = Counter((r.role, r.token_index) for r in recs)
            roles = Counter(f"{r.role}:{r.kind}" for r in recs)
            (role, pos), hits = places.most_common(1)[0] if recs else ((None, None), 0)
            tokens = Counter(r.token for r in recs if (r.role, r.token_index) == (role, pos))
            out.append({
                "layer": layer,
                "kind": kinds[layer],
                "sink_pct": 100.0 * len(recs) / (s * h) if kinds[layer] == "attention" else None,
                "counts": {k: counts.get(k, 0) for k in metrics.SINK_KINDS},
                "dominant_kind": counts.most_common(1)[0][0] if recs else None,
                "top_sink": f"{role}@{pos}" if recs else None,
                "top_role": role,
                "top_position": pos,
                "top_sink_pct": 100.0 * hits / len(recs) if recs else None,  # share of the layer's sinks there
                "top_token": tokens.most_common(1)[0][0] if recs else None,
                "roles": dict(roles.most_common()),  # "role:kind" -> count, e.g. "register:nop"
                "median_value_ratio_out": _median([r.value_norm_ratio_out for r in recs]),
                "median_stable_rank": _median([r.stable_rank for r in recs]),
                **gate,
            })
        return out

    def per_head(self) -> list[list[dict]]:
        """``[layer][head]``: share of samples where the head sinks and its most common class."""
        s = self.scan.num_samples
        table: list[list[dict]] = [[{"sink_pct": 0.0, "kind": None} for _ in range(self.scan.num_heads)]
                 for _ in range(self.scan.num_layers)]
        grouped: dict[tuple[int, int], list[SinkRecord]] = {}
        for r in self.records:
            grouped.setdefault((r.layer, r.head), []).append(r)
        for (layer, head), recs in grouped.items():
            table[layer][head] = {"sink_pct": 100.0 * len(recs) / s,
                                  "kind": Counter(r.kind for r in recs).most_common(1)[0][0]}
        gates = self.scan.gate_statistics()
        if gates is not None:  # the output gate on sink-routed queries vs elsewhere, sink share without / with it
            for layer in self.scan.attention_layers:
                for head in range(self.scan.num_heads):
                    table[layer][head].update({k: _mean_or_none(v[layer, head]) for k, v in gates.items()})
        return table

    def to_json(self) -> dict:
        return {
            "schema": SCHEMA_VERSION,
            "meta": self.scan.meta,
            "rules": self.rules,
            "found": self.found,
            "message": None if self.found else "no sinks found: no head's dominant column passed the rule",
            "per_layer": self.per_layer(),
            "per_head": self.per_head(),
            "edits": [asdict(e) for e in self.edits],
            "records": [asdict(r) for r in self.records],
            **({} if self.recommendation is None else {"recommendation": self.recommendation.to_json()}),
        }



def _mean_or_none(values: Tensor) -> float | None:
    """Mean of the finite entries (a number, or None when there are none)."""
    value = float(values.double().nanmean())
    return value if value == value else None


def _median(values: list[float]) -> float | None:
    vals = sorted(v for v in values if v == v)
    return vals[len(vals) // 2] if vals else None


def spread_layers(layers: list[int], limit: int | None) -> list[int]:
    """At most ``limit`` of ``layers`` (sorted), evenly spread: the first and the last always, ``None``: all."""
    if limit is None or len(layers) <= limit:
        return list(layers)
    if limit == 1:
        return [layers[0]]
    return [layers[round(i * (len(layers) - 1) / (limit - 1))] for i in range(limit)]


def _edit_heads(records: list[SinkRecord], limit: int | None = None) -> list[tuple[int, int, str]]:
    """The head with the most sinks in each sinking layer (ties: larger mean strength), and its usual class;
    at most ``limit`` layers, evenly spread over the sinking ones (:func:`spread_layers`)."""
    chosen = []
    for layer in spread_layers(sorted({r.layer for r in records}), limit):
        recs = [r for r in records if r.layer == layer]  # never empty: the layers come from the records
        by_head: dict[int, list[SinkRecord]] = {}
        for r in recs:
            by_head.setdefault(r.head, []).append(r)
        head = max(by_head, key=lambda k: (len(by_head[k]), sum(r.strength for r in by_head[k])))
        chosen.append((layer, head, Counter(r.kind for r in by_head[head]).most_common(1)[0][0]))
    return chosen


def _edit_targets(edits: bool | list[tuple[int, int]], records: list[SinkRecord], scan: ScanResult,
                  limit: int | None = None) -> list[tuple[int, int, str]]:
    """``(layer, head, usual class)`` of every head to edit (checked against the model's shape)."""
    if not edits:
        return []
    heads = ([(layer, head) for layer, head, _ in _edit_heads(records, limit)] if edits is True
             else [tuple(e) for e in edits])
    targets = []
    for layer, head in heads:
        if not (0 <= layer < scan.num_layers and 0 <= head < scan.num_heads):
            raise InputError(f"edit target layer {layer} head {head} is outside the model "
                             f"({scan.num_layers} layers × {scan.num_heads} heads)")
        if layer not in scan.attention_layers:
            raise InputError(f"edit target layer {layer} is a {scan.layer_kinds[layer]} layer: it has no attention "
                             f"heads to edit (attention layers: {scan.attention_layers})")
        kinds = Counter(r.kind for r in records if r.layer == layer and r.head == head)
        targets.append((layer, head, kinds.most_common(1)[0][0] if kinds else "no sink"))
    return targets


def diagnose_inputs(
    model: nn.Module,
    batches: Iterable[dict[str, Tensor]],
    tokens: list[list[str]],
    *,
    rules: dict | None = None,
    edits: bool | list[tuple[int, int]] = True,
    special: dict[str, str | None] | None = None,
    edit_rows: Tensor | None = None,
    edit_samples: int | None = None,
    edit_layers: int | None = None,
    candidates: tuple[int, ...] = (0, 1, 2, 3),
    map_len: int = 64,
    meta: dict | None = None,
    progress: Progress | None = None,
    seed: int = 0,
    modality: list[Tensor] | None = None,
) -> Diagnosis:
    """Diagnose prepared inputs (``input_ids``, ``pixel_values``, ``inputs_embeds`` …).

    ``edits``: True runs the causal edits on the most-sinking head of every layer that sinks; a list of
    ``(layer, head)`` picks them; False skips them. ``edit_layers``: with ``edits=True``, edit at most that many
    sinking layers, evenly spread from the first to the last (default: every one). ``edit_samples``: edit the
    first that many samples (default: all); batches that hold them keep their block inputs during the one
    statistics pass, and each edit reruns only the blocks from the edited layer on (a head's six edits as one
    forward over stacked copies). ``edit_rows`` ``[S, T]`` restricts the rows the
    edit RMS is measured on (e.g. the damped queries of the NOP task). ``progress`` gets ``("scan", n,
    samples)`` after each batch and ``("edits", k, passes)`` after each forward of ``k`` edited passes. The returned
    :class:`Diagnosis` carries its :class:`~sinklab.recommend.Recommendation`, computed with ``model`` in hand
    (so it knows which fixes the model already has). ``modality``: one ``[B, T]`` code tensor per batch (a
    vision-language model's inputs), the diagnosis's scan then split by modality as :func:`sinklab.scan.scan_inputs`.
    """
    rules = _check_rules(rules or {})
    if edit_samples is not None:
        check_int("edit_samples", edit_samples, 1)
    if edit_layers is not None:
        check_int("edit_layers (--edit-layers)", edit_layers, 1, ", or None (--edit-layers 0) to edit every sinking layer")
    thresholds = check_thresholds({"eps": rules["sink_mass"], "eps_event": rules["eps_event"],
                                   "relaxed_share": rules["relaxed_share"]})
    n_edit = len(tokens) if edit_samples is None else min(edit_samples, len(tokens))
    batches, mine, start, info = split_batches(batches)
    groups = query_groups(modality, len(batches))
    sizes = [int(next(iter(b.values())).shape[0]) for b in batches]
    todo = sum(sizes[i] for i in mine)
    results, first = [], 0
    kept: list[KeptBatch] = []
    with AttentionCapture(model, capture_config(candidates, map_len, thresholds)) as cap:
        with distributed.together("diagnose (statistics pass)"):
            check_weights(model, used_token_ids(batches))  # no LM head: the embedding only at the rows looked up
            # The one statistics pass over this rank's batches; batches with edited samples keep their block
            # inputs (under a launcher every rank runs those, as each rank edits its share of the heads).
            for i, (batch, size) in enumerate(zip(batches, sizes, strict=True)):
                keep = bool(edits) and first < n_edit
                if i in mine or keep:
                    stats = cap.run(keep_inputs=keep, query_group=groups[i], **batch)  # type: ignore[arg-type]
                    if i in mine:
                        results.append(stats)
                        if progress is not None:
                            progress("scan", size, todo)
                    if keep:
                        kept.append((slice(first, first + size), cap.last_inputs))  # type: ignore[arg-type]  # kept
                first += size
        scan = scan_result(results, tokens, candidates=candidates, thresholds=thresholds, start=start,
                           meta={**(meta or {}), **info, "edit_samples": n_edit if edits else 0,
                                 "edit_layers": edit_layers if edits is True else None}, modality=joined_codes(modality))
        records = sink_records(scan, rules, special or {})
        diagnosis = Diagnosis(scan=scan, records=records, rules=rules)
        targets = _edit_targets(edits, records, scan, edit_layers)
        rank, world = (distributed.rank(), distributed.world_size()) if distributed.active() else (0, 1)
        ours = targets[rank::world]  # each rank edits every world-th head; gathered back in order below
        total = len(ours) * len(kept) * len(EDITS)
        with distributed.together("diagnose (causal edits)"):
            done = [causal_edits(cap, kept, scan, layer, head, samples=n_edit, rows=edit_rows, seed=seed, kind=kind,
                                 progress=progress, total=total) for layer, head, kind in ours]
        by_rank = distributed.gather_objects(done)
        diagnosis.edits = [by_rank[i % world][i // world] for i in range(len(targets))]
    diagnosis.recommendation = recommend(diagnosis, model=model)
    return diagnosis


def special_tokens(tokenizer) -> dict[str, str | None]:
    """The tokenizer's BOS/CLS/SEP/EOS token strings."""
    return {name: getattr(tokenizer, f"{name}_token", None) for name in ("bos", "cls", "sep", "eos")}


#: Samples the causal edits run on by default (the statistics use every sample).
EDIT_SAMPLES = 4

#: Sinking layers whose most-sinking head :func:`diagnose` edits by default, evenly spread from the first to the
#: last sinking layer. Each edit reruns every block after its layer, so editing every sinking layer of a deep
#: model costs many forwards' worth of blocks (measured on SmolLM2-135M: docs/diagnose.md).
EDIT_LAYERS = 5


def diagnose(
    model: nn.Module,
    tokenizer,
    texts: str | list[str] | None = None,
    *,
    seq_len: int = 64,
    samples: int = 16,
    batch_size: int = 8,
    rules: dict | None = None,
    edits: bool | list[tuple[int, int]] = True,
    edit_samples: int = EDIT_SAMPLES,
    edit_layers: int | None = EDIT_LAYERS,
    seed: int = 0,
    source: str | None = None,
    revision: str | None = None,
    progress: Progress | None = None,
) -> Diagnosis:
    """Diagnose ``model``'s sinks on ``texts`` (default: the pydoc corpus, as :func:`sinklab.scan`).

    One statistics pass over every sample (as :func:`sinklab.scan`), then the causal edits of the most-sinking
    head of up to ``edit_layers`` sinking layers (evenly spread; None: every one) on the first ``edit_samples``
    samples, each resumed from the edited layer, the six edits of a head in one stacked forward.
    Returns a :class:`Diagnosis`; ``Diagnosis.found`` is False (not an error) when nothing sinks.
    """
    rules = _check_rules(rules or {})
    check_int("edit_samples", edit_samples, 1)
    batches, tokens, meta = text_batches(model, tokenizer, texts, seq_len=seq_len, samples=samples,
                                         batch_size=batch_size, seed=seed, source=source, revision=revision,
                                         first_batch=edit_samples if edits else None)
    return diagnose_inputs(model, batches, tokens, rules=rules, edits=edits, edit_samples=edit_samples,
                           edit_layers=edit_layers, special=special_tokens(tokenizer), meta=meta, progress=progress,
                           seed=seed)


def diagnose_images(
    model: nn.Module,
    images: list,
    text: str = "Describe the image.",
    *,
    processor: Any = None,
    text_ids: list[int] | None = None,
    rules: dict | None = None,
    edits: bool | list[tuple[int, int]] = True,
    edit_layers: int | None = EDIT_LAYERS,
    seed: int = 0,
    source: str | None = None,
    revision: str | None = None,
    progress: Progress | None = None,
) -> Diagnosis:
    """Diagnose a vision-language model's sinks on ``images`` and a ``text`` (one sample, built as
    :func:`sinklab.scan.scan_images` builds it): the language model's heads classified and edited as for text, an
    image position's record labelled by its token (``<image>`` or the processor's), the causal edits run with the
    pixels in every forward."""
    inputs, meta = image_inputs(model, images, text, processor=processor, text_ids=text_ids, source=source,
                                revision=revision)
    tokenizer = getattr(processor, "tokenizer", processor)
    d = diagnose_inputs(model, inputs.batches, inputs.tokens, rules=rules, edits=edits, edit_layers=edit_layers,
                        special=special_tokens(tokenizer) if tokenizer is not None else None, meta=meta,
                        progress=progress, seed=seed, modality=inputs.modality)
    d.scan.images = list(images)  # the report draws the sink patches over the picture
    return d
