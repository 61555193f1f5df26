"""Shared by the variant tests: a tiny float64 Llama and an independent naive forward with the variants."""

from __future__ import annotations

import math

import torch

from sinklab.testing.tiny import V, tiny_llama  # noqa: F401 - the variant tests' model, from the one factory
from sinklab.variants import VariantConfig


def naive_forward(model, ids, cfg: VariantConfig, weights: list | None = None):
    """Independent float64 forward of a Llama block stack with the variants, written from the papers.

    ``weights``, if given, receives per layer the attention weights over the tokens (registers included,
    learned slots excluded) as ``[H, T, T]``: rows sum to 1 minus the sink's and the kv-bias slot's share.
    """
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    m = model.model
    x = m.embed_tokens(ids)
    if cfg.registers:
        x = torch.cat([m.sinklab_registers[None].expand(ids.shape[0], -1, -1), x], dim=1)
    t = x.shape[1]
    pos = torch.arange(t)[None]
    cos, sin = m.rotary_emb(x, pos)
    for layer in m.layers:
        a = layer.self_attn
        h_in = layer.input_layernorm(x)
        nh, dh = model.config.num_attention_heads, a.head_dim
        nkv = model.config.num_key_value_heads
        q = a.q_proj(h_in).view(1, t, nh, dh).transpose(1, 2)
        k = a.k_proj(h_in).view(1, t, nkv, dh).transpose(1, 2)
        v = a.v_proj(h_in).view(1, t, nkv, dh).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        outs, head_w = [], []
        for head in range(nh):  # deliberately naive: one head at a time
            kh, vh = k[0, head // (nh // nkv)], v[0, head // (nh // nkv)]
            if cfg.kv_bias:
                kh = torch.cat([a.sinklab_k_bias[head // (nh // nkv)][None], kh])
                vh = torch.cat([a.sinklab_v_bias[head // (nh // nkv)][None], vh])
            z = q[0, head] @ kh.T / math.sqrt(dh)
            causal = torch.ones(t, t).tril().bool()
            if cfg.kv_bias:
                causal = torch.cat([torch.ones(t, 1, dtype=torch.bool), causal], dim=1)
            z = z.masked_fill(~causal, -math.inf)
            logits = list(z.unbind(-1))
            if cfg.sink_logit or cfg.softmax1:
                s = a.sinklab_sink_logit[head] if cfg.sink_logit else torch.tensor(0.0, dtype=z.dtype)
                e = torch.exp(z)
                wts = e / (e.sum(-1, keepdim=True) + torch.exp(s))
            else:
                wts = torch.softmax(torch.stack(logits, -1), -1)
            outs.append(wts @ vh)
            head_w.append(wts[:, 1:] if cfg.kv_bias else wts)
        if weights is not None:
            weights.append(torch.stack(head_w))
        o = torch.stack(outs, dim=1)  # (T, H, dh)
        if cfg.gate == "elementwise":
            o = o * torch.sigmoid(a.sinklab_gate(h_in[0])).view(t, nh, dh)
        elif cfg.gate == "headwise":
            o = o * torch.sigmoid(a.sinklab_gate(h_in[0])).view(t, nh, 1)
        x = x + a.o_proj(o.reshape(1, t, nh * dh))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    x = m.norm(x)
    if cfg.registers:
        x = x[:, cfg.registers:]
    return model.lm_head(x)
