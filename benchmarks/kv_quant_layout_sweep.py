"""What the dense quantized cache's layout choices cost and buy: KL and bytes per token for plan overrides.

Runs :func:`sinklab.kvquant.evaluate.kv_quant` with the protocol of ``bench_kv_quant.py`` (two windows of
384 cached + 128 scored tokens, bits 4 and 2, protections ``none`` and ``detected``, no timing) once per JSON
dict of :class:`~sinklab.kvquant.evaluate.KvQuantPlan` overrides, and records median/p90 KL, top-1, PPL and
bytes per token over a 16-bit cache at 512, 1,024 and 4,096 cached tokens.
Writes ``benchmarks/results/kv_quant_layout_sweep_<model>.json``.

    python benchmarks/kv_quant_layout_sweep.py builtin:smollm2 '[{}, {"residual": 0}, {"residual": 16}]'
"""

from __future__ import annotations

import json
import sys
import time

import torch

from sinklab.kvquant.evaluate import KvQuantPlan, kv_quant
from sinklab.models import load_model
from sinklab.texts import default_texts

from _common import run_metadata, write_result  # noqa: E402


def main() -> None:
    name, configs = sys.argv[1], json.loads(sys.argv[2])
    torch.set_num_threads(1)
    loaded = load_model(name)
    text = "\n\n".join(default_texts())
    out = []
    for cfg in configs:
        plan = KvQuantPlan(bits=(4, 2), protect=("none", "detected"), context=384, score=128, samples=2,
                           decode_steps=1, bytes_lengths=(512, 1024, 4096), **cfg)
        ids = torch.tensor(loaded.tokenizer(text[: plan.tokens * 16])["input_ids"][: plan.tokens])
        t0 = time.time()
        result = kv_quant(loaded.model, ids, plan)
        for r in result.rows:
            if r["protect"] in ("none", "detected"):
                row = {"cfg": cfg, "bits": r["bits"], "protect": r["protect"], "median_kl": r["median_kl"],
                       "p90_kl": r["p90_kl"], "top1": r["top1"], "ppl": r["ppl"], "detected": result.detected,
                       **{f"x{n}": r[f"bytes_ratio_16bit_{n}"] for n in plan.bytes_lengths}}
                out.append(row)
                print(json.dumps(row), flush=True)
        print(f"{cfg}: {time.time() - t0:.0f} s", flush=True)
    stem = name.split(":")[-1].split("/")[-1].removesuffix(".gguf")
    write_result(f"kv_quant_layout_sweep_{stem}.json", {"model": name, "rows": out, "meta": run_metadata(model=name)})


if __name__ == "__main__":
    main()
