"""``kv_quant``: what each KV bit width × protection costs (bytes, time) and buys (KL, top-1, PPL).

Protocol, per sample (a window of ``context + score`` tokens: the tokenizer's special prefix — Gemma's ``<bos>``,
nothing for SmolLM2 — then consecutive tokens of a long text, so each window is a prompt as the tokenizer would
encode it; :func:`sample_windows`): the first ``context`` tokens
are prefilled into the cache under test, then the next ``score`` tokens are fed in one forward; their
next-token distributions are compared with the same two forwards over transformers' unquantized
``DynamicCache`` (KL(full ‖ quantized), top-1 agreement) and scored against the text (PPL). Bytes per
cached token are what the cache holds after both forwards (packed codes, scales, zero points, protected
and residual tokens, the latter two in 16-bit storage), divided by the tokens cached — and, because a short
text flatters nothing but the residual's share, also at ``bytes_lengths`` cached tokens (each cache filled
to that length with the same protection). The ``16-bit`` row keeps every token unquantized in the 16-bit
storage of the protected and residual tokens: its KL is what that storage alone costs a float32 model.
Decode time is ``decode_steps`` greedy one-token
forwards on top of sample 0's cache.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch
from torch import Tensor, nn
from transformers import DynamicCache
from transformers.cache_utils import Cache

from .. import _compat
from ..errors import InputError, check_int
from ..texts import readable_tokens, special_affixes
from .codec import BITS
from .detect import detect_sinks
from .layer import dense_bytes_per_token, kv_shape, quantized_sink_cache
from .plan import PROTECTIONS, SINK_EPS, SINK_SHARE, Protection

__all__ = ["KvQuantPlan", "KvQuantResult", "kv_quant", "kv_quant_text", "sample_windows", "ROW_KEYS", "HF_BACKENDS"]

#: Keys every row of ``kv_quant.json`` has.
ROW_KEYS = ("bits", "protect", "median_kl", "p90_kl", "top1", "ppl", "bytes_per_token", "ms_per_token")
#: transformers' ``QuantizedCache`` backends that run on CPU, and the bit widths each accepts.
HF_BACKENDS = {"quanto": (2, 4), "hqq": (1, 2, 3, 4, 8)}

Progress = Callable[[str, int], None]


@dataclass
class KvQuantPlan:
    """What :func:`kv_quant` measures."""

    bits: tuple[int, ...] = (8, 4, 3, 2)  # bit widths of the packed cache
    protect: tuple[str, ...] = PROTECTIONS  # "none", "first" (the first num_first tokens), "detected"
    num_first: int = 4  # S of the "first" protection
    context: int = 1024  # tokens cached per sample before scoring
    score: int = 256  # next tokens scored per sample
    samples: int = 4  # windows of context + score tokens, consecutive in the text
    group_size: int = 64  # G: tokens per key block (per-channel key scales) at 3, 4 and 8 bits
    group_size_2bit: int = 32  # G at 2 bits: four levels per block need shorter blocks (KIVI's own G is 32)
    value_group: int | None = 64  # channels per value scale (per-token; capped at the head width); None: G
    residual: int = 32  # R: most recent tokens kept in full precision
    clip: bool | None = None  # least-squares ranges (True), min/max (False), None: at 2 bits only (CLIP_BITS)
    eps: float = SINK_EPS  # sink detection: column mass above eps …
    share: float = SINK_SHARE  # … in at least this share of layer×head pairs
    decode_steps: int = 16  # timed one-token forwards per cache (sample 0)
    hf_backends: tuple[str, ...] = ()  # also transformers' QuantizedCache with these backends ("quanto", "hqq")
    bytes_lengths: tuple[int, ...] = (1024, 4096)  # also report bytes per token at these cached lengths

    def __post_init__(self) -> None:
        self.bits, self.protect = tuple(int(b) for b in self.bits), tuple(self.protect)
        bad = [b for b in self.bits if b not in BITS]
        if bad or not self.bits:
            raise InputError(f"--bits takes values from {BITS}, got {list(self.bits)}")
        unknown = [p for p in self.protect if p not in PROTECTIONS]
        if unknown or not self.protect:
            raise InputError(f"--protect takes values from {PROTECTIONS}, got {list(self.protect)}")
        check_int("--group-size", self.group_size, 1)
        check_int("the 2-bit group size", self.group_size_2bit, 1)
        if self.value_group is not None:
            check_int("--value-group", self.value_group, 1)
        check_int("--decode-steps", self.decode_steps, 0, " (0: no decode timing)")
        check_int("--score", self.score, 1)
        check_int("--samples", self.samples, 1)
        longest = max(self.group_for(b) for b in self.bits)
        check_int("--context", self.context, 2 * longest, f" (at least two groups of {longest} tokens)")
        self.hf_backends = tuple(self.hf_backends)
        self.bytes_lengths = tuple(int(n) for n in self.bytes_lengths)
        if any(n < 1 for n in self.bytes_lengths):
            raise InputError(f"bytes lengths must be ≥ 1, got {list(self.bytes_lengths)}")
        unknown = [b for b in self.hf_backends if b not in HF_BACKENDS]
        if unknown:
            raise InputError(f"--hf-backend takes values from {sorted(HF_BACKENDS)}, got {unknown}")

    def group_for(self, bits: int) -> int:
        """``G`` at ``bits``: tokens per key block (and the channel group of transformers' caches)."""
        return self.group_size_2bit if bits == 2 else self.group_size

    @property
    def tokens(self) -> int:
        """Tokens the plan's windows hold (the text needs that many less the special prefix of each window)."""
        return self.samples * (self.context + self.score)

    def work(self) -> int:
        """Forwards (and timed decodes) the plan runs, for a progress bar."""
        hf = len(self.hf_configs())
        return self.samples * (2 + len(self.bits) * len(self.protect) + hf) + self.decode_steps * (
            1 + len(self.bits) * len(self.protect) + hf)

    def hf_configs(self) -> list[tuple[str, int]]:
        """``(backend, bits)`` pairs of transformers' ``QuantizedCache`` runs (the bit widths each backend takes)."""
        return [(name, b) for name in self.hf_backends for b in self.bits if b in HF_BACKENDS[name]]


@dataclass
class KvQuantResult:
    """Rows (one per cache: ``bits`` × ``protect``, plus the full-precision and transformers baselines) and meta."""

    rows: list[dict]
    plan: KvQuantPlan
    detected: list[list[int]]  # per sample: the detected sink positions
    dense_bytes_16: int  # bytes per token of a 16-bit unquantized cache
    meta: dict = field(default_factory=dict)
    hf_skipped: dict[str, str] = field(default_factory=dict)  # backend → why transformers refused the model

    def to_json(self) -> dict:
        return {"rows": self.rows, "plan": asdict(self.plan), "detected": self.detected,
                "dense_bytes_per_token_16bit": self.dense_bytes_16, "hf_skipped": self.hf_skipped, "meta": self.meta}

    def row(self, bits: int, protect: str) -> dict:
        return next(r for r in self.rows if r["bits"] == bits and r["protect"] == protect)


def _filled_bytes_per_token(model: nn.Module, cache: Cache, length: int) -> float:
    """Bytes per token ``cache`` holds once ``length`` tokens of ``model``'s K/V shape are stored in it.

    The cache is filled with one zero chunk ``[1, Hkv, length, d]`` per layer (the state after a prefill of
    ``length`` tokens; what a layer stores does not depend on the values), then measured with
    ``_cache_nbytes``. This is how bytes per token are reported at lengths longer than a measured text.
    """
    layers, kv, dh = kv_shape(model)
    dtype = next(model.parameters()).dtype
    chunk = torch.zeros(1, kv, length, dh, dtype=dtype)  # (B, Hkv, T, d)
    for i in range(layers):
        cache.update(chunk, chunk, i)
    return _cache_nbytes(cache) / length


def _cache_nbytes(cache: Cache) -> int:
    """Bytes a cache holds: sinklab's layers count themselves; transformers' layers (quantized or not) are walked."""
    total = 0
    for layer in cache.layers:
        if hasattr(layer, "nbytes"):
            total += layer.nbytes()
            continue
        tensors = [layer.keys, layer.values]  # type: ignore[union-attr]  # (no linear-attention layer here)
        for q in (getattr(layer, "_quantized_keys", None), getattr(layer, "_quantized_values", None)):
            if isinstance(q, tuple):  # HQQ: (packed, meta)
                tensors += [q[0], q[1]["scale"], q[1]["zero"]]
            elif q is not None:  # quanto: a tensor subclass of packed data, scale and shift
                names, _ = q.__tensor_flatten__()
                tensors += [getattr(q, n) for n in names]
        total += sum(_tensor_nbytes(t) for t in tensors if isinstance(t, Tensor))
    return total


def _tensor_nbytes(t: Tensor) -> int:
    if hasattr(t, "__tensor_flatten__") and type(t) is not Tensor:  # packed tensor subclasses (quanto's int2/int4)
        names, _ = t.__tensor_flatten__()
        return sum(_tensor_nbytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def _hf_cache(model: nn.Module, backend: str, bits: int, plan: KvQuantPlan):
    try:
        from transformers import QuantizedCache

        return QuantizedCache(backend, model.config, nbits=bits,  # type: ignore[arg-type]  # a PreTrainedConfig
                              q_group_size=plan.group_for(bits),
                              residual_length=plan.residual)
    except ImportError as exc:
        raise InputError(f"transformers' QuantizedCache needs the {backend!r} backend: {exc}") from exc


def _sinklab_cache(model: nn.Module, bits: int, protect: str, sinks: list[int], plan: KvQuantPlan) -> tuple[Cache, Protection]:
    """The packed cache of one row and its protection (``16-bit``: every token kept, unquantized)."""
    if protect == "16-bit":  # a residual longer than any text: nothing is ever packed
        return quantized_sink_cache(model, 8, None, residual=1 << 62), Protection(first=1 << 62)
    guard = {"none": Protection(), "first": Protection(first=plan.num_first),
             "detected": Protection(positions=tuple(sinks))}[protect]
    return quantized_sink_cache(model, bits, guard, group_size=plan.group_for(bits), residual=plan.residual,
                                value_group=plan.value_group, clip=plan.clip), guard


class _Runner:
    """The forwards of one sample: prefill + scored chunk on a cache, and timed greedy decode."""

    def __init__(self, model: nn.Module, ids: Tensor, plan: KvQuantPlan) -> None:
        self.model, self.plan = model, plan
        self.kwarg = _compat.cache_kwarg_name(model)
        self.device = _compat.input_device(model)
        self.ids = ids.to(self.device)[None]  # (1, context + score)

    @torch.no_grad()
    def logprobs(self, cache) -> Tensor:
        """Log-probabilities ``[score, V]`` of the scored tokens' successors (the last one predicts past the text)."""
        c = self.plan.context
        self.model(input_ids=self.ids[:, :c], use_cache=True, **{self.kwarg: cache})
        logits = self.model(input_ids=self.ids[:, c:], use_cache=True, **{self.kwarg: cache}).logits[0]
        return torch.log_softmax(logits.float(), -1)

    @torch.no_grad()
    def decode_ms(self, caches: dict, steps: int, advance: Callable[[str, int], None]) -> dict:
        """Median ms of a greedy one-token forward on top of each ``{key: (cache, first token)}``.

        Interleaved: each round decodes one token on every cache in turn, so load on the machine spreads
        over all caches alike."""
        tokens = {key: first.view(1, 1).to(self.device) for key, (_, first) in caches.items()}
        times: dict = {key: [] for key in caches}
        for _ in range(steps):
            for key, (cache, _) in caches.items():
                t0 = time.perf_counter()
                logits = self.model(input_ids=tokens[key], use_cache=True, **{self.kwarg: cache}).logits
                times[key].append(time.perf_counter() - t0)
                tokens[key] = logits[:, -1].argmax(-1, keepdim=True)
                advance("decode (interleaved)", 1)
        return {key: 1000.0 * float(torch.tensor(t).median()) if t else math.nan for key, t in times.items()}


def sample_windows(ids: Tensor, plan: KvQuantPlan, prefix: Sequence[int] = ()) -> list[Tensor]:
    """The plan's ``samples`` windows ``[context + score]``: ``prefix`` (the tokenizer's special prefix,
    :func:`sinklab.texts.special_affixes`), then the next stretch of ``ids`` ``[N]`` (text tokens without special
    tokens; consecutive stretches, so no text token is used twice).

    >>> [w.tolist() for w in sample_windows(torch.arange(10, 20), KvQuantPlan(context=2, score=1, samples=2,
    ...                                      group_size=1, group_size_2bit=1), prefix=[2])]
    [[2, 10, 11], [2, 12, 13]]
    """
    ids, head = ids.reshape(-1).long().cpu(), torch.tensor(list(prefix), dtype=torch.long)
    body = plan.context + plan.score - head.numel()
    if body < 1:
        raise InputError(f"a window of {plan.context + plan.score} tokens leaves no room for text after the "
                         f"{head.numel()} special tokens every prompt starts with")
    if ids.numel() < plan.samples * body:
        raise InputError(f"kv-quant needs {plan.samples * body} tokens of text ({plan.samples} samples × (context "
                         f"{plan.context} + score {plan.score}{f' − {head.numel()} special' if head.numel() else ''}))"
                         f", the text has {ids.numel()}: give a longer text or fewer samples")
    return [torch.cat([head, ids[s * body:(s + 1) * body]]) for s in range(plan.samples)]


def kv_quant(model: nn.Module, ids: Tensor, plan: KvQuantPlan | None = None, *, prefix: Sequence[int] = (),
             progress: Progress | None = None) -> KvQuantResult:
    """Compare packed KV caches at ``plan.bits`` × ``plan.protect`` with the unquantized cache on ``ids`` ``[N]``
    (text tokens without special tokens), in windows that start with ``prefix`` (:func:`sample_windows`: pass the
    tokenizer's special prefix, e.g. Gemma's ``<bos>``, so that each window is the prompt a user would cache).

    Returns one row per cache with :data:`ROW_KEYS` (plus ``mean_kl``, ``bytes_ratio_16bit`` — bytes per
    token over a 16-bit unquantized cache's — and ``protected_tokens``). The ``full`` row is the unquantized
    ``DynamicCache`` in the model's dtype; ``hf-<backend>`` rows are transformers' ``QuantizedCache``.
    """
    was_training = model.training  # the model comes back in the mode it came in
    try:
        return _kv_quant(model, ids, plan, prefix=prefix, progress=progress)
    finally:
        model.train(was_training)


def _configs(model: nn.Module, plan: KvQuantPlan) -> tuple[list[tuple[str, int, str]], dict[str, str]]:
    """The configurations to compare, ``(kind, bits, protection)``, and the transformers backends the model
    refuses (by name, with why). A missing backend fails here, not after an hour."""
    skipped = {}
    for name in plan.hf_backends:
        try:
            _hf_cache(model, name, HF_BACKENDS[name][1], plan)
        except ValueError as exc:  # transformers refuses the model (e.g. sliding-window layers): say so, go on
            if isinstance(exc, InputError):
                raise
            skipped[name] = str(exc)
    configs: list[tuple[str, int, str]] = [("full", 0, "full"), ("sinklab", 16, "16-bit")]
    configs += [("sinklab", b, p) for b in plan.bits for p in plan.protect]
    configs += [("hf", b, f"hf-{name}") for name, b in plan.hf_configs() if name not in skipped]
    return configs, skipped


def _cache_for(model: nn.Module, config: tuple[str, int, str], sinks: list[int],
               plan: KvQuantPlan) -> tuple[Cache, Protection]:
    """A fresh cache of one configuration and the tokens it protects (none but sinklab's)."""
    kind, bits, protect = config
    if kind == "full":
        return DynamicCache(config=model.config), Protection()  # type: ignore[arg-type]  # a PreTrainedConfig
    if kind == "hf":
        return _hf_cache(model, protect[3:], bits, plan), Protection()
    return _sinklab_cache(model, bits, protect, sinks, plan)


def _kv_quant(model: nn.Module, ids: Tensor, plan: KvQuantPlan | None = None, *, prefix: Sequence[int] = (),
              progress: Progress | None = None) -> KvQuantResult:
    plan = plan or KvQuantPlan()
    windows = sample_windows(ids, plan, prefix)
    configs, skipped = _configs(model, plan)
    model.eval()
    tick = progress or (lambda label, n: None)
    kl: dict[tuple, list[Tensor]] = {c: [] for c in configs}
    top1: dict[tuple, list[Tensor]] = {c: [] for c in configs}
    nll: dict[tuple, list[Tensor]] = {c: [] for c in configs}
    nbytes: dict[tuple, float] = {}
    at_length: dict[tuple, dict[int, float]] = {}
    timed: dict[tuple, tuple] = {}  # sample 0's caches and next tokens, decoded at the end
    protected: dict[tuple, list[int]] = {c: [] for c in configs}
    detected: list[list[int]] = []
    span = plan.context + plan.score
    first_run = None
    for s, window in enumerate(windows):
        run = _Runner(model, window, plan)
        sinks = detect_sinks(model, window[: plan.context], eps=plan.eps, share=plan.share)
        detected.append(sinks)
        tick("detect sinks", 1)
        targets = window[plan.context + 1:].to(run.device)
        ref = None
        for config in configs:
            _, bits, protect = config
            cache, guard = _cache_for(model, config, sinks, plan)
            logp = run.logprobs(cache)
            tick(f"{bits or 'full'}-bit {protect}", 1)
            if ref is None:
                ref = logp
            kl[config].append((ref.exp() * (ref - logp)).sum(-1).clamp_min(0.0).cpu())
            top1[config].append((logp.argmax(-1) == ref.argmax(-1)).cpu())
            nll[config].append(-logp[:-1].gather(-1, targets[:, None])[:, 0].cpu())
            protected[config].append(int(guard.mask(torch.arange(span)).sum()))
            if s == 0:
                nbytes[config] = _cache_nbytes(cache) / span
                timed[config] = (cache, logp[-1].argmax())
                at_length[config] = {n: _filled_bytes_per_token(model, _cache_for(model, config, sinks, plan)[0], n)
                                     for n in plan.bytes_lengths}
        if s == 0:
            first_run = run
    ms = first_run.decode_ms(timed, plan.decode_steps, tick)  # type: ignore[union-attr]  # (at least one sample)
    del timed
    dense16 = dense_bytes_per_token(model, 2)
    rows = []
    for config in configs:
        kind, bits, protect = config
        k = torch.cat(kl[config]).double()
        rows.append({
            "bits": bits if kind != "full" else 8 * next(model.parameters()).element_size(),
            "protect": protect,
            "median_kl": float(k.median()), "p90_kl": float(torch.quantile(k, 0.9)), "mean_kl": float(k.mean()),
            "top1": float(torch.cat(top1[config]).double().mean()),
            "ppl": float(torch.cat(nll[config]).double().mean().exp()),
            "bytes_per_token": nbytes[config], "bytes_ratio_16bit": nbytes[config] / dense16,
            "ms_per_token": ms[config],
            "cached_tokens": span,
            **{f"bytes_per_token_{n}": b for n, b in at_length[config].items()},
            **{f"bytes_ratio_16bit_{n}": b / dense16 for n, b in at_length[config].items()},
            "protected_tokens": sum(protected[config]) / len(protected[config]),
        })
    return KvQuantResult(rows, plan, detected, dense16, hf_skipped=skipped)


def kv_quant_text(model: nn.Module, tokenizer, text: str, plan: KvQuantPlan | None = None, *,
                  progress: Progress | None = None) -> KvQuantResult:
    """:func:`kv_quant` on a long ``text``: its tokens without special tokens, each window after the tokenizer's
    special prefix (:func:`sinklab.texts.special_affixes`: Gemma's ``<bos>``), as a prompt starts. ``meta`` holds
    ``window_prefix`` and ``detected_tokens`` (each window's detected sinks as readable token strings)."""
    plan = plan or KvQuantPlan()
    encoded = tokenizer(text[: plan.tokens * 16], add_special_tokens=False, verbose=False)["input_ids"]
    if len(encoded) < plan.tokens:  # a text of unusually long tokens: encode all of it
        encoded = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    ids, prefix = torch.tensor(encoded[: plan.tokens]), special_affixes(tokenizer)[0]
    result = kv_quant(model, ids, plan, prefix=prefix, progress=progress)
    windows = sample_windows(ids, plan, prefix)
    result.meta = {"window_prefix": readable_tokens(tokenizer, prefix),
                   "detected_tokens": [readable_tokens(tokenizer, [int(w[p]) for p in pos])
                                       for w, pos in zip(windows, result.detected)]}
    return result
