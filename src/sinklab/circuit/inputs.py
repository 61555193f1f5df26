"""The circuit's inputs: the same token rows under each first-token condition.

Conditions (the first is the reference):

* ``as_tokenized`` — the tokenizer's own encoding (its special tokens included);
* ``bos_removed`` — when the tokenizer adds a BOS/special prefix: the same rows without their first token;
  ``bos_prepended`` — when it adds none (e.g. SmolLM2): a special token (``<|endoftext|>``, ``<|im_start|>`` …)
  put in front, the last token dropped so the length stays the same;
* ``first_swapped`` — the first token replaced by a different ordinary token (same length, same rest).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import InputError

__all__ = ["REFERENCE", "SPECIAL_CANDIDATES", "CircuitInputs", "bb_inputs", "id_inputs", "row_inputs", "text_inputs"]

REFERENCE = "as_tokenized"
SPECIAL_CANDIDATES = ("<|endoftext|>", "<|im_start|>", "<s>", "<|begin_of_text|>", "<bos>")
_SWAP_WORDS = (" the", " of", " and")


@dataclass
class CircuitInputs:
    """Token-id rows per condition (reference first), their token strings, and what each condition is."""

    conditions: dict[str, list[list[int]]]
    tokens: dict[str, list[list[str]]]
    description: dict[str, str]
    pad_id: int = 0
    meta: dict = field(default_factory=dict)
    #: Model inputs besides the token ids, one row per sample (e.g. a vision-language model's ``pixel_values``),
    #: handed to every forward of every condition with its samples' rows.
    extra: dict[str, torch.Tensor] = field(default_factory=dict)


def _special_id(tokenizer, special_token: str | None) -> tuple[int, str]:
    vocab = tokenizer.get_vocab()
    if special_token is not None:
        if special_token not in vocab:
            raise InputError(f"special token {special_token!r} is not in the tokenizer's vocabulary")
        return vocab[special_token], special_token
    for tok in (tokenizer.bos_token, *SPECIAL_CANDIDATES, tokenizer.eos_token):
        if tok is not None and tok in vocab:
            return vocab[tok], tok
    raise InputError("the tokenizer has no BOS/special token to prepend; pass special_token= (--special-token)")


def _swap_ids(tokenizer) -> list[int]:
    special = set(tokenizer.all_special_ids)
    ids = []
    for word in _SWAP_WORDS:
        enc = tokenizer(word, add_special_tokens=False)["input_ids"]
        if enc and enc[0] not in special and enc[0] not in ids:
            ids.append(enc[0])
    if len(ids) < 2:
        raise InputError("cannot find two ordinary tokens to swap in as the first token")
    return ids


def _swapped(rows: list[list[int]], swap: list[int]) -> list[list[int]]:
    return [[swap[0] if r[0] != swap[0] else swap[1]] + r[1:] for r in rows]


def text_inputs(tokenizer, texts: list[str], *, seq_len: int, samples: int,
                special_token: str | None = None) -> CircuitInputs:
    """Windows of ``seq_len`` tokens (see :func:`sinklab.texts.tokenize_windows`) under the three conditions."""
    from ..texts import tokenize_windows

    windows = tokenize_windows(tokenizer, texts, seq_len, samples)
    rows = [ids[mask.bool()].tolist() for ids, mask in zip(windows.input_ids, windows.attention_mask)]
    return row_inputs(tokenizer, rows, special_token=special_token)


def row_inputs(tokenizer, rows: list[list[int]], *, special_token: str | None = None) -> CircuitInputs:
    """Token-id ``rows`` as the tokenizer wrote them (its special prefix, if any, first) under the three
    conditions."""
    from ..texts import special_affixes

    prefix, _ = special_affixes(tokenizer)
    swap = _swap_ids(tokenizer)
    conds = {REFERENCE: rows}
    desc = {REFERENCE: "as tokenized" + (f" (starts with {tokenizer.convert_ids_to_tokens(prefix[0])!r})" if prefix
                                         else " (the tokenizer adds no BOS)")}
    if prefix:
        if min(len(r) for r in rows) < 3:
            raise InputError("samples are too short to drop their first token; give longer text")
        conds["bos_removed"] = [r[1:] for r in rows]
        desc["bos_removed"] = "first (special) token removed"
    else:
        special, name = _special_id(tokenizer, special_token)
        conds["bos_prepended"] = [[special] + r[:-1] for r in rows]
        desc["bos_prepended"] = f"{name!r} prepended (last token dropped: same length)"
    conds["first_swapped"] = _swapped(rows, swap)
    desc["first_swapped"] = (f"first token replaced by {tokenizer.convert_ids_to_tokens(swap[0])!r} "
                             f"({tokenizer.convert_ids_to_tokens(swap[1])!r} where it already was that)")
    tokens = {k: [tokenizer.convert_ids_to_tokens(r) for r in v] for k, v in conds.items()}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return CircuitInputs(conds, tokens, desc, pad_id=int(pad),
                         meta={"tokenizer_added_bos": bool(prefix), "tokenizer_class": type(tokenizer).__name__})


def id_inputs(input_ids: torch.Tensor, *, bos_id: int, swap_ids: tuple[int, int], label=None) -> CircuitInputs:
    """Tokenizer-free inputs ``[S, T]`` that start with ``bos_id`` (e.g. Bigram-Backcopy sequences)."""
    if input_ids.dim() != 2 or input_ids.shape[1] < 3:
        raise InputError(f"input_ids must be [samples, ≥ 3 tokens], got {tuple(input_ids.shape)}")
    label = label or (lambda i: "BOS" if i == bos_id else f"t{i}")
    rows = input_ids.tolist()
    conds = {REFERENCE: rows, "bos_removed": [r[1:] for r in rows], "first_swapped": _swapped(rows, list(swap_ids))}
    desc = {REFERENCE: "as sampled (BOS first)", "bos_removed": "BOS removed",
            "first_swapped": f"BOS replaced by ordinary token {label(swap_ids[0])}"}
    tokens = {k: [[label(i) for i in r] for r in v] for k, v in conds.items()}
    return CircuitInputs(conds, tokens, desc, pad_id=int(bos_id), meta={"tokenizer_added_bos": True})


def bb_inputs(train_config: dict | str | Path, *, samples: int = 16, seed: int = 1234) -> CircuitInputs:
    """Bigram-Backcopy inputs rebuilt from a ``sinklab train --data bb`` run's ``train_config.json``."""
    from ..synth.bigram_backcopy import BigramBackcopy

    config = train_config if isinstance(train_config, dict) else json.loads(Path(train_config).read_text())
    if config.get("data") != "bb":
        raise InputError("train_config.json is not a Bigram-Backcopy run (data != 'bb')")
    task = BigramBackcopy(vocab=config["bb_vocab"], triggers=config["bb_triggers"],
                          seq_len=config["seq_len"], seed=config["seed"])
    ids = task.sample(samples, torch.Generator().manual_seed(seed))
    swap = (task.triggers, task.triggers + 1)  # the most popular non-trigger tokens
    inputs = id_inputs(ids, bos_id=task.bos, swap_ids=swap)
    inputs.meta.update({"task": "bigram-backcopy", "bb_vocab": task.vocab, "bb_triggers": task.triggers})
    return inputs
