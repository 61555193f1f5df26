"""``sinklab kv-quant`` end to end on the shipped tiny model; the analysis against the cache layers it measures."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from sinklab.kvquant import Protection, quantized_sink_cache
from sinklab.kvquant.layer import kv_shape
from sinklab.kvquant.evaluate import ROW_KEYS, KvQuantPlan, kv_quant
from sinklab.models import load_model

pytestmark = pytest.mark.usefixtures("one_thread")


def _cli(*args):
    from sinklab.cli import app

    return CliRunner().invoke(app, ["kv-quant", *map(str, args)])


def test_cli_writes_rows_figure_and_escaped_report(tmp_path):
    out = tmp_path / "run"
    r = _cli("builtin:tiny-lm", "--bits", "4,2", "--context", 64, "--score", 16, "--samples", 1, "--group-size", 16,
             "--residual", 4, "--decode-steps", 2, "--out", out)
    assert r.exit_code == 0, r.output
    data = json.loads((out / "kv_quant.json").read_text())
    rows = data["rows"]
    assert [(row["bits"], row["protect"]) for row in rows] == [(32, "full"), (16, "16-bit")] + [
        (b, p) for b in (4, 2) for p in ("none", "first", "detected")]
    assert all(set(ROW_KEYS) <= set(row) for row in rows)
    full = rows[0]
    assert full["median_kl"] == 0.0 and full["top1"] == 1.0
    assert full["bytes_per_token"] == 2 * data["dense_bytes_per_token_16bit"]  # float32 cache
    by = {(row["bits"], row["protect"]): row for row in rows}
    assert by[(2, "none")]["median_kl"] > by[(4, "none")]["median_kl"] > 0
    assert by[(2, "none")]["bytes_per_token"] < by[(4, "none")]["bytes_per_token"] < full["bytes_per_token"]
    assert (out / "kl_vs_bytes.png").stat().st_size > 1000
    assert data["meta"]["window_prefix"] == ["<s>"]  # the tiny model's tokenizer starts every prompt with <s>
    html = (out / "report.html").read_text()
    assert "<script" not in html and "sinklab kv-quant" in html and "starts with <code>&lt;s&gt;</code>" in html
    assert data["plan"]["clip"] is None and "least-squares (clipped) at 2 bits, min/max at other" in html
    r = _cli("builtin:tiny-lm", "--bits", "2", "--protect", "none", "--context", 64, "--score", 16, "--samples", 1,
             "--residual", 4, "--decode-steps", 0, "--no-clip", "--out", tmp_path / "minmax")
    assert r.exit_code == 0, r.output
    minmax = json.loads((tmp_path / "minmax" / "kv_quant.json").read_text())
    assert minmax["plan"]["clip"] is False
    assert "Group ranges: min/max." in (tmp_path / "minmax" / "report.html").read_text()
    assert minmax["rows"][2]["median_kl"] != by[(2, "none")]["median_kl"]  # the ranges differ, so does the KL


@pytest.mark.parametrize("args, needle", [(("--bits", "5"), "--bits"), (("--protect", "all"), "--protect"),
                                          (("--context", 8), "context")])
def test_cli_bad_options_are_one_line(tmp_path, args, needle):
    r = _cli("builtin:tiny-lm", *args, "--out", tmp_path / "x")
    assert r.exit_code == 2 and needle in r.output and "Traceback" not in r.output
    assert not (tmp_path / "x").exists()


def test_rows_match_the_cache_layers_they_measure():
    loaded = load_model("builtin:tiny-lm")
    model = loaded.model
    ids = torch.randint(5, 4000, (96,), generator=torch.Generator().manual_seed(1))
    plan = KvQuantPlan(bits=(3,), protect=("first",), num_first=2, context=64, score=32, samples=1, group_size=16,
                       value_group=16, residual=4, decode_steps=0, clip=True)  # least squares (default: 2 bits only)
    assert quantized_sink_cache(model, 2).layers[0].clip and not quantized_sink_cache(model, 4).layers[0].clip
    result = kv_quant(model, ids, plan)
    row = result.row(3, "first")
    with torch.no_grad():  # the same two forwards by hand, KL computed independently in float64
        full = model(ids[None]).logits[0, 64:].double().log_softmax(-1)
        cache = quantized_sink_cache(model, 3, Protection(first=2), group_size=16, residual=4, clip=True)
        model(ids[None, :64], cache=cache)
        got = model(ids[None, 64:], cache=cache).logits[0].double().log_softmax(-1)
    kl = (full.exp() * (full - got)).sum(-1)
    assert row["median_kl"] == pytest.approx(float(kl.median()), rel=1e-3, abs=1e-6)
    assert row["top1"] == pytest.approx(float((full.argmax(-1) == got.argmax(-1)).double().mean()))
    nll = -got[:-1].gather(-1, ids[65:, None])[:, 0]
    assert row["ppl"] == pytest.approx(float(nll.mean().exp()), rel=1e-3)
    assert row["bytes_per_token"] == sum(layer.nbytes() for layer in cache.layers) / 96
    assert row["protected_tokens"] == 2
    layers, kv, dh = kv_shape(model)  # at 4096 cached tokens, closed form: R ≤ residual < R + G, 2 exact copies
    n = (4096 - 4) // 16 * 16  # packed tokens (the 2 protected ones are holes in the first block)
    codes = 2 * n * kv * dh * 3 // 8  # keys + values, 3 bits
    meta = 2 * 2 * (n // 16) * kv * dh + 2 * 2 * n * kv * (dh // 16)  # float16 scale + zero: key blocks, value groups
    exact = (4096 - n + 2) * kv * dh * 2 * 2  # residual + protected keys and values in float16
    assert row["bytes_per_token_4096"] == pytest.approx(layers * (codes + meta + exact) / 4096, rel=1e-12)
    assert row["bytes_ratio_16bit_4096"] == pytest.approx(row["bytes_per_token_4096"] / (2 * layers * kv * dh * 2))


def test_windows_start_with_the_special_prefix():
    """Each sample window is a prompt: the tokenizer's special prefix, then the next stretch of text (no text token
    used twice); the rows are measured on those windows (the full cache's PPL equals the model's own forward over
    them, and differs without the prefix)."""
    from kvquant_models import SINK_ID, massive_sink_llama
    from sinklab.kvquant.evaluate import sample_windows

    model = massive_sink_llama()
    ids = torch.randint(5, 256, (80,), generator=torch.Generator().manual_seed(2))
    plan = KvQuantPlan(bits=(4,), protect=("none",), context=32, score=8, samples=2, group_size=8,
                       value_group=8, residual=4, decode_steps=0, bytes_lengths=())
    windows = sample_windows(ids, plan, prefix=[SINK_ID])
    assert [w.tolist() for w in windows] == [[SINK_ID] + ids[:39].tolist(), [SINK_ID] + ids[39:78].tolist()]

    def ppl(rows):
        with torch.no_grad():
            nll = [torch.nn.functional.cross_entropy(model(w[None]).logits[0, 32:39].double(), w[33:]) for w in rows]
        return float(torch.stack(nll).mean().exp())

    expected = ppl(windows)
    assert ppl(sample_windows(ids, plan)) != pytest.approx(expected, rel=1e-3)  # the prefix changes the numbers
    assert kv_quant(model, ids, plan, prefix=[SINK_ID]).row(32, "full")["ppl"] == pytest.approx(expected, rel=1e-5)
    with pytest.raises(Exception, match="tokens of text"):
        sample_windows(ids[:70], plan, prefix=[SINK_ID])
