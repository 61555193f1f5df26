"""README's Python example runs as written (outputs in a temporary folder)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parent.parent / "README.md"


def _api_block() -> str:
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## Python API"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_python_example_runs(tmp_path, monkeypatch):
    import sinklab

    code = _api_block()
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(code, str(README), "exec"), scope)  # noqa: S102 - the README's own example
    result = scope["result"]
    assert isinstance(result, sinklab.ScanResult) and result.num_samples == 4
    # The numbers, not only the types: the column mass and Sink_1^ε recomputed from transformers' own eager
    # attention of the same windows (float64, SCIENCE §1), no sinklab metric on the path.
    from test_scan import eager_attentions, reference_column_mass, reference_sink_rate

    from sinklab.texts import tokenize_windows

    loaded = scope["loaded"]
    windows = tokenize_windows(loaded.tokenizer, scope["texts"], 64, 4)
    assert [[loaded.tokenizer.decode([i]) for i in row[: len(t)]] for row, t in
            zip(windows.input_ids.tolist(), result.tokens, strict=True)] == result.tokens  # the scan's own inputs
    attn = eager_attentions(loaded.model, windows.input_ids, windows.attention_mask)
    mass = reference_column_mass(attn, windows.attention_mask.bool(), causal=True)
    torch.testing.assert_close(result.column_mass.double(), mass, atol=2e-5, rtol=0, equal_nan=True)
    assert float((mass[..., 0] - 0.3).abs().min()) > 1e-3  # no head so close to ε that rounding could flip it
    want = reference_sink_rate(mass)
    assert 0 < want < 100 and result.sink_rate(0) == pytest.approx(want, abs=1e-9)
    assert scope["d"].scan.sink_rate(0) == pytest.approx(want, abs=1e-9)  # diagnose's statistics pass: same inputs
    assert scope["d"].records and isinstance(scope["c"].amplification_layer, int)
    for folder in ("out", "diag", "circuit"):
        assert (tmp_path / folder / "report.html").is_file(), os.listdir(tmp_path)


def test_readme_gating_numbers_are_the_committed_benchmarks():
    """The gated / ungated Qwen3-Next numbers README quotes are those of benchmarks/results/gating.json (mean ± sample
    standard deviation over its seeds), to the digits printed."""
    import json
    import re
    import statistics

    rows = json.loads((README.parent / "benchmarks" / "results" / "gating.json").read_text())["rows"]
    text = " ".join(README.read_text(encoding="utf-8").split())
    m = re.search(r"gives the first token ([\d.]+) ± ([\d.]+) of the attention with the gate against ([\d.]+) ± "
                  r"([\d.]+) without, and Sink_1\^ε ([\d.]+) % against ([\d.]+) %", text)
    assert m, "README's gating sentence is gone or reworded: update this test with it"
    quoted = [float(x) for x in m.groups()]
    got = []
    for gated in (True, False):
        share = [r["first_token_share"] for r in rows if r["output_gate"] is gated]
        got.append((statistics.mean(share), statistics.stdev(share)))
    sink = [statistics.mean(r["sink_rate_0"] for r in rows if r["output_gate"] is g) for g in (True, False)]
    want = [got[0][0], got[0][1], got[1][0], got[1][1], sink[0], sink[1]]
    digits = [3, 3, 3, 3, 1, 1]
    assert [round(w, d) for w, d in zip(want, digits)] == quoted, (want, quoted)
    assert len(rows) == 6 and "3 seeds" in text


# ----------------------------------------------------------------------------- README's numbers vs committed JSON
RESULTS = README.parent / "benchmarks" / "results"


def _text() -> str:
    return " ".join(README.read_text(encoding="utf-8").split())


def _json(name: str):
    import json

    return json.loads((RESULTS / name).read_text())


def _find(pattern: str) -> list[float]:
    import re

    m = re.search(pattern, _text())
    assert m, f"README no longer says {pattern!r}: update this test with it"
    return [float(x.replace(",", "")) for x in m.groups()]


def _in_range(value: float, low: float, high: float, digits: int) -> bool:
    return low <= round(value, digits) <= high


def test_readme_eval_stream_numbers_are_the_committed_benchmarks():
    """`sinklab eval-stream` on SmolLM2 (cache 256): benchmarks/results/compare_smollm2.json; the long run past the
    trained positions: long_smollm2.json (benchmarks/long_stream_smollm2.py long --tokens 12288)."""
    import statistics

    quoted = _find(r"On SmolLM2 \(cache (\d+)\): window only PPL ([\d.]+), one sink ([\d.]+), four sinks ([\d.]+), "
                   r"recompute ([\d.]+), dense ([\d.]+); past its ([\d,]+) trained positions dense attention degrades "
                   r"\(NLL ([\d.]+) in the last ([\d,]+) of ([\d,]+) tokens\) while sinks \+ window stays level \(([\d.]+)\)")
    short, long = _json("compare_smollm2.json"), _json("long_smollm2.json")
    curves = short["curves"]
    ppl = [curves[k]["ppl"] for k in ("window", "sinks S=1", "sinks S=4", "recompute", "dense")]
    assert curves["window"]["num_sinks"] == 0 and curves["sinks S=1"]["window"] + 1 == short["cache_size"]
    last = quoted[8]
    tail = {name: statistics.mean(n for p, n in zip(long["scored_positions"], c["nll"], strict=True)
                                  if p >= long["num_tokens"] - last)
            for name, c in long["curves"].items()}
    want = [short["cache_size"], round(ppl[0], 1), round(ppl[1], 2), round(ppl[2], 2), round(ppl[3], 1), round(ppl[4], 1),
            long["trained_positions"], round(tail["dense"], 2), last, long["num_tokens"], round(tail["sinks S=4"], 2)]
    assert quoted == want


def test_readme_recall_numbers_are_the_committed_benchmark():
    """Recall 100 % inside the window, 0 % once evicted, 100 % pinned: quality_recall.json
    (benchmarks/stream_quality.py recall)."""
    quoted = _find(r"a fact is recalled (\d+) % while inside the window, (\d+) % once evicted, (\d+) % when pinned")
    d = _json("quality_recall.json")
    window = d["window"]
    inside = [a for dist, a in zip(d["distances"], d["accuracy"]["sinks"], strict=True) if dist < window]
    evicted = [a for dist, a in zip(d["distances"], d["accuracy"]["sinks"], strict=True) if dist > window]
    assert inside and evicted
    assert quoted == [100 * min(inside), 100 * max(evicted), 100 * min(d["accuracy"]["pinned"])]
    assert max(inside) == min(inside) and min(evicted) == max(evicted)  # a single figure is honest for each


def test_readme_compile_numbers_are_the_committed_benchmarks():
    """CPU: bench_stream_compile_freezing.json (the README's ranges hold every committed run); one H200:
    bench_stream_compile_cuda_bfloat16.json and …_profile.json (benchmarks/gpu_stream_compile.sh)."""
    cpu = _find(r"decodes SmolLM2 at ([\d.]+)–([\d.]+)× and Gemma 3 270M at ([\d.]+)–([\d.]+)× the eager DynamicCache's "
                r"time per token \(four runs\), within ([\d.]+)× of transformers' compiled StaticCache")
    models = {m["model"]: m["threads"] for m in _json("bench_stream_compile_freezing.json")["models"]}
    assert _json("bench_stream_compile_freezing.json")["compile"] == {"freezing": True}
    for name, (low, high) in (("builtin:smollm2", cpu[0:2]), ("builtin:gemma3", cpu[2:4])):
        for run in models[name].values():
            assert _in_range(run["ratios"]["sinklab compiled / dynamic eager"], low, high, 2), (name, run["ratios"])
            assert round(run["ratios"]["sinklab compiled / static compiled"], 2) <= cpu[4]
    gpu = _find(r"On one H200 \(bfloat16, CUDA graphs\) a compiled SmolLM2 stream decodes in ([\d.]+)–([\d.]+) ms per "
                r"token, ([\d.]+)× the eager DynamicCache but ([\d.]+)–([\d.]+)× transformers' compiled StaticCache: the "
                r"stream's eager bookkeeping between the graphs \(([\d.]+)–([\d.]+) ms per token there\)")
    runs = []
    for name in ("bench_stream_compile_cuda_bfloat16.json", "bench_stream_compile_cuda_bfloat16_profile.json"):
        d = _json(name)
        assert d["device"] == "cuda" and d["dtype"] == "bfloat16" and "H200" in d["machine"]["gpu"]
        runs += [(m["model"], m["threads"]["1"]) for m in d["models"]]
    smol = [r for model, r in runs if model.startswith("smollm2")]
    assert len(smol) == 2
    assert sorted(round(r["median_ms"]["sinklab compiled"], 1) for r in smol) == gpu[0:2]
    assert all(round(r["ratios"]["sinklab compiled / dynamic eager"], 2) == gpu[2] for r in smol)
    assert sorted(round(r["ratios"]["sinklab compiled / static compiled"], 2) for r in smol) == gpu[3:5]
    plans = [r["plan_us_per_token"] / 1000 for _, r in runs if r.get("plan_us_per_token")]  # the profiled run
    assert plans and all(_in_range(p, gpu[5], gpu[6], 1) for p in plans)
    assert {round(p, 1) for p in plans} == set(gpu[5:7])


def test_readme_vit_numbers_are_the_committed_benchmark():
    """`sinklab vit-experiment --minutes 45 --seeds 3` (docs/vit.md): benchmarks/results/vit_experiment.json."""
    quoted = _find(r"in a (\d+)-seed CPU run of ([\d,]+) steps per model, gating lifts the patch-probe mIoU from ([\d.]+) ± ([\d.]+) "
                   r"to ([\d.]+) ± ([\d.]+) and gating \+ registers to ([\d.]+) ± ([\d.]+) while \[CLS\] accuracy stays "
                   r"within ([\d.]+) points")
    d = _json("vit_experiment.json")
    rows, plan = d["rows"], d["plan"]
    cls = [row["cls acc [CLS]"][0] for row in rows.values()]
    want = [plan["config"]["seeds"], plan["steps"],
            *(round(x, 1) for v in ("baseline", "gated", "gated+registers") for x in rows[v]["mIoU"]),
            round(max(cls) - min(cls), 1)]
    assert quoted == want, (quoted, want)


#: scan's per-layer table: (registry row, digits printed) per column after "layer" (sinklab.cli's scan table).
SCAN_COLUMNS = [("sink_rate_0", 1), ("sink_strength", 2), ("top_position", 0), ("top_position_pct", 0),
                ("value_norm_ratio_out", 2), ("update_stable_rank", 2), ("hidden_norm_ratio_0", 2), ("max_activation", 1)]


def _block_after(marker: str) -> str:
    import re

    text = README.read_text(encoding="utf-8")
    assert marker in text, f"README no longer has {marker!r}: update this test with it"
    return re.search(r"```text\n(.*?)```", text[text.index(marker):], re.S).group(1)


def _check_scan_table(marker: str, committed: str) -> None:
    import re

    block, data = _block_after(marker), _json(committed)
    table = data["per_layer"]
    rows = [[float(c) for c in line.strip("│ ").split("│")] for line in block.splitlines() if line.startswith("│")]
    assert len(rows) >= 6
    for row in rows:
        layer = int(row[0])
        want = [round(table[name][layer], digits) for name, digits in SCAN_COLUMNS]
        assert row[1:] == want, (layer, row[1:], want)
    m = re.search(r"Sink\^ε\(0\) = ([\d.]+) % of layer×head pairs; most common sink: position (\d+) \('(.*)'\)", block)
    assert m and float(m.group(1)) == round(data["sink_rate"]["by_position"]["0"], 1)
    assert (int(m.group(2)), m.group(3)) == (data["top_sink"]["position"], data["top_sink"]["token"])
    assert (data["meta"]["num_samples"], data["meta"]["seq_len"]) == (16, 64)  # the defaults README states


def test_readme_minilm_scan_table_is_the_committed_scan():
    """`sinklab scan builtin:minilm` → benchmarks/results/scan_minilm.json (its scan.json, per-sample arrays dropped)."""
    _check_scan_table("Output of `sinklab scan builtin:minilm`", "scan_minilm.json")
    # the sentence under the table: [CLS]'s output-space value norm is 4–10 % of the others' in layers 1–4
    low, high = _find(r"its output-space value norm is (\d+)–(\d+) % of the other tokens'")
    ratios = [100 * _json("scan_minilm.json")["per_layer"]["value_norm_ratio_out"][layer] for layer in (1, 2, 3, 4)]
    assert round(min(ratios)) == low and round(max(ratios)) == high, ratios


def test_readme_smollm2_scan_table_is_the_committed_scan():
    """`sinklab scan builtin:smollm2` → benchmarks/results/scan_smollm2.json (its scan.json, per-sample arrays
    dropped); the abridged rows and the massive activation quoted in the prose."""
    _check_scan_table("`sinklab scan builtin:smollm2` (16 pydoc windows", "scan_smollm2.json")
    table = _json("scan_smollm2.json")["per_layer"]
    (peak,) = _find(r"where a massive activation of \|a\| ≈ ([\d,]+) appears in one channel")
    assert round(table["max_activation"][11], -3) == peak and max(table["max_activation"]) < 1.01 * table["max_activation"][11]
    # "the sink of nearly every head from layer 3 on": position 0 is the top position of every layer from 3 but 11
    assert [layer for layer in range(3, 30) if table["top_position"][layer] != 0] == [11]
    # "(before that rule, positions 62–63 were often "sinks"; now none)": no (sample, layer, head) sinks there
    dominant = [p for sample in _json("scan_smollm2.json")["dominant_columns"] for layer in sample for p in layer]
    assert len(dominant) == 16 * 30 * 9 and not {62, 63} & set(dominant)
    # "its norm is built up twice by MLPs (blocks 1–2, then 16× more in block 11 …)": ‖x₀‖/median after each block
    ratio = table["hidden_norm_ratio_0"]
    (more,) = _find(r"built up twice by MLPs \(blocks 1–2, then (\d+)× more in block 11")
    assert round(ratio[11] / ratio[2]) == more and ratio[2] > 3 * ratio[0] and ratio[10] < 2 < ratio[11] / ratio[2]


def test_readme_minilm_diagnosis_table_is_the_committed_diagnosis():
    """`sinklab diagnose builtin:minilm` → benchmarks/results/diagnose_minilm.json (its diagnosis.json, records
    dropped): every cell of README's worked example, to the digits printed."""
    block = README.read_text(encoding="utf-8")
    block = block[block.index("| layer | sink % | nop | broadcast | top token |"):]
    rows = [line.strip("|").split("|") for line in block.split("\n\n")[0].splitlines()[2:]]
    d = _json("diagnose_minilm.json")
    assert (d["meta"]["num_samples"], d["meta"]["seq_len"]) == (16, 64)
    edits = {e["layer"]: e["hidden"] for e in d["edits"]}
    assert len(rows) == len(d["per_layer"])
    for cells, layer in zip(rows, d["per_layer"], strict=True):
        cells = [c.strip() for c in cells]
        n = layer["layer"]
        want = [str(n), f"{layer['sink_pct']:.0f}", str(layer["counts"]["nop"]), str(layer["counts"]["broadcast"])]
        if layer["top_token"] is None:
            want += ["–"] * 5
            assert n not in edits
        else:
            e = edits[n]
            want += [layer["top_token"], f"{layer['median_value_ratio_out']:.3f}", f"{e['zero']:.4f}",
                     f"{e['ordinary']:.3f}", f"{e['control']:.4f}"]
        assert cells == want, (cells, want)


def test_readme_smollm2_circuit_numbers_are_the_committed_circuit():
    """`sinklab circuit builtin:smollm2` (defaults: the causal check on the first 4 samples, the loss on every 8th
    target) → benchmarks/results/circuit_smollm2.json (its circuit.json, tokens dropped)."""
    d = _json("circuit_smollm2.json")
    more, first, last, nats = _find(r"its norm is built by MLPs in blocks 1–2 and again, (\d+)× larger, in block 11, and "
                                    r"scaling x₀ down at block 11 removes the sinks of layers (\d+)–(\d+) \(\+([\d.]+) nats of loss\)")
    ratio = d["ratio"]  # r after the embeddings, then after each block
    assert d["amplification_layer"] == 11 and d["amplification_blocks"] == [1, 2, 11]
    assert "On SmolLM2 the sink is structural" in _text() and d["ablation"]["verdict"] == "structural"
    assert round(ratio[1 + 11] / ratio[1 + 2]) == more
    scale = d["causal"]["scale"]
    assert d["causal"]["layer"] == 11 and round(scale["delta_loss"], 2) == nats
    sinks = set(d["sink_layers"])
    removed = [layer for layer in range(d["num_layers"]) if layer in sinks and scale["delta"][layer] < -50]
    assert removed == list(range(int(first), int(last) + 1)), removed  # every sink layer there loses > 50 points
    assert all(scale["delta"][layer] >= 0 for layer in (12, 13, 14))  # … and only those: 12–14 keep theirs


def test_readme_small_facts_are_the_committed_runs():
    """The 1 M-token stream (long_run_tiny-lm.json, benchmarks/long_run.py tiny-lm), the Qwen3-Next pair's tokens
    (gating.json), the KV plan's sink rule (kv_quant_smollm2.json) and tiny-lm's parameter count (the shipped model)."""
    import sinklab

    run = _json("long_run_tiny-lm.json")
    assert "a 1 M-token run keeps RSS flat" in _text() and run["finished"] and run["tokens_done"] == 1_000_000
    rss = [seg["rss_mb"] for seg in run["segments"]]
    half = len(rss) // 2
    assert len(rss) >= 10 and max(rss[half:]) <= 1.02 * max(rss[:half])  # flat: no growth over the second half
    (tokens,) = _find(r"3 seeds, (\d+) M tokens each")
    assert {round(r["tokens"] / 1e6) for r in _json("gating.json")["rows"]} == {tokens}
    share, pct = _find(r"receives more than ([\d.]+) of the attention in at least (\d+) % of the layer×head pairs")
    plan = _json("kv_quant_smollm2.json")["plan"]
    assert (plan["eps"], 100 * plan["share"]) == (share, pct)
    # The Qwen3-Next pair's size: the model `sinklab train --arch qwen3-next` builds with benchmarks/gating.py's TRAIN
    import ast

    from sinklab.train import TrainConfig, build_model

    tree = ast.parse((README.parent / "benchmarks" / "gating.py").read_text(encoding="utf-8"))
    train = next(ast.literal_eval(node.value) if isinstance(node.value, ast.Dict) else
                 {k.arg: ast.literal_eval(k.value) for k in node.value.keywords}
                 for node in tree.body if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "TRAIN")
    (pair,) = _find(r"A gated / ungated Qwen3-Next pair trained this way \(([\d.]+) M parameters")
    qwen = build_model(TrainConfig(arch="qwen3-next", layers=train["layers"], width=train["width"], heads=train["heads"],
                                   seq_len=train["seq_len"]), train["vocab_size"], 1, 2, 0)
    assert round(qwen.num_parameters() / 1e6, 2) == pair
    (millions,) = _find(r"a 4-layer Llama-style causal LM \(([\d.]+) M parameters\)")
    model = sinklab.load_model("builtin:tiny-lm").model
    assert model.config.num_hidden_layers == 4 and round(model.num_parameters() / 1e6, 1) == millions


def test_readme_gemma3_circuit_numbers_are_the_committed_circuit():
    """`sinklab circuit builtin:gemma3` → benchmarks/results/circuit_gemma3.json (its circuit.json, tokens dropped)."""
    d = _json("circuit_gemma3.json")
    found, layers, nats = _find(r"finds a position-0 sink in (\d+) of (\d+) layers as tokenized and in none with `<bos>` "
                                r"removed \(the loss rises by ([\d.]+) nats\)")
    sinks = d["ablation"]["sink_layers"]
    assert (len(sinks["as_tokenized"]), d["num_layers"]) == (found, layers) and sinks["bos_removed"] == []
    assert d["ablation"]["verdict"] == "token-tied"
    loss = {k: c["loss"] for k, c in d["conditions"].items()}
    assert round(loss["bos_removed"] - loss["as_tokenized"], 1) == nats


def test_readme_llamacpp_and_graph_counts_are_the_committed_benchmarks():
    """vs_llamacpp.json: each compiled stream ÷ llama.cpp's shift over its measured cells (F32 compiled and autotuned,
    BF16 and F16 autotuned) and their first logits against the eager stream's; the frame and graph counts of a
    compiled step in bench_stream_compile_ops_cpu.json."""
    frames, graphs = _find(r"compiled step is (\d+) dynamo frame and (\d+) graph, as with the StaticCache")
    ops = _json("bench_stream_compile_ops_cpu.json")["models"][0]["threads"]["1"]["ops_per_step"]
    assert (ops["sinklab compiled"]["frames"], ops["sinklab compiled"]["graphs"]) == (frames, graphs)
    assert (ops["static compiled"]["frames"], ops["static compiled"]["graphs"]) == (1, 1)
    quoted = _find(r"the compiled stream decodes at ([\d.]+)–([\d.]+)× the time per token of llama.cpp's own "
                   r"StreamingLLM shift .*?and at ([\d.]+)–([\d.]+)× with `--compile-mode "
                   r"max-autotune-no-cudagraphs`.*?in BF16 that is ([\d.]+)–([\d.]+)×, in F16 ([\d.]+)–([\d.]+)×")
    rows = _json("vs_llamacpp.json")["rows"]
    ms = {(r["engine"], r["method"], r["precision"], r["threads"], r["cached"]): r["ms_per_token"] for r in rows}

    def span(method, precision, cells):
        ratios = [ms["sinklab", method, precision, t, c] / ms["llama.cpp", "shift", precision, t, c]
                  for (e, m, p, t, c) in ms if (e, m, p) == ("sinklab", method, precision)]
        assert len(ratios) == cells
        return [round(min(ratios), 2), round(max(ratios), 2)]

    assert (span("stream-compiled", "f32", 4) + span("stream-autotuned", "f32", 4) + span("stream-autotuned", "bf16", 4)
            + span("stream-autotuned", "f16", 4)) == quoted
    worst = {p: max(r["max_rel_vs_eager"] for r in rows if "max_rel_vs_eager" in r and r["precision"] == p
                    and r["method"].startswith("stream-"))
             for p in ("f32", "bf16", "f16")}  # a compiled stream's first logits against the eager stream's
    # float32 to rounding; the 16-bit formats within two units in the last place of bfloat16 (2 · 2⁻⁷)
    assert worst["f32"] <= 1e-5 and max(worst["bf16"], worst["f16"]) <= 2**-6, worst


def test_readme_half_precision_default_numbers_are_the_committed_benchmark():
    """vs_llamacpp_default_half.json: the default path in BF16 and F16 against llama.cpp's plain decode, as README
    quotes it (ms per token and the one ratio)."""
    rows = _json("vs_llamacpp_default_half.json")["rows"]
    ms = {(r["engine"], r["method"], r["precision"], r["threads"], r["cached"]): r["ms_per_token"] for r in rows}
    quoted = _find(r"BF16 and\s+F16 weights now compile by default too: ([\d.]+) against llama.cpp's ([\d.]+) ms in BF16 "
                   r"\(([\d.]+)×; `--eager` ([\d.]+)\) and\s+([\d.]+) against ([\d.]+) in F16 at 1,024 cached tokens, one "
                   r"thread, and ([\d.]+) against ([\d.]+) in BF16 at 4,096 on two\s+threads \(([\d.]+)×")
    bf1, f1, bf2 = ("bf16", 1, 1024), ("f16", 1, 1024), ("bf16", 2, 4096)

    def pair(cell):
        return [round(ms[("sinklab", "stream-default", *cell)], 1), round(ms[("llama.cpp", "plain", *cell)], 1)]

    ratio = [round(ms[("sinklab", "stream-default", *c)] / ms[("llama.cpp", "plain", *c)], 2) for c in (bf1, bf2)]
    assert pair(bf1) + [ratio[0], round(ms[("sinklab", "stream", *bf1)], 1)] + pair(f1) + pair(bf2) + [ratio[1]] == quoted
    assert all(r["compiled"] for r in rows if r["method"] == "stream-default")  # the default did compile
