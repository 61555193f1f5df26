"""Per-head value and update statistics of one layer, in head space and in output space.

Output-space quantities go through the triangular factor ``R_h`` of ``W_O^h`` (``‖W_O^h x‖ = ‖R_h x‖``,
see :mod:`sinklab.capture.weights`), so no ``d``-wide vector is formed. The update spectrum (Fesser et al.
2026, arXiv:2606.08105) comes from the smaller Gram matrix of ``U`` — ``Uᵀ U`` (``dh × dh``) or ``U Uᵀ``
(``Tq × Tq``), whichever is smaller: both have the same non-zero eigenvalues — batched over samples and heads
in float32 (:func:`update_spectrum`). The common-mode fraction is accumulated in float64.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..errors import ModelWeightsError

__all__ = ["head_statistics", "update_spectrum"]


def head_statistics(v: Tensor, out: Tensor, r: Tensor, qmask: Tensor, key_mask: Tensor,
                    layer: int, full: bool = True) -> dict[str, Tensor]:
    """Value norms, update norms, update spectrum and common-mode fraction of every head of one layer.

    Parameters
    ----------
    v:
        ``[B, H, Tk, dv]`` value vectors (float32, KV heads repeated, after any edit).
    out:
        ``[B, H, Tq, dv]`` the heads' attention outputs ``o_i = Σ_j A_ij v_j`` (after any output gate).
    r:
        ``[H, dv, dv]`` triangular factor of each head's output projection (identity if unknown).
    qmask, key_mask:
        ``[B, Tq]`` real queries and ``[B, 1, Tk]`` real keys.
    layer:
        The layer index, named in the error raised on non-finite activations.
    full:
        False: only ``update_norm`` (what the circuit needs); the rest is not computed.
    """
    nan = torch.full((), math.nan, device=v.device)
    u = torch.einsum("bhtd,hed->bhte", out, r) * qmask[:, None, :, None]  # (B, H, Tq, dv)
    spectrum = update_spectrum(u) if full else u  # (B, H, dv) descending
    if not bool(torch.isfinite(spectrum).all()):
        raise ModelWeightsError(
            f"non-finite activations (NaN/inf) in the attention output of layer {layer}: the statistics "
            "cannot be computed. Check the weights and inputs, or run in float32 if the model is in float16."
        )
    update_norm = torch.where(qmask[:, None], u.norm(dim=-1), nan)
    if not full:
        return {"update_norm": update_norm}
    v_out = torch.einsum("bhtd,hed->bhte", v, r)  # (B, H, Tk, dv)
    u64 = u.double()
    n_q = qmask.sum(-1).double().clamp_min(1)[:, None]  # (B, 1)
    mean_u = u64.sum(2) / n_q[..., None]  # (B, H, dv)
    energy = (u64 * u64).sum((-2, -1)) / n_q
    return {
        "value_norm": torch.where(key_mask, v.norm(dim=-1), nan),
        "value_norm_out": torch.where(key_mask, v_out.norm(dim=-1), nan),
        "update_norm": update_norm,
        "update_spectrum": spectrum,
        "common_mode": ((mean_u * mean_u).sum(-1) / energy).float(),
    }


def update_spectrum(u: Tensor) -> Tensor:
    """Singular values of each ``[Tq, dv]`` matrix of ``u`` ``[..., Tq, dv]``, descending, padded to ``dv``: ``[..., dv]``.

    The eigenvalues of the smaller Gram matrix (``u uᵀ`` when ``Tq < dv``, else ``uᵀ u``), in float32: each
    singular value is within ``√ε₃₂ · σ₁`` (~3e-4 σ₁) of a float64 SVD, and the stable rank and rank-1 energy
    that use them (sums of squares) within ~1e-6 relative. Singular values beyond ``min(Tq, dv)`` are 0.
    Non-finite input gives non-finite output.
    """
    u = u.float()
    tq, dv = u.shape[-2], u.shape[-1]
    gram = u @ u.transpose(-1, -2) if tq < dv else u.transpose(-1, -2) @ u  # (..., m, m), m = min(Tq, dv)
    if not bool(torch.isfinite(gram).all()):
        return torch.full((*u.shape[:-2], dv), math.nan, device=u.device)
    values = torch.linalg.eigvalsh(gram).clamp_min(0).flip(-1).sqrt()  # (..., m) descending
    if values.shape[-1] < dv:
        values = torch.nn.functional.pad(values, (0, dv - values.shape[-1]))
    return values

