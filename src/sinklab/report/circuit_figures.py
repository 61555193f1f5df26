"""Figures of the P0 sink circuit and of a checkpoint sweep (they take result data, never a model)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from matplotlib.figure import Figure

from .figures import plt

if TYPE_CHECKING:  # pragma: no cover
    from ..circuit import CircuitResult
    from ..circuit.sweep import SweepResult

__all__ = [
    "ablation_figure",
    "circuit_figures",
    "massive_figure",
    "norm_ratio_figure",
    "sink_map_figure",
    "sweep_figures",
]

_STAGE_COLORS = {"no sink": "#bbbbbb", "forming in deep layers": "#e0a030", "spread over the first positions": "#d05050",
                 "settled on position 0": "#3a8a3a"}


def _nan(x):
    return math.nan if x is None else x


def norm_ratio_figure(result: CircuitResult) -> Figure:
    """r_l per hidden state (line) with each block's attention / MLP / carried contribution (bars)."""
    n = result.num_layers
    fig, ax = plt.subplots(figsize=(max(6.0, 0.28 * n + 3), 3.8))
    xs = list(range(-1, n))
    ax.plot(xs, [_nan(v) for v in result.ratio], "ko-", ms=3, label="r = ‖x₀‖ / median ‖x_i‖")
    blocks = list(range(n))
    width = 0.4
    ax.bar([b - width / 2 for b in blocks], [_nan(v) for v in result.contributions["attn"]], width, color="#4a78c8",
           label="attention (c_attn)")
    ax.bar([b + width / 2 for b in blocks], [_nan(v) for v in result.contributions["mlp"]], width, color="#e07b39",
           label="MLP (c_mlp)")
    for b in result.amplification_blocks:
        ax.axvspan(b - 0.5, b + 0.5, color="#f5d76e", alpha=0.35, lw=0)
    if result.amplification_layer is not None:
        ax.axvline(result.amplification_layer, color="#c03030", ls="--", lw=1, label="amplification layer")
    ax.axhline(0, color="#999", lw=0.6)
    ax.set_xticks(xs, ["emb"] + [str(b) for b in blocks], fontsize=7)
    ax.set_xlabel("block (emb = embeddings)")
    ax.set_ylabel("in units of median ‖x_i‖")
    ax.set_title("position 0's norm ratio and what each sublayer adds along x₀", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def ablation_figure(result: CircuitResult) -> Figure:
    """Sink_0 per layer for each first-token condition."""
    fig, ax = plt.subplots(figsize=(6.0, 3.6))
    for name, cond in result.conditions.items():
        ax.plot(range(result.num_layers), [_nan(v) for v in cond["sink_rate"][0]], "o-", ms=3, label=name)
    ax.axhline(result.layer_threshold, color="#999", ls=":", lw=1, label=f"τ = {result.layer_threshold:g} %")
    ax.set_ylim(-3, 103)
    ax.set_xlabel("layer")
    ax.set_ylabel(f"Sink_0^ε % (ε={result.eps}, T={result.seq_len})")
    ax.set_title(f"first-token ablation: {result.ablation['verdict']}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def sink_map_figure(result: CircuitResult) -> Figure:
    """Layer × head attention to position 0: as tokenized, and with position 0's amplification removed / swapped."""
    panels = [("as tokenized", result.conditions["as_tokenized"]["column_mass_0"])]
    if result.causal:
        panels.append((f"x₀ scaled to r = 1 after block {result.causal['layer']}", result.causal["scale"]["column_mass_0"]))
        panels.append((f"x₀ from another first token at block {result.causal['layer']}",
                       result.causal["donor"]["column_mass_0"]))
    if result.causal_early:
        panels.append((f"x₀ scaled to r = 1 after block {result.causal_early['layer']}",
                       result.causal_early["scale"]["column_mass_0"]))
    h, n = result.num_heads, result.num_layers
    fig, axes = plt.subplots(1, len(panels), figsize=(1.2 + len(panels) * (0.9 + 0.3 * h), 1.4 + 0.22 * n),
                             squeeze=False)
    im = None
    for ax, (title, grid) in zip(axes[0], panels):
        im = ax.imshow([[_nan(v) for v in row] for row in grid], vmin=0, vmax=1, cmap="magma", aspect="auto")
        ax.set_title(title, fontsize=7)
        ax.set_xlabel("head", fontsize=7)
        ax.set_ylabel("layer", fontsize=7)
    fig.colorbar(im, ax=list(axes[0]), label="mean attention to position 0", fraction=0.05)  # type: ignore[arg-type]
    return fig


def causal_figure(result: CircuitResult) -> Figure | None:
    """Sink_0 per layer with and without position 0's amplification (the causal patches)."""
    if not result.causal:
        return None
    c = result.causal
    fig, ax = plt.subplots(figsize=(6.0, 3.6))
    ax.plot(range(result.num_layers), [_nan(v) for v in result.conditions["as_tokenized"]["sink_rate"][0]], "ko-", ms=3,
            label="as tokenized")
    ax.plot(range(result.num_layers), [_nan(v) for v in c["scale"]["sink_rate_0"]], "s--", ms=3,
            label=f"x₀ scaled to r = 1 (Δloss {_nan(c['scale']['delta_loss']):+.3f})")
    ax.plot(range(result.num_layers), [_nan(v) for v in c["donor"]["sink_rate_0"]], "^--", ms=3,
            label=f"x₀ from first_swapped (Δloss {_nan(c['donor']['delta_loss']):+.3f})")
    ax.axvline(c["layer"], color="#c03030", lw=1, ls=":")
    e = result.causal_early
    if e:
        ax.plot(range(result.num_layers), [_nan(v) for v in e["scale"]["sink_rate_0"]], "v-.", ms=3,
                label=f"x₀ scaled to r = 1 after block {e['layer']} (Δloss {_nan(e['scale']['delta_loss']):+.3f})")
        ax.axvline(e["layer"], color="#3050c0", lw=1, ls=":")
    ax.set_ylim(-3, 103)
    ax.set_xlabel("layer")
    ax.set_ylabel("Sink_0^ε %")
    ax.set_title(f"causal check: patch after block {c['layer']}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def massive_figure(result: CircuitResult) -> Figure:
    """Largest |activation| per hidden state; filled markers where the largest sits on position 0."""
    fig, ax = plt.subplots(figsize=(6.0, 3.4))
    xs = list(range(-1, result.num_layers))
    vals = [m["max_abs"] for m in result.massive]
    ax.plot(xs, vals, "-", color="#777")
    for x, m in zip(xs, result.massive):
        ax.plot(x, m["max_abs"], "o", color="#c03030" if m["max_position"] == 0 else "white", mec="#c03030", ms=5)
    ax.plot(xs, [m["median_abs"] for m in result.massive], ":", color="#4a78c8", label="median |a|")
    ax.set_yscale("log")
    ax.set_xticks(xs, ["emb"] + [str(b) for b in range(result.num_layers)], fontsize=7)
    ax.set_xlabel("block")
    ax.set_ylabel("max |a|")
    ax.set_title("largest activation per hidden state (filled: on position 0)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def circuit_figures(result: CircuitResult) -> dict[str, Figure]:
    """All circuit figures keyed by file stem."""
    figs = {"norm_ratio": norm_ratio_figure(result), "ablation": ablation_figure(result),
            "sink_map": sink_map_figure(result), "causal": causal_figure(result), "massive": massive_figure(result)}
    return {k: v for k, v in figs.items() if v is not None}


# ---------------------------------------------------------------------------------------------- sweep
def sweep_figures(sweep: SweepResult) -> dict[str, Figure]:
    """Emergence across checkpoints: amplification layer, Sink_0 per layer, where the sink sits — vs step."""
    ok = [c for c in sweep.checkpoints if c.get("error") is None]
    figs: dict[str, Figure] = {}
    if not ok:
        return figs
    steps = [c["step"] for c in ok]
    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    ax.plot(steps, [_nan(c["amplification_layer"]) for c in ok], "k-", lw=0.8)
    for c in ok:
        ax.plot(c["step"], _nan(c["amplification_layer"]), "o", color=_STAGE_COLORS.get(c["stage"], "k"), ms=6)
    for stage, color in _STAGE_COLORS.items():
        ax.plot([], [], "o", color=color, label=stage)
    ax.set_xlabel("training step")
    ax.set_ylabel("amplification layer")
    n_blocks = len(ok[0]["sink_rate"][0])
    ax.set_yticks(range(n_blocks))
    ax.set_ylim(-0.5, n_blocks - 0.5)
    ax.set_title("where position 0 is amplified (colour: stage)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    figs["sweep_amplification"] = fig

    n_layers = len(ok[0]["sink_rate"][0])
    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    for layer in range(n_layers):
        ax.plot(steps, [_nan(c["sink_rate"][0][layer]) for c in ok], "o-", ms=3, label=f"layer {layer}")
    ax.set_ylim(-3, 103)
    ax.set_xlabel("training step")
    ax.set_ylabel("Sink_0^ε %")
    ax.set_title("first-token sink rate per layer vs step", fontsize=9)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    figs["sweep_sink_layers"] = fig

    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    for p in range(len(ok[0]["sink_rate"])):
        mean = [sum(_nan(v) for v in c["sink_rate"][p]) / n_layers for c in ok]
        ax.plot(steps, mean, "o-", ms=3, label=f"position {p}")
    ax.set_ylim(-3, 103)
    ax.set_xlabel("training step")
    ax.set_ylabel("Sink_p^ε %, mean over layers")
    ax.set_title("where the sink sits", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    figs["sweep_location"] = fig
    return figs
