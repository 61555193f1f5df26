"""Pure rules of the P0 sink circuit: amplification blocks, where the sink sits, the training stage.

Nothing here touches a model; every function takes per-layer numbers (lists or tensors) so the rules can
be tested on hand-made series and shared by :func:`sinklab.circuit`, the checkpoint sweep and
:class:`sinklab.SinkMonitor`. Layers are 0-based decoder blocks; ``r`` arrays have ``L + 1`` entries,
index 0 being the embeddings (the input of block 0), index ``l + 1`` the output of block ``l``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = [
    "AMPLIFICATION_RULE",
    "LAYER_SINK_THRESHOLD",
    "LOCATION_RULE",
    "STAGES",
    "STAGE_RULE",
    "amplification_blocks",
    "amplification_layer",
    "classify_stage",
    "first_amplification_run",
    "shallow_blocks",
    "sink_layers",
    "sink_location",
    "stage_amplification",
]

#: Stages of the P0 sink's emergence (Peng et al. 2026, arXiv:2603.06591), in training order.
STAGES = ("no sink", "forming in deep layers", "spread over the first positions", "settled on position 0")

#: A layer "has a sink on position p" when Sink_p^ε of that layer (percent of its heads) reaches this.
LAYER_SINK_THRESHOLD = 25.0

AMPLIFICATION_RULE = ("amplification_layer = argmax_l (r_l − r_{l−1}) over decoder blocks l (r_{−1}: embeddings); "
                      "amplification blocks: every block with r_l ≥ 2·r_{l−1} and r_l − r_{l−1} ≥ 1, "
                      "r_l = ‖x₀‖ / median_{i>0} ‖x_i‖ after block l (mean over samples)")

LOCATION_RULE = ("over the layers where some early position p ∈ {0..P−1} has Sink_p ≥ τ: mean Sink_p per position; "
                 "'position k' if position k's mean is ≥ 2× every other early position's, else 'spread'; "
                 "'none' if no layer reaches τ")

STAGE_RULE = ("no sink: no layer has Sink_p ≥ τ for any early position p; spread over the first positions: the sink "
              "is not on position 0 alone (location 'spread' or 'position k', k ≥ 1); settled on position 0: location "
              "'position 0', the first layer with Sink_0 ≥ τ is one of the first S blocks and so is the first "
              "amplification block (not required where no block doubles r: an argmax of small rises is noise); forming "
              "in deep layers: "
              "location 'position 0' otherwise. S = max(2, ⌈L/8⌉)")


def _finite(x: float) -> float:
    return float(x) if x is not None and math.isfinite(float(x)) else math.nan


def amplification_layer(ratio: Sequence[float]) -> int | None:
    """0-based block with the largest increase ``r_l − r_{l−1}``; ``ratio`` has ``L + 1`` entries (embeddings first).

    ``None`` when no increase is finite.
    """
    best, where = -math.inf, None
    for layer in range(len(ratio) - 1):
        step = _finite(ratio[layer + 1]) - _finite(ratio[layer])
        if math.isfinite(step) and step > best:
            best, where = step, layer
    return where


def amplification_blocks(ratio: Sequence[float], *, factor: float = 2.0, min_rise: float = 1.0) -> list[int]:
    """Every block where ``r`` at least doubles (``factor``) and rises by ``min_rise`` or more."""
    out = []
    for layer in range(len(ratio) - 1):
        before, after = _finite(ratio[layer]), _finite(ratio[layer + 1])
        if math.isfinite(before) and math.isfinite(after) and after >= factor * before and after - before >= min_rise:
            out.append(layer)
    return out


def stage_amplification(ratio: Sequence[float]) -> int | None:
    """The amplification the stage rule looks at: the first amplification block, ``None`` if no block doubles r.

    A model may amplify position 0 more than once (SmolLM2: blocks 1–2, then block 11); the seed's convergence
    indicator is where the circuit *first* builds the norm up. Without any doubling, the argmax of small rises
    flips between blocks from one checkpoint to the next, so the rule then ignores it.
    """
    blocks = amplification_blocks(ratio)
    return blocks[0] if blocks else None


def first_amplification_run(ratio: Sequence[float]) -> list[int]:
    """The first run of consecutive amplification blocks (e.g. ``[1, 2]``); empty if none."""
    blocks = amplification_blocks(ratio)
    run = blocks[:1]
    for b in blocks[1:]:
        if b != run[-1] + 1:
            break
        run.append(b)
    return run


def sink_layers(rates: Sequence[float], threshold: float = LAYER_SINK_THRESHOLD) -> list[int]:
    """Layers whose Sink^ε (percent of heads) reaches ``threshold``."""
    return [layer for layer, x in enumerate(rates) if _finite(x) >= threshold]


def sink_location(early: Sequence[Sequence[float]], threshold: float = LAYER_SINK_THRESHOLD) -> str:
    """Where the sink sits: ``'none'``, ``'position k'`` or ``'spread'`` (see :data:`LOCATION_RULE`).

    ``early`` is ``[P][L]``: Sink_p^ε per layer (percent) for the first ``P`` positions.
    """
    n_pos = len(early)
    n_layers = len(early[0]) if n_pos else 0
    layers = [i for i in range(n_layers) if any(_finite(early[p][i]) >= threshold for p in range(n_pos))]
    if not layers:
        return "none"
    means = [sum(max(0.0, _finite(early[p][i])) if math.isfinite(_finite(early[p][i])) else 0.0 for i in layers)
             / len(layers) for p in range(n_pos)]
    for p in range(n_pos):
        others = [m for q, m in enumerate(means) if q != p]
        if means[p] > 0 and all(means[p] >= 2.0 * m for m in others):
            return f"position {p}"
    return "spread"


def shallow_blocks(num_layers: int) -> int:
    """How many of the first blocks count as "the first blocks": ``max(2, ⌈L/8⌉)``."""
    return max(2, math.ceil(num_layers / 8))


def classify_stage(early: Sequence[Sequence[float]], amp_layer: int | None, *,
                   threshold: float = LAYER_SINK_THRESHOLD) -> dict:
    """The emergence stage of one checkpoint (see :data:`STAGE_RULE`).

    Parameters
    ----------
    early:
        ``[P][L]`` Sink_p^ε per layer in percent for the first ``P`` positions (``P ≥ 1``).
    amp_layer:
        The checkpoint's first amplification block (:func:`stage_amplification`; ``None``: not used by the rule).

    Returns
    -------
    ``{"stage", "location", "first_sink_layer", "shallow_blocks", "amplification_layer", "threshold", "rule"}``
    """
    n_layers = len(early[0])
    shallow = shallow_blocks(n_layers)
    location = sink_location(early, threshold)
    first = next(iter(sink_layers(early[0], threshold)), None)
    if location == "none":
        stage = STAGES[0]
    elif location != "position 0":
        stage = STAGES[2]
    elif first is not None and first < shallow and (amp_layer is None or amp_layer < shallow):
        stage = STAGES[3]
    else:
        stage = STAGES[1]
    return {"stage": stage, "location": location, "first_sink_layer": first, "shallow_blocks": shallow,
            "amplification_layer": amp_layer, "threshold": threshold, "rule": STAGE_RULE}
