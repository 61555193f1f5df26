"""Documented runs (not tests): what a stream forgets and whether it stays fluent (sinklab.evaluation.quality).

Three experiments on ``builtin:smollm2`` (SmolLM2-135M-Instruct), each in its own process so they can run side
by side, each writing ``benchmarks/results/quality_<name>.json`` (rewritten as it goes, so a run cut short
still leaves its finished part):

    python benchmarks/stream_quality.py recall  [--distances 32,192,288,512,1024] [--facts 6]
    python benchmarks/stream_quality.py endless --sinks 4 [--tokens 10000] [--model smollm2|tiny-lm]  # sinks + window
    python benchmarks/stream_quality.py endless --sinks 0 [--tokens 10000] [--model …]  # window only, same cache
    python benchmarks/stream_quality.py endless-pair [--tokens 10000]  # both in lockstep (a cut leaves equal lengths)
    python benchmarks/stream_quality.py prompts [--prompts 32] [--max-new-tokens 48]
    python benchmarks/stream_quality.py prompts --sinks 0 --window 4096  # control: the same chat, nothing evicted
    python benchmarks/stream_quality.py report  # figures into docs/img/ and the tables, from the JSON files

All at cache size C = S + W = 256 (S = 4, W = 252) unless ``--window`` says otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from _common import RESULTS, run_metadata, write_result
from sinklab.report.figures import save_png

HERE = Path(__file__).resolve().parent
DOCS_IMG = HERE.parent / "docs" / "img"


def _write(name: str, data: dict) -> None:
    write_result(f"quality_{name}.json", data)


def _meta(args, start: float) -> dict:
    model = args.model if args.experiment in ("endless", "endless-pair", "prompts") else "smollm2"
    wall = time.perf_counter() - start
    return {"model": f"builtin:{model}", "wall_seconds": wall, "threads": args.threads,
            "meta": run_metadata(model=f"builtin:{model}", wall_seconds=wall,
                                 load="shared with other jobs (timings under load)")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("experiment", choices=("recall", "endless", "endless-pair", "prompts", "report"))
    ap.add_argument("--window", type=int, default=252)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=10_000)
    ap.add_argument("--distances", default="32,192,288,512,1024")
    ap.add_argument("--facts", type=int, default=6)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--system", default=None, help="prompts: a system prompt pinned in the stream (kept forever) "
                    "and given to the fresh context too")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", default="smollm2", choices=("smollm2", "tiny-lm"), help="endless and prompts")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.experiment == "report":
        return report()
    import sinklab
    from sinklab.evaluation import quality

    loaded = sinklab.load_model(f"builtin:{args.model if args.experiment != 'recall' else 'smollm2'}")
    model, tok = loaded.model.requires_grad_(False), loaded.tokenizer
    # Every StreamSession checks the weights for NaN/inf (seconds for 135M parameters); these runs open
    # hundreds of sessions on one model that does not change, so it is checked once here.
    import sinklab.checks

    sinklab.checks.check_weights(model)
    sinklab.checks.check_weights = lambda model: None
    start = time.perf_counter()
    if args.experiment == "recall":
        from sinklab.texts import default_texts

        distances = [int(x) for x in args.distances.split(",")]
        filler = torch.tensor(tok(" ".join(default_texts()[:40]), add_special_tokens=False)["input_ids"])
        facts = quality.FACTS[: args.facts]
        done = {"n": 0}

        def progress(label: str, n: int) -> None:
            done["n"] += n
            print(f"  [{time.strftime('%H:%M:%S')}] {label} ({done['n']})", flush=True)

        res = quality.fact_recall(model, tok, filler, distances, num_sinks=args.sinks, window=args.window,
                                  facts=facts, progress=progress)
        _write("recall", {**res.to_json(), **_meta(args, start)})
    elif args.experiment in ("endless", "endless-pair"):
        # endless: one run (--sinks 4: sinks + window; --sinks 0: window only). endless-pair: both, in lockstep
        # (token i of each before token i + 1 of either), so a run cut short leaves two runs of equal length.
        import copy

        kinds = [args.sinks] if args.experiment == "endless" else [args.sinks or 4, 0]
        ids = quality.endless_prompt_ids(tok)
        models = [model] + [copy.deepcopy(model) for _ in kinds[1:]]  # one open stream per model
        streams, t0 = [], time.perf_counter()
        for s, m in zip(kinds, models):
            label = "sinks + window" if s else "window only"
            window = args.window if s else args.window + (args.sinks or 4)  # same cache size C = S + W
            streams.append(quality.EndlessStream(m, ids, num_sinks=s, window=window, seed=args.seed, label=label))

        def save() -> None:
            n = len(streams[0].run.tokens)
            rate = n * len(streams) / (time.perf_counter() - t0)
            print(f"  [{time.strftime('%H:%M:%S')}] {n} tokens per run, {rate:.1f} tok/s, load {os.getloadavg()[0]:.1f}",
                  flush=True)
            for e in streams:
                _write(f"endless_{args.model}_s{e.run.num_sinks}", {
                    **e.run.to_json(), "prompt": quality.ENDLESS_PROMPT, "temperature": 0.7, "top_k": 50,
                    "seed": args.seed, "tokens_planned": args.tokens,
                    "text": tok.decode(e.run.tokens, skip_special_tokens=False), **_meta(args, start)})

        for e in streams:
            e.__enter__()
        try:
            for i in range(args.tokens):
                for e in streams:
                    e.advance(feed=i + 1 < args.tokens)
                if (i + 1) % 250 == 0:
                    save()
        finally:
            save()
            for e in streams:
                e.__exit__(None, None, None)
    elif args.experiment == "prompts":
        done = {"n": 0}

        def progress(label: str, n: int) -> None:
            done["n"] += n
            print(f"  [{time.strftime('%H:%M:%S')}] {label} ({done['n']})", flush=True)

        rows = quality.many_prompts(model, tok, quality.PROMPTS[: args.prompts], num_sinks=args.sinks,
                                    window=args.window, max_new_tokens=args.max_new_tokens, system=args.system,
                                    progress=progress)
        name = "prompts" if args.model == "smollm2" else f"prompts_{args.model}"
        if (args.sinks, args.window) != (4, 252):  # e.g. the control: one conversation with nothing evicted
            name += f"_s{args.sinks}_w{args.window}"
        if args.system:
            name += "_pinned_system"
        _write(name, {"num_sinks": args.sinks, "window": args.window, "max_new_tokens": args.max_new_tokens,
                      "system": args.system,
                      "rows": [r.__dict__ for r in rows], **_meta(args, start)})
    print(f"wall {time.perf_counter() - start:.0f} s")


def report() -> None:
    from sinklab.report.quality_figures import quality_figures, quality_tables

    data = {}
    for name in ("recall", "prompts", "prompts_tiny-lm", "endless_smollm2_s4", "endless_smollm2_s0", "endless_tiny-lm_s4",
                 "endless_tiny-lm_s0"):
        path = RESULTS / f"quality_{name}.json"
        if path.exists():
            data[name] = json.loads(path.read_text())
    if "prompts" not in data and "prompts_tiny-lm" in data:
        data["prompts"] = data.pop("prompts_tiny-lm")
    DOCS_IMG.mkdir(parents=True, exist_ok=True)
    for stem, fig in quality_figures(data).items():
        save_png(fig, DOCS_IMG / f"quality_{stem}.png", dpi=80)
    print(quality_tables(data))


if __name__ == "__main__":
    main()
