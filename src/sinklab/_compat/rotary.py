"""How each layer of a model encodes positions in its keys and queries — measured on the model, not assumed.

Streaming keeps a key rotated at one position and scores it at another (positions by cache slot), so it must
rotate exactly as the model does: the same frequencies, the same pairing of dimensions (Llama's ``rotate_half``,
or interleaved pairs as in GPT-J, Cohere, GLM, ERNIE 4.5, Helium), the same direction (nanochat turns the other
way), the same rotated dimensions (partial rotary; latent attention's decoupled rotary key at the end of the
head), on the same tensor (latent attention caches the compressed latent as "keys" and the rotary key as
"values"), and no rotation at all on layers without positions (NoPE layers of SmolLM3, EXAONE 4 …). A table
of these per architecture would be wrong for the next model, so :func:`layer_rotations` measures them.

The probe: one forward of a single token at several positions (one batch row each), through a
``DynamicCache`` and a recording attention backend. With one token a query sees only itself, its attention
output is its value whatever the position, so every layer's input is the same in every row and a layer's
keys differ between rows by the position alone. Each layer's cached tensors and the query/key its attention
receives are then matched against every rotation the model's frequency tables allow
(:data:`PROBE_TOLERANCE`); a layer whose keys or queries move in a way no rotation reproduces is refused with
the measured error — never streamed silently wrong. What a single token cannot show (ALiBi biases, relative
position buckets, masks) is refused by type before the probe.

Hybrid models (Qwen3-Next, Qwen3.5, Jamba, Bamba, LFM2 …) interleave softmax attention with linear-attention,
state-space or short-convolution layers. A layer that never calls the attention interface is described as
:data:`RECURRENT` — nothing to re-rotate, nothing to evict — only when the model's own cache
(``DynamicCache(config=model.config)``) holds it as a linear-attention layer (transformers'
``LinearAttentionCacheLayerMixin``, which carries its convolution and recurrent states), and as :data:`STATELESS`
only when that cache holds nothing for it (transformers' ``DummyLayer``: Nemotron-H's MLP/MoE blocks); the stream
then keeps that layer in the same cache-layer class. Such a layer's state does not depend on positions (the probe's
rows differ by position alone, so a layer that did would move the next attention layer's keys in a way no rotation
reproduces, and be refused there).
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import UnsupportedModelError
from ..rope import RopeSpec, rotate
from .backend import ModelPatch
from .layout import (block_hidden_states, block_input, cache_kwarg_name, cache_layer_kind, config_get, embedding_rows,
                     find_layers, input_device, num_layers, residual_stream)

__all__ = ["LayerRotation", "RECURRENT", "STATELESS", "layer_rotations", "PROBE_POSITIONS", "PROBE_TOLERANCE",
           "ALIBI_TYPES"]

#: Positions the probe puts its token at (capped below the model's position table).
PROBE_POSITIONS = (0, 1, 2, 7, 64, 509, 1000)
#: Largest relative error ``‖k_model − rotate(k_0, Δ)‖ / ‖k_model‖`` accepted as the same rotation: float32 and
#: wider (angles in float32 at position 1000 are good to ~1e-4), half precision (keys rounded to 8 bits).
PROBE_TOLERANCE = {"float": 1e-3, "half": 4e-2}
#: Model types that add ALiBi distance biases to the scores (invisible to the probe: refused by type).
ALIBI_TYPES = {"bloom", "mpt", "falcon"}
_PROBE_BACKEND = "sinklab_probe"


@dataclass(frozen=True)
class LayerRotation:
    """How one layer encodes positions.

    ``kind`` ``"attention"``: a softmax-attention layer. ``cache_rope`` rotates the tensor the layer hands its cache
    (``rotated``: ``"keys"``, or ``"values"`` where latent attention caches the compressed latent as keys and the
    decoupled rotary key as values); ``attn_rope`` rotates the key and query the attention function receives (the
    rotary part's ``offset`` can differ). Both ``None``: the layer carries no position (NoPE) and its keys need no
    re-rotation.

    ``kind`` ``"recurrent"`` (:data:`RECURRENT`): not attention — a linear-attention, state-space or convolution
    layer whose state the model's own cache holds in a linear-attention cache layer; it has no keys, nothing is
    re-rotated or evicted, and the stream keeps its state exactly as the model's own cache would. ``"stateless"``
    (:data:`STATELESS`): not attention and nothing cached (an MLP/MoE block).
    """

    cache_rope: RopeSpec | None
    attn_rope: RopeSpec | None
    rotated: str = "keys"
    kind: str = "attention"

    @property
    def is_attention(self) -> bool:
        return self.kind == "attention"

    @property
    def caches_attended_keys(self) -> bool:
        """The cached tensor is the key the attention reads, turned by the same rotation: a kept key can be re-rotated
        where it is stored (not so for latent attention, or a rotary part stored apart)."""
        return self.rotated == "keys" and _spec_key(self.cache_rope) == _spec_key(self.attn_rope)


#: A layer that is not attention: its recurrent/convolution state is kept whole, nothing to re-rotate.
RECURRENT = LayerRotation(None, None, kind="recurrent")
#: A layer that is not attention and keeps nothing in the cache (an MLP/MoE block of a hybrid).
STATELESS = LayerRotation(None, None, kind="stateless")


_MEMO: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def layer_rotations(model: nn.Module) -> list[LayerRotation]:
    """One :class:`LayerRotation` per attention layer index (the index each attention module hands the cache; one per
    decoder block in most models), measured once per model; or :class:`UnsupportedModelError` saying what the model
    does with positions that streaming cannot reproduce."""
    cached = _MEMO.get(model)
    if cached is None:
        try:
            cached = _probe(model)
        except UnsupportedModelError as exc:
            cached = exc
        _MEMO[model] = cached
    if isinstance(cached, UnsupportedModelError):
        raise UnsupportedModelError(str(cached))
    return cached


# ----------------------------------------------------------------------------- the probe
def _refuse_by_type(model: nn.Module) -> None:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", "")
    name = type(model).__name__
    if model_type in ALIBI_TYPES and getattr(config, "alibi", model_type != "falcon"):
        raise UnsupportedModelError(
            f"{name} uses ALiBi position biases. Streaming them by cache slot (StreamingLLM's rule for MPT) needs "
            "the bias applied where sinklab's stream attends, by the slot distance of each kept key; this model "
            + ("computes its attention in its own module, not through transformers' attention interface, so the "
               "stream never sees its scores (Bloom and MPT in transformers 5; lifted when transformers routes "
               "them through the interface with the bias as an argument)" if model_type != "falcon" else
               "adds the bias inside its attention mask, which the stream rebuilds per slot without it")
            + ". Use a RoPE model (Llama, Qwen, Mistral, Phi-3, Gemma, GPT-NeoX, GPT-J).")
    if config_get(config, "use_bidirectional_attention"):
        raise UnsupportedModelError(f"{name} uses bidirectional attention; streaming needs a causal LM.")
    for module in model.modules():
        kind = getattr(module, "rope_type", None)
        kinds = kind.values() if isinstance(kind, dict) else [kind]
        if any(isinstance(k, str) and "dynamic" in k for k in kinds):
            raise UnsupportedModelError(f"{name} uses dynamic NTK RoPE, whose frequencies change with sequence "
                                        "length; streaming needs fixed frequencies.")


def _frequency_tables(model: nn.Module) -> list[Tensor]:
    """Candidate ``inv_freq`` tables: every 1-D ``*inv_freq`` tensor of the model (deduplicated),
    and GPT-J/CodeGen's interleaved sinusoid table rebuilt from ``rotary_dim``."""
    found: dict[tuple, Tensor] = {}
    for module in model.modules():
        tensors = dict(module.named_buffers(recurse=False))
        tensors.update({k: v for k, v in vars(module).items() if isinstance(v, Tensor)})
        for name, value in tensors.items():
            if name.endswith("inv_freq") and value.dim() == 1 and value.is_floating_point() and value.numel():
                if value.device.type == "meta":
                    continue
                inv = value.detach().double().cpu()
                found.setdefault(tuple(inv.tolist()), inv)
    config: Any = getattr(model, "config", None)
    if getattr(config, "model_type", "") in ("gptj", "codegen"):
        dim = int(config.rotary_dim or config.n_embd // config.n_head)
        inv = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        found.setdefault(tuple(inv.tolist()), inv)
    return list(found.values())


def _positions(model: nn.Module) -> list[int]:
    limit = config_get(getattr(model, "config", None), "max_position_embeddings", "n_positions", "n_ctx",
                       "max_target_positions", "max_sequence_length")
    top = int(limit) - 1 if isinstance(limit, int) and limit > 8 else max(PROBE_POSITIONS)
    return sorted({min(p, top) for p in PROBE_POSITIONS})


def _record(model: nn.Module, positions: list[int] | None, length: int = 1, taps: dict | None = None
            ) -> tuple[dict, dict, torch.dtype, dict[int, str]]:
    """Run the probe forward — one token per row at ``positions``, or (``positions=None``) one row of ``length``
    copies of the token at the model's default positions: ``({layer: (cached keys, cached values)},
    {layer: (query, key)}, dtype, kinds)``, each tensor ``[rows, heads, dim]`` (``[length, heads, dim]`` for a
    row of copies) in float64; ``kinds``: what the model's own cache holds for each layer that holds no keys,
    ``{index: "recurrent" | "stateless"}`` (:func:`~sinklab._compat.layout.cache_layer_kind`). ``taps``: a dict
    that receives the hidden states ``[B, T, d]`` entering the first block (``"input"``) and leaving the last one
    (``"output"``)."""
    from transformers import DynamicCache

    blocks = None
    if taps is not None:
        try:
            blocks = find_layers(model)
        except UnsupportedModelError:
            blocks = None

    def tap_input(module, args, kwargs):
        try:
            taps.setdefault("input", residual_stream(model, block_input(args, kwargs)).detach())
        except UnsupportedModelError:  # a block layout the taps cannot read: the checks that need them are skipped
            pass

    def tap_output(module, args, kwargs, output):
        try:
            taps["output"] = residual_stream(model, block_hidden_states(output)).detach()
        except UnsupportedModelError:
            pass

    seen: dict[int, tuple[Tensor, Tensor]] = {}

    def attention(module, query, key, value, attention_mask, **kwargs):
        idx = getattr(module, "layer_idx", None)
        if idx is not None and idx not in seen:  # the probe's own tokens are the last (registers come first)
            seen[int(idx)] = (_rows(query[:, :, -shape[1]:]), _rows(key[:, :, -shape[1]:]))
        # What attention gives a query that sees only its own token (or its own row of equal tokens): that
        # token's value, the same at every position — so the next layer's input never depends on the position.
        # Softcaps, learned sinks and masks change how much of it, not whether it depends on the position.
        out = value[:, :, -query.shape[2]:].repeat_interleave(query.shape[1] // value.shape[1], dim=1)
        return out.transpose(1, 2).contiguous(), None  # (B, T, H, dv)

    device = input_device(model)
    rows = embedding_rows(model) or 8
    shape = (len(positions), 1) if positions is not None else (1, length)
    ids = torch.full(shape, min(5, rows - 1), dtype=torch.long, device=device)
    where = {} if positions is None else {"position_ids": torch.tensor(positions, device=device)[:, None]}
    cache = DynamicCache(config=model.config)  # type: ignore[arg-type]  # a PreTrainedConfig
    training = model.training
    model.eval()
    try:
        with ModelPatch(model) as patch, torch.no_grad():
            patch.use_attention(_PROBE_BACKEND, attention)
            if blocks is not None:
                patch.hook(blocks[0], tap_input, pre=True, with_kwargs=True)
                patch.hook(blocks[-1], tap_output, with_kwargs=True)
            model(input_ids=ids, use_cache=True, **where, **{cache_kwarg_name(model): cache})
    except UnsupportedModelError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure of the model's own forward is reported, not raised raw
        raise UnsupportedModelError(
            f"{type(model).__name__}: sinklab could not measure how it encodes positions (a one-token forward at "
            f"positions {positions} failed: {type(exc).__name__}: {exc}); streaming needs that measurement") from exc
    finally:
        model.train(training)
    cached: dict[int, tuple] = {}
    for idx, layer in enumerate(getattr(cache, "layers", [])):
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        # The probe's tokens are the last ones cached (a register variant puts its registers before them).
        if isinstance(keys, Tensor) and isinstance(values, Tensor) and keys.dim() == 4 and keys.shape[2] >= shape[1]:
            cached[idx] = (_rows(keys[:, :, -shape[1]:]), _rows(values[:, :, -shape[1]:]))
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    kinds = {i: cache_layer_kind(layer) for i, layer in enumerate(getattr(cache, "layers", []))}
    return cached, seen, dtype, {i: k for i, k in kinds.items() if k != "keys"}


def _rows(x: Tensor) -> Tensor:
    """``[B, h, T, d]`` → float64 CPU ``[B, h, d]`` (one token per row) or ``[T, h, d]`` (one row of tokens)."""
    x = x.detach().double().cpu()
    return x[:, :, 0] if x.shape[2] == 1 else x[0].transpose(0, 1)


def _moved(x: Tensor) -> float:
    """Largest relative change of ``x`` ``[P, h, d]`` from its first row (position 0)."""
    return float(((x - x[:1]).norm(dim=-1) / x.norm(dim=-1).clamp_min(1e-30)).max())


def _fit(x: Tensor, delta: Tensor, tables: list[Tensor], tol: float, *, like: RopeSpec | None = None
         ) -> tuple[RopeSpec | None, float]:
    """The rotation that takes row 0 of ``x`` ``[P, h, d]`` to every other row (``delta`` ``[P]`` positions later):
    ``(spec, error)``, spec ``None`` when no candidate is within ``tol`` (error: the best candidate's).
    ``like``: only rotations with its frequencies and pairing (a query must turn as its keys)."""
    d = x.shape[-1]
    best: tuple[float, RopeSpec | None] = (float("inf"), None)
    base = x[:1].expand_as(x)
    shift = delta[:, None].double()  # (P, 1): broadcast over heads
    candidates = ([(like.inv_freq, like.interleaved)] if like is not None
                  else [(s * inv, inter) for inv, inter, s in itertools.product(tables, (False, True), (1.0, -1.0))])
    for inv, interleaved in candidates:
        r = 2 * inv.shape[0]
        if r > d:
            continue
        for offset in sorted({0, d - r}):
            spec = RopeSpec(inv_freq=inv, interleaved=interleaved, offset=offset)
            err = float(((rotate(base, spec, shift) - x).norm(dim=-1) / x.norm(dim=-1).clamp_min(1e-30)).max())
            if err < best[0]:
                best = (err, spec)
    return (best[1] if best[0] <= tol else None), best[0]


def _probe(model: nn.Module) -> list[LayerRotation]:
    _refuse_by_type(model)
    name = type(model).__name__
    config = getattr(model, "config", None)
    n = num_layers(config) or 0
    positions = _positions(model)
    taps: dict = {}
    cached, seen, dtype, kinds = _record(model, positions, taps=taps)
    tol = PROBE_TOLERANCE["half" if torch.finfo(dtype).bits <= 16 else "float"]
    tables = _frequency_tables(model)
    delta = torch.tensor(positions, dtype=torch.float64) - positions[0]
    scaling = _attention_scaling(model)
    # Attention modules, by the layer index they hand the cache: usually one per block; some blocks hold two
    # (LongCat-Flash: indices 2i and 2i + 1), so the stream needs one cache layer per index seen.
    n = max(n, max(seen, default=-1) + 1)
    out: list[LayerRotation] = []
    for idx in range(n):
        if idx not in seen:
            if idx in kinds:  # the model's own cache holds it as a linear-attention layer (kept whole), or nothing
                out.append(RECURRENT if kinds[idx] == "recurrent" else STATELESS)
                continue
            raise UnsupportedModelError(
                f"{name}: layer {idx} does not call transformers' attention interface (a linear-attention, recurrent "
                "or state-space layer, or attention the model computes itself), and the model's own cache does not "
                "hold it as a linear-attention layer (transformers' LinearAttentionLayer: conv and recurrent states) "
                "nor as a layer without state; sinklab streams softmax attention over a KV cache beside such layers "
                "only. Lifting it needs this layer's state carried by a cache layer the stream knows")
        if idx not in cached:
            raise UnsupportedModelError(
                f"{name}: layer {idx} attends without writing its own keys to the cache (keys shared across layers, "
                "or a cache sinklab cannot read); sinklab's stream keeps one KV buffer per layer")
        keys, values = cached[idx]
        query, key = seen[idx]
        moved = {"keys": _moved(keys) > tol, "values": _moved(values) > tol}
        attn_moved = _moved(key) > tol or _moved(query) > tol
        if not any(moved.values()) and not attn_moved:
            out.append(LayerRotation(None, None))  # no position in this layer (NoPE)
            continue
        where = f"{name} layer {idx}"
        # A hybrid: a recurrent layer before this one that reads the position (RecurrentGemma's resets) moves its input.
        behind = [i for i, k in kinds.items() if k == "recurrent" and i < idx]
        also = (f", or a recurrent layer before it ({', '.join(map(str, behind))}) uses the position — a state a "
                "stream by cache slot cannot give it") if behind else ""
        if all(moved.values()):
            raise UnsupportedModelError(
                f"{where}: the keys and the values it caches both change with position, so its input carries the "
                f"position (learned or absolute position embeddings added to the tokens, as in GPT-2 and OPT{also}). "
                "A kept token cannot be moved to its cache slot that way: positions by cache slot need rotary "
                "embeddings, whose scores depend only on distances")
        if not any(moved.values()):
            raise UnsupportedModelError(
                f"{where}: its keys or queries change with position after the cache (positions applied when the "
                "cache is read, or a position-dependent query scale); streaming by cache slot would give them the "
                "wrong positions")
        rotated = "keys" if moved["keys"] else "values"
        cache_spec, err = _fit(keys if rotated == "keys" else values, delta, tables, tol)
        if cache_spec is None:
            raise UnsupportedModelError(
                f"{where}: the {rotated} it caches change with position in a way no rotary layout reproduces (best "
                f"relative error {err:.2g} > {tol:g}): learned or absolute position embeddings, or a rotary "
                "convention sinklab does not know. Streaming needs keys whose scores depend only on distances")
        attn_spec, err = _fit(key, delta, tables, tol, like=cache_spec)
        q_spec, q_err = _fit(query, delta, tables, tol, like=cache_spec) if attn_spec is not None else (None, err)
        if attn_spec is None or q_spec is None:
            raise UnsupportedModelError(
                f"{where}: the {'key' if attn_spec is None else 'query'} its attention receives does not turn with "
                f"position as its cached {rotated} do (relative error {max(err, q_err):.2g} > {tol:g}); streaming "
                "by cache slot would score it at the wrong distance")
        out.append(LayerRotation(_scaled(cache_spec, scaling), _scaled(attn_spec, scaling), rotated))
    _check_recurrent_output(name, kinds, taps, tol)
    attention = [r for r in out if r.is_attention]
    if attention and all(r.cache_rope is None for r in attention):
        _check_positions_reach_the_model(model, tol, {i for i, k in kinds.items() if k == "recurrent"})
    return _shared(out)


def _check_recurrent_output(name: str, kinds: dict, taps: dict, tol: float) -> None:
    """In a hybrid with recurrent layers: the probe's final hidden state must not move with position. One token
    per row and an attention that returns that token's value: only a layer that is not attention could still make
    it depend on the position (a recurrent layer reading it)."""
    if "recurrent" in kinds.values() and isinstance(taps.get("output"), Tensor) and taps["output"].dim() == 3:
        final = taps["output"][:, -1].double().cpu()[:, None, :]  # (P, 1, d)
        err = _moved(final)
        if err > tol:
            raise UnsupportedModelError(
                f"{name}: its output changes with position where its attention layers see none (relative change "
                f"{err:.2g} > {tol:g}), so a recurrent or state-space layer reads the position; a stream by cache "
                "slot cannot give that layer its position")


def _check_positions_reach_the_model(model: nn.Module, tol: float, recurrent: AbstractSet[int] = frozenset()) -> None:
    """No layer moved with ``position_ids``: either the model has no positions at all, or it takes them from
    somewhere else (a cache length, learned tables indexed by its own counter). A row of two copies of the token at
    the model's own positions tells them apart: without positions their first layer's keys are equal.

    In a hybrid whose first attention layer comes after a recurrent layer (Jamba, Kimi Linear: attention without
    positions), that layer's two keys differ anyway — the recurrent layer mixes the copies — so the hidden states
    entering the first block are compared instead: learned absolute positions added to the embeddings move them.
    (Positions an attention layer behind a recurrent layer counted itself from the cache length would not show
    there; no transformers hybrid does that.)"""
    taps: dict = {}
    cached, _, _, _ = _record(model, None, length=2, taps=taps)
    first = min(cached) if cached else None  # the first layer that caches keys
    if first is not None and all(first < i for i in recurrent):
        keys = cached[first][0]
    elif isinstance(taps.get("input"), Tensor) and taps["input"].dim() == 3:
        keys = taps["input"][0].double().cpu()[:, None, :]  # (T, 1, d): the two copies' embeddings
    else:
        keys = None
    if keys is not None and _moved(keys) > tol:
        raise UnsupportedModelError(
            f"{type(model).__name__}: its keys depend on position, but not on the position_ids it is given (it counts "
            "positions itself, e.g. learned absolute positions from the cache length); positions by cache slot "
            "need a model that takes position_ids, with rotary embeddings")


def _attention_scaling(model: nn.Module) -> float:
    """YaRN/longrope's ``attention_scaling`` of the rotary module (recorded for information; the model applies it
    when a key is first rotated and a re-rotation never re-applies it)."""
    for module in model.modules():
        value = getattr(module, "attention_scaling", None)
        if isinstance(value, (int, float)) and hasattr(module, "inv_freq"):
            return float(value)
    return 1.0


def _scaled(spec: RopeSpec, scaling: float) -> RopeSpec:
    return RopeSpec(inv_freq=spec.inv_freq, interleaved=spec.interleaved, attention_scaling=scaling,
                    offset=spec.offset)


def _shared(rotations: list[LayerRotation]) -> list[LayerRotation]:
    """Identical layers share one object (the stream groups layers by their rotation)."""
    unique: dict[tuple, LayerRotation] = {}
    return [unique.setdefault((_spec_key(r.cache_rope), _spec_key(r.attn_rope), r.rotated, r.kind), r)
            for r in rotations]


def _spec_key(spec: RopeSpec | None) -> tuple:
    """What identifies a rotation (frequencies, pairing, first rotated dimension); () for none."""
    return () if spec is None else (tuple(spec.inv_freq.tolist()), spec.interleaved, spec.offset)
