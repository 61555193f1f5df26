"""``sinklab stream``: generate with attention sinks + a sliding window, printing tokens as they come."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..errors import SinklabError
from ._common import (MODEL_HELP, app, device_map_option, err, load_for_command, plan_option, policy_option,
                      read_texts, retention, trust_remote_code_option, user_errors)


COMPILE_HELP = ("decode through torch.compile (on a CPU with inductor's freezing: compiled again in every run), or "
                "eagerly; default: eager for the first 1,024 steps, then compiled without freezing where it pays (a "
                "CPU, float32/bfloat16/float16 weights, a model of 50M+ parameters; $SINKLAB_COMPILE=0/1 sets it), loaded from the "
                "compile cache after the first run per model and machine, each one-token matrix product an inductor "
                "reduction; eager steps read float32 CPU weights stored for one-token steps "
                "($SINKLAB_DECODE_LAYOUT=0 turns that off)")


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
    compile: Annotated[bool | None, typer.Option("--compile/--eager", help=COMPILE_HELP)] = None,
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
    video: Annotated[list[Path] | None, typer.Option(
        "--video", help="frames for a vision-language model: a folder of images (name order) or image files "
                        "(repeat); streamed frame by frame, the prompt first")] = None,
    recent_frames: Annotated[int, typer.Option("--recent-frames", help="with --video: the newest frames kept")] = 4,
    pin_frame: Annotated[list[int] | None, typer.Option(
        "--pin-frame", help="with --video: a frame index kept forever (repeat; default: the first)")] = None,
    max_frames: Annotated[int, typer.Option("--max-frames", help="with --video: stop after this many frames (0: "
                                            "when the frames run out, or never with --loop)")] = 0,
    loop: Annotated[bool, typer.Option("--loop", help="with --video: feed the frames again and again (endless)")] = False,
) -> None:
    """Generate with attention sinks + a sliding window in constant memory; tokens print as they come."""
    from ..stream import StreamSession, stream_generate
    from ..stream.config import StreamConfig

    with user_errors():
        if video:
            _refuse_with_video((("--window", window != 1020), ("--pin-prompt", pin_prompt),
                                ("--policy", policy != "streaming"), ("--plan", plan is not None),
                                ("--compile", bool(compile)), ("--device-map", device_map is not None),
                                ("--temperature", temperature != 0.0)))
            _stream_video(model, video, prompt, file, sinks=sinks, recent_frames=recent_frames,
                          pin_frames=tuple(pin_frame) if pin_frame else (0,), max_frames=max_frames, loop=loop,
                          max_new_tokens=max_new_tokens, dtype=dtype, device=device,
                          trust_remote_code=trust_remote_code)
            return
        if loop or max_frames or pin_frame or recent_frames != 4:
            raise SinklabError("--recent-frames, --pin-frame, --max-frames and --loop set how --video streams; add "
                               "--video")
        texts = read_texts(prompt, file, option="--prompt")
        if texts is None:
            raise SinklabError("give a prompt with --prompt or --file")
        _check_sizes((("--sinks", sinks, 0), ("--window", window, 1), ("--chunk-size", chunk_size, 1),
                      ("--max-new-tokens", max_new_tokens, 0), ("--top-k", top_k, 0)))
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
        with session:
            pieces = stream_generate(loaded.model, loaded.tokenizer, texts[0], num_sinks=sinks, window=window,
                                     pin_prompt=pin_prompt, max_new_tokens=max_new_tokens, temperature=temperature,
                                     top_k=top_k, seed=seed, session=session)
            _print_pieces(pieces, session, max_new_tokens)


def _refuse_with_video(flags) -> None:
    """One line naming the text stream's flags given with ``--video``."""
    ignored = [flag for flag, on in flags if on]
    if ignored:
        raise SinklabError(f"{', '.join(ignored)}: not with --video (the video memory sets the window from "
                           "--recent-frames and pins the prompt; decoding is greedy)")


def _check_sizes(sizes) -> None:
    for flag, value, least in sizes:
        if value < least:
            raise SinklabError(f"{flag} must be ≥ {least}, got {value}")


def _print_pieces(pieces, session, max_new_tokens: int) -> None:
    """Each piece on stdout as it comes; every 16 tokens the rate and the cache's size on stderr."""
    import sys
    import time

    start, count = time.perf_counter(), 0
    for piece in pieces:
        sys.stdout.write(piece)
        sys.stdout.flush()
        count += 1
        if count % 16 == 0 or count == max_new_tokens:
            rate = count / max(1e-9, time.perf_counter() - start)
            err.print(f"[{count} tokens, {rate:.1f} tok/s, cache {session.cache_tokens()} / "
                      f"{session.state.capacity} tokens]", highlight=False)
    sys.stdout.write("\n")


def _frames(files: list[Path], loop: bool, limit: int):
    """The frames read one by one (an unreadable one stops the stream with its name), cycled with ``loop``."""
    from ..vision_inputs import load_images

    count = 0
    while True:
        for path in files:
            if limit and count >= limit:
                return
            yield load_images([path])[0]
            count += 1
        if not loop:
            return


def _stream_video(model: str, sources: list[Path], prompt: str | None, file: Path | None, *, sinks: int,
                  recent_frames: int, pin_frames: tuple[int, ...], max_frames: int, loop: bool, max_new_tokens: int,
                  dtype: str | None, device: str | None, trust_remote_code: bool) -> None:
    """``sinklab stream MODEL --video …``: the prompt, then every frame, under the video memory; one line per
    frame (the greedy next token, the cache's size), then a greedy answer once the frames end."""
    import torch

    from ..vision_inputs import load_images
    from ..vision_stream import check_vision_stream, frame_files, stream_video

    for flag, value, least in (("--sinks", sinks, 0), ("--recent-frames", recent_frames, 1),
                               ("--max-frames", max_frames, 0), ("--max-new-tokens", max_new_tokens, 0)):
        if value < least:
            raise SinklabError(f"{flag} must be ≥ {least}, got {value}")
    files = frame_files(sources)
    load_images(files[:1])  # an unreadable first frame fails before the model loads
    texts = read_texts(prompt, file, option="--prompt")
    loaded = load_for_command(model, dtype=dtype, device=device, trust_remote_code=trust_remote_code)
    check_vision_stream(loaded.model)
    processor = _image_processor(model, trust_remote_code)
    tokenizer = loaded.tokenizer
    prompt_ids = tokenizer(texts[0])["input_ids"] if texts and texts[0] else []
    logits = session = None
    for index, logits, session, memory in stream_video(loaded.model, _frames(files, loop, max_frames),
                                                       prompt_ids=prompt_ids, num_sinks=sinks,
                                                       recent_frames=recent_frames, pinned_frames=pin_frames,
                                                       image_processor=processor):
        token = tokenizer.decode([int(logits.argmax(-1))])
        err.print(f"frame {index}: next {token!r} · cache {session.cache_tokens()} / {session.state.capacity} "
                  f"tokens ({memory.frame_tokens} per frame)", highlight=False)
        if max_new_tokens and (max_frames and index + 1 == max_frames or not loop and index + 1 == len(files)):
            answer = []
            for _ in range(max_new_tokens):
                answer.append(int(logits.argmax(-1)))
                logits = session.step(torch.tensor(answer[-1:]))
            print(tokenizer.decode(answer))


def _image_processor(model: str, trust_remote_code: bool):
    """The model's own image preprocessor when its folder or hub id has one, else None (pixels from the config)."""
    from ..errors import InputError
    from ..models import load_processor

    try:
        processor = load_processor(model, trust_remote_code=trust_remote_code)
    except InputError:
        return None
    return getattr(processor, "image_processor", None)
