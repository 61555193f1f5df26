"""How to add a command: a function in ``cli/<family>.py`` with ``@app.command()``, imported in ``cli/__init__.py``.

The body runs inside ``user_errors()`` (a sinklab error is one red line and exit code 2, never a traceback), checks
the output folder before loading anything, and writes through the one atomic writer. This example registers a
``top-sink`` command on sinklab's own app, runs it through typer's test runner, checks its JSON against the
Python API and a bad input's exit code, and removes it again (``python docs/examples/add_command.py``).
"""

import json
import tempfile
from pathlib import Path
from typing import Annotated

import typer
from typer.testing import CliRunner

import sinklab
from sinklab.atomic import write_json
from sinklab.cli import app
from sinklab.cli._common import MODEL_HELP, check_count, check_out_dir, console, load_for_command, user_errors
from sinklab.texts import default_texts


def top_sink(
    model: Annotated[str, typer.Argument(help=MODEL_HELP)],
    samples: Annotated[int, typer.Option("--samples", help="number of samples")] = 2,
    out: Annotated[Path, typer.Option("--out", help="output folder")] = Path("sinklab-out"),
) -> None:
    """Print MODEL's most common sink position and write it to top_sink.json."""
    with user_errors():
        check_count(samples, "--samples")
        out = check_out_dir(out)  # before loading: a bad folder fails in a second, not after the model loads
        loaded = load_for_command(model)
        result = sinklab.scan(loaded.model, loaded.tokenizer, default_texts(), seq_len=32, samples=samples)
        position, label = result.top_sink()
        console.print(f"most common sink: position {position} ({label!r})", highlight=False)
        write_json(out / "top_sink.json", {"position": position, "label": label, "sink_rate_0": result.sink_rate(0)})


command = app.command("top-sink")(top_sink)
try:
    runner = CliRunner()
    with tempfile.TemporaryDirectory() as tmp:
        done = runner.invoke(app, ["top-sink", "builtin:tiny-lm", "--out", tmp])
        assert done.exit_code == 0, done.output
        written = json.loads((Path(tmp) / "top_sink.json").read_text())
        loaded = sinklab.load_model("builtin:tiny-lm")
        want = sinklab.scan(loaded.model, loaded.tokenizer, default_texts(), seq_len=32, samples=2)
        assert written["position"] == want.top_sink()[0] and abs(written["sink_rate_0"] - want.sink_rate(0)) < 1e-9
        bad = runner.invoke(app, ["top-sink", "builtin:tiny-lm", "--samples", "0", "--out", tmp])
        assert bad.exit_code == 2 and "--samples" in bad.output and "Traceback" not in bad.output, bad.output
    print(done.output.strip())
finally:
    app.registered_commands[:] = [c for c in app.registered_commands if c.callback is not top_sink]
