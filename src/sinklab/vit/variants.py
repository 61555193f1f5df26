"""Sink-aware variants for vision transformers: registers, output gating, and both (off by default).

Applies to transformers' ViT (``ViTModel``, ``ViTForImageClassification`` …), DINOv2 (``Dinov2Model`` …) and
the small :class:`~sinklab.vit.model.SinklabViT`, whose blocks hold an ``attention`` module with
``q_proj``/``k_proj``/``v_proj``/``o_proj`` that dispatches through transformers' attention interface.

* ``registers`` — ``n`` learned tokens inserted after the [CLS] token, right after the patch embedding
  (``[CLS, reg_0 … reg_{n−1}, patch_0 …]``, no position embedding, as DINOv2-with-registers), dropped
  from the base model's outputs (Darcet et al. 2024, arXiv:2309.16588).
* ``gate`` — ``Y ⊙ σ(X W)`` on each head's SDPA output before ``o_proj``, ``X`` the block's normalised input
  (the attention module's input): ``"elementwise"`` (``d → H·dh``) or ``"headwise"`` (``d → H``)
  (Qiu et al. 2025, arXiv:2505.06708).
* ``sink_logit`` / ``softmax1`` / ``kv_bias`` come for free: every row of :data:`sinklab.variants.VARIANTS` adds
  its parameters through :func:`sinklab.variants.add_attention_parameters` and its columns in
  :func:`sinklab.variants.variant_attention`.

The variant is described by :class:`sinklab.variants.VariantConfig` and uses the same attribute names as
:mod:`sinklab.variants` (``sinklab_variant``, ``sinklab_gate``, ``sinklab_gate_input``), so
:class:`sinklab.AttentionCapture` — and therefore scan and diagnose — sees the gate and the sink logit.
:func:`save_vit` / :func:`load_vit` keep the variant with the weights in one safetensors file (metadata
in its header); loading refuses missing or unexpected keys.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from .. import _compat
from ..atomic import atomic_file
from ..errors import InputError, ModelWeightsError, UnsupportedModelError
from ..variants import VariantConfig, VariantHandle, add_attention_parameters, add_register_parameter, parse_variant

__all__ = [
    "FORMAT",
    "VitVariantHandle",
    "apply_vit_variant",
    "load_vit",
    "register_count",
    "save_vit",
    "vit_attention_modules",
    "vit_variant",
]

FORMAT = "sinklab.vit/1"
WEIGHTS_FILE = "model.safetensors"


def vit_attention_modules(model: nn.Module) -> list[nn.Module]:
    """Each block's bidirectional ``attention`` module; :class:`UnsupportedModelError` when the layout differs."""
    mods = []
    for layer in _compat.find_layers(model):
        attn: Any = getattr(layer, "attention", None)
        ok = attn is not None and all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
        if not ok or getattr(attn, "is_causal", True):
            raise UnsupportedModelError(
                f"{type(model).__name__}: ViT variants need ViT/DINOv2-style blocks (a bidirectional `attention` "
                f"module with q/k/v/o_proj); found {type(attn).__name__ if attn is not None else 'none'}. "
                "Llama-style decoders use sinklab.apply_variant.")
        mods.append(attn)
    return mods


def vit_base(model: nn.Module) -> nn.Module:
    """The module owning ``embeddings`` (``ViTModel``/``Dinov2Model``, or the backbone inside a wrapper)."""
    for candidate in (model, getattr(model, "backbone", None), _compat.base_model(model)):
        if candidate is not None and isinstance(getattr(candidate, "embeddings", None), nn.Module):
            return candidate
    raise UnsupportedModelError(f"{type(model).__name__}: ViT variants need a ViT/DINOv2-style model (an `embeddings` "
                                "module followed by blocks with a bidirectional `attention`); Llama-style decoders use "
                                "sinklab.apply_variant")


def vit_variant(model: nn.Module) -> VariantConfig | None:
    """The variant applied to ``model`` (or its backbone), or ``None``."""
    handle = getattr(model, "sinklab_variant_handle", None) or getattr(vit_base(model), "sinklab_variant_handle", None)
    return None if handle is None else handle.config


def register_count(model: nn.Module) -> int:
    """Number of register tokens the model inserts after [CLS] (0 without the variant)."""
    cfg = vit_variant(model)
    return 0 if cfg is None else cfg.registers


class VitVariantHandle(VariantHandle):
    """What :func:`apply_vit_variant` did; ``remove()`` (or leaving the ``with`` block) undoes it."""

    def __init__(self, model: nn.Module, base: nn.Module, config: VariantConfig) -> None:
        super().__init__(model, config, base=base)



def apply_vit_variant(model: nn.Module, variant: str | VariantConfig | dict, *, init: str = "default",
                      seed: int = 0, **overrides) -> VitVariantHandle:
    """Add registers and/or output gating (or a sink logit) to a ViT/DINOv2 model in place.

    ``init="off"`` starts the gate at σ = 1 and the sink logit at −inf (outputs unchanged except for
    registers, which have no identity); ``"default"`` is for training (gate ``nn.Linear`` init with bias 0,
    sink logit 0). Registers start as ``0.02·N(0, 1)`` vectors drawn from ``seed``.
    """
    cfg = parse_variant(variant, **overrides)
    if init not in ("default", "off"):
        raise InputError(f"init must be 'default' or 'off', got {init!r}")
    base = vit_base(model)
    if getattr(base, "sinklab_variant_handle", None) is not None:
        raise InputError("a variant is already applied to this model; call handle.remove() first")
    mods = vit_attention_modules(base)
    d = _compat.config_get(base.config, "hidden_size")
    h = _compat.config_get(base.config, "num_attention_heads")
    dh = getattr(mods[0], "head_dim", d // h)
    ref: Tensor = mods[0].q_proj.weight  # type: ignore[union-attr, assignment]  # (a tensor or module to nn.Module's typing)
    handle = VitVariantHandle(model, base, cfg)
    gen = torch.Generator().manual_seed(seed)
    for attn in mods:
        add_attention_parameters(handle, attn, heads=h, kv_heads=h, head_dim=dh, width=d, init=init, generator=gen)
    if cfg.registers:
        _add_registers(handle.patch, base, cfg.registers, d, ref, gen)
    handle.install()
    return handle


def _add_registers(patch: _compat.ModelPatch, base: nn.Module, n: int, d: int, ref: Tensor,
                   gen: torch.Generator) -> None:
    """Insert ``n`` learned tokens after [CLS] at the embedding output; drop them from the base model's output."""
    add_register_parameter(patch, base, n, d, ref, gen)

    def after_embeddings(module, args, output: Tensor) -> Tensor:
        regs = base.sinklab_registers.to(output.dtype).expand(output.shape[0], n, d)  # type: ignore[operator]  # (B, n, d)
        return torch.cat([output[:, :1], regs, output[:, 1:]], dim=1)  # (B, 1 + n + P, d)

    def drop(x: Tensor) -> Tensor:
        return torch.cat([x[:, :1], x[:, 1 + n :]], dim=1)  # (B, 1 + P, d)

    def after_model(module, args, kwargs, output):
        if isinstance(output, tuple):
            return (drop(output[0]), *output[1:])
        output.last_hidden_state = drop(output.last_hidden_state)
        if getattr(output, "hidden_states", None) is not None:
            output.hidden_states = tuple(drop(hs) for hs in output.hidden_states)
        return output

    patch.hook(base.embeddings, after_embeddings)  # type: ignore[arg-type]
    patch.hook(base, after_model, with_kwargs=True)


# ----------------------------------------------------------------------------- persistence
_CLASSES = ("ViTModel", "ViTForImageClassification", "Dinov2Model", "Dinov2ForImageClassification", "SinklabViT")


def _describe(model: nn.Module) -> dict:
    """Class name, config and constructor arguments needed to rebuild ``model``."""
    name = type(model).__name__
    if name not in _CLASSES:
        raise UnsupportedModelError(f"save_vit supports {', '.join(_CLASSES)}; got {name}")
    if name == "SinklabViT":
        return {"class": name, "config": model.config.to_dict(),  # type: ignore[union-attr, operator]
                "init": {"num_classes": model.num_classes}}
    init = {}
    if name == "ViTModel":
        init = {"add_pooling_layer": model.pooler is not None,
                "use_mask_token": model.embeddings.mask_token is not None}  # type: ignore[union-attr]
    return {"class": name, "config": model.config.to_dict(), "init": init}  # type: ignore[union-attr, operator]


def save_vit(model: nn.Module, path: str | Path) -> Path:
    """Write ``path/model.safetensors``: every weight (the variant's included) and, in the header, the class,
    config, constructor arguments and variant. Written to a temporary file, then renamed."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    desc = _describe(model)
    cfg = vit_variant(model)
    desc["config"].pop("sinklab_variant", None)
    meta = {"format": FORMAT, "class": desc["class"], "config": json.dumps(desc["config"], default=str),
            "init": json.dumps(desc["init"]), "variant": json.dumps(asdict(cfg) if cfg is not None else None)}
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    with atomic_file(path / WEIGHTS_FILE) as tmp:
        save_file(state, str(tmp), metadata=meta)
    return path


def read_vit_metadata(path: str | Path) -> dict:
    """The header metadata of a checkpoint written by :func:`save_vit` (``path`` a folder or the file)."""
    from safetensors import safe_open

    file = Path(path)
    file = file / WEIGHTS_FILE if file.is_dir() else file
    if not file.is_file():
        raise ModelWeightsError(f"{path}: no {WEIGHTS_FILE} here (save_vit writes one)")
    try:
        with safe_open(str(file), framework="pt") as f:
            meta = f.metadata() or {}
    except Exception as exc:  # safetensors raises several error types for corrupt headers
        raise ModelWeightsError(f"{file}: corrupt safetensors file ({exc})") from exc
    if meta.get("format") != FORMAT:
        raise ModelWeightsError(f"{file}: not a sinklab ViT checkpoint (header format {meta.get('format')!r}, "
                                f"expected {FORMAT!r})")
    return meta


def is_vit_checkpoint(path: str | Path) -> bool:
    """True when ``path`` (a folder or file) holds a checkpoint written by :func:`save_vit` (header check only)."""
    try:
        read_vit_metadata(path)
    except ModelWeightsError:
        return False
    return True


def load_vit(path: str | Path) -> nn.Module:
    """Rebuild a model saved by :func:`save_vit` with its variant; refuse missing or unexpected keys."""
    from safetensors.torch import load_file
    from transformers import Dinov2Config, ViTConfig

    meta = read_vit_metadata(path)
    file = Path(path) / WEIGHTS_FILE if Path(path).is_dir() else Path(path)
    name, config_dict, init = meta["class"], json.loads(meta["config"]), json.loads(meta["init"])
    if name not in _CLASSES:
        raise ModelWeightsError(f"{file}: unknown model class {name!r} in the header")
    config_cls = Dinov2Config if name.startswith("Dinov2") else ViTConfig
    config = config_cls.from_dict(config_dict)
    if name == "SinklabViT":
        from .model import SinklabViT

        model = SinklabViT(config, **init)
    else:
        import transformers

        model = getattr(transformers, name)(config, **init)
    variant = json.loads(meta["variant"])
    if variant is not None:
        apply_vit_variant(model, VariantConfig(**variant), init="off")
    state = load_file(str(file))
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ModelWeightsError(f"{file}: checkpoint does not match {name} with variant {variant}: "
                                f"missing {missing[:4]}{' …' if len(missing) > 4 else ''}, "
                                f"unexpected {unexpected[:4]}{' …' if len(unexpected) > 4 else ''}")
    model.load_state_dict(state, strict=True)
    return model.eval()
