"""One way to save a result: ``sinklab.report.save(result, out)``; the API and the CLI write the same JSON.

The recommendation is computed by the analysis (with the model in hand) and carried by the ``Diagnosis``;
renderers only render it. (Before, ``Diagnosis.save()`` recommended without the model while ``sinklab
diagnose`` recommended with it, so on a model that already has a gate the two wrote different
``recommendation``s: ``evidence.variant_applied`` ``[]`` vs ``["gated"]``.)
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import sinklab
import sinklab.report
from sinklab.cli import app
from sinklab.models import _minilm_tokenizer, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")

TEXT = "Attention sinks park attention on the first token when a head has nothing to add. " * 6
ARGS = dict(seq_len=32, samples=2, edit_samples=1)


@pytest.fixture(scope="module")
def gated_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gated") / "model"
    model = tiny_llama()
    sinklab.apply_variant(model, "gated", init="off")
    sinklab.save(model, folder)
    _minilm_tokenizer().save_pretrained(str(folder))
    return folder


def test_api_and_cli_write_the_same_recommendation_for_a_gated_model(gated_checkpoint, tmp_path):
    loaded = sinklab.load_model(str(gated_checkpoint))
    d = sinklab.diagnose(loaded.model, loaded.tokenizer, TEXT, source=str(gated_checkpoint), **ARGS)
    assert d.recommendation is not None and d.recommendation.evidence["variant_applied"] == ["gated"]
    api_report = sinklab.report.save(d, tmp_path / "api")
    assert api_report == tmp_path / "api" / "report.html" and api_report.is_file()
    api = json.loads((tmp_path / "api" / "diagnosis.json").read_text())

    result = CliRunner().invoke(app, ["diagnose", str(gated_checkpoint), "--text", TEXT, "--seq-len", "32",
                                      "--samples", "2", "--edit-samples", "1", "--out", str(tmp_path / "cli")])
    assert result.exit_code == 0, result.output
    cli = json.loads((tmp_path / "cli" / "diagnosis.json").read_text())
    assert cli["recommendation"] == api["recommendation"]
    assert api["recommendation"]["evidence"]["variant_applied"] == ["gated"]
    assert api["recommendation"] == d.recommendation.to_json()


def test_save_refuses_what_it_cannot_render(tmp_path):
    with pytest.raises(sinklab.InputError, match="no renderer for"):
        sinklab.report.save({"not": "a result"}, tmp_path / "x")
    assert not (tmp_path / "x").exists()
