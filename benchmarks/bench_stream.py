"""Benchmark: StreamingLLM decoding — sinklab vs the DynamicCache floor, recompute, and peer packages.

Same tiny random Llama (d 256, 4 layers, 4 heads, vocab 1024) and one fixed random token stream in every
virtualenv. Methods:

* sinklab          — this repo's SinkCache/StreamSession (main venv)
* dynamic-floor    — DynamicCache holding S + W − 1 keys: decode one, crop back (the cost floor)
* recompute        — sliding window with re-computation (re-encodes W tokens per token)
* attention-sinks  — attention-sinks 0.4.0 on transformers 4.34.0 (throwaway venv)
* hf-sinkcache     — transformers 4.52.4 SinkCache (throwaway venv)
* kvpress          — kvpress 0.5.5 DecodingPress(StreamingLLMPress), compression every 64 steps, transformers 5.2.0

Runs are interleaved and repeated (this machine is noisy); per-token latency median and p90 over all
rounds. Also: teacher-forced logits of sinklab vs attention-sinks and vs HF SinkCache, and a long stream
with RSS samples. Prints a table and writes benchmarks/results/bench_stream.json. Not a test.

    python benchmarks/bench_stream.py [--windows 256 1020 4092] [--tokens 2000] [--rounds 3] [--no-peers]
    python benchmarks/bench_stream.py --smollm2 [--tokens 40] [--rounds 2]   # real weights, W = 1020 only
    python benchmarks/bench_stream.py --compile [--rounds 3] [--steps 8] [--threads 1 2]   # torch.compile'd stream
        [--models builtin:smollm2 builtin:gemma3] [--device cuda --dtype bfloat16 --mode reduce-overhead] [--profile]
        [--compiled-plan]

``--smollm2`` times the converted SmolLM2-135M-Instruct folder (builtin:smollm2's cache, a plain Llama
safetensors folder) instead: sinklab vs a DynamicCache of equal cached length, attention-sinks and HF
SinkCache. Every run also checks the size mapping of transformers' old SinkCache: with
``window_length = S + W`` it holds S + W keys per layer after each step, the same as sinklab's ``window=W``,
and the first teacher-forced step whose logits leave dense attention is reported for both.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

import torch
from _common import run_metadata, write_result
from sinklab.atomic import write_json

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
VENVS = HERE / ".peer-venvs"
WORKER = HERE / "_stream_worker.py"
PEERS = {
    "attention-sinks": ["attention-sinks==0.4.0", "transformers==4.34.0", "tokenizers<0.15", "einops", "safetensors"],
    "hf-sinkcache": ["transformers==4.52.4", "safetensors"],
    "kvpress": ["kvpress==0.5.5", "transformers==5.2.0", "safetensors"],
}


def peer_python(name: str) -> Path | None:
    """Create (once) the throwaway venv for a peer; None if it cannot be installed here."""
    venv = VENVS / name
    py = venv / "bin" / "python"
    marker = venv / ".ok"
    if marker.exists():
        return py
    print(f"  creating venv for {name} …", flush=True)
    try:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", "torch==2.13.0"], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", *PEERS[name]], check=True)
    except subprocess.CalledProcessError as exc:
        print(f"  could not install {name}: {exc}", flush=True)
        return None
    marker.touch()
    return py


def run_worker(py: Path, method: str, files: dict, window: int, tokens: int, logits: Path | None = None,
               src: Path | None = None) -> dict | None:
    """One ``_stream_worker.py`` run; sinklab from ``src`` (default: this checkout, when ``py`` is this Python)."""
    cmd = [str(py), str(WORKER), method, "--weights", str(files["weights"]), "--stream", str(files["stream"]),
           "--window", str(window), "--tokens", str(tokens)]
    if logits is not None:
        cmd += ["--logits", str(logits)]
    if src is None and py == Path(sys.executable):
        src = HERE.parent / "src"
    env = dict(os.environ, PYTHONPATH=str(src)) if src is not None else None
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if res.returncode != 0:
        print(f"  {method} W={window} failed: {res.stderr.strip().splitlines()[-1] if res.stderr else res.returncode}")
        return None
    return json.loads(res.stdout.strip().splitlines()[-1])


def prepare(tokens: int) -> dict:
    sys.path.insert(0, str(HERE))
    from _stream_worker import CONFIG  # noqa: E402
    from safetensors.torch import save_file
    import transformers

    RESULTS.mkdir(exist_ok=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    weights = RESULTS / "stream_model.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(weights))
    stream = RESULTS / "stream_tokens.json"
    gen = torch.Generator().manual_seed(1)
    stream.write_text(json.dumps(torch.randint(0, CONFIG["vocab_size"], (tokens,), generator=gen).tolist()))
    return {"weights": weights, "stream": stream}


def long_stream(total: int, window: int) -> list[dict]:
    """RSS every 10 % of a ``total``-token sinklab stream (flat memory)."""
    import resource
    import time

    sys.path.insert(0, str(HERE.parent / "src"))
    from _stream_worker import build_model  # noqa: E402
    from sinklab import StreamSession  # noqa: E402

    model = build_model(str(RESULTS / "stream_model.safetensors"))
    samples = []
    gen = torch.Generator().manual_seed(2)
    t0 = time.perf_counter()
    with torch.no_grad(), StreamSession(model, num_sinks=4, window=window) as s:
        logits = s.feed(torch.randint(0, 1024, (1, 8), generator=gen))
        for i in range(1, total + 1):
            logits = s.step(logits.argmax(-1))
            if i % max(1, total // 10) == 0:
                rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
                samples.append({"tokens": i, "peak_rss_mb": round(rss, 1), "cache_tokens": s.cache_tokens(),
                                "seconds": round(time.perf_counter() - t0, 1)})
                print(f"    {i:>7} tokens: peak RSS {rss:.0f} MB, cache {s.cache_tokens()} tokens", flush=True)
    return samples


def smollm2_folder() -> Path:
    """builtin:smollm2's converted folder (created by the set-up; this converts it once if missing)."""
    sys.path.insert(0, str(HERE.parent / "src"))
    from sinklab import gguf

    return gguf.converted_folder(gguf.smollm2_gguf())


def first_departure(logits: Path, dense: Path, prefill: int, tol: float = 1e-4) -> int | None:
    """Stream index of the first query whose logits leave dense attention (the worker prefills ``prefill`` tokens)."""
    a, b = torch.load(logits), torch.load(dense)
    steps = min(len(a), len(b))
    diff = (a[:steps] - b[:steps]).abs().amax(-1) / b[:steps].abs().amax(-1)
    return prefill + int((diff > tol).nonzero()[0]) if bool((diff > tol).any()) else None


def compile_main(args) -> None:
    """``--compile``: the table of benchmarks/_stream_compile.py; JSON in results/ (and under ``$OUT`` if set)."""
    sys.path.insert(0, str(HERE))
    import _stream_compile

    import transformers

    options = {k: v for k, v in (("backend", args.backend), ("mode", args.mode)) if v}
    machine = {"platform": platform.platform(), "cpu": platform.processor() or platform.machine(),
               "torch": torch.__version__, "transformers": transformers.__version__,
               "load_before": os.popen("uptime").read().strip()}
    if args.device.startswith("cuda"):
        machine["gpu"] = torch.cuda.get_device_name()
    print(f"load before: {machine['load_before']}", flush=True)
    name = args.json or ("bench_stream_compile.json" if args.device == "cpu" else
                         f"bench_stream_compile_{args.device.split(':')[0]}_{args.dtype}.json")
    targets = [RESULTS / name] + ([Path(os.environ["OUT"]) / Path(name).name] if os.environ.get("OUT") else [])

    def save(results: dict) -> None:  # after every model: a run stopped at its time limit keeps what it measured
        results["machine"] = dict(machine, load_after=os.popen("uptime").read().strip())
        for path in targets:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_json(path, results)
        print(f"load: {results['machine']['load_after']}; wrote {', '.join(map(str, targets))}", flush=True)

    results = _stream_compile.run(args.models, args.rounds, args.steps, args.threads, args.gen_tokens,
                                  num_sinks=args.sinks, window=args.window, device=args.device, dtype=args.dtype,
                                  compile_options=options, checkpoint=save,
                                  generate_only=args.generate_only, profile=args.profile,
                                  compiled_plan=args.compiled_plan, freezing=args.freezing)
    save(results)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--windows", type=int, nargs="+", default=[256, 1020, 4092])
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--recompute-tokens", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--long", type=int, default=100_000, help="tokens of the flat-memory stream (0: skip)")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--smollm2", action="store_true", help="real SmolLM2-135M weights, W 1020 (short run)")
    ap.add_argument("--compile", action="store_true", help="compiled stream vs StaticCache compiled / DynamicCache "
                    "eager on SmolLM2 (+ Gemma 3 270M if available): see benchmarks/_stream_compile.py")
    ap.add_argument("--steps", type=int, default=8, help="--compile: timed decode steps per method per round")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="--compile: intra-op thread counts")
    ap.add_argument("--generate-only", action="store_true", help="--compile: only the greedy/beams/sampling rows "
                    "(generate() through a SinkCache vs a DynamicCache), at the first --threads")
    ap.add_argument("--gen-tokens", type=int, default=8, help="--compile: new tokens for the beams/sampling rows")
    ap.add_argument("--models", nargs="+", default=["builtin:smollm2", "builtin:gemma3"],
                    help="--compile: builtin:/folder names (real weights) or config:FILE.json (random weights, same "
                    "shapes: benchmarks/configs/)")
    ap.add_argument("--sinks", type=int, default=4, help="--compile: S")
    ap.add_argument("--window", type=int, default=1020, help="--compile: W")
    ap.add_argument("--device", default="cpu", help="--compile: cpu or cuda")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="--compile")
    ap.add_argument("--backend", default=None, help="--compile: torch.compile backend (default inductor)")
    ap.add_argument("--mode", default=None, help="--compile: torch.compile mode (reduce-overhead: CUDA graphs)")
    ap.add_argument("--json", default=None, help="file name of the JSON under benchmarks/results/ (default: by mode)")
    ap.add_argument("--profile", action="store_true", help="--compile: torch.profiler op table of the compiled methods")
    ap.add_argument("--freezing", action="store_true",
                    help="--compile: inductor's freezing (weights folded into the graphs) for every compiled method")
    ap.add_argument("--compiled-plan", action="store_true",
                    help="--compile: also SinkCache(compile_plan=True) under the compiled forward")
    args = ap.parse_args()
    if args.compile:
        return compile_main(args)
    if args.smollm2:
        args.windows, args.long = [1020], 0
    files = prepare(max(args.windows) + 4 + args.tokens + 8)
    tiny_files = dict(files)
    if args.smollm2:
        files["weights"] = smollm2_folder()
    pythons = {m: Path(sys.executable) for m in ("sinklab", "dynamic-floor") + (() if args.smollm2 else ("recompute",))}
    if not args.no_peers:
        for peer in (("attention-sinks", "hf-sinkcache") if args.smollm2 else PEERS):
            py = peer_python(peer)
            if py is not None:
                pythons[peer] = py
    rows = []
    for window in args.windows:
        per_method: dict[str, dict] = {m: {"ms": [], "rss": []} for m in pythons}
        for rnd in range(args.rounds):
            order = list(pythons) if rnd % 2 == 0 else list(reversed(pythons))
            for method in order:
                n = args.recompute_tokens if method == "recompute" else args.tokens
                out = run_worker(pythons[method], method, files, window, n)
                if out:
                    per_method[method]["ms"] += out["ms"]
                    per_method[method]["rss"].append(out["peak_rss_mb"])
                    per_method[method]["transformers"] = out["transformers"]
            print(f"  W={window} round {rnd + 1}/{args.rounds} done", flush=True)
        floor = statistics.median(per_method["dynamic-floor"]["ms"]) if per_method["dynamic-floor"]["ms"] else None
        for method, data in per_method.items():
            if not data["ms"]:
                rows.append({"window": window, "method": method, "failed": True})
                continue
            ms = sorted(data["ms"])
            med = statistics.median(ms)
            rows.append({"window": window, "method": method, "median_ms": med, "p90_ms": ms[int(0.9 * (len(ms) - 1))],
                         "peak_rss_mb": max(data["rss"]), "vs_floor": med / floor if floor else None,
                         "tokens_measured": len(ms), "transformers": data.get("transformers")})
    # Teacher-forced logits past eviction (tiny Llama, S 4, W 64): sinklab vs attention-sinks 0.4.0 and HF SinkCache,
    # and the size mapping: HF SinkCache(window_length = S + W) vs sinklab window = W, both against dense.
    compare = {}
    cmp_dir = RESULTS / "logits"
    cmp_dir.mkdir(exist_ok=True)
    ours = run_worker(pythons["sinklab"], "sinklab", tiny_files, 64, 400, cmp_dir / "sinklab.pt")
    dense = run_worker(pythons["sinklab"], "dense", tiny_files, 64, 400, cmp_dir / "dense.pt")
    mapping = {}
    if ours and dense:
        mapping["sinklab"] = {"kept_keys": ours["kept_max"], "first_query_off_dense": first_departure(
            cmp_dir / "sinklab.pt", cmp_dir / "dense.pt", 68)}
        wider = run_worker(pythons["sinklab"], "sinklab", tiny_files, 65, 400, cmp_dir / "sinklab-w65.pt")
        run_worker(pythons["sinklab"], "dense", tiny_files, 65, 400, cmp_dir / "dense-w65.pt")
        if wider:  # one more window slot (window_length − S + 1): must leave dense one step later
            mapping["sinklab_window_plus_1"] = {"kept_keys": wider["kept_max"], "first_query_off_dense":
                                                first_departure(cmp_dir / "sinklab-w65.pt", cmp_dir / "dense-w65.pt", 69)}
    for peer in ("attention-sinks", "hf-sinkcache"):
        if peer in pythons and ours:
            got = run_worker(pythons[peer], peer, tiny_files, 64, 400, cmp_dir / f"{peer}.pt")
            if got:
                a, b = torch.load(cmp_dir / "sinklab.pt"), torch.load(cmp_dir / f"{peer}.pt")
                diff = (a - b).abs().amax(-1)
                compare[peer] = {"steps": int(diff.numel()), "max_abs_diff": float(diff.max()),
                                 "median_abs_diff": float(diff.median()),
                                 "first_step_above_1e-4": int((diff > 1e-4).nonzero()[0]) if bool((diff > 1e-4).any()) else None}
                if dense:
                    mapping[peer] = {"kept_keys": got.get("kept_max"),
                                     "first_query_off_dense": first_departure(cmp_dir / f"{peer}.pt", cmp_dir / "dense.pt", 68)}
    long = long_stream(args.long, 1020) if args.long else []
    print("\n| W | method | transformers | median ms/token | p90 ms | × floor | peak RSS MB |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if r.get("failed"):
            print(f"| {r['window']} | {r['method']} | – | failed | | | |")
            continue
        print(f"| {r['window']} | {r['method']} | {r['transformers']} | {r['median_ms']:.2f} | {r['p90_ms']:.2f} | "
              f"{r['vs_floor']:.2f}× | {r['peak_rss_mb']:.0f} |")
    for w in args.windows:
        rec = next((r for r in rows if r["window"] == w and r["method"] == "recompute" and not r.get("failed")), None)
        ours_row = next((r for r in rows if r["window"] == w and r["method"] == "sinklab" and not r.get("failed")), None)
        if rec and ours_row:
            print(f"recompute / sinklab at W={w}: {rec['median_ms'] / ours_row['median_ms']:.1f}×")
    for peer, c in compare.items():
        print(f"logits vs {peer}: max |Δ| {c['max_abs_diff']:.2e} over {c['steps']} steps "
              f"(first step > 1e-4: {c['first_step_above_1e-4']})")
    for name, m in mapping.items():
        print(f"size mapping, S 4 + W 64 (HF window_length 68): {name}: keys kept per layer {m['kept_keys']}, "
              f"first query off dense: stream index {m['first_query_off_dense']}")
    model = "SmolLM2-135M-Instruct (Q4_1 dequantised)" if args.smollm2 else "tiny random Llama"
    out = {"benchmark": "stream", "meta": run_metadata(model=model), "model": model, "rows": rows, "logits": compare,
           "mapping": mapping, "long_stream": long}
    write_result(args.json or ("bench_stream_smollm2.json" if args.smollm2 else "bench_stream.json"), out)


if __name__ == "__main__":
    main()
