"""diagnose(): value edits vs an independent attention, MiniLM measured classes, synthetic tasks, bad input."""

from __future__ import annotations

import json
import math

import pytest
import torch
from typer.testing import CliRunner

import sinklab.report
from sinklab import metrics
from sinklab.capture import ValueEdit
from sinklab.cli import app
from sinklab.diagnose import DEFAULT_RULES, ROLES, diagnose, diagnose_inputs, token_roles
from sinklab.edits import EDITS, run_edit
from sinklab.errors import InputError
from sinklab.synth import BroadcastTask, NopTask, run_broadcast, run_nop

from test_scan import minilm_reference, reference_records  # noqa: F401 - the float64 MiniLM reference (a fixture)
from tiny_models import build, inputs_for


def _reference_edit(model, inputs, layer, head, positions, mode, replacement=None):
    """Final hidden states with the edit applied by the separately written float64 attention of
    tests/test_diagnose_reference.py (one reference for every edit test)."""
    from test_diagnose_reference import _edited_final

    rows = dict(enumerate(positions.tolist()))
    if mode == "remove_column":
        return _edited_final(model, inputs, layer, head, {}, removed=rows).float()
    changes = {b: (p, None if mode == "zero" else replacement[b]) for b, p in rows.items()}
    return _edited_final(model, inputs, layer, head, changes).float()


@pytest.mark.parametrize("mode", ["zero", "replace", "remove_column"])
def test_value_edits_match_an_independent_attention(mode):
    model = build("llama-gqa")
    inputs = inputs_for("llama-gqa")
    positions = torch.tensor([0, 3])
    replacement = torch.randn(2, 8) * 3 if mode == "replace" else None
    edit = ValueEdit(1, 3, positions, mode, replacement=replacement)
    got, _ = run_edit(model, inputs, edit)
    ref = _reference_edit(model, inputs, 1, 3, positions, mode, replacement)
    unedited, _ = run_edit(model, inputs, None)
    keep = inputs["attention_mask"].bool()
    torch.testing.assert_close(got[keep], ref[keep], atol=1e-5, rtol=1e-4)
    assert (got[keep] - unedited[keep]).abs().max() > 1e-3  # the edit really changed something


def test_record_edit_returns_the_head_value_vectors():
    model = build("llama-gqa")
    inputs = inputs_for("llama-gqa")
    rec = ValueEdit(0, 3, torch.tensor([2, 5]), "record")
    run_edit(model, inputs, rec)
    layer = model.model.layers[0]
    with torch.no_grad():
        v = layer.self_attn.v_proj(layer.input_layernorm(model.model.embed_tokens(inputs["input_ids"])))
    v = v.view(2, 12, 2, 8)  # (B, T, Hkv, dh); head 3 uses KV head 1 under GQA
    torch.testing.assert_close(rec.recorded, torch.stack([v[0, 2, 1], v[1, 5, 1]]), atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError):
        ValueEdit(0, 0, torch.tensor([0]), "explode")


def test_classify_sink_and_relative_rms_closed_forms():
    r = torch.tensor([0.05, 0.2, 0.3, 0.6, 0.6, float("nan")])
    s = torch.tensor([3.0, 1.0, 1.0, 1.2, 2.0, 1.0])
    kinds = [metrics.SINK_KINDS[int(c)] for c in metrics.classify_sink(r, s)]
    assert kinds == ["nop", "nop", "unclassified", "broadcast", "unclassified", "unclassified"]
    with pytest.raises(ValueError):
        metrics.classify_sink(r, s, nop_max_ratio=0.7)
    base = torch.ones(2, 3, 4)
    assert metrics.relative_rms(base * 1.1, base) == pytest.approx(0.1)
    mask = torch.tensor([[True, False, False], [False, False, False]])
    edited = base.clone()
    edited[0, 1] += 5.0  # outside the mask: ignored
    assert metrics.relative_rms(edited, base, mask) == 0.0


def test_token_roles():
    special = {"bos": None, "cls": "[CLS]", "sep": "[SEP]", "eos": None}
    assert token_roles(["[CLS]", "the", ".", "##,", "[SEP]"], special) == ["cls", "other", "punct", "punct", "sep"]
    assert token_roles(["<s>", "Hello"], {"bos": "<s>", "eos": "</s>"}) == ["bos", "other"]
    assert token_roles(["Hello", "world"], {}) == ["first", "other"]
    assert token_roles(["[CLS]", "reg0", "reg3", "patch0"], {}) == ["cls", "register", "register", "patch"]
    assert set(ROLES) >= {"bos", "cls", "sep", "first", "register", "punct", "patch", "other"}


@pytest.fixture(scope="module")
def minilm_diagnosis(minilm):
    return diagnose(minilm.model, minilm.tokenizer, seq_len=64, samples=16, source="builtin:minilm")


def test_minilm_cls_sinks_are_nop_and_edits_confirm_it(minilm_diagnosis, minilm_reference, minilm):  # noqa: F811 - fixture
    """Every record, class, per-layer count and the causal edits against minilm_reference (transformers' eager BERT
    attention and the weights, float64; tests/test_scan.py) and a float64 edited forward (test_diagnose_reference)."""
    d, ref = minilm_diagnosis, minilm_reference
    dom = ref["mass"].nan_to_num(-1.0).argmax(-1)  # (S, L, H): every key is seen by all 64 queries
    kind = reference_records(ref, DEFAULT_RULES["sink_mass"])
    got = {(r.sample, r.layer, r.head): (r.kind, r.token_index, r.value_norm_ratio_out, r.stable_rank) for r in d.records}
    assert got.keys() == kind.keys()
    for key, (k, pos, r, sr) in kind.items():
        assert got[key][:2] == (k, pos), key
        assert got[key][2] == pytest.approx(r, rel=1e-4) and got[key][3] == pytest.approx(sr, rel=1e-4), key
    layers = d.per_layer()
    for row in layers:
        mine = [v for key, v in kind.items() if key[1] == row["layer"]]
        assert row["sink_pct"] == pytest.approx(100 * len(mine) / (16 * 12))
        assert row["counts"] == {c: sum(v[0] == c for v in mine) for c in ("unclassified", "nop", "broadcast")}
        if mine:  # the median r_out of the layer's sinks: between the two middle reference values
            vals = sorted(v[2] for v in mine)
            assert vals[(len(vals) - 1) // 2] * (1 - 1e-4) <= row["median_value_ratio_out"] <= vals[len(vals) // 2] * (1 + 1e-4)
    assert {r.role for r in d.records if r.token_index == 0} == {"cls"}
    # The finding, on the reference: layers 1–4 sink on [CLS], NOP; layer 0 does not sink.
    assert layers[0]["sink_pct"] == 0 and all(layers[n]["top_token"] == "[CLS]" for n in (1, 2, 3, 4))
    assert all(v[0] == "nop" for key, v in kind.items() if key[1] in (1, 2, 3, 4) and v[1] == 0)
    # Causal edits (first 4 samples, the most-sinking head of each edited layer): zero and ordinary recomputed by a
    # separately written float64 attention on the real model; the NOP signature holds on those references.
    from test_diagnose_reference import _edited_final

    inputs = {"input_ids": ref["windows"].input_ids[:4], "attention_mask": ref["windows"].attention_mask[:4]}
    base = _edited_final(minilm.model, inputs, 0, 0, {})
    assert d.edits and set(d.edits[0].hidden) == set(EDITS)
    for e in d.edits:
        positions = dom[:4, e.layer, e.head].tolist()
        assert e.positions == positions
        v = ref["values"][:, e.layer, e.head]  # (S, T, dh)
        ordinary = []
        for b, p in enumerate(positions):
            others = [j for j in range(64) if j != p]
            ordinary.append(others[int(v[b, others].norm(dim=-1).argsort()[len(others) // 2])])
        want = {}
        for name, changes in (("zero", {b: (p, None) for b, p in enumerate(positions)}),
                              ("ordinary", {b: (p, v[b, ordinary[b]]) for b, p in enumerate(positions)})):
            edited = _edited_final(minilm.model, inputs, e.layer, e.head, changes)
            want[name] = float((edited - base).pow(2).sum().sqrt() / base.pow(2).sum().sqrt())
            assert e.hidden[name] == pytest.approx(want[name], rel=2e-3, abs=2e-5), (e.layer, name)
        if e.layer in (1, 2, 3, 4):
            assert e.kind == "nop" and want["zero"] < 0.5 * want["ordinary"]  # recommend's NOP edit signature


def test_minilm_layer3_head11_broadcasts_from_the_final_period(minilm):
    from test_diagnose_reference import _edited_final
    from test_scan import bert_reference

    from sinklab.texts import tokenize_windows

    texts = ["The cat sat on the mat.", "Attention sinks soak up attention in many heads.",
             "A small model can still show the effect clearly.", "We measure every head in every layer of the encoder."]
    d = diagnose(minilm.model, minilm.tokenizer, texts, samples=4, edits=[(3, 11)])
    windows = tokenize_windows(minilm.tokenizer, texts, 64, 4)
    assert [w[: len(t)] for w, t in zip(windows.tokens, d.scan.tokens, strict=True)] == d.scan.tokens
    ref = bert_reference(minilm.model, windows.input_ids, windows.attention_mask)
    kind = reference_records(ref)  # every sink of every head, classified from the float64 reference
    got = {(r.sample, r.layer, r.head): (r.kind, r.token_index, r.value_norm_ratio_out, r.stable_rank) for r in d.records}
    assert got.keys() == kind.keys()
    for key, (k, pos, r, sr) in kind.items():
        assert got[key][:2] == (k, pos) and got[key][2:] == pytest.approx((r, sr), rel=1e-4), key
    # The finding, on the reference: head 11 of layer 3 sinks on the final "." of at least two samples, broadcast.
    mine = {key[0]: v for key, v in kind.items() if key[1:] == (3, 11)}
    assert len(mine) >= 2 and all(v[0] == "broadcast" and d.scan.tokens[s][v[1]] == "." for s, v in mine.items())
    assert {r.role for r in d.records if (r.layer, r.head) == (3, 11)} == {"punct"}
    # The edit on (3, 11): zeroing the sink value and the control (a random other real token, the generator seeded
    # with the diagnosis seed 0 as documented), recomputed with a float64 attention on the real model.
    edit = d.edits[0]
    dom = ref["mass"].nan_to_num(-1.0).argmax(-1)[:, 3, 11].tolist()
    assert edit.positions == dom
    gen = torch.Generator().manual_seed(0)
    real = [[j for j in range(ref["mask"].shape[1]) if ref["mask"][b, j]] for b in range(4)]
    others = [[j for j in real[b] if j != dom[b]] for b in range(4)]
    control = [others[b][int(torch.randint(len(others[b]), (1,), generator=gen))] for b in range(4)]
    inputs = {"input_ids": windows.input_ids, "attention_mask": windows.attention_mask}
    base = _edited_final(minilm.model, inputs, 0, 0, {})
    keep = ref["mask"][..., None].expand(base.shape)
    for name, positions in (("zero", dom), ("control", control)):
        edited = _edited_final(minilm.model, inputs, 3, 11, {b: (p, None) for b, p in enumerate(positions)})
        want = float(((edited - base)[keep] ** 2).sum().sqrt() / (base[keep] ** 2).sum().sqrt())
        assert edit.hidden[name] == pytest.approx(want, rel=2e-3, abs=2e-5), name
    plain = diagnose(minilm.model, minilm.tokenizer, ["attention sinks soak up attention in many heads"],
                     samples=1, edits=False)
    assert [r.token for r in plain.records if (r.layer, r.head) == (3, 11)] == ["[SEP]"]


def test_uniform_attention_gives_an_honest_no_sinks_result(tmp_path):
    model = build("bert")
    with torch.no_grad():
        for layer in model.encoder.layer:
            layer.attention.self.query.weight.zero_()
            layer.attention.self.query.bias.zero_()
    d = diagnose_inputs(model, [inputs_for("bert", pad=False)], [["t"] * 12] * 2)
    assert not d.found and d.records == [] and d.edits == []
    torch.testing.assert_close(d.scan.column_mass, torch.full_like(d.scan.column_mass, 1 / 12))
    sinklab.report.save(d, tmp_path / "none")
    data = json.loads((tmp_path / "none" / "diagnosis.json").read_text())
    assert data["found"] is False and "no sinks found" in data["message"]


def test_bad_rules_are_rejected(minilm):
    for rules in ({"sink_mass": 1.5}, {"rule": "vibes"}, {"nop_max_ratio": 0.8}, {"broadcast_max_srank": 0.5},
                  {"colour": 1}):
        with pytest.raises(InputError):
            diagnose(minilm.model, minilm.tokenizer, ["hello world"], rules=rules)


def test_vision_diagnosis_reports_register_roles():
    model = build("dinov2-registers")
    labels = ["[CLS]"] + [f"reg{i}" for i in range(4)] + [f"patch{i}" for i in range(16)]
    d = diagnose_inputs(model, [{"pixel_values": torch.randn(2, 3, 16, 16)}], [labels, labels],
                        rules={"sink_mass": 0.05}, edits=False)
    assert d.found
    for r in d.records:
        expected = "cls" if r.token_index == 0 else "register" if r.token_index <= 4 else "patch"
        assert r.role == expected
    assert sum(sum(row["roles"].values()) for row in d.per_layer()) == len(d.records)


@pytest.mark.long
@pytest.mark.usefixtures("one_thread")  # a tiny training run
def test_synthetic_nop_task_forms_a_nop_sink():
    task = NopTask(d=32, n=16)
    r = run_nop(task, steps=400, batch=128, eval_samples=32)
    m = r.metrics
    # Reference, float64 from the trained weights (one pre-LN head: O = h + W_O·A·V, SCIENCE §2): the same 32
    # evaluation samples (generator seed + 1), the attention of every query to the BOS slot, the output-space value
    # norm ratio of BOS and the relative RMS change of the damped rows when BOS's value is zeroed.
    x, _, _ = task.sample(32, torch.Generator().manual_seed(1))
    active = task.active(x)
    model = r.model
    block = model.layers[0]
    assert model.config.num_hidden_layers == 1 and block.attn.num_heads == 1 and block.mlp is None
    with torch.no_grad():
        h = torch.cat([model.bos.expand(32, 1, -1), x], dim=1).double()
        z = torch.nn.functional.layer_norm(h + model.pos.double(), (32,), block.ln1.weight.double(), block.ln1.bias.double(),
                                           block.ln1.eps)
        q = z @ block.attn.q_proj.weight.double().T + block.attn.q_proj.bias.double()
        k = z @ block.attn.k_proj.weight.double().T + block.attn.k_proj.bias.double()
        u = z @ block.attn.v_proj.weight.double().T @ block.attn.o_proj.weight.double().T  # W_O v_j, (S, 1 + N, d)
    a = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(32), dim=-1)  # (S, 1 + N, 1 + N)
    out = h + a @ u
    to_bos = a[:, 1:, 0]
    norms = u.norm(dim=-1)
    ratio = float((norms[:, 0] / norms[:, 1:].mean(-1)).mean())
    change = a[:, 1:, :1] * u[:, :1]  # zeroing v_BOS removes A_i0 · W_O v_0 from every row
    damped = ~active
    zero_rms = float(change[damped].pow(2).sum().sqrt() / out[:, 1:][damped].pow(2).sum().sqrt())
    assert m["attention_to_bos_damped"] == pytest.approx(float(to_bos[damped].mean()), rel=1e-5)
    assert m["attention_to_bos_active"] == pytest.approx(float(to_bos[active].mean()), rel=1e-5)
    assert m["bos_value_norm_ratio_out"] == pytest.approx(ratio, rel=1e-4)
    assert m["edit_zero_rms_damped"] == pytest.approx(zero_rms, rel=1e-3, abs=1e-6)
    # The task's NOP sink (SCIENCE §2 check values 0.993 vs 0.012, r_out ≈ 0.008), on the reference numbers: damped
    # queries park on BOS, active ones do not, BOS's value is small next to the others' — NOP by the rule (≤ 0.2).
    assert float(to_bos[damped].mean()) > 0.9 and float(to_bos[active].mean()) < 0.1
    assert ratio <= 0.2 and m["bos_kind"] == "nop"
    assert zero_rms < 0.1 and m["edit_ordinary_rms_damped"] > 5 * zero_rms


@pytest.mark.long
@pytest.mark.usefixtures("one_thread")  # a tiny training run
def test_synthetic_broadcast_task_forms_a_broadcast_hub():
    """Each bound is the definition it checks, not a value from a run: the hub's heads are sinks (their attention
    mass on it above the rule's ``sink_mass``) and mostly broadcast by the rules' own thresholds (value-norm ratio ≥
    ``broadcast_min_ratio``, a rank-one update: stable rank ≤ ``broadcast_max_srank``); the hub is most heads'
    dominant column; swapping in a donor's hub value moves the output to the donor's target."""
    from sinklab.diagnose import DEFAULT_RULES as R

    r = run_broadcast(BroadcastTask(d=32, n=16), steps=300, batch=128, eval_samples=32)  # formed by 300 steps
    m = r.metrics
    assert m["hub_kind"] == "broadcast" and m["broadcast_pct"] > 50
    assert m["hub_value_norm_ratio_out"] >= R["broadcast_min_ratio"] and m["hub_stable_rank"] <= R["broadcast_max_srank"]
    assert m["inflow_to_hub"] > R["sink_mass"] and m["dominant_is_hub_pct"] > 50
    # The donor's payload transfers: the edited output is closer to the donor's target than to its own.
    assert m["donor_swap_mse_to_donor_target"] < m["donor_swap_mse_to_own_target"]


def test_cli_diagnose_and_synth(tmp_path):
    runner = CliRunner()
    res = runner.invoke(app, ["diagnose", "builtin:minilm", "--samples", "2", "--seq-len", "16", "--no-edits",
                              "--out", str(tmp_path / "d")])
    assert res.exit_code == 0, res.output
    data = json.loads((tmp_path / "d" / "diagnosis.json").read_text())
    assert data["schema"] == "sinklab.diagnose/2" and data["rules"]["nop_max_ratio"] == 0.2
    assert (tmp_path / "d" / "diagnostic_scatter.png").exists()
    res = runner.invoke(app, ["diagnose", "builtin:minilm", "--sink-mass", "2", "--out", str(tmp_path / "bad")])
    assert res.exit_code == 2 and not (tmp_path / "bad").exists()
    res = runner.invoke(app, ["synth", "nop", "--steps", "50", "--dim", "16", "--tokens", "8",
                              "--out", str(tmp_path / "s")])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "s" / "synth.json").read_text())["task"] == "nop"
    assert runner.invoke(app, ["synth", "nope"]).exit_code == 2


# ----------------------------------------------------------------------------- decision boundaries
# Each rule of diagnose.DEFAULT_RULES (and a non-default value of it) tested on both sides: synthetic scans whose
# statistic sits DELTA below / at / above the threshold, expected verdicts written from the definitions
# (SCIENCE §1–2): sink when column mass > sink_mass, min_i A_is ≥ 1 − eps_event, routed share ≥ relaxed_share;
# NOP when r_out ≤ nop_max_ratio; broadcast when r_out ≥ broadcast_min_ratio and srank ≤ broadcast_max_srank.
DELTA = 1e-6  # far above float32 resolution near these thresholds (~3e-8), far below any gap between them


def _synthetic_scan(cases: list[dict], t: int = 16):
    """One sample per case, one layer, one head; position 0 is the dominant column, the other columns hold 0.01.

    A case sets ``mass`` (column mass at 0), ``low`` (column minimum), ``routed`` (routed share), ``r_out`` /
    ``r_head`` (value norm at 0, the others' norms are 1, so these are the ratios) and ``srank`` (update spectrum
    σ = (1, √(srank − 1)), whose stable rank Σσ²/σ₁² is srank)."""
    from sinklab.scan import ScanResult, check_thresholds

    s = len(cases)
    f64 = dict(dtype=torch.float64)

    def column(key, default, rest):
        x = torch.full((s, 1, 1, t), rest, **f64)
        x[:, 0, 0, 0] = torch.tensor([c.get(key, default) for c in cases], **f64)
        return x

    spectrum = torch.zeros(s, 1, 1, 2, **f64)
    spectrum[..., 0] = 1.0
    spectrum[:, 0, 0, 1] = torch.tensor([math.sqrt(c.get("srank", 1.2) - 1.0) for c in cases], **f64)
    zeros = torch.zeros(s, 1, 1, t, **f64)
    return ScanResult(
        column_mass=column("mass", 0.5, 0.01), column_min=column("low", 0.0, 0.0),
        routed_fraction=column("routed", 0.0, 0.0), candidate_attention=zeros[..., None], value_norm=column("r_head", 1.0, 1.0),
        value_norm_out=column("r_out", 1.0, 1.0), update_norm=zeros, update_spectrum=spectrum,
        common_mode=torch.zeros(s, 1, 1, **f64), learned_sink_mass=torch.zeros(s, 1, 1, **f64),
        column_queries=torch.full((s, 1, t), float(t), **f64), hidden_norm=torch.ones(s, 2, t, **f64),
        hidden_max_abs=torch.ones(s, 2, t, **f64), hidden_max_dim=torch.zeros(s, 2, t, dtype=torch.long),
        hidden_median_abs=torch.ones(s, 2, **f64), token_mask=torch.ones(s, t, dtype=torch.bool), attention_maps=None,
        qk_spectrum=torch.tensor([[[2.0, 1.0]]], **f64), output_space=[True], tokens=[["<s>"] + ["w"] * (t - 1)] * s,
        candidates=(0,), meta={"thresholds": check_thresholds({})},
    )


def _verdicts(cases, rules):
    """Per case: None (no sink) or the class diagnose gives the sink at position 0."""
    from sinklab.diagnose import _check_rules, sink_records

    records = {r.sample: r for r in sink_records(_synthetic_scan(cases), _check_rules(rules), {"bos": "<s>"})}
    assert all(r.token_index == 0 for r in records.values())
    return [records[i].kind if i in records else None for i in range(len(cases))]


@pytest.mark.parametrize("threshold", [None, 0.45])
def test_sink_mass_rule_flips_at_its_threshold(threshold):
    th = DEFAULT_RULES["sink_mass"] if threshold is None else threshold
    rules = {} if threshold is None else {"sink_mass": threshold}
    got = _verdicts([{"mass": th - DELTA, "r_out": 0.1}, {"mass": th, "r_out": 0.1}, {"mass": th + DELTA, "r_out": 0.1}],
                    rules)
    assert got == [None, None, "nop"]  # strictly above ε (Gu et al.: α > ε)


@pytest.mark.parametrize("threshold", [None, 0.05])
def test_strict_rule_flips_at_one_minus_eps(threshold):
    eps = DEFAULT_RULES["eps_event"] if threshold is None else threshold
    rules = {"rule": "strict", **({} if threshold is None else {"eps_event": threshold})}
    low = 1.0 - eps
    # The column mass is high on every case: only the column minimum decides.
    got = _verdicts([{"mass": 0.95, "low": low - DELTA, "r_out": 0.1}, {"mass": 0.95, "low": low + DELTA, "r_out": 0.1}],
                    rules)
    assert got == [None, "nop"]


@pytest.mark.parametrize("threshold", [None, 0.6])
def test_relaxed_rule_flips_at_its_share(threshold):
    share = DEFAULT_RULES["relaxed_share"] if threshold is None else threshold
    rules = {"rule": "relaxed", **({} if threshold is None else {"relaxed_share": threshold})}
    got = _verdicts([{"mass": 0.95, "routed": share - DELTA, "r_out": 0.1}, {"mass": 0.95, "routed": share, "r_out": 0.1},
                     {"mass": 0.95, "routed": share + DELTA, "r_out": 0.1}], rules)
    assert got == [None, "nop", "nop"]


@pytest.mark.parametrize("threshold", [None, 0.3])
def test_nop_flips_at_nop_max_ratio(threshold):
    th = DEFAULT_RULES["nop_max_ratio"] if threshold is None else threshold
    rules = {} if threshold is None else {"nop_max_ratio": threshold}
    # The head-space ratio says the opposite every time: only r_out decides (SCIENCE §2).
    got = _verdicts([{"r_out": th - DELTA, "r_head": 1.0}, {"r_out": th, "r_head": 1.0},
                     {"r_out": th + DELTA, "r_head": 0.01}], rules)
    assert got == ["nop", "nop", "unclassified"]


@pytest.mark.parametrize("threshold", [None, 0.7])
def test_broadcast_flips_at_broadcast_min_ratio(threshold):
    th = DEFAULT_RULES["broadcast_min_ratio"] if threshold is None else threshold
    rules = {} if threshold is None else {"broadcast_min_ratio": threshold}
    got = _verdicts([{"r_out": th - DELTA, "srank": 1.2}, {"r_out": th, "srank": 1.2},
                     {"r_out": th + DELTA, "srank": 1.2}], rules)
    assert got == ["unclassified", "broadcast", "broadcast"]


@pytest.mark.parametrize("threshold", [None, 1.1])
def test_broadcast_flips_at_broadcast_max_srank(threshold):
    th = DEFAULT_RULES["broadcast_max_srank"] if threshold is None else threshold
    rules = {} if threshold is None else {"broadcast_max_srank": threshold}
    got = _verdicts([{"r_out": 1.0, "srank": th - DELTA}, {"r_out": 1.0, "srank": th + DELTA}], rules)
    assert got == ["broadcast", "unclassified"]
    # and with r_out in the NOP range the rank does not matter: NOP on both sides
    assert _verdicts([{"r_out": 0.01, "srank": th - DELTA}, {"r_out": 0.01, "srank": th + DELTA}], rules) == ["nop"] * 2


def test_boundary_verdicts_reach_the_diagnosis_tables():
    """The same verdicts through Diagnosis.per_layer / per_head: counts and dominant class follow the records."""
    from sinklab.diagnose import Diagnosis, _check_rules, sink_records

    cases = [{"r_out": 0.2 - DELTA}] * 3 + [{"r_out": 0.5 + DELTA}] * 2 + [{"mass": 0.3 - DELTA}]
    scan = _synthetic_scan(cases)
    rules = _check_rules({})
    d = Diagnosis(scan=scan, records=sink_records(scan, rules, {"bos": "<s>"}), rules=rules)
    row = d.per_layer()[0]
    assert row["counts"] == {"unclassified": 0, "nop": 3, "broadcast": 2} and row["dominant_kind"] == "nop"
    assert row["sink_pct"] == pytest.approx(100 * 5 / 6) and row["top_sink"] == "bos@0"
    assert d.per_head()[0][0] == {"sink_pct": pytest.approx(100 * 5 / 6), "kind": "nop"}
