"""``sinklab.circuit``: how a causal LM builds its first-token sink (the P0 sink circuit).

Peng et al. 2026 (arXiv:2603.06591): under the causal mask position 0 attends only to itself, so its
representation depends on its own token alone; early blocks (MLPs, per the paper) amplify its norm until
RMSNorm turns it into a fixed key every head can find. This module measures, on one model:

* first-token ablation — Sink_k^ε per layer at k = 0 for each first-token condition
  (:mod:`sinklab.circuit.inputs`) and whether the sink is structural or tied to one token;
* amplification — ``r_l = ‖x₀‖ / median_{i>0} ‖x_i‖`` after each block and its attention/MLP split,
  direction stability of position 0, massive activations (Sun et al. 2024, arXiv:2402.17762);
* a causal check — position 0's residual at the amplification layer patched from a different first token,
  and scaled down to the median norm, with the change in downstream sink rates and in the loss.

Sublayer contributions (stated in every output): with ``u = x₀^{(l)} / ‖x₀^{(l)}‖`` and ``m`` the median
norm of the other tokens after block ``l``, ``c_attn = ⟨a₀, u⟩ / m``, ``c_mlp = ⟨f₀, u⟩ / m`` and
``c_carry = ⟨x₀^{(l−1)}, u⟩ / m`` for the attention output ``a₀`` and MLP output ``f₀`` of block ``l`` at
position 0. For a residual block ``x^{(l)} = x^{(l−1)} + a + f`` they sum exactly to ``r_l``
(``residual_error`` reports how far a model is from that identity).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from .. import metrics
from ..errors import InputError, UnsupportedModelError, check_int
from ..checks import check_batch_size, check_model, check_weights
from ..variants import register_count
from . import stage as rules
from .destination import DESTINATION_RULE, destination_summary
from .hooks import Patch
from .inputs import REFERENCE, CircuitInputs, text_inputs
from .measure import MeasureSession, measure_rows

__all__ = ["CAUSAL_SAMPLES", "CONDITION_SAMPLES", "CONTRIBUTION_RULE", "LOSS_STRIDE", "SCHEMA_VERSION", "CircuitResult",
           "circuit", "circuit_inputs"]

SCHEMA_VERSION = "sinklab.circuit/1"

CONTRIBUTION_RULE = ("c_attn = ⟨a₀, u⟩ / m, c_mlp = ⟨f₀, u⟩ / m, c_carry = ⟨x₀ before the block, u⟩ / m, with "
                     "u = x₀ / ‖x₀‖ after the block, a₀ / f₀ the block's attention / MLP output at position 0 and "
                     "m = median_{i>0} ‖x_i‖ after the block; c_carry + c_attn + c_mlp = r_l for a residual block")


@dataclass
class CircuitResult:
    """The P0 sink circuit of one model (plain data: every field is JSON-ready).

    Per-layer lists have ``L`` entries (decoder blocks, 0-based) except ``ratio`` and ``direction_cosine``
    (``L + 1``: index 0 is the embeddings). Sink rates are percent of heads, at ``seq_len`` tokens, ε = ``eps``.
    """

    num_layers: int
    num_heads: int
    seq_len: int
    num_samples: int
    eps: float
    layer_threshold: float
    conditions: dict[str, dict]  # name -> description, sink_rate [P][L], column_mass_0 [L][H], ratio [L+1], loss
    ratio: list[float]  # (L+1) r_l of the reference condition
    contributions: dict[str, list[float]]  # carry / attn / mlp, (L) each
    residual_error: list[float]  # (L) max_samples ‖x₀ − x₀_prev − a₀ − f₀‖ / ‖x₀‖
    direction_cosine: list[float]  # (L+1) mean pairwise cosine of x₀ across samples (reference)
    cross_condition_cosine: dict[str, list[float]]  # condition -> (L+1) cosine of x₀ with the reference's
    amplification_layer: int | None
    amplification_blocks: list[int]
    sink_layers: list[int]  # layers with Sink_0 ≥ layer_threshold (reference)
    ablation: dict
    massive: list[dict]  # (L+1) per hidden state
    causal: dict  # the causal check at amplification_layer
    stage: dict
    uniform_baseline: float  # column mass of position 0 under uniform causal attention at seq_len
    tokens: list[list[str]]  # reference tokens of the first samples
    causal_early: dict = field(default_factory=dict)  # the check at the first amplification run's last block
    rules: dict = field(default_factory=dict)
    meta: dict = field(default_factory=dict)

    # ------------------------------------------------------------------ JSON
    def to_json(self) -> dict:
        """JSON-ready dict with ``schema`` = :data:`SCHEMA_VERSION` (NaN written as ``None``)."""
        return {"schema": SCHEMA_VERSION, **json_clean(asdict(self))}

    @classmethod
    def from_json(cls, data: dict) -> CircuitResult:
        """Rebuild a result written by :meth:`to_json` (``None`` where a value was NaN)."""
        if data.get("schema") != SCHEMA_VERSION:
            raise InputError(f"not a {SCHEMA_VERSION} document (schema {data.get('schema')!r})")
        names = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in names})

    def sink_rate(self, condition: str = REFERENCE, position: int = 0) -> list[float]:
        """``[L]`` Sink_position^ε per layer (percent) under ``condition``."""
        return self.conditions[condition]["sink_rate"][position]

    def summary(self) -> str:
        """A few plain sentences: verdict, amplification, causal effect, stage."""
        c = self.causal
        parts = [self.ablation["text"], *([self.ablation["attention_text"]] if self.ablation.get("attention_text") else []),
                 (f"Amplification layer (largest rise of r): block {self.amplification_layer}; blocks where r at least "
                  f"doubles and rises by ≥ 1: {self.amplification_blocks or 'none'}."),
                 f"Layers with Sink_0 ≥ {self.layer_threshold:g} %: {self.sink_layers or 'none'}."]
        if c:
            parts.append(f"Causal check at block {c['layer']} ({c.get('samples', self.num_samples)} samples): scaling x₀ "
                         "down to the median norm changes mean "
                         f"downstream Sink_0 by {_fmt(c['scale']['downstream_delta'])} points and the loss by "
                         f"{_fmt(c['scale']['delta_loss'], '{:+.4f}')}; patching x₀ from a different first token: "
                         f"{_fmt(c['donor']['downstream_delta'])} points, loss {_fmt(c['donor']['delta_loss'], '{:+.4f}')}.")
        e = self.causal_early
        if e:
            parts.append(f"Early amplification, causal check at block {e['layer']}: scaling x₀ down changes mean "
                         f"downstream Sink_0 by {_fmt(e['scale']['downstream_delta'])} points, loss "
                         f"{_fmt(e['scale']['delta_loss'], '{:+.4f}')}; donor {_fmt(e['donor']['downstream_delta'])} "
                         f"points, loss {_fmt(e['donor']['delta_loss'], '{:+.4f}')}.")
        parts.append(f"Stage: {self.stage['stage']} (sink location: {self.stage['location']}).")
        return "\n".join(parts)


def _fmt(x: float | None, fmt: str = "{:+.1f}") -> str:
    return "–" if x is None or not math.isfinite(x) else fmt.format(x)


def json_clean(obj):
    """``obj`` with dict keys as strings, tuples as lists and non-finite floats as ``None`` (JSON-safe)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): json_clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_clean(v) for v in obj]
    return obj


def _r4(t: Tensor) -> list:
    """Tensor → nested lists rounded to 5 significant digits (NaN kept; cleaned on JSON output)."""
    return [float(f"{v:.5g}") if math.isfinite(v) else math.nan for v in t.double().flatten().tolist()] \
        if t.dim() == 1 else [_r4(row) for row in t]


# ---------------------------------------------------------------------------------------------- derived
def _ratio(rec: dict[str, Tensor]) -> Tensor:
    """``[S, L+1]`` ‖x₀‖ / median_{i>0} ‖x_i‖."""
    norms = rec["hidden_norm"].double()
    return norms[..., 0] / norms[..., 1:].nanmedian(dim=-1).values


def _contributions(rec: dict[str, Tensor]) -> tuple[dict[str, Tensor], Tensor]:
    """Mean-over-samples ``c_carry``, ``c_attn``, ``c_mlp`` ``[L]`` and the residual identity error ``[L]``."""
    x0 = rec["x0"].double()  # (S, L+1, d)
    after, before = x0[:, 1:], x0[:, :-1]
    u = after / after.norm(dim=-1, keepdim=True).clamp_min(1e-30)
    med = rec["hidden_norm"].double()[:, 1:, 1:].nanmedian(dim=-1).values  # (S, L)
    a, f = rec["attn0"].double(), rec["mlp0"].double()
    parts = {"carry": (before * u).sum(-1) / med, "attn": (a * u).sum(-1) / med, "mlp": (f * u).sum(-1) / med}
    err = (after - before - a - f).norm(dim=-1) / after.norm(dim=-1).clamp_min(1e-30)
    return {k: v.nanmean(0) for k, v in parts.items()}, err.amax(0)


def _pairwise_cosine(x0: Tensor) -> Tensor:
    """``[S, L+1, d]`` → ``[L+1]`` mean cosine over distinct sample pairs (NaN for one sample)."""
    s = x0.shape[0]
    unit = x0.double() / x0.double().norm(dim=-1, keepdim=True).clamp_min(1e-30)
    gram = torch.einsum("sld,tld->lst", unit, unit)  # (L+1, S, S)
    if s < 2:
        return torch.full((x0.shape[1],), math.nan, dtype=torch.float64)
    return (gram.sum((-1, -2)) - gram.diagonal(dim1=-2, dim2=-1).sum(-1)) / (s * (s - 1))


def _massive(rec: dict[str, Tensor], abs_threshold: float = 100.0, ratio: float = 1000.0) -> list[dict]:
    """Per hidden state (embeddings, then each block): Sun et al.'s massive activations and where they sit."""
    max_abs, max_dim = rec["max_abs"].double(), rec["max_dim"]  # (S, L+1, T)
    flags = metrics.is_massive(max_abs.nan_to_num(0.0), rec["median_abs"].double(), abs_threshold=abs_threshold,
                               ratio=ratio)
    out = []
    for layer in range(max_abs.shape[1]):
        f, m, d = flags[:, layer], max_abs[:, layer].nan_to_num(-1.0), max_dim[:, layer]
        flat = int(m.flatten().argmax())
        sample, pos = divmod(flat, m.shape[-1])
        channels: dict[int, int] = {}
        for ch in d[f].tolist():
            channels[int(ch)] = channels.get(int(ch), 0) + 1
        positions: dict[int, int] = {}
        for p in f.nonzero()[:, 1].tolist():
            positions[int(p)] = positions.get(int(p), 0) + 1
        out.append({
            "hidden_state": layer, "max_abs": float(m.max()), "max_position": pos, "max_channel": int(d[sample, pos]),
            "median_abs": float(rec["median_abs"][:, layer].double().mean()),
            "massive_tokens": int(f.sum()), "on_position_0": int(f[:, 0].sum()),
            "channels": dict(sorted(channels.items(), key=lambda kv: -kv[1])[:4]),
            "positions": dict(sorted(positions.items(), key=lambda kv: -kv[1])[:4]),
        })
    return out


def _condition_summary(rec: dict[str, Tensor], eps: float, description: str) -> dict:
    mass = rec["column_mass"].double()  # (S, L, H, P)
    rates = torch.stack([metrics.sink_rate_per_layer(mass, p, eps) for p in range(mass.shape[-1])])  # (P, L)
    loss = None
    if "loss_sum" in rec:
        loss = float(rec["loss_sum"].sum() / rec["loss_count"].sum().clamp_min(1))
    return {"description": description, "samples": int(mass.shape[0]), "sink_rate": _r4(rates),
            "column_mass_0": _r4(mass[..., 0].nanmean(0)), "ratio": _r4(_ratio(rec).nanmean(0)), "loss": loss}


def _ablation(conditions: dict[str, dict], threshold: float) -> dict:
    layers = {name: rules.sink_layers(c["sink_rate"][0], threshold) for name, c in conditions.items()}
    counts = {name: len(v) for name, v in layers.items()}
    first = {name: (v[0] if v else None) for name, v in layers.items()}
    most = max(counts.values())
    if most == 0:
        verdict = "no sink"
        text = f"No sink on position 0 in any condition (no layer with Sink_0 ≥ {threshold:g} %)."
    elif min(counts.values()) >= 0.5 * most:
        verdict = "structural"
        reform = ", ".join(f"{n}: from block {first[n]}" for n in conditions if n != REFERENCE)
        text = (f"Structural: the sink re-forms on whatever token comes first ({reform}; "
                f"{REFERENCE}: from block {first[REFERENCE]}).")
    else:
        keep = max(counts, key=counts.__getitem__)
        lost = [n for n in conditions if counts[n] < 0.5 * most]
        verdict = "token-tied"
        text = (f"Tied to the first token: the sink lives in {counts[keep]} layers under {keep} but in fewer than half "
                f"as many under {', '.join(lost)}.")
    rule = (f"a layer has a sink when its Sink_0 ≥ {threshold:g} %; structural if every condition keeps at least half "
            "as many sink layers as the condition with the most, token-tied otherwise")
    return {"verdict": verdict, "text": text, "sink_layers": layers, "first_sink_layer": first, "rule": rule}


def _sink_gone_condition(ablation: dict) -> str | None:
    """The condition whose attention the table shows: the one with the fewest sink layers (not the reference)."""
    others = [n for n in ablation["sink_layers"] if n != REFERENCE]
    return min(others, key=lambda n: len(ablation["sink_layers"][n])) if others else None


def _destination_text(ablation: dict, threshold: float) -> str:
    name = ablation["attention_condition"]
    if name is None:
        return ""
    ref, cond = ablation["attention"][REFERENCE], ablation["attention"][name]
    mean = lambda xs: sum(x for x in xs if x is not None and math.isfinite(x)) / max(1, len(xs))  # noqa: E731
    moved = [layer for layer, v in enumerate(cond["other_sink_pct"]) if v is not None and v >= threshold]
    tokens = Counter(cond["other_sink_token"][layer] for layer in moved).most_common(2)
    where = ("another token becomes the sink in layers " + ", ".join(map(str, moved)) + " (mostly "
             + ", ".join(repr(t) for t, _ in tokens) + ")") if moved else "no other token becomes a sink in any layer"
    return (f"Where the attention goes under {name}: mean entropy {mean(cond['entropy']):.2f} nats "
            f"(as tokenized {mean(ref['entropy']):.2f}), on the diagonal {mean(cond['diagonal']):.3f} "
            f"({mean(ref['diagonal']):.3f}), on the previous token {mean(cond['previous']):.3f} "
            f"({mean(ref['previous']):.3f}), on position 0 {mean(cond['position0_mass']):.3f} "
            f"({mean(ref['position0_mass']):.3f}); {where}.")


def _causal(model, rows, base: dict, donor_rec: dict, layer: int, eps: float, common: dict) -> dict:
    ref_rates = base["sink_rate"][0]

    def effect(rec: dict, what: str) -> dict:
        summ = _condition_summary(rec, eps, what)
        rates = summ["sink_rate"][0]
        delta = [a - b for a, b in zip(rates, ref_rates)]
        down = delta[layer + 1:]
        return {"description": what, "sink_rate_0": rates, "delta": delta, "column_mass_0": summ["column_mass_0"],
                "downstream_delta": sum(down) / len(down) if down else math.nan, "loss": summ["loss"],
                "delta_loss": (summ["loss"] - base["loss"]) if summ["loss"] is not None and base["loss"] is not None
                else None, "ratio": summ["ratio"]}

    donor = donor_rec["x0"][:, layer + 1]  # (S, d) x₀ after the block with a different first token
    rec_donor = measure_rows(model, rows, patch=lambda sl: Patch(layer, "replace", replacement=donor[sl]),
                             destinations=False, massive=False, **common)
    rec_scale = measure_rows(model, rows, patch=lambda sl: Patch(layer, "scale", target_ratio=1.0), destinations=False,
                             massive=False, **common)
    return {"layer": layer, "samples": len(rows),
            "donor": effect(rec_donor, "x₀ after the block replaced by its value under first_swapped"),
            "scale": effect(rec_scale, "x₀ after the block rescaled to the median norm of the other tokens (r = 1)"),
            "note": "layers ≤ the patched block are unchanged by construction (the patch is on its output)"}


#: Samples the causal check patches by default (the first ones). Each patch is a full pass, and there are two or
#: four of them: on all 16 samples they were four of SmolLM2's seven passes.
CAUSAL_SAMPLES = 4

#: Samples the other first-token conditions run on by default (the first ones; the reference runs on every
#: sample). Their verdict — does Sink_0 form, in how many layers — separates by a wide margin, and each condition
#: is a full pass (what the default changes, measured on SmolLM2 and Gemma 3: docs/benchmarks.md).
CONDITION_SAMPLES = 8

#: The loss scores every 8th next-token target by default, counting back from each row's last: an evenly spread
#: eighth of the targets (the same tokens under every condition that keeps the row's end). The LM head is the
#: costliest layer of a small-model, large-vocabulary LM (its cost on Gemma 3: docs/benchmarks.md).
LOSS_STRIDE = 8


def _first_rows(rec: dict[str, Tensor], n: int) -> dict[str, Tensor]:
    """A :func:`measure_rows` record cut to its first ``n`` samples."""
    return {key: value[:n] for key, value in rec.items()}


def _check_circuit_args(model: nn.Module, eps: float, batch_size: int, layer_threshold: float, causal: bool,
                        causal_samples: int | None, condition_samples: int | None, loss_stride: int) -> None:
    """:func:`circuit_inputs`' arguments and model checked before any pass (clear errors, no traceback)."""
    import math

    check_model(model, "circuit_inputs")
    check_batch_size(batch_size)
    if not 0.0 <= eps <= 1.0:
        raise InputError(f"eps must be in [0, 1], got {eps}")
    if isinstance(layer_threshold, bool) or not isinstance(layer_threshold, (int, float)) \
            or not math.isfinite(layer_threshold) or not 0.0 <= layer_threshold <= 100.0:
        raise InputError(f"layer_threshold (percent of a layer's heads) must be in [0, 100], got {layer_threshold!r}")
    if not isinstance(causal, bool):
        raise InputError(f"causal is True or False, got {causal!r}")
    if causal_samples is not None:
        check_int("causal_samples (--causal-samples)", causal_samples, 1,
                  ", or None (--causal-samples 0) to patch every sample")
    if condition_samples is not None:
        check_int("condition_samples (--condition-samples)", condition_samples, 1,
                  ", or None (--condition-samples 0) to run every condition on every sample")
    check_int("loss_stride (--loss-stride)", loss_stride, 1, " (1: every next-token target)")
    if register_count(model):
        raise UnsupportedModelError(
            f"the model puts {register_count(model)} register tokens in front of every sequence, so position 0 is "
            "a register, not the first token: the P0 circuit (first-token ablation) does not apply. Scan or "
            "diagnose it instead (sinks on registers are reported with role 'register').")
    check_weights(model)


def _cross_condition_cosine(recs: dict[str, dict[str, Tensor]]) -> dict:
    """Per condition other than the reference whose ``x0`` record matches the reference's on the same samples: the
    cosine of the two, averaged over the samples."""
    ref, cross = recs[REFERENCE], {}
    for name, rec in recs.items():
        n = rec["x0"].shape[0]
        if name != REFERENCE and rec["x0"].shape == ref["x0"][:n].shape:
            a, b = ref["x0"][:n].double(), rec["x0"].double()
            cross[name] = _r4(torch.nn.functional.cosine_similarity(a, b, dim=-1).mean(0))
    return cross


def circuit_inputs(model: nn.Module, inputs: CircuitInputs, *, eps: float = 0.3, batch_size: int = 8,
                   padding_side: str = "right", layer_threshold: float = rules.LAYER_SINK_THRESHOLD,
                   causal: bool = True, causal_samples: int | None = CAUSAL_SAMPLES,
                   condition_samples: int | None = CONDITION_SAMPLES, loss_stride: int = LOSS_STRIDE,
                   progress: Callable[[int], None] | None = None,
                   set_total: Callable[[int], None] | None = None, meta: dict | None = None) -> CircuitResult:
    """The circuit on prepared :class:`~sinklab.circuit.inputs.CircuitInputs` (e.g. Bigram-Backcopy rows).

    ``condition_samples``: the conditions other than the reference run on the first that many samples (None:
    all; the reference always runs on every sample). ``causal_samples``: the causal check patches the first that
    many samples (None: all; at most ``condition_samples``, since its donor comes from ``first_swapped``) and
    compares them with the reference on the same samples. ``loss_stride``: the loss scores every that-many-th
    next-token target counting back from each row's last (1: every one). ``progress(k)`` is called after every
    batch of ``k`` samples; ``set_total(n)`` once the number of sample passes is known (the reference, the
    other conditions, plus 2 causal patches, plus 2 more when the first amplification is elsewhere).
    """
    _check_circuit_args(model, eps, batch_size, layer_threshold, causal, causal_samples, condition_samples,
                        loss_stride)
    with MeasureSession(model) as session:
        common: dict[str, Any] = {"pad_id": inputs.pad_id, "batch_size": batch_size, "padding_side": padding_side,
                  "progress": progress, "session": session, "loss_stride": loss_stride, "extra": inputs.extra}
        n_all = len(inputs.conditions[REFERENCE])
        n_cond = n_all if condition_samples is None else min(condition_samples, n_all)
        n_causal = min(n_cond, n_all if causal_samples is None else causal_samples)
        # the reference runs on every sample (and alone records massive activations); its loss is scored on the
        # samples the other conditions share, so every condition's loss is over the same rows
        recs = {name: measure_rows(model, rows, loss_rows=n_cond, **common) if name == REFERENCE else
                measure_rows(model, rows[:n_cond], massive=False, **common)
                for name, rows in inputs.conditions.items()}
        amp = rules.amplification_layer(_ratio(recs[REFERENCE]).nanmean(0).tolist())
        conds = {name: _condition_summary(rec, eps, inputs.description[name]) for name, rec in recs.items()}
        causal_out, causal_early = {}, {}
        run = rules.first_amplification_run(_ratio(recs[REFERENCE]).nanmean(0).tolist())
        if set_total is not None:
            extra = (2 + 2 * bool(run and run[-1] != amp)) if causal and amp is not None else 0
            set_total(n_all + (len(inputs.conditions) - 1) * n_cond + extra * n_causal)
        if causal and amp is not None:
            rows = inputs.conditions[REFERENCE][:n_causal]
            base = (conds[REFERENCE] if n_causal == n_all else
                    _condition_summary(_first_rows(recs[REFERENCE], n_causal), eps, inputs.description[REFERENCE]))
            causal_out = _causal(model, rows, base, recs["first_swapped"], amp, eps, common)
            if run and run[-1] != amp:
                causal_early = _causal(model, rows, base, recs["first_swapped"], run[-1], eps, common)
    ref = recs[REFERENCE]
    ratio = _ratio(ref).nanmean(0)
    contrib, resid = _contributions(ref)
    n_layers, n_heads = ref["column_mass"].shape[1], ref["column_mass"].shape[2]
    early = conds[REFERENCE]["sink_rate"]
    seq_len = ref["hidden_norm"].shape[-1]
    cross = _cross_condition_cosine(recs)
    stage = rules.classify_stage(early, rules.stage_amplification(ratio.tolist()), threshold=layer_threshold)
    ablation = _ablation(conds, layer_threshold)
    ablation["attention"] = {name: destination_summary(rec, inputs.tokens[name], eps) for name, rec in recs.items()}
    ablation["attention_condition"] = _sink_gone_condition(ablation)
    ablation["attention_text"] = _destination_text(ablation, layer_threshold)
    return CircuitResult(
        num_layers=n_layers, num_heads=n_heads, seq_len=seq_len, num_samples=ref["x0"].shape[0], eps=eps,
        layer_threshold=layer_threshold, conditions=conds, ratio=_r4(ratio),
        contributions={k: _r4(v) for k, v in contrib.items()}, residual_error=_r4(resid),
        direction_cosine=_r4(_pairwise_cosine(ref["x0"])), cross_condition_cosine=cross,
        amplification_layer=amp, amplification_blocks=rules.amplification_blocks(ratio.tolist()),
        sink_layers=rules.sink_layers(early[0], layer_threshold), ablation=ablation,
        massive=_massive(ref), causal=causal_out, causal_early=causal_early, stage=stage,
        uniform_baseline=sum(1.0 / (i + 1) for i in range(seq_len)) / seq_len,
        tokens=inputs.tokens[REFERENCE][:4],
        rules={"amplification": rules.AMPLIFICATION_RULE, "contributions": CONTRIBUTION_RULE,
               "location": rules.LOCATION_RULE, "stage": rules.STAGE_RULE, "ablation": ablation["rule"],
               "attention": DESTINATION_RULE,
               "massive": "|a| > 100 and ≥ 1000 × the median |a| of that hidden state (Sun et al. 2024)",
               "positions": "position 0 = each row's first real token (padding skipped)",
               "loss": ("mean next-token cross-entropy over " + ("every target" if loss_stride == 1 else
                        f"every k-th target counting back from each row's last (k = {loss_stride})")
                        + f" of the first {n_cond} samples (those every condition runs on; the conditions other "
                        f"than {REFERENCE} run on them only)")},
        meta={**inputs.meta, "conditions": list(inputs.conditions), "condition_samples": n_cond,
              "loss_stride": loss_stride, **(meta or {})},
    )


def circuit_images(model: nn.Module, images: list, text: str = "Describe the image.", *, processor: Any = None,
                   text_ids: list[int] | None = None, bos_id: int | None = None, eps: float = 0.3,
                   batch_size: int = 8, causal: bool = True, source: str | None = None, revision: str | None = None,
                   progress: Callable[[int], None] | None = None) -> CircuitResult:
    """The P0 sink circuit of a vision-language model: one sample per image (the image, then ``text``), built as
    :func:`sinklab.scan.scan_images` builds it, under the three first-token conditions; every forward of every
    condition (and the causal patches) runs with the samples' pixels. With the model's ``processor`` the conditions
    come from its tokenizer (as :func:`circuit`); without one (a tiny random model) the rows are the config's image
    tokens and ``text_ids`` after ``bos_id``, and the first token is swapped for ``text_ids[0]`` (or ``[1]``)."""
    from ..scan import image_inputs
    from .inputs import id_inputs, row_inputs

    if not images:
        raise InputError("no image for the circuit")
    if processor is None and (bos_id is None or not text_ids or len(text_ids) < 2):
        raise InputError("circuit_images without a processor needs bos_id and at least two text_ids")
    built = [image_inputs(model, [image], text, processor=processor, text_ids=text_ids, bos=bos_id, source=source,
                          revision=revision) for image in images]
    rows = [b.batches[0]["input_ids"][0].tolist() for b, _ in built]
    keys = [k for k in built[0][0].batches[0] if k not in ("input_ids", "attention_mask")]
    shapes = {k: {tuple(b.batches[0][k].shape) for b, _ in built} for k in keys}
    if any(len(s) != 1 or next(iter(s))[:1] != (1,) for s in shapes.values()):
        raise UnsupportedModelError(f"{type(model).__name__}: its image inputs are not one row of one shape per image "
                                    f"({ {k: sorted(s) for k, s in shapes.items()} }); the circuit needs one sample "
                                    "per image")
    extra = {k: torch.cat([b.batches[0][k] for b, _ in built]) for k in keys}
    if processor is not None:
        inputs = row_inputs(getattr(processor, "tokenizer", processor), rows)
    else:
        swap = (text_ids[0], text_ids[1])  # type: ignore[index]  # checked above
        inputs = id_inputs(torch.tensor(rows), bos_id=bos_id, swap_ids=swap)  # type: ignore[arg-type]
    inputs.extra = extra
    return circuit_inputs(model, inputs, eps=eps, batch_size=batch_size, causal=causal, progress=progress,
                          meta={**built[0][1], "images": len(images)})


def circuit(model: nn.Module, tokenizer, texts: str | list[str] | None = None, *, seq_len: int = 64,
            samples: int = 16, batch_size: int = 8, eps: float = 0.3, special_token: str | None = None,
            padding_side: str = "right", layer_threshold: float = rules.LAYER_SINK_THRESHOLD, causal: bool = True,
            causal_samples: int | None = CAUSAL_SAMPLES, condition_samples: int | None = CONDITION_SAMPLES,
            loss_stride: int = LOSS_STRIDE, source: str | None = None, revision: str | None = None,
            progress: Callable[[int], None] | None = None,
            set_total: Callable[[int], None] | None = None) -> CircuitResult:
    """Measure the P0 sink circuit of a causal LM on ``texts`` (default: the pydoc corpus).

    Texts are cut into ``samples`` windows of ``seq_len`` tokens and run under three first-token conditions
    (see :mod:`sinklab.circuit.inputs`) — the reference on every sample, the others on the first
    ``condition_samples`` — then the causal patches at the amplification layer, on the first ``causal_samples``
    samples (None: every one); the loss scores every ``loss_stride``-th target. Progress is
    reported per sample through ``progress``; ``set_total`` receives the number of sample passes when known.
    """
    from ..checks import check_vocab
    from ..scan import model_meta
    from ..texts import default_texts

    check_model(model, "circuit")
    check_batch_size(batch_size)
    if isinstance(texts, str):
        texts = [texts]
    corpus = "user text" if texts is not None else "pydoc_data.topics (Python standard library documentation)"
    inputs = text_inputs(tokenizer, default_texts() if texts is None else texts, seq_len=seq_len, samples=samples,
                         special_token=special_token)
    check_vocab(model, tokenizer, torch.tensor([max(max(r) for r in v) for v in inputs.conditions.values()]))
    meta = model_meta(model, source, revision, corpus=corpus, requested_seq_len=seq_len)
    return circuit_inputs(model, inputs, eps=eps, batch_size=batch_size, padding_side=padding_side,
                          layer_threshold=layer_threshold, causal=causal, causal_samples=causal_samples,
                          condition_samples=condition_samples, loss_stride=loss_stride, progress=progress,
                          set_total=set_total, meta=meta)
