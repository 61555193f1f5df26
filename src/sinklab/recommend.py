"""``sinklab.recommend``: from a :class:`~sinklab.diagnose.Diagnosis`, which fix the evidence points to.

Fesser et al. (2026, arXiv:2606.08105) show that the two kinds of sink need different fixes: output
gating (Qiu et al. 2025, arXiv:2505.06708) lets a head damp its own output, so it no longer needs a
NOP sink; registers (Darcet et al. 2024, arXiv:2309.16588) give a broadcast hub a dedicated token to
live on; both together when both kinds are common; nothing when sinks are rare or already housed on a
dedicated slot. :func:`recommend` applies that rule to the counts of a diagnosis and writes out the
numbers it used, the rule, the confidence rule and how to apply the fix with sinklab.

The rule (``RULE`` below, thresholds in :data:`DEFAULT_THRESHOLDS`):

1. Sinks on registers (role ``register``) are *housed*: that is where a fix puts them. The rest are
   *unhoused*. ``share`` = unhoused sinks / (samples × layers × heads).
2. ``share < rare_share`` (5 %) → **none** (sinks are rare).
3. Among unhoused sinks, ``f_nop`` and ``f_broadcast`` are the class shares. A class is *common* when its
   share is ≥ ``common_share`` (25 %) and it has at least ``min_count`` sinks.
4. Both common → **gated+registers**; only NOP → **gated**; only broadcast → **registers**.
5. Neither common (mostly unclassified sinks): the causal edits decide where they exist (a head whose
   zero-value or mean-sink-value edit moves the output less than half as much as an ordinary value at the
   sink is NOP-like — its sink value carries no input-specific payload — else broadcast-like); without edits, the median output-space value-norm ratio does (≤ the midpoint of
   the NOP and broadcast thresholds → gated, else registers). Confidence is then at most *low*.

Confidence (``CONFIDENCE_RULE``): *high* when ≥ 30 unhoused sinks over ≥ 8 samples, the chosen class(es)
hold ≥ 60 % of them (each ≥ 30 % for both), and causal edits were run and agree with the classes; *medium*
when ≥ 10 sinks and the chosen class(es) hold ≥ 40 % (each ≥ 25 % for both) — or the high bar without
edits; *low* otherwise. A disagreeing edit lowers the level by one. For **none**: *high* with ≥ 8 samples,
else *medium*.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field, fields

from typing import TYPE_CHECKING, Protocol

from torch import nn

from . import _compat
from .errors import InputError

if TYPE_CHECKING:  # pragma: no cover - types only
    from .edits import EditResult
    from .scan import ScanResult


class Diagnosis(Protocol):
    """What :func:`recommend` reads of a :class:`sinklab.diagnose.Diagnosis` (which computes its recommendation, so
    this module does not import it)."""

    scan: ScanResult
    records: list
    rules: dict
    edits: list

__all__ = [
    "CONFIDENCE_RULE",
    "DEFAULT_THRESHOLDS",
    "RULE",
    "Recommendation",
    "SCHEMA_VERSION",
    "edit_signature",
    "recommend",
    "variant_support",
]

SCHEMA_VERSION = "sinklab.recommend/1"

DEFAULT_THRESHOLDS = {
    "rare_share": 0.05,  # unhoused sinks / (samples × layers × heads) below this: nothing to fix
    "common_share": 0.25,  # a class is common at this share of the unhoused sinks …
    "min_count": 3,  # … and with at least this many sinks
    "high_count": 30,  # confidence "high" needs this many unhoused sinks
    "high_samples": 8,  # … over at least this many samples
    "high_share": 0.6,  # … and the chosen class at this share (each ≥ high_share / 2 for both)
    "medium_count": 10,  # confidence "medium" needs this many sinks …
    "medium_share": 0.4,  # … and the chosen class at this share (each ≥ common_share for both)
    "nop_edit_ratio": 0.5,  # a head is NOP-like when zeroing v_s moves the output < this × an ordinary value
}

RULE = (
    "Sinks on register tokens are housed (that is where a fix puts them); the others are unhoused. "
    "share = unhoused sinks / (samples × layers × heads). If share < {rare_share:.0%}: none (sinks are rare). "
    "Else, with f_nop and f_broadcast the class shares among the unhoused sinks, a class is common when its share "
    "is ≥ {common_share:.0%} and it has ≥ {min_count} sinks: both common → gated+registers; NOP only → gated; "
    "broadcast only → registers. Neither common (mostly unclassified): the causal edits decide where they were run "
    "(zeroing the sink value or replacing it by the mean sink value moves the output < {nop_edit_ratio} × as much as an "
    "ordinary value at the sink → NOP-like, else broadcast-like), "
    "else the median output-space value-norm ratio (≤ midpoint of the NOP and broadcast thresholds → gated, else "
    "registers), at low confidence."
)

CONFIDENCE_RULE = (
    "high: ≥ {high_count} unhoused sinks over ≥ {high_samples} samples, the chosen class(es) hold ≥ {high_share:.0%} "
    "of them (each ≥ half that for both), and causal edits were run and agree with the classes; medium: ≥ "
    "{medium_count} sinks and the chosen class(es) hold ≥ {medium_share:.0%} (each ≥ {common_share:.0%} for both), "
    "or the high bar without edits; low: otherwise. Each head whose edits disagree with its class lowers the level "
    "by one (at most one step). none: high with ≥ {high_samples} samples, else medium."
)

FIXES = ("none", "gated", "registers", "gated+registers")
_LEVELS = ("low", "medium", "high")

_LLAMA_NOTE = ("Llama-style decoder: every variant applies, and a model with any of them scans, diagnoses, "
               "generates with a KV cache and streams with sinklab.SinkCache.")
_VIT_NOTE = ("ViT-style encoder: registers, elementwise/headwise gating, the sink logit and kv-bias are supported; "
             "sinklab scan/diagnose take the saved folder.")


@dataclass
class Recommendation:
    """Which fix a diagnosis points to, the numbers and rules behind it, and how to apply it."""

    fix: str  # none | gated | registers | gated+registers
    confidence: str  # low | medium | high
    reason: str  # one sentence, with the deciding numbers
    evidence: dict  # the numbers the rule used
    rule: str  # the decision rule, thresholds filled in
    confidence_rule: str  # the confidence rule, thresholds filled in
    how_to: list[str] = field(default_factory=list)  # commands / code to apply the fix
    support: dict = field(default_factory=dict)  # {"supported": bool | None, "api": str, "note": str}
    thresholds: dict = field(default_factory=dict)

    @property
    def variant(self) -> str | None:
        """The sinklab variant spec to train with (``None`` for no fix)."""
        return None if self.fix == "none" else self.fix

    def to_json(self) -> dict:
        return {"schema": SCHEMA_VERSION, **asdict(self), "variant": self.variant}

    @classmethod
    def from_json(cls, data: dict) -> Recommendation:
        """The recommendation :meth:`to_json` wrote (``variant`` is derived from ``fix``, not read)."""
        if data.get("schema") != SCHEMA_VERSION:
            raise InputError(f"not a {SCHEMA_VERSION} document (schema {data.get('schema')!r})")
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})

    def __str__(self) -> str:
        return json.dumps(self.to_json(), indent=1)


# ----------------------------------------------------------------------------- evidence
def edit_signature(edit: EditResult, nop_edit_ratio: float = DEFAULT_THRESHOLDS["nop_edit_ratio"]) -> str | None:
    """What the causal edits of one head say: ``"nop"``, ``"broadcast"`` or ``None`` (not measurable).

    NOP-like when the sink value carries no input-specific payload: zeroing it (a null value) *or* replacing it by
    the head's mean sink value (a constant value) moves the final states less than ``nop_edit_ratio`` × putting an
    ordinary token's value at the sink. Broadcast-like when both edits move them at least that much.
    """
    zero, mean, ordinary = (edit.hidden.get(k) for k in ("zero", "mean_sink", "ordinary"))
    if zero is None or mean is None or ordinary is None or any(v != v for v in (zero, mean, ordinary)) or ordinary <= 0:
        return None
    return "nop" if min(zero, mean) < nop_edit_ratio * ordinary else "broadcast"


def _evidence(diagnosis: Diagnosis, th: dict) -> dict:
    scan = diagnosis.scan
    layers = len(scan.attention_layers)  # a hybrid's recurrent / MLP-only layers have no heads to sink
    total = scan.num_samples * layers * scan.num_heads
    housed = [r for r in diagnosis.records if r.role == "register"]
    unhoused = [r for r in diagnosis.records if r.role != "register"]
    counts = Counter(r.kind for r in unhoused)
    n = len(unhoused)
    ratios = sorted(r.value_norm_ratio_out for r in unhoused if r.value_norm_ratio_out == r.value_norm_ratio_out)
    by_class = {kind: sorted({r.layer for r in unhoused if r.kind == kind}) for kind in ("nop", "broadcast")}
    edits = []
    for e in diagnosis.edits:
        sig = edit_signature(e, th["nop_edit_ratio"])
        agrees = None if e.kind not in ("nop", "broadcast") or sig is None else sig == e.kind
        edits.append({"layer": e.layer, "head": e.head, "class": e.kind, "edit_signature": sig, "agrees": agrees,
                      "zero": e.hidden.get("zero"), "mean_sink": e.hidden.get("mean_sink"), "ordinary": e.hidden.get("ordinary"),
                      "control": e.hidden.get("control")})
    sink_mass = scan.learned_sink_mass
    return {
        "samples": scan.num_samples, "layers": layers, "heads": scan.num_heads,
        "seq_len": scan.meta.get("seq_len"), "model": scan.meta.get("model"), "model_type": scan.meta.get("model_type"),
        "sinks": len(diagnosis.records), "housed_on_registers": len(housed), "unhoused": n,
        "share": n / total if total else 0.0,
        "counts": {k: counts.get(k, 0) for k in ("nop", "broadcast", "unclassified")},
        "f_nop": counts.get("nop", 0) / n if n else 0.0,
        "f_broadcast": counts.get("broadcast", 0) / n if n else 0.0,
        "f_unclassified": counts.get("unclassified", 0) / n if n else 0.0,
        "median_value_ratio_out": ratios[len(ratios) // 2] if ratios else None,
        "layers_by_class": by_class,
        "top_roles": dict(Counter(f"{r.role}:{r.kind}" for r in diagnosis.records).most_common(5)),
        "learned_sink_mass_mean": float(sink_mass.nanmean()) if sink_mass.numel() else 0.0,
        "edits": edits,
        "classification_rules": {k: diagnosis.rules[k] for k in
                                 ("nop_max_ratio", "broadcast_min_ratio", "broadcast_max_srank")},
        "output_gate": _gate_evidence(scan),
    }


def _gate_evidence(scan) -> dict | None:
    """The model's own output gate (Qwen3-Next, Qwen3.5, sinklab's ``gated``), means over heads of
    :func:`sinklab.metrics.gate_statistics`; None when it has none."""
    gates = scan.gate_statistics()
    if gates is None:
        return None
    mean = {k: float(v[scan.attention_layers].nanmean()) for k, v in gates.items()}
    return {k: (v if v == v else None) for k, v in mean.items()}


# ----------------------------------------------------------------------------- the rule
def _decide(ev: dict, th: dict) -> tuple[str, str, bool]:
    """(fix, reason, fallback) from the evidence; ``fallback`` marks rule 5 (neither class common)."""
    if ev["unhoused"] == 0 or ev["share"] < th["rare_share"]:
        housed = f" ({ev['housed_on_registers']} more sit on registers)" if ev["housed_on_registers"] else ""
        return "none", (f"sinks are rare: {ev['unhoused']} unhoused sinks in {ev['samples']} samples × {ev['layers']} "
                        f"layers × {ev['heads']} heads = {ev['share']:.1%} < {th['rare_share']:.0%}{housed}"), False
    c = ev["counts"]
    nop_common = ev["f_nop"] >= th["common_share"] and c["nop"] >= th["min_count"]
    bc_common = ev["f_broadcast"] >= th["common_share"] and c["broadcast"] >= th["min_count"]
    shares = (f"{ev['unhoused']} unhoused sinks ({ev['share']:.0%} of heads×samples): NOP {ev['f_nop']:.0%}, "
              f"broadcast {ev['f_broadcast']:.0%}, unclassified {ev['f_unclassified']:.0%}")
    if nop_common and bc_common:
        return "gated+registers", f"both kinds are common — {shares}", False
    if nop_common:
        return "gated", f"NOP sinks dominate — {shares}", False
    if bc_common:
        return "registers", f"broadcast sinks dominate — {shares}", False
    sigs = Counter(e["edit_signature"] for e in ev["edits"] if e["edit_signature"] is not None)
    if sigs:
        fix = "gated" if sigs["nop"] >= sigs["broadcast"] else "registers"
        return fix, (f"neither class is common ({shares}); the causal edits decide: {sigs['nop']} head(s) NOP-like, "
                     f"{sigs['broadcast']} broadcast-like"), True
    r = ev["median_value_ratio_out"]
    cr = ev["classification_rules"]
    mid = 0.5 * (cr["nop_max_ratio"] + cr["broadcast_min_ratio"])
    fix = "gated" if r is not None and r <= mid else "registers"
    return fix, (f"neither class is common ({shares}); median r_out {r:.3f} {'≤' if fix == 'gated' else '>'} {mid:.2f} "
                 "(midpoint of the NOP and broadcast thresholds)"), True


def _confidence(fix: str, ev: dict, th: dict, fallback: bool) -> str:
    if fix == "none":
        return "high" if ev["samples"] >= th["high_samples"] else "medium"
    if fallback:
        return "low"
    n = ev["unhoused"]
    if fix == "gated+registers":
        share_ok_high = min(ev["f_nop"], ev["f_broadcast"]) >= th["high_share"] / 2
        share_ok_medium = min(ev["f_nop"], ev["f_broadcast"]) >= th["common_share"]
    else:
        share = ev["f_nop"] if fix == "gated" else ev["f_broadcast"]
        share_ok_high, share_ok_medium = share >= th["high_share"], share >= th["medium_share"]
    judged = [e for e in ev["edits"] if e["agrees"] is not None]
    high_bar = n >= th["high_count"] and ev["samples"] >= th["high_samples"] and share_ok_high
    if high_bar and judged:
        level = 2
    elif (n >= th["medium_count"] and share_ok_medium) or high_bar:
        level = 1
    else:
        level = 0
    if any(e["agrees"] is False for e in judged):
        level = max(0, level - 1)
    return _LEVELS[level]


# ----------------------------------------------------------------------------- support and how-to
def _applied(model: nn.Module | None) -> set[str]:
    """The fixes already applied to ``model``: a subset of {"gated", "registers"} (from its variant)."""
    if model is None:
        return set()
    handle = getattr(model, "sinklab_variant_handle", None)
    if handle is None:
        base = getattr(model, "backbone", None)
        handle = getattr(base, "sinklab_variant_handle", None) if base is not None else None
    cfg = getattr(handle, "config", None)
    if cfg is None:
        return set()
    return {name for name, on in (("gated", cfg.gate is not None), ("registers", cfg.registers > 0)) if on}


def variant_support(model_type: str | None, model: nn.Module | None = None) -> dict:
    """Whether sinklab's variants can be applied to this architecture, through which API, and what is missing."""
    if model is not None:
        from .vit.variants import vit_attention_modules

        from .errors import SinklabError

        try:
            vit_attention_modules(model)
            return {"supported": True, "api": "sinklab.vit.apply_vit_variant",
                    "note": _VIT_NOTE}
        except SinklabError:  # UnsupportedModelError: not a ViT-style encoder, try the decoder API
            layers = None
        try:
            layers = _compat.find_layers(model)
        except SinklabError:
            layers = None
        if layers is not None and all(all(hasattr(getattr(layer, "self_attn", None), n)
                                          for n in ("q_proj", "k_proj", "v_proj", "o_proj")) for layer in layers):
            return {"supported": True, "api": "sinklab.apply_variant",
                    "note": _LLAMA_NOTE}
    if model_type in _compat.VIT_TYPES:
        return {"supported": True, "api": "sinklab.vit.apply_vit_variant",
                "note": _VIT_NOTE}
    if model_type in _compat.LLAMA_STYLE_TYPES:
        return {"supported": True, "api": "sinklab.apply_variant",
                "note": _LLAMA_NOTE}
    return {"supported": False, "api": None,
            "note": f"sinklab's variants do not support this architecture ({model_type or 'unknown'}) yet: they need "
                    "Llama-style self_attn.{q,k,v,o}_proj (sinklab.apply_variant) or a ViT/DINOv2 encoder "
                    "(sinklab.vit). Train a supported architecture with the fix, or port the variant."}


def _how_to(fix: str, support: dict) -> list[str]:
    if fix == "none":
        return ["No change needed. Re-run the diagnosis on longer inputs or more samples before concluding."]
    variant = fix
    if support.get("api") == "sinklab.vit.apply_vit_variant":
        steps = [f"Compare the fix on a small ViT at one budget: sinklab vit-experiment --variants baseline,{variant} "
                 "--seeds 3 --minutes 10",
                 f"Fine-tune a ViT/DINOv2: from sinklab.vit import apply_vit_variant, save_vit; "
                 f"apply_vit_variant(model, {variant!r}, init='off'); … train …; save_vit(model, 'out/')"]
    else:
        steps = [f"Train from scratch with the fix: sinklab train --variant {variant} "
                 f"--out runs/{variant.replace('+', '-')} [same data/size/steps as your baseline]",
                 f"Fine-tune: handle = sinklab.apply_variant(model, {variant!r}, init='off'); … train …; "
                 "sinklab.save(model, 'out/'); sinklab.load('out/') restores the variant"]
    if "gated" in fix:
        steps.append("init='off' starts the gate at σ = 1 (outputs unchanged); training learns where to damp.")
    if "registers" in fix:
        steps.append("Registers have no identity initialisation: they change the outputs from the first step and need "
                     "training; after training, diagnose again and check the broadcast sinks moved onto reg<i>.")
    steps.append("Then diagnose the fixed model again and compare the per-class sink counts.")
    if not support.get("supported"):
        steps.insert(0, "Not applicable to this model as is: " + support["note"])
    return steps


def recommend(diagnosis: Diagnosis, *, model: nn.Module | None = None, thresholds: dict | None = None) -> Recommendation:
    """Recommend the fix a :class:`~sinklab.diagnose.Diagnosis` points to (see the module docstring for the rule).

    ``model`` (optional) lets the recommendation check structurally which variant API supports it; without it
    the ``model_type`` recorded in the diagnosis decides.
    """
    th = {**DEFAULT_THRESHOLDS, **(thresholds or {})}
    unknown = set(th) - set(DEFAULT_THRESHOLDS)
    if unknown:
        raise InputError(f"unknown recommendation threshold(s) {sorted(unknown)}; known: {sorted(DEFAULT_THRESHOLDS)}")
    ev = _evidence(diagnosis, th)
    fix, reason, fallback = _decide(ev, th)
    confidence = _confidence(fix, ev, th, fallback)
    present = _applied(model)
    if ev["output_gate"] is not None:  # the architecture gates each head's output itself
        present.add("gated")
    ev["variant_applied"] = sorted(present)
    if fix != "none" and present:
        wanted = set(fix.split("+"))
        if wanted <= present:
            reason = (f"{reason}; but the model already has {'+'.join(sorted(wanted))}: the remaining sinks are what that "
                      "fix leaves behind (check their classes against the baseline), so nothing more to add")
            fix = "none"
        elif wanted & present:
            missing = wanted - present
            reason = f"{reason}; the model already has {'+'.join(sorted(wanted & present))}, so add {'+'.join(sorted(missing))}"
            fix = "+".join(f for f in ("gated", "registers") if f in missing)
    support = variant_support(ev["model_type"], model)
    return Recommendation(fix=fix, confidence=confidence, reason=reason, evidence=ev, rule=RULE.format(**th),
                          confidence_rule=CONFIDENCE_RULE.format(**th), how_to=_how_to(fix, support), support=support,
                          thresholds=th)
