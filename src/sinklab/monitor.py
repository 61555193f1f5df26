"""Watch sinks appear during training: a monitor for any training loop (and a transformers callback).

At chosen steps the monitor scans a fixed probe batch with :func:`sinklab.scan_inputs` and logs, per
layer: Sink_1^ε (sink rate at position 0), the mean attention each head gives position 0, position 0's
hidden-norm ratio (block output over the median of the other tokens), massive activations, Sink^ε of the
first positions, the amplification layer and the P0-circuit stage (:func:`sinklab.circuit.classify_stage`:
no sink / forming in deep layers / spread over the first positions / settled on position 0) — plus the
loss and tokens seen. Records go to a JSONL file (:func:`read_records` reads it back); the emergence figure
(metrics vs tokens seen, one line per layer) is drawn by :func:`sinklab.report.monitor_figures.write_emergence`.

Under ``torchrun`` / ``accelerate launch`` (see docs/distributed.md) the monitor is created and stepped on
every rank: with DDP (or a plain model) only the main process runs the probe; with FSDP2 (``fully_shard``)
every rank runs it, as FSDP needs. Only the main process keeps records and writes the JSONL.
Call :meth:`SinkMonitor.step` once per optimiser step (not per micro-batch under gradient accumulation).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor, nn

from . import distributed, metrics
from .circuit.stage import amplification_layer, classify_stage, stage_amplification
from .errors import check_int

__all__ = ["SinkMonitor", "SinkMonitorCallback", "read_records"]


class SinkMonitor:
    """Log sink metrics of ``model`` on ``probe`` (``{"input_ids": [B, T], ...}``) every ``every`` steps."""

    def __init__(self, model: nn.Module, probe: dict[str, Tensor], *, every: int = 100,
                 path: str | Path | None = None, eps: float = 0.3) -> None:
        check_int("every", every, 1, " (optimiser steps between measurements)")
        self.model = model
        self.probe = probe
        self.every = every
        self.eps = eps
        self.path = Path(path) if path is not None else None
        self.records: list[dict] = []  # on the main process only
        if self.path is not None and distributed.is_main():
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("")

    def measure(self) -> dict | None:
        """One scan of the probe batch: per-layer lists (None on a rank that does not run the probe)."""
        from .scan import scan_inputs

        model = distributed.unwrap(self.model)  # DDP: the wrapped module (its forward has no collectives)
        was_training = model.training
        n = next(iter(self.probe.values())).shape[1]
        with distributed.probe_ranks(model) as runs, torch.no_grad():
            if not runs:
                return None
            r = scan_inputs(model, [self.probe], [[""] * n] * next(iter(self.probe.values())).shape[0],
                            candidates=(0,), map_len=0, thresholds={"eps": self.eps}, split=False)
        model.train(was_training)
        all_norms = r.hidden_norm.double()  # (S, L+1, T): embeddings, then block outputs
        ratio_all = (all_norms[..., 0] / all_norms[..., 1:].nanmedian(-1).values).nanmean(0)  # (L+1,)
        ratio = ratio_all[1:]
        early = [r.sink_rate_per_layer(p, self.eps).tolist() for p in range(min(4, n))]  # [P][L]
        amp = amplification_layer(ratio_all.tolist())
        stage = classify_stage(early, stage_amplification(ratio_all.tolist()))
        massive = metrics.is_massive(r.hidden_max_abs[:, 1:].double(), r.hidden_median_abs[:, 1:].double())
        return {
            "sink_rate_0": r.sink_rate_per_layer(0, self.eps).tolist(),
            "attention_to_0": r.column_mass[..., 0].double().nanmean(0).tolist(),  # [L][H]
            "hidden_norm_ratio_0": ratio.tolist(),
            "massive_tokens": massive.double().sum(-1).mean(0).tolist(),
            "max_activation": r.hidden_max_abs[:, 1:].double().nan_to_num(0).amax(dim=(0, 2)).tolist(),
            "value_norm_ratio_0": metrics.value_norm_ratio(r.value_norm_out.double(), 0, r.token_mask[:, None, None])
            .nanmean(0).tolist(),  # [L][H] output-space value norm of position 0 vs the rest
            "sink_rate_early": early,  # [P][L] Sink_p^ε per layer for the first positions
            "amplification_layer": amp,  # block with the largest rise of ‖x₀‖ / median ‖x_i‖
            "stage": stage["stage"],
            "sink_location": stage["location"],
        }

    def step(self, step: int, *, loss: float | None = None, tokens: int | None = None, force: bool = False) -> dict | None:
        """Call after each optimiser step; measures when ``step % every == 0`` (or ``force``).

        ``step`` counts optimiser steps and ``tokens`` all ranks' tokens. Returns the record on the main
        process (None elsewhere and off schedule). Under a launcher every rank must call it.
        """
        if not force and step % self.every:
            return None
        measured = self.measure()
        if measured is None or not distributed.is_main():
            return None
        record = {"step": step, "tokens": tokens, "loss": loss, **measured}
        self.records.append(record)
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
        return record


def read_records(path: str | Path) -> list[dict]:
    """The records a monitor wrote to its JSONL file (one dict per measurement, in step order)."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


try:  # pragma: no cover - exercised only where transformers' Trainer is used
    from transformers import TrainerCallback

    class SinkMonitorCallback(TrainerCallback):
        """``Trainer(callbacks=[SinkMonitorCallback(monitor)])``: measures on the monitor's schedule.

        ``on_step_end`` runs once per optimiser step (``state.global_step``; micro-batches of gradient
        accumulation do not count) on every rank; ``num_input_tokens_seen`` is all ranks' tokens.
        """

        def __init__(self, monitor: SinkMonitor) -> None:
            self.monitor = monitor

        def on_step_end(self, args, state, control, **kwargs):
            loss = state.log_history[-1].get("loss") if state.log_history else None
            tokens = getattr(state, "num_input_tokens_seen", None) or None
            self.monitor.step(state.global_step, loss=loss, tokens=tokens)
            return control
except ImportError:  # pragma: no cover
    SinkMonitorCallback = None  # type: ignore[misc, assignment]
