"""Stream features that must do what they say: --pin-prompt, bad token ids, non-finite values, first-chunk
overflow, sampling — each against an independent reference (dense generation, float64 reference, torch by hand)."""

from __future__ import annotations

import pytest
import torch
from stream_reference import Reference
from tiny_models import build
from typer.testing import CliRunner

import sinklab
from sinklab.cli import app
from sinklab.errors import InputError, ModelWeightsError
from sinklab.stream import SinkCache, StreamSession, stream_generate
from sinklab.chat import ChatStream

V = 97


def _tokens(n: int, seed: int = 3) -> torch.Tensor:
    return torch.randint(2, V, (n,), generator=torch.Generator().manual_seed(seed))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


@pytest.fixture(scope="module")
def tiny_lm():
    return sinklab.load_model("builtin:tiny-lm")


def test_cli_pin_prompt_equals_dense_greedy(tiny_lm):
    """A 23-token prompt pinned, 8 new tokens, W = 8: nothing the model needs is evicted → dense greedy output."""
    prompt = "The first rule of the code is that every function returns a value. The second rule of the code is that"
    ids = tiny_lm.tokenizer(prompt, return_tensors="pt")["input_ids"]
    assert ids.shape[1] > 8
    with torch.no_grad():
        dense = tiny_lm.model.generate(ids, do_sample=False, max_new_tokens=8)
    expected = tiny_lm.tokenizer.decode(dense[0, ids.shape[1]:], skip_special_tokens=True)
    runner = CliRunner()
    args = ["stream", "builtin:tiny-lm", "--prompt", prompt, "--sinks", "2", "--window", "8", "--max-new-tokens", "8"]
    pinned = runner.invoke(app, [*args, "--pin-prompt"])
    assert pinned.exit_code == 0, pinned.output
    assert pinned.stdout.strip() == expected.strip()
    plain = "".join(stream_generate(tiny_lm.model, tiny_lm.tokenizer, prompt, num_sinks=2, window=8, max_new_tokens=8))
    assert plain.strip() != expected.strip()  # without the pin the prompt is evicted


def test_pin_prompt_with_an_unpinned_session_is_refused(tiny_lm):
    with StreamSession(tiny_lm.model, num_sinks=2, window=8) as s, pytest.raises(InputError, match="pinned"):
        next(stream_generate(tiny_lm.model, tiny_lm.tokenizer, "hello there", pin_prompt=True, session=s))


def test_token_ids_outside_the_vocabulary_are_input_errors():
    model = build("llama-gqa")
    with StreamSession(model, num_sinks=2, window=4) as s:
        with pytest.raises(InputError, match=f"token id {V} is outside the model's vocabulary"):
            s.feed(torch.tensor([[3, 4, V]]))
        with pytest.raises(InputError, match="token id -1"):
            s.step(torch.tensor([-1]))
    with SinkCache(model, num_sinks=2, window=4) as cache, pytest.raises(InputError, match="vocabulary"):
        model.generate(torch.tensor([[3, 400]]), cache=cache, max_new_tokens=2, pad_token_id=0)


def test_non_finite_values_raise_on_every_stream_path():
    model = build("llama-gqa")
    tokens = _tokens(12)[None]
    with torch.no_grad():
        model.model.layers[1].self_attn.k_proj.weight[0, 0] = float("nan")
    with pytest.raises(ModelWeightsError, match="NaN"):  # the weight check scan runs, before any work
        StreamSession(model, num_sinks=2, window=4)
    with torch.no_grad():
        model.model.layers[1].self_attn.k_proj.weight[0, 0] = 0.0

    def overflow(module, args, output):  # finite weights whose activations overflow: only the run can tell
        hidden = output[0] if isinstance(output, tuple) else output
        hidden[:, -1, 0] = float("inf")

    model.model.layers[0].register_forward_hook(overflow)
    with StreamSession(model, num_sinks=2, window=4, chunk_size=5) as s:
        with pytest.raises(ModelWeightsError, match="NaN or inf"):
            s.feed(tokens)  # chunked prefill (it used to turn NaN into zeros)
    with StreamSession(model, num_sinks=2, window=4) as s:
        with pytest.raises(ModelWeightsError, match="NaN or inf"):
            s.step(tokens[0, :1])  # decode
    with pytest.raises(ModelWeightsError, match="NaN or inf"):  # generate(), no with block
        model.generate(tokens, past_key_values=SinkCache(model, num_sinks=2, window=4), max_new_tokens=2,
                       pad_token_id=0)
    assert model.config._attn_implementation == "sdpa"  # the failed forward released the model


@pytest.mark.parametrize("num_sinks", [0, 3])
def test_first_chunk_overflowing_the_window_matches_reference(num_sinks):
    """The first chunk (16 tokens) is longer than S + W (3 + 5): evictions happen inside the very first forward."""
    model = build("llama-gqa")
    tokens = _tokens(24, seed=21)
    ref = Reference(model, num_sinks, 5)
    with StreamSession(model, num_sinks=num_sinks, window=5, chunk_size=16) as s:
        ours = s.feed(tokens[None], all_logits=True)[0]
        assert s.cache_tokens() == num_sinks + 5
    worst = max(_rel(ours[i], ref.step(int(tokens[i]))) for i in range(24))
    assert worst < 1e-4, worst


def test_sampling_matches_torch_by_hand():
    """temperature + top-k: the same draws as softmax/top-k/multinomial written out on the dense logits."""
    model = sinklab.models.tiny_llama(num_hidden_layers=2, vocab_size=V)

    class Ids:  # a tokenizer that is the identity on ids, so the yielded pieces are the sampled ids
        pad_token_id, eos_token_id = 0, None

        def __call__(self, text):
            return {"input_ids": [int(t) for t in text.split()]}

        def decode(self, ids, **kwargs):
            return "".join(f"{i} " for i in ids)

    prompt = [5, 17, 42, 8, 61]
    got = [int(p) for p in stream_generate(model, Ids(), " ".join(map(str, prompt)), num_sinks=2, window=64,
                                           max_new_tokens=12, temperature=0.7, top_k=5, seed=11)]
    gen, seq = torch.Generator().manual_seed(11), list(prompt)
    for _ in range(12):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([seq])).logits[0, -1].double() / 0.7
        top = torch.topk(logits, 5)
        probs = torch.zeros_like(logits)
        probs[top.indices] = torch.softmax(top.values, -1)
        seq.append(int(torch.multinomial(probs.float()[None], 1, generator=gen)))
    assert got == seq[len(prompt):]
    greedy = [int(p) for p in stream_generate(model, Ids(), "5 17 42", window=64, max_new_tokens=6, temperature=2.0,
                                              top_k=1)]
    argmax = [int(p) for p in stream_generate(model, Ids(), "5 17 42", window=64, max_new_tokens=6)]
    assert greedy == argmax


def test_stream_generate_and_session_misuse_are_input_errors(tiny_lm, tmp_path):
    """stream_generate checks its arguments at the call (not at the first token), refuses settings that contradict
    the session it continues, and save/load/feed name the mistake."""
    model, tok = tiny_lm.model, tiny_lm.tokenizer
    bad = [(dict(temperature=float("nan")), "temperature must be a finite number ≥ 0"),
           (dict(temperature=-1.0), "temperature must be a finite number ≥ 0"),
           (dict(top_k=-3), "top_k must be an integer ≥ 0"), (dict(max_new_tokens=2.5), "max_new_tokens must be"),
           (dict(seed="x"), "seed must be an integer"), (dict(compile={"mode": "nonsense"}), "unknown mode")]
    for kwargs, message in bad:
        with pytest.raises(InputError, match=message):
            stream_generate(model, tok, "hello", **kwargs)  # no iteration needed
    with pytest.raises(InputError, match="prompt is a string or a list of strings"):
        stream_generate(model, tok, 123)
    with pytest.raises(InputError, match="needs the model's tokenizer"):
        stream_generate(model, None, "hello")
    other = build("llama-gqa")
    with StreamSession(model, num_sinks=2, window=8) as s:
        with pytest.raises(InputError, match=r"window=0 differs from the session's window=8"):
            stream_generate(model, tok, "hello", session=s, window=0)
        with pytest.raises(InputError, match="compile and freeze belong to the session"):
            stream_generate(model, tok, "hello", session=s, compile=True)
        with pytest.raises(InputError, match="session was opened on a different model"):
            stream_generate(other, tok, "hello", session=s)
        with pytest.raises(InputError, match="session is an open StreamSession"):
            stream_generate(model, tok, "hello", session="x")
        with pytest.raises(InputError, match="nothing to save yet"):
            s.save(tmp_path / "s.safetensors")
        with pytest.raises(InputError, match="input_ids must be an integer tensor"):
            s.feed([[1, 2, 3]])
        with pytest.raises(InputError, match="input_ids must be an integer tensor"):
            s.feed(torch.ones(1, 3))
        text = "".join(stream_generate(model, tok, "hello", session=s, num_sinks=2, window=8, max_new_tokens=3))
        assert text  # the CLI's way: the session's own settings repeated are fine
        with pytest.raises(InputError, match="is a folder"):
            s.save(tmp_path)
    with pytest.raises(InputError, match="stream session was closed"):
        s.step(torch.tensor([3]))
    never = StreamSession(model, num_sinks=2, window=8)
    with pytest.raises(InputError, match="use the session as a context manager"):
        next(stream_generate(model, tok, "hello", session=never))
    never.sink.close()
    with pytest.raises(InputError, match="no such stream file"):
        StreamSession.load(model, tmp_path / "missing.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file at all")
    with pytest.raises(InputError, match="not a safetensors file written by StreamSession.save"):
        StreamSession.load(model, tmp_path / "junk.safetensors")


def test_a_window_too_large_for_memory_is_an_input_error(tiny_lm, monkeypatch):
    """A window no memory holds (10¹⁵ slots) is refused when the stream is created, in the API, the CLI and the
    chat; a window whose buffers fail to allocate is an InputError that says so, not an allocator traceback."""
    for make in (lambda: StreamSession(tiny_lm.model, num_sinks=4, window=10**15),
                 lambda: ChatStream(tiny_lm.model, tiny_lm.tokenizer, window=10**15)):
        with pytest.raises(InputError, match="more than any memory holds"):
            make()
    r = CliRunner().invoke(app, ["stream", "builtin:tiny-lm", "--prompt", "The rule", "--window", str(10**15),
                                 "--max-new-tokens", "2"])
    assert r.exit_code != 0 and "more than any memory holds" in " ".join(r.output.split()), r.output
    assert "Traceback" not in r.output
    zeros = torch.zeros

    def failing_zeros(*size, **kwargs):  # what the allocator says when a buffer does not fit
        dims = size[0] if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else size
        if any(isinstance(d, int) and d >= 10**6 for d in dims):
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:118] DefaultCPUAllocator: can't allocate memory")
        return zeros(*size, **kwargs)

    monkeypatch.setattr(torch, "zeros", failing_zeros)
    with StreamSession(tiny_lm.model, num_sinks=4, window=2 * 10**6) as s, \
            pytest.raises(InputError, match="do not fit in memory; give a smaller window"):
        s.feed(torch.tensor([[5, 6, 7]]))


@pytest.mark.parametrize("make, message", [
    (lambda: sinklab.stream.state.StreamState(num_sinks=True, window=8), "num_sinks must be an integer ≥ 0, got True"),
    (lambda: sinklab.stream.state.StreamState(num_sinks=4, window=0), "window must be an integer ≥ 1 (it includes"),
    (lambda: sinklab.variants.VariantConfig(registers=True), "registers must be an integer ≥ 0, got True"),
    (lambda: sinklab.kvquant.plan.Protection(first=False), "protect must be an integer ≥ 0, got False"),
    (lambda: SinkCache(build("llama-gqa"), 4, 8, check_every=True), "check_every must be an integer ≥ 1, got True"),
    (lambda: sinklab.kvquant.layer.DynamicQuantizedSinkLayer(group_size=True), "group_size must be an integer ≥ 1, "
                                                                                 "got True"),
    (lambda: sinklab.kvquant.layer.DynamicQuantizedSinkLayer(residual=-1), "residual must be an integer ≥ 0, got -1"),
    (lambda: sinklab.kvquant.layer.DynamicQuantizedSinkLayer(value_group=0), "value_group must be an integer ≥ 1"),
    (lambda: StreamSession(build("llama-gqa"), 4, 8, chunk_size=True), "chunk_size must be an integer ≥ 1, got True"),
    (lambda: sinklab.chat.ChatStream(build("llama-gqa"), None, max_new_tokens=0),
     "max_new_tokens must be an integer ≥ 1, got 0"),
])
def test_sizes_are_checked_one_way_and_booleans_are_not_sizes(make, message):
    import sinklab.kvquant.layer  # noqa: F401
    import sinklab.kvquant.plan  # noqa: F401
    import sinklab.chat  # noqa: F401
    import sinklab.stream.state  # noqa: F401
    import sinklab.variants  # noqa: F401

    with pytest.raises(InputError) as err:
        make()
    assert message in str(err.value)
