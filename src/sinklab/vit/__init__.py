"""Vision transformers: sink-aware variants (registers, output gating), a small ViT, a procedurally generated
dense-prediction dataset and the mitigation experiment (``sinklab vit-experiment``).

The experiment runner is imported on demand (``from sinklab.vit.experiment import run_experiment``) so that
analyses can use the variants without pulling in the training and reporting code.
"""

from .data import CLASS_NAMES, ShapesConfig, ShapesDataset
from .model import SinklabViT, small_vit_config, token_labels
from .variants import apply_vit_variant, load_vit, register_count, save_vit, vit_attention_modules

__all__ = [
           "CLASS_NAMES",
           "ShapesConfig",
           "ShapesDataset",
           "SinklabViT",
           "apply_vit_variant",
           "load_vit",
           "register_count",
           "save_vit",
           "small_vit_config",
           "token_labels",
           "vit_attention_modules",
]
