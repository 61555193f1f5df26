"""``StreamSession(compile=False)`` — what ``--eager`` runs — on two sinklab trees, side by side (SmolLM2, F32).

    python benchmarks/ab_session_eager.py --before /path/to/old/src [--after src] [--cached 1024] [--rounds 4]
        [--steps 32] [--threads 1] [--json ab_session_eager.json]

Each measurement is a fresh process with ``PYTHONPATH`` set to one tree: ``builtin:smollm2`` loaded, a
``StreamSession(model, num_sinks=4, window=cached − 4, compile=False)`` fed ``cached`` pseudo-random tokens (the
cache full: every step evicts one), two warm-up steps, then ``steps`` timed steps; the median ms per step.
Rounds alternate the trees (order reversed every other round: the machine is shared). Prints the medians and
the ratio after ÷ before; writes the JSON under ``benchmarks/results/``. Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import RESULTS, markdown_table, run_metadata, write_result  # noqa: E402

WORKER = """
import json, statistics, sys
import torch
import sinklab
from sinklab.stream import StreamSession
sys.path.insert(0, sys.argv[4])
from _common import greedy_steps
cached, steps, threads = (int(a) for a in sys.argv[1:4])
torch.set_num_threads(threads)
model = sinklab.load_model("builtin:smollm2").model.eval()
prompt = torch.randint(10, model.config.vocab_size - 1, (1, cached), generator=torch.Generator().manual_seed(0))
with torch.no_grad(), StreamSession(model, num_sinks=4, window=cached - 4, compile=False) as s:
    _, ms = greedy_steps(s, s.feed(prompt), steps, warm=2)
print(json.dumps({"ms": statistics.median(ms)}))
"""


def measure(src: str, cached: int, steps: int, threads: int) -> float:
    env = {**os.environ, "PYTHONPATH": src, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.run([sys.executable, "-c", WORKER, str(cached), str(steps), str(threads), str(HERE)], env=env,
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"the worker failed on {src}: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])["ms"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, help="the src/ folder of the tree to compare against")
    ap.add_argument("--after", default=str(HERE.parent / "src"))
    ap.add_argument("--cached", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default="ab_session_eager.json")
    args = ap.parse_args()
    trees = {"before": args.before, "after": args.after}
    ms: dict[str, list[float]] = {"before": [], "after": []}
    for r in range(args.rounds):
        for name in (("before", "after") if r % 2 == 0 else ("after", "before")):
            ms[name].append(measure(trees[name], args.cached, args.steps, args.threads))
            print(f"round {r} {name}: {ms[name][-1]:.1f} ms", flush=True)
    med = {k: statistics.median(v) for k, v in ms.items()}
    rows = [{"tree": k, "src": trees[k], "median ms/step": med[k], "rounds": ", ".join(f"{x:.1f}" for x in ms[k])}
            for k in ms]
    print(markdown_table(rows, digits=4))
    print(f"after ÷ before: {med['after'] / med['before']:.3f}")
    write_result(RESULTS / args.json, {"benchmark": "ab-session-eager", "model": "builtin:smollm2",
                                       "cached": args.cached, "steps": args.steps, "threads": args.threads,
                                       "ms": ms, "median_ms": med, "ratio_after_before": med["after"] / med["before"],
                                       "load_average": os.getloadavg(), "meta": run_metadata()}, quiet=True)


if __name__ == "__main__":
    main()
