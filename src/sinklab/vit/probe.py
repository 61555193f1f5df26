"""Linear probes on frozen features: patch segmentation (mIoU) and global classification (accuracy).

Both probes are ridge-regularised least-squares classifiers on one-hot (or soft) targets, solved in
closed form in float64 on standardised features — deterministic, no optimiser settings to tune, and
linear like the probes of Darcet et al. and Fesser et al. The segmentation probe predicts each patch's
class shares; every pixel takes its patch's arg-max (nearest upsampling), and mIoU is computed on pixels
over the classes present in the test masks or predictions.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .data import ShapesDataset, patch_targets

__all__ = ["evaluate_probes", "frozen_features", "miou", "ridge_fit", "ridge_predict"]


def ridge_fit(x: Tensor, y: Tensor, lam: float = 1e-2) -> tuple[Tensor, Tensor, Tensor]:
    """Standardise ``x`` ``[N, d]`` and solve ``min ‖[x̂ 1] W − y‖² + λ·tr(x̂ᵀx̂)/d·‖W‖²`` (``y`` ``[N, C]``).

    Returns ``(W [d + 1, C], mean [d], std [d])``, all float64.
    """
    x, y = x.double(), y.double()
    mean, std = x.mean(0), x.std(0).clamp_min(1e-8)
    z = torch.cat([(x - mean) / std, torch.ones(x.shape[0], 1, dtype=torch.float64)], dim=1)  # (N, d + 1)
    gram = z.T @ z
    reg = lam * gram.diagonal()[:-1].mean() * torch.eye(z.shape[1], dtype=torch.float64)
    reg[-1, -1] = 0.0  # the bias is not penalised
    return torch.linalg.solve(gram + reg, z.T @ y), mean, std


def ridge_predict(model: tuple[Tensor, Tensor, Tensor], x: Tensor) -> Tensor:
    """Scores ``[N, C]`` of a :func:`ridge_fit` probe."""
    w, mean, std = model
    z = torch.cat([(x.double() - mean) / std, torch.ones(x.shape[0], 1, dtype=torch.float64)], dim=1)
    return z @ w


def miou(pred: Tensor, target: Tensor, classes: int) -> float:
    """Mean intersection-over-union over the classes present in ``pred`` or ``target`` (integer tensors)."""
    ious = []
    for c in range(classes):
        p, t = pred == c, target == c
        union = int((p | t).sum())
        if union:
            ious.append(int((p & t).sum()) / union)
    return sum(ious) / len(ious) if ious else float("nan")


@torch.no_grad()
def frozen_features(backbone: nn.Module, images: Tensor, batch: int = 128) -> tuple[Tensor, Tensor, Tensor]:
    """[CLS] ``[N, d]``, mean-pooled patches ``[N, d]`` and patch features ``[N, P, d]`` of the final layer
    (after the final LayerNorm; register tokens are already dropped by the variant)."""
    was = backbone.training
    backbone.eval()
    parts = [backbone(pixel_values=images[i : i + batch]).last_hidden_state for i in range(0, images.shape[0], batch)]
    backbone.train(was)
    feats = torch.cat(parts)  # (N, 1 + P, d)
    return feats[:, 0], feats[:, 1:].mean(1), feats[:, 1:]


def evaluate_probes(backbone: nn.Module, train: ShapesDataset, test: ShapesDataset, n_train: int, n_test: int,
                    patch: int) -> dict:
    """Fit both probes on ``n_train`` images of ``train`` and score them on ``n_test`` images of ``test``."""
    classes = train.config.classes
    xi, mi, yi = train.batch(0, n_train)
    xt, mt, yt = test.batch(0, n_test)
    cls_i, pool_i, patch_i = frozen_features(backbone, xi)
    cls_t, pool_t, patch_t = frozen_features(backbone, xt)
    d = patch_i.shape[-1]
    seg = ridge_fit(patch_i.reshape(-1, d), patch_targets(mi, patch, classes).reshape(-1, classes + 1))
    scores = ridge_predict(seg, patch_t.reshape(-1, d)).argmax(-1)  # (N·P,)
    side = train.config.image_size // patch
    grid = scores.view(n_test, side, side)  # (N, gh, gw)
    pixels = grid.repeat_interleave(patch, 1).repeat_interleave(patch, 2)  # (N, H, W)
    onehot = torch.nn.functional.one_hot(yi, classes).double()
    acc = {}
    for name, (fi, ft) in {"cls": (cls_i, cls_t), "pooled": (pool_i, pool_t)}.items():
        probe = ridge_fit(fi, onehot)
        acc[name] = float((ridge_predict(probe, ft).argmax(-1) == yt).double().mean())
    return {"miou": miou(pixels, mt, classes + 1), "pixel_accuracy": float((pixels == mt).double().mean()),
            "cls_accuracy": acc["cls"], "pooled_accuracy": acc["pooled"]}
