"""Benchmark: SinkCache decoding of SmolLM2-135M with each variant applied vs the bare model.

builtin:smollm2 (the real weights, no download), one thread, S 4 + W 252, a 16-token prompt then greedy
decoding; per-token time of ``StreamSession.step`` after 20 warm-up tokens, rounds interleaved across the
variants (this machine is noisy); median, p90 and the ratio to the bare model. Variants start at
``init="off"`` (identity for the gate and sink logit; the zero kv-bias slot is softmax₁): the cost of the
variant's maths, not of different text. Prints a table and writes benchmarks/results/bench_variant_stream.json.

    python benchmarks/bench_variant_stream.py [--tokens 120] [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _common import print_table, run_metadata, write_result

VARIANTS = [None, "sink-logit", "gated", "kv-bias", "kv-bias+gated", "gated+registers"]
PROMPT = "The old lighthouse keeper climbed the stairs every evening to light the lamp."


def decode_times(model, ids: torch.Tensor, tokens: int, warmup: int = 20) -> list[float]:
    import sinklab

    times = []
    with torch.no_grad(), sinklab.StreamSession(model, num_sinks=4, window=252) as s:
        last = s.feed(ids)[:, -1].argmax(-1)
        for _ in range(tokens + warmup):
            t = time.perf_counter()
            last = s.step(last).argmax(-1)
            times.append(time.perf_counter() - t)
    return times[warmup:]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=120)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    import sinklab
    from sinklab.variants import apply_variant

    torch.set_num_threads(1)
    loaded = sinklab.load_model("builtin:smollm2")
    model = loaded.model
    ids = torch.tensor([loaded.tokenizer(PROMPT)["input_ids"]])
    times: dict[str, list[float]] = {str(v): [] for v in VARIANTS}
    for _ in range(args.rounds):
        for v in VARIANTS:
            handle = apply_variant(model, v, init="off") if v else None
            times[str(v)] += decode_times(model, ids, args.tokens)
            if handle is not None:
                handle.remove()
    base = statistics.median(times["None"])
    rows = []
    for v in VARIANTS:
        t = sorted(times[str(v)])
        med, p90 = statistics.median(t), t[int(0.9 * (len(t) - 1))]
        rows.append({"variant": v or "bare", "median_ms": 1000 * med, "p90_ms": 1000 * p90, "ratio": med / base})
    print_table(rows, {"variant": "variant", "median_ms": "median ms/token", "p90_ms": "p90 ms", "ratio": "× bare"},
                digits=3)
    write_result("bench_variant_stream.json", {"meta": run_metadata(model="builtin:smollm2"), "tokens": args.tokens,
                                               "rounds": args.rounds, "window": 252, "num_sinks": 4, "rows": rows})


if __name__ == "__main__":
    main()
