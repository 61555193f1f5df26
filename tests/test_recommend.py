"""sinklab.recommend: each synthetic task gets its own fix, MiniLM gets gating, and the closed loop on BB.

The oracles are the tasks' construction (the NOP task is built so that damped queries park on a null
BOS value; the broadcast task so that one token's content is written everywhere), the counts recomputed
here from the diagnosis records, and — for the closed loop — a second diagnosis of the model trained
with the recommended fix.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace

import pytest
import torch

from sinklab.diagnose import Diagnosis, diagnose_inputs
from sinklab.errors import InputError
from sinklab.recommend import DEFAULT_THRESHOLDS, Recommendation, edit_signature, recommend
from sinklab.report.recommend_html import render_recommendation
from sinklab.synth import BroadcastTask, NopTask, run_broadcast, run_nop


@pytest.fixture(scope="module")
def nop():
    return run_nop(NopTask(d=32, n=16), steps=300, batch=128, eval_samples=16)


@pytest.fixture(scope="module")
def broadcast():
    return run_broadcast(BroadcastTask(d=32, n=16), steps=300, batch=128, eval_samples=16)


def _share(d: Diagnosis) -> float:
    s = d.scan
    return sum(r.role != "register" for r in d.records) / (s.num_samples * s.num_layers * s.num_heads)


def test_nop_task_gets_gating(nop):
    d = nop.diagnosis
    rec = recommend(d)
    kinds = Counter(r.kind for r in d.records)
    assert kinds["nop"] >= 10  # the task's construction: damped queries on a null BOS value
    assert rec.fix == "gated" and rec.variant == "gated"
    assert rec.evidence["counts"]["nop"] == kinds["nop"]
    assert rec.evidence["f_nop"] == pytest.approx(kinds["nop"] / len(d.records))
    assert rec.evidence["share"] == pytest.approx(_share(d))
    # the NOP head's edits: zeroing the BOS value moves the damped outputs far less than an ordinary value there
    e = d.edits[0]
    assert e.hidden["zero"] < 0.5 * e.hidden["ordinary"] and edit_signature(e) == "nop"
    assert rec.evidence["edits"][0]["agrees"] is True
    # ≥ 10 sinks, 100 % NOP, edits agree, but < 30 sinks: "medium" by the written confidence rule
    assert len(d.records) < DEFAULT_THRESHOLDS["high_count"] and rec.confidence == "medium"
    assert "sinklab train --variant gated" in " ".join(rec.how_to)
    data = json.loads(json.dumps(rec.to_json()))  # JSON-ready, and back: the same recommendation
    assert Recommendation.from_json(data) == rec and Recommendation.from_json(data).to_json() == data
    with pytest.raises(InputError, match="not a sinklab.recommend/1 document"):
        Recommendation.from_json({**data, "schema": "sinklab.diagnose/2"})


def test_broadcast_task_gets_registers(broadcast):
    d = broadcast.diagnosis
    rec = recommend(d)
    kinds = Counter(r.kind for r in d.records)
    assert kinds["broadcast"] > kinds["nop"]
    assert rec.fix == "registers"
    assert rec.evidence["f_broadcast"] == pytest.approx(kinds["broadcast"] / len(d.records))
    assert rec.evidence["share"] == pytest.approx(_share(d))
    # no edits were run: the "high" bar needs them, so at most medium (written rule)
    assert rec.confidence in ("medium", "low") and not rec.evidence["edits"]


def test_both_common_gets_both_and_rare_gets_none(nop, broadcast):
    nd, bd = nop.diagnosis, broadcast.diagnosis
    mixed = Diagnosis(scan=bd.scan, records=list(bd.records) + [replace(r, layer=1) for r in nd.records[:12]],
                      rules=bd.rules)
    rec = recommend(mixed)
    assert rec.evidence["f_nop"] >= 0.25 and rec.evidence["f_broadcast"] >= 0.25
    assert rec.fix == "gated+registers"
    # rare: the same NOP model with a much stricter rule has (almost) no sinks
    x, _, _ = NopTask(d=32, n=16).sample(16, torch.Generator().manual_seed(5))
    tokens = [["<bos>"] + [f"x{i}" for i in range(16)] for _ in range(16)]
    strict = diagnose_inputs(nop.model, [{"inputs_embeds": x}], tokens, special={"bos": "<bos>"}, edits=False,
                             rules={"sink_mass": 0.999})
    rec = recommend(strict)
    assert _share(strict) < 0.05 and rec.fix == "none" and rec.variant is None
    assert rec.confidence == "high"  # 16 ≥ 8 samples


def test_sinks_on_registers_are_housed(broadcast):
    d = broadcast.diagnosis
    housed = Diagnosis(scan=d.scan, records=[replace(r, role="register") for r in d.records], rules=d.rules)
    rec = recommend(housed)
    assert rec.fix == "none"
    assert rec.evidence["housed_on_registers"] == len(d.records) and rec.evidence["unhoused"] == 0


def test_minilm_is_nop_dominated_gating_but_unsupported(minilm):
    import sinklab

    from test_scan import bert_reference, reference_records

    from sinklab.texts import default_texts, tokenize_windows

    d = sinklab.diagnose(minilm.model, minilm.tokenizer, seq_len=32, samples=4, edits=False)
    rec = recommend(d, model=minilm.model)
    # The evidence against a float64 reference of the same windows (transformers' eager attention and the weights,
    # tests/test_scan.py), classified by SCIENCE §2; the fix then follows from recommend's written rule.
    windows = tokenize_windows(minilm.tokenizer, default_texts(), 32, 4)
    ref = reference_records(bert_reference(minilm.model, windows.input_ids, windows.attention_mask))
    kinds = Counter(kind for kind, *_ in ref.values())
    n = len(ref)
    assert rec.evidence["counts"] == {k: kinds.get(k, 0) for k in ("nop", "broadcast", "unclassified")}
    assert rec.evidence["share"] == pytest.approx(n / (4 * 6 * 12))
    th = DEFAULT_THRESHOLDS
    common = {k: kinds[k] / n >= th["common_share"] and kinds[k] >= th["min_count"] for k in ("nop", "broadcast")}
    assert n / (4 * 6 * 12) >= th["rare_share"] and common == {"nop": True, "broadcast": False}
    assert rec.fix == "gated"  # NOP common, broadcast not: the rule's "gated"
    assert rec.support["supported"] is False and "bert" in rec.support["note"]
    assert rec.how_to[0].startswith("Not applicable")


def test_html_fragment_escapes(nop):
    rec = recommend(nop.diagnosis)
    rec.reason = "<script>alert(1)</script>"
    page = render_recommendation(rec)
    assert "<script>" not in page and "&lt;script&gt;" in page
    assert "Recommended fix: gated" in page


@pytest.mark.long
@pytest.mark.usefixtures("one_thread")  # a tiny training run
def test_bb_closed_loop_fix_shrinks_its_target(tmp_path):
    """The closed loop of the benchmark (seed 0, 800 steps) on half its batch: baseline → recommendation → fixed model
    → diagnosis.

    Two 800-step trainings of a 1-layer model at batch 16 (the benchmark's 32 gives the same verdicts in twice the
    time), on one thread (shorter runs are still changing the sink's class, so the outcome would depend on the step
    count and thread scheduling).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _closed_loop(tmp_path)
    finally:
        torch.set_num_threads(threads)


def _closed_loop(tmp_path):
    from sinklab.closed_loop import bb_closed_loop
    from sinklab.train import TrainConfig

    cfg = TrainConfig(data="bb", layers=1, heads=1, width=64, seq_len=32, batch=16, steps=800, lr=3e-3, warmup=100,
                      monitor_every=160)
    result = bb_closed_loop(cfg, tmp_path)
    base, fixed = result["runs"]["baseline"], result["runs"]["fixed"]
    fix = result["fix"]
    assert fix in ("gated", "registers", "gated+registers")
    assert fixed["train"]["steps"] == base["train"]["steps"] == 800  # equal budget
    b, f = base["sinks"], fixed["sinks"]
    before = result["recommendation"]["evidence"]["counts"]  # unhoused sinks by class (registers excluded)
    after = fixed["recommendation_after"]["evidence"]["counts"]
    if fix == "registers":  # the broadcast sinks leave the ordinary tokens for the registers (housed)
        assert before["broadcast"] > 0
        assert after["broadcast"] < before["broadcast"]
    else:  # the NOP-valued sinks give way: the gate does the damping
        assert b["nop_valued_sinks"] > 0
        assert f["nop_valued_sinks"] < b["nop_valued_sinks"]
    assert fixed["recommendation_after"]["fix"] == "none"  # the fix is in place


def test_print_recommendation_and_already_applied(nop, capsys):
    from sinklab.cli._common import console
    from sinklab.cli.recommend import print_recommendation

    rec = recommend(nop.diagnosis)
    with console.capture() as cap:
        print_recommendation(rec)
    text = cap.get()
    assert "recommended fix: gated" in text and "sinklab train --variant gated" in text

    import sinklab
    from sinklab.models import tiny_llama

    model = tiny_llama()
    with sinklab.apply_variant(model, "gated"):  # a model that already has the gate: nothing more to add
        again = recommend(nop.diagnosis, model=model)
    assert again.fix == "none" and "already has gated" in again.reason
    assert again.support["api"] == "sinklab.apply_variant"
