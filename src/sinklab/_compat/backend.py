"""Switching a model's attention backend and back: transformers' attention and mask registries, the config's
``_attn_implementation``, hooks and attributes set on modules — one :class:`ModelPatch` owns them all and restores
the model exactly. Also transformers' loading chatter and version."""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

from torch import nn

from ..errors import UnsupportedModelError

ATTN_IMPLEMENTATION = "sinklab_capture"


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


def explicit_mask(*args: Any, **kwargs: Any):
    """The boolean SDPA mask, always built for a causal (sliding, chunked …) pattern — the mask eager attention gets.

    SDPA's mask function returns ``None`` for a causal mask without padding and leaves causality to each attention
    module's ``is_causal`` flag, which not every module sets right: BigBird-Pegasus' decoder self-attention is
    causal only through its mask (``is_causal`` False), so a backend that trusts the flag would let every query see
    every key. With this mask function the mask says what each query sees, as in eager attention; ``None`` is left
    only where eager attention also gets none (a bidirectional mask without padding).
    """
    from transformers.masking_utils import sdpa_mask

    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


def get_attn_implementation(model: nn.Module) -> str | None:
    """The attention backend ``model`` dispatches to (``"eager"``, ``"sdpa"``, a sinklab backend …)."""
    config = getattr(model, "config", None)
    return getattr(config, "_attn_implementation", None)


def set_config_attention(config: Any, name: str) -> None:
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
            "so sinklab cannot observe it without copying its modeling code (which it never does). It becomes "
            "supported when transformers routes this model's attention through the interface (as it does for "
            "Llama, Qwen, Mistral, Gemma, Phi-3, GPT-NeoX, GPT-2, BERT …; docs/architectures.md lists them)."
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

    def hook(self, module: nn.Module, fn: Callable, *, pre: bool = False, **kwargs: Any):
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
