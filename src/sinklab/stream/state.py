"""Stream bookkeeping shared by every layer: which tokens are kept, where they live, at what position.

Per batch row, the *anchored* tokens (the first ``S``, sinks, and the pinned spans) are kept forever in the slots
``[0, S + P)`` in arrival order; of the *free* tokens only the ``W`` newest are kept, in the ring ``[S + P, S + P + W)``
(free count ``F`` at slot ``S + P + (F − 1) mod W``). Positions are by cache slot: the distance from query ``i`` to
kept token ``j`` is ``A_i − A_j + min(W, F_i − F_j)`` (``A``/``F``: inclusive anchored/free counts). Keys are stored at
the virtual position ``v = absolute − base``; the base moves forward every few windows (the ring rotated once), and
anchored keys are re-rotated per query (docs/stream.md, "How it works").
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..errors import InputError, check_int, check_spans
from ..rope import RopeSpec, angles, pair_factors
from .views import ChunkView, DecodeView, View

__all__ = ["ChunkPlan", "DecodePlan", "Geometry", "RowTensors", "StepPlan", "StreamBudget", "StreamState",
           "UniformStepPlan", "View"]


@dataclass
class UniformStepPlan:
    """A decode step where the host knows every row writes a real free token into the same slot, ``slot`` ``[1]``:
    no per-row masks (one copy per buffer)."""

    slot: Tensor
    anchor_capacity: int

    @functools.cached_property
    def ring_slot(self) -> Tensor:
        """``[1]``: the slot in the ring (past the anchored slots), for a packed ring (shared by its layers)."""
        return self.slot - self.anchor_capacity


@dataclass
class DecodePlan:
    """A decode step, each row ``rows`` ``[B]`` into its own ``slot`` ``[B]``: a padding column (not ``valid``)
    writes nothing, an ``anchored`` token goes to the anchored slots."""

    rows: Tensor
    slot: Tensor
    valid: Tensor
    anchored: Tensor
    anchor_capacity: int

    @functools.cached_property
    def ring_slot(self) -> Tensor:
        """``[B]``: each row's slot in the ring (0 for an anchored row, which keeps its ring slot as it was)."""
        return (self.slot - self.anchor_capacity).clamp(min=0)

    @functools.cached_property
    def ring_keep(self) -> Tensor | None:
        """``[B, 1, 1]``: the rows whose ring slot keeps what it holds (padding, anchored); None when no row does
        (one value read back, once per forward, by the first packed layer)."""
        keep = ~self.valid | self.anchored
        return keep[:, None, None] if bool(keep.any()) else None

    @functools.cached_property
    def any_anchored(self) -> bool:
        """Whether some row decodes an anchored token (read back once per forward)."""
        return bool(self.anchored.any())


@dataclass
class ChunkPlan:
    """A chunk: the ``(rows, cols)`` of the chunk that are written, into ``slots`` (all ``[N]``)."""

    rows: Tensor
    cols: Tensor
    slots: Tensor


#: Where one forward's new columns go in the buffers, worked out once by :class:`StreamState` for every layer.
StepPlan = UniformStepPlan | DecodePlan | ChunkPlan


class RowTensors(NamedTuple):
    """The per-row tensors of a :class:`StreamState` (first dimension ``B``; ``[B, K]`` for the slot metadata)."""

    n_real: Tensor
    n_anchor: Tensor
    n_free: Tensor
    base: Tensor
    s_valid: Tensor
    s_sidx: Tensor
    s_a: Tensor
    s_f: Tensor
    s_o: Tensor


class Geometry(NamedTuple):
    """What a decode step reads of a stream besides its tensors: the rotation of the cached keys (None: NoPE), the
    first token's position, the anchored slots ``S + P`` and the window ``W``."""

    rope: RopeSpec | None
    start_position: int
    anchor_capacity: int
    window: int


def free_step(rows: RowTensors, geometry: Geometry) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None]:
    """A decode step where every row decodes a real, free token into the same slot: writes the column's metadata,
    advances ``n_real``/``n_free`` in place and returns ``(q_v, slot, visible, anchor_c, anchor_s)`` (``[B]``, ``[B]``,
    ``[B, K]``, :func:`_anchor_rotation`'s factors or None). Pure tensor work, so it also runs compiled."""
    rope, start_position, anchor_capacity, window = geometry
    t = rows.n_real.clone()
    q_f = rows.n_free + 1
    q_v = start_position + t - rows.base
    slot = anchor_capacity + rows.n_free % window
    slot1 = slot[:1]  # (1,): the slot of every row
    rows.s_valid.index_fill_(1, slot1, True)
    for buf, value in ((rows.s_sidx, t), (rows.s_a, rows.n_anchor), (rows.s_f, q_f), (rows.s_o, q_v)):
        buf.index_copy_(1, slot1, value[:, None])
    # The ring holds the W newest free tokens (every valid slot visible); anchored keys re-rotated (O(S + P) a layer).
    visible = rows.s_valid.clone()
    c = s = None
    if anchor_capacity and rope is not None:
        c, s = _anchor_rotation(rope, rows.n_anchor, q_f, q_v, rows, anchor_capacity, window)
    rows.n_real.add_(1)
    rows.n_free.add_(1)
    return q_v, slot, visible, c, s


def _anchor_rotation(rope: RopeSpec, q_a: Tensor, q_f: Tensor, q_v: Tensor, rows: RowTensors, n: int,
                     window: int) -> tuple[Tensor, Tensor]:
    """A decode query's rotation of each of the ``n`` anchored keys to its slot distance, as the factors
    ``c``, ``s`` ``[B, 1, n, r]`` of :func:`sinklab.rope.rotate_pairs` (worked out once, applied by every layer)."""
    dist = q_a[:, None] - rows.s_a[:, :n] + torch.clamp(q_f[:, None] - rows.s_f[:, :n], max=window)
    cos, sin = angles(rope, q_v[:, None] - dist - rows.s_o[:, :n])  # (B, n, r/2)
    return pair_factors(cos.float()[:, None], sin.float()[:, None], rope.interleaved)


@functools.cache
def compiled_free_step():
    """:func:`free_step` through ``torch.compile`` (fixed shapes, one graph), created on first use (docs/stream.md,
    "Compiling the step plan")."""
    return torch.compile(free_step, dynamic=False, fullgraph=True)


#: Slots per row beyond which no buffer can be allocated anywhere (2⁴⁰: a tebibyte per key/value byte per head).
MAX_CAPACITY = 2**40


@contextlib.contextmanager
def buffers_that_fit(capacity: int):
    """Allocating a stream's buffers: running out of memory (a window far too large) is an InputError that says
    so, not an allocator traceback."""
    try:
        yield
    except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError is a RuntimeError
        text = str(exc).lower()
        if isinstance(exc, MemoryError) or "alloc" in text or "out of memory" in text:
            raise InputError(f"the stream's buffers ({capacity:,} slots per row: sinks + pinned tokens + window) do "
                             "not fit in memory; give a smaller window") from exc
        raise


class StreamBudget:
    """What every stream state shares, whatever its retention policy: the sizes (sinks, pinned spans, window), the
    host-side counters, which stream indices are anchored, and the re-base that keeps virtual positions small.

    A subclass makes its own per-row tensors (``n_real`` and ``base`` at least: :meth:`_allocate_rows`) and turns what
    its layers store when the base moves (:meth:`_rotate_stored`)."""

    scored = False  # a score-based retention policy (sinklab.stream.scored) rather than recency
    # per row, made by the subclass's ``_allocate_rows`` on the first forward
    n_real: Tensor
    base: Tensor
    span: int  # host-side bound on the next virtual position

    def __init__(self, num_sinks: int, window: int, pinned=None, start_position: int = 0,
                 rebase_every: int | None = None, rope=None, attn_rope=None, *,
                 window_meaning: str = " (it includes the current token)") -> None:
        check_int("window", window, 1, window_meaning)
        check_int("num_sinks", num_sinks)
        check_int("start_position", start_position)
        if rebase_every is not None:
            check_int("rebase_every", rebase_every, 1, " (tokens between re-bases) or None (automatic)")
        self.num_sinks = int(num_sinks)
        self.window = int(window)
        self.rope = rope  # how the cached (rotated) tensor turns with position; None: no position (NoPE)
        self.attn_rope = rope if attn_rope is None else attn_rope  # how the key the attention receives turns
        self.pinned = check_spans(pinned, "pinned")
        # Anchored capacity: sinks plus pinned tokens that are not already sinks.
        self.anchor_capacity = num_sinks + sum(max(0, e - max(s, num_sinks)) for s, e in self.pinned)
        self.capacity = self.anchor_capacity + window
        if self.capacity > MAX_CAPACITY:
            raise InputError(f"sinks + pinned tokens + window = {self.capacity:,} slots per row: more than any memory "
                             f"holds (at most {MAX_CAPACITY:,}); give a smaller window")
        self.anchor_end = max([num_sinks] + [end for _, end in self.pinned])  # stream index past every anchor
        self.start_position = int(start_position)
        self.set_rebase(rebase_every, window)
        self.closed = False
        self.rebases = 0  # times the base was moved (stored keys rotated)
        self.columns = 0  # columns (incl. padding) fed so far: what generate() calls the past length
        self.batch: int | None = None
        # Host-side: every forward so far had no padding (so each row's n_real == columns and all rows write the
        # same slot); with ``columns ≥ anchor_end`` a decoded token then needs no per-row masking (the fast path).
        self.rows_alike = True
        self.layers: list = []  # the cache layers of this state, for rebasing
        self.view: View | None = None

    def _rows_for(self, b: int, device: torch.device) -> None:
        """Make the per-row state on the first forward; refuse a forward with another number of rows."""
        if self.batch is None:
            self._init_rows(b, device)
        elif b != self.batch:
            raise InputError(
                f"this stream holds {self.batch} rows but the model was given {b}; change the number of rows "
                "through the cache (reorder_cache, batch_repeat_interleave, batch_select_indices — generate() "
                "does this for beams and num_return_sequences), or start a new SinkCache")

    def is_anchored(self, sidx: Tensor) -> Tensor:
        """Which stream indices (``-1``: none) are kept whatever happens: the sinks and the pinned spans."""
        out = (sidx >= 0) & (sidx < self.num_sinks)
        for start, end in self.pinned:
            out = out | ((sidx >= start) & (sidx < end))
        return out

    def set_rebase(self, rebase_every: int | None, keep: int) -> None:
        """Re-base at most every ``rebase_every`` tokens (None: ``max(4 · keep, 2048)``), so that the newest ``keep``
        tokens keep virtual positions ``≥ 0`` (``rebase_every`` was checked by the constructor)."""
        self.rebase_every = int(rebase_every or max(4 * keep, 2048))
        self.rebase_keep = keep

    def _maybe_rebase(self, incoming: int) -> None:
        """Move the base (the stored keys rotated once) when this forward could pass ``rebase_every``, decided on the
        host from :attr:`span`; each row's newest ``rebase_keep`` tokens keep virtual positions ``≥ 0``."""
        if self.span + incoming - 1 <= self.rebase_every:
            return
        target = self.start_position + torch.clamp(self.n_real - self.rebase_keep, min=0)
        self._rotate_stored(target - self.base)
        self.base = target
        self.span = min(self.rebase_keep, self.columns)
        self.rebases += 1

    def _init_rows(self, batch: int, device: torch.device) -> None:
        """Make the per-row tensors for ``batch`` rows on ``device`` (and move the frequencies there, once)."""
        self.device = device
        if self.rope is not None:
            self.rope = replace(self.rope, inv_freq=self.rope.inv_freq.to(device))
            self.attn_rope = replace(self.attn_rope, inv_freq=self.rope.inv_freq)
        with buffers_that_fit(self.capacity):
            self._allocate_rows(batch, device)
        self._set_rows(batch)
        self.span = self.start_position  # a host-side bound on every row's next virtual position: no read-back

    def select_rows(self, index: Tensor) -> None:
        """Keep/reorder/repeat batch rows: row ``i`` becomes old row ``index[i]`` (beams, batch expansion)."""
        for name, value in self.per_row().items():
            setattr(self, name, value.index_select(0, index.to(self.device)))
        self._set_rows(int(index.shape[0]))

    def _set_rows(self, batch: int) -> None:
        self.batch = batch

    def _allocate_rows(self, batch: int, device: torch.device) -> None:
        """Set the subclass's per-row tensors."""
        raise NotImplementedError

    def _rotate_stored(self, delta: Tensor) -> None:
        """Turn what the layers store back by ``delta`` ``[B]`` positions (the base moves forward by it)."""
        raise NotImplementedError

    def per_row(self) -> dict[str, Tensor]:
        """The per-row tensors (first dimension ``B``), by attribute name."""
        raise NotImplementedError

    # ------------------------------------------------------------------ persistence
    def state_dict(self) -> dict:
        """The per-row tensors and the host-side counters (empty before the first forward); a state made with the same
        settings takes them back with :meth:`load_state_dict` and continues exactly."""
        if self.batch is None:
            return {}
        return {**{n: v.contiguous() for n, v in self.per_row().items()}, "columns": self.columns, "span": self.span,
                "rebases": self.rebases, "rows_alike": self.rows_alike}

    def load_state_dict(self, saved: dict) -> None:
        if not saved:
            return
        rows = saved["n_real"]
        self._init_rows(rows.shape[0], rows.device)
        for name in self.per_row():
            getattr(self, name).copy_(saved[name])
        self.columns, self.span, self.rebases = int(saved["columns"]), int(saved["span"]), int(saved["rebases"])
        self.rows_alike = bool(saved["rows_alike"])


class StreamState(StreamBudget):
    """Counters, buffer metadata and position plan for one stream (all layers share it)."""

    def __init__(self, num_sinks: int, window: int, pinned=None, start_position: int = 0,
                 rebase_every: int | None = None, rope=None, compile_plan: bool = False, attn_rope=None) -> None:
        super().__init__(num_sinks, window, pinned, start_position, rebase_every, rope, attn_rope)
        # Decode-step bookkeeping through torch.compile (:func:`compiled_free_step`).
        self.compile_plan = bool(compile_plan)
        self.plan: StepPlan | None = None

    # ------------------------------------------------------------------ per-row storage
    def _allocate_rows(self, batch: int, device: torch.device) -> None:
        long: dict[str, Any] = dict(dtype=torch.long, device=device)
        self.n_real, self.n_anchor, self.n_free, self.base = (torch.zeros(batch, **long) for _ in range(4))
        self.s_valid = torch.zeros(batch, self.capacity, dtype=torch.bool, device=device)
        self.s_sidx = torch.full((batch, self.capacity), -1, **long)
        self.s_a, self.s_f, self.s_o = (torch.zeros(batch, self.capacity, **long) for _ in range(3))

    def per_row(self) -> dict[str, Tensor]:
        """The per-row tensors (first dimension ``B``), by attribute name."""
        return {n: getattr(self, n) for n in RowTensors._fields}

    def row_tensors(self) -> RowTensors:
        """The per-row tensors as one :class:`RowTensors` (the same tensors, not copies)."""
        return RowTensors(**self.per_row())

    def _set_rows(self, batch: int) -> None:
        self.batch = batch
        self._rows = torch.arange(batch, device=self.device)
        anchored = torch.zeros(self.capacity, dtype=torch.bool, device=self.device)
        anchored[: self.anchor_capacity] = True
        self.s_anchored = anchored.expand(batch, self.capacity)  # the anchored slots (the same in every row)

    def drop_last(self, n: int) -> None:
        """Forget each row's last ``n`` tokens (the caller checked that they evicted nothing; they are real)."""
        gone = self.s_valid & (self.s_sidx >= (self.n_real - n)[:, None])  # (B, cap)
        anchored = gone & self.s_anchored
        self.s_valid = self.s_valid & ~gone
        self.n_anchor -= anchored.sum(1)
        self.n_free -= (gone & ~self.s_anchored).sum(1)
        self.n_real -= gone.sum(1)
        self.columns -= n

    # ------------------------------------------------------------------ one forward
    def begin(self, valid: Tensor, all_valid: bool = False) -> Tensor:
        """Plan a forward over ``valid`` ``[B, C]`` new columns (``all_valid``: known on the host to be all real); returns
        the virtual positions ``[B, C]``. Host decisions on Python ints only, tensor maths without read-backs."""
        b, c = valid.shape
        self._rows_for(b, valid.device)
        valid = valid.to(self.device).bool()
        self._maybe_rebase(c)
        if c == 1 and all_valid and self.rows_alike and self.columns >= self.anchor_end:
            q_v = self._begin_free_step()
        else:
            q_v = self._begin_step(valid[:, 0]) if c == 1 else self._begin_chunk(valid)
        self.rows_alike = self.rows_alike and all_valid
        self.span += c
        self.columns += c
        return q_v

    def _begin_step(self, valid: Tensor) -> Tensor:
        """Decode one column (``valid`` ``[B]``): fixed-shape tensor maths, no host read, no value branch."""
        t = self.n_real  # stream index of the new token, per row
        anchored = valid & self.is_anchored(t)
        free = valid & ~anchored
        q_a = self.n_anchor + anchored.long()
        q_f = self.n_free + free.long()
        q_v = torch.where(valid, self.start_position + t - self.base, torch.zeros_like(t))
        slot = torch.where(anchored, self.n_anchor, self.anchor_capacity + self.n_free % self.window)
        rows = self._rows
        for buf, value in ((self.s_valid, valid), (self.s_sidx, t), (self.s_a, q_a), (self.s_f, q_f), (self.s_o, q_v)):
            buf[rows, slot] = torch.where(valid, value, buf[rows, slot])  # a padding column writes nothing
        self.plan = DecodePlan(rows, slot, valid, anchored, self.anchor_capacity)
        c = s = None  # every valid slot is visible; anchored keys re-rotated to their slot distance
        if self.anchor_capacity and self.rope is not None:
            c, s = _anchor_rotation(self.rope, q_a, q_f, q_v, self.row_tensors(), self.anchor_capacity, self.window)
        self.view = DecodeView(q_a[:, None], q_f[:, None], q_v[:, None], self.window, self.attn_rope,
                               self.s_valid & valid[:, None], c, s)
        self.n_real += valid.long()
        self.n_anchor += anchored.long()
        self.n_free += free.long()
        return q_v[:, None]

    def _begin_free_step(self) -> Tensor:
        """:meth:`_begin_step` where the host knows every row decodes a real, free token into the same slot: no per-row
        masks (:func:`free_step`, compiled with :attr:`compile_plan`), one ``index_copy_`` per buffer."""
        args = (self.row_tensors(), Geometry(self.rope, self.start_position, self.anchor_capacity, self.window))
        try:
            out = (compiled_free_step() if self.compile_plan else free_step)(*args)
        except torch._dynamo.exc.TorchDynamoException as exc:  # only compiling raises it, before anything ran
            warnings.warn(f"the stream's decode-step plan could not be compiled ({type(exc).__name__}: {exc}); "
                          "it runs eagerly (SinkCache(..., compile_plan=False) skips the attempt)", RuntimeWarning,
                          stacklevel=2)
            self.compile_plan = False
            out = free_step(*args)
        q_v, slot, visible, anchor_c, anchor_s = out
        q_a, q_f = self.n_anchor, self.n_free  # n_free already counts the new token
        self.plan = UniformStepPlan(slot[:1], self.anchor_capacity)  # one slot: no per-row masks
        self.view = DecodeView(q_a[:, None], q_f[:, None], q_v[:, None], self.window, self.attn_rope, visible,
                               anchor_c, anchor_s, all_visible=self.columns + 1 >= self.capacity)
        return q_v[:, None]

    def _begin_chunk(self, valid: Tensor) -> Tensor:
        """Plan a multi-column forward (prefill; eager): keys are the buffer as it was, then the chunk."""
        sidx = self.n_real[:, None] + valid.long().cumsum(1) - 1  # (B, C)
        anchored = valid & self.is_anchored(sidx)
        free = valid & ~anchored
        q_a = self.n_anchor[:, None] + anchored.long().cumsum(1)
        q_f = self.n_free[:, None] + free.long().cumsum(1)
        # (a padding column's sidx repeats the previous column's; `valid` keeps it out of what is seen and written)
        q_v = torch.where(valid, self.start_position + sidx - self.base[:, None], torch.zeros_like(sidx))
        # Anchored tokens to their slots in arrival order; free ones into the ring (the chunk's last W free tokens).
        slot = torch.where(anchored, q_a - 1, self.anchor_capacity + (q_f - 1) % self.window)
        write = anchored | (free & (q_f > q_f[:, -1:] - self.window))
        rows, cols = write.nonzero(as_tuple=True)
        self.plan = plan = ChunkPlan(rows, cols, slot[rows, cols])
        k_sidx, k_f = torch.cat([self.s_sidx, sidx], 1), torch.cat([self.s_f, q_f], 1)
        k_valid, k_anchored = torch.cat([self.s_valid, valid], 1), torch.cat([self.s_anchored, anchored], 1)
        causal = k_sidx[:, None, :] <= sidx[:, :, None]  # (B, C, K)
        recent = (q_f[:, :, None] - k_f[:, None, :]) < self.window
        self.view = ChunkView(q_a, q_f, q_v, self.window, self.attn_rope,
                              k_valid[:, None, :] & valid[:, :, None] & causal & (k_anchored[:, None, :] | recent),
                              k_a=torch.cat([self.s_a, q_a], 1), k_f=k_f, k_o=torch.cat([self.s_o, q_v], 1),
                              anchor_idx=k_anchored.any(0).nonzero()[:, 0])
        for buf, value in ((self.s_valid, valid), (self.s_sidx, sidx), (self.s_a, q_a), (self.s_f, q_f), (self.s_o, q_v)):
            buf[rows, plan.slots] = value[rows, cols]
        self.n_real += valid.sum(1)
        self.n_anchor += anchored.sum(1)
        self.n_free += free.sum(1)
        return q_v

    def _rotate_stored(self, delta: Tensor) -> None:
        ring = slice(self.anchor_capacity, self.capacity)
        for layer in self.layers:
            layer.rotate_ring(ring, -delta)
        self.s_o[:, ring] -= delta[:, None]

    def kept_tokens(self) -> int:
        """The most tokens any row keeps."""
        return int(self.s_valid.sum(1).max())

    # ------------------------------------------------------------------ construction
    @classmethod
    def for_stream(cls, config, num_sinks: int, window: int, pinned, rotation) -> StreamState:
        """The state :func:`sinklab.stream.cache.build_layers` makes for one budget of ``config`` (a ``StreamConfig``)."""
        return cls(num_sinks, window, list(pinned), config.start_position, config.rebase_every,
                   rope=rotation.cache_rope, attn_rope=rotation.attn_rope, compile_plan=config.compile_plan)

    def evicted(self) -> bool:
        """Whether any row's window has let go of a token (host read)."""
        return self.batch is not None and bool((self.n_free > self.window).any())
