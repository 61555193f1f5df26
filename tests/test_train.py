"""Training with a sink monitor, the Bigram-Backcopy task, checkpoints, and bad input."""

from __future__ import annotations

import json

import pytest
import torch
import transformers as tf

import sinklab
from sinklab import metrics
from sinklab.errors import InputError
from sinklab.monitor import SinkMonitor, read_records
from sinklab.report.monitor_figures import write_emergence
from sinklab.synth.bigram_backcopy import BigramBackcopy
from sinklab.train import TrainConfig, train

pytestmark = pytest.mark.usefixtures("one_thread")


def test_bigram_backcopy_data_follows_its_rules():
    task = BigramBackcopy(vocab=16, triggers=3, seq_len=40, seed=1)
    x = task.sample(64, torch.Generator().manual_seed(0))
    assert bool((x[:, 0] == task.bos).all()) and bool((x[:, 1:] < task.vocab).all())
    for t in range(2, 39):
        trig = task.is_trigger(x[:, t])
        assert bool((x[trig, t + 1] == x[trig, t - 1]).all())  # after a trigger: copy the token before it
    assert torch.allclose(task.transition.sum(-1), torch.ones(16))
    share = float(task.is_trigger(x[:, 1:]).double().mean())
    assert 0.15 < share < 0.6  # the triggers are the most popular tokens
    # Away from the copy rule, the tokens follow the chain: empirical bigram frequencies vs the transition rows.
    big = task.sample(4000, torch.Generator().manual_seed(2))
    free = ~task.is_trigger(big[:, 1:-1])  # positions whose successor is drawn from the chain
    prev, nxt = big[:, 1:-1][free], big[:, 2:][free]
    counts = torch.zeros(16, 16, dtype=torch.float64).index_put_((prev, nxt), torch.ones(prev.numel(), dtype=torch.float64),
                                                                 accumulate=True)
    rows = counts.sum(-1) > 2000
    empirical = counts[rows] / counts[rows].sum(-1, keepdim=True)
    assert int(rows.sum()) >= 5
    torch.testing.assert_close(empirical, task.transition[rows].double(), atol=0.03, rtol=0)
    first = torch.bincount(big[:, 1], minlength=16).double() / big.shape[0]
    torch.testing.assert_close(first, task.popularity.double(), atol=0.03, rtol=0)


def test_monitor_attention_to_position_zero_matches_eager():
    cfg = tf.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=64)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 50, (3, 12), generator=torch.Generator().manual_seed(1))
    monitor = SinkMonitor(model, {"input_ids": ids}, every=5)
    assert monitor.step(3, loss=1.0, tokens=10) is None  # off schedule
    rec = monitor.step(5, loss=1.0, tokens=10)
    with torch.no_grad():
        attn = torch.stack(model(input_ids=ids, output_attentions=True).attentions, 1).double()  # (B, L, H, T, T)
    mass0 = metrics.column_mass(attn, metrics.visibility(12, 12))[..., 0].mean(0)  # (L, H)
    torch.testing.assert_close(torch.tensor(rec["attention_to_0"], dtype=torch.float64), mass0, atol=1e-5, rtol=0)
    rate = (metrics.column_mass(attn, metrics.visibility(12, 12))[..., 0] > 0.3).double().mean(2).mean(0) * 100
    torch.testing.assert_close(torch.tensor(rec["sink_rate_0"], dtype=torch.float64), rate)
    assert model.config._attn_implementation == "eager"


def test_train_text_run_checkpoints_and_reloads(tmp_path):
    cfg = TrainConfig(data="pydoc", layers=2, width=32, heads=2, seq_len=16, batch=4, steps=12, lr=3e-3,
                      vocab_size=400, max_chars=30_000, monitor_every=5, checkpoint_every=6, variant="sink-logit")
    summary = train(cfg, tmp_path / "run")
    run = tmp_path / "run"
    records = [json.loads(line) for line in (run / "monitor.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [5, 10, 12]
    assert len(records[-1]["sink_rate_0"]) == 2 and records[-1]["tokens"] == 12 * 4 * 16
    assert (run / "checkpoint-6").is_dir() and not (run / "emergence.png").exists()  # train() renders nothing
    assert read_records(run / "monitor.jsonl") == records
    write_emergence(records, run / "emergence.png")  # what `sinklab train` does after the run
    assert (run / "emergence.png").stat().st_size > 1000
    model = sinklab.load(run / "final")
    assert model.config.sinklab_variant["sink_logit"] is True
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(run / "final"))
    ids = tok("Return the value of the attribute.", return_tensors="pt")["input_ids"]
    assert int(ids[0, 0]) == tok.bos_token_id
    assert summary["final_loss"] < 7.0  # down from ln(400) ≈ 6.0 + noise within 12 steps: a sanity bound only
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=ids).logits).all()


@pytest.mark.long
def test_bigram_backcopy_forms_a_bos_sink_quickly(tmp_path):
    # Measured at this reduced size (width 32, seq 32, batch 32, 400 steps, lr 6e-3): non-trigger queries give
    # BOS 0.990 of their attention, trigger queries 0.000 and 0.991 to the previous token; BOS value ratio 0.33.
    # (At width 64, lr 3e-3 it takes 500 steps: 0.997 / 0.000 / 0.994, ratio 0.26; at 300 steps the attention
    # pattern is there but the BOS value has not shrunk yet.)
    cfg = TrainConfig(data="bb", layers=1, heads=1, width=32, seq_len=32, batch=32, steps=400, lr=6e-3,
                      weight_decay=0.0, warmup=30, monitor_every=200)
    bb = train(cfg, tmp_path / "bb")["bb"]
    assert bb["bos_attention_non_trigger"] > 0.8
    assert bb["bos_attention_trigger"] < 0.1 and bb["copy_attention_trigger"] > 0.5
    assert bb["bos_value_norm_ratio_out"] < 0.5


def test_bad_training_input(tmp_path):
    with pytest.raises(InputError, match="multiple"):
        TrainConfig(width=30, heads=4)
    with pytest.raises(InputError):
        TrainConfig(steps=0)
    short = tmp_path / "short.txt"
    short.write_text("tiny text")
    with pytest.raises(InputError, match="fewer than one sequence"):
        train(TrainConfig(data=str(short), seq_len=64, vocab_size=300, steps=1), tmp_path / "x")
    with pytest.raises(InputError, match="neither"):
        train(TrainConfig(data=str(tmp_path / "missing.txt"), steps=1), tmp_path / "y")
    with pytest.raises(InputError, match="unknown variant"):
        train(TrainConfig(data="bb", variant="sinky", steps=1, layers=1, heads=1, width=16), tmp_path / "z")


def _eager_mass0(model, ids):
    """Independent reference: column mass at position 0 from transformers' own eager attention weights, (L, H)."""
    model.set_attn_implementation("eager")
    with torch.no_grad():
        attn = torch.stack(model(input_ids=ids, output_attentions=True).attentions, 1).double()  # (B, L, H, T, T)
    mass = metrics.column_mass(attn, metrics.visibility(ids.shape[1], ids.shape[1]))[..., 0]  # (B, L, H)
    return mass.mean(0), (mass > 0.3).double().mean(2).mean(0) * 100  # (L, H), (L,)


def test_monitor_during_training_matches_an_eager_forward_of_the_saved_checkpoint(tmp_path):
    cfg = TrainConfig(data="bb", layers=2, heads=2, width=16, seq_len=12, batch=4, steps=4, monitor_every=2, lr=1e-2)
    train(cfg, tmp_path / "run")
    records = [json.loads(line) for line in (tmp_path / "run" / "monitor.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4] and records[-1]["tokens"] == 4 * 4 * 12
    loaded = sinklab.load_model(str(tmp_path / "run" / "final"))  # by path, as scan would
    probe = BigramBackcopy(vocab=cfg.bb_vocab, triggers=cfg.bb_triggers, seq_len=12, seed=0).sample(
        8, torch.Generator().manual_seed(cfg.seed + 99))  # the probe train() gives the monitor
    mass0, rate = _eager_mass0(loaded.model, probe)
    torch.testing.assert_close(torch.tensor(records[-1]["attention_to_0"], dtype=torch.float64), mass0, atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.tensor(records[-1]["sink_rate_0"], dtype=torch.float64), rate)
    assert records[0]["attention_to_0"] != records[-1]["attention_to_0"]  # the weights moved between records


def test_monitor_callback_follows_the_trainer_state():
    from transformers import TrainerControl, TrainerState

    from sinklab.monitor import SinkMonitorCallback

    cfg = tf.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=64)
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 50, (3, 10), generator=torch.Generator().manual_seed(1))
    monitor = SinkMonitor(model, {"input_ids": ids}, every=4)
    callback = SinkMonitorCallback(monitor)
    control = TrainerControl()
    state = TrainerState(global_step=3, log_history=[{"loss": 2.5, "step": 3}], num_input_tokens_seen=90)
    assert callback.on_step_end(None, state, control) is control and monitor.records == []  # off schedule
    state.global_step, state.num_input_tokens_seen = 4, 120
    state.log_history.append({"loss": 2.25, "step": 4})
    callback.on_step_end(None, state, control)
    (rec,) = monitor.records
    assert (rec["step"], rec["loss"], rec["tokens"]) == (4, 2.25, 120)
    mass0, rate = _eager_mass0(model, ids)
    torch.testing.assert_close(torch.tensor(rec["attention_to_0"], dtype=torch.float64), mass0, atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.tensor(rec["sink_rate_0"], dtype=torch.float64), rate)


def test_qwen3_next_pair_differs_by_the_output_gate_alone(tmp_path):
    """``arch="qwen3-next"``: transformers' own Qwen3-Next; ``output_gate=False`` keeps the gate half of every q_proj
    at 0 through training (σ = ½ everywhere), while the gated twin learns a gate that varies by query."""
    common = dict(data="bb", arch="qwen3-next", layers=1, heads=2, width=32, seq_len=16, batch=8, steps=20, lr=1e-2,
                  warmup=2, monitor_every=20)
    runs = {}
    for gate in (True, False):
        train(TrainConfig(**common, output_gate=gate), tmp_path / str(gate))
        model = sinklab.load_model(str(tmp_path / str(gate) / "final")).model
        assert isinstance(model, tf.Qwen3NextForCausalLM)
        runs[gate] = model.model.layers[0].self_attn.q_proj.weight.view(2, 2, 16, 32)  # heads, (query, gate), dh, d
    assert float(runs[False][:, 1].abs().max()) == 0.0  # held shut through 20 AdamW steps with weight decay
    assert float(runs[False][:, 0].abs().max()) > 0.0 and float(runs[True][:, 1].abs().max()) > 0.0
    ids = torch.randint(0, 64, (2, 12))
    with sinklab.AttentionCapture(model) as cap:  # the ungated twin: a constant ½ gate, seen as such by the capture
        gate = cap.run(input_ids=ids).gate
    assert torch.allclose(gate, torch.full_like(gate, 0.5), atol=1e-6)
    with pytest.raises(InputError, match="needs arch='qwen3-next'"):
        TrainConfig(output_gate=False)
    with pytest.raises(InputError, match="arch 'gpt' is not one of"):
        TrainConfig(arch="gpt")
    with pytest.raises(InputError, match="variants apply to arch='llama'"):
        TrainConfig(arch="qwen3-next", variant="gated")
