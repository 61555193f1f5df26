"""Inputs for scanning or diagnosing a vision transformer loaded by path: the embedded shapes images.

``sinklab scan`` / ``sinklab diagnose`` on a ViT / DINOv2 folder or a ``sinklab.vit`` checkpoint have no
text to read; they run on images of the procedural shapes dataset (:mod:`sinklab.vit.data`, no download)
at the model's own image size, with every position labelled ``[CLS]``, ``reg<i>``, ``patch<i>``.
"""

from __future__ import annotations

from torch import Tensor, nn

from .. import _compat
from ..errors import InputError, check_int
from .data import ShapesConfig, ShapesDataset
from .model import token_labels
from .variants import vit_base, register_count

__all__ = ["is_vision_model", "image_batches"]


def is_vision_model(model: nn.Module) -> bool:
    """True for a model whose base has patch embeddings (ViT, DINOv2, a :class:`sinklab.vit.SinklabViT`)."""
    try:
        base = vit_base(model)
    except Exception:  # noqa: BLE001 - a probe: a model that vit_base cannot read is not a ViT
        return False
    return hasattr(base.embeddings, "patch_embeddings")


def image_batches(model: nn.Module, *, samples: int, batch_size: int, seed: int = 0
                  ) -> tuple[nn.Module, list[dict[str, Tensor]], list[list[str]], dict]:
    """``(backbone, batches, labels, meta)`` for :func:`sinklab.scan_inputs` / :func:`sinklab.diagnose_inputs`.

    ``samples`` test images of the shapes dataset (split ``test``, generator seed ``seed``) at the
    model's ``image_size``, in batches of ``batch_size``, on the model's input device.
    """
    check_int("samples", samples, 1)
    check_int("batch_size", batch_size, 1)
    base = vit_base(model)
    config = base.config
    size = int(_compat.config_get(config, "image_size"))
    patch = int(_compat.config_get(config, "patch_size"))
    channels = int(getattr(config, "num_channels", 3))
    if channels != 3:
        raise InputError(f"the model reads {channels}-channel images; sinklab's embedded images are RGB — "
                         "scan it from Python with sinklab.scan_inputs(pixel_values=…)")
    if size % patch:
        raise InputError(f"image_size {size} is not a multiple of patch_size {patch}")
    data = ShapesDataset(ShapesConfig(image_size=size, seed=seed), "test")
    device = _compat.input_device(base)
    batches = []
    for start in range(0, samples, batch_size):
        x, _, _ = data.batch(start, min(batch_size, samples - start))
        batches.append({"pixel_values": x.to(device)})
    labels = [token_labels((size // patch) ** 2, register_count(model))] * samples
    meta = {"corpus": f"sinklab.vit shapes images (test split, seed {seed}, {size}×{size} px)",
            "model_type": getattr(config, "model_type", "vit"), "registers": register_count(model)}
    return base, batches, labels, meta
