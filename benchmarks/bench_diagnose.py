"""Benchmark: `sinklab diagnose` vs `sinklab scan` on the same model and inputs, both as CLI runs.

Goal (issue 9 §2): with the defaults, `sinklab diagnose builtin:smollm2` takes ≤ 5× the wall time of
`sinklab scan builtin:smollm2` (model load included, converted-weights cache warm, same run) and peaks
at ≤ 1.5× its memory. Each command runs in its own process (`python -m sinklab.cli …`), measured with
``os.wait4`` (wall time and that child's peak RSS); scan and diagnose alternate for ``--repeats`` rounds
and the table reports medians. Prints a table and writes benchmarks/results/bench_diagnose.json. Not a
test: numbers depend on the machine and on what else runs on it.

    python benchmarks/bench_diagnose.py [--model builtin:smollm2] [--repeats 2] [--samples 16] [--seq-len 64]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import RESULTS, run_metadata, write_result


def run(cmd: list[str]) -> dict:
    """Wall seconds, CPU seconds (user + system: steadier than wall on a shared machine) and peak RSS (MiB)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.decode(errors='replace')[-3000:]}")
    return {"wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime, "peak_rss_mib": usage.ru_maxrss / 1024}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="builtin:smollm2")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--keep", type=Path, default=None, help="keep the scan/diagnose outputs in this folder")
    args = ap.parse_args()
    cli = [sys.executable, "-c", "import sys; from sinklab.cli import app; sys.argv[0] = 'sinklab'; app()"]
    common = [args.model, "--samples", str(args.samples), "--seq-len", str(args.seq_len)]
    rows: dict[str, list[dict]] = {"scan": [], "diagnose": []}
    with tempfile.TemporaryDirectory() as scratch:
        tmp = str(args.keep) if args.keep else scratch
        run(cli + ["scan", *common, "--out", f"{tmp}/warm"])  # warm the converted-weights cache and the OS cache
        for i in range(args.repeats):
            for command in ("scan", "diagnose"):
                rows[command].append(run(cli + [command, *common, "--out", f"{tmp}/{command}{i}"]))
                print(f"round {i + 1} {command}: {rows[command][-1]['wall_s']:.1f} s wall, "
                      f"{rows[command][-1]['cpu_s']:.1f} s CPU, "
                      f"{rows[command][-1]['peak_rss_mib']:.0f} MiB", flush=True)
            diag = json.loads(Path(f"{tmp}/diagnose{i}/diagnosis.json").read_text())
    keys = ("wall_s", "cpu_s", "peak_rss_mib")
    summary = {c: {k: statistics.median(r[k] for r in rows[c]) for k in keys} for c in rows}
    ratio = {k: summary["diagnose"][k] / summary["scan"][k] for k in keys}
    print(f"\n{args.model}: {args.samples} samples × {args.seq_len} tokens, CLI defaults, median of {args.repeats}")
    print(f"{'command':<10}{'wall s':>10}{'CPU s':>10}{'peak RSS MiB':>15}")
    for c in rows:
        print(f"{c:<10}{summary[c]['wall_s']:>10.1f}{summary[c]['cpu_s']:>10.1f}{summary[c]['peak_rss_mib']:>15.0f}")
    print(f"{'ratio':<10}{ratio['wall_s']:>9.2f}×{ratio['cpu_s']:>9.2f}×{ratio['peak_rss_mib']:>14.2f}×"
          "   (goal ≤ 5× wall, ≤ 1.5× memory)")
    print(f"edited heads: {len(diag['edits'])} × {len(diag['edits'][0]['hidden']) if diag['edits'] else 0} edits "
          f"on {diag['meta'].get('edit_samples')} samples")
    write_result(RESULTS / "bench_diagnose.json", {
        "model": args.model, "samples": args.samples, "seq_len": args.seq_len, "repeats": args.repeats,
        "runs": rows, "median": summary, "ratio": ratio, "goal": {"wall_s": 5.0, "peak_rss_mib": 1.5},
        "edited_heads": len(diag["edits"]), "edit_samples": diag["meta"].get("edit_samples"),
        "meta": run_metadata(model=args.model, load_avg_at_end=os.getloadavg()),
    })


if __name__ == "__main__":
    main()
