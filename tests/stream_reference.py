"""An independent float64 StreamingLLM reference, shared by the stream tests.

It re-applies RoPE at slot positions (0 … n−1 over the kept tokens) at every step with the model's own
rotary module and ``apply_rotary_pos_emb``, keeps its own store of pre-RoPE keys, and implements the
per-layer rules written out separately from sinklab's code: a layer of the model's own sliding-window
attention with window ``w ≤ S + W`` keeps only its last ``w`` tokens (no sinks, no pinned spans); every other
layer keeps ``S`` sinks, the pinned spans and the ``W`` most recent other tokens. Learned sink logits
(gpt-oss ``s_aux``) and logit soft-capping (Gemma 2) are applied the way the papers/models define them.
"""

from __future__ import annotations

import copy
import sys

import torch
from transformers import AttentionInterface


def _native_windows(model) -> list:
    """Each layer's own window, read from the config independently of sinklab."""
    cfg = model.config
    n = cfg.num_hidden_layers
    types = getattr(cfg, "layer_types", None)
    sw = getattr(cfg, "sliding_window", None)
    if types:
        return [sw if t == "sliding_attention" else None for t in types]
    return [sw] * n


class Reference:
    """Teacher-forced StreamingLLM in float64: ``step(token)`` returns the next-token logits."""

    def __init__(self, model, num_sinks: int, window: int, pinned=(), sliding_sinks: bool = False):
        self.model = copy.deepcopy(model).double()
        if hasattr(self.model, "set_experts_implementation"):  # MoE (gpt-oss): grouped_mm has no float64 kernel
            try:
                self.model.set_experts_implementation("eager")
            except (ValueError, AttributeError, NotImplementedError):
                pass
        self.pinned = list(pinned)
        self.policy = []  # per layer: (sinks, window, pinned?)
        for own in _native_windows(model):
            if own is not None and own <= num_sinks + window:
                self.policy.append((num_sinks, own, True) if sliding_sinks else (0, own, False))
            else:
                self.policy.append((num_sinks, window, True))
        self.store: dict[int, list] = {}
        self.t = -1
        modeling = sys.modules[type(model).__module__]
        self.apply = modeling.apply_rotary_pos_emb
        self.rotary = next(m for m in self.model.modules() if type(m).__name__.endswith("RotaryEmbedding"))
        self.types = getattr(model.config, "layer_types", None)
        AttentionInterface.register("sinklab_test_reference", self._attend)
        self.model.set_attn_implementation("sinklab_test_reference")

    def _rope(self, layer: int, x, positions):
        if hasattr(self.rotary, "inv_freq"):
            cos, sin = self.rotary(x, positions)
            scale = float(getattr(self.rotary, "attention_scaling", 1.0))
        else:  # one set of frequencies per layer type (Gemma 3)
            kind = self.types[layer]
            cos, sin = self.rotary(x, positions, kind)
            scale = float(getattr(self.rotary, f"{kind}_attention_scaling", 1.0))
        return cos.double(), sin.double(), scale

    def _anchored(self, t: int, sinks: int, pins: bool) -> bool:
        return t < sinks or (pins and any(a <= t < b for a, b in self.pinned))

    def _attend(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        layer = module.layer_idx
        sinks, window, pins = self.policy[layer]
        store = self.store.setdefault(layer, [])
        _, _, mscale = self._rope(layer, key, torch.zeros(1, 1, dtype=torch.long))
        # Position 0 is the identity rotation (times the attention scaling), so these are pre-RoPE keys.
        store.append((self.t, key[0, :, 0] / mscale, value[0, :, 0]))
        free = [e for e in store if not self._anchored(e[0], sinks, pins)]
        drop = {e[0] for e in free[: max(0, len(free) - window)]}
        store[:] = [e for e in store if e[0] not in drop]
        n = len(store)
        keys = torch.stack([e[1] for e in store], dim=1)[None]  # (1, Hkv, n, dh)
        values = torch.stack([e[2] for e in store], dim=1)[None]
        cos, sin, _ = self._rope(layer, keys, torch.arange(n)[None])
        q = (query / mscale).expand(1, -1, n, -1)  # the query sits at the last slot
        q_rot, k_rot = self.apply(q, keys, cos, sin)
        q_rot = q_rot[:, :, -1:]
        rep = q_rot.shape[1] // k_rot.shape[1]
        k_rot, values = k_rot.repeat_interleave(rep, 1), values.repeat_interleave(rep, 1)
        scores = (q_rot @ k_rot.transpose(-1, -2)) * scaling  # (1, H, 1, n)
        if kwargs.get("softcap") is not None:
            scores = torch.tanh(scores / kwargs["softcap"]) * kwargs["softcap"]
        if kwargs.get("s_aux") is not None:  # gpt-oss: a per-head logit in the softmax, dropped afterwards
            extra = kwargs["s_aux"].double().view(1, -1, 1, 1)
            probs = torch.softmax(torch.cat([scores, extra], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        return (probs @ values).transpose(1, 2), None

    @torch.no_grad()
    def step(self, token: int) -> torch.Tensor:
        self.t += 1
        ids = torch.tensor([[token]])
        return self.model(input_ids=ids, position_ids=torch.zeros_like(ids), use_cache=False).logits[0, -1]

    def kept(self, layer: int) -> int:
        return len(self.store.get(layer, []))
