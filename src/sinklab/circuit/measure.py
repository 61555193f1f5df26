"""One measuring pass of the circuit analysis: early-position column mass, position-0 records and the loss.

:func:`measure_rows` runs token rows through an :class:`~sinklab.capture.AttentionCapture` and a
:class:`~sinklab.circuit.hooks.PositionZeroRecorder` (optionally patching position 0); a
:class:`MeasureSession` keeps both open over several passes. :mod:`sinklab.circuit.analysis` turns the
measurements into the circuit's verdicts.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Self

import torch
from torch import Tensor, nn

from ..capture import AttentionCapture, CaptureConfig
from ..capture.loss import head_matches, scored_pairs, token_losses
from ..errors import InputError
from .destination import align_to_start, head_destinations
from .hooks import Patch, PositionZeroRecorder, find_sublayers

__all__ = ["EARLY", "MeasureSession", "measure_rows"]

EARLY = 4  # early positions whose sink rates are kept


def _pad(rows: list[list[int]], pad_id: int, side: str) -> tuple[Tensor, Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        sl = slice(0, len(r)) if side == "right" else slice(width - len(r), width)
        ids[i, sl] = torch.tensor(r, dtype=torch.long)
        mask[i, sl] = 1
    return ids, mask


def _losses(logits: Tensor, ids: Tensor, mask: Tensor, stride: int) -> tuple[Tensor, Tensor]:
    """Per-row sum and count of next-token cross-entropy from full ``[B, T, V]`` logits (models whose head
    :func:`~sinklab.capture.loss.head_matches` cannot reproduce), over the pairs of
    :func:`~sinklab.capture.loss.scored_pairs`."""
    valid = scored_pairs(mask, stride)  # (B, T-1)
    ce = torch.nn.functional.cross_entropy(logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten(),
                                           reduction="none").view(valid.shape)
    return torch.where(valid, ce, 0.0).double().sum(-1), valid.sum(-1).double()


class MeasureSession:
    """One :class:`AttentionCapture` plus one :class:`PositionZeroRecorder` kept open over several passes
    (the capture's per-layer weight factorisations are then computed once per model). The loss comes from the
    base model's final hidden states through the LM head at the scored positions only (:func:`~sinklab.capture.loss.token_losses`)
    where that reproduces the model's logits, else from a full forward."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.chunked_loss = head_matches(model)
        self.sub = find_sublayers(model)
        self.takes_positions = "position_ids" in inspect.signature(model.forward).parameters
        self.device = next(model.parameters()).device

    def __enter__(self) -> Self:
        # Only what the circuit reads: column masses, per-query rows and head output norms (no spectra, no
        # value norms, no hidden-state medians: the recorder keeps the hidden states it needs itself).
        self.config = CaptureConfig(candidates=(0,), map_len=0, row_stats=True, head_stats=False, hidden_stats=False)
        self.cap = AttentionCapture(self.model, self.config).__enter__()
        try:
            self.rec = PositionZeroRecorder(self.sub).__enter__()
        except BaseException:
            self.cap.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.rec.__exit__(*exc)
        self.cap.__exit__(*exc)


def measure_rows(model: nn.Module, rows: list[list[int]], *, pad_id: int = 0, batch_size: int = 8,
                 padding_side: str = "right", patch: Callable[[slice], Patch | None] | None = None,
                 progress: Callable[[int], None] | None = None, session: MeasureSession | None = None,
                 destinations: bool = True, loss_stride: int = 1, loss_rows: int | None = None,
                 massive: bool = True, extra: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
    """One pass over token ``rows``: attention column mass of the early positions, position-0 records, loss.

    Returns CPU tensors: ``column_mass`` ``[S, L, H, P]`` (P = 4 early positions, aligned to each row's first
    real token), the per-head destinations of :func:`~sinklab.circuit.destination.head_destinations`, the :class:`~sinklab.circuit.hooks.PositionZeroRecorder` fields (``hidden_norm`` ``[S, L+1, T]``,
    ``x0`` ``[S, L+1, d]``, ``attn0``/``mlp0`` ``[S, L, d]`` …), ``loss_sum``/``loss_count`` ``[S]``.
    ``patch(batch_slice)`` gives the :class:`~sinklab.circuit.hooks.Patch` for each batch (``None``: no edit).
    ``destinations=False`` skips the per-query rows and the destinations (the causal check does not read them).
    ``loss_stride``: the loss scores every that-many-th next-token target counting back from each row's last (1:
    every one);
    ``loss_rows``: only the first that many rows are scored (the others count 0 targets; None: every row).
    ``massive=False`` skips the recorder's massive-activation fields. ``extra``: model inputs besides the ids, one
    row per sample (a vision-language model's ``pixel_values``), sliced with each batch.
    """
    if padding_side not in ("left", "right"):
        raise InputError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    if session is None:
        with MeasureSession(model) as own:
            return measure_rows(model, rows, pad_id=pad_id, batch_size=batch_size, padding_side=padding_side,
                                patch=patch, progress=progress, session=own, destinations=destinations,
                                loss_stride=loss_stride, loss_rows=loss_rows, massive=massive, extra=extra)
    cap, rec = session.cap, session.rec
    parts: list[dict[str, Tensor]] = []
    cap.config = session.config if destinations else replace(session.config, row_stats=False)
    with torch.no_grad():
        for start in range(0, len(rows), batch_size):
            sl = slice(start, min(len(rows), start + batch_size))
            ids, mask = _pad(rows[sl], pad_id, padding_side)
            rec.start(mask, None if patch is None else patch(sl), massive=massive)
            scored = mask  # rows beyond loss_rows: nothing to score (no LM-head work)
            if loss_rows is not None and loss_rows < sl.stop:
                scored = mask.clone()
                scored[max(0, loss_rows - sl.start):] = 0
            kwargs: dict[str, Any] = {"input_ids": ids.to(session.device), "attention_mask": mask.to(session.device)}
            kwargs.update({k: v[sl].to(session.device) for k, v in (extra or {}).items()})
            if session.takes_positions:  # left padding: positions count real tokens only
                kwargs["position_ids"] = (mask.cumsum(-1) - 1).clamp_min(0).to(session.device)
            batch = cap.run(full_model=not session.chunked_loss, **kwargs)
            part = rec.collect()
            starts = mask.argmax(-1)
            part["column_mass"] = align_to_start(batch.column_mass, starts, EARLY)
            if destinations:
                # (the capture keeps the row statistics when destinations are asked for)
                part.update(head_destinations(batch.column_mass, batch.column_queries, batch.token_mask,
                                              batch.row_entropy, batch.row_diagonal, batch.row_previous,  # type: ignore[arg-type]
                                              batch.update_norm, starts))
            if session.chunked_loss:
                hidden = cap.last_output.last_hidden_state
                part["loss_sum"], part["loss_count"] = token_losses(model, hidden, ids, scored, stride=loss_stride)
            elif getattr(cap.last_output, "logits", None) is not None:
                part["loss_sum"], part["loss_count"] = _losses(cap.last_output.logits.cpu(), ids, scored, loss_stride)
            parts.append(part)
            if progress is not None:
                progress(sl.stop - sl.start)
    return _merge(parts)


def _merge(parts: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    out = {}
    for key in parts[0]:
        tensors = [p[key] for p in parts]
        if key in ("hidden_norm", "max_abs", "max_dim", "column_mass_all"):
            width = max(t.shape[-1] for t in tensors)
            fill = -1 if key == "max_dim" else math.nan
            tensors = [torch.nn.functional.pad(t, (0, width - t.shape[-1]), value=fill) for t in tensors]
        out[key] = torch.cat(tensors, dim=0)
    return out
