"""Vision-language models: the scan with images, every statistic split by modality.

The tiny models are built from their types' own default configs, shrunk (:mod:`sinklab.testing.vlm_conformance`);
the reference is a float64 loop over the model's own eager attention weights (``output_attentions=True``) of its
language model's layers. The image is drawn procedurally (no files, nothing downloaded).
"""

from __future__ import annotations

import inspect
import json
import math
import warnings
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from sinklab import _compat, metrics, vision_inputs
from sinklab.capture import AttentionCapture
from sinklab.cli import app
from sinklab.errors import InputError
from sinklab.scan import scan_images
from sinklab.testing import tiny
from sinklab.testing import vlm_conformance as vc
from sinklab.testing.conformance import CELLS

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore::sinklab.scan.ShortSequenceWarning")]  # one short sample

runner = CliRunner()


@pytest.fixture(scope="module")
def models() -> dict:
    return {}


def built(models: dict, model_type: str):
    if model_type not in models:
        models[model_type] = vc.build(model_type)
    return models[model_type]


@pytest.mark.parametrize("model_type", ["llava", "qwen2_vl", "gemma3"])
def test_modality_statistics_match_a_float64_loop(models, model_type):
    """Maps of every decoder layer, text/image sink strength and the share of text→image attention on visual sink
    tokens, against a float64 loop over the eager twin's weights; at an ε low enough that image tokens do sink."""
    model = built(models, model_type).model
    inputs = vision_inputs.config_inputs(model, vc.test_image(), vc.TEXT_IDS)
    eps = 0.05
    result = scan_images(model, [vc.test_image()], text_ids=vc.TEXT_IDS, map_len=4096, thresholds={"eps": eps})
    layers = result.num_layers
    assert layers == tiny.LAYERS  # the text decoder's layers, not the vision tower's
    weights = vc.language_attentions(model, inputs.batches[0], layers)
    assert len(weights) == layers
    worst_map, worst_stat = vc.compare(result, weights, inputs.modality[0][0])
    assert worst_map <= 1e-5 and worst_stat <= 1e-6, (worst_map, worst_stat)
    ref = vc.modality_reference(weights, inputs.modality[0][0], eps)
    share = result.visual_sink_share()[0]
    assert bool(torch.isfinite(share).all()) and bool((share > 0).any())  # some text→image attention on sinks
    rate = result.modality_sink_rate("image")
    assert torch.allclose(rate, 100.0 * (ref["image"] >= eps).double().mean(-1))
    codes = inputs.modality[0][0]
    n_image = int((codes == vision_inputs.IMAGE).sum())
    summary = result.to_json()["modality"]
    assert summary["positions"]["image"] == n_image and summary["positions"]["text"] == len(vc.TEXT_IDS)
    for sink in summary["top_sinks"]:
        code = int(codes[sink["position"]])
        assert sink["modality"] == vision_inputs.MODALITIES[code]
        assert (sink["patch"] is not None) == (code == vision_inputs.IMAGE)


def test_top_sinks_name_the_patch_row_and_column(models):
    """Llava's 16 image tokens form a 4 × 4 grid: patch i is row i // 4, column i % 4."""
    model = built(models, "llava").model
    result = scan_images(model, [vc.test_image()], text_ids=vc.TEXT_IDS)
    assert result.meta["image_grids"] == [[[4, 4]]]
    spans = vision_inputs.image_spans(result.modality[0], [(4, 4)])
    first = spans[0].positions[0]
    assert vision_inputs.patch_label(spans, first + 6) == "image 0 patch 6 (row 1, col 2)"
    assert vision_inputs.patch_label(spans, first - 1) is None


def test_image_sink_figure_places_the_patch_grid(models):
    from sinklab.report.vlm_figures import image_sinks, patch_mass

    model = built(models, "llava").model
    result = scan_images(model, [vc.test_image()], text_ids=vc.TEXT_IDS)
    mass, counts = patch_mass(result)
    positions = vision_inputs.image_spans(result.modality[0], [(4, 4)])[0].positions
    expected = result.column_mass[0][..., list(positions)].double().nanmean(dim=(0, 1)).reshape(4, 4)
    assert torch.allclose(torch.from_numpy(mass), expected)
    dominant = result.dominant_columns()[0].flatten().tolist()
    assert counts.sum() == sum(p in positions for p in dominant)
    assert image_sinks(result) is not None


def test_the_vision_tower_keeps_its_own_attention(models):
    model = built(models, "gemma3").model
    tower = model.model.vision_tower
    before = _compat.get_attn_implementation(tower)
    with AttentionCapture(model) as cap:
        assert _compat.get_attn_implementation(tower) == before
        assert cap.num_layers == tiny.LAYERS
        assert _compat.find_layers(model) is _compat.language_model(model).layers
    assert _compat.get_attn_implementation(tower) == before


def test_modality_metrics_by_hand():
    """One sample, one layer, one head, four keys: text, image, image, text; all eligible."""
    mass = torch.tensor([0.5, 0.3, 0.1, 0.1], dtype=torch.float64).reshape(1, 1, 1, 4)
    codes = torch.tensor([[0, 1, 1, 0]])
    eligible = torch.ones(1, 1, 1, 4, dtype=torch.bool)
    text = metrics.modality_sink_strength(mass, eligible, codes == 0)
    image = metrics.modality_sink_strength(mass, eligible, codes == 1)
    assert float(text) == 0.5 and math.isclose(float(image), 0.3)
    assert metrics.modality_sink_rate(image, 0.25).tolist() == [100.0]
    assert metrics.modality_sink_rate(image, 0.35).tolist() == [0.0]
    group = torch.tensor([0.4, 0.6, 0.2, 0.8], dtype=torch.float64).reshape(1, 1, 1, 4)  # the text queries' sums per key
    share = metrics.visual_sink_share(group, mass, eligible, codes == 1, 0.25)  # key 1 sinks, key 2 does not
    assert math.isclose(float(share), 0.6 / 0.8)
    none = metrics.modality_sink_strength(mass, eligible, torch.zeros(1, 4, dtype=torch.bool))
    assert bool(torch.isnan(none).all())


def test_modality_codes_and_refusals(models):
    model = built(models, "qwen2_vl").model
    inputs = vision_inputs.config_inputs(model, vc.test_image(), [10, 11])
    codes = inputs.modality[0][0].tolist()
    assert codes[0] == vision_inputs.IMAGE_SPECIAL and codes[-3] == vision_inputs.IMAGE_SPECIAL  # vision start/end
    assert codes.count(vision_inputs.IMAGE) == 16 and codes[-2:] == [0, 0]
    text_model = tiny.named_model("llama-gqa")
    with pytest.raises(InputError, match="no vision tower"):
        scan_images(text_model, [vc.test_image()], text_ids=[1, 2])
    with pytest.raises(InputError, match="cannot read image"):
        vision_inputs.load_images([Path(__file__)])


def test_sweep_rows_on_a_subset():
    rows = [vc.run_row(t) for t in ("idefics3", "paligemma")]
    assert [r["status"] for r in rows] == ["ok", "ok"], rows


# ----------------------------------------------------------------------------- the command line
@pytest.fixture(scope="module")
def llava_folder(tmp_path_factory, models) -> Path:
    """A tiny Llava saved with its processor (the pixel preprocessor and a tokenizer with ``<image>``)."""
    from transformers import LlavaForConditionalGeneration, LlavaImageProcessorPil, LlavaProcessor

    tok = tiny.tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    pixels = LlavaImageProcessorPil(size={"shortest_edge": tiny.IMAGE_SIZE},
                                    crop_size={"height": tiny.IMAGE_SIZE, "width": tiny.IMAGE_SIZE})
    processor = LlavaProcessor(image_processor=pixels, tokenizer=tok, patch_size=tiny.PATCH,
                               vision_feature_select_strategy="default", image_token="<image>",
                               num_additional_image_tokens=1)
    config = built(models, "llava").model.config
    config.image_token_index = tok.convert_tokens_to_ids("<image>")
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).eval()
    folder = tmp_path_factory.mktemp("tiny-llava")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(folder)
    processor.save_pretrained(folder)
    vc.test_image().save(folder / "image.png")
    return folder


def test_cli_scan_with_an_image(llava_folder, tmp_path):
    out = tmp_path / "out"
    result = runner.invoke(app, ["scan", str(llava_folder), "--image", str(llava_folder / "image.png"),
                                 "--text", "a bright square on stripes", "--out", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads((out / "scan.json").read_text())
    assert data["modality"]["positions"]["image"] == 16
    assert data["tokens"][0].count("<image>") == 16
    assert "by modality" in result.output and (out / "report.html").exists()
    assert (out / "image_sinks.png").exists()  # the image with its sink patches (Llava: a 4 × 4 grid)
    assert "By modality" in (out / "report.html").read_text()


def test_bundled_sample_photographs(llava_folder, tmp_path):
    """`sample:NAME` reads the photographs scikit-image's wheel ships (the cat is 451 × 300, the coffee 600 × 400,
    the camera man grey, given as RGB), and the command line takes them like files."""
    import numpy as np
    from PIL import Image

    images = vision_inputs.load_images(["sample", "sample:coffee", "sample:camera"])
    assert [im.size for im in images] == [(451, 300), (600, 400), (512, 512)]
    assert all(im.mode == "RGB" for im in images)
    with Image.open(vision_inputs.sample_image_path("chelsea")) as cat:
        assert np.array_equal(np.asarray(images[0]), np.asarray(cat.convert("RGB")))
    out = tmp_path / "out"
    result = runner.invoke(app, ["scan", str(llava_folder), "--image", "sample:astronaut", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert json.loads((out / "scan.json").read_text())["modality"]["positions"]["image"] == 16
    bad = runner.invoke(app, ["scan", str(llava_folder), "--image", "sample:dog", "--out", str(tmp_path / "b")])
    assert bad.exit_code == 2 and "unknown sample image 'dog'" in " ".join(bad.output.split())


def test_cli_image_errors(llava_folder, tmp_path):
    bad = tmp_path / "not-an-image.png"
    bad.write_text("plain text")
    result = runner.invoke(app, ["scan", str(llava_folder), "--image", str(bad), "--out", str(tmp_path / "a")])
    text = " ".join(result.output.split())
    assert result.exit_code == 2 and "cannot read image" in text and "Traceback" not in text
    result = runner.invoke(app, ["scan", "builtin:tiny-llama", "--image", str(llava_folder / "image.png"),
                                 "--out", str(tmp_path / "b")])
    text = " ".join(result.output.split())
    assert result.exit_code == 2 and "has no vision tower" in text, text
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_the_committed_sweep_table_matches_its_json():
    """The sweep's section of the one page of both sweeps (docs/architectures.md): the causal-LM matrix's columns
    and counts table, one row per type, from its JSON."""
    root = Path(__file__).resolve().parents[1]
    data = json.loads((root / "benchmarks" / "results" / "vlm_architectures.json").read_text())
    page = (root / "docs" / "architectures.md").read_text()
    section = page[page.index("## Vision-language models"):]
    c = data["counts"]
    assert c["types"] == len(data["rows"]) == len(vc.all_types())
    assert f"{c['types']} types, {c['built']} built, {c['not built']} not built" in section
    assert "| cell | ok | refused | crash | wrong | n/a |" in section
    assert f"| scan | {c['ok']} | {c['refused']} | {c['crash']} | {c['wrong']} | {c['n/a']} |" in section
    for key in CELLS[1:]:
        k = c[key]
        assert f"| {key} | {k['ok']} | {k['refused']} | {k['crash']} | {k['wrong']} | {k['n/a']} |" in section
        assert sum(k.values()) == c["built"]  # every built type has every cell
    assert "| type | " + " | ".join(CELLS) + " |" in page[: page.index("## Vision-language models")]  # same columns
    assert "| type | " + " | ".join(CELLS) + " |" in section
    for row in data["rows"]:
        first = "not built" if row["status"] == "not built" else row["status"]
        assert f"| {row['type']} | {first}" in section


def test_committed_sweep_was_made_from_the_sources_under_test():
    """The sweep's JSON and its section of the page record the fingerprint of the sinklab sources its cells run; a
    change to any of them makes the committed page stale until `make architectures` reruns it."""
    from sinklab.testing.conformance import source_fingerprint

    root = Path(__file__).resolve().parents[1]
    data = json.loads((root / "benchmarks" / "results" / "vlm_architectures.json").read_text())
    page = (root / "docs" / "architectures.md").read_text()
    recorded = data["meta"]["source"]["fingerprint"]
    assert f"Vision-language source fingerprint: `{recorded}`" in page, "the page and the sweep's JSON differ"
    current = source_fingerprint("sinklab.testing.vlm_conformance")
    assert recorded == current, (f"docs/architectures.md's vision-language section was made from other sinklab "
                                 f"sources (fingerprint {recorded}, the code under test is {current}): regenerate "
                                 "it with `make architectures`")


def test_sweep_stream_cells():
    """The sweep's stream cells: a 1-D rotary model streams, before eviction and past it with its image pinned; so
    does an M-RoPE model (Qwen2-VL), its float64 reference given each token's 3-D offset from the model's own layout
    of the whole prompt."""
    llava, qwen = vc.run_row("llava"), vc.run_row("qwen2_vl")
    assert llava["stream"]["status"] == llava["stream_evicted"]["status"] == "ok", llava
    assert "16 image tokens pinned" in llava["stream_evicted"]["detail"]
    assert qwen["stream"]["status"] == qwen["stream_evicted"]["status"] == "ok", qwen
    assert "18 image tokens pinned" in qwen["stream_evicted"]["detail"]
    # Cohere 2's full-attention layers carry no position (RoPE on its sliding layers only): the reference knows it
    cohere = vc.run_row("cohere2_vision")
    assert cohere["stream_evicted"]["status"] == "ok", cohere
    # Kimi K2.5's latent attention: each head's rotary part is its last dims (a reference that rotates the first
    # ones finds the stream wrong by 1.4e-3)
    kimi = vc.run_row("kimi_k25")
    assert kimi["stream_evicted"]["status"] == "ok", kimi


@pytest.mark.parametrize("model_type", ["minicpmv4_7", "qwen3_vl"])
def test_models_that_lay_out_multimodal_positions_stream_by_their_own_layout(model_type):
    """MiniCPM-V 4.7 computes M-RoPE positions from its token types although its config names no rotary sections,
    and Qwen3-VL interleaves its axes and adds vision features inside its first layers (deepstack): their own
    forwards differ from sequential positions, and the stream, fed by their own layout, equals them before eviction
    and the float64 reference after."""
    model = built(models={}, model_type=model_type).model
    batch = vision_inputs.config_inputs(model, vc.test_image(), vc.TEXT_IDS[:12]).batches[0]
    with torch.no_grad():
        own = model(**batch).logits[0, -1]
        sequential = model(**batch, position_ids=torch.arange(batch["input_ids"].shape[1])[None]).logits[0, -1]
    assert float((own - sequential).abs().max()) > 1e-4  # its positions are not the sequence's
    row = vc.run_row(model_type)
    assert row["stream"]["status"] == row["stream_evicted"]["status"] == "ok", row


def test_multimodal_positions_rebase_and_survive_save_and_load(tmp_path):
    """An M-RoPE stream's time index is re-based with the slots (the decoder's positions stay within the re-base
    span, one index on every axis for text) and gives the logits of a stream that never re-based; a saved and
    loaded stream continues with the next text token's offset: the same logits as the uninterrupted one."""
    from sinklab.stream import StreamSession
    from sinklab.vision_stream import feed_vision

    model = built(models={}, model_type="qwen2_vl").model
    inputs = vision_inputs.config_inputs(model, vc.test_image(), vc.TEXT_IDS[:12])
    tokens = vc.TEXT_IDS[12:40]
    seen: list[torch.Tensor] = []

    def run(rebase_every: int | None, save: Path | None = None) -> list[torch.Tensor]:
        with StreamSession(model, num_sinks=2, window=6, rebase_every=rebase_every) as s:
            out = [feed_vision(s, inputs)[0]] + [s.step(torch.tensor([t]))[0] for t in tokens]
            assert int(s.cache.positions.offset[0]) == -12  # 18 image tokens on a 3 × 3 position grid
            if save is not None:
                s.save(save)
            return out + [s.step(torch.tensor([t]))[0] for t in (5, 6, 7)]

    rotary = _compat.language_model(model).rotary_emb
    handle = rotary.register_forward_pre_hook(lambda m, args: seen.append(args[1].detach().clone()))
    try:
        rebased = run(16, tmp_path / "qwen.safetensors")
    finally:
        handle.remove()
    steps = [p for p in seen if p.shape[-1] == 1 and int(p.max()) < 1000]  # (1000: the rotary probe's)
    assert len(steps) == len(tokens) + 3 and all(bool((p == p[:1]).all()) for p in steps)
    assert max(abs(int(p.max())) for p in steps) <= 16, "the time index grew with the stream"
    for a, b in zip(rebased, run(None), strict=True):
        assert float((a - b).abs().max() / b.abs().max()) < 1e-5
    with StreamSession.load(model, tmp_path / "qwen.safetensors") as resumed:
        assert int(resumed.cache.positions.offset[0]) == -12
        again = [resumed.step(torch.tensor([t]))[0] for t in (5, 6, 7)]
    for a, b in zip(again, rebased[-3:], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("model_type, layout, grid", [
    ("lfm2_vl", "patches with spatial shapes", (2, 2)),  # SigLIP 2 NaFlex patches, the grid's shape and mask
    ("gemma4", "patches with positions", (2, 2)),  # NaFlex patches with their (x, y); OVERRIDES: pooling kernel 2
    ("kimi_k25", "row-major patch images", (2, 2)),  # row-major patches and their grid; OVERRIDES: projector norm
    ("blip-2", "square", None),  # TOKEN_OVERRIDES: the image token its default leaves unset; 32 query tokens, no grid
    ("instructblipvideo", "still video with instruction", None),  # its video token: the picture as a still video
])
def test_sweep_rows_of_more_pixel_layouts(model_type, layout, grid):
    """Types whose towers take pixels in other layouts than a square picture, or whose tiny config needs an override:
    the scan's maps and statistics match the eager weights (the sweep's cell), in the layout named."""
    row = vc.run_row(model_type)
    assert row["status"] == "ok", row
    model = vc.build(model_type).model
    pixels, count, found = vision_inputs._image_pixels(model, vc.test_image(), vc.TEXT_IDS)
    stack = _compat.base_model(model)
    get = getattr(stack, "get_image_features", None) or stack.get_video_features  # InstructBLIP-Video: videos only
    takes = frozenset(inspect.signature(get).parameters)
    names = [name for name, inputs, _ in vision_inputs._layouts(model, vc.test_image(), takes, vc.TEXT_IDS)
             if inputs.keys() == pixels.keys() and all(torch.equal(inputs[k], pixels[k].cpu()) for k in inputs)]
    assert names[0] == layout and found == grid, (names, found, count)


def test_a_model_that_takes_images_without_a_vision_config_is_refused_with_what_would_lift_it():
    row = vc.run_row("fuyu")  # its patches are projected inside the decoder: no vision tower in its config
    assert row["status"] == "refused" and "takes images (" in row["detail"] and "Lifting it needs" in row["detail"]


def test_the_video_token_stands_for_the_image_token_only_where_the_config_names_no_image_token():
    from types import SimpleNamespace

    assert vision_inputs.image_token_id(SimpleNamespace(video_token_id=5)) == 5
    assert vision_inputs.image_token_id(SimpleNamespace(image_token_id=7, video_token_id=5)) == 7
    assert vision_inputs.image_token_id(SimpleNamespace(image_token_id=None, video_token_id=5)) is None  # unset
    assert vision_inputs.image_token_id(SimpleNamespace(text_config=SimpleNamespace(image_token_index=3),
                                                        video_token_id=5)) == 3


# ----------------------------------------------------------------------------- diagnose with images
def _decoder_final(model, batch, layer, head, zero=None, removed=None):
    """The decoder's final hidden states, float64 attention written here on the language model only (the vision
    tower keeps its own), with head ``head`` of ``layer`` given a zero value at ``zero`` or no column at
    ``removed``."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    lm = _compat.language_model(model)
    target = lm.layers[layer].self_attn

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        hq, hkv, t, s = query.shape[1], key.shape[1], query.shape[2], key.shape[2]
        k = key.double().repeat_interleave(hq // hkv, 1)
        v = value.double().repeat_interleave(hq // hkv, 1).clone()
        allowed = torch.tril(torch.ones(t, s, dtype=torch.bool)).expand(query.shape[0], hq, t, s).clone()
        if module is target and zero is not None:
            v[0, head, zero] = 0.0
        if module is target and removed is not None:
            allowed[0, head, :, removed] = False
        scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
        probs = torch.softmax((query.double() @ k.transpose(-1, -2) * scaling).masked_fill(~allowed, -math.inf), -1)
        return (probs.nan_to_num(0.0) @ v).to(query.dtype).transpose(1, 2).contiguous(), None

    AttentionInterface.register("sinklab_test_vlm_edit", attention)
    AttentionMaskInterface.register("sinklab_test_vlm_edit", sdpa_mask)
    before = lm.config._attn_implementation
    lm.set_attn_implementation("sinklab_test_vlm_edit")
    try:
        with torch.no_grad():
            return model.model(**batch).last_hidden_state.double()
    finally:
        lm.set_attn_implementation(before)


def test_diagnose_with_an_image_edits_with_the_pixels_in_every_forward(models):
    from sinklab.diagnose import diagnose_images

    model = built(models, "llava").model
    ids = list(range(5, 40))
    layer, head = 1, 2
    d = diagnose_images(model, [vc.test_image()], text_ids=ids, rules={"sink_mass": 0.0}, edits=[(layer, head)])
    scanned = scan_images(model, [vc.test_image()], text_ids=ids)
    torch.testing.assert_close(d.scan.column_mass, scanned.column_mass, atol=1e-6, rtol=0, equal_nan=True)
    assert d.scan.tokens == scanned.tokens and "<image>" in d.scan.tokens[0]
    # the diagnosis's scan is split by modality as scan_images' (checked against a float64 loop above)
    assert torch.equal(d.scan.modality, scanned.modality)
    torch.testing.assert_close(d.scan.group_mass, scanned.group_mass, atol=1e-6, rtol=0, equal_nan=True)
    for name in ("text", "image"):
        torch.testing.assert_close(d.scan.modality_sink_strength(name), scanned.modality_sink_strength(name),
                                   atol=1e-6, rtol=0, equal_nan=True)
    torch.testing.assert_close(d.scan.visual_sink_share(0.3), scanned.visual_sink_share(0.3), atol=1e-6, rtol=0,
                               equal_nan=True)  # at one ε (the diagnosis ran its rule at sink_mass 0)
    edit = d.edits[0]
    batch = vision_inputs.config_inputs(model, vc.test_image(), ids).batches[0]
    base = _decoder_final(model, batch, layer, head)
    other = {**batch, "pixel_values": -batch["pixel_values"]}
    assert float((_decoder_final(model, other, layer, head) - base).abs().max()) > 1e-3  # the pixels matter here
    for name, change in (("zero", {"zero": edit.positions[0]}), ("remove_column", {"removed": edit.positions[0]})):
        got = _decoder_final(model, batch, layer, head, **change)
        want = float((got - base).norm() / base.norm())
        assert edit.hidden[name] == pytest.approx(want, rel=2e-3, abs=2e-5), name


def test_cli_diagnose_with_an_image(llava_folder, tmp_path):
    out = tmp_path / "out"
    result = runner.invoke(app, ["diagnose", str(llava_folder), "--image", str(llava_folder / "image.png"),
                                 "--text", "a bright square on stripes", "--sink-mass", "0.0", "--out", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads((out / "diagnosis.json").read_text())
    assert data["meta"]["images"] == 1 and data["meta"]["image_grids"] == [[[4, 4]]]
    assert "by modality (16 image tokens" in " ".join(result.output.split())  # the scan's table, split by modality
    assert data["records"]
    report = " ".join((out / "report.html").read_text().split())
    assert "<h2>By modality</h2><p>Positions: 26 text, 16 image" in report  # the split, as in the scan's report
    assert "alt='image_sinks'" in report and (out / "image_sinks.png").exists()  # the sink patches over the picture
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    from sinklab.diagnose import diagnose_images
    from sinklab.vision_inputs import load_images

    api = diagnose_images(LlavaForConditionalGeneration.from_pretrained(llava_folder).eval(),
                          load_images([llava_folder / "image.png"]), "a bright square on stripes",
                          processor=AutoProcessor.from_pretrained(llava_folder), rules={"sink_mass": 0.0})
    assert [(e["layer"], e["head"]) for e in data["edits"]] == [(e.layer, e.head) for e in api.edits] != []
    for got, want in zip(data["edits"], api.edits, strict=True):
        assert got["hidden"] == pytest.approx(want.hidden, rel=1e-5, abs=1e-7)
    bad = runner.invoke(app, ["diagnose", "builtin:tiny-llama", "--image", str(llava_folder / "image.png"),
                              "--out", str(tmp_path / "b")])
    assert bad.exit_code == 2 and "has no vision tower" in " ".join(bad.output.split())
    assert not (tmp_path / "b").exists()


# ----------------------------------------------------------------------------- the P0 circuit with images
def test_circuit_with_images_runs_every_condition_with_the_pixels(models):
    """One sample per image, BOS first: the reference and BOS-removed conditions' column mass on position 0 and
    norm ratio ‖x₀‖ / median ‖xᵢ‖ against the eager twin's weights and the model's own hidden states, each sample
    with its pixels (float64 here)."""
    from sinklab.circuit import circuit_images

    model = built(models, "llava").model
    images = [vc.test_image(), vc.video_frame(1), vc.video_frame(2)]
    ids, bos = vc.TEXT_IDS[:20], 1
    result = circuit_images(model, images, text_ids=ids, bos_id=bos, causal=False)
    assert result.num_samples == 3 and list(result.conditions) == ["as_tokenized", "bos_removed", "first_swapped"]
    batches = [vision_inputs.config_inputs(model, image, ids, bos=bos).batches[0] for image in images]
    for name, cut in (("as_tokenized", 0), ("bos_removed", 1)):
        mass, ratio = [], []
        for batch in batches:
            batch = {**batch, "input_ids": batch["input_ids"][:, cut:], "attention_mask": batch["attention_mask"][:, cut:]}
            weights = vc.language_attentions(model, batch, tiny.LAYERS)
            mass.append(torch.stack([w[0].double()[:, :, 0].mean(-1) for w in weights]))  # (L, H): key 0, all queries
            with torch.no_grad():
                hidden = model.model(**batch, output_hidden_states=True).hidden_states
            norms = torch.stack([h[0].double().norm(dim=-1) for h in hidden[:tiny.LAYERS]])  # (L, T), un-normed ones
            ratio.append(norms[:, 0] / norms[:, 1:].median(dim=-1).values)
        got = result.conditions[name]
        torch.testing.assert_close(torch.tensor(got["column_mass_0"], dtype=torch.float64), torch.stack(mass).mean(0),
                                   atol=1e-4, rtol=0)
        torch.testing.assert_close(torch.tensor(got["ratio"][:tiny.LAYERS], dtype=torch.float64),
                                   torch.stack(ratio).mean(0), atol=1e-3, rtol=1e-3)
    with pytest.raises(InputError, match="bos_id"):
        circuit_images(model, images, text_ids=ids)


def test_cli_circuit_with_an_image(llava_folder, tmp_path):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    from sinklab.circuit import circuit_images
    from sinklab.vision_inputs import load_images

    out = tmp_path / "out"
    image = llava_folder / "image.png"
    result = runner.invoke(app, ["circuit", str(llava_folder), "--image", str(image), "--image", str(image),
                                 "--text", "a bright square on stripes", "--no-causal", "--out", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads((out / "circuit.json").read_text())
    api = circuit_images(LlavaForConditionalGeneration.from_pretrained(llava_folder).eval(),
                         load_images([image, image]), "a bright square on stripes",
                         processor=AutoProcessor.from_pretrained(llava_folder), causal=False)
    assert data["num_samples"] == 2 and list(data["conditions"]) == list(api.conditions)
    for name, cond in api.conditions.items():
        torch.testing.assert_close(torch.tensor(data["conditions"][name]["column_mass_0"]),
                                   torch.tensor(cond["column_mass_0"]), atol=1e-6, rtol=0)
    bad = runner.invoke(app, ["circuit", "builtin:tiny-llama", "--image", str(image), "--out", str(tmp_path / "b")])
    assert bad.exit_code == 2 and "has no vision tower" in " ".join(bad.output.split())


def test_modality_codes_must_match_the_batches(models):
    """scan_inputs and diagnose_inputs refuse modality codes that are not one tensor per batch."""
    from sinklab import scan_inputs
    from sinklab.diagnose import diagnose_inputs

    model = built(models, "llava").model
    inputs = vision_inputs.config_inputs(model, vc.test_image(), vc.TEXT_IDS)
    for run in (scan_inputs, diagnose_inputs):
        with pytest.raises(InputError, match="one code tensor per batch"):
            run(model, inputs.batches, inputs.tokens, modality=inputs.modality * 2)


def test_cli_circuit_with_an_image_refuses_a_device_map(llava_folder, tmp_path):
    result = runner.invoke(app, ["circuit", str(llava_folder), "--image", "sample", "--device-map", "auto",
                                 "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "drop --device-map" in " ".join(result.output.split())
    assert not (tmp_path / "o").exists()
