"""Benchmark: peak RSS and wall time of `sinklab` scan vs a plain SDPA forward vs eager output_attentions.

Tiny Llama-style model (d 256, 4 layers, 4 heads, random weights), one sample of T tokens, T in
{512, 2048, 8192}. Every measurement runs in its own subprocess so peak RSS (ru_maxrss) is clean.
Prints a table and writes benchmarks/results/bench_scan.json. Not a test: numbers depend on the machine.

    python benchmarks/bench_scan.py [--lengths 512 2048 8192] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

MODES = ("plain-sdpa", "sinklab-scan", "eager-attentions")


def _model(attn: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=16384)
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


def worker(mode: str, length: int, repeats: int) -> dict:
    import torch

    torch.set_num_threads(max(1, torch.get_num_threads()))
    ids = torch.randint(0, 1024, (1, length), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    times = []
    if mode == "sinklab-scan":
        import sinklab

        model = _model("sdpa")
        for _ in range(repeats):
            t0 = time.perf_counter()
            sinklab.scan_inputs(model, [{"input_ids": ids, "attention_mask": mask}], [[""] * length])
            times.append(time.perf_counter() - t0)
    else:
        model = _model("sdpa" if mode == "plain-sdpa" else "eager")
        with torch.no_grad():
            for _ in range(repeats):
                t0 = time.perf_counter()
                model.model(input_ids=ids, attention_mask=mask, use_cache=False,
                            output_attentions=mode == "eager-attentions")
                times.append(time.perf_counter() - t0)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"mode": mode, "T": length, "seconds": min(times), "peak_rss_mb": peak_mb}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--worker", nargs=2, metavar=("MODE", "T"))
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker[0], int(args.worker[1]), args.repeats)))
        return
    rows = []
    for length in args.lengths:
        for mode in MODES:
            out = subprocess.run([sys.executable, __file__, "--worker", mode, str(length), "--repeats", str(args.repeats)],
                                 capture_output=True, text=True, check=True)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"  {mode:17s} T={length:5d}: {rows[-1]['seconds']:7.2f} s  {rows[-1]['peak_rss_mb']:8.0f} MB", flush=True)
    print("\n| T | mode | time (s) | peak RSS (MB) | time / plain | RSS / plain |")
    print("|---|---|---|---|---|---|")
    for length in args.lengths:
        base = next(r for r in rows if r["T"] == length and r["mode"] == "plain-sdpa")
        for r in (r for r in rows if r["T"] == length):
            r["time_ratio"] = r["seconds"] / base["seconds"]
            r["rss_ratio"] = r["peak_rss_mb"] / base["peak_rss_mb"]
            print(f"| {length} | {r['mode']} | {r['seconds']:.2f} | {r['peak_rss_mb']:.0f} | "
                  f"{r['time_ratio']:.2f}× | {r['rss_ratio']:.2f}× |")
    import torch
    import transformers

    result = {"benchmark": "scan", "machine": {"platform": platform.platform(), "python": platform.python_version(),
              "torch": torch.__version__, "transformers": transformers.__version__, "threads": torch.get_num_threads()},
              "rows": rows}
    path = Path(__file__).parent / "results" / "bench_scan.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
