"""Every touch of transformers internals and per-architecture layouts lives here.

The rest of sinklab talks to models through this module only: registering an attention function
(with its matching mask function), switching a model's attention implementation and back, finding the
stack of transformer blocks, and reading the query/key/output projection weights in the layouts the
supported architectures use (separate ``q_proj``/``k_proj``, fused ``qkv_proj`` (Phi-3), per-head
fused ``query_key_value`` (GPT-NeoX), ``Conv1D`` ``c_attn``/``c_proj`` (GPT-2), BERT/ViT ``query``/``key``
with the output dense in a sibling module, DINOv2's LayerScale).
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .errors import UnsupportedModelError

ATTN_IMPLEMENTATION = "sinklab_capture"

_Q_NAMES = ("q_proj", "query", "q", "wq")
_K_NAMES = ("k_proj", "key", "k", "wk")
_O_NAMES = ("o_proj", "out_proj", "c_proj", "dense", "wo")


@contextmanager
def quiet_loading():
    """Keep transformers' loading chatter (LOAD REPORT, weight-loading and shard-writing bars) off the terminal.

    Callers check the loading info themselves (see :func:`sinklab.checkpoint.strict_load_report`), so nothing
    that matters is lost. Verbosity and the progress-bar switch are restored on exit.
    """
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def register_attention(name: str, fn: Callable, mask: Callable | None = None) -> None:
    """Register ``fn`` as attention backend ``name`` with the boolean SDPA-style mask function.

    Registering the mask too matters: without it transformers hands the backend no mask at all.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, sdpa_mask if mask is None else mask)


def get_attn_implementation(model: nn.Module) -> str | None:
    """The attention backend ``model`` dispatches to (``"eager"``, ``"sdpa"``, a sinklab backend …)."""
    config = getattr(model, "config", None)
    return getattr(config, "_attn_implementation", None)


def set_config_attention(config: object, name: str) -> None:
    """Choose attention backend ``name`` on a config a model is about to be built from."""
    config._attn_implementation = name


def _set_attn_implementation(model: nn.Module, name: str) -> None:
    """Switch ``model`` (and its sub-models) to attention backend ``name``; raise if it cannot."""
    setter = getattr(model, "set_attn_implementation", None)
    if setter is None:
        raise UnsupportedModelError(
            f"{type(model).__name__} is not a transformers PreTrainedModel; sinklab needs one to capture attention."
        )
    try:
        setter(name)
    except (ValueError, KeyError, AttributeError) as exc:
        raise UnsupportedModelError(
            f"{type(model).__name__} refused attention implementation {name!r}: {exc}"
        ) from exc
    if get_attn_implementation(model) != name:
        raise UnsupportedModelError(
            f"{type(model).__name__} does not dispatch attention through transformers' AttentionInterface, "
            "so sinklab cannot observe it without copying its modeling code (which it never does)."
        )


_ACTIVE_PATCHES: weakref.WeakSet = weakref.WeakSet()


class ModelPatch:
    """Everything sinklab does to one model, owned in one place and undone exactly by :meth:`restore`.

    A patch can install an attention backend (:meth:`use_attention`), forward hooks (:meth:`hook`),
    attributes, parameters and submodules (:meth:`add`) and config fields (:meth:`set_config`). It is a
    context manager; code whose change outlives a ``with`` block (a variant, an open stream) keeps the patch
    and calls :meth:`restore` later. Restoring twice is harmless.

    transformers keeps the attention backend on the config object, and models built from the same config
    object share it. So the backend is never switched on the model's own config: every module of ``model``
    that holds a config gets a private copy for as long as the patch is active, the backend is set on the
    copy, and restoring puts the original objects back — a second model built from the same config is never
    affected, and the model's config comes back as the very same, unchanged object. Patches may be restored
    out of order (a stream released while a capture is active): a patch restored under another one hands its
    originals to the one above.

    Examples
    --------
    >>> with ModelPatch(model) as patch:                                # doctest: +SKIP
    ...     patch.use_attention("my_backend", my_attention)
    ...     patch.hook(model.model.layers[0], my_hook)
    ...     model(ids)
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._undo: list[tuple] = []  # ("hook", handle) | ("attr", module, name): data, so deepcopy maps it
        self._configs: list[list] = []  # [module, attribute, original, private copy]

    def __enter__(self) -> ModelPatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()

    # ------------------------------------------------------------------ changes
    def use_attention(self, name: str, fn: Callable, *, mask: Callable | None = None,
                      target: nn.Module | None = None) -> None:
        """Dispatch ``model``'s attention to ``fn`` (registered as backend ``name`` with the SDPA mask function).

        ``target`` is the sub-model whose ``set_attn_implementation`` is called (default: ``model``; a ViT
        backbone inside a classification wrapper). Raises :class:`UnsupportedModelError` (and changes nothing)
        when the model does not dispatch attention through transformers' ``AttentionInterface``.
        """
        register_attention(name, fn, mask)  # mask: the backend's own mask function (default: SDPA's boolean mask)
        self._private_configs()
        try:
            _set_attn_implementation(self.model if target is None else target, name)
        except BaseException:
            self.restore()
            raise

    def set_config(self, name: str, value: object, *, module: nn.Module | None = None) -> None:
        """Set field ``name`` on the (private, see the class docstring) config of ``module`` (default: the model)
        until restored."""
        self._private_configs()
        setattr((self.model if module is None else module).config, name, value)

    def hook(self, module: nn.Module, fn: Callable, *, pre: bool = False, **kwargs: object):
        """Register a forward (``pre``: pre-) hook on ``module``; removed on restore. Returns its handle."""
        register = module.register_forward_pre_hook if pre else module.register_forward_hook
        handle = register(fn, **kwargs)
        self._undo.append(("hook", handle))
        return handle

    def add(self, module: nn.Module, name: str, value: object) -> None:
        """Give ``module`` a submodule, parameter or plain attribute ``name`` (deleted on restore).

        A plain attribute set later by a hook (``module.name = …``) is declared with ``value=None``.
        """
        if isinstance(value, nn.Module):
            module.add_module(name, value)
        elif isinstance(value, nn.Parameter):
            module.register_parameter(name, value)
        else:
            setattr(module, name, value)
        self._undo.append(("attr", module, name))

    # ------------------------------------------------------------------ restore
    def restore(self) -> None:
        """Undo every change, newest first; the model's config objects come back."""
        while self._undo:
            kind, *what = self._undo.pop()
            if kind == "hook":
                what[0].remove()
            elif hasattr(what[0], what[1]):
                delattr(what[0], what[1])
        for module, attr, original, private in reversed(self._configs):
            if module.__dict__.get(attr) is private:
                module.__dict__[attr] = original
                continue
            for other in list(_ACTIVE_PATCHES):  # restored under another patch: hand it our original
                for entry in other._configs:
                    if entry[0] is module and entry[1] == attr and entry[2] is private:
                        entry[2] = original
        self._configs.clear()
        _ACTIVE_PATCHES.discard(self)

    def _private_configs(self) -> None:
        """Give every config-holding module of the model a private copy of its config (once per patch)."""
        if self._configs:
            return
        from transformers import PretrainedConfig

        found = [(module, attr, value) for module in self.model.modules() for attr, value in vars(module).items()
                 if isinstance(value, PretrainedConfig)]
        originals = list({id(v): v for _, _, v in found}.values())
        copies = dict(zip(map(id, originals), copy.deepcopy(originals)))  # one memo: shared sub-configs stay shared
        for module, attr, value in found:
            module.__dict__[attr] = copies[id(value)]
            self._configs.append([module, attr, value, copies[id(value)]])
        _ACTIVE_PATCHES.add(self)


def config_get(config: object, *names: str, default: object = None) -> object:
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


def find_layers(model: nn.Module) -> nn.ModuleList:
    """The ``nn.ModuleList`` of transformer blocks (``model.layers``, ``encoder.layer``, ``transformer.h`` …).

    Chosen as the shallowest ``ModuleList`` whose length equals the config's layer count.
    """
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


def _linear_weight(module: nn.Module) -> Tensor:
    """Weight as ``[out, in]`` for ``nn.Linear`` and transformers' ``Conv1D`` (stored ``[in, out]``)."""
    if isinstance(module, nn.Linear):
        return module.weight
    if type(module).__name__ == "Conv1D":
        return module.weight.t()
    weight = getattr(module, "weight", None)
    if isinstance(weight, Tensor) and weight.dim() == 2:
        return weight
    raise UnsupportedModelError(f"cannot read a projection weight from {type(module).__name__}")


def _child(module: nn.Module, names: tuple[str, ...]) -> nn.Module | None:
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
    q_mod, k_mod = _child(attn, _Q_NAMES), _child(attn, _K_NAMES)
    if q_mod is not None and k_mod is not None:
        wq = _linear_weight(q_mod)[: n_heads * head_dim]
        wk = _linear_weight(k_mod)[: n_kv * head_dim]
        return wq.reshape(n_heads, head_dim, -1), wk.reshape(n_kv, head_dim, -1)
    if isinstance(getattr(attn, "qkv_proj", None), nn.Module):  # Phi-3: [q | k | v] rows
        w = _linear_weight(attn.qkv_proj)
        wq = w[: n_heads * head_dim]
        wk = w[n_heads * head_dim : (n_heads + n_kv) * head_dim]
        return wq.reshape(n_heads, head_dim, -1), wk.reshape(n_kv, head_dim, -1)
    if isinstance(getattr(attn, "query_key_value", None), nn.Module):  # GPT-NeoX: per head [q | k | v]
        w = _linear_weight(attn.query_key_value).reshape(n_heads, 3 * head_dim, -1)
        return w[:, :head_dim], w[:, head_dim : 2 * head_dim]
    if isinstance(getattr(attn, "c_attn", None), nn.Module):  # GPT-2: [q | k | v] columns of Conv1D
        w = _linear_weight(attn.c_attn)
        width = n_heads * head_dim
        return w[:width].reshape(n_heads, head_dim, -1), w[width : 2 * width].reshape(n_heads, head_dim, -1)
    return None


def _output_weight(layer: nn.Module, attn: nn.Module) -> Tensor | None:
    """``[d, H·dh]`` output projection of ``attn``: on the module, or in an enclosing ``output.dense``."""
    for module in _ancestors(layer, attn):
        direct = _child(module, _O_NAMES)
        if direct is not None and module is attn:
            return _linear_weight(direct)
        output = getattr(module, "output", None)
        if isinstance(output, nn.Module) and isinstance(getattr(output, "dense", None), nn.Module):
            return _linear_weight(output.dense)
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
_ABSOLUTE_POSITION_TYPES = {"gpt2", "opt", "bert", "roberta", "gpt_neo", "bart", "xglm", "biogpt", "vit", "dinov2"}
_ALIBI_TYPES = {"bloom", "mpt", "falcon"}


def rope_spec(model: nn.Module):
    """The model's rotary embedding as a :class:`sinklab.rope.RopeSpec`, or an explanatory error.

    Reads the public ``inv_freq``/``attention_scaling`` of the model's rotary-embedding module (Llama,
    Qwen2/3, Mistral, Gemma, Phi-3, GPT-NeoX with partial rotary, gpt-oss …) or, for GPT-J's interleaved
    sinusoid table, rebuilds the frequencies from ``config.rotary_dim``.
    """
    from .rope import RopeSpec

    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", "")
    name = type(model).__name__
    if model_type in _ALIBI_TYPES and getattr(config, "alibi", model_type != "falcon"):
        raise UnsupportedModelError(
            f"{name} uses ALiBi position biases; sinklab's streaming re-positions RoPE keys by cache slot and does "
            "not yet re-bias ALiBi scores. Use a RoPE model (Llama, Qwen, Mistral, Phi-3, Gemma, GPT-NeoX, GPT-J)."
        )
    if model_type in ("gptj", "codegen"):
        dim = int(config.rotary_dim or config.n_embd // config.n_head)
        inv = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        return RopeSpec(inv_freq=inv, interleaved=True, attention_scaling=1.0)
    found = []
    for module in model.modules():
        inv = getattr(module, "inv_freq", None)
        if isinstance(inv, Tensor) and inv.dim() == 1:
            found.append(module)
    if not found:
        why = ("learned absolute position embeddings" if model_type in _ABSOLUTE_POSITION_TYPES
               else "no rotary position embedding sinklab can find")
        raise UnsupportedModelError(
            f"{name} ({model_type or 'unknown type'}) has {why}: positions by cache slot need RoPE, whose scores depend "
            "only on distances, so evicted tokens can be skipped. A model with absolute position embeddings would see "
            "its sinks and window at positions it was trained to read differently, so it cannot stream this way."
        )
    freqs = {tuple(m.inv_freq.tolist()) for m in found}
    if len(freqs) > 1:
        raise UnsupportedModelError(
            f"{name} uses several rotary embeddings (e.g. local and global layers); streaming supports one."
        )
    rope_type = getattr(found[0], "rope_type", "default")
    if rope_type == "dynamic":
        raise UnsupportedModelError(f"{name} uses dynamic NTK RoPE, whose frequencies change with sequence length; "
                                    "streaming needs fixed frequencies.")
    module = found[0]
    return RopeSpec(inv_freq=module.inv_freq.detach().double().cpu(), interleaved=False,
                    attention_scaling=float(getattr(module, "attention_scaling", 1.0)))


def layer_rope_specs(model: nn.Module) -> list:
    """One :class:`sinklab.rope.RopeSpec` per decoder layer (identical layers share one object).

    Models with one rotary embedding get :func:`rope_spec` for every layer. Models whose rotary module holds
    one set of frequencies per layer type (Gemma 3: ``sliding_attention_inv_freq`` (local base) and
    ``full_attention_inv_freq`` (global base)) get each layer the frequencies of its ``config.layer_types`` entry.
    """
    from .rope import RopeSpec

    config = getattr(model, "config", None)
    n = num_layers(config) or 0
    types = config_get(config, "layer_types")
    if types:
        for module in model.modules():
            per_type = {t: getattr(module, f"{t}_inv_freq", None) for t in set(types)}
            if all(isinstance(v, Tensor) and v.dim() == 1 for v in per_type.values()):
                rope_type = getattr(module, "rope_type", {})
                if any((rope_type.get(t) if isinstance(rope_type, dict) else rope_type) == "dynamic" for t in per_type):
                    raise UnsupportedModelError(f"{type(model).__name__} uses dynamic NTK RoPE, whose frequencies "
                                                "change with sequence length; streaming needs fixed frequencies.")
                specs = {t: RopeSpec(inv_freq=v.detach().double().cpu(), interleaved=False,
                                     attention_scaling=float(getattr(module, f"{t}_attention_scaling", 1.0)))
                         for t, v in per_type.items()}
                return [specs[t] for t in types]
    spec = rope_spec(model)
    return [spec] * n


def layer_sliding_windows(model: nn.Module) -> list[int | None]:
    """Each decoder layer's own attention window (keys a query sees, itself included), ``None`` for full attention.

    Read from the config the way transformers' models build their masks: ``layer_types`` (``sliding_attention``
    layers use ``sliding_window``; gpt-oss, Gemma 2/3, Qwen2 …), else one ``sliding_window`` for every layer
    (Mistral, Phi-3). Other layer types (chunked, linear attention) cannot stream.
    """
    config = getattr(model, "config", None)
    n = num_layers(config) or 0
    window = config_get(config, "sliding_window")
    types = config_get(config, "layer_types")
    if config_get(config, "use_bidirectional_attention"):
        raise UnsupportedModelError(f"{type(model).__name__} uses bidirectional attention; streaming needs a causal LM.")
    if types:
        out: list[int | None] = []
        for i, kind in enumerate(types):
            if kind == "full_attention":
                out.append(None)
            elif kind == "sliding_attention" and window is not None:
                out.append(int(window))
            else:
                raise UnsupportedModelError(f"{type(model).__name__}: layer {i} has attention type {kind!r}; sinklab "
                                            "streams full and sliding-window attention layers only.")
        return out
    return [int(window) if window is not None else None] * n


def base_model(model: nn.Module) -> nn.Module:
    """The decoder stack that takes ``position_ids`` (``model.model``, ``gpt_neox``, ``transformer`` …)."""
    return getattr(model, "base_model", model)


def cache_kwarg_name(model: nn.Module) -> str:
    """``cache`` on transformers versions that renamed it, else ``past_key_values``."""
    import inspect

    params = inspect.signature(base_model(model).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def output_cache(output: object) -> object:
    """The cache a forward returned: ``cache`` on transformers ≥ 5.2, ``past_key_values`` on older releases."""
    return output["cache"] if "cache" in output else output.past_key_values  # noqa: SIM401 (lazy)


def cache_argument(kwargs: dict) -> tuple[str | None, object]:
    """The cache a forward call received, under transformers' new (``cache``) or old (``past_key_values``) name."""
    for key in ("cache", "past_key_values"):
        if kwargs.get(key) is not None:
            return key, kwargs[key]
    return None, None


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
