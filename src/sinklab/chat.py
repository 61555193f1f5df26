"""``ChatStream``: an endless multi-turn chat through one persistent stream (StreamingLLM's chatbot); an application
above :mod:`sinklab.stream`, which it uses through ``StreamSession``.

Each user turn is rendered with the model's chat template (:data:`PLAIN_TEMPLATE` without one); only the text the
stream has not consumed yet is tokenized and fed, and the answer is generated into the same cache, which never grows
past ``S + P + W`` tokens (sinks, pinned system prompt, window). Usage: docs/chat.md.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import nn

from .errors import InputError, check_int
from .stream.config import StreamConfig, resolve_config
from .stream.session import StreamSession, TextPieces, check_chunk_size, check_sampling, file_metadata, sample_token
from .variants import register_count

__all__ = ["PLAIN_TEMPLATE", "ChatStream", "Meter", "Turn"]

#: The layout used when the tokenizer has no chat template of its own.
PLAIN_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}\n\n"
                  "{% else %}{{ m['role'] | capitalize }}: {{ m['content'] }}\n{% endif %}{% endfor %}"
                  "{% if add_generation_prompt %}Assistant:{% endif %}")
_CHAT_KEY = "sinklab.chat"


@dataclass
class Turn:
    """One exchange: the user's text, the ids fed for it (template included) and the answer's ids/text."""

    user: str
    prompt_ids: list[int]
    answer_ids: list[int] = field(default_factory=list)
    answer: str = ""
    stopped: str = ""  # "eos", "length" or "interrupted"
    seconds: float = 0.0


@dataclass
class Meter:
    """The cache after an answer: tokens kept, evicted and pinned, and the answer's speed."""

    kept: int
    evicted: int
    pinned: int
    capacity: int
    tokens_seen: int
    answer_tokens: int
    tok_s: float

    def line(self) -> str:
        return (f"[cache {self.kept}/{self.capacity} kept · {self.evicted} evicted · {self.pinned} pinned · "
                f"{self.answer_tokens} tokens at {self.tok_s:.1f} tok/s]")


def _stop_ids(model: nn.Module, tokenizer) -> set[int]:
    """Token ids that end an answer: the tokenizer's EOS and the generation config's (a list for some models)."""
    ids = set()
    for source in (getattr(tokenizer, "eos_token_id", None), getattr(getattr(model, "generation_config", None),
                                                                     "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(int(i) for i in source)
    return ids


class ChatStream:
    """A chat whose whole history runs through one :class:`StreamSession` (constant memory).

    ``system``: a prompt pinned forever; ``config`` or the keywords of :class:`~sinklab.stream.SinkCache` (and
    ``chunk_size``): the stream; per answer a length limit, greedy at ``temperature`` 0, else sampled from one
    generator seeded once per chat (a scripted chat is reproducible); ``compile``: the decode step's
    ``torch.compile`` as :class:`StreamSession` takes it (None: the default path)."""

    def __init__(self, model: nn.Module, tokenizer, *, system: str | None = None, config: StreamConfig | None = None,
                 max_new_tokens: int = 256, temperature: float = 0.0, top_k: int = 0, seed: int = 0,
                 compile: bool | dict | None = None, **stream) -> None:
        check_sampling(max_new_tokens, temperature, top_k, seed)
        check_int("max_new_tokens", max_new_tokens, 1)
        self.chunk_size = stream.pop("chunk_size", 256)
        self.compile = compile
        window = stream.pop("window", 1020 if config is None else None)
        config = resolve_config(model, config, stream.pop("num_sinks", None), window, stream)
        check_chunk_size(self.chunk_size)
        if tokenizer is None:
            raise InputError("chat needs a tokenizer (this checkpoint has none)")
        self.model, self.tokenizer = model, tokenizer
        self.system = system or None
        self.config = config
        self.max_new_tokens, self.temperature, self.top_k, self.seed = max_new_tokens, temperature, top_k, seed
        self.template = getattr(tokenizer, "chat_template", None) or PLAIN_TEMPLATE
        self.own_template = self.template is not PLAIN_TEMPLATE
        self.stop_ids = _stop_ids(model, tokenizer)
        self.session: StreamSession | None = None
        self._stop = False
        self._start_fresh()

    # ------------------------------------------------------------------ lifetime
    def _render(self, messages: list[dict], generation: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, chat_template=self.template, tokenize=False,
                                                  add_generation_prompt=generation)

    def _encode(self, text: str, first: bool) -> list[int]:
        # A real chat template writes its own special tokens; the plain layout lets the tokenizer add BOS once.
        return list(self.tokenizer(text, add_special_tokens=first and not self.own_template)["input_ids"])

    def _start_fresh(self) -> None:
        self.messages: list[dict] = [{"role": "system", "content": self.system}] if self.system else []
        self.rendered = ""  # every character the stream has consumed, as text
        self.turns: list[Turn] = []
        self.pinned_tokens = 0
        config = self.config
        if self.system:
            n = len(self._encode(self._render(self.messages, False), True)) + register_count(self.model)
            config, self.pinned_tokens = replace(config, pinned=(*config.pinned, (0, n))), n
        self._session = StreamSession(self.model, config=config, chunk_size=self.chunk_size, compile=self.compile)
        self._gen = torch.Generator().manual_seed(self.seed)

    def __enter__(self) -> ChatStream:
        self.session = self._session.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.session is not None:
            self.session.__exit__(None, None, None)
            self.session = None

    def reset(self) -> None:
        """Forget the conversation: a new stream (the system prompt, if any, is pinned again)."""
        self.close()
        self._start_fresh()
        self.__enter__()

    # ------------------------------------------------------------------ one turn
    def stop(self) -> None:
        """Ask the running answer to stop after its current token (safe from a signal handler)."""
        self._stop = True

    def _new_text(self, user: str) -> str:
        """The text the stream must consume for this user turn: what the template adds since the last answer."""
        full = self._render(self.messages + [{"role": "user", "content": user}], True)
        if full.startswith(self.rendered):
            return full[len(self.rendered):]
        # A template that reformats earlier messages (e.g. trims the answer): keep what the stream has, close
        # the last answer the way the template does and append the new turn.
        before = self._render(self.messages, False)
        answer = self.messages[-1]["content"].strip() if self.messages else ""
        closing = before[before.rfind(answer) + len(answer):] if answer and answer in before else ""
        return closing + full[len(before):]

    def turn(self, user: str) -> Iterator[str]:
        """Feed one user message and yield the answer's text pieces as they are generated."""
        if self.session is None:
            raise RuntimeError("use the chat as a context manager: `with ChatStream(...) as chat:`")
        if not user.strip():
            raise InputError("the message is empty")
        text = self._new_text(user)
        ids = self._encode(text, first=not self.rendered)
        record = Turn(user=user, prompt_ids=ids)
        self.turns.append(record)
        self.messages.append({"role": "user", "content": user})
        self.rendered += text
        self._stop = False
        start = time.perf_counter()
        logits = self.session.feed(torch.tensor([ids]))
        pieces = TextPieces(self.tokenizer, ids)
        record.stopped = "length"
        try:
            for _ in range(self.max_new_tokens):
                token = int(sample_token(logits, self.temperature, self.top_k, self._gen)[0])
                if token in self.stop_ids:  # not fed: the next turn's template text closes the answer
                    record.stopped = "eos"
                    break
                # Fed at once, so the stream always holds exactly the answer's tokens, whatever stops it.
                logits = self.session.step(torch.tensor([token]))
                record.answer_ids.append(token)
                piece = pieces.add(token)
                record.answer += piece
                yield piece
                if self._stop:
                    record.stopped = "interrupted"
                    break
        finally:
            answer = self.tokenizer.decode(record.answer_ids, skip_special_tokens=False)
            self.messages.append({"role": "assistant", "content": answer})
            self.rendered += answer
            record.seconds = time.perf_counter() - start

    # ------------------------------------------------------------------ state
    def meter(self) -> Meter:
        """Kept / evicted / pinned tokens of the cache and the last answer's speed."""
        s = self.session
        kept = s.cache_tokens() if s is not None else 0
        seen = s.tokens_seen if s is not None else 0
        last = self.turns[-1] if self.turns else None
        n = len(last.answer_ids) if last else 0
        return Meter(kept=kept, evicted=max(0, seen - kept), pinned=self.pinned_tokens,
                     capacity=s.state.capacity if s is not None else 0, tokens_seen=seen, answer_tokens=n,
                     tok_s=n / last.seconds if last and last.seconds > 0 else 0.0)

    def save(self, path: str | Path) -> Path:
        """Write the stream (``StreamSession.save``, atomic) with the conversation in its metadata."""
        path = Path(path)
        if path.is_dir():
            raise InputError(f"{path} is a folder; give a file name such as chat.safetensors")
        if not path.parent.exists():
            raise InputError(f"cannot save to {path}: folder {path.parent} does not exist")
        chat = json.dumps({"messages": self.messages, "rendered": self.rendered, "system": self.system,
                           "pinned_tokens": self.pinned_tokens, "template": self.template})
        return self.session.save(path, {_CHAT_KEY: chat})  # type: ignore[union-attr]  # (a closed chat fails here)

    def load(self, path: str | Path) -> None:
        """Continue the chat saved in ``path`` (its stream settings come with it)."""
        if not Path(path).is_file():
            raise InputError(f"{path}: no such file")
        raw = file_metadata(path).get(_CHAT_KEY)
        if raw is None:
            raise InputError(f"{path} holds a stream but no chat; save chats with /save")
        chat = json.loads(raw)
        if chat["template"] != self.template:
            raise InputError(f"{path} was saved with another chat template; load it with the model that wrote it")
        session = StreamSession.load(self.model, path)
        self.close()
        self._session = session
        self.__enter__()
        self.messages, self.rendered, self.system = chat["messages"], chat["rendered"], chat["system"]
        self.pinned_tokens, self.turns = chat["pinned_tokens"], []
