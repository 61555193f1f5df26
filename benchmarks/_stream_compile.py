"""``bench_stream.py --compile``: a compiled sinklab stream against StaticCache compiled and DynamicCache eager.

Models: SmolLM2-135M-Instruct and Gemma 3 270M (``builtin:`` real weights; or a ``config:FILE.json`` built with
random weights — the same shapes, so the same speed — for a machine without the converted cache). S 4, W 1020.
Every method decodes at the same cached length, in steady state past eviction:

* sinklab compiled — ``torch.compile(model.forward)`` with the SinkCache passed in, each step planned by the cache
  before the compiled call (``SinkCache.planned_forward``, as ``StreamSession.step``: one dynamo frame and one graph
  per step) (``--freezing``: inductor's freezing for every compiled method, what ``StreamSession(compile=True)``
  does on a CPU);
* sinklab compiled+plan — the same with ``SinkCache(compile_plan=True)``: the decode step's bookkeeping (the
  decoder-stack pre-hook, eager between the graphs) compiled too (``--compiled-plan``);
* sinklab eager    — the same forward, eager;
* static compiled  — transformers' StaticCache of S + W slots, filled to S + W − 1, decode one, then every
  layer's ``crop(-1)`` hands the step's slot back, so each step attends over S + W keys. Sliding layers
  (Gemma 3: 512 tokens) are StaticSlidingWindowLayers that roll their own window and stay full; their crop
  only moves the counter back, so the mask sizes stay fixed and nothing recompiles;
* dynamic eager    — DynamicCache holding S + W − 1 keys: decode one, crop back (today's floor). Sliding
  layers keep their window once past-recording is on (``activate_past_recording``: crop may then undo a step);
* greedy / beams / sampling — ``generate`` greedy, with 2 beams, and with top-k sampling, through a SinkCache
  and through a DynamicCache of equal cached length (median ms between decoding steps, stamped by a logits
  processor; the prompt's prefill time is reported apart).

Rounds are interleaved (the machine is shared); warm-up (compile) is timed separately; one thread and two.
Also per token: the safety checks and the step plan (the pre-hook's bookkeeping, eager and, with
``--compiled-plan``, compiled); ``--profile`` prints torch.profiler's op table of each compiled method. The
DynamicCache's own work per token (every layer's ``update`` — a copy one token longer — and the crop back) is
timed alone too: without it the eager floor would be ``(dynamic − copies) / dynamic`` of itself, the best an
eager ring buffer can do at zero bookkeeping cost. And the aten ops of one eager decode step, views and allocations
left out (on an accelerator, kernel launches), for sinklab and the DynamicCache.
The bandwidth limit: bytes read per token (weights + the cached K/V) ÷ the copy bandwidth of this machine.
On CUDA every timed step ends with a synchronisation, and with ``mode="reduce-overhead"`` (CUDA graphs) each
compiled step starts with ``torch.compiler.cudagraph_mark_step_begin()``.
"""

from __future__ import annotations

import copy
import json
import statistics
import time
import traceback
from pathlib import Path

import torch
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList, StaticCache

import sinklab
from sinklab import _compat


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, mb: int = 256, repeats: int = 5) -> float:
    """Bytes per second moved by ``dst.copy_(src)`` (read + write) over a buffer far larger than the caches."""
    mb = 1024 if device.type == "cuda" else mb  # past the GPU's L2 by far
    src = torch.ones(mb * 2**20 // 4, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() * 4 / best


def _ids(n: int, vocab: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    ids = torch.randint(10, vocab - 1, (1, n), generator=torch.Generator().manual_seed(seed))
    return ids.to(device)


def load(spec: str, device: torch.device, dtype: torch.dtype) -> tuple[str, torch.nn.Module, str]:
    """A model by ``builtin:``/folder name (real weights) or ``config:FILE.json`` (random weights, same shapes).

    ``A|B`` tries ``A`` first, then ``B`` (``builtin:smollm2|config:benchmarks/configs/smollm2-135m.json``: the
    real weights where the converted cache is, else the same architecture with random weights).
    """
    if "|" in spec:
        errors = []
        for option in spec.split("|"):
            try:
                return load(option, device, dtype)
            except Exception as exc:  # noqa: BLE001 - try the next one; all failing is reported below
                errors.append(f"{option}: {exc}")
        raise RuntimeError("; ".join(errors))
    if spec.startswith("config:"):
        import transformers

        path = Path(spec[len("config:"):])
        raw = json.loads(path.read_text())
        config = transformers.AutoConfig.for_model(**raw)
        torch.manual_seed(0)
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
        return path.stem, model.eval(), f"random weights, config {path.name}"
    loaded = sinklab.load_model(spec)
    return spec, loaded.model.to(device=device, dtype=dtype).eval(), "real weights"


class Method:
    """One decoder at a fixed cached length: ``warm()`` once (timed), then ``step()`` per token."""

    compiled = False

    def __init__(self, name: str, model, cached: int, vocab: int, compile_options: dict) -> None:
        self.name, self.model, self.cached, self.vocab = name, model, cached, vocab
        self.device = _compat.input_device(model)
        self.kw = _compat.cache_kwarg_name(model)
        self.token = _ids(1, vocab, self.device, seed=1)
        self.options = compile_options

    def _compile(self):
        return torch.compile(self.model.forward, **self.options)

    @torch.no_grad()
    def warm(self, steps: int = 3) -> float:
        t = time.perf_counter()
        self.setup()
        for _ in range(steps):
            self.step()
        sync(self.device)
        return time.perf_counter() - t

    @torch.no_grad()
    def step(self) -> torch.Tensor:
        if self.compiled and self.device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()  # outputs of the previous replay may be overwritten now
        return self.forward_step()

    def close(self) -> None:
        pass


class Sink(Method):
    def __init__(self, *a, compiled: bool, num_sinks: int, window: int, compile_plan: bool = False) -> None:
        super().__init__(*a)
        self.compiled, self.num_sinks, self.window, self.compile_plan = compiled, num_sinks, window, compile_plan

    def setup(self) -> None:
        self.cache = sinklab.SinkCache(self.model, num_sinks=self.num_sinks, window=self.window,
                                       compile_plan=self.compile_plan)
        prompt = _ids(self.cached + 64, self.vocab, self.device)  # past eviction
        self.model(input_ids=prompt, **{self.kw: self.cache})
        self.forward = self._compile() if self.compiled else self.model.forward

    def forward_step(self) -> torch.Tensor:
        # as StreamSession.step: the cache plans the step, then the (compiled) forward runs — one graph
        return self.cache.planned_forward(self.forward, input_ids=self.token, **{self.kw: self.cache}).logits

    def close(self) -> None:
        self.cache.close()


class Static(Method):
    compiled = True

    def setup(self) -> None:
        self.cache = StaticCache(config=self.model.config, max_cache_len=self.cached + 1)
        self.model(input_ids=_ids(self.cached, self.vocab, self.device), **{self.kw: self.cache})
        self.pos = torch.tensor([[self.cached]], device=self.device)
        self.forward = self._compile()

    def forward_step(self) -> torch.Tensor:
        out = self.forward(input_ids=self.token, position_ids=self.pos, **{self.kw: self.cache}).logits
        # Hand the slot back, layer by layer: a full layer's counter goes back (the next step overwrites the slot);
        # a sliding layer has rolled its window (still full) and only its counters go back.
        for layer in self.cache.layers:
            layer.crop(-1)
        return out


class Dynamic(Method):
    def setup(self) -> None:
        self.cache = DynamicCache(config=self.model.config)
        if hasattr(self.cache, "activate_past_recording"):  # sliding layers past their window can then be cropped
            self.cache.activate_past_recording()
        self.model(input_ids=_ids(self.cached, self.vocab, self.device), **{self.kw: self.cache})

    def forward_step(self) -> torch.Tensor:
        out = self.model(input_ids=self.token, **{self.kw: self.cache}).logits
        self.cache.crop(-1)
        return out


def check_costs(method: Sink, calls: int = 200) -> dict[str, float]:
    """µs per decoded token of the stream's safety checks, called as each forward calls them (ids in range before
    the decoder stack, finite hidden states after it) on this step's shapes."""
    cache = method.cache
    hidden = torch.zeros(1, 1, method.model.config.get_text_config(decoder=True).hidden_size,
                         device=method.device, dtype=next(method.model.parameters()).dtype)
    out = {}
    for name, call in (("ids in range", lambda: cache.check_ids(method.token)),
                       ("finite hidden states", lambda: cache.check_hidden(hidden))):
        sync(method.device)
        t = time.perf_counter()
        for _ in range(calls):
            call()
        sync(method.device)
        out[name] = 1e6 * (time.perf_counter() - t) / calls
    return out


PLANNED = "sinklab compiled+plan"  # the row of SinkCache(compile_plan=True) under the compiled forward


def plan_cost(method: Sink, calls: int = 200) -> float:
    """µs per decoded token of the stream's host bookkeeping: ``SinkCache.plan_forward`` (the decoder-stack pre-hook's
    work: ids check, slot, virtual positions, visibility, anchor re-rotation angles), called as a decode step calls it.
    It advances the stream, so it runs last, on a stream that is closed afterwards."""
    cache = method.cache
    with torch.no_grad():  # as in a decode step (a compiled plan is guarded on grad mode)
        for _ in range(3):
            cache.plan_forward((), {"input_ids": method.token})
        sync(method.device)
        t = time.perf_counter()
        for _ in range(calls):
            cache.plan_forward((), {"input_ids": method.token})
        sync(method.device)
    return 1e6 * (time.perf_counter() - t) / calls


def profile_steps(method: Method, steps: int = 10, rows: int = 12) -> str:
    """torch.profiler's table (ops by self CPU time; CUDA time too on a GPU) over ``steps`` decode steps."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if method.device.type == "cuda" else [])
    with torch.no_grad(), profile(activities=activities) as prof:
        for _ in range(steps):
            method.step()
        sync(method.device)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def dense_copy_ms(method: Method, steps: int = 20) -> float:
    """ms per decoded token of the eager DynamicCache's own work: every layer's ``update`` (keys and values
    copied into a new tensor one token longer, ``torch.cat``) and the ``crop(-1)`` back, timed on a copy of the
    method's cache with the step's shapes and no model — the one cost a ring buffer does not pay. (torch.profiler's
    self time of ``aten::cat`` inside a step was not usable here: it came out larger than the whole step.)"""
    src = method.cache
    cache = DynamicCache()
    n = len(src.layers)
    for i, layer in enumerate(src.layers):
        cache.update(layer.keys.clone(), layer.values.clone(), i)
    new = [(layer.keys[..., -1:, :].clone(), layer.values[..., -1:, :].clone()) for layer in src.layers]
    with torch.no_grad():
        for _ in range(2):  # the first round warms the allocator
            sync(method.device)
            t = time.perf_counter()
            for _ in range(steps):
                for i in range(n):
                    cache.update(*new[i], i)
                cache.crop(-1)
            sync(method.device)
    return 1e3 * (time.perf_counter() - t) / steps


_GRAPH_CALLS = ("## Call CompiledFxGraph", "CompiledFunction")  # profiler names of a compiled graph's run
_VIEW_OPS = {"aten::unsqueeze", "aten::slice", "aten::select", "aten::view", "aten::as_strided", "aten::transpose",
             "aten::t", "aten::expand", "aten::_unsafe_view", "aten::reshape", "aten::flatten", "aten::resolve_conj",
             "aten::resolve_neg", "aten::alias", "aten::permute", "aten::squeeze", "aten::unbind", "aten::split",
             "aten::narrow", "aten::chunk", "aten::detach", "aten::lift_fresh", "aten::empty", "aten::empty_strided",
             "aten::_reshape_alias", "aten::to", "aten::contiguous"}  # to/contiguous with nothing to do: leaves


def _in_graph(event) -> bool:
    """Whether a profiler event ran inside a compiled graph (not in the eager code between graphs)."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(_GRAPH_CALLS):
            return True
        parent = parent.cpu_parent
    return False


def ops_per_step(method: Method) -> dict[str, int]:
    """One decode step under torch.profiler: ``eager_ops`` — innermost aten ops that are not views, allocations or
    no-op conversions (a ``to`` that copies has a child op, so it is not innermost) and that run outside any
    compiled graph (for an eager method: all of them); on an accelerator each is a kernel launch from the host.
    For a compiled method also ``graphs`` (compiled graphs called) and ``frames`` (dynamo-compiled frames
    entered: each graph break adds some)."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        method.step()
    events = prof.events()
    aten = [e for e in events if e.name.startswith("aten::")]
    leaves = [e for e in aten if not any(c.name.startswith("aten::") for c in e.cpu_children)]
    out = {"eager_ops": sum(e.name not in _VIEW_OPS and not _in_graph(e) for e in leaves)}
    if method.compiled:
        out["graphs"] = sum(e.name.startswith(_GRAPH_CALLS) for e in events)
        out["frames"] = sum(e.name.startswith("Torch-Compiled Region") for e in events)
    return out


def time_steps(method: Method, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        sync(method.device)
        t = time.perf_counter()
        method.step()
        sync(method.device)
        out.append(1e3 * (time.perf_counter() - t))
    return out


class _StepClock(LogitsProcessor):
    """Records the time at each decoding step's logits processing (a generate() step boundary)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.times = device, []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        sync(self.device)
        self.times.append(time.perf_counter())
        return scores


@torch.no_grad()
def generate_rows(model, vocab: int, cached: int, num_sinks: int, window: int, new: int) -> list[dict]:
    """Greedy, beams and sampling: ms per new token through a SinkCache vs a DynamicCache of equal cached length.

    A logits processor stamps every step, so the rows are the median step-to-step time of the decoding steps
    (the prompt's prefill is reported apart, as ``prefill_s``: the first step's stamp minus the call's start).
    """
    rows = []
    device = _compat.input_device(model)
    prompt = _ids(cached, vocab, device, seed=3)
    for make in (lambda: sinklab.SinkCache(model, num_sinks=num_sinks, window=window),
                 lambda: DynamicCache(config=model.config)):  # warm-up: the first generate of a process pays extra
        cache = make()
        model.generate(prompt, cache=cache, max_new_tokens=4, min_new_tokens=4, pad_token_id=0, do_sample=False)
        if hasattr(cache, "close"):
            cache.close()
    for mode, gen in (("greedy", dict(do_sample=False)), ("beams-2", dict(num_beams=2, do_sample=False)),
                      ("sampling", dict(do_sample=True, top_k=50, temperature=0.8))):
        for cache_name in ("sinklab eager", "dynamic eager"):
            torch.manual_seed(0)
            cache = (sinklab.SinkCache(model, num_sinks=num_sinks, window=window) if cache_name.startswith("sinklab")
                     else DynamicCache(config=model.config))
            clock = _StepClock(device)
            sync(device)
            start = time.perf_counter()
            model.generate(prompt, cache=cache, max_new_tokens=new + 1, min_new_tokens=new + 1, pad_token_id=0,
                           logits_processor=LogitsProcessorList([clock]), **gen)
            if hasattr(cache, "close"):
                cache.close()
            steps = [1e3 * (b - a) for a, b in zip(clock.times, clock.times[1:])]
            rows.append({"mode": mode, "method": cache_name, "ms_per_token": statistics.median(steps),
                         "steps": len(steps), "prefill_s": clock.times[0] - start})
    return rows


def bytes_per_token(model, num_sinks: int, window: int) -> int:
    """Weights (each parameter once; a tied head counted once) + every layer's cached K/V after the step."""
    cfg = model.config.get_text_config(decoder=True)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    element = next(model.parameters()).element_size()
    kv = 0
    for own in _compat.layer_sliding_windows(model):  # a native sliding layer keeps min(its window, S + W)
        keys = num_sinks + window if own is None else min(own, num_sinks + window)
        kv += 2 * cfg.num_key_value_heads * head_dim * keys * element
    return weights + kv


def run(specs: list[str], rounds: int, steps: int, threads: list[int], gen_tokens: int, num_sinks: int = 4,
        window: int = 1020, device: str = "cpu", dtype: str = "float32", compile_options: dict | None = None,
        checkpoint=None, generate_only: bool = False, profile: bool = False, compiled_plan: bool = False,
        freezing: bool = False) -> dict:
    """Every model in ``specs`` at each thread count; ``checkpoint(results)`` is called after each model.

    ``generate_only``: only the greedy/beams/sampling rows (at ``threads[0]``), no decode-step table.
    ``profile``: also torch.profiler's op table over 10 steps of each compiled method (printed, in the JSON).
    ``compiled_plan``: also the row of ``SinkCache(compile_plan=True)`` under the compiled forward.
    ``freezing``: inductor's freezing for every compiled method (weights folded into the graphs; what
    ``StreamSession(compile=True)`` uses on a CPU)."""
    dev, dt = torch.device(device), getattr(torch, dtype)
    options = dict(compile_options or {})
    if freezing:  # a global inductor setting, so StaticCache's compiled forward gets it too (equal terms)
        import torch._inductor.config as inductor_config

        inductor_config.freezing = True
    bandwidth = copy_bandwidth(dev)
    results = {"bandwidth_GBps": bandwidth / 1e9, "device": str(dev), "dtype": dtype,
               "compile": {**options, **({"freezing": True} if freezing else {})},
               "num_sinks": num_sinks, "window": window, "models": []}
    print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s ({dev})", flush=True)
    for spec in specs:
        try:
            label, model, weights = load(spec, dev, dt)
        except Exception as exc:  # noqa: BLE001 - not in the box: say so, run the rest
            print(f"{spec} skipped: {exc}")
            results["models"].append({"model": spec, "skipped": str(exc)})
            continue
        print(f"{label}: {weights}", flush=True)
        vocab = _compat.embedding_rows(model)
        total = bytes_per_token(model, num_sinks, window)
        floor_ms = 1e3 * total / bandwidth
        entry = {"model": label, "weights": weights, "bytes_per_token": total, "bandwidth_floor_ms": floor_ms,
                 "threads": {}}
        for n_threads in ([] if generate_only else threads):
            try:
                measure(entry, label, model, vocab, n_threads, rounds, steps, num_sinks, window, options, floor_ms,
                        results, profile, compiled_plan)
            except Exception as exc:  # noqa: BLE001 - a one-shot run (a GPU lease) keeps the other rows
                traceback.print_exc()
                entry["threads"][n_threads] = {"error": f"{type(exc).__name__}: {exc}"}
            torch._dynamo.reset()
        if gen_tokens:
            torch.set_num_threads(threads[0])
            entry["generate"] = generate_rows(model, vocab, num_sinks + window - 1, num_sinks, window, gen_tokens)
            for row in entry["generate"]:
                print(f"  {row['mode']:<9} {row['method']:<14} {row['ms_per_token']:8.1f} ms/token "
                      f"(prefill {row['prefill_s']:.1f} s)")
        results["models"].append(entry)
        del model
        if checkpoint is not None:
            checkpoint(results)
    return results


def measure(entry: dict, label: str, model, vocab: int, n_threads: int, rounds: int, steps: int, num_sinks: int,
            window: int, options: dict, floor_ms: float, results: dict, profile: bool = False,
            compiled_plan: bool = False) -> None:
    """One thread count: warm every method (timed), interleaved rounds, ratios; into ``entry["threads"]``."""
    cached = num_sinks + window - 1  # K/V held before each step; the step attends over S + W
    torch.set_num_threads(n_threads)
    # One copy of the model per method: interleaving caches on one model would switch its attention
    # backend every step (and make the compiled forwards recompile).
    copies = [copy.deepcopy(model) for _ in range(5 if compiled_plan else 4)]
    sink = dict(num_sinks=num_sinks, window=window)
    methods = [Sink("sinklab compiled", copies[0], cached, vocab, options, compiled=True, **sink),
               Static("static compiled", copies[1], cached, vocab, options),
               Sink("sinklab eager", copies[2], cached, vocab, options, compiled=False, **sink),
               Dynamic("dynamic eager", copies[3], cached, vocab, options)]
    if compiled_plan:  # SinkCache(compile_plan=True): the decode step's bookkeeping compiled too
        methods.insert(1, Sink(PLANNED, copies[4], cached, vocab, options, compiled=True, compile_plan=True, **sink))
    warm, failed, skips = {}, {}, {}
    counters = torch._dynamo.utils.counters["inductor"]
    for m in methods:  # a method that fails (an older transformers, a backend) is left out; the rest still run
        before = counters["cudagraph_skips"]
        try:
            warm[m.name] = m.warm()
        except Exception as exc:  # noqa: BLE001 - reported in the table and the JSON
            traceback.print_exc()
            failed[m.name] = f"{type(exc).__name__}: {exc}"
            continue
        skips[m.name] = counters["cudagraph_skips"] - before  # CUDA graphs given up for this method's graphs
        print(f"  {label} {n_threads} thread(s): {m.name} warm in {warm[m.name]:.1f} s", flush=True)
    methods = [m for m in methods if m.name in warm]
    samples: dict[str, list[float]] = {m.name: [] for m in methods}
    for _ in range(rounds):  # interleaved
        for m in methods:
            samples[m.name] += time_steps(m, steps)
    by_name = {m.name: m for m in methods}
    vs_eager = {}  # the same tokens decoded: one more step must agree with the eager stream's
    if "sinklab eager" in by_name:
        with torch.no_grad():
            last = {m.name: m.step()[:, -1].double().cpu() for m in methods if m.name.startswith("sinklab")}
        b = last.pop("sinklab eager")
        vs_eager = {name: float((a - b).abs().max() / b.abs().max()) for name, a in last.items()}
    profiles = {m.name: profile_steps(m) for m in methods if profile and m.compiled}
    for name, table in profiles.items():
        print(f"  profile, {name}, 10 steps:\n{table}", flush=True)
    # Before plan_cost, which advances the stream without a forward.
    step_ops = {m.name: ops_per_step(m) for m in methods}
    checks, plan = {}, {}
    if "sinklab eager" in by_name:
        checks = check_costs(by_name["sinklab eager"])
        plan["eager"] = plan_cost(by_name["sinklab eager"])
    if PLANNED in by_name:
        plan["compiled"] = plan_cost(by_name[PLANNED])
    copy_ms = None
    if "dynamic eager" in by_name:
        copy_ms = dense_copy_ms(by_name["dynamic eager"])
    for m in methods:
        m.close()
    med = {k: statistics.median(v) for k, v in samples.items()}
    ratios = {f"{a} / {b}": med[a] / med[b] for a, b in (("sinklab compiled", "static compiled"),
                                                       ("sinklab compiled", "dynamic eager"),
                                                       ("sinklab eager", "dynamic eager"),
                                                       (PLANNED, "static compiled"), (PLANNED, "dynamic eager"))
              if a in med and b in med}
    if "sinklab compiled" in med:
        ratios["bandwidth floor / sinklab compiled"] = floor_ms / med["sinklab compiled"]
    if copy_ms is not None and "dynamic eager" in med:  # an eager ring at zero bookkeeping cost could reach this
        ratios["(dynamic eager − its cache copies) / dynamic eager"] = 1 - copy_ms / med["dynamic eager"]
    entry["threads"][n_threads] = {
        "warmup_s": warm, "median_ms": med, "failed": failed, "cudagraph_skips": skips,
        "p90_ms": {k: sorted(v)[int(0.9 * (len(v) - 1))] for k, v in samples.items()},
        "samples": rounds * steps, "sinklab_compiled_vs_eager_logits_rel": vs_eager.get("sinklab compiled"),
        "compiled_plan_vs_eager_logits_rel": vs_eager.get(PLANNED),
        "checks_us_per_token": checks, "plan_us_per_token": plan, "dense_cache_copy_ms_per_token": copy_ms,
        "ops_per_step": step_ops,
        "profiles": profiles, "ratios": ratios}
    print_table(label, n_threads, entry, results)


def print_table(label: str, n_threads: int, entry: dict, results: dict) -> None:
    r = entry["threads"][n_threads]
    print(f"\n{label} ({entry['weights']}), {results['device']} {results['dtype']}, {n_threads} thread(s), "
          f"S {results['num_sinks']} + W {results['window']}, compile {results['compile'] or 'inductor'} "
          f"(bandwidth floor {entry['bandwidth_floor_ms']:.2f} ms/token)")
    print(f"  {'method':<18}{'median ms':>10}{'p90 ms':>9}{'warm-up s':>11}")
    for name, ms in r["median_ms"].items():
        print(f"  {name:<18}{ms:10.2f}{r['p90_ms'][name]:9.2f}{r['warmup_s'][name]:11.1f}")
    for name, value in r["ratios"].items():
        print(f"  {name:<38} {value:.3f}×")
    for name, why in r["failed"].items():
        print(f"  {name}: FAILED ({why})")
    if any(r["cudagraph_skips"].values()):
        print(f"  CUDA graphs skipped (graphs per method): {r['cudagraph_skips']}")
    if r["sinklab_compiled_vs_eager_logits_rel"] is not None:
        print(f"  sinklab compiled vs eager, logits (rel)  {r['sinklab_compiled_vs_eager_logits_rel']:.1e}")
    if r.get("compiled_plan_vs_eager_logits_rel") is not None:
        print(f"  {PLANNED} vs eager, logits (rel)  {r['compiled_plan_vs_eager_logits_rel']:.1e}")
    if r["checks_us_per_token"]:
        costs = ", ".join(f"{k} {v:.0f} µs" for k, v in r["checks_us_per_token"].items())
        print(f"  checks per token: {costs} (of {r['median_ms']['sinklab eager']:.1f} ms)")
    if r.get("ops_per_step"):  # kernel launches from the host on an accelerator; graphs and dynamo frames entered
        ops = ", ".join(f"{k} {v['eager_ops']}" + (f" ({v['graphs']} graphs, {v['frames']} frames)" if "graphs" in v
                                                   else "") for k, v in r["ops_per_step"].items())
        print(f"  aten ops per decode step outside compiled graphs: {ops}")
    if r.get("dense_cache_copy_ms_per_token") is not None:
        print(f"  DynamicCache's own update + crop per token (alone): {r['dense_cache_copy_ms_per_token']:.2f} ms")
    if r.get("plan_us_per_token"):
        costs = ", ".join(f"{k} {v:.0f} µs" for k, v in r["plan_us_per_token"].items())
        print(f"  step plan per token (host bookkeeping, ids check included): {costs}")
    print(flush=True)
