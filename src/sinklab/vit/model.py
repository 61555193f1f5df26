"""A small ViT for CPU experiments: transformers' ``ViTModel`` built from a ``ViTConfig``, plus two heads.

The backbone is a plain ``transformers.ViTModel`` (no pooler, with a mask token), so every sinklab tool
that works on transformers ViTs works on it; the heads only serve training: a linear classifier on the
[CLS] output (the global label) and a linear pixel decoder on each masked patch's output (SimMIM-style
masked-patch reconstruction, Xie et al. 2022, arXiv:2111.09886), which keeps patch features local.
"""

from __future__ import annotations

from torch import Tensor, nn

from .. import _compat
from ..variants import register_labels

__all__ = ["SinklabViT", "small_vit_config", "token_labels"]


def small_vit_config(image_size: int = 32, patch_size: int = 4, width: int = 64, layers: int = 4, heads: int = 4):
    """A ``transformers.ViTConfig`` for a CPU-sized ViT (no dropout, SDPA attention)."""
    from transformers import ViTConfig

    config = ViTConfig(hidden_size=width, num_hidden_layers=layers, num_attention_heads=heads,
                       intermediate_size=4 * width, image_size=image_size, patch_size=patch_size, num_channels=3,
                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, qkv_bias=True)
    _compat.set_config_attention(config, "sdpa")
    return config


class SinklabViT(nn.Module):
    """``backbone`` (``ViTModel``) + ``cls_head`` (d → classes) + ``pixel_head`` (d → patch² · 3)."""

    def __init__(self, config, num_classes: int) -> None:
        super().__init__()
        from transformers import ViTModel

        self.config = config
        self.num_classes = num_classes
        self.backbone = ViTModel(config, add_pooling_layer=False, use_mask_token=True)
        d, p = config.hidden_size, config.patch_size
        self.cls_head = nn.Linear(d, num_classes)
        self.pixel_head = nn.Linear(d, p * p * config.num_channels)

    def forward(self, pixel_values: Tensor, bool_masked_pos: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """``pixel_values`` ``[B, 3, H, W]`` → class logits ``[B, C]``, patch pixels ``[B, P, p²·3]``, features ``[B, 1+P, d]``.

        Register tokens (if the variant adds them) are already dropped from the features.
        """
        feats = self.backbone(pixel_values=pixel_values, bool_masked_pos=bool_masked_pos).last_hidden_state
        return self.cls_head(feats[:, 0]), self.pixel_head(feats[:, 1:]), feats


def token_labels(num_patches: int, registers: int = 0) -> list[str]:
    """Labels of the positions inside the blocks: ``[CLS]``, ``reg<i>`` …, ``patch<i>`` … (diagnose's roles)."""
    return ["[CLS]"] + register_labels(registers) + [f"patch{i}" for i in range(num_patches)]
