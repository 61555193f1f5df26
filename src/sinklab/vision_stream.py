"""Streams with images: a vision-language model's prompt, image tokens and all, fed through a
:class:`~sinklab.stream.StreamSession`, the image's tokens pinnable (kept forever), and a video fed frame by frame
with the video memory plan (sinks, pinned frames, the most recent frames and their text, in constant memory).

The vision tower runs on the model's own attention, once per image or frame; only the text decoder streams
(``SinkCache`` installs its attention on ``_compat.language_model``). Positions are by cache slot, one index per token
(1-D rotary: Llava, Gemma 3, PaliGemma, Idefics3 …). A model that rotates by (time, height, width) positions
(M-RoPE: Qwen2-VL, Qwen2.5-VL, Qwen3-VL, GLM-4V …) keeps each token's 3-D offset from its cache-slot index
(:mod:`sinklab.stream.mrope`): the time index is re-based with the stream, height and width kept, and each chunk with
an image is laid out from its own first slot.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, fields
from typing import Any
from pathlib import Path

import torch
from torch import Tensor, nn

from . import _compat
from .errors import InputError, UnsupportedModelError, check_int
from .stream import StreamSession
from .stream.config import StreamConfig
from .stream.mrope import rope_index
from .vision_inputs import IMAGE, IMAGE_SPECIAL, TEXT, VisionInputs, check_vision_model, config_inputs, image_spans

__all__ = ["image_pins", "check_vision_stream", "native_positions", "feed_vision", "VideoMemory", "video_frames", "frame_files",
           "stream_video"]


def image_pins(inputs: VisionInputs, *, offset: int = 0, sample: int = 0,
               framing: bool = True) -> tuple[tuple[int, int], ...]:
    """The half-open stream spans of ``inputs``' images (sample ``sample`` of its first batch), to pass as
    ``pinned=``: each image's tokens, with the image-special tokens that frame them when ``framing``; ``offset``: the
    stream tokens fed before this prompt."""
    check_int("offset", offset)
    codes = inputs.modality[0][sample]
    spans: list[tuple[int, int]] = []
    for span in image_spans(codes):
        start, end = span.positions[0], span.positions[-1] + 1
        if framing:
            while start > 0 and int(codes[start - 1]) == IMAGE_SPECIAL:
                start -= 1
            while end < codes.shape[0] and int(codes[end]) == IMAGE_SPECIAL:
                end += 1
        if spans and start <= spans[-1][1]:  # two images framed back to back: one span
            spans[-1] = (spans[-1][0], end)
        else:
            spans.append((start, end))
    return tuple((offset + a, offset + b) for a, b in spans)


def check_vision_stream(model: nn.Module) -> None:
    """Refuse what a stream with images cannot reproduce: no vision tower (an :class:`InputError`)."""
    check_vision_model(model, "images in a stream")


def native_positions(model: nn.Module, batch: dict[str, Any]) -> Tensor | None:
    """The multimodal positions ``(axes, B, C)`` the model's own ``get_rope_index`` gives ``batch`` on its own
    (counted from 0), or ``None`` for a model with one position per token."""
    index = rope_index(model)
    if index is None:
        return None
    named = inspect.signature(index).parameters
    positions, _ = index(**{k: v for k, v in batch.items() if k in named})
    return positions


@torch.no_grad()
def feed_vision(session: StreamSession, inputs: VisionInputs, *, causal_images: bool = False) -> Tensor:
    """Feed ``inputs``' first batch (its ids, its pixels) through ``session``'s open cache in one forward: the vision
    tower encodes the image(s) and the text decoder streams the whole prompt; returns the logits ``[B, V]`` at its last
    position.

    ``token_type_ids`` that mark image tokens (Gemma 3's processor: an image's tokens attend to each other both ways)
    are refused, since the stream's attention is causal; ``causal_images=True`` drops them and streams the image
    causally (its logits then differ from the model's own forward with them)."""
    check_vision_stream(session.model)
    if session.cache is None:
        raise InputError("use the session as a context manager: `with StreamSession(...) as s:`")
    batch = dict(inputs.batches[0])
    types = batch.get("token_type_ids")
    if isinstance(types, Tensor) and bool(types.any()):
        if not causal_images:
            raise UnsupportedModelError(
                f"{type(session.model).__name__}: the inputs' token_type_ids mark image tokens, which attend to each "
                "other both ways in the model's own prefill, and the stream's attention is causal; lifting it needs "
                "the stream's prefill to mask each image's tokens bidirectionally (or pass causal_images=True to "
                "stream the image causally).")
        batch.pop("token_type_ids")
    positions = native_positions(session.model, batch)  # M-RoPE: the chunk laid out from its own first slot
    if positions is not None:
        batch["position_ids"] = positions + session.cache.get_seq_length()
    batch.pop("attention_mask", None)  # every column real: the stream masks by its own metadata
    kwargs = {"use_cache": True, _compat.cache_kwarg_name(session.model): session.cache}
    logits = session.model(**batch, **kwargs).logits[:, -1]
    session.tokens_seen += int(batch["input_ids"].shape[1])
    return logits


@dataclass(frozen=True)
class VideoMemory:
    """What a video stream keeps: ``num_sinks`` sinks, the frames ``pinned_frames`` (by index: the first, a prompted
    one) and the ``recent_frames`` newest frames, each frame a block of ``frame_tokens`` tokens (its vision tokens,
    framing and text), after a prompt of ``prompt_tokens`` tokens (kept whole when ``pin_prompt``).

    It is a plan over the recency ring: the recent frames are the window (``recent_frames × frame_tokens`` tokens,
    so their text goes with them), the pinned frames and the prompt are pinned spans — constant memory, whatever
    the video's length."""

    frame_tokens: int
    recent_frames: int = 4
    pinned_frames: tuple[int, ...] = (0,)
    num_sinks: int = 4
    prompt_tokens: int = 0
    pin_prompt: bool = True

    def __post_init__(self) -> None:
        check_int("frame_tokens", self.frame_tokens, 1)
        check_int("recent_frames", self.recent_frames, 1)
        check_int("num_sinks", self.num_sinks)
        check_int("prompt_tokens", self.prompt_tokens)
        for frame in self.pinned_frames:
            check_int("pinned frame", frame)

    def frame_span(self, frame: int) -> tuple[int, int]:
        """Stream span ``[start, end)`` of frame ``frame``."""
        start = self.prompt_tokens + frame * self.frame_tokens
        return start, start + self.frame_tokens

    def pinned(self) -> tuple[tuple[int, int], ...]:
        spans = [(0, self.prompt_tokens)] if self.pin_prompt and self.prompt_tokens else []
        spans += [self.frame_span(f) for f in sorted(set(self.pinned_frames))]
        return tuple(spans)

    def config(self, **settings) -> StreamConfig:
        """The stream's :class:`~sinklab.stream.StreamConfig` (``settings``: its other fields)."""
        return StreamConfig(num_sinks=self.num_sinks, window=self.recent_frames * self.frame_tokens,
                            pinned=self.pinned(), **settings)


def video_frames(model: nn.Module, frames: Sequence, text_ids: Sequence[int] = (), *,
                 image_processor: Any = None) -> list[VisionInputs]:
    """Each frame (a PIL image) as one block of inputs: its image tokens (framed as the config frames an image),
    then ``text_ids``; every block has the same number of tokens (:attr:`VideoMemory.frame_tokens`). The pixels are
    ``image_processor``'s (the model's own preprocessing: resizing, normalisation) when given, else from the config."""
    out = [config_inputs(model, frame, text_ids) for frame in frames]
    for frame, block in zip(frames, out):
        if image_processor is not None:
            batch = block.batches[0]
            pixels = image_processor(images=[frame], return_tensors="pt")["pixel_values"]
            if tuple(pixels.shape) != tuple(batch["pixel_values"].shape):
                raise UnsupportedModelError(
                    f"{type(model).__name__}: its image processor gives pixels of shape {tuple(pixels.shape)}, the "
                    f"vision config {tuple(batch['pixel_values'].shape)}; a frame needs the one layout its tokens "
                    "were counted for")
            batch["pixel_values"] = pixels.to(batch["pixel_values"].device, batch["pixel_values"].dtype)
    sizes = {int(block.batches[0]["input_ids"].shape[1]) for block in out}
    if len(sizes) > 1:
        raise UnsupportedModelError(f"{type(model).__name__}: its frames fill different numbers of tokens {sorted(sizes)}"
                                    "; the video memory needs one block size per frame")
    for block in out:
        if not bool((block.modality[0] != TEXT).any()) or not bool((block.modality[0] == IMAGE).any()):
            raise UnsupportedModelError(f"{type(model).__name__}: a frame filled no image tokens")
    return out


#: File endings read as video frames from a folder.
FRAME_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")


def frame_files(sources: Sequence[str | Path]) -> list[Path]:
    """The frames named by ``sources``: a folder gives its image files in name order, a file itself; an
    :class:`InputError` for a missing path or no frames at all."""
    files: list[Path] = []
    for source in map(Path, sources):
        if source.is_dir():
            found = sorted(p for p in source.iterdir() if p.is_file() and p.suffix.lower() in FRAME_SUFFIXES)
            if not found:
                raise InputError(f"no frames in {source} (image files ending in {', '.join(FRAME_SUFFIXES)})")
            files += found
        elif source.is_file():
            files.append(source)
        else:
            raise InputError(f"no such frame file or folder: {source}")
    if not files:
        raise InputError("no frames given")
    return files


def stream_video(model: nn.Module, frames: Iterable, *, prompt_ids: Sequence[int] = (), text_ids: Sequence[int] = (),
                 num_sinks: int = 4, recent_frames: int = 4, pinned_frames: tuple[int, ...] = (0,),
                 image_processor: Any = None,
                 **session_settings) -> Iterator[tuple[int, Tensor, StreamSession, VideoMemory]]:
    """Stream ``frames`` (PIL images, possibly endless) through ``model`` under a :class:`VideoMemory`: the prompt
    (pinned) first, then each frame's block (its image tokens, then ``text_ids``); yields ``(frame index, logits
    [1, V] after it, the open session, the memory)`` after every frame; ``image_processor``: as
    :func:`video_frames`; ``session_settings``: :class:`~sinklab.stream.StreamConfig` fields (``rebase_every`` …)
    and :class:`~sinklab.stream.StreamSession`'s own."""
    check_vision_stream(model)
    iterator = iter(frames)
    try:
        first = next(iterator)
    except StopIteration:
        raise InputError("no frames given") from None
    block = video_frames(model, [first], text_ids, image_processor=image_processor)[0]
    memory = VideoMemory(frame_tokens=int(block.batches[0]["input_ids"].shape[1]), recent_frames=recent_frames,
                         pinned_frames=pinned_frames, num_sinks=num_sinks, prompt_tokens=len(prompt_ids))
    names = {f.name for f in fields(StreamConfig)}  # the stream's own settings go into the memory's config
    config = memory.config(**{k: v for k, v in session_settings.items() if k in names})
    session_settings = {k: v for k, v in session_settings.items() if k not in names}
    with StreamSession(model, config=config, **session_settings) as session:
        if prompt_ids:
            session.feed(torch.tensor([list(prompt_ids)]))
        index = 0
        while True:
            yield index, feed_vision(session, block), session, memory
            try:
                frame = next(iterator)
            except StopIteration:
                return
            index += 1
            block = video_frames(model, [frame], text_ids, image_processor=image_processor)[0]
            if int(block.batches[0]["input_ids"].shape[1]) != memory.frame_tokens:
                raise UnsupportedModelError(f"frame {index} fills a block of {block.batches[0]['input_ids'].shape[1]} "
                                            f"tokens, the first {memory.frame_tokens}; the video memory needs one size")
