"""sinklab.vit: variants vs a naive float64 ViT, registers dropped, identity init, save/load, the generator, probes."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch.nn import functional as F

from sinklab.capture import AttentionCapture, CaptureConfig
from sinklab.errors import InputError, ModelWeightsError, UnsupportedModelError
from sinklab.vit import ShapesConfig, ShapesDataset, apply_vit_variant, load_vit, save_vit
from sinklab.vit.data import patch_targets
from sinklab.vit.probe import frozen_features, miou, ridge_fit, ridge_predict

import variant_cases
from tiny_models import tiny_vit

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: a second thread only spins

VARIANTS = variant_cases.VIT


def _vit(kind: str):
    return tiny_vit(kind)


def _randomise(model) -> None:
    """Give the variant's parameters non-trivial values (gate weights, registers) so the test can fail."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "sinklab_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)


def _naive(model, x: torch.Tensor, n_regs: int, gate: str | None, kv: bool = False) -> torch.Tensor:
    """float64 ViT/DINOv2 forward written out by hand: per-head loops, gate, registers inserted after [CLS],
    kv-bias (one learned key/value column per head in front of the keys)."""
    dino = type(model).__name__.startswith("Dinov2")
    p = {k: v.detach().double() for k, v in model.state_dict().items()}
    e = "embeddings."
    d = p[e + "cls_token"].shape[-1]
    patches = F.conv2d(x.double(), p[e + "patch_embeddings.projection.weight"], p[e + "patch_embeddings.projection.bias"],
                       stride=4).flatten(2).transpose(1, 2)  # (B, P, d)
    b = x.shape[0]
    h = torch.cat([p[e + "cls_token"].expand(b, 1, d), patches], 1) + p[e + "position_embeddings"]
    if n_regs:
        h = torch.cat([h[:, :1], p["sinklab_registers"].expand(b, n_regs, d), h[:, 1:]], 1)
    heads = model.config.num_attention_heads
    dh = d // heads
    prefix = "encoder.layer." if dino else "layers."
    for i in range(model.config.num_hidden_layers):
        q = f"{prefix}{i}."
        ln1 = (q + "norm1.") if dino else (q + "layernorm_before.")
        xn = F.layer_norm(h, (d,), p[ln1 + "weight"], p[ln1 + "bias"], eps=model.config.layer_norm_eps)
        a = q + "attention."
        outs = []
        for hd in range(heads):
            sl = slice(hd * dh, (hd + 1) * dh)
            qq = xn @ p[a + "q_proj.weight"][sl].T + p[a + "q_proj.bias"][sl]
            kk = xn @ p[a + "k_proj.weight"][sl].T + p[a + "k_proj.bias"][sl]
            vv = xn @ p[a + "v_proj.weight"][sl].T + p[a + "v_proj.bias"][sl]
            if kv:
                kk = torch.cat([p[a + "sinklab_k_bias"][hd].expand(b, 1, dh), kk], 1)
                vv = torch.cat([p[a + "sinklab_v_bias"][hd].expand(b, 1, dh), vv], 1)
            o = torch.softmax(qq @ kk.transpose(1, 2) / math.sqrt(dh), -1) @ vv  # (B, T, dh)
            if gate is not None:
                g = torch.sigmoid(xn @ p[a + "sinklab_gate.weight"].T + p[a + "sinklab_gate.bias"])
                o = o * (g[..., sl] if gate == "elementwise" else g[..., hd : hd + 1])
            outs.append(o)
        y = torch.cat(outs, -1) @ p[a + "o_proj.weight"].T + p[a + "o_proj.bias"]
        if dino:
            y = y * p[q + "layer_scale1.lambda1"]
        h = h + y
        ln2 = (q + "norm2.") if dino else (q + "layernorm_after.")
        xn = F.layer_norm(h, (d,), p[ln2 + "weight"], p[ln2 + "bias"], eps=model.config.layer_norm_eps)
        m = F.gelu(xn @ p[q + "mlp.fc1.weight"].T + p[q + "mlp.fc1.bias"]) @ p[q + "mlp.fc2.weight"].T + p[q + "mlp.fc2.bias"]
        h = h + (m * p[q + "layer_scale2.lambda1"] if dino else m)
    h = F.layer_norm(h, (d,), p["layernorm.weight"], p["layernorm.bias"], eps=model.config.layer_norm_eps)
    return torch.cat([h[:, :1], h[:, 1 + n_regs :]], 1)


@pytest.mark.parametrize("kind", ["vit", "dinov2"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_variant_matches_naive_float64(kind, variant):
    model = _vit(kind)
    handle = apply_vit_variant(model, variant, registers=2) if "registers" in variant else apply_vit_variant(model, variant)
    _randomise(model)
    x = torch.rand(2, 3, 12, 12, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = model(pixel_values=x).last_hidden_state
    gate = handle.config.gate
    kv = handle.config.kv_bias
    ref = _naive(model, x, handle.config.registers, gate, kv)
    assert out.shape == (2, 1 + 9, 24)  # registers dropped from the output
    assert torch.allclose(out.double(), ref, atol=2e-5), (out.double() - ref).abs().max()
    # the test can fail: the reference without the registers (or without the gate / the kv slot) is far off
    regs = handle.config.registers
    wrong = _naive(model, x, 0, gate, kv) if regs else _naive(model, x, regs, None, False)
    assert not torch.allclose(out.double(), wrong, atol=1e-3)
    # the capture (scan/diagnose) computes the same forward, and sees the kv slot's mass
    with torch.no_grad(), AttentionCapture(model, CaptureConfig(candidates=(0,), map_len=0)) as cap:
        batch = cap.run(pixel_values=x)
        captured = cap.last_output.last_hidden_state
    assert torch.allclose(captured.double(), ref, atol=2e-5)
    assert batch.column_mass.shape[-1] == 1 + regs + 9
    assert (float(batch.learned_sink_mass.min()) > 1e-3) == kv


@pytest.mark.parametrize("kind", ["vit", "dinov2"])
def test_gate_off_and_zero_registers_equal_the_baseline(kind):
    model = _vit(kind)
    x = torch.rand(2, 3, 12, 12, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        base = model(pixel_values=x).last_hidden_state
        for spec, extra in (("gated", {}), ("gated-headwise", {}), ("gated+registers", {"registers": 0})):
            with apply_vit_variant(model, spec, init="off", **extra):
                assert torch.allclose(model(pixel_values=x).last_hidden_state, base, atol=1e-6)
        with apply_vit_variant(model, "registers", registers=1):  # registers have no identity: outputs change
            assert not torch.allclose(model(pixel_values=x).last_hidden_state, base, atol=1e-4)
        assert torch.equal(model(pixel_values=x).last_hidden_state, base)  # removed: back to the baseline


def test_registers_inside_the_blocks_but_not_in_outputs_or_probes():
    import sinklab
    from sinklab.vit import token_labels

    model = _vit("vit")
    apply_vit_variant(model, "gated+registers", registers=3)
    x = torch.rand(4, 3, 12, 12, generator=torch.Generator().manual_seed(4))
    cls, pooled, patches = frozen_features(model, x)
    assert patches.shape == (4, 9, 24) and cls.shape == pooled.shape == (4, 24)
    with torch.no_grad():
        hs = model(pixel_values=x, output_hidden_states=True).hidden_states
    assert all(h.shape[1] == 10 for h in hs)
    d = sinklab.diagnose_inputs(model, [{"pixel_values": x}], [token_labels(9, 3)] * 4, edits=False,
                                special={"cls": "[CLS]"})
    assert d.scan.seq_len == 1 + 3 + 9  # the blocks see the registers
    assert {r.role for r in d.records} <= {"cls", "register", "patch"}


def test_save_load_by_path_keeps_the_variant(tmp_path):
    model = _vit("dinov2")
    apply_vit_variant(model, "gated-headwise+registers", registers=2)
    _randomise(model)
    save_vit(model, tmp_path / "m")
    loaded = load_vit(tmp_path / "m")
    x = torch.rand(2, 3, 12, 12)
    with torch.no_grad():
        assert torch.equal(loaded(pixel_values=x).last_hidden_state, model(pixel_values=x).last_hidden_state)
    assert loaded.sinklab_variant_handle.config == model.sinklab_variant_handle.config
    import sinklab  # the general loader (what every command uses) dispatches to the ViT loader by path

    by_path = sinklab.load_model(str(tmp_path / "m")).model
    with torch.no_grad():
        assert torch.equal(by_path(pixel_values=x).last_hidden_state, model(pixel_values=x).last_hidden_state)
    from sinklab.vit.variants import is_vit_checkpoint

    assert is_vit_checkpoint(tmp_path / "m") and not is_vit_checkpoint(tmp_path)
    # a checkpoint with a missing key is refused, as is one with an unexpected key
    from safetensors import safe_open
    from safetensors.torch import save_file

    file = tmp_path / "m" / "model.safetensors"
    with safe_open(str(file), framework="pt") as f:
        meta, state = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
    broken = dict(state)
    broken.pop("sinklab_registers")
    (tmp_path / "b").mkdir()
    save_file(broken, str(tmp_path / "b" / "model.safetensors"), metadata=meta)
    with pytest.raises(ModelWeightsError, match="missing.*sinklab_registers"):
        load_vit(tmp_path / "b")
    save_file({**state, "extra.weight": torch.zeros(1)}, str(tmp_path / "b" / "model.safetensors"), metadata=meta)
    with pytest.raises(ModelWeightsError, match="unexpected.*extra.weight"):
        load_vit(tmp_path / "b")
    save_file(state, str(tmp_path / "b" / "model.safetensors"))  # no sinklab header
    with pytest.raises(ModelWeightsError, match="not a sinklab ViT checkpoint"):
        load_vit(tmp_path / "b")


def test_bad_inputs():
    from sinklab.vit.experiment import VitExperimentConfig

    with pytest.raises(InputError):
        VitExperimentConfig(variants=["baseline", "nope"])
    from sinklab.vit.experiment import build

    kv = build(VitExperimentConfig(variants=["baseline", "kv-bias"], width=24, heads=3, layers=1), "kv-bias", 0)
    assert any("sinklab_k_bias" in n for n, _ in kv.named_parameters())
    from sinklab.models import tiny_llama

    with pytest.raises(UnsupportedModelError, match="ViT/DINOv2-style"):
        apply_vit_variant(tiny_llama(), "gated")


# ----------------------------------------------------------------------------- the generator
def _naive_inside(cls: int, px: float, py: float, o: dict) -> bool:
    dx, dy = px + 0.5 - o["cx"], py + 0.5 - o["cy"]
    dist = math.hypot(dx, dy)
    r = o["r"]
    if cls == 1:
        return dist <= r
    if cls == 2:
        return max(abs(dx), abs(dy)) <= 0.85 * r
    if cls == 3:
        t = (dy + r) / (1.8 * r)
        return 0 <= t <= 1 and abs(dx) <= t * r
    return 0.55 * r <= dist <= r


def _naive_texture(cls: int, x: int, y: int) -> float:
    light = {1: True, 2: (y // 2) % 2 == 0, 3: (x // 2) % 2 == 0, 4: ((x // 2) + (y // 2)) % 2 == 0}[cls]
    return 1.0 if light else 0.55


def test_generator_masks_match_images():
    cfg = ShapesConfig(image_size=16, min_radius=3, max_radius=6, seed=7)
    ds = ShapesDataset(cfg, "train")
    n = cfg.image_size
    for index in range(3):
        image, mask, label, scene = ds.render(index)
        img = image.double().tolist()
        areas = [0] * 5
        for y in range(n):
            for x in range(n):
                top = None
                for o in scene.objects:  # later objects are painted on top
                    if _naive_inside(o["cls"], x, y, o):
                        top = o
                expected_cls = 0 if top is None else top["cls"]
                assert int(mask[y, x]) == expected_cls
                areas[expected_cls] += 1
                pix = [img[c][y][x] for c in range(3)]
                if top is not None:  # repaint the pixel from the mask's object: colour × class texture
                    want = [top["colour"][c] * _naive_texture(top["cls"], x, y) for c in range(3)]
                    assert max(abs(a - b) for a, b in zip(pix, want)) < 1e-6
                else:
                    fx, fy, ph = scene.grating
                    wave = math.sin(2 * math.pi * (fx * x + fy * y) / n + ph)
                    for c in range(3):
                        lo = min(1.0, max(0.0, scene.background[c] + cfg.grating * wave - cfg.noise))
                        hi = min(1.0, max(0.0, scene.background[c] + cfg.grating * wave + cfg.noise))
                        assert lo - 1e-6 <= pix[c] <= hi + 1e-6
        assert label == max(range(4), key=lambda k: (areas[k + 1], -k))
    a, b = ds.render(1)[0], ShapesDataset(cfg, "train").render(1)[0]
    assert torch.equal(a, b)  # deterministic per (seed, split, index)
    assert not torch.equal(a, ShapesDataset(cfg, "test").render(1)[0])
    shares = patch_targets(ds.batch(0, 2)[1], 4, 4)
    assert shares.shape == (2, 16, 5) and torch.allclose(shares.sum(-1), torch.ones(2, 16))


# ----------------------------------------------------------------------------- probes
def test_ridge_probe_and_miou_against_closed_forms():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(50, 4, generator=gen, dtype=torch.float64)
    y = torch.randn(50, 3, generator=gen, dtype=torch.float64)
    w, mean, std = ridge_fit(x, y, lam=0.0)  # λ = 0: ordinary least squares with a bias
    z = torch.cat([(x - mean) / std, torch.ones(50, 1, dtype=torch.float64)], 1)
    assert torch.allclose(ridge_predict((w, mean, std), x), z @ torch.linalg.lstsq(z, y).solution, atol=1e-10)
    pred = torch.tensor([0, 0, 1, 1, 2])
    target = torch.tensor([0, 1, 1, 1, 0])
    # class 0: |{0}| / |{0,1,4}| = 1/3; class 1: |{2,3}| / |{1,2,3}| = 2/3; class 2: 0 / 1
    assert miou(pred, target, 3) == pytest.approx((1 / 3 + 2 / 3 + 0) / 3)


def test_experiment_smoke_resumes_and_refuses_other_settings(tmp_path):
    from sinklab.report.vit_figures import write_experiment_figures
    from sinklab.vit.experiment import VitExperimentConfig, experiment_runs, run_experiment

    cfg = VitExperimentConfig(variants=["baseline", "gated+registers"], seeds=1, minutes=0.02, image_size=12,
                              patch_size=4, width=12, layers=2, heads=2, registers=2, batch=4, probe_train=16,
                              probe_test=8, diag_samples=2)
    summary = run_experiment(cfg, tmp_path)
    steps = summary["plan"]["steps"]
    runs = experiment_runs(cfg, tmp_path)
    assert [(r["variant"], r["seed"]) for r in runs] == [("baseline", 0), ("gated+registers", 0)]
    write_experiment_figures(summary, runs, cfg, tmp_path)  # what `sinklab vit-experiment` does after the run
    for name in ("results.json", "table.md", "sink_classes.png", "output_norms.png", "attention_maps.png"):
        assert (tmp_path / name).is_file()
    result = json.loads((tmp_path / "runs" / "gated-registers_s0" / "result.json").read_text())
    assert result["steps"] == steps and len(result["diagnosis"]["output_norms"]["register"]) == 2 * 2
    again = run_experiment(cfg, tmp_path)  # finished runs are reused: the same numbers
    assert again["rows"] == summary["rows"]
    with pytest.raises(InputError, match="different settings"):
        run_experiment(VitExperimentConfig(**{**cfg.__dict__, "lr": 1e-4}), tmp_path)


def test_cli_bad_variant_is_one_red_line(tmp_path):
    from typer.testing import CliRunner

    from sinklab.cli import app

    result = CliRunner().invoke(app, ["vit-experiment", "--variants", "baseline,nope", "--out", str(tmp_path / "x")])
    assert result.exit_code == 2 and "unknown variant" in result.output
    assert not (tmp_path / "x").exists()  # nothing half-written


def test_cli_scan_and_diagnose_run_a_vision_transformer_folder_like_the_api(tmp_path):
    """``sinklab scan FOLDER`` / ``diagnose FOLDER`` on a ViT run on the embedded images: the CLI's JSON equals the
    API on the same batches, and --text is refused with one line."""
    from typer.testing import CliRunner

    from sinklab.cli import app
    from sinklab.scan import scan_inputs
    from sinklab.vit.inputs import image_batches

    model = _vit("vit")
    model.save_pretrained(tmp_path / "vit")
    runner = CliRunner()
    result = runner.invoke(app, ["scan", str(tmp_path / "vit"), "--samples", "4", "--batch-size", "2",
                                 "--out", str(tmp_path / "scan")])
    assert result.exit_code == 0, result.output
    cli = json.loads((tmp_path / "scan" / "scan.json").read_text())
    base, batches, labels, meta = image_batches(model, samples=4, batch_size=2, seed=0)
    api = scan_inputs(base, batches, labels, meta=meta)
    assert cli["per_layer"] == json.loads(json.dumps(api.to_json()["per_layer"]))
    result = runner.invoke(app, ["diagnose", str(tmp_path / "vit"), "--samples", "4", "--batch-size", "2",
                                 "--edit-samples", "2", "--out", str(tmp_path / "diag")])
    assert result.exit_code == 0, result.output
    diag = json.loads((tmp_path / "diag" / "diagnosis.json").read_text())
    assert diag["meta"]["model"] == str(tmp_path / "vit") and diag["per_layer"] and diag["recommendation"]
    result = runner.invoke(app, ["scan", str(tmp_path / "vit"), "--text", "hello", "--out", str(tmp_path / "x")])
    assert result.exit_code != 0 and "vision transformer" in result.output and "Traceback" not in result.output
