"""The eager decode step of two sinklab trees, side by side, against the DynamicCache floor.

    python benchmarks/ab_stream_eager.py --before /path/to/old/src [--after src] [--windows 1020 2044]
        [--rounds 4] [--tokens 2000] [--json bench_stream_eager_ab.json]

Runs ``benchmarks/_stream_worker.py`` (the tiny Llama and token stream of ``bench_stream.py``; run that once
first, it writes them under ``benchmarks/results/``) with ``PYTHONPATH`` set to each tree in turn, plus the
``dynamic-floor`` method, in interleaved rounds (order reversed every other round), one thread per process.
Prints the median ms per token and each tree's ratio to the floor; writes the JSON under ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

from _common import run_metadata, write_result
from bench_stream import RESULTS, run_worker

FILES = {"weights": RESULTS / "stream_model.safetensors", "stream": RESULTS / "stream_tokens.json"}


def run(method: str, src: str, window: int, tokens: int) -> list[float]:
    out = run_worker(Path(sys.executable), method, FILES, window, tokens, src=Path(src))
    if out is None:
        raise SystemExit(f"{method} from {src} failed at W={window} (its error is printed above)")
    return out["ms"]


def commit_of(src: str) -> str | None:
    """The git commit a source tree is checked out at (None outside a git checkout)."""
    done = subprocess.run(["git", "-C", src, "rev-parse", "HEAD"], capture_output=True, text=True, check=False)
    return done.stdout.strip() or None if done.returncode == 0 else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, help="the src/ folder of the tree to compare against")
    ap.add_argument("--after", default=str(Path(__file__).resolve().parent.parent / "src"),
                    help="the src/ folder measured (default: this tree)")
    ap.add_argument("--windows", type=int, nargs="+", default=[1020, 2044])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--json", default="bench_stream_eager_ab.json")
    args = ap.parse_args()
    for path in FILES.values():
        if not path.exists():
            raise SystemExit(f"benchmarks/results/{path.name} is missing: run benchmarks/bench_stream.py once first")
    trees = {"before": args.before, "after": args.after, "floor": args.after}
    out = {}
    print("| S + W | before ms | after ms | DynamicCache floor ms | before ÷ floor | after ÷ floor |")
    print("|---|---|---|---|---|---|")
    for window in args.windows:
        ms: dict[str, list[float]] = {k: [] for k in trees}
        for rnd in range(args.rounds):
            for name in (list(trees) if rnd % 2 == 0 else list(reversed(trees))):
                ms[name] += run("dynamic-floor" if name == "floor" else "sinklab", trees[name], window, args.tokens)
        med = {k: statistics.median(v) for k, v in ms.items()}
        ratio = {k: med[k] / med["floor"] for k in ("before", "after")}
        out[window] = {"median_ms": med, "vs_floor": ratio, "tokens": len(ms["after"])}
        print(f"| {4 + window} | {med['before']:.2f} | {med['after']:.2f} | {med['floor']:.2f} | "
              f"{ratio['before']:.3f}× | {ratio['after']:.3f}× |", flush=True)
    trees_out = {k: {"src": trees[k], "commit": commit_of(trees[k])} for k in ("before", "after")}
    write_result(args.json, {"trees": trees_out, "rounds": args.rounds, "windows": out, "meta": run_metadata()})


if __name__ == "__main__":
    main()
