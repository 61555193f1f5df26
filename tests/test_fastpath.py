"""The default decode path (sinklab.fastpath): how a stream told nothing picks compiled or eager, where the compile
cache goes, and the first compiled call's progress lines — all without compiling a real model (inductor's compile
is minutes on a CPU; the one compile here is dynamo's "eager" backend on a tiny model)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch._dynamo
import torch._functorch.config as functorch_config
import torch._inductor.config as inductor_config
from tiny_models import build

from sinklab import fastpath
from sinklab.errors import InputError
from sinklab.stream import StreamSession


@pytest.fixture
def can_build(monkeypatch):
    """A machine where inductor could build (a compiler and Python's headers), whatever this one has."""
    monkeypatch.setattr(fastpath, "cxx_compiler", lambda: "g++")
    monkeypatch.setattr(fastpath, "python_headers", lambda: True)


@pytest.mark.parametrize("value, expected", [("0", False), ("off", False), ("FALSE", False), ("no", False),
                                             ("1", True), ("on", True), (" True ", True), ("yes", True)])
def test_the_variable_decides_when_set(monkeypatch, value, expected):
    monkeypatch.setenv(fastpath.COMPILE_ENV, value)
    assert fastpath.default_compile("cpu", torch.float32) is expected
    assert fastpath.default_compile("cuda", torch.bfloat16) is expected  # set: whatever the machine


@pytest.mark.parametrize("value", ["auto", "", "AUTO"])
def test_auto_compiles_on_a_cpu_for_float_weights_only(monkeypatch, can_build, value):
    monkeypatch.setenv(fastpath.COMPILE_ENV, value)
    assert fastpath.default_compile("cpu", torch.float32) is True
    assert fastpath.default_compile(torch.device("cpu"), torch.bfloat16) is True
    assert fastpath.default_compile("cpu", torch.float16) is True
    assert fastpath.default_compile("cpu", torch.float64) is False
    assert fastpath.default_compile("cuda:0", torch.float32) is False
    assert fastpath.default_compile("cuda:0", torch.bfloat16) is False
    monkeypatch.delenv(fastpath.COMPILE_ENV)
    assert fastpath.default_compile("cpu", torch.float32) is True  # unset is auto
    assert fastpath.default_compile("cpu", torch.float32, fastpath.MIN_PARAMETERS - 1) is False  # a tiny model


def test_auto_leaves_a_tiny_model_eager(monkeypatch, can_build):
    monkeypatch.setenv(fastpath.COMPILE_ENV, "auto")
    assert fastpath.resolve_compile(None, build("llama-gqa")) == (False, True)
    monkeypatch.setattr(fastpath, "MIN_PARAMETERS", 1)
    assert fastpath.resolve_compile(None, build("llama-gqa")) == ({"options": fastpath.matvec_options()}, True)


def test_auto_is_eager_where_inductor_cannot_build(monkeypatch):
    monkeypatch.setenv(fastpath.COMPILE_ENV, "auto")
    monkeypatch.setattr(fastpath, "python_headers", lambda: True)
    monkeypatch.setattr(fastpath, "cxx_compiler", lambda: None)
    assert fastpath.default_compile("cpu", torch.float32) is False
    monkeypatch.setattr(fastpath, "cxx_compiler", lambda: "g++")
    monkeypatch.setattr(fastpath, "python_headers", lambda: False)
    assert fastpath.default_compile("cpu", torch.float32) is False


def test_a_compiler_is_looked_up_as_inductor_would(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    monkeypatch.setattr(fastpath.shutil, "which", lambda name: "/usr/bin/c++" if name == "c++" else None)
    assert fastpath.cxx_compiler() == "c++"
    monkeypatch.setattr(fastpath.shutil, "which", lambda name: None)
    assert fastpath.cxx_compiler() is None


def test_a_bad_variable_is_one_clear_error(monkeypatch):
    monkeypatch.setenv(fastpath.COMPILE_ENV, "sometimes")
    with pytest.raises(InputError, match=r"\$SINKLAB_COMPILE is auto, 1 \(on\) or 0 \(off\), got 'sometimes'"):
        fastpath.default_compile("cpu", torch.float32)


def test_an_explicit_choice_wins_over_the_variable(monkeypatch):
    model = build("llama-gqa")
    monkeypatch.setenv(fastpath.COMPILE_ENV, "1")
    assert fastpath.resolve_compile(False, model) == (False, False)
    assert fastpath.resolve_compile({"backend": "eager"}, model) == ({"backend": "eager"}, False)
    assert fastpath.resolve_compile(None, model) == ({"options": fastpath.matvec_options()}, True)
    monkeypatch.setenv(fastpath.COMPILE_ENV, "0")
    assert fastpath.resolve_compile(True, model) == (True, False)
    assert fastpath.resolve_compile(None, model) == (False, True)


def test_session_default_follows_the_variable_without_compiling(monkeypatch):
    """Building a session compiles nothing (torch.compile is lazy): what it would run is read off the session."""
    model = build("llama-gqa")
    monkeypatch.setenv(fastpath.COMPILE_ENV, "1")
    auto = StreamSession(model, num_sinks=2, window=8)
    assert auto.compile_options == {"options": fastpath.matvec_options()}  # on a CPU: the one-row products decomposed
    assert isinstance(auto._step_forward, fastpath.FirstCall)
    assert auto._step_forward.fallback is not None  # sinklab's own choice: a failed compile decodes eagerly
    assert auto.freezing is False  # frozen graphs bypass inductor's on-disk caches
    assert StreamSession(model, num_sinks=2, window=8, compile=True).freezing is True  # asked for: as before
    assert StreamSession(model, num_sinks=2, window=8, compile=True)._step_forward.fallback is None
    assert StreamSession(model, num_sinks=2, window=8, compile=False).compile_options is None
    monkeypatch.setenv(fastpath.COMPILE_ENV, "0")
    eager = StreamSession(model, num_sinks=2, window=8)
    assert eager.compile_options is None and eager._step_forward == model.forward
    assert eager._given["compile"] is None  # a saved stream re-resolves the default where it is loaded


def test_chat_passes_its_choice_to_the_session(monkeypatch):
    import sinklab
    from sinklab.chat import ChatStream

    tiny_lm = sinklab.load_model("builtin:tiny-lm")
    monkeypatch.setenv(fastpath.COMPILE_ENV, "1")
    assert ChatStream(tiny_lm.model, tiny_lm.tokenizer, window=8, compile=False)._session.compile_options is None
    assert ChatStream(tiny_lm.model, tiny_lm.tokenizer, window=8)._session.compile_options == {"options": fastpath.matvec_options()}


def test_the_cache_folder_is_sinklabs_unless_the_user_set_one(monkeypatch, tmp_path):
    # the config modules' own patch() puts their values back (monkeypatch's undo would delete the attributes)
    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        for name in ("TORCHINDUCTOR_CACHE_DIR", "TORCHINDUCTOR_FX_GRAPH_CACHE", "TORCHINDUCTOR_AUTOGRAD_CACHE"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("SINKLAB_CACHE", str(tmp_path / "sl"))
        assert fastpath.use_compile_cache() == tmp_path / "sl" / "inductor"
        import os

        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "sl" / "inductor")
        assert inductor_config.fx_graph_cache is True and functorch_config.enable_autograd_cache is True
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
        assert fastpath.use_compile_cache() == tmp_path / "mine"  # the user's own folder stays
        inductor_config.fx_graph_cache = False
        monkeypatch.setenv("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")
        fastpath.use_compile_cache()
        assert inductor_config.fx_graph_cache is False  # the user's own switch stays


def test_first_call_says_it_compiles_and_how_long_it_took():
    lines: list[str] = []
    calls: list[int] = []
    first = fastpath.FirstCall(lambda x: calls.append(x) or x + 1, cache=Path("/c"), say=lines.append)
    assert first(1) == 2 and first(2) == 3 and calls == [1, 2]
    assert len(lines) == 2  # once, on the first call
    assert "compiling the decode step with torch.compile" in lines[0] and "(compile cache: /c)" in lines[0]
    assert "--eager" in lines[0]
    assert lines[1].startswith("[sinklab: decode step compiled in ") and lines[1].endswith(" s]")
    assert first.seconds is not None and first.from_cache is None  # no inductor graph: no cache to read


def test_first_call_names_a_cache_hit(monkeypatch):
    from torch._dynamo.utils import counters

    def loads(x):
        counters["inductor"]["fxgraph_cache_hit"] += 1
        return x

    monkeypatch.setitem(counters, "inductor", counters["inductor"].copy())
    lines: list[str] = []
    first = fastpath.FirstCall(loads, say=lines.append)
    first(0)
    assert first.from_cache is True and "decode step loaded from the compile cache in" in lines[1]


def test_an_automatic_compile_that_fails_decodes_eagerly():
    def broken(x):
        raise RuntimeError("no C++ compiler\nmore")

    first = fastpath.FirstCall(broken, fallback=lambda x: x * 10, say=lambda _: None)
    with pytest.warns(RuntimeWarning, match=r"automatic compile of the decode step failed \(RuntimeError: no C\+\+ "
                                            r"compiler\); decoding eagerly \(set SINKLAB_COMPILE=0"):
        assert first(2) == 20
    assert first(3) == 30 and first.runs_eager  # eager from then on (a session lays the weights out for it)
    asked = fastpath.FirstCall(broken, say=lambda _: None)
    with pytest.raises(RuntimeError, match="no C"):  # a compile the caller asked for: its error
        asked(1)


def test_first_call_builds_the_forward_at_the_first_call():
    built: list[int] = []
    first = fastpath.FirstCall(build=lambda: built.append(1) or (lambda x: x * 2), say=lambda _: None)
    assert built == []  # nothing compiled (nor imported) before the first step
    assert first(2) == 4 and first(3) == 6 and built == [1]
    with pytest.raises(TypeError, match="a forward or a build function"):
        fastpath.FirstCall(lambda: 1, build=lambda: (lambda: 1))


def test_an_automatic_compile_waits_its_eager_steps():
    """The first ``eager_calls`` calls run the eager forward and build nothing; the next one compiles, once."""
    built: list[int] = []
    lines: list[str] = []
    first = fastpath.FirstCall(build=lambda: built.append(1) or (lambda x: x * 2), fallback=lambda x: -x,
                               say=lines.append, eager_calls=3)
    assert [first(1), first(2), first(3)] == [-1, -2, -3] and built == [] and lines == []
    assert [first(4), first(5)] == [8, 10] and built == [1] and len(lines) == 2
    with pytest.raises(TypeError, match="needs a fallback"):
        fastpath.FirstCall(lambda x: x, eager_calls=1)
    step = fastpath.compiled_step(lambda x: x, {"backend": "eager"}, freezing=False, automatic=True)
    assert step.eager_left == fastpath.EAGER_STEPS
    assert fastpath.compiled_step(lambda x: x, {"backend": "eager"}, freezing=False).eager_left == 0


def test_quiet_first_call_says_nothing():
    lines: list[str] = []
    fastpath.FirstCall(lambda: 1, say=lines.append, quiet=True)()
    assert lines == []


def test_a_session_step_announces_its_compile_once_per_model(capsys):
    """Through a real session (dynamo's eager backend: no inductor build): the progress lines go to stderr, the
    model's second compiled session says nothing, the logits are the eager ones."""
    torch._dynamo.reset()
    model = build("llama-gqa")
    ids = torch.randint(0, 50, (1, 6))
    outs = []
    for compile in (False, {"backend": "eager"}, {"backend": "eager"}):
        with torch.no_grad(), StreamSession(model, num_sinks=2, window=8, compile=compile) as s:
            logits = s.feed(ids)
            outs.append(s.step(logits.argmax(-1)))
    err = capsys.readouterr().err
    assert err.count("[sinklab: compiling the decode step") == 1 and err.count("decode step compiled in") == 1
    assert torch.allclose(outs[1], outs[0], atol=1e-5) and torch.allclose(outs[2], outs[0], atol=1e-5)
    torch._dynamo.reset()


def test_cli_eager_and_default_print_the_same_text(monkeypatch):
    """``sinklab stream --eager`` decodes eagerly even where the variable says compile; with the variable at 0 the
    default is eager too: the same greedy text, and no compile line."""
    from typer.testing import CliRunner

    from sinklab.cli import app

    args = ["stream", "builtin:tiny-lm", "--prompt", "The rule of the code is", "--sinks", "2", "--window", "8",
            "--max-new-tokens", "6"]
    monkeypatch.setenv(fastpath.COMPILE_ENV, "1")
    monkeypatch.setattr("sinklab.stream.session.compiled_step", lambda *a, **k: pytest.fail("--eager compiled"))
    eager = CliRunner().invoke(app, [*args, "--eager"])
    monkeypatch.setenv(fastpath.COMPILE_ENV, "0")
    default = CliRunner().invoke(app, args)
    assert eager.exit_code == 0 and default.exit_code == 0, eager.output + default.output
    assert eager.stdout == default.stdout and eager.stdout.strip()
    assert "compiling" not in eager.stderr + default.stderr


@pytest.mark.parametrize("flags", [["--eager", "--freeze"], ["--eager", "--compile-mode", "max-autotune"]])
def test_cli_eager_with_compile_settings_is_an_error(flags):
    from typer.testing import CliRunner

    from sinklab.cli import app

    r = CliRunner().invoke(app, ["stream", "builtin:tiny-lm", "--prompt", "The rule", "--max-new-tokens", "2", *flags])
    assert r.exit_code != 0 and "add --compile" in " ".join(r.output.split()), r.output


def test_cli_chat_eager_decodes_without_compiling(monkeypatch):
    """``sinklab chat --eager``: eager even where the variable says compile."""
    from typer.testing import CliRunner

    from sinklab.cli import app

    monkeypatch.setenv(fastpath.COMPILE_ENV, "1")
    monkeypatch.setattr("sinklab.stream.session.compiled_step", lambda *a, **k: pytest.fail("--eager compiled"))
    r = CliRunner().invoke(app, ["chat", "builtin:tiny-lm", "--max-new-tokens", "3", "--window", "16", "--eager"],
                           input="hi\n")
    assert r.exit_code == 0, r.output
    assert "compiling" not in r.output


def _tied_llama():
    from sinklab.models import tiny_llama

    model = tiny_llama(seed=3).eval()
    model.lm_head.weight = model.model.embed_tokens.weight  # tied, as SmolLM2's are
    return model


def test_decode_layout_keeps_every_value_and_moves_only_the_memory_order(tmp_path):
    model = _tied_llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(0, 1000, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids).logits
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert fastpath.decode_layout(model) == len(linears)
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name  # bit for bit
    for m in linears:
        assert m.weight.stride() == (1, m.weight.shape[0])  # input-major in memory, the [out, in] shape kept
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, want, rtol=1e-5, atol=1e-5)  # float32 summation order only
    assert fastpath.decode_layout(model) == 0  # a second holder: nothing moves
    assert fastpath.restore_layout(model) == 0  # ... nor when it lets go
    assert not model.lm_head.weight.is_contiguous()
    assert fastpath.restore_layout(model) == len(linears)  # the last holder puts every weight back
    assert all(p.is_contiguous() for p in model.parameters())
    assert fastpath.restore_layout(model) == 0
    model.save_pretrained(tmp_path)  # what the layout would break (transformers reads each weight as one block)
    from transformers import AutoModelForCausalLM

    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    for name, value in again.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_decode_layout_leaves_other_dtypes_and_the_opt_out(monkeypatch):
    model = _tied_llama().to(torch.bfloat16)
    assert fastpath.decode_layout(model) == 0
    assert all(p.is_contiguous() for p in model.parameters())
    monkeypatch.setenv(fastpath.LAYOUT_ENV, "0")
    model = _tied_llama()
    with StreamSession(model, num_sinks=2, window=16, compile=False) as s, torch.no_grad():
        s.step(s.feed(torch.tensor([[1, 2, 3]])).argmax(-1))
        assert model.lm_head.weight.is_contiguous()


def test_a_session_holds_the_decode_layout_from_its_first_step_and_gives_it_back():
    model = _tied_llama()
    weight = model.model.layers[0].mlp.down_proj.weight
    ids = torch.randint(0, 1000, (1, 12), generator=torch.Generator().manual_seed(1))
    nxt = torch.tensor([7])
    with torch.no_grad():
        want = model(torch.cat([ids, nxt[None]], 1)).logits[0, -1]  # nothing evicted: the dense forward
    first = StreamSession(model, num_sinks=2, window=16, compile=False)
    with first as s, torch.no_grad():
        s.feed(ids)
        assert weight.is_contiguous()  # a prefill gains nothing from it: not yet
        got = s.step(nxt)[0]
        assert not weight.is_contiguous()
    assert weight.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    fastpath.decode_layout(model)  # a holder of the user's own outlives the session's
    with StreamSession(model, num_sinks=2, window=16, compile=False) as s, torch.no_grad():
        s.feed(ids)
        s.step(nxt)
        assert not weight.is_contiguous()
    assert not weight.is_contiguous()
    fastpath.restore_layout(model)
    assert weight.is_contiguous()


@pytest.mark.parametrize("dtype, rtol, atol", [(torch.float32, 1e-5, 1e-4), (torch.bfloat16, 2e-2, 1e-1)])
def test_matvec_options_compile_every_one_row_product_to_a_reduction_of_the_same_values(dtype, rtol, atol):
    """A compiled step with :func:`fastpath.matvec_options`: a one-row product by a weight wider than the pass's own
    CPU limit, with and without a bias, is decomposed (inductor's counters) and matches the float64 product of the
    same (rounded) values — in float32 and in bfloat16, the automatic choice's half-precision case."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*shape, generator=gen).to(dtype) for shape in ((1, 48), (3000, 48), (3000,)))
    counters.clear()
    step = fastpath.compiled_step(lambda x: (torch.nn.functional.linear(x, w), torch.nn.functional.linear(x, w, b)),
                                  {"options": fastpath.matvec_options(), "dynamic": False}, freezing=False,
                                  say=lambda _: None)
    with torch.no_grad(), inductor_config.patch(fx_graph_cache=False), \
            functorch_config.patch(enable_autograd_cache=False):  # a cache hit would skip the pass and its counters
        plain, biased = step(x)
    decomposed = counters["inductor"]["decompose_mm"] + counters["inductor"]["decompose_addmm"]
    torch._dynamo.reset()
    assert decomposed == 2
    assert plain.dtype == biased.dtype == dtype
    want = x.double() @ w.double().T
    torch.testing.assert_close(plain.double(), want, rtol=rtol, atol=atol)
    torch.testing.assert_close(biased.double(), want + b.double(), rtol=rtol, atol=atol)


def test_a_sessions_eager_steps_hold_the_decode_layout_and_its_compiled_steps_do_not(monkeypatch):
    """sinklab's own compile (dynamo's eager backend here): the first ``EAGER_STEPS`` steps run eagerly on the
    input-major weights, the compiled ones on the weights as stored; every step's logits are the dense forward's."""
    from sinklab.stream import session as session_module

    torch._dynamo.reset()
    monkeypatch.setattr(fastpath, "EAGER_STEPS", 2)
    monkeypatch.setattr(session_module, "resolve_compile", lambda compile, model: ({"backend": "eager"}, True))
    model = _tied_llama()
    weight = model.model.layers[0].mlp.down_proj.weight
    ids = torch.randint(0, 1000, (1, 10), generator=torch.Generator().manual_seed(2))
    nxt = [5, 9, 11, 3]
    with torch.no_grad():
        want = [model(torch.cat([ids, torch.tensor([nxt[:i + 1]])], 1)).logits[0, -1] for i in range(len(nxt))]
    contiguous, got = [], []
    with StreamSession(model, num_sinks=2, window=24) as s, torch.no_grad():
        s.feed(ids)
        for t in nxt:
            got.append(s.step(torch.tensor([t]))[0])
            contiguous.append(weight.is_contiguous())
        assert not s._step_forward.pending  # the compiled forward ran
    torch._dynamo.reset()
    assert contiguous == [False, False, True, True]
    assert weight.is_contiguous()
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_the_default_choice_does_not_import_inductor():
    """Choosing the default (a session's construction) leaves inductor unimported: its import waits for the compile,
    so a run that decodes eagerly (the first ``EAGER_STEPS``) never pays it before its first token."""
    import subprocess
    import sys

    code = ("import sys; from sinklab import fastpath; fastpath.matvec_options(); "
            "print('torch._inductor.fx_passes.decompose_mem_bound_mm' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "False"
