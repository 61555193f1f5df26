"""Causal value edits of one head: what the final hidden states do when a sink's value is changed.

Every edit runs through :class:`~sinklab.capture.ValueEdit` on the real model: zero the sink value, the
head's mean sink value, a donor's sink value, an ordinary token's value, remove the column, and a control
(zero an ordinary token). :func:`causal_edits` reruns only the blocks from the edited layer on
(:meth:`~sinklab.capture.AttentionCapture.final_states`), all six edits of a batch in one forward over stacked
copies; :func:`run_edit` is one stand-alone full pass.
:mod:`sinklab.diagnose` uses them to confirm its NOP / broadcast classes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .capture import AttentionCapture, CaptureConfig, StackedEdits, ValueEdit
from .capture.resume import BlockInputs
from .errors import InputError
from .scan import Progress, ScanResult

__all__ = ["EDITS", "EditResult", "KeptBatch", "causal_edits", "run_edit"]

EDITS = ("zero", "mean_sink", "donor", "ordinary", "remove_column", "control")


@dataclass
class EditResult:
    """Relative RMS change of the final hidden states under each causal edit of one head.

    The final hidden states are the base model's ``last_hidden_state`` (after the final norm where the
    model has one), over the real tokens of the edited samples.
    """

    layer: int
    head: int
    kind: str  # the head's most common class among its records
    positions: list[int]  # the sink position edited in each edited sample
    hidden: dict[str, float]  # edit name -> relative RMS change



def run_edit(model: nn.Module, batch: dict[str, Tensor], edit: ValueEdit | None) -> tuple[Tensor, Tensor | None]:
    """Final hidden states (and logits for LMs) of one full ``model(**batch)`` pass under ``edit`` (None: unedited).

    A stand-alone full pass (no statistics). :func:`diagnose` does not use it: its edits resume from the
    edited layer (:meth:`~sinklab.capture.AttentionCapture.final_states`).
    """
    with AttentionCapture(model, CaptureConfig(map_len=0, candidates=()), edit=edit) as cap:
        output = cap.forward(full_model=True, output_hidden_states=True, **batch)
    hidden = getattr(output, "last_hidden_state", None)
    if hidden is None:
        states = getattr(output, "hidden_states", None)
        hidden = states[-1] if states else None
    if hidden is None:
        raise InputError("the model output has neither last_hidden_state nor hidden_states")
    return hidden, getattr(output, "logits", None)


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
    """A non-sink real position per sample of ``sinks`` ``[n]``: the median-value-norm token or a random one."""
    out = []
    for s in range(sinks.shape[0]):
        real = scan.token_mask[s].nonzero()[:, 0].tolist()
        others = [p for p in real if p != int(sinks[s])] or real
        if pick == "median":
            norms = scan.value_norm[s, layer, head, others]
            order = norms.argsort()
            out.append(others[int(order[len(others) // 2])])
        else:
            out.append(others[int(torch.randint(len(others), (1,), generator=generator))])
    return torch.tensor(out, dtype=torch.long)


#: A batch kept for the edits: its sample slice and every block's input (see AttentionCapture.final_states).
KeptBatch = tuple[slice, BlockInputs]


def _recorded_values(cap: AttentionCapture, kept: list[KeptBatch], layer: int, head: int, positions: Tensor,
                     ordinary: Tensor) -> tuple[Tensor, Tensor]:
    """The values ``[m, dv]`` of ``(layer, head)`` at each sample's sink (``positions``) and at its ordinary token,
    recorded by rerunning block ``layer`` only, two copies per batch."""
    sink_values, ordinary_values = [], []
    try:
        for sl, inputs in kept:
            record = StackedEdits([ValueEdit(layer, head, positions[sl], "record"),
                                   ValueEdit(layer, head, ordinary[sl], "record")])
            cap.edit = record
            cap.final_states(inputs, layer, layer + 1, copies=2)
            sink_values.append(record.edits[0].recorded)
            ordinary_values.append(record.edits[1].recorded)
    finally:
        cap.edit = None
    return torch.cat(sink_values), torch.cat(ordinary_values)  # type: ignore[arg-type]  # "record" edits recorded them


def causal_edits(
    cap: AttentionCapture,
    kept: list[KeptBatch],
    scan: ScanResult,
    layer: int,
    head: int,
    *,
    samples: int | None = None,
    rows: Tensor | None = None,
    seed: int = 0,
    kind: str = "",
    progress: Progress | None = None,
    total: int = 0,
    stack: bool = True,
) -> EditResult:
    """Run every edit of :data:`EDITS` on ``(layer, head)`` at each edited sample's dominant column.

    ``cap`` is the active capture that produced ``kept`` (batches whose block inputs were kept); each edit
    reruns blocks ``layer …`` only, without statistics or LM head, against the unedited final states of the
    same pass. The first ``samples`` samples are edited (default: all kept); ``rows`` ``[S, T]`` restricts
    which query rows count in the RMS (default: every real token). ``mean_sink`` is the mean sink value and
    ``donor`` the previous sample's sink value (cyclically) over the edited samples. ``stack``: run the six
    edits of a batch as one forward over six stacked copies (:class:`~sinklab.capture.StackedEdits`; the same
    numbers as one pass per edit, to float rounding); False runs one resumed pass per edit.
    """
    covered = max(sl.stop for sl, _ in kept)
    n = covered if samples is None else min(samples, covered)
    positions = scan.dominant_columns()[:covered, layer, head]  # (m,)
    gen = torch.Generator().manual_seed(seed)
    ordinary = _ordinary_positions(scan, layer, head, positions, gen, "median")
    control = _ordinary_positions(scan, layer, head, positions, gen, "random")
    use = (scan.token_mask if rows is None else rows.bool())[:covered].clone()  # (m, T)
    use[n:] = False
    sink_all, ordinary_all = _recorded_values(cap, kept, layer, head, positions, ordinary)
    donor_all = sink_all.clone()
    donor_all[:n] = sink_all[:n].roll(1, dims=0)  # sample s gets sample s−1's sink value
    mean_sink = sink_all[:n].mean(0)
    hidden = {name: _RMS() for name in EDITS}
    try:
        for sl, inputs in kept:
            pos = positions[sl]
            edits = {
                "zero": ValueEdit(layer, head, pos, "zero"),
                "mean_sink": ValueEdit(layer, head, pos, "replace", replacement=mean_sink),
                "donor": ValueEdit(layer, head, pos, "replace", replacement=donor_all[sl]),
                "ordinary": ValueEdit(layer, head, pos, "replace", replacement=ordinary_all[sl]),
                "remove_column": ValueEdit(layer, head, pos, "remove_column"),
                "control": ValueEdit(layer, head, control[sl], "zero"),
            }
            base = inputs.final  # (B, T, d)
            b = base.shape[0]
            r = use[sl, : base.shape[1]].to(base.device)
            if not stack:
                for name, edit in edits.items():
                    cap.edit = edit
                    hidden[name].add(cap.final_states(inputs, layer), base, r)  # type: ignore[arg-type]
                    if progress is not None:
                        progress("edits", 1, total)
                continue
            cap.edit = StackedEdits(list(edits.values()))  # every edit in one forward: copy i under edit i
            out = cap.final_states(inputs, layer, copies=len(edits))  # (len(EDITS)·B, T, d)
            for i, name in enumerate(edits):
                hidden[name].add(out[i * b : (i + 1) * b], base, r)  # type: ignore[index]  # stop None: a tensor
            if progress is not None:
                progress("edits", len(edits), total)
    finally:
        cap.edit = None
    return EditResult(layer=layer, head=head, kind=kind, positions=positions[:n].tolist(),
                      hidden={k: v.value for k, v in hidden.items()})
