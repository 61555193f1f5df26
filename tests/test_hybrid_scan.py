"""Hybrid models scanned, and output gates measured.

* A hybrid's recurrent layers (linear attention, state-space, convolution) have no attention map: the capture marks
  them (``layer_kinds``), fills their statistics with NaN, the sink rate counts the attention layers only, and the
  attention layer's map equals the model's own eager ``output_attentions`` in float64. The state a recurrent layer
  keeps per sequence is read off the model's own cache and checked against the sizes its config implies.
* The output gate (Qwen3-Next's ``o_proj(attn · σ(gate))``, sinklab's ``gated`` variant) is recovered per query and
  head and checked against a hand computation from the weights; the per-head gate statistic against a naive loop on
  a two-head toy.

Tiny configs in code, no download.
"""

from __future__ import annotations

import math

import pytest
import torch
import transformers as tf
from torch import nn

import sinklab
from sinklab import metrics
from sinklab.capture import AttentionCapture, CaptureConfig
from sinklab.capture.core import gate_ratio
from sinklab.diagnose import diagnose_inputs
from sinklab.errors import InputError, UnsupportedModelError
from sinklab.scan import scan_inputs

pytestmark = pytest.mark.usefixtures("one_thread")

V = 64


def _qwen3_next(layer_types=("linear_attention", "full_attention", "linear_attention"), dtype=torch.float64):
    config = tf.Qwen3NextConfig(
        vocab_size=V, hidden_size=64, intermediate_size=64, num_hidden_layers=len(layer_types), num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, layer_types=list(layer_types),
        mlp_only_layers=list(range(len(layer_types))), max_position_embeddings=256, pad_token_id=0)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = tf.Qwen3NextForCausalLM(config).eval().to(dtype)
    with torch.no_grad():  # sharper attention and a gate that varies: q/k and the gate half of q_proj scaled up
        for layer in model.model.layers:
            attn = getattr(layer, "self_attn", None)
            if attn is not None:
                attn.q_proj.weight.mul_(4.0)
                attn.k_proj.weight.mul_(4.0)
    return model


def _ids(b=2, t=24, seed=1):
    return torch.randint(1, V, (b, t), generator=torch.Generator().manual_seed(seed))


def _hand_gate(attn: nn.Module, hidden: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """σ of the gate half of Qwen3-Next's q_proj, mean over each head's dimensions: ``[B, H, T]``."""
    q = attn.q_proj(hidden).view(*hidden.shape[:2], heads, 2 * head_dim)
    return torch.sigmoid(q[..., head_dim:]).mean(-1).transpose(1, 2)


def _attention_input(model: nn.Module, layer: int, ids: torch.Tensor) -> torch.Tensor:
    seen = {}
    attn = model.model.layers[layer].self_attn
    handle = attn.register_forward_pre_hook(lambda m, a, k: seen.update(x=k["hidden_states"]), with_kwargs=True)
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    finally:
        handle.remove()
    return seen["x"]


# ----------------------------------------------------------------------------- the gate statistic
def test_gate_statistics_against_a_naive_loop():
    g = torch.Generator().manual_seed(0)
    s, layers, heads, t = 2, 1, 2, 7
    gate = torch.rand(s, layers, heads, t, generator=g, dtype=torch.float64)
    attn = torch.rand(s, layers, heads, t, generator=g, dtype=torch.float64)
    attn[0, 0, 1, 3] = math.nan  # a padding query
    attn[:, :, 0, 2] = 0.9  # head 0: some queries routed to the sink
    out = metrics.gate_statistics(gate, attn, route_threshold=0.5, first_query=1)
    for h in range(heads):
        on, off, share, gated = [], [], [], []
        for si in range(s):
            for i in range(1, t):
                a, gi = float(attn[si, 0, h, i]), float(gate[si, 0, h, i])
                if a != a:
                    continue
                (on if a >= 0.5 else off).append(gi)
                share.append(a)
                gated.append(gi * a)
        mean = lambda xs: sum(xs) / len(xs) if xs else math.nan  # noqa: E731
        for key, want in (("gate_on_sink", mean(on)), ("gate_elsewhere", mean(off)), ("sink_share", mean(share)),
                          ("gated_sink_share", mean(gated))):
            got = float(out[key][0, h])
            assert (math.isnan(want) and math.isnan(got)) or abs(got - want) < 1e-12, (key, h, got, want)


def test_gate_statistics_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="S, L, H, T"):
        metrics.gate_statistics(torch.zeros(1, 1, 2, 3), torch.zeros(1, 1, 2, 4))


def test_gate_ratio_recovers_a_gate_and_refuses_what_is_not_one():
    g = torch.Generator().manual_seed(0)
    returned = torch.randn(2, 5, 3, 8, generator=g, dtype=torch.float64)
    gate = torch.rand(2, 5, 3, 8, generator=g, dtype=torch.float64)
    got = gate_ratio((returned * gate).reshape(2, 5, 24), returned)
    assert torch.allclose(got, gate.float().mean(-1).transpose(1, 2), atol=1e-6)
    assert gate_ratio(returned.reshape(2, 5, 24), returned) is None  # no gate
    assert gate_ratio((returned * 2.0).reshape(2, 5, 24), returned) is None  # a scale, not a gate in [0, 1]
    assert gate_ratio(returned.reshape(2, 5, 24)[..., :12], returned) is None  # another shape


# ----------------------------------------------------------------------------- capture on a hybrid
def test_capture_marks_recurrent_layers_and_matches_the_model_on_the_attention_layer():
    model = _qwen3_next()
    ids = _ids()
    with AttentionCapture(model, CaptureConfig(map_len=24)) as cap:
        batch = cap.run(input_ids=ids)
    assert batch.layer_kinds == ["recurrent", "attention", "recurrent"]
    for layer in (0, 2):
        assert bool(batch.column_mass[:, layer].isnan().all()) and bool((batch.column_queries[:, layer] == 0).all())
        assert bool(batch.gate[:, layer].isnan().all())
    assert bool(torch.isfinite(batch.column_mass[:, 1]).all())
    with torch.no_grad():
        ref = model(input_ids=ids[:1], output_attentions=True, use_cache=False).attentions
    assert len(ref) == 1  # transformers returns the attention layers' weights only
    assert float((batch.attention_maps[1].double() - ref[0][0]).abs().max()) < 1e-6
    # hidden-state statistics exist for every block, recurrent ones included
    assert bool(torch.isfinite(batch.hidden_norm).all())


def test_capture_gate_equals_the_gate_computed_from_the_weights():
    model = _qwen3_next()
    ids = _ids()
    cap = AttentionCapture(model)
    with cap:
        batch = cap.run(input_ids=ids)
    attn = model.model.layers[1].self_attn
    want = _hand_gate(attn, _attention_input(model, 1, ids), 4, 16)
    assert float((batch.gate[:, 1].double() - want).abs().max()) < 1e-6
    with cap:  # entered again: its hooks were removed on exit and are installed anew
        again = cap.run(input_ids=ids)
    assert again.gate is not None and torch.equal(again.gate.nan_to_num(-1), batch.gate.nan_to_num(-1))
    assert float(want.std()) > 0.02  # the gate varies by query and head: the check is not vacuous


def _tiny_llama(layers: int) -> nn.Module:
    config = tf.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                            num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(config).eval()


def test_capture_gate_of_sinklab_gated_variant():
    model = _tiny_llama(2)
    sinklab.apply_variant(model, "gated")
    ids = _ids(t=12)
    with AttentionCapture(model) as cap:
        batch = cap.run(input_ids=ids)
    attn = model.model.layers[1].self_attn
    want = torch.sigmoid(attn.sinklab_gate(_attention_input(model, 1, ids))).view(2, 12, 2, 16).mean(-1).transpose(1, 2)
    assert float((batch.gate[:, 1] - want).abs().max()) < 1e-5


def test_an_ungated_model_has_no_gate():
    model = _tiny_llama(1)
    with AttentionCapture(model) as cap:
        batch = cap.run(input_ids=_ids(t=12))
    assert batch.gate is None and batch.layer_kinds == ["attention"]


# ----------------------------------------------------------------------------- scan, diagnose, recommend
def _scan(model, ids):
    tokens = [[f"t{int(i)}" for i in row] for row in ids]
    return scan_inputs(model, [{"input_ids": ids, "attention_mask": torch.ones_like(ids)}], tokens, map_len=32)


def test_scan_counts_the_attention_layers_and_reports_the_recurrent_state():
    model = _qwen3_next()
    ids = _ids(b=2, t=32)
    result = _scan(model, ids)
    assert result.attention_layers == [1]
    per_layer = result.sink_rate_per_layer(0)
    assert math.isnan(float(per_layer[0])) and math.isnan(float(per_layer[2]))
    assert result.sink_rate(0) == pytest.approx(float(metrics.sink_rate(result.column_mass[:, [1]], 0, 0.3)))
    table = result.per_layer()
    assert table["sink_strength"][0] is None and table["sink_strength"][1] is not None
    assert table["max_activation"][0] is not None  # block-output metrics exist for recurrent layers
    # state per sequence: the causal conv over the [q, k, v] channels in the model's dtype (float64 here) and the
    # delta-rule state per value head, which transformers' reference implementation keeps in float32
    c = model.config
    conv = (2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim)
    want = conv * c.linear_conv_kernel_dim * 8 + c.linear_num_value_heads * c.linear_key_head_dim \
        * c.linear_value_head_dim * 4
    assert result.meta["recurrent_state_bytes"] == {"0": want, "2": want}
    from sinklab.report.figures import strongest_head

    assert strongest_head(result)[0] == 1  # the report's attention map is never a recurrent layer's (NaN) one
    data = result.to_json()
    assert data["layer_kinds"] == ["recurrent", "attention", "recurrent"]
    assert data["gate"]["gate_on_sink"][0] == [None] * 4
    stats = result.gate_statistics()
    attn = result.candidate_attention[..., 0]
    manual = metrics.gate_statistics(result.gate, attn, result.meta["thresholds"]["route_threshold"])
    assert torch.equal(stats["sink_share"].isnan(), manual["sink_share"].isnan())


def test_a_model_without_attention_layers_is_refused():
    config = tf.MambaConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, state_size=4, expand=2, conv_kernel=4)
    model = tf.MambaForCausalLM(config).eval()
    with pytest.raises(UnsupportedModelError, match="no attention layer"):
        _scan(model, _ids(t=8))


def test_diagnose_refuses_to_edit_a_recurrent_layer_and_recommend_reads_the_gate():
    model = _qwen3_next()
    ids = _ids(b=2, t=32)
    tokens = [[f"t{int(i)}" for i in row] for row in ids]
    batches = [{"input_ids": ids, "attention_mask": torch.ones_like(ids)}]
    with pytest.raises(InputError, match="layer 0 is a recurrent layer"):
        diagnose_inputs(model, batches, tokens, edits=[(0, 0)])
    d = diagnose_inputs(model, batches, tokens, edits=False)
    rows = d.per_layer()
    assert [r["kind"] for r in rows] == ["recurrent", "attention", "recurrent"]
    assert rows[0]["sink_pct"] is None and rows[1]["mean_gate_on_sink"] is None or isinstance(
        rows[1]["mean_gate_elsewhere"], float)
    rec = d.recommendation
    assert rec.evidence["layers"] == 1  # the share counts the attention layer's heads only
    assert rec.evidence["output_gate"]["gate_elsewhere"] == pytest.approx(
        float(d.scan.gate_statistics()["gate_elsewhere"][1].nanmean()))
    assert "gated" in rec.evidence["variant_applied"]
