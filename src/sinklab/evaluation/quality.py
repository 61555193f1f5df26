"""What a bounded stream forgets and whether it stays fluent: three measures beyond perplexity.

* :func:`fact_recall` — a fact (``the code for the blue door is 4172``) placed ``d`` tokens before a
  question about it; exact-match accuracy of the greedy answer vs ``d`` for dense attention, sinks +
  window, window only, and sinks + window with the fact's tokens pinned. StreamingLLM keeps the model
  fluent, not its memory: once the fact leaves the window it is gone, unless it is pinned.
* :func:`endless_generation` — thousands of sampled tokens through one stream (fixed seed); per block of
  tokens, the distinct-4-gram ratio and the model's mean NLL of its own tokens (under the stream's logits).
  A stream that has lost its sinks collapses into noise or loops; one with sinks stays flat.
* :func:`many_prompts` — a list of prompts answered one after another in one chat stream
  (:class:`~sinklab.chat.ChatStream`); each answer is scored by its mean NLL under a *fresh* dense
  context of its own prompt, beside the answer a fresh dense context gives itself.

Every method here is a stream: "dense" is a stream whose window holds every token (nothing is evicted,
which equals full attention — ``tests/test_stream.py``). The texts (facts, prompts) are written by the
project (:data:`FACTS`, :data:`PROMPTS`); the filler is Python's pydoc topics.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch
from torch import Tensor, nn

from ..errors import InputError, check_int, is_int
from ..chat import ChatStream
from ..stream.session import StreamSession, sample_token

__all__ = ["ENDLESS_PROMPT", "FACTS", "PROMPTS", "QUALITY_MEASURES", "RECALL_METHODS", "EndlessRun", "EndlessStream",
           "PromptAnswer", "QualityPlan", "RecallResult", "block_length", "block_stats", "distinct_ngram_ratio", "endless_generation",
           "endless_prompt_ids", "evaluate_quality", "fact_recall", "many_prompts", "parse_distances", "parse_quality"]

Progress = Callable[[str, int], None]

#: Key → value facts for the recall test (the value is what the answer must start with).
FACTS: tuple[tuple[str, str], ...] = (
    ("the blue door", "falcon"), ("the red box", "violet"), ("the north gate", "copper"), ("the old safe", "harbor"),
    ("the green locker", "maple"), ("the back office", "lantern"), ("the garden shed", "orchid"),
    ("the west tower", "pebble"), ("the small cabinet", "tundra"), ("the boat house", "saffron"),
)

#: Varied prompts for "many prompts, one stream": facts, how-to, maths, code, writing, advice.
PROMPTS: tuple[str, ...] = (
    "What is the capital of France?",
    "Give me three tips for sleeping better.",
    "Explain photosynthesis in one sentence.",
    "Write a haiku about the sea.",
    "What is 12 times 7?",
    "How do I reverse a list in Python?",
    "Name three planets of the solar system.",
    "What does a thermometer measure?",
    "Suggest a name for a black cat.",
    "Why is the sky blue?",
    "Translate 'good morning' into Spanish.",
    "What is the boiling point of water in Celsius?",
    "Write one sentence about autumn leaves.",
    "How many legs does a spider have?",
    "What is a prime number?",
    "Give me a healthy breakfast idea.",
    "Who wrote Romeo and Juliet?",
    "What is the opposite of 'ancient'?",
    "Describe a rainbow to a child.",
    "How do plants drink water?",
    "List three fruits that are red.",
    "What is the largest ocean on Earth?",
    "Write a short thank-you note to a teacher.",
    "What is the difference between weather and climate?",
    "How can I save money on groceries?",
    "What gas do humans breathe out?",
    "Tell me a fun fact about octopuses.",
    "What is the square root of 81?",
    "How do you make a cup of tea?",
    "What does a CPU do in a computer?",
    "Give two reasons to learn a second language.",
    "What is the main ingredient of guacamole?",
)

RECALL_METHODS = ("dense", "sinks", "window", "pinned")
_PREAMBLE = "Read the notes below; a question follows at the end.\n"


# ---------------------------------------------------------------------------------------------- n-grams
def distinct_ngram_ratio(tokens: Sequence[int], n: int = 4) -> float:
    """Distinct ``n``-grams / all ``n``-grams of ``tokens`` (1.0: no repeats; → 0 when a loop repeats)."""
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else float("nan")


def block_length(n: int) -> int:
    """Block length for the statistics of an endless run of ``n`` tokens: 1,000, or 250 / 100 for short runs."""
    return 1000 if n >= 5000 else 250 if n >= 1500 else 100


def block_stats(tokens: Sequence[int], nll: Sequence[float], block: int = 1000, n: int = 4) -> dict[str, list]:
    """Per block of ``block`` tokens: its end, distinct-``n``-gram ratio and mean NLL (a last partial block too)."""
    out: dict[str, list] = {"end": [], "distinct": [], "mean_nll": []}
    for a in range(0, len(tokens), block):
        b = min(len(tokens), a + block)
        if b - a < n:
            break
        out["end"].append(b)
        out["distinct"].append(distinct_ngram_ratio(tokens[a:b], n))
        out["mean_nll"].append(float(sum(nll[a:b]) / (b - a)))
    return out


# ---------------------------------------------------------------------------------------------- recall
@dataclass
class RecallResult:
    """Exact-match accuracy per method and distance, and every answer."""

    distances: list[int]
    methods: list[str]
    num_sinks: int
    window: int
    accuracy: dict[str, list[float]]
    answers: list[dict] = field(default_factory=list)  # {method, distance, key, value, answer, correct}

    def to_json(self) -> dict:
        return asdict(self)


def _first_word(text: str) -> str:
    """The answer's first word, lower-cased, without quotes or punctuation (``' "Falcon".'`` → ``falcon``)."""
    words = text.split()
    return words[0].strip("\"'.,;:!?()[]`").lower() if words else ""


def _stream_settings(method: str, num_sinks: int, window: int, total: int, fact: tuple[int, int]) -> dict:
    if method == "dense":  # a window that holds everything: nothing is evicted
        return dict(num_sinks=0, window=total)
    if method == "window":  # same cache size, no sinks
        return dict(num_sinks=0, window=num_sinks + window)
    if method == "sinks":
        return dict(num_sinks=num_sinks, window=window)
    if method == "pinned":
        return dict(num_sinks=num_sinks, window=window, pinned=[fact])
    raise InputError(f"unknown recall method {method!r}; choose from {', '.join(RECALL_METHODS)}")


def _greedy(model: nn.Module, ids: list[int], settings: dict, max_new_tokens: int, chunk_size: int) -> list[int]:
    out = []
    with StreamSession(model, chunk_size=chunk_size, **settings) as s:
        logits = s.feed(torch.tensor([ids]))
        for _ in range(max_new_tokens):
            token = int(logits[0].argmax())
            out.append(token)
            if len(out) < max_new_tokens:
                logits = s.step(torch.tensor([token]))
    return out


def fact_recall(model: nn.Module, tokenizer, filler_ids: Tensor, distances: Sequence[int], *, num_sinks: int = 4,
                window: int = 252, methods: Sequence[str] = RECALL_METHODS, facts: Sequence[tuple[str, str]] = FACTS,
                max_new_tokens: int = 3, chunk_size: int = 256, progress: Progress | None = None) -> RecallResult:
    """Recall of a fact placed ``d`` tokens before its question, for each method and distance.

    The stream is ``preamble ⧺ fact ⧺ filler[:d] ⧺ question``: the preamble (longer than the sinks) keeps the
    fact out of the sink slots, ``d`` counts the filler tokens between the fact and the question, and the
    answer is correct when the first word of the greedy continuation is the fact's value.
    """
    if filler_ids.numel() < max(distances):
        raise InputError(f"the filler has {filler_ids.numel()} tokens; the largest distance needs {max(distances)}")
    enc = lambda text: list(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    head = list(tokenizer(_PREAMBLE)["input_ids"])  # the tokenizer's own BOS, if any, starts the stream
    if len(head) <= num_sinks:
        raise InputError("the preamble must be longer than the sinks")
    acc: dict[str, list] = {m: [] for m in methods}
    answers = []
    for d in distances:
        hits = {m: 0 for m in methods}
        for key, value in facts:
            fact = enc(f"Note: the password for {key} is {value}.\n")
            question = enc(f"\nQuestion: what is the password for {key}?\nAnswer: the password for {key} is")
            ids = head + fact + filler_ids[:d].tolist() + question
            span = (len(head), len(head) + len(fact))
            for m in methods:
                settings = _stream_settings(m, num_sinks, window, len(ids) + max_new_tokens, span)
                text = tokenizer.decode(_greedy(model, ids, settings, max_new_tokens, chunk_size),
                                        skip_special_tokens=True)
                ok = _first_word(text) == value
                hits[m] += ok
                answers.append({"method": m, "distance": d, "key": key, "value": value, "answer": text, "correct": ok})
                if progress:
                    progress(f"recall d={d} {m}", 1)
        for m in methods:
            acc[m].append(hits[m] / len(facts))
    return RecallResult(list(distances), list(methods), num_sinks, window, acc, answers)


# ---------------------------------------------------------------------------------------------- endless
#: The request that starts an endless run (a chat model gets it through its chat template).
ENDLESS_PROMPT = "Tell me a long story about a lighthouse keeper and the sea."


def endless_prompt_ids(tokenizer, prompt: str = ENDLESS_PROMPT) -> list[int]:
    """Ids that start an endless run: ``prompt`` through the chat template, or plain text without one."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer(prompt)["input_ids"])


@dataclass
class EndlessRun:
    """Sampled tokens and the model's NLL of each (under the stream's own logits)."""

    label: str
    num_sinks: int
    window: int
    tokens: list[int]
    nll: list[float]
    seconds: float = 0.0

    def stats(self, block: int = 1000, n: int = 4) -> dict[str, list]:
        return block_stats(self.tokens, self.nll, block, n)

    def to_json(self, block: int | None = None) -> dict:
        """JSON-ready: settings, every token and NLL, and the per-block statistics (:func:`block_length`)."""
        block = block or block_length(len(self.tokens))
        return {"label": self.label, "num_sinks": self.num_sinks, "window": self.window, "tokens": self.tokens,
                "nll": self.nll, "seconds": self.seconds, "block": block, "blocks": self.stats(block)}


class EndlessStream:
    """One endless sampled stream, advanced a token at a time (so several can run in lockstep).

    >>> with EndlessStream(model, prompt_ids, num_sinks=4, window=252, seed=0) as e:   # doctest: +SKIP
    ...     for _ in range(10_000):
    ...         e.advance()
    ...     run = e.run
    """

    def __init__(self, model: nn.Module, prompt_ids: Sequence[int], *, num_sinks: int, window: int,
                 temperature: float = 0.7, top_k: int = 50, seed: int = 0, label: str = "") -> None:
        if not prompt_ids:
            raise InputError("an endless run needs a prompt of at least one token")
        self.temperature, self.top_k = temperature, top_k
        self.gen = torch.Generator().manual_seed(seed)
        self.run = EndlessRun(label or f"S={num_sinks} W={window}", num_sinks, window, [], [])
        self.prompt_ids = list(prompt_ids)
        self.session = StreamSession(model, num_sinks=num_sinks, window=window)
        self.logits: Tensor | None = None
        self._start = 0.0

    def __enter__(self) -> EndlessStream:
        import time

        self._start = time.perf_counter()
        self.session.__enter__()
        self.logits = self.session.feed(torch.tensor([self.prompt_ids]))
        return self

    def __exit__(self, *exc: object) -> None:
        self.session.__exit__(*exc)

    def advance(self, feed: bool = True) -> int:
        """Sample the next token, record it and its NLL, and (``feed``) feed it back; return it."""
        import time

        if self.logits is None:
            raise RuntimeError("use the endless stream as a context manager")
        token = sample_token(self.logits, self.temperature, self.top_k, self.gen)
        self.run.tokens.append(int(token[0]))
        self.run.nll.append(float(-torch.log_softmax(self.logits[0].double(), -1)[int(token[0])]))
        if not math.isfinite(self.run.nll[-1]):
            raise InputError(f"{self.run.label}: NLL is not finite at token {len(self.run.tokens) - 1}")
        if feed:
            self.logits = self.session.step(token)
        self.run.seconds = time.perf_counter() - self._start
        return int(token[0])


def endless_generation(model: nn.Module, prompt_ids: Sequence[int], n_tokens: int, *, num_sinks: int, window: int,
                       temperature: float = 0.7, top_k: int = 50, seed: int = 0, label: str = "",
                       progress: Progress | None = None, every: int = 100,
                       on_update: Callable[[EndlessRun], None] | None = None) -> EndlessRun:
    """Sample ``n_tokens`` after ``prompt_ids`` through one stream; record each token's NLL (untempered logits).

    No stop token: the stream runs the whole length (StreamingLLM's endless generation). ``on_update`` sees
    the run so far every ``every`` tokens (to save a long run as it goes)."""
    if n_tokens < 1:
        raise InputError(f"an endless run needs at least one token, got {n_tokens}")
    with EndlessStream(model, prompt_ids, num_sinks=num_sinks, window=window, temperature=temperature,
                       top_k=top_k, seed=seed, label=label) as e:
        for i in range(n_tokens):
            e.advance(feed=i + 1 < n_tokens)
            if (i + 1) % every == 0 or i + 1 == n_tokens:
                if progress:
                    progress(e.run.label, every if (i + 1) % every == 0 else (i + 1) % every)
                if on_update:
                    on_update(e.run)
    return e.run


# ---------------------------------------------------------------------------------------------- many prompts
@dataclass
class PromptAnswer:
    """One prompt answered in the long stream and in a fresh dense context, both scored by the fresh context."""

    prompt: str
    stream_answer: str
    fresh_answer: str
    stream_nll: float  # mean NLL of the stream's answer under a fresh dense context of the prompt
    fresh_nll: float  # mean NLL of the fresh answer under the same context
    stream_tokens: int
    fresh_tokens: int
    evicted_before: int  # tokens the stream had evicted when this prompt arrived


def _answer_nll(model: nn.Module, prompt_ids: list[int], answer_ids: list[int]) -> float:
    """Mean NLL of ``answer_ids`` after ``prompt_ids`` under full attention (one forward)."""
    if not answer_ids:
        return float("nan")
    ids = torch.tensor([prompt_ids + answer_ids])
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits[0, len(prompt_ids) - 1:-1].double()
    return float(-torch.log_softmax(logits, -1).gather(1, torch.tensor(answer_ids)[:, None]).mean())


def many_prompts(model: nn.Module, tokenizer, prompts: Sequence[str] = PROMPTS, *, num_sinks: int = 4,
                 window: int = 252, max_new_tokens: int = 48, system: str | None = None,
                 progress: Progress | None = None) -> list[PromptAnswer]:
    """Answer ``prompts`` one after another in one :class:`ChatStream` (greedy), then each in a fresh context.

    The fresh context is the chat template over the prompt alone (and the system prompt), answered greedily
    with nothing evicted; both answers are scored by that same fresh context."""
    out = []
    with ChatStream(model, tokenizer, system=system, num_sinks=num_sinks, window=window,
                    max_new_tokens=max_new_tokens) as chat:
        for p in prompts:
            evicted = chat.meter().evicted
            for _ in chat.turn(p):
                pass
            out.append((p, chat.turns[-1], evicted))
            if progress:
                progress("stream", 1)
    rows = []
    for p, turn, evicted in out:
        with ChatStream(model, tokenizer, system=system, num_sinks=0, window=1024 + max_new_tokens,
                        max_new_tokens=max_new_tokens) as fresh:
            for _ in fresh.turn(p):
                pass
            f = fresh.turns[-1]
            if fresh.meter().evicted:  # pragma: no cover - a prompt of over 1,024 tokens
                raise InputError(f"prompt {p[:40]!r}… is too long for the fresh dense context")
        rows.append(PromptAnswer(p, turn.answer, f.answer, _answer_nll(model, f.prompt_ids, turn.answer_ids),
                                 _answer_nll(model, f.prompt_ids, f.answer_ids), len(turn.answer_ids),
                                 len(f.answer_ids), evicted))
        if progress:
            progress("fresh", 1)
    return rows


# ---------------------------------------------------------------------------------------------- eval-stream
#: The measures ``sinklab eval-stream --quality`` can run.
QUALITY_MEASURES = ("recall", "endless", "prompts")


def parse_quality(text: str | Sequence[str]) -> tuple[str, ...]:
    """``"recall,endless"`` → ``("recall", "endless")`` (in :data:`QUALITY_MEASURES` order); unknown names raise."""
    names = [n.strip() for n in (text.split(",") if isinstance(text, str) else text) if n.strip()]
    unknown = sorted(set(names) - set(QUALITY_MEASURES))
    if unknown or not names:
        raise InputError(f"--quality: unknown or empty {unknown or names!r}; choose from {', '.join(QUALITY_MEASURES)}")
    return tuple(m for m in QUALITY_MEASURES if m in names)


def parse_distances(text: str | Sequence[int]) -> tuple[int, ...]:
    """``"32,512,1024"`` → ``(32, 512, 1024)`` (sorted, duplicates dropped); non-integers or values < 1 raise."""
    try:
        items = [int(x) for x in (text.split(",") if isinstance(text, str) else text) if str(x).strip()]
    except ValueError as exc:
        raise InputError("--recall-distances must be comma-separated integers such as 32,512,1024, "
                         f"got {text!r}") from exc
    if not items or min(items) < 1:
        raise InputError(f"--recall-distances needs one or more distances ≥ 1 (tokens), got {text!r}")
    return tuple(sorted(set(items)))


@dataclass(frozen=True)
class QualityPlan:
    """Which quality measures to run, at the stream's ``num_sinks`` + ``window``; validated on construction.

    ``distances`` ``None`` picks ``16, W/2, C + 32, 2C, 4C`` (``C = S + W``): inside the window to far
    outside it. The endless runs compare sinks + window with window only at the same cache size ``C``.
    """

    measures: tuple[str, ...] = QUALITY_MEASURES
    num_sinks: int = 4
    window: int = 252
    distances: tuple[int, ...] | None = None
    facts: int = len(FACTS)
    endless_tokens: int = 2000
    seed: int = 0
    prompts: int = len(PROMPTS)
    answer_tokens: int = 48
    chunk_size: int = 256

    def __post_init__(self) -> None:
        object.__setattr__(self, "measures", parse_quality(self.measures))
        if self.distances is not None:
            object.__setattr__(self, "distances", parse_distances(self.distances))
        if self.num_sinks < 1:
            raise InputError("--quality compares sinks with window only: the stream needs ≥ 1 sink (--sinks)")
        check_int("the window", self.window, 1)
        for name, value, top in (("--recall-facts", self.facts, len(FACTS)), ("--prompts", self.prompts, len(PROMPTS))):
            if not is_int(value) or not 1 <= value <= top:
                raise InputError(f"{name} must be between 1 and {top} (the project's list), got {value!r}")
        for name, value in (("--endless-tokens", self.endless_tokens), ("--answer-tokens", self.answer_tokens)):
            check_int(name, value, 1)

    @property
    def cache_size(self) -> int:
        return self.num_sinks + self.window

    def recall_distances(self) -> tuple[int, ...]:
        c = self.cache_size
        return self.distances or tuple(sorted({16, max(1, self.window // 2), c + 32, 2 * c, 4 * c}))

    def work(self) -> int:
        """Units of progress: one per recall answer, endless token (both runs) and prompt answered (twice)."""
        n = 0
        if "recall" in self.measures:
            n += len(self.recall_distances()) * self.facts * len(RECALL_METHODS)
        if "endless" in self.measures:
            n += 2 * self.endless_tokens
        if "prompts" in self.measures:
            n += 2 * self.prompts
        return n


def evaluate_quality(model: nn.Module, tokenizer, plan: QualityPlan, filler_ids: Tensor, *, model_name: str = "",
                     progress: Progress | None = None) -> dict:
    """Run ``plan``'s measures: ``{"recall": …, "endless_s<S>": …, "endless_s0": …, "prompts": …}`` (JSON-ready).

    The shapes are those :func:`sinklab.report.quality_figures.quality_tables` and ``quality_figures`` draw.
    ``filler_ids`` (the text between a fact and its question) must hold the largest recall distance."""
    if tokenizer is None:
        raise InputError("the quality measures need a tokenizer (this checkpoint has none)")
    s, w = plan.num_sinks, plan.window
    out: dict = {}
    if "recall" in plan.measures:
        res = fact_recall(model, tokenizer, filler_ids, plan.recall_distances(), num_sinks=s, window=w,
                          facts=FACTS[: plan.facts], chunk_size=plan.chunk_size, progress=progress)
        out["recall"] = {**res.to_json(), "model": model_name}
    if "endless" in plan.measures:
        ids = endless_prompt_ids(tokenizer)
        for sinks, window, label in ((s, w, "sinks + window"), (0, s + w, "window only")):
            run = endless_generation(model, ids, plan.endless_tokens, num_sinks=sinks, window=window, seed=plan.seed,
                                     label=label, progress=progress)
            out[f"endless_s{sinks}"] = {**run.to_json(), "model": model_name, "prompt": ENDLESS_PROMPT,
                                        "temperature": 0.7, "top_k": 50, "seed": plan.seed,
                                        "text": tokenizer.decode(run.tokens, skip_special_tokens=False)}
    if "prompts" in plan.measures:
        rows = many_prompts(model, tokenizer, PROMPTS[: plan.prompts], num_sinks=s, window=w,
                            max_new_tokens=plan.answer_tokens, progress=progress)
        out["prompts"] = {"model": model_name, "num_sinks": s, "window": w, "max_new_tokens": plan.answer_tokens,
                          "rows": [asdict(r) for r in rows]}
    return out
