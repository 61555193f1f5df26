"""The decode weight layout (``sinklab.fastpath.decode_layout``): a one-token step's matrix-vector products over a
model's own projections, stored as transformers loads them and input-major.

    python benchmarks/bench_decode_layout.py [--model builtin:smollm2] [--threads 1] [--rounds 4] [--steps 10]

Per "token": one ``F.linear`` of a random vector with every ``nn.Linear`` weight of the model in turn (the tied
output head included), as a decode step does them; the median ms per token over ``steps`` tokens, rounds
alternating the layouts (the machine is shared). Two more rows: the same products compiled by inductor with
``fastpath.matvec_options`` (what sinklab's default compiled step does: each one a C++ reduction over the weight's
rows, the weights as loaded), and every weight read once (``weight.sum()``: the memory's own floor). Also the time ``decode_layout`` and ``restore_layout`` take.
Prints a table; writes ``benchmarks/results/bench_decode_layout.json``. Not a test.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import RESULTS, markdown_table, run_metadata, write_result  # noqa: E402


@torch.no_grad()
def one_token(linears: list[torch.nn.Linear], product=F.linear) -> float:
    """Seconds for one vector through every projection (each with an input of its own width)."""
    inputs = {m.in_features: torch.randn(1, m.in_features) for m in linears}
    t = time.perf_counter()
    for m in linears:
        product(inputs[m.in_features], m.weight)
    return time.perf_counter() - t


def read_once(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return weight.sum()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="builtin:smollm2")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import sinklab
    from sinklab import fastpath

    model = sinklab.load_model(args.model).model.eval().float()
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    weight_bytes = sum(m.weight.numel() * m.weight.element_size() for m in {id(m.weight): m for m in linears}.values())
    options = {"options": fastpath.matvec_options(), "dynamic": False}
    fastpath.apply_matvec_width(options)  # what a session's compile does: the LM head decomposed too
    compiled = torch.compile(F.linear, **options)
    products = {"as loaded": F.linear, "decode layout": F.linear, "compiled, matvec_options (as loaded)": compiled,
                "every weight read once (weight.sum)": read_once}
    times: dict[str, list[float]] = {k: [] for k in products}
    moves: dict[str, list[float]] = {"decode_layout": [], "restore_layout": []}
    for r in range(args.rounds):
        order = list(products) if r % 2 == 0 else list(reversed(products))
        for layout in order:
            if layout == "decode layout":
                t = time.perf_counter()
                fastpath.decode_layout(model)
                moves["decode_layout"].append(time.perf_counter() - t)
            one_token(linears, products[layout])  # warm-up (and the compile, once per shape)
            times[layout] += [1e3 * one_token(linears, products[layout]) for _ in range(args.steps)]
            if layout == "decode layout":
                t = time.perf_counter()
                fastpath.restore_layout(model)
                moves["restore_layout"].append(time.perf_counter() - t)
    rows = [{"layout": k, "ms_per_token": round(statistics.median(v), 2),
             "GB_per_s": round(weight_bytes / 1e9 / (statistics.median(v) / 1e3), 1),
             "rounds": [round(statistics.median(v[i * args.steps:(i + 1) * args.steps]), 2)
                        for i in range(args.rounds)]} for k, v in times.items()]
    moved = {k: round(1e3 * statistics.median(v), 1) for k, v in moves.items()}
    print(markdown_table([{"layout": r["layout"], "ms per token": r["ms_per_token"], "GB/s": r["GB_per_s"],
                           "rounds (ms)": ", ".join(map(str, r["rounds"]))} for r in rows],
                         ["layout", "ms per token", "GB/s", "rounds (ms)"]))
    print(f"{len(linears)} projections, {weight_bytes / 1e6:.0f} MB of weights; decode_layout "
          f"{moved['decode_layout']} ms, restore_layout {moved['restore_layout']} ms (median)")
    write_result(RESULTS / "bench_decode_layout.json",
                 {"benchmark": "decode-layout", "model": args.model, "threads": args.threads, "rows": rows,
                  "projections": len(linears), "weight_bytes": weight_bytes, "relayout_ms": moved,
                  "meta": run_metadata(model=args.model)})


if __name__ == "__main__":
    main()
