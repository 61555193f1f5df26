"""Worker of ``benchmarks/vs_llamacpp.py``: llama.cpp (llama-cpp-python) decoding at a fixed cached length.

Runs inside the throwaway virtualenv that holds llama-cpp-python (no torch, no sinklab). Reads one JSON job on
argv[1] and prints one JSON line of results:

``{"model": PATH.gguf, "threads": N, "cached": C, "num_sinks": S, "steps": K, "rounds": R}``

Everything goes through llama.cpp's C API (``llama_cpp`` low-level bindings), one sequence:

* **prefill** — ``C`` tokens in one ``llama_decode`` per batch of ``n_batch`` (ms per prompt token);
* **plain** (the floor) — one token decoded at ``C`` cached tokens, then removed again
  (``llama_memory_seq_rm``), so every step attends over ``C + 1`` keys;
* **shift** (llama.cpp's StreamingLLM) — keep the first ``S`` tokens; each step removes the oldest token after
  them (``llama_memory_seq_rm``), moves the positions of the rest back by one (``llama_memory_seq_add``: llama.cpp
  re-rotates the cached keys with RoPE before the next decode), and decodes one token at ``C`` cached tokens;
* **cli-shift** (llama.cpp's context shift as its CLI does it) — when the context of ``C`` tokens is full, keep
  ``S`` and drop half of the rest at once (``n_discard = (C − S) / 2``: ``seq_rm`` of that span, ``seq_add`` of
  ``−n_discard`` on the tokens after it), then decode on until it is full again. The cost per token averaged over
  one such cycle: the mean plain decode over ``steps`` cached lengths spread evenly over the cycle
  (``C − n_discard … C − 1``; a decode's cost grows with the cached length) plus the shift — the decode right after
  it, which re-rotates the kept keys, less a plain decode at that length — divided by ``n_discard``.
* **first token** — the prompt of ``C`` tokens prefilled and one token decoded, from a cleared cache (``load_s``:
  the model load and context set-up before it, once per process).

Tokens are pseudo-random ids (the same generator as the torch side's seeds is not needed: the timing does not
depend on the ids). The median ms per token over ``rounds × steps`` steps is printed for each phase.
"""

from __future__ import annotations

import ctypes
import json
import random
import statistics
import sys
import time

import llama_cpp as L  # noqa: N812


def _batch(tokens: list[int], start: int, logits_last: bool = True):
    """A llama_batch of ``tokens`` at positions ``start, start + 1, …`` in sequence 0."""
    n = len(tokens)
    batch = L.llama_batch_init(n, 0, 1)
    for i, tok in enumerate(tokens):
        batch.token[i] = tok
        batch.pos[i] = start + i
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = 0
        batch.logits[i] = 1 if (logits_last and i == n - 1) else 0
    batch.n_tokens = n
    return batch


def _decode(ctx, tokens: list[int], start: int) -> None:
    batch = _batch(tokens, start)
    try:
        rc = L.llama_decode(ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        L.llama_get_logits_ith(ctx, -1)  # the logits are ready (the CPU backend computes them in llama_decode)
    finally:
        L.llama_batch_free(batch)


def main() -> None:
    job = json.loads(sys.argv[1])
    threads, cached, sinks = job["threads"], job["cached"], job["num_sinks"]
    steps, rounds, n_batch = job["steps"], job["rounds"], job.get("n_batch", 512)
    started = time.perf_counter()
    L.llama_backend_init()
    mparams = L.llama_model_default_params()
    model = L.llama_model_load_from_file(job["model"].encode(), mparams)
    if not model:
        raise SystemExit(f"llama.cpp could not load {job['model']}")
    vocab = L.llama_n_vocab(L.llama_model_get_vocab(model))
    cparams = L.llama_context_default_params()
    cparams.n_ctx = cached + 64
    cparams.n_batch = n_batch
    cparams.n_ubatch = n_batch
    cparams.n_threads = threads
    cparams.n_threads_batch = threads
    ctx = L.llama_init_from_model(model, cparams)
    mem = L.llama_get_memory(ctx)
    load_s = time.perf_counter() - started
    rng = random.Random(0)
    prompt = [rng.randrange(10, vocab - 1) for _ in range(cached)]
    token = rng.randrange(10, vocab - 1)

    def prefill() -> float:
        L.llama_memory_clear(mem, True)
        t = time.perf_counter()
        for i in range(0, cached, n_batch):
            _decode(ctx, prompt[i:i + n_batch], i)
        return 1e3 * (time.perf_counter() - t) / cached

    def plain_at(length: int) -> float:
        """One token decoded at ``length`` cached tokens (the cache holds at least that many), then removed."""
        L.llama_memory_seq_rm(mem, 0, length, -1)
        t = time.perf_counter()
        _decode(ctx, [token], length)
        ms = 1e3 * (time.perf_counter() - t)
        L.llama_memory_seq_rm(mem, 0, length, -1)
        return ms

    def cli_shift() -> float:
        """ms per token over one context-shift cycle of llama.cpp's CLI (the cache full at ``cached`` tokens)."""
        discard = (cached - sinks) // 2
        lengths = sorted({cached - discard + (i * (discard - 1)) // max(1, steps - 1) for i in range(steps)})
        prefill()
        decodes = [plain_at(n) for n in reversed(lengths)]  # from the full cache down: each removes the tail
        prefill()  # full again: `cached` tokens
        t = time.perf_counter()
        L.llama_memory_seq_rm(mem, 0, sinks, sinks + discard)
        L.llama_memory_seq_add(mem, 0, sinks + discard, -1, -discard)
        _decode(ctx, [token], cached - discard)  # applies the shift (the kept keys re-rotated), then decodes
        shifted = 1e3 * (time.perf_counter() - t)
        shift = max(0.0, shifted - plain_at(cached - discard))
        return statistics.mean(decodes) + shift / discard

    def first_token() -> float:
        t = time.perf_counter()
        prefill()
        _decode(ctx, [token], cached)
        return time.perf_counter() - t

    out: dict[str, list[float]] = {"prefill": [], "plain": [], "shift": [], "cli-shift": []}
    firsts = []
    for _ in range(rounds):
        out["prefill"].append(prefill())
        for _ in range(2):  # warm-up
            _decode(ctx, [token], cached)
            L.llama_memory_seq_rm(mem, 0, cached, -1)
        for _ in range(steps):
            t = time.perf_counter()
            _decode(ctx, [token], cached)
            out["plain"].append(1e3 * (time.perf_counter() - t))
            L.llama_memory_seq_rm(mem, 0, cached, -1)
        # StreamingLLM: the cache holds `cached` tokens (positions 0 … cached − 1); each step evicts one
        for _ in range(steps + 2):
            t = time.perf_counter()
            if not L.llama_memory_seq_rm(mem, 0, sinks, sinks + 1):
                raise RuntimeError("llama_memory_seq_rm refused to remove a token")
            L.llama_memory_seq_add(mem, 0, sinks + 1, -1, -1)
            _decode(ctx, [token], cached - 1)
            out["shift"].append(1e3 * (time.perf_counter() - t))
        del out["shift"][-(steps + 2):-steps]  # the first two shift steps of each round are warm-up
        out["cli-shift"].append(cli_shift())
        firsts.append(first_token())
    L.llama_free(ctx)
    L.llama_model_free(model)
    print(json.dumps({"version": L.__version__, "ms_per_token": {k: statistics.median(v) for k, v in out.items()},
                      "samples": {k: len(v) for k, v in out.items()}, "load_s": load_s,
                      "first_token_s": statistics.median(firsts), "system_info":
                      ctypes.string_at(L.llama_print_system_info()).decode(errors="replace")}))


if __name__ == "__main__":
    main()
