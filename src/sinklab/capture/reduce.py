"""Chunked attention and the per-chunk reductions of its probabilities.

:func:`chunked_attention` computes one layer's attention output (the same maths as transformers' eager
path, in float32) over query chunks, so nothing of size ``Tq × Tk`` per head outlives a chunk. Each
chunk's probabilities are handed to a :class:`ColumnStats`, which folds them into per-column (mass,
minimum, routed share, visibility count) and per-query (candidate attention, sink mass) statistics.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from ..attention import AttendSpec, Columns, attend, mask_rows
from .types import CaptureConfig

__all__ = ["ColumnStats", "chunked_attention"]

class ColumnStats:
    """Accumulates one layer's attention statistics chunk by chunk.

    ``qmask`` ``[B, Tq]`` marks real queries. Shapes below: ``B`` batch, ``H`` heads, ``Tq``/``Tk`` query/key
    positions, ``K`` candidate positions, ``m`` attention-map side.
    """

    def __init__(self, b: int, h: int, tq: int, tk: int, qmask: Tensor, config: CaptureConfig, *,
                 has_sink: bool, group: Tensor | None = None) -> None:
        dev = qmask.device
        candidates, map_len, route_threshold = config.candidates, config.map_len, config.route_threshold
        local_window, row_stats = config.local_window, config.row_stats
        self.qmask = qmask
        self.candidates = list(candidates)
        self.route_threshold = route_threshold
        self.has_sink = has_sink
        self.col_sum = torch.zeros(b, h, tk, device=dev)  # Σ_i A_ij over real queries
        self.col_cnt = torch.zeros(b, tk, device=dev)  # number of real queries that see key j
        self.col_min = torch.full((b, h, tk), math.inf, device=dev)
        self.col_hit = torch.zeros(b, h, tk, device=dev)  # queries with A_ij ≥ route_threshold
        self.row_mass = torch.zeros(b, h, tq, device=dev)  # Σ_j A_ij (< 1 with a learned sink)
        self.local_window = local_window
        self.local = torch.zeros(b, h, tq, device=dev)  # Σ_j A_ij over the local_window keys up to the query's own
        self.cand = torch.full((b, h, tq, len(self.candidates)), math.nan, device=dev)  # (B, H, Tq, K)
        self.m = min(map_len, tq, tk)
        self.amap = torch.zeros(h, self.m, self.m, device=dev) if map_len > 0 else None  # sample 0
        self.qweight = qmask.float()[:, None, None, :]  # (B, 1, 1, Tq) for matmul reductions over queries
        self.tk = tk
        # per query: entropy, attention to its own key and to the key before it (query i is key i + Tk − Tq)
        self.rows = torch.full((3, b, h, tq), math.nan, device=dev) if row_stats else None
        # a query group [B, Tq] (the text queries of a vision-language sample): Σ_i A_ij over its real queries
        self.group = None if group is None else (group & qmask).float()[:, None, None, :]  # (B, 1, 1, Tq)
        self.group_sum = torch.zeros(b, h, tk, device=dev) if group is not None else None

    def add(self, probs: Tensor, allowed: Tensor, c0: int, c1: int, kend: int, full: int, fast: bool) -> None:
        """Fold in the probabilities ``[B, H, C, kend]`` of query rows ``c0:c1``.

        ``allowed`` ``[B|1, 1|H, C, kend]`` is their visibility; on the ``fast`` path (no mask, no padding)
        every column left of ``full`` is seen by every query of the chunk.
        """
        self.row_mass[:, :, c0:c1] = probs.sum(-1) if self.has_sink else 1.0
        # Disallowed entries are exactly 0, so sums over queries only need the query mask.
        hits = probs >= self.route_threshold
        if fast:
            self.col_sum[..., :kend] += probs.sum(2)
            self.col_hit[..., :kend] += hits.sum(2)
            self.col_cnt[:, :full] += c1 - c0
            self.col_min[..., :full] = torch.minimum(self.col_min[..., :full], probs[..., :full].amin(2))
            diag = allowed[..., full:]
            self.col_cnt[:, full:kend] += diag[:, 0].sum(1)
        else:
            qw = self.qweight[..., c0:c1]  # (B, 1, 1, C)
            self.col_sum[..., :kend] += torch.matmul(qw, probs)[:, :, 0]
            self.col_hit[..., :kend] += torch.matmul(qw, hits.float())[:, :, 0]
            self.col_cnt[:, :kend] += torch.matmul(qw[:, 0], allowed[:, 0].float())[:, 0]
            diag = allowed & self.qmask[:, None, c0:c1, None]  # (B, 1, C, kend)
        low = probs[..., full:].masked_fill(~diag, math.inf).amin(2)
        self.col_min[..., full:kend] = torch.minimum(self.col_min[..., full:kend], low)
        for j, p in enumerate(self.candidates):
            if p < kend:
                self.cand[:, :, c0:c1, j] = probs[..., p]
            elif p < self.tk:
                self.cand[:, :, c0:c1, j] = 0.0
        if self.rows is not None:
            self._add_rows(probs, c0, c1, kend)
        if self.group is not None:
            self.group_sum[..., :kend] += torch.matmul(self.group[..., c0:c1], probs)[:, :, 0]  # type: ignore[index]
        self._add_local(probs, c0, c1, kend)
        if self.amap is not None and c0 < self.m:
            r1 = min(c1, self.m)
            self.amap[:, c0:r1, : min(self.m, kend)] = probs[0, :, : r1 - c0, : self.m]

    def _add_local(self, probs: Tensor, c0: int, c1: int, kend: int) -> None:
        """Each query's attention on its ``local_window`` most recent keys (its own included): a band sum, read
        off one cumulative sum over the keys."""
        own = torch.arange(c0, c1, device=probs.device) + (self.tk - self.local.shape[-1])  # key index of each query
        cs = probs.cumsum(-1)
        top = cs.gather(-1, own.clamp(0, kend - 1)[None, None, :, None].expand(*probs.shape[:3], 1))[..., 0]
        low_idx = own - self.local_window
        low = cs.gather(-1, low_idx.clamp(0, kend - 1)[None, None, :, None].expand(*probs.shape[:3], 1))[..., 0]
        self.local[:, :, c0:c1] = top - torch.where(low_idx >= 0, low, torch.zeros_like(low))

    def _add_rows(self, probs: Tensor, c0: int, c1: int, kend: int) -> None:
        """Entropy ``−Σ_j A_ij log A_ij`` of rows ``c0:c1`` and their diagonal / previous-key entries."""
        self.rows[0, :, :, c0:c1] = -torch.special.xlogy(probs, probs).sum(-1)  # type: ignore[index]  # (called with row_stats on)
        offset = self.tk - self.rows.shape[-1]  # type: ignore[union-attr]
        own = torch.arange(c0, c1, device=probs.device) + offset  # (C,) key index of each query
        for slot, keys in ((1, own), (2, own - 1)):
            ok = (keys >= 0) & (keys < kend)
            picked = probs.gather(-1, keys.clamp(0, kend - 1)[None, None, :, None].expand(*probs.shape[:3], 1))[..., 0]
            self.rows[slot, :, :, c0:c1] = torch.where(ok, picked, math.nan)  # type: ignore[index]

    def finish(self) -> dict[str, Tensor]:
        """The per-column and per-query statistics, NaN where no real query sees a key / for padding queries."""
        seen = self.col_cnt[:, None] > 0  # (B, 1, Tk)
        nan = torch.full((), math.nan, device=self.col_sum.device)
        count = self.col_cnt[:, None].clamp_min(1)
        qmask_f = self.qmask[:, None].float()  # (B, 1, Tq)
        stats = {
            "column_mass": torch.where(seen, self.col_sum / count, nan),
            "column_min": torch.where(seen, self.col_min, nan),
            "routed_fraction": torch.where(seen, self.col_hit / count, nan),
            "candidate_attention": torch.where(self.qmask[:, None, :, None], self.cand, nan),
            "local_mass": torch.where(self.qmask[:, None], self.local, nan),
            "learned_sink_mass": ((1.0 - self.row_mass) * qmask_f).sum(-1) / qmask_f.sum(-1).clamp_min(1),
            "column_queries": self.col_cnt,  # (B, Tk) real queries that see each key
        }
        if self.amap is not None:
            stats["map"] = self.amap
        if self.group_sum is not None:
            stats["group_mass"] = self.group_sum
        if self.rows is not None:
            real = self.qmask[:, None]  # (B, 1, Tq)
            for name, row in zip(("row_entropy", "row_diagonal", "row_previous"), self.rows):
                stats[name] = torch.where(real, row, math.nan)
        return stats


def _last_visible(allowed: Tensor, tk: int) -> int:
    """One past the last key column any row of the chunk may see (skip the causal upper triangle)."""
    cols = allowed.reshape(-1, allowed.shape[-1]).any(0).nonzero()
    return int(cols.max()) + 1 if cols.numel() else tk


def chunked_attention(
    query: Tensor,
    k: Tensor,
    v: Tensor,
    attention_mask: Tensor | None,
    qmask: Tensor,
    *,
    is_causal: bool,
    scale: float,
    chunk_elements: int,
    softcap: float | None = None,
    columns: Callable[[Tensor], list[Columns]] | None = None,
    bias: Tensor | None = None,
    drop: tuple[int, Tensor] | None = None,
    stats: ColumnStats | None = None,
) -> Tensor:
    """One layer's attention output ``[B, H, Tq, dv]`` (float32), reduced into ``stats`` chunk by chunk.

    ``query`` ``[B, H, Tq, dh]``; ``k``/``v`` ``[B, H, Tk, dh|dv]`` float32 with the KV heads already
    repeated; ``attention_mask`` boolean ``[B|1, 1, Tq, Tk]`` (True = attend), additive float, or ``None``;
    ``qmask`` ``[B, Tq]`` real queries; ``columns`` gives the learned columns (a sink logit, a kv-bias slot:
    :class:`sinklab.attention.Columns`) for a chunk's queries — their weight is not a key's, so ``1 − Σ_j A_ij``
    counts them as sink mass; ``bias`` additive
    ``[..., Tq, Tk]`` position bias; ``drop`` ``(head, positions [B])`` removes one key column per sample
    for one head (rows renormalise; a row left with no key outputs 0; position −1: nothing removed in that row).
    Each chunk is :func:`sinklab.attention.attend` (manual path, which also returns the weights the statistics
    need).
    """
    b, h, tq, _ = query.shape
    tk, dv = k.shape[2], v.shape[-1]
    dev = query.device
    out = torch.empty(b, h, tq, dv, device=dev)
    chunk = max(1, min(tq, chunk_elements // max(1, b * h * tk)))
    # Fast path (no mask tensor, no padding): only the causal diagonal block needs masking, and
    # every column left of it is seen by every query of the chunk.
    fast = attention_mask is None and bool(qmask.all()) and drop is None
    offset = tk - tq
    for c0 in range(0, tq, chunk):
        c1 = min(tq, c0 + chunk)
        allowed, additive = mask_rows(attention_mask, is_causal, c0, c1, tq, tk, dev)
        if attention_mask is None:  # causal rows c0..c1 see keys up to c1 - 1 + offset
            kend = min(tk, c1 + offset) if is_causal and tq > 1 else tk
        else:
            kend = _last_visible(allowed, tk)
        allowed = allowed[..., :kend]
        if drop is not None:  # remove_column: this head no longer sees the column
            allowed = allowed.expand(b, h, c1 - c0, kend).clone()
            keep = (drop[1] >= 0) & (drop[1] < kend)
            allowed[torch.arange(b, device=dev)[keep], drop[0], :, drop[1][keep]] = False
        full = (min(kend, c0 + offset + 1) if is_causal and tq > 1 else kend) if fast else 0
        shift = None  # additive terms after the softcap, as eager attention adds them
        if bias is not None:
            shift = bias[..., c0:c1, :kend].float()
        if additive is not None:
            shift = additive[..., :kend] if shift is None else shift + additive[..., :kend]
        q = query[:, :, c0:c1].float()
        # Rows with nothing visible (padding, or a query whose only key was removed) come out as 0.
        spec = AttendSpec(scale=scale, bias=shift, columns=columns(q) if columns is not None else (),
                          softcap=softcap, mask_from=full)
        out[:, :, c0:c1], probs = attend(q, k[:, :, :kend], v[:, :, :kend], allowed, spec, weights=True)
        if stats is not None:
            stats.add(probs, allowed, c0, c1, kend, full, fast)
    return out
