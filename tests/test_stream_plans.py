"""The stream's typed plans and views: what each forward plans for its layers, checked against closed forms."""

from __future__ import annotations

import torch
from tiny_models import build

from sinklab.stream import SinkCache
from sinklab.stream.scored import ScoredView
from sinklab.stream.state import ChunkPlan, DecodePlan, UniformStepPlan
from sinklab.stream.views import ChunkView, DecodeView


def test_decode_plans_give_the_packed_ring_its_slots_and_rows_to_keep():
    """Three rows past 4 anchored slots: row 0 anchored (slot 1), row 1 padding (slot 5), row 2 a window token
    (slot 7). The ring slot is ``slot − 4`` clamped at 0; rows 0 and 1 keep their ring slot as it was."""
    plan = DecodePlan(torch.arange(3), torch.tensor([1, 5, 7]), torch.tensor([True, False, True]),
                      torch.tensor([True, False, False]), anchor_capacity=4)
    assert plan.ring_slot.tolist() == [0, 1, 3]
    assert plan.ring_keep is not None and plan.ring_keep[:, 0, 0].tolist() == [True, True, False]
    assert plan.ring_keep is plan.ring_keep and plan.any_anchored is True  # worked out once, shared by the layers
    free = DecodePlan(torch.arange(2), torch.tensor([6, 4]), torch.ones(2, dtype=torch.bool),
                      torch.zeros(2, dtype=torch.bool), anchor_capacity=4)
    assert free.ring_keep is None and free.any_anchored is False and free.ring_slot.tolist() == [2, 0]
    assert UniformStepPlan(torch.tensor([6]), anchor_capacity=4).ring_slot.tolist() == [2]


def test_each_forward_plans_its_own_kind_and_a_chunk_layout_is_worked_out_once():
    """A 9-token prefill with S = 2 sinks and W = 4: one :class:`ChunkView` whose layout every layer shares (the
    anchored-key shift worked out once for both layers), against the closed form of positions by cache slot;
    then a decode step plans one slot for the row (:class:`UniformStepPlan`, :class:`DecodeView`)."""
    model = build("llama-gqa")
    calls = []
    shift = ChunkView._anchor_shift

    def counted(self, idx):
        calls.append(1)
        return shift(self, idx)

    cache = SinkCache(model, num_sinks=2, window=4)
    ChunkView._anchor_shift = counted
    try:
        with torch.no_grad():
            model(input_ids=torch.arange(3, 12)[None], cache=cache)
    finally:
        ChunkView._anchor_shift = shift
    view, plan = cache.state.view, cache.state.plan
    assert isinstance(view, ChunkView) and isinstance(plan, ChunkPlan)
    assert len(calls) == 1 and model.config.num_hidden_layers == 2
    layout = view.layout()
    # Query i ≥ 2 holds both sinks (A = 2) and i − 1 free tokens; sink j is at slot distance 1 − j + min(4, i − 1)
    # from it, so it is re-rotated by i − 1 − min(4, i − 1): 0 up to query 5, then 1, 2, 3.
    expected = torch.tensor([0, 0, 0, 0, 0, 0, 1, 2, 3])[:, None].expand(9, 2)
    # The anchored keys: the buffer's two (empty) anchored slots, then the chunk's two sinks (keys 6 and 7).
    assert view.anchor_idx.tolist() == [0, 1, 6, 7]
    seen = layout.anchor_visible[0, 0]  # (C, 4): query i sees sink j when j ≤ i, the empty slots never
    assert seen.tolist() == [[False, False] + [j <= i for j in range(2)] for i in range(9)]
    assert torch.equal(layout.anchor_shift[0, :, 2:][seen[:, 2:]], expected[seen[:, 2:]])
    # The sinks moved out of the plain keys; the empty buffer's slots and the sinks drop out of the keys kept:
    # query i sees chunk token j (2 ≤ j ≤ i) while fewer than W = 4 free tokens separate them.
    assert layout.keep.tolist() == list(range(6 + 2, 6 + 9))
    want = [[2 <= j <= i and i - j < 4 for j in range(2, 9)] for i in range(9)]
    assert layout.visible[0].tolist() == want and not layout.causal
    with torch.no_grad():
        model(input_ids=torch.tensor([[5]]), cache=cache)
    view, plan = cache.state.view, cache.state.plan
    assert isinstance(view, DecodeView) and isinstance(plan, UniformStepPlan)
    assert plan.slot.tolist() == [2 + (8 - 1) % 4]  # the 8th free token: its ring slot after the 2 anchored ones
    assert view.q_v.tolist() == [[9]] and view.visible.all()
    cache.close()


def test_a_scored_policy_plans_a_scored_view():
    """A score-based policy's forward is a :class:`ScoredView`: each new column's stream index (-1: padding)."""
    model = build("llama-gqa")
    cache = SinkCache(model, num_sinks=1, window=12, policy="tova")
    mask = torch.tensor([[0, 1, 1, 1]])
    with torch.no_grad():
        model(input_ids=torch.tensor([[0, 3, 4, 5]]), attention_mask=mask, cache=cache)
    view = cache.state.view
    assert isinstance(view, ScoredView)
    assert view.sidx.tolist() == [[-1, 0, 1, 2]] and view.q_v[0, 1:].tolist() == [0, 1, 2]
    cache.close()


def test_a_packed_rings_masked_decode_step_equals_each_row_streamed_alone():
    """A left-padded batch decodes through the per-row :class:`DecodePlan` (the packed ring reads its ring slots and
    the rows to keep from it): row 0 (one real prompt token) decodes its second sink while row 1 decodes a window
    token, so one row keeps its ring slot. Each row's logits equal the same row streamed alone, up to eviction and
    past it (S = 2, W = 4: six steps)."""
    model = build("llama-gqa")
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, 64, (2, 4), generator=g)
    follow = torch.randint(0, 64, (6, 2), generator=g)
    mask = torch.ones(2, 4, dtype=torch.long)
    mask[0, :3] = 0
    cache = SinkCache(model, num_sinks=2, window=4, kv_bits=4)
    got = []
    with torch.no_grad():
        model(input_ids=prompt, attention_mask=mask, cache=cache)
        for step in follow:
            mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
            got.append(model(input_ids=step[:, None], attention_mask=mask, cache=cache).logits[:, -1])
            assert isinstance(cache.state.plan, DecodePlan)
            if len(got) == 1:
                assert cache.state.plan.any_anchored and cache.state.plan.ring_keep[:, 0, 0].tolist() == [True, False]
    cache.close()
    for row, start in ((0, 3), (1, 0)):
        alone = SinkCache(model, num_sinks=2, window=4, kv_bits=4)
        with torch.no_grad():
            model(input_ids=prompt[row:row + 1, start:], cache=alone)
            for i, step in enumerate(follow):
                logits = model(input_ids=step[row].view(1, 1), cache=alone).logits[0, -1]
                torch.testing.assert_close(got[i][row], logits, rtol=1e-4, atol=1e-5)
        alone.close()
