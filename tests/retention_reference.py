"""An independent float64 reference for sinklab's score-based retention policies.

Written from the policies' definitions, not from sinklab's code: every key-value head keeps its own list of
``(stream index, pre-RoPE key, value)``; a query is scored against each head's kept keys with RoPE re-applied at
slot positions ``0 … n−1`` over what *that head* keeps (the query at ``n − 1``), by the model's own rotary module
and ``apply_rotary_pos_emb``. After each forward, a head over its budget keeps its sinks, the ``recent`` newest
tokens and the best-scored others:

* TOVA: the newest query's attention weight (averaged over the query heads of the group);
* SnapKV: the last ``window`` queries' weights, averaged, then a mean over the ``kernel`` neighbours in stream order
  (fewer at the ends);
* key norm: minus the L2 norm of the key.
"""

from __future__ import annotations

import copy
import sys

import torch
from transformers import AttentionInterface


def _tova(ref, store, weights) -> list[float]:
    return weights[-1].tolist()


def _snapkv(ref, store, weights) -> list[float]:
    mean = weights[-ref.window:].mean(0).tolist()
    half = ref.kernel // 2
    return [sum(mean[max(0, j - half):j + half + 1]) / len(mean[max(0, j - half):j + half + 1])
            for j in range(len(store))]


def _knorm(ref, store, weights) -> list[float]:
    return [-float(e[1].norm()) for e in store]


#: Score-based policy name → its scoring rule ``(reference, store, weights (C, n)) -> one score per stored token``
#: (higher = kept). A new policy of ``sinklab.stream.policy.POLICIES`` adds its rule here.
SCORES = {"tova": _tova, "snapkv": _snapkv, "knorm": _knorm}


class RetentionReference:
    def __init__(self, model, policy: str, num_sinks: int, budget: int, recent: int, window: int = 1,
                 kernel: int = 7):
        if policy not in SCORES:
            raise NotImplementedError(f"no float64 reference for the retention policy {policy!r}: add its scoring "
                                      "rule to SCORES in tests/retention_reference.py")
        self.model = copy.deepcopy(model).double()
        self.policy, self.sinks, self.budget, self.recent = policy, num_sinks, budget, recent
        self.window, self.kernel = window, kernel
        modeling = sys.modules[type(model).__module__]
        self.apply = modeling.apply_rotary_pos_emb
        self.rotary = next(m for m in self.model.modules() if type(m).__name__.endswith("RotaryEmbedding"))
        self.store: dict[int, list[list]] = {}  # layer → per kv head: [(t, key (dh,), value (dv,))]
        self.t0 = 0  # stream index of the forward's first token
        self.given: dict = {}  # layer → [Hkv, T]: scores of stream indices 0 … T−1, used at the layer's next eviction
        AttentionInterface.register("sinklab_test_retention", self._attend)
        self.model.set_attn_implementation("sinklab_test_retention")

    def _rot(self, x, positions):
        cos, sin = self.rotary(x, torch.tensor([positions]))
        return cos.double(), sin.double()

    def _attend(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        layer = module.layer_idx
        _, h, c, dh = query.shape
        hkv = key.shape[1]
        rep = h // hkv
        heads = self.store.setdefault(layer, [[] for _ in range(hkv)])
        out = torch.zeros(1, h, c, value.shape[-1], dtype=torch.float64)
        weights_by_group = []
        for g in range(hkv):
            store = heads[g]
            old = len(store)
            for i in range(c):
                store.append((self.t0 + i, key[0, g, i], value[0, g, i]))
            n = len(store)
            keys = torch.stack([e[1] for e in store])[None, None]  # (1, 1, n, dh)
            vals = torch.stack([e[2] for e in store])  # (n, dv)
            cos, sin = self._rot(keys, list(range(n)))
            q = query[:, g * rep:(g + 1) * rep]  # (1, rep, c, dh), pre-RoPE (position 0)
            qpos = list(range(old, n))  # query i sits at its own slot
            qcos, qsin = self._rot(q, qpos)
            q_rot, _ = self.apply(q, q, qcos, qsin)
            _, k_rot = self.apply(keys, keys, cos, sin)
            scores = (q_rot @ k_rot[0, 0].T) * scaling  # (1, rep, c, n)
            allowed = torch.tensor([[j <= old + i for j in range(n)] for i in range(c)])
            scores = scores.masked_fill(~allowed, float("-inf"))
            probs = torch.softmax(scores, -1)
            out[:, g * rep:(g + 1) * rep] = probs @ vals
            weights_by_group.append(probs[0].mean(0))  # (c, n)
        given = self.given.pop(layer, None)
        for g in range(hkv):
            self._evict(heads[g], weights_by_group[g], self._budget(layer, g), None if given is None else given[g])
        return out.transpose(1, 2), None

    def _budget(self, layer: int, head: int) -> int:
        """A number: every head's budget; a list of lists: per layer and key-value head (a plan's)."""
        return self.budget if isinstance(self.budget, int) else self.budget[layer][head]

    def _evict(self, store: list, weights: torch.Tensor, budget: int, given=None) -> None:
        n = len(store)
        if n <= budget:
            return
        newest = store[-1][0]
        score = SCORES[self.policy](self, store, weights)
        if given is not None:  # a prescored prompt: its own scores for the tokens it scores
            score = [float(given[e[0]]) if e[0] < len(given) else s for e, s in zip(store, score)]
        protected = [e[0] < self.sinks or e[0] > newest - self.recent for e in store]
        ranked = sorted(range(n), key=lambda j: (not protected[j], -score[j], -store[j][0]))
        keep = set(ranked[:budget])
        store[:] = [e for j, e in enumerate(store) if j in keep]

    @torch.no_grad()
    def forward(self, tokens: list[int]) -> torch.Tensor:
        """Feed ``tokens`` as one forward; the logits ``[C, V]``."""
        ids = torch.tensor([tokens])
        logits = self.model(input_ids=ids, position_ids=torch.zeros_like(ids), use_cache=False).logits[0]
        self.t0 += len(tokens)
        return logits

    def kept(self, layer: int) -> list[list[int]]:
        return [[e[0] for e in head] for head in self.store[layer]]
