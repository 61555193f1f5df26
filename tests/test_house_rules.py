"""The house rules ARCHITECTURE.md states, each tried the way it could break: writers are atomic, entry points give
the model back in the mode it came in, validation refuses what is not a size or a span."""

from __future__ import annotations

import json

import pytest
import torch

from sinklab.atomic import write_json
from sinklab.errors import InputError, check_spans
from sinklab.models import tiny_llama


def test_write_json_leaves_the_previous_file_when_the_value_cannot_be_written(tmp_path):
    path = tmp_path / "out.json"
    write_json(path, {"a": 1})

    class Loop(dict):
        pass

    loop = Loop()
    loop["self"] = loop  # a circular structure: json refuses it before anything is written
    with pytest.raises(ValueError, match="[Cc]ircular"):
        write_json(path, loop)
    assert json.loads(path.read_text()) == {"a": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]  # no temporary file left


def test_checkpoint_save_is_atomic(tmp_path, monkeypatch):
    import sinklab.checkpoint

    model = tiny_llama(num_hidden_layers=1)
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    sinklab.checkpoint.save(model, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert "notes.txt" in before and any(name.endswith(".safetensors") for name in before)

    def half_written(self, path, **kwargs):
        with open(f"{path}/model.safetensors", "wb") as f:  # half a file, then the disk fills up
            f.write(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(type(model), "save_pretrained", half_written)
    with pytest.raises(OSError, match="disk full"):
        sinklab.checkpoint.save(model, out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_kv_quant_gives_a_training_model_back_in_training_mode():
    from sinklab.kvquant.evaluate import KvQuantPlan, kv_quant

    model = tiny_llama(num_hidden_layers=1).train()
    plan = KvQuantPlan(bits=(4,), protect=("none",), context=24, score=8, samples=1, group_size=8, value_group=8,
                       residual=4, decode_steps=1)
    kv_quant(model, torch.randint(5, 4000, (32,), generator=torch.Generator().manual_seed(0)), plan)
    assert model.training and all(m.training for m in model.modules())


@pytest.mark.parametrize("spans, message", [
    ([(True, 3)], "pairs"), ([(0.0, 3)], "pairs"), ([(3, 3)], "0 ≤ start < end"), ([(-1, 2)], "0 ≤ start < end"),
    ([(0, 4), (2, 6)], "overlap"), ("0-4", "list of"), ([(1, 2, 3)], "pairs"),
])
def test_span_lists_refuse_what_is_not_a_half_open_integer_span(spans, message):
    with pytest.raises(InputError, match=message):
        check_spans(spans)


def test_span_lists_accept_numpy_and_tensor_integers_and_sort():
    import numpy as np

    assert check_spans([(np.int64(5), 7), (0, torch.tensor(2))]) == [(0, 2), (5, 7)]
    assert check_spans([(0, 4), (2, 6)], overlapping=True) == [(0, 4), (2, 6)]
    assert check_spans(None) == []


def test_a_retention_plan_refuses_a_bool_or_a_wrong_shape():
    from sinklab.stream.plan import RetentionPlan

    good = dict(model_type="llama", num_layers=2, kv_heads=1, num_sinks=4, window=8, recent=2, local_window=64,
                threshold=0.9, budgets=[[12], None], coverage=[[0.5], None], local=[[False], None])
    RetentionPlan(**good)
    for change, message in [({"num_layers": True}, "num_layers"), ({"window": 0}, "window"),
                            ({"budgets": [[12]]}, "budgets"), ({"local": [[False, True], None]}, "local"),
                            ({"threshold": 1.5}, "threshold"), ({"budgets": [[0], None]}, "budget")]:
        with pytest.raises(InputError, match=message):
            RetentionPlan(**{**good, **change})
