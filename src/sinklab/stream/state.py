"""Stream bookkeeping shared by every layer: which tokens are kept, where they live, at what position.

Vocabulary (0-based, per batch row):

* stream index ``t`` — the rank of a real token in its row's stream (padding has none);
* **anchored** tokens — the first ``S`` (sinks) and those inside a pinned span: kept forever;
* **free** tokens — the rest; only the ``W`` most recent are kept (the window), in a ring buffer;
* slot positions — a kept token's position is its rank among the tokens the query keeps, so the
  distance from query ``i`` to kept token ``j`` is ``D_ij = A_i − A_j + min(W, F_i − F_j)`` with ``A``/``F``
  the inclusive counts of anchored/free tokens. For window tokens that is the true distance.
* virtual position ``v = absolute − base`` — what the model's RoPE sees. Window keys are stored rotated at
  their ``v``; the base is moved forward ("rebase") every few windows, rotating the ring once, so ``v``
  stays small (float32-exact) at any stream length; anchored keys are scored by rotating them per query.

Buffer layout per row: ``[0, S + P)`` anchored slots in arrival order, ``[S + P, S + P + W)`` the ring
(free token with count ``F`` lives at ``S + P + (F − 1) mod W``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import InputError
from ..rope import angles

__all__ = ["StreamState", "View"]


@dataclass
class View:
    """Metadata of the keys the attention sees in one forward, and of its queries. All ``[B, K]``/``[B, C]``."""

    k_valid: Tensor
    k_sidx: Tensor
    k_anchored: Tensor
    k_a: Tensor
    k_f: Tensor
    k_o: Tensor  # virtual position each key was rotated at
    q_valid: Tensor | None
    q_sidx: Tensor | None
    q_a: Tensor | None
    q_f: Tensor | None
    q_v: Tensor | None
    from_buffer: bool  # True: keys are the buffer itself (decode); False: buffer ⧺ chunk
    visible: Tensor | None = None  # (B, K) for decode, (B, C, K) for a chunk: what each query may attend to
    anchor_idx: Tensor | None = None  # key positions holding anchored tokens (chunk path)
    anchor_cos: Tensor | None = None  # (B, 1, A, r/2) decode: rotation of each anchored key to its slot distance
    anchor_sin: Tensor | None = None
    # Rotation taking each query from its virtual position to its own cache-slot position (kept tokens it
    # sees − 1): (B, C), or one int when every row agrees (decode). Only a kv-bias slot's score needs it.
    slot_shift: Tensor | int = 0


def _check_pinned(pinned) -> list[tuple[int, int]]:
    spans = []
    for item in pinned or []:
        try:
            start, end = (int(x) for x in item)
        except (TypeError, ValueError) as exc:
            raise InputError(f"pinned spans are (start, end) pairs of stream-token indices, got {item!r}") from exc
        if start < 0 or end <= start:
            raise InputError(f"pinned span {item!r} must satisfy 0 ≤ start < end (half-open)")
        spans.append((start, end))
    spans.sort()
    for (a0, a1), (b0, b1) in zip(spans, spans[1:]):
        if b0 < a1:
            raise InputError(f"pinned spans {(a0, a1)} and {(b0, b1)} overlap")
    return spans


class StreamState:
    """Counters, buffer metadata and position plan for one stream (all layers share it)."""

    def __init__(self, num_sinks: int, window: int, pinned=None, start_position: int = 0,
                 rebase_every: int | None = None, rope=None) -> None:
        if not isinstance(window, int) or window < 1:
            raise InputError(f"window must be an integer ≥ 1 (it includes the current token), got {window!r}")
        if not isinstance(num_sinks, int) or num_sinks < 0:
            raise InputError(f"num_sinks must be an integer ≥ 0, got {num_sinks!r}")
        if start_position < 0:
            raise InputError(f"start_position must be ≥ 0, got {start_position}")
        self.num_sinks = num_sinks
        self.window = window
        self.rope = rope
        self.pinned = _check_pinned(pinned)
        # Anchored capacity: sinks plus pinned tokens that are not already sinks.
        self.anchor_capacity = num_sinks + sum(max(0, e - max(s, num_sinks)) for s, e in self.pinned)
        self.capacity = self.anchor_capacity + window
        self.start_position = int(start_position)
        self.rebase_every = int(rebase_every or max(4 * window, 2048))
        self.rebase_keep = window  # re-base so the newest `rebase_keep` tokens keep virtual positions ≥ 0
        self.closed = False
        self.columns = 0  # columns (incl. padding) fed so far: what generate() calls the past length
        self.batch: int | None = None
        self.layers: list = []  # SinkWindowLayer objects, for rebasing
        self.view: View | None = None
        self.plan: dict | None = None

    # ------------------------------------------------------------------ per-row storage
    def _init_rows(self, batch: int, device: torch.device) -> None:
        self.batch = batch
        self.device = device
        cap = self.capacity
        long = dict(dtype=torch.long, device=device)
        self.n_real = torch.zeros(batch, **long)
        self.n_anchor = torch.zeros(batch, **long)
        self.n_free = torch.zeros(batch, **long)
        self.base = torch.zeros(batch, **long)
        self.s_valid = torch.zeros(batch, cap, dtype=torch.bool, device=device)
        self.s_sidx = torch.full((batch, cap), -1, **long)
        self.s_a = torch.zeros(batch, cap, **long)
        self.s_f = torch.zeros(batch, cap, **long)
        self.s_o = torch.zeros(batch, cap, **long)
        anchored = torch.zeros(cap, dtype=torch.bool, device=device)
        anchored[: self.anchor_capacity] = True
        self.s_anchored = anchored.expand(batch, cap)
        self.uniform = True  # every row has the same counters (no padding so far): scalar fast path
        self.__dict__.pop("_scalar_cache", None)

    def _is_anchored(self, sidx: Tensor) -> Tensor:
        out = sidx < self.num_sinks
        for start, end in self.pinned:
            out = out | ((sidx >= start) & (sidx < end))
        return out

    # ------------------------------------------------------------------ one forward
    def begin(self, valid: Tensor) -> Tensor:
        """Plan a forward over ``valid`` ``[B, C]`` new columns; returns the virtual positions ``[B, C]``."""
        b, c = valid.shape
        if self.batch is None:
            self._init_rows(b, valid.device)
        elif b != self.batch:
            raise InputError(
                f"this stream was started with batch size {self.batch} but got {b} rows; beam search and "
                "num_return_sequences > 1 are not supported by SinkCache — use greedy/sampling with one row per stream, "
                "or sinklab.stream_generate for batches"
            )
        valid = valid.to(self.device).bool()
        all_valid = bool(valid.all())
        self._maybe_rebase(c)
        if c == 1 and all_valid and self.uniform:
            return self._begin_uniform_step()
        if not all_valid:
            self.uniform = False  # rows now differ (left padding): keep the general per-row path
        sidx = self.n_real[:, None] + valid.long().cumsum(1) - 1  # (B, C)
        anchored = valid & self._is_anchored(sidx)
        free = valid & ~anchored
        q_a = self.n_anchor[:, None] + anchored.long().cumsum(1)
        q_f = self.n_free[:, None] + free.long().cumsum(1)
        absolute = self.start_position + sidx
        q_v = torch.where(valid, absolute - self.base[:, None], torch.zeros_like(sidx))
        sidx = torch.where(valid, sidx, torch.full_like(sidx, -1))

        # Where each new token goes in the buffer: anchored slots in arrival order; free ones into the
        # ring, keeping only the last W free tokens of this chunk.
        slot = torch.where(anchored, q_a - 1, self.anchor_capacity + (q_f - 1) % self.window)
        last_f = q_f[:, -1:]
        write = anchored | (free & (q_f > last_f - self.window))
        if bool((anchored & (q_a > self.anchor_capacity)).any()):  # pragma: no cover - guarded by capacity maths
            raise RuntimeError("anchored capacity exceeded")
        rows, cols = write.nonzero(as_tuple=True)
        self.plan = {"rows": rows, "cols": cols, "slots": slot[rows, cols]}

        query = dict(q_valid=valid, q_sidx=sidx, q_a=q_a, q_f=q_f, q_v=q_v)
        if c == 1:  # decode: write first, the keys are the buffer itself
            self._write_meta(rows, cols, slot, valid, sidx, q_a, q_f, q_v)
            self.view = View(self.s_valid, self.s_sidx, self.s_anchored, self.s_a, self.s_f, self.s_o,
                             from_buffer=True, **query)
            # The ring holds exactly the W most recent free tokens, so every valid slot is visible; anchored
            # keys are re-rotated to their slot distance from this query (O(S + P) per layer).
            self.view.visible = self.s_valid & valid
            n = self.anchor_capacity
            if n:
                dist = q_a - self.s_a[:, :n] + torch.clamp(q_f - self.s_f[:, :n], max=self.window)  # (B, A)
                cos, sin = angles(self.rope, q_v - dist - self.s_o[:, :n])
                self.view.anchor_cos, self.view.anchor_sin = cos.float()[:, None], sin.float()[:, None]
        else:  # chunk: keys are the buffer as it was, then the chunk
            view = View(
                torch.cat([self.s_valid, valid], 1), torch.cat([self.s_sidx, sidx], 1),
                torch.cat([self.s_anchored, anchored], 1), torch.cat([self.s_a, q_a], 1),
                torch.cat([self.s_f, q_f], 1), torch.cat([self.s_o, q_v], 1), from_buffer=False, **query)
            causal = view.k_sidx[:, None, :] <= sidx[:, :, None]  # (B, C, K)
            recent = (q_f[:, :, None] - view.k_f[:, None, :]) < self.window
            view.visible = view.k_valid[:, None, :] & valid[:, :, None] & causal & (view.k_anchored[:, None, :] | recent)
            view.anchor_idx = view.k_anchored.any(0).nonzero()[:, 0]
            self.view = view
            self._write_meta(rows, cols, slot, valid, sidx, q_a, q_f, q_v)
        self.view.slot_shift = q_a + torch.clamp(q_f, max=self.window) - 1 - q_v
        self.n_real += valid.sum(1)
        self.n_anchor += anchored.sum(1)
        self.n_free += free.sum(1)
        self.columns += c
        self.__dict__.pop("_scalar_cache", None)
        return q_v

    def _begin_uniform_step(self) -> Tensor:
        """Decode one token in every row when all rows share their counters (the common case): scalar maths."""
        t, n_anchor, n_free, base = self._scalars
        anchored = t < self.num_sinks or any(a <= t < b for a, b in self.pinned)
        if anchored:
            slot, q_a, q_f = n_anchor, n_anchor + 1, n_free
        else:
            slot, q_a, q_f = self.anchor_capacity + n_free % self.window, n_anchor, n_free + 1
        v = self.start_position + t - base
        for name, value in (("s_valid", True), ("s_sidx", t), ("s_a", q_a), ("s_f", q_f), ("s_o", v)):
            getattr(self, name)[:, slot] = value
        self.plan = {"slot": slot}
        view = View(self.s_valid, self.s_sidx, self.s_anchored, self.s_a, self.s_f, self.s_o,
                    None, None, None, None, None, from_buffer=True, visible=self.s_valid)
        n = self.anchor_capacity
        if n:
            dist = q_a - self.s_a[:, :n] + torch.clamp(q_f - self.s_f[:, :n], max=self.window)  # (B, A)
            cos, sin = angles(self.rope, v - dist - self.s_o[:, :n])
            view.anchor_cos, view.anchor_sin = cos.float()[:, None], sin.float()[:, None]
        view.slot_shift = q_a + min(q_f, self.window) - 1 - v
        self.view = view
        self.n_real += 1
        (self.n_anchor if anchored else self.n_free).add_(1)
        self._scalars = (t + 1, n_anchor + int(anchored), n_free + int(not anchored), base)
        self.columns += 1
        return torch.full((self.batch, 1), v, dtype=torch.long, device=self.device)

    @property
    def _scalars(self) -> tuple[int, int, int, int]:
        """Row 0's counters as Python ints (valid while ``uniform``), cached to avoid device syncs."""
        cached = self.__dict__.get("_scalar_cache")
        if cached is None:
            cached = (int(self.n_real[0]), int(self.n_anchor[0]), int(self.n_free[0]), int(self.base[0]))
            self.__dict__["_scalar_cache"] = cached
        return cached

    @_scalars.setter
    def _scalars(self, value: tuple[int, int, int, int]) -> None:
        self.__dict__["_scalar_cache"] = value

    def _write_meta(self, rows, cols, slot, valid, sidx, q_a, q_f, q_v) -> None:
        slots = slot[rows, cols]
        self.s_valid[rows, slots] = True
        self.s_sidx[rows, slots] = sidx[rows, cols]
        self.s_a[rows, slots] = q_a[rows, cols]
        self.s_f[rows, slots] = q_f[rows, cols]
        self.s_o[rows, slots] = q_v[rows, cols]

    def _maybe_rebase(self, incoming: int) -> None:
        """Move each row's base so virtual positions stay below ``rebase_every`` (ring rotated once)."""
        if self.uniform:
            t, _, _, base = self._scalars
            if self.start_position + t + incoming - 1 - base <= self.rebase_every:
                return
        newest = self.start_position + self.n_real + incoming - 1 - self.base  # (B,) largest v this forward
        if not bool((newest > self.rebase_every).any()):
            return
        target = self.start_position + torch.clamp(self.n_real - self.rebase_keep, min=0)
        delta = torch.where(newest > self.rebase_every, target - self.base, torch.zeros_like(target))
        if not bool((delta != 0).any()):
            return
        ring = slice(self.anchor_capacity, self.capacity)
        for layer in self.layers:
            layer.rotate_ring(ring, -delta)
        self.s_o[:, ring] -= delta[:, None]
        self.base += delta
        self.__dict__.pop("_scalar_cache", None)

    # ------------------------------------------------------------------ persistence
    def state_dict(self) -> dict[str, Tensor]:
        names = ("n_real", "n_anchor", "n_free", "base", "s_valid", "s_sidx", "s_a", "s_f", "s_o")
        return {f"state.{n}": getattr(self, n).contiguous() for n in names}

    def load_state_dict(self, tensors: dict[str, Tensor], columns: int) -> None:
        b = tensors["state.n_real"].shape[0]
        self._init_rows(b, tensors["state.n_real"].device)
        for key, value in tensors.items():
            if key.startswith("state."):
                getattr(self, key[6:]).copy_(value)
        self.columns = columns
        self.__dict__.pop("_scalar_cache", None)
        self.uniform = all(bool((getattr(self, n) == getattr(self, n)[0]).all())
                           for n in ("n_real", "n_anchor", "n_free", "base"))

    def settings(self) -> dict:
        return {"num_sinks": self.num_sinks, "window": self.window, "pinned": self.pinned,
                "start_position": self.start_position, "rebase_every": self.rebase_every}
