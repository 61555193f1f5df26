"""Forward hooks on a decoder's own modules: record position 0 per block and sublayer, patch its residual.

The sublayers are found generically: each block (``_compat.find_layers``) must have one attention child
(``self_attn``, ``attn``, ``attention`` or ``self_attention``) and one MLP child (``mlp``, ``feed_forward``,
``ffn`` or ``block_sparse_moe``). Hooks are registered on entry and always removed on exit. "Position 0"
of a row is its first real token (``starts``), so left-padded batches measure the same thing as unpadded ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Self

import torch
from torch import Tensor, nn

from .. import _compat, metrics
from ..errors import UnsupportedModelError

__all__ = ["ATTN_NAMES", "MLP_NAMES", "Patch", "PositionZeroRecorder", "Sublayers", "find_sublayers"]

ATTN_NAMES = ("self_attn", "attn", "attention", "self_attention")
#: A hybrid block's token mixer when it is not attention (linear attention, state-space, short convolution).
MIXER_NAMES = ("linear_attn", "mamba", "mixer", "conv", "linear_attention")
MLP_NAMES = ("mlp", "feed_forward", "ffn", "block_sparse_moe")


@dataclass
class Sublayers:
    """The decoder blocks and, per block, its token mixer (attention, or a hybrid's recurrent mixer) and MLP modules
    (None where a hybrid's block has no such sublayer: its contribution is 0)."""

    blocks: nn.ModuleList
    attn: list[nn.Module | None]
    mlp: list[nn.Module | None]


def find_sublayers(model: nn.Module) -> Sublayers:
    """Blocks plus attention/MLP children; :class:`UnsupportedModelError` for encoders and unknown layouts."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    name = type(model).__name__
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{name} is an encoder-decoder model; the P0 circuit is measured on causal "
                                    "decoder-only models.")
    if model_type in _compat.ENCODER_TYPES:
        raise UnsupportedModelError(
            f"{name} ({model_type}) is an encoder: every position attends to every other, so no causal mask singles "
            "out position 0 and the P0 sink circuit does not apply. Use `sinklab scan`/`diagnose` for encoders.")
    streams = _compat.stacked_streams(model)
    if streams is not None:
        raise UnsupportedModelError(
            f"{name} ({model_type}) passes {streams[0]} stacked copies of its hidden state between blocks (AltUp, "
            f"alternating updates): each block predicts every copy from all of them, runs attention and MLP on copy "
            f"{streams[1]} only and corrects the others from its result, and the final state mixes the copies. The P0 "
            "circuit splits one residual stream (after a block = before + attention + MLP) and patches it at "
            "position 0; lifting this needs that split and patch carried through AltUp's predict/correct mixing. "
            "`sinklab scan`/`diagnose` read the main copy and do support it.")
    blocks = _compat.find_layers(model)
    kinds = _compat.cache_layer_kinds(model, len(blocks))
    hybrid = any(kind != "keys" for kind in kinds)  # blocks may then hold one sublayer (a mixer, or an MLP)
    attn, mlp = [], []
    for index, block in enumerate(blocks):
        a = _compat.child_module(block, ATTN_NAMES)
        if a is None and hybrid:  # a hybrid's recurrent or MLP-only block, or Nemotron-H's `mixer`
            a = _compat.child_module(block, MIXER_NAMES)
        m = _compat.child_module(block, MLP_NAMES)
        if m is None and a is not None and kinds[index] == "stateless" and _compat.child_module(block, ATTN_NAMES) is None:
            a, m = None, a  # one sublayer that mixes no tokens (Nemotron-H's MLP / MoE blocks): it is the MLP
        if (a is None and kinds[index] != "stateless") or (m is None and not hybrid):
            children = ", ".join(n for n, _ in block.named_children())
            missing = "attention" if a is None else "MLP"
            wanted = ATTN_NAMES + MIXER_NAMES if a is None else MLP_NAMES
            raise UnsupportedModelError(
                f"{name}: block {index} ({type(block).__name__}) has no {missing} child named one of {wanted} "
                f"(its children: {children}); the circuit hooks each block's own attention and MLP modules. "
                "Adding this block's sublayer names to circuit.hooks.ATTN_NAMES / MLP_NAMES would lift it when the "
                "block is attention then MLP on one residual stream; `sinklab scan`/`diagnose` do not need it.")
        attn.append(a)
        mlp.append(m)
    if any(a is not None and getattr(a, "is_causal", True) is False for a in attn):
        raise UnsupportedModelError(f"{name}: its attention is not causal (is_causal=False); the P0 sink circuit is "
                                    "a property of causal decoders.")
    return Sublayers(blocks, attn, mlp)


@dataclass
class Patch:
    """An edit of position 0's residual stream at the output of block ``layer``.

    ``mode="replace"``: set it to ``replacement`` ``[B, d]`` (one row per sample of the running batch);
    ``mode="scale"``: rescale it so that ``‖x₀‖ = target_ratio · median_{i>0} ‖x_i‖``.
    """

    layer: int
    mode: str = "scale"
    replacement: Tensor | None = None
    target_ratio: float = 1.0

    def __post_init__(self) -> None:
        if self.mode not in ("replace", "scale"):
            raise ValueError(f"unknown patch mode {self.mode!r}; choose 'replace' or 'scale'")


def _first_tensor(output: object) -> Tensor:
    if isinstance(output, Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], Tensor):
        return output[0]
    raise UnsupportedModelError(f"cannot find the output tensor of a sublayer returning {type(output).__name__}")


def _with_hidden(output: object, hidden: Tensor) -> object:
    if isinstance(output, Tensor):
        return hidden
    if isinstance(output, tuple):
        return (hidden, *output[1:])
    raise UnsupportedModelError(f"cannot patch a block output of type {type(output).__name__}")


class PositionZeroRecorder:
    """Context manager recording, per forward pass, what the circuit needs (CPU float32 tensors).

    After each forward: ``hidden_norm`` ``[B, L+1, T]`` (aligned: column ``j`` is the row's ``j``-th real
    token, NaN beyond), ``x0`` ``[B, L+1, d]``, ``max_abs``/``max_dim`` ``[B, L+1, T]``, ``median_abs``
    ``[B, L+1]`` (only when :meth:`start` is given ``massive=True``), ``attn0``/``mlp0`` ``[B, L, d]`` (each
    sublayer's output at position 0). Index 0 of the
    ``L+1`` axis is the embeddings (block 0's input), index ``l + 1`` block ``l``'s output (after any patch).
    """

    def __init__(self, sub: Sublayers) -> None:
        self.sub = sub
        self.patch: Patch | None = None
        self._hooks: _compat.ModelPatch | None = None
        self._starts: Tensor | None = None
        self._mask: Tensor | None = None
        self._rec: dict[str, dict[int, Tensor]] = {}

    def __enter__(self) -> Self:
        patch = self._hooks = _compat.ModelPatch(self.sub.blocks[0])  # the one way sinklab changes a model
        try:
            patch.hook(self.sub.blocks[0], self._embed_hook, pre=True, with_kwargs=True)
            for index, block in enumerate(self.sub.blocks):
                patch.hook(block, self._block_hook(index))
                for key, sub in (("attn0", self.sub.attn[index]), ("mlp0", self.sub.mlp[index])):
                    if sub is not None:  # a hybrid block without this sublayer: it adds 0 (filled by collect)
                        patch.hook(sub, self._sub_hook(key, index))
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self._hooks is not None:
            self._hooks.restore()
            self._hooks = None

    def start(self, attention_mask: Tensor, patch: Patch | None = None, massive: bool = True) -> None:
        """Prepare for one forward pass over a batch with ``attention_mask`` ``[B, T]`` (1 = real token);
        ``massive=False`` skips the massive-activation fields (a median over every activation of every layer)."""
        self._mask = attention_mask.bool()
        self._starts = self._mask.long().argmax(-1)  # (B,) first real token of each row
        self.patch = patch
        self._massive = massive
        keys = ("hidden_norm", "x0", "attn0", "mlp0") + (("max_abs", "max_dim", "median_abs") if massive else ())
        self._rec = {k: {} for k in keys}

    def collect(self) -> dict[str, Tensor]:
        """Stack what the last forward recorded (see the class docstring for shapes)."""
        n = len(self.sub.blocks)
        x0 = self._rec["x0"].get(0)
        for key, subs in (("attn0", self.sub.attn), ("mlp0", self.sub.mlp)):
            for index, sub in enumerate(subs):
                if sub is None and x0 is not None:
                    self._rec[key][index] = torch.zeros_like(x0)
        out = {}
        for key, per in self._rec.items():
            count = n if key in ("attn0", "mlp0") else n + 1
            missing = [i for i in range(count) if i not in per]
            if missing:
                raise UnsupportedModelError(f"the forward pass did not run the hooked modules for {key} at {missing}")
            out[key] = torch.stack([per[i] for i in range(count)], dim=1)
        return out

    # ------------------------------------------------------------------ hooks
    def _rows(self, device: torch.device) -> tuple[Tensor, Tensor]:
        starts = self._starts.to(device)  # type: ignore[union-attr]  # set by start()
        return torch.arange(starts.shape[0], device=device), starts

    def _aligned(self, values: Tensor, fill: float) -> Tensor:
        """``[B, T]`` per-position values → column ``j`` = the row's ``j``-th real token (``fill`` beyond)."""
        t = values.shape[1]
        mask = self._mask.to(values.device)  # type: ignore[union-attr]  # set by start()
        idx = self._starts.to(values.device)[:, None] + torch.arange(t, device=values.device)  # type: ignore[union-attr]  # (B, T)
        valid = idx < t
        idx = idx.clamp_max(t - 1)
        valid = valid & mask.gather(1, idx)
        return torch.where(valid, values.gather(1, idx), torch.full((), fill, dtype=values.dtype, device=values.device))

    def _record(self, index: int, hidden: Tensor) -> None:
        x = hidden.detach().float()  # (B, T, d)
        mask = self._mask.to(x.device)  # type: ignore[union-attr]  # set by start()
        rows, starts = self._rows(x.device)
        self._rec["hidden_norm"][index] = self._aligned(x.norm(dim=-1), math.nan).cpu()
        self._rec["x0"][index] = x[rows, starts].cpu()
        if not self._massive:
            return
        max_abs, max_dim = x.abs().max(dim=-1)
        self._rec["max_abs"][index] = self._aligned(max_abs, math.nan).cpu()
        self._rec["max_dim"][index] = self._aligned(max_dim.float(), -1.0).long().cpu()
        self._rec["median_abs"][index] = metrics.activation_median(x, mask).cpu()

    def _embed_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self._record(0, _compat.block_input(args, kwargs))

    def _block_hook(self, index: int):
        def hook(module: nn.Module, args: tuple, output: object):
            hidden = _compat.block_hidden_states(output)
            patch, replaced = self.patch, None
            if patch is not None and patch.layer == index:
                hidden = self._patched(hidden, patch)
                replaced = _with_hidden(output, hidden)
            self._record(index + 1, hidden)
            return replaced

        return hook

    def _patched(self, hidden: Tensor, patch: Patch) -> Tensor:
        rows, starts = self._rows(hidden.device)
        hidden = hidden.clone()
        if patch.mode == "replace":
            hidden[rows, starts] = patch.replacement.to(hidden.device, hidden.dtype)  # type: ignore[union-attr]
            return hidden
        norms = self._aligned(hidden.detach().float().norm(dim=-1), math.nan)  # (B, T)
        median = norms[:, 1:].nanmedian(dim=-1).values  # (B,)
        x0 = hidden[rows, starts]
        factor = patch.target_ratio * median / x0.float().norm(dim=-1).clamp_min(1e-12)
        hidden[rows, starts] = x0 * factor[:, None].to(x0.dtype)
        return hidden

    def _sub_hook(self, key: str, index: int):
        def hook(module: nn.Module, args: tuple, output: object) -> None:
            out = _first_tensor(output).detach().float()  # (B, T, d)
            b, t = self._mask.shape  # type: ignore[union-attr]  # set by start()
            if out.dim() == 2 and out.shape[0] == b * t:  # tokens flattened ([B·T, d]: Llama 4's MoE block)
                out = out.reshape(b, t, -1)
            if out.dim() != 3 or out.shape[0] != b:
                raise UnsupportedModelError(
                    f"{type(module).__name__} returns a {tuple(out.shape)} tensor, not one [{b}, T, d] state per "
                    "token; the circuit reads each sublayer's output at position 0.")
            rows, starts = self._rows(out.device)
            self._rec[key][index] = out[rows, starts].cpu()

        return hook
