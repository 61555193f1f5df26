"""Which sink-detection rule should the quantized cache protect? Measured on windows the kv-quant benchmark does NOT score.

``bench_kv_quant.py`` scores the first two windows of 384 + 128 tokens of sinklab's default text; this script
uses windows starting at token 2048, 4096, … (``--starts``), each also with ``<bos>`` put in front where the
tokenizer has one (Gemma 3: sinks are tied to ``<bos>``; without it they move to delimiters). For each window it
measures the column mass of every layer and head once (sinklab's capture), derives the protected positions by
each rule, and compares the median KL of the next-token distributions of the 128 scored tokens (dense
quantized cache, the defaults of ``KvQuantPlan``) against the unquantized cache:

* ``global eE``: positions above ``E`` in ≥ 10 % of all layer×head pairs, kept in every layer (the rule of
  :func:`sinklab.kvquant.sink_positions`);
* ``layer max>E`` / ``layer mean>E``: per layer, the ≤ 2 positions whose largest / mean column mass over the
  layer's heads exceeds ``E``, kept in that layer only;
* ``first4``: the first four tokens.

Prints each window and the pooled medians, writes ``benchmarks/results/kv_quant_sink_threshold_<model>.json``.

    python benchmarks/kv_quant_sink_threshold.py builtin:gemma3 [--starts 2048 4096] [--rules 'none|global']
"""

from __future__ import annotations

import argparse
import re

import torch
from transformers import DynamicCache

from sinklab.capture import AttentionCapture, CaptureConfig
from sinklab.kvquant import Protection, quantized_sink_cache
from sinklab.kvquant.evaluate import KvQuantPlan
from sinklab.metrics import eligible_columns
from sinklab.models import load_model
from sinklab.texts import default_texts

from _common import run_metadata, write_result  # noqa: E402
CONTEXT, SCORE = 384, 128


def column_mass(model, window: torch.Tensor) -> torch.Tensor:
    """``[L, H, T]`` column mass of ``window`` ``[T]``, zero at keys seen by too few queries."""
    with torch.no_grad(), AttentionCapture(model, CaptureConfig(candidates=(), map_len=0)) as cap:
        batch = cap.run(input_ids=window[None])
    mass, queries = batch.column_mass[0], batch.column_queries[0]
    queries = queries if queries.dim() == 2 else queries.expand(mass.shape[0], -1)
    return mass.nan_to_num(0.0) * eligible_columns(queries, queries.amax(-1))[:, None]


def rules(mass: torch.Tensor) -> dict[str, list[tuple[int, ...]]]:
    """Rule name → protected positions per layer."""
    layers = mass.shape[0]
    out: dict[str, list[tuple[int, ...]]] = {"none": [()] * layers}
    for eps in (0.3, 0.2, 0.15):
        rate = (mass > eps).double().mean((0, 1))
        top = [int(p) for p in torch.argsort(rate, descending=True)[:8] if rate[p] >= 0.1]
        out[f"global e{eps}"] = [tuple(sorted(top))] * layers
    for kind, eps_list in (("max", (0.3, 0.2, 0.1)), ("mean", (0.2, 0.1))):
        for eps in eps_list:
            per = []
            for layer in range(layers):
                score = mass[layer].amax(0) if kind == "max" else mass[layer].mean(0)
                per.append(tuple(sorted(int(p) for p in torch.argsort(score, descending=True)[:2] if score[p] > eps)))
            out[f"layer {kind}>{eps}"] = per
    out["first4"] = [(0, 1, 2, 3)] * layers
    return out


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--starts", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--rules", default="", help="regular expression: only rules whose name matches")
    args = ap.parse_args()
    torch.set_num_threads(1)
    loaded = load_model(args.model)
    model, tok = loaded.model, loaded.tokenizer
    plan = KvQuantPlan()
    ids = torch.tensor(tok("\n\n".join(default_texts())[: (max(args.starts) + CONTEXT + SCORE) * 16])["input_ids"])
    bos = [False] + ([True] if tok.bos_token_id is not None and "gemma" in args.model.lower() else [])
    rows, pooled = [], {}
    for start in args.starts:
        for with_bos in bos:
            window = ids[start:start + CONTEXT + SCORE]
            if with_bos:
                window = torch.cat([torch.tensor([tok.bos_token_id]), window[:-1]])
            full = DynamicCache(config=model.config)
            model(window[None, :CONTEXT], cache=full)
            ref = torch.log_softmax(model(window[None, CONTEXT:], cache=full).logits[0].float(), -1)
            for name, per_layer in rules(column_mass(model, window[:CONTEXT])).items():
                if args.rules and not re.search(args.rules, name):
                    continue
                for bits in (2, 4):
                    cache = quantized_sink_cache(model, bits, None, group_size=plan.group_for(bits),
                                                 residual=plan.residual, value_group=plan.value_group)
                    for layer, positions in zip(cache.layers, per_layer):
                        layer.protect = Protection(positions=positions)
                    model(window[None, :CONTEXT], cache=cache)
                    logp = torch.log_softmax(model(window[None, CONTEXT:], cache=cache).logits[0].float(), -1)
                    kl = (ref.exp() * (ref - logp)).sum(-1).clamp_min(0.0)
                    pooled.setdefault((name, bits), []).append(kl)
                    row = {"start": start, "bos": with_bos, "rule": name, "bits": bits, "median_kl": float(kl.median()),
                           "tokens_per_layer": sum(map(len, per_layer)) / len(per_layer),
                           "positions": [list(p) for p in per_layer]}
                    rows.append(row)
                    print(start, with_bos, name, bits, f"median {row['median_kl']:.4g}",
                          f"tokens/layer {row['tokens_per_layer']:.2f}", per_layer[0] if len(set(per_layer)) == 1
                          else per_layer, flush=True)
    summary = []
    print("\npooled over windows (median KL, cut against none)")
    for (name, bits), kls in sorted(pooled.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        base, med = float(torch.cat(pooled[("none", bits)]).median()), float(torch.cat(kls).median())
        summary.append({"rule": name, "bits": bits, "median_kl": med, "cut": 1 - med / base})
        print(f"{bits} bits {name:16s} median {med:.4g}  cut {1 - med / base:.1%}")
    stem = args.model.split(":")[-1].split("/")[-1].removesuffix(".gguf")
    write_result(f"kv_quant_sink_threshold_{stem}.json",
                 {"model": args.model, "starts": args.starts, "context": CONTEXT, "score": SCORE, "rows": rows,
                  "pooled": summary, "meta": run_metadata(model=args.model)})


if __name__ == "__main__":
    main()
