"""Next-token loss from the base model's final hidden states: the LM head only at the scored positions, in chunks.

A causal LM's head maps every position to a vocabulary-wide row of logits (262,144 for Gemma 3): run over a
whole batch it costs more than the backbone and holds ``B × T × V`` floats. The statistics never need it;
a loss needs it only at the (token, next token) pairs it scores. :func:`token_losses` applies the model's
own output embedding (and its final logit soft-capping, if the config has one) to those rows only, a chunk
at a time. :func:`head_matches` checks once per model (and again when its weights change) that this gives
the model's own logits; where it does not (an architecture with a different head), callers run the full
model instead.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from .. import _compat
from ..attention import soft_cap
from ..fingerprint import ModelCache

__all__ = ["head_matches", "head_logits", "scored_pairs", "token_losses", "CHUNK_ELEMENTS"]

#: Logit entries per chunk (16 MB in float32; the chunk and its exp are the loss's only large temporaries).
CHUNK_ELEMENTS = 1 << 22

_VERIFIED = ModelCache()


def _head(model: nn.Module) -> nn.Module | None:
    getter = getattr(model, "get_output_embeddings", None)
    try:
        return getter() if getter is not None else None
    except (NotImplementedError, AttributeError):
        return None


def _final_softcap(model: nn.Module) -> float | None:
    """The model's final-logit soft-capping (Gemma 2), None without one."""
    config: Any = getattr(model, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(config, "final_logit_softcapping", None)


def head_logits(model: nn.Module, hidden: Tensor) -> Tensor:
    """The LM head of ``model`` on final hidden states ``[..., d]`` → logits ``[..., V]`` (as the model's forward)."""
    return soft_cap(_head(model)(hidden), _final_softcap(model))  # type: ignore[misc]  # a model with a head


@torch.no_grad()
def head_matches(model: nn.Module) -> bool:
    """Whether :func:`head_logits` on the base model's output equals ``model(...).logits`` (a 3-token probe).

    Cached per model while its weights are unchanged. Call it outside an active capture.
    """
    if _head(model) is None or _compat.base_model(model) is model or not _compat.embedding_rows(model):
        return False

    def probe() -> bool:
        device = _compat.input_device(model)
        ids = torch.arange(1, 4, device=device)[None] % _compat.embedding_rows(model)  # type: ignore[operator]  # not 0: often padding; rows checked above
        was_training = model.training
        model.eval()
        try:
            ref = getattr(model(input_ids=ids, use_cache=False), "logits", None)
            hidden = getattr(_compat.base_model(model)(input_ids=ids, use_cache=False), "last_hidden_state", None)
        finally:
            model.train(was_training)
        if ref is None or hidden is None:
            return False
        mine = head_logits(model, hidden).float()
        ref = ref.float()
        return mine.shape == ref.shape and bool(((mine - ref).abs() <= 1e-4 * ref.abs().amax() + 1e-5).all())

    return _VERIFIED.get(model, "lm_head", model.parameters(), probe)


def _vocab_chunked_ce(model: nn.Module, head: nn.Linear, h: Tensor, targets: Tensor, chunk_elements: int) -> Tensor:
    """Cross-entropy ``[N]`` of rows ``h`` ``[N, d]`` against ``targets`` ``[N]``, over vocabulary slices.

    All rows go through one slice of the head's weight at a time (at most ``chunk_elements`` logits), with a
    running log-sum-exp, so the ``V × d`` weight is read once per call — not once per chunk of rows, which made a
    262,144-row head memory-bound.
    """
    n, vocab = h.shape[0], head.weight.shape[0]
    step = max(1, chunk_elements // max(n, 1))
    peak = torch.full((n,), -torch.inf, device=h.device)  # running max of the logits
    total = torch.zeros(n, device=h.device)  # Σ exp(logit − peak)
    picked = torch.zeros(n, device=h.device)  # the target's logit
    cap = _final_softcap(model)
    for v0 in range(0, vocab, step):
        v1 = min(vocab, v0 + step)
        bias = None if head.bias is None else head.bias[v0:v1]
        z = soft_cap(torch.nn.functional.linear(h, head.weight[v0:v1], bias), cap).float()  # as head_logits
        new_peak = torch.maximum(peak, z.amax(-1))
        total = total * torch.exp(peak - new_peak) + torch.exp(z - new_peak[:, None]).sum(-1)
        peak = new_peak
        inside = (targets >= v0) & (targets < v1)  # no boolean indexing: no host sync per slice
        here = z.gather(1, (targets - v0).clamp(0, v1 - v0 - 1)[:, None])[:, 0]
        picked = torch.where(inside, here, picked)
    return peak + torch.log(total) - picked


def scored_pairs(mask: Tensor, stride: int = 1) -> Tensor:
    """``[B, T-1]`` bool: the (token, next token) pairs a loss scores — both tokens real, and with ``stride`` k
    only every k-th one counting back from each row's last (the row's last target, the k-th before it …, whatever
    the padding side): an evenly spread 1/k of the targets, the same tokens in rows that share their end.
    """
    valid = mask[:, :-1].bool() & mask[:, 1:].bool()  # (B, T-1)
    if stride > 1:
        from_end = valid.flip(-1).cumsum(-1).flip(-1) - 1  # 0 at each row's last pair
        valid &= from_end % stride == 0
    return valid


@torch.no_grad()
def token_losses(model: nn.Module, hidden: Tensor, ids: Tensor, mask: Tensor,
                 chunk_elements: int = CHUNK_ELEMENTS, stride: int = 1) -> tuple[Tensor, Tensor]:
    """Per-row sum and count of next-token cross-entropy over the real (token, next token) pairs.

    Parameters
    ----------
    hidden:
        ``[B, T, d]`` the base model's final hidden states (after the final norm).
    ids, mask:
        ``[B, T]`` token ids and real-token mask.
    stride:
        score every ``stride``-th pair counting back from each row's last (:func:`scored_pairs`; 1: every pair).

    Returns
    -------
    ``(loss_sum [B], count [B])`` float64 on the CPU. The head runs on the scored rows only, at most
    ``chunk_elements`` logits at a time: all rows against one slice of the vocabulary (a running log-sum-exp), so
    the head's weight is read once.
    """
    valid = scored_pairs(mask, stride)
    rows = valid.nonzero()  # (N, 2)
    sums = torch.zeros(ids.shape[0], dtype=torch.float64)
    if rows.numel():
        h = hidden[rows[:, 0].to(hidden.device), rows[:, 1].to(hidden.device)]  # (N, d)
        targets = ids[rows[:, 0], rows[:, 1] + 1].to(hidden.device)  # (N,)
        head = _head(model)
        if isinstance(head, nn.Linear):
            ce = _vocab_chunked_ce(model, head, h, targets, chunk_elements)
        else:  # a head sinklab cannot slice by vocabulary: whole rows, a few at a time
            vocab = int(getattr(head, "out_features", 0) or head.weight.shape[0])  # type: ignore[union-attr, index]
            step = max(1, chunk_elements // max(vocab, 1))
            ce = torch.cat([torch.nn.functional.cross_entropy(head_logits(model, h[a : a + step]).float(),
                                                              targets[a : a + step], reduction="none")
                            for a in range(0, h.shape[0], step)])
        sums.index_add_(0, rows[:, 0], ce.double().cpu())
    return sums, valid.sum(-1).double()
