"""Hybrid models through a SinkCache: softmax-attention layers keep sinks + a window, the linear-attention /
state-space / convolution layers keep their state in the model's own cache-layer class (transformers'
``LinearAttentionLayer``), never evicted.

The model is a tiny Qwen3-Next (gated DeltaNet linear attention with a causal conv, then gated softmax attention with
partial rotary, then linear attention again; hidden 64). Before eviction the stream must equal the model's own cache.
Past eviction the reference is ``tests/stream_reference.py`` in float64: the model runs token by token with its own
``DynamicCache`` — so its recurrent layers carry their exact state — while every attention layer attends over its
own store of the kept keys (the first ``S`` and the ``W`` most recent) re-rotated at slot positions 0 … n−1 with the
model's own rotary module and ``apply_rotary_pos_emb``. (A plain forward over the kept tokens is *not* a reference
for a hybrid: the recurrent layers have seen every token, so a deeper layer's input depends on all of them; the test
checks that it differs.) LFM2 (short-convolution layers) and Nemotron-H (Mamba-2 layers, MLP/MoE blocks, attention
without positions) are checked past eviction too; Nemotron-H against the model's own cache with the evicted keys
removed (no positions to re-rotate).

Tiny configs in code, no download; float64 where a bound is tight.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import transformers as tf
from stream_reference import Reference, assert_beams_equal_default
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

import sinklab
from sinklab import _compat
from sinklab.errors import InputError, UnsupportedModelError
from sinklab.stream import SinkCache, StreamSession
from sinklab.stream.layer import SinkWindowLayer

pytestmark = pytest.mark.usefixtures("one_thread")

V = 97
S, W = 4, 8
GREEDY = dict(do_sample=False, eos_token_id=None, pad_token_id=0, return_dict_in_generate=True, output_logits=True)
LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention"]


def _qwen3_next(dtype=torch.float32) -> nn.Module:
    config = tf.Qwen3NextConfig(
        vocab_size=V, hidden_size=64, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=32, layer_types=LAYER_TYPES,
        max_position_embeddings=512, pad_token_id=0)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = tf.Qwen3NextForCausalLM(config).eval()
    with torch.no_grad():  # sharper attention, so that evicting a token matters
        for name, p in model.named_parameters():
            if "self_attn.q_proj" in name or "self_attn.k_proj" in name:
                p.mul_(3.0)
    return _to(model, dtype)


def _to(model: nn.Module, dtype) -> nn.Module:
    model = model.to(dtype)
    if dtype == torch.float64:
        model.set_experts_implementation("eager")  # grouped-mm MoE kernels have no float64 path
    return model


@pytest.fixture(scope="module")
def model():
    return _qwen3_next()


@pytest.fixture(scope="module")
def model64():
    return _qwen3_next(torch.float64)


def _tokens(n: int, seed: int = 3) -> torch.Tensor:
    return torch.randint(2, V, (1, n), generator=torch.Generator().manual_seed(seed))


def _rel(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Relative error of each row (last dimension)."""
    return (got.double() - want.double()).norm(dim=-1) / want.double().norm(dim=-1)


@torch.no_grad()
def _stream_logits(model, ids: torch.Tensor, chunk: int, cache: SinkCache) -> torch.Tensor:
    """``[T, V]``: a chunk of ``chunk`` tokens, then one token per forward, through ``cache``."""
    out = [model(input_ids=ids[:, :chunk], cache=cache, use_cache=True).logits[0]]
    for i in range(chunk, ids.shape[1]):
        out.append(model(input_ids=ids[:, i : i + 1], cache=cache, use_cache=True).logits[0])
    return torch.cat(out)


def _cache_bytes(cache) -> int:
    total = 0
    for layer in cache.layers:
        for name in ("keys", "values", "anchor_keys"):
            t = getattr(layer, name, None)
            total += t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0
        for name in ("conv_states", "recurrent_states"):
            total += sum(t.numel() * t.element_size() for t in (getattr(layer, name, None) or {}).values()
                         if isinstance(t, torch.Tensor))
    return total


# ----------------------------------------------------------------------------- what the stream reads off the model
def test_recurrent_layers_are_described_not_refused(model):
    kinds = [r.kind for r in _compat.layer_rotations(model)]
    assert kinds == ["recurrent", "attention", "recurrent"]
    attention = _compat.layer_rotations(model)[1]
    assert attention.cache_rope is not None and attention.cache_rope.inv_freq.numel() == 2  # 25 % of 16 dims rotate
    assert _compat.layer_sliding_windows(model) == [None, None, None]
    with SinkCache(model, num_sinks=S, window=W) as cache:
        own = DynamicCache(config=model.config).layers
        assert [type(x) for x in cache.layers] == [type(own[0]), SinkWindowLayer, type(own[2])]
        assert type(own[0]).__name__ == "LinearAttentionLayer"
        assert cache.recurrent_layers == [0, 2] and cache.layer_states[0] is None


def test_a_layer_the_models_cache_does_not_hold_as_recurrent_is_still_refused(model, monkeypatch):
    """A layer that never calls attention is kept only because the model's own cache holds it as a linear-attention
    layer: with that cache read as holding keys, the old refusal comes back."""
    monkeypatch.setattr(_compat.rotary, "cache_layer_kind", lambda layer: "keys")
    with pytest.raises(UnsupportedModelError, match="layer 0 does not call transformers' attention interface"):
        _compat.layer_rotations(copy.deepcopy(model))


def test_a_recurrent_layer_that_reads_the_position_is_refused(model):
    """The stream gives a recurrent layer every token but no position: a last layer that reads ``position_ids``
    (emulated by a hook on the last, linear-attention block) is caught by the probe, not streamed wrong."""
    twin = copy.deepcopy(model)

    def reads_position(module, args, kwargs, output):
        return output + 1e-1 * kwargs["position_ids"][..., None].to(output.dtype)

    twin.model.layers[-1].register_forward_hook(reads_position, with_kwargs=True)
    with pytest.raises(UnsupportedModelError, match="a recurrent or state-space layer reads the position"):
        _compat.layer_rotations(twin)


def test_layer_types_that_still_cannot_stream_say_what_would_lift_it():
    def fake(**config):
        module = nn.Module()
        module.config = SimpleNamespace(num_hidden_layers=2, sliding_window=None, **config)
        return module

    assert _compat.layer_sliding_windows(fake(layer_types=["conv", "mlp"])) == [None, None]
    with pytest.raises(UnsupportedModelError, match="chunked attention.*per-layer chunk rule"):
        _compat.layer_sliding_windows(fake(layer_types=["linear_attention", "chunked_attention"]))
    with pytest.raises(UnsupportedModelError, match="one cache layer.*lifting it needs one stream layer"):
        _compat.layer_sliding_windows(fake(layer_types=["linear_attention", "hybrid"]))
    config = AutoConfig.for_model("mamba", hidden_size=32, num_hidden_layers=2, state_size=4, vocab_size=V)
    torch.manual_seed(0)
    mamba = AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(UnsupportedModelError, match="no softmax-attention layer.*constant memory"):
        SinkCache(mamba, num_sinks=S, window=W)


# ----------------------------------------------------------------------------- before eviction: the model's own cache
def test_generate_before_eviction_equals_the_default_cache(model):
    ids = _tokens(16)
    with torch.no_grad():
        dense = model.generate(ids, max_new_tokens=8, **GREEDY)
        with SinkCache(model, num_sinks=4, window=64) as cache:
            ours = model.generate(ids, cache=cache, max_new_tokens=8, **GREEDY)
    assert torch.equal(ours.sequences, dense.sequences)
    assert float(_rel(ours.logits[0], dense.logits[0]).max()) <= 1e-5
    assert max(float(_rel(a, b).max()) for a, b in zip(ours.logits, dense.logits)) <= 1e-5


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-6)])
def test_hand_loop_before_eviction_equals_a_plain_forward(model, model64, dtype, tol):
    """A chunk, then token by token (the recurrent layers' single-token path), against one plain forward."""
    m = model64 if dtype == torch.float64 else model
    ids = _tokens(24)
    with SinkCache(m, num_sinks=4, window=64) as cache:
        got = _stream_logits(m, ids, 10, cache)
    with torch.no_grad():
        want = m(input_ids=ids).logits[0]
    assert float(_rel(got, want).max()) <= tol


def test_gated_attention_output_is_the_models_own(model):
    """Qwen3-Next multiplies its attention output by sigmoid(gate), the gate computed from the query projection —
    outside the attention function, so the stream leaves it alone: the output projection's input is the model's own."""
    attn = model.model.layers[1].self_attn
    seen: dict[str, list] = {"gate": [], "o": []}
    handles = [attn.q_proj.register_forward_hook(lambda m, a, out: seen["gate"].append(out)),
               attn.o_proj.register_forward_pre_hook(lambda m, a: seen["o"].append(a[0]))]
    ids = _tokens(20)
    try:
        with torch.no_grad():
            model(input_ids=ids)
            with SinkCache(model, num_sinks=4, window=64) as cache:
                _stream_logits(model, ids, 8, cache)
    finally:
        for h in handles:
            h.remove()
    dense, ours = seen["o"][0][0], torch.cat([x[0] for x in seen["o"][1:]])
    assert float(_rel(ours, dense).max()) <= 1e-5
    heads, dh = model.config.num_attention_heads, model.config.head_dim
    gate = torch.sigmoid(seen["gate"][0].view(1, ids.shape[1], heads, 2 * dh)[..., dh:])
    assert float(gate.std()) > 0.05 and float(gate.min()) < 0.3 and float(gate.max()) > 0.7  # a gate that matters


# ----------------------------------------------------------------------------- past eviction: the float64 reference
@pytest.mark.parametrize("chunk", [10, 24])  # 24 > S + W: the prefill chunk itself evicts
def test_past_eviction_equals_the_float64_reference(model64, chunk):
    ids = _tokens(44)
    ref = Reference(model64, S, W)
    want = torch.stack([ref.step(int(t)) for t in ids[0]])
    with SinkCache(model64, num_sinks=S, window=W) as cache:
        got = _stream_logits(model64, ids, chunk, cache)
    err = _rel(got, want)
    assert ids.shape[1] - (S + W) >= 30  # ≥ 20 steps past the first eviction
    assert float(err.max()) <= 1e-6, f"max relative error {float(err.max()):.1e} at {int(err.argmax())}"
    assert ref.kept(1) == S + W
    # The check is not vacuous: full attention differs, and so does a plain forward over the kept tokens (the
    # reference of a dense model), whose recurrent layers would not have seen the evicted tokens.
    with torch.no_grad():
        dense = model64(input_ids=ids).logits[0]
        kept = torch.cat([ids[:, :S], ids[:, -W:]], 1)
        plain_kept = model64(input_ids=kept).logits[0, -1]
    assert float(_rel(dense, want)[S + W :].max()) > 1e-2
    assert float(_rel(plain_kept, want[-1])) > 1e-3  # 1.0e-2 measured: 10⁴ × the bound above


def test_recurrent_state_is_kept_exactly(model64):
    """The first linear-attention layer sees only the tokens: its state equals the model's own cache after the whole
    text. The last one sits behind the evicting attention: its state equals the reference's."""
    ids = _tokens(40)
    ref = Reference(model64, S, W)
    for t in ids[0]:
        ref.step(int(t))
    own = DynamicCache(config=model64.config)
    with torch.no_grad():
        model64(input_ids=ids, cache=own, use_cache=True)
    with SinkCache(model64, num_sinks=S, window=W) as cache:
        _stream_logits(model64, ids, 10, cache)
        for i, want in ((0, own), (2, ref.cache)):
            for name in ("conv_states", "recurrent_states"):
                got, exp = getattr(cache.layers[i], name)[0], getattr(want.layers[i], name)[0]
                assert float((got - exp).norm() / exp.norm()) <= 1e-6, (i, name)
        assert int(cache.layers[0].get_seq_length()) == ids.shape[1] == cache.get_seq_length()


def test_memory_stays_constant(model):
    """Every tensor the stream holds has a fixed size; the model's own cache grows with the text."""
    ids = _tokens(120)
    sizes = {"stream": [], "own": []}
    for label in sizes:
        cache = SinkCache(model, num_sinks=S, window=W) if label == "stream" else DynamicCache(config=model.config)
        with torch.no_grad():
            for c0 in (0, 16, 68):
                model(input_ids=ids[:, c0 : c0 + (16 if c0 == 0 else 52)], cache=cache, use_cache=True)
                sizes[label].append(_cache_bytes(cache))
        if label == "stream":
            cache.close()
    assert len(set(sizes["stream"])) == 1
    assert sizes["own"][-1] > sizes["own"][0] > sizes["stream"][0]


# ----------------------------------------------------------------------------- generate modes, sessions, the CLI path
def test_left_padded_batch_rows_equal_their_solo_streams(model):
    a, b = _tokens(10, seed=1), _tokens(6, seed=2)
    ids = torch.zeros(2, 10, dtype=torch.long)
    mask = torch.zeros_like(ids)
    ids[0], ids[1, 4:] = a[0], b[0]
    mask[0], mask[1, 4:] = 1, 1

    def run(x, m):
        with SinkCache(model, num_sinks=S, window=W) as cache, torch.no_grad():
            return model.generate(x, attention_mask=m, cache=cache, max_new_tokens=16, **GREEDY)

    both, solo_a, solo_b = run(ids, mask), run(a, torch.ones_like(a)), run(b, torch.ones_like(b))
    assert torch.equal(both.sequences[0], solo_a.sequences[0])
    assert torch.equal(both.sequences[1, 4:], solo_b.sequences[0])
    assert max(float(_rel(x[1], y[0])) for x, y in zip(both.logits, solo_b.logits)) <= 1e-5


def test_beams_and_prompt_lookup_before_eviction_equal_the_default_cache(model, monkeypatch):
    """Beams move the recurrent states with their rows (transformers' own reorder_cache); prompt lookup takes
    rejected tokens back through the recurrent layers' own recorded past (crop)."""
    ids = _tokens(8, seed=1)
    beams = dict(num_beams=2, num_return_sequences=2, max_new_tokens=8, eos_token_id=None, pad_token_id=0,
                 return_dict_in_generate=True, output_scores=True)
    assert_beams_equal_default(model, ids, 4, 64, **beams)

    crops = []
    original = SinkCache.crop
    monkeypatch.setattr(SinkCache, "crop", lambda self, n: (crops.append(n), original(self, n))[1])
    repeated = torch.cat([ids, ids, ids[:, :4]], 1)
    lookup = dict(max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        dense = model.generate(repeated, **lookup)
        with SinkCache(model, num_sinks=4, window=64) as cache:
            ours = model.generate(repeated, cache=cache, prompt_lookup_num_tokens=3, **lookup)
    assert torch.equal(ours, dense)
    assert any(n < 0 for n in crops)  # some drafted tokens were taken back


def test_crop_without_a_recorded_past_is_refused(model):
    with SinkCache(model, num_sinks=4, window=64) as cache, torch.no_grad():
        model(input_ids=_tokens(6), cache=cache, use_cache=True)
        with pytest.raises(InputError, match="recurrent layers of this hybrid model"):
            cache.crop(-1)
        cache.crop(0)  # nothing to take back: fine


def test_session_and_stream_generate_run_a_hybrid(model64, tmp_path):
    """StreamSession (chunked prefill, then greedy steps) gives the reference's greedy tokens past eviction, also when
    saved half-way (recurrent state included) and resumed in a new session; stream_generate — the path of
    `sinklab stream` and `chat` — runs on the same model."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    prompt = _tokens(14, seed=5)
    ref = Reference(model64, S, W)
    for t in prompt[0, :-1]:
        ref.step(int(t))
    want, tok = [], int(prompt[0, -1])
    for _ in range(20):
        tok = int(ref.step(tok).argmax())
        want.append(tok)
    path = tmp_path / "stream.safetensors"
    with StreamSession(model64, num_sinks=S, window=W, chunk_size=6) as session:
        logits = session.feed(prompt)
        got = []
        for i in range(20):
            nxt = logits.argmax(-1)
            got.append(int(nxt))
            if i == 10:
                session.save(path)
                saved_next = nxt
            logits = session.step(nxt)
    assert got == want
    with StreamSession.load(model64, path) as resumed:  # the recurrent layers' conv and delta-rule state came back
        logits, again = resumed.step(saved_next), []
        for _ in range(9):
            nxt = logits.argmax(-1)
            again.append(int(nxt))
            logits = resumed.step(nxt)
    assert again == want[11:]

    vocab = {w: i for i, w in enumerate(["<pad>", "<s>", "</s>", "<unk>"] + [chr(i) for i in range(32, 32 + V - 4)])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer = tf.PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>",
                                           bos_token="<s>", eos_token="</s>")
    pieces = list(sinklab.stream_generate(model64, tokenizer, "the quick brown fox", num_sinks=S, window=W,
                                          max_new_tokens=20, stop_at_eos=False))
    assert len(pieces) == 20 and all(isinstance(p, str) for p in pieces)


# ----------------------------------------------------------------------------- other hybrids, past eviction
_OTHERS = {
    # LFM2: short-convolution layers (a conv state, no recurrent one) around RoPE attention.
    "lfm2": dict(num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"], conv_L_cache=3,
                 block_ff_dim=64, block_auto_adjust_ff_dim=False),
    # Nemotron-H: Mamba-2, an MLP block and a MoE block (nothing cached), attention without positions.
    "nemotron_h": dict(num_hidden_layers=4, layers_block_type=["linear_attention", "mlp", "full_attention", "moe"],
                       mamba_num_heads=4, mamba_head_dim=16, n_groups=1, ssm_state_size=16, expand=1, chunk_size=16,
                       head_dim=16, n_routed_experts=2, num_experts_per_tok=1, moe_intermediate_size=32,
                       moe_shared_expert_intermediate_size=32, n_group=1, topk_group=1),
}


class _EvictedCacheReference:
    """For attention without positions: the model's own ``DynamicCache``, token by token, each attention layer's
    keys and values cut after every step to the first ``S`` and the ``W − 1`` most recent (the next token is the
    window's last). Nothing to re-rotate."""

    def __init__(self, model):
        self.model, self.cache = model, DynamicCache(config=model.config)

    @torch.no_grad()
    def step(self, token: int) -> torch.Tensor:
        out = self.model(input_ids=torch.tensor([[token]]), cache=self.cache, use_cache=True).logits[0, -1]
        for layer in self.cache.layers:
            keys = getattr(layer, "keys", None)
            if isinstance(keys, torch.Tensor) and keys.shape[2] > S + W - 1:
                n = keys.shape[2]
                keep = torch.cat([torch.arange(S), torch.arange(n - W + 1, n)])
                layer.keys, layer.values = layer.keys[:, :, keep], layer.values[:, :, keep]
        return out


@pytest.mark.parametrize("model_type", sorted(_OTHERS))
def test_other_hybrids_past_eviction(model_type):
    config = AutoConfig.for_model(model_type, vocab_size=V, hidden_size=64, intermediate_size=64,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                  pad_token_id=0, bos_token_id=1, eos_token_id=2, **_OTHERS[model_type])
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = _to(AutoModelForCausalLM.from_config(config).eval(), torch.float64)
    rotations = _compat.layer_rotations(model)
    nope = all(r.cache_rope is None for r in rotations)
    assert nope == (model_type == "nemotron_h")
    if model_type == "nemotron_h":
        assert [r.kind for r in rotations] == ["recurrent", "stateless", "attention", "stateless"]
    ids = _tokens(36)
    ref = _EvictedCacheReference(model) if nope else Reference(model, S, W)
    want = torch.stack([ref.step(int(t)) for t in ids[0]])
    with SinkCache(model, num_sinks=S, window=W) as cache:
        got = _stream_logits(model, ids, 10, cache)
    assert float(_rel(got, want).max()) <= 1e-6
    with torch.no_grad():
        dense = model(input_ids=ids).logits[0]
    assert float(_rel(dense, want)[S + W :].max()) > 1e-2
