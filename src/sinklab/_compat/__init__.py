"""Every touch of transformers internals and per-architecture layouts lives in this package.

The rest of sinklab talks to models through ``sinklab._compat`` only (imported by name; its names are public):

* :mod:`.backend` — registering an attention function with its matching mask function, switching a model's
  attention implementation and back (:class:`ModelPatch`), transformers' loading chatter and version;
* :mod:`.layout` — the config fields under their names, the stack of transformer blocks, the query/key/output
  projection weights in each supported layout, sliding-window specs, the architecture tables and the
  cache argument's name;
* :mod:`.rotary` — how each layer encodes positions in its keys and queries, measured on the model
  (:func:`layer_rotations`): what the stream re-rotates, and what it refuses;
* :mod:`.support` — architecture features the capture or the stream cannot reproduce (hyper-connections,
  compressed or indexer-picked keys, position biases, convolution state …), refused up front with what would
  lift the refusal (:func:`check_capture`, :func:`check_stream`).
"""

from __future__ import annotations

from .backend import (
    ATTN_IMPLEMENTATION,
    quiet_loading,
    transformers_version,
    register_attention,
    explicit_mask,
    get_attn_implementation,
    set_config_attention,
    ModelPatch,
)
from .layout import (
    config_get,
    num_layers,
    find_layers,
    vision_language,
    language_model,
    child_module,
    O_NAMES,
    block_hidden_states,
    block_input,
    stacked_streams,
    residual_stream,
    resume_blocker,
    HeadWeights,
    head_weights,
    embedding_rows,
    input_device,
    LLAMA_STYLE_TYPES,
    VIT_TYPES,
    ENCODER_TYPES,
    layer_sliding_windows,
    RECURRENT_LAYER_TYPES,
    FEEDFORWARD_LAYER_TYPES,
    model_cache_layers,
    cache_layer_kind,
    cache_layer_kinds,
    recurrent_state_bytes,
    base_model,
    cache_kwarg_name,
    output_cache,
    cache_argument,
    route_cache_argument,
    offloaded_weights,
    named_weights,
)
from .rotary import RECURRENT, STATELESS, LayerRotation, layer_rotations
from .support import check_capture, check_stream, unsupported_features

__all__ = [
    "ATTN_IMPLEMENTATION",
    "quiet_loading",
    "transformers_version",
    "register_attention",
    "explicit_mask",
    "get_attn_implementation",
    "set_config_attention",
    "ModelPatch",
    "config_get",
    "num_layers",
    "find_layers",
    "vision_language",
    "language_model",
    "child_module",
    "O_NAMES",
    "block_hidden_states",
    "block_input",
    "stacked_streams",
    "residual_stream",
    "resume_blocker",
    "HeadWeights",
    "head_weights",
    "embedding_rows",
    "input_device",
    "LLAMA_STYLE_TYPES",
    "VIT_TYPES",
    "ENCODER_TYPES",
    "layer_sliding_windows",
    "RECURRENT_LAYER_TYPES",
    "FEEDFORWARD_LAYER_TYPES",
    "model_cache_layers",
    "cache_layer_kind",
    "cache_layer_kinds",
    "recurrent_state_bytes",
    "base_model",
    "cache_kwarg_name",
    "output_cache",
    "cache_argument",
    "route_cache_argument",
    "offloaded_weights",
    "named_weights",
    "LayerRotation",
    "RECURRENT",
    "STATELESS",
    "layer_rotations",
    "check_capture",
    "check_stream",
    "unsupported_features",
]
