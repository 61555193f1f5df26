"""``sinklab.SinkCache``: StreamingLLM on any RoPE model through transformers' public Cache API.

    with sinklab.SinkCache(model, num_sinks=4, window=1020) as cache:      # or without `with`: closed when collected
        model.generate(input_ids, cache=cache, max_new_tokens=20_000)      # or past_key_values=cache

The cache's layers come from :func:`build_layers`; :mod:`sinklab.stream.activation` switches the model's attention
while the cache is in use and plans each forward's positions. Sliding-window and hybrid models: docs/stream.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from transformers.cache_utils import Cache

from .. import _compat
from ..checks import check_model
from ..errors import InputError, ModelWeightsError, UnsupportedModelError, check_int
from .activation import streams_of
from .config import KV_GROUP_SIZE, StreamConfig, resolve_config
from .layer import SinkWindowLayer
from .mrope import MultimodalPositions, lays_out_positions
from .plan import RetentionPlan
from .policy import RetentionPolicy
from .quantized import QuantizedSinkWindowLayer
from .scored import ScoredLayer, ScoredState
from .state import StreamState

__all__ = ["KV_GROUP_SIZE", "LAYER_KINDS", "LayerSpec", "SinkCache", "build_layers"]


def _real_columns(mask, b: int, c: int, device: torch.device) -> torch.Tensor:
    """Which of the ``c`` new columns are real tokens, ``[B, C]`` bool, from a 2-D padding mask or a prepared 4-D
    one: the stream's own ``[B, 1, 1, C]``, or the model's own read on the diagonal of its last ``C`` keys (which every
    causal, sliding or chunked pattern keeps; :meth:`StreamLayerBase.get_mask_sizes`)."""
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        return mask[:, -c:].bool()
    if isinstance(mask, torch.Tensor) and mask.dim() == 4:
        block = mask[:, 0, -c:, -c:]  # (B, 1 | C, C): the new queries against the new columns
        seen = block[:, -1] if block.shape[1] == 1 else block.diagonal(dim1=-2, dim2=-1)
        return seen if seen.dtype == torch.bool else seen == 0  # additive float masks: 0 = attend
    return torch.ones(b, c, dtype=torch.bool, device=device)


@dataclass(frozen=True)
class LayerSpec:
    """What the factory knows of one attention layer when it makes the layer's cache (``cls.for_stream(state, spec)``)."""

    index: int
    rotation: Any  # how the layer rotates its keys (sinklab._compat.layer_rotations)
    sliding: int | None  # the model's own sliding window on this layer (None: full attention)
    config: StreamConfig
    shared: dict  # what the layers of one stream share, by the state's id (the packed layers' PackShared)


#: Which state and cache-layer classes hold an attention layer: (score-based policy, packed window) → the classes.
#: Each class makes itself from the config (``for_stream``); a score-based policy over a packed window is refused by
#: :class:`StreamConfig`.
LAYER_KINDS: dict[tuple[bool, bool], tuple[Any, Any]] = {
    (False, False): (StreamState, SinkWindowLayer),
    (False, True): (StreamState, QuantizedSinkWindowLayer),
    (True, False): (ScoredState, ScoredLayer),
}


def _budget(own: int | None, config: StreamConfig) -> tuple[bool, int, int, tuple]:
    """``(score-based, sinks, window, pinned)`` of an attention layer whose own sliding window is ``own``: a native
    window ``w ≤ S + W`` keeps its last ``w`` tokens by recency, without sinks or pins unless ``sliding_sinks``."""
    native = own is not None and own <= config.num_sinks + config.window
    if native and not config.sliding_sinks:
        return False, 0, own, ()  # type: ignore[return-value]  # (native: own is set)
    return config.policy.scored, config.num_sinks, own if native else config.window, config.pinned  # type: ignore[return-value]


def _layer_layout(model: nn.Module) -> tuple[list, list[int | None]]:
    """Each layer's measured rotation (:func:`sinklab._compat.layer_rotations`, which refuses what the stream cannot
    reproduce) and the model's own sliding window on it (None: full attention)."""
    rotations = _compat.layer_rotations(model)
    if not any(r.is_attention for r in rotations):
        raise UnsupportedModelError(
            f"{type(model).__name__} has no softmax-attention layer: every layer keeps a fixed-size recurrent "
            "state, which its own cache already holds in constant memory; sinks and a window have nothing to act on "
            "(generate with the model's own cache)")
    windows = _compat.layer_sliding_windows(model)
    if len(rotations) != len(windows):  # blocks with several attention modules
        if any(w is not None for w in windows):
            raise UnsupportedModelError(
                f"{type(model).__name__} has {len(rotations)} attention layers in {len(windows)} blocks and sliding "
                "windows per block; sinklab cannot tell which attention layer each window belongs to")
        windows = [None] * len(rotations)
    return rotations, windows


def build_layers(model: nn.Module, config: StreamConfig, rotations: list,
                 windows: list[int | None]) -> tuple[list, list]:
    """The stream's cache layers and each one's state (None for a layer that is not attention). Attention layers of
    the same rotation and budget share one state; :data:`LAYER_KINDS` picks the classes. A hybrid's other layers are
    fresh layers of the class the model's own cache uses for them (transformers' ``LinearAttentionLayer``, holding the
    convolution and recurrent states exactly as that cache would; a ``DummyLayer`` for a block without state)."""
    own_layers = _compat.model_cache_layers(model) if not all(r.is_attention for r in rotations) else []
    groups: dict[tuple, Any] = {}
    shared: dict = {}
    states: list = []
    layers: list = []
    for i, (rotation, own) in enumerate(zip(rotations, windows)):
        if not rotation.is_attention:
            if i >= len(own_layers) or _compat.cache_layer_kind(own_layers[i]) != rotation.kind:
                raise UnsupportedModelError(  # the probe measured this very cache: the config changed since
                    f"{type(model).__name__}: layer {i} is a {rotation.kind} layer, but the model's own cache has no "
                    "such layer for it; create the SinkCache again")
            states.append(None)
            layers.append(own_layers[i])
            continue
        scored, *sizes = _budget(own, config)
        state_cls, layer_cls = LAYER_KINDS[scored, config.kv_bits is not None]
        if scored and not rotation.caches_attended_keys:
            raise UnsupportedModelError(
                f"{type(model).__name__}: the {config.policy.name!r} policy re-rotates the keys it keeps, and this "
                "model's cached tensor is not the rotated key the attention reads (latent attention or a rotary part "
                "stored apart); stream it with the default policy (streaming)")
        key = (id(rotation), scored, *sizes)
        if key not in groups:
            groups[key] = state_cls.for_stream(config, *sizes, rotation=rotation)
        states.append(groups[key])
        layers.append(layer_cls.for_stream(groups[key], LayerSpec(i, rotation, own, config, shared)))
    return states, layers


class SinkCache(Cache):
    """A transformers ``Cache`` that streams ``model`` (a causal LM with rotary positions or none, as
    :func:`sinklab._compat.layer_rotations` measures it) with ``num_sinks`` attention sinks + a ``window``.

    ``config`` is a :class:`~sinklab.stream.config.StreamConfig`; or give its fields as keywords (:func:`stream_config`:
    ``plan`` may also be a scan, a diagnosis or a saved plan's path; transformers' old ``window_length`` /
    ``num_sink_tokens`` are mapped, deprecated)."""

    is_sinklab_stream = True

    def __init__(self, model: nn.Module, num_sinks: int | None = None, window: int | None = None, *,
                 config: StreamConfig | None = None, **settings) -> None:
        check_model(model, "SinkCache")
        _compat.check_stream(model)  # features the stream cannot reproduce, refused with what would lift it
        config = resolve_config(model, config, num_sinks, window, settings)
        if config.plan is not None:
            config.plan.check_model(model)
        self.config = config
        self.model = model
        self.layer_rotations, self.layer_windows = _layer_layout(model)
        #: A hybrid model's layers with a recurrent / convolution state, kept whole in the model's own cache-layer class.
        self.recurrent_layers = [i for i, r in enumerate(self.layer_rotations) if r.kind == "recurrent"]
        self.layer_states, layers = build_layers(model, config, self.layer_rotations, self.layer_windows)
        self.states = list(dict.fromkeys(s for s in self.layer_states if s is not None))
        # Every group re-bases at the same steps by the same amount, so all layers share one virtual position.
        keep = max(s.capacity if s.scored else s.window for s in self.states)
        for st in self.states:
            st.set_rebase(config.rebase_every, keep)
        full = [s for s in self.states if (s.num_sinks, s.window) == (config.num_sinks, config.window)
                and s.scored == config.policy.scored]
        self.state = full[0] if full else self.states[0]  # the sinks + window budget (what cache_tokens reports)
        self.closed = False
        self._vocab = _compat.embedding_rows(model)
        self.check_every = config.check_every
        self._pending_ids: torch.Tensor | bool = False
        self._pending_hidden: torch.Tensor | bool = False
        self._checked = 0  # columns checked so far
        #: Multimodal rotary positions (M-RoPE), or None: each token's 3-D position offset from its virtual one.
        self.positions = MultimodalPositions() if lays_out_positions(model) else None
        super().__init__(layers=layers)
        self._streams = streams_of(model)
        self._streams.add(self)

    @property
    def policy(self) -> RetentionPolicy:
        return self.config.policy

    @property
    def plan(self) -> RetentionPlan | None:
        return self.config.plan

    # ------------------------------------------------------------------ lifetime
    def __enter__(self) -> SinkCache:
        if self.closed:
            raise InputError("this SinkCache was closed; create a new one")
        self._streams.activate(self, explicit=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release the model (its own attention comes back) and end the stream; idempotent."""
        if not self.closed:
            self.closed = True
            for s in self.states:
                s.closed = True
            self._streams.discard(id(self))

    @property
    def cache(self) -> SinkCache:  # the pre-0.2 context manager yielded a separate Cache object
        return self

    # ------------------------------------------------------------------ one forward
    def plan_forward(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Called by the decoder-stack pre-hook: check the ids, plan every layer group, set ``position_ids``."""
        ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds")
        ref = ids if ids is not None else embeds
        b, c = ref.shape[0], ref.shape[1]  # type: ignore[union-attr]  # (the model takes ids or embeddings)
        if ids is not None:
            self.check_ids(ids)
        given, seen = kwargs.get("position_ids"), self.state.columns
        if self.positions is None and isinstance(given, torch.Tensor) and given.dim() == 3 \
                and not bool((given == given[-1:]).all()):
            raise UnsupportedModelError(f"{type(self.model).__name__}: it hands its decoder different positions per "
                                        "axis (multimodal rotary) but has no get_rope_index, which the stream needs "
                                        "to lay out a chunk's positions; stream it without images, or add the method")
        mask = kwargs.get("attention_mask")
        if isinstance(mask, dict):  # generate() on a hybrid model: one prepared mask per layer type, same padding
            mask = next((m for m in mask.values() if isinstance(m, torch.Tensor)), None)
        valid = _real_columns(mask, b, c, ref.device)  # type: ignore[union-attr]
        # Every column real, known on the host: no mask, or a CPU mask (on an accelerator the read would synchronise).
        all_valid = not isinstance(mask, torch.Tensor) or (valid.device.type == "cpu" and bool(valid.all()))
        positions = [s.begin(valid, all_valid) for s in self.states][0]
        if self.positions is not None:
            positions = self.positions.plan(given, positions, seen, all_valid)
        kwargs["position_ids"] = positions
        kwargs.pop("cache_position", None)
        return args, kwargs

    def planned_forward(self, forward, **kwargs):
        """``forward(**kwargs)`` (the model's forward or a compiled one, given this cache) planned here, eagerly, before
        the call, while the decoder-stack hooks stand aside: a compiled decode step is then one graph, no break. The
        finite-values check runs on the returned logits. ``StreamSession.step`` decodes this way."""
        token = self._streams.enter_planned(self)
        try:
            _, planned = self.plan_forward((), kwargs)
            out = forward(**planned)
        finally:
            self._streams.exit_planned(token)
        self.check_hidden(out.logits)
        return out

    # ------------------------------------------------------------------ checks (per chunk, or deferred)
    def check_ids(self, ids: torch.Tensor) -> None:
        """Token ids in range: read on the host where they already are (CPU), else checked every ``check_every``."""
        if self._vocab is None or not ids.numel():
            return
        if ids.device.type == "cpu" and ids.numel() <= 64:  # a decode step: a few Python comparisons, no tensor op
            bad = next((v for v in ids.flatten().tolist() if not 0 <= v < self._vocab), None)
        elif ids.device.type == "cpu" or ids.shape[1] > 1:
            out = (ids < 0) | (ids >= self._vocab)
            bad = int(ids[out][0]) if bool(out.any()) else None
        else:  # one column on an accelerator: accumulate on the device, read back every `check_every` columns
            self._pending_ids = ((ids < 0) | (ids >= self._vocab)).any() | self._pending_ids
            return
        if bad is not None:
            raise InputError(f"token id {bad} is outside the model's vocabulary (0 … {self._vocab - 1}); "
                             "the ids come from a different tokenizer or were corrupted")

    def check_hidden(self, hidden: torch.Tensor) -> None:
        """Called after each forward with the decoder stack's output ``[B, C, D]``: NaN/inf → ModelWeightsError, at once
        for a chunk or on the CPU; single columns on an accelerator are read back every ``check_every`` columns."""
        columns = self.state.columns
        if hidden.device.type == "cpu":  # one float64 sum (NaN and ±inf carry through it, finite values cannot overflow)
            if not math.isfinite(float(hidden.sum(dtype=torch.float64))):
                self._pending_hidden = torch.ones((), dtype=torch.bool)
        else:
            self._pending_hidden = ~torch.isfinite(hidden).all() | self._pending_hidden
            if hidden.shape[1] == 1 and columns - self._checked < self.check_every:  # one column, on a device
                return
        self.flush_checks(columns - hidden.shape[1])

    def flush_checks(self, first: int | None = None) -> None:
        """Read the accumulated checks back (one host read) and raise for what they found."""
        lo, hi = (self._checked if first is None else min(first, self._checked)), self.state.columns - 1
        pending_ids, pending_hidden = self._pending_ids, self._pending_hidden
        self._pending_ids = self._pending_hidden = False
        self._checked = self.state.columns
        if isinstance(pending_hidden, torch.Tensor) and bool(pending_hidden):
            raise ModelWeightsError(
                f"the model produced NaN or inf hidden states while streaming (columns {lo}–{hi} of the stream); "
                "check its weights with sinklab.checks.check_weights, or run in float32 if it overflows in half "
                "precision")
        if isinstance(pending_ids, torch.Tensor) and bool(pending_ids):
            raise InputError(f"a token id outside the model's vocabulary (0 … {self._vocab - 1}) was fed in columns "  # type: ignore[operator]
                             f"{lo}–{hi}; the ids come from a different tokenizer or were corrupted")

    # ------------------------------------------------------------------ generate modes (rows, crop)
    def _select_rows(self, index: torch.Tensor) -> None:
        if self.positions is not None:
            self.positions.select_rows(index)
        for state in self.states:
            if state.batch is not None:
                state.select_rows(index)
        for i, layer in enumerate(self.layers):
            if self.layer_states[i] is None:
                layer.reorder_cache(index)  # type: ignore[arg-type]  # transformers' own: every conv / recurrent state follows its row
            else:
                layer.select_rows(index)  # type: ignore[union-attr]  # a stream layer

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row ``i`` continues beam ``beam_idx[i]`` (every per-row tensor of the stream follows)."""
        self._select_rows(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """``num_return_sequences`` / beams: each row becomes ``repeats`` identical rows."""
        if self.state.batch is not None:
            self._select_rows(torch.arange(self.state.batch, device=self.state.device).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the rows ``indices`` (in that order)."""
        if self.state.batch is not None:
            self._select_rows(torch.as_tensor(indices, device=self.state.device).long())

    def crop(self, tokens_to_remove: int) -> None:
        """Take back the last ``-tokens_to_remove`` columns (assisted decoding, prompt lookup): exact only while nothing
        was evicted (else an InputError), and for a hybrid's recurrent layers only while they record their past."""
        if tokens_to_remove > 0:
            raise InputError(f"SinkCache.crop takes minus the number of columns to remove (transformers ≥ 5), "
                             f"got {tokens_to_remove}")
        n = -int(tokens_to_remove)
        recording = [self.layers[i] for i in self.recurrent_layers if getattr(self.layers[i], "record_past", False)]
        if n and self.recurrent_layers and len(recording) < len(self.recurrent_layers):
            raise InputError(
                f"SinkCache cannot take back the last {n} tokens: the recurrent layers of this hybrid model fold every "
                "token into their state and keep no history unless they record it (cache.activate_past_recording(), "
                "which generate() calls for assisted decoding)")
        if self.state.batch is None:
            return
        if n > self.state.columns:
            raise InputError(f"cannot remove {n} columns from a stream of {self.state.columns}")
        evicted = next((state for state in self.states if n and state.evicted()), None)
        if evicted is not None:
            raise InputError(
                f"SinkCache cannot take back the last {n} tokens: the stream has already evicted tokens from its "
                f"{evicted.window}-token window, and those are gone (a cropped stream would differ from one that "
                "never saw the removed tokens). Assisted decoding and prompt lookup need a cache that keeps "
                "every token (DynamicCache), or a window larger than the whole generation")
        for layer in recording:  # transformers' own (crop(0) trims the recorded conv states to the kernel size)
            layer.crop(-n)  # type: ignore[union-attr]
        for state in self.states if n else ():
            state.drop_last(n)

    def grow(self, tokens: int) -> None:
        """Raise every head's budget by ``tokens`` under a score-based policy: the next ``tokens`` tokens are kept
        without evicting any, and the budget holds again after them. A prompt compressed once, then its question and
        answer appended whole — what kvpress's presses do — is ``cache.grow(n)`` after the prompt
        (docs/retention.md). A layer with its own sliding window kept whole (a ring of that window) keeps it; a
        recency (StreamingLLM) stream keeps a fixed window: refused."""
        check_int("tokens", tokens, 0)
        if not self.policy.scored:
            raise InputError(f"grow() raises the budgets of a score-based stream; the {self.policy.name!r} policy "
                             "keeps a fixed window: give a score-based policy, e.g. SinkCache(model, ..., "
                             "policy='snapkv')")
        for state in self.states:
            if state.scored:
                for layer in state.layers:
                    layer.grow(tokens)
                state.set_rebase(self.config.rebase_every, state.rebase_keep + tokens)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Columns fed so far (padding included), whichever layer is asked: every layer of a stream has seen them
        all, a hybrid's recurrent layers too (whose own count is a tensor)."""
        return self.state.columns

    # ------------------------------------------------------------------ compile
    def get_query_offset(self, layer_idx: int = 0) -> int:
        """Columns fed so far; 0 inside a compiled forward, where the stream's own mask function ignores it
        (reading the host counter there would make torch.compile specialise on it and recompile every token)."""
        return 0 if torch.compiler.is_compiling() else self.state.columns

    @property
    def is_compileable(self) -> bool:
        """Decoding is compileable (fixed shapes; a packed ``kv_bits`` ring is not); transformers' ``generate``
        compiles a compileable cache under a CompileConfig."""
        return all(layer.is_compileable for layer in self.layers)

    # ------------------------------------------------------------------ persistence
    def state_dict(self) -> dict:
        """Everything the stream holds, nested: each state's and each layer's own ``state_dict`` by index (a hybrid's
        recurrent layers: :func:`recurrent_state_dict`), and which layers are recurrent. A cache made with the same
        config on the same model continues exactly after :meth:`load_state_dict`."""
        return {"states": {str(g): s.state_dict() for g, s in enumerate(self.states)},
                "layers": {str(i): self._layer_state(i) for i in range(len(self.layers))},
                "recurrent": list(self.recurrent_layers),
                **({"positions": self.positions.state_dict()} if self.positions is not None else {})}

    def _layer_state(self, i: int) -> dict:
        if i in self.recurrent_layers:
            return recurrent_state_dict(self.layers[i])
        layer: Any = self.layers[i]  # a stream layer, or a stateless one of the model's own cache
        return layer.state_dict() if self.layer_states[i] is not None else {}

    def check_state_dict(self, saved: dict, source: str = "the saved stream") -> None:
        """InputError unless ``saved`` (a :meth:`state_dict`) fits this cache's layers and budgets."""
        if len(saved.get("states", {})) != len(self.states):
            raise InputError(f"{source} was saved from a model with {len(saved.get('states', {}))} layer budgets; "
                             f"this one has {len(self.states)} — load it with the model that wrote it")
        if sorted(saved.get("recurrent", [])) != sorted(self.recurrent_layers) \
                or len(saved.get("layers", {})) != len(self.layers):
            raise InputError(f"{source} holds {len(saved.get('layers', {}))} layers, recurrent ones "
                             f"{sorted(saved.get('recurrent', []))}; this model has {len(self.layers)}, recurrent "
                             f"{sorted(self.recurrent_layers)} — load it with the model that wrote it")

    def load_state_dict(self, saved: dict) -> None:
        """Put back what :meth:`state_dict` returned (checked by :meth:`check_state_dict`)."""
        self.check_state_dict(saved)
        for g, state in enumerate(self.states):
            state.load_state_dict(saved["states"][str(g)])
        layers: list[Any] = list(self.layers)
        for i, layer in enumerate(layers):
            if i in self.recurrent_layers:
                load_recurrent_state_dict(layer, saved["layers"][str(i)])
            elif self.layer_states[i] is not None:
                layer.load_state_dict(saved["layers"][str(i)])
        if self.positions is not None:
            self.positions.load_state_dict(saved.get("positions", {}))
        self._checked = self.state.columns


_PLAIN = (bool, int, float, str, type(None))


def recurrent_state_dict(layer: object) -> dict:
    """A hybrid's recurrent cache layer (transformers' linear-attention layer: per-state dicts of conv / recurrent
    tensors and flags, a length counter) as a nested dict: each tensor or plain attribute as it is, each dict
    attribute as ``{"items": {key: value}, "int_keys": bool}``."""
    out: dict = {}
    for name, value in vars(layer).items():
        if isinstance(value, (Tensor, *_PLAIN)):
            out[name] = value
        elif isinstance(value, dict):
            items = {str(k): v for k, v in value.items() if isinstance(v, (Tensor, *_PLAIN))}
            out[name] = {"items": items, "int_keys": all(isinstance(k, int) for k in value)}
    return out


def load_recurrent_state_dict(layer: Any, saved: dict) -> None:
    """Put back what :func:`recurrent_state_dict` took from a layer of the same class."""
    tensors = []
    for name, value in saved.items():
        if isinstance(value, dict):
            cast = int if value["int_keys"] else str
            value = {cast(k): v for k, v in value["items"].items()}
            tensors += [(name != "conv_states", v) for v in value.values() if isinstance(v, Tensor)]
        setattr(layer, name, value)
    first = min(tensors, key=lambda t: t[0], default=None)  # transformers takes the layer's dtype and device from
    if first is not None and hasattr(layer, "device"):  # its conv state
        layer.device, layer.dtype = first[1].device, first[1].dtype
