"""A tiny Llama built to have massive-activation sinks (for the KV-quantization tests)."""

from __future__ import annotations

import torch
from torch import nn

from sinklab.models import tiny_llama

SINK_ID = 1  # the token that becomes a sink wherever it appears
MASSIVE, COMMON = 0, 1
Q_GAIN = 10.0


def massive_sink_llama(seed: int = 0) -> nn.Module:
    """2 layers, 4 heads over 2 KV heads of width 32. Token ``SINK_ID`` has a massive activation (channel
    ``MASSIVE``) that every layer's keys turn into a large, low-frequency key; every other token's query points
    at it, so each occurrence of the token draws most of the attention (a sink with an outlier key)."""
    model = tiny_llama(seed, vocab_size=256, num_hidden_layers=2, rope_theta=1e6, tie_word_embeddings=False,
                       initializer_range=0.1)
    dh, hkv = 32, 2
    with torch.no_grad():
        emb = model.model.embed_tokens.weight  # (V, 128); tied to the LM head
        emb[:, MASSIVE] = 0.0
        emb[:, COMMON] = 0.05
        emb[SINK_ID] = 0.0
        emb[SINK_ID, MASSIVE] = 400.0
        slow = [h * dh + dh // 2 - 1 for h in range(hkv)]  # the lowest RoPE frequency of each KV head
        for layer in model.model.layers:
            attn = layer.self_attn
            attn.k_proj.weight[:, MASSIVE] = 0.0
            attn.k_proj.weight[slow, MASSIVE] = 1.0
            attn.q_proj.weight[:, COMMON] = 0.0
            for h in range(4):
                attn.q_proj.weight[h * dh + dh // 2 - 1, COMMON] = Q_GAIN
            attn.v_proj.weight[:, MASSIVE] = 0.0
        model.lm_head.weight[:, [MASSIVE, COMMON]] = 0.0
    return model.eval()
