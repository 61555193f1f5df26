"""Prefill cost of a SinkCache against a DynamicCache, and the stream's decode cost after it.

One process, one thread by default; rounds interleave the methods so that load changes hit both. Per round:
a DynamicCache prefill of ``--tokens`` tokens, a SinkCache(num_sinks, window) prefill of the same tokens
(logits compared with the dense prefill where nothing was evicted yet), then ``--decode`` greedy decode steps
through each cache. CPU seconds (``time.process_time``) and wall seconds; the medians go to the table and to
``benchmarks/results/bench_prefill_<model>.json``.

    python benchmarks/bench_prefill.py --model builtin:smollm2 --tokens 1023 --sinks 4 --window 1020
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
from _common import print_table, run_metadata, write_result
from transformers import DynamicCache

import sinklab


def timed(fn):
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - wall, time.process_time() - cpu


def one_round(model, prompt: torch.Tensor, args) -> dict:
    row = {}
    for name in ("dynamic", "sinkcache"):
        cache = DynamicCache(config=model.config) if name == "dynamic" else sinklab.SinkCache(
            model, num_sinks=args.sinks, window=args.window)
        with torch.no_grad():
            out, wall, cpu = timed(lambda: model(prompt, cache=cache, use_cache=True))  # noqa: B023 - called at once
            row[f"{name}_prefill_wall_s"], row[f"{name}_prefill_cpu_s"] = wall, cpu
            row[f"{name}_logits"] = out.logits[0, -1].double()
            token = out.logits[:, -1:].argmax(-1)
            walls, cpus = [], []
            for _ in range(args.decode):
                step, wall, cpu = timed(lambda: model(token, cache=cache, use_cache=True))  # noqa: B023 - called at once
                token = step.logits[:, -1:].argmax(-1)
                walls.append(wall)
                cpus.append(cpu)
            row[f"{name}_decode_ms_wall"] = 1000 * statistics.median(walls)
            row[f"{name}_decode_ms_cpu"] = 1000 * statistics.median(cpus)
        if name == "sinkcache":
            cache.close()
    row["max_abs_logit_diff"] = float((row.pop("dynamic_logits") - row.pop("sinkcache_logits")).abs().max())
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:smollm2")
    parser.add_argument("--tokens", type=int, default=1023)
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--window", type=int, default=1020)
    parser.add_argument("--decode", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = sinklab.load_model(args.model).model
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (1, args.tokens), generator=torch.Generator().manual_seed(3))
    one_round(model, prompt[:, :64], argparse.Namespace(**{**vars(args), "decode": 2}))  # warm-up
    rows = [one_round(model, prompt, args) for _ in range(args.rounds)]
    med = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
    ratio = med["sinkcache_prefill_cpu_s"] / med["dynamic_prefill_cpu_s"]
    print(f"{args.model}: {args.tokens}-token prefill, S={args.sinks} W={args.window}, {args.threads} thread(s), "
          f"{args.rounds} rounds, load {os.getloadavg()[0]:.1f}")
    print_table([{"cache": name, **{k: med[f"{name}_{k}"] for k in ("prefill_wall_s", "prefill_cpu_s",
                                                                     "decode_ms_wall", "decode_ms_cpu")}}
                 for name in ("dynamic", "sinkcache")],
                {"cache": "cache", "prefill_wall_s": "prefill wall s", "prefill_cpu_s": "prefill CPU s",
                 "decode_ms_wall": "decode ms/token wall", "decode_ms_cpu": "decode ms/token CPU"}, digits=3)
    print(f"SinkCache / DynamicCache prefill (CPU s): {ratio:.2f}x (goal <= 1.5x); "
          f"max |logit diff| at the last prompt token {med['max_abs_logit_diff']:.2e}")
    out = args.out or Path(__file__).parent / "results" / f"bench_prefill_{args.model.split(':')[-1]}.json"
    write_result(out.resolve(), {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                                 "load": os.getloadavg(), "rounds": rows, "median": med, "prefill_ratio_cpu": ratio,
                                 "meta": run_metadata(model=args.model)})


if __name__ == "__main__":
    main()
