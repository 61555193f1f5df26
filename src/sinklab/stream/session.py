"""``StreamSession`` and ``stream_generate``: unbounded streams in constant memory, with save/resume.

``model.generate`` grows its own per-step tensors (``input_ids``, ``attention_mask``) with the stream;
a session keeps only the cache and the last token, so a stream can run for millions of tokens.
"""

from __future__ import annotations

import inspect
import json
import math
import numbers
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from .. import _compat
from ..atomic import atomic_file
from ..compile import compile_options
from ..fastpath import compiled_step, decode_layout, resolve_compile, restore_layout
from ..errors import InputError, check_int, is_int
from ..variants import register_count
from .cache import SinkCache
from .config import StreamConfig

__all__ = ["StreamSession", "TextPieces", "check_chunk_size", "check_sampling", "compile_options", "sample_token",
           "stream_generate"]

_FORMAT = "sinklab.stream/2"


def _describe(value) -> str:
    return f"a {value.dtype} tensor" if isinstance(value, Tensor) else type(value).__name__


def _token_ids(value) -> bool:
    """Whether ``value`` can be token ids: an integer tensor (not bool, float or complex)."""
    return isinstance(value, Tensor) and not (value.is_floating_point() or value.is_complex()
                                              or value.dtype == torch.bool)


def check_chunk_size(chunk_size) -> None:
    """Tokens per prefill forward: an integer ≥ 1."""
    check_int("chunk_size", chunk_size, 1)


#: Why ``compile={"fullgraph": True}`` is refused for a stream's decode step.
_NO_FULLGRAPH = ("a stream — the stream's bookkeeping runs eagerly at the decoder stack's entry and exit "
                 "(one deliberate graph break)")


class StreamSession:
    """An open stream: ``feed`` token ids (chunked), ``step`` one token per row, ``save`` / ``load`` the state.

    >>> with StreamSession(model, num_sinks=4, window=1020) as s:   # doctest: +SKIP
    ...     logits = s.feed(prompt_ids)          # [B, vocab] at the last position
    ...     logits = s.step(logits.argmax(-1))   # one new token per row
    """

    def __init__(self, model: nn.Module, num_sinks: int | None = None, window: int | None = None, *,
                 config: StreamConfig | None = None, chunk_size: int = 256, compile: bool | dict | None = None,
                 freeze: bool | None = None, **settings) -> None:
        """``config`` (or the keywords of :class:`~sinklab.stream.SinkCache`; the window defaults to 1020, and a
        plan is re-budgeted to it) sets the stream; ``chunk_size``: tokens per prefill forward; ``compile``: decode
        through ``torch.compile`` (True or its options), eagerly (False), or (None) as
        :func:`sinklab.fastpath.resolve_compile` picks; ``freeze``: inductor's freezing (None: on a CPU)."""
        from ..checks import check_model, check_weights

        check_model(model, "StreamSession")
        check_chunk_size(chunk_size)
        chosen, automatic = resolve_compile(compile, model)
        options = compile_options(chosen, _NO_FULLGRAPH)
        if freeze is not None and not isinstance(freeze, bool):
            raise InputError(f"freeze is True, False or None (automatic), got {freeze!r}")
        check_weights(model)  # NaN/inf weights: one clear error now, not garbage tokens later
        self.model = model
        self.chunk_size = chunk_size
        if config is None and window is None:
            window = 1020
        self.sink = SinkCache(model, num_sinks, window, config=config, **settings)
        self.config: StreamConfig = self.sink.config
        self._given = {"compile": compile, "freeze": freeze}  # what save() writes, for load() to rebuild
        self.cache: Any = None  # the open SinkCache (set by __enter__)
        self._cache_kwarg = _compat.cache_kwarg_name(model)
        self._device = _compat.input_device(model)
        self.tokens_seen = 0
        self._laid_out = False  # this session holds the model's decode layout (fastpath.decode_layout): eager steps
        self._restore: dict | None = None  # a loaded stream's state, put back on __enter__
        # Decoding (``step``) through torch.compile; chunks (``feed``) stay eager. Compiled once per model forward.
        self.compile_options = options  # what torch.compile was given for step() (None: eager)
        compiled, options = options is not None, options or {}
        # freeze=None: on a CPU with inductor and no inductor options of the caller's, freeze (weights as graph
        # constants, prepacked projections; a mode keeps it; the graph holds the weights as compiled: docs/stream.md).
        inductor = options.get("backend", "inductor") == "inductor"
        if freeze and not (compiled and inductor):
            raise InputError("freeze=True needs compile with torch.compile's inductor backend (freezing is one of "
                             "inductor's settings); drop freeze or compile with inductor")
        # sinklab's own (automatic) compile does not freeze: a frozen graph bypasses inductor's on-disk caches.
        self.freezing = freeze if freeze is not None else (
            compiled and inductor and self._device.type == "cpu" and "options" not in options and not automatic)
        self._step_forward = compiled_step(model.forward, options, freezing=self.freezing, automatic=automatic) \
            if compiled else model.forward

    def __enter__(self) -> StreamSession:
        self.cache = self.sink.__enter__()
        if self._restore is not None:
            self.sink.load_state_dict(self._restore)
            self._restore = None
        return self

    def __exit__(self, *exc: object) -> None:
        self.sink.__exit__(*exc)
        if self._laid_out:
            restore_layout(self.model)
            self._laid_out = False

    @property
    def state(self):
        return self.sink.state

    @property
    def kv_bits(self) -> int | None:
        return self.config.kv_bits

    @property
    def kv_group_size(self) -> int:
        return self.config.kv_group_size

    @torch.no_grad()
    def feed(self, input_ids: Tensor, attention_mask: Tensor | None = None, *, all_logits: bool = False) -> Tensor:
        """Feed ``[B, T]`` ids (left padding marked by ``attention_mask``) in chunks of ``chunk_size``; the logits at
        the last position ``[B, V]`` (or at every position ``[B, T, V]``), exactly as when fed one by one."""
        self._check_open()
        if not _token_ids(input_ids):
            raise InputError(f"input_ids must be an integer tensor [batch, tokens], got {_describe(input_ids)}")
        if input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise InputError(f"input_ids must be [batch, tokens] with at least one token, got {tuple(input_ids.shape)}")
        device = _compat.input_device(self.model)
        input_ids = input_ids.to(device)
        outs, kwargs = [], {"use_cache": True, self._cache_kwarg: self.cache}
        for c0 in range(0, input_ids.shape[1], self.chunk_size):
            c1 = min(input_ids.shape[1], c0 + self.chunk_size)
            if attention_mask is not None:
                kwargs["attention_mask"] = attention_mask[:, c0:c1].to(device)
            logits = self.model(input_ids=input_ids[:, c0:c1], **kwargs).logits
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
        # An eager step reads float32 CPU projections stored input-major (fastpath.decode_layout); a compiled step
        # reads them as stored (its products are inductor's own reductions over the weight's rows).
        eager = self.compile_options is None or getattr(self._step_forward, "runs_eager", False)
        if eager != self._laid_out:
            if eager:
                decode_layout(self.model)
            else:
                restore_layout(self.model)
            self._laid_out = eager
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
    def save(self, path: str | Path, metadata: dict[str, str] | None = None) -> Path:
        """Write the stream (config, session settings, every ``state_dict``) to a safetensors file, atomically, with
        ``metadata`` as more string entries; :meth:`load` resumes it."""
        self._check_open()
        if self.state.batch is None:
            raise InputError("nothing to save yet: feed the stream first")
        path = Path(path)
        if path.is_dir():
            raise InputError(f"{path} is a folder; give a file name (e.g. {path / 'stream.safetensors'})")
        tensors, plain = split_tree(self.sink.state_dict())
        meta = {"format": _FORMAT, "config": self.config.to_json(), "chunk_size": self.chunk_size,
                **self._saved_compile(), "tokens_seen": self.tokens_seen, "state": plain}
        with atomic_file(path) as tmp:  # a failed or interrupted save leaves the previous file (or none)
            save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp),
                      metadata={**(metadata or {}), "sinklab": json.dumps(meta)})
        return path

    def _saved_compile(self) -> dict:
        """``compile``/``freeze`` as given, for the file; options JSON cannot hold (a callable backend) are left out,
        with a warning (the resumed stream decodes eagerly)."""
        try:
            json.dumps(self._given)
            return dict(self._given)
        except TypeError:
            warnings.warn("the compile options hold a callable, which a stream file cannot: the resumed stream "
                          "decodes eagerly (pass compile= again after StreamSession.load)", UserWarning, stacklevel=3)
            return {"compile": None, "freeze": None}

    @classmethod
    def load(cls, model: nn.Module, path: str | Path) -> StreamSession:
        """A session that resumes the saved stream when entered (``with StreamSession.load(m, p) as s:``), made with
        every setting the saved one had."""
        meta = _read_meta(path)
        session = cls(model, config=StreamConfig.from_json(meta["config"]), chunk_size=meta["chunk_size"],
                      compile=meta["compile"], freeze=meta["freeze"])
        # Cloned: tensors read from the file sit wherever its header puts them, and a misaligned buffer changes
        # the summation order of vectorised kernels (a resumed stream would differ in the last bit).
        tensors = {k: v.clone() for k, v in load_file(str(path), device=str(_compat.input_device(model))).items()}
        saved = join_tree(tensors, meta["state"])
        session.sink.check_state_dict(saved, f"{path}")
        session._restore = saved
        session.tokens_seen = meta["tokens_seen"]
        return session

    def cache_tokens(self) -> int:
        """Kept tokens per row (the cache's size in tokens, at most ``S + P + W``; a score-based policy: the mean over
        its layers and heads)."""
        return self.state.kept_tokens() if self.state.batch is not None else 0


def file_metadata(path: str | Path) -> dict[str, str]:
    """The string metadata of a stream file, or an InputError that says what the file is not."""
    from safetensors import SafetensorError, safe_open

    if not Path(path).is_file():
        raise InputError(f"{path}: no such stream file" + (" (it is a folder)" if Path(path).is_dir() else ""))
    try:
        with safe_open(str(path), framework="pt") as f:
            return f.metadata() or {}
    except SafetensorError as exc:
        raise InputError(f"{path} is not a safetensors file written by StreamSession.save ({exc})") from exc


def _read_meta(path: str | Path) -> dict:
    """The sinklab metadata of a stream file, or an InputError that says what the file is not."""
    raw = file_metadata(path).get("sinklab")
    if raw is None:
        raise InputError(f"{path} is not a sinklab stream file (no sinklab metadata)")
    meta = json.loads(raw)
    if meta.get("format") != _FORMAT:
        raise InputError(f"{path}: unsupported stream format {meta.get('format')} (this sinklab reads {_FORMAT}; "
                         "for a file of an earlier sinklab, start the stream again and save it anew)")
    return meta


def split_tree(tree: dict, prefix: str = "") -> tuple[dict[str, Tensor], dict]:
    """A nested ``state_dict`` as its tensors by dotted key (what a safetensors file holds) and the rest, nested as
    it was (JSON: counters, flags); :func:`join_tree` is the inverse."""
    tensors: dict[str, Tensor] = {}
    plain: dict = {}
    for key, value in tree.items():
        if isinstance(value, Tensor):
            tensors[prefix + key] = value
        elif isinstance(value, dict):
            inner, plain[key] = split_tree(value, f"{prefix}{key}.")
            tensors.update(inner)
        else:
            plain[key] = value
    return tensors, plain


def join_tree(tensors: dict[str, Tensor], plain: dict) -> dict:
    """Put the tensors of :func:`split_tree` back into (a copy of) the nested rest."""
    tree = json.loads(json.dumps(plain))
    for key, value in tensors.items():
        *parents, leaf = key.split(".")
        node = tree
        for name in parents:
            node = node.setdefault(name, {})
        node[leaf] = value
    return tree


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
    session = session or StreamSession(model, num_sinks, window, pinned=pinned, chunk_size=chunk_size,
                                       compile=compile, freeze=freeze)
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
