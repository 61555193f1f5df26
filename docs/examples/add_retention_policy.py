"""How to add a retention policy: one subclass of ``ScoredPolicy`` and one row in ``POLICIES``.

``SinkCache(model, policy=NAME)``, the CLI's ``--policy`` and ``benchmarks/retention.py`` read the table. A policy
only scores the candidates (``[B, Hkv, N]``, higher = kept); the stream keeps the sinks, the pinned spans and the
``recent`` newest tokens exactly, and per key-value head the best-scored others up to its budget. This example keeps
the tokens with the largest value norms, and checks that after streaming past the budget every head kept exactly
the sinks, the newest tokens and its largest-value-norm others (``python docs/examples/add_retention_policy.py``).
"""

from dataclasses import dataclass

import torch

from sinklab import SinkCache
from sinklab.models import tiny_llama
from sinklab.stream.policy import POLICIES, Observation, ScoredPolicy


@dataclass
class ValueNorm(ScoredPolicy):
    """Keep the tokens whose values are largest."""

    name = "vnorm"
    needs_weights = False  # True: ``obs.weights`` holds the last ``window`` queries' attention
    recent: int = 2

    def score(self, obs: Observation) -> torch.Tensor:
        return obs.values.float().norm(dim=-1)  # [B, Hkv, N]


POLICIES["vnorm"] = ValueNorm
try:
    model = tiny_llama(num_hidden_layers=2)
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    sinks, window = 2, 10
    cache = SinkCache(model, num_sinks=sinks, window=window, policy="vnorm")
    norms = {}  # layer -> [Hkv, T]: each token's value norm, read off the cache right after its forward
    with torch.no_grad():
        for t in range(ids.shape[1]):  # one token per forward: each forward evicts at most one token per head
            model(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
            for layer, stored in enumerate(cache.layers):
                slot = (stored.sidx[0] == t).float().argmax(-1)  # [Hkv]: where each head wrote token t
                new = stored.values[0, torch.arange(len(slot)), slot].float().norm(dim=-1)
                norms.setdefault(layer, []).append(new)
    # what each head must hold: the sinks, the 2 newest, then greedily the largest value norms seen so far
    for layer, per_token in norms.items():
        norm = torch.stack(per_token, -1)  # [Hkv, T]
        for head in range(norm.shape[0]):
            kept = list(range(sinks))
            for t in range(sinks, ids.shape[1]):
                kept.append(t)
                if len(kept) > sinks + window:
                    candidates = [i for i in kept[sinks:] if i < t - 1]  # the 2 newest are always kept
                    kept.remove(min(candidates, key=lambda i: norm[head, i].item()))
            assert cache.layers[layer].kept_indices()[head] == sorted(kept), (layer, head)
    print("layer 0, head 0 keeps tokens", cache.layers[0].kept_indices()[0])
finally:
    del POLICIES["vnorm"]
