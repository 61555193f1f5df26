"""Measurements for ``benchmarks/gating.py``: each trained Qwen3-Next run (gated / ungated, per seed) on held-out text.

Per run (final checkpoint): first-token attention share, Sink_1^ε, the largest activation, held-out perplexity, the
streamed perplexity with 4 sinks + 60 recent vs 0 sinks + 64 recent (the same 64-token KV budget, positions by cache
slot), the output gate on sink-routed queries vs elsewhere, and the P0-circuit stage at every monitor step.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from _common import run_metadata, write_result

import sinklab
from sinklab.evaluation.stream import recompute_nll, stream_nll
from sinklab.report.figures import save_png

SCAN = dict(seq_len=64, samples=32, batch_size=16)
STREAM_TOKENS = 2048
BUDGET = 64  # KV slots, the length the models were trained at


def _heldout_ids(tokenizer, held: Path, n: int) -> torch.Tensor:
    text = " ".join(held.read_text(encoding="utf-8").split("\n\n"))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][: n - 1]
    return torch.tensor([tokenizer.bos_token_id, *ids], dtype=torch.long)


def _stages(run: Path) -> list[dict]:
    out = []
    for line in (run / "monitor.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out.append({"step": rec["step"], "tokens": rec["tokens"], "stage": rec.get("stage"),
                    "sink_rate_0": rec.get("sink_rate_0"), "loss": rec.get("loss")})
    return out


def measure_run(run: Path, held: Path) -> dict:
    loaded = sinklab.load_model(str(run / "final"))
    model, tokenizer = loaded.model, loaded.tokenizer
    model.eval()
    paragraphs = [p for p in held.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    result = sinklab.scan(model, tokenizer, paragraphs, **SCAN)
    attn = result.attention_layers
    first = result.candidate_attention[:, attn, :, 1:, 0]  # queries ≥ 1 → position 0
    hidden = result.hidden_max_abs[:, 1:]  # block outputs
    gates = result.gate_statistics()
    ids = _heldout_ids(tokenizer, held, STREAM_TOKENS)
    positions = torch.arange(BUDGET, ids.numel() - 1)
    with torch.no_grad():
        dense = recompute_nll(model, ids, positions, BUDGET)  # a fresh 64-token window per scored token
        s4 = stream_nll(model, ids, positions, 4, BUDGET - 4)
        s0 = stream_nll(model, ids, positions, 0, BUDGET)
    ppl = lambda nll: float(torch.exp(nll.double().mean()))  # noqa: E731
    config = json.loads((run / "train_config.json").read_text())
    summary = json.loads((run / "summary.json").read_text())
    return {
        "run": run.name, "output_gate": config["output_gate"], "seed": config["seed"], "steps": config["steps"],
        "tokens": summary["tokens"], "train_seconds": summary["seconds"], "final_loss": summary["final_loss"],
        "first_token_share": float(first.double().nanmean()),
        "sink_rate_0": result.sink_rate(0),
        "sink_rate_0_per_layer": [float(x) for x in result.sink_rate_per_layer(0)],
        "max_activation": float(hidden.double().nan_to_num(0).max()),
        "ppl_heldout_window64": ppl(dense),
        "ppl_stream_4_sinks": ppl(s4),
        "ppl_stream_0_sinks": ppl(s0),
        "gate_on_sink": None if gates is None else float(gates["gate_on_sink"][attn].nanmean()),
        "gate_elsewhere": None if gates is None else float(gates["gate_elsewhere"][attn].nanmean()),
        "stages": _stages(run),
    }


def _mean_sd(values: list[float]) -> str:
    vals = [v for v in values if v is not None and v == v]
    if not vals:
        return "–"
    m = sum(vals) / len(vals)
    sd = math.sqrt(sum((v - m) ** 2 for v in vals) / (len(vals) - 1)) if len(vals) > 1 else 0.0
    return f"{m:.3g} ± {sd:.2g}"


COLUMNS = (("first_token_share", "first-token share"), ("sink_rate_0", "Sink_1^ε %"),
           ("max_activation", r"max \|a\|"), ("ppl_heldout_window64", "ppl (64-token windows)"),
           ("ppl_stream_4_sinks", "stream ppl, 4 sinks"), ("ppl_stream_0_sinks", "stream ppl, 0 sinks"),
           ("gate_on_sink", "gate on sink-routed q"), ("gate_elsewhere", "gate elsewhere"))


def table(rows: list[dict]) -> str:
    lines = ["| model | " + " | ".join(t for _, t in COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    for gated in (True, False):
        mine = [r for r in rows if r["output_gate"] == gated]
        if mine:
            name = f"{'gated' if gated else 'ungated'} ({len(mine)} seed{'s' if len(mine) > 1 else ''})"
            lines.append(f"| {name} | " + " | ".join(_mean_sd([r[k] for r in mine]) for k, _ in COLUMNS) + " |")
    return "\n".join(lines)


def stage_table(rows: list[dict]) -> str:
    lines = ["| run | stage sequence (step: stage) | layer-0 Sink_1^ε % at the end |", "|---|---|---|"]
    for r in rows:
        seq, last = [], None
        for s in r["stages"]:
            if s["stage"] != last:
                seq.append(f"{s['step']}: {s['stage']}")
                last = s["stage"]
        end = r["stages"][-1]["sink_rate_0"][0] if r["stages"] and r["stages"][-1]["sink_rate_0"] else None
        lines.append(f"| {r['run']} | {' → '.join(seq)} | {end if end is None else f'{end:.0f}'} |")
    return "\n".join(lines)


def figure(rows: list[dict], path: Path) -> None:
    """Gated vs ungated, one dot per seed: first-token share, Sink_1^ε, largest activation, stream ppl 0 / 4 sinks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (("first_token_share", "first-token attention share"), ("sink_rate_0", "Sink_1^ε (% of heads)"),
              ("max_activation", "largest activation |a|"), (None, "stream ppl ÷ 64-token-window ppl"))
    fig, axes = plt.subplots(1, 4, figsize=(13, 3.2))
    for ax, (key, title) in zip(axes, panels):
        for x, gated in enumerate((False, True)):
            mine = [r for r in rows if r["output_gate"] == gated]
            colour = "tab:green" if gated else "tab:red"
            if key is None:
                for dx, (k, marker) in ((-0.12, ("ppl_stream_0_sinks", "v")), (0.12, ("ppl_stream_4_sinks", "^"))):
                    ys = [r[k] / r["ppl_heldout_window64"] for r in mine]
                    ax.scatter([x + dx] * len(ys), ys, color=colour, marker=marker,
                               label=f"{'0' if '0_' in k else '4'} sinks" if gated else None)
            else:
                ys = [r[key] for r in mine]
                ax.scatter([x] * len(ys), ys, color=colour)
                if ys:
                    ax.hlines(sum(ys) / len(ys), x - 0.2, x + 0.2, color=colour)
        ax.set_xticks([0, 1], ["ungated", "gated"])
        ax.set_xlim(-0.6, 1.6)
        ax.set_title(title, fontsize=9)
        if key is None:
            ax.axhline(1.0, color="grey", lw=0.6)
            ax.legend(fontsize=7)
    fig.suptitle("Qwen3-Next trained with and without its output gate (same data, seeds, steps)", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_png(fig, path, dpi=110)
    plt.close(fig)


def measure_all(out: Path, held: Path, seeds: list[int], results: Path) -> list[dict]:
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    rows = []
    for seed in seeds:
        for gated in (True, False):
            run = out / f"{'gated' if gated else 'ungated'}-s{seed}"
            if (run / "final").exists():
                rows.append(measure_run(run, held))
                print(f"measured {run.name}", flush=True)
    meta = run_metadata(scan=SCAN, stream_tokens=STREAM_TOKENS, kv_budget=BUDGET)
    write_result(results.resolve(), {"meta": meta, "rows": rows}, quiet=True)
    figure(rows, results.parent.parent.parent / "docs" / "img" / f"{results.stem}.png")
    print(table(rows))
    print()
    print(stage_table(rows))
    return rows
