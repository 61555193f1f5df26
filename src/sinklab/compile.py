"""``torch.compile`` options, checked before anything compiles: each mistake one clear InputError at the call, not a
compiler traceback at the first compiled step. Generic (nothing here is about streams): the stream's session uses it
for its decode step."""

from __future__ import annotations

import inspect

import torch

from .errors import InputError

__all__ = ["compile_options", "frozen"]


def frozen(forward):
    """``forward`` (a ``torch.compile``'d function) compiled with inductor's freezing: the setting is global and
    read when a graph is compiled (``torch.compile(..., options={"freezing": True})`` does not reach it), so
    every call — any compilation happens inside one — runs with it set."""
    import torch._inductor.config as inductor_config

    def call(*args, **kwargs):
        with inductor_config.patch(freezing=True):
            return forward(*args, **kwargs)

    return call


def compile_options(compile: bool | dict | None, no_fullgraph: str | None = None) -> dict | None:
    """Check ``compile`` (None/False: eager; True: ``torch.compile``'s defaults; a dict: its options) and return
    the ``torch.compile`` keyword arguments, or None for an eager function. ``no_fullgraph``: why the caller cannot
    hold ``fullgraph=True`` (None: it can)."""
    if compile is None or compile is False:
        return None
    if compile is True:
        return {}
    if not isinstance(compile, dict):
        raise InputError(f"compile is True, False/None or a dict of torch.compile options, got {compile!r}")
    allowed = [n for n in inspect.signature(torch.compile).parameters if n != "model"]
    unknown = sorted(set(compile) - set(allowed))
    if unknown:
        raise InputError(f"compile: unknown torch.compile option(s) {', '.join(map(repr, unknown))}; "
                         f"it takes {', '.join(allowed)}")
    options = dict(compile)
    if options.get("fullgraph") and no_fullgraph is not None:
        raise InputError(f"compile: fullgraph=True cannot hold for {no_fullgraph}; leave fullgraph out")
    for name in ("dynamic", "disable"):
        if options.get(name) is not None and not isinstance(options[name], bool):
            raise InputError(f"compile: {name} is True or False, got {options[name]!r}")
    backend = options.get("backend", "inductor")
    if not callable(backend):
        known = torch._dynamo.list_backends(exclude_tags=())
        if not isinstance(backend, str) or backend not in known:
            raise InputError(f"compile: unknown backend {backend!r}; torch.compile knows {', '.join(known)} "
                             "(or pass a callable)")
    _check_inductor_settings(options, backend)
    if options.get("disable"):
        return None  # torch.compile(disable=True) is the eager function itself
    return options


def _check_inductor_settings(options: dict, backend) -> None:
    """``mode`` and ``options`` are inductor's: known names, one of the two, and only with that backend."""
    inductor = backend == "inductor"
    if "mode" in options and options["mode"] is not None:
        modes = list(torch._inductor.list_mode_options())
        if not inductor:
            raise InputError(f"compile: mode is an inductor setting; backend {backend!r} would ignore it")
        if options["mode"] not in modes:
            raise InputError(f"compile: unknown mode {options['mode']!r}; inductor's modes are {', '.join(modes)}")
    if options.get("options") is not None:
        extra = options["options"]
        if not isinstance(extra, dict):
            raise InputError(f"compile: options is a dict of inductor settings, got {extra!r}")
        if options.get("mode") is not None:
            raise InputError("compile: give either mode or options, not both (torch.compile takes one)")
        if not inductor:
            raise InputError(f"compile: options are inductor settings; backend {backend!r} would ignore them")
        wrong = sorted(set(extra) - set(torch._inductor.list_options()))
        if wrong:
            raise InputError(f"compile: {', '.join(map(repr, wrong))} are not inductor settings "
                             "(torch._inductor.list_options() lists them)")
