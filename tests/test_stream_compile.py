"""A compiled stream: torch.compile'd decoding equals eager decoding and the float64 reference, with no
recompilation after warm-up across evictions and rebases.

No C++ build here (inductor's compile is too slow for a 2-core test run; its numbers are in
benchmarks/bench_stream.py ``--compile``). The left-padded pinned batch — per-row masked cache writes —
compiles with ``backend="aot_eager"`` (dynamo + AOT autograd's functionalisation of the in-place writes, what
inductor sees too); the other cases with ``backend="eager"``: dynamo's graph capture, graph breaks and
recompilation guards, which is what they check.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from stream_reference import Reference
from tiny_models import build
from transformers import CompileConfig

import sinklab
from sinklab.stream import SinkCache, StreamSession
from sinklab.variants import apply_variant

V = 97


def _tokens(n: int, seed: int = 3) -> torch.Tensor:
    return torch.randint(2, V, (n,), generator=torch.Generator().manual_seed(seed))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _decode(model, forward, prompt, mask, steps, warm, states=None, **cache_kw):
    """Feed ``prompt`` eagerly, then ``steps`` teacher-forced tokens through ``forward``; logits ``[steps, B, V]``.

    After ``warm`` decode steps any recompilation raises (torch._dynamo's ``error_on_recompile``). ``states`` (a
    list) receives a copy of the stream's per-row buffers and counters at the end.
    """
    b = prompt.shape[0]
    follow = torch.stack([_tokens(steps, seed=40 + r) for r in range(b)], 1)  # (steps, B)
    cache = SinkCache(model, **cache_kw)
    name = sinklab._compat.cache_kwarg_name(model)
    out = []
    with torch.no_grad():
        model(input_ids=prompt, attention_mask=mask, **{name: cache})
        for i in range(steps):
            with torch._dynamo.config.patch(error_on_recompile=i >= warm):
                out.append(forward(input_ids=follow[i][:, None], **{name: cache}).logits[:, -1])
    rebases = cache.state.rebases
    if states is not None:
        states.append({k: v.clone() for k, v in cache.state.per_row().items()})
    cache.close()
    return torch.stack(out), follow, rebases


def _reference_rows(model, prompt, mask, follow, **cache_kw):
    """The float64 reference of each row alone (its real tokens only): logits ``[steps, B, V]``."""
    rows = []
    for r in range(prompt.shape[0]):
        ref = Reference(model, cache_kw["num_sinks"], cache_kw["window"], cache_kw.get("pinned", ()))
        real = prompt[r][mask[r].bool()] if mask is not None else prompt[r]
        for t in real.tolist():
            ref.step(t)
        rows.append(torch.stack([ref.step(int(t)) for t in follow[:, r]]))
    return torch.stack(rows, 1)


def _llama_variant():
    model = build("llama-gqa")
    apply_variant(model, "sink-logit+gated")
    return model


def _gemma3():
    from test_gemma3 import cut_down_gemma3  # builtin:gemma3's config narrowed: 1 sliding (window 8) : 1 global

    return cut_down_gemma3(layers=2)


CASES = {  # name: (model builder, batch, cache settings, backend); batch 1 takes the unmasked (fast) write
    "padded-batch-pinned": (lambda: build("llama-gqa"), 2, dict(num_sinks=1, window=5, pinned=[(3, 6)], rebase_every=8),
                            "aot_eager"),
    "gemma3-sliding-and-global": (_gemma3, 1, dict(num_sinks=2, window=6, rebase_every=11), "eager"),
    "variant-sink-logit-gate": (_llama_variant, 1, dict(num_sinks=2, window=6, rebase_every=8), "eager"),
}


@pytest.mark.long
@pytest.mark.parametrize("case", list(CASES))
def test_compiled_decoding_equals_eager_and_reference(case):
    """14 decode steps, a re-base every few tokens (≥ 3) and evictions throughout: compiled == eager ≤ 1e-5,
    == the float64 reference of each row alone; no recompilation after 2 warm-up steps. The Gemma 3 case (two
    cache budgets: native sliding layers and sinks + window on the global one) compiles through
    ``StreamSession(compile=...)``, the others through ``torch.compile(model.forward)``."""
    make, batch, cache_kw, backend = CASES[case]
    model = make()
    steps, warm = 14, 2
    if batch == 1:
        prompt, mask = _tokens(9, seed=5)[None], None
    else:  # left-padded: row 0 has 4 pads, row 1 none; each row's sinks and pins are its own
        prompt = torch.stack([_tokens(9, seed=5), _tokens(9, seed=6)])
        mask = torch.ones_like(prompt)
        mask[0, :4] = 0
    eager, follow, _ = _decode(model, model.forward, prompt, mask, steps, steps, **cache_kw)
    if case.startswith("gemma3"):
        ours, rebases = _session_decode(model, prompt, follow, warm, backend, **cache_kw)
    else:
        compiled = torch.compile(model.forward, backend=backend)
        ours, _, rebases = _decode(model, compiled, prompt, mask, steps, warm, **cache_kw)
    assert rebases >= 3
    worst = max(_rel(ours[i, r], eager[i, r]) for i in range(steps) for r in range(batch))
    assert worst <= 1e-5, worst
    ref = _reference_rows(model, prompt, mask, follow, **cache_kw)
    worst_ref = max(_rel(ours[i, r], ref[i, r]) for i in range(steps) for r in range(batch))
    assert worst_ref < 1e-4, worst_ref


def _session_decode(model, prompt, follow, warm, backend, **cache_kw):
    """The same stream through ``StreamSession(compile=...)`` (what ``stream_generate`` / ``--compile`` use)."""
    out = []
    with StreamSession(model, chunk_size=64, compile={"backend": backend}, **cache_kw) as s:
        s.feed(prompt)
        for i in range(follow.shape[0]):
            with torch._dynamo.config.patch(error_on_recompile=i >= warm):
                out.append(s.step(follow[i]))
        return torch.stack(out), s.state.rebases


@pytest.mark.long
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_and_eager_steps_mix_on_one_stream(backend):
    """Eager steps keep each anchored key's partner dimensions between steps; a compiled step that writes an
    anchored key must drop them too (a side effect of the traced cache write). One stream: a 1-token prompt,
    an eager step (sink 1), a compiled step (sink 2), then eager steps past eviction == the all-eager stream."""
    model = build("llama-gqa")
    kw = dict(num_sinks=3, window=4)
    follow = _tokens(12, seed=9)
    name = sinklab._compat.cache_kwarg_name(model)
    compiled = torch.compile(model.forward, backend=backend)
    runs = []
    for mixed in (False, True):
        out = []
        with torch.no_grad(), SinkCache(model, **kw) as cache:
            model(input_ids=_tokens(1, seed=2)[None], **{name: cache})
            for i, tok in enumerate(follow):
                forward = compiled if mixed and i == 1 else model.forward
                out.append(forward(input_ids=tok.view(1, 1), **{name: cache}).logits[0, -1])
        runs.append(torch.stack(out))
    assert max(_rel(a, b) for a, b in zip(*runs)) <= 1e-5


def test_generate_with_compile_config_equals_eager_generate():
    """``generate(past_key_values=SinkCache, compile_config=...)`` compiles the decode step (on a CPU only with
    transformers' ``_compile_all_devices``): same tokens as eager, and no recompilation across rebases."""
    model = build("llama-gqa")
    ids = _tokens(7, seed=8)[None]
    gen = dict(max_new_tokens=18, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad(), SinkCache(model, num_sinks=2, window=6, rebase_every=10) as cache:
        eager = model.generate(ids, past_key_values=cache, **gen)
    config = CompileConfig(backend="eager", fullgraph=False)
    config._compile_all_devices = True
    counters = torch._dynamo.utils.counters
    with torch.no_grad(), SinkCache(model, num_sinks=2, window=6, rebase_every=10) as cache:
        model.generate(ids, past_key_values=cache, compile_config=config, max_new_tokens=3, do_sample=False,
                       eos_token_id=None, pad_token_id=0)  # warm-up
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0  # it did compile
    with torch.no_grad(), SinkCache(model, num_sinks=2, window=6, rebase_every=10) as cache, \
            torch._dynamo.config.patch(error_on_recompile=True):
        compiled = model.generate(ids, past_key_values=cache, compile_config=config, **gen)
        assert cache.state.rebases >= 3
    assert counters["stats"]["unique_graphs"] == graphs
    assert torch.equal(compiled, eager)


@pytest.mark.long
def test_cli_stream_compile_prints_the_eager_text():
    """``sinklab stream --compile`` (dynamo's eager backend here; inductor in the benchmark): the same greedy text."""
    from typer.testing import CliRunner

    from sinklab.cli import app

    args = ["stream", "builtin:tiny-lm", "--prompt", "The rule of the code is", "--sinks", "2", "--window", "8",
            "--max-new-tokens", "12"]
    runner = CliRunner()
    eager = runner.invoke(app, args)
    compiled = runner.invoke(app, [*args, "--compile", "--compile-backend", "eager"])
    assert eager.exit_code == 0 and compiled.exit_code == 0, compiled.output
    assert compiled.stdout == eager.stdout and len(eager.stdout.strip()) > 0


@pytest.mark.parametrize("make, cache_kw", [
    (lambda: build("llama-gqa"), dict(num_sinks=2, window=6, rebase_every=8)),
    (_gemma3, dict(num_sinks=2, window=6, rebase_every=11)),  # two budgets: one compiled plan per window
], ids=["llama", "gemma3-sliding-and-global"])
@pytest.mark.long
def test_compiled_step_plan_equals_the_eager_plan(make, cache_kw):
    """``SinkCache(compile_plan=True)`` (inductor; off by default, meant for accelerators): the decode step's
    bookkeeping compiled once per budget on the first step, then no recompilation across evictions and ≥ 3
    re-bases; the stream's buffers and logits equal those of the eager plan, and both equal the float64
    reference; after the same tokens both streams hold the same buffers and counters. Also under a compiled forward
    (the plan runs in the decoder-stack hook, between its graphs)."""
    model = make()
    prompt = _tokens(9, seed=5)[None]
    states: list[dict] = []
    eager, follow, rebases = _decode(model, model.forward, prompt, None, 24, 24, states, compile_plan=False,
                                     **cache_kw)
    counters = torch._dynamo.utils.counters
    before = counters["stats"]["unique_graphs"]
    planned, _, _ = _decode(model, model.forward, prompt, None, 24, 1, states, compile_plan=True, **cache_kw)
    windows = {s.window for s in SinkCache(model, **cache_kw).states}
    assert counters["stats"]["unique_graphs"] - before == len(windows)  # one plan graph per budget, at step 0
    assert rebases >= 3 and _rel(planned, eager) <= 1e-6
    assert states[0].keys() == states[1].keys()
    for name in states[0]:
        assert torch.equal(states[0][name], states[1][name]), name
    ref = _reference_rows(model, prompt, None, follow, **cache_kw)
    assert _rel(planned, ref) < 1e-4
    torch._dynamo.reset()
    compiled = torch.compile(model.forward, backend="eager")
    both, _, _ = _decode(model, compiled, prompt, None, 24, 2, compile_plan=True, **cache_kw)
    assert _rel(both, eager) <= 1e-5


def test_compile_plan_is_checked_and_reaches_the_stream():
    model = build("llama-gqa")
    with pytest.raises(sinklab.errors.InputError, match="compile_plan"):
        SinkCache(model, num_sinks=2, window=6, compile_plan="yes")
    with StreamSession(model, num_sinks=2, window=6, compile_plan=True) as s:
        assert all(state.compile_plan for state in s.sink.states)
    assert not any(state.compile_plan for state in SinkCache(model, num_sinks=2, window=6).states)


@pytest.mark.long
def test_session_compile_true_on_cpu_freezes_weights_and_matches_eager():
    """``StreamSession(compile=True)`` on a CPU: inductor with freezing (what ``stream_generate(compile=True)`` and
    ``sinklab stream --compile`` use; a mode keeps it, inductor options of the caller's do not): the projections'
    weights are prepacked into the graph (inductor's weight-pack pass fires — it does not without freezing), the
    logits equal the eager session's (≤ 1e-5) over evictions and ≥ 3 re-bases, and nothing recompiles after 2
    warm-up steps. (``mode="max-autotune-no-cudagraphs"``, whose compile is several times longer, is checked against
    eager on SmolLM2 by benchmarks/vs_llamacpp.py; tests/test_readme.py holds its committed figures to 1e-5.)"""
    model = build("llama-gqa")
    prompt, follow = _tokens(9, seed=5)[None], _tokens(16, seed=7)
    counters = torch._dynamo.utils.counters  # its entries may be replaced while compiling: read them by key
    before = counters["inductor"]["mkldnn_linear_weight_pack_matcher_count"]
    out = {}
    for compile in (None, True):
        with StreamSession(model, num_sinks=2, window=6, rebase_every=8, compile=compile) as s:
            s.feed(prompt)
            steps = []
            for i, t in enumerate(follow):
                with torch._dynamo.config.patch(error_on_recompile=compile is True and i >= 2):
                    steps.append(s.step(t[None]))
            out[compile] = torch.stack(steps)
            assert s.sink.state.rebases >= 3
            assert s.freezing is bool(compile) and s.compile_options == ({} if compile else None)
    assert counters["inductor"]["mkldnn_linear_weight_pack_matcher_count"] > before
    assert _rel(out[True], out[None]) <= 1e-5
    assert StreamSession(model, num_sinks=2, window=6, compile={"mode": "max-autotune-no-cudagraphs"}).freezing
    for given in ({"backend": "eager"}, {"options": {"freezing": False}}):
        with StreamSession(model, num_sinks=2, window=6, compile=given) as s:  # as given: no freezing added
            assert s.compile_options == given and not s.freezing
    assert StreamSession(model, num_sinks=2, window=6, compile={"backend": "inductor"}).freezing
    assert not StreamSession(model, num_sinks=2, window=6, compile=True, freeze=False).freezing
    assert StreamSession(model, num_sinks=2, window=6, compile={"mode": "default"}, freeze=True).freezing
    for bad in (dict(freeze=True), dict(compile={"backend": "eager"}, freeze=True), dict(compile=True, freeze="on")):
        with pytest.raises(sinklab.errors.InputError, match="freeze"):
            StreamSession(model, num_sinks=2, window=6, **bad)


def test_step_plan_that_cannot_compile_runs_eagerly_with_a_warning(monkeypatch):
    """No compiler for the plan here (dynamo or the backend fails): one RuntimeWarning, ``compile_plan`` drops to
    False, and the stream goes on with the eager plan — the same logits as a stream that never tried."""
    from sinklab.stream import state as stream_state

    class NoCompiler(torch._dynamo.exc.TorchDynamoException):
        pass

    def failing(*args):
        raise NoCompiler("no backend on this machine")

    model = build("llama-gqa")
    prompt = _tokens(9, seed=5)[None]
    eager, _, _ = _decode(model, model.forward, prompt, None, 12, 12, num_sinks=2, window=6, rebase_every=8)
    monkeypatch.setattr(stream_state, "compiled_free_step", lambda: failing)
    cache = SinkCache(model, num_sinks=2, window=6, rebase_every=8, compile_plan=True)
    follow = _tokens(12, seed=40)
    with torch.no_grad(), pytest.warns(RuntimeWarning, match=r"could not be compiled \(NoCompiler: no backend on this machine\); it runs "
                                                            r"eagerly \(SinkCache\(\.\.\., compile_plan=False\) skips the attempt\)"):
        model(input_ids=prompt, cache=cache)
        got = torch.stack([model(input_ids=t.view(1, 1), cache=cache).logits[:, -1] for t in follow])
    assert cache.state.compile_plan is False
    cache.close()
    assert torch.equal(got, eager)


@pytest.mark.parametrize("args, message", [
    (["--freeze"], "--freeze is inductor's freezing of a compiled step; add --compile"),
    (["--compile-backend", "eager"], "--compile-backend and --compile-mode set how --compile compiles"),
    (["--compile-mode", "bogus"], "--compile-backend and --compile-mode set how --compile compiles"),
    (["--compile", "--compile-backend", "bogus"], "unknown backend 'bogus'"),
    (["--compile", "--compile-mode", "bogus"], "unknown mode 'bogus'"),
    (["--compile", "--compile-backend", "eager", "--compile-mode", "max-autotune"], "mode is an inductor setting"),
    (["--compile", "--compile-backend", "eager", "--freeze"], "freeze=True needs compile with torch.compile's"),
    (["--sinks", "-1"], "--sinks must be ≥ 0, got -1"),
    (["--top-k", "-3"], "--top-k must be ≥ 0, got -3"),
    (["--temperature", "nan"], "temperature must be a finite number ≥ 0"),
    (["--file", __file__], "give either --prompt or --file, not both"),
])
def test_cli_stream_options_are_clear_errors(args, message):
    """A bad or idle compile option, or a bad size, is one line naming the flag — no traceback, no silent no-op."""
    from typer.testing import CliRunner

    from sinklab.cli import app

    r = CliRunner().invoke(app, ["stream", "builtin:tiny-lm", "--prompt", "The rule", "--max-new-tokens", "2", *args])
    assert r.exit_code != 0 and message in " ".join(r.output.split()) and "Traceback" not in r.output, r.output


def _count_step(step, steps: int = 4) -> tuple[float, float]:
    """Dynamo frames entered and compiled graphs run per call of ``step`` (after warm-up); ``step`` calls a function
    compiled with :func:`_counting_backend`."""
    from torch.profiler import profile

    for _ in range(3):
        step()
    _GRAPH_RUNS[0] = 0
    with profile() as prof:
        for _ in range(steps):
            step()
    frames = sum(e.name.startswith("Torch-Compiled Region") for e in prof.events())
    return frames / steps, _GRAPH_RUNS[0] / steps


_GRAPH_RUNS = [0]


def _counting_backend(gm, example_inputs):
    """A dynamo backend that runs each captured graph as is and counts its calls."""
    def run(*args):
        _GRAPH_RUNS[0] += 1
        return gm.forward(*args)
    return run


@pytest.mark.long
@pytest.mark.parametrize("make", [lambda: build("llama-gqa"), _gemma3], ids=["llama-gqa", "gemma3-two-budgets"])
def test_a_compiled_session_step_is_one_frame_and_one_graph(make):
    """``StreamSession(compile=...)``: each decode step, past eviction, enters one dynamo frame and runs one graph —
    transformers' StaticCache's count on the same model — because the cache plans the step before the compiled call
    (``SinkCache.planned_forward``) and its decoder-stack hooks stand aside. A model forward compiled around a
    SinkCache passed in the usual way breaks the graph at those hooks (more frames and graphs), which is what this
    count guards against. The Gemma 3 case has two stream states (sliding and global layers)."""
    from transformers import StaticCache

    model = make()
    tok = torch.tensor([5])
    with StreamSession(model, num_sinks=2, window=6, compile={"backend": _counting_backend}) as s:
        s.feed(_tokens(12, seed=4)[None])
        ours = _count_step(lambda: s.step(tok))
    assert ours == (1.0, 1.0), ours
    torch._dynamo.reset()
    name = sinklab._compat.cache_kwarg_name(model)
    static = StaticCache(config=model.config, max_cache_len=16)
    forward = torch.compile(model.forward, backend=_counting_backend)
    pos = torch.tensor([[9]])
    with torch.no_grad():
        model(input_ids=_tokens(9, seed=4)[None], **{name: static})

        def static_step():
            forward(input_ids=tok[None], position_ids=pos, **{name: static})
            for layer in static.layers:
                layer.crop(-1)
        assert _count_step(static_step) == (1.0, 1.0)
    torch._dynamo.reset()
    cache = SinkCache(model, num_sinks=2, window=6)
    with torch.no_grad():
        model(input_ids=_tokens(12, seed=4)[None], **{name: cache})
        hooked = _count_step(lambda: forward(input_ids=tok[None], **{name: cache}))
    cache.close()
    assert hooked[0] > 1 and hooked[1] > 1, hooked  # the hooks' eager bookkeeping between graphs


@pytest.mark.long
def test_a_forward_compiled_with_matvec_options_through_planned_forward_equals_eager():
    """The route docs/stream.md gives a user who compiles ``model.forward`` with a SinkCache: the options sinklab's
    own CPU compile passes (``fastpath.matvec_options`` after ``fastpath.apply_matvec_width``) and
    ``SinkCache.planned_forward``. Inductor decomposes the step's one-row products (its counters), the logits equal
    the eager stream's (≤ 1e-5) past eviction and re-bases, and nothing recompiles after 2 warm-up steps."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters

    from sinklab import fastpath

    model = build("llama-gqa")
    name = sinklab._compat.cache_kwarg_name(model)
    prompt, follow = _tokens(9, seed=5)[None], _tokens(12, seed=7)
    opts = {"options": fastpath.matvec_options()}
    fastpath.apply_matvec_width(opts)
    forward = torch.compile(model.forward, **opts)
    counters.clear()
    out = {}
    for compiled in (False, True):
        cache = SinkCache(model, num_sinks=2, window=6, rebase_every=5)
        steps = []
        # a compile-cache hit would skip the pass and its counters
        with torch.no_grad(), inductor_config.patch(fx_graph_cache=False), \
                functorch_config.patch(enable_autograd_cache=False):
            model(input_ids=prompt, **{name: cache})
            for i, t in enumerate(follow):
                kwargs = {"input_ids": t[None, None], name: cache}
                if compiled:
                    with torch._dynamo.config.patch(error_on_recompile=i >= 2):
                        steps.append(cache.planned_forward(forward, **kwargs).logits[:, -1])
                else:
                    steps.append(model(**kwargs).logits[:, -1])
        assert cache.state.rebases >= 2
        cache.close()
        out[compiled] = torch.stack(steps)
    assert counters["inductor"]["decompose_mm"] + counters["inductor"]["decompose_addmm"] > 0
    assert _rel(out[True], out[False]) <= 1e-5
