"""Runs NVIDIA kvpress presses on token-id jobs, inside the kvpress venv (see ``_kvpress_env.py``; no sinklab here).

Usage: ``python _kvpress_worker.py JOB.json`` where the job is::

    {"model_dir": str, "threads": int,
     "presses": [{"method": str, "kv_fraction": float}],
     "items": [{"id": str, "kind": "generate", "context_ids": [int], "question_ids": [int], "max_new_tokens": int}
               | {"id": str, "kind": "generate", "context_ids": [int], "questions": [[int]], "max_new_tokens": int}
               | {"id": str, "kind": "ppl", "context_ids": [int], "continuation_ids": [int]}],
     "sliding_layers": "compress" | "skip"}          # optional, default "compress"; only for models with them

For each press x item, as kvpress's own pipeline does for a context/question split: prefill ``context_ids`` under the
press (it compresses each layer's cache once, at the end of the prefill), then, with no press active, either feed
``question_ids`` and greedily decode exactly ``max_new_tokens`` tokens (no EOS stop), or feed ``continuation_ids`` in
one forward and score every one of them (the first from the prefill's last logits). With ``questions`` the context is
compressed once and each question (an empty one: decode from the prompt's last logits) is asked of a copy of the
compressed cache. ``kv_fraction`` is the fraction
of the context's KV entries kept: ``compression_ratio = 1 - kv_fraction``.

One JSON line per press x item on stdout, nothing else there (logs and progress go to stderr)::

    {"id", "kind", "method", "kv_fraction", "compression_ratio", "context_len",
     "kept_tokens",      # KV entries kept after prefill, mean over layers and KV heads (KVzip: unmasked entries)
     "kept_by_layer",    # the same per layer
     "kept_entries", "kept_bytes",   # KV entries summed over layers and KV heads, and their bytes (key + value)
     "generated_ids" | "generated" | ("nll_sum", "n_scored"),   # ppl = exp(nll_sum / n_scored)
     "prefill_s", "post_s", "total_s", "attn_implementation", "patches", ["sliding_layers"]}
    or {"id", "kind", "method", "kv_fraction", "error"} when that press fails on that item.

Presses (kvpress 0.5.5 classes, ``compression_ratio=1 - kv_fraction``): dense (none), streaming
(``StreamingLLMPress(n_sink=4)``), snapkv (``SnapKVPress``), tova (``TOVAPress``), expected_attention
(``ExpectedAttentionPress``), knorm (``KnormPress``), kvzip (``KVzipPress``; masks entries instead of shrinking the
cache, refuses Gemma 3), adakv_expected_attention (``AdaKVPress(ExpectedAttentionPress)``: per-head budgets, masks
entries too), adakv_snapkv (``AdaKVPress(SnapKVPress)``), pyramidkv (``PyramidKVPress``: per-layer budgets). All run with SDPA attention: SnapKV and TOVA recompute the window's attention themselves when
the layer returns no weights, and KVzip asserts a non-eager implementation.

Where this worker departs from calling ``with press(model): model(...)`` and then the model as it stands, and why
(each applied one is named in the row's ``patches``):

* Gemma 3 (``Gemma3ForCausalLM``): kvpress hooks every layer, sliding-window ones included (it skips those only for
  ``Gemma3ForConditionalGeneration``), but transformers 5.2 then builds each later forward's masks from the sliding
  layers' cumulative length, which no longer matches the shrunk caches: the next forward fails with a size mismatch
  (and the full-attention layers would lose causality among new tokens). So for models with sliding layers the worker
  tracks the original position of every kept entry (found by matching the kept keys against the pre-compression keys)
  and hands each attention layer its own mask: causal, plus the sliding window for sliding layers.
  ``"sliding_layers": "skip"`` leaves the sliding layers uncompressed instead (kvpress's policy for
  ``Gemma3ForConditionalGeneration``). The sliding layers hold only the last ``sliding_window - 1`` context tokens
  when the press sees them, so a press there compresses that window (its "sinks" are the window's first tokens).
* Gemma 3's rotary embedding needs a ``layer_type`` that kvpress does not pass (``ExpectedAttentionPress`` calls
  ``module.rotary_emb(x, position_ids)``); each layer's ``rotary_emb`` is bound to that layer's type.
* KVzip reads the chat template of ``model.config.name_or_path`` to find the context inside a chat-formatted prompt;
  the jobs' contexts are raw token ids, so it is given the tokenizer without its chat template (kvpress's own path
  for models without one: nothing stripped before the context, "\\n" before the reconstruction).
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

import contextlib  # noqa: E402
import copy  # noqa: E402
import inspect  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from importlib.metadata import version  # noqa: E402
from typing import Callable, Iterator  # noqa: E402

import torch  # noqa: E402
import transformers  # noqa: E402
from torch import nn  # noqa: E402
from transformers import AutoModelForCausalLM, DynamicCache  # noqa: E402

import kvpress  # noqa: E402
from kvpress.presses import kvzip_press as _kvzip_module  # noqa: E402

transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

PRESSES: dict[str, Callable[[float], kvpress.BasePress] | None] = {
    "dense": None,
    "streaming": lambda ratio: kvpress.StreamingLLMPress(compression_ratio=ratio, n_sink=4),
    "snapkv": lambda ratio: kvpress.SnapKVPress(compression_ratio=ratio),
    "tova": lambda ratio: kvpress.TOVAPress(compression_ratio=ratio),
    "expected_attention": lambda ratio: kvpress.ExpectedAttentionPress(compression_ratio=ratio),
    "knorm": lambda ratio: kvpress.KnormPress(compression_ratio=ratio),
    "kvzip": lambda ratio: kvpress.KVzipPress(compression_ratio=ratio),
    "adakv_expected_attention": lambda ratio: kvpress.AdaKVPress(kvpress.ExpectedAttentionPress(compression_ratio=ratio)),
    "adakv_snapkv": lambda ratio: kvpress.AdaKVPress(kvpress.SnapKVPress(compression_ratio=ratio)),
    "pyramidkv": lambda ratio: kvpress.PyramidKVPress(compression_ratio=ratio),
}
# None of these needs the layers' attention weights (see the module docstring); KVzip must not run eager.
ATTN_IMPLEMENTATION = {method: "sdpa" for method in PRESSES}


def _greedy(forward, logits, pos: int, steps: int) -> list[int]:
    """``steps`` greedy tokens from ``logits`` (the next token's), each fed back through ``forward`` at ``pos`` on."""
    generated: list[int] = []
    for step in range(steps):
        generated.append(int(logits.argmax()))
        if step + 1 < steps:
            logits = forward([generated[-1]], pos, False)[-1]
            pos += 1
    return generated

def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _attentions(model: nn.Module) -> list[nn.Module]:
    return [layer.self_attn for layer in model.model.layers]


def _window(model: nn.Module, attn: nn.Module) -> int | None:
    """The sliding window of an attention layer (keys with ``pos > q - window`` are seen), or None."""
    return int(model.config.sliding_window) if getattr(attn, "is_sliding", False) else None


def has_sliding_layers(model: nn.Module) -> bool:
    return any(_window(model, attn) for attn in _attentions(model))


def _kept_indices(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """Index in ``before`` (1, H, K, D) of each row of ``after`` (1, H, K', D), per head: (H, K')."""
    heads, k_len, dim = before.shape[1:]
    if after.shape == before.shape and torch.equal(after, before):
        return torch.arange(k_len).expand(heads, k_len).clone()
    proj = torch.randn(dim, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    a = (before[0].double() * proj).sum(-1)
    b = (after[0].double() * proj).sum(-1)
    sorted_a, order = a.sort(dim=-1)
    hi = torch.searchsorted(sorted_a, b.contiguous()).clamp(max=k_len - 1)
    lo = (hi - 1).clamp(min=0)
    nearer = torch.where((sorted_a.gather(-1, hi) - b).abs() <= (sorted_a.gather(-1, lo) - b).abs(), hi, lo)
    idx = order.gather(-1, nearer)
    found = before[0].gather(1, idx.unsqueeze(-1).expand(-1, -1, dim))
    if not torch.equal(found, after[0]):
        raise RuntimeError("could not locate the kept KV entries among the pre-compression ones")
    return idx


class PositionTracker:
    """Original positions of the KV entries each layer holds, and per-layer attention masks built from them.

    Needed for models with sliding-window layers, whose transformers masks assume uncompressed caches.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self.attns = _attentions(model)
        self.kv_heads = model.config.num_key_value_heads
        self.groups = model.config.num_attention_heads // self.kv_heads
        self.compressed: dict[int, torch.Tensor] = {}
        self.positions: list[torch.Tensor] = []
        self.masks: list[torch.Tensor] | None = None
        self.pending: list[torch.Tensor] = []
        self.hooks: list = []

    def wrap(self, compress: Callable) -> Callable:
        """``press.compress`` that also records which original positions each layer kept."""

        def compress_and_record(module, hidden_states, keys, values, attentions, kwargs):
            new_keys, new_values = compress(module, hidden_states, keys, values, attentions, kwargs)
            first = hidden_states.shape[1] - keys.shape[2]  # sliding layers hold only the last window - 1 tokens
            self.compressed[int(module.layer_idx)] = first + _kept_indices(keys, new_keys)
            return new_keys, new_values

        return compress_and_record

    def after_prefill(self, cache: DynamicCache, context_len: int) -> None:
        self.positions = []
        for i, layer in enumerate(cache.layers):
            held = layer.keys.shape[-2]
            pos = self.compressed.get(i)
            if pos is None:
                pos = torch.arange(context_len - held, context_len).expand(self.kv_heads, held).clone()
            if pos.shape != (self.kv_heads, held):
                raise RuntimeError(f"layer {i}: tracked {tuple(pos.shape)} positions, cache holds {held}")
            self.positions.append(pos)
        self.hooks = [attn.register_forward_pre_hook(self._pre_hook, with_kwargs=True) for attn in self.attns]

    def _pre_hook(self, module, args, kwargs):
        if self.masks is not None:
            kwargs["attention_mask"] = self.masks[int(module.layer_idx)]
        return args, kwargs

    def begin(self, new_positions: torch.Tensor) -> None:
        """Masks for a forward of tokens at ``new_positions`` on top of what each layer holds."""
        dtype = self.model.dtype
        q_pos = new_positions.view(1, -1, 1)
        self.masks, self.pending = [], []
        for attn, pos in zip(self.attns, self.positions):
            cols = torch.cat([pos, new_positions.expand(self.kv_heads, -1)], dim=1)
            seen = cols.unsqueeze(1) <= q_pos
            window = _window(self.model, attn)
            if window:
                seen &= cols.unsqueeze(1) > q_pos - window
            mask = torch.zeros(seen.shape, dtype=dtype).masked_fill(~seen, torch.finfo(dtype).min)
            self.masks.append(mask.repeat_interleave(self.groups, dim=0).unsqueeze(0))
            self.pending.append(cols[:, -(window - 1):] if window else cols)  # as DynamicSlidingWindowLayer keeps

    def end(self, cache: DynamicCache) -> None:
        for i, (layer, pos) in enumerate(zip(cache.layers, self.pending)):
            if layer.keys.shape[-2] != pos.shape[-1]:
                raise RuntimeError(f"layer {i}: cache holds {layer.keys.shape[-2]} entries, tracked {pos.shape[-1]}")
        self.positions, self.masks, self.pending = self.pending, None, []

    def close(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks = []


class _LayerRope(nn.Module):
    """A model-wide rotary embedding that takes ``layer_type`` (Gemma 3), bound to one layer's type."""

    def __init__(self, rope: nn.Module, layer_type: str):
        super().__init__()
        self.rope, self.layer_type = rope, layer_type

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
        return self.rope(x, position_ids, layer_type=self.layer_type)


class _NoChatTemplate:
    """Stands in for ``AutoTokenizer`` inside kvzip_press: the same tokenizer without its chat template."""

    @staticmethod
    def from_pretrained(*args, **kwargs):
        tok = transformers.AutoTokenizer.from_pretrained(*args, **kwargs)
        tok.chat_template = None
        return tok


def _skip_sliding(press: kvpress.BasePress) -> Callable:
    base = type(press).forward_hook

    def forward_hook(module, input, kwargs, output):
        return output if getattr(module, "is_sliding", False) else base(press, module, input, kwargs, output)

    return forward_hook


@contextlib.contextmanager
def pressing(model: nn.Module, press: kvpress.BasePress | None, tracker: PositionTracker | None,
             skip_sliding: bool, patches: list[str]) -> Iterator[None]:
    """``with press(model):``, plus the shims named in the module docstring (recorded in ``patches``)."""
    if press is None:
        yield
        return
    if isinstance(press, kvpress.KVzipPress):
        saved = _kvzip_module.AutoTokenizer
        _kvzip_module.AutoTokenizer = _NoChatTemplate
        patches.append("kvzip: tokenizer without chat template (raw-token context)")
        try:
            with press(model):
                yield
        finally:
            _kvzip_module.AutoTokenizer = saved
        return
    if skip_sliding:
        press.forward_hook = _skip_sliding(press)
        patches.append("sliding-window layers left uncompressed")
    if tracker is not None:
        press.compress = tracker.wrap(press.compress)
    with press(model):
        rope = model.model.rotary_emb
        if "layer_type" in inspect.signature(rope.forward).parameters:
            for layer in model.model.layers:
                layer.self_attn.rotary_emb = _LayerRope(rope, layer.attention_type)
            patches.append("rotary_emb bound to each layer's layer_type")
        yield


def kept_counts(model: nn.Module, cache: DynamicCache) -> list[float]:
    """KV entries each layer keeps (mean over KV heads); entries KVzip masked out do not count."""
    out = []
    for attn, layer in zip(_attentions(model), cache.layers):
        held = layer.keys.shape[-2]
        masked = getattr(attn, "masked_key_indices", None)
        n_masked = len(masked[0]) if masked is not None else 0
        out.append(held - n_masked / layer.keys.shape[1])
    return out


def kept_totals(model: nn.Module, cache: DynamicCache) -> tuple[int, int]:
    """KV entries held over every layer and KV head (masked ones not counted) and their bytes (key + value)."""
    entries = nbytes = 0
    for attn, layer in zip(_attentions(model), cache.layers):
        masked = getattr(attn, "masked_key_indices", None)
        n = layer.keys.shape[1] * layer.keys.shape[2] - (len(masked[0]) if masked is not None else 0)
        entries += n
        nbytes += n * (layer.keys.shape[-1] + layer.values.shape[-1]) * layer.keys.element_size()
    return entries, nbytes


def _nll_sum(first_logits: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor, chunk: int = 256) -> float:
    """Summed -log p of every target: the first from ``first_logits``, target i from ``logits[i - 1]``."""
    preds = torch.cat([first_logits.unsqueeze(0), logits[:-1]])
    total = 0.0
    for s in range(0, len(targets), chunk):
        logp = preds[s:s + chunk].double().log_softmax(-1)
        total -= float(logp.gather(1, targets[s:s + chunk, None]).sum())
    return total


def run_item(model: nn.Module, method: str, kv_fraction: float, item: dict, sliding_mode: str) -> dict:
    ratio = 1.0 - float(kv_fraction)
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"kv_fraction must be in (0, 1], got {kv_fraction}")
    factory = PRESSES[method]
    press = factory(ratio) if factory is not None else None
    sliding = has_sliding_layers(model)
    tracker = PositionTracker(model) if sliding and press is not None else None
    patches: list[str] = []
    if tracker is not None:
        patches.append("per-layer attention masks from tracked positions (sliding-window model)")
    context = list(item["context_ids"])
    c_len = len(context)
    cache = DynamicCache(config=model.config)
    row: dict = {"compression_ratio": ratio if press is not None else 0.0, "context_len": c_len}

    def forward(ids: list[int], start: int, all_logits: bool) -> torch.Tensor:
        positions = torch.arange(start, start + len(ids))
        if tracker is not None:
            tracker.begin(positions)
        out = model(input_ids=torch.tensor([ids]), past_key_values=cache, position_ids=positions.unsqueeze(0),
                    logits_to_keep=0 if all_logits else 1)
        if tracker is not None:
            tracker.end(cache)
        return out.logits[0]

    t0 = time.perf_counter()
    try:
        with torch.no_grad():
            with pressing(model, press, tracker, sliding and sliding_mode == "skip", patches):
                last = model(input_ids=torch.tensor([context]), past_key_values=cache, logits_to_keep=1).logits[0, -1]
            kept = kept_counts(model, cache)
            if tracker is not None:
                tracker.after_prefill(cache, c_len)
            t1 = time.perf_counter()
            entries, nbytes = kept_totals(model, cache)
            row.update(kept_entries=entries, kept_bytes=nbytes)
            if item["kind"] == "generate" and "questions" in item:
                row["generated"] = []
                for question in item["questions"]:
                    saved, fresh = tracker.positions if tracker is not None else None, copy.deepcopy(cache)
                    cache, original = fresh, cache
                    try:
                        logits = forward(list(question), c_len, False)[-1] if question else last
                        generated = _greedy(forward, logits, c_len + len(question), int(item["max_new_tokens"]))
                    finally:
                        cache = original
                        if tracker is not None:
                            tracker.positions = saved
                    row["generated"].append(generated)
            elif item["kind"] == "generate":
                question = list(item.get("question_ids", []))
                logits = forward(question, c_len, False)[-1] if question else last
                generated = _greedy(forward, logits, c_len + len(question), int(item["max_new_tokens"]))
                row["generated_ids"] = generated
            elif item["kind"] == "ppl":
                cont = list(item["continuation_ids"])
                logits = forward(cont, c_len, True) if len(cont) > 1 else last.new_zeros((1, last.shape[-1]))
                row["nll_sum"] = _nll_sum(last, logits, torch.tensor(cont)) if cont else 0.0
                row["n_scored"] = len(cont)
            else:
                raise ValueError(f"unknown item kind {item['kind']!r}")
            t2 = time.perf_counter()
    finally:
        if tracker is not None:
            tracker.close()
        for attn in _attentions(model):  # KVzip leaves its masks on the modules
            attn.masked_key_indices = None
    row.update(kept_tokens=sum(kept) / len(kept), kept_by_layer=[round(k, 2) for k in kept],
               prefill_s=round(t1 - t0, 3), post_s=round(t2 - t1, 3), total_s=round(t2 - t0, 3),
               patches=patches)
    if sliding:
        row["sliding_layers"] = sliding_mode if press is not None else "dense"
    return row


def load_model(model_dir: str, attn_implementation: str) -> nn.Module:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation=attn_implementation)
    return model.eval()


def main(job_path: str) -> int:
    stdout, sys.stdout = sys.stdout, sys.stderr  # only result rows go to the real stdout
    job = json.load(open(job_path))
    torch.set_num_threads(int(job.get("threads", 1)))
    sliding_mode = job.get("sliding_layers", "compress")
    if sliding_mode not in ("compress", "skip"):
        raise SystemExit(f"sliding_layers must be 'compress' or 'skip', got {sliding_mode!r}")
    log(f"[kvpress-worker] kvpress {version('kvpress')} transformers {transformers.__version__} "
        f"torch {torch.__version__} threads {torch.get_num_threads()} model {job['model_dir']}")
    models: dict[str, nn.Module | Exception] = {}
    n_total, n_done = len(job["presses"]) * len(job["items"]), 0
    for spec in job["presses"]:
        method, kv_fraction = spec["method"], spec["kv_fraction"]
        for item in job["items"]:
            n_done += 1
            base = {"id": item["id"], "kind": item["kind"], "method": method, "kv_fraction": kv_fraction}
            t0 = time.perf_counter()
            try:
                if method not in PRESSES:
                    raise ValueError(f"unknown method {method!r}; known: {sorted(PRESSES)}")
                impl = ATTN_IMPLEMENTATION[method]
                if impl not in models:
                    t_load = time.perf_counter()
                    try:
                        models[impl] = load_model(job["model_dir"], impl)
                        log(f"[kvpress-worker] loaded {type(models[impl]).__name__} ({impl}) "
                            f"in {time.perf_counter() - t_load:.1f} s")
                    except Exception as exc:  # noqa: BLE001 - every row then reports it
                        models[impl] = exc
                if isinstance(models[impl], Exception):
                    raise RuntimeError(f"model load failed: {models[impl]}")
                row = {**base, **run_item(models[impl], method, kv_fraction, item, sliding_mode),
                       "attn_implementation": impl}
                status = f"kept {row['kept_tokens']:.1f}/{row['context_len']}"
            except Exception as exc:  # noqa: BLE001 - one failing press must not end the job
                log(traceback.format_exc(limit=-4))
                row = {**base, "error": f"{type(exc).__name__}: {exc}"}
                status = f"ERROR {row['error'][:160]}"
            log(f"[kvpress-worker] {n_done}/{n_total} {method}@{kv_fraction} {item['id']} ({item['kind']}): "
                f"{status} in {time.perf_counter() - t0:.1f} s")
            stdout.write(json.dumps(row) + "\n")
            stdout.flush()
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: _kvpress_worker.py JOB.json")
    sys.exit(main(sys.argv[1]))
