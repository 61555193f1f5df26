"""Per-head value and update statistics of one layer, in head space and in output space.

Output-space quantities go through the triangular factor ``R_h`` of ``W_O^h`` (``‖W_O^h x‖ = ‖R_h x‖``,
see :mod:`sinklab.capture.weights`), so no ``d``-wide vector is formed. The update spectrum comes from
the ``dh × dh`` Gram matrix of ``U = A·u`` in float64 (Fesser et al. 2026, arXiv:2606.08105).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..errors import ModelWeightsError

__all__ = ["head_statistics"]


def head_statistics(v: Tensor, out: Tensor, r: Tensor, qmask: Tensor, key_mask: Tensor,
                    layer: int) -> dict[str, Tensor]:
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
    """
    nan = torch.full((), math.nan, device=v.device)
    v_out = torch.einsum("bhtd,hed->bhte", v, r)  # (B, H, Tk, dv)
    u = torch.einsum("bhtd,hed->bhte", out, r) * qmask[:, None, :, None]  # (B, H, Tq, dv)
    u64 = u.double()
    gram = u64.transpose(-1, -2) @ u64  # (B, H, dv, dv)
    if not bool(torch.isfinite(gram).all()):
        raise ModelWeightsError(
            f"non-finite activations (NaN/inf) in the attention output of layer {layer}: the statistics "
            "cannot be computed. Check the weights and inputs, or run in float32 if the model is in float16."
        )
    spectrum = torch.linalg.eigvalsh(gram).clamp_min(0).flip(-1).sqrt()  # (B, H, dv) descending
    n_q = qmask.sum(-1).double().clamp_min(1)[:, None]  # (B, 1)
    mean_u = u64.sum(2) / n_q[..., None]  # (B, H, dv)
    energy = gram.diagonal(dim1=-2, dim2=-1).sum(-1) / n_q
    return {
        "value_norm": torch.where(key_mask, v.norm(dim=-1), nan),
        "value_norm_out": torch.where(key_mask, v_out.norm(dim=-1), nan),
        "update_norm": torch.where(qmask[:, None], u.norm(dim=-1), nan),
        "update_spectrum": spectrum.float(),
        "common_mode": ((mean_u * mean_u).sum(-1) / energy).float(),
    }
