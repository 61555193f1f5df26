"""Retention tasks in the style of RULER (Hsieh et al., 2024), generated locally over real filler text, and what
one compressed prompt answers: the cells of ``benchmarks/retention.py``'s grid.

* :func:`make_cell` — one prompt, the same for the same ``(task, context, seed)``: ``needle`` (one "special magic
  number" sentence at a random depth), ``multikey`` (four such sentences with different keys), ``vartrack`` (a chain
  of variable assignments scattered through the text) or ``ppl`` (the ``PPL_TOKENS`` tokens that follow the
  context); the filler is the Python documentation's prose (:func:`filler_ids`).
* :func:`run_prompt` — compress a prompt with a fresh cache and answer it in one of two regimes: ``agnostic`` (the
  context is compressed before any question is seen, and every question it holds is asked of a copy of the
  compressed cache) or ``aware`` (the question is part of the compressed prompt); and in one of two ways of
  decoding after it (:data:`DECODES`): ``appended`` (the prompt is compressed once and what follows — question,
  answer, continuation — is kept whole, as kvpress's presses do: :meth:`sinklab.stream.SinkCache.grow`) or ``held``
  (the budget holds at every step).
* :func:`held` — the key-value entries and bytes a cache holds, counted over every attention layer and key-value
  head; :func:`uniform_budget` — the per-head budget that holds a given number of entries in all.
* :func:`cell_row` — one row of the grid (accuracy with its Wilson interval, or perplexity).
"""

from __future__ import annotations

import copy
import math
import random
import time

import torch

from ..errors import InputError
from ..stream.policy import Observation, ScoredPolicy

__all__ = ["ANSWER_TOKENS", "DECODES", "NUM_SINKS", "PPL_TOKENS", "REGIMES", "TASKS", "answers_of", "cell_row", "filler_ids",
           "held", "layer_holds", "make_cache", "make_cell", "run_prompt", "uniform_budget", "wilson"]

TASKS = ("needle", "multikey", "vartrack", "ppl")
REGIMES = ("agnostic", "aware")
DECODES = ("appended", "held")
ANSWER_TOKENS = 10
PPL_TOKENS = 256
NUM_SINKS = 4
WORDS = ("amber", "basalt", "cobalt", "delta", "ember", "fjord", "garnet", "harbor", "indigo", "juniper", "kelp",
         "lumen", "marble", "nectar", "onyx", "pepper", "quartz", "raven", "saffron", "tundra")


# ----------------------------------------------------------------------------- tasks
def filler_ids(tokenizer) -> list[int]:
    """The filler text's token ids: the Python documentation's prose (:func:`sinklab.texts.default_texts`)."""
    from sinklab.texts import default_texts

    return tokenizer(" ".join(default_texts()), add_special_tokens=False)["input_ids"]


def _boundary(tokenizer, ids: list[int], at: int) -> int:
    """The first token boundary at or after ``at`` that follows a sentence's full stop (within 80 tokens)."""
    for i in range(at, min(len(ids), at + 80)):
        if tokenizer.decode(ids[i - 1:i]).rstrip().endswith("."):
            return i
    return at


def make_cell(tokenizer, filler: list[int], task: str, context: int, seed: int) -> dict:
    """One prompt of a cell, the same for the same arguments: ``context_ids`` (``context`` tokens, the tokenizer's
    special prefix included) and either ``questions`` (``[{question_ids, answer}]``, every question the context
    holds) with ``aware`` (the index of the one asked in the query-aware regime), or ``continuation_ids``
    (``ppl``: the ``PPL_TOKENS`` tokens of text that follow the context)."""
    from sinklab.texts import special_affixes

    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; the tasks are {', '.join(TASKS)}")
    rng = random.Random(f"{task}-{context}-{seed}")  # a str seed: the same draw in every process
    prefix = special_affixes(tokenizer)[0]
    enc = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    if len(filler) < context + PPL_TOKENS + 2:
        raise ValueError(f"the filler holds {len(filler)} tokens; a {context}-token context needs more")
    start = rng.randrange(0, len(filler) - context - PPL_TOKENS - 1)
    if task == "ppl":
        body = filler[start:start + context - len(prefix)]
        cont = filler[start + len(body):start + len(body) + PPL_TOKENS]
        return {"context_ids": prefix + body, "continuation_ids": cont}
    if task in ("needle", "multikey"):
        keys = rng.sample(WORDS, 1 if task == "needle" else 4)
        facts = [(k, str(rng.randrange(1_000_000, 9_999_999))) for k in keys]
        inserts = [f" The special magic number for {k} is {v}." for k, v in facts]
        asked = rng.randrange(len(facts))
        depths = sorted(rng.uniform(0.1, 0.9) for _ in inserts)
        questions = [(f"\n\nAnswer: the special magic number for {k} is", v) for k, v in facts]
    else:  # vartrack: VAR A = 12345, VAR B = VAR A, VAR C = VAR B; asked "VAR C = VAR B =" (two hops back)
        names = ["".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ") for _ in range(5)) for _ in range(3)]
        value = str(rng.randrange(10_000, 99_999))
        inserts = [f" VAR {names[0]} = {value}."] + [f" VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, 3)]
        depths = [0.1 + 0.8 * i / len(inserts) + rng.uniform(0, 0.1) for i in range(len(inserts))]
        questions = [(f"\n\nAnswer: VAR {names[2]} = VAR {names[1]} = ", value)]
        asked = 0
    pieces = [enc(s) for s in inserts]
    body = filler[start:start + context - len(prefix) - sum(len(p) for p in pieces)]
    cuts = [_boundary(tokenizer, body, max(1, int(d * len(body)))) for d in depths]
    ids, last = list(prefix), 0
    for i in sorted(range(len(pieces)), key=lambda i: cuts[i]):
        ids += body[last:cuts[i]] + pieces[i]
        last = cuts[i]
    ids += body[last:]
    return {"context_ids": ids[:context], "questions": [{"question_ids": enc(q), "answer": a} for q, a in questions],
            "aware": asked}


def wilson(hits: int, n: int, z: float = 1.959964) -> list[float] | None:
    """The 95 % Wilson score interval of ``hits`` successes in ``n`` trials (None for ``n = 0``)."""
    if n == 0:
        return None
    p = hits / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return [round(max(0.0, centre - half), 4), round(min(1.0, centre + half), 4)]


# ----------------------------------------------------------------------------- what a cache holds
def held(cache) -> tuple[int, int]:
    """``(entries, bytes)`` a cache holds now, summed over its attention layers and key-value heads (batch row 0):
    a score-based layer's kept tokens per head, a recency layer's tokens in its ring, a dense layer's length."""
    entries = nbytes = 0
    for layer in cache.layers:
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not isinstance(keys, torch.Tensor) or keys.dim() != 4:
            continue  # not initialised, or a recurrent layer
        width = (keys.shape[-1] + values.shape[-1]) * keys.element_size()  # type: ignore[union-attr]
        if callable(getattr(layer, "kept_tokens", None)):  # sinklab ScoredLayer: [B, Hkv]
            n = int(layer.kept_tokens()[0].sum())
        elif hasattr(getattr(layer, "state", None), "kept_tokens"):  # sinklab SinkWindowLayer
            n = int(layer.state.kept_tokens()) * keys.shape[1]
        else:  # transformers' own layers
            n = keys.shape[1] * keys.shape[2]
        entries += n
        nbytes += n * width
    return entries, nbytes


def layer_holds(cache) -> list[tuple[int, int]]:
    """``(key-value heads, tokens)`` per attention layer of a dense cache after a prompt."""
    return [(layer.keys.shape[1], layer.keys.shape[2]) for layer in cache.layers
            if isinstance(getattr(layer, "keys", None), torch.Tensor) and layer.keys.dim() == 4]


def uniform_budget(holds: list[tuple[int, int]], target: float) -> int:
    """The per-head budget ``B`` whose total ``Σ heads × min(B, tokens)`` is nearest ``target`` entries."""
    total = lambda b: sum(h * min(b, t) for h, t in holds)  # noqa: E731
    lo, hi = 1, max(t for _, t in holds)
    while lo < hi:  # the least B reaching the target
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if total(mid) < target else (lo, mid)
    return lo if lo == 1 or abs(total(lo) - target) <= abs(total(lo - 1) - target) else lo - 1


# ----------------------------------------------------------------------------- sinklab
#: What ``auto`` asks the model before compressing a prompt (:func:`sinklab.stream.prefill.reconstruction_scores`).
REPEAT_INSTRUCTION = "\n\nRepeat the previous context exactly.\n"


def _check_decode(decode: str) -> None:
    if decode not in DECODES:
        raise InputError(f"decode is one of {', '.join(DECODES)}, got {decode!r}")


class _Newest(ScoredPolicy):
    """StreamingLLM as a score-based policy: every candidate scores the same, so each head keeps its sinks and its
    newest tokens (ties go to the newer) — the recency ring's kept set, in a stream whose budget can grow."""

    name = "streaming"

    def score(self, obs: Observation) -> torch.Tensor:
        return torch.zeros(obs.real.shape, dtype=torch.float32, device=obs.real.device)


def make_cache(model, method: str, budget: int | None, plan=None, tokenizer=None, decode: str = "held"):
    """``prefill(prompt) → (cache, logits of the prompt's last token)`` for ``method`` at ``budget`` tokens per head:
    ``dense`` (transformers' own cache), a named policy, or ``auto``/``auto_uniform`` (the plan's budgets, per head or
    uniform; the prompt compressed by :func:`sinklab.stream.prefill.compressed_prompt`, which needs ``tokenizer``
    for its instruction); ``auto_snapkv``: the plan's budgets with SnapKV scoring the prompt. ``decode="appended"``:
    ``streaming`` as a score-based stream (:class:`_Newest`), whose budget :func:`run_prompt` can grow."""
    from sinklab.stream import SinkCache
    from sinklab.stream.prefill import compressed_prompt

    _check_decode(decode)

    def forward(cache, prompt):
        return cache, model(input_ids=torch.tensor([list(prompt)]), cache=cache, logits_to_keep=1).logits[0, -1]

    if method == "dense":
        from transformers import DynamicCache

        return lambda prompt: forward(DynamicCache(config=model.config), prompt)
    if method in ("auto", "auto_uniform"):
        instruction = tokenizer(REPEAT_INSTRUCTION, add_special_tokens=False)["input_ids"]
        return lambda prompt: compressed_prompt(model, prompt, instruction, plan=plan)
    if method == "auto_snapkv":
        return lambda prompt: forward(SinkCache(model, policy="auto", plan=plan), prompt)
    policy = _Newest(recent=1) if method == "streaming" and decode == "appended" else method
    return lambda prompt: forward(SinkCache(model, num_sinks=NUM_SINKS, window=budget - NUM_SINKS,  # type: ignore[operator]
                                            policy=policy), prompt)


def _close(cache) -> None:
    if hasattr(cache, "close"):
        cache.close()


def _greedy(model, cache, logits: torch.Tensor, steps: int) -> list[int]:
    """``steps`` greedy tokens from ``logits`` (the next token's), fed into ``cache`` as they come."""
    out = []
    for step in range(steps):
        out.append(int(logits.argmax()))
        if step + 1 < steps:
            logits = model(input_ids=torch.tensor([[out[-1]]]), cache=cache, logits_to_keep=1).logits[0, -1]
    return out


@torch.no_grad()
def run_prompt(model, cell: dict, regime: str, prefill, decode: str = "held") -> dict:
    """Compress one prompt with ``prefill(prompt)`` (:func:`make_cache`) and answer it: ``{seconds, entries,
    bytes}`` plus ``generated`` (one id list per question asked) or ``nll``/``count`` (``ppl``). ``decode="appended"``:
    a sinklab stream's budget grows by every token fed after the prompt (:meth:`~sinklab.stream.SinkCache.grow`), so
    they are all kept, as kvpress keeps them; ``"held"``: the budget holds."""
    _check_decode(decode)

    def grow(c, tokens: int) -> None:
        if decode == "appended" and getattr(c, "is_sinklab_stream", False):
            c.grow(tokens)

    prompt = list(cell["context_ids"])
    if regime == "aware":
        prompt += cell["questions"][cell["aware"]]["question_ids"]
    t0 = time.perf_counter()
    cache, last = prefill(prompt)
    try:
        out: dict = {"seconds": time.perf_counter() - t0}
        out["entries"], out["bytes"] = held(cache)
        if "continuation_ids" in cell:
            cont = torch.tensor(cell["continuation_ids"])
            grow(cache, cont.shape[0])
            logits = model(input_ids=cont[None, :-1], cache=cache).logits[0]
            preds = torch.cat([last[None], logits]).double()
            out["nll"] = float(torch.nn.functional.cross_entropy(preds, cont, reduction="sum"))
            out["count"] = int(cont.shape[0])
        elif regime == "aware":
            grow(cache, ANSWER_TOKENS)
            out["generated"] = [_greedy(model, cache, last, ANSWER_TOKENS)]
        else:  # every question of the context, each on a copy of the compressed cache
            out["generated"] = []
            for q in cell["questions"]:
                fork = copy.deepcopy(cache, {id(model): model})  # the model is shared, never copied
                try:
                    grow(fork, len(q["question_ids"]) + ANSWER_TOKENS)
                    logits = model(input_ids=torch.tensor([q["question_ids"]]), cache=fork,
                                   logits_to_keep=1).logits[0, -1]
                    out["generated"].append(_greedy(model, fork, logits, ANSWER_TOKENS))
                finally:
                    _close(fork)
        return out
    finally:
        _close(cache)


# ----------------------------------------------------------------------------- rows
def answers_of(cell: dict, regime: str) -> list[str]:
    if regime == "aware":
        return [cell["questions"][cell["aware"]]["answer"]]
    return [q["answer"] for q in cell["questions"]]


def cell_row(key: dict, cells: list[dict], outcomes: list[dict], tokenizer, dense_entries: int | None) -> dict:
    """One grid row from the outcomes of its prompts (``outcomes[i]`` for ``cells[i]``; ``{"error": …}`` for a
    prompt that failed)."""
    ok = [(c, o) for c, o in zip(cells, outcomes) if "error" not in o]
    row = {**key, "accuracy": None, "interval": None, "ppl": None, "n": 0, "prompts": len(ok), "kept_entries": None,
           "dense_entries": dense_entries, "kept_share": None, "kept_bytes": None, "seconds": None}
    errors = [o["error"] for o in outcomes if "error" in o]
    if errors:
        row["error"] = errors[0][:300]
    if not ok:
        return row
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    row["kept_entries"] = round(mean([o["entries"] for _, o in ok]), 1)
    row["kept_bytes"] = round(mean([o["bytes"] for _, o in ok]))
    row["seconds"] = round(mean([o["seconds"] for _, o in ok]), 3)
    if dense_entries:
        row["kept_share"] = round(row["kept_entries"] / dense_entries, 4)
    if key["task"] == "ppl":
        row["ppl"] = round(math.exp(sum(o["nll"] for _, o in ok) / sum(o["count"] for _, o in ok)), 4)
        row["n"] = sum(o["count"] for _, o in ok)
        return row
    hits = [a in tokenizer.decode(g) for c, o in ok for a, g in zip(answers_of(c, key["regime"]), o["generated"])]
    row["n"], row["accuracy"] = len(hits), round(sum(hits) / len(hits), 4)
    row["interval"] = wilson(sum(hits), len(hits))
    return row
