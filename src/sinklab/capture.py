"""Model plumbing: record per-layer, per-head attention statistics without holding L×H×T×T.

:class:`AttentionCapture` is a context manager. On entry it registers sinklab's attention function
with transformers' ``AttentionInterface`` (plus the matching mask function), switches the model to
it, and hooks every transformer block's input/output; on exit everything is undone. The attention
function computes the layer's output itself, in query chunks from the post-RoPE ``q``/``k`` it is
handed, and reduces each chunk's probabilities on the fly into per-column and per-query statistics.
Statistics are accumulated in float32 (and float64 for spectra) whatever the model dtype.
"""

from __future__ import annotations

import contextvars
import math
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from . import _compat, metrics
from .attention import mask_rows
from .errors import UnsupportedModelError

__all__ = ["CaptureConfig", "CaptureBatch", "AttentionCapture", "ValueEdit", "EDIT_MODES"]

_ACTIVE: contextvars.ContextVar[AttentionCapture | None] = contextvars.ContextVar("sinklab_capture", default=None)


@dataclass
class CaptureConfig:
    """What :class:`AttentionCapture` keeps besides the always-on statistics."""

    candidates: tuple[int, ...] = (0, 1, 2, 3)  # positions whose per-query attention is kept
    map_len: int = 128  # keep sample 0's attention maps over its first map_len positions (0: none)
    chunk_elements: int = 1 << 21  # score entries per query chunk (bounds the temporaries)
    route_threshold: float = 0.5  # A_ij at or above this counts a query as routed to column j

    def __post_init__(self) -> None:
        if any(p < 0 for p in self.candidates):
            raise ValueError(f"candidate positions must be ≥ 0, got {self.candidates}")
        if self.map_len < 0 or self.chunk_elements < 1:
            raise ValueError("map_len must be ≥ 0 and chunk_elements ≥ 1")


@dataclass
class CaptureBatch:
    """Statistics of one forward pass over a batch (CPU tensors; padding positions are NaN).

    Shapes: ``B`` batch, ``L`` layers, ``H`` heads, ``T`` positions, ``K`` candidates, ``r`` head width.
    """

    column_mass: Tensor  # (B, L, H, T) mean attention received from the queries that see it
    column_min: Tensor  # (B, L, H, T) min over those queries
    routed_fraction: Tensor  # (B, L, H, T) share of those queries with A >= route_threshold
    candidate_attention: Tensor  # (B, L, H, T, K) attention of each query to each candidate position
    value_norm: Tensor  # (B, L, H, T) ||v_j|| in head space
    value_norm_out: Tensor  # (B, L, H, T) ||W_O^h v_j|| in output space (head space if W_O unknown)
    update_norm: Tensor  # (B, L, H, T) ||W_O^h o_i|| of each query's head update
    update_spectrum: Tensor  # (B, L, H, r) singular values of the head update U over real queries
    common_mode: Tensor  # (B, L, H) ||mean u||^2 / mean ||u||^2
    learned_sink_mass: Tensor  # (B, L, H) mean over queries of 1 - sum_j A_ij
    hidden_norm: Tensor  # (B, L+1, T) ||x|| per token, index 0 = block-0 input
    hidden_max_abs: Tensor  # (B, L+1, T) max |x| per token
    hidden_max_dim: Tensor  # (B, L+1, T) its dimension (long)
    hidden_median_abs: Tensor  # (B, L+1) median |x| over real tokens and dims
    token_mask: Tensor  # (B, T) real tokens
    attention_maps: Tensor | None  # (L, H, m, m) sample 0's attention over its first m positions
    qk_spectrum: Tensor  # (L, H, dh) singular values of Wq_h^T Wk_h (NaN if layout unknown)
    output_space: list[bool] = field(default_factory=list)  # per layer: W_O found


_FLOOR = torch.finfo(torch.float32).min


EDIT_MODES = ("record", "zero", "replace", "remove_column")


@dataclass
class ValueEdit:
    """A causal edit of one head's attention at one key position per sample.

    ``mode``: ``"record"`` stores the head's value vectors at ``positions`` in ``recorded`` (``[B, dh]``);
    ``"zero"`` sets them to 0; ``"replace"`` sets them to ``replacement`` (``[B, dh]`` or ``[dh]``);
    ``"remove_column"`` masks the column for this head so each row renormalises over the rest.
    ``positions`` is a ``[B]`` long tensor (one key position per sample).
    """

    layer: int
    head: int
    positions: Tensor
    mode: str = "record"
    replacement: Tensor | None = None
    recorded: Tensor | None = None

    def __post_init__(self) -> None:
        if self.mode not in EDIT_MODES:
            raise ValueError(f"unknown edit mode {self.mode!r}; choose one of {EDIT_MODES}")
        if self.mode == "replace" and self.replacement is None:
            raise ValueError("mode 'replace' needs a replacement vector")


def _repeat_kv(x: Tensor, n_rep: int) -> Tensor:
    if n_rep == 1:
        return x
    b, hkv, t, d = x.shape
    return x[:, :, None].expand(b, hkv, n_rep, t, d).reshape(b, hkv * n_rep, t, d)


@dataclass
class _LayerInfo:
    r: Tensor  # (H, dh, dh) triangular factor of W_O^h: ||W_O^h v|| = ||R_h v||
    output_space: bool
    qk: Tensor  # (H, dh)


class AttentionCapture:
    """Context manager that records sink statistics from a transformers model's forward passes.

    Examples
    --------
    >>> with AttentionCapture(model) as cap:                      # doctest: +SKIP
    ...     batch = cap.run(input_ids=ids, attention_mask=mask)
    >>> batch.column_mass.shape                                   # doctest: +SKIP
    torch.Size([B, L, H, T])
    """

    def __init__(self, model: nn.Module, config: CaptureConfig | None = None, edit: ValueEdit | None = None) -> None:
        self.model = model
        self.config = config or CaptureConfig()
        self.edit = edit  # applied during every forward while set (see ValueEdit)
        self.last_output: object = None
        self._layers: nn.ModuleList | None = None
        self._layer_of: dict[int, int] = {}
        self._handles: list = []
        self._previous_impl: str | None = None
        self._token_mask: Tensor | None = None
        self._records: dict[int, dict[str, Tensor]] = {}
        self._hidden: dict[int, tuple[Tensor, Tensor, Tensor, Tensor]] = {}
        self._info: dict[tuple[int, str], _LayerInfo] = {}
        self._token: contextvars.Token | None = None

    # ------------------------------------------------------------------ set-up / tear-down
    def __enter__(self) -> AttentionCapture:
        self._layers = _compat.find_layers(self.model)
        for index, layer in enumerate(self._layers):
            for sub in layer.modules():
                self._layer_of[id(sub)] = index
        _compat.register_attention(_compat.ATTN_IMPLEMENTATION, _dispatch)
        self._previous_impl = _compat.get_attn_implementation(self.model)
        _compat.set_attn_implementation(self.model, _compat.ATTN_IMPLEMENTATION)
        try:
            self._handles.append(self._layers[0].register_forward_pre_hook(self._embed_hook, with_kwargs=True))
            for index, layer in enumerate(self._layers):
                self._handles.append(layer.register_forward_hook(self._make_block_hook(index)))
            self._token = _ACTIVE.set(self)
        except BaseException:
            self._teardown()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._teardown()

    def _teardown(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._token is not None:
            _ACTIVE.reset(self._token)
            self._token = None
        if self._previous_impl is not None and _compat.get_attn_implementation(self.model) != self._previous_impl:
            self.model.set_attn_implementation(self._previous_impl)

    @property
    def num_layers(self) -> int:
        if self._layers is None:
            raise RuntimeError("AttentionCapture is not active; use it as a context manager")
        return len(self._layers)

    # ------------------------------------------------------------------ running
    @torch.no_grad()
    def run(self, *, full_model: bool = False, **inputs: Tensor) -> CaptureBatch:
        """Run one forward pass (no cache) and return its statistics.

        The base model runs by default (no LM head); ``full_model=True`` runs the whole model and keeps
        its output in ``self.last_output`` (e.g. for logits under a :class:`ValueEdit`).
        """
        if self._layers is None:
            raise RuntimeError("AttentionCapture.run() must be called inside `with AttentionCapture(model):`")
        self._records.clear()
        self._hidden.clear()
        mask = inputs.get("attention_mask")
        self._token_mask = None if mask is None else mask.bool()
        was_training = self.model.training
        self.model.eval()
        try:
            kwargs = dict(inputs)
            if "input_ids" in kwargs or "inputs_embeds" in kwargs:
                kwargs.setdefault("use_cache", False)
            # The base model skips the LM head: logits (T × vocab) are never needed for the statistics.
            target = self.model if full_model else getattr(self.model, "base_model", self.model)
            self.last_output = target(**kwargs)
        finally:
            self.model.train(was_training)
        missing = [i for i in range(len(self._layers)) if i not in self._records]
        if missing:
            raise UnsupportedModelError(
                f"{type(self.model).__name__}: the attention of layer(s) {missing} did not go through "
                "transformers' AttentionInterface, so sinklab cannot observe it. Supported: models whose "
                "attention modules call ALL_ATTENTION_FUNCTIONS (Llama, Qwen2/3, Mistral, Gemma, Phi-3, GPT-NeoX, "
                "GPT-2, OPT, BERT, ViT, DINOv2, gpt-oss …)."
            )
        return self._collect()

    def _collect(self) -> CaptureBatch:
        n = len(self._layers)
        rec = [self._records[i] for i in range(n)]

        def stack(key: str) -> Tensor:
            return torch.stack([r[key] for r in rec], dim=1)

        token_mask = rec[0]["token_mask"]
        hidden = [self._hidden[i] for i in range(n + 1)]
        maps = None
        if self.config.map_len > 0:
            maps = torch.stack([r["map"] for r in rec], dim=0)
        return CaptureBatch(
            column_mass=stack("column_mass"),
            column_min=stack("column_min"),
            routed_fraction=stack("routed_fraction"),
            candidate_attention=stack("candidate_attention"),
            value_norm=stack("value_norm"),
            value_norm_out=stack("value_norm_out"),
            update_norm=stack("update_norm"),
            update_spectrum=stack("update_spectrum"),
            common_mode=stack("common_mode"),
            learned_sink_mass=stack("learned_sink_mass"),
            hidden_norm=torch.stack([h[0] for h in hidden], dim=1),
            hidden_max_abs=torch.stack([h[1] for h in hidden], dim=1),
            hidden_max_dim=torch.stack([h[2] for h in hidden], dim=1),
            hidden_median_abs=torch.stack([h[3] for h in hidden], dim=1),
            token_mask=token_mask,
            attention_maps=maps,
            qk_spectrum=torch.stack([r["qk"] for r in rec], dim=0),
            output_space=[bool(r["output_space"]) for r in rec],
        )

    # ------------------------------------------------------------------ hidden-state hooks
    def _hidden_stats(self, index: int, hidden: Tensor) -> None:
        x = hidden.detach().float()
        b, t = x.shape[0], x.shape[1]
        mask = self._positions_mask(b, t, x.device)
        norm = x.norm(dim=-1)
        max_abs, dim = x.abs().max(dim=-1)
        median = metrics.activation_median(x, mask)
        nan = torch.full((), math.nan, device=x.device)
        self._hidden[index] = (
            torch.where(mask, norm, nan).cpu(),
            torch.where(mask, max_abs, nan).cpu(),
            torch.where(mask, dim, -1).cpu(),
            median.cpu(),
        )

    def _embed_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self._hidden_stats(0, _compat.block_input(args, kwargs))

    def _make_block_hook(self, index: int):
        def hook(module: nn.Module, args: tuple, output: object) -> None:
            self._hidden_stats(index + 1, _compat.block_hidden_states(output))

        return hook

    def _positions_mask(self, b: int, t: int, device: torch.device) -> Tensor:
        """``[B, T]`` real-token mask for a sequence of length ``t`` (all real without a mask)."""
        mask = self._token_mask
        if mask is None or mask.shape[-1] < t:
            return torch.ones(b, t, dtype=torch.bool, device=device)
        return mask[:, -t:].to(device) if mask.shape[-1] != t else mask.to(device)

    # ------------------------------------------------------------------ attention
    def _apply_edit(self, index: int, v: Tensor) -> tuple[int, Tensor] | None:
        """Apply ``self.edit`` to layer ``index``'s per-head values ``v`` ``[B, H, Tk, dv]``.

        Returns ``(head, positions)`` for a column removal (done on the mask), else ``None``.
        """
        edit = self.edit
        if edit is None or edit.layer != index:
            return None
        rows = torch.arange(v.shape[0], device=v.device)
        pos = edit.positions.to(v.device).long()
        if edit.mode == "record":
            edit.recorded = v[rows, edit.head, pos].detach().cpu().clone()
        elif edit.mode == "zero":
            v[rows, edit.head, pos] = 0.0
        elif edit.mode == "replace":
            v[rows, edit.head, pos] = edit.replacement.to(v.device, v.dtype).expand(v.shape[0], v.shape[-1])
        elif edit.mode == "remove_column":
            return edit.head, pos
        return None

    def _layer_info(self, index: int, module: nn.Module, h: int, hkv: int, dh: int, device: torch.device) -> _LayerInfo:
        key = (index, str(device))
        info = self._info.get(key)
        if info is None:
            weights = _compat.head_weights(self._layers[index], module, h, hkv, dh)
            if weights.wo is not None:
                r = torch.linalg.qr(weights.wo, mode="r").R  # (H, dh, dh): ||W_O^h v|| = ||R_h v||
            else:
                r = torch.eye(dh, dtype=torch.float64).expand(h, dh, dh)
            if weights.wq is not None and weights.wk is not None:
                qk = metrics.qk_spectrum(weights.wq, weights.wk)
            else:
                qk = torch.full((h, dh), math.nan, dtype=torch.float64)
            info = _LayerInfo(r=r.float().to(device), output_space=weights.wo is not None, qk=qk.float())
            self._info[key] = info
        return info

    def attend(
        self,
        module: nn.Module,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        scaling: float | None = None,
        dropout: float = 0.0,
        **kwargs: object,
    ) -> tuple[Tensor, None]:
        """Attention forward (same maths as transformers' eager path) plus on-the-fly statistics.

        ``query`` ``[B, H, Tq, dh]``, ``key``/``value`` ``[B, Hkv, Tk, dh]`` (post-RoPE), ``attention_mask``
        boolean ``[B, 1, Tq, Tk]`` (True = attend), additive float, or ``None``. Returns the output as
        ``[B, Tq, H, dh]`` in the query's dtype.
        """
        index = self._layer_of.get(id(module))
        if index is None:
            raise UnsupportedModelError(f"attention module {type(module).__name__} is outside the block list")
        if index in self._records:
            raise UnsupportedModelError(
                f"{type(self.model).__name__}: layer {index} ran attention twice in one forward "
                "(cross-attention?); encoder-decoder models are not supported by the scan."
            )
        cfg = self.config
        b, h, tq, dh = query.shape
        hkv, tk, dv = key.shape[1], key.shape[2], value.shape[-1]
        dev = query.device
        scale = dh**-0.5 if scaling is None else float(scaling)
        is_causal = kwargs.get("is_causal")
        is_causal = getattr(module, "is_causal", True) if is_causal is None else bool(is_causal)
        softcap = kwargs.get("softcap")
        sinks = kwargs.get("s_aux")
        bias = kwargs.get("position_bias")
        variant = getattr(module, "sinklab_variant", None)  # sinklab.variants applied to this model
        if variant is not None:
            if variant.kv_bias:
                raise UnsupportedModelError("capturing a model with the kv-bias variant is not supported yet")
            if variant.sink_logit:
                sinks = module.sinklab_sink_logit
            elif variant.softmax1:
                sinks = torch.zeros(h, device=query.device)
        k = _repeat_kv(key.float(), h // hkv)  # (B, H, Tk, dh)
        v = _repeat_kv(value.float(), h // hkv).clone()  # (B, H, Tk, dv), private: edits write into it
        drop = self._apply_edit(index, v)  # may edit v in place (it is a private float copy)
        qmask = self._positions_mask(b, tk, dev)[:, tk - tq :]  # (B, Tq)
        if attention_mask is not None:
            attention_mask = attention_mask[..., :tk]

        out = torch.empty(b, h, tq, dv, device=dev)
        col_sum = torch.zeros(b, h, tk, device=dev)
        col_cnt = torch.zeros(b, tk, device=dev)
        col_min = torch.full((b, h, tk), math.inf, device=dev)
        col_hit = torch.zeros(b, h, tk, device=dev)
        row_mass = torch.zeros(b, h, tq, device=dev)
        cands = [p for p in cfg.candidates]
        cand = torch.full((b, h, tq, len(cands)), math.nan, device=dev)
        m = min(cfg.map_len, tq, tk)
        amap = torch.zeros(h, m, m, device=dev) if cfg.map_len > 0 else None
        chunk = max(1, min(tq, cfg.chunk_elements // max(1, b * h * tk)))

        # Fast path (no mask tensor, no padding): only the causal diagonal block needs masking, and
        # every column left of it is seen by every query of the chunk.
        fast = attention_mask is None and bool(qmask.all()) and drop is None
        offset = tk - tq
        qweight = qmask.float()[:, None, None, :]  # (B, 1, 1, Tq) for matmul reductions over queries
        for c0 in range(0, tq, chunk):
            c1 = min(tq, c0 + chunk)
            allowed, additive = mask_rows(attention_mask, is_causal, c0, c1, tq, tk, dev)
            if attention_mask is None:  # causal rows c0..c1 see keys up to c1 - 1 + offset
                kend = min(tk, c1 + offset) if is_causal and tq > 1 else tk
            else:
                kend = _last_visible(allowed, tk)
            allowed = allowed[..., :kend]
            if drop is not None:  # remove_column: this head no longer sees the column
                allowed = allowed.expand(b, h, c1 - c0, kend).clone()
                keep = drop[1] < kend
                allowed[torch.arange(b, device=dev)[keep], drop[0], :, drop[1][keep]] = False
            full = (min(kend, c0 + offset + 1) if is_causal and tq > 1 else kend) if fast else 0
            scores = torch.matmul(query[:, :, c0:c1].float() * scale, k[:, :, :kend].transpose(-1, -2))
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            if bias is not None:
                scores = scores + bias[..., c0:c1, :kend].float()
            if additive is not None:
                scores = scores + additive[..., :kend]
            # A finite floor (as eager attention uses) keeps rows with no visible key finite; their
            # queries are padding and excluded below.
            scores[..., full:].masked_fill_(~allowed[..., full:], _FLOOR)
            if sinks is not None:
                sink = sinks.float().to(dev).reshape(1, h, 1, 1)
                top = torch.maximum(scores.amax(-1, keepdim=True), sink)
                e = torch.exp(scores - top)
                probs = e / (e.sum(-1, keepdim=True) + torch.exp(sink - top))
                row_mass[:, :, c0:c1] = probs.sum(-1)
            else:
                probs = torch.softmax(scores, dim=-1)
                row_mass[:, :, c0:c1] = 1.0
            del scores
            if drop is not None:  # a row whose only visible key was removed attends to nothing: output 0
                probs = probs.masked_fill(~allowed.any(-1, keepdim=True), 0.0)
            out[:, :, c0:c1] = torch.matmul(probs, v[:, :, :kend])

            # Disallowed entries are exactly 0, so sums over queries only need the query mask.
            hits = probs >= cfg.route_threshold
            if fast:
                col_sum[..., :kend] += probs.sum(2)
                col_hit[..., :kend] += hits.sum(2)
                col_cnt[:, :full] += c1 - c0
                col_min[..., :full] = torch.minimum(col_min[..., :full], probs[..., :full].amin(2))
                diag = allowed[..., full:]
                col_cnt[:, full:kend] += diag[:, 0].sum(1)
            else:
                qw = qweight[..., c0:c1]  # (B, 1, 1, C)
                col_sum[..., :kend] += torch.matmul(qw, probs)[:, :, 0]
                col_hit[..., :kend] += torch.matmul(qw, hits.float())[:, :, 0]
                col_cnt[:, :kend] += torch.matmul(qw[:, 0], allowed[:, 0].float())[:, 0]
                diag = allowed & qmask[:, None, c0:c1, None]  # (B, 1, C, kend)
            low = probs[..., full:].masked_fill(~diag, math.inf).amin(2)
            col_min[..., full:kend] = torch.minimum(col_min[..., full:kend], low)
            for j, p in enumerate(cands):
                if p < kend:
                    cand[:, :, c0:c1, j] = probs[..., p]
                elif p < tk:
                    cand[:, :, c0:c1, j] = 0.0
            if amap is not None and c0 < m:
                r1 = min(c1, m)
                amap[:, c0:r1, : min(m, kend)] = probs[0, :, : r1 - c0, :m]

        if variant is not None and variant.gate is not None:  # output gate σ(X W) on each head's output
            gate = torch.sigmoid(module.sinklab_gate(module.sinklab_gate_input).float())  # (B, Tq, H·dv | H)
            out = out * gate.view(b, tq, h, -1).transpose(1, 2)
        seen = col_cnt[:, None] > 0  # (B, 1, Tk)
        nan = torch.full((), math.nan, device=dev)
        info = self._layer_info(index, module, h, hkv, dv, dev)
        # Output-space quantities through R_h (||W_O^h x|| = ||R_h x||).
        v_out = torch.einsum("bhtd,hed->bhte", v, info.r)
        u = torch.einsum("bhtd,hed->bhte", out, info.r) * qmask[:, None, :, None]  # (B, H, Tq, dh)
        u64 = u.double()
        gram = u64.transpose(-1, -2) @ u64  # (B, H, dh, dh)
        spectrum = torch.linalg.eigvalsh(gram).clamp_min(0).flip(-1).sqrt()
        n_q = qmask.sum(-1).double().clamp_min(1)[:, None]  # (B, 1)
        mean_u = u64.sum(2) / n_q[..., None]
        energy = gram.diagonal(dim1=-2, dim2=-1).sum(-1) / n_q
        common = (mean_u * mean_u).sum(-1) / energy
        qmask_f = qmask[:, None].float()
        sink_mass = ((1.0 - row_mass) * qmask_f).sum(-1) / qmask_f.sum(-1).clamp_min(1)
        key_mask = self._positions_mask(b, tk, dev)[:, None]  # (B, 1, Tk)

        record = {
            "column_mass": torch.where(seen, col_sum / col_cnt[:, None].clamp_min(1), nan),
            "column_min": torch.where(seen, col_min, nan),
            "routed_fraction": torch.where(seen, col_hit / col_cnt[:, None].clamp_min(1), nan),
            "candidate_attention": torch.where(qmask[:, None, :, None], cand, nan),
            "value_norm": torch.where(key_mask, v.norm(dim=-1), nan),
            "value_norm_out": torch.where(key_mask, v_out.norm(dim=-1), nan),
            "update_norm": torch.where(qmask[:, None], u.norm(dim=-1), nan),
            "update_spectrum": spectrum.float(),
            "common_mode": common.float(),
            "learned_sink_mass": sink_mass,
            "token_mask": self._positions_mask(b, tk, dev),
            "qk": info.qk,
            "output_space": torch.tensor(info.output_space),
        }
        if amap is not None:
            record["map"] = amap
        self._records[index] = {name: value.cpu() for name, value in record.items()}
        return out.to(query.dtype).transpose(1, 2).contiguous(), None


def _last_visible(allowed: Tensor, tk: int) -> int:
    """One past the last key column any row of the chunk may see (skip the causal upper triangle)."""
    cols = allowed.reshape(-1, allowed.shape[-1]).any(0).nonzero()
    return int(cols.max()) + 1 if cols.numel() else tk


def _dispatch(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, **kwargs):
    """The function registered with ``AttentionInterface``; routes to the active capture."""
    capture = _ACTIVE.get()
    if capture is None:
        raise RuntimeError(
            "sinklab's capture attention was called outside an active AttentionCapture; "
            "restore the model's attention implementation (e.g. model.set_attn_implementation('sdpa'))."
        )
    return capture.attend(module, query, key, value, attention_mask, **kwargs)
