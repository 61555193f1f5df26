"""Benchmark: peak RSS and wall time of `sinklab` scan vs a plain SDPA forward vs eager output_attentions.

Tiny Llama-style model (d 256, 4 layers, 4 heads, random weights), one sample of T tokens, T in
{512, 2048, 8192}. Every measurement runs in its own subprocess so peak RSS (ru_maxrss) is clean.
Prints a table and writes benchmarks/results/bench_scan.json. Not a test: numbers depend on the machine.

Real-model mode (``--models``): per model, one process loads it once (load excluded) and times, in
interleaved rounds on the same windows (16 × 64 tokens by default), the backbone forward
(``model.model``, no LM head), ``sinklab.scan``, ``sinklab.diagnose`` and ``sinklab.circuit`` with their
defaults, and the whole model's forward (``lm-forward``: LM head included, what any loss runs): wall and CPU
seconds (CPU time is steadier on a shared machine), medians over the rounds. Peak memory: RSS sampled every
2 ms during each operation's warm-up run (in that order, ``lm-forward`` last: a memory-mapped, tied LM head
stays paged in once read), against the RSS after loading. Writes benchmarks/results/bench_scan_models.json.

Image + text mode (``--image-models``): the same rounds on a small random vision-language model built from a config
in code (:data:`VLM_CONFIGS`: a Llava — CLIP tower, Llama decoder — and a Gemma 3 — SigLIP tower, Gemma 3 decoder;
no downloads), one drawn image and ``--text-tokens`` text ids: the model's own forward on those inputs
(``model.model``: vision tower, projector and decoder, no LM head), the whole model's (``lm-forward``),
``sinklab.scan.scan_images`` end to end (``scan``: the inputs built from the config, which runs the vision tower once
more to count the image's tokens, then the scan) and ``sinklab.scan_inputs`` on the inputs built beforehand
(``scan-inputs``: what the scan itself costs, as with a processor). Writes benchmarks/results/bench_scan_image.json.

    python benchmarks/bench_scan.py [--lengths 512 2048 8192] [--repeats 2]
    python benchmarks/bench_scan.py --models builtin:smollm2 path/to/gemma-3-270m.gguf [--repeats 3]
    python benchmarks/bench_scan.py --image-models llava gemma3 [--text-tokens 256] [--repeats 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any
from _common import print_table, run_metadata, write_result

MODES = ("plain-sdpa", "sinklab-scan", "eager-attentions")
OPERATIONS = ("forward", "lm-forward", "scan", "diagnose", "circuit")
IMAGE_OPERATIONS = ("forward", "lm-forward", "scan", "scan-inputs")
IMAGE_TOKEN = 4095  # the image placeholder: the small models' last vocabulary row (the text ids stay below it)


def _llava():
    """A small random Llava: CLIP tower (d 384, 6 layers, 224² pixels, 14² patches: 256 image tokens), Llama
    decoder (d 512, 8 layers, 8 heads)."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    vision = CLIPVisionConfig(hidden_size=384, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=6,
                              image_size=224, patch_size=14, projection_dim=512)
    text = LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=2048, num_hidden_layers=8,
                       num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=4096)
    return LlavaForConditionalGeneration(LlavaConfig(vision_config=vision, text_config=text,
                                                     image_token_index=IMAGE_TOKEN, vision_feature_layer=-2))


def _gemma3():
    """A small random Gemma 3: SigLIP tower (d 384, 6 layers, 224² pixels, 14² patches pooled to 64 image tokens),
    Gemma 3 decoder (d 512, 8 layers, 8 heads, its 5 local : 1 global sliding-window pattern)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

    vision = SiglipVisionConfig(hidden_size=384, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=6,
                                image_size=224, patch_size=14, vision_use_head=False)
    text = Gemma3TextConfig(vocab_size=4096, hidden_size=512, intermediate_size=2048, num_hidden_layers=8,
                            num_attention_heads=8, num_key_value_heads=4, head_dim=64, sliding_window=128,
                            max_position_embeddings=4096)
    return Gemma3ForConditionalGeneration(Gemma3Config(
        vision_config=vision, text_config=text, mm_tokens_per_image=64, image_token_index=IMAGE_TOKEN,
        boi_token_index=IMAGE_TOKEN - 2, eoi_token_index=IMAGE_TOKEN - 1))


#: The image + text mode's models, built from configs in code (random weights, float32, SDPA).
VLM_CONFIGS = {"llava": _llava, "gemma3": _gemma3}


def _model(attn: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=16384)
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


def worker(mode: str, length: int, repeats: int) -> dict:
    import torch

    torch.set_num_threads(max(1, torch.get_num_threads()))
    ids = torch.randint(0, 1024, (1, length), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    times = []
    if mode == "sinklab-scan":
        import sinklab

        model = _model("sdpa")
        for _ in range(repeats):
            t0 = time.perf_counter()
            sinklab.scan_inputs(model, [{"input_ids": ids, "attention_mask": mask}], [[""] * length])
            times.append(time.perf_counter() - t0)
    else:
        model = _model("sdpa" if mode == "plain-sdpa" else "eager")
        with torch.no_grad():
            for _ in range(repeats):
                t0 = time.perf_counter()
                model.model(input_ids=ids, attention_mask=mask, use_cache=False,
                            output_attentions=mode == "eager-attentions")
                times.append(time.perf_counter() - t0)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"mode": mode, "T": length, "seconds": min(times), "peak_rss_mb": peak_mb}


def _operations(name: str, samples: int, seq_len: int, resident: bool = False) -> dict:
    """Load ``name`` and return ``{operation: callable}`` on the same windows (see the module docstring);
    ``resident``: every parameter read once after loading (memory-mapped pages in)."""
    import warnings

    import torch

    import sinklab
    from sinklab.circuit import circuit
    from sinklab.scan import text_batches

    warnings.filterwarnings("ignore")
    loaded = sinklab.load_model(name)
    model, tok = loaded.model, loaded.tokenizer
    if resident:
        with torch.no_grad():
            for p in model.parameters():
                p.sum()
    batches, _, _ = text_batches(model, tok, None, seq_len=seq_len, samples=samples, batch_size=8)

    def forward():
        with torch.no_grad():
            for batch in batches:
                model.model(**batch, use_cache=False)

    def lm_forward():  # the whole model, LM head included: what a loss (the circuit's) has to run
        with torch.no_grad():
            for batch in batches:
                model(**batch, use_cache=False)

    return {"forward": forward,
            "scan": lambda: sinklab.scan(model, tok, seq_len=seq_len, samples=samples),
            "diagnose": lambda: sinklab.diagnose(model, tok, seq_len=seq_len, samples=samples),
            "circuit": lambda: circuit(model, tok, seq_len=seq_len, samples=samples),
            "lm-forward": lm_forward}  # last: it pages in a tied LM head the others may not read


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class _PeakRSS:
    """Samples this process's RSS every 2 ms and keeps the peak seen while each labelled operation runs."""

    def __init__(self) -> None:
        import threading

        self.label: str | None = None
        self.peak: dict[str, float] = {}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.is_set():
            label, rss = self.label, _rss_mib()
            if label is not None:
                self.peak[label] = max(self.peak.get(label, 0.0), rss)
            time.sleep(0.002)

    def stop(self) -> None:
        self._done.set()
        self._thread.join()


def model_worker(name: str, repeats: int, samples: int, seq_len: int, resident: bool = False) -> dict:
    """Wall/CPU seconds of every operation in interleaved rounds, and the peak RSS while each one ran.

    ``resident``: read every parameter once before the baseline RSS is taken, so a memory-mapped weight that
    only some operations read (Gemma 3's tied 262,144-row LM head) counts in every operation's baseline."""
    return timed_rounds(_operations(name, samples, seq_len, resident), repeats)


def timed_rounds(ops: dict, repeats: int) -> dict:
    """Each operation's median wall and CPU seconds over ``repeats`` interleaved rounds, its rounds, and the peak RSS
    while it ran (a warm-up round first: allocator, thread pools, first-use costs)."""
    ops["forward"]()  # warm: allocator and thread pools
    loaded = _rss_mib()
    rss = _PeakRSS()
    for op, fn in ops.items():  # warm-up round (first-use costs: weight statistics and check); memory peaks
        rss.label = op
        fn()
        rss.label = None
    rss.stop()
    times: dict[str, list[tuple[float, float]]] = {op: [] for op in ops}
    for _ in range(repeats):
        for op, fn in ops.items():
            wall, cpu = time.perf_counter(), time.process_time()
            fn()
            times[op].append((time.perf_counter() - wall, time.process_time() - cpu))
    return {op: {"wall_s": statistics.median(t[0] for t in v), "cpu_s": statistics.median(t[1] for t in v),
                 "rounds": v, "peak_rss_mib": max(rss.peak.get(op, loaded), loaded), "rss_after_load_mib": loaded}
            for op, v in times.items()}


def _image_operations(name: str, text_tokens: int) -> tuple[dict, Any]:
    """Build ``VLM_CONFIGS[name]`` and return ``{operation: callable}`` on one drawn image and ``text_tokens``
    random text ids (see the module docstring)."""
    import warnings

    import torch

    import sinklab
    from sinklab import vision_inputs
    from sinklab.scan import scan_images
    from sinklab.testing.vlm_conformance import test_image

    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    model = VLM_CONFIGS[name]()
    model.config._attn_implementation = "sdpa"
    model = model.eval()
    image = test_image()
    text_ids = torch.randint(0, IMAGE_TOKEN - 2, (text_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    inputs = vision_inputs.config_inputs(model, image, text_ids)
    batch = inputs.batches[0]

    def forward():
        with torch.no_grad():
            model.model(**batch, use_cache=False)

    def lm_forward():
        with torch.no_grad():
            model(**batch, use_cache=False)

    return {"forward": forward, "lm-forward": lm_forward,
            "scan": lambda: scan_images(model, [image], text_ids=text_ids),
            "scan-inputs": lambda: sinklab.scan_inputs(model, inputs.batches, inputs.tokens,
                                                       modality=inputs.modality)}, inputs


def image_worker(name: str, repeats: int, text_tokens: int) -> dict:
    """:func:`model_worker`'s rounds for the image + text operations of ``VLM_CONFIGS[name]``."""
    ops, inputs = _image_operations(name, text_tokens)
    counts = {m: int((inputs.modality[0] == i).sum()) for i, m in enumerate(("text", "image", "image-special"))}
    return {"positions": counts, "operations": timed_rounds(ops, repeats)}


def image_main(args) -> None:
    rows, runs = [], {}
    for name in args.image_models:
        threads = [] if args.threads is None else ["--threads", str(args.threads)]
        run = runs[name] = _child(["--image-worker", name, "--repeats", str(args.repeats), "--text-tokens",
                                   str(args.text_tokens), *threads])
        ops = run["operations"]
        for op in IMAGE_OPERATIONS:
            t = ops[op]
            rows.append({"model": name, "tokens": " + ".join(f"{v} {k}" for k, v in run["positions"].items() if v),
                         "operation": op, "wall_s": t["wall_s"], "cpu_s": t["cpu_s"],
                         "wall_ratio": t["wall_s"] / ops["forward"]["wall_s"],
                         "cpu_ratio": t["cpu_s"] / ops["forward"]["cpu_s"],
                         "peak_delta_mib": t["peak_rss_mib"] - t["rss_after_load_mib"],
                         "peak_ratio": t["peak_rss_mib"] / ops["forward"]["peak_rss_mib"]})
        print(f"  {name}: done", flush=True)
    print_table(rows, {"model": "model", "tokens": "tokens", "operation": "operation", "wall_s": "wall (s)",
                       "cpu_s": "CPU (s)", "wall_ratio": "wall / forward", "cpu_ratio": "CPU / forward",
                       "peak_delta_mib": "peak − built (MiB)", "peak_ratio": "peak / forward's"}, digits=3,
                title=f"one image + {args.text_tokens} text ids, medians of {args.repeats} interleaved rounds "
                      f"(threads: {args.threads or 'default'})")
    _write("bench_scan_image.json", {"benchmark": "scan-image", "text_tokens": args.text_tokens,
                                     "repeats": args.repeats, "threads": args.threads, "rows": rows, "runs": runs})


def _child(args: list[str]) -> dict:
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def models_main(args) -> None:
    rows = {}
    for name in args.models:
        rows[name] = _child(["--model-worker", name, "--repeats", str(args.repeats), "--samples", str(args.samples),
                             *(["--resident"] if args.resident else []),
                             "--seq-len", str(args.seq_len)])
        print(f"  {name}: done", flush=True)
    print(f"\n{args.samples} × {args.seq_len} tokens, load excluded, medians of {args.repeats} interleaved rounds "
          f"(threads: {os.environ.get('OMP_NUM_THREADS', 'default')})\n")
    print("| model | operation | wall (s) | CPU (s) | wall / forward | CPU / forward | CPU / scan | "
          "peak RSS (MiB) | peak − loaded (MiB) | peak / forward's | peak / lm-forward's |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, t in rows.items():
        for op in OPERATIONS:
            print(f"| {name} | {op} | {t[op]['wall_s']:.2f} | {t[op]['cpu_s']:.2f} | "
                  f"{t[op]['wall_s'] / t['forward']['wall_s']:.2f}× | {t[op]['cpu_s'] / t['forward']['cpu_s']:.2f}× | "
                  f"{t[op]['cpu_s'] / t['scan']['cpu_s']:.2f}× | {t[op]['peak_rss_mib']:.0f} | "
                  f"{t[op]['peak_rss_mib'] - t[op]['rss_after_load_mib']:.0f} | "
                  f"{t[op]['peak_rss_mib'] / t['forward']['peak_rss_mib']:.2f}× | "
                  f"{t[op]['peak_rss_mib'] / t['lm-forward']['peak_rss_mib']:.2f}× |")
    _write("bench_scan_models" + ("_resident" if args.resident else "") + ".json",
           {"benchmark": "scan-models", "samples": args.samples, "seq_len": args.seq_len, "repeats": args.repeats,
            "resident": args.resident, "models": rows})


def _write(filename: str, result: dict) -> None:
    write_result(filename, {**result, "meta": run_metadata()})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--worker", nargs=2, metavar=("MODE", "T"))
    ap.add_argument("--models", nargs="+", help="real-model mode: builtin names or model paths")
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--model-worker")
    ap.add_argument("--resident", action="store_true",
                    help="real-model mode: page every weight in before the baseline RSS (see model_worker)")
    ap.add_argument("--image-models", nargs="+", choices=sorted(VLM_CONFIGS),
                    help="image + text mode: small random vision-language models built from configs in code")
    ap.add_argument("--text-tokens", type=int, default=256, help="image + text mode: text ids after the image")
    ap.add_argument("--threads", type=int, help="torch threads in the image + text mode's worker")
    ap.add_argument("--image-worker")
    args = ap.parse_args()
    if args.image_worker:
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        print(json.dumps(image_worker(args.image_worker, args.repeats, args.text_tokens)))
        return
    if args.image_models:
        image_main(args)
        return
    if args.model_worker:
        print(json.dumps(model_worker(args.model_worker, args.repeats, args.samples, args.seq_len, args.resident)))
        return
    if args.models:
        models_main(args)
        return
    if args.worker:
        print(json.dumps(worker(args.worker[0], int(args.worker[1]), args.repeats)))
        return
    rows = []
    for length in args.lengths:
        for mode in MODES:
            out = subprocess.run([sys.executable, __file__, "--worker", mode, str(length), "--repeats", str(args.repeats)],
                                 capture_output=True, text=True, check=True)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"  {mode:17s} T={length:5d}: {rows[-1]['seconds']:7.2f} s  {rows[-1]['peak_rss_mb']:8.0f} MB", flush=True)
    for length in args.lengths:
        base = next(r for r in rows if r["T"] == length and r["mode"] == "plain-sdpa")
        for r in (r for r in rows if r["T"] == length):
            r["time_ratio"] = r["seconds"] / base["seconds"]
            r["rss_ratio"] = r["peak_rss_mb"] / base["peak_rss_mb"]
    print_table(rows, {"T": "T", "mode": "mode", "seconds": "time (s)", "peak_rss_mb": "peak RSS (MB)",
                       "time_ratio": "time / plain", "rss_ratio": "RSS / plain"}, digits=3)
    _write("bench_scan.json", {"benchmark": "scan", "rows": rows})


if __name__ == "__main__":
    main()
