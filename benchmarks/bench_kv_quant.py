"""Benchmark: sink-aware KV-cache quantization on a real model (sinklab kv-quant + transformers' QuantizedCache).

For each model, runs :func:`sinklab.kvquant.evaluate.kv_quant` — packed caches at each bit width × protection
(none, first S, detected sinks) against the unquantized cache — plus transformers' ``QuantizedCache`` with
the quanto and HQQ backends at the bit widths each accepts. The backends are installed into a throwaway
virtualenv made here (``--venv``; it sees the main venv's packages through a ``.pth`` file), never into the
main one; when they cannot be installed the run goes on without them and the JSON says why.

Prints the table and writes ``benchmarks/results/kv_quant_<model><suffix>.json`` and ``…_kl_vs_bytes.png``.
Timings are medians of interleaved greedy decode steps (every cache decodes one token in turn). Not a test.

``--stream`` measures the streaming form instead: ``SinkCache(num_sinks=S, window=W)`` at full precision and
with ``kv_bits=4`` / ``2`` on the same long text fed in chunks (PPL over every token after the first window),
then interleaved one-token decode steps on each stream. Writes ``benchmarks/results/kv_quant_stream_<model>.json``.

    python benchmarks/bench_kv_quant.py [--models builtin:smollm2 /work/gemma3/gemma-3-270m-q4_k_m.gguf]
        [--context 512] [--score 128] [--samples 2] [--bits 4 2] [--decode-steps 8]
    python benchmarks/bench_kv_quant.py --stream [--tokens 2048] [--window 252] [--bits 4 2] [--decode-steps 16]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import sysconfig
from pathlib import Path
from sinklab.atomic import write_json

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
BACKENDS = ("optimum-quanto==0.2.7", "hqq==0.2.8.post1")


def _venv(path: Path) -> tuple[Path | None, str]:
    """A throwaway venv with quanto and HQQ that also sees this interpreter's packages; (python, note)."""
    python = path / "bin" / "python"
    if not python.exists():
        base = Path(sys.base_prefix) / "bin" / "python3"
        subprocess.run([str(base), "-m", "venv", str(path)], check=True)
        site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              check=True, capture_output=True, text=True).stdout.strip()
        Path(site, "main-venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    r = subprocess.run([str(python), "-m", "pip", "install", "-q", *BACKENDS], capture_output=True, text=True,
                       check=False)
    if r.returncode:
        return None, "pip install failed: " + (r.stderr.strip().splitlines() or ["?"])[-1]
    return python, "installed " + ", ".join(BACKENDS) + f" into {path}"


def _worker(args: argparse.Namespace) -> None:
    import torch

    from sinklab.kvquant.evaluate import KvQuantPlan, kv_quant_text
    from sinklab.models import load_model
    from sinklab.report.kvquant import kl_vs_bytes, table_header, table_rows
    from sinklab.texts import default_texts

    torch.set_num_threads(args.threads)
    for name in args.models:
        loaded = load_model(name)
        text = "\n\n".join(default_texts())
        plan = KvQuantPlan(bits=tuple(args.bits), context=args.context, score=args.score, samples=args.samples,
                           decode_steps=args.decode_steps, hf_backends=tuple(args.hf),
                           clip={"auto": None, "on": True, "off": False}[args.clip])
        result = kv_quant_text(loaded.model, loaded.tokenizer, text, plan)
        stem = name.split(":")[-1].split("/")[-1].removesuffix(".gguf") + args.suffix
        result.meta = {"model": name, "note": args.note, "threads": args.threads, "load_average": os.getloadavg(),
                       "machine": "under load on a shared 2-core CPU VM", **result.meta}
        data = result.to_json()
        RESULTS.mkdir(exist_ok=True)
        write_json((RESULTS / f"kv_quant_{stem}.json"), data)
        kl_vs_bytes(data).savefig(RESULTS / f"kv_quant_{stem}_kl_vs_bytes.png", dpi=110)
        print(f"\n{name}: {plan.samples} × ({plan.context} cached + {plan.score} scored) tokens, "
              f"16-bit cache {data['dense_bytes_per_token_16bit']:,} bytes/token; detected {result.detected}; "
              f"under load on a shared 2-core CPU VM (load average {os.getloadavg()[0]:.1f})")
        print(" | ".join(table_header(data)))
        for row in table_rows(data):
            print(" | ".join(row))
        sys.stdout.flush()


def _stream_worker(args: argparse.Namespace) -> None:
    import math
    import statistics
    import time

    import torch

    from sinklab.models import load_model
    from sinklab.stream import SinkCache
    from sinklab.texts import default_texts

    torch.set_num_threads(args.threads)
    for name in args.models:
        loaded = load_model(name)
        model = loaded.model
        ids = torch.tensor(loaded.tokenizer("\n\n".join(default_texts())[: args.tokens * 16])["input_ids"][: args.tokens])
        runs = [None, *args.bits]
        streams, nll, tokens, segments = {}, {}, {}, {}
        for bits in runs:  # PPL: the text in chunks of 128, every position after the first S + W scored
            groups = {} if bits is None else {"kv_group_size": args.group_size}  # full precision: no groups
            cache = SinkCache(model, num_sinks=4, window=args.window, kv_bits=bits, **groups)
            losses = []
            with torch.no_grad():
                for c0 in range(0, ids.numel() - 1, 128):
                    chunk = ids[None, c0:min(c0 + 128, ids.numel() - 1)]
                    logits = model(input_ids=chunk, cache=cache).logits[0].float()
                    target = ids[c0 + 1:c0 + 1 + chunk.shape[1]]
                    losses.append(torch.nn.functional.cross_entropy(logits, target, reduction="none"))
            loss = torch.cat(losses)[4 + args.window:]
            nll[bits] = float(loss.double().mean())
            segments[bits] = [math.exp(float(x.double().mean())) for x in loss.split(256)]
            streams[bits], tokens[bits] = cache, logits[-1].argmax().view(1, 1)
            print(f"{name} stream kv_bits={bits}: PPL {math.exp(nll[bits]):.4f} over {loss.numel()} tokens; per 256: "
                  + " ".join(f"{x:.2f}" for x in segments[bits]), flush=True)
        times = {bits: [] for bits in runs}
        cpu = {bits: [] for bits in runs}  # CPU seconds of this process: less sensitive to a shared machine's load
        with torch.no_grad():
            for _ in range(args.decode_steps):  # interleaved: one token on every stream in turn
                for bits in runs:
                    t0, c0 = time.perf_counter(), time.process_time()
                    logits = model(input_ids=tokens[bits], cache=streams[bits]).logits
                    times[bits].append(time.perf_counter() - t0)
                    cpu[bits].append(time.process_time() - c0)
                    tokens[bits] = logits[:, -1].argmax(-1, keepdim=True)
        layers = {bits: streams[bits].layers for bits in runs}
        full_bytes = sum((ly.keys.numel() + ly.values.numel()) * 2 for ly in layers[None])  # as a 16-bit cache
        rows = []
        for bits in runs:
            ms = 1000 * statistics.median(times[bits])
            scratch = sum(t.numel() * t.element_size() for t in (layers[bits][0].keys, layers[bits][0].values))
            held = full_bytes if bits is None else sum(ly.nbytes() for ly in layers[bits]) + scratch  # + shared buffer
            cpu_ms = 1000 * statistics.median(cpu[bits])
            rows.append({"kv_bits": bits or 32, "ppl": math.exp(nll[bits]),
                         "ppl_vs_full": math.exp(nll[bits] - nll[None]), "ms_per_token": ms,
                         "ms_vs_full": ms / (1000 * statistics.median(times[None])),
                         "cpu_ms_per_token": cpu_ms, "cpu_ms_vs_full": cpu_ms / (1000 * statistics.median(cpu[None])),
                         "cache_bytes": held, "bytes_vs_16bit": held / full_bytes, "ppl_per_256": segments[bits]})
        for s in streams.values():
            s.close()
        data = {"model": name, "tokens": int(ids.numel()), "num_sinks": 4, "window": args.window, "rows": rows,
                "kv_group_size": args.group_size,
                "decode_steps": args.decode_steps, "threads": args.threads,
                "load_average": os.getloadavg(), "machine": "under load on a shared 2-core CPU VM"}
        stem = name.split(":")[-1].split("/")[-1].removesuffix(".gguf")
        RESULTS.mkdir(exist_ok=True)
        write_json((RESULTS / f"kv_quant_stream_{stem}.json"), data)
        print(f"\n{name}: stream S = 4, W = {args.window}, {ids.numel()} tokens; under load on a shared 2-core CPU VM")
        print("kv_bits | PPL | PPL / full | ms/token | ms / full | CPU ms/token | CPU / full | cache bytes | × 16-bit")
        for r in rows:
            print(f"{r['kv_bits']} | {r['ppl']:.4f} | {r['ppl_vs_full']:.4f} | {r['ms_per_token']:.1f} | "
                  f"{r['ms_vs_full']:.2f} | {r['cpu_ms_per_token']:.1f} | {r['cpu_ms_vs_full']:.2f} | "
                  f"{r['cache_bytes']:,} | {r['bytes_vs_16bit']:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["builtin:smollm2"])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--score", type=int, default=128)
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--bits", type=int, nargs="+", default=[4, 2])
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--suffix", default="", help="appended to the result files' names (e.g. _4096)")
    ap.add_argument("--venv", type=Path, default=Path("/tmp/sinklab-kvquant-bench-venv"))
    ap.add_argument("--no-hf", action="store_true", help="skip transformers' QuantizedCache")
    ap.add_argument("--clip", choices=("auto", "on", "off"), default="auto",
                    help="least-squares ranges: at 2 bits only (auto), at every width, or never (min/max)")
    ap.add_argument("--stream", action="store_true", help="measure SinkCache(kv_bits=) instead")
    ap.add_argument("--tokens", type=int, default=2048, help="--stream: tokens of text")
    ap.add_argument("--window", type=int, default=252, help="--stream: window W (S = 4)")
    ap.add_argument("--group-size", type=int, default=16, help="--stream: channels per scale and zero point")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--hf", nargs="*", default=[], help=argparse.SUPPRESS)
    ap.add_argument("--note", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.stream:
        _stream_worker(args)
        return
    if args.worker:
        _worker(args)
        return
    python, note = (None, "skipped (--no-hf)") if args.no_hf else _venv(args.venv)
    hf = ["quanto", "hqq"] if python else []
    cmd = [str(python or sys.executable), __file__, "--worker", "--note", note, "--hf", *hf, "--models", *args.models,
           "--context", str(args.context), "--score", str(args.score), "--samples", str(args.samples),
           "--bits", *map(str, args.bits), "--decode-steps", str(args.decode_steps), "--threads", str(args.threads),
           "--suffix", args.suffix, "--clip", args.clip]
    print(f"transformers' QuantizedCache: {note}")
    sys.stdout.flush()
    env = dict(os.environ, PYTHONPATH=str(HERE.parent / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    subprocess.run(cmd, check=True, env=env)


if __name__ == "__main__":
    main()
