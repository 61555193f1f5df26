"""README's Python example runs as written (outputs in a temporary folder)."""

from __future__ import annotations

import os
import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def _api_block() -> str:
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## Python API"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_python_example_runs(tmp_path, monkeypatch):
    import sinklab

    code = _api_block()
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(code, str(README), "exec"), scope)  # noqa: S102 - the README's own example
    assert isinstance(scope["result"], sinklab.ScanResult) and scope["result"].num_samples == 4
    assert scope["d"].records and isinstance(scope["c"].amplification_layer, int)
    for folder in ("out", "diag", "circuit"):
        assert (tmp_path / folder / "report.html").is_file(), os.listdir(tmp_path)


def test_readme_gating_numbers_are_the_committed_benchmarks():
    """The gated / ungated Qwen3-Next numbers README quotes are those of benchmarks/results/gating.json (mean ± sample
    standard deviation over its seeds), to the digits printed."""
    import json
    import re
    import statistics

    rows = json.loads((README.parent / "benchmarks" / "results" / "gating.json").read_text())["rows"]
    text = " ".join(README.read_text(encoding="utf-8").split())
    m = re.search(r"gives the first token ([\d.]+) ± ([\d.]+) of the attention with the gate against ([\d.]+) ± "
                  r"([\d.]+) without, and Sink_1\^ε ([\d.]+) % against ([\d.]+) %", text)
    assert m, "README's gating sentence is gone or reworded: update this test with it"
    quoted = [float(x) for x in m.groups()]
    got = []
    for gated in (True, False):
        share = [r["first_token_share"] for r in rows if r["output_gate"] is gated]
        got.append((statistics.mean(share), statistics.stdev(share)))
    sink = [statistics.mean(r["sink_rate_0"] for r in rows if r["output_gate"] is g) for g in (True, False)]
    want = [got[0][0], got[0][1], got[1][0], got[1][1], sink[0], sink[1]]
    digits = [3, 3, 3, 3, 1, 1]
    assert [round(w, d) for w, d in zip(want, digits)] == quoted, (want, quoted)
    assert len(rows) == 6 and "3 seeds" in text
