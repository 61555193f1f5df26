"""The P0 sink circuit: exact answers on hand-built models, rules on hand-made series, CLI and reports."""

from __future__ import annotations

import json

import pytest
import torch

from sinklab.circuit import CircuitResult, circuit_inputs, classify_stage, measure_rows, sink_location
from sinklab.circuit.analysis import _contributions, _ratio
from sinklab.circuit.hooks import Patch
from sinklab.circuit.inputs import CircuitInputs, id_inputs
from sinklab.errors import UnsupportedModelError

L, D, V = 4, 32, 97
CHANNEL, VALUE, AMP_BLOCK = 5, 400.0, 2


def _llama(seed: int = 3, zero_qk: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=V, hidden_size=D, intermediate_size=64, num_hidden_layers=L, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=128)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    if zero_qk:  # every score 0: uniform causal attention, no preference for the first token
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_proj.weight.zero_()
                layer.self_attn.k_proj.weight.zero_()
    return model


def _add_at_position_0(model, block: int):
    """A forward hook on one block's MLP adding VALUE·e_CHANNEL at each row's first position (right padding)."""
    vec = torch.zeros(D)
    vec[CHANNEL] = VALUE

    def hook(module, args, output):
        out = output.clone()
        out[:, 0] += vec
        return out

    return model.model.layers[block].mlp.register_forward_hook(hook)


def _rows(n: int = 4, length: int = 16, seed: int = 5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V - 1, (n, length), generator=g)
    ids[:, 0] = V - 1  # a "BOS"
    return ids


def _inputs(n: int = 4, length: int = 16) -> CircuitInputs:
    return id_inputs(_rows(n, length), bos_id=V - 1, swap_ids=(3, 4))


@pytest.fixture(scope="module")
def amplified():
    model = _llama()
    handle = _add_at_position_0(model, AMP_BLOCK)
    result = circuit_inputs(model, _inputs(), batch_size=4)
    handle.remove()
    plain = circuit_inputs(model, _inputs(), batch_size=4, causal=False)
    return model, result, plain


def test_amplification_layer_is_the_block_that_adds_the_vector(amplified):
    _, result, plain = amplified
    assert result.amplification_layer == AMP_BLOCK
    assert result.amplification_blocks == [AMP_BLOCK]
    rise = result.ratio[AMP_BLOCK + 1] - result.ratio[AMP_BLOCK]
    assert rise > 20
    # the rise is the MLP's: c_mlp carries it, attention does not
    assert result.contributions["mlp"][AMP_BLOCK] == pytest.approx(rise, rel=0.05)
    assert abs(result.contributions["attn"][AMP_BLOCK]) < 0.05 * rise
    # the massive activation sits on position 0, in the chosen channel, from that block's output on
    after = result.massive[AMP_BLOCK + 1]
    assert after["on_position_0"] == result.num_samples == after["massive_tokens"]
    assert list(after["channels"]) == [CHANNEL] and after["max_position"] == 0
    assert result.massive[AMP_BLOCK]["massive_tokens"] == 0
    # removing the hook removes the effect
    assert plain.amplification_blocks == []
    assert max(plain.ratio) < 2.0
    assert all(m["massive_tokens"] == 0 for m in plain.massive)


def test_contributions_match_hidden_state_differences(amplified):
    """Independent reference: transformers' own output_hidden_states, in float64."""
    model, _, _ = amplified
    ids = _rows()
    with torch.no_grad():
        hs = model(input_ids=ids, output_hidden_states=True).hidden_states  # L+1 entries, last one normed
    rec = measure_rows(model, ids.tolist())
    for layer in range(L - 1):  # hs[L] is after the final norm in transformers; compare the un-normed ones
        diff = (hs[layer + 1][:, 0] - hs[layer][:, 0]).double()
        mine = (rec["attn0"][:, layer] + rec["mlp0"][:, layer]).double()
        torch.testing.assert_close(mine, diff, atol=1e-5, rtol=1e-5)
        norms = hs[layer + 1].double().norm(dim=-1)  # (S, T)
        ref = norms[:, 0] / norms[:, 1:].median(dim=-1).values
        torch.testing.assert_close(_ratio(rec)[:, layer + 1], ref, atol=1e-5, rtol=1e-5)
    parts, err = _contributions(rec)
    total = parts["carry"] + parts["attn"] + parts["mlp"]
    torch.testing.assert_close(total, _ratio(rec)[:, 1:].mean(0), atol=1e-5, rtol=1e-5)
    assert float(err.max()) < 1e-5


def test_donor_with_same_first_token_changes_nothing():
    model = _llama()
    a, b = _rows(4, 16, seed=5), _rows(4, 16, seed=6)  # same first token (BOS), different rest
    base = measure_rows(model, a.tolist())
    donor = measure_rows(model, b.tolist())["x0"][:, 2]  # after block 1
    same = measure_rows(model, a.tolist(), patch=lambda sl: Patch(1, "replace", replacement=donor[sl]))
    torch.testing.assert_close(same["column_mass"], base["column_mass"], atol=1e-6, rtol=1e-5, equal_nan=True)
    torch.testing.assert_close(same["loss_sum"], base["loss_sum"], atol=1e-6, rtol=1e-6)
    b[:, 0] = 7  # now the donor's first token differs: position 0's residual (and so the rest) changes
    other = measure_rows(model, b.tolist())["x0"][:, 2]
    moved = measure_rows(model, a.tolist(), patch=lambda sl: Patch(1, "replace", replacement=other[sl]))
    assert float((moved["loss_sum"] - base["loss_sum"]).abs().max()) > 1e-4
    scaled = measure_rows(model, a.tolist(), patch=lambda sl: Patch(1, "scale", target_ratio=1.0))
    assert _ratio(scaled)[:, 2].tolist() == pytest.approx([1.0] * 4, abs=1e-5)


def test_uniform_attention_has_no_sink():
    model = _llama(zero_qk=True)
    result = circuit_inputs(model, _inputs(4, 32), batch_size=4, causal=False)
    # uniform causal attention gives position 0 a column mass of H_T / T = 0.127 < ε at T = 32
    assert result.uniform_baseline == pytest.approx(sum(1 / (i + 1) for i in range(32)) / 32)
    for name, cond in result.conditions.items():
        assert cond["sink_rate"][0] == [0.0] * L
        t = 31 if name == "bos_removed" else 32
        col = torch.tensor(cond["column_mass_0"])  # (L, H): every head gives position 0 exactly H_T / T
        torch.testing.assert_close(col, torch.full_like(col, sum(1 / (i + 1) for i in range(t)) / t), atol=1e-4, rtol=0)
    assert result.ablation["verdict"] == "no sink"
    assert result.stage["stage"] == "no sink"


def test_left_padding_equals_no_padding():
    model = _llama()
    g = torch.Generator().manual_seed(9)
    lengths = [14, 9, 11]
    rows = [[V - 1] + torch.randint(3, V - 1, (n - 1,), generator=g).tolist() for n in lengths]
    conds = {"as_tokenized": rows, "bos_removed": [r[1:] for r in rows], "first_swapped": [[3] + r[1:] for r in rows]}
    toks = {k: [[str(i) for i in r] for r in v] for k, v in conds.items()}
    inputs = CircuitInputs(conds, toks, {k: k for k in conds}, pad_id=0)
    alone = circuit_inputs(model, inputs, batch_size=1)  # no padding at all
    left = circuit_inputs(model, inputs, batch_size=3, padding_side="left")
    right = circuit_inputs(model, inputs, batch_size=3, padding_side="right")
    for other in (left, right):
        assert other.amplification_layer == alone.amplification_layer
        assert other.ratio == pytest.approx(alone.ratio, rel=1e-4)
        for k in ("attn", "mlp", "carry"):
            assert other.contributions[k] == pytest.approx(alone.contributions[k], rel=1e-3, abs=1e-4)
        for name in conds:
            assert other.conditions[name]["sink_rate"] == alone.conditions[name]["sink_rate"]
            assert other.conditions[name]["loss"] == pytest.approx(alone.conditions[name]["loss"], rel=1e-5)
            torch.testing.assert_close(torch.tensor(other.conditions[name]["column_mass_0"]),
                                       torch.tensor(alone.conditions[name]["column_mass_0"]), rtol=1e-4, atol=1e-5)
        assert other.causal["scale"]["loss"] == pytest.approx(alone.causal["scale"]["loss"], rel=1e-5)


def test_stage_rule_on_hand_made_monitor_series():
    z = [0.0] * 4
    series = [  # (Sink_p per layer for p = 0..3, amplification layer) → stage, location
        ([z, z, z, z], 1, "no sink", "none"),
        ([[0, 0, 50, 75], [0, 0, 0, 25], z, z], 2, "forming in deep layers", "position 0"),
        ([[0, 50, 50, 50], [0, 50, 50, 25], [0, 25, 25, 0], z], 1, "spread over the first positions", "spread"),
        ([[0, 0, 25, 0], [0, 75, 75, 50], z, z], 1, "spread over the first positions", "position 1"),
        ([[25, 100, 100, 100], z, z, z], 0, "settled on position 0", "position 0"),
        ([[25, 100, 100, 100], z, z, z], 3, "forming in deep layers", "position 0"),  # amplified too deep
    ]
    for early, amp, stage, location in series:
        got = classify_stage(early, amp)
        assert (got["stage"], got["location"]) == (stage, location), early
        assert sink_location(early) == location
    assert classify_stage([[0, 0, 10, 24]], 0)["stage"] == "no sink"  # below τ = 25 %


def test_amplification_rules_on_a_twice_amplifying_series():
    from sinklab.circuit.stage import (
        amplification_blocks,
        amplification_layer,
        first_amplification_run,
        stage_amplification,
    )

    ratio = [0.95, 1.2, 3.3, 10.3, 9.4, 1.1, 164.0, 150.0]  # embeddings, then blocks 0..6 (SmolLM2-like)
    assert amplification_layer(ratio) == 5
    assert amplification_blocks(ratio) == [1, 2, 5]
    assert first_amplification_run(ratio) == [1, 2]
    assert stage_amplification(ratio) == 1
    assert stage_amplification([1.0, 1.3, 1.5]) is None  # no block doubles r
    assert amplification_blocks([1.0, 1.9, 3.7]) == []  # rises by ≥ 1 but never doubles
    assert amplification_blocks([0.4, 0.9, 1.0]) == []  # doubles but rises by only 0.5


def test_monitor_logs_the_stage(tmp_path):
    from sinklab.monitor import SinkMonitor

    model = _llama(zero_qk=True)
    monitor = SinkMonitor(model, {"input_ids": _rows(2, 32)}, every=1, path=tmp_path / "m.jsonl")
    record = monitor.step(1, loss=1.0, tokens=64)
    assert record["stage"] == "no sink" and record["sink_location"] == "none"
    assert record["sink_rate_early"][0] == record["sink_rate_0"]
    model2 = _llama()
    handle = _add_at_position_0(model2, 1)
    rec2 = SinkMonitor(model2, {"input_ids": _rows(2, 32)}, every=1).step(1)
    handle.remove()
    assert rec2["amplification_layer"] == 1
    logged = json.loads((tmp_path / "m.jsonl").read_text().splitlines()[0])
    assert logged["stage"] == "no sink"


def test_encoder_is_refused():
    from transformers import BertConfig, BertModel

    bert = BertModel(BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                intermediate_size=64))
    with pytest.raises(UnsupportedModelError, match="encoder"):
        measure_rows(bert, [[1, 2, 3]])


def test_json_round_trip_and_escaped_html(amplified):
    from sinklab.report.circuit_html import render_circuit_html

    _, result, _ = amplified
    data = json.loads(json.dumps(result.to_json()))
    assert data["schema"] == "sinklab.circuit/1"
    back = CircuitResult.from_json(data)
    assert back.amplification_layer == AMP_BLOCK and back.to_json() == data
    back.tokens = [["<script>x</script>", "a&b"]]
    page = render_circuit_html(back, {})
    assert "<script>x" not in page and "&lt;script&gt;x" in page and "a&amp;b" in page


def _bb_run(root, broken: bool = False):
    """A sinklab-train-like run folder: train_config.json, checkpoint-10 (the untrained init) and final."""
    from dataclasses import asdict

    from sinklab.train import TrainConfig, build_model
    from sinklab.checkpoint import save

    cfg = TrainConfig(data="bb", layers=2, width=32, heads=2, seq_len=16, steps=20, bb_vocab=16, bb_triggers=2)
    (root / "train_config.json").write_text(json.dumps(asdict(cfg)))
    model = build_model(cfg, cfg.bb_vocab + 1, cfg.bb_vocab, None, None)
    save(model, root / "checkpoint-10")
    save(model, root / "final")
    if broken:
        (root / "checkpoint-15").mkdir()
        (root / "checkpoint-15" / "model.safetensors").write_bytes(b"not a safetensors file")
    return cfg


def test_sweep_cli_on_a_bb_run(tmp_path):
    from typer.testing import CliRunner

    from sinklab.cli import app

    run = tmp_path / "run"
    run.mkdir()
    _bb_run(run, broken=True)
    out = tmp_path / "sweep"
    res = CliRunner().invoke(app, ["circuit-sweep", str(run), "--samples", "3", "--no-causal", "--out", str(out)])
    assert res.exit_code == 0, res.output
    sweep = json.loads((out / "sweep.json").read_text())
    rows = {r["label"]: r for r in sweep["checkpoints"]}
    assert [r["step"] for r in sweep["checkpoints"]] == [0, 10, 15, 20]
    assert rows["checkpoint-15"]["error"] and "stage" not in rows["checkpoint-15"]
    # the rebuilt initialisation is the exact model saved as checkpoint-10: identical measurements
    assert rows["init"]["sink_rate"] == rows["checkpoint-10"]["sink_rate"]
    assert rows["init"]["ratio"] == rows["checkpoint-10"]["ratio"]
    assert {p.name for p in out.iterdir()} >= {"sweep.json", "report.html", "sweep_amplification.png"}
    res = CliRunner().invoke(app, ["circuit", str(run / "final"), "--samples", "3", "--out", str(tmp_path / "c")])
    assert res.exit_code == 0, res.output
    data = json.loads((tmp_path / "c" / "circuit.json").read_text())
    assert data["meta"]["inputs"] == "bigram-backcopy" and data["tokens"][0][0] == "BOS"
    assert "bos_removed" in data["conditions"] and data["causal"]["layer"] == data["amplification_layer"]
    res = CliRunner().invoke(app, ["circuit", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x")])
    assert res.exit_code == 2 and not (tmp_path / "x").exists()


def test_causal_check_on_the_first_samples_equals_the_check_on_those_samples_alone():
    model = _llama()
    rows = _rows(3)
    handle = _add_at_position_0(model, AMP_BLOCK)
    try:
        part = circuit_inputs(model, id_inputs(rows, bos_id=V - 1, swap_ids=(3, 4)), batch_size=4, causal_samples=2)
        alone = circuit_inputs(model, id_inputs(rows[:2], bos_id=V - 1, swap_ids=(3, 4)), batch_size=4,
                               causal_samples=None)
    finally:
        handle.remove()
    assert part.amplification_layer == alone.amplification_layer == AMP_BLOCK
    assert part.causal["samples"] == alone.causal["samples"] == 2 and part.num_samples == 3
    for kind in ("scale", "donor"):
        for key in ("sink_rate_0", "delta", "ratio"):
            assert part.causal[kind][key] == pytest.approx(alone.causal[kind][key], rel=1e-4, abs=1e-4), (kind, key)
        for key in ("loss", "delta_loss", "downstream_delta"):
            assert part.causal[kind][key] == pytest.approx(alone.causal[kind][key], rel=1e-5, abs=1e-6), (kind, key)
    assert part.causal["scale"]["ratio"][AMP_BLOCK + 1] == pytest.approx(1.0, abs=1e-3)  # the patch did its job …
    assert part.ratio[AMP_BLOCK + 1] > 10  # … on an amplified x₀


def test_other_conditions_on_the_first_samples_equal_those_samples_alone():
    model = _llama()
    rows = _rows(5)
    rows[:, 0] = torch.arange(10, 15)  # a different first token per row: x₀ differs between samples
    inputs = lambda r: id_inputs(r, bos_id=V - 1, swap_ids=(3, 4))  # noqa: E731
    part = circuit_inputs(model, inputs(rows), batch_size=4, condition_samples=2, causal_samples=4)
    alone = circuit_inputs(model, inputs(rows[:2]), batch_size=4, condition_samples=None, causal=False)
    full = circuit_inputs(model, inputs(rows), batch_size=4, condition_samples=None, causal=False)
    ref = part.conditions["as_tokenized"]
    assert ref["samples"] == 5 and ref["sink_rate"] == full.conditions["as_tokenized"]["sink_rate"]
    # every condition's loss is over the same rows: the reference's too, on the first samples only
    assert ref["loss"] == pytest.approx(alone.conditions["as_tokenized"]["loss"], rel=1e-5)
    assert ref["loss"] != pytest.approx(full.conditions["as_tokenized"]["loss"], rel=1e-4)
    for name in ("bos_removed", "first_swapped"):
        got, want = part.conditions[name], alone.conditions[name]
        assert got["samples"] == 2 and got["sink_rate"] == want["sink_rate"]
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
        torch.testing.assert_close(torch.tensor(got["column_mass_0"]), torch.tensor(want["column_mass_0"]),
                                   rtol=1e-4, atol=1e-6)
        # x₀ compared with the reference's x₀ on the same (first) samples
        assert part.cross_condition_cosine[name] == pytest.approx(alone.cross_condition_cosine[name], rel=1e-4)
        assert part.cross_condition_cosine[name] != pytest.approx(full.cross_condition_cosine[name], rel=1e-4)
    assert part.causal["samples"] == 2  # the donor x₀ comes from first_swapped: at most condition_samples
    assert part.meta["condition_samples"] == 2 and part.meta["loss_stride"] == 8


def test_the_loss_scores_every_kth_target_back_from_each_rows_last():
    model = _llama()
    rows = _rows(3, 12)
    with torch.no_grad():
        logits = model(input_ids=rows).logits.double()
    ce = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), rows[:, 1:].flatten(), reduction="none")
    ce = ce.view(3, 11)
    for stride, want in ((4, ce[:, [2, 6, 10]].mean()), (1, ce.mean())):
        res = circuit_inputs(model, id_inputs(rows, bos_id=V - 1, swap_ids=(3, 4)), batch_size=2, causal=False,
                             loss_stride=stride)
        assert res.conditions["as_tokenized"]["loss"] == pytest.approx(float(want), rel=1e-5)
