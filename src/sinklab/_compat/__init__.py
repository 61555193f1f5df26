"""Every touch of transformers internals and per-architecture layouts lives in this package.

The rest of sinklab talks to models through ``sinklab._compat`` only (imported by name; its names are public):

* :mod:`.backend` — registering an attention function with its matching mask function, switching a model's
  attention implementation and back (:class:`ModelPatch`), transformers' loading chatter and version;
* :mod:`.layout` — the config fields under their names, the stack of transformer blocks, the query/key/output
  projection weights in each supported layout, RoPE and sliding-window specs, the architecture tables and the
  cache argument's name.
"""

from __future__ import annotations

from .backend import (
    ATTN_IMPLEMENTATION,
    quiet_loading,
    transformers_version,
    register_attention,
    get_attn_implementation,
    set_config_attention,
    ModelPatch,
)
from .layout import (
    config_get,
    num_layers,
    find_layers,
    child_module,
    block_hidden_states,
    block_input,
    HeadWeights,
    head_weights,
    embedding_rows,
    input_device,
    LLAMA_STYLE_TYPES,
    VIT_TYPES,
    ENCODER_TYPES,
    rope_spec,
    layer_rope_specs,
    layer_sliding_windows,
    base_model,
    cache_kwarg_name,
    output_cache,
    cache_argument,
    offloaded_weights,
    named_weights,
)

__all__ = [
    "ATTN_IMPLEMENTATION",
    "quiet_loading",
    "transformers_version",
    "register_attention",
    "get_attn_implementation",
    "set_config_attention",
    "ModelPatch",
    "config_get",
    "num_layers",
    "find_layers",
    "child_module",
    "block_hidden_states",
    "block_input",
    "HeadWeights",
    "head_weights",
    "embedding_rows",
    "input_device",
    "LLAMA_STYLE_TYPES",
    "VIT_TYPES",
    "ENCODER_TYPES",
    "rope_spec",
    "layer_rope_specs",
    "layer_sliding_windows",
    "base_model",
    "cache_kwarg_name",
    "output_cache",
    "cache_argument",
    "offloaded_weights",
    "named_weights",
]
