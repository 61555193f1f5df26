"""``sinklab chat`` / ``ChatStream``: a scripted chat equals ``generate`` with a DynamicCache while nothing is
evicted and the float64 StreamingLLM reference after; piped stdin, --script, /save /reset /load, and one
session under a pseudo-terminal (Ctrl-C stops the answer, not the chat; Ctrl-D ends it)."""

from __future__ import annotations

import copy
import json
import os
import pty
import select
import sys
import time

import pytest
import torch
from transformers import DynamicCache
from typer.testing import CliRunner

import sinklab
from sinklab._compat import cache_kwarg_name
from sinklab.cli import app
from sinklab.chat import ChatStream, Meter

from stream_reference import Reference

pytestmark = pytest.mark.usefixtures("one_thread")

TURNS = ["Return the value of x", "What is a class?", "Thanks, and the module?"]
# A ChatML-like template written out in plain text (tiny-lm's tokenizer has no chat markers of its own).
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


@pytest.fixture(scope="module")
def tiny_lm():
    loaded = sinklab.load_model("builtin:tiny-lm")
    tok = copy.deepcopy(loaded.tokenizer)
    tok.chat_template = TEMPLATE
    return loaded.model, tok


def _chat(model, tok, **kw) -> tuple[ChatStream, Meter]:
    with ChatStream(model, tok, **kw) as chat:
        for turn in TURNS:
            for _ in chat.turn(turn):
                pass
        return chat, chat.meter()


def _all_ids(chat: ChatStream) -> list[int]:
    return [i for t in chat.turns for i in t.prompt_ids + t.answer_ids]


def test_chat_equals_generate_with_a_dynamic_cache_before_eviction(tiny_lm):
    model, tok = tiny_lm
    chat, meter = _chat(model, tok, system="Answer briefly.", window=400, max_new_tokens=10)
    # The ids fed are exactly the template over the conversation (each turn tokenized once, never re-tokenized).
    assert tok.decode(_all_ids(chat)) == tok.apply_chat_template(chat.messages, tokenize=False)[:len(chat.rendered)]
    assert meter.evicted == 0 and meter.pinned > 0 and meter.kept == len(_all_ids(chat))
    context: list[int] = []
    for turn in chat.turns:
        context += turn.prompt_ids
        with torch.no_grad():
            out = model.generate(torch.tensor([context]), **{cache_kwarg_name(model): DynamicCache(config=model.config)},
                                 max_new_tokens=10, do_sample=False, eos_token_id=tok.eos_token_id,
                                 pad_token_id=tok.pad_token_id)[0, len(context):].tolist()
        assert out[:len(turn.answer_ids)] == turn.answer_ids
        if turn.stopped == "eos":
            assert out[len(turn.answer_ids)] == tok.eos_token_id
        context += turn.answer_ids


def test_chat_past_eviction_equals_the_float64_reference_with_the_system_prompt_pinned(tiny_lm):
    model, tok = tiny_lm
    chat, meter = _chat(model, tok, system="Answer briefly.", num_sinks=4, window=16, max_new_tokens=12)
    assert meter.evicted > 30 and meter.kept == 4 + (meter.pinned - 4) + 16
    ref = Reference(model, 4, 16, pinned=[(0, chat.pinned_tokens)])
    checked = 0
    for turn in chat.turns:
        for t in turn.prompt_ids[:-1]:
            ref.step(t)
        logits = ref.step(turn.prompt_ids[-1])
        expected = turn.answer_ids + ([tok.eos_token_id] if turn.stopped == "eos" else [])
        for i, token in enumerate(expected):
            top2 = logits.topk(2).values
            if float(top2[0] - top2[1]) > 1e-3:  # a float64 near-tie may break either way
                assert int(logits.argmax()) == token
                checked += 1
            if i < len(turn.answer_ids):
                logits = ref.step(token)
    assert checked >= 25


runner = CliRunner()


def _cli(*args, input: str | None = None):
    return runner.invoke(app, ["chat", "builtin:tiny-lm", *map(str, args)], input=input)


def test_piped_stdin_save_reset_load_and_errors(tmp_path):
    saved = tmp_path / "chat.safetensors"
    common = ("--window", "8", "--max-new-tokens", "6", "--system", "Be brief.")
    straight = _cli(*common, input="Return the value\nWhat next?\n")
    around = _cli(*common, input=f"Return the value\n/save {saved}\n/reset\n/bogus\n/load {saved}\nWhat next?\n")
    assert straight.exit_code == 0 and around.exit_code == 0, around.output
    assert straight.stdout == around.stdout  # /load resumes exactly where /save left off
    users = [line for line in around.stdout.splitlines() if line.startswith("user: ")]
    assert users == ["user: Return the value", "user: What next?"] and around.stdout.count("assistant:") == 2
    assert "no chat template" in around.stderr and "unknown command /bogus" in around.stderr
    meters = [line for line in around.stderr.splitlines() if line.startswith("[cache ")]
    assert len(meters) == 2 and "evicted" in meters[-1] and " pinned" in meters[-1]
    assert saved.is_file() and not list(tmp_path.glob(".*tmp"))
    bad = _cli(*common, input=f"/load {tmp_path / 'missing.safetensors'}\n/save\n")
    assert bad.exit_code == 0 and "no such file" in bad.stderr and "/save needs a file name" in bad.stderr


def test_script_lines_and_json_lines_give_the_api_transcript(tmp_path, tiny_lm):
    script = tmp_path / "turns.jsonl"
    script.write_text(f"{TURNS[0]}\n\n{json.dumps(TURNS[1])}\n{json.dumps({'user': TURNS[2]})}\n")
    result = _cli("--script", script, "--window", "16", "--max-new-tokens", "8")
    assert result.exit_code == 0, result.output
    loaded = sinklab.load_model("builtin:tiny-lm")
    chat, _ = _chat(loaded.model, loaded.tokenizer, window=16, max_new_tokens=8)  # the plain layout, as the CLI
    assert result.stdout == "".join(f"user: {t.user}\nassistant: {t.answer.lstrip()}\n" for t in chat.turns)
    script.write_text('{"user": 3}\n')
    bad = _cli("--script", script)
    assert bad.exit_code == 2 and "line 1: a JSON line must be a string" in " ".join(bad.output.split())


def _read_until(fd: int, seen: bytearray, done, what: str, timeout: float = 240.0) -> None:
    """Read the terminal into ``seen`` until ``done(seen)``."""
    end = time.monotonic() + timeout
    while not done(seen):
        assert time.monotonic() < end, f"{what} never came; got {bytes(seen[-400:])!r}"
        ready, _, _ = select.select([fd], [], [], 1.0)
        if ready:
            try:
                seen += os.read(fd, 4096)
            except OSError:  # the child closed the terminal
                return


@pytest.mark.long
def test_under_a_pseudo_terminal_ctrl_c_stops_the_answer_and_ctrl_d_ends_the_chat():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1", COLUMNS="200")
    pid, fd = pty.fork()
    if pid == 0:  # the child: a chat on the terminal, answers that would run for 100,000 tokens
        os.execve(sys.executable, [sys.executable, "-m", "sinklab.cli", "chat", "builtin:tiny-llama", "--window",
                                   "16", "--max-new-tokens", "100000"], env)
    seen = bytearray()
    try:
        _read_until(fd, seen, lambda b: b"you> " in b, "the prompt")
        os.write(fd, b"hello there\n")
        _read_until(fd, seen, lambda b: b"hello there\r\n" in b, "the echo")
        start = len(seen)
        _read_until(fd, seen, lambda b: len(b) - start > 40, "the answer's first tokens")
        os.write(fd, b"\x03")  # Ctrl-C: the terminal sends SIGINT
        _read_until(fd, seen, lambda b: b"interrupted" in b and b[b.index(b"interrupted"):].count(b"you> ") >= 1,
                    "a meter marked interrupted, then a new prompt")
        os.write(fd, b"\x04")  # Ctrl-D at the prompt: end of input
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, bytes(seen[-400:])
    finally:
        try:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        os.close(fd)
    assert b"Traceback" not in seen and b"[cache " in seen


@pytest.mark.parametrize("args, message", [
    (["--temperature", "nan"], "temperature must be a finite number ≥ 0"),
    (["--temperature", "-1"], "temperature must be a finite number ≥ 0"),
    (["--top-k", "-3"], "top_k must be an integer ≥ 0"),
    (["--window", str(10**20)], "more than any memory holds"),
    (["--script", "."], "is a folder, not a file of user turns"),
])
def test_chat_settings_fail_once_before_the_first_turn(args, message):
    """Bad sampling settings or sizes end the command with one line before any turn (they used to crash with a
    traceback at the first sampled token, or fail again on every turn)."""
    from typer.testing import CliRunner

    from sinklab.cli import app

    r = CliRunner().invoke(app, ["chat", "builtin:tiny-lm", "--max-new-tokens", "2", *args], input="hi\n")
    assert r.exit_code == 2 and message in " ".join(r.output.split()) and "Traceback" not in r.output, r.output
