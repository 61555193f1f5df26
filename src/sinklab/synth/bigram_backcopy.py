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

    def sample(self, batch: int, gen: torch.Generator) -> Tensor:
        """``[batch, seq_len]`` token ids, BOS first."""
        x = torch.empty(batch, self.seq_len, dtype=torch.long)
        x[:, 0] = self.bos
        x[:, 1] = torch.multinomial(self.popularity.expand(batch, -1), 1, generator=gen)[:, 0]
        for t in range(1, self.seq_len - 1):
            nxt = torch.multinomial(self.transition[x[:, t]], 1, generator=gen)[:, 0]
            copy = self.is_trigger(x[:, t]) & (t >= 2)
            x[:, t + 1] = torch.where(copy, x[:, t - 1], nxt)
        return x

    def is_trigger(self, x: Tensor) -> Tensor:
        return x < self.triggers
