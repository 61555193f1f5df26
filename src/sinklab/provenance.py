"""Where a result came from: the record every JSON output and report carries.

:func:`provenance` returns a plain dict (JSON-ready): the command line, the model and where it came from,
device and dtype, a UTC timestamp, the sinklab/transformers/torch/Python versions and a SHA-256 of the
input texts, so two outputs can be told apart — or shown to come from the same input — without the
texts themselves.

>>> record = provenance(["sinklab", "scan", "builtin:minilm"], "builtin:minilm", "cpu", "float32", ["a b c"])
>>> record["command_line"], record["device"], record["dtype"], record["input"]["texts"]
('sinklab scan builtin:minilm', 'cpu', 'float32', 1)
>>> record["input"]["sha256"] == text_hash(["a b c"]) != text_hash(["a b", "c"])
True
"""

from __future__ import annotations

import hashlib
import platform
import shlex
from collections.abc import Sequence
from datetime import datetime, timezone

__all__ = ["provenance", "text_hash", "versions"]


def text_hash(texts: Sequence[str] | None) -> str | None:
    """SHA-256 (hex) of the texts, each UTF-8 encoded and length-prefixed (so ``["ab", "c"] ≠ ["a", "bc"]``)."""
    if texts is None:
        return None
    digest = hashlib.sha256()
    for text in texts:
        data = text.encode("utf-8")
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.hexdigest()


def versions() -> dict[str, str]:
    """Versions of sinklab, transformers, torch and Python."""
    import torch
    import transformers

    from ._version import __version__

    return {"sinklab": __version__, "transformers": transformers.__version__, "torch": torch.__version__,
            "python": platform.python_version()}


def _describe_model(model: object) -> dict:
    if model is None or isinstance(model, str):
        return {"name": model}
    source = getattr(model, "source", None)  # a LoadedModel
    inner = getattr(model, "model", model)
    config = getattr(inner, "config", None)
    out = {"name": source or getattr(config, "_name_or_path", None) or type(inner).__name__,
           "class": type(inner).__name__}
    if revision := getattr(model, "revision", None):
        out["revision"] = revision
    variant = getattr(config, "sinklab_variant", None)
    if variant:
        out["variant"] = variant
    return out


def provenance(command_line: Sequence[str] | str | None, model: object, device: object = None, dtype: object = None,
               texts: Sequence[str] | None = None) -> dict:
    """The provenance record of one run.

    Parameters
    ----------
    command_line
        ``sys.argv`` (a list, quoted back into one string) or the string itself; ``None`` for API use.
    model
        A name (``"builtin:tiny-lm"``), a :class:`~sinklab.models.LoadedModel` or a model.
    device, dtype
        Where and in which precision it ran (``torch.device``/``torch.dtype`` or strings); when ``None``
        they are read from the model's first parameter if there is one.
    texts
        The input texts (hashed, never stored); ``None`` for inputs that are not text.
    """
    inner = getattr(model, "model", model)
    param = next(inner.parameters(), None) if hasattr(inner, "parameters") else None
    if device is None and param is not None:
        device = param.device
    if dtype is None and param is not None:
        dtype = param.dtype
    if isinstance(command_line, (list, tuple)):
        command_line = shlex.join(str(a) for a in command_line)
    return {
        "command_line": command_line,
        "model": _describe_model(model),
        "device": None if device is None else str(device),
        "dtype": None if dtype is None else str(dtype).removeprefix("torch."),
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "versions": versions(),
        "input": {"texts": None if texts is None else len(texts), "characters": None if texts is None else
                  sum(len(t) for t in texts), "sha256": text_hash(texts)},
    }
