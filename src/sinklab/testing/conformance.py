"""The architecture matrix as test infrastructure: tiny models of every type through sinklab's entry points.

Each :class:`Configuration` (a transformers model type, a layer count, config overrides) is built by
:func:`sinklab.testing.tiny.build` and run through five cells against independent references:

* ``scan`` — ``sinklab.scan`` on two 32-token windows of a character-level tokenizer; sample 0's attention maps
  against the model's own eager attention weights (``output_attentions=True``) of the same tokens;
* ``stream`` — ``SinkCache(num_sinks=4, window=64)`` through the model's own ``generate`` (nothing evicted)
  against ``generate`` with the model's default cache: same greedy tokens, first-step logits within 1e-4;
* ``stream_evicted`` — a one-layer variant fed a 40-token chunk, then 20 single tokens, through
  ``SinkCache(num_sinks=4, window=8)``; every position's logits against a plain forward of the model over
  exactly the kept tokens (the first 4 and the 8 most recent) at positions 0 … n−1 (exact for one layer with one
  cached attention layer); in float32 and again in float64. A hybrid: token by token against the float64 stream
  reference (:mod:`sinklab.testing.reference`);
* ``diagnose`` — ``sinklab.diagnose`` with one edited layer and sample; the result serialises and is finite;
* ``circuit`` — ``sinklab.circuit`` with one causal and one condition sample (causal LMs and text encoders).

Each cell is ``ok``, ``refused: <sinklab's message>`` (an ``UnsupportedModelError``/``InputError``), ``crash:
<exception, last frame>``, ``wrong: <measured error>`` or ``n/a: <why>``; a model that cannot be built at all
is ``not built: <reason>`` (distinct from sinklab refusing it).

The test suite (``tests/test_architectures.py``) runs a slice of it in-process; ``benchmarks/architectures.py``
runs every type (one process each) and writes ``docs/architectures.md`` with the :func:`source_fingerprint` of
the sources the cells exercise, which the suite compares with the code under test.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import math
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from .. import _compat
from ..circuit.analysis import circuit
from ..diagnose import diagnose, diagnose_inputs
from ..errors import InputError, UnsupportedModelError
from ..scan import scan, scan_inputs
from ..stream.cache import SinkCache
from ..texts import tokenize_windows
from .reference import Reference
from .tiny import (
    LAYERS,
    OWN_WINDOW,
    SEED,
    Built,
    NotBuilt,
    build,
    parse_name,
    random_ids,
    short_error,
    texts,
    tiny_tokenizer,
    vision_batch,
)

CELLS = ("scan", "stream", "stream_evicted", "diagnose", "circuit")
STATUSES = ("ok", "refused", "crash", "wrong", "n/a")
EVICT_SINKS, EVICT_WINDOW, EVICT_PROMPT, EVICT_STEPS = 4, 8, 40, 20
EVICT_OWN_WINDOW = 64  # > sinks + window: the one-layer check is the sinks + window rule
STREAM_PROMPT, STREAM_NEW = 16, 8
TEXT_LEN = 32  # tokens per scan/diagnose/circuit window
#: float64: the model's own rotary tables are float32 even in a float64 model (transformers computes cos/sin in
#: float32), so the plain-forward reference itself carries rounding of that order.
TOLERANCE, TOLERANCE_F64 = 1e-4, 1e-6


@dataclass(frozen=True)
class Configuration:
    """One row of the matrix: a model type (``llama``, ``bert@base``) built with ``layers`` decoder layers and the
    config ``overrides`` on top of the shrunk default config (:func:`sinklab.testing.tiny.build`).

    ``prefer_full``: the one-layer model of ``stream_evicted`` is a global layer (False: the first layer kind the
    shrinker keeps, a sliding one where the type mixes them). ``why``: what this configuration exercises that the
    type's default row does not.
    """

    type: str
    layers: int = LAYERS
    overrides: tuple[tuple[str, Any], ...] = ()
    prefer_full: bool = True
    why: str = ""

    @property
    def name(self) -> str:
        """The row's name: the type for its default configuration, else ``type [N layers, field=value …]``."""
        if self.layers == LAYERS and not self.overrides and self.prefer_full:
            return self.type
        parts = [f"{self.layers} layer{'s' if self.layers != 1 else ''}"]
        parts += [f"{k}={v}" for k, v in self.overrides]
        if not self.prefer_full:
            parts.append("evicted on its first layer kind")
        return f"{self.type} [{', '.join(parts)}]"

    def build(self, layers: int | None = None, window: int = OWN_WINDOW, *, prefer_full: bool = False) -> Built:
        """The tiny model of this configuration (``layers``: another layer count, for the one-layer variant)."""
        return build(self.type, self.layers if layers is None else layers, window, prefer_full=prefer_full,
                     overrides=dict(self.overrides))


#: Other configurations of some types: layer counts and mixes of layer kinds the default two-layer row does not
#: build (its rows run after the one row per type).
CONFIGURATIONS: tuple[Configuration, ...] = (
    Configuration("llama", layers=1, why="a one-layer model through scan, stream, diagnose and circuit"),
    Configuration("ergo", layers=1, prefer_full=False,
                  why="one sliding-window layer with RoPE: its own window kept natively by the stream, and "
                      "streamed past eviction (the type's row evicts a global layer without positions)"),
    Configuration("ergo", layers=4, why="three sliding layers with RoPE, one global layer without positions"),
    Configuration("gemma3_text", layers=4, why="three local layers, one global layer, one rotary table per kind"),
    Configuration("gpt_oss", layers=3, why="learned sinks over two sliding layers and one full layer"),
    Configuration("inkling_text", layers=4, overrides=(("swa_num_attention_heads", 8),),
                  why="four layers of two kinds with different head counts (sliding 8, global 4)"),
    Configuration("qwen3_next", layers=4, why="a hybrid with three linear-attention layers before its attention"),
    Configuration("exaone4", layers=4, why="three local RoPE layers and one global NoPE layer"),
)


@dataclass
class Cell:
    """One cell of the matrix: a status in :data:`STATUSES`, its message (the reason or the measured error)."""

    status: str
    message: str = ""
    seconds: float = 0.0

    def text(self) -> str:
        return self.status if not self.message else f"{self.status}: {self.message}"


# ----------------------------------------------------------------------------- running one cell
class NotApplicable(Exception):
    """The cell does not apply to this model, or its reference (the model's own code) fails."""


def _frame(tb_frame: traceback.FrameSummary) -> str:
    path = tb_frame.filename
    for marker in ("site-packages/", "/src/", "/benchmarks/", "/tests/"):
        if marker in path:
            path = path.split(marker, 1)[1]
            break
    return f"{path}:{tb_frame.lineno} in {tb_frame.name}"


def crash_text(exc: BaseException, limit: int = 400) -> str:
    """``Type: message [at file:line in function]`` of the exception's last frame, and the deepest sinklab frame
    when the last frame is not sinklab's."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = _frame(frames[-1]) if frames else "?"
    ours = [f for f in frames if "/sinklab/" in f.filename.replace("\\", "/")]
    via = f"; via {_frame(ours[-1])}" if ours and ours[-1] is not frames[-1] else ""
    return f"{short_error(exc, limit)} [at {where}{via}]"


def run_cell(fn: Callable[[], Cell]) -> Cell:
    """Run one cell: its own result (``ok``/``wrong``/``n/a``), or ``refused`` for sinklab's
    ``UnsupportedModelError``/``InputError``, ``n/a`` for :class:`NotApplicable`, ``crash`` for anything else."""
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cell = fn()
    except (UnsupportedModelError, InputError) as exc:
        cell = Cell("refused", " ".join(str(exc).split()))
    except NotApplicable as exc:
        cell = Cell("n/a", str(exc))
    except Exception as exc:  # noqa: BLE001 - a crash is a result here
        cell = Cell("crash", crash_text(exc))
    cell.seconds = round(time.perf_counter() - t0, 2)
    return cell


def reference(what: str, fn: Callable[[], Any]) -> Any:
    """Run the model's own code for a reference; its failure makes the cell n/a (it is not sinklab's)."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001
        raise NotApplicable(f"{what} fails: {short_error(exc, 200)}") from None


def relative_error(ours: Tensor, ref: Tensor) -> float:
    """``max |ours − ref| / max |ref|`` in float64 (inf when a side is not finite)."""
    ours, ref = ours.double(), ref.double()
    if not bool(torch.isfinite(ours).all() and torch.isfinite(ref).all()):
        return math.inf
    return float((ours - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def eager_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` on transformers' eager attention (for ``output_attentions``)."""
    dtype = next(model.parameters()).dtype
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cls: Any = type(model)
        twin = cls._from_config(copy.deepcopy(model.config), attn_implementation="eager", dtype=dtype)
    twin.load_state_dict(model.state_dict())
    return twin.eval()


# ----------------------------------------------------------------------------- the cells
def cell_scan(built: Built, tok) -> Cell:
    """``sinklab.scan`` (``scan_inputs`` for images): sample 0's attention maps ``(L, H, T, T)`` against the
    model's own eager attention weights of the same input (``output_attentions=True``), max abs difference
    ≤ 1e-4 on every layer that returns weights. Without such a layer: every map row finite and summing to
    1 − the learned sink mass of its head (``wrong`` otherwise)."""
    model = built.model
    if built.kind == "vision":
        batches, labels = vision_batch()
        result = scan_inputs(model, batches, labels, map_len=64)
        one = {"pixel_values": batches[0]["pixel_values"][:1]}
    else:
        result = scan(model, tok, texts(), seq_len=TEXT_LEN, samples=2, batch_size=2, map_len=64)
        windows = tokenize_windows(tok, texts(), TEXT_LEN, 2)
        n = int(windows.attention_mask[0].sum())
        one = {"input_ids": windows.input_ids[:1, :n], "attention_mask": windows.attention_mask[:1, :n]}
    assert result.attention_maps is not None and result.learned_sink_mass is not None  # map_len > 0: both kept
    maps = result.attention_maps.double()  # (L, H, m, m)
    attn = result.attention_layers  # a hybrid's recurrent layers have no map (NaN)
    if not attn or not bool(torch.isfinite(result.column_mass[0][attn][:, :, : maps.shape[-1]]).all()):
        return Cell("wrong", "non-finite column mass in sample 0")
    try:
        with torch.no_grad():
            out = eager_copy(model)(**one, output_attentions=True)
        weights = getattr(out, "attentions", None) or ()
    except Exception as exc:  # noqa: BLE001 - no reference weights: fall back to the row sums
        weights, why = (), f"eager output_attentions fails ({short_error(exc, 120)})"
    else:
        why = "the model returns no attention weights"
    m = maps.shape[-1]
    # Learned sink logits take part of each row's mass; models' eager weights either leave that share out (gpt-oss)
    # or renormalise over the keys (Granite-SWA), so with learned sinks both sides are compared as distributions
    # over the keys.
    sinks = bool((result.learned_sink_mass[0].abs() > 1e-6).any())
    compared, worst = 0, 0.0
    # Hybrids return weights for their attention layers only, in order.
    layer_of = attn if len(attn) < maps.shape[0] and len(weights) == len(attn) else range(len(weights))
    for layer, w in zip(layer_of, weights):
        if not isinstance(w, Tensor) or layer >= maps.shape[0] or w.dim() != 4 or w.shape[-2] < m or w.shape[-1] < m:
            continue
        ours, ref = maps[layer], w[0, :, :m, :m].double()
        if ref.shape != ours.shape:
            continue
        if sinks:
            ours, ref = ours / ours.sum(-1, keepdim=True), ref / ref.sum(-1, keepdim=True)
        compared += 1
        worst = max(worst, float((ours - ref).abs().max()) if bool(torch.isfinite(ours).all()) else math.inf)
    if compared:
        others = maps.shape[0] - len(attn)
        msg = (f"attention maps vs eager output_attentions on {compared}/{maps.shape[0]} layers"
               f"{f' ({others} recurrent/MLP-only, marked as such)' if others else ''}"
               f"{' (rows normalised over the keys: learned sinks)' if sinks else ''}: max abs diff {worst:.1e}")
        return Cell("ok" if worst <= TOLERANCE else "wrong", msg)
    rows = maps[attn].sum(-1)  # (L, H, m)
    sink = result.learned_sink_mass[0][attn].double()[:, :, None]  # (L, H, 1)
    err = float((rows + sink - 1).abs().max()) if bool(torch.isfinite(rows).all()) else math.inf
    msg = f"{why}; map rows + learned sink mass − 1: max {err:.1e}"
    return Cell("ok" if err <= TOLERANCE else "wrong", msg)


def _generate(model: nn.Module, ids: Tensor, **extra: Any) -> Any:
    kwargs = dict(max_new_tokens=STREAM_NEW, do_sample=False, output_logits=True, return_dict_in_generate=True,
                  eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        return model.generate(  # type: ignore[operator]  # a transformers GenerationMixin
            ids, attention_mask=torch.ones_like(ids), **kwargs, **extra)


def cell_stream(built: Built) -> Cell:
    """``SinkCache(num_sinks=4, window=64)`` through the model's own ``generate`` (16-token prompt, 8 greedy
    tokens: nothing evicted) against ``generate`` with the model's default cache: the same tokens and first-step
    logits within 1e-4 relative (a token that differs where the reference's top two logits are closer than the
    measured logit error is a near tie, not a failure)."""
    if built.kind != "causal":
        raise NotApplicable("a base model without an LM head: nothing to generate")
    model = built.model
    ids = random_ids(STREAM_PROMPT)
    SinkCache(model, num_sinks=4, window=64).close()  # a refusal comes first, before the reference runs
    ref = reference("the model's own generate", lambda: _generate(model, ids))
    with SinkCache(model, num_sinks=4, window=64) as cache:
        ours = _generate(model, ids, **{_compat.cache_kwarg_name(model): cache})
    errors = [relative_error(a[0], b[0]) for a, b in zip(ours.logits, ref.logits)]
    same = torch.equal(ours.sequences, ref.sequences)
    if not same:
        step = int((ours.sequences[0] != ref.sequences[0]).nonzero()[0]) - ids.shape[1]
        top2 = ref.logits[step][0].double().topk(2).values
        gap = float((top2[0] - top2[1]) / ref.logits[step][0].double().abs().max())
        if max(errors[: step + 1]) <= TOLERANCE and gap <= 2 * max(errors[step], 1e-7):
            return Cell("ok", f"near tie at step {step} (top-2 gap {gap:.1e}); logits within {max(errors[:step + 1]):.1e}")
        return Cell("wrong", f"greedy tokens differ from step {step}; logit error there {errors[step]:.1e}, "
                             f"first step {errors[0]:.1e}")
    if errors[0] > TOLERANCE:
        return Cell("wrong", f"first-step logits differ by {errors[0]:.1e} relative (tokens equal)")
    return Cell("ok", f"tokens equal; logits: first step {errors[0]:.1e}, worst step {max(errors):.1e} relative")


def kept_tokens(tokens: Tensor, i: int, sinks: int = EVICT_SINKS, window: int = EVICT_WINDOW) -> Tensor:
    """``[1, n]`` the tokens a StreamingLLM cache keeps for the query at position ``i`` of ``tokens`` ``[1, N]``:
    the first ``sinks`` and the ``window`` most recent (``i`` included)."""
    recent = max(sinks, i + 1 - window)
    return torch.cat([tokens[:, : min(sinks, i + 1)], tokens[:, recent : i + 1]], dim=1)


def plain_kept_logits(model: nn.Module, tokens: Tensor) -> list[Tensor]:
    """The reference of :func:`stream_error`: for every position ``i`` of ``tokens`` ``[1, N]``, the last logits
    ``[V]`` of a plain forward (no cache) over :func:`kept_tokens` at positions 0 … n−1. Queries with the same
    number of kept tokens go through one batched forward."""
    by_length: dict[int, list[int]] = {}
    for i in range(tokens.shape[1]):
        by_length.setdefault(kept_tokens(tokens, i).shape[1], []).append(i)
    out: dict[int, Tensor] = {}
    for n, rows in by_length.items():
        batch = torch.cat([kept_tokens(tokens, i) for i in rows])  # (len(rows), n)
        positions = torch.arange(n)[None].expand(len(rows), n)
        logits = model(input_ids=batch, position_ids=positions, use_cache=False).logits[:, -1]
        out.update(zip(rows, logits))
    return [out[i] for i in range(tokens.shape[1])]


def stream_error(model: nn.Module, tokens: Tensor) -> float:
    """Max relative logit error of a one-layer model streamed through ``SinkCache(4, 8)`` — a chunk of
    :data:`EVICT_PROMPT` tokens, then one token per forward — against :func:`plain_kept_logits`, at every position
    of ``tokens`` ``[1, N]``."""
    SinkCache(model, num_sinks=EVICT_SINKS, window=EVICT_WINDOW).close()  # a refusal comes first
    with torch.no_grad():
        refs = reference("the model's plain forward", lambda: plain_kept_logits(model, tokens))
        ours = []
        with SinkCache(model, num_sinks=EVICT_SINKS, window=EVICT_WINDOW) as cache:
            kw = {_compat.cache_kwarg_name(model): cache, "use_cache": True}
            ours += list(model(input_ids=tokens[:, :EVICT_PROMPT], **kw).logits[0])
            for i in range(EVICT_PROMPT, tokens.shape[1]):
                ours.append(model(input_ids=tokens[:, i : i + 1], **kw).logits[0, -1])
    return max(relative_error(a, b) for a, b in zip(ours, refs))


def hybrid_stream_error(model: nn.Module, tokens: Tensor) -> tuple[float, float]:
    """Max relative logit error of a hybrid model (recurrent layers between attention layers) streamed token by
    token through ``SinkCache(4, 8)`` against the float64 StreamingLLM reference of the test suite
    (:mod:`sinklab.testing.reference`: the model's own cache for the recurrent layers, the kept keys re-rotated to
    their slot positions by the model's own rotary code). A plain forward over the kept tokens is no reference
    here: the recurrent layers have seen every token. Also returns how far the dense (nothing evicted) logits
    are from the reference, so a check where eviction changes nothing shows as such."""
    ref = reference("the float64 stream reference", lambda: Reference(model, EVICT_SINKS, EVICT_WINDOW))
    want = reference("the float64 stream reference", lambda: [ref.step(int(t)) for t in tokens[0]])
    worst = 0.0
    with torch.no_grad(), SinkCache(model, num_sinks=EVICT_SINKS, window=EVICT_WINDOW) as cache:
        kw = {_compat.cache_kwarg_name(model): cache, "use_cache": True}
        for i in range(tokens.shape[1]):
            ours = model(input_ids=tokens[:, i : i + 1], **kw).logits[0, -1]
            worst = max(worst, relative_error(ours, want[i]))
    with torch.no_grad():
        dense = model(input_ids=tokens).logits[0]  # nothing evicted: how far eviction moves the logits
    moved = max(relative_error(dense[i], want[i]) for i in range(tokens.shape[1]))
    return worst, moved


def cached_layers(model: nn.Module) -> int:
    """Attention layers the model's own cache holds after a 4-token forward (1 when it cannot tell)."""
    try:
        with torch.no_grad():
            out = model(input_ids=random_ids(4), use_cache=True)
        cache = out.get("past_key_values", out.get("cache"))
        return max(1, sum(isinstance(getattr(layer, "keys", None), Tensor) and layer.keys.numel() > 0
                          for layer in getattr(cache, "layers", [])))
    except Exception:  # noqa: BLE001 - the stream cell itself will show what fails
        return 1


def _float64(model: nn.Module) -> nn.Module:
    twin = copy.deepcopy(model).double()
    setter = getattr(twin, "set_experts_implementation", None)
    if setter is not None:  # grouped-mm MoE kernels have no float64 path
        try:
            setter("eager")
        except Exception:  # noqa: BLE001
            pass
    return twin


def cell_stream_evicted(built: Built, config: Configuration | None = None) -> Cell:
    """A one-layer variant (its own sliding window, if any, widened to 64) streamed past eviction through
    ``SinkCache(num_sinks=4, window=8)``: 40 tokens in one chunk, then 20 single tokens; every position's logits
    against a plain forward over exactly the kept tokens at positions 0 … n−1 (with one layer a kept key depends
    only on its token and position, so this is exact): ≤ 1e-4 relative in float32, ≤ 1e-6 in float64 (the bound
    of the reference's own float32 rotary tables). n/a where the one block caches several attention layers (one
    reads another's output: the reference is no longer exact)."""
    if built.kind != "causal":
        raise NotApplicable("a base model without an LM head: nothing to stream")
    probe = SinkCache(built.model, num_sinks=EVICT_SINKS, window=EVICT_WINDOW)  # a refusal comes first
    hybrid = bool(probe.recurrent_layers)
    probe.close()
    if hybrid:  # recurrent layers have seen every token: the float64 stream reference, on the built model
        tokens = random_ids(EVICT_PROMPT + EVICT_STEPS, seed=SEED + 1)
        err64, moved = hybrid_stream_error(_float64(built.model), tokens)
        return Cell("ok" if err64 <= TOLERANCE_F64 else "wrong",
                    f"hybrid, against the float64 stream reference (sinklab.testing.reference): {err64:.1e} "
                    f"(eviction itself moves the logits by {moved:.1e})")
    config = config or Configuration(built.name)
    if config.name != config.type and not config.overrides and config.prefer_full:
        raise NotApplicable(f"its one-layer variant is the {config.type} row's (the same model, checked there)")
    try:
        one = config.build(1, EVICT_OWN_WINDOW, prefer_full=config.prefer_full)
    except NotBuilt as exc:
        raise NotApplicable(f"one-layer model not built: {exc}") from None
    SinkCache(one.model, num_sinks=EVICT_SINKS, window=EVICT_WINDOW).close()  # a refusal comes first
    cached = cached_layers(one.model)
    if cached > 1:
        raise NotApplicable(f"its one block caches {cached} attention layers (a later one reads an earlier one's "
                            "output), so a plain forward over the kept tokens is no exact reference")
    tokens = random_ids(EVICT_PROMPT + EVICT_STEPS, seed=SEED + 1)
    err32 = stream_error(one.model, tokens)
    if err32 > TOLERANCE:
        return Cell("wrong", f"float32: max relative logit error {err32:.1e} past eviction")
    try:
        err64 = stream_error(_float64(one.model), tokens)
    except NotApplicable as exc:
        return Cell("ok", f"float32 {err32:.1e}; float64 not run ({exc})")
    except Exception as exc:  # noqa: BLE001 - the float32 stream worked: a float64-only failure
        if isinstance(exc, (UnsupportedModelError, InputError)):
            return Cell("refused", f"float64 only: {' '.join(str(exc).split())}")
        return Cell("crash", f"float64 only (float32 ok, {err32:.1e}): {crash_text(exc)}")
    if err64 > TOLERANCE_F64:
        return Cell("wrong", f"float64: max relative logit error {err64:.1e} (float32 {err32:.1e})")
    return Cell("ok", f"float32 {err32:.1e}, float64 {err64:.1e}")


def finite_json(obj: object) -> bool:
    """Whether every float in a JSON-ready structure is finite (None for missing values is fine)."""
    if isinstance(obj, float):
        return math.isfinite(obj)
    if isinstance(obj, dict):
        return all(finite_json(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return all(finite_json(v) for v in obj)
    return True


def cell_diagnose(built: Built, tok) -> Cell:
    """``sinklab.diagnose`` (``diagnose_inputs`` for images) on two windows, one edited layer and sample: it
    serialises, and the causal edits' numbers are finite."""
    if built.kind == "vision":
        batches, labels = vision_batch()
        d = diagnose_inputs(built.model, batches, labels, edit_samples=1, edit_layers=1)
    else:
        d = diagnose(built.model, tok, texts(), seq_len=TEXT_LEN, samples=2, batch_size=2, edit_samples=1,
                             edit_layers=1)
    data = json.loads(json.dumps(d.to_json()))
    if not finite_json(data["edits"]):
        return Cell("wrong", "non-finite causal-edit results")
    return Cell("ok", f"{len(d.records)} sinks, {len(d.edits)} edited heads")


def cell_circuit(built: Built, tok) -> Cell:
    """``sinklab.circuit`` on two windows, one causal and one condition sample: it serialises."""
    if built.kind == "vision":
        raise NotApplicable("an image model: the circuit's conditions are token edits")
    r = circuit(built.model, tok, texts(), seq_len=TEXT_LEN, samples=2, batch_size=2, causal_samples=1,
                        condition_samples=1)
    json.dumps(r.to_json())
    return Cell("ok", "")


# ----------------------------------------------------------------------------- one row, in-process
def configuration(name: str) -> Configuration:
    """The configuration of row ``name``: a type's default row or one of :data:`CONFIGURATIONS`."""
    for config in CONFIGURATIONS:
        if config.name == name:
            return config
    return Configuration(name)


def row_names(types: list[str] | None = None) -> list[str]:
    """Every row: one per type of :func:`sinklab.testing.tiny.all_types`, then :data:`CONFIGURATIONS` (``types``:
    only the rows of those types)."""
    from .tiny import all_types

    names = [t for t in all_types() if types is None or t in types]
    return names + [c.name for c in CONFIGURATIONS if types is None or c.type in types]


def run_cells(built: Built, config: Configuration | None = None, cells: tuple[str, ...] = CELLS,
              report: Callable[[tuple], None] | None = None) -> dict[str, Cell]:
    """Run ``cells`` on a built model, each seeded; ``report`` receives ``("cell", name, cell_dict)`` as they
    finish. Returns ``{cell: Cell}``."""
    tok = tiny_tokenizer()
    run: dict[str, Callable[[], Cell]] = {
        "scan": lambda: cell_scan(built, tok),
        "stream": lambda: cell_stream(built),
        "stream_evicted": lambda: cell_stream_evicted(built, config),
        "diagnose": lambda: cell_diagnose(built, tok),
        "circuit": lambda: cell_circuit(built, tok),
    }
    out = {}
    for name in cells:
        torch.manual_seed(SEED)
        out[name] = run_cell(run[name])
        if report is not None:
            report(("cell", name, asdict(out[name])))
    return out


def run_row(name: str, report: Callable[[tuple], None] | None = None) -> dict:
    """Build row ``name`` (:func:`configuration`) and run every cell in this process; returns its JSON row.
    ``report`` receives ``("built", info)`` and ``("cell", cell_name, cell_dict)`` as they happen (the matrix's
    worker processes send them on)."""
    report = report or (lambda message: None)
    config = configuration(name)
    t0 = time.perf_counter()
    torch.manual_seed(SEED)
    row: dict = {"type": name, "model_type": parse_name(config.type)[0], "built": False, "cells": {}}
    if config.why:
        row["why"] = config.why
    try:
        built = config.build()
    except NotBuilt as exc:
        row["not_built"] = str(exc)
        report(("built", {"built": False, "not_built": str(exc)}))
        row["seconds"] = round(time.perf_counter() - t0, 2)
        return row
    info = {"built": True, "kind": built.kind, "class": type(built.model).__name__, "attn": built.attn,
            "attempt": built.attempt, "parameters": sum(p.numel() for p in built.model.parameters())}
    row.update(info)
    report(("built", info))
    row["cells"] = {k: asdict(v) for k, v in run_cells(built, config, report=report).items()}
    row["seconds"] = round(time.perf_counter() - t0, 2)
    return row


# ----------------------------------------------------------------------------- what the matrix was made from
#: Where the fingerprint starts: the modules the cells run (their imports are followed from here).
FINGERPRINT_ROOT = "sinklab.testing.conformance"


def _imports(path: Path, module: str, package: bool) -> set[str]:
    """The ``sinklab`` modules ``path`` (module ``module``) imports, at any depth of its code (function-level
    imports included), resolved to dotted names."""
    import ast

    found: set[str] = set()
    base = module.split(".") if package else module.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "sinklab"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parent = base[: len(base) - node.level + 1]
                target = ".".join(parent + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "sinklab":
                continue
            found.add(target)
            found |= {f"{target}.{a.name}" for a in node.names}  # `from . import x`: x may be a module
    return found


@functools.lru_cache(maxsize=None)
def source_files(root: str = FINGERPRINT_ROOT) -> tuple[Path, ...]:
    """The ``sinklab`` source files the matrix exercises: ``root`` and every sinklab module it imports, directly
    or through others (read statically, so a function-level import counts), with the ``__init__`` of each package
    on the way (but the top-level facade, which imports the whole library). Sorted; worked out once per process
    (the import graph of the installed sources does not change under a running process; their bytes are read
    afresh by :func:`source_fingerprint`)."""
    src = Path(__file__).resolve().parents[1]  # .../sinklab

    def locate(module: str) -> tuple[Path, bool] | None:
        rel = Path(*module.split(".")[1:])
        if (src / rel / "__init__.py").is_file():
            return src / rel / "__init__.py", True
        if (src / rel).with_suffix(".py").is_file():
            return (src / rel).with_suffix(".py"), False
        return None

    seen: dict[str, Path] = {}
    todo = [root]
    while todo:
        module = todo.pop()
        if module in seen or module == "sinklab":
            continue
        found = locate(module)
        if found is None:  # a name imported from a module, not a module
            continue
        path, package = found
        seen[module] = path
        parts = module.split(".")
        todo += [".".join(parts[:i]) for i in range(2, len(parts))]  # the packages on the way
        todo += sorted(_imports(path, module, package))
    return tuple(sorted(set(seen.values())))


def source_fingerprint(root: str = FINGERPRINT_ROOT) -> str:
    """SHA-256 (first 16 hex digits) over the path (relative to ``src/sinklab``) and bytes of every file of
    :func:`source_files`: what the committed matrix records, and what the suite recomputes to tell whether the
    table was made from the code under test."""
    src = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in source_files(root):
        digest.update(path.relative_to(src).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]
