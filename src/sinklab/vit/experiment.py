"""The ViT mitigation experiment: baseline vs registers vs gating vs both, at one identical budget.

:func:`run_experiment` measures the throughput of the heaviest variant once, turns the total budget
(``minutes``) into **one** step count for every variant and seed, and stores it in ``plan.json`` — a
resumed run reads the plan back, so it is the same run. Each (variant, seed) trains a
:class:`~sinklab.vit.model.SinklabViT` from the same initial backbone weights (seeded; the variant's extra
parameters come from their own generator) on the same batches (image ``i`` of step ``s`` is image
``s·batch + i`` of :class:`~sinklab.vit.data.ShapesDataset`, the masked patches drawn from ``(seed, s)``),
with loss = cross-entropy of the global label on [CLS] + MSE of the masked patches' pixels. Then, on the
frozen backbone: linear patch probe (mIoU), linear probes on [CLS] and on the mean patch feature
(accuracy), and :func:`sinklab.diagnose_inputs` on held-out images (sink classes per layer, sinks on
registers, high-norm tokens, value-norm ratios). Checkpoints per (variant, seed) make it resumable after
a kill: a finished run is skipped, an unfinished one continues from its last checkpoint. The runner writes
data only; :func:`sinklab.report.vit_figures.write_experiment_figures` draws the figures from it.
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from .. import metrics
from ..atomic import atomic_dir, write_json, write_text
from ..diagnose import Diagnosis, diagnose_inputs
from ..errors import InputError, check_int
from .data import ShapesConfig, ShapesDataset
from .model import SinklabViT, small_vit_config, token_labels
from .probe import evaluate_probes
from .variants import apply_vit_variant, save_vit

__all__ = ["VARIANT_SPECS", "VitExperimentConfig", "experiment_runs", "run_experiment", "summarise"]

#: experiment variant name → sinklab variant spec (``None``: the baseline).
VARIANT_SPECS = {"baseline": None, "registers": "registers", "gated": "gated", "gated-headwise": "gated-headwise",
                 "gated+registers": "gated+registers", "sink-logit": "sink-logit", "kv-bias": "kv-bias"}


@dataclass
class VitExperimentConfig:
    """Everything that defines the experiment (each field has a default); ``plan.json`` stores it."""

    variants: list[str] = field(default_factory=lambda: ["baseline", "registers", "gated", "gated+registers"])
    seeds: int = 3
    minutes: float = 10.0  # total budget; training gets train_fraction of it, split equally over all runs
    train_fraction: float = 0.6  # the rest pays for probes, diagnoses and figures
    image_size: int = 24
    patch_size: int = 4  # 6 × 6 = 36 patches
    width: int = 48
    layers: int = 4
    heads: int = 4
    registers: int = 4
    batch: int = 32
    lr: float = 2e-3
    weight_decay: float = 0.05
    warmup_fraction: float = 0.1
    mask_ratio: float = 0.4  # share of patches masked for the reconstruction loss
    probe_train: int = 512  # images to fit the probes on
    probe_test: int = 256  # images to score them on
    diag_samples: int = 16  # held-out images diagnosed per run
    checkpoints: int = 4  # checkpoints per run (resumability)

    def __post_init__(self) -> None:
        unknown = [v for v in self.variants if v not in VARIANT_SPECS]
        if unknown or not self.variants:
            raise InputError(f"unknown variant(s) {unknown}; choose from {', '.join(VARIANT_SPECS)}")
        if len(set(self.variants)) != len(self.variants):
            raise InputError("each variant may appear once")
        check_int("--seeds", self.seeds, 1)
        if isinstance(self.minutes, bool) or not self.minutes > 0:
            raise InputError(f"--minutes must be > 0, got {self.minutes!r}")
        if self.image_size % self.patch_size or self.width % self.heads:
            raise InputError("image size must be a multiple of the patch size and width a multiple of heads")
        if not 0 < self.train_fraction <= 1 or not 0 < self.mask_ratio < 1:
            raise InputError("train_fraction must be in (0, 1] and mask_ratio in (0, 1)")

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


# ----------------------------------------------------------------------------- building and training
def shapes_config(cfg: VitExperimentConfig, seed: int) -> ShapesConfig:
    """The dataset of one seed; object radii scale with the image (4–9 px at 32 px)."""
    scale = cfg.image_size / 32
    return ShapesConfig(image_size=cfg.image_size, min_radius=4.0 * scale, max_radius=9.0 * scale, seed=seed)


def build(cfg: VitExperimentConfig, variant: str, seed: int) -> SinklabViT:
    """The model of one run: backbone weights from ``seed`` (identical across variants), then the variant."""
    torch.manual_seed(seed)
    model = SinklabViT(small_vit_config(cfg.image_size, cfg.patch_size, cfg.width, cfg.layers, cfg.heads),
                       num_classes=ShapesConfig().classes)
    spec = VARIANT_SPECS[variant]
    if spec is not None:
        overrides: dict[str, Any] = {"registers": cfg.registers} if "registers" in spec else {}
        apply_vit_variant(model, spec, seed=seed + 1000, **overrides)
    return model


def patchify(images: Tensor, patch: int) -> Tensor:
    """``[B, 3, H, W]`` → ``[B, P, patch²·3]`` in the ViT's row-major patch order."""
    b, c, h, w = images.shape
    x = images.view(b, c, h // patch, patch, w // patch, patch)  # (B, C, gh, p, gw, p)
    return x.permute(0, 2, 4, 3, 5, 1).reshape(b, (h // patch) * (w // patch), patch * patch * c)


def _optimizer(model: nn.Module, cfg: VitExperimentConfig) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "sinklab_registers" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "sinklab_registers" not in n)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))


def _lr(cfg: VitExperimentConfig, step: int, steps: int) -> float:
    warm = max(1, int(cfg.warmup_fraction * steps))
    return cfg.lr * min(1.0, (step + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(1.0, step / steps)))


def train_step(model: SinklabViT, opt: torch.optim.Optimizer, cfg: VitExperimentConfig, data: ShapesDataset,
               seed: int, step: int, steps: int) -> float:
    """One optimiser step on batch ``step`` (deterministic in ``(seed, step)``); returns the loss."""
    x, _, y = data.batch(step * cfg.batch, cfg.batch)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    masked = torch.rand(cfg.batch, cfg.num_patches, generator=gen) < cfg.mask_ratio  # (B, P)
    logits, pixels, _ = model(x, bool_masked_pos=masked)
    target = patchify(x, cfg.patch_size)
    loss = nn.functional.cross_entropy(logits, y) + ((pixels - target) ** 2)[masked].mean()
    for group in opt.param_groups:
        group["lr"] = _lr(cfg, step, steps)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return float(loss.detach())


def measure_throughput(cfg: VitExperimentConfig, warmup: int = 1, timed: int = 3) -> float:
    """Seconds per training step of the heaviest requested variant (registers and gate, if requested)."""
    heavy = max(cfg.variants, key=lambda v: (("registers" in v) + ("gated" in v), v))
    model = build(cfg, heavy, 0)
    opt = _optimizer(model, cfg)
    data = ShapesDataset(shapes_config(cfg, 0), "train")
    model.train()
    for s in range(warmup):
        train_step(model, opt, cfg, data, 0, s, warmup + timed)
    start = time.perf_counter()
    for s in range(warmup, warmup + timed):
        train_step(model, opt, cfg, data, 0, s, warmup + timed)
    return (time.perf_counter() - start) / timed


# ----------------------------------------------------------------------------- checkpoints
def _save_checkpoint(run_dir: Path, model: nn.Module, opt: torch.optim.Optimizer, step: int, losses: list) -> None:
    with atomic_dir(run_dir / "checkpoint", replace=True) as tmp:
        save_vit(model, tmp)
        torch.save({"step": step, "optimizer": opt.state_dict(), "losses": losses}, tmp / "train_state.pt")


def _load_checkpoint(run_dir: Path, model: nn.Module, opt: torch.optim.Optimizer) -> tuple[int, list]:
    from safetensors.torch import load_file

    ckpt = run_dir / "checkpoint"
    if not (ckpt / "train_state.pt").is_file():
        return 0, []
    model.load_state_dict(load_file(str(ckpt / "model.safetensors")), strict=True)
    state = torch.load(ckpt / "train_state.pt", weights_only=True)
    opt.load_state_dict(state["optimizer"])
    return int(state["step"]), list(state["losses"])


# ----------------------------------------------------------------------------- evaluation
def _diagnose(cfg: VitExperimentConfig, model: SinklabViT, variant: str) -> tuple[dict, Diagnosis]:
    regs = cfg.registers if "registers" in variant else 0
    test = ShapesDataset(shapes_config(cfg, 0), "test")
    x, _, _ = test.batch(0, cfg.diag_samples)
    labels = token_labels(cfg.num_patches, regs)
    n_tok = len(labels)
    d = diagnose_inputs(model.backbone, [{"pixel_values": x}], [labels] * cfg.diag_samples, edits=False,
                        special={"cls": "[CLS]"}, map_len=n_tok, candidates=(0,),
                        meta={"model": f"sinklab-vit:{variant}", "model_type": "vit"})
    scan = d.scan
    last = scan.hidden_norm[:, -1].double()  # (S, T) norms of the last block's outputs
    flags = metrics.high_norm_tokens(last, scan.token_mask, k=scan.meta["thresholds"]["high_norm_k"])  # (S, T)
    roles = ["cls"] + ["register"] * regs + ["patch"] * cfg.num_patches
    high = Counter(roles[t] for s, t in flags.nonzero().tolist())
    records = d.records
    ratio = {k: _median([r.value_norm_ratio_out for r in records if r.kind == k]) for k in ("nop", "broadcast")}
    maps = scan.attention_maps  # (L, H, T, T) of image 0
    summary = {
        "sinks_per_image": len(records) / cfg.diag_samples,
        "by_class": {k: sum(r.kind == k for r in records) / cfg.diag_samples for k in ("nop", "broadcast", "unclassified")},
        "by_role": dict(Counter(f"{r.role}:{r.kind}" for r in records)),
        "on_registers_per_image": sum(r.role == "register" for r in records) / cfg.diag_samples,
        "on_cls_per_image": sum(r.role == "cls" for r in records) / cfg.diag_samples,
        "on_patches_per_image": sum(r.role == "patch" for r in records) / cfg.diag_samples,
        "per_layer": [{"layer": p["layer"], "sink_pct": p["sink_pct"], "counts": p["counts"]} for p in d.per_layer()],
        "median_value_ratio_out": ratio,
        "high_norm_per_image": {k: high.get(k, 0) / cfg.diag_samples for k in ("cls", "register", "patch")},
        "output_norms": {"patch": last[:, 1 + regs :].flatten().tolist(), "register": last[:, 1 : 1 + regs].flatten().tolist(),
                         "cls": last[:, 0].tolist()},
        "column_mass_image0": maps.mean(dim=(1, 2)).tolist() if maps is not None else None,  # (L, T) mean over heads
        "learned_sink_mass": float(scan.learned_sink_mass.mean()),
    }
    return summary, d


def _median(values: list[float]) -> float | None:
    vals = sorted(v for v in values if v == v)
    return vals[len(vals) // 2] if vals else None


def run_one(cfg: VitExperimentConfig, variant: str, seed: int, steps: int, run_dir: Path,
            progress: Callable[[int], None] | None = None) -> dict:
    """Train (resuming from a checkpoint if any), evaluate and diagnose one (variant, seed); write result.json."""
    run_dir.mkdir(parents=True, exist_ok=True)
    model = build(cfg, variant, seed)
    opt = _optimizer(model, cfg)
    start, losses = _load_checkpoint(run_dir, model, opt)
    data = ShapesDataset(shapes_config(cfg, seed), "train")
    every = max(1, steps // max(1, cfg.checkpoints))
    model.train()
    t0 = time.perf_counter()
    for step in range(start, steps):
        losses.append(train_step(model, opt, cfg, data, seed, step, steps))
        if progress is not None:
            progress(step + 1)
        if (step + 1) % every == 0 and step + 1 < steps:
            _save_checkpoint(run_dir, model, opt, step + 1, losses)
    seconds = time.perf_counter() - t0
    model.eval()
    save_vit(model, run_dir / "final")
    shapes = shapes_config(cfg, seed)
    probes = evaluate_probes(model.backbone, ShapesDataset(shapes, "probe"), ShapesDataset(shapes, "test"),
                             cfg.probe_train, cfg.probe_test, cfg.patch_size)
    diag, diagnosis = _diagnose(cfg, model, variant)
    tail = losses[-max(1, len(losses) // 10):]
    result = {"variant": variant, "seed": seed, "steps": steps, "resumed_from": start, "train_seconds": seconds,
              "final_loss": sum(tail) / len(tail), "probes": probes, "diagnosis": diag,
              "recommendation": diagnosis.recommendation.to_json()}  # type: ignore[union-attr]  # always set
    write_json(run_dir / "result.json", result)
    return result


# ----------------------------------------------------------------------------- the whole experiment
def _plan(cfg: VitExperimentConfig, out: Path) -> dict:
    path = out / "plan.json"
    if path.exists():
        plan = json.loads(path.read_text())
        if plan["config"] != asdict(cfg):
            changed = sorted(k for k in plan["config"] if plan["config"][k] != asdict(cfg).get(k))
            raise InputError(f"{out} holds a run with different settings ({', '.join(changed)}); "
                             "resume with the same options or choose a new --out")
        return plan
    sec = measure_throughput(cfg)
    runs = len(cfg.variants) * cfg.seeds
    steps = max(5, int(cfg.minutes * 60 * cfg.train_fraction / (runs * sec)))
    plan = {"config": asdict(cfg), "seconds_per_step": sec, "steps": steps, "runs": runs,
            "torch_threads": torch.get_num_threads()}
    write_json(path, plan)
    return plan


def run_experiment(cfg: VitExperimentConfig, out: str | Path,
                   progress: Callable[[str, int, int], None] | None = None) -> dict:
    """Run (or resume) the whole experiment into ``out``; returns the summary also written to ``results.json``.

    ``progress(description, completed, total)`` is called as training advances.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    plan = _plan(cfg, out)
    steps = plan["steps"]
    results = []
    for seed in range(cfg.seeds):
        for variant in cfg.variants:
            run_dir = _run_dir(out, variant, seed)
            done = run_dir / "result.json"
            name = f"{variant} seed {seed}"
            if done.exists():
                results.append(json.loads(done.read_text()))
                if progress:
                    progress(name, steps, steps)
                continue
            cb = (lambda s, name=name: progress(name, s, steps)) if progress else None
            results.append(run_one(cfg, variant, seed, steps, run_dir, cb))
    summary = summarise(cfg, plan, results)
    write_json(out / "results.json", summary)
    write_text(out / "table.md", summary["table_md"])
    return summary


def experiment_runs(cfg: VitExperimentConfig, out: str | Path) -> list[dict]:
    """The finished runs' ``result.json`` in ``out`` (seed-major, variants in ``cfg`` order): what the figures draw."""
    return [json.loads((_run_dir(Path(out), variant, seed) / "result.json").read_text())
            for seed in range(cfg.seeds) for variant in cfg.variants
            if (_run_dir(Path(out), variant, seed) / "result.json").exists()]


def _run_dir(out: Path, variant: str, seed: int) -> Path:
    return out / "runs" / f"{variant.replace('+', '-')}_s{seed}"


_COLUMNS = [
    ("mIoU", lambda r: 100 * r["probes"]["miou"]),
    ("pixel acc", lambda r: 100 * r["probes"]["pixel_accuracy"]),
    ("cls acc [CLS]", lambda r: 100 * r["probes"]["cls_accuracy"]),
    ("cls acc pooled", lambda r: 100 * r["probes"]["pooled_accuracy"]),
    ("sinks/img", lambda r: r["diagnosis"]["sinks_per_image"]),
    ("NOP", lambda r: r["diagnosis"]["by_class"]["nop"]),
    ("broadcast", lambda r: r["diagnosis"]["by_class"]["broadcast"]),
    ("unclass.", lambda r: r["diagnosis"]["by_class"]["unclassified"]),
    ("on registers", lambda r: r["diagnosis"]["on_registers_per_image"]),
    ("high-norm patches/img", lambda r: r["diagnosis"]["high_norm_per_image"]["patch"]),
    ("loss", lambda r: r["final_loss"]),
]


def _mean_std(values: list[float]) -> tuple[float, float]:
    t = torch.tensor(values, dtype=torch.float64)
    return float(t.mean()), float(t.std()) if len(values) > 1 else 0.0


def summarise(cfg: VitExperimentConfig, plan: dict, results: list[dict]) -> dict:
    """Mean ± std over seeds of every column, per variant, and the markdown table."""
    rows = {}
    for variant in cfg.variants:
        runs = [r for r in results if r["variant"] == variant]
        rows[variant] = {name: _mean_std([fn(r) for r in runs]) for name, fn in _COLUMNS}
        rows[variant]["recommendation"] = Counter(r["recommendation"]["fix"] for r in runs).most_common(1)[0][0]
    header = "| variant | " + " | ".join(name for name, _ in _COLUMNS) + " | recommends |"
    sep = "|---|" + "---:|" * len(_COLUMNS) + "---|"
    lines = [header, sep]
    for variant, row in rows.items():
        cells = [f"{row[name][0]:.2f} ± {row[name][1]:.2f}" for name, _ in _COLUMNS]
        lines.append(f"| {variant} | " + " | ".join(cells) + f" | {row['recommendation']} |")
    note = (f"\n{cfg.seeds} seed(s), {plan['steps']} steps each (batch {cfg.batch}, {plan['seconds_per_step']:.3f} s/step "
            f"measured), ViT {cfg.layers}×{cfg.width} ({cfg.heads} heads), {cfg.image_size}² images, patch "
            f"{cfg.patch_size}, {cfg.registers} registers. Probes: ridge on {cfg.probe_train} images, scored on "
            f"{cfg.probe_test}. Sinks: diagnose on {cfg.diag_samples} held-out images (column mass > 0.3).\n")
    return {"plan": plan, "rows": rows, "table_md": "\n".join(lines) + "\n" + note}
