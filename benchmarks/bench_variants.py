"""Benchmark: training-step time of each sink-aware attention variant vs plain SDPA at equal size.

Llama-style model (d 256, 4 layers, 4 heads, vocab 1024), batch 8 × 256 tokens, AdamW; steps are
interleaved across variants and repeated (this machine is noisy); median step time per variant and its
ratio to plain SDPA. Prints a table and writes benchmarks/results/bench_variants.json. Not a test.

    python benchmarks/bench_variants.py [--steps 20] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _common import print_table, run_metadata, write_result

VARIANTS = [None, "sink-logit", "softmax1", "kv-bias", "gated", "gated-headwise", "registers", "sink-logit+gated"]


def make(variant: str | None):
    import transformers

    from sinklab.variants import apply_variant

    cfg = transformers.LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                                   num_attention_heads=4, max_position_embeddings=1024)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    if variant:
        apply_variant(model, variant)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()
    models = {v or "plain-sdpa": make(v) for v in VARIANTS}
    batch = torch.randint(0, 1024, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(0))
    times: dict[str, list[float]] = {k: [] for k in models}
    for rnd in range(args.rounds):
        for name, (model, opt) in (models.items() if rnd % 2 == 0 else reversed(list(models.items()))):
            for step in range(args.steps + 1):
                t0 = time.perf_counter()
                loss = model(input_ids=batch, labels=batch, use_cache=False).loss
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                if step:  # the first step of each block warms caches up
                    times[name].append(time.perf_counter() - t0)
        print(f"  round {rnd + 1}/{args.rounds} done", flush=True)
    base = statistics.median(times["plain-sdpa"])
    rows = []
    for name, ts in times.items():
        med = statistics.median(ts)
        rows.append({"variant": name, "median_ms": med * 1e3, "ratio": med / base, "steps": len(ts)})
    print_table(rows, {"variant": "variant", "median_ms": "median step (ms)", "ratio": "× plain SDPA"}, digits=3)
    write_result("bench_variants.json", {"benchmark": "variants", "meta": run_metadata(), "config": vars(args),
                                         "rows": rows})


if __name__ == "__main__":
    main()
