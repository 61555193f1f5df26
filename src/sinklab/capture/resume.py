"""Resumable passes: keep what every block received in one forward, then rerun only the blocks from ``l`` on.

A causal edit at layer ``l`` cannot change anything before block ``l``, so its pass can start from the
residual stream at block ``l``'s input. :class:`BlockInputs` holds, for one batch, the positional and
keyword arguments each block was called with (hidden states, masks, position embeddings — exactly as the
model's own forward built them), the base model's final hidden states, and the module that maps the last
block's output to them (the final norm, found by checking candidates numerically; the identity for
post-norm encoders). :func:`run_blocks` calls the model's own block modules with those arguments, so
position embeddings and masks are the model's, not re-derived. :func:`stacked` repeats a batch's recorded
inputs ``n`` times along the batch axis, so ``n`` differently edited passes run as one forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from .. import _compat

__all__ = ["BlockInputs", "run_blocks", "stacked", "find_final_map", "UNKNOWN_MAP", "NOT_RESUMABLE"]

#: ``BlockInputs.final_map`` when no module of the model maps the last block's output to its final states.
UNKNOWN_MAP = "unknown"
#: ``BlockInputs.final_map`` when no pass may restart at a block at all (``_compat.resume_blocker``): every pass,
#: to any block, runs the whole model.
NOT_RESUMABLE = "not resumable"


@dataclass
class BlockInputs:
    """What every block of one forward pass received (``B`` batch, ``T`` positions, ``d`` width)."""

    calls: list[tuple[tuple, dict]]  # per block: (args, kwargs) as the model's forward called it
    token_mask: Tensor | None  # (B, T) real tokens (None: all real)
    final: Tensor  # (B, T, d) the base model's final hidden states (last_hidden_state)
    final_map: nn.Module | str | None  # last block output -> final: a module, None (identity) or UNKNOWN_MAP
    batch: dict  # the model inputs, for a full pass where final_map is UNKNOWN_MAP

    @property
    def resumable(self) -> bool:
        """True when a pass can start at any block (the final map is known)."""
        return not isinstance(self.final_map, str)


def _with_hidden(args: tuple, kwargs: dict, hidden: Tensor) -> tuple[tuple, dict]:
    """The block call ``(args, kwargs)`` with its hidden-states input replaced by ``hidden``."""
    if args and isinstance(args[0], Tensor):
        return (hidden,) + tuple(args[1:]), kwargs
    return args, {**kwargs, "hidden_states": hidden}


def _repeat(value: Any, batch: int, copies: int, memo: dict[int, Tensor]) -> Any:
    """``value`` with every batch-leading tensor (``[B, …]``, two or more dims) repeated ``copies`` times; a tensor
    met again (the mask and position embeddings every block call shares) is repeated once (``memo``, by ``id``)."""
    if isinstance(value, Tensor):
        if value.dim() >= 2 and value.shape[0] == batch:
            if id(value) not in memo:  # (copies·B, …): copy i = rows i·B …
                memo[id(value)] = value.repeat(copies, *([1] * (value.dim() - 1)))
            return memo[id(value)]
        return value
    if isinstance(value, (tuple, list)):
        return type(value)(_repeat(v, batch, copies, memo) for v in value)
    if isinstance(value, dict):
        return {k: _repeat(v, batch, copies, memo) for k, v in value.items()}
    return value


def stacked(inputs: BlockInputs, copies: int) -> BlockInputs:
    """``inputs`` repeated ``copies`` times along the batch axis (copy ``i`` = rows ``i·B … (i+1)·B − 1``).

    Batch-leading tensors (hidden states, masks ``[B, 1, T, T]``, position embeddings ``[B, T, d]``, model
    inputs) are repeated, each shared one once for all the calls; shared ones of another batch size
    (``[1, T, T]`` masks, 1-D cache positions) are kept as they are.
    """
    if copies == 1:
        return inputs
    memo: dict[int, Tensor] = {}
    b = inputs.final.shape[0]
    calls = [] if inputs.final_map == NOT_RESUMABLE else inputs.calls  # never rerun: not worth repeating
    return BlockInputs(calls=[(_repeat(args, b, copies, memo), _repeat(kwargs, b, copies, memo))
                              for args, kwargs in calls],
                       token_mask=_repeat(inputs.token_mask, b, copies, memo),
                       final=_repeat(inputs.final, b, copies, memo), final_map=inputs.final_map,
                       batch=_repeat(inputs.batch, b, copies, memo))


def run_blocks(layers: nn.ModuleList, inputs: BlockInputs, start: int, stop: int) -> Tensor:
    """Hidden states ``[B, T, d]`` after block ``stop − 1``, starting from block ``start``'s recorded input."""
    hidden = _compat.block_input(*inputs.calls[start])
    for index in range(start, stop):
        args, kwargs = _with_hidden(*inputs.calls[index], hidden)
        hidden = _compat.block_hidden_states(layers[index](*args, **kwargs))
    return hidden


def _close(a: Tensor, b: Tensor, mask: Tensor | None) -> bool:
    if a.shape != b.shape:
        return False
    if mask is not None:
        a, b = a[mask], b[mask]
    return bool((a.float() - b.float()).abs().max() <= 1e-5 * b.float().abs().max() + 1e-6)


@torch.no_grad()
def find_final_map(model: nn.Module, layers: nn.ModuleList, last: Tensor, final: Tensor,
                   token_mask: Tensor | None) -> nn.Module | str | None:
    """The module ``f`` of ``model`` outside the blocks with ``f(last) == final`` (``None`` if they are equal).

    Candidates are the normalisation modules of the base model that are not inside a block (``norm``,
    ``ln_f``, ``layernorm`` …); each is checked numerically on this batch. Returns :data:`UNKNOWN_MAP`
    when none matches (then edits fall back to full passes).
    """
    if _close(last, final, token_mask):
        return None
    inside = {id(m) for layer in layers for m in layer.modules()}
    for module in _compat.base_model(model).modules():
        if id(module) in inside or list(module.children()):
            continue
        if not (isinstance(module, nn.LayerNorm) or "norm" in type(module).__name__.lower()):
            continue
        try:
            out = module(last)
        except (RuntimeError, TypeError, ValueError):
            continue
        if isinstance(out, Tensor) and _close(out, final, token_mask):
            return module
    return UNKNOWN_MAP
