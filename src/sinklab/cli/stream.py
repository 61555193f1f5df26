"""``sinklab stream``: generate with attention sinks + a sliding window, printing tokens as they come."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..errors import SinklabError
from ._common import (MODEL_HELP, app, device_map_option, err, load_for_command, plan_option, policy_option,
                      read_texts, retention, trust_remote_code_option, user_errors)


@app.command()
def stream(
    model: Annotated[str, typer.Argument(help="a RoPE causal LM: " + MODEL_HELP)],
    prompt: Annotated[str | None, typer.Option("--prompt", help="prompt text")] = None,
    file: Annotated[Path | None, typer.Option("--file", help="read the prompt from a UTF-8 file")] = None,
    sinks: Annotated[int, typer.Option("--sinks", help="attention sinks kept forever (S)")] = 4,
    window: Annotated[int, typer.Option("--window", help="recent tokens each query sees, itself included (W)")] = 1020,
    pin_prompt: Annotated[bool, typer.Option("--pin-prompt", help="keep the whole prompt forever")] = False,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens")] = 256,
    temperature: Annotated[float, typer.Option("--temperature", help="0 = greedy")] = 0.0,
    top_k: Annotated[int, typer.Option("--top-k")] = 0,
    chunk_size: Annotated[int, typer.Option("--chunk-size", help="prompt tokens per prefill chunk")] = 256,
    dtype: Annotated[str | None, typer.Option("--dtype")] = None,
    device: Annotated[str | None, typer.Option("--device")] = None,
    trust_remote_code: Annotated[bool, trust_remote_code_option()] = False,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    device_map: Annotated[str | None, device_map_option()] = None,
    compile: Annotated[bool | None, typer.Option("--compile/--eager", help="decode through torch.compile (on a "
                                                 "CPU with inductor's freezing: compiled again in every run), or "
                                                 "eagerly; default: compiled without freezing where it pays (a CPU, "
                                                 "float32 weights, a model of 50M+ parameters; $SINKLAB_COMPILE=0/1 "
                                                 "sets it): the first run per model and machine waits for the "
                                                 "compile, later runs load it from the cache")] = None,
    compile_backend: Annotated[str, typer.Option("--compile-backend", help="torch.compile backend for --compile")] = "inductor",
    compile_mode: Annotated[str | None, typer.Option("--compile-mode", help="torch.compile mode for --compile "
                                                     "(reduce-overhead: CUDA graphs on a GPU; "
                                                     "max-autotune-no-cudagraphs: inductor's own matrix kernels on "
                                                     "a CPU, faster with 2+ threads, minutes to compile)")] = None,
    freeze: Annotated[bool | None, typer.Option("--freeze/--no-freeze", help="with --compile: inductor's freezing "
                                                "(faster on a CPU, a second copy of the weights in memory; default: "
                                                "on, on a CPU)")] = None,
    policy: Annotated[str, policy_option()] = "streaming",
    plan: Annotated[Path | None, plan_option()] = None,
) -> None:
    """Generate with attention sinks + a sliding window in constant memory; tokens print as they come."""
    import sys as _sys
    import time

    from ..stream import StreamSession, stream_generate
    from ..stream.config import StreamConfig

    with user_errors():
        texts = read_texts(prompt, file, option="--prompt")
        if texts is None:
            raise SinklabError("give a prompt with --prompt or --file")
        sizes = (("--sinks", sinks, 0), ("--window", window, 1), ("--chunk-size", chunk_size, 1),
                 ("--max-new-tokens", max_new_tokens, 0), ("--top-k", top_k, 0))
        for flag, value, least in sizes:
            if value < least:
                raise SinklabError(f"{flag} must be ≥ {least}, got {value}")
        if not compile and (compile_mode is not None or compile_backend != "inductor"):
            raise SinklabError("--compile-backend and --compile-mode set how --compile compiles; add --compile")
        if freeze and not compile:
            raise SinklabError("--freeze is inductor's freezing of a compiled step; add --compile")
        loaded = load_for_command(model, dtype=dtype, device=device, trust_remote_code=trust_remote_code, device_map=device_map)
        # --pin-prompt: the prompt's tokens are kept forever (pins are fixed when the stream starts).
        n_prompt = len(loaded.tokenizer(texts[0])["input_ids"]) if texts[0] else 0
        pinned = [(0, n_prompt)] if pin_prompt and n_prompt else None
        config = StreamConfig(num_sinks=sinks, window=window, pinned=tuple(pinned or ()),
                              **retention(loaded, policy, plan, sinks, window))
        options = {"backend": compile_backend} | ({"mode": compile_mode} if compile_mode else {})
        session = StreamSession(loaded.model, config=config, chunk_size=chunk_size,
                                compile=options if compile else compile, freeze=freeze)
        start = time.perf_counter()
        count = 0
        with session:
            for piece in stream_generate(loaded.model, loaded.tokenizer, texts[0], num_sinks=sinks, window=window,
                                         pin_prompt=pin_prompt, max_new_tokens=max_new_tokens, temperature=temperature,
                                         top_k=top_k, seed=seed, session=session):
                _sys.stdout.write(piece)  # type: ignore[arg-type]  # one prompt: each piece is a str
                _sys.stdout.flush()
                count += 1
                if count % 16 == 0 or count == max_new_tokens:
                    rate = count / max(1e-9, time.perf_counter() - start)
                    err.print(f"[{count} tokens, {rate:.1f} tok/s, cache {session.cache_tokens()} / "
                              f"{session.state.capacity} tokens]", highlight=False)
        _sys.stdout.write("\n")
