"""Pure tensor functions for attention-sink metrics.

Nothing here touches a model: every function takes tensors and returns tensors, so each one can be
tested against a naive float64 loop. Shapes use these letters:

``S`` samples, ``L`` layers, ``H`` heads, ``Tq``/``Tk`` query/key positions (``T`` when equal),
``d`` model width, ``dh`` head width. Positions are 0-based everywhere (Gu et al.'s Sink_1 is
``sink_rate(column_mass, 0)``).

Definitions follow the papers (Gu et al. 2025, arXiv:2410.10781; Fesser et al. 2026, arXiv:2606.08105;
Sun et al. 2024, arXiv:2402.17762; Darcet et al. 2024, arXiv:2309.16588):

* column mass  ``α_j = Σ_i vis_ij A_ij / Σ_i vis_ij`` — the mean attention key ``j`` receives from the
  non-padding queries that can see it (causal-aware);
* sink rate ``Sink_k^ε`` — percentage of (layer, head) pairs with ``α_k > ε`` averaged over samples;
* ε-sink events — strict ``min_i A_is ≥ 1 − ε`` and relaxed "≥ share of queries put ≥ 0.5 on s";
* massive activations — ``|a| > 100`` and ``|a| ≥ 1000 × median |a|`` of the hidden state;
* high-norm tokens — ``norm > median + k · 1.4826 · MAD`` (robust z-score above ``k``);
* value-norm ratio — ``‖v_s‖ / mean_{j≠s} ‖v_j‖``;
* stable rank ``‖U‖_F² / σ₁²`` and rank-1 energy ``σ₁² / Σσ²`` of a head's update ``U``;
* common-mode fraction ``‖mean_i u_i‖² / mean_i ‖u_i‖²``;
* QK spectrum: singular values of ``Θ_h = Wq_hᵀ Wk_h`` (``nn.Linear`` weights ``[out, in]``);
* dominant column — the key with the largest column mass among the keys seen by at least
  ``max(8, ⌈N/8⌉)`` real queries (see :func:`eligible_columns`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = [
    "modality_sink_strength", "modality_sink_rate", "visual_sink_share",
    "visibility",
    "column_mass",
    "column_min",
    "routed_fraction",
    "sink_rate",
    "sink_rate_per_layer",
    "gate_statistics",
    "is_eps_sink",
    "is_relaxed_sink",
    "activation_median",
    "is_massive",
    "massive_activations",
    "high_norm_tokens",
    "value_norm_ratio",
    "singular_values",
    "stable_rank",
    "rank1_energy",
    "stable_rank_from_singular_values",
    "rank1_energy_from_singular_values",
    "common_mode_fraction",
    "qk_spectrum",
    "sigma_ratio",
    "MAD_SCALE",
    "SINK_KINDS",
    "classify_sink",
    "relative_rms",
    "min_visible_queries",
    "eligible_columns",
    "dominant_columns",
    "uniform_column_mass",
    "min_meaningful_length",
]

#: Scale that turns a median absolute deviation into a consistent estimate of a normal's σ.
MAD_SCALE = 1.4826


def visibility(
    tq: int,
    tk: int,
    *,
    causal: bool = True,
    query_mask: Tensor | None = None,
    key_mask: Tensor | None = None,
    device: torch.device | str | None = None,
) -> Tensor:
    """Boolean ``[..., Tq, Tk]`` matrix: query ``i`` is a real token and may attend to key ``j``.

    ``causal`` aligns the last query with the last key (offset ``Tk − Tq``), as a KV cache does.
    ``query_mask`` ``[..., Tq]`` and ``key_mask`` ``[..., Tk]`` mark real (non-padding) tokens.
    """
    vis = torch.ones(tq, tk, dtype=torch.bool, device=device)
    if causal:
        vis = torch.tril(vis, diagonal=tk - tq)
    if query_mask is not None:
        vis = vis & query_mask.bool()[..., :, None]
    if key_mask is not None:
        vis = vis & key_mask.bool()[..., None, :]
    return vis


def _broadcast_vis(attn: Tensor, visible: Tensor | None) -> Tensor:
    if visible is None:
        return torch.ones_like(attn, dtype=torch.bool)
    return visible.bool().expand(attn.shape)


def column_mass(attn: Tensor, visible: Tensor | None = None) -> Tensor:
    """Mean attention each key receives from the queries that can see it.

    Parameters
    ----------
    attn:
        ``[..., Tq, Tk]`` attention probabilities (rows sum to ≤ 1).
    visible:
        Boolean ``[..., Tq, Tk]`` (broadcastable), see :func:`visibility`. ``None`` means every
        query sees every key.

    Returns
    -------
    ``[..., Tk]`` column mass; NaN where no query sees the key (padding).
    """
    vis = _broadcast_vis(attn, visible)
    total = torch.where(vis, attn, torch.zeros((), dtype=attn.dtype, device=attn.device)).sum(-2)
    count = vis.sum(-2).to(attn.dtype)
    return total / count  # 0/0 -> NaN where no query sees the key


def column_min(attn: Tensor, visible: Tensor | None = None) -> Tensor:
    """``min_i A_ij`` over the queries that see key ``j``: ``[..., Tk]``, NaN where none does."""
    vis = _broadcast_vis(attn, visible)
    inf = torch.full((), math.inf, dtype=attn.dtype, device=attn.device)
    out = torch.where(vis, attn, inf).amin(-2)
    return torch.where(vis.any(-2), out, torch.full_like(out, math.nan))


def routed_fraction(attn: Tensor, visible: Tensor | None = None, threshold: float = 0.5) -> Tensor:
    """Share of the queries that see key ``j`` and give it ``≥ threshold`` attention: ``[..., Tk]``."""
    vis = _broadcast_vis(attn, visible)
    hits = ((attn >= threshold) & vis).sum(-2).to(attn.dtype)
    return hits / vis.sum(-2).to(attn.dtype)


def sink_rate_per_layer(column_mass: Tensor, position: int, eps: float = 0.3) -> Tensor:
    """Sink^ε at ``position`` per layer, in percent.

    ``column_mass`` is ``[S, L, H, T]``; returns ``[L]``: for each layer, the mean over samples (that
    have a token at ``position``) of the percentage of heads with ``α_position > eps``. NaN if no
    sample reaches ``position``.
    """
    if column_mass.dim() != 4:
        raise ValueError(f"column_mass must be [samples, layers, heads, positions], got {tuple(column_mass.shape)}")
    if not 0 <= position < column_mass.shape[-1]:
        raise ValueError(f"position {position} is outside 0..{column_mass.shape[-1] - 1}")
    col = column_mass[..., position]  # (S, L, H)
    present = ~torch.isnan(col).any(dim=(1, 2))  # (S,)
    if not bool(present.any()):
        return torch.full((column_mass.shape[1],), math.nan, dtype=torch.float64)
    share = (col[present] > eps).double().mean(dim=2) * 100.0  # (S', L)
    return share.mean(dim=0)


def sink_rate(column_mass: Tensor, position: int = 0, eps: float = 0.3) -> float:
    """Sink_k^ε (Gu et al.) in percent: share of (layer, head) pairs with ``α_k > ε``, mean over samples.

    Always report it with the sequence length that produced ``column_mass`` — it falls as T grows.
    """
    return float(sink_rate_per_layer(column_mass, position, eps).mean())


def gate_statistics(gate: Tensor, sink_attention: Tensor, route_threshold: float = 0.5,
                    first_query: int = 1) -> dict[str, Tensor]:
    """Whether an output gate has taken the sink's job (Qiu et al. 2025): per layer and head, ``[L, H]`` float64.

    ``gate`` ``[S, L, H, T]`` is each query's mean output gate on its head's output (``σ(x W_g)`` averaged over the
    head's dimensions); ``sink_attention`` ``[S, L, H, T]`` each query's attention to the sink position. Queries
    before ``first_query`` (the sink itself, which can only see itself) and NaN entries are left out. Returns

    * ``gate_on_sink`` — mean gate over the queries routed to the sink (``A_i,sink ≥ route_threshold``);
    * ``gate_elsewhere`` — mean gate over the other queries;
    * ``sink_share`` — mean attention to the sink (the gate not applied);
    * ``gated_sink_share`` — mean of ``gate · A_i,sink``: how much of the sink's value reaches the head's output
      once gated (with a fully open gate it equals ``sink_share``).

    NaN where a head has no such query. A gate that shuts on sink-routed queries (``gate_on_sink`` ≪
    ``gate_elsewhere``) is doing the "no-op" the sink does in an ungated model.
    """
    if gate.shape != sink_attention.shape or gate.dim() != 4:
        raise ValueError(f"gate and sink_attention must both be [S, L, H, T], got {tuple(gate.shape)} and "
                         f"{tuple(sink_attention.shape)}")
    g, a = gate[..., first_query:].double(), sink_attention[..., first_query:].double()
    real = ~(torch.isnan(g) | torch.isnan(a))
    g, a = torch.where(real, g, 0.0), torch.where(real, a, 0.0)
    routed = real & (a >= route_threshold)
    other = real & ~routed

    def mean(x: Tensor, where: Tensor) -> Tensor:
        n = where.sum(dim=(0, 3))
        total = torch.where(where, x, 0.0).sum(dim=(0, 3))
        return torch.where(n > 0, total / n.clamp_min(1), math.nan)

    return {"gate_on_sink": mean(g, routed), "gate_elsewhere": mean(g, other), "sink_share": mean(a, real),
            "gated_sink_share": mean(g * a, real)}


def is_eps_sink(column_min: Tensor, eps: float) -> Tensor:
    """Strict ε-sink event (Fesser Def. 1): ``min_i A_is ≥ 1 − ε``. NaN inputs give ``False``."""
    if not 0.0 <= eps <= 1.0:
        raise ValueError(f"eps must be in [0, 1], got {eps}")
    return column_min >= 1.0 - eps


def is_relaxed_sink(routed_fraction: Tensor, share: float = 0.9) -> Tensor:
    """Relaxed sink rule: at least ``share`` of the queries put ≥ 0.5 of their attention on the column."""
    if not 0.0 < share <= 1.0:
        raise ValueError(f"share must be in (0, 1], got {share}")
    return routed_fraction >= share


def _masked_median(x: Tensor, mask: Tensor | None, dim: int | tuple[int, ...]) -> Tensor:
    """Median over ``dim`` ignoring entries where ``mask`` is False (lower median, like torch)."""
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    if mask is not None:
        x = torch.where(mask.expand(x.shape), x, torch.full((), math.nan, dtype=x.dtype, device=x.device))
    keep = [d % x.dim() for d in dims]
    perm = [d for d in range(x.dim()) if d not in keep] + keep
    flat = x.permute(perm).reshape(*[x.shape[d] for d in range(x.dim()) if d not in keep], -1)
    return flat.nanmedian(dim=-1).values


def activation_median(hidden: Tensor, token_mask: Tensor | None = None) -> Tensor:
    """Median ``|a|`` over all real tokens and dimensions of ``[..., T, d]`` hidden states: ``[...]``."""
    tmask = None if token_mask is None else token_mask.bool()[..., None]
    return _masked_median(hidden.abs(), tmask, dim=(-2, -1))


def is_massive(max_abs: Tensor, median: Tensor, *, abs_threshold: float = 100.0, ratio: float = 1000.0) -> Tensor:
    """Massive-activation rule (Sun et al. 2024): ``max|a| > abs_threshold`` and ``≥ ratio × median |a|``.

    ``max_abs`` is ``[..., T]`` (largest ``|a|`` of each token), ``median`` ``[...]`` the median ``|a|``
    of the whole hidden state (see :func:`activation_median`).
    """
    return (max_abs > abs_threshold) & (max_abs >= ratio * median[..., None])


def massive_activations(
    hidden: Tensor,
    token_mask: Tensor | None = None,
    *,
    abs_threshold: float = 100.0,
    ratio: float = 1000.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """Massive activations (Sun et al. 2024) per token.

    Parameters
    ----------
    hidden:
        ``[..., T, d]`` hidden states of one layer.
    token_mask:
        ``[..., T]`` real tokens; padding is excluded from the median and never flagged.

    Returns
    -------
    ``(is_massive [..., T], max_abs [..., T], argmax_dim [..., T])``, see :func:`is_massive`.
    """
    max_abs, dim = hidden.abs().max(dim=-1)
    flag = is_massive(max_abs, activation_median(hidden, token_mask), abs_threshold=abs_threshold, ratio=ratio)
    if token_mask is not None:
        flag = flag & token_mask.bool()
    return flag, max_abs, dim


def high_norm_tokens(norms: Tensor, token_mask: Tensor | None = None, k: float = 5.0) -> Tensor:
    """Robust outlier rule for high-norm tokens: ``norm > median + k · 1.4826 · MAD`` along the last axis.

    ``norms`` is ``[..., T]``; returns a boolean ``[..., T]``. Padding (``token_mask`` False) is
    excluded from the statistics and never flagged.
    """
    tmask = None if token_mask is None else token_mask.bool()
    med = _masked_median(norms, tmask, dim=-1)[..., None]
    mad = _masked_median((norms - med).abs(), tmask, dim=-1)[..., None]
    flag = norms > med + k * MAD_SCALE * mad
    if tmask is not None:
        flag = flag & tmask
    return flag


def value_norm_ratio(norms: Tensor, sink: Tensor | int, token_mask: Tensor | None = None) -> Tensor:
    """``‖v_s‖ / mean_{j≠s} ‖v_j‖`` (the reference mean excludes the sink and padding).

    ``norms`` is ``[..., T]``; ``sink`` an int or a ``[...]`` index tensor; returns ``[...]``.
    """
    if isinstance(sink, int):
        sink = torch.full(norms.shape[:-1], sink, dtype=torch.long, device=norms.device)
    sink = sink.long()
    valid = torch.ones_like(norms, dtype=torch.bool) if token_mask is None else token_mask.bool().expand(norms.shape)
    others = valid.clone()
    others.scatter_(-1, sink[..., None], False)
    zero = torch.zeros((), dtype=norms.dtype, device=norms.device)
    ref = torch.where(others, norms, zero).sum(-1) / others.sum(-1).to(norms.dtype)
    return norms.gather(-1, sink[..., None])[..., 0] / ref


def singular_values(u: Tensor) -> Tensor:
    """Singular values of ``[..., N, d]`` in float64, descending."""
    return torch.linalg.svdvals(u.double())


def stable_rank_from_singular_values(s: Tensor) -> Tensor:
    """``Σσ² / σ₁²``; NaN for an all-zero matrix."""
    s2 = s.double() ** 2
    return s2.sum(-1) / s2[..., 0]


def rank1_energy_from_singular_values(s: Tensor) -> Tensor:
    """``σ₁² / Σσ²``; NaN for an all-zero matrix."""
    s2 = s.double() ** 2
    return s2[..., 0] / s2.sum(-1)


def stable_rank(u: Tensor) -> Tensor:
    """Stable rank ``‖U‖_F² / σ₁(U)²`` of ``[..., N, d]`` (float64). A rank-1 matrix gives 1."""
    return stable_rank_from_singular_values(singular_values(u))


def rank1_energy(u: Tensor) -> Tensor:
    """Share of ``‖U‖_F²`` in the top singular direction, ``σ₁² / Σσ²`` (float64)."""
    return rank1_energy_from_singular_values(singular_values(u))


def common_mode_fraction(u: Tensor, row_mask: Tensor | None = None) -> Tensor:
    """``E(mean_i u_i) / E(u)`` with ``E`` the mean squared entry, i.e. ``‖ū‖² / mean_i ‖u_i‖²``.

    ``u`` is ``[..., N, d]`` (rows are tokens); ``row_mask`` ``[..., N]`` selects the real rows.
    1 when every row is the same, ~1/N for unrelated rows.
    """
    u = u.double()
    if row_mask is None:
        row_mask = torch.ones(u.shape[:-1], dtype=torch.bool, device=u.device)
    w = row_mask.to(u.dtype)[..., None]
    n = w.sum(-2)  # (..., 1)
    mean = (u * w).sum(-2) / n  # (..., d)
    energy = ((u * u) * w).sum(dim=(-2, -1)) / n[..., 0]
    return (mean * mean).sum(-1) / energy


def qk_spectrum(wq: Tensor, wk: Tensor) -> Tensor:
    """Singular values of each head's bilinear form ``Θ_h = Wq_hᵀ · Wk_h`` (``d × d``), float64.

    Parameters
    ----------
    wq:
        ``[H, dh, d]`` query projection rows of each head (``nn.Linear`` weight ``[out, in]`` split
        by head).
    wk:
        ``[Hkv, dh, d]`` key projection rows; under grouped-query attention head ``h`` uses KV head
        ``h // (H // Hkv)``.

    Returns
    -------
    ``[H, dh]`` descending singular values (Θ has rank ≤ dh). Computed from the QR factors
    ``Wq_hᵀ = Q_q R_q``, ``Wk_hᵀ = Q_k R_k`` so that ``σ(Θ_h) = σ(R_q R_kᵀ)`` — no ``d × d`` matrix.
    """
    h, dh, d = wq.shape
    hkv = wk.shape[0]
    if h % hkv:
        raise ValueError(f"{h} query heads are not a multiple of {hkv} key heads")
    wk = wk.repeat_interleave(h // hkv, dim=0)  # (H, dh, d)
    rq = torch.linalg.qr(wq.double().transpose(-1, -2), mode="r").R  # (H, dh, dh) if dh <= d
    rk = torch.linalg.qr(wk.double().transpose(-1, -2), mode="r").R
    return torch.linalg.svdvals(rq @ rk.transpose(-1, -2))


def sigma_ratio(s: Tensor) -> Tensor:
    """``σ₁ / σ₂`` of descending singular values ``[..., r]`` (inf when σ₂ = 0)."""
    return s[..., 0] / s[..., 1]


#: Sink classes in the order of :func:`classify_sink`'s codes.
SINK_KINDS = ("unclassified", "nop", "broadcast")


def classify_sink(
    value_ratio_out: Tensor,
    stable_rank: Tensor,
    *,
    nop_max_ratio: float = 0.2,
    broadcast_min_ratio: float = 0.5,
    broadcast_max_srank: float = 1.5,
) -> Tensor:
    """Fesser et al.'s classes as codes into :data:`SINK_KINDS`: 1 = NOP (``r_out ≤ nop_max_ratio``),
    2 = broadcast (``r_out ≥ broadcast_min_ratio`` and ``srank ≤ broadcast_max_srank``), else 0.

    ``value_ratio_out`` is the output-space value-norm ratio at the sink, ``stable_rank`` that of the
    head's update; NaN inputs give 0 (unclassified).
    """
    if not 0.0 <= nop_max_ratio <= broadcast_min_ratio:
        raise ValueError(f"need 0 ≤ nop_max_ratio ({nop_max_ratio}) ≤ broadcast_min_ratio ({broadcast_min_ratio})")
    if broadcast_max_srank < 1.0:
        raise ValueError(f"broadcast_max_srank must be ≥ 1 (a stable rank is ≥ 1), got {broadcast_max_srank}")
    nop = value_ratio_out <= nop_max_ratio
    broadcast = (value_ratio_out >= broadcast_min_ratio) & (stable_rank <= broadcast_max_srank)
    codes = torch.zeros(value_ratio_out.shape, dtype=torch.long, device=value_ratio_out.device)
    codes[nop] = 1
    codes[broadcast & ~nop] = 2
    return codes


def relative_rms(edited: Tensor, base: Tensor, mask: Tensor | None = None) -> float:
    """``rms(edited − base) / rms(base)`` over the rows selected by ``mask`` (``[..., T]`` over ``[..., T, d]``)."""
    diff, ref = (edited.double() - base.double()) ** 2, base.double() ** 2
    if mask is not None:
        m = mask.bool()[..., None].expand(diff.shape)
        diff, ref = diff[m], ref[m]
    return float(diff.mean().sqrt() / ref.mean().sqrt())


def min_visible_queries(num_queries: Tensor) -> Tensor:
    """``max(8, ⌈N/8⌉)``: how many queries must see a key before its column mass can name a head's sink.

    In a causal model key ``j`` of ``N`` is seen by only ``N − j`` queries, so the last keys' column mass
    is the mean of one or two probabilities — noisy, and often large (a query's attention to itself).
    Eight queries bound that noise by averaging; ``N/8`` keeps the excluded tail at most an eighth of a
    long sequence. Sink_k^ε at a fixed position ``k`` (Gu et al.) is not affected.
    """
    return torch.clamp(torch.ceil(num_queries.double() / 8.0), min=8.0)


def eligible_columns(column_queries: Tensor, num_queries: Tensor) -> Tensor:
    """Boolean ``[..., T]``: keys seen by at least :func:`min_visible_queries` real queries.

    ``column_queries`` ``[..., T]`` counts the real queries that see each key (0 at padding),
    ``num_queries`` ``[...]`` the real queries. Where no key reaches the count (fewer than 8 tokens, a
    sliding window narrower than it) the most-seen keys are eligible, so every row keeps a candidate.
    """
    counts = column_queries.double()
    need = torch.minimum(min_visible_queries(num_queries), counts.amax(-1))
    return (counts >= need[..., None]) & (counts > 0)


def dominant_columns(column_mass: Tensor, eligible: Tensor | None = None) -> Tensor:
    """``[...]`` position of the largest column mass of ``[..., T]`` among ``eligible`` keys (NaN ignored)."""
    mass = column_mass.double().nan_to_num(-1.0)
    if eligible is not None:
        mass = torch.where(eligible.expand(mass.shape), mass, torch.full((), -2.0, dtype=mass.dtype))
    return mass.argmax(dim=-1)


def uniform_column_mass(num_tokens: int, causal: bool = True) -> float:
    """Column mass of position 0 under uniform attention over ``num_tokens`` tokens: ``H_N / N`` causal, ``1/N`` not.

    A head that spreads its attention evenly already gives position 0 this much; when it is near ε the
    sink rate ``Sink_0^ε`` says nothing about sinks.
    """
    if num_tokens < 1:
        return math.nan
    if not causal:
        return 1.0 / num_tokens
    return sum(1.0 / (i + 1) for i in range(num_tokens)) / num_tokens


def min_meaningful_length(eps: float, causal: bool = True) -> int:
    """Fewest tokens for which uniform attention gives position 0 at most ``ε/2`` (see :func:`uniform_column_mass`)."""
    if not 0.0 < eps <= 1.0:
        raise ValueError(f"eps must be in (0, 1], got {eps}")
    n = 1
    while uniform_column_mass(n, causal) > eps / 2:
        n += 1
    return n


# ----------------------------------------------------------------------------- modality split (vision-language)
def modality_sink_strength(column_mass: Tensor, eligible: Tensor, select: Tensor) -> Tensor:
    """``[S, L, H]`` each head's largest column mass over the eligible keys of one modality (NaN where none).

    ``column_mass`` ``[S, L, H, T]``; ``eligible`` ``[S, L, 1|H, T]`` the keys seen by enough queries to be a
    dominant column (:func:`eligible_columns`: late keys, averaged over a few queries only, are left out);
    ``select`` ``[S, T]`` boolean, the positions of the modality (text, or image tokens).
    """
    keep = eligible.bool() & select.bool()[:, None, None, :]
    masked = torch.where(keep, column_mass.double(), -math.inf)
    best = masked.amax(-1)
    return torch.where(torch.isfinite(best), best, math.nan)


def modality_sink_rate(strength: Tensor, eps: float) -> Tensor:
    """``[L]`` percent of heads (over samples) whose :func:`modality_sink_strength` ``[S, L, H]`` reaches ``eps``:
    Sink^ε with the sink anywhere among one modality's keys. Samples without such a key do not count (NaN for a
    layer where no sample has one)."""
    seen = torch.isfinite(strength)
    hits = ((strength >= eps) & seen).double().sum((0, 2))
    count = seen.double().sum((0, 2))
    return torch.where(count > 0, 100.0 * hits / count.clamp_min(1), math.nan)


def visual_sink_share(group_mass: Tensor, column_mass: Tensor, eligible: Tensor, image: Tensor,
                      eps: float) -> Tensor:
    """``[S, L, H]`` the share of the text queries' attention to image tokens that lands on visual sink tokens.

    ``group_mass`` ``[S, L, H, T]``: each key's attention summed over the text queries only; ``column_mass``
    ``[S, L, H, T]`` over all queries; ``eligible`` ``[S, L, 1|H, T]``; ``image`` ``[S, T]`` the image tokens. A
    visual sink token of a head is an eligible image token whose column mass reaches ``eps``. NaN where the text
    queries give the image nothing.
    """
    image = image.bool()[:, None, None, :]
    mass = torch.where(image, group_mass.double(), 0.0).nan_to_num(0.0)
    sinks = image & eligible.bool() & (column_mass.double() >= eps)
    total = mass.sum(-1)
    on_sinks = torch.where(sinks, mass, 0.0).sum(-1)
    return torch.where(total > 0, on_sinks / total.clamp_min(1e-300), math.nan)
