"""The closed loop on the Bigram-Backcopy task: diagnose → recommend → train the fix at equal budget → diagnose.

:func:`bb_closed_loop` trains the baseline with :func:`sinklab.train.train` (``--data bb``), diagnoses it on
held-out sequences (with causal edits: one layer, cheap), asks :func:`sinklab.recommend.recommend` for the
fix, trains that variant with the *same* configuration, seed, data order and number of steps, diagnoses
again and reports what changed for the sink class the fix targets:

* ``nop_valued_sinks`` — sinks whose output-space value-norm ratio is at or below the midpoint of the
  NOP and broadcast thresholds (the NOP side; the BB sink sits between the two thresholds);
* ``bos_attention_non_trigger`` — the attention non-trigger queries give BOS (the dormant head's parking);
* ``bos_value_norm_ratio_out`` and the edit signature of the sink head.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, replace
from pathlib import Path

import torch

from .diagnose import Diagnosis, diagnose_inputs
from .train import TrainConfig, bb_metrics, train
from .variants import register_count, register_labels

__all__ = ["bb_closed_loop", "bb_diagnose", "sink_summary"]


def bb_diagnose(model, task, samples: int = 16, seed: int = 123, edits: bool = True) -> Diagnosis:
    """Diagnose a Bigram-Backcopy model on ``samples`` fresh sequences (tokens labelled, BOS as ``<bos>``)."""
    x = task.sample(samples, torch.Generator().manual_seed(seed))
    regs = register_labels(register_count(model))  # prepended inside the model
    tokens = [regs + ["<bos>"] + [f"t{int(i)}" for i in row[1:]] for row in x]
    return diagnose_inputs(model, [{"input_ids": x}], tokens, special={"bos": "<bos>"}, edits=edits,
                           meta={"model": "bb", "model_type": "llama", "task": "bigram-backcopy"})


def sink_summary(d: Diagnosis) -> dict:
    """Sink counts by class, NOP-valued sinks, sinks at BOS and the median r_out of one diagnosis."""
    mid = 0.5 * (d.rules["nop_max_ratio"] + d.rules["broadcast_min_ratio"])
    ratios = sorted(r.value_norm_ratio_out for r in d.records)
    return {
        "sinks": len(d.records),
        "by_class": {k: Counter(r.kind for r in d.records).get(k, 0) for k in ("nop", "broadcast", "unclassified")},
        "nop_valued_sinks": sum(r.value_norm_ratio_out <= mid for r in d.records),
        "broadcast_valued_sinks": sum(r.value_norm_ratio_out > mid for r in d.records),
        "sinks_at_bos": sum(r.role == "bos" for r in d.records),
        "sinks_on_registers": sum(r.role == "register" for r in d.records),
        "median_value_ratio_out": ratios[len(ratios) // 2] if ratios else None,
        "mean_strength": sum(r.strength for r in d.records) / len(d.records) if d.records else 0.0,
        "per_layer": d.per_layer(),
    }


def _train_or_reuse(cfg: TrainConfig, out: Path, reuse: bool, progress) -> dict:
    import json

    summary = out / "summary.json"
    if reuse and summary.is_file() and json.loads((out / "train_config.json").read_text()) == asdict(cfg):
        return json.loads(summary.read_text())
    return train(cfg, out, progress=progress)


def bb_closed_loop(cfg: TrainConfig, out: str | Path, samples: int = 16, progress=None, reuse: bool = False) -> dict:
    """Baseline → diagnosis → recommendation → fixed model (same budget) → diagnosis. Returns a dict
    (JSON-ready except ``"diagnoses"``). ``reuse=True`` loads runs already trained in ``out`` with the same config."""
    from . import checkpoint
    from .synth.bigram_backcopy import BigramBackcopy

    if cfg.data != "bb" or cfg.variant:
        raise ValueError("bb_closed_loop needs a baseline TrainConfig with data='bb' and no variant")
    out = Path(out)
    task = BigramBackcopy(vocab=cfg.bb_vocab, triggers=cfg.bb_triggers, seq_len=cfg.seq_len, seed=cfg.seed)
    probe = task.sample(16, torch.Generator().manual_seed(cfg.seed + 7))
    runs: dict[str, dict] = {}
    base_summary = _train_or_reuse(cfg, out / "baseline", reuse, progress)
    base = checkpoint.load(out / "baseline" / "final")
    base_diag = bb_diagnose(base, task, samples)
    rec = base_diag.recommendation  # computed by the diagnosis, with the model
    assert rec is not None  # diagnose_inputs always sets it
    runs["baseline"] = {"train": _train_numbers(base_summary), "bb": bb_metrics(base, task, probe),
                        "sinks": sink_summary(base_diag)}
    result = {"config": asdict(cfg), "recommendation": rec.to_json(), "runs": runs, "fix": rec.fix}
    if rec.variant is not None:
        fixed_cfg = replace(cfg, variant=rec.variant)
        fixed_summary = _train_or_reuse(fixed_cfg, out / "fixed", reuse, progress)
        fixed = checkpoint.load(out / "fixed" / "final")
        fixed_diag = bb_diagnose(fixed, task, samples)
        runs["fixed"] = {"variant": rec.variant, "train": _train_numbers(fixed_summary),
                         "bb": bb_metrics(fixed, task, probe), "sinks": sink_summary(fixed_diag),
                         "recommendation_after": fixed_diag.recommendation.to_json()}  # type: ignore[union-attr]
        result["diagnoses"] = (base_diag, fixed_diag)
    else:
        result["diagnoses"] = (base_diag,)
    return result


def _train_numbers(summary: dict) -> dict:
    return {k: summary[k] for k in ("steps", "tokens", "seconds", "final_loss")}
