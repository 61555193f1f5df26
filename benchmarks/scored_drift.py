"""How far a score-based stream's kept keys drift from their exact rotation over a long stream.

Under ``positions="slot"`` every eviction round moves older kept keys forward and each re-base moves every stored
key; the cache stores each key as received and rotates it once, from there, by the positions it has moved
(``ScoredLayer.rotated_keys``), so the error should not grow with the stream. This script streams random
tokens one at a time through ``SinkCache(model, num_sinks=, window=, policy=)`` on ``sinklab.models.tiny_llama``
(every step evicts once the budget is full), records each token's un-rotated key (the output of ``k_proj``) in
float64, and at each checkpoint compares every key the cache holds against that key rotated once, in float64, to the
virtual position the cache says it sits at. Reported per checkpoint: the max and mean absolute error over all held
keys (all layers and heads), the same for the sink keys alone (held from the first token, so rotated at every
eviction round), and the max relative error (per key, the error's norm over the key's norm).

    python benchmarks/scored_drift.py --tokens 100000 --every 10000 --policies tova snapkv
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import print_table, run_metadata, write_result  # noqa: E402

from sinklab.models import tiny_llama  # noqa: E402
from sinklab.rope import rotate  # noqa: E402
from sinklab.stream import SinkCache  # noqa: E402


def held_key_error(cache, unrotated: list[torch.Tensor], inserted: list[torch.Tensor], inserted_at: torch.Tensor,
                   num_sinks: int) -> dict:
    """Errors of the keys ``cache`` holds against their exact single float64 rotation (``unrotated[layer]``:
    ``[tokens, Hkv, dh]`` float64, by stream index), and the re-rotation drift alone: against the key as the cache
    received it (``inserted[layer]``, rotated by the model at virtual position ``inserted_at[token]``) rotated once
    in float64 by the positions it has moved since."""
    errs, sink_errs, rel, drift = [], [], [], []
    for i, layer in enumerate(cache.layers):
        sidx, pos, keys = layer.sidx[0], layer.pos[0], layer.rotated_keys()[0]  # (Hkv, cap), (Hkv, cap), (Hkv, cap, dh)
        held = sidx >= 0
        heads = torch.arange(sidx.shape[0])[:, None].expand_as(sidx)
        raw = unrotated[i][sidx.clamp(min=0), heads]  # (Hkv, cap, dh)
        exact = rotate(raw, layer.rope, pos)  # float64 in, float64 out: one rotation
        diff = (keys.double() - exact).abs()
        errs.append(diff[held])
        sink_errs.append(diff[held & (sidx < num_sinks)])
        rel.append((keys.double() - exact)[held].norm(dim=-1) / exact[held].norm(dim=-1))
        moved = rotate(inserted[i][sidx.clamp(min=0), heads], layer.rope, pos - inserted_at[sidx.clamp(min=0)])
        drift.append((keys.double() - moved).abs()[held])
    e, s, r, d = torch.cat(errs), torch.cat(sink_errs), torch.cat(rel), torch.cat(drift)
    return {"drift_max_abs": float(d.max()), "drift_mean_abs": float(d.mean()),"max_abs": float(e.max()), "mean_abs": float(e.mean()), "sink_max_abs": float(s.max()),
            "sink_mean_abs": float(s.mean()), "max_rel": float(r.max()),
            "key_max_abs": float(max(layer.keys[0][layer.sidx[0] >= 0].abs().max() for layer in cache.layers))}


def stream(model, policy: str, tokens: int, every: int, num_sinks: int, window: int, seed: int,
           rebase_every: int | None = None) -> list[dict]:
    """One stream of ``tokens`` random tokens; a row per checkpoint."""
    attn = [layer.self_attn for layer in model.model.layers]
    hkv = model.config.num_key_value_heads
    dh = model.config.hidden_size // model.config.num_attention_heads
    unrotated = [torch.zeros(tokens, hkv, dh, dtype=torch.float64) for _ in attn]
    inserted = [torch.zeros(tokens, hkv, dh, dtype=torch.float64) for _ in attn]
    inserted_at = torch.zeros(tokens, dtype=torch.long)
    cursor = [0]

    def record(i):
        def hook(_module, _inputs, out):
            c = out.shape[1]
            unrotated[i][cursor[0]:cursor[0] + c] = out[0].double().view(c, hkv, dh)
        return hook

    def watch(i, update, cache):
        def wrapped(key_states, value_states, *args, **kwargs):
            t = cursor[0]
            inserted[i][t] = key_states[0, :, -1].double()
            inserted_at[t] = int(cache.state.view.q_v[0, -1])
            return update(key_states, value_states, *args, **kwargs)
        return wrapped

    handles = [a.k_proj.register_forward_hook(record(i)) for i, a in enumerate(attn)]
    ids = torch.randint(0, model.config.vocab_size, (tokens,), generator=torch.Generator().manual_seed(seed))
    rows = []
    t0 = time.perf_counter()
    try:
        with torch.no_grad(), SinkCache(model, num_sinks=num_sinks, window=window, policy=policy,
                                        rebase_every=rebase_every) as cache:
            model(input_ids=ids[:1][None], cache=cache)  # the first token makes the cache layers
            for i, layer in enumerate(cache.layers):
                layer.update = watch(i, layer.update, cache)
            inserted_at[0] = 0
            for i, layer in enumerate(cache.layers):
                inserted[i][0] = layer.keys[0, :, 0].double()
            for t in range(1, tokens):
                cursor[0] = t
                model(input_ids=ids[t:t + 1][None], cache=cache)
                if (t + 1) % every == 0 or t + 1 == tokens:
                    errors = held_key_error(cache, unrotated, inserted, inserted_at, num_sinks)
                    row = {"policy": policy, "tokens": t + 1, **errors,
                           "rebases": cache.state.rebases, "seconds": round(time.perf_counter() - t0, 1)}
                    rows.append(row)
                    print(row, flush=True)
    finally:
        for h in handles:
            h.remove()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=100_000)
    ap.add_argument("--every", type=int, default=10_000)
    ap.add_argument("--policies", nargs="+", default=["tova", "snapkv"])
    ap.add_argument("--num-sinks", type=int, default=4)
    ap.add_argument("--window", type=int, default=60)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="scored_drift.json")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    model = tiny_llama(seed=1).to(dtype)
    start = time.perf_counter()
    rows = []
    for policy in args.policies:  # written after each policy: a long run that stops keeps what it finished
        rows += stream(model, policy, args.tokens, args.every, args.num_sinks, args.window, args.seed)
        meta = run_metadata(model="sinklab.models.tiny_llama(seed=1)", device="cpu", dtype=args.dtype,
                            wall_seconds=time.perf_counter() - start, num_sinks=args.num_sinks, window=args.window,
                            seed=args.seed, tokens=args.tokens)
        write_result(args.out, {"meta": meta, "rows": rows})
    print_table(rows, ["policy", "tokens", "drift_max_abs", "drift_mean_abs", "sink_max_abs", "sink_mean_abs",
                       "max_abs", "mean_abs", "max_rel", "rebases", "seconds"])


if __name__ == "__main__":
    main()
