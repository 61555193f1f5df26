"""Per-head KV budgets from sinklab's own scan: the ``auto`` retention policy's plan (JSON: :meth:`RetentionPlan.save`,
:func:`load_plan`). A *local* key-value head keeps ``S + min(local_window, W)`` tokens, the far heads share the rest
of the uniform total and keep their tokens by SnapKV scores; the rules, and calibrated budgets
(:func:`sinklab.evaluation.calibration.calibrate_plan`): docs/retention.md.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import _compat
from .._version import __version__
from ..atomic import write_json
from ..errors import InputError, UnsupportedModelError, check_int

__all__ = ["RetentionPlan", "plan_from_scan", "load_plan", "head_coverage", "allocate", "rescale"]

FORMAT = "sinklab-retention-plan/1"


@dataclass
class RetentionPlan:
    """Per-layer, per-key-value-head token budgets (``None`` for a layer the plan does not budget: not attention,
    or a native sliding-window layer that keeps its own window)."""

    model_type: str
    num_layers: int
    kv_heads: int
    num_sinks: int
    window: int
    recent: int
    local_window: int
    threshold: float
    budgets: list[list[int] | None]
    coverage: list[list[float] | None]  # per key-value head: the least-covered query head's sink + local share
    local: list[list[bool] | None]
    source: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        """A plan is user input too (a JSON file): every count an integer, every row the right length."""
        check_int("num_layers", self.num_layers, 1)
        check_int("kv_heads", self.kv_heads, 1)
        check_int("num_sinks", self.num_sinks, 0)
        check_int("window", self.window, 1)
        check_int("recent", self.recent, 0)
        check_int("local_window", self.local_window, 1)
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)) \
                or not 0.0 <= self.threshold <= 1.0:
            raise InputError(f"threshold must be a number in [0, 1], got {self.threshold!r}")
        for name in ("budgets", "coverage", "local"):
            rows = getattr(self, name)
            if not isinstance(rows, list) or len(rows) != self.num_layers \
                    or any(r is not None and (not isinstance(r, list) or len(r) != self.kv_heads) for r in rows):
                raise InputError(f"a retention plan's {name} must hold {self.num_layers} layers of {self.kv_heads} "
                                 f"key-value heads (or null)")
        for row in self.budgets:
            for b in row or ():
                check_int("a retention plan's budget", b, 1)

    @property
    def total_tokens(self) -> int:
        return sum(sum(b) for b in self.budgets if b is not None)

    def summary(self) -> dict:
        """Head counts and budgets at a glance (what the CLI prints and the JSON carries)."""
        heads = [x for row in self.local if row is not None for x in row]
        # (a layer with budgets has its locality flags: the plans sinklab writes hold both or neither)
        pairs = [p for row, flags in zip(self.budgets, self.local) if row is not None for p in zip(row, flags)]  # type: ignore[arg-type]
        far, near = [b for b, f in pairs if not f], [b for b, f in pairs if f]
        every = [b for row in self.budgets if row is not None for b in row]
        return {"heads": len(heads), "local_heads": sum(heads), "local_budget": near[0] if near else None,
                "far_budget": far[0] if far else None, "total_tokens": self.total_tokens,
                "uniform_budget": self.num_sinks + self.window, "least_budget": min(every, default=None),
                "most_budget": max(every, default=None), "calibrated": "calibration" in self.source}

    def with_budget(self, num_sinks: int, window: int) -> RetentionPlan:
        """The plan at another uniform budget of ``num_sinks + window`` tokens per head: the same local heads, or,
        for budgets fitted on a calibration text, each head's fitted budget scaled to the new total."""
        if "calibration" not in self.source:
            budgets = allocate(self.local, num_sinks, window, self.local_window)
        else:
            budgets = rescale(self.budgets, num_sinks + window, num_sinks + self.recent)
        return replace(self, num_sinks=num_sinks, window=window, budgets=budgets)

    def uniform(self) -> RetentionPlan:
        """The same plan with every budgeted head at the uniform ``num_sinks + window`` tokens (an ablation: what
        the per-head budgets add)."""
        b = self.num_sinks + self.window
        return replace(self, budgets=[None if row is None else [b] * len(row) for row in self.budgets])

    def to_json(self) -> dict:
        return {"format": FORMAT, **asdict(self), "summary": self.summary()}

    @classmethod
    def from_json(cls, data: dict) -> RetentionPlan:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise InputError(f"not a sinklab retention plan (expected format {FORMAT!r})")
        names = set(cls.__dataclass_fields__)
        try:
            return cls(**{k: v for k, v in data.items() if k in names})
        except TypeError as exc:
            raise InputError(f"a retention plan with missing fields: {exc}") from exc

    def save(self, path: str | Path) -> Path:
        """Write the plan as JSON to ``path`` atomically; return the path."""
        return write_json(path, self.to_json())

    def check_model(self, model: nn.Module) -> None:
        """The plan was made for a model of this layout (type, layers, key-value heads)."""
        kind, layers, heads = _layout(model)
        if (kind, layers, heads) != (self.model_type, self.num_layers, self.kv_heads):
            raise InputError(f"this plan was made for a {self.model_type} with {self.num_layers} layers of "
                             f"{self.kv_heads} key-value heads; the model is a {kind} with {layers} layers of {heads}")


def allocate(local: list[list[bool] | None], num_sinks: int, window: int, local_window: int) -> list[list[int] | None]:
    """Budgets per layer and key-value head: ``num_sinks + min(local_window, window)`` for a local head, the rest of
    the uniform total ``heads × (num_sinks + window)`` shared equally by the others (rounded down)."""
    short = num_sinks + min(local_window, window)
    flags = [f for row in local if row is not None for f in row]
    n_local, n_heads = sum(flags), len(flags)
    pool = n_heads * (num_sinks + window)
    far = math.floor((pool - n_local * short) / (n_heads - n_local)) if n_heads > n_local else short
    return [None if row is None else [short if f else far for f in row] for row in local]


def rescale(budgets: list[list[int] | None], per_head: int, least: int) -> list[list[int] | None]:
    """``budgets`` scaled to a total of ``per_head`` tokens per budgeted head, none below ``least``: each budget in
    proportion (rounded down), then the tokens left over one each to the largest budgets (the first of equals
    first), or the excess taken one each from them."""
    flat = [b for row in budgets if row is not None for b in row]
    target, old = per_head * len(flat), sum(flat)
    new = [max(least, b * target // old) for b in flat]
    order = sorted(range(len(flat)), key=lambda i: -flat[i])
    k = 0
    while sum(new) != target and k < 4 * len(flat) * max(1, per_head):
        i = order[k % len(order)]
        if sum(new) < target:
            new[i] += 1
        elif new[i] > least:
            new[i] -= 1
        k += 1
    it = iter(new)
    return [None if row is None else [next(it) for _ in row] for row in budgets]


def load_plan(path: str | Path) -> RetentionPlan:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise InputError(f"no retention plan at {path}") from exc
    except (OSError, json.JSONDecodeError) as exc:
        raise InputError(f"cannot read the retention plan {path}: {exc}") from exc
    return RetentionPlan.from_json(data)


def _layout(model: nn.Module) -> tuple[str, int, int]:
    cfg: Any = getattr(model.config, "text_config", None) or model.config
    heads: Any = getattr(cfg, "num_key_value_heads", None) or getattr(cfg, "num_attention_heads", 0)
    return str(cfg.model_type), int(cfg.num_hidden_layers), int(heads)


def head_coverage(scan, num_sinks: int) -> torch.Tensor:
    """``[L, H]``: each head's mean share of attention on the first ``num_sinks`` positions plus its last
    ``local_window`` keys, over the real queries past both (so the two never overlap). NaN for non-attention
    layers."""
    if scan.local_mass is None:
        raise InputError("this scan has no local attention shares (made by an older sinklab); scan again")
    w = int(scan.meta.get("local_window", 64))
    first = w + num_sinks
    if scan.local_mass.shape[-1] <= first:
        raise InputError(f"the scan's texts ({scan.local_mass.shape[-1]} tokens) are too short to tell local heads: "
                         f"scan at least {first + 64} tokens per sample")
    missing = [p for p in range(num_sinks) if p not in scan.candidates]
    if missing:
        raise InputError(f"the scan kept the attention on positions {list(scan.candidates)}, not on sinks {missing}")
    cols = [scan.candidates.index(p) for p in range(num_sinks)]
    sinks = scan.candidate_attention[..., cols].sum(-1)  # (S, L, H, T)
    share = (scan.local_mass + sinks)[..., first:]
    return share.nanmean(dim=(0, 3))


def plan_from_scan(model: nn.Module, scan, *, num_sinks: int = 4, window: int = 1020, recent: int | None = None,
                   threshold: float = 0.9, sliding_sinks: bool = False) -> RetentionPlan:
    """The ``auto`` plan for ``model`` from its :class:`~sinklab.scan.ScanResult` (or a diagnosis holding one in
    ``.scan``), at the total budget of ``num_sinks + window`` tokens per key-value head. ``recent``: the newest tokens
    every head keeps (default: 32, or less where the window or the scan's local window is shorter)."""
    scan = getattr(scan, "scan", scan)
    check_int("num_sinks", num_sinks)
    check_int("window", window, 1)
    w_local = int(scan.meta.get("local_window", 64))
    recent = min(32, w_local, window) if recent is None else recent
    check_int("recent", recent, 1)
    if not 0.0 < float(threshold) <= 1.0:
        raise InputError(f"threshold is a share of attention in (0, 1], got {threshold!r}")
    kind, layers, kv = _layout(model)
    coverage = head_coverage(scan, num_sinks)
    if coverage.shape[0] != layers:
        raise InputError(f"the scan has {coverage.shape[0]} layers; the model {layers}: scan this model")
    heads = coverage.shape[1]
    if heads % kv:
        raise UnsupportedModelError(f"{heads} query heads do not split into {kv} key-value heads")
    rep = heads // kv
    if recent > min(w_local, window):
        raise InputError(f"recent ({recent}) must be at most the local window ({w_local}) and the window ({window})")
    windows = _compat.layer_sliding_windows(model)
    kinds = scan.meta.get("layer_kinds") or ["attention"] * layers
    budgeted = [k == "attention" and not (w is not None and w <= num_sinks + window and not sliding_sinks)
                for k, w in zip(kinds, windows)]
    per_kv = coverage.view(layers, kv, rep).amin(-1)  # the least-local query head decides
    local = (per_kv >= threshold) & torch.tensor(budgeted)[:, None]
    cov = [[round(float(x), 4) for x in per_kv[i]] if budgeted[i] else None for i in range(layers)]
    flags = [[bool(x) for x in local[i]] if budgeted[i] else None for i in range(layers)]
    budgets = allocate(flags, num_sinks, window, w_local)
    source = {"sinklab": __version__, "model": scan.meta.get("model"), "samples": scan.num_samples,
              "seq_len": scan.meta.get("seq_len")}
    return RetentionPlan(kind, layers, kv, num_sinks, window, recent, w_local, float(threshold), budgets, cov, flags,
                         source)
