"""Pure attention functions with an explicit "nothing to attend to" option.

``softmax_with_sink`` appends one sink logit to every row of scores and drops it after the softmax
(gpt-oss's learned per-head sink; ``sink_logit = 0`` is softmax₁ of "Attention is off by one";
``sink_logit = −inf`` is the plain softmax). The weights over the real tokens then sum to
``1 − sink mass``, so a head can do (almost) nothing without parking attention on a real token.

Worked example: six value vectors, scores all ≈ 0. Without a sink each gets 1/6 and the
output is their mean (norm 0.83 in the example); with a sink logit of 3 the sink takes
``e³ / (e³ + 6) = 77 %`` and the output shrinks by the same factor to 0.19:

>>> import torch
>>> scores = torch.zeros(6)
>>> values = torch.tensor([[0.83, 0.0]]).repeat(6, 1) + torch.tensor([[0.1, 0.2], [-0.1, -0.2], [0.3, 0.0],
...                                                                    [-0.3, 0.0], [0.0, 0.5], [0.0, -0.5]])
>>> round(float((softmax_with_sink(scores, float("-inf")) @ values).norm()), 2)
0.83
>>> w = softmax_with_sink(scores, 3.0)
>>> round(1 - float(w.sum()), 2), round(float((w @ values).norm()), 2)
(0.77, 0.19)
"""

from __future__ import annotations


import torch
from torch import Tensor

__all__ = ["softmax_with_columns", "softmax_with_sink", "sink_mass", "mask_rows"]


def softmax_with_columns(scores: Tensor, extra: Tensor) -> tuple[Tensor, Tensor]:
    """Softmax over ``[scores | extra]`` on the last axis, returned split: ``(weights [..., T], extra [..., E])``.

    ``extra`` ``[..., E]`` holds the logits of learned columns that are not tokens (a sink logit, a kv-bias
    slot's score) with the same leading shape as ``scores``. Masked entries may be ``−inf``.

    >>> w, x = softmax_with_columns(torch.zeros(1, 3), torch.zeros(1, 1))
    >>> [round(v, 2) for v in w[0].tolist()], round(float(x[0, 0]), 2)
    ([0.25, 0.25, 0.25], 0.25)
    """
    top = torch.maximum(scores.amax(dim=-1, keepdim=True), extra.amax(dim=-1, keepdim=True)).detach()
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    e, x = torch.exp(scores - top), torch.exp(extra - top)
    denom = e.sum(dim=-1, keepdim=True) + x.sum(dim=-1, keepdim=True)
    return e / denom, x / denom


def softmax_with_sink(scores: Tensor, sink_logit: Tensor | float) -> Tensor:
    """Softmax over the last axis of ``scores`` ``[..., T]`` with one extra logit ``sink_logit`` (dropped).

    ``sink_logit`` broadcasts against ``scores.shape[:-1]`` (e.g. ``[H, 1]`` for a per-head sink with
    scores ``[B, H, Tq, Tk]``). Returns weights over the ``T`` real entries; each row sums to
    ``1 − e^s / (e^s + Σ e^z)``. Masked entries may be ``−inf``; a row with every real entry masked
    gives all zeros (everything goes to the sink) unless the sink is ``−inf`` too (NaN, as softmax).
    """
    sink = torch.as_tensor(sink_logit, dtype=scores.dtype, device=scores.device)
    return softmax_with_columns(scores, sink.expand(scores.shape[:-1]).unsqueeze(-1))[0]


def sink_mass(weights: Tensor) -> Tensor:
    """``1 − Σ_j w_j``: the share each row gave to the sink."""
    return 1.0 - weights.sum(dim=-1)


def mask_rows(
    mask: Tensor | None, is_causal: bool, c0: int, c1: int, tq: int, tk: int, device: torch.device | str
) -> tuple[Tensor, Tensor | None]:
    """What query rows ``c0:c1`` may attend to, from whatever mask transformers handed the attention function.

    ``mask`` is boolean ``[B|1, 1, Tq, Tk]`` (True = attend), additive float (``finfo.min`` = blocked), or
    ``None`` (causal with the last query aligned to the last key, or full when ``is_causal`` is False).
    Returns the boolean ``[B|1, 1, C, Tk]`` visibility and, for float masks, the additive part (else None).
    """
    if mask is None:
        rows = torch.arange(c0, c1, device=device)[:, None] + (tk - tq)
        cols = torch.arange(tk, device=device)[None, :]
        allowed = (cols <= rows) if is_causal and tq > 1 else torch.ones(c1 - c0, tk, dtype=torch.bool, device=device)
        return allowed[None, None], None
    part = mask[..., c0:c1, :tk]
    if part.dtype == torch.bool:
        return part, None
    floor = torch.finfo(part.dtype).min / 2
    allowed = part > floor
    return allowed, part.float().masked_fill(~allowed, 0.0)
