"""Benchmark: what a user waits for with ``sinklab stream`` and no flags — the first run (the compile), later runs
(the compile cache), and ``--eager`` — each in a fresh process, as a user starts it.

    python benchmarks/bench_first_token.py [--model builtin:smollm2] [--max-new-tokens 16] [--rounds 3]
                                           [--threads 1]

Each run is ``python -m sinklab stream MODEL --prompt … --max-new-tokens N [--eager]`` with ``$SINKLAB_COMPILE``
unset (the default path) and ``$TORCHINDUCTOR_CACHE_DIR`` a fresh folder for this benchmark (so the first default
run is cold whatever the machine compiled before; a user's runs use ``<sinklab cache>/inductor``). Timed from
the process start, reading its stdout as the tokens are printed:

* ``first token`` — the first printed piece (import, model load, prompt prefill; the decode step is not compiled
  yet, so this is the same with and without the compile);
* ``second token`` — the first decoded step: the compile on a cold run, the cache load on a warm one;
* ``total`` — the process's whole run for N tokens;
* ``ms/token`` — decode time per token after the second token (printed pieces to the last one);
* ``compile`` — what the progress line said the first compiled step took, and whether the cache served it.

Rounds: one cold default run, then warm default and eager runs alternated (the machine is shared). Writes
``benchmarks/results/bench_first_token.json`` and prints the table. Not a test.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import RESULTS, ROOT, markdown_table, run_metadata, write_result  # noqa: E402

PROMPT = "The capital of France is"
COMPILE_LINE = re.compile(r"\[sinklab: decode step (compiled|loaded from the compile cache) in ([\d.]+) s\]")
COUNT_LINE = re.compile(r"\[(\d+) tokens, ")


def run_once(model: str, prompt: str, max_new_tokens: int, eager: bool, cache_dir: Path, threads: int) -> dict:
    """One fresh ``sinklab stream`` process: the arrival time of each printed piece, its progress lines."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir), "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": str(threads)}
    env.pop("SINKLAB_COMPILE", None)
    cmd = [sys.executable, "-m", "sinklab", "stream", model, "--prompt", prompt, "--max-new-tokens",
           str(max_new_tokens)] + (["--eager"] if eager else [])
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    arrivals: list[float] = []
    err: list[bytes] = []

    def read_err() -> None:
        assert proc.stderr is not None
        err.append(proc.stderr.read())

    reader = threading.Thread(target=read_err)
    reader.start()
    assert proc.stdout is not None
    while True:
        chunk = os.read(proc.stdout.fileno(), 4096)
        if not chunk:
            break
        if chunk.strip():
            arrivals.append(time.perf_counter() - start)
    proc.wait()
    total = time.perf_counter() - start
    reader.join()
    stderr = b"".join(err).decode(errors="replace")
    if proc.returncode != 0:
        raise RuntimeError(f"sinklab stream failed ({proc.returncode}): {stderr[-2000:]}")
    counts = [int(m) for m in COUNT_LINE.findall(stderr)]
    tokens = counts[-1] if counts else len(arrivals)
    compiled = COMPILE_LINE.search(stderr)
    decode = (1e3 * (arrivals[-1] - arrivals[1]) / max(1, tokens - 2)) if len(arrivals) > 2 else None
    return {"path": "eager" if eager else "default", "first_token_s": arrivals[0] if arrivals else None,
            "second_token_s": arrivals[1] if len(arrivals) > 1 else None, "total_s": total, "tokens": tokens,
            "decode_ms_per_token": decode, "compile_s": float(compiled.group(2)) if compiled else None,
            "compile_from_cache": (compiled.group(1) != "compiled") if compiled else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="builtin:smollm2")
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3, help="warm default and eager runs, alternated")
    ap.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of each run (torch's intra-op threads)")
    ap.add_argument("--out", default=str(RESULTS / "bench_first_token.json"))
    args = ap.parse_args()

    t0 = time.perf_counter()
    load_before = os.getloadavg()
    runs = []
    with tempfile.TemporaryDirectory(prefix="sinklab-inductor-") as tmp:
        cache = Path(tmp)
        cold = run_once(args.model, args.prompt, args.max_new_tokens, False, cache, args.threads)
        runs.append({**cold, "kind": "cold"})
        print(f"cold default: {cold}", flush=True)
        for r in range(args.rounds):
            for eager in ((False, True) if r % 2 == 0 else (True, False)):
                run = run_once(args.model, args.prompt, args.max_new_tokens, eager, cache, args.threads)
                runs.append({**run, "kind": "eager" if eager else "warm", "round": r})
                print(f"round {r} {'eager' if eager else 'warm default'}: {run}", flush=True)
    rows = []
    for kind, label in (("cold", "default, first run (cold compile)"), ("warm", "default, later runs (cache)"),
                        ("eager", "--eager")):
        group = [r for r in runs if r["kind"] == kind]

        def med(key: str, group=group) -> float | None:
            values = [r[key] for r in group if r[key] is not None]
            return statistics.median(values) if values else None

        rows.append({"run": label, "runs": len(group), "first token (s)": med("first_token_s"),
                     "second token (s)": med("second_token_s"), "total (s)": med("total_s"),
                     "compile step (s)": med("compile_s"), "ms/token": med("decode_ms_per_token")})
    table = markdown_table(rows, list(rows[0]), digits=3)
    print(table)
    out = {"benchmark": "first-token", "model": args.model, "prompt": args.prompt,
           "max_new_tokens": args.max_new_tokens, "threads": args.threads, "rows": rows, "runs": runs,
           "load_before": load_before, "load_after": os.getloadavg(),
           "meta": run_metadata(model=args.model, wall_seconds=time.perf_counter() - t0)}
    write_result(Path(args.out).resolve(), out, quiet=True)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
