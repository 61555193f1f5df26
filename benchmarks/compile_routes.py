"""``torch.compile(model.forward)`` with a SinkCache, the two ways in, against transformers' StaticCache compiled the
same way (SmolLM2, one thread, a CPU).

    python benchmarks/compile_routes.py [--cached 512] [--steps 16] [--rounds 2] [--threads 1]

* ``sinklab forward`` — ``torch.compile(model.forward)`` called with the SinkCache as the cache argument, as a user
  would (the cache plans each step in its decoder-stack hooks, which are ``torch.compiler.disable``d: graph breaks
  at the stack's entry and exit);
* ``sinklab planned`` — the same compiled forward handed to ``SinkCache.planned_forward`` (the cache plans before
  the call: one dynamo frame and one graph per step; what ``StreamSession.step`` runs);
* ``static`` — transformers' StaticCache, filled to the same length, each step cropped back (``_stream_compile``).

No freezing (the default path's compile), inductor's defaults; ``--matvec`` compiles all three with
``fastpath.matvec_options()`` (what sinklab's own CPU compile passes; writes ``compile_routes_matvec.json``). S 4, W ``cached − 4``: every step past eviction.
Rounds alternate the methods; the median ms per step. Writes ``benchmarks/results/compile_routes.json``. Not a
test.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import RESULTS, markdown_table, run_metadata, write_result  # noqa: E402
from _stream_compile import Sink, Static, time_steps  # noqa: E402


class SinkForward(Sink):
    """The compiled forward called with the SinkCache directly: the cache's hooks plan the step (graph breaks)."""

    def forward_step(self) -> torch.Tensor:
        return self.forward(input_ids=self.token, **{self.kw: self.cache}).logits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cached", type=int, default=512)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--matvec", action="store_true",
                    help="compile all three with fastpath.matvec_options() (what sinklab's own CPU compile passes)")
    args = ap.parse_args()
    import sinklab
    from sinklab import fastpath

    torch.set_num_threads(args.threads)
    model = sinklab.load_model("builtin:smollm2").model.eval()
    vocab = model.config.vocab_size
    options: dict = {}
    if args.matvec:
        options = {"options": fastpath.matvec_options()}
        fastpath.apply_matvec_width(options)
    sink = dict(compiled=True, num_sinks=4, window=args.cached - 4)
    methods = {"sinklab forward": SinkForward("sinklab forward", model, args.cached - 64, vocab, options, **sink),
               "sinklab planned": Sink("sinklab planned", model, args.cached - 64, vocab, options, **sink),
               "static": Static("static", model, args.cached - 1, vocab, options)}
    warm = {}
    for name, m in methods.items():
        warm[name] = m.warm()
        print(f"{name}: set up and compiled in {warm[name]:.1f} s", flush=True)
    ms: dict[str, list[float]] = {k: [] for k in methods}
    with torch.no_grad():
        for r in range(args.rounds):
            for name in (list(methods) if r % 2 == 0 else list(reversed(methods))):
                ms[name] += time_steps(methods[name], args.steps)
    med = {k: statistics.median(v) for k, v in ms.items()}
    rows = [{"method": k, "ms/step": med[k], "÷ static": med[k] / med["static"], "warm-up (s)": warm[k]}
            for k in methods]
    print(markdown_table(rows, digits=4))
    out = RESULTS / ("compile_routes_matvec.json" if args.matvec else "compile_routes.json")
    write_result(out, {
        "benchmark": "compile-routes", "model": "builtin:smollm2", "cached": args.cached, "threads": args.threads,
        "steps": args.steps, "rounds": args.rounds, "matvec": args.matvec, "median_ms": med, "warm_s": warm, "samples": ms,
        "load_average": os.getloadavg(), "meta": run_metadata(model="builtin:smollm2")}, quiet=True)
    for m in methods.values():
        m.close()
    print(f"wrote {out} at {time.strftime('%H:%M')}")


if __name__ == "__main__":
    main()
