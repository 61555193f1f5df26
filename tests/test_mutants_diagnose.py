"""sinklab.diagnose's rules: the parts mutation testing found unchecked (docs/testing.md).

The rule checks' boundaries and messages, and every field of a sink record against the scan it came from
(recomputed here from the scan's tensors: a gather at the dominant column, ``σ₁² / Σσ²``, ``σ₁ / σ₂``), on the
synthetic one-head scans of tests/test_diagnose.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from sinklab.diagnose import DEFAULT_RULES, _check_rules, sink_records
from sinklab.errors import InputError
from test_diagnose import _synthetic_scan


@pytest.mark.parametrize("rules, message", [
    ({"sink_mas": 0.3}, "unknown diagnosis rule(s) ['sink_mas']; known: "),
    ({"rule": "loose"}, "rule must be 'mass', 'strict' or 'relaxed', got 'loose'"),
    ({"eps_event": 1.5}, "threshold eps_event must be in [0, 1], got 1.5"),
    ({"relaxed_share": -0.1}, "threshold relaxed_share must be in [0, 1], got -0.1"),
    ({"nop_max_ratio": 0.6, "broadcast_min_ratio": 0.5}, "nop_max_ratio must not exceed broadcast_min_ratio"),
    ({"broadcast_max_srank": 0.5}, "broadcast_max_srank must be ≥ 1, got 0.5"),
    ({"broadcast_max_srank": math.inf}, "broadcast_max_srank must be ≥ 1, got inf"),
])
def test_bad_rules_say_what_is_wrong(rules, message):
    with pytest.raises(InputError) as err:
        _check_rules(rules)
    assert str(err.value).startswith(message), str(err.value)


def test_rule_values_on_their_bounds_are_accepted():
    """Both ends of [0, 1] are valid thresholds, NOP and broadcast may share their ratio, and a stable rank bound of
    exactly 1 (rank-one updates only) is valid."""
    for key in ("sink_mass", "eps_event", "relaxed_share", "nop_max_ratio", "broadcast_min_ratio"):
        for value in (0.0, 1.0):
            rules = {key: value}
            if key == "nop_max_ratio":
                rules["broadcast_min_ratio"] = 1.0
            if key == "broadcast_min_ratio":
                rules["nop_max_ratio"] = 0.0
            assert _check_rules(rules)[key] == value
    assert _check_rules({"nop_max_ratio": 0.4, "broadcast_min_ratio": 0.4})["nop_max_ratio"] == 0.4
    assert _check_rules({"broadcast_max_srank": 1.0})["broadcast_max_srank"] == 1.0
    assert _check_rules({}) == DEFAULT_RULES


def test_every_record_field_is_the_scans_value_at_the_dominant_column():
    cases = [{"mass": 0.6, "routed": 0.8, "r_out": 0.05, "r_head": 0.07, "srank": 1.5},
             {"mass": 0.7, "routed": 0.95, "r_out": 0.9, "r_head": 0.8, "srank": 1.1}]
    scan = _synthetic_scan(cases)
    scan.common_mode = torch.tensor([0.25, 0.75], dtype=torch.float64)[:, None, None]
    scan.qk_spectrum = torch.tensor([[[3.0, 1.5]]], dtype=torch.float64)
    records = sink_records(scan, _check_rules({}), {"bos": "<s>"})
    assert [r.sample for r in records] == [0, 1]
    for r, case in zip(records, cases):
        sigma = scan.update_spectrum[r.sample, 0, 0].double()
        assert (r.layer, r.head, r.token_index, r.token, r.role) == (0, 0, 0, "<s>", "bos")
        assert r.strength == pytest.approx(case["mass"])
        assert r.routed_fraction == pytest.approx(case["routed"])
        assert r.value_norm_ratio == pytest.approx(case["r_head"])
        assert r.value_norm_ratio_out == pytest.approx(case["r_out"])
        assert r.stable_rank == pytest.approx(case["srank"])
        assert r.rank1_energy == pytest.approx(float(sigma[0] ** 2 / (sigma**2).sum()))
        assert r.common_mode == pytest.approx([0.25, 0.75][r.sample])
        assert r.qk_sigma_ratio == pytest.approx(2.0)
        assert isinstance(r.routed_fraction, float) and isinstance(r.common_mode, float)


def test_a_sink_past_the_labelled_tokens_has_the_role_other():
    """Token labels shorter than the sequence (a caller's labels): a sink at an unlabelled position is "other", and
    one at the last labelled position keeps its role."""
    scan = _synthetic_scan([{"mass": 0.6}, {"mass": 0.6}], t=16)
    scan.column_mass[:, 0, 0, 0] = 0.01
    scan.column_mass[0, 0, 0, 3] = 0.6  # sample 0: the sink is at position 3, past its three labels
    scan.column_mass[1, 0, 0, 2] = 0.6  # sample 1: at position 2, its last label
    scan.tokens = [["<s>", "a", "b"], ["<s>", "a", "<s>"]]
    records = sink_records(scan, _check_rules({}), {"bos": "<s>"})
    by_sample = {r.sample: r for r in records}
    assert (by_sample[0].token_index, by_sample[0].role) == (3, "other")
    assert (by_sample[1].token_index, by_sample[1].role) == (2, "bos")
