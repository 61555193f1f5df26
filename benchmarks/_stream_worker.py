"""One streaming measurement, run by bench_stream.py in whichever virtualenv the method needs.

Imports only torch and transformers (plus the peer package, or sinklab for `sinklab`), builds the tiny
Llama from an explicit config (transformers 4.x and 5.x read RoPE settings from a config differently),
loads the shared weights, prefills S + W tokens of the shared stream, then decodes teacher-forced.
Prints one JSON line: per-token latencies (ms), peak RSS (MB) and, with --logits, saves each step's logits.
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time

import torch
import transformers

CONFIG = dict(vocab_size=1024, hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=4, max_position_embeddings=16384, tie_word_embeddings=False)


def folder_config(folder: str) -> dict:
    """A Llama checkpoint folder's config as explicit kwargs that transformers 4.x and 5.x read the same way."""
    raw = json.load(open(f"{folder}/config.json"))
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings")
    out = {k: raw[k] for k in keys if k in raw}
    theta = (raw.get("rope_parameters") or {}).get("rope_theta", raw.get("rope_theta", 10000.0))
    if int(transformers.__version__.split(".")[0]) >= 5:
        out["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    else:
        out["rope_theta"] = theta
    return out


def build_model(weights: str):
    from safetensors.torch import load_file

    folder = weights if not weights.endswith(".safetensors") else None
    config = transformers.LlamaConfig(**(folder_config(folder) if folder else CONFIG))
    try:
        config._attn_implementation = "sdpa"
    except Exception:  # noqa: BLE001  # pragma: no cover - old versions
        pass
    model = transformers.LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(load_file(f"{folder}/model.safetensors" if folder else weights),
                                                strict=False)
    missing = [k for k in missing if "inv_freq" not in k and not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if config.tie_word_embeddings:
        model.tie_weights()
    assert not missing and not unexpected, (missing, unexpected)
    return model.eval()


def cache_kwarg(model) -> str:
    import inspect

    return "cache" if "cache" in inspect.signature(model.model.forward).parameters else "past_key_values"


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run(method: str, weights: str, stream: list[int], s: int, w: int, n: int, keep_logits: bool):
    ids = torch.tensor(stream)
    prefill = ids[None, : s + w]
    tokens = ids[s + w : s + w + n]
    times, logits, kept = [], [], []
    model = build_model(weights)
    with torch.no_grad():
        if method == "sinklab":
            from sinklab import StreamSession

            with StreamSession(model, num_sinks=s, window=w) as session:
                out = session.feed(prefill)
                for tok in tokens:
                    t0 = time.perf_counter()
                    out = session.step(tok[None])
                    times.append(time.perf_counter() - t0)
                    kept.append(session.cache_tokens())
                    if keep_logits:
                        logits.append(out[0].clone())
        elif method == "dynamic-floor":
            from transformers import DynamicCache

            cache = DynamicCache(config=model.config)
            name = cache_kwarg(model)
            model(input_ids=prefill[:, : s + w - 1], use_cache=True, **{name: cache})
            for tok in tokens:
                t0 = time.perf_counter()
                out = model(input_ids=tok.view(1, 1), use_cache=True, **{name: cache}).logits
                cache.crop(-1)  # back to S + W − 1 keys: the cost of a dense cache of the same size
                times.append(time.perf_counter() - t0)
        elif method == "dense":  # full attention over everything (the reference for "first step that differs")
            from transformers import DynamicCache

            cache = DynamicCache(config=model.config)
            name = cache_kwarg(model)
            model(input_ids=prefill, use_cache=True, **{name: cache})
            for tok in tokens:
                t0 = time.perf_counter()
                out = model(input_ids=tok.view(1, 1), use_cache=True, **{name: cache}).logits
                times.append(time.perf_counter() - t0)
                if keep_logits:
                    logits.append(out[0, -1].clone())
        elif method == "recompute":
            window = ids[s + w - w + 1 : s + w].tolist()
            for tok in tokens:
                window = (window + [int(tok)])[-w:]
                t0 = time.perf_counter()
                out = model(input_ids=torch.tensor([window]), use_cache=False).logits
                times.append(time.perf_counter() - t0)
        elif method == "attention-sinks":
            import attention_sinks

            with tempfile.TemporaryDirectory() as tmp:
                model.save_pretrained(tmp)
                model = attention_sinks.LlamaForCausalLM.from_pretrained(
                    tmp, attention_sink_size=s, attention_sink_window_size=w - 1).eval()
            past = model(input_ids=prefill, use_cache=True).past_key_values
            for tok in tokens:
                t0 = time.perf_counter()
                res = model(input_ids=tok.view(1, 1), past_key_values=past, use_cache=True)
                past = res.past_key_values
                times.append(time.perf_counter() - t0)
                if keep_logits:
                    logits.append(res.logits[0, -1].clone())
        elif method == "hf-sinkcache":
            from transformers import SinkCache

            cache = SinkCache(window_length=s + w, num_sink_tokens=s)
            model(input_ids=prefill, past_key_values=cache, use_cache=True)
            for tok in tokens:
                t0 = time.perf_counter()
                res = model(input_ids=tok.view(1, 1), past_key_values=cache, use_cache=True)
                times.append(time.perf_counter() - t0)
                kept.append(int(cache.key_cache[0].shape[-2]))  # keys the old class holds after this step
                if keep_logits:
                    logits.append(res.logits[0, -1].clone())
        elif method == "kvpress":
            from kvpress import DecodingPress, StreamingLLMPress
            from transformers import DynamicCache

            press = DecodingPress(base_press=StreamingLLMPress(n_sink=s), compression_interval=64, target_size=s + w)
            cache = DynamicCache()
            with press(model):
                model(input_ids=prefill, past_key_values=cache, use_cache=True)
                for i, tok in enumerate(tokens):
                    pos = torch.tensor([s + w + i])
                    t0 = time.perf_counter()
                    model(input_ids=tok.view(1, 1), past_key_values=cache, use_cache=True, cache_position=pos)
                    times.append(time.perf_counter() - t0)
        else:
            raise SystemExit(f"unknown method {method}")
    return times, logits, kept


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("method")
    ap.add_argument("--weights", required=True, help="a .safetensors file (the bench's tiny Llama) or a Llama folder")
    ap.add_argument("--stream", required=True)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--window", type=int, required=True)
    ap.add_argument("--tokens", type=int, required=True)
    ap.add_argument("--logits", default=None, help="save per-step logits to this .pt file")
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)  # every method on one thread: steadier per-token timings on a shared machine
    stream = json.load(open(args.stream))
    times, logits, kept = run(args.method, args.weights, stream, args.sinks, args.window, args.tokens, bool(args.logits))
    if args.logits:
        torch.save(torch.stack(logits), args.logits)
    print(json.dumps({"method": args.method, "window": args.window, "ms": [t * 1e3 for t in times],
                      "peak_rss_mb": peak_mb(), "transformers": transformers.__version__,
                      "kept_max": max(kept) if kept else None}))


if __name__ == "__main__":
    main()
