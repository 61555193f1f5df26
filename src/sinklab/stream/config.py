"""``StreamConfig``: every setting of a stream, checked once, then read by the cache, the session, the CLI and the
saved files alike (``StreamConfig.from_json(config.to_json()) == config``). The keyword form of
:class:`~sinklab.stream.SinkCache` / :class:`~sinklab.stream.StreamSession` builds one through :func:`stream_config`.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import Any

from ..errors import InputError, check_int, check_spans, is_int
from ..kvquant.codec import BITS
from .plan import RetentionPlan, load_plan, plan_from_scan
from .policy import POLICIES, Prescored, Recency, RetentionPolicy, SnapKV, get_policy

__all__ = ["KV_GROUP_SIZE", "StreamConfig", "resolve_config", "stream_config"]

#: Channels per scale and zero point of a quantized window (``kv_bits``) unless given; the one place it is written.
KV_GROUP_SIZE = 16
FORMAT = "sinklab.stream-config/1"


@dataclass(frozen=True)
class StreamConfig:
    """A stream's settings. Frozen: a stream's settings are fixed when it starts (``dataclasses.replace(config,
    window=...)`` makes another). Each field has a one-line comment below; what each does in full: docs/stream.md
    ("One configuration, saved streams").
    """

    num_sinks: int = 4  # S: the first real tokens kept forever (0: the window-only baseline)
    window: int = 1020  # W ≥ 1: the newest tokens each query sees, itself included
    pinned: tuple[tuple[int, int], ...] = ()  # half-open stream-token spans kept forever besides the sinks
    start_position: int = 0  # absolute position of the stream's first token
    rebase_every: int | None = None  # tokens between re-bases of the virtual positions (None: automatic)
    sliding_sinks: bool = False  # the model's own sliding-window layers get the sinks and pinned spans too
    check_every: int = 64  # on an accelerator: decoded columns between reads of the deferred checks
    kv_bits: int | None = None  # the window packed at 2, 3, 4 or 8 bits (None: exact)
    kv_group_size: int = KV_GROUP_SIZE  # channels per scale and zero point of a packed window
    compile_plan: bool = False  # the decode step's bookkeeping through torch.compile
    policy: Any = field(default_factory=Recency)  # what each head keeps: a name of POLICIES, "auto" or an object
    plan: RetentionPlan | None = None  # per-head budgets of policy "auto" (its policy: SnapKV at plan.recent)
    positions: str = "slot"  # a score-based stream's key positions: "slot" (by cache slot) or "original"

    def __post_init__(self) -> None:
        check_int("num_sinks", self.num_sinks)
        check_int("window", self.window, 1, " (it includes the current token)")
        check_int("start_position", self.start_position)
        if self.rebase_every is not None:
            check_int("rebase_every", self.rebase_every, 1, " (tokens between re-bases) or None (automatic)")
        check_int("check_every", self.check_every, 1)
        if not isinstance(self.compile_plan, bool):
            raise InputError(f"compile_plan is True or False, got {self.compile_plan!r}")
        if self.kv_bits is not None and (not is_int(self.kv_bits) or self.kv_bits not in BITS):
            raise InputError(f"kv_bits must be one of {BITS} (or None for full precision), got {self.kv_bits!r}")
        check_int("kv_group_size", self.kv_group_size, 1)
        if self.kv_bits is None and self.kv_group_size != KV_GROUP_SIZE:
            raise InputError(f"kv_group_size={self.kv_group_size!r} sets the groups of a quantized window; it needs "
                             "kv_bits")
        if self.positions not in ("slot", "original"):
            raise InputError(f"positions is 'slot' (positions by cache slot) or 'original', got {self.positions!r}")
        self._set("pinned", tuple(check_spans(self.pinned, "pinned")))
        self._set("sliding_sinks", bool(self.sliding_sinks))
        self._set("policy", self._resolved_policy())
        if self.plan is not None and (self.num_sinks, self.window) != (self.plan.num_sinks, self.plan.window):
            self._set("plan", self.plan.with_budget(self.num_sinks, self.window))  # the same local heads
        if self.policy.scored and self.kv_bits is not None:
            raise InputError(f"kv_bits packs the recency policy's ring buffer; the {self.policy.name!r} policy keeps "
                             "its tokens unpacked (use policy='streaming' with kv_bits)")

    def _set(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)  # (frozen: normalised once, here)

    def _resolved_policy(self) -> RetentionPolicy:
        """The policy object; ``auto`` (or a saved auto stream's SnapKV) needs and reads the plan."""
        if self.plan is not None and not isinstance(self.plan, RetentionPlan):
            raise InputError(f"plan is a sinklab.stream.plan.RetentionPlan here, got {type(self.plan).__name__} "
                             "(sinklab.stream.config.stream_config makes one from a scan or a file)")
        if self.policy == "auto" or (self.plan is not None and isinstance(self.policy, SnapKV)):
            if self.plan is None:
                raise InputError("policy='auto' needs a plan: plan=scan_or_diagnosis (sinklab.scan / sinklab.diagnose "
                                 "of this model), a RetentionPlan, or the retention_plan.json that `sinklab diagnose` "
                                 "saves")
            return self.policy if isinstance(self.policy, Prescored) else SnapKV(recent=self.plan.recent)
        if self.plan is not None:
            raise InputError(f"a plan sets per-head budgets for policy='auto'; policy={self.policy!r} keeps one "
                             "budget for every head")
        return get_policy(self.policy)

    # ------------------------------------------------------------------ JSON
    def to_json(self) -> dict:
        """The settings as JSON (the policy by its row in :data:`~sinklab.stream.policy.POLICIES` and its
        parameters, the plan whole); :meth:`from_json` reads it back."""
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["pinned"] = [list(p) for p in self.pinned]
        out["policy"] = _policy_json(self.policy)
        out["plan"] = None if self.plan is None else self.plan.to_json()
        return {"format": FORMAT, **out}

    @classmethod
    def from_json(cls, data: dict) -> StreamConfig:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise InputError(f"not a sinklab stream configuration (expected format {FORMAT!r})")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names - {"format"})
        if unknown:
            raise InputError(f"a stream configuration with unknown settings {unknown} (written by a newer sinklab?)")
        values = {k: v for k, v in data.items() if k in names}
        values["policy"] = _policy_from_json(values.get("policy", {"name": "streaming"}))
        if values.get("plan") is not None:
            values["plan"] = RetentionPlan.from_json(values["plan"])
        return cls(**values)


def _policy_json(policy: RetentionPolicy) -> dict:
    """A policy as ``{"name": ..., its parameters}``; only a row of POLICIES can be written."""
    policy = policy.as_row() if isinstance(policy, Prescored) else policy
    if type(policy) is not POLICIES.get(policy.name):
        raise InputError(f"the policy {type(policy).__name__} ({policy.name!r}) is not a row of "
                         "sinklab.stream.policy.POLICIES, so a saved stream could not rebuild it; add it to the table")
    params: dict[str, Any] = {}
    if dataclasses.is_dataclass(policy):
        params = {f.name: getattr(policy, f.name) for f in dataclasses.fields(policy) if f.init}
    return {"name": policy.name, **params}


def _policy_from_json(data) -> RetentionPolicy:
    if not isinstance(data, dict) or data.get("name") not in POLICIES:
        raise InputError(f"a saved policy is {{'name': one of {list(POLICIES)}, its parameters}}, got {data!r}")
    params = {k: v for k, v in data.items() if k != "name"}
    try:
        return POLICIES[data["name"]](**params)
    except TypeError as exc:
        raise InputError(f"the saved {data['name']!r} policy has unknown parameters: {exc}") from exc


def _legacy_sizes(num_sinks: int, window: int | None, window_length: int | None,
                  num_sink_tokens: int | None) -> tuple[int, int | None]:
    """Map transformers' old ``SinkCache(window_length, num_sink_tokens)`` names onto ``(num_sinks, window)``: the old
    ``window_length`` counted the sinks too, so ``window = window_length − num_sinks``."""
    if window_length is None and num_sink_tokens is None:
        return num_sinks, window
    num_sinks = num_sinks if num_sink_tokens is None else num_sink_tokens
    if window_length is not None:
        if window is not None:
            raise InputError("give window (sinklab) or window_length (transformers' old SinkCache), not both")
        if not is_int(window_length):
            raise InputError(f"window_length must be an integer, got {window_length!r}")
        if window_length <= num_sinks:
            raise InputError(f"window_length ({window_length!r}) counts the {num_sinks} sinks too; it must exceed them")
        window = window_length - num_sinks
    warnings.warn(f"window_length/num_sink_tokens are transformers' old names: this is "
                  f"SinkCache(model, num_sinks={num_sinks}, window={window}) (window_length counted the sinks)",
                  FutureWarning, stacklevel=4)
    return num_sinks, window


def _plan_of(plan, model, num_sinks: int, window: int) -> RetentionPlan | None:
    """A :class:`RetentionPlan` from a plan, the path of a saved one, or a scan / diagnosis to make it from (at
    ``num_sinks + window`` tokens per head)."""
    scan = getattr(plan, "scan", plan)  # a Diagnosis holds its scan
    if isinstance(plan, (str, bytes)) or hasattr(plan, "__fspath__"):
        return load_plan(plan)
    if hasattr(scan, "local_mass"):
        return plan_from_scan(model, scan, num_sinks=num_sinks, window=window)
    if plan is not None and not isinstance(plan, RetentionPlan):
        raise InputError(f"plan is a sinklab.stream.plan.RetentionPlan, the path of a saved one, or a scan or "
                         f"diagnosis to make one from; got {type(plan).__name__}")
    return plan


def stream_config(model, num_sinks: int | None = None, window: int | None = None, *, plan=None,
                  window_length: int | None = None, num_sink_tokens: int | None = None, **settings) -> StreamConfig:
    """The :class:`StreamConfig` of the keyword form ``SinkCache(model, num_sinks=4, window=1020, ...)``: maps the old
    transformers names, makes or reads an ``auto`` plan (checked against ``model``); without a ``window`` a plan keeps
    its own budget, else it is re-budgeted to it (the same local heads). ``settings``: the other fields."""
    sized = window is not None or window_length is not None
    sinks, window = _legacy_sizes(4 if num_sinks is None else num_sinks, window, window_length, num_sink_tokens)
    width = 1020 if window is None else window
    plan = _plan_of(plan, model, sinks, width) if plan is not None else None
    if plan is not None and (settings.get("policy") == "auto" or isinstance(settings.get("policy"), Prescored)):
        plan.check_model(model)
        if not sized:
            sinks, width = plan.num_sinks, plan.window
    return StreamConfig(num_sinks=sinks, window=width, plan=plan, **settings)


def resolve_config(model, config: StreamConfig | None, num_sinks: int | None, window: int | None,
                   settings: dict) -> StreamConfig:
    """``config`` itself, or the one its keywords make (:func:`stream_config`); an InputError for both."""
    if config is None:
        return stream_config(model, num_sinks, window, **settings)
    if num_sinks is not None or window is not None or settings:
        raise InputError("give the stream's settings either as config=StreamConfig(...) or as keywords, not both")
    return config
