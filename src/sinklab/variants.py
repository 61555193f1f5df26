"""Sink-aware attention variants, applied to Llama-style transformers models through public extension points.

Each variant is a flag, off by default, with its paper:

* ``sink_logit`` — a learned per-head sink logit appended to every row (gpt-oss, arXiv:2508.10925);
* ``softmax1`` — the sink logit fixed at 0 ("Attention is off by one", Miller 2023);
* ``kv_bias`` — a learned per-head key/value slot visible to every query (Sun et al. 2024, arXiv:2402.17762);
* ``gate`` — output gating after attention, ``Y ⊙ σ(X W)`` with ``X`` the normalised block input:
  ``"elementwise"`` (``d → H·dh``) or ``"headwise"`` (``d → H``) (Qiu et al. 2025, arXiv:2505.06708);
* ``registers`` — ``n`` learnable placeholder tokens prepended to every sample, dropped at the output
  (Darcet et al. 2024, arXiv:2309.16588; the learnable sink token of StreamingLLM, arXiv:2309.17453).

Each variant is one class (:class:`Variant`: its parameters, its extra softmax columns, its gate) in the
table :data:`VARIANTS`, which the variant attention, the capture, the stream and the ViT side loop over.
``apply_variant(model, "gated+registers")`` adds the parameters to each attention module, registers an
attention function (with its mask function) and hooks; ``handle.remove()`` undoes all of it.
``save``/``load`` keep the variant with the weights (safetensors). The attention itself is
:func:`sinklab.attention.attend`: the sink slot and the KV-bias slot enter PyTorch's fused SDPA as extra
key columns, so no per-head Python loop and no T×T float mask in Python.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import Tensor, nn

from . import _compat
from .attention import AttendSpec, Columns, attend, mask_rows
from .errors import InputError, UnsupportedModelError, check_int

__all__ = ["VariantConfig", "Variant", "VARIANTS", "VARIANT_NAMES", "active_variants", "parse_variant", "apply_variant",
           "VariantHandle", "add_attention_parameters", "variant_column_logits", "variant_has_columns", "variant_gate",
           "register_count", "register_labels", "add_register_parameter"]

ATTN_NAME = "sinklab_variant"
_OFF_GATE_BIAS = 30.0  # σ(30) == 1.0 in float32: a gate initialised "off" passes everything


@dataclass(frozen=True)
class VariantConfig:
    """Which variants are on. Incompatible combinations fail at construction."""

    sink_logit: bool = False  # learned per-head sink logit (gpt-oss)
    softmax1: bool = False  # sink logit fixed at 0 (softmax₁)
    kv_bias: bool = False  # learned per-head key/value slot (Sun et al.)
    gate: str | None = None  # None | "elementwise" | "headwise" (Qiu et al.)
    registers: int = 0  # learnable placeholder tokens prepended to every sample

    def __post_init__(self) -> None:
        if self.sink_logit and self.softmax1:
            raise InputError("softmax1 is the sink logit fixed at 0: choose either sink_logit or softmax1, not both")
        gates = [v.fields["gate"] for v in VARIANTS if "gate" in v.fields]  # the gate kinds the table knows
        if self.gate is not None and self.gate not in gates:
            raise InputError(f"gate must be None or one of {', '.join(map(repr, gates))}, got {self.gate!r}")
        check_int("registers", self.registers)
        if not self.any:
            raise InputError("no variant selected; choose at least one of sink_logit, softmax1, kv_bias, gate, registers")

    @property
    def any(self) -> bool:
        return any(variant.active(self) for variant in VARIANTS)


# ----------------------------------------------------------------------------- the table of variants
class Variant:
    """One attention variant, one row of :data:`VARIANTS`: everything sinklab does differently for it.

    ``name`` (the CLI/``parse_variant`` name) sets ``fields`` of :class:`VariantConfig`. ``add_parameters`` adds
    its parameters to one attention module (causal LM and ViT alike, through the handle's ``ModelPatch``);
    ``columns`` are the extra softmax columns it gives each query (:class:`sinklab.attention.Columns`); ``gate``
    the output gate ``[B, Tq, H, dh | 1]`` (register tokens are placed by :func:`apply_variant` /
    :func:`sinklab.vit.apply_vit_variant`). Every consumer — the variant attention, the
    capture, the stream, the ViT side, the CLI's list of names — loops over the table. A new variant: one class
    and one entry in :data:`VARIANTS` (plus its field in :class:`VariantConfig` and a case in
    ``tests/variant_cases.py``).
    """

    name = ""
    fields: dict = {}
    has_columns = False
    off_is_identity = False  # init="off" leaves the model's outputs unchanged

    def active(self, cfg: VariantConfig) -> bool:
        """Is this variant on in ``cfg``?"""
        return all(getattr(cfg, key) == value for key, value in self.fields.items())

    def add_parameters(self, patch: _compat.ModelPatch, attn: nn.Module, *, heads: int, kv_heads: int, head_dim: int,
                       width: int, init: str, sink_start: float, generator: torch.Generator | None) -> None:
        """Add this variant's parameters (and hooks) to one attention module, through ``patch`` (nothing by default)."""

    def columns(self, module: nn.Module, query: Tensor, scale: float, slot_query, softcap: float | None
                ) -> list[Columns]:
        """This variant's extra columns for ``query`` ``[B, H, C, dh]`` (none by default)."""
        return []

    def gate(self, module: nn.Module, heads: int) -> Tensor | None:
        """This variant's output gate for the module's current input (none by default)."""
        return None


class SinkLogit(Variant):
    """A learned per-head sink logit appended to every row, value 0 (gpt-oss, arXiv:2508.10925)."""

    name, fields, has_columns, off_is_identity = "sink-logit", {"sink_logit": True}, True, True

    def add_parameters(self, patch, attn, *, heads, kv_heads, head_dim, width, init, sink_start, generator):
        ref = attn.q_proj.weight
        start = -math.inf if init == "off" else float(sink_start)
        patch.add(attn, "sinklab_sink_logit", nn.Parameter(torch.full((heads,), start, dtype=ref.dtype, device=ref.device)))

    def columns(self, module, query, scale, slot_query, softcap):
        return [Columns.sink(module.sinklab_sink_logit, query)]


class Softmax1(Variant):
    """The sink logit fixed at 0: softmax₁ ("Attention is off by one", Miller 2023)."""

    name, fields, has_columns = "softmax1", {"softmax1": True}, True

    def columns(self, module, query, scale, slot_query, softcap):
        return [Columns.sink(torch.zeros(query.shape[1], device=module.q_proj.weight.device), query)]


class KvBias(Variant):
    """A learned per-head key/value slot seen by every query, 0 at the start (Sun et al. 2024, arXiv:2402.17762).

    Its key has no position: its logit is ``q·k_slot·scale`` with ``q`` rotated where the caller says
    (``slot_query``: a tensor or a function returning one; default the query as it is).
    """

    name, fields, has_columns = "kv-bias", {"kv_bias": True}, True

    def add_parameters(self, patch, attn, *, heads, kv_heads, head_dim, width, init, sink_start, generator):
        ref = attn.q_proj.weight
        for name in ("sinklab_k_bias", "sinklab_v_bias"):
            patch.add(attn, name, nn.Parameter(torch.zeros(kv_heads, head_dim, dtype=ref.dtype, device=ref.device)))

    def columns(self, module, query, scale, slot_query, softcap):
        q = slot_query() if callable(slot_query) else slot_query
        rep = query.shape[1] // module.sinklab_k_bias.shape[0]
        return [Columns.slot(query if q is None else q.to(query), module.sinklab_k_bias.repeat_interleave(rep, 0),
                             module.sinklab_v_bias, scale, softcap)]


class Gated(Variant):
    """Output gating ``Y ⊙ σ(X W)``, ``X`` the normalised block input, ``d → H·dh`` (Qiu et al. 2025, arXiv:2505.06708)."""

    name, fields, off_is_identity = "gated", {"gate": "elementwise"}, True

    def add_parameters(self, patch, attn, *, heads, kv_heads, head_dim, width, init, sink_start, generator):
        ref = attn.q_proj.weight
        gate = nn.Linear(width, heads * head_dim if self.fields["gate"] == "elementwise" else heads, bias=True)
        if generator is not None and init != "off":
            bound = width**-0.5  # nn.Linear's default range, drawn from the generator
            with torch.no_grad():
                gate.weight.uniform_(-bound, bound, generator=generator)
        gate = gate.to(ref.device, ref.dtype)
        with torch.no_grad():
            if init == "off":
                gate.weight.zero_()
                gate.bias.fill_(_OFF_GATE_BIAS)
            else:
                gate.bias.zero_()
        patch.add(attn, "sinklab_gate", gate)
        patch.add(attn, "sinklab_gate_input", None)
        patch.hook(attn, stash_gate_input, pre=True, with_kwargs=True)

    def gate(self, module, heads):
        y = module.sinklab_gate(module.sinklab_gate_input)
        gate = torch.sigmoid(y.to(torch.promote_types(y.dtype, torch.float32)))
        return gate.view(*gate.shape[:2], heads, -1)


class GatedHeadwise(Gated):
    """Output gating with one gate per head, ``d → H`` (Qiu et al. 2025)."""

    name, fields = "gated-headwise", {"gate": "headwise"}


class Registers(Variant):
    """``n`` learnable placeholder tokens in every sample, dropped at the output (Darcet et al. 2024,
    arXiv:2309.16588; the learnable sink token of StreamingLLM, arXiv:2309.17453). Default ``n`` = 4."""

    name, fields = "registers", {"registers": 4}

    def active(self, cfg):
        return cfg.registers > 0


VARIANTS: tuple[Variant, ...] = (SinkLogit(), Softmax1(), KvBias(), Gated(), GatedHeadwise(), Registers())
VARIANT_NAMES = {variant.name: dict(variant.fields) for variant in VARIANTS}


def active_variants(cfg: VariantConfig | None) -> list[Variant]:
    """The rows of :data:`VARIANTS` that are on in ``cfg`` (table order), none for ``None``."""
    return [] if cfg is None else [variant for variant in VARIANTS if variant.active(cfg)]


def parse_variant(spec: str | VariantConfig | dict, **overrides) -> VariantConfig:
    """``"gated+registers"``, a dict of fields, or a :class:`VariantConfig` → :class:`VariantConfig`."""
    if isinstance(spec, VariantConfig):
        fields = asdict(spec)
    elif isinstance(spec, dict):
        fields = dict(spec)
    else:
        fields = {}
        for name in str(spec).split("+"):
            name = name.strip()
            if name not in VARIANT_NAMES:
                raise InputError(f"unknown variant {name!r}; choose from {sorted(VARIANT_NAMES)} (combine with '+')")
            clash = set(fields) & set(VARIANT_NAMES[name])
            if clash:
                raise InputError(f"variant {name!r} sets {sorted(clash)} twice; e.g. 'gated' and 'gated-headwise' exclude each other")
            fields.update(VARIANT_NAMES[name])
    fields.update(overrides)
    try:
        return VariantConfig(**fields)
    except TypeError as exc:
        raise InputError(f"bad variant fields {fields}: {exc}") from exc


# ----------------------------------------------------------------------------- attention function
def variant_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                      scaling: float | None = None, dropout: float = 0.0, **kwargs) -> tuple[Tensor, None]:
    """Registered attention: :func:`sinklab.attention.attend` with the variant's columns and gate (fused unless the
    model soft-caps its attention logits), keeping the model's own softcap and learned sink logits.

    The sink logit ``s_h`` and the kv-bias slot enter as extra key columns of the fused attention (the sink's
    value is 0; the slot's logit is ``q·k_slot·scale``), then the output gate. Output ``[B, Tq, H, dh]``.
    """
    _, h, tq, dh = query.shape
    scale = dh**-0.5 if scaling is None else float(scaling)
    softcap = kwargs.get("softcap")  # the model's own attention soft-capping (Gemma 2) and sink logits (gpt-oss)
    visible, _ = mask_rows(attention_mask, getattr(module, "is_causal", True), 0, tq, tq, key.shape[2], query.device)
    columns = variant_column_logits(module, query, scale, softcap=softcap, model_sink=kwargs.get("s_aux"))
    spec = AttendSpec(scale=scale, columns=columns, softcap=softcap, gate=variant_gate(module, h),
                      dropout=dropout if module.training else 0.0)
    out = attend(query, key, value, visible, spec)
    return out.transpose(1, 2).contiguous(), None


def variant_column_logits(module: nn.Module, query: Tensor, scale: float, slot_query=None,
                          softcap: float | None = None, model_sink: Tensor | None = None) -> list[Columns]:
    """The extra softmax columns of one attention module for ``query`` ``[B, H, C, dh]``, from :data:`VARIANTS`.

    ``slot_query``: the queries rotated where a position-free slot should see them (a tensor or a function
    returning one; default ``query``); ``softcap`` applies to the slot's logit. ``model_sink``: the model's
    own learned sink logits (gpt-oss's ``s_aux``), used unless a variant brings its own sink. Empty without
    any of them.
    """
    columns = []
    for variant in active_variants(getattr(module, "sinklab_variant", None)):
        columns += variant.columns(module, query, scale, slot_query, softcap)
    if model_sink is not None and not any(col.values is None for col in columns):
        columns.insert(0, Columns.sink(model_sink, query))
    return columns


def variant_has_columns(module: nn.Module) -> bool:
    """Does a variant give this attention module extra softmax columns?"""
    return any(v.has_columns for v in active_variants(getattr(module, "sinklab_variant", None)))


def variant_gate(module: nn.Module, heads: int) -> Tensor | None:
    """The output gate ``σ(X W)`` of one attention module for its current input, ``[B, Tq, H, dh | 1]``
    (float32, or float64 for a float64 model), or None without a gate. Multiply each head's attention output
    by it before ``o_proj``. Several gating variants compose: their gates multiply."""
    out = None
    for variant in active_variants(getattr(module, "sinklab_variant", None)):
        gate = variant.gate(module, heads)
        if gate is not None:
            out = gate if out is None else out * gate
    return out


# ----------------------------------------------------------------------------- applying
def _attention_modules(model: nn.Module) -> list[nn.Module]:
    mods = []
    for layer in _compat.find_layers(model):
        attn = getattr(layer, "self_attn", None)
        if attn is None or not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
            raise UnsupportedModelError(
                f"{type(model).__name__}: variants need Llama-style attention (self_attn with q/k/v/o_proj); "
                f"found {type(attn).__name__ if attn is not None else 'none'}"
            )
        mods.append(attn)
    return mods


class VariantHandle:
    """What :func:`apply_variant` did to a model; ``remove()`` (or leaving the ``with`` block) undoes it.

    Every change (parameters, hooks, the attention backend, the config field ``sinklab_variant``) is owned by
    one :class:`sinklab._compat.ModelPatch` (``patch``). ``base`` is the module whose attention implementation
    carries the variant (the model itself for a causal LM; the ViT/DINOv2 backbone inside a classification
    model, see :mod:`sinklab.vit.variants`).
    """

    def __init__(self, model: nn.Module, config: VariantConfig, base: nn.Module | None = None) -> None:
        self.model = model
        self.base = model if base is None else base
        self.config = config
        self.patch = _compat.ModelPatch(model)

    def __enter__(self) -> VariantHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def install(self) -> None:
        """Switch the model to the variant attention and mark it (the parameters and hooks are already added).

        On any failure everything the handle added is undone before the error propagates.
        """
        try:
            self.patch.use_attention(ATTN_NAME, variant_attention, target=self.base)
            self.patch.set_config("sinklab_variant", asdict(self.config), module=self.base)
            for module in {id(m): m for m in (self.model, self.base)}.values():
                self.patch.add(module, "sinklab_variant_handle", self)
        except BaseException:
            self.remove()
            raise

    def remove(self) -> None:
        self.patch.restore()


def stash_gate_input(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook of a gated attention module: keep its input ``X`` for the gate ``σ(X W)``."""
    module.sinklab_gate_input = args[0] if args else kwargs["hidden_states"]


def add_attention_parameters(handle: VariantHandle, attn: nn.Module, *, heads: int, kv_heads: int, head_dim: int,
                             width: int, init: str, sink_start: float = 0.0,
                             generator: torch.Generator | None = None) -> None:
    """Add the variant's parameters (and the gate's input hook) to one attention module, through ``handle.patch``.

    ``heads``/``kv_heads``/``head_dim``/``width``: the module's shapes (sink logit ``[heads]``, key/value slot
    ``[kv_heads, head_dim]``, gate ``width → heads·head_dim`` or ``heads``). ``init="off"``: the identity (sink
    logit −inf, gate σ = 1); else the sink logit starts at ``sink_start``, the gate has bias 0 and
    ``nn.Linear``'s weights (redrawn from ``generator`` when one is given, for reproducible runs; ``init="off"``
    draws nothing from it).
    """
    add = handle.patch.add
    add(attn, "sinklab_variant", handle.config)
    for variant in active_variants(handle.config):
        variant.add_parameters(handle.patch, attn, heads=heads, kv_heads=kv_heads, head_dim=head_dim, width=width,
                               init=init, sink_start=sink_start, generator=generator)


def apply_variant(model: nn.Module, variant: str | VariantConfig | dict, *, init: str = "default",
                  sink_init: float | None = None, **overrides) -> VariantHandle:
    """Add sink-aware attention to a Llama-style model in place; returns a handle that can undo it.

    ``init="off"`` starts each variant at its identity (sink logit −inf, gate σ = 1) so a pretrained model's
    outputs are unchanged; ``"default"`` is for training (sink logit 0, gate from ``nn.Linear`` init with
    bias 0, KV slot 0). Registers start as small random vectors either way (they have no identity).

    ``sink_init`` (sink-logit variant, ``init="default"``) is the logit's starting value. The default 0 gives
    the slot ≈ 1/(N+1) of a row of N keys, and its gradient is proportional to the mass it holds, so a
    first-token sink that forms early wins the race and the logit stays unused; ``sink_init ≈ log N`` lets it
    take the parked mass instead (docs/sink_logit.md: on Bigram-Backcopy, BOS attention 0.994 at 0, 0.017 at 4).
    """
    cfg = parse_variant(variant, **overrides)
    if init not in ("default", "off"):
        raise InputError(f"init must be 'default' or 'off', got {init!r}")
    if sink_init is not None:
        if not cfg.sink_logit:
            raise InputError("sink_init sets the learned sink logit's start; the variant has no sink logit "
                             "(use 'sink-logit', e.g. 'sink-logit+gated')")
        if init == "off":
            raise InputError("sink_init and init='off' contradict each other (off starts the sink logit at −inf)")
        if not math.isfinite(float(sink_init)):
            raise InputError(f"sink_init must be a finite number, got {sink_init!r}")
    if getattr(model, "sinklab_variant_handle", None) is not None:
        raise InputError("a variant is already applied to this model; call handle.remove() first")
    mods = _attention_modules(model)
    config = model.config
    d = _compat.config_get(config, "hidden_size")
    h = _compat.config_get(config, "num_attention_heads")
    hkv = _compat.config_get(config, "num_key_value_heads", default=h)
    dh = getattr(mods[0], "head_dim", d // h)
    ref: Tensor = mods[0].q_proj.weight  # type: ignore[union-attr, assignment]  # (a tensor or module to nn.Module's typing)
    handle = VariantHandle(model, cfg)
    for attn in mods:
        add_attention_parameters(handle, attn, heads=h, kv_heads=hkv, head_dim=dh, width=d, init=init,
                                 sink_start=sink_init or 0.0)
    if cfg.registers:
        _add_registers(handle.patch, model, cfg.registers, d, ref)
    handle.install()
    return handle


def add_register_parameter(patch: _compat.ModelPatch, base: nn.Module, n: int, d: int, ref: Tensor,
                           generator: torch.Generator) -> None:
    """The registers' one parameter, ``base.sinklab_registers`` ``[n, d]`` (N(0, 0.02²), ``ref``'s device and dtype),
    for the causal-LM and the ViT side alike; where they enter the sequence is each side's own hook."""
    init = torch.randn(n, d, generator=generator) * 0.02
    patch.add(base, "sinklab_registers", nn.Parameter(init.to(ref.device, ref.dtype)))


def _add_registers(patch: _compat.ModelPatch, model: nn.Module, n: int, d: int, ref: Tensor) -> None:
    """Prepend ``n`` learned vectors to every sample's embeddings; drop them from the base model's output.

    The registers are positions ``0 … n−1`` of every sequence and the tokens follow at ``n, n+1, …``. With a
    KV cache they are fed once, with the first forward into an empty cache (prefill), and stay in the cache
    like tokens (in a :class:`sinklab.SinkCache` they are its first ``n`` kept tokens, so ``num_sinks ≥ n``
    keeps them); later forwards feed tokens only, with the 2-D attention mask, ``position_ids`` and
    ``cache_position`` shifted by ``n``. Outputs lose the ``n`` register positions only when they were fed.
    """
    base = _compat.base_model(model)
    add_register_parameter(patch, base, n, d, ref, torch.Generator().manual_seed(0))
    fed: list[bool] = []  # per forward in flight: were the registers prepended (so the output must drop them)?

    def before(module, args, kwargs):
        _, cache = _compat.cache_argument(kwargs)
        first = cache is None or int(cache.get_seq_length()) == 0
        ids = kwargs.pop("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds")
        if embeds is None:
            embeds = module.get_input_embeddings()(ids)
        b = embeds.shape[0]
        if first:
            kwargs["inputs_embeds"] = torch.cat([module.sinklab_registers.expand(b, n, -1).to(embeds.dtype), embeds], 1)
        else:
            kwargs["inputs_embeds"] = embeds
        mask = kwargs.get("attention_mask")
        if isinstance(mask, Tensor) and mask.dim() == 2:  # the cache (or this forward) holds the registers too
            kwargs["attention_mask"] = torch.cat([mask.new_ones(b, n), mask], dim=1)
        # A sinklab stream sets the positions itself (registers count as its first tokens), and a decode step it
        # planned before the call (SinkCache.planned_forward) arrives with them already: left as they are.
        stream = getattr(cache, "is_sinklab_stream", False)
        for name in ("position_ids", "cache_position"):
            pos = kwargs.get(name)
            if isinstance(pos, Tensor) and not stream:
                pos = pos + n
                if first:
                    lead = torch.arange(n, device=pos.device, dtype=pos.dtype)
                    pos = torch.cat([lead.expand(*pos.shape[:-1], n), pos], dim=-1)
                kwargs[name] = pos
        fed.append(first)
        return (), kwargs

    def after(module, args, kwargs, output):
        if not (fed.pop() if fed else False) or output is None:
            return output
        output.last_hidden_state = output.last_hidden_state[:, n:]
        if getattr(output, "hidden_states", None) is not None:
            output.hidden_states = tuple(hs[:, n:] for hs in output.hidden_states)
        return output

    # prepend: the registers are in place before any other pre-hook (a SinkCache's plans the stream positions)
    patch.hook(base, before, pre=True, with_kwargs=True, prepend=True)
    patch.hook(base, after, with_kwargs=True, always_call=True)


def register_count(model: nn.Module) -> int:
    """Register tokens a variant puts in front of every sequence of ``model`` (0 without registers).

    Scans and diagnoses label them ``reg0 … reg{n−1}`` (role ``register``) ahead of the tokens."""
    handle = getattr(model, "sinklab_variant_handle", None)
    return 0 if handle is None else int(handle.config.registers)


def register_labels(n: int) -> list[str]:
    """``["reg0", …]``: the position labels of ``n`` register tokens."""
    return [f"reg{i}" for i in range(n)]
