"""Tiny random models for tests and the architecture matrix: one factory, no weights downloaded.

Two ways to a tiny model, one module:

* :func:`build` — any model type transformers registers (``llama``, ``gemma3_text``, ``bert@base`` …) from the
  type's own default config with every size shrunk by name (:func:`shrink`: width 64, 2 layers, 4 heads, 2 KV
  heads, head width 16, vocabulary 128, 4 experts with top-2, small MLA ranks, per-layer lists cut to the kept
  layers by :func:`pick_layers`), a layer count and extra config ``overrides`` on top; float32, eval, seeded.
  What the architecture matrix (:mod:`sinklab.testing.conformance`) runs.
* :func:`named_model` — the hand-written configs of :data:`TEXT_MODELS` / :data:`VISION_MODELS` (narrower still,
  attention sharpened so that random weights sink) that the test suite's capture, scan and stream tests use;
  :func:`inputs_for` gives their inputs, :func:`tiny_vit` and :func:`tiny_llama` two more small builders.

Inputs for the matrix: :func:`tiny_tokenizer` (a character-level tokenizer inside the tiny vocabulary),
:func:`texts`, :func:`random_ids`, :func:`vision_batch`.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import transformers
from torch import Tensor, nn

from .. import _compat

SEED = 0

#: Encoder and vision families ``sinklab.scan`` accepts, built as their base models (``AutoModel``); rows ``<type>@base``.
BASE_TYPES = ("bert", "roberta", "distilbert", "electra", "modernbert", "vit", "dinov2", "dinov2_with_registers")

# ----------------------------------------------------------------------------- tiny sizes
WIDTH, FFN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 64, 128, 2, 4, 2, 16, 128
POSITIONS = 2048  # max_position_embeddings and the like are capped here (a learned table stays small)
EXPERTS, TOP_K = 4, 2
OWN_WINDOW = 8  # a model's own sliding window in the 2-layer model (so `stream` exercises it)
DATA_IDS = (4, 100)  # random token ids are drawn from [4, 100): inside the tokenizer, clear of multimodal ids
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
FIXED = {  # other fields by name: small, consistent values
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
TOKEN_KEEP = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "sep_token_id": 2, "cls_token_id": 1,
               "decoder_start_token_id": 1, "unk_token_id": 3, "mask_token_id": 3, "forced_eos_token_id": 2}


class NotBuilt(Exception):
    """The tiny model of a type could not be built or run at all (not sinklab's doing)."""


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


def is_int(value: object) -> bool:
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
        heads = next((d[k] for k in ("num_attention_heads", "n_head", "num_heads") if is_int(d.get(k))), None)
        return HEADS if value == heads else min(KV_HEADS, value)
    if key in ("mamba_d_head", "mamba_head_dim", "mamba_headdim") or (ssm and key == "head_dim"):
        expand = d.get("mamba_expand", d.get("expand", 2))
        return WIDTH * int(expand) // HEADS  # SSM heads × head width = expand × width
    if key == "head_dim" and is_int(d.get("qk_rope_head_dim")) and value == d["qk_rope_head_dim"]:
        return FIXED["qk_rope_head_dim"]  # MLA: head_dim is the rotary part
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
    if key in FIXED:
        return FIXED[key]
    if key.endswith("vocab_size"):  # shape_vocab_size, unpadded_vocab_size … (type_vocab_size stays small)
        return min(value, VOCAB)
    if "intermediate" in key or "ffn" in key or key.endswith(("_ff", "d_inner", "dff")):
        return FFN
    if key.endswith(_PATTERN_SUFFIXES):
        return 2 if value > 1 else value
    if key.endswith(_OFFSET_SUFFIXES):
        return 1 if value > 0 else value
    if key.endswith(("_token_id", "_token_index")):
        if key in TOKEN_KEEP or value >= VOCAB:
            return TOKEN_KEEP.get(key)
        others = sorted(k for k, v in d.items() if k.endswith(("_token_id", "_token_index")) and k not in TOKEN_KEEP
                        and is_int(v) and v < VOCAB)
        return VOCAB - 1 - others.index(key)  # an image/audio token id: at the top, clear of the data's ids
    width = next((d[k] for k in ("hidden_size", "n_embd", "d_model") if is_int(d.get(k))), None)
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
    if is_int(d.get("moe_intermediate_size")):
        if key in _EXPERT_KEYS:
            return EXPERTS
        if key in _TOP_K_KEYS:
            return TOP_K
        if key in ("n_shared_experts", "num_shared_experts"):
            return 1
    return None


def _is_index_list(value: list, n_orig: int) -> bool:
    """A list of layer indices (``mlp_only_layers``, ``index_layers`` …): increasing ints below the layer count."""
    return (bool(value) and len(value) < n_orig and all(is_int(v) and 0 <= v < n_orig for v in value)
            and all(a < b for a, b in zip(value, value[1:])))


def _is_reference_list(value: list) -> bool:
    """A per-layer list of layer indices (``kv_source_layers``: layer i reads layer value[i]'s cache)."""
    return (all(is_int(v) for v in value) and set(value) - {0, 1} != set() and value[0] == 0
            and all(v <= i for i, v in enumerate(value)))


def _truncate(key: str, value: list, keep: list[int], d: dict, layers: int, window: int) -> list:
    """The per-layer list ``d[key]`` for the kept layers; values that are layer indices follow their layer, sizes
    (a per-layer ``intermediate_size``) shrink like the field would."""
    if _is_reference_list(value):
        return [keep.index(value[i]) if value[i] in keep else j for j, i in enumerate(keep)]
    kept = [value[i] for i in keep]
    if all(is_int(v) for v in kept):
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
        elif is_int(value):
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
    name = str(name[0] if isinstance(name, (tuple, list)) else name)
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


def instantiate(cls, config, attn: str) -> nn.Module:
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


def _config_for(model_type: str, cls: Any) -> Any:
    """The default config the model class takes: the type's own, or the class's (``Qwen3_5ForCausalLM`` takes
    the text config of the ``qwen3_5`` composite)."""
    cfg0 = default_config(model_type)
    own = getattr(cls, "config_class", None)
    if isinstance(own, type) and not isinstance(cfg0, own):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return own()
    return cfg0


def parameter_count(cls, config) -> int:
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
HYBRID_PATTERNS: dict[str, dict[str, Any]] = {
    "bamba": {"attn_layer_indices": [1]},
    "granitemoehybrid": {"layer_types": ["mamba", "attention"]},
}


def build(name: str, layers: int = LAYERS, window: int = OWN_WINDOW, *, prefer_full: bool = False,
          overrides: dict[str, Any] | None = None) -> Built:
    """A tiny random model of row ``name`` (``llama``, ``bert@base`` …), float32, eval, seeded.

    ``layers`` decoder layers (:func:`pick_layers` chooses which of the default config's layers they are), the
    model's own sliding window (if it has one) ``window`` tokens, ``prefer_full``: a one-layer model of a
    local/global type is a global layer. ``overrides``: config fields set on top of the shrunk config (a head
    count per layer kind, a layer pattern …). Tries the config variants of :data:`ATTEMPTS`, each with SDPA and then eager attention; the first model that
    builds (at most :data:`MAX_PARAMETERS` parameters) and runs one forward wins. If none does,
    :class:`NotBuilt` with the most telling error (one that is not "no SDPA for this model").
    """
    model_type, base = parse_name(name)
    cls = _model_class(model_type, base)
    try:
        cfg0 = _config_for(model_type, cls)
    except Exception as exc:  # noqa: BLE001 - the type's own defaults are unusable
        raise NotBuilt(f"its default config fails: {short_error(exc)}") from None
    kind = "vision" if model_type in ("vit", "dinov2", "dinov2_with_registers") else ("text" if base else "causal")
    d = cfg0.to_dict()
    errors: list[str] = []
    tried: set[str] = set()
    extra = dict(overrides or {})
    for attempt, lists, subs in ATTEMPTS:
        overrides = shrink(d, layers, window, lists=lists, subs=subs, prefer_full=prefer_full)
        if model_type in HYBRID_PATTERNS and layers == 2:
            overrides.update(HYBRID_PATTERNS[model_type])
        if kind == "causal" and "is_decoder" in d:
            overrides["is_decoder"] = True  # an encoder family's LM head is causal only as a decoder
        overrides.update(extra)
        key = repr(sorted(overrides.items(), key=lambda kv: kv[0]))
        if key in tried:
            continue
        tried.add(key)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                config = type(cfg0)(**overrides)
        except Exception as exc:  # noqa: BLE001
            errors.append(f"config: {short_error(exc)}")
            continue
        try:
            size = parameter_count(cls, config)
        except Exception as exc:  # noqa: BLE001
            errors.append(f"model: {short_error(exc)}")
            continue
        if size > MAX_PARAMETERS:
            errors.append(f"still {size / 1e6:.1f} M parameters after shrinking (a size field it uses is not "
                          "recognised)")
            continue
        for attn in ("sdpa", "eager"):
            try:
                model = instantiate(cls, copy.deepcopy(config), attn)
                with torch.no_grad(), warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    model(**smoke_inputs(kind))
            except Exception as exc:  # noqa: BLE001
                errors.append(f"{attn} model: {short_error(exc)}")
                continue
            return Built(name, model_type, kind, model, attn, attempt, overrides)
    telling = [e for e in errors if "does not support an attention implementation" not in e]
    raise NotBuilt((telling or errors or ["no attempt built it"])[0])


def short_error(exc: BaseException, limit: int = 300) -> str:
    """``Type: message`` on one line, at most ``limit`` characters."""
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


# ----------------------------------------------------------------------------- hand-written tiny models
#: Vocabulary of the hand-written text models.
V = 97

_TEXT = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=128)

#: name → (config class, model class, config kwargs) of the hand-written text models.
TEXT_MODELS: dict[str, tuple[str, str, dict[str, Any]]] = {
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
                                   num_experts_per_tok=1, sliding_window=6,
                                   layer_types=["sliding_attention", "full_attention"])),
}

#: name → (config class, model class, config kwargs) of the hand-written vision models (16 × 16 images, patch 4).
VISION_MODELS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "vit": ("ViTConfig", "ViTModel", dict(image_size=16, patch_size=4, num_channels=3, hidden_size=32,
                                         intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)),
    "dinov2": ("Dinov2Config", "Dinov2Model", dict(image_size=16, patch_size=4, num_channels=3, hidden_size=32,
                                                 mlp_ratio=2, num_hidden_layers=2, num_attention_heads=4,
                                                 layerscale_value=0.5)),
    "dinov2-registers": ("Dinov2WithRegistersConfig", "Dinov2WithRegistersModel",
                         dict(image_size=16, patch_size=4, num_channels=3, hidden_size=32, mlp_ratio=2,
                              num_hidden_layers=2, num_attention_heads=4, num_register_tokens=4)),
}

#: The hand-written models with an LM head.
CAUSAL = {"llama-gqa", "qwen2", "qwen3", "mistral-sliding", "gemma", "phi3", "gpt-neox-partial-rotary", "gpt2", "opt",
          "gpt-oss-learned-sinks"}

#: Built with eager attention whatever is asked: transformers offers no SDPA path for learned sink logits.
EAGER_ONLY = {"gpt-oss-learned-sinks"}

#: Projection weights :func:`named_model` scales up, so that sinks and routed queries occur in random weights.
_SHARPENED = ("q_proj.weight", "k_proj.weight", "query.weight", "key.weight", "query_key_value.weight",
              "qkv_proj.weight", "c_attn.weight")


def named_model(name: str, attn: str = "sdpa", dtype: torch.dtype = torch.float32) -> nn.Module:
    """The hand-written tiny model ``name`` of :data:`TEXT_MODELS` / :data:`VISION_MODELS` (seed 1, eval,
    ``dtype``), its query and key projections scaled by 6 so that its attention is sharp enough to sink."""
    cfg_name, model_name, kwargs = {**TEXT_MODELS, **VISION_MODELS}[name]
    config = getattr(transformers, cfg_name)(**kwargs)
    _compat.set_config_attention(config, "eager" if name in EAGER_ONLY else attn)
    torch.manual_seed(1)
    model = getattr(transformers, model_name)(config).eval().to(dtype)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if any(k in pname for k in _SHARPENED):
                p.mul_(6.0)
    return model


def inputs_for(name: str, batch: int = 2, length: int = 12, pad: bool = True) -> dict[str, Tensor]:
    """Inputs of :func:`named_model` ``name``: pixels ``[B, 3, 16, 16]``, or token ids ``[B, T]`` with a mask
    whose second row is right-padded by 4 when ``pad``."""
    g = torch.Generator().manual_seed(2)
    if name in VISION_MODELS:
        return {"pixel_values": torch.randn(batch, 3, 16, 16, generator=g)}
    ids = torch.randint(2, V, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    if pad and batch > 1:
        mask[1, length - 4 :] = 0
    return {"input_ids": ids, "attention_mask": mask}


def tiny_vit(kind: str, image_size: int = 12) -> nn.Module:
    """A 2-layer, width-24 transformers ``ViTModel`` (no pooler) or ``Dinov2Model`` (LayerScale 0.5), patch 4."""
    torch.manual_seed(0)
    args: dict[str, Any] = {"hidden_size": 24, "num_hidden_layers": 2, "num_attention_heads": 3,
                            "intermediate_size": 48, "image_size": image_size, "patch_size": 4, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    if kind == "vit":
        return transformers.ViTModel(transformers.ViTConfig(**args), add_pooling_layer=False).eval()
    return transformers.Dinov2Model(transformers.Dinov2Config(**args, layerscale_value=0.5)).eval()


def tiny_llama(heads: int = 4, kv: int = 2, layers: int = 2) -> nn.Module:
    """A float64 ``LlamaForCausalLM`` of width 32 over :data:`V` tokens (seed 4, SDPA): the variant tests' model."""
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                   num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=64)
    _compat.set_config_attention(cfg, "sdpa")
    torch.manual_seed(4)
    return transformers.LlamaForCausalLM(cfg).double()
