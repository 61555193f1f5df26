"""The capture on architectures whose blocks, masks or sublayers do not look like Llama's, against the models' own
code: eager ``output_attentions`` weights, the models' own forward (hidden states, final states), or a refusal
that names what the model does and what would lift it.

* BART-family decoders (BigBird-Pegasus' decoder self-attention is causal through its mask only: ``is_causal`` is
  False on the module) — the capture's maps must follow the mask eager attention gets;
* Llama 4 (chunked attention, NoPE layers with a position-dependent query temperature, MoE blocks that return
  ``(tokens·batch, d)`` plus router logits; its head model's ``base_model_prefix`` names no attribute);
* Gemma 3n (AltUp: blocks pass four stacked copies ``[4, B, T, d]`` of the hidden state; layers that reuse an
  earlier layer's keys and values through ``shared_kv_states``).
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
import transformers as tf

from sinklab import _compat
from sinklab.capture import AttentionCapture, CaptureConfig, StackedEdits, ValueEdit
from sinklab.circuit import circuit_inputs
from sinklab.circuit.inputs import id_inputs
from sinklab.diagnose import diagnose_inputs
from sinklab.errors import UnsupportedModelError

pytestmark = pytest.mark.usefixtures("one_thread")

V, T = 97, 16


def _ids(batch: int = 2, length: int = T, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, V - 1, (batch, length), generator=torch.Generator().manual_seed(seed))


def _masks(batch: int = 2, length: int = T) -> dict[str, torch.Tensor]:
    """No padding (the causal mask SDPA would skip), and sample 0 right-padded (a mask that must be built)."""
    padded = torch.ones(batch, length, dtype=torch.long)
    padded[0, length - 5 :] = 0
    return {"unpadded": torch.ones(batch, length, dtype=torch.long), "padded": padded}


def _eager_weights(model, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The model's own eager attention weights of sample 0 (``output_attentions``), each ``[H, T, T]``."""
    twin = copy.deepcopy(model)
    twin.set_attn_implementation("eager")
    with torch.no_grad():
        out = twin(input_ids=ids[:1], attention_mask=mask[:1], output_attentions=True)
    return tuple(w[0] for w in out.attentions)


def _assert_maps_match_eager(model, ids: torch.Tensor, mask: torch.Tensor, atol: float = 1e-5) -> None:
    """Sample 0's captured maps against eager ``output_attentions`` on every layer, over its real tokens."""
    with AttentionCapture(model, CaptureConfig(map_len=ids.shape[1])) as cap:
        maps = cap.run(input_ids=ids, attention_mask=mask).attention_maps  # (L, H, T, T)
    ref = _eager_weights(model, ids, mask)
    n = int(mask[0].sum())
    assert len(ref) == maps.shape[0]
    for layer, w in enumerate(ref):
        torch.testing.assert_close(maps[layer, :, :n, :n].double(), w[:, :n, :n].double(), atol=atol, rtol=0,
                                   msg=lambda m, layer=layer: f"layer {layer}: {m}")


# ============================================================================= BART-family decoders: causality
_BART = dict(vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
             decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=128,
             pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1, dropout=0.0,
             attention_dropout=0.0, activation_dropout=0.0)
BART_FAMILY = {
    "bigbird_pegasus": ("BigBirdPegasusConfig", "BigBirdPegasusForCausalLM"),
    "bart": ("BartConfig", "BartForCausalLM"),
    "mbart": ("MBartConfig", "MBartForCausalLM"),
    "marian": ("MarianConfig", "MarianForCausalLM"),
    "pegasus": ("PegasusConfig", "PegasusForCausalLM"),
    "plbart": ("PLBartConfig", "PLBartForCausalLM"),
    "blenderbot": ("BlenderbotConfig", "BlenderbotForCausalLM"),
    "blenderbot-small": ("BlenderbotSmallConfig", "BlenderbotSmallForCausalLM"),
}


def _bart_family(name: str):
    cfg_name, cls_name = BART_FAMILY[name]
    config = getattr(tf, cfg_name)(**_BART)
    config._attn_implementation = "eager"  # BigBird-Pegasus has no SDPA path; the capture replaces it anyway
    torch.manual_seed(0)
    model = getattr(tf, cls_name)(config).eval()
    with torch.no_grad():  # sharper attention: a map that ignored the mask would be far from eager's
        for pname, p in model.named_parameters():
            if pname.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(4.0)
    return model


@pytest.mark.parametrize("padding", ["unpadded", "padded"])
@pytest.mark.parametrize("name", list(BART_FAMILY))
def test_bart_family_decoder_maps_follow_the_mask_eager_attention_gets(name, padding):
    """BigBird-Pegasus' decoder self-attention has ``is_causal=False`` and is causal only through its mask; SDPA's
    mask function drops a causal mask without padding, so a capture trusting the flag let every query see every
    key (0.97 off). The capture now always gets the mask eager attention gets."""
    model = _bart_family(name)
    if name == "bigbird_pegasus":
        assert model.model.decoder.layers[0].self_attn.is_causal is False  # the case this test is about
    _assert_maps_match_eager(model, _ids(), _masks()[padding])


def test_the_capture_mask_is_never_the_skipped_causal_one():
    """``_compat.explicit_mask`` builds the causal mask SDPA's own mask function would skip (None)."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    kwargs = dict(batch_size=2, q_length=5, kv_length=5, mask_function=causal_mask_function,
                  attention_mask=torch.ones(2, 5, dtype=torch.bool), allow_is_causal_skip=True)
    assert sdpa_mask(**kwargs) is None
    mask = _compat.explicit_mask(**kwargs)
    assert mask.dtype == torch.bool and torch.equal(mask[0, 0], torch.ones(5, 5, dtype=torch.bool).tril())


# ============================================================================= Llama 4
def _llama4():
    config = tf.Llama4TextConfig(vocab_size=V, hidden_size=32, intermediate_size=64, intermediate_size_mlp=64,
                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                 num_local_experts=4, num_experts_per_tok=1, moe_layers=[0, 1], no_rope_layers=[1, 0],
                                 attention_chunk_size=6, layer_types=["chunked_attention", "full_attention"],
                                 max_position_embeddings=128, attn_temperature_tuning=True, floor_scale=4,
                                 attn_scale=0.5, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return tf.Llama4ForCausalLM(config).eval()


@pytest.fixture(scope="module")
def llama4():
    return _llama4()


@pytest.mark.parametrize("padding", ["unpadded", "padded"])
def test_llama4_maps_match_eager(llama4, padding):
    """Chunked layers (a token sees its own chunk of 6) and the NoPE layer whose queries are scaled by a
    position-dependent temperature (floor_scale 4: it changes within 16 tokens)."""
    _assert_maps_match_eager(llama4, _ids(), _masks()[padding])


def test_llama4_base_model_is_the_decoder_stack(llama4):
    """``Llama4ForCausalLM.base_model_prefix`` is ``language_model`` but its stack is ``.model``: transformers'
    ``base_model`` is the head model itself (logits, no ``last_hidden_state``), so diagnose's resumed passes had
    no final states to compare with."""
    assert llama4.base_model is llama4
    assert _compat.base_model(llama4) is llama4.model


def test_llama4_resumed_passes_equal_its_own_forward(llama4):
    """Every resumed pass (from each block, one copy or stacked copies) gives the final states of the model's own
    forward; a value edit changes them, identically when stacked."""
    ids, mask = _ids(), _masks()["padded"]
    with torch.no_grad():
        own = llama4.model(input_ids=ids, attention_mask=mask).last_hidden_state
    rows = mask.bool()
    with AttentionCapture(llama4, CaptureConfig(map_len=0)) as cap:
        cap.run(input_ids=ids, attention_mask=mask, keep_inputs=True)
        kept = cap.last_inputs
        assert kept.resumable
        torch.testing.assert_close(kept.final[rows], own[rows], atol=1e-5, rtol=1e-5)
        for start in range(2):
            torch.testing.assert_close(cap.final_states(kept, start)[rows], own[rows], atol=1e-5, rtol=1e-5)
            stacked = cap.final_states(kept, start, copies=2)
            torch.testing.assert_close(stacked[:2][rows], own[rows], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(stacked[2:][rows], own[rows], atol=1e-5, rtol=1e-5)
        cap.edit = ValueEdit(1, 0, torch.tensor([0, 0]), "zero")
        edited = cap.final_states(kept, 1)
        full = cap.forward(input_ids=ids, attention_mask=mask).last_hidden_state
        cap.edit = StackedEdits([ValueEdit(1, 0, torch.tensor([0, 0]), "zero"),
                                 ValueEdit(1, 0, torch.tensor([0, 0]), "remove_column")])
        both = cap.final_states(kept, 1, copies=2)
        cap.edit = None
    torch.testing.assert_close(edited[rows], full[rows], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(both[:2][rows], edited[rows], atol=1e-5, rtol=1e-5)
    assert float((edited - own)[rows].abs().max()) > 1e-4


def test_llama4_diagnose_runs_its_causal_edits(llama4):
    ids = _ids(2, 32)
    d = diagnose_inputs(llama4, [{"input_ids": ids, "attention_mask": torch.ones_like(ids)}], [["t"] * 32] * 2,
                        edits=[(0, 0), (1, 2)], edit_samples=1)
    data = json.loads(json.dumps(d.to_json()))
    assert len(d.edits) == 2
    assert all(math.isfinite(v) for e in d.edits for v in e.hidden.values())
    assert data["edits"]


def test_llama4_circuit_splits_the_residual_stream_exactly(llama4):
    """The MoE block returns ``([tokens·batch, d], router logits)``: read as ``[B, T, d]``, position 0's MLP output
    makes ``x₀ after = x₀ before + attention + MLP`` hold (it crashed before), and the contributions add up to the
    next norm ratio."""
    rows = _ids(4, T, seed=5)
    rows[:, 0] = V - 1
    result = circuit_inputs(llama4, id_inputs(rows, bos_id=V - 1, swap_ids=(3, 4)), batch_size=4, causal=False)
    assert max(result.residual_error) < 1e-4
    parts = torch.tensor([result.contributions[k] for k in ("carry", "attn", "mlp")], dtype=torch.float64).sum(0)
    torch.testing.assert_close(parts, torch.tensor(result.ratio[1:], dtype=torch.float64), atol=1e-3, rtol=1e-3)


# ============================================================================= Gemma 3n
def _gemma3n(shared: int = 2):
    config = tf.Gemma3nTextConfig(
        vocab_size=V, vocab_size_per_layer_input=V, hidden_size=32, hidden_size_per_layer_input=8, intermediate_size=64,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
        sliding_window=6, layer_types=["sliding_attention", "full_attention"] * 2, num_kv_shared_layers=shared,
        laurel_rank=4, activation_sparsity_pattern=[0.0] * 4, altup_num_inputs=4, pad_token_id=0, bos_token_id=1,
        eos_token_id=2)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = tf.Gemma3nForCausalLM(config).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(4.0)
    return model


@pytest.fixture(scope="module")
def gemma3n():
    model = _gemma3n()
    assert model.config.kv_sharing_modes == ["store", "store", "reuse", "reuse"]  # layers 2, 3 reuse 0's and 1's
    return model


@pytest.mark.parametrize("padding", ["unpadded", "padded"])
def test_gemma3n_maps_match_eager_on_shared_kv_layers(gemma3n, padding):
    """Layers 2 and 3 attend with the keys and values layers 0 and 1 stored (``shared_kv_states``)."""
    _assert_maps_match_eager(gemma3n, _ids(), _masks()[padding])


def test_gemma3n_hidden_statistics_read_the_main_altup_copy(gemma3n):
    """Blocks pass ``[4, B, T, d]``; the statistics are of copy ``altup_active_idx`` (the copy attention and MLP
    read and update), against plain forward hooks on the model's own blocks."""
    ids, mask = _ids(), _masks()["padded"]
    main = gemma3n.config.altup_active_idx
    seen = {}
    layers = gemma3n.model.layers
    handles = [layers[0].register_forward_pre_hook(lambda m, a: seen.__setitem__(0, a[0][main].norm(dim=-1)))]
    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_hook(
            lambda m, a, out, i=i: seen.__setitem__(i + 1, out[main].norm(dim=-1))))
    with torch.no_grad():
        gemma3n.model(input_ids=ids, attention_mask=mask)
    for h in handles:
        h.remove()
    assert seen[1].shape == (2, T)
    with AttentionCapture(gemma3n, CaptureConfig(map_len=0)) as cap:
        norms = cap.run(input_ids=ids, attention_mask=mask).hidden_norm  # (B, L+1, T)
    rows = mask.bool()
    for index in range(len(layers) + 1):
        torch.testing.assert_close(norms[:, index][rows], seen[index][rows], atol=1e-4, rtol=1e-5)
        assert bool(norms[:, index][~rows].isnan().all())


def _own_final_states(model):
    """The padded batch, the model's own final hidden states of it, its real-token rows and their largest |value|."""
    ids, mask = _ids(), _masks()["padded"]
    with torch.no_grad():
        own = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
    rows = mask.bool()
    return ids, mask, own, rows, float(own[rows].abs().max())


def test_gemma3n_edited_passes_run_the_whole_model(gemma3n):
    """AltUp's stacked copies and the KV a later layer reuses make a rerun from a block's recorded input wrong, so
    no pass resumes: every pass, to any block, is the model's own forward under the edit."""
    ids, mask, own, rows, scale = _own_final_states(gemma3n)
    with AttentionCapture(gemma3n, CaptureConfig(map_len=0)) as cap:
        cap.run(input_ids=ids, attention_mask=mask, keep_inputs=True)
        kept = cap.last_inputs
        assert not kept.resumable
        assert _compat.resume_blocker(gemma3n, kept.calls) is not None
        for start in range(4):
            torch.testing.assert_close(cap.final_states(kept, start)[rows], own[rows], atol=1e-5 * scale, rtol=0)
            stacked = cap.final_states(kept, start, copies=2)
            torch.testing.assert_close(stacked[2:][rows], own[rows], atol=1e-5 * scale, rtol=0)
        record = StackedEdits([ValueEdit(2, 0, torch.tensor([0, 0]), "record"),
                               ValueEdit(2, 0, torch.tensor([1, 1]), "record")])
        cap.edit = record
        block = cap.final_states(kept, 2, 3, copies=2)  # the output of block 2 (main copy), two copies
        cap.edit = ValueEdit(2, 0, torch.tensor([0, 0]), "zero")  # a shared-KV layer's value
        edited = cap.final_states(kept, 2)
        cap.edit = None
    assert block.shape == (4, T, 32)
    assert record.edits[0].recorded.shape[0] == 2 and bool(torch.isfinite(record.edits[0].recorded).all())
    assert float((edited - own)[rows].abs().max()) > 1e-4 * scale


def test_gemma3n_diagnose_runs_its_causal_edits(gemma3n):
    ids = _ids(2, 32)
    d = diagnose_inputs(gemma3n, [{"input_ids": ids, "attention_mask": torch.ones_like(ids)}], [["t"] * 32] * 2,
                        edits=[(1, 0), (3, 1)], edit_samples=1)
    json.dumps(d.to_json())
    assert len(d.edits) == 2
    assert all(math.isfinite(v) for e in d.edits for v in e.hidden.values())


def test_gemma3n_circuit_is_refused_naming_altup(gemma3n):
    rows = _ids(4, T, seed=5)
    rows[:, 0] = V - 1
    with pytest.raises(UnsupportedModelError) as info:
        circuit_inputs(gemma3n, id_inputs(rows, bos_id=V - 1, swap_ids=(3, 4)), batch_size=4)
    message = str(info.value)
    assert "Gemma3nForCausalLM" in message and "AltUp" in message and "4 stacked copies" in message
    assert "lifting this needs" in message


# ============================================================================= shared KV without AltUp (Gemma 4)
def test_shared_kv_layers_make_passes_run_the_whole_model():
    """Gemma 4 without AltUp: layers 2, 3 reuse the keys and values layers 0, 1 stored in ``shared_kv_states``.
    A rerun from a block's recorded input would read whatever the last pass stored there (an edited pass, or a batch
    of another size: it crashed on stacked copies), so edited passes run the whole model: each equals the model's
    own forward, and an edit before the storing layer does not leak into a later pass."""
    config = tf.Gemma4TextConfig(
        vocab_size=V, vocab_size_per_layer_input=V, hidden_size=32, hidden_size_per_layer_input=8, intermediate_size=64,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8, global_head_dim=8,
        max_position_embeddings=128, sliding_window=6, layer_types=["sliding_attention", "full_attention"] * 2,
        num_kv_shared_layers=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = tf.Gemma4ForCausalLM(config).eval()
    assert _compat.stacked_streams(model) is None and config.kv_sharing_modes == ["store", "store", "reuse", "reuse"]
    ids, mask, own, rows, scale = _own_final_states(model)
    with AttentionCapture(model, CaptureConfig(map_len=0)) as cap:
        cap.run(input_ids=ids, attention_mask=mask, keep_inputs=True)
        kept = cap.last_inputs
        assert not kept.resumable and "shared_kv_states" in _compat.resume_blocker(model, kept.calls)
        for start in range(4):
            cap.edit = ValueEdit(start, 0, torch.tensor([0, 0]), "zero")  # an edited pass first …
            cap.final_states(kept, start)
            cap.edit = None  # … then unedited ones, from the next block, one copy and two
            after = min(start + 1, 3)
            torch.testing.assert_close(cap.final_states(kept, after)[rows], own[rows], atol=1e-5 * scale, rtol=0)
            stacked = cap.final_states(kept, after, copies=2)
            torch.testing.assert_close(stacked[2:][rows], own[rows], atol=1e-5 * scale, rtol=0)
