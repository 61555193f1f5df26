"""Streams with images (sinklab.vision_stream): a vision-language model's prompt, image and all, through a
StreamSession; the image's tokens pinned; a video fed frame by frame under the video memory plan.

References: the model's own forward and ``generate()`` with the image (nothing evicted), and the float64 stream
reference (``sinklab.testing.reference``) over the kept tokens, fed the embeddings the model's own forward hands its
text decoder at the image positions (the projected vision features), token by token.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sinklab import vision_inputs
from sinklab.errors import UnsupportedModelError
from sinklab.stream import StreamSession
from sinklab.testing import vlm_conformance as vc
from sinklab.testing.reference import Reference
from sinklab.vision_stream import VideoMemory, check_vision_stream, feed_vision, image_pins, video_frames

pytestmark = pytest.mark.usefixtures("one_thread")

TEXT = vc.TEXT_IDS[:12]


@pytest.fixture(scope="module")
def models() -> dict:
    return {}


def built(models: dict, model_type: str):
    if model_type not in models:
        models[model_type] = vc.build(model_type).model
    return models[model_type]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def kept_indices(session) -> set[int]:
    state = session.state
    return set(state.s_sidx[0][state.s_valid[0]].tolist())


@pytest.mark.parametrize("model_type", ["llava", "gemma3"])
def test_prompt_with_image_matches_the_models_own_generate(models, model_type):
    """Nothing evicted: the streamed prompt's logits equal the model's forward with the image, and greedy decoding
    through the session equals ``generate()`` with the image."""
    model = built(models, model_type)
    inputs = vision_inputs.config_inputs(model, vc.test_image(), TEXT)
    batch = inputs.batches[0]
    with torch.no_grad():
        own = model(**batch).logits[0, -1]
        gen = model.generate(**batch, max_new_tokens=6, do_sample=False)[0, batch["input_ids"].shape[1]:]
    with StreamSession(model, num_sinks=2, window=256) as s:
        logits = feed_vision(s, inputs)
        assert _rel(logits[0], own) < 1e-5
        tokens = []
        for _ in range(6):
            tokens.append(int(logits.argmax(-1)))
            logits = s.step(torch.tensor(tokens[-1:]))
    assert tokens == gen.tolist()


@pytest.mark.parametrize("model_type", ["llava", "gemma3"])
def test_pinned_image_past_eviction_matches_the_float64_reference(models, model_type):
    """A window smaller than the text after the image, the image pinned: every logit against the float64 reference
    over the kept tokens, and the image's tokens kept at every step."""
    model = built(models, model_type)
    inputs = vision_inputs.config_inputs(model, vc.test_image(), TEXT)
    pins = image_pins(inputs)
    codes = inputs.modality[0][0]
    image = [p for p, c in enumerate(codes.tolist()) if c != vision_inputs.TEXT]
    assert [p for a, b in pins for p in range(a, b)] == image  # the image's tokens and its framing, nothing else
    sinks, window = 1, 5
    assert len(TEXT) > window
    ref = Reference(model, sinks, window, pins)
    expected = vc.reference_feed(ref, inputs, vc.decoder_embeds(model, inputs.batches[0]))
    rng = np.random.default_rng(3)
    with StreamSession(model, num_sinks=sinks, window=window, pinned=pins) as s:
        worst = _rel(feed_vision(s, inputs)[0], expected)
        assert set(image) <= kept_indices(s)
        for token in rng.integers(10, 60, size=8).tolist():
            worst = max(worst, _rel(s.step(torch.tensor([token]))[0], ref.step(token)))
            kept = kept_indices(s)
            assert set(image) <= kept and len(kept) == len(set(range(sinks)) | set(image)) + window
    assert worst < 1e-4, worst


def test_bidirectional_image_tokens_are_refused_or_streamed_causally(models):
    """Gemma 3 with token_type_ids (its processor's): image tokens attend both ways in its own prefill, which a causal
    stream would silently miss — refused; ``causal_images=True`` streams the image causally, equal to the model's own
    forward without them."""
    model = built(models, "gemma3")
    inputs = vision_inputs.config_inputs(model, vc.test_image(), TEXT)
    batch = inputs.batches[0]
    typed = vision_inputs.VisionInputs([{**batch, "token_type_ids": (inputs.modality[0] == vision_inputs.IMAGE).long()}],
                                       inputs.tokens, inputs.modality, inputs.grids)
    with torch.no_grad():
        bidirectional = model(**typed.batches[0]).logits[0, -1]
        causal = model(**batch).logits[0, -1]
    assert _rel(bidirectional, causal) > 1e-4  # the two attentions do differ on this model
    with StreamSession(model, num_sinks=2, window=256) as s:
        with pytest.raises(UnsupportedModelError, match="attend to each other both ways"):
            feed_vision(s, typed)
    with StreamSession(model, num_sinks=2, window=256) as s:
        assert _rel(feed_vision(s, typed, causal_images=True)[0], causal) < 1e-5


def test_image_pins_offset_and_framing(models):
    inputs = vision_inputs.config_inputs(built(models, "gemma3"), vc.test_image(), TEXT)
    framed, bare = image_pins(inputs, offset=7), image_pins(inputs, framing=False)
    assert framed[0][1] - framed[0][0] == bare[0][1] - bare[0][0] + 2  # begin and end of image
    assert framed[0][0] - 7 == bare[0][0] - 1


def test_multimodal_rotary_positions_the_model_lays_out_itself(models):
    """Qwen2-VL called with a SinkCache directly (no feed_vision): the model lays out the image's (time, height,
    width) positions itself and the stream takes them as given — the prompt's logits and the next steps equal the
    model's own forward with its default cache; text alone (every axis the same position) too."""
    from transformers import DynamicCache

    from sinklab.stream import SinkCache

    model = built(models, "qwen2_vl")
    check_vision_stream(model)  # no refusal: its layout comes from its own get_rope_index
    batch = vision_inputs.config_inputs(model, vc.test_image(), TEXT).batches[0]
    follow = torch.tensor([[30, 31]])
    with torch.no_grad():
        dense = DynamicCache(config=model.config)
        own = [model(**batch, cache=dense).logits[0, -1]]
        own += [model(input_ids=follow[:, i : i + 1], cache=dense).logits[0, -1] for i in range(2)]
        with SinkCache(model, num_sinks=2, window=64) as cache:
            ours = [model(**batch, cache=cache).logits[0, -1]]
            ours += [model(input_ids=follow[:, i : i + 1], cache=cache).logits[0, -1] for i in range(2)]
            assert int(cache.positions.offset[0]) == -12  # the text after the image: 12 positions before its index
    for a, b in zip(ours, own, strict=True):
        assert _rel(a, b) < 1e-5
    text = torch.tensor([TEXT])
    with torch.no_grad():
        own_text = model(input_ids=text).logits[0, -1]
        with SinkCache(model, num_sinks=2, window=64) as cache:
            assert _rel(model(input_ids=text, cache=cache).logits[0, -1], own_text) < 1e-5


def frame_kept(memory: VideoMemory, frames: int) -> set[int]:
    """After ``frames`` whole frames: the sinks, the prompt, the pinned frames and the newest unpinned frames,
    from the frame boundaries (independently of the ring's token window)."""
    p, f = memory.prompt_tokens, memory.frame_tokens
    keep = set(range(min(memory.num_sinks, p + frames * f))) | set(range(p))
    recent = [i for i in range(frames) if i not in memory.pinned_frames][-memory.recent_frames:]
    for i in [*memory.pinned_frames, *recent]:
        if i < frames:
            keep |= set(range(p + i * f, p + (i + 1) * f))
    return keep


def chunk_offsets(model, prompt: torch.Tensor, blocks) -> torch.Tensor | None:
    """An M-RoPE model's offsets for the float64 reference, recomputed from scratch for the prompt then every frame
    (:func:`sinklab.testing.vlm_conformance.frame_offsets`)."""
    return vc.frame_offsets(model, prompt.shape[1], [b.batches[0] for b in blocks])


@pytest.mark.parametrize("model_type", ["llava", "gemma3", "qwen2_vl"])
def test_video_memory_keeps_its_definition_and_matches_the_float64_reference(models, model_type):
    """A prompt, then frames fed one by one (each its pixels through the vision tower and a forward of its block of
    tokens through the stream): at every frame the kept set is the sinks + prompt + pinned first frame + the newest
    frames, and the logits equal the float64 reference over the kept tokens. Qwen2-VL (M-RoPE): each frame's
    (time, height, width) positions laid out from its own first slot, against offsets recomputed from scratch."""
    model = built(models, model_type)
    blocks = video_frames(model, [vc.video_frame(i) for i in range(7)], text_ids=[11, 12])
    prompt = torch.tensor([[20, 21, 22]])
    memory = VideoMemory(frame_tokens=int(blocks[0].batches[0]["input_ids"].shape[1]), recent_frames=2,
                         pinned_frames=(0,), num_sinks=2, prompt_tokens=3)
    offsets = chunk_offsets(model, prompt, blocks)
    assert (offsets is not None) == (model_type == "qwen2_vl")
    ref = Reference(model, memory.num_sinks, memory.config().window, memory.pinned(), offsets=offsets)
    embeds = [vc.decoder_embeds(model, block.batches[0]) for block in blocks]  # before the stream holds the model
    worst = 0.0
    with StreamSession(model, config=memory.config()) as s:
        ours = s.feed(prompt)[0]
        for t in prompt[0].tolist():
            expected = ref.step(t)
        worst = _rel(ours, expected)
        for i, block in enumerate(blocks):
            worst = max(worst, _rel(feed_vision(s, block)[0], vc.reference_feed(ref, block, embeds[i])))
            assert kept_indices(s) == frame_kept(memory, i + 1), i
        capacity = s.state.capacity
    assert capacity == 3 + memory.frame_tokens * 3 and s.tokens_seen == 3 + 7 * memory.frame_tokens
    assert worst < 1e-4, worst


def test_an_endless_multimodal_rotary_video_keeps_its_positions_bounded(models):
    """Qwen2-VL, 40 frames through a 2-frame memory with the first frame pinned and a re-base every 64 tokens: the
    positions the decoder rotates by stay within one re-base span and one frame of zero, every frame, and the last
    frame's logits equal the float64 reference fed the prompt, the pinned frame and the last (layers + 1) × 2 frames
    (a kept token's state at a layer depends on the window below it; offsets per chunk). Offsets carried over every frame would drift by each frame's compression, past any bound."""
    from sinklab import _compat
    from sinklab.vision_stream import stream_video

    model = built(models, "qwen2_vl")
    frames = 40
    span = (int(model.config.get_text_config().num_hidden_layers) + 1) * 2
    blocks = video_frames(model, [vc.video_frame(i) for i in (0, *range(frames - span, frames))], text_ids=[11, 12])
    feeds = [vc.decoder_embeds(model, block.batches[0]) for block in blocks]
    seen: list[torch.Tensor] = []
    rotary = _compat.language_model(model).rotary_emb
    handle = rotary.register_forward_pre_hook(lambda m, args: seen.append(args[1].detach().clone()))
    try:
        for step in stream_video(model, (vc.video_frame(i) for i in range(frames)), prompt_ids=[20, 21, 22],
                                 text_ids=[11, 12], num_sinks=2, recent_frames=2, rebase_every=64):
            last, memory = step[1][0].clone(), step[3]
    finally:
        handle.remove()
    positions = [p for p in seen if int(p.abs().max()) < 1000]  # (1000: the rotary probe's)
    bound = 64 + 2 * memory.frame_tokens
    assert max(int(p.abs().max()) for p in positions) <= bound, "the positions drifted with the stream"
    offsets = chunk_offsets(model, torch.tensor([[20, 21, 22]]), blocks)
    ref = Reference(model, memory.num_sinks, memory.config().window, memory.pinned(), offsets=offsets)
    for t in (20, 21, 22):
        ref.step(t)
    for block, feed in zip(blocks, feeds, strict=True):
        expected = vc.reference_feed(ref, block, feed)
    assert _rel(last, expected) < 1e-4


def test_frames_take_the_image_processors_pixels(models):
    """With the model's image processor, a frame's pixels are the processor's (its resizing and normalisation), in
    the layout whose tokens the config counted; a processor whose layout differs is refused."""
    from transformers import LlavaImageProcessorPil

    from sinklab.testing import tiny

    model = built(models, "llava")
    size = tiny.IMAGE_SIZE
    processor = LlavaImageProcessorPil(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
    frame = vc.video_frame(3)
    block = video_frames(model, [frame], [11], image_processor=processor)[0]
    expected = processor(images=[frame], return_tensors="pt")["pixel_values"]
    assert torch.equal(block.batches[0]["pixel_values"], expected)
    assert not torch.equal(video_frames(model, [frame], [11])[0].batches[0]["pixel_values"], expected)
    wrong = LlavaImageProcessorPil(size={"shortest_edge": 2 * size}, crop_size={"height": 2 * size, "width": 2 * size})
    with pytest.raises(UnsupportedModelError, match="image processor gives pixels"):
        video_frames(model, [frame], image_processor=wrong)


# ----------------------------------------------------------------------------- the command line
@pytest.fixture(scope="module")
def llava_folder(tmp_path_factory, models):
    """A tiny Llava saved with a tiny tokenizer, and a folder of procedurally drawn PNG frames."""
    import warnings

    from sinklab.testing import tiny

    folder = tmp_path_factory.mktemp("tiny-llava")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        built(models, "llava").save_pretrained(folder / "model")
    tiny.tiny_tokenizer().save_pretrained(folder / "model")
    (folder / "frames").mkdir()
    for i in range(3):
        vc.video_frame(i).save(folder / "frames" / f"frame{i:03d}.png")
    return folder


def _one_line(result) -> str:
    return " ".join(result.output.split())


def test_cli_streams_frames_endlessly(llava_folder):
    from typer.testing import CliRunner

    from sinklab.cli import app

    result = CliRunner().invoke(app, ["stream", str(llava_folder / "model"), "--video", str(llava_folder / "frames"),
                                      "--prompt", "what moves", "--recent-frames", "2", "--sinks", "2", "--loop",
                                      "--max-frames", "7", "--max-new-tokens", "3"])
    assert result.exit_code == 0, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("frame ")]
    assert [line.split(":")[0] for line in lines] == [f"frame {i}" for i in range(7)]
    sizes = [line.split("cache ")[1].split(" ")[0] for line in lines]
    assert sizes[-1] == sizes[-2] == sizes[-3]  # constant memory once the recent frames are full


def test_cli_video_errors(llava_folder, tmp_path):
    from typer.testing import CliRunner

    from sinklab.cli import app

    runner = CliRunner()
    empty = tmp_path / "empty"
    empty.mkdir()
    result = runner.invoke(app, ["stream", str(llava_folder / "model"), "--video", str(empty)])
    assert result.exit_code == 2 and "no frames in" in _one_line(result) and "Traceback" not in result.output
    bad = tmp_path / "broken.png"
    bad.write_text("not a picture")
    result = runner.invoke(app, ["stream", str(llava_folder / "model"), "--video", str(bad)])
    assert result.exit_code == 2 and "cannot read image" in _one_line(result) and "Traceback" not in result.output
    result = runner.invoke(app, ["stream", str(llava_folder / "model"), "--video", str(bad), "--window", "8"])
    assert result.exit_code == 2 and "--window: not with --video" in _one_line(result)
    result = runner.invoke(app, ["stream", "builtin:tiny-llama", "--video", str(llava_folder / "frames")])
    assert result.exit_code == 2 and "has no vision tower" in _one_line(result), result.output
