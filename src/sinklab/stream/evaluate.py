"""Running perplexity over a long text (the StreamingLLM Figure 3 experiment).

Four ways to model a long text token by token:

* ``dense`` — full attention over everything so far (one causal forward; stops at ``dense_limit``);
* ``window`` — a sliding window without sinks (``S = 0``): collapses once the first tokens are evicted;
* ``recompute`` — sliding window with re-computation: every token re-encodes its last ``W`` tokens from
  scratch (exact but O(W) per token; limited to ``recompute_limit`` tokens);
* ``sinks`` — StreamingLLM: ``S`` sinks + a window of ``W``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
from torch import Tensor, nn

from .. import _compat
from ..errors import InputError
from .session import StreamSession

__all__ = ["stream_nll", "dense_nll", "recompute_nll", "evaluate_stream", "running_ppl"]


def _nll(logits: Tensor, targets: Tensor) -> Tensor:
    return torch.nn.functional.cross_entropy(logits.float(), targets, reduction="none")


@torch.no_grad()
def stream_nll(model: nn.Module, ids: Tensor, num_sinks: int, window: int, chunk_size: int = 256,
               progress: Callable[[int], None] | None = None) -> Tensor:
    """NLL of ``ids[1:]`` (``[N − 1]``) with a sink+window stream; chunks are exact (= token by token)."""
    out = []
    with StreamSession(model, num_sinks=num_sinks, window=window, chunk_size=chunk_size) as s:
        for c0 in range(0, ids.shape[0] - 1, chunk_size):
            c1 = min(ids.shape[0] - 1, c0 + chunk_size)
            logits = s.feed(ids[None, c0:c1], all_logits=True)[0]
            out.append(_nll(logits, ids[c0 + 1 : c1 + 1].to(logits.device)).cpu())
            if progress:
                progress(c1 - c0)
    return torch.cat(out)


@torch.no_grad()
def dense_nll(model: nn.Module, ids: Tensor, limit: int) -> Tensor:
    """NLL with full attention over the first ``limit`` tokens (one forward)."""
    n = min(limit, ids.shape[0])
    device = _compat.input_device(model)
    logits = model(input_ids=ids[None, :n].to(device), use_cache=False).logits[0, :-1]
    return _nll(logits, ids[1:n].to(logits.device)).cpu()


@torch.no_grad()
def recompute_nll(model: nn.Module, ids: Tensor, window: int, limit: int) -> Tensor:
    """NLL with a re-computed sliding window of ``window`` tokens (positions 0 … W−1 each time)."""
    device = _compat.input_device(model)
    out = []
    for t in range(1, min(limit, ids.shape[0])):
        ctx = ids[max(0, t - window) : t][None].to(device)
        logits = model(input_ids=ctx, use_cache=False).logits[0, -1]
        out.append(_nll(logits[None], ids[t : t + 1].to(device)).cpu())
    return torch.cat(out) if out else torch.zeros(0)


def running_ppl(nll: Tensor) -> list[float]:
    """Perplexity of the running mean NLL after each token."""
    if nll.numel() == 0:
        return []
    mean = nll.double().cumsum(0) / torch.arange(1, nll.numel() + 1, dtype=torch.float64)
    return [math.exp(min(float(x), 700.0)) for x in mean]


def evaluate_stream(model: nn.Module, ids: Tensor, *, num_sinks: int = 4, window: int = 1020,
                    dense_limit: int = 4096, recompute_limit: int = 300, chunk_size: int = 256,
                    progress: Callable[[int], None] | None = None) -> dict:
    """Per-token NLL and running perplexity for dense / window / recompute / sinks. ``ids`` is ``[N]``."""
    if ids.dim() != 1 or ids.numel() < 2:
        raise InputError("eval-stream needs a 1-D token sequence of at least 2 tokens")
    max_pos = getattr(model.config, "max_position_embeddings", None) or dense_limit
    results = {}
    timings = {}
    for name, fn in (
        ("dense", lambda: dense_nll(model, ids, min(dense_limit, max_pos))),
        ("window", lambda: stream_nll(model, ids, 0, window, chunk_size)),
        ("recompute", lambda: recompute_nll(model, ids, window, recompute_limit)),
        ("sinks", lambda: stream_nll(model, ids, num_sinks, window, chunk_size, progress)),
    ):
        t0 = time.perf_counter()
        nll = fn()
        timings[name] = time.perf_counter() - t0
        results[name] = {
            "tokens": int(nll.numel()),
            "mean_nll": float(nll.mean()) if nll.numel() else None,
            "ppl": math.exp(float(nll.mean())) if nll.numel() else None,
            "seconds": timings[name],
            "seconds_per_token": timings[name] / max(1, int(nll.numel())),
            "nll": [round(float(x), 4) for x in nll],
        }
    return {"num_sinks": num_sinks, "window": window, "tokens": int(ids.numel()), "curves": results}
