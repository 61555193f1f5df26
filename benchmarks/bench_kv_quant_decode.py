"""Decode speed of the packed KV cache against the full-precision one, at a given number of cached tokens.

One process, one thread by default. Each cache is filled with the same ``--cached`` tokens (chunks of 512), then
the caches decode one token in turn, ``--steps`` rounds (so load changes hit every cache alike); the first two
rounds are warm-up. Caches: transformers' ``DynamicCache`` in the model's dtype (``full``), and sinklab's
``quantized_sink_cache`` at each ``--bits`` with the first 4 tokens protected (``kv-quant``'s ``first``
protection; the decode cost does not depend on which tokens are protected). Prints the table and writes
``benchmarks/results/bench_kv_quant_decode_<model>.json``. Not a test.

    python benchmarks/bench_kv_quant_decode.py [--model builtin:smollm2] [--cached 1024 4096] [--bits 4 2]
        [--steps 24] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
from transformers import DynamicCache

import sinklab
from sinklab.kvquant.layer import quantized_sink_cache
from sinklab.kvquant.plan import Protection

from _common import RESULTS, print_table, run_metadata, write_result  # noqa: E402


def fill(model, make, ids: torch.Tensor):
    cache = make()
    with torch.no_grad():
        for i in range(0, ids.shape[1], 512):
            model(input_ids=ids[:, i:i + 512], past_key_values=cache, use_cache=True)
    return cache


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="builtin:smollm2")
    ap.add_argument("--cached", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--bits", type=int, nargs="+", default=[4, 2])
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = sinklab.load_model(args.model).model.eval()
    rows = []
    for n in args.cached:
        ids = torch.randint(100, model.config.vocab_size - 100, (1, n), generator=torch.Generator().manual_seed(n))
        makers = {"full": lambda: DynamicCache(config=model.config)}
        for bits in args.bits:
            makers[f"{bits}-bit"] = lambda b=bits: quantized_sink_cache(model, b, Protection(first=4))
        caches = {name: fill(model, make, ids) for name, make in makers.items()}
        token = torch.tensor([[1234]])
        times: dict[str, list[float]] = {name: [] for name in caches}
        with torch.no_grad():
            for _ in range(args.steps):
                for name, cache in caches.items():
                    start = time.perf_counter()
                    model(input_ids=token, past_key_values=cache, use_cache=True)
                    times[name].append(time.perf_counter() - start)
        full = statistics.median(times["full"][2:])
        for name, t in times.items():
            ms = 1000 * statistics.median(t[2:])
            rows.append({"cached": n, "cache": name, "ms_per_token": ms, "ratio_to_full": ms / (1000 * full),
                         "min_ms": 1000 * min(t[2:]), "max_ms": 1000 * max(t[2:])})
        del caches
    print_table(rows, {"cached": "cached", "cache": "cache", "ms_per_token": "ms/token", "ratio_to_full": "× full",
                       "min_ms": "min ms", "max_ms": "max ms"}, digits=3)
    name = args.model.split(":")[-1].split("/")[-1].replace(".gguf", "")
    out = args.out or RESULTS / f"bench_kv_quant_decode_{name}.json"
    write_result(out.resolve(), {"model": args.model, "threads": args.threads, "steps": args.steps,
                                 "load_avg": os.getloadavg(), "rows": rows, "meta": run_metadata(model=args.model)})


if __name__ == "__main__":
    main()
