"""Multimodal rotary positions (M-RoPE: Qwen2-VL's time, height and width axes) in a stream.

A model with M-RoPE rotates each frequency band of a head by one axis of a token's 3-D position. Text tokens have
the same index on every axis; an image's tokens share a time index and spread over height and width, and the text
after an image continues from the image's largest index plus one. Adding the same amount to all three axes rotates
every band by that amount, which is exactly a 1-D rotary shift: so the stream keeps its one virtual position per
token (by cache slot) and adds each token's **offset**, its 3-D position minus its virtual one, fixed when it is
written. Every later move of a kept key is then the stream's usual 1-D re-rotation, and the time index is re-based
with everything else: kept frames stay inside the positions the model was trained on, whatever the stream's length.

Offsets do not accumulate over chunks: a chunk with an image fed after others (a video frame) is laid out by the
model's own ``get_rope_index`` from the chunk's own first slot, so each token's offset is its deviation inside its
chunk, and the text after a chunk carries that chunk's offset only. (Carried over every frame, the offsets of an
endless video would grow without bound, and a query would come to sit before the pinned frames it reads, since the
slot distance drops an evicted frame's tokens but not its offset.) The first chunk is laid out exactly as the
model's own forward lays out the whole prompt.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from .. import _compat
from ..errors import UnsupportedModelError

__all__ = ["rope_index", "lays_out_positions", "MultimodalPositions"]


def rope_index(model: nn.Module) -> Callable[..., Any] | None:
    """The model's own ``get_rope_index`` (on its base model or itself), which lays out multimodal positions; None
    for a model with one position per token. A config that names rotary sections (``mrope_section``) without one
    hands its decoder one position per token, and streams as any 1-D rotary model."""
    for owner in (_compat.base_model(model), model):
        method: Any = getattr(owner, "get_rope_index", None)
        if callable(method):
            return method
    return None


def lays_out_positions(model: nn.Module) -> bool:
    """Whether ``model`` lays out multimodal positions (:func:`rope_index`)."""
    return rope_index(model) is not None


class MultimodalPositions:
    """The per-row offset of the next text token (its position on every axis minus its virtual one), and the 3-D
    positions of each forward. Positions a model hands the decoder are read against the columns fed before the
    chunk (its ``get_rope_index`` for a first chunk, its ``rope_deltas`` after;
    :func:`sinklab.vision_stream.feed_vision` lays out a later chunk with an image from its own first slot)."""

    axes = 3

    def __init__(self) -> None:
        self.offset: Tensor | None = None  # [B] long

    def plan(self, given: object, virtual: Tensor, seen: int, all_valid: bool) -> Tensor:
        """``(3, B, C)`` positions for a forward whose virtual positions are ``virtual`` ``[B, C]``, after ``seen``
        columns; ``given``: the positions the model handed its decoder (``(axes, B, C)``, or ``None`` / 1-D ones for
        text), each token keeping its offset from the index the model counted it at."""
        b, c = virtual.shape
        if self.offset is None or self.offset.shape[0] != b:
            self.offset = torch.zeros(b, dtype=torch.long, device=virtual.device)
        if not (isinstance(given, Tensor) and given.dim() == 3):
            return (virtual + self.offset[:, None]).expand(self.axes, b, c)
        given = given[-self.axes:].to(virtual.device)  # four rows: a text row first (packed inputs), then the axes
        if not all_valid:
            raise UnsupportedModelError(
                "padded rows with multimodal rotary positions: the stream cannot tell which of the model's positions "
                "belong to real tokens; feed one row, or rows of equal length")
        counted = seen + torch.arange(c, device=virtual.device)
        self.offset = given.amax(dim=(0, 2)) + 1 - (seen + c)
        return virtual[None] + (given - counted)

    def select_rows(self, index: Tensor) -> None:
        if self.offset is not None:
            self.offset = self.offset[index.to(self.offset.device)]

    def state_dict(self) -> dict:
        return {} if self.offset is None else {"offset": self.offset.clone()}

    def load_state_dict(self, saved: dict) -> None:
        self.offset = saved["offset"].clone() if "offset" in saved else None
