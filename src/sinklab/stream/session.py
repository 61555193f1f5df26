"""``StreamSession`` and ``stream_generate``: unbounded streams in constant memory, with save/resume.

``model.generate`` grows its own per-step tensors (``input_ids``, ``attention_mask``) with the stream;
a session keeps only the cache and the last token, so a stream can run for millions of tokens.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from .. import _compat
from ..atomic import atomic_file
from ..errors import InputError, check_int, is_int
from ..variants import register_count
from .cache import KV_GROUP_SIZE, SinkCache

__all__ = ["StreamSession", "TextPieces", "check_chunk_size", "check_sampling", "compile_options", "sample_token",
           "stream_generate"]

_FORMAT = "sinklab.stream/1"


def _describe(value) -> str:
    return f"a {value.dtype} tensor" if isinstance(value, Tensor) else type(value).__name__


def _token_ids(value) -> bool:
    """Whether ``value`` can be token ids: an integer tensor (not bool, float or complex)."""
    return isinstance(value, Tensor) and not (value.is_floating_point() or value.is_complex()
                                              or value.dtype == torch.bool)


def check_chunk_size(chunk_size) -> None:
    """Tokens per prefill forward: an integer ≥ 1."""
    check_int("chunk_size", chunk_size, 1)


def _frozen(forward):
    """``forward`` (a ``torch.compile``'d function) compiled with inductor's freezing: the setting is global and
    read when a graph is compiled (``torch.compile(..., options={"freezing": True})`` does not reach it), so
    every call — any compilation happens inside one — runs with it set."""
    import torch._inductor.config as inductor_config

    def call(*args, **kwargs):
        with inductor_config.patch(freezing=True):
            return forward(*args, **kwargs)

    return call


def compile_options(compile: bool | dict | None) -> dict | None:
    """Check ``compile`` (None/False: eager; True: ``torch.compile``'s defaults; a dict: its options) and return
    the ``torch.compile`` keyword arguments, or None for an eager step. Every mistake is one clear InputError
    here, not a compiler traceback at the first decoded token."""
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
    if options.get("fullgraph"):
        raise InputError("compile: fullgraph=True cannot hold for a stream — the stream's bookkeeping runs eagerly "
                         "at the decoder stack's entry and exit (one deliberate graph break); leave fullgraph out")
    for name in ("dynamic", "disable"):
        if options.get(name) is not None and not isinstance(options[name], bool):
            raise InputError(f"compile: {name} is True or False, got {options[name]!r}")
    backend = options.get("backend", "inductor")
    if not callable(backend):
        known = torch._dynamo.list_backends(exclude_tags=())
        if not isinstance(backend, str) or backend not in known:
            raise InputError(f"compile: unknown backend {backend!r}; torch.compile knows {', '.join(known)} "
                             "(or pass a callable)")
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
    if options.get("disable"):
        return None  # torch.compile(disable=True) is the eager function itself
    return options


class StreamSession:
    """An open stream: ``feed`` token ids (chunked), ``step`` one token per row, ``save`` / ``load`` the state.

    >>> with StreamSession(model, num_sinks=4, window=1020) as s:   # doctest: +SKIP
    ...     logits = s.feed(prompt_ids)          # [B, vocab] at the last position
    ...     logits = s.step(logits.argmax(-1))   # one new token per row
    """

    def __init__(self, model: nn.Module, num_sinks: int = 4, window: int = 1020, pinned=None,
                 start_position: int = 0, chunk_size: int = 256, rebase_every: int | None = None, *,
                 sliding_sinks: bool = False, compile: bool | dict | None = None, kv_bits: int | None = None,
                 kv_group_size: int = KV_GROUP_SIZE, compile_plan: bool = False, freeze: bool | None = None,
                 policy=None, plan=None, positions: str = "slot") -> None:
        from ..checks import check_model, check_weights

        check_model(model, "StreamSession")
        check_chunk_size(chunk_size)
        options = compile_options(compile)
        if freeze is not None and not isinstance(freeze, bool):
            raise InputError(f"freeze is True, False or None (automatic), got {freeze!r}")
        check_weights(model)  # NaN/inf weights: one clear error now, not garbage tokens later
        self.model = model
        self.chunk_size = chunk_size
        self.sink = SinkCache(model, num_sinks, window, pinned, start_position, rebase_every,
                              sliding_sinks=sliding_sinks, kv_bits=kv_bits, kv_group_size=kv_group_size,
                              compile_plan=compile_plan, policy=policy, plan=plan, positions=positions)
        self.kv_bits, self.kv_group_size = kv_bits, kv_group_size
        self.cache: Any = None  # the open SinkCache (set by __enter__)
        self._cache_kwarg = _compat.cache_kwarg_name(model)
        self._device = _compat.input_device(model)
        self.tokens_seen = 0
        self._restore: dict[str, Tensor] | None = None
        self._restore_recurrent: dict[str, dict] = {}  # saved recurrent layers' plain fields (StreamSession.load)
        # Decoding (``step``) through torch.compile; chunks (``feed``) stay eager. Compiled once per model forward.
        self.compile_options = options  # what torch.compile was given for step() (None: eager)
        compiled, options = options is not None, options or {}
        # freeze=None: on a CPU with inductor and no inductor options of the caller's, freeze — the weights become
        # constants of the graph and the projections prepacked matrices: SmolLM2 59.0 → 47.2–51.5 ms per token,
        # Gemma 3 270M 102.3 → 65.0–71.7 ms on a 2-core CPU VM, for a second, prepacked copy of the weights in memory
        # (docs/stream.md). A mode keeps it: mode="max-autotune-no-cudagraphs" lets inductor pick its C++ GEMM
        # templates for the frozen weights. The compiled forward holds the weights as they were when it was compiled.
        inductor = options.get("backend", "inductor") == "inductor"
        if freeze and not (compiled and inductor):
            raise InputError("freeze=True needs compile with torch.compile's inductor backend (freezing is one of "
                             "inductor's settings); drop freeze or compile with inductor")
        self.freezing = freeze if freeze is not None else (
            compiled and inductor and self._device.type == "cpu" and "options" not in options)
        self._step_forward = torch.compile(model.forward, **options) if compiled else model.forward
        if self.freezing:
            self._step_forward = _frozen(self._step_forward)

    def __enter__(self) -> StreamSession:
        self.cache = self.sink.__enter__()
        if self._restore is not None:
            self._load_tensors(self._restore)
            self._restore = None
        return self

    def __exit__(self, *exc: object) -> None:
        self.sink.__exit__(*exc)

    @property
    def state(self):
        return self.sink.state

    def _forward(self, ids: Tensor, mask: Tensor | None, forward=None) -> Tensor:
        kwargs = {"input_ids": ids, "use_cache": True, self._cache_kwarg: self.cache}
        if mask is not None:
            kwargs["attention_mask"] = mask
        return (forward or self.model)(**kwargs).logits

    @torch.no_grad()
    def feed(self, input_ids: Tensor, attention_mask: Tensor | None = None, *, all_logits: bool = False) -> Tensor:
        """Feed ``[B, T]`` ids (left padding marked by ``attention_mask``) in chunks of ``chunk_size``.

        Returns the logits at the last position ``[B, V]`` (or at every position ``[B, T, V]``); exactly what
        feeding the ids one by one would give.
        """
        self._check_open()
        if not _token_ids(input_ids):
            raise InputError(f"input_ids must be an integer tensor [batch, tokens], got {_describe(input_ids)}")
        if input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise InputError(f"input_ids must be [batch, tokens] with at least one token, got {tuple(input_ids.shape)}")
        device = _compat.input_device(self.model)
        input_ids = input_ids.to(device)
        outs = []
        for c0 in range(0, input_ids.shape[1], self.chunk_size):
            c1 = min(input_ids.shape[1], c0 + self.chunk_size)
            mask = None if attention_mask is None else attention_mask[:, c0:c1].to(device)
            logits = self._forward(input_ids[:, c0:c1], mask)
            outs.append(logits if all_logits else logits[:, -1:])
        self.tokens_seen += input_ids.shape[1]
        out = torch.cat(outs, dim=1)
        return out if all_logits else out[:, -1]

    @torch.no_grad()
    def step(self, token_ids: Tensor) -> Tensor:
        """Feed one token per row (``[B]``); returns the next-token logits ``[B, V]``."""
        self._check_open()
        if not _token_ids(token_ids):
            raise InputError(f"token_ids must be an integer tensor [batch], got {_describe(token_ids)}")
        self.tokens_seen += 1
        graphs = self.compile_options is not None and self._device.type == "cuda"
        if graphs:  # a new step: CUDA graphs (mode="reduce-overhead") may reuse the last step's output memory
            torch.compiler.cudagraph_mark_step_begin()
        # Planned by the cache before the call (its hooks stand aside): a compiled step is one graph.
        ids = token_ids.reshape(-1, 1).to(self._device)
        logits = self.sink.planned_forward(self._step_forward, input_ids=ids, use_cache=True,
                                           **{self._cache_kwarg: self.cache}).logits[:, -1]
        return logits.clone() if graphs else logits  # the caller's logits outlive the next replay

    def _check_open(self) -> None:
        if self.cache is None:
            raise InputError("use the session as a context manager: `with StreamSession(...) as s:`")
        if self.sink.closed:
            raise InputError("this stream session was closed (its `with` block ended); open a new one, or resume a "
                             "saved stream with StreamSession.load")

    # ------------------------------------------------------------------ persistence
    def save(self, path: str | Path) -> Path:
        """Write the cache and position counters to a safetensors file (resume with :meth:`load`)."""
        self._check_open()
        if self.sink.policy.scored:
            raise InputError(f"saving a stream is supported for the recency policy (streaming); the "
                             f"{self.sink.policy.name!r} policy's per-head token sets are not saved yet")
        if self.state.batch is None:
            raise InputError("nothing to save yet: feed the stream first")
        path = Path(path)
        if path.is_dir():
            raise InputError(f"{path} is a folder; give a file name (e.g. {path / 'stream.safetensors'})")
        tensors = {}
        for g, state in enumerate(self.sink.states):
            prefix = "" if g == 0 else f"group{g}."
            tensors.update({prefix + k: v for k, v in state.state_dict().items()})
        for i, layer in enumerate(self.cache.layers):
            if i in self.sink.recurrent_layers or not hasattr(layer, "is_initialized"):
                continue  # recurrent layers below; stateless ones hold nothing
            if layer.is_initialized and self.kv_bits is not None:  # the packed ring and the exact anchors
                tensors.update({f"layer.{i}.{k}": v.contiguous() for k, v in layer.state_tensors().items()})
                tensors[f"layer.{i}.head_dim"] = torch.tensor(layer.dh)
            elif layer.is_initialized:
                tensors[f"layer.{i}.keys"] = layer.keys.contiguous()
                tensors[f"layer.{i}.values"] = layer.values.contiguous()
                tensors[f"layer.{i}.anchor_keys"] = layer.anchor_keys.contiguous()
        recurrent = {}
        for i in self.sink.recurrent_layers:  # a hybrid's linear-attention / state-space / conv state, whole
            kept, recurrent[str(i)] = _recurrent_state(self.cache.layers[i])
            tensors.update({f"layer.{i}.recurrent.{k}": v.contiguous() for k, v in kept.items()})
        meta = {"format": _FORMAT, "settings": self._settings(),
                "columns": self.state.columns, "recurrent": recurrent,
                "tokens_seen": self.tokens_seen, "chunk_size": self.chunk_size}
        with atomic_file(path) as tmp:  # a failed or interrupted save leaves the previous file (or none)
            save_file({k: v.detach().cpu() for k, v in tensors.items()}, str(tmp), metadata={"sinklab": json.dumps(meta)})
        return path

    @classmethod
    def load(cls, model: nn.Module, path: str | Path) -> StreamSession:
        """A session that resumes the saved stream when entered (``with StreamSession.load(m, p) as s:``)."""
        from safetensors import SafetensorError, safe_open

        if not Path(path).is_file():
            raise InputError(f"{path}: no such stream file" + (" (it is a folder)" if Path(path).is_dir() else ""))
        try:
            with safe_open(str(path), framework="pt") as f:
                raw = (f.metadata() or {}).get("sinklab")
        except SafetensorError as exc:
            raise InputError(f"{path} is not a safetensors file written by StreamSession.save ({exc})") from exc
        if raw is None:
            raise InputError(f"{path} is not a sinklab stream file (no sinklab metadata)")
        meta = json.loads(raw)
        if meta.get("format") != _FORMAT:
            raise InputError(f"{path}: unsupported stream format {meta.get('format')!r}")
        s = meta["settings"]
        session = cls(model, s["num_sinks"], s["window"], [tuple(p) for p in s["pinned"]], s["start_position"],
                      meta["chunk_size"], s["rebase_every"], sliding_sinks=s.get("sliding_sinks", False),
                      kv_bits=s.get("kv_bits"), kv_group_size=s.get("kv_group_size", KV_GROUP_SIZE))
        if len(session.sink.states) != s.get("groups", 1):
            raise InputError(f"{path} was saved from a model with {s.get('groups', 1)} layer budgets; this one has "
                             f"{len(session.sink.states)} — load it with the model that wrote it")
        # Cloned: tensors read from the file sit wherever its header puts them, and a misaligned buffer changes
        # the summation order of vectorised kernels (a resumed stream would differ in the last bit).
        tensors = {k: v.clone() for k, v in load_file(str(path), device=str(_compat.input_device(model))).items()}
        tensors["__columns__"] = torch.tensor(meta["columns"])
        saved = sorted(int(i) for i in meta.get("recurrent", {}))
        if saved != sorted(session.sink.recurrent_layers):
            raise InputError(f"{path} holds the recurrent state of layers {saved}; this model's recurrent layers are "
                             f"{sorted(session.sink.recurrent_layers)} — load it with the model that wrote it")
        session._restore_recurrent = meta.get("recurrent", {})
        session._restore = tensors
        session.tokens_seen = meta["tokens_seen"]
        return session

    def _load_tensors(self, tensors: dict[str, Tensor]) -> None:
        for key, fields in self._restore_recurrent.items():
            prefix = f"layer.{key}.recurrent."
            _restore_recurrent_state(self.cache.layers[int(key)], fields,
                                     {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)})
        for g, state in enumerate(self.sink.states):
            prefix = "state." if g == 0 else f"group{g}.state."
            state.load_state_dict({k[len(prefix) - 6:]: v for k, v in tensors.items() if k.startswith(prefix)},
                                  int(tensors["__columns__"]))
        for i, layer in enumerate(self.cache.layers):
            if i in self.sink.recurrent_layers:
                continue
            if f"layer.{i}.ring_packed" in tensors:
                prefix = f"layer.{i}."
                layer.load_state_tensors({k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)},
                                         int(tensors[prefix + "head_dim"]))
            elif f"layer.{i}.keys" in tensors:
                layer.keys = tensors[f"layer.{i}.keys"]
                layer.values = tensors[f"layer.{i}.values"]
                layer.anchor_keys = tensors[f"layer.{i}.anchor_keys"]
                layer.device, layer.dtype = layer.keys.device, layer.keys.dtype
                layer.mark_static()
                layer.is_initialized = True

    def _settings(self) -> dict:
        """What :meth:`load` needs to rebuild this session's cache (the main state's budget; the others follow)."""
        main = self.sink.state
        return {"num_sinks": main.num_sinks, "window": main.window, "pinned": main.pinned,
                "start_position": main.start_position, "rebase_every": main.rebase_every,
                "sliding_sinks": self.sink.sliding_sinks, "groups": len(self.sink.states),
                "kv_bits": self.kv_bits, "kv_group_size": self.kv_group_size}

    def cache_tokens(self) -> int:
        """Kept tokens per row (the cache's size in tokens, at most ``S + P + W``; a score-based policy: the mean over
        its layers and heads)."""
        return self.state.kept_tokens() if self.state.batch is not None else 0


def _recurrent_state(layer: object) -> tuple[dict[str, Tensor], dict]:
    """A recurrent cache layer's state (transformers' linear-attention layer: per-state dicts of conv / recurrent
    tensors and flags, a length counter) as tensors ``{"field" | "field.key": tensor}`` and JSON fields."""
    tensors, fields = {}, {}
    for name, value in vars(layer).items():
        if isinstance(value, Tensor):
            tensors[name] = value
        elif isinstance(value, dict):
            plain = {}
            for key, item in value.items():
                if isinstance(item, Tensor):
                    tensors[f"{name}.{key}"] = item
                elif item is None or isinstance(item, (bool, int, float, str)):
                    plain[str(key)] = item
            fields[name] = {"dict": plain, "int_keys": all(isinstance(k, int) for k in value)}
        elif value is None or isinstance(value, (bool, int, float, str)):
            fields[name] = {"value": value}
    return tensors, fields


def _restore_recurrent_state(layer: Any, fields: dict, tensors: dict[str, Tensor]) -> None:
    """Put back what :func:`_recurrent_state` took from a layer of the same class."""
    for name, field in fields.items():
        if "value" in field:
            setattr(layer, name, field["value"])
            continue
        cast = int if field["int_keys"] else str
        restored = {cast(k): v for k, v in field["dict"].items()}
        prefix = f"{name}."
        restored.update({cast(k[len(prefix):]): v for k, v in tensors.items() if k.startswith(prefix)})
        setattr(layer, name, restored)
    for name, value in tensors.items():
        if "." not in name:
            setattr(layer, name, value)
    first = next((v for k, v in sorted(tensors.items(), key=lambda kv: not kv[0].startswith("conv_states."))
                  if "." in k), None)  # transformers takes the layer's dtype and device from its conv state
    if first is not None and hasattr(layer, "device"):
        layer.device, layer.dtype = first.device, first.dtype


def sample_token(logits: Tensor, temperature: float, top_k: int, gen: torch.Generator | None) -> Tensor:
    """One token per row of ``logits`` ``[B, V]``: argmax when ``temperature ≤ 0``, else top-k sampling → ``[B]``."""
    if temperature <= 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k > 0:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, -1).cpu(), 1, generator=gen)[:, 0].to(logits.device)


class TextPieces:
    """Turn generated token ids into the text each one adds, decoding with a little context so word pieces
    and byte-level BPE join correctly; special tokens (``</s>``, ``<|im_end|>`` …) print as nothing."""

    def __init__(self, tokenizer, context: list[int]) -> None:
        self.tokenizer = tokenizer
        self.tail = list(context[-4:])

    def add(self, token: int) -> str:
        before = self.tokenizer.decode(self.tail, skip_special_tokens=True)
        text = self.tokenizer.decode(self.tail + [token], skip_special_tokens=True)
        self.tail = (self.tail + [token])[-4:]
        return text[len(before):]


def check_sampling(max_new_tokens, temperature, top_k, seed) -> None:
    """InputErrors for generation settings: an integer length ≥ 0, a finite temperature ≥ 0 (0: greedy), an
    integer top-k ≥ 0 (0: off) and an integer seed."""
    import math
    import numbers

    check_int("max_new_tokens", max_new_tokens, 0)
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) or not math.isfinite(temperature) \
            or temperature < 0:
        raise InputError(f"temperature must be a finite number ≥ 0 (0: greedy), got {temperature!r}")
    check_int("top_k", top_k, 0, " (0: the whole vocabulary)")
    if not is_int(seed):
        raise InputError(f"seed must be an integer, got {seed!r}")


def _check_session(session, model, **given) -> None:
    """``stream_generate(..., session=s)`` continues ``s``: its model and settings are the session's, so a
    different model, or a setting that differs from both the default and the session's, is an error."""
    if not isinstance(session, StreamSession):
        raise InputError(f"session is an open StreamSession, got {type(session).__name__}")
    if session.model is not model:
        raise InputError("session was opened on a different model than the one given; pass the session's model")
    if given.pop("compile") is not None or given.pop("freeze") is not None:
        raise InputError("compile and freeze belong to the session: set them on StreamSession(...), not here")
    state = session.state
    pinned = given.pop("pinned")
    if pinned is not None and any(tuple(p) not in state.pinned for p in pinned):
        raise InputError(f"pinned={pinned!r}: pins are fixed when a stream starts; this session pins "
                         f"{state.pinned or 'nothing'}")
    defaults = inspect.signature(stream_generate).parameters
    own = {"num_sinks": state.num_sinks, "window": state.window, "chunk_size": session.chunk_size}
    for name, value in given.items():
        if value != defaults[name].default and value != own[name]:
            raise InputError(f"{name}={value!r} differs from the session's {name}={own[name]!r}; a session's "
                             "settings are fixed when it is created")


def stream_generate(model: nn.Module, tokenizer, prompt: str | list[str], *, num_sinks: int = 4, window: int = 1020,
                    pinned=None, pin_prompt: bool = False, max_new_tokens: int = 256, temperature: float = 0.0,
                    top_k: int = 0, seed: int = 0, chunk_size: int = 256, stop_at_eos: bool = True,
                    session: StreamSession | None = None, compile: bool | dict | None = None,
                    freeze: bool | None = None) -> Iterator[str | list[str]]:
    """Generate from ``prompt`` in constant memory, yielding each new piece of text as it comes.

    A list of prompts is left-padded into one batch (each row's sinks are its own first real tokens) and
    yields a list of pieces per step. ``pin_prompt`` keeps the whole prompt forever (the longest one in a
    batch decides the span). Pass an open ``session`` to continue a stream.
    """
    batch = isinstance(prompt, list)
    prompts = prompt if batch else [prompt]
    if not prompts or any(not p for p in prompts):
        raise InputError("the prompt is empty")
    if any(not isinstance(p, str) for p in prompts):
        raise InputError(f"the prompt is a string or a list of strings, got {_describe(prompt)}")
    check_sampling(max_new_tokens, temperature, top_k, seed)
    if tokenizer is None or not callable(tokenizer):
        raise InputError("stream_generate needs the model's tokenizer (e.g. sinklab.load_model(...).tokenizer)")
    if session is not None:
        _check_session(session, model, num_sinks=num_sinks, window=window, chunk_size=chunk_size, pinned=pinned,
                       compile=compile, freeze=freeze)
    encoded = [tokenizer(p)["input_ids"] for p in prompts]
    width = max(len(e) for e in encoded)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.full((len(encoded), width), int(pad), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, e in enumerate(encoded):
        ids[row, width - len(e):] = torch.tensor(e)
        mask[row, width - len(e):] = 1
    if pin_prompt:
        span = (0, max(len(e) for e in encoded) + register_count(model))  # a variant's registers come first
        if session is not None and not any(a <= 0 and span[1] <= b for a, b in session.state.pinned):
            raise InputError(f"pin_prompt with an open session: the session must have been built with pinned="
                             f"[{span}] (pins are fixed when a stream starts)")
        pinned = list(pinned or []) + [span]
    if session is not None:
        session._check_open()
    own = session is None
    session = session or StreamSession(model, num_sinks, window, pinned, chunk_size=chunk_size, compile=compile,
                                       freeze=freeze)
    # Everything above runs at the call (bad arguments raise there); the tokens come as the caller iterates.
    return _pieces(session, own, ids, mask, encoded, tokenizer, batch, max_new_tokens, temperature, top_k, seed,
                   stop_at_eos)


def _pieces(session: StreamSession, own: bool, ids: Tensor, mask: Tensor, encoded: list, tokenizer, batch: bool,
            max_new_tokens: int, temperature: float, top_k: int, seed: int,
            stop_at_eos: bool) -> Iterator[str | list[str]]:
    """:func:`stream_generate`'s generator: feed the prompt, then sample and step one token at a time."""
    gen = torch.Generator().manual_seed(seed)
    eos = tokenizer.eos_token_id
    if own:
        session.__enter__()
    try:
        logits = session.feed(ids, mask if not bool(mask.all()) else None)
        done = torch.zeros(len(encoded), dtype=torch.bool)
        decoders = [TextPieces(tokenizer, e) for e in encoded]
        for _ in range(max_new_tokens):
            token = sample_token(logits, temperature, top_k, gen)
            pieces = [("" if d else dec.add(t)) for t, d, dec in zip(token.tolist(), done.tolist(), decoders)]
            if eos is not None and stop_at_eos:
                done |= token.cpu() == eos
            yield pieces if batch else pieces[0]
            if stop_at_eos and bool(done.all()):
                break
            logits = session.step(token)
    finally:
        if own:
            session.__exit__(None, None, None)
