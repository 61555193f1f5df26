"""Checks every analysis runs on a model before trusting its numbers: finite weights, a tokenizer that belongs
to the model, sequence lengths within its positions.

A low module (below capture, scan and the analyses, beside the loader): analyses import the checks, never
the loader (:mod:`sinklab.models`).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from . import _compat
from .errors import InputError, ModelWeightsError, SinklabWarning, UnsupportedModelError, check_int
from .fingerprint import ModelCache

__all__ = ["check_positions", "check_vocab", "check_weights", "max_positions", "used_token_ids", "uses_rope",
           "warn_if_past_positions"]


#: Models whose weights passed :func:`check_weights`, valid while their fingerprint is unchanged.
_CHECKED = ModelCache()


def check_model(model, what: str = "this function") -> None:
    """An InputError unless ``model`` is a loaded model (a name or path is a common slip: load it first)."""
    if not isinstance(model, nn.Module):
        hint = " (a name or path: load it first with sinklab.load_model(...).model)" if isinstance(model, str) else ""
        raise InputError(f"{what} takes a loaded model (torch.nn.Module), got {type(model).__name__}{hint}")


def check_batch_size(batch_size) -> None:
    """Samples per forward: an integer ≥ 1 (the message names the option and the flag)."""
    check_int("batch_size (--batch-size)", batch_size, 1)


def check_weights(model: nn.Module, token_ids: torch.Tensor | None = None) -> None:
    """Raise :class:`ModelWeightsError` naming the first parameter with NaN or inf entries.

    A learned sink logit at −inf is not corrupt: it is the sink switched off (``apply_variant(init="off")``).
    The check runs once per loaded model and again only when a weight changed (an optimizer step, a
    variant applied, ``load_state_dict``: see :mod:`sinklab.fingerprint`). Each parameter is first summed
    (a sum is finite only if every entry is); only a non-finite sum gets the exact entry-wise test.

    ``token_ids``: for analyses that only look tokens up (no LM head: scan, diagnose), the ids they feed the
    model. The input embedding table is then checked at those rows only, on every call; a 262,144-row table
    (Gemma 3) is not read — and, memory-mapped, not paged into memory — for the few hundred rows a scan uses.
    """
    table = _token_table(model) if token_ids is not None else None
    if table is None or token_ids is None:  # (no ids: no table)
        _CHECKED.get(model, "finite", model.parameters(), lambda: _check_finite(model))
        return
    rest = [p for p in model.parameters() if p is not table]
    _CHECKED.get(model, "finite-but-token-table", rest, lambda: _check_finite(model, skip=table))
    ids = token_ids.flatten().unique().to(table.device)
    ids = ids[(ids >= 0) & (ids < table.shape[0])]
    if not bool(torch.isfinite(table.detach()[ids].float()).all()):
        name = next((n for n, p in model.named_parameters() if p is table), "input embedding")
        _refuse(model, name)


def used_token_ids(batches: list[dict]) -> torch.Tensor | None:
    """All ``input_ids`` of model-input ``batches`` (one flat tensor), or None when a batch has none."""
    if not batches or any(not isinstance(b.get("input_ids"), torch.Tensor) or "inputs_embeds" in b for b in batches):
        return None
    return torch.cat([b["input_ids"].flatten().cpu() for b in batches])


def _token_table(model: nn.Module) -> torch.Tensor | None:
    """The input token embedding's weight (an ``nn.Embedding``), or None."""
    getter = getattr(model, "get_input_embeddings", None)
    try:
        emb = getter() if getter is not None else None
    except (NotImplementedError, AttributeError):
        return None
    weight = getattr(emb, "weight", None)
    if not isinstance(emb, nn.Embedding) or not isinstance(weight, torch.Tensor) or weight.device.type == "meta":
        return None
    return weight


def _refuse(model: nn.Module, pname: str) -> None:
    raise ModelWeightsError(
        f"{type(model).__name__}: parameter {pname!r} contains NaN or inf values; "
        "the checkpoint is corrupt or was saved mid-divergence — reload or retrain it."
    )


def _check_finite(model: nn.Module, skip: torch.Tensor | None = None) -> bool:
    for pname, param in _compat.named_weights(model):  # offloaded (device_map) blocks load one at a time
        if not param.is_floating_point() or param is skip:
            continue
        total = param.detach().sum(dtype=torch.float32 if param.element_size() < 4 else None)
        if bool(torch.isfinite(total)):  # NaN or ±inf anywhere makes the sum NaN or ±inf
            continue
        finite = torch.isfinite(param)  # the sum may also have overflowed: test every entry
        if pname.endswith("sinklab_sink_logit"):
            finite = finite | (param == float("-inf"))
        if not bool(finite.all()):
            _refuse(model, pname)
    return True


def check_vocab(model: nn.Module, tokenizer, input_ids: torch.Tensor) -> None:
    """Raise if the tokenizer can produce ids the model's embedding has no row for."""
    rows = _compat.embedding_rows(model)
    if rows is None:
        return
    largest = int(input_ids.max()) if input_ids.numel() else -1
    if largest >= rows or len(tokenizer) > rows:
        raise ModelWeightsError(
            f"the tokenizer has {len(tokenizer)} tokens (largest id in this input: {largest}) but "
            f"{type(model).__name__}'s embedding has only {rows} rows; the tokenizer does not belong to this "
            "model — pass the tokenizer saved with it."
        )


def max_positions(model: nn.Module) -> int | None:
    """Positions the model was trained on: ``sinklab_trained_positions`` (written by ``sinklab train``),
    else the config's ``max_position_embeddings``/``n_positions``; ``None`` when the config says nothing."""
    config = getattr(model, "config", None)
    value = _compat.config_get(config, "sinklab_trained_positions", "max_position_embeddings", "n_positions",
                               "max_sequence_length")
    return int(value) if isinstance(value, int) else None


def uses_rope(model: nn.Module) -> bool:
    """Whether ``model`` encodes positions by rotary embedding (scores depend on distances only)."""
    try:
        return any(r.cache_rope is not None for r in _compat.layer_rotations(model))
    except UnsupportedModelError:
        return False


def check_positions(model: nn.Module, seq_len: int) -> None:
    """Raise :class:`InputError` when ``seq_len`` is beyond an absolute-position model's position table;
    warn (:func:`warn_if_past_positions`) when a RoPE model runs past the positions it was trained on."""
    limit = max_positions(model)
    if limit is None or seq_len <= limit:
        return
    if uses_rope(model):
        warn_if_past_positions(model, seq_len)
        return
    raise InputError(f"--seq-len {seq_len} is beyond {type(model).__name__}'s {limit} positions: it has a learned "
                     f"absolute position table with {limit} rows; use --seq-len {limit} or less")


def warn_if_past_positions(model: nn.Module, seq_len: int) -> str | None:
    """Warn (:class:`~sinklab.errors.SinklabWarning`) if ``seq_len`` exceeds the positions a RoPE model was
    trained on; returns the message (``None`` when within range). Streaming past them is the point of
    ``sinklab stream``; scan and diagnose should call this."""
    limit = max_positions(model)
    if limit is None or seq_len <= limit:
        return None
    msg = (f"--seq-len {seq_len} runs {type(model).__name__} past the {limit} positions it was trained on: "
           "attention there is extrapolation, and its sinks may not be the model's usual ones")
    warnings.warn(msg, SinklabWarning, stacklevel=2)
    return msg
