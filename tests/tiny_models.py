"""Tiny random-init models of every supported architecture, built from configs in code (no download)."""

from __future__ import annotations

import torch
import transformers as tf

V = 97  # vocabulary of the text models

_TEXT = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=128)


TEXT_MODELS = {
    "llama-gqa": ("LlamaConfig", "LlamaForCausalLM", dict(_TEXT, num_key_value_heads=2)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(_TEXT, num_key_value_heads=2)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(_TEXT, num_key_value_heads=2, head_dim=8)),
    "mistral-sliding": ("MistralConfig", "MistralForCausalLM", dict(_TEXT, num_key_value_heads=2, sliding_window=5)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(_TEXT, num_key_value_heads=1, head_dim=8)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(_TEXT, num_key_value_heads=2, pad_token_id=0)),
    "gpt-neox-partial-rotary": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(_TEXT, rotary_pct=0.25)),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=128)),
    "opt": ("OPTConfig", "OPTForCausalLM", dict(vocab_size=V, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                                                  num_attention_heads=4, max_position_embeddings=128,
                                                  word_embed_proj_dim=32, pad_token_id=1)),
    "bert": ("BertConfig", "BertModel", dict(_TEXT)),
    "gpt-oss-learned-sinks": ("GptOssConfig", "GptOssForCausalLM",
                              dict(_TEXT, num_key_value_heads=2, head_dim=8, num_local_experts=2,
                                   num_experts_per_tok=1, sliding_window=6, layer_types=["sliding_attention", "full_attention"])),
}

VISION_MODELS = {
    "vit": ("ViTConfig", "ViTModel", dict(image_size=16, patch_size=4, num_channels=3, hidden_size=32,
                                         intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)),
    "dinov2": ("Dinov2Config", "Dinov2Model", dict(image_size=16, patch_size=4, num_channels=3, hidden_size=32,
                                                 mlp_ratio=2, num_hidden_layers=2, num_attention_heads=4,
                                                 layerscale_value=0.5)),
    "dinov2-registers": ("Dinov2WithRegistersConfig", "Dinov2WithRegistersModel",
                         dict(image_size=16, patch_size=4, num_channels=3, hidden_size=32, mlp_ratio=2,
                              num_hidden_layers=2, num_attention_heads=4, num_register_tokens=4)),
}

CAUSAL = {"llama-gqa", "qwen2", "qwen3", "mistral-sliding", "gemma", "phi3", "gpt-neox-partial-rotary", "gpt2", "opt",
          "gpt-oss-learned-sinks"}


EAGER_ONLY = {"gpt-oss-learned-sinks"}  # transformers offers no SDPA path for learned sink logits


def build(name: str, attn: str = "sdpa", dtype=torch.float32):
    cfg_name, model_name, kwargs = {**TEXT_MODELS, **VISION_MODELS}[name]
    if name in EAGER_ONLY:
        attn = "eager"
    config = getattr(tf, cfg_name)(**kwargs)
    config._attn_implementation = attn
    torch.manual_seed(1)
    model = getattr(tf, model_name)(config).eval().to(dtype)
    # Sharpen attention so sinks and routed queries actually occur in random weights.
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if any(k in pname for k in ("q_proj.weight", "k_proj.weight", "query.weight", "key.weight",
                                         "query_key_value.weight", "qkv_proj.weight", "c_attn.weight")):
                p.mul_(6.0)
    return model


def inputs_for(name: str, batch: int = 2, length: int = 12, pad: bool = True):
    """Model inputs; text models get a right-padded second row when ``pad``."""
    g = torch.Generator().manual_seed(2)
    if name in VISION_MODELS:
        return {"pixel_values": torch.randn(batch, 3, 16, 16, generator=g)}
    ids = torch.randint(2, V, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    if pad and batch > 1:
        mask[1, length - 4 :] = 0
    return {"input_ids": ids, "attention_mask": mask}


def tiny_vit(kind: str, image_size: int = 12):
    """A 2-layer, width-24 transformers ``ViTModel`` (no pooler) or ``Dinov2Model`` (LayerScale 0.5), patch 4."""
    torch.manual_seed(0)
    args = {"hidden_size": 24, "num_hidden_layers": 2, "num_attention_heads": 3, "intermediate_size": 48,
            "image_size": image_size, "patch_size": 4, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    if kind == "vit":
        return tf.ViTModel(tf.ViTConfig(**args), add_pooling_layer=False).eval()
    return tf.Dinov2Model(tf.Dinov2Config(**args, layerscale_value=0.5)).eval()

