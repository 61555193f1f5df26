"""The rounding drift of a score-based stream's kept keys: the keys are stored as received and rotated once, from
there, by the positions they have moved, so after any number of eviction rounds and re-bases every held key stays
within one float32 rounding of the key the cache received rotated once, in float64 — the same bound after 1,200
tokens as after 300 (benchmarks/scored_drift.py measures the same over a 100,000-token stream)."""

from __future__ import annotations

import pytest
import torch

from sinklab.models import tiny_llama
from sinklab.rope import rotate
from sinklab.stream import SinkCache

#: Max absolute error allowed on a held key: about two float32 roundings of the tiny model's keys (of order one).
TOLERANCE = 2.5e-7


def _drift(policy: str, tokens: int, rebase_every: int | None) -> tuple[float, int, int]:
    """Max absolute drift over every key held after ``tokens`` tokens, the most positions a sink key moved (net),
    and the re-bases."""
    model = tiny_llama(seed=1)
    ids = torch.randint(0, 30000, (tokens,), generator=torch.Generator().manual_seed(3))
    inserted: dict[tuple[int, int], tuple[torch.Tensor, int]] = {}
    with torch.no_grad(), SinkCache(model, num_sinks=2, window=40, policy=policy, rebase_every=rebase_every) as cache:
        model(input_ids=ids[:1][None], cache=cache)
        for i, layer in enumerate(cache.layers):
            inserted[i, 0] = (layer.keys[0, :, 0].double(), 0)

            def watch(key_states, value_states, *args, _i=i, _update=layer.update, **kwargs):
                view = cache.state.view
                inserted[_i, int(view.sidx[0, -1])] = (key_states[0, :, -1].double(), int(view.q_v[0, -1]))
                return _update(key_states, value_states, *args, **kwargs)

            layer.update = watch
        for t in range(1, tokens):
            model(input_ids=ids[t:t + 1][None], cache=cache)
        worst, moved = 0.0, 0
        for i, layer in enumerate(cache.layers):
            for h, (row, pos) in enumerate(zip(layer.sidx[0].tolist(), layer.pos[0].tolist())):
                for slot, (s, p) in enumerate(zip(row, pos)):
                    if s < 0:
                        continue
                    key, at = inserted[i, s]
                    exact = rotate(key[h], layer.rope, torch.tensor(p - at))
                    worst = max(worst, float((layer.rotated_keys()[0, h, slot].double() - exact).abs().max()))
                    if s == 0:
                        moved = max(moved, abs(p - at))
        rebases = cache.state.rebases
    return worst, moved, rebases


@pytest.mark.parametrize("policy", ["tova", "snapkv"])
@pytest.mark.parametrize("tokens", [300, 1200])
def test_kept_keys_stay_near_their_single_float64_rotation(policy, tokens):
    worst, moved, rebases = _drift(policy, tokens, rebase_every=100)
    assert moved > 0 and rebases >= 2  # the sink keys were moved by evictions and by re-bases
    assert worst <= TOLERANCE, f"{policy}: held keys drifted {worst:.3g} from their single float64 rotation"
