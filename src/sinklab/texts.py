"""Inputs for a scan: the embedded default corpus and tokenisation into fixed-length windows."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import Tensor

from .errors import InputError, is_int

__all__ = ["default_texts", "TokenBatch", "tokenize_windows", "special_affixes", "readable_token", "readable_tokens", "byte_level_text"]


def default_texts(limit: int | None = None) -> list[str]:
    """English paragraphs that ship with Python itself (``pydoc_data.topics``): no download, deterministic."""
    from pydoc_data.topics import topics

    texts = []
    for key in sorted(topics):
        body = " ".join(topics[key].split())
        if len(body) >= 400:
            texts.append(body)
    return texts if limit is None else texts[:limit]


def special_affixes(tokenizer) -> tuple[list[int], list[int]]:
    """Special token ids the tokenizer puts before and after a text (e.g. ``[CLS]``/``[SEP]`` or ``<s>``)."""
    probe = "sinklab probe text"
    plain = tokenizer(probe, add_special_tokens=False)["input_ids"]
    full = tokenizer(probe, add_special_tokens=True)["input_ids"]
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return list(full[:start]), list(full[start + len(plain) :])
    return [], []


@dataclass
class TokenBatch:
    """Right-padded token windows: ``input_ids``/``attention_mask`` ``[S, T]`` and token strings."""

    input_ids: Tensor
    attention_mask: Tensor
    tokens: list[list[str]]
    added_bos: bool

    def batches(self, batch_size: int):
        """Yield ``(slice, {'input_ids', 'attention_mask'})`` trimmed to each batch's longest sample."""
        for start in range(0, self.input_ids.shape[0], batch_size):
            stop = min(start + batch_size, self.input_ids.shape[0])
            mask = self.attention_mask[start:stop]
            width = int(mask.sum(-1).max())
            yield slice(start, stop), {
                "input_ids": self.input_ids[start:stop, :width],
                "attention_mask": mask[:, :width],
            }


def tokenize_windows(tokenizer, texts: list[str], seq_len: int, samples: int, seed: int = 0) -> TokenBatch:
    """Cut ``texts`` into at most ``samples`` windows of at most ``seq_len`` tokens (special tokens included).

    Windows are taken round-robin: the first window of every text, then the second of every text …
    so a handful of long texts still gives varied samples. Each window gets the tokenizer's own
    special tokens (BOS or [CLS] … [SEP]) as a normal encoding would. ``seed`` 0 takes the texts in
    order from their first token; another seed shuffles the texts and starts each one at a random
    token offset (less than one window), so different seeds give different, reproducible samples.
    """
    if tokenizer is None or not callable(tokenizer):
        raise InputError("a tokenizer is needed to cut texts into windows (sinklab.load_model(...).tokenizer); "
                         "this model was loaded without one — scan prepared inputs with scan_inputs instead")
    if not is_int(seq_len) or seq_len < 2:
        raise InputError(f"--seq-len must be at least 2 tokens to measure attention sinks, got {seq_len!r}")
    if not is_int(samples) or samples < 1:
        raise InputError(f"--samples must be at least 1, got {samples!r}")
    if not is_int(seed):
        raise InputError(f"--seed must be an integer, got {seed!r}")
    if isinstance(texts, str):
        texts = [texts]
    if isinstance(texts, bytes) or not hasattr(texts, "__iter__"):
        raise InputError(f"texts are a string or a list of strings, got {type(texts).__name__}")
    texts = [t for t in texts if t is not None]
    wrong = sorted({type(t).__name__ for t in texts if not isinstance(t, str)})
    if wrong:
        raise InputError(f"texts are a string or a list of strings, got a list holding {', '.join(wrong)}")
    if not texts or all(not t.strip() for t in texts):
        raise InputError("the input text is empty; pass --text/--file with some text, or omit both for the default corpus")
    prefix, suffix = special_affixes(tokenizer)
    body = seq_len - len(prefix) - len(suffix)
    if body < 1:
        raise InputError(f"--seq-len {seq_len} leaves no room for text after {len(prefix) + len(suffix)} special tokens")
    texts = [t for t in texts if t.strip()]
    per_text = _encode(tokenizer, texts[:samples] if not seed else texts)
    if not seed and len(texts) > samples and not all(per_text):  # an empty text gives no window: take them all
        per_text = _encode(tokenizer, texts)
    if seed:
        gen = torch.Generator().manual_seed(int(seed))
        order = torch.randperm(len(per_text), generator=gen).tolist()
        offsets = torch.randint(0, body, (len(per_text),), generator=gen).tolist()
        per_text = [per_text[i][off:] or per_text[i] for i, off in zip(order, offsets)]
    chunks = [[ids[i : i + body] for i in range(0, len(ids), body)] for ids in per_text]
    windows: list[list[int]] = []
    depth = 0
    while len(windows) < samples and any(depth < len(c) for c in chunks):
        for c in chunks:
            if depth < len(c) and len(windows) < samples:
                windows.append(prefix + list(c[depth]) + suffix)
        depth += 1
    if not windows:
        raise InputError("the input text produced no tokens")
    if max(len(w) for w in windows) < 2:
        raise InputError("every sample has fewer than 2 tokens; give longer text")
    width = max(len(w) for w in windows)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.full((len(windows), width), int(pad), dtype=torch.long)
    mask = torch.zeros((len(windows), width), dtype=torch.long)
    for row, w in enumerate(windows):
        ids[row, : len(w)] = torch.tensor(w, dtype=torch.long)
        mask[row, : len(w)] = 1
    tokens = [readable_tokens(tokenizer, w) for w in windows]  # what reports show: "Ġthe" → " the"
    bos_ids = {tokenizer.bos_token_id, getattr(tokenizer, "cls_token_id", None)} - {None}
    added_bos = bool(prefix) and prefix[0] in bos_ids
    return TokenBatch(input_ids=ids, attention_mask=mask, tokens=tokens, added_bos=added_bos)


def _encode(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, without special tokens. With seed 0 the first window of each of the first
    ``samples`` texts fills the samples (windows go round-robin), so only those texts need encoding."""
    return [tokenizer(t, add_special_tokens=False, verbose=False)["input_ids"] for t in texts]


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet reversed: printable stand-in character → byte (Radford et al. 2019)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(keep, chars)}


_ESCAPES = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}


def _visible(text: str) -> str:
    return "".join(_ESCAPES.get(ch, ch if ch.isprintable() or ch == " " else f"\\x{ord(ch):02x}") for ch in text)


def byte_level_text(piece: str) -> str:
    """A byte-level BPE piece (GPT-2 alphabet: ``Ġ`` for a space, ``Ċ`` for a newline …) as readable text.

    Bytes that do not form whole UTF-8 characters (a piece holding half of ``é``) show as ``\\xNN``;
    control characters as ``\\n``, ``\\t`` …

    >>> byte_level_text("Ġthe"), byte_level_text("ĠcafÃ©"), byte_level_text("Ã"), byte_level_text("Ċ")
    (' the', ' café', '\\\\xc3', '\\\\n')
    """
    table = _byte_decoder()
    if not all(ch in table for ch in piece):
        return _visible(piece)
    raw = bytes(table[ch] for ch in piece)
    return _visible(raw.decode("utf-8", errors="backslashreplace"))


def _is_byte_level(tokenizer) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend is not None and "ByteLevel" in f"{backend.decoder} {backend.pre_tokenizer}"


def readable_tokens(tokenizer, token_ids: list[int]) -> list[str]:
    """:func:`readable_token` for a whole sequence (the tokenizer's kind is looked up once)."""
    pieces = tokenizer.convert_ids_to_tokens([int(t) for t in token_ids])
    special = set(getattr(tokenizer, "all_special_ids", ()) or ())
    byte_level = _is_byte_level(tokenizer)
    out = []
    for tid, piece in zip(token_ids, pieces):
        if piece is None:
            out.append(f"<id {int(tid)}>")
        elif int(tid) in special:
            out.append(piece)
        else:
            out.append(byte_level_text(piece) if byte_level else _visible(piece.replace("\u2581", " ")))
    return out


def readable_token(tokenizer, token_id: int) -> str:
    """Token ``token_id`` as a person reads it: byte-level pieces decoded (``Ġthe`` → ``" the"``),
    SentencePiece's ``▁`` as a space, special tokens and WordPiece pieces (``##ing``) as they are,
    control characters escaped. For tables and reports (escape it again for HTML)."""
    piece = tokenizer.convert_ids_to_tokens(int(token_id))
    if piece is None:
        return f"<id {int(token_id)}>"
    if int(token_id) in set(getattr(tokenizer, "all_special_ids", ()) or ()):
        return piece
    if _is_byte_level(tokenizer):
        return byte_level_text(piece)
    return _visible(piece.replace("\u2581", " "))
