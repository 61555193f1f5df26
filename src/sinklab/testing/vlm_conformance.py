"""The vision-language conformance sweep: every image-text-to-text model type transformers registers, built as a tiny
random model from its own default config, scanned on one procedurally drawn image and a short text, and checked
against the model's own eager attention weights.

One row per type (:func:`run_row`): ``not built`` (the tiny model could not be built or run at all: not sinklab's
doing), or the causal-LM matrix's cells with an image — the scan (``ok``: the language model's attention maps match
``output_attentions=True`` of an eager twin on every layer that returns weights, and the modality statistics match a
float64 loop over those weights), then :data:`CELLS` (stream, past eviction, diagnose, circuit) — each ``ok``,
``wrong``, ``crash``, ``refused`` (sinklab's own refusal, with what would lift it) or ``n/a``.
``benchmarks/vlm_architectures.py`` writes the JSON and the vision-language section of ``docs/architectures.md``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
import inspect
import json
import math
import warnings
from typing import Any

import numpy as np
import torch
import transformers
from torch import Tensor, nn

from .. import _compat, vision_inputs
from ..scan import ScanResult, scan_images
from . import tiny
from .conformance import Cell, NotApplicable, finite_json, reference, run_cell

__all__ = ["all_types", "build", "OVERRIDES", "TOKEN_OVERRIDES", "test_image", "video_frame", "DecoderFeed", "decoder_embeds", "reference_feed", "frame_offsets", "cell_scan", "run_row", "modality_reference", "TEXT_IDS",
           "TOLERANCE", "STATUSES"]

STATUSES = ("ok", "wrong", "crash", "refused", "n/a", "not built")
TOLERANCE = 1e-4
TEXT_IDS = list(range(10, 42))  # the text after the image: inside the tiny vocabulary, clear of its image ids
IMAGE_PIXELS = (40, 48)  # the drawn image's height and width (resized to each vision config)

#: Per-type config fields on top of the generic shrink, each with why: sizes the generic rules cannot derive.
_ONE_TILE = {"image_grid_pinpoints": [[tiny.IMAGE_SIZE, tiny.IMAGE_SIZE]]}  # any-resolution tiling: one tile
OVERRIDES: dict[str, dict[str, Any]] = {
    "gemma3": {"mm_tokens_per_image": 4},  # pooled tokens per image: a square that divides the tiny patch grid
    "gemma3n": {"vision_soft_tokens_per_image": 4},
    "shieldgemma2": {"mm_tokens_per_image": 4},
    "llava_next": _ONE_TILE, "llava_next_video": _ONE_TILE, "llava_onevision": _ONE_TILE,
    "vipllava": {"vision_feature_layers": [-2, -1]},  # the vision layers it concatenates: of the tiny tower's two
    "mllama": {"text_config": {"cross_attention_layers": [1]}},  # keep a cross-attention layer (the refusal's cause)
    # the projector's table of patch counts → query tokens: the tiny 4 × 4 patch grid (its default knows 35² and 70²)
    "aria": {"projector_patch_to_query_dict": {(tiny.IMAGE_SIZE // tiny.PATCH) ** 2: 4}},
    # the projector's norm runs over the vision tower's width (its default, 1152, is the full tower's)
    "kimi_k25": {"projection_hidden_size": tiny.WIDTH},
    # the decoder builds its sliding-window mask whatever its layer types, and the default leaves the window unset
    "step3p7": {"text_config": {"sliding_window": tiny.OWN_WINDOW}},
    # one attention layer beside the linear one: the default pattern (three linear layers, then one attention
    # layer) cut to two layers has none, and the model's own forward then fails. That layer's QSA indexer needs its
    # sizes (its default names none): small ones, a budget of 16 tokens under the sequence's 50, so the selection
    # (the model hands it to eager and SDPA in the mask) drops keys
    "qwen4_exp": {"text_config": {"layer_types": ["linear_attention", "indexed_attention"], "indexer_n_heads": 2,
                                  "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 16,
                                  "indexer_compress_ratio": 4}},
    # its own multimodal rotary split (22, 22, 20: height and width equal, the one it assumes when none is named)
    # scaled to the tiny head; the generic default (Qwen2-VL's 16, 24, 24) gives height and width unequal halves
    "ernie4_5_vl_moe": {"text_config": {"rope_parameters": {"rope_theta": 500000.0, "rope_type": "default",
                                                            "mrope_section": [3, 3, 2]}}},
    # the pooling kernel that divides the tiny 4 × 4 patch grid (its default, 3, needs a multiple of 3 patches a side)
    "gemma4": {"vision_config": {"pooling_kernel_size": 2}},
}

#: Multimodal token fields the type's default config leaves unset while its checkpoints set them: each gets a free row
#: of the tiny vocabulary, like the ids the default names. The image token (the placeholder the processor writes
#: where the vision features go, as for Llava; InstructBLIP-Video's video token): without it BLIP-2 / InstructBLIP
#: (-Video) cannot place their query tokens and
#: MiniCPM-V drops the image. Qwen2.5-Omni's thinker finds each image by its vision-start token when it lays out
#: its (time, height, width) positions, a field its default config lacks.
TOKEN_OVERRIDES: dict[str, tuple[str, ...]] = {
    "blip-2": ("image_token_index",), "instructblip": ("image_token_index",),
    "instructblipvideo": ("video_token_index",),
    "minicpm_ocr": ("image_token_id",), "minicpmv4_6": ("image_token_id",), "minicpmv4_7": ("image_token_id",),
    "qwen2_5_omni_thinker": ("vision_start_token_id", "vision_end_token_id"),
}


def all_types() -> list[str]:
    """Every image-text-to-text model type of this transformers (``MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES``)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return sorted(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)


def _model_class(model_type: str) -> Any:
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    name = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES[model_type]
    name = str(name[0] if isinstance(name, (tuple, list)) else name)
    cls = getattr(transformers, name, None)
    if cls is None:
        raise tiny.NotBuilt(f"transformers has no class {name}")
    return cls


def _token_ids(d: dict, out: dict, taken: list[tuple[int, int]]) -> None:
    """Multimodal token ids of ``d`` (a config dict) moved into the tiny vocabulary's top rows, one row each."""
    for key in sorted(d):
        value = d[key]
        if (not key.startswith("_") and key.endswith(("_token_id", "_token_index")) and key not in tiny.TOKEN_KEEP
                and tiny.is_int(value)):
            if value not in {v for v, _ in taken}:
                taken.append((value, tiny.VOCAB - 1 - len(taken)))
            out[key] = dict(taken)[value]


def _vision_sizes(d: dict) -> dict:
    """Vision-tower fields the generic shrink leaves: depth, window and full-attention blocks of windowed towers."""
    out: dict = {}
    for key, tiny_value in (("image_size", tiny.IMAGE_SIZE), ("patch_size", tiny.PATCH)):
        if isinstance(d.get(key), list) and len(d[key]) == 2:  # (height, width)
            out[key] = [tiny_value, tiny_value]
    if tiny.is_int(d.get("depth")):
        out["depth"] = tiny.LAYERS
    if tiny.is_int(d.get("window_size")) and tiny.is_int(d.get("spatial_merge_size")):
        out["window_size"] = tiny.PATCH * d["spatial_merge_size"] * 2
    if tiny.is_int(d.get("out_hidden_size")):
        out["out_hidden_size"] = tiny.WIDTH  # the projector's output: the text model's width
    if isinstance(d.get("fullatt_block_indexes"), list):
        out["fullatt_block_indexes"] = [tiny.LAYERS - 1]
    if isinstance(d.get("deepstack_visual_indexes"), list):
        out["deepstack_visual_indexes"] = [0]
    return out


#: The multimodal rotary split (time, height, width) Qwen2-VL's family uses when its config names none.
MROPE_DEFAULT = [16, 24, 24]


def _rope_sections(d: dict, multimodal: bool = False) -> dict:
    """A multimodal rotary split (``mrope_section``, halves of the head width by axis) scaled to the tiny width;
    ``multimodal``: the model rotates by (time, height, width) even where the config names no split."""
    rope = d.get("rope_parameters") or d.get("rope_scaling")
    if not isinstance(rope, dict):
        return {}
    sections = rope.get("mrope_section") or (MROPE_DEFAULT if multimodal else None)
    if not isinstance(sections, list):
        return {}
    rotated = tiny.FIXED["qk_rope_head_dim"] if tiny.is_int(d.get("qk_rope_head_dim")) else tiny.HEAD_DIM
    rotated = int(rotated * float(rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)) or 1.0))
    half, total = rotated // 2, sum(sections)
    scaled = [max(1, s * half // total) for s in sections]
    scaled[0] += half - sum(scaled)
    key = "rope_parameters" if d.get("rope_parameters") else "rope_scaling"
    return {key: {**rope, "mrope_section": scaled}}


def _shrunk(d: dict, lists: bool, subs: str) -> dict:
    overrides = tiny.shrink(d, tiny.LAYERS, tiny.OWN_WINDOW, lists=lists, subs=subs)
    taken: list[tuple[int, int]] = []
    _token_ids(d, overrides, taken)
    vision = d.get("vision_config") or {}
    multimodal = tiny.is_int(vision.get("temporal_patch_size")) or tiny.is_int(vision.get("spatial_merge_size"))
    for key, value in d.items():
        if isinstance(value, dict) and key.endswith("_config"):
            sub = overrides.get(key, {} if subs == "overrides" else dict(value))
            sub = {**sub, **_vision_sizes(value), **_rope_sections(value, multimodal and key == "text_config")}
            inner: dict = {}
            _token_ids(value, inner, taken)
            sub.update(inner)
            if sub:
                overrides[key] = sub
    overrides.update(_rope_sections(d))
    return overrides


def test_image() -> Any:
    """A procedurally drawn RGB image (PIL): diagonal colour bands and a bright square, the same every run."""
    from PIL import Image

    rows, cols = np.indices(IMAGE_PIXELS)
    array = np.stack([(rows * 5 + cols * 3) % 256, (rows * 2 + cols * 7) % 256, (rows * cols) % 256], -1)
    array[8:20, 10:24] = 255
    return Image.fromarray(array.astype(np.uint8))


def video_frame(index: int) -> Any:
    """Frame ``index`` of a procedurally drawn video (PIL): colour bands that drift and a bright square that moves."""
    from PIL import Image

    rows, cols = np.indices((32, 32))
    array = np.stack([(rows * 5 + cols * 3 + 9 * index) % 256, (rows * 2 + cols * 7 + 5 * index) % 256,
                      (rows * cols + 3 * index) % 256], -1)
    corner = (2 * index) % 20
    array[corner : corner + 8, corner : corner + 8] = 255
    return Image.fromarray(array.astype(np.uint8))


@dataclass(frozen=True)
class DecoderFeed:
    """What the model's own forward hands its text decoder: the input embeddings ``[T, D]`` (the projected vision
    features at the image positions) and, for a model that adds vision features inside its first layers (Qwen3-VL's
    deepstack), each visual position's per-layer additions."""

    embeds: Tensor
    deepstack: dict[int, list[Tensor]]
    #: Positions whose decoder input is not their token's embedding (image tokens; Ovis 2.5's image markers too).
    replaced: frozenset[int] = frozenset()


def decoder_embeds(model: nn.Module, batch: dict) -> DecoderFeed:
    """:class:`DecoderFeed` of the model's own forward on ``batch``, read by a pre-hook on the decoder; run it
    outside any stream on the model."""
    seen: dict[str, Any] = {}

    def grab(module: nn.Module, args: tuple, kwargs: dict) -> None:
        seen["x"] = kwargs["inputs_embeds"][0].detach().clone()
        masks, stack = kwargs.get("visual_pos_masks"), kwargs.get("deepstack_visual_embeds")
        if masks is not None and stack:
            where = masks[0].nonzero().flatten().tolist()
            seen["deep"] = {p: [layer[k].detach().clone() for layer in stack] for k, p in enumerate(where)}

    handle = _compat.language_model(model).register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.no_grad():
            model(**batch)
    finally:
        handle.remove()
    table: Any = model.get_input_embeddings()  # type: ignore[operator]
    with torch.no_grad():
        own = table(batch["input_ids"][0].clamp(0, table.num_embeddings - 1))
    differs = (seen["x"] - own.to(seen["x"].dtype)).abs().amax(-1) > 1e-6 * own.abs().max()
    return DecoderFeed(seen["x"], seen.get("deep", {}), frozenset(differs.nonzero().flatten().tolist()))


def reference_feed(ref: Any, inputs: vision_inputs.VisionInputs, feed: DecoderFeed) -> Tensor:
    """Feed ``inputs``' first sample token by token into the float64 stream reference (``testing.reference``): the
    image positions (and any other the model's forward replaced) as ``feed``'s embeddings (:func:`decoder_embeds`),
    the rest as ids; the logits after its last token."""
    batch = inputs.batches[0]
    codes, ids = inputs.modality[0][0], batch["input_ids"][0]
    out: Any = None
    for p in range(ids.shape[0]):
        if int(codes[p]) == vision_inputs.IMAGE or p in feed.replaced:
            out = ref.step_embeds(feed.embeds[p], deepstack=feed.deepstack.get(p))
        else:
            out = ref.step(int(ids[p]))
    return out


def build(model_type: str) -> tiny.Built:
    """A tiny random model of image-text-to-text type ``model_type`` (float32, eval, seeded): its default config
    with text and vision sizes shrunk (:func:`sinklab.testing.tiny.shrink`, the vision tower's depth and window, the
    rotary sections), multimodal token ids moved into the tiny vocabulary, :data:`OVERRIDES`; SDPA, else eager
    attention; the first variant that scans the test image's pixels through the vision tower wins."""
    cls = _model_class(model_type)
    try:
        cfg0 = tiny.default_config(model_type)
    except Exception as exc:  # noqa: BLE001 - the type's own defaults are unusable
        raise tiny.NotBuilt(f"its default config fails: {tiny.short_error(exc)}") from None
    d = cfg0.to_dict()
    for i, key in enumerate(TOKEN_OVERRIDES.get(model_type, ())):  # an id outside any vocabulary, moved below
        if d.get(key) is None:
            d[key] = 10**9 + i
    vision_class = (getattr(cfg0, "sub_configs", None) or {}).get("vision_config")
    if d.get("vision_config") is None and isinstance(vision_class, type):  # a default without its vision tower
        try:
            d["vision_config"] = vision_class().to_dict()
        except Exception:  # noqa: BLE001 - no default vision config: the model is built without one
            pass
    errors: list[str] = []
    fallback: tiny.Built | None = None  # the first model that instantiates, should none run on sinklab's inputs
    for attempt, lists, subs in tiny.ATTEMPTS:
        overrides = _shrunk(d, lists, subs)
        for key, value in OVERRIDES.get(model_type, {}).items():  # a sub-config's fields merge into it
            overrides[key] = {**overrides.get(key, {}), **value} if isinstance(value, dict) else value
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                config = type(cfg0)(**overrides)
            size = tiny.parameter_count(cls, config)
        except Exception as exc:  # noqa: BLE001
            errors.append(f"config: {tiny.short_error(exc)}")
            continue
        if size > tiny.MAX_PARAMETERS:
            errors.append(f"still {size / 1e6:.1f} M parameters after shrinking")
            continue
        for attn in ("sdpa", "eager"):
            try:
                model = tiny.instantiate(cls, copy.deepcopy(config), attn)
            except Exception as exc:  # noqa: BLE001
                errors.append(f"{attn} model: {tiny.short_error(exc)}")
                continue
            built = tiny.Built(model_type, model_type, "vision-language", model, attn, attempt, overrides)
            fallback = fallback or built
            try:  # the first variant that also runs on the inputs sinklab builds from the config wins
                inputs = vision_inputs.config_inputs(model, test_image(), TEXT_IDS)
                with torch.no_grad(), warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    _compat.base_model(model)(**inputs.batches[0])
            except Exception:  # noqa: BLE001 - the cell says why (refused, or the model's own forward fails)
                continue
            return built
    if fallback is not None:
        return fallback
    telling = [e for e in errors if "does not support an attention implementation" not in e]
    raise tiny.NotBuilt((telling or errors or ["no attempt built it"])[0])


def _eager_twin(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with eager attention everywhere (``output_attentions`` needs it)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cls: Any = type(model)
        twin = cls._from_config(copy.deepcopy(model.config), attn_implementation="eager", dtype=torch.float32)
    twin.load_state_dict(model.state_dict())
    return twin.eval()


def language_attentions(model: nn.Module, batch: dict[str, Tensor], layers: int) -> list[Tensor]:
    """The language model's ``[B, H, T, T]`` eager attention weights of ``batch``, one per decoder layer (the model's
    output may hold the vision tower's weights too: the last ``layers`` of matching length are the decoder's)."""
    twin = _eager_twin(model)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = _compat.base_model(twin)(**batch, output_attentions=True)
    t = batch["input_ids"].shape[-1]
    found = getattr(out, "attentions", None)
    if found is None:  # BLIP-2 / InstructBLIP: the decoder's own output, beside the vision and Q-Former outputs
        found = getattr(getattr(out, "language_model_outputs", None), "attentions", None)
    weights = [w for w in (found or ()) if isinstance(w, Tensor) and w.dim() == 4
               and w.shape[-1] == t and w.shape[-2] == t]
    return weights[-layers:] if len(weights) >= layers else []


def modality_reference(weights: list[Tensor], codes: Tensor, eps: float) -> dict[str, Tensor]:
    """Float64 loop over eager weights ``[1, H, T, T]`` per layer of one sample with ``codes`` ``[T]``: per layer and
    head the text and image sink strength (largest column mass over the eligible keys of the modality: keys seen by
    at least max(8, ⌈T/8⌉) queries), and the share of the text queries' attention to the image that lands on image
    keys whose column mass reaches ``eps``. Written as loops on purpose: independent of the library's tensor code."""
    t = int(codes.shape[0])
    need = max(8, math.ceil(t / 8))
    out = {name: torch.full((len(weights), weights[0].shape[1]), math.nan, dtype=torch.float64)
           for name in ("text", "image", "share")}
    for layer, w in enumerate(weights):
        a = w[0].double()
        for head in range(a.shape[0]):
            mass, seen = [], []
            for k in range(t):
                rows = [q for q in range(t) if a[head, q, k] > 0]  # the queries that see key k (masked: exactly 0)
                seen.append(len(rows))
                mass.append(sum(float(a[head, q, k]) for q in rows) / len(rows) if rows else math.nan)
            cap = min(need, max(seen))
            eligible = [seen[k] >= cap and seen[k] > 0 for k in range(t)]
            for name, code in (("text", vision_inputs.TEXT), ("image", vision_inputs.IMAGE)):
                values = [mass[k] for k in range(t) if eligible[k] and int(codes[k]) == code]
                if values:
                    out[name][layer, head] = max(values)
            total = on_sinks = 0.0
            for k in range(t):
                if int(codes[k]) != vision_inputs.IMAGE:
                    continue
                given = sum(float(a[head, q, k]) for q in range(t) if int(codes[q]) == vision_inputs.TEXT)
                total += given
                if eligible[k] and mass[k] >= eps:
                    on_sinks += given
            if total > 0:
                out["share"][layer, head] = on_sinks / total
    return out


def compare(result: ScanResult, weights: list[Tensor], codes: Tensor,
            layers: list[int] | None = None) -> tuple[float, float]:
    """(worst attention-map difference, worst modality-statistic difference) of sample 0 against ``weights``, the
    eager weights of decoder ``layers`` (default: every layer; a hybrid's attention layers)."""
    assert result.attention_maps is not None
    layers = list(range(len(weights))) if layers is None else layers
    maps = result.attention_maps.double()
    m = maps.shape[-1]
    worst_map = max(float((maps[i] - w[0, :, :m, :m].double()).abs().max()) for i, w in zip(layers, weights))
    ref = modality_reference(weights, codes, result.meta["thresholds"]["eps"])
    ours = {"text": result.modality_sink_strength("text")[0][layers],
            "image": result.modality_sink_strength("image")[0][layers], "share": result.visual_sink_share()[0][layers]}
    worst_stat = 0.0
    for name, value in ours.items():
        a, b = value.double(), ref[name]
        if not torch.equal(torch.isnan(a), torch.isnan(b)):
            return worst_map, math.inf
        both = ~torch.isnan(a)
        if bool(both.any()):
            worst_stat = max(worst_stat, float((a[both] - b[both]).abs().max()))
    return worst_map, worst_stat


def cell_scan(built: tiny.Built) -> Cell:
    """Scan the test image and :data:`TEXT_IDS`; compare every decoder layer's map (the whole sequence) and the
    modality statistics with the eager twin's weights (max abs difference ≤ :data:`TOLERANCE`)."""
    model = built.model
    vision_inputs.check_vision_model(model, "an image")
    batch = vision_inputs.config_inputs(model, test_image(), TEXT_IDS)  # refused: what sinklab cannot build
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference("the model's own forward on these inputs", lambda: _compat.base_model(model)(**batch.batches[0]))
    result = scan_images(model, [test_image()], text_ids=TEXT_IDS, map_len=4096)
    attn = result.attention_layers  # a hybrid's layers without attention have no weights (marked as such)
    weights = reference("eager output_attentions", lambda: language_attentions(model, batch.batches[0], len(attn)))
    if len(weights) != len(attn):
        raise NotApplicable(f"the eager model returns {len(weights)} decoder attention maps for {len(attn)} "
                            "attention layers")
    worst_map, worst_stat = compare(result, weights, batch.modality[0][0], attn)
    counts = result.modality_summary()["positions"]
    others = result.num_layers - len(attn)
    msg = (f"{len(attn)} decoder attention layers{f' (+{others} recurrent, marked as such)' if others else ''}, "
           f"{counts['image']} image + {counts['image-special']} framing + {counts['text']} "
           f"text tokens: maps vs eager output_attentions max abs diff {worst_map:.1e}, modality statistics vs "
           f"float64 loop {worst_stat:.1e}")
    return Cell("ok" if max(worst_map, worst_stat) <= TOLERANCE else "wrong", msg)


#: The stream cells' window past eviction: smaller than the text after the image, so text is evicted while the
#: pinned image stays.
EVICT_SINKS, EVICT_WINDOW, EVICT_STEPS = 1, 5, 6


def _rel(a: Tensor, b: Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def cell_stream(built: tiny.Built) -> Cell:
    """The prompt, image and all, through a ``StreamSession`` (nothing evicted) against the model's own forward with
    the image (last logits within :data:`TOLERANCE` relative) and its own ``generate()`` (the same 4 greedy tokens)."""
    from ..stream import StreamSession
    from ..vision_stream import check_vision_stream, feed_vision

    model = built.model
    check_vision_stream(model)
    inputs = vision_inputs.config_inputs(model, test_image(), TEXT_IDS[:12])
    batch = inputs.batches[0]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        own = reference("the model's own forward", lambda: model(**batch).logits[0, -1])
        named = set(inspect.signature(model.forward).parameters)  # generate() refuses inputs forward does not name
        generate: Any = model.generate
        gen = reference("the model's own generate", lambda: generate(
            **{k: v for k, v in batch.items() if k in named}, max_new_tokens=4, do_sample=False, eos_token_id=None,
            pad_token_id=0))
    want = gen[0, batch["input_ids"].shape[1]:].tolist()
    with StreamSession(model, num_sinks=2, window=256) as session:
        logits = feed_vision(session, inputs)
        error, tokens = _rel(logits[0], own), []
        for _ in range(4):
            tokens.append(int(logits[0].argmax()))
            logits = session.step(torch.tensor(tokens[-1:]))
    same = tokens == want
    msg = f"prompt logits vs the model's forward {error:.1e}; 4 greedy tokens {'equal' if same else 'differ'}"
    return Cell("ok" if error <= TOLERANCE and same else "wrong", msg + " to generate() with the image")


def native_offsets(model: nn.Module, batch: dict, steps: int) -> Tensor | None:
    """A multimodal rotary model's (M-RoPE) offsets ``(axes, T + steps)`` for the float64 reference: each prompt
    token's position in the model's own layout of the whole prompt minus its index, then ``steps`` text tokens
    counted on from the prompt's largest position; ``None`` for one position per token."""
    from ..vision_stream import native_positions

    native = native_positions(model, batch)
    if native is None:
        return None
    native = native[:, 0]
    t = native.shape[1]
    following = (native.max() + 1 - t).expand(native.shape[0], steps)
    return torch.cat([native - torch.arange(t), following], 1)


def frame_offsets(model: nn.Module, prompt_tokens: int, batches: list[dict]) -> Tensor | None:
    """A multimodal rotary model's offsets ``(axes, T)`` for the float64 reference over a text prompt of
    ``prompt_tokens`` then the chunks ``batches`` (video frames), each laid out from its own first slot as
    :func:`sinklab.vision_stream.feed_vision` lays it out: the prompt's text none, each chunk's tokens their position
    in the model's own layout of that chunk alone minus their index in it; ``None`` for one position per token."""
    from ..vision_stream import native_positions

    rows = []
    for batch in batches:
        positions = native_positions(model, batch)
        if positions is None:
            return None
        rows.append(positions[:, 0] - torch.arange(positions.shape[-1]))
    return torch.cat([torch.zeros(rows[0].shape[0], prompt_tokens, dtype=torch.long), *rows], 1)


def cell_stream_evicted(built: tiny.Built) -> Cell:
    """The image pinned, a window smaller than the text after it: the prompt's and :data:`EVICT_STEPS` decoded
    tokens' logits against the float64 stream reference over the kept tokens (fed the decoder's own image
    embeddings), and the image kept at every step."""
    from ..stream import SinkCache, StreamSession
    from ..vision_stream import check_vision_stream, feed_vision, image_pins
    from .reference import Reference

    model = built.model
    check_vision_stream(model)
    inputs = vision_inputs.config_inputs(model, test_image(), TEXT_IDS[:12])
    pins = image_pins(inputs)
    SinkCache(model, num_sinks=EVICT_SINKS, window=EVICT_WINDOW, pinned=pins).close()  # a refusal comes first
    image = {p for a, b in pins for p in range(a, b)}
    embeds = reference("the model's own forward", lambda: decoder_embeds(model, inputs.batches[0]))
    steps = TEXT_IDS[12:12 + EVICT_STEPS]

    offsets = native_offsets(model, inputs.batches[0], EVICT_STEPS)

    def teacher_forced() -> list[Tensor]:
        ref = Reference(model, EVICT_SINKS, EVICT_WINDOW, pins, offsets=offsets)
        return [reference_feed(ref, inputs, embeds)] + [ref.step(token) for token in steps]

    expected = reference("the float64 stream reference", teacher_forced)
    worst, lost = 0.0, 0
    with StreamSession(model, num_sinks=EVICT_SINKS, window=EVICT_WINDOW, pinned=pins) as session:
        worst = _rel(feed_vision(session, inputs)[0], expected[0])
        for token, want in zip(steps, expected[1:], strict=True):
            worst = max(worst, _rel(session.step(torch.tensor([token]))[0], want))
            state = session.state
            lost += len(image - set(state.s_sidx[0][state.s_valid[0]].tolist()))
    msg = (f"{len(image)} image tokens pinned, window {EVICT_WINDOW}, {EVICT_STEPS} steps past eviction: logits vs the "
           f"float64 reference {worst:.1e}{'' if not lost else f', {lost} image tokens lost'}")
    return Cell("ok" if worst <= TOLERANCE and not lost else "wrong", msg)


def cell_diagnose(built: tiny.Built) -> Cell:
    """``sinklab.diagnose.diagnose_images`` on the test image and text, one edited layer: it serialises, its causal
    edits are finite and its scan is split by modality (as the causal-LM matrix's diagnose cell, with the image)."""
    from ..diagnose import diagnose_images

    d = diagnose_images(built.model, [test_image()], text_ids=TEXT_IDS[:12], edit_layers=1)
    data = json.loads(json.dumps(d.to_json()))
    if not finite_json(data["edits"]):
        return Cell("wrong", "non-finite causal-edit results")
    if d.scan.modality is None:
        return Cell("wrong", "the diagnosis's scan is not split by modality")
    images = int((d.scan.modality[0] == vision_inputs.IMAGE).sum())
    return Cell("ok", f"{len(d.records)} sinks, {len(d.edits)} edited heads, {images} image tokens")


def cell_circuit(built: tiny.Built) -> Cell:
    """``sinklab.circuit.circuit_images`` on the test image: the three first-token conditions and the causal
    patches, every forward with the pixels; it serialises."""
    from ..circuit import circuit_images

    r = circuit_images(built.model, [test_image()], text_ids=TEXT_IDS[1:12], bos_id=TEXT_IDS[0])
    json.dumps(r.to_json())
    return Cell("ok", "")


#: The cells after the scan, as in the causal-LM matrix: (row key, cell).
CELLS = (("stream", cell_stream), ("stream_evicted", cell_stream_evicted), ("diagnose", cell_diagnose),
         ("circuit", cell_circuit))


def run_row(model_type: str, stream: bool = True) -> dict:
    """One row: how the tiny model was built (or why not), the scan cell and (``stream``) the cells after it
    (:data:`CELLS`: the stream, past eviction, diagnose and circuit)."""
    try:
        built = build(model_type)
    except tiny.NotBuilt as exc:
        return {"type": model_type, "status": "not built", "detail": str(exc)}
    except Exception as exc:  # noqa: BLE001 - building is transformers' code; any failure means not built
        return {"type": model_type, "status": "not built", "detail": tiny.short_error(exc)}
    cell = run_cell(lambda: cell_scan(built))
    params = sum(p.numel() for p in built.model.parameters())
    row = {"type": model_type, "class": type(built.model).__name__, "status": cell.status, "detail": cell.message,
           "attn": built.attn, "attempt": built.attempt, "parameters": params, "seconds": cell.seconds}
    if stream:
        for name, fn in CELLS:
            got = run_cell(lambda fn=fn: fn(built))  # type: ignore[misc]
            row[name] = {"status": got.status, "detail": got.message}
    return row
