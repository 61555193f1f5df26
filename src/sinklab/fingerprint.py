"""Cheap identity of a model's weights, so results that depend only on the weights are computed once.

A :func:`weights_fingerprint` records, for every parameter, the parameter object itself (by weak
reference), its storage address, shape, dtype, device, autograd's version counter and a strided sample of
its values (at most :data:`SAMPLE` elements spread over the whole tensor). The counter goes up with most
in-place changes made through the tensor — ``load_state_dict``, ``with torch.no_grad(): p.mul_(2)``, the
``foreach`` optimizers — and a swapped parameter (``p.data = …``, a variant applied, a new module) changes
the object or its address. Some kernels write without bumping the counter: the *fused* optimizers
(``torch.optim.AdamW(fused=True)``, transformers' Trainer default ``adamw_torch_fused``) and any write
through ``p.data``. An optimizer step changes essentially every element, so the sample catches those; only
a ``.data`` write that misses every sampled element (editing one entry, say) goes unseen: :func:`forget`
drops what was cached for a model after such a write. Weights that accelerate offloads (on the ``meta`` device) have no fingerprint:
whatever depends on them is recomputed each time.

:class:`ModelCache` keeps one value per model (weakly: the model can be freed) and key, valid while the
fingerprint of the given parameters is unchanged.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable, Iterable
from typing import TypeVar

import torch
from torch import Tensor, nn

__all__ = ["weights_fingerprint", "ModelCache", "forget"]

T = TypeVar("T")

#: Fingerprint of one parameter: weak reference, storage address, shape, dtype, device, version counter, and a
#: strided sample of its values (compared with ``torch.equal``, so a NaN in it never matches: recomputed).
_Entry = tuple[weakref.ref, int, tuple[int, ...], str, str, int, Tensor]

#: Most elements sampled per parameter (evenly strided over the flattened tensor).
SAMPLE = 1024

_CACHES: list[ModelCache] = []


def weights_fingerprint(params: Iterable[Tensor]) -> tuple[_Entry, ...] | None:
    """Fingerprint of ``params`` (see the module docstring); ``None`` if any of them is offloaded (``meta``)."""
    out = []
    for p in params:
        if p.device.type == "meta":
            return None
        out.append((weakref.ref(p), p.data_ptr(), tuple(p.shape), str(p.dtype), str(p.device), p._version,
                    _sample(p)))
    return tuple(out)


def _sample(p: Tensor) -> Tensor:
    """At most :data:`SAMPLE` values of ``p``, evenly strided over its flattened elements (a copy)."""
    flat = p.detach().reshape(-1)
    step = max(1, -(-flat.numel() // SAMPLE))
    return flat[::step].clone()


def _same(a: tuple[_Entry, ...], b: tuple[_Entry, ...]) -> bool:
    """Equal fingerprints: the same live parameter objects with the same address, layout and version."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        obj = x[0]()
        if obj is None or obj is not y[0]() or x[1:6] != y[1:6] or not torch.equal(x[6], y[6]):
            return False
    return True


class ModelCache:
    """Values computed from a model's weights, one per ``(model, key)``, served while the weights are unchanged.

    Examples
    --------
    >>> cache = ModelCache()                                               # doctest: +SKIP
    >>> cache.get(model, "qk", model.parameters(), lambda: expensive(model))  # doctest: +SKIP
    """

    def __init__(self) -> None:
        self._store: weakref.WeakKeyDictionary[nn.Module, dict[Hashable, tuple[tuple, object]]] = \
            weakref.WeakKeyDictionary()
        _CACHES.append(self)

    def get(self, model: nn.Module, key: Hashable, params: Iterable[Tensor], compute: Callable[[], T]) -> T:
        """The cached value for ``(model, key)`` if ``params`` are unchanged since it was computed, else ``compute()``.

        ``compute`` raising leaves nothing cached. Offloaded parameters are never cached.
        """
        fingerprint = weights_fingerprint(params)
        entries = self._store.get(model)
        if fingerprint is not None and entries is not None:
            hit = entries.get(key)
            if hit is not None and _same(hit[0], fingerprint):
                return hit[1]  # type: ignore[return-value]
        value = compute()
        if fingerprint is not None:
            self._store.setdefault(model, {})[key] = (fingerprint, value)
        return value

    def forget(self, model: nn.Module) -> None:
        """Drop every value cached for ``model``."""
        self._store.pop(model, None)


def forget(model: nn.Module) -> None:
    """Drop every weight-derived value sinklab cached for ``model`` or any of its submodules (needed only after
    writes through ``p.data``)."""
    for module in model.modules():
        for cache in _CACHES:
            cache.forget(module)
