"""Documented long run (not a test): millions of tokens through one stream — memory, drift, throughput.

One ``StreamSession`` eats a long text (Python's pydoc topics, repeated as often as needed) in chunks; every
``--probe``-th part of it goes in one token at a time through ``step`` (the decode path) instead. At
checkpoints spread over the run it records:

* **RSS** of the process (``psutil``): flat means constant memory;
* **drift**: the stream's logits for the last token against a *fresh-window recompute* — a new session fed
  only the ``S`` sink tokens and the last ``(L + 1)·W`` tokens (``L`` layers). A token's hidden state at layer
  ``l`` depends only on the sinks and on the ``W`` tokens before it at layer ``l − 1``, so ``(L + 1)·W``
  tokens cover everything the last query can see (the extra ``W`` lets the fresh stream's first window
  fill up). The two must agree to float32 rounding, at token 10³ as at token 10⁶: re-basing positions and
  the ring buffer accumulate no error;
* **throughput**: chunked and one-token (decode) tokens/s per segment, and the stream's mean NLL of the
  text per segment (the model keeps predicting the text as well at the end as at the start).

Writes ``benchmarks/results/long_run_<model>.json`` and ``docs/img/long_run_<model>.png``.

    python benchmarks/long_run.py tiny-lm  [--tokens 1000000] [--window 252] [--chunk 64]
    python benchmarks/long_run.py smollm2  [--tokens 100000]  [--window 252] [--chunk 32]
    python benchmarks/long_run.py figure|table benchmarks/results/long_run_<model>.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

import psutil
import torch
from _common import RESULTS, run_metadata, write_result
from sinklab.report.figures import save_png

HERE = Path(__file__).resolve().parent
DOCS_IMG = HERE.parent / "docs" / "img"


def text_ids(tokenizer, n: int) -> torch.Tensor:
    """``n`` token ids of the pydoc topics, the text repeated (each copy tokenized once) until long enough."""
    from sinklab.texts import default_texts

    one = torch.tensor(tokenizer("\n\n".join(default_texts()), verbose=False)["input_ids"])
    reps = -(-n // one.numel())
    return one.repeat(reps)[:n]


def fresh_logits(model, ids: torch.Tensor, t: int, sinks: int, window: int, layers: int, chunk: int) -> torch.Tensor:
    """Logits at token ``t − 1`` from a new stream fed the sinks and the last ``(L + 1)·W`` tokens before ``t``."""
    from sinklab.stream import StreamSession

    k = (layers + 1) * window
    seq = torch.cat([ids[:sinks], ids[max(sinks, t - k):t]])[None]
    with StreamSession(model, num_sinks=sinks, window=window, chunk_size=chunk) as fresh:
        return fresh.feed(seq)[0].double()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", choices=("tiny-lm", "smollm2"))
    ap.add_argument("--tokens", type=int, default=None, help="default 1,000,000 (tiny-lm) / 100,000 (smollm2)")
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--window", type=int, default=252)
    ap.add_argument("--chunk", type=int, default=None, help="tokens per feed (default 64 tiny-lm / 32 smollm2)")
    ap.add_argument("--segments", type=int, default=20, help="throughput / RSS samples over the run")
    ap.add_argument("--checkpoints", type=int, default=5, help="drift checks over the run (the first at 2·(L+1)·W)")
    ap.add_argument("--probe", type=int, default=64, help="tokens fed one by one (decode) at each segment's start")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import sinklab
    from sinklab.stream import StreamSession

    tokens = args.tokens or (1_000_000 if args.model == "tiny-lm" else 100_000)
    chunk = args.chunk or (64 if args.model == "tiny-lm" else 32)
    loaded = sinklab.load_model(f"builtin:{args.model}")
    model = loaded.model.requires_grad_(False)
    layers = model.config.num_hidden_layers
    twin = copy.deepcopy(model)  # the fresh-window recompute runs on a copy (one open stream per model)
    ids = text_ids(loaded.tokenizer, tokens)
    seg_len = tokens // args.segments
    cone = (layers + 1) * args.window
    first_check = min(tokens, 2 * cone + args.sinks)
    checks = sorted({first_check, *[int(first_check + i * (tokens - first_check) / max(1, args.checkpoints - 1))
                                    for i in range(args.checkpoints)]})
    proc = psutil.Process()
    out = RESULTS / f"long_run_{args.model}.json"
    print(f"{args.model}: {tokens:,} tokens, S={args.sinks} W={args.window}, chunk {chunk}, "
          f"drift checks at {checks} (fresh window {cone} tokens)", flush=True)

    segments, drift = [], []
    t = 0
    nll_sum = torch.zeros((), dtype=torch.float64)
    start = time.perf_counter()
    with StreamSession(model, num_sinks=args.sinks, window=args.window, chunk_size=chunk) as s:
        while t < tokens:
            seg_end = min(tokens, t + seg_len)
            t0 = time.perf_counter()
            c0 = time.process_time()
            seg_nll, seg_n, chunk_s, chunk_n, step_s, step_n = 0.0, 0, 0.0, 0, 0.0, 0
            chunk_cpu, step_cpu = 0.0, 0.0
            last = None
            while t < seg_end:
                stop = min(seg_end, *[c for c in checks if c > t] or [seg_end])
                if step_n < args.probe and t > 0:  # the decode path: one token per forward
                    n = min(args.probe - step_n, stop - t)
                    a, ac = time.perf_counter(), time.process_time()
                    for i in range(t, t + n):
                        logits = s.step(ids[i:i + 1])[0]
                        if i + 1 < tokens:
                            seg_nll += float(torch.log_softmax(logits.double(), -1)[ids[i + 1]].neg())
                            seg_n += 1
                        last = logits
                    step_s += time.perf_counter() - a
                    step_cpu += time.process_time() - ac
                    step_n += n
                else:
                    n = min(chunk * 16, stop - t)
                    a, ac = time.perf_counter(), time.process_time()
                    logits = s.feed(ids[None, t:t + n], all_logits=True)[0]
                    chunk_s += time.perf_counter() - a
                    chunk_cpu += time.process_time() - ac
                    chunk_n += n
                    nxt = ids[t + 1:t + n + 1]
                    lp = torch.log_softmax(logits[: nxt.numel()].double(), -1)
                    seg_nll += float(lp.gather(1, nxt[:, None]).neg().sum())
                    seg_n += nxt.numel()
                    last = logits[-1]
                t += n
                if t in checks:
                    ref = fresh_logits(twin, ids, t, args.sinks, args.window, layers, chunk)
                    diff = float((last.double() - ref).abs().max())
                    drift.append({"token": t, "max_abs_logit_diff": diff,
                                  "rel": diff / float(ref.abs().max()),
                                  "same_argmax": bool(last.argmax() == ref.argmax())})
                    print(f"  drift at {t:,}: max |Δlogit| {diff:.2e}", flush=True)
            nll_sum += seg_nll
            row = {"end": t, "rss_mb": proc.memory_info().rss / 2**20, "seconds": time.perf_counter() - t0,
                   "chunk_tok_s": chunk_n / chunk_s if chunk_s else None,
                   "decode_tok_s": step_n / step_s if step_s else None, "mean_nll": seg_nll / max(1, seg_n),
                   # per CPU-second of this process: the machine's load taken out (one thread)
                   "chunk_tok_cpu_s": chunk_n / chunk_cpu if chunk_cpu else None,
                   "decode_tok_cpu_s": step_n / step_cpu if step_cpu else None,
                   "cpu_seconds": time.process_time() - c0, "load_avg_1m": os.getloadavg()[0],
                   "cache_tokens": s.cache_tokens(), "base": int(s.state.base[0])}
            segments.append(row)
            print(f"  [{time.strftime('%H:%M:%S')}] {t:,} tokens: RSS {row['rss_mb']:.0f} MB, "
                  f"chunked {row['chunk_tok_s'] or 0:.0f} tok/s ({row['chunk_tok_cpu_s'] or 0:.0f}/CPU-s), "
                  f"decode {row['decode_tok_s'] or 0:.1f} tok/s ({row['decode_tok_cpu_s'] or 0:.1f}/CPU-s), "
                  f"load {row['load_avg_1m']:.1f}, "
                  f"NLL {row['mean_nll']:.3f}, cache {row['cache_tokens']}", flush=True)
            _write(out, args, tokens, chunk, layers, segments, drift, time.perf_counter() - start, done=t >= tokens)
    _figure(out)
    print(f"wall {time.perf_counter() - start:.0f} s; wrote {out}")


def _write(path: Path, args, tokens, chunk, layers, segments, drift, wall, done) -> None:
    data = {"model": f"builtin:{args.model}", "tokens_planned": tokens, "tokens_done": segments[-1]["end"],
            "finished": done, "num_sinks": args.sinks, "window": args.window, "chunk": chunk, "layers": layers,
            "probe": args.probe, "fresh_window": (layers + 1) * args.window, "segments": segments, "drift": drift,
            "wall_seconds": wall, "threads": args.threads,
            "meta": run_metadata(model=f"builtin:{args.model}", wall_seconds=wall,
                                 load="shared with other jobs (timings under load)")}
    write_result(path, data, quiet=True)


def _figure(path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(path.read_text())
    seg = data["segments"]
    x = [r["end"] for r in seg]
    fig, axes = plt.subplots(1, 4, figsize=(15, 3.2))
    axes[0].plot(x, [r["rss_mb"] for r in seg], "o-")
    axes[0].set(title="RSS (MB)", xlabel="tokens streamed")
    axes[0].set_ylim(0, max(r["rss_mb"] for r in seg) * 1.2)
    cpu = any(r.get("chunk_tok_cpu_s") for r in seg)
    if cpu:  # per CPU-second of the process (one thread): the machine's load taken out
        axes[1].plot(x, [r.get("chunk_tok_cpu_s") or float("nan") for r in seg], "o-",
                     label=f"chunks of {data['chunk']}, per CPU-s")
        axes[1].plot(x, [r.get("decode_tok_cpu_s") or float("nan") for r in seg], "s-", label="decode, per CPU-s")
    axes[1].plot(x, [r["chunk_tok_s"] or float("nan") for r in seg], "o" + ("--" if cpu else "-"),
                 label=f"chunks of {data['chunk']}" + (", wall" if cpu else ""), alpha=0.5 if cpu else 1)
    axes[1].plot(x, [r["decode_tok_s"] or float("nan") for r in seg], "s" + ("--" if cpu else "-"),
                 label="one token (decode)" + (", wall" if cpu else ""), alpha=0.5 if cpu else 1)
    axes[1].set(title="throughput (tok/s" + (", per CPU-s and wall" if cpu else ", under load") + ")",
                xlabel="tokens streamed", yscale="log")
    axes[1].legend(fontsize=8)
    axes[2].plot([d["token"] for d in data["drift"]], [max(d["max_abs_logit_diff"], 1e-12) for d in data["drift"]], "o-")
    axes[2].set(title="max |Δlogit| vs fresh-window recompute", xlabel="tokens streamed", yscale="log")
    axes[3].plot(x, [r["mean_nll"] for r in seg], "o-")
    axes[3].set(title="mean NLL of the text per segment", xlabel="tokens streamed")
    fig.suptitle(f"{data['model']}: {data['tokens_done']:,} tokens, S={data['num_sinks']} W={data['window']}")
    fig.tight_layout()
    DOCS_IMG.mkdir(parents=True, exist_ok=True)
    save_png(fig, DOCS_IMG / f"long_run_{data['model'].split(':')[-1]}.png", dpi=80)
    plt.close(fig)


def table(path: Path) -> str:
    """The run as a Markdown table: per segment RSS, throughput and NLL; the drift checks below."""
    data = json.loads(path.read_text())
    rows = [f"{data['model']}: {data['tokens_done']:,} of {data['tokens_planned']:,} tokens, S = {data['num_sinks']}, "
            f"W = {data['window']}, chunks of {data['chunk']}, {data['probe']} tokens one by one per segment; "
            f"wall {data['wall_seconds']:.0f} s (under load on a shared 2-core CPU VM)", "",
            "| tokens | RSS MB | chunked tok/s (per CPU-s) | decode tok/s (per CPU-s) | load (1 min) | mean NLL | "
            "cache tokens |", "|---|---|---|---|---|---|---|"]

    def rate(wall, cpu) -> str:
        return f"{wall or 0:.1f}" + (f" ({cpu:.1f})" if cpu else "")

    for r in data["segments"]:
        load = f"{r['load_avg_1m']:.1f}" if "load_avg_1m" in r else "–"
        rows.append(f"| {r['end']:,} | {r['rss_mb']:.0f} | {rate(r['chunk_tok_s'], r.get('chunk_tok_cpu_s'))} | "
                    f"{rate(r['decode_tok_s'], r.get('decode_tok_cpu_s'))} | {load} | {r['mean_nll']:.3f} | "
                    f"{r['cache_tokens']} |")
    rows += ["", f"| drift check at token | max \\|Δlogit\\| vs fresh-window recompute ({data['fresh_window']} tokens) | "
                 "relative | same argmax |", "|---|---|---|---|"]
    for d in data["drift"]:
        rows.append(f"| {d['token']:,} | {d['max_abs_logit_diff']:.2e} | {d['rel']:.1e} | {d['same_argmax']} |")
    return "\n".join(rows)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "figure":
        _figure(Path(sys.argv[2]))
    elif len(sys.argv) > 1 and sys.argv[1] == "table":
        print(table(Path(sys.argv[2])))
    else:
        main()
