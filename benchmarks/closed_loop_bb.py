"""The closed loop on Bigram-Backcopy, several seeds: diagnose → recommend → train the fix → diagnose.

Usage: ``python benchmarks/closed_loop_bb.py --steps 800 --seeds 0,1,2 --out runs/closed_loop`` (trained runs
in ``--out`` are reused when their config matches). Writes ``closed_loop_bb_<steps>.json`` and ``.png``
into ``--results`` (default ``benchmarks/results``) and prints a markdown table.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from _common import write_result

from sinklab.closed_loop import bb_closed_loop
from sinklab.train import TrainConfig
from sinklab.report.figures import save_png


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--out", type=Path, default=Path("runs/closed_loop"))
    ap.add_argument("--results", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        cfg = TrainConfig(data="bb", layers=1, heads=1, width=args.width, seq_len=args.seq_len, batch=32,
                          steps=args.steps, lr=3e-3, warmup=min(100, args.steps // 5),
                          monitor_every=max(1, args.steps // 5), seed=seed)
        r = bb_closed_loop(cfg, args.out / f"{args.steps}_{args.width}_{args.seq_len}_{seed}", reuse=True)
        r.pop("diagnoses")
        rows.append(r)
    write_result((args.results / f"closed_loop_bb_{args.steps}.json").resolve(), rows)
    print("| seed | fix (confidence) | run | loss | BOS attn (non-trigger) | r_out BOS | sinks | NOP / bc / unclass. | NOP-valued | at BOS |")
    print("|---|---|---|---:|---:|---:|---:|---|---:|---:|")
    for r in rows:
        for name, run in r["runs"].items():
            s, bb = run["sinks"], run["bb"]
            c = s["by_class"]
            print(f"| {r['config']['seed']} | {r['fix']} ({r['recommendation']['confidence']}) | {name} | "
                  f"{run['train']['final_loss']:.3f} | {bb['bos_attention_non_trigger']:.3f} | "
                  f"{bb['bos_value_norm_ratio_out']:.2f} | {s['sinks']} | {c['nop']} / {c['broadcast']} / "
                  f"{c['unclassified']} | {s['nop_valued_sinks']} | {s['sinks_at_bos']} |")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.2))
    labels = [f"s{r['config']['seed']}" for r in rows]
    xs = range(len(rows))
    for ax, key, title in ((axes[0], "nop_valued_sinks", "NOP-valued sinks (r_out ≤ 0.35)"),
                           (axes[1], "sinks_at_bos", "sinks on BOS")):
        ax.bar([x - 0.2 for x in xs], [r["runs"]["baseline"]["sinks"][key] for r in rows], 0.4, label="baseline")
        ax.bar([x + 0.2 for x in xs], [r["runs"].get("fixed", r["runs"]["baseline"])["sinks"][key] for r in rows], 0.4,
               label="recommended fix")
        ax.set_title(title, fontsize=9)
        ax.set_xticks(list(xs), labels)
    axes[2].bar([x - 0.2 for x in xs], [r["runs"]["baseline"]["bb"]["bos_attention_non_trigger"] for r in rows], 0.4,
                label="baseline")
    axes[2].bar([x + 0.2 for x in xs], [r["runs"].get("fixed", r["runs"]["baseline"])["bb"]["bos_attention_non_trigger"]
                                        for r in rows], 0.4, label="recommended fix")
    axes[2].set_title("attention to BOS from non-trigger queries", fontsize=9)
    axes[2].set_xticks(list(xs), labels)
    axes[2].legend(fontsize=7)
    fig.suptitle(f"closed loop on Bigram-Backcopy ({args.steps} steps, fix: {', '.join(sorted({r['fix'] for r in rows}))})",
                 fontsize=10)
    fig.tight_layout()
    save_png(fig, args.results / f"closed_loop_bb_{args.steps}.png", dpi=110)


if __name__ == "__main__":
    main()
