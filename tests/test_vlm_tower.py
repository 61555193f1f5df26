"""A vision-language model's vision tower scanned as an encoder: column masses against a float64 loop over the
tower's own eager attention weights (``output_attentions=True``), hidden norms against its own hidden states, the
pixels against a resize done here with numpy, and the refusals."""

from __future__ import annotations

import copy
import json
import warnings

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from sinklab.cli import app
from sinklab.errors import InputError, UnsupportedModelError
from sinklab.models import tiny_llama
from sinklab.scan import scan_vision_tower
from sinklab.testing import tiny
from sinklab.testing import vlm_conformance as vc

pytestmark = pytest.mark.usefixtures("one_thread")
runner = CliRunner()


def _images():
    return [vc.test_image(), vc.video_frame(3)]


def _reference(tower, images):
    """Float64 column mass ``[S, L, H, T]`` (each key's attention averaged over all queries) from the tower's eager
    weights, and the hidden states' norms ``[S, L+1, T]``, on pixels resized here."""
    size = tiny.IMAGE_SIZE
    pixels = torch.stack([torch.from_numpy(np.asarray(im.convert("RGB").resize((size, size)), dtype=np.float32)
                                           / 127.5 - 1.0).permute(2, 0, 1) for im in images])
    twin = copy.deepcopy(tower)
    twin.set_attn_implementation("eager")
    with torch.no_grad():
        out = twin(pixel_values=pixels, output_attentions=True, output_hidden_states=True)
    attn = torch.stack(out.attentions, dim=1).double()  # (S, L, H, T, T)
    return attn.mean(-2), torch.stack(out.hidden_states, dim=1).double().norm(dim=-1)


@pytest.mark.parametrize("model_type, head", [("llava", ["[CLS]"]), ("gemma3", [])])
def test_tower_scan_matches_the_towers_own_eager_weights(vlm_model, model_type, head):
    model = vlm_model(model_type)
    images = _images()
    result = scan_vision_tower(model, images)
    mass, norms = _reference(model.model.vision_tower, images)
    grid = tiny.IMAGE_SIZE // tiny.PATCH
    assert result.tokens[0] == head + [f"patch{r},{c}" for r in range(grid) for c in range(grid)]
    assert result.meta["patch_grid"] == [grid, grid] and "vision tower" in result.meta["component"]
    assert result.column_mass.shape == mass.shape and mass.shape[0] == 2
    torch.testing.assert_close(result.column_mass.double(), mass, atol=1e-5, rtol=0)
    # the layers' inputs (the tower's own hidden states before each block; its last entry is after the last block)
    layers = result.hidden_norm.shape[1]
    torch.testing.assert_close(result.hidden_norm.double(), norms[:, :layers], rtol=1e-4, atol=1e-4)


def test_tower_scan_refusals(vlm_model):
    with pytest.raises(UnsupportedModelError, match="patch layout"):  # flattened patches with their grid
        scan_vision_tower(vlm_model("qwen2_vl"), _images())
    with pytest.raises(InputError, match="no vision tower"):
        scan_vision_tower(tiny_llama(), _images())
    with pytest.raises(InputError, match="no image"):
        scan_vision_tower(vlm_model("llava"), [])


def test_cli_scans_the_vision_tower(vlm_model, tmp_path):
    model = vlm_model("llava")
    folder = tmp_path / "llava"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(folder)
    tiny.tiny_tokenizer().save_pretrained(folder)  # a folder without a processor: pixels sized by the config
    image = tmp_path / "image.png"
    vc.test_image().save(image)
    out = tmp_path / "out"
    result = runner.invoke(app, ["scan", str(folder), "--image", str(image), "--vision-tower", "--out", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads((out / "scan.json").read_text())
    assert data["tokens"][0][0] == "[CLS]" and data["meta"]["patch_grid"] == [4, 4]
    assert "vision tower (CLIPVisionModel)" in " ".join(result.output.split())
    mass, _ = _reference(model.model.vision_tower, [vc.test_image()])
    torch.testing.assert_close(torch.tensor(data["column_mass"], dtype=torch.float64), mass, atol=1e-5, rtol=0)
    bad = runner.invoke(app, ["scan", "builtin:tiny-llama", "--vision-tower", "--out", str(tmp_path / "b")])
    assert bad.exit_code == 2 and "--vision-tower" in " ".join(bad.output.split())
