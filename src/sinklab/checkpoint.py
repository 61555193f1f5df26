"""Checkpoints with their variant: :func:`save` and the strict :func:`load` (``sinklab.save`` / ``sinklab.load``).

A checkpoint is a safetensors model folder plus ``sinklab_variant.json`` (the :class:`~sinklab.variants.VariantConfig`
of a model changed by :func:`~sinklab.variants.apply_variant`). :func:`load` brings the variant back with its
extra weights and refuses any missing, unused or mis-shaped weight; :func:`check_safetensors` and
:func:`strict_load_report` are the checks the loader (:mod:`sinklab.models`) shares.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Set as AbstractSet
from dataclasses import asdict
from pathlib import Path

from torch import Tensor, nn

from . import _compat
from .atomic import atomic_dir
from .errors import InputError, ModelWeightsError
from .variants import VariantConfig, apply_variant

__all__ = ["CONFIG_FILE", "check_safetensors", "load", "save", "strict_load_report"]

CONFIG_FILE = "sinklab_variant.json"


def save(model: nn.Module, path: str | Path) -> Path:
    """Save a model with its variant: safetensors weights (extra parameters included) + ``sinklab_variant.json``,
    atomically (the files move into ``path`` only once all are written; other files in ``path`` are kept)."""
    handle = getattr(model, "sinklab_variant_handle", None)
    path = Path(path)
    with atomic_dir(path) as tmp:  # a failed save leaves the folder as it was
        with _compat.quiet_loading():
            model.save_pretrained(str(tmp), safe_serialization=True)  # type: ignore[operator]  # a PreTrainedModel
        if handle is not None:
            (tmp / CONFIG_FILE).write_text(json.dumps({"format": "sinklab.variant/1", "variant": asdict(handle.config)}))
    return path


def check_safetensors(path: str | Path) -> list[Path]:
    """The ``*.safetensors`` files of folder ``path``, each opened once to check it is whole.

    Raises :class:`ModelWeightsError` for a truncated or corrupt file (safetensors checks that the header
    is valid and that the data covers every tensor the header lists).
    """
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as handle_f:
                list(handle_f.keys())
        except Exception as exc:
            raise ModelWeightsError(f"{f}: corrupt or truncated safetensors file ({exc}); the checkpoint was not "
                                    "written completely — copy it again or use an earlier checkpoint") from exc
    return files


def strict_load_report(source: str | Path, info: dict, *, allow_unexpected: bool = False,
                       consumed: AbstractSet[str] = frozenset()) -> None:
    """Raise :class:`ModelWeightsError` if ``from_pretrained``'s loading info lists missing, unexpected or
    mismatched weights (``consumed``: keys sinklab loads itself; ``allow_unexpected``: the checkpoint has a
    task head that the base model leaves out on purpose)."""
    missing = sorted(info.get("missing_keys") or ())
    unexpected = sorted(set(info.get("unexpected_keys") or ()) - set(consumed))
    mismatched = sorted(str(k) for k in info.get("mismatched_keys") or ())
    if allow_unexpected:
        unexpected = [k for k in unexpected if "sinklab_" in k]
    problems = []
    if missing:
        problems.append(f"{len(missing)} parameter(s) of the model are not in the files (they would stay random): "
                        f"{_few(missing)}")
    if unexpected:
        hint = (" — variant weights without sinklab_variant.json: save with sinklab.save" if
                any("sinklab_" in k for k in unexpected) else "")
        problems.append(f"{len(unexpected)} weight(s) in the files are not used by the model: {_few(unexpected)}{hint}")
    if mismatched:
        problems.append(f"{len(mismatched)} weight(s) have the wrong shape: {_few(mismatched)}")
    if problems:
        raise ModelWeightsError(f"{source}: the checkpoint does not match its model; " + "; ".join(problems))


def _few(keys: list[str], n: int = 3) -> str:
    return ", ".join(keys[:n]) + (f" … ({len(keys) - n} more)" if len(keys) > n else "")


def _model_class(config):
    """The class named by the config's ``architectures`` (any class a variant can be applied to)."""
    import transformers
    from transformers import AutoModel, AutoModelForCausalLM

    architectures = getattr(config, "architectures", None) or []
    cls = getattr(transformers, architectures[0], None) if architectures else None
    if cls is not None:
        return cls
    return AutoModelForCausalLM if any("CausalLM" in a for a in architectures) else AutoModel


def load(path: str | Path, *, dtype=None) -> nn.Module:
    """Load a model saved by :func:`save` (or any local safetensors model folder), strictly.

    The variant comes back from the checkpoint's own metadata (``sinklab_variant.json``, else the
    ``sinklab_variant`` field of ``config.json``), with its extra weights. Every weight in the files must
    be used and every parameter of the model loaded, else :class:`ModelWeightsError`. (Plain
    ``from_pretrained`` would drop the variant's weights as "unexpected" and run the bare model.)
    """
    from safetensors import safe_open
    from transformers import AutoConfig

    path = Path(path)
    files = check_safetensors(path) if path.is_dir() else []
    if not files:
        raise ModelWeightsError(f"{path}: no safetensors checkpoint here (sinklab loads its checkpoints with safetensors only)")
    try:
        with _compat.quiet_loading():
            config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelWeightsError(f"{path}: no usable config.json ({exc})") from exc
    variant = _saved_variant(path, config)
    try:
        with _compat.quiet_loading(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, info = _model_class(config).from_pretrained(str(path), local_files_only=True, dtype=dtype,
                                                              output_loading_info=True)
    except (OSError, RuntimeError, ValueError) as exc:
        raise ModelWeightsError(f"{path}: the weights cannot be loaded: {exc}") from exc
    extra: dict[str, Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as handle_f:
            extra.update({k: handle_f.get_tensor(k) for k in handle_f.keys() if "sinklab_" in k})
    if variant is not None:
        apply_variant(model, variant, init="off")
        wanted = {k for k in model.state_dict() if "sinklab_" in k}
        absent = sorted(wanted - set(extra))
        if absent:
            raise ModelWeightsError(f"{path}: the variant's weights are missing from the checkpoint: {_few(absent)}")
        result = model.load_state_dict(extra, strict=False)
        info = dict(info, unexpected_keys=set(info["unexpected_keys"]) | set(result.unexpected_keys))
        strict_load_report(path, info, consumed=wanted)
    else:
        strict_load_report(path, info)
    return model.eval()


def _saved_variant(path: Path, config) -> VariantConfig | None:
    meta_file = path / CONFIG_FILE
    try:
        if meta_file.exists():
            return VariantConfig(**json.loads(meta_file.read_text())["variant"])
        fields = getattr(config, "sinklab_variant", None)
        return VariantConfig(**fields) if fields else None
    except (json.JSONDecodeError, KeyError, TypeError, InputError) as exc:
        raise ModelWeightsError(f"{meta_file}: unreadable variant metadata ({exc}); save the model again "
                                "with sinklab.save") from exc
