"""Figures of the ViT mitigation experiment (matplotlib, Agg): sink classes per layer, attention maps, norms."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from .figures import save_png

__all__ = ["experiment_figures", "write_experiment_figures"]

_KINDS = (("nop", "tab:blue"), ("broadcast", "tab:orange"), ("unclassified", "tab:gray"))


def _sink_classes(results: list[dict], variants: list[str]):
    fig, axes = plt.subplots(1, len(variants), figsize=(3.2 * len(variants), 2.8), sharey=True, squeeze=False)
    for ax, variant in zip(axes[0], variants):
        runs = [r for r in results if r["variant"] == variant]
        layers = len(runs[0]["diagnosis"]["per_layer"])
        bottom = [0.0] * layers
        for kind, colour in _KINDS:
            vals = [sum(r["diagnosis"]["per_layer"][i]["counts"][kind] for r in runs) / len(runs) for i in range(layers)]
            ax.bar(range(layers), vals, bottom=bottom, color=colour, label=kind)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_title(variant, fontsize=9)
        ax.set_xlabel("layer")
    axes[0][0].set_ylabel("sinks (per run, all images)")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle("sink classes per layer (mean over seeds)", fontsize=10, y=1.04)
    return fig


def _attention_maps(results: list[dict], variants: list[str], cfg):
    chosen = [r for r in results if r["seed"] == 0 and r["variant"] in variants and r["diagnosis"]["column_mass_image0"]]
    if not chosen:
        return None
    side = cfg.image_size // cfg.patch_size
    layers = len(chosen[0]["diagnosis"]["column_mass_image0"])
    fig, axes = plt.subplots(len(chosen), layers, figsize=(2.1 * layers, 2.2 * len(chosen)), squeeze=False)
    for row, r in zip(axes, chosen):
        regs = cfg.registers if "registers" in r["variant"] else 0
        for layer, ax in enumerate(row):
            cm = r["diagnosis"]["column_mass_image0"][layer]
            patches = cm[1 + regs :]
            ax.imshow([patches[i * side : (i + 1) * side] for i in range(side)], cmap="magma", vmin=0,
                      vmax=max(1e-6, max(cm)))
            extra = f"CLS {cm[0]:.2f}" + (f", regs {sum(cm[1:1 + regs]):.2f}" if regs else "")
            ax.set_title(f"{r['variant']} L{layer}\n{extra}", fontsize=7)
            ax.set_xticks([])
            ax.set_yticks([])
    fig.suptitle("attention received by each patch (column mass, mean over heads), test image 0, seed 0", fontsize=9)
    return fig


def _norms(results: list[dict], variants: list[str]):
    fig, axes = plt.subplots(1, len(variants), figsize=(3.2 * len(variants), 2.6), sharex=True, squeeze=False)
    top = max(max(r["diagnosis"]["output_norms"]["patch"] + r["diagnosis"]["output_norms"]["register"] or [1.0])
              for r in results)
    bins = [top * i / 40 for i in range(41)]
    for ax, variant in zip(axes[0], variants):
        runs = [r for r in results if r["variant"] == variant]
        patch = [v for r in runs for v in r["diagnosis"]["output_norms"]["patch"] if math.isfinite(v)]
        regs = [v for r in runs for v in r["diagnosis"]["output_norms"]["register"] if math.isfinite(v)]
        ax.hist(patch, bins=bins, color="tab:blue", alpha=0.7, label="patches", density=True)
        if regs:
            ax.hist(regs, bins=bins, color="tab:red", alpha=0.7, label="registers", density=True)
        ax.set_yscale("log")
        ax.set_title(variant, fontsize=9)
        ax.set_xlabel("‖x‖ at the last block's output")
        ax.legend(fontsize=7)
    fig.suptitle("output-norm histograms (held-out images, all seeds)", fontsize=10, y=1.04)
    return fig


def experiment_figures(summary: dict, results: list[dict], cfg) -> dict:
    """``{"sink_classes": …, "attention_maps": …, "output_norms": …}`` figures."""
    variants = list(cfg.variants)
    figs = {"sink_classes": _sink_classes(results, variants), "output_norms": _norms(results, variants)}
    maps = _attention_maps(results, [v for v in variants if v in ("baseline", "registers", "gated+registers")]
                           or variants[:2], cfg)
    if maps is not None:
        figs["attention_maps"] = maps
    return figs


def write_experiment_figures(summary: dict, results: list[dict], cfg, out: str | Path) -> list[Path]:
    """Save :func:`experiment_figures` as ``<name>.png`` in ``out`` (``results``: ``experiment_runs(cfg, out)``)."""
    return [save_png(fig, Path(out) / f"{stem}.png", bbox_inches="tight")
            for stem, fig in experiment_figures(summary, results, cfg).items()]
