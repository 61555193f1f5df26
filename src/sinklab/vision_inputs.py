"""Inputs for scanning a vision-language model: images read from files, turned into the model's pixel inputs (by
its own processor, or from its config for a model that has none, such as a tiny random one), the token sequence with
the image's tokens in place, and which position holds which modality.

A position is one of :data:`MODALITIES`: ``text``, ``image`` (one of the tokens the vision tower's features replace,
the config's ``image_token_id`` / ``image_token_index``), or ``image-special`` (a token that frames an image: begin /
end of image, vision start / end). Where the image tokens of one image form a grid, :class:`ImageSpan` says its rows
and columns, so a patch index reads as (row, column).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from . import _compat
from .errors import InputError, UnsupportedModelError

__all__ = ["MODALITIES", "TEXT", "IMAGE", "IMAGE_SPECIAL", "ImageSpan", "VisionInputs", "image_token_id",
           "special_image_ids", "modality_codes", "image_spans", "load_images", "config_inputs", "processor_inputs",
           "check_vision_model", "patch_label"]

#: Modality codes of :func:`modality_codes`, by index.
MODALITIES = ("text", "image", "image-special")
TEXT, IMAGE, IMAGE_SPECIAL = 0, 1, 2

#: Config fields that name the token the vision features replace.
IMAGE_TOKEN_FIELDS = ("image_token_id", "image_token_index")
#: Config fields of the token a video's features replace: the image token of a model whose config names only these
#: (InstructBLIP-Video: a picture enters as a still video).
VIDEO_TOKEN_FIELDS = ("video_token_id", "video_token_index")
#: Config fields of tokens that frame an image, as (opening, closing) pairs.
FRAME_TOKEN_FIELDS = (("boi_token_id", "eoi_token_id"), ("boi_token_index", "eoi_token_index"),
                      ("vision_start_token_id", "vision_end_token_id"), ("image_start_token_id", "image_end_token_id"),
                      ("start_image_token_id", "end_image_token_id"))
#: Other config fields of image-framing tokens (no pair).
OTHER_SPECIAL_FIELDS = ("fake_image_token_id", "global_image_token_id", "image_newline_token_id",
                        "image_break_token_id", "image_end_token_id")


def _config_int(config: object, name: str) -> int | None:
    for cfg in (config, getattr(config, "text_config", None)):
        value = getattr(cfg, name, None) if cfg is not None else None
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _first_int(config: object, names: Sequence[str]) -> int | None:
    return next((v for v in (_config_int(config, n) for n in names) if v is not None), None)


def image_token_id(config: object) -> int | None:
    """The id of the token the vision features replace (``image_token_id`` or ``image_token_index``; in a config
    that names neither, its video token: :data:`VIDEO_TOKEN_FIELDS`), or None."""
    configs = [c for c in (config, getattr(config, "text_config", None)) if c is not None]
    named = any(hasattr(c, n) for c in configs for n in IMAGE_TOKEN_FIELDS)  # set or not: then the image's own
    return _first_int(config, IMAGE_TOKEN_FIELDS if named else VIDEO_TOKEN_FIELDS)


def special_image_ids(config: object) -> set[int]:
    """Ids of the tokens that frame an image (begin/end of image, vision start/end …) the config names."""
    names = [n for pair in FRAME_TOKEN_FIELDS for n in pair] + list(OTHER_SPECIAL_FIELDS)
    ids = {_config_int(config, n) for n in names}
    image = image_token_id(config)
    return {i for i in ids if i is not None and i != image}


def modality_codes(input_ids: Tensor, config: object) -> Tensor:
    """``[B, T]`` int8 modality of each position (:data:`MODALITIES`) of ``input_ids`` ``[B, T]``."""
    image = image_token_id(config)
    if image is None:
        raise UnsupportedModelError(f"{type(config).__name__} names no image token (image_token_id / "
                                    "image_token_index), so sinklab cannot tell image positions from text.")
    codes = torch.zeros(input_ids.shape, dtype=torch.int8)
    special = sorted(special_image_ids(config))
    if special:
        codes[torch.isin(input_ids.cpu(), torch.tensor(special))] = IMAGE_SPECIAL
    codes[input_ids.cpu() == image] = IMAGE
    return codes


@dataclass(frozen=True)
class ImageSpan:
    """One image's tokens in one sample: their positions and, where known, the grid they form (``rows`` ×
    ``cols``, row-major: patch ``i`` is row ``i // cols``, column ``i % cols``)."""

    positions: tuple[int, ...]
    rows: int | None = None
    cols: int | None = None

    def to_json(self) -> dict:
        return {"first": self.positions[0] if self.positions else None, "count": len(self.positions),
                "rows": self.rows, "cols": self.cols}


def image_spans(codes: Tensor, grids: Sequence[tuple[int, int] | None] = ()) -> list[ImageSpan]:
    """The runs of image positions in one sample's codes ``[T]``, the ``i``-th run with ``grids[i]`` (rows, cols)
    when it has that many tokens (no grid otherwise: rows and columns unknown)."""
    positions = (codes == IMAGE).nonzero().flatten().tolist()
    runs: list[list[int]] = []
    for p in positions:
        if runs and p == runs[-1][-1] + 1:
            runs[-1].append(p)
        else:
            runs.append([p])
    if len(grids) == 1 and len(runs) > 1 and grids[0] is not None and grids[0][0] * grids[0][1] == len(positions):
        runs = [positions]  # one image whose rows are separated by break tokens
    spans = []
    for i, run in enumerate(runs):
        grid = grids[i] if i < len(grids) else None
        if grid is not None and grid[0] * grid[1] != len(run):
            grid = None
        spans.append(ImageSpan(tuple(run), *(grid or (None, None))))
    return spans


def patch_label(spans: Sequence[ImageSpan], position: int) -> str | None:
    """``"image 0 patch 5 (row 1, col 1)"`` for an image position, None for any other."""
    for i, span in enumerate(spans):
        if position in span.positions:
            index = span.positions.index(position)
            where = f" (row {index // span.cols}, col {index % span.cols})" if span.cols else ""
            return f"image {i} patch {index}{where}"
    return None


@dataclass
class VisionInputs:
    """A vision-language scan's inputs: model-ready ``batches``, each sample's token labels, each batch's
    ``[B, T]`` modality codes, and each sample's image grids (rows, cols) where known."""

    batches: list[dict[str, Tensor]]
    tokens: list[list[str]]
    modality: list[Tensor]
    grids: list[list[tuple[int, int] | None]] = field(default_factory=list)


def check_vision_model(model: nn.Module, what: str = "--image") -> None:
    """Refuse a model without a vision tower (a text-only causal LM given images), and a vision-language model whose
    image positions sinklab cannot find (no image token: the vision features enter some other way)."""
    if getattr(getattr(model, "config", None), "vision_config", None) is None:
        try:
            takes = set(inspect.signature(type(model).forward).parameters)
        except (TypeError, ValueError):
            takes = set()
        pixels = [name for name in ("pixel_values", "image_patches", "flattened_patches") if name in takes]
        if pixels:  # it takes images, through something other than a vision tower of its own config
            raise UnsupportedModelError(
                f"{type(model).__name__} takes images ({pixels[0]}) but its config has no vision_config: the pixels "
                "reach the text through something sinklab does not model (a patch projection inside the decoder, an "
                "encoder-decoder's encoder read by cross-attention, a nested model's config), and sinklab finds a "
                "vision-language model's text decoder and image positions through its vision_config, get_decoder "
                "and image token. Lifting it needs that model's decoder and the positions its image fills.")
        raise InputError(f"{type(model).__name__} has no vision tower (no vision_config in its config), so it cannot "
                         f"take {what}; give a vision-language model (Llava, Qwen2-VL, Gemma 3, Idefics3/SmolVLM, "
                         "PaliGemma …) or drop it.")
    if not _compat.vision_language(model):
        raise UnsupportedModelError(
            f"{type(model).__name__}: sinklab finds no text decoder of its own (get_decoder) beside the vision tower "
            "(an encoder-decoder or a decoder that is the whole model); scanning it needs the decoder's blocks told "
            "apart from the vision tower's.")
    if _compat.config_get(model.config, "cross_attention_layers"):
        raise UnsupportedModelError(
            f"{type(model).__name__}: its decoder reads the image through cross-attention layers (the image's tokens "
            "are not in the sequence), and the scan keeps one self-attention map per layer over the sequence. "
            "Lifting it needs the cross-attention layers' maps kept apart, over the image's tokens.")
    if image_token_id(model.config) is None:
        raise UnsupportedModelError(
            f"{type(model).__name__}: its config names no image token (image_token_id / image_token_index): the vision "
            "features enter the decoder some other way (query tokens, cross-attention, a prefix), so sinklab cannot "
            "tell image positions from text. Lifting it needs that model's rule for where its image positions are.")


#: Real photographs bundled in the scikit-image wheel (``skimage/data``), usable as ``sample:NAME`` wherever an image
#: path goes; ``sample`` alone is the first. Read as files: the package is installed without its dependencies and
#: never imported.
SAMPLE_IMAGES = ("chelsea", "astronaut", "coffee", "motorcycle_left", "camera", "horse")


def sample_image_path(name: str) -> Path:
    """The file of the bundled photograph ``name`` (:data:`SAMPLE_IMAGES`); an :class:`InputError` when the name is
    unknown or scikit-image's wheel is not installed."""
    import importlib.util

    if name not in SAMPLE_IMAGES:
        raise InputError(f"unknown sample image {name!r}; the samples are {', '.join(SAMPLE_IMAGES)}")
    spec = importlib.util.find_spec("skimage")  # located, not imported
    folders = list(spec.submodule_search_locations or ()) if spec is not None else []
    path = Path(folders[0]) / "data" / f"{name}.png" if folders else None
    if path is None or not path.is_file():
        raise InputError("the sample photographs come with the scikit-image wheel (its skimage/data folder); install "
                         "it with `pip install --no-deps scikit-image==0.26.0` (`make venv` does) or give an image file")
    return path


def load_images(paths: Sequence[str | Path]) -> list:
    """The images at ``paths`` as RGB ``PIL.Image``\\ s; ``sample`` or ``sample:NAME`` is a bundled photograph
    (:data:`SAMPLE_IMAGES`); an unreadable file is an :class:`InputError` naming it."""
    from PIL import Image, UnidentifiedImageError

    images = []
    for path in paths:
        if str(path) == "sample" or str(path).startswith("sample:"):
            path = sample_image_path(str(path).partition(":")[2] or SAMPLE_IMAGES[0])
        try:
            with Image.open(path) as image:
                images.append(image.convert("RGB"))
        except (OSError, UnidentifiedImageError, ValueError) as exc:
            raise InputError(f"cannot read image {path}: {' '.join(str(exc).split()) or type(exc).__name__}") from None
    return images


# ----------------------------------------------------------------------------- pixels from the config
def _vision_config(model: nn.Module) -> Any:
    return getattr(model.config, "vision_config", None)


def _pixels(image: Any, size: int) -> Tensor:
    """``[3, size, size]`` float pixels in [−1, 1] of a PIL image resized to ``size`` × ``size``."""
    import numpy as np

    array = np.asarray(image.convert("RGB").resize((size, size)), dtype=np.float32) / 127.5 - 1.0
    return torch.from_numpy(array).permute(2, 0, 1).contiguous()


def _patch_rows(square: Tensor, patch: int, channels_last: bool = False) -> Tensor:
    """``[N, 3, P, P]`` (or ``[N, P, P, 3]``) patches of ``square`` ``[3, S, S]``, row-major (row by row, left to
    right)."""
    grid = square.shape[-1] // patch
    rows = square.reshape(3, grid, patch, grid, patch).permute(1, 3, 0, 2, 4).reshape(grid * grid, 3, patch, patch)
    return rows.permute(0, 2, 3, 1).contiguous() if channels_last else rows.contiguous()


#: Frames of the still video a picture becomes for a model that only takes videos (InstructBLIP-Video's processor
#: samples 4).
STILL_FRAMES = 4


def _layouts(model: nn.Module, image: Any, takes: frozenset[str] = frozenset(),
             text_ids: Sequence[int] = ()) -> list[tuple[str, dict[str, Tensor], tuple[int, int] | None]]:
    """Pixel-input layouts vision towers take, most common first: (name, inputs of one image, token grid).
    ``takes``: the parameter names of the model's ``get_image_features``; a layout with inputs besides the pixels
    (patch positions, spatial shapes, per-image sizes, the Q-Former's instruction: ``text_ids``) is tried only where
    the model names them."""
    vc = _vision_config(model)
    patch = getattr(vc, "patch_size", 14) or 14
    patch = int(patch[0] if isinstance(patch, (list, tuple)) else patch)
    temporal = getattr(vc, "temporal_patch_size", None)
    merge = int(getattr(vc, "spatial_merge_size", 1) or 1)
    size = getattr(vc, "image_size", None)
    if isinstance(size, (list, tuple)):
        size = size[0]
    size = int(size) if isinstance(size, int) and size > 0 else patch * 4 * merge
    square = _pixels(image, size)
    grid = size // patch
    out: list[tuple[str, dict[str, Tensor], tuple[int, int] | None]] = []
    thw = torch.tensor([[1, grid, grid]])
    if temporal or merge > 1:  # Qwen2-VL family: flattened patches (time × channels × patch × patch) and their grid
        temporal = temporal or 1
        frames = square[None].expand(int(temporal), -1, -1, -1)  # (t, 3, S, S)
        patches = frames.reshape(int(temporal), 3, grid // merge, merge, patch, grid // merge, merge, patch)
        patches = patches.permute(2, 5, 3, 6, 1, 0, 4, 7).reshape(grid * grid, -1)
        cells = (grid // merge, grid // merge)
        out.append(("patches", {"pixel_values": patches, "image_grid_thw": thw}, cells))
        if temporal == 1:  # the same patches as small images, unbatched and batched (PaddleOCR-VL, Kimi-VL style)
            tiles = patches.reshape(grid * grid, 3, patch, patch)
            out.append(("patch images", {"pixel_values": tiles, "image_grid_thw": thw}, cells))
            out.append(("batched patch images", {"pixel_values": tiles[None], "image_grid_thw": thw}, cells))
        else:  # each patch a (time, patch, patch, channels) volume, row-major (Inkling's MLP tower)
            volumes = _patch_rows(square, patch, channels_last=True)[:, None].expand(-1, int(temporal), -1, -1, -1)
            out.append(("patch volumes", {"pixel_values": volumes.contiguous()}, (grid, grid)))
    elif "image_grid_thw" in takes:  # row-major patches with their (1, rows, cols) grid, merged by the tower itself
        rows = _patch_rows(square, patch)
        sizes = {"image_merge_sizes": torch.tensor([1])} if "image_merge_sizes" in takes else {}  # unmerged images
        out.append(("row-major patches", {"pixel_values": rows.reshape(grid * grid, -1), "image_grid_thw": thw,
                                          **sizes}, None))
        out.append(("row-major patch images", {"pixel_values": rows, "image_grid_thw": thw, **sizes}, None))
    if "spatial_shapes" in takes or "image_position_ids" in takes:  # NaFlex: [1, N, P·P·3] patches and their places
        flat = _patch_rows(square, patch, channels_last=True).reshape(1, grid * grid, -1)
        if "spatial_shapes" in takes:  # SigLIP 2 (LFM2-VL): the patch grid's shape, a mask of real patches
            out.append(("patches with spatial shapes", {
                "pixel_values": flat, "spatial_shapes": torch.tensor([[grid, grid]]),
                "pixel_attention_mask": torch.ones(1, grid * grid, dtype=torch.bool)}, None))
        if "image_position_ids" in takes:  # Gemma 4: each patch's (x, y) = (column, row); its pixels in [0, 1]
            places = torch.stack(torch.meshgrid(torch.arange(grid), torch.arange(grid), indexing="ij"), -1)
            out.append(("patches with positions", {"pixel_values": (flat + 1) / 2,
                                                   "image_position_ids": places.flip(-1).reshape(1, -1, 2)}, None))
    if "qformer_input_ids" in takes:  # InstructBLIP: the Q-Former reads the instruction (the text's ids) with the image
        ids = torch.tensor([list(text_ids)])
        instruction = {"qformer_input_ids": ids, "qformer_attention_mask": torch.ones_like(ids)}
        out.append(("square with instruction", {"pixel_values": square[None], **instruction}, None))
        still = square[None, None].expand(1, STILL_FRAMES, -1, -1, -1).contiguous()
        out.append(("still video with instruction", {"pixel_values": still, **instruction}, None))
    if "target_sizes" in takes:  # MiniCPM-V: one picture and its size in patches
        out.append(("square with target sizes", {"pixel_values": square[None],
                                                 "target_sizes": torch.tensor([[grid, grid]], dtype=torch.int32)}, None))
    out.append(("square", {"pixel_values": square[None]}, None))
    out.append(("square with sizes", {"pixel_values": square[None], "image_sizes": torch.tensor([[size, size]])}, None))
    # any-resolution tiling (LLaVA-NeXT, OneVision): the whole image and one tile of it
    out.append(("tiles with sizes", {"pixel_values": square[None, None].expand(1, 2, -1, -1, -1).contiguous(),
                                     "image_sizes": torch.tensor([[size, size]])}, None))
    out.append(("image list", {"pixel_values": square[None, None],
                               "pixel_attention_mask": torch.ones(1, 1, size, size, dtype=torch.bool)}, None))
    # one tile and a mask of real tiles (Granite-Docling)
    out.append(("tile list", {"pixel_values": square[None, None],
                              "pixel_attention_mask": torch.ones(1, 1, dtype=torch.bool)}, None))
    return out


#: Layouts of one untiled picture: their features, where a square count, are its grid (row-major).
_PICTURE_LAYOUTS = {"square", "image list", "tile list", "row-major patches", "row-major patch images",
                    "patches with spatial shapes", "patches with positions", "square with target sizes",
                    "square with instruction"}


def _square(count: int) -> tuple[int, int] | None:
    side = math.isqrt(count)
    return (side, side) if side * side == count else None


def _feature_count(output: Any) -> int:
    """Rows of image features in ``get_image_features``' output (a tensor, a list of them, or a model output)."""
    for name in ("pooler_output", "image_embeds", "last_hidden_state"):
        value = getattr(output, name, None)
        if value is not None:
            output = value
            break
    if isinstance(output, Tensor):
        return int(output.reshape(-1, output.shape[-1]).shape[0])
    if isinstance(output, (list, tuple)) and output and all(isinstance(x, Tensor) for x in output):
        return sum(int(x.reshape(-1, x.shape[-1]).shape[0]) for x in output)
    raise UnsupportedModelError(f"cannot count the image features in a {type(output).__name__}")


@torch.no_grad()
def _image_pixels(model: nn.Module, image: Any,
                  text_ids: Sequence[int] = ()) -> tuple[dict[str, Tensor], int, tuple[int, int] | None]:
    """One image's pixel inputs from the model's config, how many tokens its features fill, and their grid."""
    stack = _compat.base_model(model)
    get = getattr(stack, "get_image_features", None) or getattr(model, "get_image_features", None)
    video = _first_int(model.config, VIDEO_TOKEN_FIELDS)
    if get is None and video is not None and image_token_id(model.config) == video:
        get = getattr(stack, "get_video_features", None)  # a model that only takes videos: a still video
    if get is None:
        raise UnsupportedModelError(f"{type(model).__name__} has no get_image_features, so sinklab cannot count the "
                                    "tokens an image fills from the config; give its processor instead (sinklab scan "
                                    "MODEL --image loads the model's own processor)")
    errors = []
    device = _compat.input_device(model)
    try:
        takes = frozenset(inspect.signature(get).parameters)
    except (TypeError, ValueError):
        takes = frozenset()
    for name, inputs, grid in _layouts(model, image, takes, text_ids):
        inputs = {k: v.to(device) for k, v in inputs.items()}
        try:
            count = _feature_count(get(**inputs))
        except Exception as exc:  # noqa: BLE001 - a layout this tower does not take
            errors.append(f"{name}: {type(exc).__name__}: {' '.join(str(exc).split())[:160]}")
            continue
        if getattr(model.config, "num_query_tokens", None):  # BLIP-2-style query tokens: no patch grid
            return inputs, count, None
        if grid is None and name in _PICTURE_LAYOUTS:  # one picture's features: a square grid if any
            grid = _square(count)
        return inputs, count, grid if grid is not None and grid[0] * grid[1] == count else None
    raise UnsupportedModelError(f"{type(model).__name__}: no pixel layout sinklab builds from a config fits its vision "
                                f"tower ({'; '.join(errors)}); give its processor instead, or teach "
                                "sinklab.vision_inputs its layout")


def config_inputs(model: nn.Module, image: Any, text_ids: Sequence[int], *, bos: int | None = None) -> VisionInputs:
    """One sample for a model without a processor (a tiny random model): ``image`` (PIL) resized to the vision
    config's image size, the config's image-framing tokens around as many image tokens as its features fill, then
    ``text_ids``; ``bos`` first when given. Token labels: ``<image>`` and the framing tokens' names, text as ids."""
    check_vision_model(model, "an image")
    config = model.config
    pixels, count, grid = _image_pixels(model, image, text_ids)
    image_id = image_token_id(config)
    opening = closing = None
    for first, last in FRAME_TOKEN_FIELDS:
        a, b = _config_int(config, first), _config_int(config, last)
        if a is not None and b is not None:
            opening, closing = (a, first), (b, last)
            break
    ids: list[int] = [] if bos is None else [bos]
    labels: list[str] = [] if bos is None else [f"<{bos}>"]
    if opening is not None:
        ids.append(opening[0])
        labels.append(f"<{opening[1].removesuffix('_id').removesuffix('_index')}>")
    ids += [image_id] * count  # type: ignore[list-item]  # check_vision_model: there is one
    labels += ["<image>"] * count
    if closing is not None:
        ids.append(closing[0])
        labels.append(f"<{closing[1].removesuffix('_id').removesuffix('_index')}>")
    ids += list(text_ids)
    labels += [str(i) for i in text_ids]
    input_ids = torch.tensor([ids], device=_compat.input_device(model))
    codes = modality_codes(input_ids, config)
    batch = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), **pixels}
    if "mm_token_type_ids" in inspect.signature(type(_compat.base_model(model)).forward).parameters:
        batch["mm_token_type_ids"] = (codes == IMAGE).long().to(input_ids.device)  # M-RoPE: 1 marks image tokens
    return VisionInputs([batch], [labels], [codes], [[grid]])


def processor_inputs(model: nn.Module, processor: Any, images: Sequence[Any], text: str) -> VisionInputs:
    """One sample through the model's own processor: a user turn of ``images`` then ``text`` (the processor's chat
    template where it has one, else its image token per image before the text), tokenised with every image's tokens
    in place. Token labels are the tokenizer's token strings."""
    check_vision_model(model)
    tokenizer = getattr(processor, "tokenizer", processor)
    prompt = None
    if getattr(processor, "chat_template", None) or getattr(tokenizer, "chat_template", None):
        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
        try:
            prompt = processor.apply_chat_template([{"role": "user", "content": content}], tokenize=False)
        except Exception:  # noqa: BLE001 - a template that wants something else: the plain prompt below
            prompt = None
    if prompt is None:
        token = getattr(processor, "image_token", None) or "<image>"
        prompt = token * len(images) + text
    try:
        encoded = processor(text=[prompt], images=list(images), return_tensors="pt")
    except Exception as exc:  # noqa: BLE001 - the processor's own complaint, in one line
        raise InputError(f"the model's processor could not take the image(s): {type(exc).__name__}: "
                         f"{' '.join(str(exc).split())[:300]}") from None
    device = _compat.input_device(model)
    batch = {k: v.to(device) for k, v in encoded.items() if isinstance(v, Tensor)}
    ids = batch["input_ids"]
    batch.setdefault("attention_mask", torch.ones_like(ids))
    labels = [str(t) for t in tokenizer.convert_ids_to_tokens(ids[0].tolist())]
    codes = modality_codes(ids, model.config)
    grids: list[tuple[int, int] | None] = []
    thw = batch.get("image_grid_thw")
    if thw is not None:
        merge = int(getattr(_vision_config(model), "spatial_merge_size", 1) or 1)
        grids = [(int(h) // merge, int(w) // merge) for _, h, w in thw.tolist()]
    elif getattr(model.config, "image_grid_pinpoints", None) is None:  # no tiling: each run of tokens is one picture
        grids = [_square(len(span.positions)) for span in image_spans(codes[0])]
    return VisionInputs([batch], [labels], [codes], [grids])


# ----------------------------------------------------------------------------- the vision tower as an encoder
#: Where a vision-language model keeps its vision tower, tried in order on the model and on its inner ``model``.
TOWER_NAMES = ("vision_tower", "vision_model", "visual", "vision_encoder")


@dataclass
class TowerInputs:
    """The vision tower of a vision-language model and its inputs for a scan as an encoder: one sample per image,
    its positions labelled ``[CLS]`` / ``reg<i>`` (tokens before the patches) and ``patch<row>,<col>``."""

    tower: nn.Module
    batches: list[dict[str, Tensor]]
    tokens: list[list[str]]
    grid: tuple[int, int]


def vision_tower(model: nn.Module) -> nn.Module:
    """The module that turns a vision-language model's pixels into patch tokens (``vision_tower``, ``vision_model``,
    ``visual`` or ``vision_encoder`` of the model or of its inner ``model``); an :class:`InputError` for a model
    without a vision config (a text-only model)."""
    if _vision_config(model) is None:
        raise InputError(f"{type(model).__name__} has no vision tower (no vision_config in its config); give a "
                         "vision-language model, or scan a ViT-style encoder directly")
    for root in (model, getattr(model, "model", None)):
        for name in TOWER_NAMES:
            tower = getattr(root, name, None) if isinstance(root, nn.Module) else None
            if isinstance(tower, nn.Module):
                return tower
    raise UnsupportedModelError(f"{type(model).__name__}: no vision tower found (as {', '.join(TOWER_NAMES)}); "
                                "scan its vision encoder by itself as an encoder (sinklab.scan_inputs with "
                                "pixel_values)")


def _tower_pixels(model: nn.Module, images: Sequence[Any], processor: Any) -> Tensor:
    """``[N, 3, H, W]`` pixels of ``images``: the processor's image preprocessor, or a resize to the vision config's
    image size (a tiny random model)."""
    if processor is not None:
        preprocess = getattr(processor, "image_processor", processor)
        pixels = preprocess(images=list(images), return_tensors="pt")["pixel_values"]
    else:
        size = getattr(_vision_config(model), "image_size", None)
        size = size[0] if isinstance(size, (list, tuple)) else size
        if not isinstance(size, int):
            raise UnsupportedModelError(f"{type(model).__name__}: its vision config names no image_size; give its "
                                        "processor to size the pixels")
        pixels = torch.stack([_pixels(image, size) for image in images])
    if pixels.dim() != 4 or pixels.shape[1] != 3:
        raise UnsupportedModelError(
            f"{type(model).__name__}: its vision tower takes pixels shaped {tuple(pixels.shape)} (tiles, crops or "
            "flattened patches), not one [3, H, W] picture per image; scanning it as an encoder needs that tower's "
            "own patch layout")
    return pixels


def tower_inputs(model: nn.Module, images: Sequence[Any], processor: Any = None) -> TowerInputs:
    """The vision tower and one sample per image for :func:`sinklab.scan.scan_vision_tower`. Refused (one
    :class:`UnsupportedModelError` saying what would lift it) for a tower that does not take ``pixel_values`` as
    pictures (Qwen2-VL's flattened patches with their grid, tiled towers)."""
    if not images:
        raise InputError("no image to scan")
    tower = vision_tower(model)
    try:
        takes = set(inspect.signature(tower.forward).parameters)
    except (TypeError, ValueError):
        takes = set()
    if "pixel_values" not in takes:
        raise UnsupportedModelError(
            f"{type(model).__name__}: its vision tower ({type(tower).__name__}) takes {', '.join(sorted(takes)[:4])} "
            "rather than pixel_values (patches already flattened, with their grid); scanning it as an encoder needs "
            "that tower's own patch layout")
    pixels = _tower_pixels(model, images, processor)
    param = next(tower.parameters())
    pixels = pixels.to(device=param.device, dtype=param.dtype if param.is_floating_point() else pixels.dtype)
    patch = getattr(getattr(tower, "config", None) or _vision_config(model), "patch_size", None)
    patch = int(patch[0] if isinstance(patch, (list, tuple)) else patch or 1)
    grid = (pixels.shape[2] // patch, pixels.shape[3] // patch)
    with torch.no_grad():  # the token count: some towers put a class token or registers before the patches
        count = int(tower(pixel_values=pixels[:1]).last_hidden_state.shape[1])
    extra = count - grid[0] * grid[1]
    if extra < 0:
        raise UnsupportedModelError(f"{type(model).__name__}: its vision tower gives {count} tokens for a "
                                    f"{grid[0]} × {grid[1]} patch grid (pooled inside the tower); scanning it as an "
                                    "encoder needs the pooling's layout")
    head = (["[CLS]"] + [f"reg{i}" for i in range(extra - 1)]) if extra else []
    labels = head + [f"patch{r},{c}" for r in range(grid[0]) for c in range(grid[1])]
    return TowerInputs(tower, [{"pixel_values": pixels}], [list(labels) for _ in range(pixels.shape[0])], grid)
