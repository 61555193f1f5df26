"""Loading by name or path: device and position checks, quiet strict loading, readable tokens, provenance."""

from __future__ import annotations

import hashlib
import warnings

import pytest
import torch

import sinklab
from sinklab.errors import InputError, SinklabWarning
from sinklab.models import check_device, check_positions, max_positions, uses_rope, warn_if_past_positions
from sinklab.provenance import provenance, text_hash
from sinklab.texts import byte_level_text, readable_token

from tiny_models import build


def test_absolute_position_model_refuses_a_longer_seq_len(minilm):
    assert max_positions(minilm.model) == 512 and not uses_rope(minilm.model)
    check_positions(minilm.model, 512)
    with pytest.raises(InputError, match=r"--seq-len 513 is beyond BertModel's 512 positions.*--seq-len 512 or less"):
        check_positions(minilm.model, 513)
    gpt2 = build("gpt2")  # n_positions = 128
    with pytest.raises(InputError, match="128 positions"):
        check_positions(gpt2, 129)


def test_rope_model_past_its_trained_positions_warns(tmp_path):
    model = build("llama-gqa")  # max_position_embeddings = 128
    assert uses_rope(model) and max_positions(model) == 128
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert warn_if_past_positions(model, 128) is None
        check_positions(model, 128)
    with pytest.warns(SinklabWarning, match="past the 128 positions it was trained on"):
        check_positions(model, 200)
    model.config.sinklab_trained_positions = 64  # written by sinklab train: the real trained length wins
    with pytest.warns(SinklabWarning, match="64 positions"):
        assert "--seq-len 65" in warn_if_past_positions(model, 65)
    tiny_lm = sinklab.load_model("builtin:tiny-lm").model  # trained at 64 tokens (its model card)
    assert max_positions(tiny_lm) == 64


def test_check_device(monkeypatch):
    check_device(None)
    check_device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(InputError, match="CUDA is not available"):
        check_device("cuda:0")
    with pytest.raises(InputError, match="not a device name"):
        check_device("tpu7")


def test_saving_and_loading_print_nothing(tmp_path, capfd):
    model = build("llama-gqa")
    sinklab.apply_variant(model, "gated")
    sinklab.save(model, tmp_path / "m")
    sinklab.load_model(str(tmp_path / "m"))
    out, err = capfd.readouterr()
    assert out == "" and "LOAD REPORT" not in err and "Loading weights" not in err and "Writing" not in err
    from transformers.utils import logging as hf_logging

    assert hf_logging.is_progress_bar_enabled()  # restored afterwards


def test_hub_id_that_cannot_be_fetched_says_so():
    with pytest.raises(InputError, match="'someone/no-such-model' is not a local path and cannot be loaded from the"):
        sinklab.load_model("someone/no-such-model")


def test_readable_token_decodes_byte_level_pieces(minilm):
    tok = sinklab.load_model("builtin:tiny-lm").tokenizer  # byte-level BPE
    ids = tok("Return the value\n", add_special_tokens=True)["input_ids"]
    shown = [readable_token(tok, i) for i in ids]
    assert shown[0] == "<s>" and " the" in shown and "Ġthe" not in shown
    assert "".join(shown[1:]) == "Return the value\\n"  # whole characters: the pieces join into the text
    pieces = [readable_token(tok, i) for i in tok("café", add_special_tokens=False)["input_ids"]]
    assert "".join(pieces) in ("café", "caf\\xc3\\xa9")  # é whole, or its two bytes split over two pieces
    assert byte_level_text("ĠcafÃ©") == " café" and byte_level_text("Ã") == "\\xc3"
    wp = minilm.tokenizer  # WordPiece: pieces stay as they are
    ids = wp("the valuing", add_special_tokens=True)["input_ids"]
    assert [readable_token(wp, i) for i in ids] == wp.convert_ids_to_tokens(ids)


def test_provenance_records_where_a_result_came_from(minilm):
    texts = ["a sample text", "another"]
    record = provenance(["sinklab", "scan", "builtin:minilm", "--text", "two words"], minilm, texts=texts)
    assert record["command_line"] == "sinklab scan builtin:minilm --text 'two words'"
    assert record["model"] == {"name": "builtin:minilm", "class": "BertModel"}
    assert (record["device"], record["dtype"]) == ("cpu", "float32")
    ref = hashlib.sha256()
    for t in texts:
        ref.update(len(t.encode()).to_bytes(8, "little") + t.encode())
    assert record["input"] == {"texts": 2, "characters": 20, "sha256": ref.hexdigest()}
    assert text_hash(["ab", "c"]) != text_hash(["a", "bc"])
    assert record["versions"]["sinklab"] == sinklab.__version__ and record["timestamp"].endswith("+00:00")


def test_scan_windows_carry_readable_tokens(minilm):
    from sinklab.texts import readable_tokens, tokenize_windows

    tok = sinklab.load_model("builtin:tiny-lm").tokenizer
    batch = tokenize_windows(tok, ["Return the value of the attribute. " * 4], seq_len=16, samples=1)
    ids = batch.input_ids[0][batch.attention_mask[0].bool()].tolist()
    assert batch.tokens[0] == [readable_token(tok, i) for i in ids] == readable_tokens(tok, ids)
    assert " the" in batch.tokens[0] and not any("Ġ" in t for t in batch.tokens[0])
    wp = tokenize_windows(minilm.tokenizer, ["the valuing of things"], seq_len=8, samples=1)
    assert wp.tokens[0] == minilm.tokenizer.convert_ids_to_tokens(wp.input_ids[0][: len(wp.tokens[0])].tolist())
