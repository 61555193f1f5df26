"""The capture's data: what to keep (:class:`CaptureConfig`), what one pass returns (:class:`CaptureBatch`),
and a causal edit of one head's values (:class:`ValueEdit`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..errors import check_int

__all__ = ["CaptureConfig", "CaptureBatch", "ValueEdit", "StackedEdits", "EDIT_MODES"]


@dataclass
class CaptureConfig:
    """What :class:`~sinklab.capture.AttentionCapture` keeps besides the always-on statistics."""

    candidates: tuple[int, ...] = (0, 1, 2, 3)  # positions whose per-query attention is kept
    map_len: int = 128  # keep sample 0's attention maps over its first map_len positions (0: none)
    chunk_elements: int = 1 << 21  # score entries per query chunk (bounds the temporaries)
    route_threshold: float = 0.5  # A_ij at or above this counts a query as routed to column j
    local_window: int = 64  # each query's attention on its last local_window keys: CaptureBatch.local_mass
    row_stats: bool = False  # also keep each query's attention entropy and its share on itself / the previous key
    head_stats: bool = True  # value norms, update spectrum, common mode per head (False: update norms only)
    hidden_stats: bool = True  # block hidden-state norms, max |a| and medians (False: only checked to be finite)

    def __post_init__(self) -> None:
        for p in self.candidates:
            check_int("a candidate position", p, 0)
        check_int("map_len", self.map_len, 0)
        check_int("chunk_elements", self.chunk_elements, 1)
        check_int("local_window", self.local_window, 1)


@dataclass
class CaptureBatch:
    """Statistics of one forward pass over a batch (CPU tensors; padding positions are NaN).

    Shapes: ``B`` batch, ``L`` layers, ``H`` heads, ``T`` positions, ``K`` candidates, ``r`` head width.
    ``value_norm``, ``value_norm_out``, ``update_spectrum`` and ``common_mode`` are None under
    ``CaptureConfig(head_stats=False)``; the ``hidden_*`` fields under ``hidden_stats=False``.
    """

    column_mass: Tensor  # (B, L, H, T) mean attention received from the queries that see it
    column_min: Tensor  # (B, L, H, T) min over those queries
    routed_fraction: Tensor  # (B, L, H, T) share of those queries with A >= route_threshold
    candidate_attention: Tensor  # (B, L, H, T, K) attention of each query to each candidate position
    value_norm: Tensor | None  # (B, L, H, T) ||v_j|| in head space
    value_norm_out: Tensor | None  # (B, L, H, T) ||W_O^h v_j|| in output space (head space if W_O unknown)
    update_norm: Tensor  # (B, L, H, T) ||W_O^h o_i|| of each query's head update
    update_spectrum: Tensor | None  # (B, L, H, r) singular values of the head update U over real queries
    common_mode: Tensor | None  # (B, L, H) ||mean u||^2 / mean ||u||^2
    learned_sink_mass: Tensor  # (B, L, H) mean over queries of 1 - sum_j A_ij
    local_mass: Tensor  # (B, L, H, T) each query's attention on its CaptureConfig.local_window most recent keys
    column_queries: Tensor  # (B, L, T) number of real queries that see each key (0 at padding)
    hidden_norm: Tensor | None  # (B, L+1, T) ||x|| per token, index 0 = block-0 input
    hidden_max_abs: Tensor | None  # (B, L+1, T) max |x| per token
    hidden_max_dim: Tensor | None  # (B, L+1, T) its dimension (long)
    hidden_median_abs: Tensor | None  # (B, L+1) median |x| over real tokens and dims
    token_mask: Tensor  # (B, T) real tokens
    attention_maps: Tensor | None  # (L, H, m, m) sample 0's attention over its first m positions
    qk_spectrum: Tensor  # (L, H, dh) singular values of Wq_h^T Wk_h (NaN if layout unknown)
    output_space: list[bool] = field(default_factory=list)  # per layer: W_O found
    row_entropy: Tensor | None = None  # (B, L, H, T) entropy (nats) of each query's attention row (row_stats)
    row_diagonal: Tensor | None = None  # (B, L, H, T) A_ii, the query's attention to its own key (row_stats)
    row_previous: Tensor | None = None  # (B, L, H, T) A_i,i−1, to the key just before it (NaN at i = 0) (row_stats)
    gate: Tensor | None = None  # (B, L, H, T) mean output gate on each query's head output (None: no layer gated)
    group_mass: Tensor | None = None  # (B, L, H, T) Σ over the run's query group (run(query_group=…)) of A_ij
    layer_kinds: list[str] = field(default_factory=list)  # per layer: attention | recurrent | feedforward


EDIT_MODES = ("record", "zero", "replace", "remove_column")


@dataclass
class ValueEdit:
    """A causal edit of one head's attention at one key position per sample.

    ``mode``: ``"record"`` stores the head's value vectors at ``positions`` in ``recorded`` (``[B, dh]``);
    ``"zero"`` sets them to 0; ``"replace"`` sets them to ``replacement`` (``[B, dh]`` or ``[dh]``);
    ``"remove_column"`` masks the column for this head so each row renormalises over the rest.
    ``positions`` is a ``[B]`` long tensor (one key position per sample).
    """

    layer: int
    head: int
    positions: Tensor
    mode: str = "record"
    replacement: Tensor | None = None
    recorded: Tensor | None = None

    def __post_init__(self) -> None:
        if self.mode not in EDIT_MODES:
            raise ValueError(f"unknown edit mode {self.mode!r}; choose one of {EDIT_MODES}")
        if self.mode == "replace" and self.replacement is None:
            raise ValueError("mode 'replace' needs a replacement vector")

    def apply(self, v: Tensor) -> tuple[int, Tensor] | None:
        """Apply the edit to one layer's per-head values ``v`` ``[B, H, Tk, dv]`` (in place, a private copy).

        Returns ``(head, positions)`` for a column removal (done on the mask by the caller), else ``None``.
        """
        rows = torch.arange(v.shape[0], device=v.device)
        pos = self.positions.to(v.device).long()
        if self.mode == "record":
            self.recorded = v[rows, self.head, pos].detach().cpu().clone()  # (B, dv)
        elif self.mode == "zero":
            v[rows, self.head, pos] = 0.0
        elif self.mode == "replace":
            v[rows, self.head, pos] = self.replacement.to(v.device, v.dtype).expand(  # type: ignore[union-attr]
                v.shape[0], v.shape[-1])  # (a "replace" edit has its replacement)
        elif self.mode == "remove_column":
            return self.head, pos
        return None


@dataclass
class StackedEdits:
    """Several :class:`ValueEdit` of one head, each on its own copy of a batch stacked along the batch axis.

    A pass over ``n`` copies of a ``B``-row batch (``[n·B, …]``, copy ``i`` = rows ``i·B … (i+1)·B − 1``)
    applies ``edits[i]`` to copy ``i``: ``n`` edited passes in one forward (see
    :meth:`~sinklab.capture.AttentionCapture.final_states` ``copies=``). Every edit is on the same
    ``layer`` and ``head``.
    """

    edits: list[ValueEdit]

    def __post_init__(self) -> None:
        if not self.edits:
            raise ValueError("StackedEdits needs at least one edit")
        if len({(e.layer, e.head) for e in self.edits}) != 1:
            raise ValueError("stacked edits must all edit the same layer and head")

    @property
    def layer(self) -> int:
        return self.edits[0].layer

    @property
    def head(self) -> int:
        return self.edits[0].head

    def apply(self, v: Tensor) -> tuple[int, Tensor] | None:
        """Apply edit ``i`` to copy ``i`` of ``v`` ``[n·B, H, Tk, dv]`` (in place, a private copy).

        Returns ``(head, positions [n·B])`` when some copy removes its column (−1 in the rows of the copies that
        do not), else ``None``.
        """
        n = len(self.edits)
        if v.shape[0] % n:
            raise ValueError(f"{v.shape[0]} rows are not {n} stacked copies of one batch")
        b = v.shape[0] // n
        drop = torch.full((v.shape[0],), -1, dtype=torch.long, device=v.device)
        dropped = False
        for i, edit in enumerate(self.edits):
            out = edit.apply(v[i * b : (i + 1) * b])  # a view: the edit writes into v
            if out is not None:
                drop[i * b : (i + 1) * b] = out[1]
                dropped = True
        return (self.head, drop) if dropped else None
