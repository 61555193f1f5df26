"""Per-architecture layouts: the config fields under their many names, the stack of transformer blocks, the
query/key/output projection weights in the layouts the supported architectures use (separate ``q_proj``/``k_proj``,
fused ``qkv_proj`` (Phi-3), per-head fused ``query_key_value`` (GPT-NeoX), ``Conv1D`` ``c_attn``/``c_proj``
(GPT-2), BERT/ViT ``query``/``key`` with the output dense in a sibling module, DINOv2's LayerScale), the
sliding-window specs, the architecture tables, and where the cache argument goes."""

from __future__ import annotations

import functools
import inspect
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import UnsupportedModelError

_Q_NAMES = ("q_proj", "query", "q", "wq")
_K_NAMES = ("k_proj", "key", "k", "wk")
O_NAMES = _O_NAMES = ("o_proj", "out_proj", "c_proj", "dense", "wo")  # attention output projections


def config_get(config: object, *names: str, default: Any = None) -> Any:
    """First attribute of ``config`` (or its ``text_config``) among ``names`` that is set."""
    for cfg in (config, getattr(config, "text_config", None), getattr(config, "get_text_config", lambda: None)()):
        if cfg is None:
            continue
        for name in names:
            value = getattr(cfg, name, None)
            if value is not None:
                return value
    return default


def num_layers(config: object) -> int | None:
    value = config_get(config, "num_hidden_layers", "n_layer", "num_layers")
    return int(value) if value is not None else None


def vision_language(model: nn.Module) -> bool:
    """Whether ``model`` is a vision-language model: a config with a ``vision_config`` and a text decoder of its own
    (``get_decoder()``: Llava, Qwen2-VL, Gemma 3, Idefics3/SmolVLM, PaliGemma …)."""
    config = getattr(model, "config", None)
    if getattr(config, "vision_config", None) is None:
        return False
    get_decoder = getattr(model, "get_decoder", None)
    try:
        decoder = get_decoder() if callable(get_decoder) else None
    except (AttributeError, NotImplementedError, TypeError):
        return False
    return isinstance(decoder, nn.Module) and decoder is not model


def language_model(model: nn.Module) -> nn.Module:
    """The text decoder of a vision-language model (:func:`vision_language`), else ``model`` itself: the part whose
    attention sinklab captures (the vision tower keeps its own attention)."""
    return model.get_decoder() if vision_language(model) else model  # type: ignore[operator]


def find_layers(model: nn.Module) -> nn.ModuleList:
    """The ``nn.ModuleList`` of transformer blocks (``model.layers``, ``encoder.layer``, ``transformer.h`` …).

    Chosen as the shallowest ``ModuleList`` whose length equals the config's layer count; in a vision-language
    model, the text decoder's (:func:`language_model`), never the vision tower's.
    """
    if vision_language(model):
        model = language_model(model)
    n = num_layers(getattr(model, "config", None))
    candidates = []
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0 and (n is None or len(module) == n):
            candidates.append((name.count("."), name, module))
    if not candidates:
        raise UnsupportedModelError(
            f"{type(model).__name__}: found no list of {n} transformer blocks; sinklab supports transformers "
            "models whose blocks live in one nn.ModuleList (Llama, Qwen, Mistral, Gemma, Phi-3, GPT-NeoX, "
            "GPT-2, OPT, BERT, ViT, DINOv2, gpt-oss …)."
        )
    candidates.sort(key=lambda c: (c[0], c[1]))
    return candidates[0][2]


def block_hidden_states(output: object) -> Tensor:
    """The hidden-state tensor in a block's forward output (a tensor or a tuple led by one)."""
    if isinstance(output, Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], Tensor):
        return output[0]
    for name in ("hidden_states", "last_hidden_state"):
        hidden = getattr(output, name, None)
        if isinstance(hidden, Tensor):
            return hidden
    raise UnsupportedModelError(f"cannot find hidden states in a block output of type {type(output).__name__}")


def block_input(args: tuple, kwargs: dict) -> Tensor:
    """The hidden-state tensor a block receives (positional or ``hidden_states=``)."""
    if args and isinstance(args[0], Tensor):
        return args[0]
    hidden = kwargs.get("hidden_states")
    if isinstance(hidden, Tensor):
        return hidden
    raise UnsupportedModelError("cannot find the hidden-states input of a transformer block")


def stacked_streams(model: nn.Module) -> tuple[int, int] | None:
    """``(copies, main)`` when ``model``'s blocks pass ``copies`` stacked copies of the hidden state
    ``[copies, B, T, d]`` instead of one ``[B, T, d]`` (Gemma 3n's AltUp, alternating updates), else None.

    Each AltUp block predicts every copy from all of them, runs its attention and MLP on copy ``main``
    (``altup_active_idx``) only and corrects the other copies from that result; the final hidden state mixes
    all copies. Copy ``main`` is the one the model treats as its residual stream.
    """
    copies = config_get(getattr(model, "config", None), "altup_num_inputs")
    if not isinstance(copies, int) or isinstance(copies, bool) or copies < 2:
        return None
    main = config_get(getattr(model, "config", None), "altup_active_idx", default=0)
    return copies, int(main)


def residual_stream(model: nn.Module, hidden: Tensor) -> Tensor:
    """The ``[B, T, d]`` residual stream in a block's input or output ``hidden``: the main copy of stacked copies
    (:func:`stacked_streams`), else ``hidden`` itself."""
    spec = stacked_streams(model)
    if spec is not None and hidden.dim() == 4 and hidden.shape[0] == spec[0]:
        return hidden[spec[1]]
    return hidden


def resume_blocker(model: nn.Module, calls: list[tuple[tuple, dict]]) -> str | None:
    """Why a pass cannot restart at a block from the arguments every block received in one forward (``calls``),
    or None when it can.

    It cannot when the blocks pass stacked copies of the hidden state (:func:`stacked_streams`: the copies are
    not one batch-leading tensor, and the final state mixes them), nor when a block writes state that a later
    block reads (a filled ``shared_kv_states``: Gemma 3n/4 layers that reuse an earlier layer's keys and
    values) — a rerun would read the state of whichever pass wrote it last.
    """
    spec = stacked_streams(model)
    if spec is not None:
        return f"its blocks pass {spec[0]} stacked copies of the hidden state (AltUp)"
    for _, kwargs in calls:
        shared = kwargs.get("shared_kv_states")
        if shared is not None and hasattr(shared, "__len__") and len(shared) > 0:
            return "later layers reuse the keys and values an earlier layer stored (shared_kv_states)"
    return None


def _linear_weight(module: nn.Module) -> Tensor:
    """Weight as ``[out, in]`` for ``nn.Linear`` and transformers' ``Conv1D`` (stored ``[in, out]``)."""
    if isinstance(module, nn.Linear):
        return module.weight
    if type(module).__name__ == "Conv1D":
        return module.weight.t()  # type: ignore[operator]  # Conv1D.weight is a tensor
    weight = getattr(module, "weight", None)
    if isinstance(weight, Tensor) and weight.dim() == 2:
        return weight
    raise UnsupportedModelError(f"cannot read a projection weight from {type(module).__name__}: sinklab reads "
                                "per-head weights from nn.Linear, transformers' Conv1D or a module with a 2-D "
                                "`weight`; a projection of another kind needs a reader in sinklab._compat.layout")


def child_module(module: nn.Module, names: tuple[str, ...]) -> nn.Module | None:
    """The first of ``module``'s attributes named in ``names`` that is an ``nn.Module`` (None if none is)."""
    for name in names:
        sub = getattr(module, name, None)
        if isinstance(sub, nn.Module):
            return sub
    return None


def _ancestors(layer: nn.Module, target: nn.Module) -> list[nn.Module]:
    """Modules from ``target`` up to ``layer`` (inclusive), innermost first."""
    parent: dict[int, nn.Module] = {}
    for module in layer.modules():
        for child in module.children():
            parent.setdefault(id(child), module)
    chain = [target]
    while id(chain[-1]) in parent and chain[-1] is not layer:
        chain.append(parent[id(chain[-1])])
    return chain


@dataclass(frozen=True)
class HeadWeights:
    """Projection weights of one layer's attention, split by head (all ``float64``).

    ``wq`` ``[H, dh, d]``, ``wk`` ``[Hkv, dh, d]``, ``wo`` ``[H, d, dh]`` (``u_j = wo[h] @ v_j``, with
    LayerScale folded in), or ``None`` where the layout is not recognised.
    """

    wq: Tensor | None
    wk: Tensor | None
    wo: Tensor | None


def _split_qk(attn: nn.Module, n_heads: int, n_kv: int, head_dim: int) -> tuple[Tensor, Tensor] | None:
    q_mod, k_mod = child_module(attn, _Q_NAMES), child_module(attn, _K_NAMES)
    if q_mod is not None and k_mod is not None:
        wq = _linear_weight(q_mod)[: n_heads * head_dim]
        wk = _linear_weight(k_mod)[: n_kv * head_dim]
        return wq.reshape(n_heads, head_dim, -1), wk.reshape(n_kv, head_dim, -1)
    if isinstance(qkv := getattr(attn, "qkv_proj", None), nn.Module):  # Phi-3: [q | k | v] rows
        w = _linear_weight(qkv)
        wq = w[: n_heads * head_dim]
        wk = w[n_heads * head_dim : (n_heads + n_kv) * head_dim]
        return wq.reshape(n_heads, head_dim, -1), wk.reshape(n_kv, head_dim, -1)
    if isinstance(qkv := getattr(attn, "query_key_value", None), nn.Module):  # GPT-NeoX: per head [q | k | v]
        w = _linear_weight(qkv).reshape(n_heads, 3 * head_dim, -1)
        return w[:, :head_dim], w[:, head_dim : 2 * head_dim]
    if isinstance(qkv := getattr(attn, "c_attn", None), nn.Module):  # GPT-2: [q | k | v] columns of Conv1D
        w = _linear_weight(qkv)
        width = n_heads * head_dim
        return w[:width].reshape(n_heads, head_dim, -1), w[width : 2 * width].reshape(n_heads, head_dim, -1)
    return None


def _output_weight(layer: nn.Module, attn: nn.Module) -> Tensor | None:
    """``[d, H·dh]`` output projection of ``attn``: on the module, or in an enclosing ``output.dense``."""
    for module in _ancestors(layer, attn):
        direct = child_module(module, _O_NAMES)
        if direct is not None and module is attn:
            return _linear_weight(direct)
        output = getattr(module, "output", None)
        if isinstance(output, nn.Module) and isinstance(dense := getattr(output, "dense", None), nn.Module):
            return _linear_weight(dense)
    return None


def _layer_scale(layer: nn.Module) -> Tensor | None:
    """DINOv2-style LayerScale γ applied to the attention branch, if the block has one."""
    scale = getattr(layer, "layer_scale1", None)
    if scale is None:
        return None
    for name in ("lambda1", "gamma", "weight"):
        value = getattr(scale, name, None)
        if isinstance(value, Tensor):
            return value
    return None


@torch.no_grad()
def head_weights(layer: nn.Module, attn: nn.Module, n_heads: int, n_kv: int, head_dim: int) -> HeadWeights:
    """Read ``attn``'s projections split per head; unknown layouts give ``None`` fields.

    Weights that accelerate offloaded (``device_map`` with CPU/disk offload) are loaded for the read and
    released again; the returned float64 CPU copies do not depend on them.
    """
    with offloaded_weights(layer):
        qk = _split_qk(attn, n_heads, n_kv, head_dim)
        if qk is not None and any(w.device.type == "meta" for w in qk):  # offloaded by an outer block
            qk = None
        wq, wk = (None, None) if qk is None else (qk[0].double().cpu(), qk[1].double().cpu())
        wo = _output_weight(layer, attn)
        if wo is not None and wo.device.type == "meta":
            wo = None
        if wo is not None and wo.shape[1] == n_heads * head_dim:
            wo = wo.double().cpu()
            gamma = _layer_scale(layer)
            if gamma is not None:
                wo = gamma.double().cpu()[:, None] * wo
            wo = wo.reshape(wo.shape[0], n_heads, head_dim).permute(1, 0, 2).contiguous()  # (H, d, dh)
        else:
            wo = None
    return HeadWeights(wq=wq, wk=wk, wo=wo)


def embedding_rows(model: nn.Module) -> int | None:
    """Number of rows of the input token embedding (None for models without one, e.g. ViT)."""
    getter = getattr(model, "get_input_embeddings", None)
    if getter is None:
        return None
    try:
        emb = getter()
    except (NotImplementedError, AttributeError):
        return None
    weight = getattr(emb, "weight", None)
    if isinstance(emb, nn.Embedding) or isinstance(weight, Tensor):
        return int(weight.shape[0]) if weight is not None else None
    return None


def input_device(model: nn.Module) -> torch.device:
    """Device the inputs must live on (the input embedding's, under ``device_map`` dispatch too)."""
    getter = getattr(model, "get_input_embeddings", None)
    try:
        emb = getter() if getter is not None else None
    except (NotImplementedError, AttributeError):
        emb = None
    weight = getattr(emb, "weight", None)
    if isinstance(weight, Tensor):
        return weight.device
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


# ----------------------------------------------------------------------------- architecture tables
#: transformers model types whose blocks have Llama-style ``self_attn.{q,k,v,o}_proj`` (sinklab.variants).
LLAMA_STYLE_TYPES = {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "olmo", "olmo2", "smollm3",
                     "granite", "cohere", "starcoder2", "helium", "glm"}
#: model types the ViT variants support (sinklab.vit).
VIT_TYPES = {"vit", "dinov2", "sinklab-vit"}
#: bidirectional encoders: every position attends to every other (no causal first-token circuit).
ENCODER_TYPES = {"bert", "roberta", "distilbert", "albert", "electra", "deberta", "deberta-v2", "xlm-roberta",
                 "mpnet", "camembert", "vit", "dinov2", "dinov2_with_registers", "modernbert"}


#: ``layer_types`` names of layers that are not attention but keep a recurrent / state-space / convolution state
#: (hybrid models: Qwen3-Next, Qwen3.5, Kimi Linear, OLMo hybrid, Bailing hybrid, Jamba, Bamba, Granite MoE hybrid,
#: Nemotron-H, LFM2 …), and of layers without any token mixing (Nemotron-H's ``mlp``/``moe`` blocks). They have no
#: window; whether the stream can keep them is decided by :func:`sinklab._compat.layer_rotations` (the model's own
#: cache must hold them as linear-attention layers, or hold nothing for them: :func:`cache_layer_kind`).
RECURRENT_LAYER_TYPES = frozenset({"linear_attention", "conv", "mamba", "mamba2", "recurrent", "rwkv", "deltanet",
                                   "gated_deltanet", "moe_linear_attention", "lightning_attention"})
FEEDFORWARD_LAYER_TYPES = frozenset({"mlp", "moe"})

#: Why a layer type cannot stream yet, and what would lift it (the refusal a user reads).
_WHY_NOT_STREAMED = {
    "chunked_attention": "chunked attention (Llama 4) lets a token see only the tokens of its own chunk; sinks + a "
                         "sliding window would change what each token sees. sinklab does not stream it yet: "
                         "it needs a per-layer chunk rule in the stream's visibility.",
    "hybrid": "this layer runs attention and a recurrent (state-space) mixer side by side and the model's cache keeps "
              "both in one cache layer (Falcon-H1, Zamba2). sinklab streams attention layers (sinks + window) beside "
              "separate linear-attention layers, whose state it keeps in transformers' own LinearAttentionLayer; "
              "lifting it needs one stream layer that carries the sinks + window and the recurrent state together.",
    None: "sinklab streams full and sliding-window softmax-attention layers, and linear-attention / recurrent / "
          "convolution layers kept whole beside them; a layer of another kind needs its own rule in the stream, "
          "which sinklab does not have yet.",
}
_WHY_NOT_STREAMED["hybrid_sliding"] = _WHY_NOT_STREAMED["hybrid"]


def layer_sliding_windows(model: nn.Module) -> list[int | None]:
    """Each decoder layer's own attention window (keys a query sees, itself included), ``None`` for full attention
    and for the layers of a hybrid model that are not attention (:data:`RECURRENT_LAYER_TYPES`,
    :data:`FEEDFORWARD_LAYER_TYPES`: no window, whatever state they have is kept whole).

    Read from the config the way transformers' models build their masks: ``layer_types`` (``sliding_attention``
    layers use ``sliding_window``; gpt-oss, Gemma 2/3, Qwen2 …), else one ``sliding_window`` for every layer
    (Mistral, Phi-3). Other layer types (chunked attention, attention and a recurrent mixer in one layer) cannot
    stream.
    """
    config = getattr(model, "config", None)
    n = num_layers(config) or 0
    window = config_get(config, "sliding_window")
    types = config_get(config, "layer_types")
    if config_get(config, "use_bidirectional_attention"):
        raise UnsupportedModelError(f"{type(model).__name__} uses bidirectional attention; streaming needs a causal LM.")
    if config_get(config, "attention_chunk_size") and "chunked_attention" not in (types or ()):
        raise UnsupportedModelError(f"{type(model).__name__} uses chunked attention (attention_chunk_size); "
                                    + _WHY_NOT_STREAMED["chunked_attention"])
    if types:
        out: list[int | None] = []
        for i, kind in enumerate(types):
            if kind == "full_attention" or kind in RECURRENT_LAYER_TYPES or kind in FEEDFORWARD_LAYER_TYPES:
                out.append(None)
            elif kind == "sliding_attention" and window is not None:
                out.append(int(window))
            else:
                raise UnsupportedModelError(f"{type(model).__name__}: layer {i} has attention type {kind!r}; "
                                            + _WHY_NOT_STREAMED.get(kind, _WHY_NOT_STREAMED[None]))
        return out
    return [int(window) if window is not None else None] * n


def model_cache_layers(model: nn.Module) -> list:
    """Fresh (empty) layers of the model's own cache: ``DynamicCache(config=model.config).layers`` — what its forward
    builds when it is given no cache — one per decoder layer (``[]`` where transformers builds its layers lazily)."""
    from transformers import DynamicCache

    return list(getattr(DynamicCache(config=model.config), "layers", []))  # type: ignore[arg-type]


def cache_layer_kind(layer: object) -> str:
    """What one layer of a transformers cache holds:

    * ``"recurrent"`` — a linear-attention cache layer (transformers' ``LinearAttentionCacheLayerMixin`` and not also a
      key/value layer: ``LinearAttentionLayer``, for ``layer_types`` ``linear_attention`` and ``conv``): a layer's
      fixed-size convolution and recurrent states, which the model reads and writes through ``Cache.get_conv_state``
      / ``update_conv_state`` / ``get_recurrent_state`` / ``update_recurrent_state`` / ``has_previous_state``;
    * ``"stateless"`` — transformers' ``DummyLayer``: nothing (``mlp``/``moe`` blocks without token mixing, or a
      layer reading another layer's keys — told apart by whether it calls attention);
    * ``"keys"`` — anything else (keys and values, or a layer sinklab does not know).
    """
    try:
        from transformers.cache_utils import CacheLayerMixin, DummyLayer, LinearAttentionCacheLayerMixin
    except ImportError:  # pragma: no cover - transformers before linear-attention cache layers
        return "keys"
    if isinstance(layer, LinearAttentionCacheLayerMixin) and not isinstance(layer, CacheLayerMixin):
        return "recurrent"
    if isinstance(layer, DummyLayer):
        return "stateless"
    return "keys"


def cache_layer_kinds(model: nn.Module, n: int) -> list[str]:
    """:func:`cache_layer_kind` of each of the model's ``n`` decoder layers, from a fresh cache of its own (``keys``
    for every layer where transformers builds its cache layers lazily or builds another number of them)."""
    cache = model_cache_layers(model)
    return [cache_layer_kind(layer) for layer in cache] if len(cache) == n else ["keys"] * n


def base_model(model: nn.Module) -> nn.Module:
    """The decoder stack that takes ``position_ids`` (``model.model``, ``gpt_neox``, ``transformer`` …).

    transformers' ``base_model`` reads the attribute named by ``base_model_prefix``; where no attribute has that
    name (``Llama4ForCausalLM``/``MllamaForCausalLM``: prefix ``language_model``, stack under ``model``) it is the
    head model itself, whose output holds logits, not hidden states. Then, for a model with an output head, the
    one child that is a ``PreTrainedModel`` is the stack (a base model such as DINOv2, whose encoder is one too,
    stays itself).
    """
    base = getattr(model, "base_model", model)
    get_head = getattr(model, "get_output_embeddings", None)
    if base is model and callable(get_head) and get_head() is not None:
        from transformers import PreTrainedModel

        stacks = [child for child in model.children() if isinstance(child, PreTrainedModel)]
        if len(stacks) == 1:
            return stacks[0]
    return base


@functools.cache
def _forward_parameters(forward: Any) -> frozenset[str]:
    """The parameter names of a module class's ``forward`` (read once per class)."""
    return frozenset(inspect.signature(forward).parameters)


def cache_kwarg_name(model: nn.Module) -> str:
    """``cache`` on transformers versions that renamed it, else ``past_key_values``."""
    return "cache" if "cache" in _forward_parameters(type(base_model(model)).forward) else "past_key_values"


def output_cache(output: Any) -> Any:
    """The cache a forward returned: ``cache`` on transformers ≥ 5.24, ``past_key_values`` on older releases."""
    return output["cache"] if "cache" in output else output.past_key_values  # noqa: SIM401 (lazy)


def recurrent_state_bytes(model: nn.Module, input_ids: Tensor) -> dict[int, int]:
    """Bytes of state each recurrent layer keeps per sequence (conv + recurrent state; the same at any length), read
    off the model's own cache after one forward of the first token of ``input_ids``: ``{layer: bytes}``."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)  # type: ignore[arg-type]  # a PreTrainedConfig
    try:
        with torch.no_grad():
            base_model(model)(input_ids=input_ids[:1, :1], use_cache=True, **{cache_kwarg_name(model): cache})
    except Exception:  # noqa: BLE001 - a model with a cache class of its own (MiniMax): the size is not known
        return {}
    def size(value: object) -> int:  # tensors held directly or in dicts / lists (per-state dicts), not counters
        if isinstance(value, Tensor):
            return value.numel() * value.element_size() if value.dim() > 0 else 0
        if isinstance(value, dict):
            return sum(size(v) for v in value.values())
        if isinstance(value, (list, tuple)):
            return sum(size(v) for v in value)
        return 0

    return {i: size(vars(layer)) for i, layer in enumerate(getattr(cache, "layers", []))
            if cache_layer_kind(layer) == "recurrent"}


def cache_argument(kwargs: dict) -> tuple[str | None, Any]:
    """The cache a forward call received, under transformers' new (``cache``) or old (``past_key_values``) name."""
    for key in ("cache", "past_key_values"):
        if kwargs.get(key) is not None:
            return key, kwargs[key]
    return None, None


def route_cache_argument(module: nn.Module, kwargs: dict) -> None:
    """Hand the cache in ``kwargs`` to ``module``'s forward under the name that forward reads.

    A causal LM's head passes the caller's ``past_key_values=`` down to its decoder stack through ``**kwargs``;
    a stack that takes only the new name (``cache``) would ignore it and build a cache of its own, and the other way
    round. Renamed in place when the forward names one of the two and not the other; untouched otherwise.
    """
    key, cache = cache_argument(kwargs)
    if key is None:
        return
    other = "cache" if key == "past_key_values" else "past_key_values"
    names = _forward_parameters(type(module).forward)
    if key not in names and other in names:
        kwargs[other] = kwargs.pop(key)


@contextmanager
def offloaded_weights(module: nn.Module):
    """Make the parameters of ``module`` readable when accelerate's big-model dispatch offloaded them.

    A model loaded with ``device_map`` (GPU/CPU/disk offload) keeps offloaded parameters on the ``meta``
    device and loads them in a forward pre-hook. Reading weights outside a forward (weight statistics,
    the NaN check) goes through this context manager, which loads them the same way for ``module`` and
    its submodules only — one layer at a time, never the whole model — and releases them afterwards.
    A model without offloaded parameters passes through untouched.
    """
    try:
        from accelerate.utils import align_module_device, has_offloaded_params
    except ImportError:  # pragma: no cover - accelerate is a dependency
        yield module
        return
    with ExitStack() as stack:
        for sub in module.modules():
            if has_offloaded_params(sub):
                stack.enter_context(align_module_device(sub))
        yield module


def named_weights(model: nn.Module):
    """Yield ``(name, parameter)`` for every parameter, loading accelerate-offloaded blocks one at a time.

    Equivalent to ``model.named_parameters()`` on an ordinary model; on a model dispatched with offload,
    each offloaded block is loaded (as its forward would) while its parameters are yielded.
    """
    try:
        from accelerate.utils import align_module_device, has_offloaded_params
    except ImportError:  # pragma: no cover - accelerate is a dependency
        yield from model.named_parameters()
        return

    def walk(prefix: str, module: nn.Module):
        if has_offloaded_params(module):
            with align_module_device(module):
                for name, param in module.named_parameters():
                    yield prefix + name, param
            return
        for name, param in module.named_parameters(recurse=False):
            yield prefix + name, param
        for name, child in module.named_children():
            yield from walk(f"{prefix}{name}.", child)

    yield from walk("", model)
