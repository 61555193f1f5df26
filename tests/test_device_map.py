"""A model dispatched with accelerate (some layers offloaded to CPU and disk) gives the same numbers."""

from __future__ import annotations

import pytest
import torch

import sinklab
from sinklab.models import _minilm_tokenizer, tiny_llama

TEXTS = ["The quick brown fox jumps over the lazy dog, again and again. " * 6]
# Layers 1 and 3 live on disk (parameters on the meta device until their forward), the rest on the CPU.
DEVICE_MAP = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
              "model.layers.2": "cpu", "model.layers.3": "disk", "model.norm": "cpu",
              "model.rotary_emb": "cpu", "lm_head": "cpu"}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    tiny_llama().save_pretrained(folder)
    _minilm_tokenizer().save_pretrained(folder)
    plain = sinklab.load_model(str(folder))
    offloaded = sinklab.load_model(str(folder), device_map=DEVICE_MAP,
                                   offload_folder=str(tmp_path_factory.mktemp("offload")))
    assert offloaded.model.model.layers[1].self_attn.o_proj.weight.device.type == "meta"
    return plain, offloaded


def test_scan_on_an_offloaded_model_equals_the_plain_model(pair):
    plain, off = pair
    a = sinklab.scan(plain.model, plain.tokenizer, TEXTS, seq_len=24, samples=2)
    b = sinklab.scan(off.model, off.tokenizer, TEXTS, seq_len=24, samples=2)
    for name in ("column_mass", "value_norm", "value_norm_out", "update_spectrum", "qk_spectrum", "hidden_norm",
                 "common_mode"):
        x, y = getattr(a, name), getattr(b, name)
        torch.testing.assert_close(y, x, equal_nan=True, msg=name)
    assert off.model.model.layers[1].self_attn.o_proj.weight.device.type == "meta"  # released again


def test_diagnose_edits_on_an_offloaded_model_equal_the_plain_model(pair):
    plain, off = pair
    kwargs = dict(seq_len=24, samples=2, rules={"sink_mass": 0.05}, edits=[(2, 1)])
    a = sinklab.diagnose(plain.model, plain.tokenizer, TEXTS, **kwargs)
    b = sinklab.diagnose(off.model, off.tokenizer, TEXTS, **kwargs)
    assert len(a.records) == len(b.records) > 0
    assert a.edits and list(a.edits[0].hidden) == list(b.edits[0].hidden)
    for key, value in a.edits[0].hidden.items():
        assert b.edits[0].hidden[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


def test_stream_on_an_offloaded_model_equals_the_plain_model(pair):
    plain, off = pair
    ids = plain.tokenizer(TEXTS[0], return_tensors="pt")["input_ids"][:, :20]
    outs = []
    for loaded in (plain, off):
        with sinklab.SinkCache(loaded.model, num_sinks=2, window=8) as cache:
            outs.append(loaded.model.generate(ids, past_key_values=cache, max_new_tokens=16, do_sample=False,
                                              output_scores=True, return_dict_in_generate=True))
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    torch.testing.assert_close(torch.stack(outs[1].scores), torch.stack(outs[0].scores))


def test_cli_scan_with_device_map_records_provenance(pair, tmp_path):
    import json

    from typer.testing import CliRunner

    from sinklab.cli import app

    folder = pair[0].model.config._name_or_path
    out = tmp_path / "scan"
    result = CliRunner().invoke(app, ["scan", folder, "--text", TEXTS[0], "--seq-len", "24", "--samples", "2",
                                      "--device-map", "auto", "--out", str(out)])
    assert result.exit_code == 0, result.output
    meta = json.loads((out / "scan.json").read_text())["meta"]
    record = meta["provenance"]
    assert isinstance(record["command_line"], str) and record["command_line"]
    assert record["input"]["texts"] == 1 and len(record["input"]["sha256"]) == 64
    assert record["versions"]["transformers"] and record["timestamp"]


@pytest.mark.parametrize("name", ["builtin:tiny-lm", "builtin:tiny-llama"])
def test_device_map_on_a_model_sinklab_loads_whole_is_an_error(name):
    """A device map that would be ignored is refused (it used to be dropped silently, --device with it)."""
    from typer.testing import CliRunner

    from sinklab.cli import app
    from sinklab.errors import InputError

    with pytest.raises(InputError, match="loaded whole by sinklab"):
        sinklab.load_model(name, device_map="auto")
    r = CliRunner().invoke(app, ["stream", name, "--prompt", "The rule", "--max-new-tokens", "2",
                                 "--device-map", "bogus"])
    assert r.exit_code != 0 and "loaded whole by sinklab" in " ".join(r.output.split()), r.output

