"""Bad input at the command line: one red line, exit code 2 (130 for Ctrl-C), no traceback, nothing left behind.

Every case runs the CLI in-process (typer's CliRunner) as a user would type it and checks the exit code,
the message and the folder the command would have written.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
import typer
from typer.testing import CliRunner

import sinklab
from sinklab.cli import app
from sinklab.cli._common import user_errors, check_out_dir
from sinklab.errors import InputError, SinklabWarning

pytestmark = pytest.mark.usefixtures("one_thread")


runner = CliRunner()


def run(*args: str):
    result = runner.invoke(app, [str(a) for a in args])
    text = " ".join(result.output.split())  # rich wraps long lines at the terminal width
    return result, text


def fails(args, code: int, *needles: str) -> str:
    result, text = run(*args)
    assert result.exit_code == code, text
    assert "Traceback" not in text and result.exception is None or isinstance(result.exception, SystemExit)
    for needle in needles:
        assert needle in text, text
    return text


def leftovers(folder: Path) -> list[str]:
    """Temporary folders that an atomic writer failed to clean up."""
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(".sinklab-"))


@pytest.fixture(scope="module")
def bb_run(tmp_path_factory):
    """A 3-step ``sinklab train --data bb --variant gated`` run: a checkpoint of token ids, no tokenizer."""
    out = tmp_path_factory.mktemp("bb") / "run"
    result, text = run("train", "--data", "bb", "--out", out, "--layers", "1", "--heads", "1", "--width", "16",
                       "--seq-len", "8", "--batch-size", "4", "--steps", "3", "--variant", "gated",
                       "--monitor-every", "3")
    assert result.exit_code == 0, text
    assert "Bigram-Backcopy" in text
    assert (out / "emergence.png").stat().st_size > 1000  # rendered by the CLI from monitor.jsonl
    return out


def test_version():
    result, text = run("--version")
    assert result.exit_code == 0 and text.startswith(f"sinklab {sinklab.__version__} (transformers ")


def test_model_paths_that_do_not_exist_or_are_not_models(tmp_path):
    fails(["scan", tmp_path / "nope" / "model"], 2, "no such file or directory")
    fails(["scan", "./nope"], 2, "./nope: no such file or directory")
    assert "Repo id" not in fails(["scan", "nope/dir/x"], 2, "no such file or directory")
    (tmp_path / "empty").mkdir()
    fails(["scan", tmp_path / "empty"], 2, "has no config.json")
    (tmp_path / "file.bin").write_bytes(b"\0\1")
    fails(["scan", tmp_path / "file.bin"], 2, "is a file, not a model folder")


def test_unknown_builtin_lists_every_builtin():
    text = fails(["scan", "builtin:nope"], 2, "unknown built-in model 'builtin:nope'")
    for name in sinklab.BUILTIN_MODELS:
        assert name in text
    assert "builtin:tiny-lm" in text


def test_device_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    fails(["scan", "builtin:tiny-llama", "--device", "cuda"], 2, "CUDA is not available", "--device cpu")
    fails(["scan", "builtin:tiny-llama", "--device", "gpu0"], 2, "is not a device name")


def test_bad_text_input(tmp_path):
    binary = tmp_path / "blob.bin"
    binary.write_bytes(bytes(range(128, 256)) * 4)
    fails(["scan", "builtin:tiny-llama", "--file", binary, "--out", tmp_path / "o"], 2, "not UTF-8 text",
          "byte 0x80 at offset 0")
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n\n ")
    fails(["scan", "builtin:tiny-llama", "--file", empty, "--out", tmp_path / "o"], 2, "is empty")
    fails(["scan", "builtin:tiny-llama", "--text", "   ", "--out", tmp_path / "o"], 2, "--text is empty")
    fails(["scan", "builtin:tiny-llama", "--file", tmp_path, "--out", tmp_path / "o"], 2, "is a folder")
    fails(["scan", "builtin:tiny-llama", "--file", tmp_path / "missing.txt"], 2, "no such file")
    assert not (tmp_path / "o").exists()


def test_token_id_checkpoint_given_to_a_text_command(bb_run):
    fails(["scan", bb_run / "final"], 2, "has no tokenizer", "--data bb")
    loaded = sinklab.load_model(str(bb_run / "final"))  # the Python API loads it, for token-id work
    assert loaded.tokenizer is None and loaded.model.config.sinklab_variant["gate"] == "elementwise"


def test_truncated_checkpoint(bb_run, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(bb_run / "final", broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    fails(["scan", broken], 2, "corrupt or truncated safetensors file", "model.safetensors")


def test_a_config_transformers_rejects_is_one_clear_error(tmp_path):
    """A folder whose config.json transformers refuses (a field of the wrong type) or whose sizes build no model
    (hidden_size −5) gives one error naming config.json and the reason — never transformers' traceback."""
    import json

    import transformers as tf

    folder = tmp_path / "model"
    config = tf.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                            num_attention_heads=2, num_key_value_heads=2)
    tf.LlamaForCausalLM(config).save_pretrained(folder)
    good = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**good, "num_attention_heads": "x"}))
    fails(["scan", folder], 2, "cannot read its config.json", "num_attention_heads", "expected int")
    (folder / "config.json").write_text(json.dumps({**good, "hidden_size": -5}))
    fails(["scan", folder], 2, "config.json", "hidden size (-5)")


def test_out_must_be_a_writable_folder(tmp_path):
    a_file = tmp_path / "report.txt"
    a_file.write_text("keep me")
    fails(["synth", "nop", "--out", a_file, "--steps", "1"], 2, "is an existing file, not a folder")
    fails(["synth", "nop", "--out", a_file / "sub", "--steps", "1"], 2, "is a file, so no folder can be made")
    fails(["train", "--data", "bb", "--out", "/proc/sinklab-test-out", "--steps", "1"], 2, "cannot write in /proc")
    assert a_file.read_text() == "keep me" and leftovers(tmp_path) == []
    with pytest.raises(InputError):
        check_out_dir(a_file)
    assert check_out_dir(tmp_path / "new" / "deeper") == tmp_path / "new" / "deeper"
    assert not (tmp_path / "new").exists()  # the check itself leaves nothing


def test_counts_and_options_out_of_range(tmp_path):
    out = tmp_path / "o"
    fails(["synth", "nop", "--steps", "0", "--out", out], 2, "--steps must be ≥ 1, got 0")
    fails(["synth", "nop", "--batch-size", "-3", "--out", out], 2, "--batch-size must be ≥ 1, got -3")
    fails(["synth", "nop", "--seq-len", "1", "--out", out], 2, "--seq-len must be ≥ 2")
    fails(["synth", "nop", "--lr", "0", "--out", out], 2, "--lr must be > 0")
    fails(["synth", "bogus", "--out", out], 2, "unknown synthetic task 'bogus'")
    fails(["train", "--data", "bb", "--out", out, "--steps", "-1"], 2, "steps must be an integer ≥ 1")
    fails(["train", "--data", "bb", "--out", out, "--warmup", "-5"], 2, "warmup must be an integer ≥ 0")
    fails(["train", "--data", "bb", "--out", out, "--checkpoint-every", "-1"], 2,
          "checkpoint_every must be an integer ≥ 0")
    fails(["train", "--data", tmp_path / "missing.txt", "--out", out, "--steps", "1"], 2, "neither 'pydoc'")
    fails(["train", "--data", "bb", "--out", out, "--variant", "sinky", "--steps", "1"], 2, "unknown variant")
    fails(["diagnose", "builtin:tiny-lm", "--edit-layers", "-2", "--out", out], 2,
          "--edit-layers) must be an integer ≥ 1, or None (--edit-layers 0)", "got -2")
    fails(["circuit", "builtin:tiny-lm", "--causal-samples", "-1", "--out", out], 2,
          "--causal-samples) must be an integer ≥ 1, or None (--causal-samples 0)", "got -1")
    fails(["circuit", "builtin:tiny-lm", "--condition-samples", "-3", "--out", out], 2,
          "--condition-samples) must be an integer ≥ 1, or None (--condition-samples 0)", "got -3")
    fails(["circuit", "builtin:tiny-lm", "--loss-stride", "0", "--out", out], 2,
          "--loss-stride) must be an integer ≥ 1 (1: every next-token target)", "got 0")
    for size in ("0", "-1"):  # circuit used to crash here (range step 0, an empty batch list)
        fails(["circuit", "builtin:tiny-lm", "--batch-size", size, "--out", out], 2,
              f"batch_size (--batch-size) must be an integer ≥ 1, got {size}")
    # an option whose feature is off used to be ignored silently
    fails(["diagnose", "builtin:tiny-lm", "--no-edits", "--edit-samples", "3", "--out", out], 2,
          "--edit-samples 3 has no effect with --no-edits")
    fails(["diagnose", "builtin:tiny-lm", "--rule", "strict", "--sink-mass", "0.9", "--out", out], 2,
          "--sink-mass 0.9 has no effect with --rule strict")
    fails(["circuit", "builtin:tiny-lm", "--no-causal", "--causal-samples", "3", "--out", out], 2,
          "--causal-samples 3 has no effect with --no-causal")
    fails(["kv-quant", "builtin:tiny-lm", "--protect", "none", "--first", "3", "--out", out], 2,
          "--first 3 has no effect without 'first' in --protect")
    fails(["kv-quant", "builtin:tiny-lm", "--decode-steps", "-1", "--out", out], 2, "--decode-steps must be an integer ≥ 0")
    for srank in ("nan", "inf"):  # used to run through with a threshold no stable rank can meet
        fails(["diagnose", "builtin:tiny-lm", "--broadcast-srank", srank, "--out", out], 2, "broadcast_max_srank")
    assert not out.exists() and leftovers(tmp_path) == []


def test_analyses_refuse_wrong_types_with_input_errors():
    """The Python entry points name a wrong argument instead of failing deep inside (AttributeError,
    TypeError, range() errors)."""
    loaded = sinklab.load_model("builtin:tiny-lm")
    model, tok = loaded.model, loaded.tokenizer
    text = "The rule of the code is that every function returns a value. " * 3
    cases = [
        (lambda: sinklab.scan("builtin:tiny-lm", tok, text), "scan_inputs takes a loaded model|takes a loaded model"),
        (lambda: sinklab.circuit("builtin:tiny-lm", tok, text), "circuit takes a loaded model"),
        (lambda: sinklab.scan_inputs(None, [], []), "scan_inputs takes a loaded model"),
        (lambda: sinklab.scan(model, None, text), "a tokenizer is needed"),
        (lambda: sinklab.scan(model, tok, 123), "texts are a string or a list of strings, got int"),
        (lambda: sinklab.scan(model, tok, [1, 2]), "got a list holding int"),
        (lambda: sinklab.scan(model, tok, text, seq_len="8"), "--seq-len must be at least 2 tokens"),
        (lambda: sinklab.scan(model, tok, text, samples=2.5), "--samples must be at least 1, got 2.5"),
        (lambda: sinklab.scan(model, tok, text, seed="a"), "--seed must be an integer"),
        (lambda: sinklab.scan(model, tok, text, batch_size="2"), "batch_size .* must be an integer ≥ 1, got '2'"),
        (lambda: sinklab.circuit(model, tok, text, seq_len=8, samples=1, batch_size=0), "got 0"),
        (lambda: sinklab.circuit(model, tok, text, seq_len=8, samples=1, layer_threshold=float("nan")),
         "layer_threshold .* must be in \\[0, 100\\]"),
        (lambda: sinklab.circuit(model, tok, text, seq_len=8, samples=1, causal="no"), "causal is True or False"),
        (lambda: sinklab.circuit(model, tok, text, seq_len=8, samples=1, loss_stride=1.5), "--loss-stride"),
    ]
    for call, message in cases:
        with pytest.raises(InputError, match=message):
            call()


def test_synth_writes_atomically_and_ctrl_c_leaves_nothing(tmp_path, monkeypatch):
    import sinklab.synth

    out = tmp_path / "synth"
    args = ["synth", "nop", "--steps", "3", "--batch-size", "8", "--dim", "8", "--seq-len", "6", "--out", out]
    runs = []
    original = sinklab.synth.run_nop
    monkeypatch.setattr(sinklab.synth, "run_nop", lambda *a, **k: runs[0] if runs else runs.append(original(*a, **k))
                        or runs[0])  # train once; the interrupted run below reuses the result
    result, text = run(*args[:-2], "--tokens", "6", "--batch", "8", "--out", out)  # the old names still work
    assert result.exit_code == 0, text
    saved = json.loads((out / "synth.json").read_text())
    assert saved["task"] == "nop" and [r["step"] for r in saved["log"]] == [3]
    assert json.loads((out / "diagnosis.json").read_text())["meta"]["model"] == "synth:nop"
    assert (out / "report.html").stat().st_size > 1000 and leftovers(tmp_path) == []

    def interrupted(result, folder):  # Ctrl-C after the diagnosis files went into the temporary folder
        (Path(folder) / "diagnosis.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(sinklab.cli.diagnose, "save", interrupted)
    again = tmp_path / "again"
    fails(args[:-1] + [again], 130, "interrupted: no output written")
    assert not again.exists() and leftovers(tmp_path) == []


def test_train_ctrl_c_keeps_the_checkpoints(tmp_path, monkeypatch):
    from sinklab.monitor import SinkMonitor

    original = SinkMonitor.step

    def step(self, n, **kwargs):
        if n == 3:
            raise KeyboardInterrupt
        return original(self, n, **kwargs)

    monkeypatch.setattr(SinkMonitor, "step", step)
    run_dir = tmp_path / "run"
    fails(["train", "--data", "bb", "--out", run_dir, "--layers", "1", "--heads", "1", "--width", "16", "--seq-len",
           "8", "--batch-size", "4", "--steps", "5", "--checkpoint-every", "2", "--monitor-every", "100"], 130,
          "interrupted: training stopped", f"stay in {run_dir}")
    assert sorted(p.name for p in run_dir.iterdir() if p.is_dir()) == ["checkpoint-2"]  # no half-written temp
    assert sinklab.load(run_dir / "checkpoint-2").config.sinklab_trained_positions == 8


def test_warnings_print_as_one_yellow_line_and_errors_exit_2():
    mini = typer.Typer()

    @mini.command()
    def go(fail: bool = False) -> None:
        with user_errors():
            warnings.warn("past the trained positions", SinklabWarning, stacklevel=1)
            if fail:
                raise InputError("bad input here")

    result = runner.invoke(mini, [])
    assert result.exit_code == 0 and "warning: past the trained positions" in result.output
    assert "SinklabWarning" not in result.output  # not Python's file:line: Category: format
    result = runner.invoke(mini, ["--fail"])
    assert result.exit_code == 2 and "error: bad input here" in result.output


#: Options a command checks before its model (so that the model is what the error is about).
REQUIRED = {"stream": ("--prompt", "x")}


def _commands() -> dict:
    return typer.main.get_command(app).commands  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", sorted(_commands()))
def test_every_command_has_help_and_refuses_a_missing_model_in_one_line(name, tmp_path):
    """Picked up from the app itself: a new command is covered without editing a list."""
    result, text = run(name, "--help")
    assert result.exit_code == 0 and "Usage:" in text, text
    takes_model = any(p.name == "model" for p in _commands()[name].params)
    if takes_model:  # the options a command needs before it looks at the model
        fails([name, tmp_path / "no-such-model", *REQUIRED.get(name, ())], 2, "no such file or directory")
