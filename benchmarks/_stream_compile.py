"""``bench_stream.py --compile``: a compiled sinklab stream against StaticCache compiled and DynamicCache eager.

Real weights (SmolLM2-135M-Instruct; Gemma 3 270M when builtin:gemma3 is available), S 4, W 1020, float32.
Every method decodes at the same cached length, in steady state past eviction:

* sinklab compiled — ``torch.compile(model.forward)`` (inductor) with the SinkCache passed in;
* sinklab eager    — the same forward, eager;
* static compiled  — transformers' StaticCache of S + W slots, filled to S + W − 1, decode one, then the
  step's slot is handed back (``cumulative_length`` reset) so every step attends over S + W keys;
* dynamic eager    — DynamicCache holding S + W − 1 keys: decode one, crop back (today's floor);
* beams / sampling — ``generate`` with 2 beams, and with top-k sampling, through a SinkCache and through a
  DynamicCache of equal cached length (ms per new token from two generate lengths).

Rounds are interleaved (the machine is shared); warm-up (compile) is timed separately; one thread and two.
The bandwidth limit: bytes read per token (weights + the cached K/V) ÷ the copy bandwidth of this machine.
"""

from __future__ import annotations

import copy
import statistics
import time

import torch
from transformers import DynamicCache, StaticCache

import sinklab
from sinklab import _compat


def copy_bandwidth(mb: int = 256, repeats: int = 5) -> float:
    """Bytes per second moved by ``dst.copy_(src)`` (read + write) over a buffer far larger than the caches."""
    src = torch.ones(mb * 2**20 // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() * 4 / best


def _ids(n: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(10, vocab - 1, (1, n), generator=torch.Generator().manual_seed(seed))


class Method:
    """One decoder at a fixed cached length: ``warm()`` once (timed), then ``step()`` per token."""

    def __init__(self, name: str, model, cached: int, vocab: int) -> None:
        self.name, self.model, self.cached, self.vocab = name, model, cached, vocab
        self.kw = _compat.cache_kwarg_name(model)
        self.token = _ids(1, vocab, seed=1)

    @torch.no_grad()
    def warm(self) -> float:
        t = time.perf_counter()
        self.setup()
        for _ in range(3):
            self.step()
        return time.perf_counter() - t


class Sink(Method):
    def __init__(self, *a, compiled: bool, num_sinks: int, window: int) -> None:
        super().__init__(*a)
        self.compiled, self.num_sinks, self.window = compiled, num_sinks, window

    def setup(self) -> None:
        self.cache = sinklab.SinkCache(self.model, num_sinks=self.num_sinks, window=self.window)
        self.model(input_ids=_ids(self.cached + 64, self.vocab), **{self.kw: self.cache})  # past eviction
        self.forward = torch.compile(self.model.forward) if self.compiled else self.model.forward

    @torch.no_grad()
    def step(self) -> None:
        self.forward(input_ids=self.token, **{self.kw: self.cache})

    def close(self) -> None:
        self.cache.close()


class Static(Method):
    def setup(self) -> None:
        self.cache = StaticCache(config=self.model.config, max_cache_len=self.cached + 1)
        ids = _ids(self.cached, self.vocab)
        self.model(input_ids=ids, **{self.kw: self.cache})
        self.pos = torch.tensor([[self.cached]])
        self.forward = torch.compile(self.model.forward)

    @torch.no_grad()
    def step(self) -> None:
        self.forward(input_ids=self.token, position_ids=self.pos, **{self.kw: self.cache})
        self.cache.crop(-1)  # hand the slot back: every step attends over `cached + 1` keys

    def close(self) -> None:
        pass


class Dynamic(Method):
    def setup(self) -> None:
        self.cache = DynamicCache(config=self.model.config)
        self.model(input_ids=_ids(self.cached, self.vocab), **{self.kw: self.cache})

    @torch.no_grad()
    def step(self) -> None:
        self.model(input_ids=self.token, **{self.kw: self.cache})
        self.cache.crop(-1)

    def close(self) -> None:
        pass


def time_steps(method: Method, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        t = time.perf_counter()
        method.step()
        out.append(1e3 * (time.perf_counter() - t))
    return out


@torch.no_grad()
def generate_rows(model, vocab: int, cached: int, num_sinks: int, window: int, new: int) -> list[dict]:
    """Beams and sampling: ms per new token through a SinkCache vs a DynamicCache of equal cached length."""
    rows = []
    prompt = _ids(cached, vocab, seed=3)
    for mode, gen in (("beams-2", dict(num_beams=2, do_sample=False)),
                      ("sampling", dict(do_sample=True, top_k=50, temperature=0.8))):
        for cache_name in ("sinklab eager", "dynamic eager"):
            times = {}
            for n in (1, new + 1):
                torch.manual_seed(0)
                cache = (sinklab.SinkCache(model, num_sinks=num_sinks, window=window) if cache_name.startswith("sinklab")
                         else DynamicCache(config=model.config))
                t = time.perf_counter()
                model.generate(prompt, cache=cache, max_new_tokens=n, min_new_tokens=n, pad_token_id=0, **gen)
                times[n] = time.perf_counter() - t
                if hasattr(cache, "close"):
                    cache.close()
            rows.append({"mode": mode, "method": cache_name, "ms_per_token": 1e3 * (times[new + 1] - times[1]) / new})
    return rows


def run(models: list[tuple[str, object]], rounds: int, steps: int, threads: list[int], gen_tokens: int,
        num_sinks: int = 4, window: int = 1020) -> dict:
    bandwidth = copy_bandwidth()
    results = {"bandwidth_GBps": bandwidth / 1e9, "models": []}
    for label, loaded in models:
        model = loaded.model.float().eval()
        vocab = _compat.embedding_rows(model)
        cached = num_sinks + window - 1  # K/V held before each step; the step attends over S + W
        cfg = model.config
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * (cached + 1) * 4
        floor_ms = 1e3 * (weights + kv) / bandwidth
        entry = {"model": label, "bytes_per_token": weights + kv, "bandwidth_floor_ms": floor_ms, "threads": {}}
        for n_threads in threads:
            torch.set_num_threads(n_threads)
            # One copy of the model per method: interleaving caches on one model would switch its attention
            # backend every step (and make the compiled forwards recompile).
            copies = [copy.deepcopy(model) for _ in range(4)]
            methods = [Sink("sinklab compiled", copies[0], cached, vocab, compiled=True, num_sinks=num_sinks,
                            window=window),
                       Static("static compiled", copies[1], cached, vocab),
                       Sink("sinklab eager", copies[2], cached, vocab, compiled=False, num_sinks=num_sinks, window=window),
                       Dynamic("dynamic eager", copies[3], cached, vocab)]
            warm = {m.name: m.warm() for m in methods}
            samples: dict[str, list[float]] = {m.name: [] for m in methods}
            for _ in range(rounds):  # interleaved
                for m in methods:
                    samples[m.name] += time_steps(m, steps)
            for m in methods:
                m.close()
            med = {k: statistics.median(v) for k, v in samples.items()}
            entry["threads"][n_threads] = {
                "warmup_s": warm, "median_ms": med,
                "p90_ms": {k: sorted(v)[int(0.9 * (len(v) - 1))] for k, v in samples.items()},
                "ratios": {
                    "sinklab compiled / static compiled": med["sinklab compiled"] / med["static compiled"],
                    "sinklab compiled / dynamic eager": med["sinklab compiled"] / med["dynamic eager"],
                    "sinklab eager / dynamic eager": med["sinklab eager"] / med["dynamic eager"],
                    "bandwidth floor / sinklab compiled": floor_ms / med["sinklab compiled"],
                }}
            print_table(label, n_threads, entry)
            torch._dynamo.reset()
        if gen_tokens:
            torch.set_num_threads(threads[0])
            entry["generate"] = generate_rows(model, vocab, cached, num_sinks, window, gen_tokens)
            for row in entry["generate"]:
                print(f"  {row['mode']:<9} {row['method']:<14} {row['ms_per_token']:8.1f} ms/token")
        results["models"].append(entry)
    return results


def print_table(label: str, n_threads: int, entry: dict) -> None:
    r = entry["threads"][n_threads]
    print(f"\n{label}, {n_threads} thread(s), S 4 + W 1020, float32 "
          f"(bandwidth floor {entry['bandwidth_floor_ms']:.1f} ms/token)")
    print(f"  {'method':<18}{'median ms':>10}{'p90 ms':>9}{'warm-up s':>11}")
    for name, ms in r["median_ms"].items():
        print(f"  {name:<18}{ms:10.1f}{r['p90_ms'][name]:9.1f}{r['warmup_s'][name]:11.1f}")
    for name, value in r["ratios"].items():
        print(f"  {name:<38} {value:.3f}×")
