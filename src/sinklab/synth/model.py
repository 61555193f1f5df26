"""A tiny pre-LN transformer for the synthetic tasks, plugged into transformers' attention interface."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutput
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..attention import AttendSpec, attend

__all__ = ["SynthConfig", "SynthModel", "SynthResult", "fit", "task_settings"]


class SynthConfig(PretrainedConfig):
    """Configuration of :class:`SynthModel` (every field has a default)."""

    model_type = "sinklab-synth"

    def __init__(
        self,
        hidden_size: int = 64,  # d = d_h (one head by default)
        num_hidden_layers: int = 1,
        num_attention_heads: int = 1,
        seq_len: int = 32,  # N real tokens (the BOS slot comes on top)
        bos: bool = True,  # prepend a BOS slot whose residual is a learned vector (its input zeroed)
        positions: bool = True,  # learned position embedding, added to the attention input only
        mlp: bool = False,  # a 4d GELU MLP after each attention
        initializer_range: float = 0.02,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.seq_len = seq_len
        self.bos = bos
        self.positions = positions
        self.mlp = mlp
        self.initializer_range = initializer_range


def eager_attention_forward(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                    scaling: float, dropout: float = 0.0, **kwargs) -> tuple[Tensor, Tensor]:
    """Plain softmax attention (:func:`sinklab.attention.attend`'s manual path, which returns the weights);
    ``query``/``key``/``value`` ``[B, H, T, dh]`` → output ``[B, T, H, dh]`` and weights ``[B, H, T, T]``. A boolean
    ``attention_mask`` says what each query sees, a float one is added to the scores."""
    is_bool = attention_mask is not None and attention_mask.dtype == torch.bool
    spec = AttendSpec(scale=scaling, bias=None if is_bool else attention_mask)
    out, probs = attend(query, key, value, attention_mask if is_bool else None, spec, weights=True)
    return out.transpose(1, 2).contiguous(), probs


class SynthAttention(nn.Module):
    """Multi-head bidirectional self-attention with ``q_proj``/``k_proj``/``v_proj``/``o_proj``."""

    is_causal = False

    def __init__(self, config: SynthConfig) -> None:
        super().__init__()
        self.config = config
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.num_key_value_groups = 1
        d = config.hidden_size
        self.q_proj = nn.Linear(d, d, bias=True)
        self.k_proj = nn.Linear(d, d, bias=True)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        shape = (b, t, self.num_heads, self.head_dim)
        q = self.q_proj(x).view(shape).transpose(1, 2)  # (B, H, T, dh)
        k = self.k_proj(x).view(shape).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        out, _ = attention(self, q, k, v, None, scaling=self.head_dim**-0.5, dropout=0.0)
        return self.o_proj(out.reshape(b, t, -1))  # (B, T, d)


class SynthBlock(nn.Module):
    """Pre-LN block: ``h + attn(LN(h + p))`` then, optionally, ``h + mlp(LN(h))``."""

    def __init__(self, config: SynthConfig) -> None:
        super().__init__()
        d = config.hidden_size
        self.ln1 = nn.LayerNorm(d)
        self.attn = SynthAttention(config)
        self.mlp = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)) if config.mlp else None

    def forward(self, h: Tensor, pos: Tensor | None = None) -> Tensor:
        h = h + self.attn(self.ln1(h if pos is None else h + pos))
        if self.mlp is not None:
            h = h + self.mlp(h)
        return h


class SynthModel(PreTrainedModel):
    """Tiny transformer over continuous inputs: ``model(inputs_embeds=x)`` with ``x`` ``[B, N, d]``.

    With ``config.bos`` the output has ``N + 1`` positions, the BOS slot first.
    """

    config_class = SynthConfig
    base_model_prefix = "synth"
    _supports_attention_backend = True
    _supports_sdpa = True

    def __init__(self, config: SynthConfig) -> None:
        super().__init__(config)
        d, n = config.hidden_size, config.seq_len + int(config.bos)
        self.bos = nn.Parameter(torch.randn(d) * 0.5) if config.bos else None
        self.pos = nn.Parameter(torch.randn(n, d) * 0.5) if config.positions else None
        self.layers = nn.ModuleList(SynthBlock(config) for _ in range(config.num_hidden_layers))

    def _init_weights(self, module: nn.Module) -> None:  # keep PyTorch's defaults
        return None

    def forward(self, inputs_embeds: Tensor, attention_mask: Tensor | None = None,
                output_hidden_states: bool = False, **kwargs) -> BaseModelOutput:
        h = inputs_embeds
        if self.bos is not None:
            h = torch.cat([self.bos.expand(h.shape[0], 1, -1), h], dim=1)  # (B, 1 + N, d)
        pos = None if self.pos is None else self.pos[: h.shape[1]]
        states = [h]
        for block in self.layers:
            h = block(h, pos)
            states.append(h)
        return BaseModelOutput(last_hidden_state=h, hidden_states=tuple(states) if output_hidden_states else None)


def fit(model: nn.Module, sample: Callable[[int, torch.Generator], tuple[Tensor, Tensor, Tensor]], *, steps: int,
        batch: int = 256, lr: float = 3e-3, weight_decay: float = 0.0, seed: int = 0,
        log_every: int = 100, progress: Callable[[int, float], None] | None = None) -> list[dict]:
    """AdamW on MSE over the rows ``sample`` marks. ``sample(batch, gen) -> (x, y, rows)``; returns the loss log.

    ``progress(step, loss)`` is called after every step (e.g. to advance a bar whose total is ``steps``).
    """
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    model.train()
    log = []
    for step in range(1, steps + 1):
        x, y, rows = sample(batch, gen)
        out = model(inputs_embeds=x).last_hidden_state[:, -x.shape[1] :]  # drop the BOS slot
        loss = ((out - y) ** 2)[rows].mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % log_every == 0 or step == steps:
            log.append({"step": step, "loss": loss.item()})
        if progress is not None:
            progress(step, loss.item())
    model.eval()
    return log


@dataclass
class SynthResult:
    """A trained synthetic model, its diagnosis, the task's signature numbers and the loss log."""

    model: SynthModel
    diagnosis: object  # sinklab.diagnose.Diagnosis
    metrics: dict
    log: list[dict]


def task_settings(task: object) -> dict:
    """A task dataclass's scalar settings (for provenance in the JSON outputs)."""
    return {k: v for k, v in vars(task).items() if isinstance(v, (int, float, str, bool))}
