"""A procedurally generated dense-prediction dataset: textured shapes on textured backgrounds.

Every image is drawn on the fly from ``(seed, split, index)`` alone (no download, no files): a background
of one colour plus a sinusoidal grating and uniform noise, then 1 … ``max_objects`` objects painted in
order (later ones on top). Each object class has its own shape *and* texture, painted in a random colour:

====  ==========  =================================  ==================================
 id    class       inside test (pixel centres)        texture multiplier at pixel (x, y)
====  ==========  =================================  ==================================
 0     background  —                                  —
 1     disc        dist ≤ r                           1
 2     square      max(|dx|, |dy|) ≤ 0.85 r           1 if (y // 2) even else 0.55
 3     triangle    apex up, base 1.8 r below apex     1 if (x // 2) even else 0.55
 4     ring        0.55 r ≤ dist ≤ r                  1 if (x // 2 + y // 2) even else 0.55
====  ==========  =================================  ==================================

The per-pixel mask holds the class id of the object on top (0 = background); the global label is the
class covering the most pixels (ties: the lower id), minus one (labels ``0 … classes − 1``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["CLASS_NAMES", "Scene", "ShapesConfig", "ShapesDataset", "inside", "texture"]

CLASS_NAMES = ("background", "disc", "square", "triangle", "ring")
_SPLITS = {"train": 0, "probe": 1, "test": 2}
_DARK = 0.55  # texture multiplier of the dark stripes/squares


@dataclass(frozen=True)
class ShapesConfig:
    """Size of the images and how many objects they hold (every field has a default)."""

    image_size: int = 32  # H = W
    max_objects: int = 3  # 1 … max_objects objects per image
    min_radius: float = 4.0  # object size r in pixels, uniform in [min_radius, max_radius]
    max_radius: float = 9.0
    noise: float = 0.08  # background noise amplitude (uniform in ±noise)
    grating: float = 0.15  # background grating amplitude
    seed: int = 0

    @property
    def classes(self) -> int:
        return len(CLASS_NAMES) - 1


@dataclass
class Scene:
    """The parameters one image was drawn from (enough to repaint its objects exactly)."""

    background: tuple[float, float, float]
    grating: tuple[float, float, float]  # (fx, fy, phase): sin(2π (fx·x + fy·y) / size + phase)
    objects: list[dict]  # each: {"cls", "cx", "cy", "r", "colour": (r, g, b)}


def inside(cls: int, xs: Tensor, ys: Tensor, cx: float, cy: float, r: float) -> Tensor:
    """Boolean: pixel centres ``(xs + 0.5, ys + 0.5)`` inside an object of class ``cls`` (see the table)."""
    dx, dy = xs + 0.5 - cx, ys + 0.5 - cy
    dist = torch.sqrt(dx * dx + dy * dy)
    if cls == 1:
        return dist <= r
    if cls == 2:
        return torch.maximum(dx.abs(), dy.abs()) <= 0.85 * r
    if cls == 3:
        t = (dy + r) / (1.8 * r)  # 0 at the apex (cy − r), 1 at the base (cy + 0.8 r)
        return (t >= 0) & (t <= 1) & (dx.abs() <= t * r)
    if cls == 4:
        return (dist >= 0.55 * r) & (dist <= r)
    raise ValueError(f"unknown object class {cls}")


def texture(cls: int, xs: Tensor, ys: Tensor) -> Tensor:
    """Brightness multiplier of class ``cls`` at integer pixel coordinates (see the table)."""
    xi, yi = xs.long(), ys.long()
    if cls == 1:
        return torch.ones_like(xs, dtype=torch.float32)
    light = {2: (yi // 2) % 2 == 0, 3: (xi // 2) % 2 == 0, 4: ((xi // 2) + (yi // 2)) % 2 == 0}[cls]
    return torch.where(light, 1.0, _DARK).float()


class ShapesDataset:
    """Deterministic images, masks and labels: ``dataset.batch(start, count)``; ``split`` picks a disjoint stream."""

    def __init__(self, config: ShapesConfig | None = None, split: str = "train") -> None:
        if split not in _SPLITS:
            raise ValueError(f"split must be one of {sorted(_SPLITS)}, got {split!r}")
        self.config = config or ShapesConfig()
        self.split = split
        n = self.config.image_size
        self.ys, self.xs = torch.meshgrid(torch.arange(n, dtype=torch.float32), torch.arange(n, dtype=torch.float32),
                                          indexing="ij")  # (H, W)

    def _generator(self, index: int) -> torch.Generator:
        return torch.Generator().manual_seed((self.config.seed * 3 + _SPLITS[self.split]) * 1_000_003 + index)

    def scene(self, index: int) -> tuple[Scene, torch.Generator]:
        """The parameters of image ``index`` (and the generator, positioned for the background noise)."""
        cfg, g = self.config, self._generator(index)

        def u(*shape):
            return torch.rand(*shape, generator=g)

        background = tuple((0.1 + 0.6 * u(3)).tolist())
        fx, fy, phase = (u(3) * torch.tensor([4.0, 4.0, 2 * math.pi])).tolist()
        objects = []
        for _ in range(1 + int(torch.randint(cfg.max_objects, (1,), generator=g))):
            cls = 1 + int(torch.randint(cfg.classes, (1,), generator=g))
            cx, cy = (u(2) * cfg.image_size).tolist()
            r = cfg.min_radius + (cfg.max_radius - cfg.min_radius) * float(u(1))
            objects.append({"cls": cls, "cx": cx, "cy": cy, "r": r, "colour": tuple((0.3 + 0.7 * u(3)).tolist())})
        return Scene(background, (fx, fy, phase), objects), g

    def render(self, index: int) -> tuple[Tensor, Tensor, int, Scene]:
        """Image ``[3, H, W]`` in [0, 1], mask ``[H, W]`` (class ids), global label, and the scene."""
        cfg = self.config
        scene, g = self.scene(index)
        n = cfg.image_size
        fx, fy, phase = scene.grating
        wave = torch.sin(2 * math.pi * (fx * self.xs + fy * self.ys) / n + phase)  # (H, W)
        noise = (torch.rand(3, n, n, generator=g) * 2 - 1) * cfg.noise
        image = torch.tensor(scene.background)[:, None, None] + cfg.grating * wave + noise  # (3, H, W)
        image = image.clamp(0.0, 1.0)
        mask = torch.zeros(n, n, dtype=torch.long)
        for obj in scene.objects:
            hit = inside(obj["cls"], self.xs, self.ys, obj["cx"], obj["cy"], obj["r"])
            paint = torch.tensor(obj["colour"])[:, None, None] * texture(obj["cls"], self.xs, self.ys)  # (3, H, W)
            image = torch.where(hit, paint, image)
            mask = torch.where(hit, obj["cls"], mask)
        area = torch.bincount(mask.flatten(), minlength=cfg.classes + 1)[1:]
        label = int(area.argmax()) if int(area.sum()) else 0
        return image, mask, label, scene

    def batch(self, start: int, count: int) -> tuple[Tensor, Tensor, Tensor]:
        """Images ``[B, 3, H, W]``, masks ``[B, H, W]``, labels ``[B]`` of indices ``start … start + count − 1``."""
        items = [self.render(i) for i in range(start, start + count)]
        return (torch.stack([it[0] for it in items]), torch.stack([it[1] for it in items]),
                torch.tensor([it[2] for it in items], dtype=torch.long))


def patch_targets(masks: Tensor, patch: int, classes: int) -> Tensor:
    """Share of each class in each patch: masks ``[B, H, W]`` → ``[B, P, classes + 1]`` (rows sum to 1)."""
    b, h, w = masks.shape
    onehot = torch.nn.functional.one_hot(masks, classes + 1).float()  # (B, H, W, C)
    grid = onehot.view(b, h // patch, patch, w // patch, patch, classes + 1)  # (B, gh, p, gw, p, C)
    return grid.mean(dim=(2, 4)).reshape(b, (h // patch) * (w // patch), classes + 1)  # (B, P, C)
