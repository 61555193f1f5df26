"""The architecture matrix: every causal-LM type transformers knows, as a tiny random model, through sinklab.

For each model type in ``transformers``' causal-LM auto mapping (plus a few encoder and vision families that
``sinklab.scan`` accepts, as their base models) this builds a tiny random model from the type's own default
config with every size shrunk by name (width 64, 2 layers, 4 heads, 2 KV heads, head width 16, vocabulary 128,
4 experts with top-2 …; no weights are downloaded) and runs five cells against independent references:

* ``scan`` — ``sinklab.scan`` on two 32-token windows of a character-level tokenizer; sample 0's attention maps
  against the model's own eager attention weights (``output_attentions=True``) of the same tokens;
* ``stream`` — ``SinkCache(num_sinks=4, window=64)`` through the model's own ``generate`` (nothing evicted)
  against ``generate`` with the model's default cache: same greedy tokens, first-step logits within 1e-4;
* ``stream_evicted`` — a one-layer variant fed a 40-token chunk, then 20 single tokens, through
  ``SinkCache(num_sinks=4, window=8)``; every position's logits against a plain forward of the model over
  exactly the kept tokens (the first 4 and the 8 most recent) at positions 0 … n−1 (exact for one layer with one
  cached attention layer); in float32 and again in float64;
* ``diagnose`` — ``sinklab.diagnose`` with one edited layer and sample; the result serialises and is finite;
* ``circuit`` — ``sinklab.circuit`` with one causal and one condition sample (causal LMs and text encoders).

Each cell is ``ok``, ``refused: <sinklab's message>`` (an ``UnsupportedModelError``/``InputError``), ``crash:
<exception, last frame>``, ``wrong: <measured error>`` or ``n/a: <why>``; a model that cannot be built at all
is ``not built: <reason>`` (distinct from sinklab refusing it). Each type runs in its own forked process with a
timeout, ``--jobs`` at a time. Writes ``benchmarks/results/architectures.json`` and ``docs/architectures.md``.

    python benchmarks/architectures.py [--types llama gpt2 …] [--jobs 2] [--timeout 120] [--json PATH] [--docs PATH]
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import math
import multiprocessing as mp
import os
import platform
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from torch import Tensor, nn  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_JSON = ROOT / "benchmarks" / "results" / "architectures.json"
DEFAULT_DOCS = ROOT / "docs" / "architectures.md"

SEED = 0
CELLS = ("scan", "stream", "stream_evicted", "diagnose", "circuit")
STATUSES = ("ok", "refused", "crash", "wrong", "n/a")

#: Encoder and vision families ``sinklab.scan`` accepts, built as their base models (``AutoModel``); rows ``<type>@base``.
BASE_TYPES = ("bert", "roberta", "distilbert", "electra", "modernbert", "vit", "dinov2", "dinov2_with_registers")

# ----------------------------------------------------------------------------- tiny sizes
WIDTH, FFN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 64, 128, 2, 4, 2, 16, 128
POSITIONS = 2048  # max_position_embeddings and the like are capped here (a learned table stays small)
EXPERTS, TOP_K = 4, 2
OWN_WINDOW = 8  # a model's own sliding window in the 2-layer model (so `stream` exercises it)
EVICT_SINKS, EVICT_WINDOW, EVICT_PROMPT, EVICT_STEPS = 4, 8, 40, 20
EVICT_OWN_WINDOW = 64  # > sinks + window: the one-layer check is the sinks + window rule
STREAM_PROMPT, STREAM_NEW = 16, 8
TEXT_LEN = 32  # tokens per scan/diagnose/circuit window
DATA_IDS = (4, 100)  # random token ids are drawn from [4, 100): inside the tokenizer, clear of multimodal ids
#: float64: the model's own rotary tables are float32 even in a float64 model (transformers computes cos/sin in
#: float32), so the plain-forward reference itself carries ~1e-7 of rounding.
TOLERANCE, TOLERANCE_F64 = 1e-4, 1e-6
IMAGE_SIZE, PATCH = 32, 8

_WIDTH_KEYS = {"hidden_size", "n_embd", "d_model", "dim", "embed_dim", "emb_dim", "embedding_size", "d_embed",
               "word_embed_proj_dim", "lru_width", "input_embedding_size",
               "output_embedding_size", "hidden_dim"}
_LAYER_KEYS = {"num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers", "encoder_layers",
               "num_decoder_layers", "num_encoder_layers"}
_HEAD_KEYS = {"num_attention_heads", "n_head", "n_heads", "num_heads", "decoder_attention_heads",
              "encoder_attention_heads", "attention_heads", "swa_num_attention_heads", "num_decoder_attention_heads",
              "num_encoder_attention_heads", "index_n_heads", "index_num_heads"}
_KV_HEAD_KEYS = {"num_key_value_heads", "num_kv_heads", "swa_num_key_value_heads", "num_query_groups",
                 "multi_query_group_num", "n_kv_heads"}
_HEAD_DIM_KEYS = {"head_dim", "attention_head_dim", "d_head", "dim_head", "kv_channels", "swa_head_dim",
                  "attention_head_size", "index_head_dim", "linear_key_head_dim", "linear_value_head_dim",
                  "linear_head_dim", "mamba_d_head", "mamba_head_dim", "mamba_headdim"}
_POSITION_KEYS = {"max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "max_target_positions",
                  "max_source_positions", "context_length", "max_sequence_length"}
_EXPERT_KEYS = {"num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"}
_TOP_K_KEYS = {"num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k", "top_k"}
_WINDOW_KEYS = {"sliding_window", "sliding_window_size", "attention_window_size", "local_attention_window_len",
                "window_size", "attention_chunk_size"}
_FIXED = {  # other fields by name: small, consistent values
    "vocab_size": VOCAB, "decoder_vocab_size": VOCAB, "vocab_size_per_layer_input": VOCAB,
    "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
    "qk_head_dim": 16, "o_lora_rank": 16, "rotary_dim": 8, "pretraining_tp": 1,
    "n_group": 1, "topk_group": 1, "num_expert_group": 1, "n_shared_experts": 1, "num_shared_experts": 1,
    "moe_num_shared_experts": 1, "first_k_dense_replace": 1, "num_dense_layers": 1, "decoder_sparse_step": 1,
    "num_kv_shared_layers": 0, "max_window_layers": 1, "hidden_size_per_layer_input": 16, "laurel_rank": 8,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_num_heads": 4,
    "mamba_d_state": 16, "mamba_n_heads": 4, "mamba_num_heads": 4, "mamba_n_groups": 1, "mamba_ngroups": 1,
    "mamba_chunk_size": 16, "mamba_dt_rank": 8, "mamba_expand": 2, "mamba_d_ssm": 128, "ssm_state_size": 16,
    "state_size": 16, "time_step_rank": 8, "chunk_size": 16, "n_mamba_heads": 4,
    "image_size": IMAGE_SIZE, "patch_size": PATCH, "num_channels": 3, "num_register_tokens": 4,
    "index_topk": 16, "router_hidden_size": 32, "gated_norm_rank": 8, "loop_gate_rank": 8,
    "num_hashes": 1, "num_buckets": 8, "n_groups": 1,
}
_PATTERN_SUFFIXES = ("_period", "_every_n_layers", "_interval", "_pattern", "_layer_step", "moe_layer_freq")
_OFFSET_SUFFIXES = ("_offset",)
_TOKEN_KEEP = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "sep_token_id": 2, "cls_token_id": 1,
               "decoder_start_token_id": 1, "unk_token_id": 3, "mask_token_id": 3, "forced_eos_token_id": 2}


class NotBuilt(Exception):
    """The tiny model of a type could not be built or run at all (not sinklab's doing)."""


@dataclass
class Cell:
    """One cell of the matrix: a status in :data:`STATUSES`, its message (the reason or the measured error)."""

    status: str
    message: str = ""
    seconds: float = 0.0

    def text(self) -> str:
        return self.status if not self.message else f"{self.status}: {self.message}"


@dataclass
class Built:
    """A tiny model of one type: the model (eval, float32), its kind (``causal``/``text``/``vision``), how it was
    built (attention implementation, which override attempt), and the config overrides applied."""

    name: str
    model_type: str
    kind: str
    model: nn.Module
    attn: str
    attempt: str
    overrides: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------- the config shrinker
def all_types() -> list[str]:
    """Every row name: the causal-LM types of this transformers, then ``<type>@base`` for :data:`BASE_TYPES`."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_MAPPING_NAMES

    causal = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    return causal + [f"{t}@base" for t in BASE_TYPES if t in MODEL_MAPPING_NAMES]


def parse_name(name: str) -> tuple[str, bool]:
    """``"bert@base"`` → ``("bert", True)``; ``"llama"`` → ``("llama", False)``."""
    return (name[: -len("@base")], True) if name.endswith("@base") else (name, False)


def _layer_count(d: dict) -> int | None:
    for key in ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers"):
        if isinstance(d.get(key), int) and not isinstance(d.get(key), bool):
            return int(d[key])
    return None


def pick_layers(lists: dict[str, list], n: int, prefer_full: bool = False) -> list[int]:
    """Which of the original layers the ``n``-layer model keeps (sorted original indices).

    ``lists`` maps a config field to its per-layer list (one entry per original layer). The first layer, then the
    first layer of each new attention kind (the ``*layer_types``/``*block_type*`` lists), then of each new
    combination of every per-layer setting, then the rest in order — so two layers of Gemma 3 are one local and
    one global layer, and two of a hybrid hold one attention layer. ``prefer_full`` (the one-layer model): the
    first ``full_attention`` layer when the model's layers are only full and sliding attention.
    """
    length = len(next(iter(lists.values()))) if lists else 0
    if length == 0:
        return list(range(n))
    kinds = [k for k in lists if "layer_types" in k or "block_type" in k]
    types = lists.get("layer_types")
    if prefer_full and types and set(types) <= {"full_attention", "sliding_attention"} and "full_attention" in types:
        first = types.index("full_attention")
        return sorted([first, *[i for i in range(length) if i != first][: n - 1]])
    picked: list[int] = [0]
    for names in ([k for k in kinds if k == "layer_types"], kinds, list(lists)):
        seen = {tuple(str(lists[k][j]) for k in names) for j in picked}
        for i in range(length):
            sig = tuple(str(lists[k][i]) for k in names)
            if len(picked) < n and sig not in seen:
                picked.append(i)
                seen.add(sig)
    picked += [i for i in range(length) if i not in picked][: n - len(picked)]
    return sorted(picked[:n])


def _int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _size_override(key: str, value: int, d: dict, layers: int, window: int) -> int | None:
    """The tiny value of the integer config field ``key`` of ``d`` (None: leave it as it is)."""
    ssm = "expand" in d and any(k in d for k in ("state_size", "ssm_state_size")) and "num_attention_heads" not in d
    if key in _WIDTH_KEYS:
        return WIDTH
    if key in _LAYER_KEYS:
        return layers
    if key in _HEAD_KEYS:
        return HEADS
    if key in _KV_HEAD_KEYS:  # multi-head attention stays multi-head (MLA needs it); grouped becomes 4 : 2
        heads = next((d[k] for k in ("num_attention_heads", "n_head", "num_heads") if _int(d.get(k))), None)
        return HEADS if value == heads else min(KV_HEADS, value)
    if key in ("mamba_d_head", "mamba_head_dim", "mamba_headdim") or (ssm and key == "head_dim"):
        expand = d.get("mamba_expand", d.get("expand", 2))
        return WIDTH * int(expand) // HEADS  # SSM heads × head width = expand × width
    if key == "head_dim" and _int(d.get("qk_rope_head_dim")) and value == d["qk_rope_head_dim"]:
        return _FIXED["qk_rope_head_dim"]  # MLA: head_dim is the rotary part
    if key in _HEAD_DIM_KEYS:
        return HEAD_DIM
    if key in _POSITION_KEYS:
        return min(value, POSITIONS)
    if key in _EXPERT_KEYS:
        return EXPERTS
    if key in _TOP_K_KEYS:
        return min(TOP_K, value)
    if key in _WINDOW_KEYS:
        return window
    if key in _FIXED:
        return _FIXED[key]
    if key.endswith("vocab_size"):  # shape_vocab_size, unpadded_vocab_size … (type_vocab_size stays small)
        return min(value, VOCAB)
    if "intermediate" in key or "ffn" in key or key.endswith(("_ff", "d_inner", "dff")):
        return FFN
    if key.endswith(_PATTERN_SUFFIXES):
        return 2 if value > 1 else value
    if key.endswith(_OFFSET_SUFFIXES):
        return 1 if value > 0 else value
    if key.endswith(("_token_id", "_token_index")):
        if key in _TOKEN_KEEP or value >= VOCAB:
            return _TOKEN_KEEP.get(key)
        others = sorted(k for k, v in d.items() if k.endswith(("_token_id", "_token_index")) and k not in _TOKEN_KEEP
                        and _int(v) and v < VOCAB)
        return VOCAB - 1 - others.index(key)  # an image/audio token id: at the top, clear of the data's ids
    width = next((d[k] for k in ("hidden_size", "n_embd", "d_model") if _int(d.get(k))), None)
    if width and value >= 256 and value * 4 % width == 0 and value * 4 // width in (2, 4, 8, 16):
        return WIDTH * value // width  # derived from the width under another name (half, the same, twice …)
    return None


def _none_override(key: str, d: dict) -> int | None:
    """A value for a field the default config leaves at None although the model needs it (head width, KV heads,
    expert counts of a config whose MoE sizes are set)."""
    if key == "head_dim" and "num_attention_heads" in d:
        return HEAD_DIM
    if key in _KV_HEAD_KEYS and "num_attention_heads" in d:
        return KV_HEADS
    if _int(d.get("moe_intermediate_size")):
        if key in _EXPERT_KEYS:
            return EXPERTS
        if key in _TOP_K_KEYS:
            return TOP_K
        if key in ("n_shared_experts", "num_shared_experts"):
            return 1
    return None


def _is_index_list(value: list, n_orig: int) -> bool:
    """A list of layer indices (``mlp_only_layers``, ``index_layers`` …): increasing ints below the layer count."""
    return (bool(value) and len(value) < n_orig and all(_int(v) and 0 <= v < n_orig for v in value)
            and all(a < b for a, b in zip(value, value[1:])))


def _is_reference_list(value: list) -> bool:
    """A per-layer list of layer indices (``kv_source_layers``: layer i reads layer value[i]'s cache)."""
    return (all(_int(v) for v in value) and set(value) - {0, 1} != set() and value[0] == 0
            and all(v <= i for i, v in enumerate(value)))


def _truncate(key: str, value: list, keep: list[int], d: dict, layers: int, window: int) -> list:
    """The per-layer list ``d[key]`` for the kept layers; values that are layer indices follow their layer, sizes
    (a per-layer ``intermediate_size``) shrink like the field would."""
    if _is_reference_list(value):
        return [keep.index(value[i]) if value[i] in keep else j for j, i in enumerate(keep)]
    kept = [value[i] for i in keep]
    if all(_int(v) for v in kept):
        tiny = [_size_override(key, int(v), d, layers, window) for v in kept]
        return [v if t is None else t for v, t in zip(kept, tiny)]
    return kept


def _pattern(value: list, layers: int) -> list | None:
    """A repeating pattern of layer kinds shorter than the layer count (RecurrentGemma's ``block_types``):
    its first ``layers`` distinct kinds, in order (None if ``value`` is not such a list)."""
    if len(value) < 2 or not all(isinstance(v, str) for v in value) or len(set(value)) < 2:
        return None
    out: list = []
    for v in value:
        if v not in out and len(out) < layers:
            out.append(v)
    return out + [v for v in value if len(out) < layers][: layers - len(out)]


def shrink(d: dict, layers: int, window: int, *, lists: bool = True, subs: str = "full",
           prefer_full: bool = False) -> dict:
    """Constructor keyword arguments that make the config ``d`` (a ``to_dict()``) tiny.

    Integer fields by name (the tables above); per-layer lists (as long as the original layer count) and
    ``per_layer_config`` entries for the kept layers (:func:`pick_layers`; ``lists=False`` leaves the lists for
    the config to derive); lists of layer indices renumbered; sub-configs (``text_config``, ``vision_config`` …)
    recursively, given whole (``subs="full"``: the default's fields with the overrides) or as the overrides
    only (``subs="overrides"``). ``bos``/``eos``/``pad`` ids move into the tiny vocabulary, multimodal token ids
    stay where they are (outside the data's id range) or keep their value.
    """
    out: dict = {}
    n_orig = _layer_count(d) or 0
    per_layer = {k: v for k, v in d.items() if isinstance(v, list) and n_orig > 1 and len(v) == n_orig
                 and all(isinstance(x, (str, int, float, bool)) or x is None for x in v)}
    keep = pick_layers(per_layer, layers, prefer_full)
    for key, value in d.items():
        if key.startswith("_") or key in ("transformers_version", "architectures", "torch_dtype", "dtype",
                                           "id2label", "label2id"):
            continue
        if isinstance(value, dict) and key == "per_layer_config":
            if lists:
                chosen = {int(k): v for k, v in value.items() if str(k).isdigit() and int(k) in keep}
                out[key] = {f"{keep.index(i):02d}": shrink(v, layers, window) or v for i, v in chosen.items()}
        elif isinstance(value, dict) and (key.endswith(("_config", "_encoder", "decoder")) or "model_type" in value):
            sub = shrink(value, layers, window, lists=lists, subs=subs, prefer_full=prefer_full)
            if sub:
                out[key] = {**value, **sub} if subs == "full" else sub
        elif key in per_layer:
            if lists:
                out[key] = _truncate(key, value, keep, d, layers, window)
        elif isinstance(value, list) and _is_index_list(value, n_orig):
            out[key] = [keep.index(v) for v in value if v in keep]
        elif isinstance(value, list) and _pattern(value, layers) is not None and n_orig > len(value):
            out[key] = _pattern(value, layers)
        elif _int(value):
            new = _size_override(key, int(value), d, layers, window)
            if new is not None and new != value:
                out[key] = new
        elif value is None:
            new = _none_override(key, d)
            if new is not None:
                out[key] = new
        elif key == "eos_token_id" and isinstance(value, list):
            out[key] = [2]
        elif key in ("hidden_dropout_prob", "attention_probs_dropout_prob", "attention_dropout", "hidden_dropout",
                     "dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop", "activation_dropout"):
            out[key] = 0.0
    return out


# ----------------------------------------------------------------------------- building a tiny model
def default_config(model_type: str):
    """The type's default config (``AutoConfig.for_model``)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoConfig.for_model(model_type)


def _model_class(model_type: str, base: bool):
    from transformers.models.auto import modeling_auto

    mapping = modeling_auto.MODEL_MAPPING_NAMES if base else modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    name = mapping[model_type]
    name = name[0] if isinstance(name, (tuple, list)) else name
    cls = getattr(transformers, name, None)
    if cls is None:
        raise NotBuilt(f"transformers has no class {name}")
    return cls


def smoke_inputs(kind: str, length: int = 8) -> dict[str, Tensor]:
    """A small input batch of one row for a build check: token ids, or pixels for a vision model."""
    gen = torch.Generator().manual_seed(SEED)
    if kind == "vision":
        return {"pixel_values": torch.randn(1, 3, IMAGE_SIZE, IMAGE_SIZE, generator=gen)}
    return {"input_ids": torch.randint(*DATA_IDS, (1, length), generator=gen)}


def _instantiate(cls, config, attn: str) -> nn.Module:
    torch.manual_seed(SEED)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            model = cls._from_config(config, attn_implementation=attn, dtype=torch.float32)
        except TypeError:
            model = cls._from_config(config, attn_implementation=attn, torch_dtype=torch.float32)
    return model.eval().float()


#: Parameters a shrunk model may have; more means a size field went unrecognised (refuse before allocating it).
MAX_PARAMETERS = 4_000_000


def _config_for(model_type: str, cls) -> object:
    """The default config the model class takes: the type's own, or the class's (``Qwen3_5ForCausalLM`` takes
    the text config of the ``qwen3_5`` composite)."""
    cfg0 = default_config(model_type)
    own = getattr(cls, "config_class", None)
    if isinstance(own, type) and not isinstance(cfg0, own):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return own()
    return cfg0


def _parameter_count(cls, config) -> int:
    """Parameters the model would have, counted on the meta device (nothing allocated)."""
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = cls._from_config(copy.deepcopy(config))
    return sum(p.numel() for p in model.parameters())


#: Config variants :func:`build` tries in order: per-layer lists given or derived, sub-configs whole or overrides.
ATTEMPTS = (("explicit per-layer lists", True, "full"), ("derived per-layer lists", False, "full"),
            ("explicit lists, sub-config overrides only", True, "overrides"),
            ("derived lists, sub-config overrides only", False, "overrides"))


#: Types whose default config has no attention layer at all (transformers' own forward then fails): the layer
#: pattern of the hybrid they are (a recurrent layer, then attention), set on top of the shrunk config.
HYBRID_PATTERNS = {
    "bamba": {"attn_layer_indices": [1]},
    "granitemoehybrid": {"layer_types": ["mamba", "attention"]},
}


def build(name: str, layers: int = LAYERS, window: int = OWN_WINDOW, *, prefer_full: bool = False) -> Built:
    """A tiny random model of row ``name`` (``llama``, ``bert@base`` …), float32, eval, seeded.

    Tries the config variants of :data:`ATTEMPTS`, each with SDPA and then eager attention; the first model that
    builds (at most :data:`MAX_PARAMETERS` parameters) and runs one forward wins. If none does,
    :class:`NotBuilt` with the most telling error (one that is not "no SDPA for this model").
    """
    model_type, base = parse_name(name)
    cls = _model_class(model_type, base)
    try:
        cfg0 = _config_for(model_type, cls)
    except Exception as exc:  # noqa: BLE001 - the type's own defaults are unusable
        raise NotBuilt(f"its default config fails: {_short(exc)}") from None
    kind = "vision" if model_type in ("vit", "dinov2", "dinov2_with_registers") else ("text" if base else "causal")
    d = cfg0.to_dict()
    errors: list[str] = []
    tried: set[str] = set()
    for attempt, lists, subs in ATTEMPTS:
        overrides = shrink(d, layers, window, lists=lists, subs=subs, prefer_full=prefer_full)
        if model_type in HYBRID_PATTERNS and layers == 2:
            overrides.update(HYBRID_PATTERNS[model_type])
        if kind == "causal" and "is_decoder" in d:
            overrides["is_decoder"] = True  # an encoder family's LM head is causal only as a decoder
        key = repr(sorted(overrides.items(), key=lambda kv: kv[0]))
        if key in tried:
            continue
        tried.add(key)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                config = type(cfg0)(**overrides)
        except Exception as exc:  # noqa: BLE001
            errors.append(f"config: {_short(exc)}")
            continue
        try:
            size = _parameter_count(cls, config)
        except Exception as exc:  # noqa: BLE001
            errors.append(f"model: {_short(exc)}")
            continue
        if size > MAX_PARAMETERS:
            errors.append(f"still {size / 1e6:.1f} M parameters after shrinking (a size field it uses is not "
                          "recognised)")
            continue
        for attn in ("sdpa", "eager"):
            try:
                model = _instantiate(cls, copy.deepcopy(config), attn)
                with torch.no_grad(), warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    model(**smoke_inputs(kind))
            except Exception as exc:  # noqa: BLE001
                errors.append(f"{attn} model: {_short(exc)}")
                continue
            return Built(name, model_type, kind, model, attn, attempt, overrides)
    telling = [e for e in errors if "does not support an attention implementation" not in e]
    raise NotBuilt((telling or errors or ["no attempt built it"])[0])


def _short(exc: BaseException, limit: int = 300) -> str:
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


# ----------------------------------------------------------------------------- inputs: a tiny tokenizer and texts
def tiny_tokenizer():
    """A character-level tokenizer of 107 ids: ``<pad>`` 0, ``<s>`` 1 (put before every text), ``</s>`` 2,
    ``<unk>`` 3, the printable ASCII characters, and `` the``/`` of``/`` and`` as whole tokens (the circuit swaps
    the first token for one of those). Every id is below 120, inside the tiny models' 128-row vocabulary."""
    from tokenizers import Tokenizer, models, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    merges = [(" ", "t"), (" t", "h"), (" th", "e"), (" ", "o"), (" o", "f"), (" ", "a"), (" a", "n"), (" an", "d")]
    vocab = {t: i for i, t in enumerate(specials + [chr(c) for c in range(32, 127)])}
    for a, b in merges:
        vocab[a + b] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")


def texts() -> list[str]:
    """Four English paragraphs that ship with Python (``sinklab.texts.default_texts``)."""
    from sinklab.texts import default_texts

    return default_texts(limit=4)


def random_ids(n: int, seed: int = SEED) -> Tensor:
    """``[1, n]`` token ids drawn from :data:`DATA_IDS`."""
    return torch.randint(*DATA_IDS, (1, n), generator=torch.Generator().manual_seed(seed))


def vision_batch() -> tuple[list[dict[str, Tensor]], list[list[str]]]:
    """Two random images ``[2, 3, 32, 32]`` as one batch, and position labels (``[CLS]``, ``patch<i>``)."""
    pixels = torch.randn(2, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(SEED))
    labels = ["[CLS]"] + [f"patch{i}" for i in range((IMAGE_SIZE // PATCH) ** 2)]
    return [{"pixel_values": pixels}], [labels, labels]


# ----------------------------------------------------------------------------- running one cell
class NotApplicable(Exception):
    """The cell does not apply to this model, or its reference (the model's own code) fails."""


def _frame(tb_frame: traceback.FrameSummary) -> str:
    path = tb_frame.filename
    for marker in ("site-packages/", "/src/", "/benchmarks/", "/tests/"):
        if marker in path:
            path = path.split(marker, 1)[1]
            break
    return f"{path}:{tb_frame.lineno} in {tb_frame.name}"


def crash_text(exc: BaseException, limit: int = 400) -> str:
    """``Type: message [at file:line in function]`` of the exception's last frame, and the deepest sinklab frame
    when the last frame is not sinklab's."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = _frame(frames[-1]) if frames else "?"
    ours = [f for f in frames if "/sinklab/" in f.filename.replace("\\", "/")]
    via = f"; via {_frame(ours[-1])}" if ours and ours[-1] is not frames[-1] else ""
    return f"{_short(exc, limit)} [at {where}{via}]"


def run_cell(fn: Callable[[], Cell]) -> Cell:
    """Run one cell: its own result (``ok``/``wrong``/``n/a``), or ``refused`` for sinklab's
    ``UnsupportedModelError``/``InputError``, ``n/a`` for :class:`NotApplicable`, ``crash`` for anything else."""
    from sinklab.errors import InputError, UnsupportedModelError

    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cell = fn()
    except (UnsupportedModelError, InputError) as exc:
        cell = Cell("refused", " ".join(str(exc).split()))
    except NotApplicable as exc:
        cell = Cell("n/a", str(exc))
    except Exception as exc:  # noqa: BLE001 - a crash is a result here
        cell = Cell("crash", crash_text(exc))
    cell.seconds = round(time.perf_counter() - t0, 2)
    return cell


def reference(what: str, fn: Callable[[], object]) -> object:
    """Run the model's own code for a reference; its failure makes the cell n/a (it is not sinklab's)."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001
        raise NotApplicable(f"{what} fails: {_short(exc, 200)}") from None


def relative_error(ours: Tensor, ref: Tensor) -> float:
    """``max |ours − ref| / max |ref|`` in float64 (inf when a side is not finite)."""
    ours, ref = ours.double(), ref.double()
    if not bool(torch.isfinite(ours).all() and torch.isfinite(ref).all()):
        return math.inf
    return float((ours - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def cache_kwarg(model: nn.Module) -> str:
    """The name the model's forward takes its cache under (``cache`` in newer transformers, else
    ``past_key_values``)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def eager_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` on transformers' eager attention (for ``output_attentions``)."""
    twin = copy.deepcopy(model)
    twin.set_attn_implementation("eager")
    return twin


# ----------------------------------------------------------------------------- the cells
def cell_scan(built: Built, tok) -> Cell:
    """``sinklab.scan`` (``scan_inputs`` for images): sample 0's attention maps ``(L, H, T, T)`` against the
    model's own eager attention weights of the same input (``output_attentions=True``), max abs difference
    ≤ 1e-4 on every layer that returns weights. Without such a layer: every map row finite and summing to
    1 − the learned sink mass of its head (``wrong`` otherwise)."""
    import sinklab

    model = built.model
    if built.kind == "vision":
        batches, labels = vision_batch()
        result = sinklab.scan_inputs(model, batches, labels, map_len=64)
        one = {"pixel_values": batches[0]["pixel_values"][:1]}
    else:
        from sinklab.texts import tokenize_windows

        result = sinklab.scan(model, tok, texts(), seq_len=TEXT_LEN, samples=2, batch_size=2, map_len=64)
        windows = tokenize_windows(tok, texts(), TEXT_LEN, 2)
        n = int(windows.attention_mask[0].sum())
        one = {"input_ids": windows.input_ids[:1, :n], "attention_mask": windows.attention_mask[:1, :n]}
    maps = result.attention_maps.double()  # (L, H, m, m)
    attn = result.attention_layers  # a hybrid's recurrent layers have no map (NaN)
    if not attn or not bool(torch.isfinite(result.column_mass[0][attn][:, :, : maps.shape[-1]]).all()):
        return Cell("wrong", "non-finite column mass in sample 0")
    try:
        with torch.no_grad():
            out = eager_copy(model)(**one, output_attentions=True)
        weights = getattr(out, "attentions", None) or ()
    except Exception as exc:  # noqa: BLE001 - no reference weights: fall back to the row sums
        weights, why = (), f"eager output_attentions fails ({_short(exc, 120)})"
    else:
        why = "the model returns no attention weights"
    m = maps.shape[-1]
    # Learned sink logits take part of each row's mass; models' eager weights either leave that share out (gpt-oss)
    # or renormalise over the keys (Granite-SWA), so with learned sinks both sides are compared as distributions
    # over the keys.
    sinks = bool((result.learned_sink_mass[0].abs() > 1e-6).any())
    compared, worst = 0, 0.0
    # Hybrids return weights for their attention layers only, in order.
    layer_of = attn if len(attn) < maps.shape[0] and len(weights) == len(attn) else range(len(weights))
    for layer, w in zip(layer_of, weights):
        if not isinstance(w, Tensor) or layer >= maps.shape[0] or w.dim() != 4 or w.shape[-2] < m or w.shape[-1] < m:
            continue
        ours, ref = maps[layer], w[0, :, :m, :m].double()
        if ref.shape != ours.shape:
            continue
        if sinks:
            ours, ref = ours / ours.sum(-1, keepdim=True), ref / ref.sum(-1, keepdim=True)
        compared += 1
        worst = max(worst, float((ours - ref).abs().max()) if bool(torch.isfinite(ours).all()) else math.inf)
    if compared:
        others = maps.shape[0] - len(attn)
        msg = (f"attention maps vs eager output_attentions on {compared}/{maps.shape[0]} layers"
               f"{f' ({others} recurrent/MLP-only, marked as such)' if others else ''}"
               f"{' (rows normalised over the keys: learned sinks)' if sinks else ''}: max abs diff {worst:.1e}")
        return Cell("ok" if worst <= TOLERANCE else "wrong", msg)
    rows = maps[attn].sum(-1)  # (L, H, m)
    sink = result.learned_sink_mass[0][attn].double()[:, :, None]  # (L, H, 1)
    err = float((rows + sink - 1).abs().max()) if bool(torch.isfinite(rows).all()) else math.inf
    msg = f"{why}; map rows + learned sink mass − 1: max {err:.1e}"
    return Cell("ok" if err <= TOLERANCE else "wrong", msg)


def _generate(model: nn.Module, ids: Tensor, **extra):
    kwargs = dict(max_new_tokens=STREAM_NEW, do_sample=False, output_logits=True, return_dict_in_generate=True,
                  eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs, **extra)


def cell_stream(built: Built) -> Cell:
    """``SinkCache(num_sinks=4, window=64)`` through the model's own ``generate`` (16-token prompt, 8 greedy
    tokens: nothing evicted) against ``generate`` with the model's default cache: the same tokens and first-step
    logits within 1e-4 relative (a token that differs where the reference's top two logits are closer than the
    measured logit error is a near tie, not a failure)."""
    import sinklab

    if built.kind != "causal":
        raise NotApplicable("a base model without an LM head: nothing to generate")
    model = built.model
    ids = random_ids(STREAM_PROMPT)
    sinklab.SinkCache(model, num_sinks=4, window=64).close()  # a refusal comes first, before the reference runs
    ref = reference("the model's own generate", lambda: _generate(model, ids))
    with sinklab.SinkCache(model, num_sinks=4, window=64) as cache:
        ours = _generate(model, ids, **{cache_kwarg(model): cache})
    errors = [relative_error(a[0], b[0]) for a, b in zip(ours.logits, ref.logits)]
    same = torch.equal(ours.sequences, ref.sequences)
    if not same:
        step = int((ours.sequences[0] != ref.sequences[0]).nonzero()[0]) - ids.shape[1]
        top2 = ref.logits[step][0].double().topk(2).values
        gap = float((top2[0] - top2[1]) / ref.logits[step][0].double().abs().max())
        if max(errors[: step + 1]) <= TOLERANCE and gap <= 2 * max(errors[step], 1e-7):
            return Cell("ok", f"near tie at step {step} (top-2 gap {gap:.1e}); logits within {max(errors[:step + 1]):.1e}")
        return Cell("wrong", f"greedy tokens differ from step {step}; logit error there {errors[step]:.1e}, "
                             f"first step {errors[0]:.1e}")
    if errors[0] > TOLERANCE:
        return Cell("wrong", f"first-step logits differ by {errors[0]:.1e} relative (tokens equal)")
    return Cell("ok", f"tokens equal; logits: first step {errors[0]:.1e}, worst step {max(errors):.1e} relative")


def kept_tokens(tokens: Tensor, i: int, sinks: int = EVICT_SINKS, window: int = EVICT_WINDOW) -> Tensor:
    """``[1, n]`` the tokens a StreamingLLM cache keeps for the query at position ``i`` of ``tokens`` ``[1, N]``:
    the first ``sinks`` and the ``window`` most recent (``i`` included)."""
    recent = max(sinks, i + 1 - window)
    return torch.cat([tokens[:, : min(sinks, i + 1)], tokens[:, recent : i + 1]], dim=1)


def plain_kept_logits(model: nn.Module, tokens: Tensor) -> list[Tensor]:
    """The reference of :func:`stream_error`: for every position ``i`` of ``tokens`` ``[1, N]``, the last logits
    ``[V]`` of a plain forward (no cache) over :func:`kept_tokens` at positions 0 … n−1. Queries with the same
    number of kept tokens go through one batched forward."""
    by_length: dict[int, list[int]] = {}
    for i in range(tokens.shape[1]):
        by_length.setdefault(kept_tokens(tokens, i).shape[1], []).append(i)
    out: dict[int, Tensor] = {}
    for n, rows in by_length.items():
        batch = torch.cat([kept_tokens(tokens, i) for i in rows])  # (len(rows), n)
        positions = torch.arange(n)[None].expand(len(rows), n)
        logits = model(input_ids=batch, position_ids=positions, use_cache=False).logits[:, -1]
        out.update(zip(rows, logits))
    return [out[i] for i in range(tokens.shape[1])]


def stream_error(model: nn.Module, tokens: Tensor) -> float:
    """Max relative logit error of a one-layer model streamed through ``SinkCache(4, 8)`` — a chunk of
    :data:`EVICT_PROMPT` tokens, then one token per forward — against :func:`plain_kept_logits`, at every position
    of ``tokens`` ``[1, N]``."""
    import sinklab

    sinklab.SinkCache(model, num_sinks=EVICT_SINKS, window=EVICT_WINDOW).close()  # a refusal comes first
    with torch.no_grad():
        refs = reference("the model's plain forward", lambda: plain_kept_logits(model, tokens))
        ours = []
        with sinklab.SinkCache(model, num_sinks=EVICT_SINKS, window=EVICT_WINDOW) as cache:
            kw = {cache_kwarg(model): cache, "use_cache": True}
            ours += list(model(input_ids=tokens[:, :EVICT_PROMPT], **kw).logits[0])
            for i in range(EVICT_PROMPT, tokens.shape[1]):
                ours.append(model(input_ids=tokens[:, i : i + 1], **kw).logits[0, -1])
    return max(relative_error(a, b) for a, b in zip(ours, refs))


def hybrid_stream_error(model: nn.Module, tokens: Tensor) -> tuple[float, float]:
    """Max relative logit error of a hybrid model (recurrent layers between attention layers) streamed token by
    token through ``SinkCache(4, 8)`` against the float64 StreamingLLM reference of the test suite
    (``tests/stream_reference.py``: the model's own cache for the recurrent layers, the kept keys re-rotated to
    their slot positions by the model's own rotary code). A plain forward over the kept tokens is no reference
    here: the recurrent layers have seen every token. Also returns how far the dense (nothing evicted) logits
    are from the reference, so a check where eviction changes nothing shows as such."""
    import sinklab

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from stream_reference import Reference

    ref = reference("the float64 stream reference", lambda: Reference(model, EVICT_SINKS, EVICT_WINDOW))
    want = reference("the float64 stream reference", lambda: [ref.step(int(t)) for t in tokens[0]])
    worst = 0.0
    with torch.no_grad(), sinklab.SinkCache(model, num_sinks=EVICT_SINKS, window=EVICT_WINDOW) as cache:
        kw = {cache_kwarg(model): cache, "use_cache": True}
        for i in range(tokens.shape[1]):
            ours = model(input_ids=tokens[:, i : i + 1], **kw).logits[0, -1]
            worst = max(worst, relative_error(ours, want[i]))
    with torch.no_grad():
        dense = model(input_ids=tokens).logits[0]  # nothing evicted: how far eviction moves the logits
    moved = max(relative_error(dense[i], want[i]) for i in range(tokens.shape[1]))
    return worst, moved


def cached_layers(model: nn.Module) -> int:
    """Attention layers the model's own cache holds after a 4-token forward (1 when it cannot tell)."""
    try:
        with torch.no_grad():
            out = model(input_ids=random_ids(4), use_cache=True)
        cache = out.get("past_key_values", out.get("cache"))
        return max(1, sum(isinstance(getattr(layer, "keys", None), Tensor) and layer.keys.numel() > 0
                          for layer in getattr(cache, "layers", [])))
    except Exception:  # noqa: BLE001 - the stream cell itself will show what fails
        return 1


def _float64(model: nn.Module) -> nn.Module:
    twin = copy.deepcopy(model).double()
    setter = getattr(twin, "set_experts_implementation", None)
    if setter is not None:  # grouped-mm MoE kernels have no float64 path
        try:
            setter("eager")
        except Exception:  # noqa: BLE001
            pass
    return twin


def cell_stream_evicted(built: Built) -> Cell:
    """A one-layer variant (its own sliding window, if any, widened to 64) streamed past eviction through
    ``SinkCache(num_sinks=4, window=8)``: 40 tokens in one chunk, then 20 single tokens; every position's logits
    against a plain forward over exactly the kept tokens at positions 0 … n−1 (with one layer a kept key depends
    only on its token and position, so this is exact): ≤ 1e-4 relative in float32, ≤ 1e-6 in float64 (the bound
    of the reference's own float32 rotary tables). n/a where the one block caches several attention layers (one
    reads another's output: the reference is no longer exact)."""
    import sinklab

    if built.kind != "causal":
        raise NotApplicable("a base model without an LM head: nothing to stream")
    probe = sinklab.SinkCache(built.model, num_sinks=EVICT_SINKS, window=EVICT_WINDOW)  # a refusal comes first
    hybrid = bool(probe.recurrent_layers)
    probe.close()
    if hybrid:  # recurrent layers have seen every token: the float64 stream reference, on the built model
        tokens = random_ids(EVICT_PROMPT + EVICT_STEPS, seed=SEED + 1)
        err64, moved = hybrid_stream_error(_float64(built.model), tokens)
        return Cell("ok" if err64 <= TOLERANCE_F64 else "wrong",
                    f"hybrid, against the float64 stream reference (tests/stream_reference.py): {err64:.1e} "
                    f"(eviction itself moves the logits by {moved:.1e})")
    try:
        one = build(built.name, layers=1, window=EVICT_OWN_WINDOW, prefer_full=True)
    except NotBuilt as exc:
        raise NotApplicable(f"one-layer model not built: {exc}") from None
    sinklab.SinkCache(one.model, num_sinks=EVICT_SINKS, window=EVICT_WINDOW).close()  # a refusal comes first
    cached = cached_layers(one.model)
    if cached > 1:
        raise NotApplicable(f"its one block caches {cached} attention layers (a later one reads an earlier one's "
                            "output), so a plain forward over the kept tokens is no exact reference")
    tokens = random_ids(EVICT_PROMPT + EVICT_STEPS, seed=SEED + 1)
    err32 = stream_error(one.model, tokens)
    if err32 > TOLERANCE:
        return Cell("wrong", f"float32: max relative logit error {err32:.1e} past eviction")
    try:
        err64 = stream_error(_float64(one.model), tokens)
    except NotApplicable as exc:
        return Cell("ok", f"float32 {err32:.1e}; float64 not run ({exc})")
    except Exception as exc:  # noqa: BLE001 - the float32 stream worked: a float64-only failure
        from sinklab.errors import InputError, UnsupportedModelError

        if isinstance(exc, (UnsupportedModelError, InputError)):
            return Cell("refused", f"float64 only: {' '.join(str(exc).split())}")
        return Cell("crash", f"float64 only (float32 ok, {err32:.1e}): {crash_text(exc)}")
    if err64 > TOLERANCE_F64:
        return Cell("wrong", f"float64: max relative logit error {err64:.1e} (float32 {err32:.1e})")
    return Cell("ok", f"float32 {err32:.1e}, float64 {err64:.1e}")


def _finite_json(obj: object) -> bool:
    """Whether every float in a JSON-ready structure is finite (None for missing values is fine)."""
    if isinstance(obj, float):
        return math.isfinite(obj)
    if isinstance(obj, dict):
        return all(_finite_json(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return all(_finite_json(v) for v in obj)
    return True


def cell_diagnose(built: Built, tok) -> Cell:
    """``sinklab.diagnose`` (``diagnose_inputs`` for images) on two windows, one edited layer and sample: it
    serialises, and the causal edits' numbers are finite."""
    import sinklab

    if built.kind == "vision":
        batches, labels = vision_batch()
        d = sinklab.diagnose_inputs(built.model, batches, labels, edit_samples=1, edit_layers=1)
    else:
        d = sinklab.diagnose(built.model, tok, texts(), seq_len=TEXT_LEN, samples=2, batch_size=2, edit_samples=1,
                             edit_layers=1)
    data = json.loads(json.dumps(d.to_json()))
    if not _finite_json(data["edits"]):
        return Cell("wrong", "non-finite causal-edit results")
    return Cell("ok", f"{len(d.records)} sinks, {len(d.edits)} edited heads")


def cell_circuit(built: Built, tok) -> Cell:
    """``sinklab.circuit`` on two windows, one causal and one condition sample: it serialises."""
    import sinklab

    if built.kind == "vision":
        raise NotApplicable("an image model: the circuit's conditions are token edits")
    r = sinklab.circuit(built.model, tok, texts(), seq_len=TEXT_LEN, samples=2, batch_size=2, causal_samples=1,
                        condition_samples=1)
    json.dumps(r.to_json())
    return Cell("ok", "")


# ----------------------------------------------------------------------------- one type, in-process
def run_type(name: str, report: Callable[[tuple], None] | None = None) -> dict:
    """Build row ``name`` and run every cell in this process; returns its JSON row. ``report`` receives
    ``("built", info)`` and ``("cell", cell_name, cell_dict)`` as they happen (the subprocess sends them on)."""
    report = report or (lambda message: None)
    t0 = time.perf_counter()
    torch.manual_seed(SEED)
    model_type, _ = parse_name(name)
    row: dict = {"type": name, "model_type": model_type, "built": False, "cells": {}}
    try:
        built = build(name)
    except NotBuilt as exc:
        row["not_built"] = str(exc)
        report(("built", {"built": False, "not_built": str(exc)}))
        row["seconds"] = round(time.perf_counter() - t0, 2)
        return row
    info = {"built": True, "kind": built.kind, "class": type(built.model).__name__, "attn": built.attn,
            "attempt": built.attempt, "parameters": sum(p.numel() for p in built.model.parameters())}
    row.update(info)
    report(("built", info))
    tok = tiny_tokenizer()
    cells: dict[str, Callable[[], Cell]] = {
        "scan": lambda: cell_scan(built, tok),
        "stream": lambda: cell_stream(built),
        "stream_evicted": lambda: cell_stream_evicted(built),
        "diagnose": lambda: cell_diagnose(built, tok),
        "circuit": lambda: cell_circuit(built, tok),
    }
    for cell_name, fn in cells.items():
        torch.manual_seed(SEED)
        cell = asdict(run_cell(fn))
        row["cells"][cell_name] = cell
        report(("cell", cell_name, cell))
    row["seconds"] = round(time.perf_counter() - t0, 2)
    return row


# ----------------------------------------------------------------------------- many types, one process each
def _quiet() -> None:
    """Silence transformers' logging and Python warnings in a worker; one intra-op thread (``--jobs`` share the cores)."""
    transformers.logging.set_verbosity_error()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)


def _child(name: str, conn: Connection) -> None:
    """Worker process: run row ``name``, sending each step's result to the parent as it happens."""
    _quiet()
    try:
        row = run_type(name, report=conn.send)
        conn.send(("done", row["seconds"]))
    except Exception as exc:  # noqa: BLE001 - a bug of this script, not of the model or sinklab: say so
        conn.send(("harness", crash_text(exc)))
    finally:
        conn.close()


def _pending_row(name: str) -> dict:
    return {"type": name, "model_type": parse_name(name)[0], "built": False, "cells": {}}


def _finish(row: dict, why: str) -> dict:
    """Mark what a dead or timed-out worker left unreported: not built, or the remaining cells crashed."""
    if "not_built" not in row and not row.get("built"):
        row["not_built"] = f"the worker {why} while building"
        return row
    for cell in CELLS:
        row["cells"].setdefault(cell, asdict(Cell("crash", f"the worker {why} during this cell")))
    return row


def _apply(row: dict, message: tuple) -> None:
    if message[0] == "built":
        row.update(message[1])
    elif message[0] == "cell":
        row["cells"][message[1]] = message[2]
    elif message[0] == "done":
        row["seconds"] = message[1]
    elif message[0] == "harness":
        row["harness_error"] = message[1]
        _finish(row, f"hit an error of this script ({message[1]})")


#: Modules the fork server imports once (every worker starts with them): transformers' model machinery takes
#: ~4 s to import, far more than a tiny model's cells.
PRELOAD = ("__main__", "transformers.modeling_utils", "transformers.generation.utils", "transformers.masking_utils",
           "transformers.activations", "transformers.integrations.hub_kernels", "tokenizers", "sinklab",
           "sinklab.stream", "sinklab.circuit", "sinklab.diagnose")


def run_matrix(names: list[str], jobs: int = 2, timeout: float = 120.0,
               progress: Callable[[dict, int, int], None] | None = None) -> list[dict]:
    """Run every row in its own process forked from a server that imported torch, transformers and sinklab once;
    ``jobs`` at a time, each killed after ``timeout`` seconds. Returns the rows in ``names`` order."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    todo = list(names)
    running: dict[Connection, tuple[str, mp.Process, float, dict]] = {}
    rows: dict[str, dict] = {}

    def close(conn: Connection, why: str | None) -> None:
        name, proc, start, row = running.pop(conn)
        if why is not None:
            proc.kill()
            _finish(row, why)
        proc.join(5)
        if proc.exitcode not in (0, None) and why is None and "seconds" not in row:
            _finish(row, f"died (exit code {proc.exitcode})")
        row["seconds"] = row.get("seconds", round(time.perf_counter() - start, 2))
        row["wall_seconds"] = round(time.perf_counter() - start, 2)
        rows[name] = row
        conn.close()
        if progress is not None:
            progress(row, len(rows), len(names))

    while todo or running:
        while todo and len(running) < jobs:
            name = todo.pop(0)
            parent, child = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_child, args=(name, child), daemon=True)
            proc.start()
            child.close()
            running[parent] = (name, proc, time.perf_counter(), _pending_row(name))
        now = time.perf_counter()
        deadline = min(start + timeout for _, _, start, _ in running.values())
        for conn in wait(list(running), timeout=max(0.0, deadline - now)):
            try:
                while conn.poll():
                    _apply(running[conn][3], conn.recv())
            except (EOFError, OSError):
                close(conn, None if "seconds" in running[conn][3] else "died")
        for conn, (_name, _proc, start, _row) in list(running.items()):
            if time.perf_counter() - start > timeout:
                close(conn, f"was killed after the {timeout:.0f} s timeout")
    return [rows[n] for n in names]


# ----------------------------------------------------------------------------- summary, JSON, Markdown
def status_of(row: dict, cell: str) -> str:
    """A row's status in one cell (``not built`` when the model was not built)."""
    if not row.get("built"):
        return "not built"
    return row["cells"].get(cell, {}).get("status", "crash")


def counts(rows: list[dict]) -> dict[str, dict[str, int]]:
    """``{cell: {status: rows}}`` over the built rows."""
    return {cell: {s: sum(status_of(r, cell) == s for r in rows) for s in STATUSES} for cell in CELLS}


def summary_table(rows: list[dict]) -> str:
    """The counts as a Markdown table (also printed at the end of a run)."""
    table = counts(rows)
    built = sum(bool(r.get("built")) for r in rows)
    lines = [f"{len(rows)} types, {built} built, {len(rows) - built} not built", "",
             "| cell | " + " | ".join(STATUSES) + " |", "|---" * (len(STATUSES) + 1) + "|"]
    for cell in CELLS:
        lines.append(f"| {cell} | " + " | ".join(str(table[cell][s]) for s in STATUSES) + " |")
    return "\n".join(lines)


def shorten(text: str, limit: int = 110) -> str:
    """One line of at most ``limit`` characters (Markdown table safe)."""
    text = " ".join(text.replace("|", "/").split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _cell_md(row: dict, cell: str) -> str:
    if not row.get("built"):
        return "—"
    c = row["cells"].get(cell, {"status": "crash", "message": "no result"})
    return c["status"] if not c.get("message") or c["status"] == "ok" else f"{c['status']}: {shorten(c['message'])}"


def render_markdown(rows: list[dict], meta: dict) -> str:
    """``docs/architectures.md``: what each column checks and against what, how it was made, the counts, one row
    per type."""
    cols = " | ".join(CELLS)
    out = [
        "# Architecture matrix",
        "",
        "Every causal-LM model type of transformers " + meta["transformers"] + " (its `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`), "
        "plus a few encoder and vision families as their base models (`<type>@base`), built as a **tiny random "
        "model** from the type's own default config with every size shrunk by name (width 64, 2 layers, 4 heads, "
        "2 KV heads, head width 16, vocabulary 128, 4 experts with top-2, small MLA ranks, per-layer lists cut to "
        "the kept layers — one local and one global layer where the model mixes them, one recurrent and one "
        "attention layer for a hybrid, whose pattern is set where the default config has no attention layer "
        "(Bamba, Granite MoE hybrid); no weights downloaded), "
        "float32, SDPA attention where the model has it (else eager), seeded. Random weights: this checks that "
        "sinklab runs and computes the right numbers on each architecture, not what sinks a trained model has.",
        "",
        "Columns (each cell: `ok`, `refused` — sinklab's `UnsupportedModelError`/`InputError`, with the message a "
        "user sees —, `crash` — any other exception, with its last frame —, `wrong` — a measured error past the "
        "tolerance —, or `n/a`):",
        "",
        "* **scan** — `sinklab.scan` on two 32-token windows (a character-level tokenizer); sample 0's attention "
        "maps against the model's own eager attention weights (`output_attentions=True`) on the same tokens, max "
        "abs difference ≤ 1e-4 (where the model returns no weights: every row sums to 1 − its learned sink mass).",
        "* **stream** — `SinkCache(model, num_sinks=4, window=64)` passed to the model's own `generate` (16-token "
        "prompt, 8 greedy tokens, nothing evicted; a model's own sliding window is set to 8 tokens so it is "
        "exercised) against `generate` with the model's default cache: the same tokens and first-step logits "
        "within 1e-4 relative.",
        "* **stream_evicted** — a one-layer variant (its own sliding window widened to 64 tokens, so the check is the "
        "sinks + window rule) streamed with `SinkCache(num_sinks=4, window=8)`: a 40-token chunk, then 20 tokens one "
        "by one; at every position, the logits against a plain forward (the model's own attention, no cache) over "
        "exactly the kept tokens — the first 4 and the 8 most recent — at positions 0 … n−1. With one layer a kept "
        "key depends only on its token and its position, so the reference is exact: ≤ 1e-4 relative in float32, "
        "and again in float64 ≤ 1e-6 (transformers computes rotary tables in float32 even for a float64 model). "
        "n/a where the one block caches several attention layers (one reads another's output, so the reference is "
        "no longer exact) or where a one-layer model cannot be built. A hybrid (recurrent layers between attention "
        "layers: their state has seen every token, so the plain forward is no reference) is checked on its "
        "two-layer model, token by token, against the float64 stream reference of the test suite "
        "(`tests/stream_reference.py`: the model's own cache for the recurrent layers, the kept keys re-rotated to "
        "their slot positions by the model's own rotary code), ≤ 1e-6; the cell also says how far eviction itself "
        "moves the logits, so a check that eviction does not affect shows as such.",
        "* **diagnose** — `sinklab.diagnose` on the same windows with one edited layer and sample; the diagnosis "
        "serialises and its causal edits are finite (random weights rarely sink, so usually nothing is edited).",
        "* **circuit** — `sinklab.circuit` on the same windows, one causal and one condition sample; it serialises.",
        "",
        "`not built` rows are types whose tiny model could not be made or run by transformers itself (a vision tower "
        "needing `timm`, a default config that does not validate, …) — that is not sinklab refusing them.",
        "",
        f"Made by `{meta['command']}` on {meta['machine']} in {meta['wall_seconds'] / 60:.1f} min "
        f"({meta['date']}; torch {meta['torch']}, transformers {meta['transformers']}, sinklab {meta['sinklab']} at "
        f"{meta['git']}). "
        "The JSON with every message in full: `benchmarks/results/architectures.json`.",
        "",
        "## Counts",
        "",
        summary_table(rows),
        "",
        "## Types",
        "",
        f"| type | {cols} |",
        "|---" * (len(CELLS) + 1) + "|",
    ]
    for row in rows:
        if row.get("built"):
            out.append(f"| {row['type']} | " + " | ".join(_cell_md(row, c) for c in CELLS) + " |")
        else:
            out.append(f"| {row['type']} | not built: {shorten(row.get('not_built', '?'), 160)} |" + " |" * (len(CELLS) - 1))
    return "\n".join(out) + "\n"


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary sibling and ``os.replace`` (a failed run leaves nothing)."""
    from sinklab.atomic import atomic_file

    with atomic_file(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def git_state() -> str:
    """The commit the sinklab sources are at, and whether ``src/`` has uncommitted changes (read-only git calls)."""
    import subprocess

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()

    try:
        commit, dirty = git("rev-parse", "--short", "HEAD"), git("status", "--porcelain", "--", "src")
    except (OSError, subprocess.CalledProcessError):
        return "an unknown commit"
    return f"commit {commit}" + (" with uncommitted changes in src/" if dirty else "")


def run_meta(argv: list[str], wall: float) -> dict:
    """Provenance of a run: command, machine, versions, sources, date, wall time."""
    import sinklab

    return {"git": git_state(), "command": "python benchmarks/architectures.py" + ("" if not argv else " " + " ".join(argv)),
            "machine": "a shared 2-core CPU VM", "platform": platform.platform(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "sinklab": sinklab.__version__, "date": time.strftime("%Y-%m-%d"), "wall_seconds": round(wall, 1)}


def failures(rows: list[dict]) -> str:
    """Every crash and wrong cell, then every type not built, one line each (for the end of a run)."""
    lines = []
    for status in ("crash", "wrong"):
        for cell in CELLS:
            hits = [r for r in rows if status_of(r, cell) == status]
            if hits:
                lines.append(f"{status} in {cell} ({len(hits)}):")
                lines += [f"  {r['type']}: {r['cells'][cell]['message']}" for r in hits]
    missing = [r for r in rows if not r.get("built")]
    if missing:
        lines.append(f"not built ({len(missing)}):")
        lines += [f"  {r['type']}: {r.get('not_built')}" for r in missing]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", nargs="+", help="rows to run (default: all); e.g. llama gpt2 bert@base")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes at a time")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per type before its worker is killed")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    parser.add_argument("--docs", type=Path, default=DEFAULT_DOCS)
    parser.add_argument("--merge", action="store_true",
                        help="with --types: replace those rows in the existing --json and keep the others")
    args = parser.parse_args(argv)
    names = all_types()
    if args.types:
        unknown = sorted(set(args.types) - set(names))
        if unknown:
            parser.error(f"unknown types {unknown}")
        names = [n for n in names if n in args.types]

    def progress(row: dict, done: int, total: int) -> None:
        cells = "  ".join(f"{c}={status_of(row, c)}" for c in CELLS) if row.get("built") else \
            f"not built: {shorten(row.get('not_built', ''), 90)}"
        print(f"[{done:3d}/{total}] {row['type']:<26s} {row.get('wall_seconds', 0):6.1f}s  {cells}", flush=True)

    t0 = time.perf_counter()
    rows = run_matrix(names, jobs=args.jobs, timeout=args.timeout, progress=progress)
    meta = run_meta(argv, time.perf_counter() - t0)
    if args.merge and args.json.exists():
        old = json.loads(args.json.read_text())
        fresh = {row["type"] for row in rows}
        rows = sorted([r for r in old["rows"] if r["type"] not in fresh] + rows, key=lambda r: r["type"])
        meta = {**old["meta"], "merged": meta}
    write_atomic(args.json, json.dumps({"meta": meta, "counts": counts(rows), "rows": rows}, indent=1) + "\n")
    write_atomic(args.docs, render_markdown(rows, meta))
    print()
    print(summary_table(rows))
    print()
    print(failures(rows))
    print(f"\nwall time {meta['wall_seconds']:.0f} s; wrote {args.json} and {args.docs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
