"""``sinklab.SinkCache``: StreamingLLM on any RoPE model through transformers' public Cache API.

    cache = sinklab.SinkCache(model, num_sinks=4, window=1020)            # a transformers Cache
    model.generate(input_ids, past_key_values=cache, max_new_tokens=20_000)  # or cache=cache

    with sinklab.SinkCache(model, num_sinks=4, window=1020) as cache:      # the same, closed on exit
        model.generate(input_ids, cache=cache, max_new_tokens=20_000)

The cache is a transformers ``Cache`` whose layers are :class:`SinkWindowLayer`. On first use it switches
the model's attention implementation to sinklab's stream attention (no mask function is registered, so
transformers builds no mask; the attention masks by cache metadata), and a forward pre-hook on the
decoder stack replaces ``position_ids`` by virtual slot positions, whoever computed them (``generate()``
or a hand-written loop). ``close()``, the end of the ``with`` block or garbage collection undo it all
(:mod:`sinklab.stream.activation`).

Per-layer budgets: a layer of the model's own sliding-window attention (Mistral's ``sliding_window``,
``sliding_attention`` entries of ``layer_types`` in gpt-oss, Gemma 2/3) whose window ``w ≤ S + W`` keeps
its native semantics — the last ``w`` tokens, no sinks, no pinned spans (``sliding_sinks=True`` adds them) —
so the stream equals the model's own forward until the full-attention layers start evicting. Every other
layer keeps ``S`` sinks, the pinned spans and a window of ``W``.

Hybrid models (Qwen3-Next, Qwen3.5, Jamba, Bamba, LFM2 …): a layer that is not attention — linear attention,
state-space, short convolution — and that the model's own cache holds as a linear-attention layer keeps its
convolution and recurrent states in that same transformers cache-layer class (``LinearAttentionLayer``), reached
through ``Cache.get_conv_state`` / ``update_recurrent_state`` … as usual. Those states are fixed-size and never
evicted, so the whole model runs in constant memory; only the attention layers keep sinks + a window.
"""

from __future__ import annotations

import math
import warnings

import torch
from torch import nn
from transformers.cache_utils import Cache

from .. import _compat
from ..checks import check_model
from ..errors import InputError, ModelWeightsError, UnsupportedModelError, check_int, is_int
from .activation import streams_of
from .layer import SinkWindowLayer
from .plan import RetentionPlan, load_plan, plan_from_scan
from .policy import RetentionPolicy, SnapKV, get_policy
from .scored import ScoredLayer, ScoredState
from .state import StreamState

__all__ = ["SinkCache"]


#: Channels per scale and zero point of a quantized window (``SinkCache(kv_bits=...)``) unless given; the one place
#: this default is written.
KV_GROUP_SIZE = 16


def _legacy_sizes(num_sinks: int, window: int | None, window_length: int | None,
                  num_sink_tokens: int | None) -> tuple[int, int]:
    """Map transformers' old ``SinkCache(window_length, num_sink_tokens)`` names onto ``(num_sinks, window)``.

    The old ``window_length`` was the whole cache: the sinks plus the recent tokens, the new token included
    (``len(key_cache) == window_length`` after each update), so ``window = window_length − num_sinks``.
    """
    if num_sink_tokens is not None:
        num_sinks = num_sink_tokens
    if window_length is not None:
        if window is not None:
            raise InputError("give window (sinklab) or window_length (transformers' old SinkCache), not both")
        if not is_int(window_length):
            raise InputError(f"window_length must be an integer, got {window_length!r}")
        if window_length <= num_sinks:
            raise InputError(f"window_length ({window_length!r}) counts the {num_sinks} sinks too; it must exceed them")
        window = window_length - num_sinks
    if window_length is not None or num_sink_tokens is not None:
        warnings.warn(f"window_length/num_sink_tokens are transformers' old names: this is "
                      f"SinkCache(model, num_sinks={num_sinks}, window={window}) (window_length counted the sinks)",
                      FutureWarning, stacklevel=3)
    return num_sinks, (1020 if window is None else window)


def _real_columns(mask, b: int, c: int, device: torch.device) -> torch.Tensor:
    """Which of the ``c`` new columns are real tokens, ``[B, C]`` bool (left padding: each row's sinks are its
    own first real tokens). From a 2-D padding mask, or from a 4-D one that ``generate()`` prepared (a
    compileable cache gets its masks built before the forward):

    * the stream's own (:func:`~sinklab.stream.attention.stream_mask`, ``[B, 1, 1, C]``): the real new columns;
    * one built by the model's own mask function (the first forward of ``generate()``, before the stream is
      switched on: sdpa/eager, causal or sliding-window): ``[B, 1|H, C, K]`` whose last ``C`` key columns are the
      new tokens (:meth:`SinkWindowLayer.get_mask_sizes`); query ``i`` sees key ``i`` of them exactly when that
      column is real (every causal, sliding or chunked pattern keeps the diagonal), so the diagonal is read —
      not the last query's row, which a sliding window, or the keys past it, would cut short.
    """
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        return mask[:, -c:].bool()
    if isinstance(mask, torch.Tensor) and mask.dim() == 4:
        block = mask[:, 0, -c:, -c:]  # (B, 1 | C, C): the new queries against the new columns
        seen = block[:, -1] if block.shape[1] == 1 else block.diagonal(dim1=-2, dim2=-1)
        return seen if seen.dtype == torch.bool else seen == 0  # additive float masks: 0 = attend
    return torch.ones(b, c, dtype=torch.bool, device=device)


def _policy_and_plan(policy, plan, model, num_sinks: int, window: int,
                     sized: bool) -> tuple[RetentionPolicy, RetentionPlan | None]:
    """The retention policy and, for ``auto``, its plan: a :class:`RetentionPlan`, the path of a saved one, or a
    scan / diagnosis to make it from (at ``num_sinks + window`` tokens per head). A saved plan given with an explicit
    window is re-budgeted to it (the same local heads)."""
    scan = getattr(plan, "scan", plan)  # a Diagnosis holds its scan
    if isinstance(plan, (str, bytes)) or hasattr(plan, "__fspath__"):
        plan = load_plan(plan)
    elif hasattr(scan, "local_mass"):
        plan = plan_from_scan(model, scan, num_sinks=num_sinks, window=window)
    elif plan is not None and not isinstance(plan, RetentionPlan):
        raise InputError(f"plan is a sinklab.stream.plan.RetentionPlan, the path of a saved one, or a scan or "
                         f"diagnosis to make one from; got {type(plan).__name__}")
    if policy == "auto":
        if plan is None:
            raise InputError("policy='auto' needs a plan: plan=scan_or_diagnosis (sinklab.scan / sinklab.diagnose of "
                             "this model), a RetentionPlan, or the retention_plan.json that `sinklab diagnose` saves")
        plan.check_model(model)
        if sized and (num_sinks, window) != (plan.num_sinks, plan.window):
            plan = plan.with_budget(num_sinks, window)
        return SnapKV(recent=plan.recent), plan
    if plan is not None:
        raise InputError(f"a plan sets per-head budgets for policy='auto'; policy={policy!r} keeps one budget for "
                         "every head")
    return get_policy(policy), None


class SinkCache(Cache):
    """A transformers ``Cache`` that streams ``model`` with attention sinks + a sliding window.

    Parameters
    ----------
    model:
        A causal LM whose positions are rotary (any pairing, direction or rotated width; latent attention; layers
        without positions too) — measured on the model by :func:`sinklab._compat.layer_rotations`, which refuses
        what streaming cannot reproduce (transformers ``PreTrainedModel``).
    num_sinks:
        ``S``, the first real tokens kept forever (0 gives the window-only baseline).
    window:
        ``W ≥ 1``, the most recent tokens each query sees, itself included (StreamingLLM's ``recent_size``).
        Default 1020.
    pinned:
        Half-open ``(start, end)`` stream-token ranges kept forever after the sinks (e.g. a system prompt);
        not counted in ``W``.
    start_position:
        Absolute position of the stream's first token (a stream resumed deep into a text); positions stay
        slot-based and float32-exact whatever its value.
    sliding_sinks:
        Also give the model's own sliding-window layers the sinks and pinned spans (default: they keep their
        native last-``w`` window).
    check_every:
        On an accelerator, single decoded columns are checked (token ids in range, finite hidden states) on
        the device and read back every ``check_every`` columns (1: every token, a device synchronisation
        each). Chunks, and every forward on the CPU, are checked at once.
    window_length, num_sink_tokens:
        transformers' old ``SinkCache`` names (deprecated): ``window = window_length − num_sinks``.
    kv_bits, kv_group_size:
        Store the window packed at 2, 3, 4 or 8 bits (scale and zero point per token and group of
        ``kv_group_size`` channels); sinks and pinned spans stay exact (:mod:`sinklab.stream.quantized`).
    compile_plan:
        Run each decode step's bookkeeping (slot, virtual position, visibility, anchor re-rotation) as one
        ``torch.compile``'d function instead of some forty small eager ops — for a compiled forward on an
        accelerator, where those ops are kernel launches between the graphs (the eager bookkeeping measured
        0.8–0.9 ms per token on an H200). Off by default: its effect there is not measured yet, and on a CPU
        the eager bookkeeping is about 0.2 % of a step. Compiled once per budget on the first decode step
        (same numbers as eager: tests/test_stream_compile.py); where it cannot be compiled it runs eagerly,
        with a warning.
    """

    is_sinklab_stream = True

    def __init__(self, model: nn.Module, num_sinks: int = 4, window: int | None = None, pinned=None,
                 start_position: int = 0, rebase_every: int | None = None, *, sliding_sinks: bool = False,
                 check_every: int = 64, window_length: int | None = None, num_sink_tokens: int | None = None,
                 kv_bits: int | None = None, kv_group_size: int = KV_GROUP_SIZE, compile_plan: bool = False,
                 policy: str | RetentionPolicy | None = None, plan: RetentionPlan | str | None = None,
                 positions: str = "slot") -> None:
        check_model(model, "SinkCache")
        _compat.check_stream(model)  # features the stream cannot reproduce, refused with what would lift it
        sized = window is not None or window_length is not None
        num_sinks, window = _legacy_sizes(num_sinks, window, window_length, num_sink_tokens)
        if not isinstance(compile_plan, bool):
            raise InputError(f"compile_plan is True or False, got {compile_plan!r}")
        self.policy, self.plan = _policy_and_plan(policy, plan, model, num_sinks, window, sized)
        if self.plan is not None:
            num_sinks, window = self.plan.num_sinks, self.plan.window
        if self.policy.scored and kv_bits is not None:
            raise InputError(f"kv_bits packs the recency policy's ring buffer; the {self.policy.name!r} policy keeps "
                             "its tokens unpacked (use policy='streaming' with kv_bits)")
        self.model = model
        self.sliding_sinks = bool(sliding_sinks)
        main = StreamState(num_sinks, window, pinned, start_position, rebase_every)
        self.layer_windows = _compat.layer_sliding_windows(model)
        # How each layer rotates its keys, measured on the model (pairing, direction, rotated dimensions, which
        # cached tensor; none on NoPE layers; a hybrid's recurrent layers: not attention): _compat.layer_rotations
        # refuses what it cannot reproduce.
        self.layer_rotations = _compat.layer_rotations(model)
        attention = [r.is_attention for r in self.layer_rotations]
        if not any(attention):
            raise UnsupportedModelError(
                f"{type(model).__name__} has no softmax-attention layer: every layer keeps a fixed-size recurrent "
                "state, which its own cache already holds in constant memory; sinks and a window have nothing to act on "
                "(generate with the model's own cache)")
        #: A hybrid model's layers that are not attention, kept in the model's own cache-layer class: those with a
        #: recurrent / convolution state (kept whole), and those without state (MLP/MoE blocks).
        self.recurrent_layers = [i for i, r in enumerate(self.layer_rotations) if r.kind == "recurrent"]
        self.stateless_layers = [i for i, r in enumerate(self.layer_rotations) if r.kind == "stateless"]
        if len(self.layer_rotations) != len(self.layer_windows):  # blocks with several attention modules
            if any(w is not None for w in self.layer_windows):
                raise UnsupportedModelError(
                    f"{type(model).__name__} has {len(self.layer_rotations)} attention layers in "
                    f"{len(self.layer_windows)} blocks and sliding windows per block; sinklab cannot tell which "
                    "attention layer each window belongs to")
            self.layer_windows = [None] * len(self.layer_rotations)
        groups: dict[tuple, StreamState] = {}
        self.layer_states: list[StreamState | None] = []  # None: a recurrent layer (no keys, no budget)
        for rotation, own in zip(self.layer_rotations, self.layer_windows):
            if not rotation.is_attention:
                self.layer_states.append(None)
                continue
            native = own is not None and own <= num_sinks + window
            sizes: tuple[int, int, tuple[tuple[int, int], ...]]  # (sinks, window, pinned); native: own is set
            if native and not sliding_sinks:
                sizes = (0, own, ())  # type: ignore[assignment]
            else:
                sizes = (num_sinks, own if native else window, tuple(main.pinned))  # type: ignore[assignment]
            scored = self.policy.scored and not (native and not sliding_sinks)
            key = (id(rotation), scored, *sizes)
            if key not in groups and scored:
                if not rotation.caches_attended_keys:
                    raise UnsupportedModelError(
                        f"{type(model).__name__}: the {self.policy.name!r} policy re-rotates the keys it keeps, and this "
                        "model's cached tensor is not the rotated key the attention reads (latent attention or a "
                        "rotary part stored apart); stream it with the default policy (streaming)")
                # (a ScoredState stands in for a StreamState: the layers use what both have; a scored policy)
                groups[key] = ScoredState(self.policy, sizes[0], sizes[1], list(sizes[2]),  # type: ignore[assignment, arg-type]
                                          start_position,
                                          rebase_every, rope=rotation.cache_rope, positions=positions)
            elif key not in groups:
                groups[key] = StreamState(sizes[0], sizes[1], list(sizes[2]), start_position, rebase_every,
                                          rope=rotation.cache_rope, attn_rope=rotation.attn_rope,
                                          compile_plan=compile_plan)
            self.layer_states.append(groups[key])
        self.states = list(groups.values())
        # Every group re-bases at the same steps by the same amount, so all layers share one virtual position.
        keep = max(s.capacity if s.scored else s.window for s in self.states)
        for st in self.states:
            st.set_rebase(rebase_every, keep)
        full = [s for s in self.states if (s.num_sinks, s.window) == (num_sinks, window) and s.scored == self.policy.scored]
        self.state = full[0] if full else self.states[0]  # the sinks + window budget (what cache_tokens reports)
        self.rope = self.state.rope
        self.closed = False
        self._vocab = _compat.embedding_rows(model)
        self.check_every = check_int("check_every", check_every, 1)
        self._pending_ids: torch.Tensor | bool = False
        self._pending_hidden: torch.Tensor | bool = False
        self._checked = 0  # columns checked so far
        if kv_bits is None and kv_group_size != KV_GROUP_SIZE:
            raise InputError(f"kv_group_size={kv_group_size!r} sets the groups of a quantized window; it needs kv_bits")
        swapped = [r.rotated == "values" for r in self.layer_rotations]  # latent attention: see SinkWindowLayer
        if kv_bits is None:
            def attention_layer(s, v: bool, i: int):
                if s.scored:
                    return ScoredLayer(s, s.rope, self.plan.budgets[i] if self.plan is not None else None,
                                       sliding=self.layer_windows[i], sliding_sinks=self.sliding_sinks)
                return SinkWindowLayer(s, s.rope, rotates_values=v)
        else:
            from .quantized import PackShared, QuantizedSinkWindowLayer

            packs: dict[int, PackShared] = {}  # one per stream state: the layers that pack together

            def attention_layer(s, v: bool, i: int):
                return QuantizedSinkWindowLayer(s, s.rope, kv_bits, kv_group_size, rotates_values=v,
                                                shared=packs.setdefault(id(s), PackShared()))
        # A hybrid's other layers: fresh layers of the class the model's own cache uses for them (transformers'
        # LinearAttentionLayer, which holds the convolution and recurrent states exactly as that cache would; a
        # DummyLayer for a block without state).
        own_layers = _compat.model_cache_layers(model) if not all(attention) else []
        layers = []
        for i, (s, v, rotation) in enumerate(zip(self.layer_states, swapped, self.layer_rotations)):
            if s is not None:
                layers.append(attention_layer(s, v, i))
            elif i < len(own_layers) and _compat.cache_layer_kind(own_layers[i]) == rotation.kind:
                layers.append(own_layers[i])
            else:  # the probe measured this very cache; a mismatch means the config changed since
                raise UnsupportedModelError(f"{type(model).__name__}: layer {i} is a {rotation.kind} layer, but the "
                                            "model's own cache has no such layer for it; create the SinkCache again")
        super().__init__(layers=layers)
        self._streams = streams_of(model)
        self._streams.add(self)

    # ------------------------------------------------------------------ lifetime
    def __enter__(self) -> SinkCache:
        if self.closed:
            raise InputError("this SinkCache was closed; create a new one")
        self._streams.activate(self, explicit=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release the model (its own attention comes back) and end the stream; idempotent."""
        if not self.closed:
            self.closed = True
            for s in self.states:
                s.closed = True
            self._streams.discard(id(self))

    @property
    def cache(self) -> SinkCache:  # the pre-0.2 context manager yielded a separate Cache object
        return self

    # ------------------------------------------------------------------ one forward
    def plan_forward(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Called by the decoder-stack pre-hook: check the ids, plan every layer group, set ``position_ids``."""
        ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds")
        ref = ids if ids is not None else embeds
        b, c = ref.shape[0], ref.shape[1]  # type: ignore[union-attr]  # (the model takes ids or embeddings)
        if ids is not None:
            self.check_ids(ids)
        mask = kwargs.get("attention_mask")
        if isinstance(mask, dict):  # generate() on a hybrid model: one prepared mask per layer type, same padding
            mask = next((m for m in mask.values() if isinstance(m, torch.Tensor)), None)
        valid = _real_columns(mask, b, c, ref.device)  # type: ignore[union-attr]
        # Every column real, known on the host: no mask, or a CPU mask (read where it already is; on an
        # accelerator that read would be a synchronisation, so the per-row masked write is used instead).
        all_valid = not isinstance(mask, torch.Tensor) or (valid.device.type == "cpu" and bool(valid.all()))
        positions = [s.begin(valid, all_valid) for s in self.states][0]
        kwargs["position_ids"] = positions
        kwargs.pop("cache_position", None)
        return args, kwargs

    def planned_forward(self, forward, **kwargs):
        """``forward(**kwargs)`` — the model's forward or a ``torch.compile``'d one, given ``input_ids`` and this
        cache (``past_key_values=`` or ``cache=``) — with the forward planned here, eagerly, before the call, not
        in the decoder-stack hooks, which stand aside.

        The same computation as calling ``forward`` directly; what changes is where the host's bookkeeping runs.
        Inside a compiled ``forward`` nothing of the stream leaves the graph: a compiled decode step is one dynamo
        frame and one graph (the hooks' eager work is otherwise a graph break at the decoder stack's entry and
        exit). The finite-values check then runs on the returned logits. ``StreamSession.step`` decodes this way.
        """
        token = self._streams.enter_planned(self)
        try:
            _, planned = self.plan_forward((), kwargs)
            out = forward(**planned)
        finally:
            self._streams.exit_planned(token)
        self.check_hidden(out.logits)
        return out

    # ------------------------------------------------------------------ checks (per chunk, or deferred)
    def check_ids(self, ids: torch.Tensor) -> None:
        """Token ids in range: read on the host where they already are (CPU), else checked every ``check_every``."""
        if self._vocab is None or not ids.numel():
            return
        if ids.device.type == "cpu" and ids.numel() <= 64:  # a decode step: a few Python comparisons, no tensor op
            bad = next((v for v in ids.flatten().tolist() if not 0 <= v < self._vocab), None)
        elif ids.device.type == "cpu" or ids.shape[1] > 1:
            out = (ids < 0) | (ids >= self._vocab)
            bad = int(ids[out][0]) if bool(out.any()) else None
        else:  # one column on an accelerator: accumulate on the device, read back every `check_every` columns
            self._pending_ids = ((ids < 0) | (ids >= self._vocab)).any() | self._pending_ids
            return
        if bad is not None:
            raise InputError(f"token id {bad} is outside the model's vocabulary (0 … {self._vocab - 1}); "
                             "the ids come from a different tokenizer or were corrupted")

    def check_hidden(self, hidden: torch.Tensor) -> None:
        """Called after each forward with the decoder stack's output ``[B, C, D]``: NaN/inf → ModelWeightsError.

        A chunk, or any forward on the CPU, is checked at once (the values are on the host already); single
        columns on an accelerator are accumulated on the device and read back every ``check_every`` columns.
        """
        state = self.state
        if hidden.device.type == "cpu":
            # On the host already: one float64 sum, read at once (NaN and ±inf carry through it; finite
            # float32/16 values cannot overflow it).
            if not math.isfinite(float(hidden.sum(dtype=torch.float64))):
                self._pending_hidden = torch.ones((), dtype=torch.bool)
            self.flush_checks(state.columns - hidden.shape[1])
            return
        bad = ~torch.isfinite(hidden).all()
        if hidden.shape[1] == 1 and state.columns - self._checked < self.check_every:  # one column, on a device
            self._pending_hidden = bad | self._pending_hidden
            return
        self._pending_hidden = bad | self._pending_hidden
        self.flush_checks(state.columns - hidden.shape[1])

    def flush_checks(self, first: int | None = None) -> None:
        """Read the accumulated checks back (one host read) and raise for what they found."""
        lo, hi = (self._checked if first is None else min(first, self._checked)), self.state.columns - 1
        pending_ids, pending_hidden = self._pending_ids, self._pending_hidden
        self._pending_ids = self._pending_hidden = False
        self._checked = self.state.columns
        if isinstance(pending_hidden, torch.Tensor) and bool(pending_hidden):
            raise ModelWeightsError(
                f"the model produced NaN or inf hidden states while streaming (columns {lo}–{hi} of the stream); "
                "check its weights with sinklab.checks.check_weights, or run in float32 if it overflows in half "
                "precision")
        if isinstance(pending_ids, torch.Tensor) and bool(pending_ids):
            raise InputError(f"a token id outside the model's vocabulary (0 … {self._vocab - 1}) was fed in columns "  # type: ignore[operator]
                             f"{lo}–{hi}; the ids come from a different tokenizer or were corrupted")

    # ------------------------------------------------------------------ generate modes (rows, crop)
    def _select_rows(self, index: torch.Tensor) -> None:
        for state in self.states:
            if state.batch is not None:
                state.select_rows(index)
        for i, layer in enumerate(self.layers):
            if self.layer_states[i] is None:
                layer.reorder_cache(index)  # type: ignore[arg-type]  # transformers' own: every conv / recurrent state follows its row
            else:
                layer.select_rows(index)  # type: ignore[union-attr]  # a stream layer

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row ``i`` continues beam ``beam_idx[i]`` (every per-row tensor of the stream follows)."""
        self._select_rows(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """``num_return_sequences`` / beams: each row becomes ``repeats`` identical rows."""
        if self.state.batch is not None:
            self._select_rows(torch.arange(self.state.batch, device=self.state.device).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the rows ``indices`` (in that order)."""
        if self.state.batch is not None:
            self._select_rows(torch.as_tensor(indices, device=self.state.device).long())

    def crop(self, tokens_to_remove: int) -> None:
        """Take back the last ``-tokens_to_remove`` columns (assisted decoding, prompt lookup).

        Exact only while nothing has been evicted: a token that pushed another out of the window cannot be
        taken back (the one it replaced is gone). Past that point this raises; use a DynamicCache for assisted
        decoding, or a window larger than the whole generation. A hybrid's recurrent layers are cropped by
        transformers' own layers, which can take tokens back only while they record their past states
        (``activate_past_recording``, as ``generate()`` does for assisted decoding).
        """
        if tokens_to_remove > 0:
            raise InputError(f"SinkCache.crop takes minus the number of columns to remove (transformers ≥ 5), "
                             f"got {tokens_to_remove}")
        n = -int(tokens_to_remove)
        if n and self.policy.scored:
            raise InputError(f"SinkCache cannot take back tokens under the {self.policy.name!r} policy: its evictions "
                             "depend on every token seen (assisted decoding needs a DynamicCache or policy='streaming')")
        recording = [self.layers[i] for i in self.recurrent_layers if getattr(self.layers[i], "record_past", False)]
        if n and self.recurrent_layers and len(recording) < len(self.recurrent_layers):
            raise InputError(
                f"SinkCache cannot take back the last {n} tokens: the recurrent layers of this hybrid model fold every "
                "token into their state and keep no history unless they record it (cache.activate_past_recording(), "
                "which generate() calls for assisted decoding)")
        if n == 0 or self.state.batch is None:
            if self.state.batch is not None:
                for layer in recording:  # transformers' own: trims the recorded conv states back to the kernel size
                    layer.crop(0)  # type: ignore[union-attr]
            return
        if n > self.state.columns:
            raise InputError(f"cannot remove {n} columns from a stream of {self.state.columns}")
        for state in self.states:
            if bool((state.n_free > state.window).any()):
                raise InputError(
                    f"SinkCache cannot take back the last {n} tokens: the stream has already evicted tokens from its "
                    f"{state.window}-token window, and those are gone (a cropped stream would differ from one that "
                    "never saw the removed tokens). Assisted decoding and prompt lookup need a cache that keeps "
                    "every token (DynamicCache), or a window larger than the whole generation")
        for layer in recording:
            layer.crop(-n)  # type: ignore[union-attr]
        for state in self.states:
            state.drop_last(n)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Columns fed so far (padding included), whichever layer is asked: every layer of a stream has seen them
        all, a hybrid's recurrent layers too (whose own count is a tensor)."""
        return self.state.columns

    # ------------------------------------------------------------------ compile
    def get_query_offset(self, layer_idx: int = 0) -> int:
        """Columns fed so far; 0 inside a compiled forward, where the stream's own mask function ignores it
        (reading the host counter there would make torch.compile specialise on it and recompile every token)."""
        return 0 if torch.compiler.is_compiling() else self.state.columns

    @property
    def is_compileable(self) -> bool:
        """Decoding is compileable (fixed shapes; a packed ``kv_bits`` ring is not); transformers' ``generate``
        compiles a compileable cache under a CompileConfig."""
        return all(layer.is_compileable for layer in self.layers)
