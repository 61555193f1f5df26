"""Architecture features sinklab cannot reproduce, refused before anything runs — with what the model does and
what would lift the refusal.

Each feature is read from the config and the module tree (field and submodule names), never from modeling code,
and is told apart for the two ways sinklab runs a model:

* the **capture** (:func:`check_capture`; scan, diagnose, circuit …) replaces the attention function and reads
  every block's ``[batch, tokens, hidden]`` output;
* the **stream** (:func:`check_stream`; ``SinkCache``) also replaces the cache and positions the kept tokens by
  rotating RoPE keys to their slot distances, masking by cache metadata (it never reads the attention mask).

A feature the capture handles (an additive mask bias, ``position_bias``) may still be refused for the stream.
Without a check a model with one of these features would crash deep inside a forward, or — worse — give numbers
that are silently wrong (a dropped bias, a dense attention where the model picks keys).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from ..errors import UnsupportedModelError
from .layout import config_get

__all__ = ["check_capture", "check_stream", "unsupported_features"]


def _modules_named(model: nn.Module, *suffixes: str) -> list[nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith(suffixes)]


def _hyper_connections(model: nn.Module, config: object) -> str | None:
    n = config_get(config, "hc_mult")
    if isinstance(n, int) and n > 1:
        return (f"carries {n} residual streams per token (hyper-connections: its blocks take and return "
                f"[batch, tokens, {n}, hidden])")
    return None


_COMPRESSED = ("compressed_sparse_attention", "heavily_compressed_attention")


def _compressed_keys(model: nn.Module, config: object) -> str | None:
    types = sorted({t for t in (config_get(config, "layer_types") or ()) if t in _COMPRESSED})
    if types:
        return f"appends compressed summaries of blocks of past tokens to its keys ({', '.join(types)} layers)"
    if any(isinstance(getattr(m, "compressor", None), nn.Module) for m in model.modules()):
        return "appends compressed summaries of blocks of past tokens to its keys (a `compressor` in its attention)"
    return None


def _sparse_indexer(model: nn.Module, config: object) -> str | None:
    k = config_get(config, "index_topk")
    if k is not None and _modules_named(model, "Indexer"):
        return (f"lets a learned indexer pick each query's top-{k} keys (DeepSeek-style sparse attention); "
                "transformers hands that choice to an attention function other than eager/sdpa as `indices`, "
                "not in the mask")
    return None


def _looped_layers(model: nn.Module, config: object) -> str | None:
    passes = config_get(config, "loop_num_passes")
    if isinstance(passes, int) and passes > 1:
        start, end = config_get(config, "loop_layer_index_start"), config_get(config, "loop_layer_index_end")
        return f"runs layers {start}–{end} {passes} times per token (looped layers)"
    return None


def _depth_attention(model: nn.Module, config: object) -> str | None:
    if _modules_named(model, "BlockAttentionResidual"):
        return ("mixes earlier blocks' outputs by attention over depth (block attention residuals), through the "
                "same attention function as its token attention")
    return None


def _input_sinks(model: nn.Module, config: object) -> str | None:
    if any(isinstance(getattr(m, "sink_proj", None), nn.Module) for m in model.modules()):
        return "computes each query's sink logit from its hidden state (`sink_proj`, handed to attention as `sinks`)"
    return None


def _dynamic_mask(model: nn.Module, config: object) -> str | None:
    if any(callable(getattr(m, "prepare_dynamic_mask", None)) for m in model.modules()):
        return ("adds a learned bias computed from the cached values to its attention scores, through the attention "
                "mask (dynamic mask attention, with a top-k of keep_window_size keys)")
    return None


def _relative_bias(model: nn.Module, config: object) -> str | None:
    extent = config_get(config, "rel_extent")
    if extent is not None or _modules_named(model, "RelativeLogits", "RelativePositionBias"):
        log = config_get(config, "log_scaling_n_floor")
        scaled = f", and scales full-attention queries by log(position) past {log}" if log is not None else ""
        return (f"encodes positions by a learned relative-position bias (over distances below {extent}) computed "
                f"from cache positions, instead of rotating keys{scaled}")
    return None


def _conv_state(model: nn.Module, config: object) -> str | None:
    if _modules_named(model, "ShortConvolution"):
        return "mixes neighbouring tokens through short causal convolutions whose state lives in the cache"
    return None


@dataclass(frozen=True)
class Feature:
    """One architecture feature: how it is found, and why the capture / the stream cannot reproduce it (``None``:
    it can) with what would lift that."""

    found: Callable[[nn.Module, object], str | None]  # what the model does, or None when it does not
    capture: str | None
    stream: str | None


FEATURES: tuple[Feature, ...] = (
    Feature(_hyper_connections,
            capture="sinklab's block statistics, value edits and block re-runs read one [batch, tokens, hidden] "
                    "residual stream per block; lifting it needs them defined over the parallel streams",
            stream=None),
    Feature(_compressed_keys,
            capture="the capture scores one key per token, and these keys are not tokens; lifting it needs its "
                    "statistics to tell the token keys from the compressed ones",
            stream="a SinkCache keeps tokens, not the compressed blocks the model's own cache layers build; lifting "
                   "it needs a stream policy for the compressed entries"),
    Feature(_sparse_indexer,
            capture="sinklab's attention would attend to every key; lifting it needs it to apply the selection",
            stream="sinklab's stream attention would attend to every kept key and keeps no keys for the indexer; "
                   "lifting it needs both"),
    Feature(_looped_layers,
            capture="sinklab's statistics are per layer, one attention call each; lifting it needs them per pass",
            stream="a SinkCache lays out one cache layer per layer, not one per pass; lifting it needs per-pass "
                   "layers"),
    Feature(_depth_attention,
            capture="sinklab's attention function would take those calls for token attention; lifting it needs it "
                    "to hand attention over depth back to the model's own",
            stream="sinklab's stream attention would take those calls for token attention; lifting it needs it to "
                   "hand attention over depth back to the model's own"),
    Feature(_input_sinks,
            capture="sinklab's attention reads learned per-head sink logits (`s_aux`) only and would drop these; "
                    "lifting it needs per-query sink columns",
            stream="sinklab's stream attention reads learned per-head sink logits (`s_aux`) only and would drop "
                   "these; lifting it needs per-query sink columns"),
    Feature(_dynamic_mask, capture=None,
            stream="sinklab's stream attention masks by cache metadata and never reads the attention mask, so it "
                   "would drop that bias; lifting it needs the model's mask bias applied over the cache's slots"),
    Feature(_relative_bias, capture=None,
            stream="sinklab's stream positions the kept tokens by rotating RoPE keys to their slot distances and "
                   "drops the model's `position_bias`; lifting it needs that bias recomputed at slot distances"),
    Feature(_conv_state, capture=None,
            stream="a SinkCache's attention layers hold no convolution state (it keeps one only for the separate "
                   "linear-attention layers of a hybrid model, in transformers' own LinearAttentionLayer); lifting it "
                   "needs a stream layer that keeps the convolution state alongside the window"),
)


def unsupported_features(model: nn.Module, use: str) -> list[str]:
    """``"what the model does: why sinklab cannot, and what would lift it"`` for each feature of ``model`` that
    ``use`` (``"capture"`` or ``"stream"``) cannot reproduce; empty when there is none."""
    if use not in ("capture", "stream"):
        raise ValueError(f"use is 'capture' or 'stream', got {use!r}")
    config = getattr(model, "config", None)
    found = []
    for feature in FEATURES:
        why = getattr(feature, use)
        if why is None:
            continue
        what = feature.found(model, config)
        if what is not None:
            found.append(f"it {what}: {why}")
    return found


def _refuse(model: nn.Module, use: str, doing: str) -> None:
    found = unsupported_features(model, use)
    if found:
        model_type = getattr(getattr(model, "config", None), "model_type", None) or "unknown type"
        raise UnsupportedModelError(f"{type(model).__name__} ({model_type}) cannot be {doing}: "
                                    + "; ".join(f"({i}) {line}" for i, line in enumerate(found, 1)) + ".")


def check_capture(model: nn.Module) -> None:
    """Raise :class:`UnsupportedModelError` if the capture (scan, diagnose, circuit …) cannot reproduce ``model``."""
    _refuse(model, "capture", "captured (scan, diagnose, circuit)")


def check_stream(model: nn.Module) -> None:
    """Raise :class:`UnsupportedModelError` if a ``SinkCache`` cannot stream ``model``."""
    _refuse(model, "stream", "streamed with a SinkCache")
