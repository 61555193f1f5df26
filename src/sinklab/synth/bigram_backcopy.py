"""The Bigram-Backcopy task (Guo et al. 2024, arXiv:2410.13835): sinks that appear at CPU scale.

Sequences start with BOS. After one of ``k`` trigger tokens the next token copies the token *before* the
trigger; otherwise it follows a fixed bigram Markov chain whose rows are drawn around a Zipf popularity
(so the triggers — the most popular tokens — fill a good share of positions). A one-layer, one-head
model learns to copy on trigger queries and to do nothing on the others: those queries park on BOS (a
dormant head, an attention sink with a small value and a large BOS residual norm).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["BigramBackcopy"]


@dataclass
class BigramBackcopy:
    """Data of the task; token ``vocab`` is BOS (so the model vocabulary is ``vocab + 1``)."""

    vocab: int = 64
    triggers: int = 3
    seq_len: int = 64
    zipf: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.vocab < self.triggers + 2 or self.triggers < 1 or self.seq_len < 3:
            raise ValueError("need vocab ≥ triggers + 2, triggers ≥ 1 and seq_len ≥ 3")
        g = torch.Generator().manual_seed(self.seed + 30_000)
        popularity = 1.0 / torch.arange(1, self.vocab + 1, dtype=torch.float64) ** self.zipf
        noise = torch.exp(0.5 * torch.randn(self.vocab, self.vocab, generator=g, dtype=torch.float64))
        rows = popularity[None] * noise
        self.transition = (rows / rows.sum(-1, keepdim=True)).float()  # (V, V)
        self.popularity = (popularity / popularity.sum()).float()
        self.bos = self.vocab
        self.trigger_ids = torch.arange(self.triggers)  # the most popular tokens
        self._transition_cdf = self.transition.double().cumsum(-1).float().contiguous()  # (V, V)
        self._popularity_cdf = self.popularity.double().cumsum(-1).float()  # (V,)

    def sample(self, batch: int, gen: torch.Generator) -> Tensor:
        """``[batch, seq_len]`` token ids, BOS first."""
        # Inverse-CDF sampling from one block of uniforms: the same distribution as torch.multinomial row by row,
        # at a fraction of the cost (one searchsorted per position instead of a multinomial draw).
        u = torch.rand(self.seq_len, batch, 1, generator=gen)  # (T, B, 1): u[t] is contiguous
        x = torch.empty(batch, self.seq_len, dtype=torch.long)
        x[:, 0] = self.bos
        x[:, 1] = torch.searchsorted(self._popularity_cdf, u[1]).clamp_(max=self.vocab - 1)[:, 0]
        for t in range(1, self.seq_len - 1):
            nxt = torch.searchsorted(self._transition_cdf[x[:, t]], u[t + 1]).clamp_(max=self.vocab - 1)[:, 0]
            copy = self.is_trigger(x[:, t]) & (t >= 2)
            x[:, t + 1] = torch.where(copy, x[:, t - 1], nxt)
        return x

    def is_trigger(self, x: Tensor) -> Tensor:
        return x < self.triggers
