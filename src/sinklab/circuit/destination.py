"""Where the attention goes when the sink is gone: per-layer destinations of attention under one condition.

A token-tied sink (Gemma 3's ``<bos>``) disappears when its token is removed; the attention it soaked up has
to go somewhere. Per head and sample this module keeps (from one capture pass with
``CaptureConfig(row_stats=True)``): the dominant column (the scan's rule, :data:`sinklab.scan.DOMINANT_RULE`)
and its mass, the mean over real queries of the row entropy, of the attention to the query's own key (the
diagonal) and to the key just before it, and of the head's output norm ``‖W_O^h o_i‖``. Per layer it then
reports the most-attended position, whether a token other than the first becomes a sink, and those means.

Pure tensor functions: no model, no hooks.
"""

from __future__ import annotations

import math
from collections import Counter

import torch
from torch import Tensor

from .. import metrics

__all__ = ["DESTINATION_RULE", "align_to_start", "destination_summary", "head_destinations"]

DESTINATION_RULE = (
    "per layer, over samples and heads: entropy = mean over real queries of −Σ_j A_ij ln A_ij (nats); top position = "
    "the most common dominant column (argmax of the column mass over keys seen by ≥ max(8, ⌈T/8⌉) queries), share = "
    "mean column mass there, heads = share of (sample, head) whose dominant column it is; diagonal / previous = mean "
    "A_ii / A_i,i−1; other sink = share of (sample, head) whose dominant column is not position 0 and has mass > ε, "
    "with its most common token; ‖out‖ = mean over queries of the head's output-space update norm ‖W_O^h o_i‖")


def align_to_start(x: Tensor, starts: Tensor, k: int) -> Tensor:
    """``[B, L, H, T]`` → ``[B, L, H, k]``: each row's first ``k`` real positions (NaN beyond the row's end)."""
    b, n_l, h, t = x.shape
    idx = (starts[:, None] + torch.arange(k)).clamp_max(t - 1)  # (B, k)
    out = x.gather(-1, idx[:, None, None, :].expand(b, n_l, h, k))
    beyond = (starts[:, None] + torch.arange(k)) >= t
    return out.masked_fill(beyond[:, None, None, :], math.nan)


def _query_mean(x: Tensor, valid: Tensor) -> Tensor:
    """``[B, L, H, T]`` → ``[B, L, H]`` float64 mean over ``valid`` non-NaN positions (NaN when none)."""
    x = x.double()
    ok = valid & ~torch.isnan(x)
    count = ok.sum(-1)
    return torch.where(count > 0, torch.where(ok, x, 0.0).sum(-1) / count.clamp_min(1), math.nan)


def head_destinations(column_mass: Tensor, column_queries: Tensor, token_mask: Tensor, entropy: Tensor,
                      diagonal: Tensor, previous: Tensor, out_norm: Tensor, starts: Tensor) -> dict[str, Tensor]:
    """Per-head destination statistics of one batch.

    Parameters
    ----------
    column_mass, entropy, diagonal, previous, out_norm:
        ``[B, L, H, T]`` from :class:`~sinklab.capture.CaptureBatch` (``row_*`` need ``row_stats=True``).
    column_queries:
        ``[B, L, T]`` real queries that see each key.
    token_mask:
        ``[B, T]`` real tokens.
    starts:
        ``[B]`` each row's first real position (non-zero under left padding).

    Returns
    -------
    dict
        ``dest_position`` ``[B, L, H]`` (long, relative to the row start), ``dest_mass``, ``entropy``,
        ``diagonal``, ``previous``, ``out_norm`` ``[B, L, H]`` (float64) and ``column_mass_all``
        ``[B, L, H, T]`` aligned to the row start.
    """
    b, n_l, _, t = column_mass.shape
    n = token_mask.sum(-1)[:, None].expand(b, n_l)
    eligible = metrics.eligible_columns(column_queries, n)[:, :, None]  # (B, L, 1, T)
    dom = metrics.dominant_columns(column_mass, eligible)  # (B, L, H) absolute positions
    real = token_mask.bool()[:, None, None, :]
    after_first = real & (torch.arange(t)[None, :] > starts[:, None])[:, None, None, :]
    return {
        "dest_position": dom - starts[:, None, None],
        "dest_mass": column_mass.double().gather(-1, dom[..., None])[..., 0],
        "entropy": _query_mean(entropy, real),
        "diagonal": _query_mean(diagonal, real),
        "previous": _query_mean(previous, after_first),
        "out_norm": _query_mean(out_norm, real),
        "column_mass_all": align_to_start(column_mass, starts, t),
    }


def _r(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}") if math.isfinite(x) else math.nan


def destination_summary(rec: dict[str, Tensor], tokens: list[list[str]], eps: float) -> dict[str, list]:
    """Per-layer summary (lists of ``L``) of the :func:`head_destinations` fields of ``S`` samples.

    ``tokens`` are the samples' token strings (position 0 = each row's first real token); ``eps`` is the
    sink-rate ε. See :data:`DESTINATION_RULE`.
    """
    pos, mass = rec["dest_position"], rec["dest_mass"].double()  # (S, L, H)
    cols = rec["column_mass_all"].double()  # (S, L, H, T)
    n_s, n_l, _ = pos.shape
    out: dict[str, list] = {k: [] for k in ("entropy", "top_position", "top_token", "top_share", "top_heads_pct",
                                            "position0_mass", "diagonal", "previous", "other_sink_pct",
                                            "other_sink_token", "other_sink_position", "out_norm")}

    def token(s: int, p: int) -> str:
        return tokens[s][p] if 0 <= p < len(tokens[s]) else f"#{p}"

    for layer in range(n_l):
        p = pos[:, layer]  # (S, H)
        top = int(p.flatten().mode().values)
        out["top_position"].append(top)
        out["top_token"].append(Counter(token(s, top) for s in range(n_s)).most_common(1)[0][0])
        out["top_share"].append(_r(float(cols[:, layer, :, top].nanmean())) if top < cols.shape[-1] else math.nan)
        out["top_heads_pct"].append(_r(float((p == top).double().mean() * 100)))
        out["position0_mass"].append(_r(float(cols[:, layer, :, 0].nanmean())))
        for key in ("entropy", "diagonal", "previous", "out_norm"):
            out[key].append(_r(float(rec[key][:, layer].double().nanmean())))
        other = (p != 0) & (mass[:, layer] > eps)  # (S, H)
        out["other_sink_pct"].append(_r(float(other.double().mean() * 100)))
        hits = [(s, int(p[s, h])) for s, h in other.nonzero().tolist()]
        out["other_sink_token"].append(Counter(token(s, q) for s, q in hits).most_common(1)[0][0] if hits else None)
        out["other_sink_position"].append(Counter(q for _, q in hits).most_common(1)[0][0] if hits else None)
    return out
