"""How to add a metric: a pure tensor function and one ``MetricRow`` in ``sinklab.registry.REGISTRY``.

The scan's JSON, the CLI table and the HTML report loop over the registry, so the new row appears in all of them.
This example adds "how far the first token's value norm stands out", checks it against a direct computation on
the scan's own tensors, and removes the row again (``python docs/examples/add_metric.py``).
"""

import torch

import sinklab
from sinklab.models import tiny_llama
from sinklab.registry import REGISTRY, MetricRow
from sinklab.texts import default_texts


def first_value_norm_ratio(r) -> torch.Tensor:
    """[L]: position 0's head-space value norm over the mean of the other positions, averaged over samples and
    heads. ``r.value_norm`` is ``(S, L, H, T)`` with NaN where a sample has no token."""
    v = r.value_norm.double()
    return (v[..., 0] / v[..., 1:].nanmean(-1)).nanmean(dim=(0, 2))


row = MetricRow("first_value_norm_ratio", "‖v₀‖/mean", "position 0's value norm over the others' mean",
                first_value_norm_ratio)
REGISTRY.append(row)
try:
    model = tiny_llama(num_hidden_layers=2)
    tokenizer = sinklab.load_model("builtin:tiny-lm").tokenizer
    result = sinklab.scan(model, tokenizer, default_texts()[:2], seq_len=32, samples=2)
    table = result.per_layer()
    assert "first_value_norm_ratio" in table and "first_value_norm_ratio" in result.to_json()["per_layer"]
    # an independent computation: a loop over samples and heads in float64
    v = result.value_norm.double()
    for layer, got in enumerate(table["first_value_norm_ratio"]):
        ratios = [v[s, layer, h, 0] / v[s, layer, h, 1:].nanmean() for s in range(v.shape[0]) for h in range(v.shape[2])]
        want = torch.stack(ratios).nanmean().item()
        assert abs(got - want) <= 1e-9 * abs(want), (layer, got, want)
    print("per layer:", [round(x, 3) for x in table["first_value_norm_ratio"]])
finally:
    REGISTRY.remove(row)
