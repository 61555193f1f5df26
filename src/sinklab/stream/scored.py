"""Score-based retention: each key-value head keeps its sinks, pinned spans, newest tokens and best-scored others.

Each layer (:class:`ScoredLayer`) stores ``[B, Hkv, cap, dh]`` keys and values, per slot the token's stream index
(``-1``: empty) and its key's virtual position; each head's kept tokens first, in stream order. A forward attends over
``buffer ⧺ new columns``, the policy scores every candidate (:class:`~sinklab.stream.policy.Observation`) and each
head keeps at most its budget. With ``positions="slot"`` an evicted token's later neighbours move forward by the number
evicted after them; each key is stored as received and rotated once, from there, by the positions it has moved
(:meth:`ScoredLayer.rotated_keys`): rounding does not add up. ``"original"`` keeps true positions (as kvpress does);
docs/retention.md has the whole rule.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..attention import AttendSpec, Columns, attend
from ..errors import InputError, UnsupportedModelError
from ..rope import RopeSpec, rotate
from ..variants import variant_column_logits, variant_gate
from .layer import StreamLayerBase
from .policy import Observation, ScoredPolicy
from .state import StreamBudget, buffers_that_fit
from .views import StreamCall

__all__ = ["ScoredState", "ScoredLayer", "ScoredView", "scored_attention"]

_LAST = torch.iinfo(torch.long).max


@dataclass
class ScoredView:
    """The new columns of one forward of a score-based stream: stream index ``sidx`` ``[B, C]`` (-1: padding) and
    virtual position ``q_v`` ``[B, C]``; what a query sees is worked out per layer (:func:`scored_attention`)."""

    sidx: Tensor
    q_v: Tensor

    def attend(self, call: StreamCall, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        """:func:`scored_attention` over the calling layer's ``buffer ⧺ new``, ``[B, H, C, dv]``."""
        return scored_attention(call, self, query, key, value)


class ScoredState(StreamBudget):
    """Counters and the current forward's columns for the score-based layers of one stream (they share it)."""

    scored = True
    view: ScoredView | None  # the current forward's new columns

    def __init__(self, policy: ScoredPolicy, num_sinks: int, window: int, pinned=None, start_position: int = 0,
                 rebase_every: int | None = None, rope: RopeSpec | None = None, positions: str = "slot") -> None:
        super().__init__(num_sinks, window, pinned, start_position, rebase_every, rope,
                         window_meaning=" (the tokens each head keeps besides its sinks and pinned spans)")
        self.policy = policy
        self.positions = positions
        self.set_rebase(rebase_every, self.capacity)  # kept keys reach back a whole budget

    def _allocate_rows(self, batch: int, device: torch.device) -> None:
        self.n_real, self.base = (torch.zeros(batch, dtype=torch.long, device=device) for _ in range(2))

    def begin(self, valid: Tensor, all_valid: bool = False) -> Tensor:
        """Plan a forward over ``valid`` ``[B, C]`` new columns; returns their virtual positions ``[B, C]``."""
        b, c = valid.shape
        self._rows_for(b, valid.device)
        valid = valid.to(self.device).bool()
        self._maybe_rebase(c)
        sidx = self.n_real[:, None] + valid.long().cumsum(1) - 1
        q_v = torch.where(valid, self.start_position + sidx - self.base[:, None], torch.zeros_like(sidx))
        self.view = ScoredView(torch.where(valid, sidx, torch.full_like(sidx, -1)), q_v)
        self.n_real += valid.sum(1)
        self.rows_alike = self.rows_alike and all_valid
        self.span += c
        self.columns += c
        return q_v

    def _rotate_stored(self, delta: Tensor) -> None:
        for layer in self.layers:
            layer.shift(-delta[:, None, None])

    def kept_tokens(self) -> int:
        """Tokens kept per head, the mean over this stream's layers and heads (rounded)."""
        sizes = [layer.kept_tokens().float().mean(-1).max() for layer in self.layers if layer.is_initialized]
        return int(round(float(torch.stack(sizes).mean()))) if sizes else 0

    def per_row(self) -> dict[str, Tensor]:
        """The per-row tensors (first dimension ``B``), by attribute name."""
        return {"n_real": self.n_real, "base": self.base}

    def evicted(self) -> bool:
        """Whether any head of any layer has let go of a token it saw (host read)."""
        return any(layer.evicted() for layer in self.layers)

    def drop_last(self, n: int) -> None:
        """Forget each row's last ``n`` tokens (the caller checked that no head evicted any; they are real)."""
        for layer in self.layers:
            layer.drop_last(self.n_real - n)
        self.n_real = self.n_real - n
        self.columns -= n

    # ------------------------------------------------------------------ construction
    @classmethod
    def for_stream(cls, config, num_sinks: int, window: int, pinned, rotation) -> ScoredState:
        """The state :func:`sinklab.stream.cache.build_layers` makes for one budget of ``config`` (a ``StreamConfig``)."""
        return cls(config.policy, num_sinks, window, list(pinned), config.start_position, config.rebase_every,
                   rope=rotation.cache_rope, positions=config.positions)


class ScoredLayer(StreamLayerBase):
    """One layer's score-based cache (see the module docstring); all layers of a stream share a :class:`ScoredState`."""

    is_compileable = False
    state: ScoredState
    # each kept token's key as received, stream index, key position and positions moved since (rotated once on read)
    row_buffers = ("keys", "values", "sidx", "pos", "moved")
    saved_buffers = (*row_buffers, "budgets")

    def __init__(self, state: ScoredState, rope: RopeSpec | None, budgets: list[int] | None = None,
                 sliding: int | None = None, sliding_sinks: bool = False) -> None:
        super().__init__()
        self.state = state
        self.rope = rope
        # The model's own sliding window on this layer (None: full attention), evicted first (docs/retention.md).
        self.sliding = sliding
        self.keeps_anchors = sliding is None or bool(sliding_sinks)
        self.plan_budgets = budgets  # per key-value head (a plan); None: the state's capacity for every head
        self.extra = 0  # tokens added to every head's budget by grow() before the first forward
        self.pending: tuple | None = None
        self.moving = False  # host flag: some stored key sits at another position than it was received at
        state.layers.append(self)

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        b, hkv, _, dh = key_states.shape
        budgets = [b + self.extra for b in self.plan_budgets or [self.state.capacity] * hkv]
        if len(budgets) != hkv:
            raise InputError(f"the plan gives {len(budgets)} budgets for a layer with {hkv} key-value heads")
        least = self.state.anchor_capacity + self.state.policy.recent
        if min(budgets) < least:
            raise InputError(f"a head's budget of {min(budgets)} tokens cannot hold its {self.state.anchor_capacity} "
                             f"sinks and pinned tokens plus the {self.state.policy.recent} newest tokens the "
                             f"{self.state.policy.name!r} policy always keeps; give a larger window or a smaller recent")
        self.budgets = torch.tensor(budgets, dtype=torch.long, device=key_states.device)
        cap = max(budgets)
        self.device, self.dtype = key_states.device, key_states.dtype
        with buffers_that_fit(cap):
            self.keys = key_states.new_zeros(b, hkv, cap, dh)
            self.values = value_states.new_zeros(b, hkv, cap, value_states.shape[-1])
        self.sidx = torch.full((b, hkv, cap), -1, dtype=torch.long, device=self.device)
        self.pos = torch.zeros(b, hkv, cap, dtype=torch.long, device=self.device)
        self.moved = torch.zeros_like(self.pos)
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """Return ``buffer ⧺ new`` for the attention; :meth:`keep` then cuts it back to the budgets."""
        if self.state.closed:
            raise InputError("this SinkCache was closed; create a new one")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        new = self.state.view  # planned for this forward
        assert new is not None
        sidx, q_v = new.sidx, new.q_v
        hkv = key_states.shape[1]
        keys = torch.cat([self.keys, key_states], 2)
        values = torch.cat([self.values, value_states], 2)
        c_sidx = torch.cat([self.sidx, sidx[:, None].expand(-1, hkv, -1)], 2)
        c_pos = torch.cat([self.pos, q_v[:, None].expand(-1, hkv, -1)], 2)
        c_moved = torch.cat([self.moved, torch.zeros_like(c_pos[:, :, self.moved.shape[2]:])], 2)
        self.pending = (keys, values, c_sidx, c_pos, c_moved)
        return torch.cat([self.rotated_keys(), key_states], 2), values

    def grow(self, tokens: int) -> None:
        """Raise every head's budget by ``tokens``; the buffers grow by as many empty slots."""
        if not self.is_initialized:
            self.extra += tokens
            return
        self.budgets = self.budgets + tokens

        def wider(t: Tensor, fill: int) -> Tensor:
            return torch.cat([t, t.new_full((*t.shape[:2], tokens, *t.shape[3:]), fill)], 2)

        self.keys, self.values = wider(self.keys, 0), wider(self.values, 0)
        self.sidx, self.pos, self.moved = wider(self.sidx, -1), wider(self.pos, 0), wider(self.moved, 0)

    def rotated_keys(self) -> Tensor:
        """``[B, Hkv, cap, dh]``: the stored keys at the positions they sit at now (each rotated once, in float64
        angles, from the key as received)."""
        if not self.moving or self.rope is None:
            return self.keys
        return rotate(self.keys, self.rope, self.moved)

    def keep(self, scores: Tensor, order: Tensor) -> None:
        """Cut ``buffer ⧺ new`` back to each head's budget: sinks, pinned spans and the ``recent`` newest always, then
        the highest ``scores`` ``[B, Hkv, N]`` (``order``: the candidates in stream order, empty slots last)."""
        keys, values, c_sidx, c_pos, c_moved = self.pending  # type: ignore[misc]  # stored by update()
        self.pending = None
        state, cap = self.state, self.keys.shape[2]
        present = real = c_sidx >= 0
        newest = state.n_real[:, None, None] - 1
        anchored = self.anchored(c_sidx)
        protected = real & (anchored | (c_sidx > newest - state.policy.recent))
        if self.sliding is not None:  # out of this layer's own window for every later query: gone
            real = real & (anchored | (c_sidx > newest - self.sliding))
        prio = torch.where(protected, torch.full_like(scores, float("inf")), scores.float())
        prio = torch.where(real, prio, torch.full_like(prio, float("-inf")))
        # Ties broken towards the newer token: a stable sort over the candidates newest first.
        newest_first = order.flip(-1)
        ranked = newest_first.gather(-1, torch.argsort(prio.gather(-1, newest_first), dim=-1, descending=True,
                                                       stable=True))
        rank = torch.empty_like(ranked).scatter_(-1, ranked, torch.arange(ranked.shape[-1], device=ranked.device)
                                                 .expand_as(ranked).contiguous())
        kept = real & (rank < self.budgets[None, :, None])
        idx = torch.argsort(torch.where(kept, c_sidx, torch.full_like(c_sidx, _LAST)), dim=-1, stable=True)[..., :cap]
        self.sidx = torch.where(kept.gather(-1, idx), c_sidx.gather(-1, idx), torch.full_like(idx, -1))
        pos, moved = c_pos.gather(-1, idx), c_moved.gather(-1, idx)
        dh, dv = keys.shape[-1], values.shape[-1]
        self.keys = keys.gather(2, idx[..., None].expand(-1, -1, -1, dh))
        self.values = values.gather(2, idx[..., None].expand(-1, -1, -1, dv))
        if state.positions == "slot" and self.rope is not None:
            # Each kept key moves forward by the evicted tokens after it (those that left a sliding window included).
            shift = torch.where(self.sidx >= 0, _later_count((present & ~kept).long(), order).gather(-1, idx),
                                torch.zeros_like(idx))
            if bool(shift.any()):
                pos, moved = pos + shift, moved + shift
                self.moving = True
        self.pos, self.moved = pos, moved

    def anchored(self, sidx: Tensor) -> Tensor:
        """The tokens this layer keeps whatever their score: its stream's sinks and pinned spans (none on a sliding
        layer without ``sliding_sinks``)."""
        if self.keeps_anchors:
            return self.state.is_anchored(sidx)
        return torch.zeros_like(sidx, dtype=torch.bool)

    def shift(self, delta: Tensor) -> None:
        """Rotate every stored key by ``delta`` ``[B, 1, 1]`` positions (the stream re-basing)."""
        if self.is_initialized:
            self.pos = self.pos + delta
            if self.rope is not None:
                self.moved = self.moved + delta
                self.moving = True

    def load_state_dict(self, saved: dict[str, Tensor]) -> None:  # files from before "moved": keys already in place
        super().load_state_dict({"moved": torch.zeros_like(saved["pos"]), **saved} if saved else saved)

    def _replaced(self) -> None:
        self.moving = bool(self.moved.any())

    def kept_tokens(self) -> Tensor:
        """``[B, Hkv]``: the tokens each head holds."""
        return (self.sidx >= 0).sum(-1)

    def kept_indices(self, row: int = 0) -> list[list[int]]:
        """Per key-value head, the stream indices (0 = the first token streamed) batch row ``row`` holds, sorted."""
        if not self.is_initialized:
            return []
        return [sorted(i for i in head if i >= 0) for head in self.sidx[row].tolist()]

    # ------------------------------------------------------------------ construction and crop
    @classmethod
    def for_stream(cls, state: ScoredState, spec) -> ScoredLayer:
        """The layer :func:`sinklab.stream.cache.build_layers` makes for ``spec`` (its budgets from the plan)."""
        config = spec.config
        budgets = config.plan.budgets[spec.index] if config.plan is not None else None
        return cls(state, state.rope, budgets, sliding=spec.sliding, sliding_sinks=config.sliding_sinks)

    def evicted(self) -> bool:
        """Whether any head of any row has let go of a token it saw (host read)."""
        return self.is_initialized and bool((self.kept_tokens() < self.state.n_real[:, None]).any())

    def drop_last(self, first: Tensor) -> None:
        """Forget the tokens from stream index ``first`` ``[B]`` on (the caller checked that nothing was evicted, so
        each head holds every token in stream order and the dropped ones are its last)."""
        if self.is_initialized:
            self.sidx = torch.where(self.sidx >= first[:, None, None], torch.full_like(self.sidx, -1), self.sidx)


def _later_count(flags: Tensor, order: Tensor) -> Tensor:
    """For each candidate, how many flagged candidates come after it in stream ``order`` (``[B, Hkv, N]``)."""
    ordered = flags.gather(-1, order)
    after = ordered.flip(-1).cumsum(-1).flip(-1) - ordered
    return torch.empty_like(after).scatter_(-1, order, after)


def _last_rows(col: Columns, w: int) -> Columns:
    """A column set's entries for the last ``w`` queries only."""
    def cut(t: Tensor | None) -> Tensor | None:
        return t[:, :, -w:] if t is not None and t.shape[2] > 1 else t

    return Columns(cut(col.logits), col.values, cut(col.visible))  # type: ignore[arg-type]  # (logits: a tensor)


def scored_attention(call: StreamCall, view: ScoredView, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
    """Attention of ``query`` ``[B, H, C, dh]`` over the calling score-based layer's ``buffer ⧺ new``
    (``key``/``value`` from :meth:`ScoredLayer.update`), then the layer cut back to its budgets. Output
    ``[B, H, C, dv]`` (float32)."""
    b, h, c, dh = query.shape
    hkv = key.shape[1]
    rep = h // hkv
    module, layer, scale, softcap = call.module, call.layer, call.scale, call.softcap
    state = layer.state
    sidx = layer.pending[2]  # (B, Hkv, K)
    q_sidx = view.sidx  # (B, C)
    # What each query sees: a real candidate at or before it (the buffer holds only what its head kept).
    visible = (sidx[:, :, None, :] >= 0) & (sidx[:, :, None, :] <= q_sidx[:, None, :, None]) & \
        (q_sidx[:, None, :, None] >= 0)  # (B, Hkv, C, K)
    if layer.sliding is not None:  # the model's own sliding window (the sinks and pinned spans stay in sight)
        near = (q_sidx[:, None, :, None] - sidx[:, :, None, :]) < layer.sliding
        visible = visible & (near | layer.anchored(sidx)[:, :, None, :])
    visible = visible.repeat_interleave(rep, 1) if rep > 1 else visible
    variant = getattr(module, "sinklab_variant", None)
    if variant is not None and getattr(variant, "kv_bias", False):
        raise UnsupportedModelError(
            f"the {state.policy.name!r} policy cannot score a kv-bias slot: its score depends on the query's slot "
            "position, which differs per head once heads keep different tokens; stream this variant with the "
            "default policy (streaming)")
    gate = variant_gate(module, h)
    q = query.float()
    columns = variant_column_logits(module, q, scale, slot_query=lambda: q, softcap=softcap, model_sink=call.s_aux)
    out = attend(q, key.float(), value.float(), visible, AttendSpec(scale=scale, softcap=softcap, gate=gate,
                                                                      columns=columns))
    policy = state.policy
    weights = None
    if policy.needs_weights:
        w = min(policy.window, c)
        spec = AttendSpec(scale=scale, softcap=softcap, columns=[_last_rows(col, w) for col in columns], fast=False)
        _, weights = attend(q[:, :, -w:], key.float(), value.float(), visible[:, :, -w:], spec, weights=True)
        weights = weights.view(b, hkv, rep, w, -1).mean(2)  # (B, Hkv, w, K)
    real = sidx >= 0
    order = torch.argsort(torch.where(real, sidx, torch.full_like(sidx, _LAST)), dim=-1, stable=True)
    layer.keep(policy.score(Observation(weights, key, value, real, order, sidx, getattr(module, "layer_idx", None))),
               order)
    return out
