"""README's Python example runs as written (on the session's SmolLM2, outputs in a temporary folder)."""

from __future__ import annotations

import os
import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def _api_block() -> str:
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## Python API"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_python_example_runs(smollm2, tmp_path, monkeypatch):
    import sinklab

    code = _api_block()
    assert 'sinklab.load_model("builtin:smollm2")' in code
    code = code.replace('sinklab.load_model("builtin:smollm2")', "_loaded")
    monkeypatch.chdir(tmp_path)
    scope = {"_loaded": smollm2}
    exec(compile(code, str(README), "exec"), scope)  # noqa: S102 - the README's own example
    assert isinstance(scope["result"], sinklab.ScanResult) and scope["result"].num_samples == 4
    assert scope["d"].records and isinstance(scope["c"].amplification_layer, int)
    for folder in ("out", "diag", "circuit"):
        assert (tmp_path / folder / "report.html").is_file(), os.listdir(tmp_path)
