"""``sinklab.diagnose``: *why* each sink exists — adaptive NOP vs broadcast — confirmed by causal value edits.

Per sample, each head's dominant column (largest column mass) counts as a sink when it passes the
chosen rule (column mass > 0.3 by default; the strict ε-sink and relaxed 90 %/0.5 rules are options).
Each sink becomes a :class:`SinkRecord` classified with Fesser et al.'s thresholds (arXiv:2606.08105):
NOP if the output-space value-norm ratio ``r_out ≤ 0.2``; broadcast if ``r_out ≥ 0.5`` and the
head update's stable rank ``≤ 1.5``; otherwise unclassified. Causal value edits (zero the sink value,
the head's mean sink value, a donor's sink value, an ordinary token's value, remove the column, and a
control) run through :class:`~sinklab.capture.ValueEdit` on the real model.
"""

from __future__ import annotations

import string
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from . import metrics
from .capture import AttentionCapture, CaptureConfig, ValueEdit
from .errors import InputError
from .scan import ScanResult, scan_inputs, text_batches

__all__ = ["DEFAULT_RULES", "EDITS", "SinkRecord", "EditResult", "Diagnosis", "diagnose", "diagnose_inputs",
           "token_roles", "causal_edits", "run_edit"]

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
EDITS = ("zero", "mean_sink", "donor", "ordinary", "remove_column", "control")

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


@dataclass
class EditResult:
    """Relative RMS change of the final hidden states (and logits) under each causal edit of one head."""

    layer: int
    head: int
    kind: str  # the head's most common class among its records
    positions: list[int]  # the sink position edited in each sample
    hidden: dict[str, float]
    logits: dict[str, float] | None = None


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
    if merged["broadcast_max_srank"] < 1.0:
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


# ----------------------------------------------------------------------------- causal edits
def _final_states(output: object) -> tuple[Tensor, Tensor | None]:
    hidden = getattr(output, "last_hidden_state", None)
    if hidden is None:
        states = getattr(output, "hidden_states", None)
        hidden = states[-1] if states else None
    if hidden is None:
        raise InputError("the model output has neither last_hidden_state nor hidden_states")
    return hidden, getattr(output, "logits", None)


def run_edit(model: nn.Module, batch: dict[str, Tensor], edit: ValueEdit | None) -> tuple[Tensor, Tensor | None]:
    """Final hidden states (and logits for LMs) of ``model(**batch)`` under ``edit`` (None: unedited)."""
    with AttentionCapture(model, CaptureConfig(map_len=0, candidates=()), edit=edit) as cap:
        cap.run(full_model=True, output_hidden_states=True, **batch)
        return _final_states(cap.last_output)


class _RMS:
    """Accumulates ``Σ(edited − base)²`` and ``Σ base²`` over batches and selected rows."""

    def __init__(self) -> None:
        self.diff = 0.0
        self.ref = 0.0

    def add(self, edited: Tensor, base: Tensor, rows: Tensor) -> None:
        m = rows.bool()[..., None].expand(base.shape)
        self.diff += float(((edited.double() - base.double()) ** 2)[m].sum())
        self.ref += float((base.double() ** 2)[m].sum())

    @property
    def value(self) -> float:
        return (self.diff / self.ref) ** 0.5 if self.ref > 0 else float("nan")


def _ordinary_positions(scan: ScanResult, layer: int, head: int, sinks: Tensor, generator: torch.Generator,
                        pick: str) -> Tensor:
    """A non-sink real position per sample: the median-value-norm token (``pick='median'``) or a random one."""
    out = []
    for s in range(scan.num_samples):
        real = scan.token_mask[s].nonzero()[:, 0].tolist()
        others = [p for p in real if p != int(sinks[s])] or real
        if pick == "median":
            norms = scan.value_norm[s, layer, head, others]
            order = norms.argsort()
            out.append(others[int(order[len(others) // 2])])
        else:
            out.append(others[int(torch.randint(len(others), (1,), generator=generator))])
    return torch.tensor(out, dtype=torch.long)


def causal_edits(
    model: nn.Module,
    batches: list[tuple[slice, dict[str, Tensor]]],
    scan: ScanResult,
    layer: int,
    head: int,
    *,
    rows: Tensor | None = None,
    seed: int = 0,
    kind: str = "",
) -> EditResult:
    """Run every edit of :data:`EDITS` on ``(layer, head)`` at each sample's dominant column.

    ``batches`` are ``(sample slice, model inputs)`` pairs covering the scan's samples; ``rows`` ``[S, T]``
    restricts which query rows count in the RMS (default: every real token).
    """
    positions = scan.dominant_columns()[:, layer, head]
    gen = torch.Generator().manual_seed(seed)
    ordinary = _ordinary_positions(scan, layer, head, positions, gen, "median")
    control = _ordinary_positions(scan, layer, head, positions, gen, "random")
    rows = scan.token_mask if rows is None else rows.bool()
    base, sink_values, ordinary_values = {}, [], []
    for sl, batch in batches:
        base[sl.start] = run_edit(model, batch, None)
        rec = ValueEdit(layer, head, positions[sl], "record")
        run_edit(model, batch, rec)
        sink_values.append(rec.recorded)
        rec = ValueEdit(layer, head, ordinary[sl], "record")
        run_edit(model, batch, rec)
        ordinary_values.append(rec.recorded)
    sink_all = torch.cat(sink_values)  # (S, dv)
    donor_all = sink_all.roll(1, dims=0)  # sample s gets sample s−1's sink value
    ordinary_all = torch.cat(ordinary_values)
    hidden = {name: _RMS() for name in EDITS}
    logits = {name: _RMS() for name in EDITS}
    has_logits = False
    for sl, batch in batches:
        pos = positions[sl]
        edits = {
            "zero": ValueEdit(layer, head, pos, "zero"),
            "mean_sink": ValueEdit(layer, head, pos, "replace", replacement=sink_all.mean(0)),
            "donor": ValueEdit(layer, head, pos, "replace", replacement=donor_all[sl]),
            "ordinary": ValueEdit(layer, head, pos, "replace", replacement=ordinary_all[sl]),
            "remove_column": ValueEdit(layer, head, pos, "remove_column"),
            "control": ValueEdit(layer, head, control[sl], "zero"),
        }
        base_h, base_l = base[sl.start]
        width = base_h.shape[1]
        r = rows[sl, :width].to(base_h.device)
        for name, edit in edits.items():
            h, lg = run_edit(model, batch, edit)
            hidden[name].add(h, base_h, r)
            if lg is not None and base_l is not None:
                has_logits = True
                logits[name].add(lg, base_l, r)
    return EditResult(
        layer=layer, head=head, kind=kind, positions=positions.tolist(),
        hidden={k: v.value for k, v in hidden.items()},
        logits={k: v.value for k, v in logits.items()} if has_logits else None,
    )


# ----------------------------------------------------------------------------- the diagnosis
@dataclass
class Diagnosis:
    """Sink records, per-layer/per-head summaries and causal edits of one model."""

    scan: ScanResult
    records: list[SinkRecord]
    rules: dict
    edits: list[EditResult] = field(default_factory=list)

    @property
    def found(self) -> bool:
        """False when no head's dominant column passed the rule ("no sinks found")."""
        return bool(self.records)

    def per_layer(self) -> list[dict]:
        """Per layer: share of (sample, head) that sink, counts per class, the dominant class, top token."""
        s, n_layers, h = self.scan.num_samples, self.scan.num_layers, self.scan.num_heads
        out = []
        for layer in range(n_layers):
            recs = [r for r in self.records if r.layer == layer]
            counts = Counter(r.kind for r in recs)
            tokens = Counter(r.token for r in recs)
            roles = Counter(f"{r.role}:{r.kind}" for r in recs)
            out.append({
                "layer": layer,
                "sink_pct": 100.0 * len(recs) / (s * h),
                "counts": {k: counts.get(k, 0) for k in metrics.SINK_KINDS},
                "dominant_kind": counts.most_common(1)[0][0] if recs else None,
                "top_token": tokens.most_common(1)[0][0] if recs else None,
                "roles": dict(roles.most_common()),  # "role:kind" -> count, e.g. "register:nop"
                "median_value_ratio_out": _median([r.value_norm_ratio_out for r in recs]),
                "median_stable_rank": _median([r.stable_rank for r in recs]),
            })
        return out

    def per_head(self) -> list[list[dict]]:
        """``[layer][head]``: share of samples where the head sinks and its most common class."""
        s = self.scan.num_samples
        table = [[{"sink_pct": 0.0, "kind": None} for _ in range(self.scan.num_heads)]
                 for _ in range(self.scan.num_layers)]
        grouped: dict[tuple[int, int], list[SinkRecord]] = {}
        for r in self.records:
            grouped.setdefault((r.layer, r.head), []).append(r)
        for (layer, head), recs in grouped.items():
            table[layer][head] = {"sink_pct": 100.0 * len(recs) / s,
                                  "kind": Counter(r.kind for r in recs).most_common(1)[0][0]}
        return table

    def to_json(self) -> dict:
        return {
            "schema": "sinklab.diagnose/1",
            "meta": self.scan.meta,
            "rules": self.rules,
            "found": self.found,
            "message": None if self.found else "no sinks found: no head's dominant column passed the rule",
            "per_layer": self.per_layer(),
            "per_head": self.per_head(),
            "edits": [asdict(e) for e in self.edits],
            "records": [asdict(r) for r in self.records],
        }

    def figures(self) -> dict:
        from .report.diagnose_figures import diagnosis_figures

        return diagnosis_figures(self)

    def save(self, out_dir: str | Path) -> Path:
        """Write ``diagnosis.json``, figures and ``report.html`` into ``out_dir`` (atomically)."""
        from .report.diagnose_html import render_diagnosis
        from .report.html import write_outputs

        return write_outputs(Path(out_dir), self.to_json(), self.figures(),
                             lambda images: render_diagnosis(self, images), "diagnosis.json")


def _median(values: list[float]) -> float | None:
    vals = sorted(v for v in values if v == v)
    return vals[len(vals) // 2] if vals else None


def _edit_heads(records: list[SinkRecord], n_layers: int) -> list[tuple[int, int, str]]:
    """The head with the most sinks in each layer (ties: larger mean strength), and its usual class."""
    chosen = []
    for layer in range(n_layers):
        recs = [r for r in records if r.layer == layer]
        if not recs:
            continue
        by_head: dict[int, list[SinkRecord]] = {}
        for r in recs:
            by_head.setdefault(r.head, []).append(r)
        head = max(by_head, key=lambda k: (len(by_head[k]), sum(r.strength for r in by_head[k])))
        chosen.append((layer, head, Counter(r.kind for r in by_head[head]).most_common(1)[0][0]))
    return chosen


def diagnose_inputs(
    model: nn.Module,
    batches: Iterable[dict[str, Tensor]],
    tokens: list[list[str]],
    *,
    rules: dict | None = None,
    edits: bool | list[tuple[int, int]] = True,
    special: dict[str, str | None] | None = None,
    edit_rows: Tensor | None = None,
    candidates: tuple[int, ...] = (0, 1, 2, 3),
    map_len: int = 64,
    meta: dict | None = None,
    progress=None,
    seed: int = 0,
) -> Diagnosis:
    """Diagnose prepared inputs (``input_ids``, ``pixel_values``, ``inputs_embeds`` …).

    ``edits``: True runs the causal edits on the most-sinking head of every layer; a list of
    ``(layer, head)`` picks them; False skips them. ``edit_rows`` ``[S, T]`` restricts the rows the edit
    RMS is measured on (e.g. the damped queries of the NOP task).
    """
    rules = _check_rules(rules or {})
    batches = list(batches)
    start, indexed = 0, []
    for batch in batches:
        first = next(iter(batch.values()))
        indexed.append((slice(start, start + first.shape[0]), batch))
        start += first.shape[0]
    scan = scan_inputs(model, batches, tokens, candidates=candidates, map_len=map_len,
                       thresholds={"eps": rules["sink_mass"], "eps_event": rules["eps_event"],
                                   "relaxed_share": rules["relaxed_share"]},
                       progress=progress, meta=meta)
    records = sink_records(scan, rules, special or {})
    diagnosis = Diagnosis(scan=scan, records=records, rules=rules)
    if edits:
        heads = ([(layer, head) for layer, head, _ in _edit_heads(records, scan.num_layers)] if edits is True
                 else [tuple(e) for e in edits])
        for layer, head in heads:
            if not (0 <= layer < scan.num_layers and 0 <= head < scan.num_heads):
                raise InputError(f"edit target layer {layer} head {head} is outside the model "
                                 f"({scan.num_layers} layers × {scan.num_heads} heads)")
            kinds = Counter(r.kind for r in records if r.layer == layer and r.head == head)
            kind = kinds.most_common(1)[0][0] if kinds else "no sink"
            diagnosis.edits.append(causal_edits(model, indexed, scan, layer, head, rows=edit_rows, seed=seed,
                                                kind=kind))
    return diagnosis


def special_tokens(tokenizer) -> dict[str, str | None]:
    """The tokenizer's BOS/CLS/SEP/EOS token strings."""
    return {name: getattr(tokenizer, f"{name}_token", None) for name in ("bos", "cls", "sep", "eos")}


def diagnose(
    model: nn.Module,
    tokenizer,
    texts: str | list[str] | None = None,
    *,
    seq_len: int = 64,
    samples: int = 16,
    batch_size: int = 16,
    rules: dict | None = None,
    edits: bool | list[tuple[int, int]] = True,
    seed: int = 0,
    source: str | None = None,
    revision: str | None = None,
    progress=None,
) -> Diagnosis:
    """Diagnose ``model``'s sinks on ``texts`` (default: the pydoc corpus, as :func:`sinklab.scan`).

    Returns a :class:`Diagnosis`; ``Diagnosis.found`` is False (not an error) when nothing sinks.
    """
    rules = _check_rules(rules or {})
    batches, tokens, meta = text_batches(model, tokenizer, texts, seq_len=seq_len, samples=samples,
                                         batch_size=batch_size, seed=seed, source=source, revision=revision)
    return diagnose_inputs(model, batches, tokens, rules=rules, edits=edits,
                           special=special_tokens(tokenizer), meta=meta, progress=progress, seed=seed)
