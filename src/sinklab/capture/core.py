"""The capture's plumbing: attention-function registration, block hooks, the forward pass, collection.

:class:`AttentionCapture` is a context manager. On entry it installs sinklab's attention function
as the model's attention backend and hooks every transformer block's input/output, all through one
:class:`sinklab._compat.ModelPatch`; on exit everything is undone. The attention
function computes the layer's output itself (:func:`~sinklab.capture.reduce.chunked_attention`), in
query chunks from the post-RoPE ``q``/``k`` it is handed, and reduces each chunk's probabilities on the
fly (:class:`~sinklab.capture.reduce.ColumnStats`); value/update statistics come from
:mod:`~sinklab.capture.heads`, weight statistics from :mod:`~sinklab.capture.weights`, block-output
statistics from :mod:`~sinklab.capture.hidden`. Statistics are accumulated in float32 (float64 for
spectra) whatever the model dtype.
"""

from __future__ import annotations

import contextvars
from typing import Any

import torch
from torch import Tensor, nn

from .. import _compat
from ..errors import UnsupportedModelError
from ..variants import variant_column_logits, variant_gate, variant_has_columns
from .heads import head_statistics
from .hidden import HIDDEN_FIELDS, check_finite, hidden_statistics
from .reduce import ColumnStats, chunked_attention
from .resume import NOT_RESUMABLE, UNKNOWN_MAP, BlockInputs, find_final_map, run_blocks, stacked
from .types import CaptureBatch, CaptureConfig, StackedEdits, ValueEdit
from .weights import SHARED, WeightStatistics

__all__ = ["AttentionCapture"]

_ACTIVE: contextvars.ContextVar[AttentionCapture | None] = contextvars.ContextVar("sinklab_capture", default=None)

_PER_LAYER = ("column_mass", "column_min", "routed_fraction", "candidate_attention", "value_norm", "value_norm_out",
              "update_norm", "update_spectrum", "common_mode", "learned_sink_mass", "column_queries", "local_mass",
              "group_mass")
_PER_QUERY = ("row_entropy", "row_diagonal", "row_previous")  # CaptureConfig(row_stats=True) only


def _repeat_kv(x: Tensor, n_rep: int) -> Tensor:
    """``[B, Hkv, T, d]`` → ``[B, Hkv·n_rep, T, d]`` (query head ``h`` uses KV head ``h // n_rep``)."""
    if n_rep == 1:
        return x
    b, hkv, t, d = x.shape
    return x[:, :, None].expand(b, hkv, n_rep, t, d).reshape(b, hkv * n_rep, t, d)


class AttentionCapture:
    """Context manager that records sink statistics from a transformers model's forward passes.

    ``edit`` (a :class:`ValueEdit`, or :class:`StackedEdits` over stacked copies) is applied during every
    forward while set. ``weights``: the
    :class:`WeightStatistics` to use (default: the shared one, which recomputes a block's entry when its
    weights change). ``run(keep_inputs=True)``
    keeps every block's input (:class:`~sinklab.capture.resume.BlockInputs`) so that :meth:`final_states`
    can rerun an edited pass from the edited layer only, without statistics.

    Examples
    --------
    >>> with AttentionCapture(model) as cap:                      # doctest: +SKIP
    ...     batch = cap.run(input_ids=ids, attention_mask=mask)
    >>> batch.column_mass.shape                                   # doctest: +SKIP
    torch.Size([B, L, H, T])
    """

    def __init__(self, model: nn.Module, config: CaptureConfig | None = None,
                 edit: ValueEdit | StackedEdits | None = None,
                 *, weights: WeightStatistics | None = None) -> None:
        self.model = model
        self.config = config or CaptureConfig()
        self.edit = edit
        self.weights = weights if weights is not None else SHARED
        self.last_output: Any = None
        self.last_inputs: BlockInputs | None = None  # set by run(keep_inputs=True)
        self.statistics = True  # False while final_states() runs: attention output only
        self._layers: nn.ModuleList | None = None
        self._layer_of: dict[int, int] = {}
        self._patch: _compat.ModelPatch | None = None
        self._token_mask: Tensor | None = None
        self._query_group: Tensor | None = None  # run(query_group=…): [B, T] queries whose column sums are kept
        self._records: dict[int, dict[str, Tensor]] = {}
        self._hidden: dict[int, tuple[Tensor, Tensor, Tensor, Tensor] | None] = {}
        self._token: contextvars.Token | None = None
        self._calls: list[tuple[tuple, dict]] | None = None  # block inputs while run(keep_inputs=True)
        self._last_block: Tensor | None = None
        self._grab: int | None = None  # final_states() on a full pass: the block whose output it returns
        self._grabbed: Tensor | None = None
        self._causal_mask: tuple[Tensor, int, bool] | None = None  # (mask, Tk, is it the plain causal pattern)
        self._gate_hooked: dict[int, bool] = {}  # attention module → its output projection is hooked (a gate is read)
        self._pending: dict[int, tuple[int, Tensor]] = {}  # attention module → (layer, the output attend returned)
        self._kinds: list[str] | None = None  # per layer: attention | recurrent | feedforward (hybrids)

    # ------------------------------------------------------------------ set-up / tear-down
    def __enter__(self) -> AttentionCapture:
        _compat.check_capture(self.model)  # features the capture cannot reproduce, refused with what would lift it
        self._layers = _compat.find_layers(self.model)
        for index, layer in enumerate(self._layers):
            for sub in layer.modules():
                self._layer_of[id(sub)] = index
        self._patch = patch = _compat.ModelPatch(self.model)
        try:
            # A vision-language model: the text decoder's attention only; the vision tower keeps its own.
            target = _compat.language_model(self.model) if _compat.vision_language(self.model) else None
            patch.use_attention(_compat.ATTN_IMPLEMENTATION, _dispatch, mask=_compat.explicit_mask, target=target)
            patch.hook(self._layers[0], self._embed_hook, pre=True, with_kwargs=True)
            for layer in self._layers:
                patch.hook(layer, self._keep_hook, pre=True, with_kwargs=True)
            for index, layer in enumerate(self._layers):
                patch.hook(layer, self._make_block_hook(index))
            self._token = _ACTIVE.set(self)
        except BaseException:
            self._teardown()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._teardown()

    def _teardown(self) -> None:
        if self._patch is not None:
            self._patch.restore()  # the gate hooks go with it: a re-entered capture hooks the projections again
            self._patch = None
        self._gate_hooked.clear()
        if self._token is not None:
            _ACTIVE.reset(self._token)
            self._token = None

    @property
    def num_layers(self) -> int:
        return len(self._blocks)

    @property
    def _blocks(self) -> nn.ModuleList:
        if self._layers is None:
            raise RuntimeError("AttentionCapture is not active; use it as a context manager")
        return self._layers

    # ------------------------------------------------------------------ running
    @torch.no_grad()
    def run(self, *, full_model: bool = False, keep_inputs: bool = False, query_group: Tensor | None = None,
            **inputs: Any) -> CaptureBatch:
        """Run one forward pass (no cache) and return its statistics.

        The base model runs by default (no LM head); ``full_model=True`` runs the whole model and keeps
        its output in ``self.last_output`` (e.g. for logits under a :class:`ValueEdit`). ``keep_inputs``
        keeps every block's input in ``self.last_inputs`` for :meth:`final_states`. ``query_group`` ``[B, T]``
        (boolean, aligned with the input positions): :attr:`CaptureBatch.group_mass` sums each key's attention
        over those queries only (a vision-language scan's text queries).
        """
        if self._layers is None:
            raise RuntimeError("AttentionCapture.run() must be called inside `with AttentionCapture(model):`")
        self._records.clear()
        self._hidden.clear()
        self._pending.clear()
        self._kinds = None
        mask = inputs.get("attention_mask")
        self._token_mask = None if mask is None else mask.bool()
        self._calls = [] if keep_inputs else None
        self.last_inputs = None
        self._query_group = None if query_group is None else query_group.bool()
        try:
            self.last_output = self._forward(full_model, inputs)
            if keep_inputs:
                self.last_inputs = self._block_inputs(inputs)
        finally:
            self._calls = None
            self._last_block = None
            self._query_group = None
        self._pending.clear()
        missing = [i for i in range(len(self._layers)) if i not in self._records]
        if missing:
            self._kinds = self._layer_kinds(missing)
        return self._collect()

    def _layer_kinds(self, missing: list[int]) -> list[str]:
        """Per layer: ``attention``, or for the layers whose attention the capture did not see, what the model's own
        cache holds for them — ``recurrent`` (linear-attention / state-space / convolution state) or
        ``feedforward`` (nothing: an MLP-only block). Anything else is refused."""
        held = _compat.cache_layer_kinds(self.model, self.num_layers)
        kinds = ["attention"] * self.num_layers
        unknown = []
        for i in missing:
            kind = held[i]
            if kind == "keys":
                unknown.append(i)
            kinds[i] = "recurrent" if kind == "recurrent" else "feedforward"
        if unknown or len(missing) == self.num_layers:
            raise UnsupportedModelError(
                f"{type(self.model).__name__}: the attention of layer(s) {unknown or missing} did not go through "
                "transformers' attention interface, so sinklab cannot observe it"
                + (", and the model has no attention layer that it can" if not unknown else
                   ", and the model's own cache does not hold them as recurrent (linear-attention, state-space or "
                   "convolution) layers, which the scan would mark as such")
                + ". Supported: models whose attention dispatches through the interface (Llama, Qwen2/3, Mistral, "
                "Gemma, Phi-3, GPT-NeoX, GPT-2, OPT, BERT, ViT, DINOv2, gpt-oss …) and hybrids whose other layers "
                "the model's cache holds as recurrent (Qwen3-Next, Qwen3.5, LFM2, Jamba, Nemotron-H … — "
                "docs/architectures.md)."
            )
        return kinds

        return self._collect()

    @torch.no_grad()
    def forward(self, *, full_model: bool = False, **inputs: Any) -> Any:
        """One forward pass under ``self.edit`` without statistics; returns the model's output."""
        if self._layers is None:
            raise RuntimeError("AttentionCapture.forward() must be called inside `with AttentionCapture(model):`")
        mask = inputs.get("attention_mask")
        self.statistics, token_mask = False, self._token_mask
        self._token_mask = None if mask is None else mask.bool()
        try:
            return self._forward(full_model, inputs)
        finally:
            self.statistics, self._token_mask = True, token_mask

    def _forward(self, full_model: bool, inputs: dict) -> Any:
        was_training = self.model.training
        self.model.eval()
        try:
            kwargs = dict(inputs)
            if "input_ids" in kwargs or "inputs_embeds" in kwargs:
                kwargs.setdefault("use_cache", False)
            # The base model skips the LM head: logits (T × vocab) are never needed for the statistics.
            target = self.model if full_model else _compat.base_model(self.model)
            return target(**kwargs)
        finally:
            self.model.train(was_training)

    def _block_inputs(self, batch: dict) -> BlockInputs:
        final = getattr(self.last_output, "last_hidden_state", None)
        final_map: nn.Module | str | None
        if final is None or self._calls is None or len(self._calls) != self.num_layers:
            final_map = UNKNOWN_MAP
        elif _compat.resume_blocker(self.model, self._calls) is not None:
            final_map = NOT_RESUMABLE
        else:
            final_map = find_final_map(self.model, self._blocks, self._last_block, final,  # type: ignore[arg-type]
                                       self._token_mask)  # (the last block's output is kept with the calls)
        # calls/final are None only with final_map UNKNOWN_MAP, where a pass never restarts from them
        return BlockInputs(calls=self._calls, token_mask=self._token_mask, final=final,  # type: ignore[arg-type]
                           final_map=final_map,
                           batch=dict(batch))

    @torch.no_grad()
    def final_states(self, inputs: BlockInputs, start: int = 0, stop: int | None = None, *,
                     copies: int = 1) -> Tensor | None:
        """Rerun blocks ``start … stop − 1`` from ``inputs`` under ``self.edit``, without statistics.

        Returns the base model's final hidden states ``[B, T, d]`` (``stop`` None: through the last block and
        the final norm), or the hidden states after block ``stop − 1``. No LM head, no statistics. Where the
        final map is unknown the whole base model runs on ``inputs.batch`` instead (same result, slower), and so
        it does for any ``stop`` where no block may be rerun from its recorded input (``NOT_RESUMABLE``).
        ``copies``: run that many copies of the batch stacked along the batch axis (``[copies·B, T, d]``), e.g.
        under a :class:`StackedEdits` with one edit per copy.
        """
        inputs = stacked(inputs, copies)
        if self._layers is None:
            raise RuntimeError("AttentionCapture.final_states() must be called inside `with AttentionCapture(model):`")
        n = len(self._layers)
        stop = n if stop is None else stop
        self.statistics, token_mask = False, self._token_mask
        self._token_mask = inputs.token_mask
        was_training = self.model.training
        self.model.eval()
        try:
            if not inputs.resumable and (stop == n or inputs.final_map == NOT_RESUMABLE):
                self._grab = stop - 1 if stop < n else None
                output = self._forward(False, inputs.batch)
                return output.last_hidden_state if stop == n else self._grabbed
            hidden = run_blocks(self._layers, inputs, start, stop)
            if stop < n or inputs.final_map is None:
                return hidden
            return inputs.final_map(hidden)  # type: ignore[operator]  # resumable here: a module
        finally:
            self.statistics, self._token_mask = True, token_mask
            self._grab, self._grabbed = None, None
            self.model.train(was_training)

    def _collect(self) -> CaptureBatch:
        n = self.num_layers
        kinds = self._kinds or ["attention"] * n
        some = next(self._records[i] for i in range(n) if kinds[i] == "attention")
        _check_head_counts(self.model, {i: self._records[i] for i in range(n) if kinds[i] == "attention"})
        rec = [self._records[i] if kinds[i] == "attention" else _no_attention(some) for i in range(n)]
        hidden = [self._hidden[i] for i in range(n + 1)]
        per_layer: dict[str, Any] = {key: torch.stack([r[key] for r in rec], dim=1) if key in rec[0] else None for key in _PER_LAYER}
        gated = any("gate" in r for r in rec)
        kept = self.config.hidden_stats
        return CaptureBatch(
            **per_layer,
            **{name: torch.stack([h[i] for h in hidden], dim=1) if kept else None  # type: ignore[index, arg-type]
               for i, name in enumerate(HIDDEN_FIELDS)},
            token_mask=rec[0]["token_mask"],
            attention_maps=torch.stack([r["map"] for r in rec], dim=0) if self.config.map_len > 0 else None,
            qk_spectrum=torch.stack([r["qk"] for r in rec], dim=0),
            output_space=[bool(r["output_space"]) for r in rec],
            **{key: torch.stack([r[key] for r in rec], dim=1) for key in _PER_QUERY if self.config.row_stats},
            gate=torch.stack([_layer_gate(r, kind) for r, kind in zip(rec, kinds)], dim=1) if gated else None,
            layer_kinds=list(kinds),
        )

    # ------------------------------------------------------------------ hidden-state hooks
    def _hidden_stats(self, index: int, hidden: Tensor) -> None:
        mask = self._positions_mask(hidden.shape[0], hidden.shape[1], hidden.device)
        if self.config.hidden_stats:
            self._hidden[index] = hidden_statistics(hidden, mask, index)
        else:
            check_finite(hidden.detach(), mask, index)
            self._hidden[index] = None

    def _embed_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self.statistics:
            self._hidden_stats(0, _compat.residual_stream(self.model, _compat.block_input(args, kwargs)))

    def _keep_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._calls is None or not self.statistics:
            return
        hidden = _compat.block_input(args, kwargs).detach().clone()  # private copy: nothing later aliases it
        if args and isinstance(args[0], Tensor):
            args = (hidden,) + tuple(args[1:])
        else:
            kwargs = {**kwargs, "hidden_states": hidden}
        self._calls.append((tuple(args), dict(kwargs)))

    def _make_block_hook(self, index: int):
        def hook(module: nn.Module, args: tuple, output: object) -> None:
            if index == self._grab:
                self._grabbed = _compat.residual_stream(self.model, _compat.block_hidden_states(output))
            if not self.statistics:
                return
            hidden = _compat.residual_stream(self.model, _compat.block_hidden_states(output))  # AltUp: main copy
            self._hidden_stats(index + 1, hidden)
            if self._calls is not None and index == self.num_layers - 1:
                self._last_block = hidden.detach()

        return hook

    def _positions_mask(self, b: int, t: int, device: torch.device) -> Tensor:
        """``[B, T]`` real-token mask for a sequence of length ``t`` (all real without a mask).

        A sequence longer than the mask has positions the model put in front of the inputs (register
        tokens, a [CLS] or prompt prefix): they are real. A shorter one is the mask's last ``t`` positions.
        """
        mask = self._token_mask
        if mask is None:
            return torch.ones(b, t, dtype=torch.bool, device=device)
        mask = mask.to(device)
        if mask.shape[-1] < t:
            return torch.cat([mask.new_ones(mask.shape[0], t - mask.shape[-1]), mask], dim=-1)
        return mask[:, -t:] if mask.shape[-1] != t else mask

    def _group_rows(self, b: int, tq: int, tk: int, device: torch.device) -> Tensor | None:
        """The query group's ``[B, Tq]`` rows for a layer with ``tk`` keys (None without a group)."""
        group = self._query_group
        if group is None:
            return None
        if group.shape != (b, tk):
            raise UnsupportedModelError(
                f"{type(self.model).__name__}: the query group covers {tuple(group.shape)} positions but the "
                f"attention sees {(b, tk)}; the model changed the sequence length (the scan's modality split needs "
                "the image's tokens in the input ids, as the processor puts them)")
        return group.to(device)[:, tk - tq:]

    # ------------------------------------------------------------------ attention
    def _plain_causal(self, mask: Tensor, tq: int, tk: int) -> bool:
        """:func:`_is_plain_causal`, checked once per mask object (every layer of a kind shares one)."""
        cached = self._causal_mask
        if cached is not None and cached[0] is mask and cached[1] == tk:
            return cached[2]
        plain = _is_plain_causal(mask, tq, tk)
        self._causal_mask = (mask, tk, plain)
        return plain

    def attend(
        self,
        module: nn.Module,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        scaling: float | None = None,
        dropout: float = 0.0,
        **kwargs: Any,
    ) -> tuple[Tensor, None]:
        """Attention forward (same maths as transformers' eager path) plus on-the-fly statistics.

        ``query`` ``[B, H, Tq, dh]``, ``key``/``value`` ``[B, Hkv, Tk, dh]`` (post-RoPE), ``attention_mask``
        boolean ``[B, 1, Tq, Tk]`` (True = attend), additive float, or ``None``. Returns the output as
        ``[B, Tq, H, dh]`` in the query's dtype.
        """
        index = self._layer_of.get(id(module))
        if index is None:
            raise UnsupportedModelError(f"attention module {type(module).__name__} is outside the block list")
        if self.statistics and index in self._records:
            raise UnsupportedModelError(
                f"{type(self.model).__name__}: layer {index} ran attention twice in one forward "
                "(cross-attention, or differential attention's two maps per layer); the scan keeps one "
                "attention map per layer, so encoder-decoder and differential-attention models are not supported "
                "by it yet."
            )
        cfg = self.config
        b, h, tq, dh = query.shape
        hkv, tk, dv = key.shape[1], key.shape[2], value.shape[-1]
        dev = query.device
        scale = dh**-0.5 if scaling is None else float(scaling)
        is_causal = kwargs.get("is_causal")
        is_causal = getattr(module, "is_causal", True) if is_causal is None else bool(is_causal)
        sinks, softcap = kwargs.get("s_aux"), kwargs.get("softcap")
        has_columns = sinks is not None or variant_has_columns(module)  # sinklab.variants applied to this model

        def columns(q: Tensor) -> list:  # the learned columns (sink logit, kv-bias slot) for a chunk's queries
            return variant_column_logits(module, q, scale, softcap=softcap, model_sink=sinks)

        k = _repeat_kv(key.float(), h // hkv)  # (B, H, Tk, dh)
        v = _repeat_kv(value.float(), h // hkv).clone()  # (B, H, Tk, dv), private: edits write into it
        edit = self.edit if self.edit is not None and self.edit.layer == index else None
        drop = edit.apply(v) if edit is not None else None  # may edit v in place (a private float copy)
        qmask = self._positions_mask(b, tk, dev)[:, tk - tq :]  # (B, Tq)
        if attention_mask is not None:
            # The mask says what each query sees (the capture's mask function always builds it, as for eager
            # attention); the plain causal pattern goes back to None + is_causal, the fast path of the same maths.
            plain = self._plain_causal(attention_mask, tq, tk)
            attention_mask, is_causal = (None, True) if plain else (attention_mask[..., :tk], is_causal)
        stats = None
        if self.statistics:
            stats = ColumnStats(b, h, tq, tk, qmask, cfg, has_sink=has_columns, group=self._group_rows(b, tq, tk, dev))
        out = chunked_attention(query, k, v, attention_mask, qmask, is_causal=is_causal, scale=scale,
                                chunk_elements=cfg.chunk_elements, softcap=softcap,
                                columns=columns if has_columns else None, bias=kwargs.get("position_bias"), drop=drop,
                                stats=stats)  # (B, H, Tq, dv)
        gate = variant_gate(module, h)  # output gate σ(X W) on each head's output, (B, Tq, H, dv | 1)
        if gate is not None:
            out = out * gate.transpose(1, 2).to(out.dtype)
        if stats is None:  # final_states(): the output is all that is needed
            return out.to(query.dtype).transpose(1, 2).contiguous(), None
        returned = out.to(query.dtype).transpose(1, 2).contiguous()  # (B, Tq, H, dv)
        if gate is None:  # a gate the model applies itself, between this output and its output projection
            self._watch_gate(module, index, returned)
        key_mask = self._positions_mask(b, tk, dev)
        info = self.weights.get(index, self._blocks[index], module, h, hkv, dv, dev)
        record = {
            **stats.finish(),
            **head_statistics(v, out, info.r, qmask, key_mask[:, None], index, full=cfg.head_stats),
            "token_mask": key_mask,
            "qk": info.qk,
            "output_space": torch.tensor(info.output_space),
        }
        if gate is not None:  # sinklab's own gate variant: its mean over each head's dimensions, (B, H, Tq)
            record["gate"] = gate.float().mean(-1).transpose(1, 2).expand(b, h, tq)
        self._records[index] = {name: value.cpu() for name, value in record.items()}
        return returned, None

    # ------------------------------------------------------------------ output gates
    def _watch_gate(self, module: nn.Module, index: int, returned: Tensor) -> None:
        """Keep the attention output ``[B, Tq, H, dv]`` until the module's output projection reads its input: where
        the model multiplies the two by a gate in between (Qwen3-Next, Qwen3.5: ``o_proj(attn · σ(gate))``), their
        ratio is that gate (:func:`gate_ratio`)."""
        key = id(module)
        if key not in self._gate_hooked:  # looked up once per module, hooked where it is a linear projection
            self._gate_hooked[key] = isinstance(proj := _compat.child_module(module, _compat.O_NAMES), nn.Linear)
            if self._gate_hooked[key]:
                self._patch.hook(proj, self._make_gate_hook(key), pre=True)  # type: ignore[union-attr, arg-type]
        if self._gate_hooked[key]:
            self._pending[key] = (index, returned)

    def _make_gate_hook(self, key: int):
        def hook(proj: nn.Module, args: tuple) -> None:
            pending = self._pending.pop(key, None)
            if pending is None or not self.statistics or not args or not isinstance(args[0], Tensor):
                return
            index, returned = pending
            record = self._records.get(index)
            if record is None or "gate" in record:
                return
            gate = gate_ratio(args[0], returned)
            if gate is not None:
                record["gate"] = gate.cpu()

        return hook


def gate_ratio(projected: Tensor, returned: Tensor, *, tolerance: float = 1e-2) -> Tensor | None:
    """The output gate a model applied between its attention output and its output projection, per query and head.

    ``returned`` ``[B, Tq, H, dv]`` is what the attention function returned; ``projected`` the output projection's
    input (``[B, Tq, H·dv]``). Their elementwise ratio, averaged over each head's dimensions, gives ``[B, H, Tq]``:
    ``x = fl(y · g)`` makes ``x / y`` the gate to the dtype's rounding whatever ``y``'s size, so only entries where
    the attention output is exactly 0 (or subnormal) are left out. ``None`` when there
    is no gate (the two are equal) or what lies between is not a gate in [0, 1] (a normalisation, a scale).
    """
    if projected.numel() != returned.numel():
        return None
    x = projected.reshape(returned.shape).float()
    y = returned.float()
    if torch.equal(x, y):
        return None
    valid = y.abs() > torch.finfo(torch.float32).tiny
    ratio = torch.where(valid, x / torch.where(valid, y, 1.0), torch.nan)
    seen = ratio[valid]
    if seen.numel() == 0 or bool((seen < -tolerance).any()) or bool((seen > 1 + tolerance).any()):
        return None
    return ratio.nanmean(-1).transpose(1, 2)  # (B, H, Tq)


def _check_head_counts(model: nn.Module, records: dict[int, dict[str, Tensor]]) -> None:
    """Refuse a model whose attention layers have different numbers of heads (``records``: layer → its record,
    ``column_mass`` ``[B, H, T]``): every per-head statistic is stacked into one ``[B, L, H, …]`` tensor."""
    layers: dict[int, list[int]] = {}
    for i, record in records.items():
        layers.setdefault(int(record["column_mass"].shape[1]), []).append(i)
    if len(layers) > 1:
        counts = "; ".join(f"{h} heads in layer(s) {ls}" for h, ls in sorted(layers.items()))
        raise UnsupportedModelError(
            f"{type(model).__name__}: its attention layers have different numbers of heads ({counts}), and the "
            "capture (scan, diagnose, circuit) stacks every layer's per-head statistics into one [batch, layer, "
            "head, …] tensor. Lifting this needs per-layer head axes in CaptureBatch (or the smaller layers' heads "
            "padded and marked absent) and in the analyses that read it; until then, a config with one head count "
            "for every layer kind is captured.")


def _no_attention(like: dict[str, Tensor]) -> dict[str, Tensor]:
    """A record for a layer without attention (recurrent, MLP-only), shaped like an attention layer's ``like``: NaN
    statistics, no query sees any key, the same real-token mask."""
    out = {}
    for name, value in like.items():
        if name == "token_mask":
            out[name] = value
        elif name == "column_queries":
            out[name] = torch.zeros_like(value)
        elif name == "output_space":
            out[name] = torch.tensor(False)
        elif name != "gate":
            out[name] = torch.full_like(value, torch.nan, dtype=torch.float32)
    return out


def _layer_gate(record: dict[str, Tensor], kind: str) -> Tensor:
    """One layer's ``[B, H, T]`` gate for :attr:`CaptureBatch.gate`: measured, 1 for an ungated attention layer (its
    output passes whole), NaN for a layer without attention."""
    mass = record["learned_sink_mass"]  # (B, H): any per-head field gives the shape
    t = record["token_mask"].shape[-1]
    if "gate" in record:
        gate = record["gate"]
        return torch.cat([gate.new_full((*gate.shape[:2], t - gate.shape[-1]), torch.nan), gate], -1) \
            if gate.shape[-1] < t else gate
    return torch.full((*mass.shape, t), 1.0 if kind == "attention" else torch.nan)


def _is_plain_causal(mask: Tensor, tq: int, tk: int) -> bool:
    """Whether boolean ``mask`` ``[B|1, 1, Tq, ≥Tk]`` is, on its first ``tk`` keys, exactly causal for every row: query
    ``i`` sees keys ``0 … i + Tk − Tq`` (no padding, no window)."""
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[-2] != tq or mask.shape[-1] < tk:
        return False
    if mask.shape[0] > 1 and mask.stride(0) == 0:  # one mask expanded over the batch: check it once
        mask = mask[:1]
    rows = torch.arange(tq, device=mask.device)[:, None] + (tk - tq)
    causal = torch.arange(tk, device=mask.device)[None, :] <= rows  # (Tq, Tk)
    return bool((mask[..., :tk] == causal).all())


def _dispatch(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, **kwargs):
    """The attention backend the capture installs; routes to the active capture."""
    capture = _ACTIVE.get()
    if capture is None:
        raise RuntimeError(
            "sinklab's capture attention was called outside an active AttentionCapture; "
            "the model was copied or changed while a capture was active."
        )
    return capture.attend(module, query, key, value, attention_mask, **kwargs)
