"""An independent float64 StreamingLLM reference, shared by the stream tests and the architecture matrix.

It re-applies RoPE at slot positions (0 … n−1 over the kept tokens) at every step with the model's own
rotary module and ``apply_rotary_pos_emb``, keeps its own store of pre-RoPE keys, and implements the
per-layer rules written out separately from sinklab's code: a layer of the model's own sliding-window
attention with window ``w ≤ S + W`` keeps only its last ``w`` tokens (no sinks, no pinned spans); every other
layer keeps ``S`` sinks, the pinned spans and the ``W`` most recent other tokens. Learned sink logits
(gpt-oss ``s_aux``) and logit soft-capping (Gemma 2) are applied the way the papers/models define them, and
so are sinklab's variants (sink logit, softmax₁, kv-bias slot scored by the query at its slot position,
output gate); register tokens are fed by :meth:`Reference.feed_registers` as the first tokens.

Hybrid models (Qwen3-Next …: ``layer_types`` with ``linear_attention`` / ``conv`` layers beside attention): the
reference runs the model with its own ``DynamicCache(config=...)``, so those layers carry their convolution and
recurrent states exactly as the model itself does (never evicted); the attention layers still go through the
reference's own store and slot positions (their ``DynamicLayer`` is emptied after every step, so the model's cache
keeps no attention keys).
"""

from __future__ import annotations

import copy
import inspect
import sys
from typing import Any

import torch

from .. import _compat


def _nope_layers(text) -> set[int]:
    """Layers whose attention carries no position, read from the (text) config as the models define them: a
    ``no_rope_layers`` flag of 0 (SmolLM3, Llama 4); the full-attention layers of Cohere 2 and of a hybrid EXAONE 4
    (RoPE on the sliding-window layers only)."""
    flags = getattr(text, "no_rope_layers", None)
    if isinstance(flags, (list, tuple)):
        return {i for i, f in enumerate(flags) if not f}
    types = getattr(text, "layer_types", None) or ()
    if getattr(text, "model_type", None) in ("cohere2", "exaone4") and "sliding_attention" in types:
        return {i for i, t in enumerate(types) if t == "full_attention"}
    return set()


def _native_windows(model) -> list:
    """Each layer's own window, read from the (text) config independently of sinklab."""
    cfg = getattr(model.config, "text_config", None) or model.config
    n = cfg.num_hidden_layers
    types = getattr(cfg, "layer_types", None)
    sw = getattr(cfg, "sliding_window", None)
    if types:
        return [sw if t == "sliding_attention" else None for t in types]
    return [sw] * n


class Reference:
    """Teacher-forced StreamingLLM in float64: ``step(token)`` returns the next-token logits."""

    def __init__(self, model, num_sinks: int, window: int, pinned=(), sliding_sinks: bool = False, offsets=None):
        """``offsets`` ``(axes, T)``: a multimodal rotary model's (M-RoPE) position of each stream token minus its
        stream index, from its own layout of the uncompressed sequence; a kept token sits at its slot plus its
        offset."""
        self.offsets = offsets
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
        # A vision-language model: its text decoder's modeling module rotates (the vision tower is never run here).
        modeling = sys.modules[type(_compat.language_model(model)).__module__]
        # A model without positions in its attention (NoPE: Nemotron-H) has neither: its keys are never rotated.
        self.apply = getattr(modeling, "apply_rotary_pos_emb", None)
        decoder = _compat.language_model(self.model)  # a vision tower may have a rotary module of its own
        self.rotary = next((m for m in decoder.modules() if type(m).__name__.endswith("RotaryEmbedding")), None)
        text = getattr(model.config, "text_config", None) or model.config
        self.types = getattr(text, "layer_types", None)
        self.nope = _nope_layers(text)
        self.mla = getattr(text, "qk_rope_head_dim", None) is not None  # DeepSeek-V3-style latent attention
        # Gemma 4's apply_rotary_pos_emb(x, cos, sin) rotates one tensor at a time
        self.one_tensor = self.apply is not None and list(inspect.signature(self.apply).parameters)[1] == "cos"
        # Gemma 4: an image position's per-layer input is the pad token's, as in the model's own forward
        self.per_layer_pad = text.pad_token_id if getattr(text, "hidden_size_per_layer_input", None) else None
        # A hybrid: its non-attention layers keep their state in the model's own cache, fed token by token.
        self.cache = None
        if any(t not in ("full_attention", "sliding_attention") for t in (self.types or ())):
            from transformers import DynamicCache

            self.cache = DynamicCache(config=self.model.config)
        # The private float64 copy dispatches its attention to the reference's own (never restored: it is ours).
        _compat.ModelPatch(self.model).use_attention("sinklab_test_reference", self._attend)
        # A sinklab register variant: the reference feeds the registers itself (feed_registers), as the first
        # tokens of the stream; the copied model's own register hooks are taken out.
        base = self.model.model if hasattr(self.model, "model") else self.model
        self.registers = getattr(base, "sinklab_registers", None)
        for hooks in (base._forward_pre_hooks, base._forward_hooks):
            for key in [k for k, f in hooks.items() if "_add_registers" in getattr(f, "__qualname__", "")]:
                del hooks[key]

    def _rope(self, layer: int, x, positions):
        if self.rotary is None:
            return None, None, 1.0
        if hasattr(self.rotary, "inv_freq"):
            cos, sin = self.rotary(x, positions)
            scale = float(getattr(self.rotary, "attention_scaling", 1.0))
        else:  # one set of frequencies per layer type (Gemma 3)
            kind = self.types[layer]  # type: ignore[index]  # a per-type rotary module comes with layer_types
            cos, sin = self.rotary(x, positions, kind)
            scale = float(getattr(self.rotary, f"{kind}_attention_scaling", 1.0))
        return cos.double(), sin.double(), scale

    def _rotate(self, q, k, cos, sin):
        """The model's own ``apply_rotary_pos_emb``: on (q, k) together, or one tensor at a time (Gemma 4's)."""
        if self.apply is None:
            raise TypeError("its modeling module has no apply_rotary_pos_emb for the reference to rotate with")
        if self.mla and cos.shape[-1] < q.shape[-1]:  # latent attention: each head's rotary part is its last dims
            r = cos.shape[-1]
            q_rot, k_rot = self._rotate(q[..., -r:], k[..., -r:], cos, sin)
            return torch.cat([q[..., :-r], q_rot], -1), torch.cat([k[..., :-r], k_rot], -1)
        if self.one_tensor:
            return self.apply(q, cos, sin), self.apply(k, cos, sin)
        return self.apply(q, k, cos, sin)

    def _anchored(self, t: int, sinks: int, pins: bool) -> bool:
        return t < sinks or (pins and any(a <= t < b for a, b in self.pinned))

    def _attend(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        layer = module.layer_idx
        sinks, window, pins = self.policy[layer]
        store = self.store.setdefault(layer, [])
        _, _, mscale = self._rope(layer, key, torch.zeros(1, 1, dtype=torch.long))
        # Position 0 is the identity rotation (times the attention scaling), so these are pre-RoPE keys. The newest
        # key is the step's own (a hybrid's cache hands over its attention layer's keys, emptied every step).
        store.append((self.t, key[0, :, -1] / mscale, value[0, :, -1]))
        free = [e for e in store if not self._anchored(e[0], sinks, pins)]
        drop = {e[0] for e in free[: max(0, len(free) - window)]}
        store[:] = [e for e in store if e[0] not in drop]
        n = len(store)
        keys = torch.stack([e[1] for e in store], dim=1)[None]  # (1, Hkv, n, dh)
        values = torch.stack([e[2] for e in store], dim=1)[None]
        slots = torch.arange(n)[None]
        if self.offsets is not None:  # (axes, 1, n): every axis by slot, plus the token's own offset
            slots = slots + self.offsets[:, [e[0] for e in store]][:, None]
        cos, sin, _ = self._rope(layer, keys, slots)
        q = (query / mscale).expand(1, -1, n, -1)  # the query sits at the last slot
        q_rot, k_rot = (q, keys) if self.rotary is None or layer in self.nope else self._rotate(q, keys, cos, sin)
        q_rot = q_rot[:, :, -1:]
        rep = q_rot.shape[1] // k_rot.shape[1]
        k_rot, values = k_rot.repeat_interleave(rep, 1), values.repeat_interleave(rep, 1)
        scores = (q_rot @ k_rot.transpose(-1, -2)) * scaling  # (1, H, 1, n)
        if kwargs.get("softcap") is not None:
            scores = torch.tanh(scores / kwargs["softcap"]) * kwargs["softcap"]
        nh = scores.shape[1]
        extra, extra_values = [], []  # per-head learned columns: (logit (1, H, 1, 1), value (1, H, 1, dv))
        if kwargs.get("s_aux") is not None:  # gpt-oss: a per-head logit in the softmax, dropped afterwards
            extra.append(kwargs["s_aux"].double().view(1, -1, 1, 1))
            extra_values.append(torch.zeros_like(values[:, :, :1]))
        variant = getattr(module, "sinklab_variant", None)  # sinklab.variants, written out from the papers
        if variant is not None and (variant.sink_logit or variant.softmax1):
            s = module.sinklab_sink_logit if variant.sink_logit else torch.zeros(nh)
            extra.append(s.double().view(1, -1, 1, 1))
            extra_values.append(torch.zeros_like(values[:, :, :1]))
        if variant is not None and variant.kv_bias:  # a key with no position: scored by the query at its slot
            kb = module.sinklab_k_bias.double().repeat_interleave(rep, 0)  # (H, dh)
            vb = module.sinklab_v_bias.double().repeat_interleave(rep, 0)
            extra.append(((q_rot[0, :, 0] * kb).sum(-1) * scaling).view(1, -1, 1, 1))
            extra_values.append(vb.view(1, nh, 1, -1))
        probs = torch.softmax(torch.cat([scores, *extra], dim=-1), dim=-1)
        out = probs[..., :n] @ values
        for i, val in enumerate(extra_values):
            out = out + probs[..., n + i : n + i + 1] * val
        out = out.transpose(1, 2)  # (1, 1, H, dv)
        if variant is not None and variant.gate is not None:  # Y ⊙ σ(X W), X the attention module's input
            g = torch.sigmoid(module.sinklab_gate(module.sinklab_gate_input.double()))
            out = out * g.view(1, 1, nh, -1)
        return out, None

    def _cache_kwargs(self) -> dict:
        if self.cache is None:
            return {"use_cache": False}
        return {"use_cache": True, "cache": self.cache}

    def _drop_attention_keys(self) -> None:
        """A hybrid's cache: the recurrent layers keep their state; the attention layers keep nothing (the
        reference's own store holds their keys)."""
        for layer in getattr(self.cache, "layers", ()):
            if isinstance(getattr(layer, "keys", None), torch.Tensor):
                layer.keys, layer.values = layer.keys[:, :, :0], layer.values[:, :, :0]

    @torch.no_grad()
    def step(self, token: int) -> torch.Tensor:
        self.t += 1
        ids = torch.tensor([[token]])
        out = self.model(input_ids=ids, position_ids=torch.zeros_like(ids), **self._cache_kwargs()).logits[0, -1]
        self._drop_attention_keys()
        return out

    @torch.no_grad()
    def step_embeds(self, vector: torch.Tensor, deepstack: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Step one input embedding ``[D]`` in (an image token of a vision-language model: the projected vision
        feature the model's own forward puts at that position; ``deepstack``: what it adds to that position's hidden
        state after each of its first layers, Qwen3-VL); returns the next-token logits."""
        self.t += 1
        extra = {}
        if self.per_layer_pad is not None:
            per_layer: Any = _compat.language_model(self.model).get_per_layer_inputs
            extra["per_layer_inputs"] = per_layer(torch.tensor([[self.per_layer_pad]]))

        def visual(module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            kwargs["visual_pos_masks"] = torch.ones(1, 1, dtype=torch.bool)
            kwargs["deepstack_visual_embeds"] = [d.double().view(1, -1) for d in deepstack]  # type: ignore[union-attr]
            return args, kwargs

        decoder = _compat.language_model(self.model)
        handle = decoder.register_forward_pre_hook(visual, with_kwargs=True) if deepstack else None
        try:
            out = self.model(inputs_embeds=vector.double().view(1, 1, -1),
                             position_ids=torch.zeros(1, 1, dtype=torch.long), **extra,
                             **self._cache_kwargs()).logits[0, -1]
        finally:
            if handle is not None:
                handle.remove()
        self._drop_attention_keys()
        return out

    @torch.no_grad()
    def feed_registers(self) -> None:
        """Step the variant's register vectors in, one by one, as the stream's first tokens."""
        for vec in self.registers:  # type: ignore[union-attr]  # called for register variants only
            self.t += 1
            self.model(inputs_embeds=vec.double().view(1, 1, -1), position_ids=torch.zeros(1, 1, dtype=torch.long),
                       **self._cache_kwargs())
            self._drop_attention_keys()

    def kept(self, layer: int) -> int:
        return len(self.store.get(layer, []))


def assert_beams_equal_default(model, ids: torch.Tensor, num_sinks: int, window: int, **gen) -> None:
    """Beam search through ``SinkCache(model, num_sinks, window)`` gives the sequences and scores of ``generate`` with
    the model's default cache (``gen``: ``num_beams``, ``output_scores=True`` … ; nothing evicted)."""
    from ..stream import SinkCache

    with torch.no_grad():
        dense = model.generate(ids, **gen)
        with SinkCache(model, num_sinks=num_sinks, window=window) as cache:
            ours = model.generate(ids, cache=cache, **gen)
    assert torch.equal(ours.sequences, dense.sequences)
    torch.testing.assert_close(ours.sequences_scores, dense.sequences_scores, rtol=1e-5, atol=1e-6)
