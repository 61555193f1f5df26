"""``sinklab chat``: an endless terminal chat through one persistent SinkCache (StreamingLLM's chatbot)."""

from __future__ import annotations

import json
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from ..errors import InputError, SinklabError
from ._common import (MODEL_HELP, app, device_map_option, err, load_for_command, plan_option, policy_option, retention,
                      trust_remote_code_option, user_errors)

COMMANDS = {"/reset": "forget the conversation (the system prompt stays)", "/save FILE": "save the chat",
            "/load FILE": "continue a saved chat", "/quit": "leave (so does Ctrl-D)", "/help": "this list"}
_HELP = "commands: " + "; ".join(f"{k} — {v}" for k, v in COMMANDS.items())


def script_turns(path: Path) -> Iterator[str]:
    """User turns of a ``--script`` file: one per line, as plain text or as JSON lines (``"text"`` or
    ``{"user": "text"}``); blank lines are skipped, ``/commands`` run as typed."""
    if path.is_dir():
        raise InputError(f"--script {path}: is a folder, not a file of user turns")
    if not path.is_file():
        raise InputError(f"--script {path}: no such file")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise InputError(f"--script {path}: not UTF-8 text (offset {exc.start})") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if line.lstrip()[:1] in '{"':
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InputError(f"--script {path}, line {number}: not valid JSON ({exc.msg})") from None
            if isinstance(item, dict):
                item = item.get("user", item.get("content"))
            if not isinstance(item, str) or not item.strip():
                raise InputError(f"--script {path}, line {number}: a JSON line must be a string or "
                                 '{"user": "text"}')
            yield item
        else:
            yield line


def _stdin_turns(interactive: bool) -> Iterator[str]:
    while True:
        try:
            line = input("you> ") if interactive else sys.stdin.readline()
        except EOFError:
            return
        except KeyboardInterrupt:  # Ctrl-C at the prompt: a fresh prompt, not the end of the chat
            sys.stdout.write("\n")
            continue
        if not interactive and line == "":
            return
        line = line.rstrip("\n")
        if line.strip():
            yield line


def _command(chat, line: str) -> bool:
    """Run a ``/command``; False means quit."""
    name, _, arg = line.strip().partition(" ")
    arg = arg.strip()
    if name in ("/quit", "/exit"):
        return False
    if name == "/help":
        err.print(_HELP, highlight=False)
    elif name == "/reset":
        chat.reset()
        err.print("[dim]conversation reset[/dim]", highlight=False)
    elif name in ("/save", "/load"):
        if not arg:
            raise InputError(f"{name} needs a file name, e.g. {name} chat.safetensors")
        if name == "/save":
            err.print(f"[dim]saved to {escape(str(chat.save(Path(arg))))}[/dim]", highlight=False)
        else:
            chat.load(Path(arg))
            m = chat.meter()
            err.print(f"[dim]loaded {escape(arg)}: {m.tokens_seen} tokens streamed, {m.kept} kept[/dim]",
                      highlight=False)
    else:
        raise InputError(f"unknown command {name}; {_HELP}")
    return True


def _answer(chat, line: str, transcript: bool) -> None:
    """Stream one answer to stdout; Ctrl-C stops it (the stream stays consistent), not the chat."""
    if transcript:
        sys.stdout.write(f"user: {line}\n")
    sys.stdout.write("assistant: " if transcript else "")
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, lambda *_: chat.stop()) if main else None
    started = False
    try:
        for piece in chat.turn(line):
            if not started:  # the answer's leading space (a word-initial token) is not printed
                piece = piece.lstrip()
                started = bool(piece)
            sys.stdout.write(piece)
            sys.stdout.flush()
    finally:
        if main:
            signal.signal(signal.SIGINT, previous)
    sys.stdout.write("\n")
    sys.stdout.flush()
    turn = chat.turns[-1]
    note = " · interrupted" if turn.stopped == "interrupted" else ""
    err.print(f"[dim]{escape(chat.meter().line())}{note}[/dim]", highlight=False)


@app.command()
def chat(
    model: Annotated[str, typer.Argument(help="a RoPE causal LM (ideally an instruct model): " + MODEL_HELP)] =
        "builtin:smollm2",
    system: Annotated[str | None, typer.Option("--system", help="system prompt, pinned: kept forever")] = None,
    script: Annotated[Path | None, typer.Option("--script", help="run these user turns (one per line, or JSON "
                                                                 "lines) and print the transcript")] = None,
    sinks: Annotated[int, typer.Option("--sinks", help="attention sinks kept forever (S)")] = 4,
    window: Annotated[int, typer.Option("--window", help="recent tokens each query sees, itself included (W)")] = 1020,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", help="longest answer, in tokens")] = 256,
    temperature: Annotated[float, typer.Option("--temperature", help="0 = greedy")] = 0.0,
    top_k: Annotated[int, typer.Option("--top-k")] = 0,
    chunk_size: Annotated[int, typer.Option("--chunk-size", help="prompt tokens per prefill chunk")] = 256,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    dtype: Annotated[str | None, typer.Option("--dtype")] = None,
    device: Annotated[str | None, typer.Option("--device")] = None,
    trust_remote_code: Annotated[bool, trust_remote_code_option()] = False,
    device_map: Annotated[str | None, device_map_option()] = None,
    policy: Annotated[str, policy_option()] = "streaming",
    plan: Annotated[Path | None, plan_option()] = None,
    eager: Annotated[bool, typer.Option("--eager", help="decode without torch.compile (default: eager for the first "
                                        "1,024 steps, then compiled where it pays, a CPU and float32/bfloat16/"
                                        "float16 weights; "
                                        "the compile is cached per model and machine)")] = False,
) -> None:
    """Chat with a model through one stream in constant memory: /reset, /save FILE, /load FILE, /quit.

    Tokens print as they come; after each answer one line shows the cache (kept / evicted / pinned tokens,
    tok/s). Ctrl-C stops the current answer, Ctrl-D (end of input) leaves. With --script, or with input piped
    in, the chat runs without prompts and prints the transcript."""
    from ..chat import ChatStream
    from ..stream.config import StreamConfig

    with user_errors():
        turns = list(script_turns(script)) if script is not None else None
        loaded = load_for_command(model, dtype=dtype, device=device, trust_remote_code=trust_remote_code, device_map=device_map)
        config = StreamConfig(num_sinks=sinks, window=window, **retention(loaded, policy, plan, sinks, window))
        engine = ChatStream(loaded.model, loaded.tokenizer, system=system, config=config, chunk_size=chunk_size,
                            max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, seed=seed,
                            compile=False if eager else None)
        if not engine.own_template:
            err.print(f"[yellow]note:[/yellow] {model}'s tokenizer has no chat template; using a plain "
                      "'User: … / Assistant:' layout", highlight=False)
        interactive = turns is None and sys.stdin.isatty()
        if interactive:
            err.print(f"[dim]{escape(model)} · S={sinks} W={window} · {_HELP}[/dim]", highlight=False)
        with engine:
            for line in (turns if turns is not None else _stdin_turns(interactive)):
                try:
                    if line.lstrip().startswith("/"):
                        if not _command(engine, line):
                            break
                        continue
                    _answer(engine, line, transcript=not interactive)
                except SinklabError as exc:  # a bad command or message: say so, keep chatting
                    err.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False, soft_wrap=True)
