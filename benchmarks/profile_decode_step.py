"""Where the default compiled decode step spends its time: the matrix-vector products, the attention over the cache,
and everything else (norms, rotations, the cache write, the step's plan, guards and Python).

    python benchmarks/profile_decode_step.py [--model builtin:smollm2] [--cached 1024 4096] [--threads 1]
                                             [--dtype float32] [--steps 8]

The step is the one ``StreamSession`` runs told nothing past its eager steps (``torch.compile`` with
``fastpath.matvec_options``, no freezing; ``fastpath.EAGER_STEPS`` set to 0 here), ``S 4 + W (cached − 4)`` past
eviction. ``torch.profiler`` records ``steps`` steps with inductor's per-kernel profiling on
(``torch._inductor.config.cpp.enable_kernel_profile``), and every kernel's own time goes to one share by its name:

* ``products`` — a generated kernel whose fused ops include a matrix product (``mm``/``addmm``/``bmm``: the
  decomposed one-row products, fused with the norms, activations, rotations and cache writes around them — a
  generated kernel is named by every op fused into it, so this share holds some of that work too) and the
  library's own ``aten::mm``/``addmm``/``bmm``/``linear``;
* ``attention`` — the library's attention kernel (``aten::_scaled_dot_product_…``) and generated kernels with a
  softmax and no product;
* ``other`` — every other kernel and op, the compiled graph's Python wrapper, dynamo's guards, the step's plan.

Also the bytes a step must read (weights, the cache's keys and values) and the time reading them once takes
(``tensor.sum()``: the memory's floor), so each share can be set against its floor. Prints a table; writes
``benchmarks/results/profile_decode_step.json``. Not a test.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import RESULTS, greedy_steps, markdown_table, run_metadata, write_result  # noqa: E402

NUM_SINKS = 4
WRAPPERS = ("## Call CompiledFxGraph", "Torch-Compiled Region")  # their totals hold the kernels; self time is kept


def share(name: str) -> str:
    """The share a profiled event's own time goes to, by its name."""
    low = name.lower()
    if low.startswith("aten::"):
        op = low[6:]
        if op in ("mm", "addmm", "bmm", "linear", "matmul"):
            return "products"
        return "attention" if "scaled_dot_product" in op or "softmax" in op else "other"
    if "cpp_fused" in low:  # a generated kernel is named by every op fused into it
        if any(f"_{op}_" in f"_{low}_" for op in ("mm", "addmm", "bmm")):
            return "products"
        if "softmax" in low:
            return "attention"
    return "other"


def floor_ms(tensors: list[torch.Tensor], rounds: int = 5) -> float:
    """Milliseconds to read every tensor once (the median of ``rounds``)."""
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        for x in tensors:
            x.sum()
        times.append(1e3 * (time.perf_counter() - t))
    return statistics.median(times)


def profile(model, cached: int, steps: int) -> dict:
    import torch._inductor.config as inductor_config
    from torch.profiler import profile as torch_profile

    from sinklab import fastpath
    from sinklab.stream import StreamSession

    prompt = torch.randint(10, model.config.vocab_size - 1, (1, cached), generator=torch.Generator().manual_seed(0))
    eager_steps = fastpath.EAGER_STEPS
    fastpath.EAGER_STEPS = 0
    torch._dynamo.reset()
    try:
        with torch.no_grad(), inductor_config.patch({"cpp.enable_kernel_profile": True}), \
                StreamSession(model, num_sinks=NUM_SINKS, window=cached - NUM_SINKS) as session:
            logits, times = greedy_steps(session, session.feed(prompt), steps, warm=4)  # the compile, warm steps
            with torch_profile() as prof:
                for _ in range(steps):
                    logits = session.step(logits.argmax(-1))
            cache = [t for layer in session.cache.layers for t in (layer.keys, layer.values)]
            cache_bytes = sum(t.numel() * t.element_size() for t in cache)
            cache_floor = floor_ms(cache)
    finally:
        fastpath.EAGER_STEPS = eager_steps
        torch._dynamo.reset()
    shares = {"products": 0.0, "attention": 0.0, "other": 0.0}
    kernels = []
    for event in prof.key_averages():
        ms = event.self_cpu_time_total / 1e3 / steps
        shares[share(event.key)] += ms
        kernels.append((ms, event.key, share(event.key)))
    weights = list({id(p): p for p in model.parameters()}.values())
    return {"cached": cached, "ms_per_step": statistics.median(times), "profiled_ms": shares,
            "weight_bytes": sum(p.numel() * p.element_size() for p in weights), "weight_floor_ms": floor_ms(weights),
            "cache_bytes": cache_bytes, "cache_floor_ms": cache_floor,
            "top_kernels": [{"ms": round(ms, 3), "name": name[:200], "share": s}
                            for ms, name, s in sorted(kernels)[::-1][:12]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="builtin:smollm2")
    ap.add_argument("--cached", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", type=Path, default=RESULTS / "profile_decode_step.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="sinklab-profile-"))

    import sinklab

    model = sinklab.load_model(args.model).model.eval().to(getattr(torch, args.dtype))
    results = [profile(model, cached, args.steps) for cached in args.cached]
    rows = []
    for r in results:
        p = r["profiled_ms"]
        rows.append({"cached": r["cached"], "ms/step": r["ms_per_step"], "profiled": sum(p.values()),
                     "products": p["products"], "weights' floor": r["weight_floor_ms"],
                     "attention": p["attention"], "cache's floor": r["cache_floor_ms"], "other": p["other"]})
    print(markdown_table(rows, digits=4))
    for r in results:
        print(f"\ncached {r['cached']}: top kernels (ms per step)")
        print(markdown_table(r["top_kernels"], digits=4))
    write_result(args.out, {"benchmark": "profile-decode-step", "model": args.model, "dtype": args.dtype,
                            "threads": args.threads, "steps": args.steps, "results": results,
                            "load_average": os.getloadavg(), "meta": run_metadata(model=args.model)}, quiet=True)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
