"""Conditional damping, the NOP task of Fesser et al. 2026 (arXiv:2606.08105).

The head must do nothing for half of the tokens.

One head, ``d = d_h = 64``, ``N = 32``, pre-LayerNorm, learned position embedding and a BOS slot at
position 0 with a learned vector (its input zeroed). Output ``O = x + W_O·A·V``. Target
``y_i = x_i`` if ``⟨x_i, v⟩ ≤ λ`` (damped: the head must do nothing) else ``y_i = γ·x_i`` (active), with
``v`` a fixed unit vector and ``λ`` chosen so a fraction ``p`` of tokens is active. The expected
solution parks damped queries on the BOS slot, whose value is ≈ 0: an adaptive NOP sink.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ..diagnose import Diagnosis, diagnose_inputs
from .model import SynthConfig, SynthModel, SynthResult, fit, task_settings

__all__ = ["NopTask", "run_nop"]


@dataclass
class NopTask:
    """Data of the conditional-damping task."""

    d: int = 64
    n: int = 32
    gamma: float = 0.0  # active tokens' target is gamma · x
    p_active: float = 0.5  # share of active tokens
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 < self.p_active < 1.0:
            raise ValueError(f"p_active must be in (0, 1), got {self.p_active}")
        g = torch.Generator().manual_seed(self.seed + 10_000)
        v = torch.randn(self.d, generator=g)
        self.direction = v / v.norm()  # (d,)
        # ⟨x, v⟩ ~ N(0, 1) for x ~ N(0, I): λ is the (1 − p) quantile.
        self.threshold = math.sqrt(2.0) * torch.erfinv(torch.tensor(1.0 - 2.0 * self.p_active)).item()

    def sample(self, batch: int, gen: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
        """``x``, ``y`` ``[B, N, d]`` and the loss rows (all real tokens)."""
        x = torch.randn(batch, self.n, self.d, generator=gen)
        active = self.active(x)
        y = torch.where(active[..., None], self.gamma * x, x)
        return x, y, torch.ones(batch, self.n, dtype=torch.bool)

    def active(self, x: Tensor) -> Tensor:
        return (x @ self.direction) > self.threshold  # (B, N)


def run_nop(task: NopTask | None = None, *, steps: int = 2000, batch: int = 256, lr: float = 3e-3,
            eval_samples: int = 64, seed: int = 0,
            progress: Callable[[int, float], None] | None = None) -> SynthResult:
    """Train the NOP model on CPU, then run the diagnose pipeline and the causal edits on damped queries."""
    task = task or NopTask(seed=seed)
    torch.manual_seed(seed)
    model = SynthModel(SynthConfig(hidden_size=task.d, seq_len=task.n, bos=True, positions=True, mlp=False))
    log = fit(model, task.sample, steps=steps, batch=batch, lr=lr, seed=seed, progress=progress)
    x, y, _ = task.sample(eval_samples, torch.Generator().manual_seed(seed + 1))
    active = task.active(x)
    tokens = [["<bos>"] + [f"x{i}" for i in range(task.n)] for _ in range(eval_samples)]
    damped_rows = torch.cat([torch.zeros(eval_samples, 1, dtype=torch.bool), ~active], dim=1)  # (S, 1 + N)
    diagnosis = diagnose_inputs(model, [{"inputs_embeds": x}], tokens, special={"bos": "<bos>"}, edits=[(0, 0)],
                                edit_rows=damped_rows, meta={"model": "synth:nop", "task": task_settings(task)})
    scan = diagnosis.scan
    to_bos = scan.candidate_attention[:, 0, 0, 1:, 0]  # (S, N) attention of each real query to the BOS slot
    bos_ratio = float((scan.value_norm_out[:, 0, 0, 0] / scan.value_norm_out[:, 0, 0, 1:].mean(-1)).mean())
    with torch.no_grad():
        out = model(inputs_embeds=x).last_hidden_state[:, 1:]
    edits = diagnosis.edits[0].hidden
    # "ordinary" in the edit table is the median-value token of each sample: the ordinary value at the sink.
    metrics = {
        "gamma": task.gamma,
        "final_loss": log[-1]["loss"],
        "mse_damped": float(((out - y) ** 2)[~active].mean()),
        "mse_active": float(((out - y) ** 2)[active].mean()),
        "attention_to_bos_damped": float(to_bos[~active].mean()),
        "attention_to_bos_active": float(to_bos[active].mean()),
        "bos_value_norm_ratio_out": bos_ratio,
        "bos_kind": _kind_at(diagnosis, 0),
        "edit_zero_rms_damped": edits["zero"],
        "edit_ordinary_rms_damped": edits["ordinary"],
        "edit_control_rms_damped": edits["control"],
    }
    return SynthResult(model=model, diagnosis=diagnosis, metrics=metrics, log=log)


def _kind_at(diagnosis: Diagnosis, position: int) -> str | None:
    kinds = [r.kind for r in diagnosis.records if r.token_index == position]
    return max(set(kinds), key=kinds.count) if kinds else None

