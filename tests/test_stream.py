"""Streaming (StreamingLLM) against an independent float64 reference, DynamicCache, and known peer bugs."""

from __future__ import annotations

import sys
import warnings

import pytest
import torch
import transformers as tf
from transformers import DynamicCache

import sinklab
from sinklab import rope
from sinklab.errors import InputError, UnsupportedModelError
from sinklab.stream import SinkCache, StreamSession, stream_generate

from stream_reference import Reference
from tiny_models import build

V = 97


def build_llama_yarn():
    cfg = tf.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                          "original_max_position_embeddings": 16})
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(1)
    return tf.LlamaForCausalLM(cfg).eval()


def model_for(name: str):
    return build_llama_yarn() if name == "llama-yarn" else build(name)


def kw(model, cache) -> dict:
    """The cache argument under the name this transformers version uses (``cache`` or ``past_key_values``)."""
    return {sinklab._compat.cache_kwarg_name(model): cache}


def _tokens(n: int, seed: int = 3) -> torch.Tensor:
    return torch.randint(2, V, (n,), generator=torch.Generator().manual_seed(seed))


def _left_padded_pair():
    """Two prompts (9 and 14 tokens) and their left-padded batch ``ids``/``mask`` ``[2, 14]``."""
    a, b = _tokens(9, seed=11), _tokens(14, seed=12)
    ids = torch.zeros(2, 14, dtype=torch.long)
    mask = torch.zeros(2, 14, dtype=torch.long)
    ids[0, 5:], mask[0, 5:] = a, 1
    ids[1], mask[1] = b, 1
    return a, b, ids, mask


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


REFERENCE_CASES = [(arch, s) for arch in ("llama-gqa", "qwen2", "gpt-neox-partial-rotary", "phi3") for s in (0, 1, 4)]
REFERENCE_CASES += [("gemma", 4), ("llama-yarn", 2)]


@pytest.mark.parametrize("arch,num_sinks", REFERENCE_CASES)
def test_matches_float64_reference_past_eviction(arch, num_sinks):
    model = model_for(arch)
    window, steps = 6, 160  # the ring wraps 25 times
    ref = Reference(model, num_sinks, window)
    tokens = _tokens(steps)
    worst = 0.0
    with StreamSession(model, num_sinks=num_sinks, window=window) as s:
        first = s.feed(tokens[None, :13], all_logits=True)[0]  # 13 > S + W: evictions inside the first chunk
        for i in range(13):
            worst = max(worst, _rel(first[i], ref.step(int(tokens[i]))))
        for i in range(13, steps):
            worst = max(worst, _rel(s.step(tokens[i : i + 1])[0], ref.step(int(tokens[i]))))
        assert s.cache_tokens() == num_sinks + window
    assert worst < 1e-4, worst


@pytest.mark.parametrize("arch,num_sinks,pinned", [("llama-gqa", 4, ()), ("gpt-neox-partial-rotary", 2, [(9, 11)])])
def test_decoding_from_the_first_token_matches_float64_reference(arch, num_sinks, pinned):
    """Every token a decode step from the very first one: anchors arrive in decode steps (kept partner dimensions
    must be dropped), slots are still empty (the mask is needed until every slot holds a visible token), then
    evictions and re-bases — against the float64 reference at every step."""
    model = model_for(arch)
    window, steps = 5, 48
    ref = Reference(model, num_sinks, window, pinned)
    tokens = _tokens(steps, seed=21)
    worst = 0.0
    with StreamSession(model, num_sinks=num_sinks, window=window, pinned=pinned, rebase_every=12) as s:
        for i in range(steps):
            worst = max(worst, _rel(s.step(tokens[i : i + 1])[0], ref.step(int(tokens[i]))))
        assert s.state.rebases >= 3 and s.cache_tokens() == num_sinks + window + sum(e - b for b, e in pinned)
    assert worst < 1e-4, worst


def test_pinned_spans_match_reference():
    model = build("llama-gqa")
    pinned = [(8, 11), (30, 32)]
    ref = Reference(model, 2, 5, pinned)
    tokens = _tokens(120, seed=5)
    with StreamSession(model, num_sinks=2, window=5, pinned=pinned, chunk_size=9) as s:
        ours = s.feed(tokens[None], all_logits=True)[0]
        assert s.cache_tokens() == 2 + 5 + 5
    for i in range(120):
        assert _rel(ours[i], ref.step(int(tokens[i]))) < 1e-4


def test_identical_to_dynamic_cache_before_eviction():
    model = build("llama-gqa")
    ids = _tokens(12)[None]
    kwargs = dict(max_new_tokens=12, do_sample=False, output_logits=True, return_dict_in_generate=True,
                  eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        plain = model.generate(ids, **kw(model, DynamicCache(config=model.config)), **kwargs)
        with SinkCache(model, num_sinks=4, window=40) as cache:
            ours = model.generate(ids, **kw(model, cache), **kwargs)
    assert torch.equal(plain.sequences, ours.sequences)
    assert max(float((a - b).abs().max()) for a, b in zip(plain.logits, ours.logits)) < 1e-5


def test_generate_with_prompt_longer_than_window_equals_token_by_token():
    """attention-sinks #22 / transformers #35350 (long prompts) and the Hub sink_cache discussion 2
    (generate() passing absolute query positions while keys are slot-positioned)."""
    model = build("qwen2")
    prompt = _tokens(30)[None]
    kwargs = dict(max_new_tokens=40, do_sample=False, output_logits=True, return_dict_in_generate=True,
                  eos_token_id=None, pad_token_id=0)
    with torch.no_grad(), SinkCache(model, num_sinks=4, window=8) as cache:
        out = model.generate(prompt, **kw(model, cache), **kwargs)
        assert cache.layers[0].keys.shape[2] == 12  # never past the budget, even for a 30-token chunk
    with StreamSession(model, num_sinks=4, window=8, chunk_size=1) as s:
        logits = s.feed(prompt)
        for i, step_logits in enumerate(out.logits):
            assert _rel(step_logits[0], logits[0]) < 1e-5
            logits = s.step(out.sequences[:, 30 + i])
    with torch.no_grad(), SinkCache(model, num_sinks=4, window=8) as cache, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # past_key_values= is deprecated but still accepted
        again = model.generate(prompt, past_key_values=cache, **kwargs)
    assert torch.equal(again.sequences, out.sequences)


def test_chunked_prompt_equals_token_by_token_and_budget_holds():
    model = build("gpt-neox-partial-rotary")
    tokens = _tokens(90)[None]
    with StreamSession(model, num_sinks=3, window=7, chunk_size=25) as s:
        chunked = s.feed(tokens, all_logits=True)
        assert all(layer.keys.shape[2] == 10 for layer in s.cache.layers)
    with StreamSession(model, num_sinks=3, window=7, chunk_size=1) as s:
        single = s.feed(tokens, all_logits=True)
    torch.testing.assert_close(chunked, single, atol=2e-5, rtol=1e-5)


def test_left_padded_batch_equals_each_row_alone():
    model = build("llama-gqa")
    a, b, ids, mask = _left_padded_pair()
    follow = _tokens(30, seed=13).view(15, 2)
    with StreamSession(model, num_sinks=2, window=5, chunk_size=4) as s:
        batch_logits = [s.feed(ids, mask)]
        batch_logits += [s.step(follow[i]) for i in range(15)]
    for row, prompt in enumerate((a, b)):
        with StreamSession(model, num_sinks=2, window=5, chunk_size=4) as s:
            alone = [s.feed(prompt[None])]
            alone += [s.step(follow[i, row : row + 1]) for i in range(15)]
        for x, y in zip(batch_logits, alone):
            assert _rel(x[row], y[0]) < 1e-5


def test_generate_with_a_left_padded_batch_equals_each_row_alone():
    """generate() passes its own position ids and a growing 2-D mask; each row still gets its own sinks."""
    model = build("llama-gqa")
    a, b, ids, mask = _left_padded_pair()
    gen = dict(max_new_tokens=20, do_sample=False, output_logits=True, return_dict_in_generate=True,
               eos_token_id=None, pad_token_id=0)
    with torch.no_grad(), SinkCache(model, num_sinks=2, window=5) as cache:
        out = model.generate(ids, attention_mask=mask, **kw(model, cache), **gen)
    for row, prompt in enumerate((a, b)):
        with torch.no_grad(), SinkCache(model, num_sinks=2, window=5) as cache:
            alone = model.generate(prompt[None], **kw(model, cache), **gen)
        assert torch.equal(out.sequences[row, 14:], alone.sequences[0, len(prompt):])
        assert max(_rel(x[row], y[0]) for x, y in zip(out.logits, alone.logits)) < 1e-5


def test_save_and_resume_equal_an_uninterrupted_stream(tmp_path):
    model = build("phi3")
    tokens = _tokens(80)
    with StreamSession(model, num_sinks=4, window=10, rebase_every=24) as s:
        s.feed(tokens[None, :50])
        path = s.save(tmp_path / "stream.safetensors")
        straight = [s.step(tokens[i : i + 1]) for i in range(50, 80)]
    with StreamSession.load(model, path) as s:
        resumed = [s.step(tokens[i : i + 1]) for i in range(50, 80)]
        assert s.state.columns == 80
    for x, y in zip(straight, resumed):
        torch.testing.assert_close(x, y, atol=0, rtol=0)


def test_a_failed_save_leaves_the_previous_file(tmp_path, monkeypatch):
    """StreamSession.save writes through sinklab's one atomic writer: an error half-way (here: the disk fills after
    the first bytes) leaves the earlier save whole and no temporary file beside it; a file it writes gets the mode
    a plain file gets under the umask."""
    import os

    import sinklab.stream.session as session_module

    model = build("phi3")
    tokens = _tokens(30)
    path = tmp_path / "stream.safetensors"
    with StreamSession(model, num_sinks=4, window=10) as s:
        s.feed(tokens[None, :20])
        s.save(path)
        before = path.read_bytes()
        s.feed(tokens[None, 20:])

        def full_disk(tensors, name, metadata=None):
            with open(name, "wb") as f:
                f.write(b"\0" * 16)
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(session_module, "save_file", full_disk)
        with pytest.raises(OSError, match="No space"):
            s.save(path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stream.safetensors"]
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask


def test_start_position_four_million_stays_float64_accurate():
    model = build("llama-gqa")
    tokens = _tokens(60, seed=7)
    ref = Reference(model, 4, 8)
    worst = 0.0
    with StreamSession(model, num_sinks=4, window=8, start_position=4_000_000, rebase_every=32) as s:
        for i in range(60):
            worst = max(worst, _rel(s.step(tokens[i : i + 1])[0], ref.step(int(tokens[i]))))
        assert int(s.state.base[0]) >= 4_000_000  # positions were re-based, never fed to RoPE at 4e6
    assert worst < 1e-4


def test_rotate_matches_the_models_own_rope():
    cases = {"llama-gqa": False, "gpt-neox-partial-rotary": False}
    for name in cases:
        model = build(name)
        spec = sinklab._compat.layer_rotations(model)[0].cache_rope
        rotary = next(m for m in model.modules() if hasattr(m, "inv_freq"))
        modeling = sys.modules[type(model).__module__]
        x = torch.randn(1, 2, 1, 8, dtype=torch.float64)
        for p, delta in ((3, 5), (100, -40)):
            cos, sin = rotary(x, torch.tensor([[p]]))
            at_p, _ = modeling.apply_rotary_pos_emb(x, x, cos.double(), sin.double())
            cos, sin = rotary(x, torch.tensor([[p + delta]]))
            at_q, _ = modeling.apply_rotary_pos_emb(x, x, cos.double(), sin.double())
            torch.testing.assert_close(rope.rotate(at_p, spec, torch.tensor(delta)), at_q, atol=1e-5, rtol=1e-5)
    # GPT-J: interleaved pairs, partial rotary_dim, its own sinusoid table.
    cfg = tf.GPTJConfig(vocab_size=V, n_embd=32, n_layer=1, n_head=2, rotary_dim=8, n_positions=256)
    gptj = tf.GPTJForCausalLM(cfg)
    spec = sinklab._compat.layer_rotations(gptj)[0].cache_rope
    from transformers.models.gptj import modeling_gptj as mg

    table = mg.create_sinusoidal_positions(256, 8)
    x = torch.randn(1, 4, 2, 16, dtype=torch.float64)  # (B, T, H, dh) as GPT-J rotates

    def at(pos):
        sin, cos = torch.split(table[pos].double()[None, None], 4, dim=-1)
        sin = torch.repeat_interleave(sin, 2, dim=-1)[:, :, None]
        cos = torch.repeat_interleave(cos, 2, dim=-1)[:, :, None]
        rot = x[..., :8] * cos + mg.rotate_every_two(x[..., :8]) * sin
        return torch.cat([rot, x[..., 8:]], dim=-1)

    torch.testing.assert_close(rope.rotate(at(10), spec, torch.tensor(7)), at(17), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotate_pairs_equals_a_complex_rotation(interleaved):
    """The rotation every stream path uses (factors once per step, two ops per tensor; a kept partner; partial
    rotary) against complex numbers in float64."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 5, 10, dtype=torch.float64, generator=g)  # 8 rotated dimensions, 2 passed through
    theta = torch.randn(2, 1, 5, 4, dtype=torch.float64, generator=g) * 50  # one angle per pair, per key
    xr = x[..., :8]
    pairs = (xr[..., 0::2], xr[..., 1::2]) if interleaved else (xr[..., :4], xr[..., 4:])
    z = torch.complex(*pairs) * torch.polar(torch.ones_like(theta), theta)
    rotated = torch.stack([z.real, z.imag], -1).flatten(-2) if interleaved else torch.cat([z.real, z.imag], -1)
    want = torch.cat([rotated, x[..., 8:].expand(2, 3, 5, 2)], -1)
    c, s = rope.pair_factors(theta.cos(), theta.sin(), interleaved)
    torch.testing.assert_close(rope.rotate_pairs(x, c, s, interleaved), want, atol=1e-12, rtol=1e-12)
    kept = rope.pair_partner(xr, interleaved)
    torch.testing.assert_close(rope.rotate_pairs(x, c, s, interleaved, partner=kept), want, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(rope.rotate_with(x, theta.cos(), theta.sin(), interleaved), want, atol=1e-12,
                               rtol=1e-12)


def test_stream_generate_yields_text_and_batches(minilm):
    model = sinklab.models.tiny_llama(num_hidden_layers=2)
    pieces = list(stream_generate(model, minilm.tokenizer, "hello streaming world", num_sinks=2, window=6,
                                  max_new_tokens=12, stop_at_eos=False))
    assert len(pieces) == 12 and all(isinstance(p, str) for p in pieces)
    rows = list(stream_generate(model, minilm.tokenizer, ["a b", "a longer prompt here"], num_sinks=2, window=6,
                                max_new_tokens=5, stop_at_eos=False))
    assert len(rows) == 5 and all(len(r) == 2 for r in rows)
    alone = list(stream_generate(model, minilm.tokenizer, "a b", num_sinks=2, window=6, max_new_tokens=5,
                                 stop_at_eos=False))
    assert [r[0] for r in rows] == alone


def test_errors_are_clear():
    """Every refusal names what was wrong and what to do (messages asserted, not just the exception type)."""
    gpt2 = build("gpt2")
    with pytest.raises(UnsupportedModelError, match="absolute position"):
        SinkCache(gpt2)
    llama = build("llama-gqa")
    with pytest.raises(InputError, match=r"window must be an integer ≥ 1 \(it includes the current token\), got 0"):
        SinkCache(llama, window=0)
    with pytest.raises(InputError, match=r"num_sinks must be an integer ≥ 0, got -1"):
        SinkCache(llama, num_sinks=-1)
    with pytest.raises(InputError, match=r"pinned spans \(3, 9\) and \(5, 12\) overlap"):
        SinkCache(llama, pinned=[(3, 9), (5, 12)])
    with pytest.raises(InputError, match=r"pinned span \(5, 5\) must satisfy 0 ≤ start < end \(half-open\)"):
        SinkCache(llama, pinned=[(5, 5)])
    with pytest.raises(InputError, match="pinned spans are \\(start, end\\) pairs"):
        SinkCache(llama, pinned=[5])
    with pytest.raises(InputError, match="chunk_size must be an integer ≥ 1, got 0"):
        StreamSession(llama, chunk_size=0)
    SinkCache(llama, num_sinks=0, window=3)  # S = 0 (window-only baseline) and S > W are allowed
    SinkCache(llama, num_sinks=8, window=3)
    with StreamSession(llama, window=4) as s:
        with pytest.raises(InputError, match=r"token id 97 is outside the model's vocabulary \(0 … 96\)"):
            s.feed(torch.tensor([[5, 97]]))
        with pytest.raises(InputError, match="input_ids must be \\[batch, tokens\\] with at least one token"):
            s.feed(torch.tensor([5, 6]))
    cache = SinkCache(llama, window=4)
    with torch.no_grad():
        llama(input_ids=torch.tensor([[7, 8]]), **kw(llama, cache))
        cache.close()
        with pytest.raises(InputError, match="this SinkCache was closed; create a new one"):
            llama(input_ids=torch.tensor([[9]]), **kw(llama, cache))
    assert llama.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("kwargs, message", [
    (dict(compile={"backend": "nonsense"}), r"unknown backend 'nonsense'; torch.compile knows .*inductor"),
    (dict(compile={"mode": "nonsense"}), r"unknown mode 'nonsense'; inductor's modes are .*reduce-overhead"),
    (dict(compile={"backend": "eager", "mode": "reduce-overhead"}), r"mode is an inductor setting"),
    (dict(compile={"foo": 1}), r"unknown torch.compile option\(s\) 'foo'; it takes .*backend"),
    (dict(compile={"fullgraph": True}), r"fullgraph=True cannot hold for a stream"),
    (dict(compile={"mode": "default", "options": {"freezing": True}}), r"either mode or options, not both"),
    (dict(compile={"options": {"nonsense_opt": 1}}), r"'nonsense_opt' are not inductor settings"),
    (dict(compile={"options": "x"}), r"options is a dict of inductor settings"),
    (dict(compile={"dynamic": "maybe"}), r"dynamic is True or False"),
    (dict(compile="fast"), r"compile is True, False/None or a dict"),
    (dict(window=True), r"window must be an integer ≥ 1"),
    (dict(num_sinks=True), r"num_sinks must be an integer ≥ 0"),
    (dict(chunk_size="4"), r"chunk_size must be an integer ≥ 1, got '4'"),
    (dict(start_position="0"), r"start_position must be an integer ≥ 0, got '0'"),
    (dict(start_position=2.7), r"start_position must be an integer ≥ 0, got 2.7"),
    (dict(rebase_every=-5), r"^rebase_every must be an integer ≥ 1 \(tokens between re-bases\) or None \(automatic\), got -5$"),
    (dict(rebase_every="x"), r"rebase_every must be an integer ≥ 1"),
    (dict(pinned=5), r"pinned is a list of \(start, end\) pairs .* got 5"),
    (dict(pinned=[(1.5, 4)]), r"pinned spans are \(start, end\) pairs"),
])
def test_session_settings_are_checked_up_front(kwargs, message):
    """Bad settings are one InputError at construction — not a compiler traceback at the first decoded token, and
    never silently taken for something else (True as a window, 2.7 as a start position)."""
    with pytest.raises(InputError, match=message):
        StreamSession(build("llama-gqa"), **kwargs)


def test_compile_options_that_run():
    """What compile= accepts: a dict is torch.compile's options (empty: its defaults), disable=True is eager."""
    from sinklab.stream.session import compile_options

    assert compile_options(None) is None and compile_options(False) is None and compile_options(True) == {}
    assert compile_options({}) == {} and compile_options({"disable": True}) is None
    assert compile_options({"backend": "eager", "dynamic": False}) == {"backend": "eager", "dynamic": False}
    assert compile_options({"mode": "reduce-overhead"}) == {"mode": "reduce-overhead"}
    assert compile_options({"options": {"freezing": True}}) == {"options": {"freezing": True}}
    with pytest.raises(InputError, match="StreamSession takes a loaded model"):
        StreamSession("builtin:tiny-lm")
    with pytest.raises(InputError, match="SinkCache takes a loaded model"):
        SinkCache(None)
    with pytest.raises(InputError, match="window_length must be an integer, got 12.0"):
        SinkCache(build("llama-gqa"), window_length=12.0)


def test_gptj_interleaved_rope_streams_consistently():
    """GPT-J (interleaved, partial rotary): equal to DynamicCache before eviction; chunked == token by token after."""
    cfg = tf.GPTJConfig(vocab_size=V, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=256)
    cfg._attn_implementation = "eager"
    torch.manual_seed(2)
    model = tf.GPTJForCausalLM(cfg).eval()
    if not model._can_set_attn_implementation():  # GPT-J joined the attention interface during 5.x
        pytest.skip(f"GPT-J does not use AttentionInterface in transformers {tf.__version__}")
    tokens = _tokens(60)[None]
    with torch.no_grad():
        dense = model(input_ids=tokens[:, :20]).logits[0]
    with StreamSession(model, num_sinks=2, window=30, chunk_size=7) as s:
        early = s.feed(tokens[:, :20], all_logits=True)[0]
    torch.testing.assert_close(early, dense, atol=2e-5, rtol=1e-5)
    with StreamSession(model, num_sinks=2, window=6, chunk_size=11) as s:
        chunked = s.feed(tokens, all_logits=True)
    with StreamSession(model, num_sinks=2, window=6, chunk_size=1) as s:
        single = s.feed(tokens, all_logits=True)
    torch.testing.assert_close(chunked, single, atol=2e-5, rtol=1e-5)
