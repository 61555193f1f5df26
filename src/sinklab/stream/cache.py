"""``sinklab.SinkCache``: StreamingLLM on any RoPE model through transformers' public Cache API.

    with sinklab.SinkCache(model, num_sinks=4, window=1020) as cache:   # cache is a transformers Cache
        model.generate(input_ids, cache=cache, max_new_tokens=20_000)    # or past_key_values=cache

While the block is open: the model's attention implementation is sinklab's stream attention (no mask
function is registered, so transformers builds no mask; the attention masks by cache metadata), and a
forward pre-hook on the decoder stack replaces ``position_ids`` by virtual slot positions, whoever
computed them (``generate()`` or a hand-written loop). Everything is undone on exit.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.cache_utils import Cache

from .. import _compat
from ..errors import InputError
from .attention import ACTIVE_STREAM, ATTN_NAME, stream_attention
from .layer import SinkWindowLayer
from .state import StreamState

__all__ = ["SinkCache"]


class SinkCache:
    """Context manager that opens a stream on ``model`` and yields its transformers ``Cache``.

    Parameters
    ----------
    num_sinks:
        ``S``, the first real tokens kept forever (0 gives the window-only baseline).
    window:
        ``W ≥ 1``, the most recent tokens each query sees, itself included (StreamingLLM's ``recent_size``).
    pinned:
        Half-open ``(start, end)`` stream-token ranges kept forever after the sinks (e.g. a system prompt);
        not counted in ``W``.
    start_position:
        Absolute position of the stream's first token (a stream resumed deep into a text); positions stay
        slot-based and float32-exact whatever its value.
    """

    def __init__(self, model: nn.Module, num_sinks: int = 4, window: int = 1020, pinned=None,
                 start_position: int = 0, rebase_every: int | None = None) -> None:
        self.model = model
        self.rope = _compat.rope_spec(model)
        self.state = StreamState(num_sinks, window, pinned, start_position, rebase_every, rope=self.rope)
        n_layers = _compat.num_layers(model.config)
        self.cache = Cache(layers=[SinkWindowLayer(self.state, self.rope) for _ in range(n_layers)])
        self.cache.sinklab_stream = self  # lets sinklab find the stream from the cache object
        self._handle = None
        self._token = None
        self._previous = None

    def __enter__(self) -> Cache:
        from transformers import AttentionInterface

        AttentionInterface.register(ATTN_NAME, stream_attention)
        self._previous = _compat.get_attn_implementation(self.model)
        _compat.set_attn_implementation(self.model, ATTN_NAME)
        self._handle = _compat.base_model(self.model).register_forward_pre_hook(self._pre_hook, with_kwargs=True)
        self._token = ACTIVE_STREAM.set(self)
        return self.cache

    def __exit__(self, *exc: object) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        if self._token is not None:
            ACTIVE_STREAM.reset(self._token)
            self._token = None
        if self._previous is not None and _compat.get_attn_implementation(self.model) != self._previous:
            self.model.set_attn_implementation(self._previous)

    def _pre_hook(self, module: nn.Module, args: tuple, kwargs: dict):
        _, cache = _compat.cache_argument(kwargs)
        if cache is not self.cache:
            raise InputError("inside `with SinkCache(model) as cache:` pass that cache to the model "
                             "(cache=cache, or past_key_values=cache on older transformers)")
        ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds")
        ref = ids if ids is not None else embeds
        b, c = ref.shape[0], ref.shape[1]
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 2:
            valid = mask[:, -c:].bool()  # left padding: each row's sinks are its own first real tokens
        else:
            valid = torch.ones(b, c, dtype=torch.bool, device=ref.device)
        kwargs["position_ids"] = self.state.begin(valid)
        kwargs.pop("cache_position", None)
        return args, kwargs
