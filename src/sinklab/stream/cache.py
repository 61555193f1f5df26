"""``sinklab.SinkCache``: StreamingLLM on any RoPE model through transformers' public Cache API.

    cache = sinklab.SinkCache(model, num_sinks=4, window=1020)            # a transformers Cache
    model.generate(input_ids, past_key_values=cache, max_new_tokens=20_000)  # or cache=cache

    with sinklab.SinkCache(model, num_sinks=4, window=1020) as cache:      # the same, closed on exit
        model.generate(input_ids, cache=cache, max_new_tokens=20_000)

The cache is a transformers ``Cache`` whose layers are :class:`SinkWindowLayer`. On first use it switches
the model's attention implementation to sinklab's stream attention (no mask function is registered, so
transformers builds no mask; the attention masks by cache metadata), and a forward pre-hook on the
decoder stack replaces ``position_ids`` by virtual slot positions, whoever computed them (``generate()``
or a hand-written loop). ``close()``, the end of the ``with`` block or garbage collection undo it all
(:mod:`sinklab.stream.activation`).

Per-layer budgets: a layer of the model's own sliding-window attention (Mistral's ``sliding_window``,
``sliding_attention`` entries of ``layer_types`` in gpt-oss, Gemma 2/3) whose window ``w ≤ S + W`` keeps
its native semantics — the last ``w`` tokens, no sinks, no pinned spans (``sliding_sinks=True`` adds them) —
so the stream equals the model's own forward until the full-attention layers start evicting. Every other
layer keeps ``S`` sinks, the pinned spans and a window of ``W``.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn
from transformers.cache_utils import Cache

from .. import _compat
from ..errors import InputError
from .activation import streams_of
from .layer import SinkWindowLayer
from .state import StreamState

__all__ = ["SinkCache"]


def _legacy_sizes(num_sinks: int, window: int | None, window_length: int | None,
                  num_sink_tokens: int | None) -> tuple[int, int]:
    """Map transformers' old ``SinkCache(window_length, num_sink_tokens)`` names onto ``(num_sinks, window)``.

    The old ``window_length`` was the whole cache: the sinks plus the recent tokens, the new token included
    (``len(key_cache) == window_length`` after each update), so ``window = window_length − num_sinks``.
    """
    if num_sink_tokens is not None:
        num_sinks = num_sink_tokens
    if window_length is not None:
        if window is not None:
            raise InputError("give window (sinklab) or window_length (transformers' old SinkCache), not both")
        if not isinstance(window_length, int) or window_length <= num_sinks:
            raise InputError(f"window_length ({window_length!r}) counts the {num_sinks} sinks too; it must exceed them")
        window = window_length - num_sinks
    if window_length is not None or num_sink_tokens is not None:
        warnings.warn(f"window_length/num_sink_tokens are transformers' old names: this is "
                      f"SinkCache(model, num_sinks={num_sinks}, window={window}) (window_length counted the sinks)",
                      FutureWarning, stacklevel=3)
    return num_sinks, (1020 if window is None else window)


class SinkCache(Cache):
    """A transformers ``Cache`` that streams ``model`` with attention sinks + a sliding window.

    Parameters
    ----------
    model:
        A RoPE causal LM (transformers ``PreTrainedModel``).
    num_sinks:
        ``S``, the first real tokens kept forever (0 gives the window-only baseline).
    window:
        ``W ≥ 1``, the most recent tokens each query sees, itself included (StreamingLLM's ``recent_size``).
        Default 1020.
    pinned:
        Half-open ``(start, end)`` stream-token ranges kept forever after the sinks (e.g. a system prompt);
        not counted in ``W``.
    start_position:
        Absolute position of the stream's first token (a stream resumed deep into a text); positions stay
        slot-based and float32-exact whatever its value.
    sliding_sinks:
        Also give the model's own sliding-window layers the sinks and pinned spans (default: they keep their
        native last-``w`` window).
    window_length, num_sink_tokens:
        transformers' old ``SinkCache`` names (deprecated): ``window = window_length − num_sinks``.
    kv_bits, kv_group_size:
        Store the window packed at 2, 3, 4 or 8 bits (scale and zero point per token and group of
        ``kv_group_size`` channels); sinks and pinned spans stay exact (:mod:`sinklab.stream.quantized`).
    """

    is_sinklab_stream = True

    def __init__(self, model: nn.Module, num_sinks: int = 4, window: int | None = None, pinned=None,
                 start_position: int = 0, rebase_every: int | None = None, *, sliding_sinks: bool = False,
                 window_length: int | None = None, num_sink_tokens: int | None = None, kv_bits: int | None = None,
                 kv_group_size: int = 16) -> None:
        num_sinks, window = _legacy_sizes(num_sinks, window, window_length, num_sink_tokens)
        self.model = model
        self.sliding_sinks = bool(sliding_sinks)
        main = StreamState(num_sinks, window, pinned, start_position, rebase_every)
        ropes = _compat.layer_rope_specs(model)
        self.layer_windows = _compat.layer_sliding_windows(model)
        groups: dict[tuple, StreamState] = {}
        self.layer_states: list[StreamState] = []
        for rope, own in zip(ropes, self.layer_windows):
            native = own is not None and own <= num_sinks + window
            if native and not sliding_sinks:
                policy = (0, own, ())
            else:
                policy = (num_sinks, own if native else window, tuple(main.pinned))
            key = (id(rope), *policy)
            if key not in groups:
                groups[key] = StreamState(policy[0], policy[1], list(policy[2]), start_position, rebase_every, rope=rope)
            self.layer_states.append(groups[key])
        self.states = list(groups.values())
        # Every group re-bases at the same steps by the same amount, so all layers share one virtual position.
        keep = max(s.window for s in self.states)
        for s in self.states:
            s.rebase_every, s.rebase_keep = int(rebase_every or max(4 * keep, 2048)), keep
        full = [s for s in self.states if (s.num_sinks, s.window) == (num_sinks, window)]
        self.state = full[0] if full else self.states[0]  # the sinks + window budget (what cache_tokens reports)
        self.rope = self.state.rope
        self.closed = False
        self._vocab = _compat.embedding_rows(model)
        if kv_bits is None:
            layers = [SinkWindowLayer(s, s.rope) for s in self.layer_states]
        else:
            from .quantized import QuantizedSinkWindowLayer

            layers = [QuantizedSinkWindowLayer(s, s.rope, kv_bits, kv_group_size) for s in self.layer_states]
        super().__init__(layers=layers)
        self._streams = streams_of(model)
        self._streams.add(self)

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
        b, c = ref.shape[0], ref.shape[1]
        if ids is not None and self._vocab is not None and ids.numel():
            if bool(((ids < 0) | (ids >= self._vocab)).any()):
                bad = ids[(ids < 0) | (ids >= self._vocab)][0]
                raise InputError(f"token id {int(bad)} is outside the model's vocabulary (0 … {self._vocab - 1}); "
                                 "the ids come from a different tokenizer or were corrupted")
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 2:
            valid = mask[:, -c:].bool()  # left padding: each row's sinks are its own first real tokens
        else:
            valid = torch.ones(b, c, dtype=torch.bool, device=ref.device)
        positions = [s.begin(valid) for s in self.states][0]
        kwargs["position_ids"] = positions
        kwargs.pop("cache_position", None)
        return args, kwargs
