"""Which stream a model is running: the forward hooks that switch a model into a ``SinkCache`` and back.

One :class:`ModelStreams` per model, made by its first ``SinkCache``, holds a pre-hook and an always-called hook on
the decoder stack while any of its caches is alive. A forward given a ``SinkCache`` activates it (sinklab's stream
attention installed once through :class:`sinklab._compat.ModelPatch`; the pre-hook plans the forward), per thread;
any other forward releases an implicitly activated cache (inside ``with SinkCache(...)`` it is an error). Closing
the last cache, or garbage collection, removes the hooks: nothing of sinklab stays on the model.
"""

from __future__ import annotations

import threading
import weakref

import torch
from torch import nn

from .. import _compat
from ..errors import InputError
from .attention import ACTIVE_STREAM, ATTN_NAME, TRACED_STREAM, stream_attention, stream_mask

__all__ = ["ModelStreams", "streams_of"]

_REGISTRY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def streams_of(model: nn.Module) -> ModelStreams:
    """The model's stream bookkeeping (created, and its hooks installed, on first request)."""
    entry = _REGISTRY.get(model)
    if entry is None:
        entry = _REGISTRY[model] = ModelStreams(model)
    return entry


class ModelStreams:
    """The caches alive on one model, the one that is active, and the hooks that switch between them."""

    def __init__(self, model: nn.Module) -> None:
        self._model = weakref.ref(model)
        self._caches: set[int] = set()
        self.active: int | None = None  # id of the active cache
        self.explicit = False  # the active cache was opened by `with` (foreign forwards are errors)
        self._backend: _compat.ModelPatch | None = None  # the stream attention, while a cache is active
        self._local = threading.local()
        base = _compat.base_model(_compat.language_model(model))  # a vision-language model: its text decoder
        # The hooks run eagerly even inside a compiled forward (a graph break at the decoder stack's entry and exit);
        # a forward the cache planned itself (SinkCache.planned_forward) sets ``planned`` and they stand aside.
        self.planned = False
        self._hooks = _compat.ModelPatch(base)  # not the model: the registry must not keep it alive
        eager_pre, eager_post = torch.compiler.disable(self._pre_hook), torch.compiler.disable(self._post_hook)

        def pre_hook(module: nn.Module, args: tuple, kwargs: dict):
            return None if self.planned else eager_pre(module, args, kwargs)

        def post_hook(module: nn.Module, args: tuple, kwargs: dict, output) -> None:
            if not self.planned:
                eager_post(module, args, kwargs, output)

        self._hooks.hook(base, pre_hook, pre=True, with_kwargs=True)
        self._hooks.hook(base, post_hook, with_kwargs=True, always_call=True)

    def __deepcopy__(self, memo: dict) -> ModelStreams:
        """A copied model (``copy.deepcopy``) gets inert hooks: its streams are its own, not the original's."""
        inert = object.__new__(ModelStreams)
        # (a dead reference and no hooks: an inert copy)
        inert._model, inert._caches, inert.active, inert.explicit = (lambda: None), set(), None, False  # type: ignore[assignment]
        inert._backend, inert._local, inert._hooks = None, threading.local(), None  # type: ignore[assignment]
        inert.planned = False
        return inert

    # ------------------------------------------------------------------ lifetime
    def add(self, cache) -> None:
        self._caches.add(id(cache))
        weakref.finalize(cache, self.discard, id(cache))

    def discard(self, cache_id: int) -> None:
        """Forget a cache (closed or garbage-collected); the last one takes the hooks with it."""
        if self.active == cache_id:
            self.release()
        self._caches.discard(cache_id)
        if not self._caches:
            if self._hooks is not None:
                self._hooks.restore()
            model = self._model()
            if model is not None and _REGISTRY.get(model) is self:
                del _REGISTRY[model]

    def activate(self, cache, explicit: bool = False) -> None:
        if self.active == id(cache):
            self.explicit = self.explicit or explicit
            return
        if self.active is not None:
            if self.explicit:
                raise InputError("another SinkCache is open on this model in a `with` block; close it first "
                                 "(one stream per model at a time)")
            self.release()
        # alive: it is running a forward; a vision tower keeps its own attention
        backend = _compat.ModelPatch(_compat.language_model(self._model()))  # type: ignore[arg-type]
        # The stream's own mask function (the real new columns only; the attention masks by metadata).
        backend.use_attention(ATTN_NAME, stream_attention, mask=stream_mask)
        self._backend, self.active, self.explicit = backend, id(cache), explicit

    def release(self) -> None:
        """Give the model its own attention implementation back."""
        if self._backend is not None:
            self._backend.restore()
        self.active, self.explicit, self._backend = None, False, None

    # ------------------------------------------------------------------ hooks
    def _pre_hook(self, module: nn.Module, args: tuple, kwargs: dict):
        stack = self._local.__dict__.setdefault("tokens", [])
        stack.append(None)
        if self._model() is None:  # inert copy (see __deepcopy__)
            return None
        _, cache = _compat.cache_argument(kwargs)
        if not getattr(cache, "is_sinklab_stream", False):
            if self.active is not None:
                if self.explicit:
                    raise InputError("inside `with SinkCache(model) as cache:` pass that cache to the model "
                                     "(cache=cache, or past_key_values=cache)")
                self.release()
            return None
        _compat.route_cache_argument(module, kwargs)  # a stack that reads only `cache=` ignores `past_key_values=`
        stack[-1] = (self._bind(cache), cache)
        return cache.plan_forward(args, kwargs)

    def _bind(self, cache) -> object:
        """Make ``cache`` the stream of this forward (this thread's, and the traced one); returns the ContextVar
        token that undoes it."""
        if cache.closed:
            raise InputError("this SinkCache was closed; create a new one (a stream cannot be resumed after close — "
                             "use StreamSession.save/load for that)")
        self.activate(cache)
        token = ACTIVE_STREAM.set(cache)
        TRACED_STREAM[0] = cache
        return token

    def enter_planned(self, cache) -> object:
        """Activate ``cache`` for a forward it plans itself (the hooks stand aside); returns what
        :meth:`exit_planned` takes to undo it."""
        token = self._bind(cache)
        self.planned = True
        return token

    def exit_planned(self, token) -> None:
        self.planned = False
        TRACED_STREAM[0] = None
        ACTIVE_STREAM.reset(token)

    def _post_hook(self, module: nn.Module, args: tuple, kwargs: dict, output) -> None:
        stack = self._local.__dict__.get("tokens")
        entry = stack.pop() if stack else None
        if entry is None:
            return
        token, stream = entry
        ACTIVE_STREAM.reset(token)
        TRACED_STREAM[0] = None
        if output is not None:
            stream.check_hidden(_compat.block_hidden_states(output))
