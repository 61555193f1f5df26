"""Global broadcast, the second task of Fesser et al. 2026 (arXiv:2606.08105).

Every token must receive the rotated content of one chosen token.

``x_i ~ N(0, I_d)``, ``N = 32``, ``j* = argmax_j ⟨x_j, u⟩``, target ``y_i = x_i + α·R·x_{j*}`` (R orthogonal).
Two layers, one head each, pre-LN, MLP 4d GELU. The expected solution: one layer becomes a hub — every
query attends to ``j*`` (a content-dependent sink at a different position in every sample) with a
normal value norm and a rank-1 update — a broadcast sink; the other layer is ≈ identity.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ..capture import ValueEdit
from ..diagnose import diagnose_inputs
from ..edits import run_edit
from .model import SynthConfig, SynthModel, SynthResult, fit, task_settings

__all__ = ["BroadcastTask", "run_broadcast"]


@dataclass
class BroadcastTask:
    """Data of the global-broadcast task."""

    d: int = 64
    n: int = 32
    alpha: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        g = torch.Generator().manual_seed(self.seed + 20_000)
        u = torch.randn(self.d, generator=g)
        self.direction = u / u.norm()  # (d,)
        self.rotation = torch.linalg.qr(torch.randn(self.d, self.d, generator=g)).Q  # (d, d) orthogonal

    def hub(self, x: Tensor) -> Tensor:
        """``j*`` per sample: ``[B]``."""
        return (x @ self.direction).argmax(dim=-1)

    def target(self, x: Tensor, payload_from: Tensor | None = None) -> Tensor:
        """``y = x + α R x_{j*}``; ``payload_from`` ``[B, N, d]`` takes ``x_{j*}`` from other samples."""
        src = x if payload_from is None else payload_from
        chosen = src[torch.arange(src.shape[0]), self.hub(src)]  # (B, d)
        return x + self.alpha * (chosen @ self.rotation.T)[:, None, :]

    def sample(self, batch: int, gen: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
        x = torch.randn(batch, self.n, self.d, generator=gen)
        return x, self.target(x), torch.ones(batch, self.n, dtype=torch.bool)


def run_broadcast(task: BroadcastTask | None = None, *, steps: int = 3000, batch: int = 256, lr: float = 3e-3,
                  eval_samples: int = 64, seed: int = 0,
            progress: Callable[[int, float], None] | None = None) -> SynthResult:
    """Train the two-layer broadcast model on CPU, diagnose it, and test the donor swap."""
    task = task or BroadcastTask(seed=seed)
    torch.manual_seed(seed)
    model = SynthModel(SynthConfig(hidden_size=task.d, num_hidden_layers=2, seq_len=task.n, bos=False,
                                   positions=False, mlp=True))
    log = fit(model, task.sample, steps=steps, batch=batch, lr=lr, seed=seed, progress=progress)
    x, y, _ = task.sample(eval_samples, torch.Generator().manual_seed(seed + 1))
    tokens = [[f"x{i}" for i in range(task.n)] for _ in range(eval_samples)]
    diagnosis = diagnose_inputs(model, [{"inputs_embeds": x}], tokens, edits=False,
                                meta={"model": "synth:broadcast", "task": task_settings(task)})
    scan = diagnosis.scan
    hubs = task.hub(x)  # (S,)
    inflow = scan.column_mass[torch.arange(eval_samples), :, 0, hubs]  # (S, L): column mass at j* per layer
    hub_layer = int(inflow.mean(0).argmax())
    on_hub = scan.dominant_columns()[:, hub_layer, 0] == hubs
    # Donor swap: put sample s−1's hub value at sample s's hub; the payload should follow the donor.
    donor_x = x.roll(1, dims=0)
    rec = ValueEdit(hub_layer, 0, task.hub(donor_x), "record")
    run_edit(model, {"inputs_embeds": donor_x}, rec)
    edited, _ = run_edit(model, {"inputs_embeds": x}, ValueEdit(hub_layer, 0, hubs, "replace", replacement=rec.recorded))
    own, donor = task.target(x), task.target(x, payload_from=donor_x)
    with torch.no_grad():
        out = model(inputs_embeds=x).last_hidden_state
    kinds = [r.kind for r in diagnosis.records if r.layer == hub_layer]
    metrics = {
        "final_loss": log[-1]["loss"],
        "hub_layer": hub_layer,
        "inflow_to_hub": float(inflow[:, hub_layer].mean()),
        "inflow_other_layer": float(inflow[:, 1 - hub_layer].mean()),
        "dominant_is_hub_pct": 100.0 * float(on_hub.double().mean()),
        "hub_value_norm_ratio_out": _mean([r.value_norm_ratio_out for r in diagnosis.records if r.layer == hub_layer]),
        "hub_stable_rank": _mean([r.stable_rank for r in diagnosis.records if r.layer == hub_layer]),
        "hub_kind": max(set(kinds), key=kinds.count) if kinds else None,
        "broadcast_pct": 100.0 * kinds.count("broadcast") / max(1, len(kinds)),
        "mse_to_own_target": float(((out - y) ** 2).mean()),
        "donor_swap_mse_to_donor_target": float(((edited - donor) ** 2).mean()),
        "donor_swap_mse_to_own_target": float(((edited - own) ** 2).mean()),
    }
    return SynthResult(model=model, diagnosis=diagnosis, metrics=metrics, log=log)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None
