"""diagnose and the scan registry against naive float64 references built from eager attentions.

One tiny Llama (GQA, 2 layers, 4 heads) with three samples of 12 tokens (one right-padded) is run once
with ``output_attentions=True``; every reference below loops over samples/heads in float64 from those
attentions, the hidden states and the projection weights, independently of sinklab's capture.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable

import pytest
import torch
from tiny_models import build, inputs_for
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

import sinklab
from sinklab import metrics
from sinklab.capture import AttentionCapture, ValueEdit
from sinklab.diagnose import diagnose_inputs
from sinklab.edits import EDITS

LAYER, HEAD = 1, 2  # the edited head


def _model(inputs, attn="sdpa"):
    """The tiny Llama with a massive activation: one embedding dimension of sample 0's first token."""
    model = build("llama-gqa", attn=attn)
    with torch.no_grad():
        model.model.embed_tokens.weight[inputs["input_ids"][0, 0], 3] = 3000.0
    return model


def _inputs():
    inputs = inputs_for("llama-gqa", batch=3)
    inputs["attention_mask"][2, 9:] = 0
    return inputs


@pytest.fixture(scope="module")
def ref():
    inputs = _inputs()
    model = _model(inputs, attn="eager")
    blocks = []  # every block's output, by a plain forward hook (output_hidden_states' last entry is post-norm)
    handles = [layer.register_forward_hook(lambda m, a, o: blocks.append(o[0] if isinstance(o, tuple) else o))
               for layer in model.model.layers]
    with torch.no_grad():
        out = model(**inputs, output_attentions=True, output_hidden_states=True)
    for handle in handles:
        handle.remove()
    attn = torch.stack(out.attentions, dim=1).double()  # (S, L, H, T, T)
    mask = inputs["attention_mask"].bool()
    s, n_layers, h, t, _ = attn.shape
    vis = metrics.visibility(t, t, causal=True, query_mask=mask, key_mask=mask)[:, None, None]  # (S, 1, 1, T, T)
    return {"model": model, "inputs": inputs, "out": out, "attn": attn, "mask": mask, "vis": vis.expand_as(attn),
            "blocks": [b.double() for b in blocks]}


# ----------------------------------------------------------------------------- naive pieces
def _column_stats(r):
    """Naive per-column mass / min / routed share and visibility counts: (S, L, H, T) loops (cached)."""
    if "columns" in r:
        return r["columns"]
    attn, vis = r["attn"], r["vis"]
    s, n_layers, h, t, _ = attn.shape
    mass = torch.full((s, n_layers, h, t), math.nan, dtype=torch.float64)
    low, routed = mass.clone(), mass.clone()
    count = torch.zeros(s, n_layers, t)
    for b in range(s):
        for layer in range(n_layers):
            for head in range(h):
                for j in range(t):
                    col = [float(attn[b, layer, head, i, j]) for i in range(t) if vis[b, layer, head, i, j]]
                    count[b, layer, j] = len(col)
                    if col:
                        mass[b, layer, head, j] = sum(col) / len(col)
                        low[b, layer, head, j] = min(col)
                        routed[b, layer, head, j] = sum(c >= 0.5 for c in col) / len(col)
    r["columns"] = (mass, low, routed, count)
    return r["columns"]


def _dominant(r):
    """Dominant column per (sample, layer, head): keys seen by ≥ max(8, ⌈N/8⌉) queries (capped)."""
    mass, _, _, count = _column_stats(r)
    s, n_layers, h, t = mass.shape
    dom = torch.zeros(s, n_layers, h, dtype=torch.long)
    for b in range(s):
        n = int(r["mask"][b].sum())
        for layer in range(n_layers):
            need = min(max(8, math.ceil(n / 8)), int(count[b, layer].max()))
            ok = [j for j in range(t) if count[b, layer, j] >= need and count[b, layer, j] > 0]
            for head in range(h):
                dom[b, layer, head] = max(ok, key=lambda j: (float(mass[b, layer, head, j]), -j))
    return dom


def _values(r, layer):
    """Value vectors (S, H, T, dh) and per-head output maps (H, d, dh) of one layer, from the weights."""
    model = r["model"]
    block = model.model.layers[layer]
    with torch.no_grad():
        x = block.input_layernorm(r["out"].hidden_states[layer])
        v = block.self_attn.v_proj(x)
    s, t, _ = v.shape
    v = v.detach().view(s, t, 2, 8).transpose(1, 2).double().repeat_interleave(2, dim=1)  # (S, H, T, dh): GQA 4 / 2
    wo = block.self_attn.o_proj.weight.detach().double().view(-1, 4, 8).permute(1, 0, 2)  # (H, d, dh)
    return v, wo


def _lower_median(values):
    vals = sorted(values)
    return vals[(len(vals) - 1) // 2]


# ----------------------------------------------------------------------------- the registry
#: Registry row name → its naive float64 reference ``(ref, layer) -> float``, written from the row's definition
#: (docs/metrics.md). A new ``MetricRow`` needs one function here, decorated with ``@reference(name)``;
#: ``test_registry_row_equals_a_naive_float64_computation`` runs on every row and names a row that has none.
REFERENCES: dict[str, Callable[[dict, int], float]] = {}


def reference(name: str):
    """Register the naive reference of registry row ``name``."""

    def register(fn):
        assert name not in REFERENCES, f"two references for {name!r}"
        REFERENCES[name] = fn
        return fn

    return register


def _heads(r, layer):
    """Per (sample, head) of one layer, in loops (cached): the dominant column, its mass, the value-norm ratios
    (head and output space), the update's spectrum statistics and the strict / relaxed sink events."""
    cache = r.setdefault("heads", {})
    if layer in cache:
        return cache[layer]
    mass, low, routed, _ = _column_stats(r)
    dom = _dominant(r)
    th, attn, mask = r["th"], r["attn"], r["mask"]
    s, _, h, t, _ = attn.shape
    v, wo = _values(r, layer)
    u = torch.einsum("hed,bhtd->bhte", wo, v)  # (S, H, T, d) output-space values
    per: dict[str, list] = {k: [] for k in ("strength", "ratio", "ratio_out", "srank", "rank1", "common", "eps",
                                             "relaxed", "dom")}
    for b in range(s):
        real = [j for j in range(t) if mask[b, j]]
        for head in range(h):
            p = int(dom[b, layer, head])
            per["dom"].append(p)
            per["strength"].append(float(mass[b, layer, head, p]))
            others = [j for j in real if j != p]
            for key, vec in (("ratio", v), ("ratio_out", u)):
                norms = vec[b, head].norm(dim=-1)
                per[key].append(float(norms[p]) / (sum(float(norms[j]) for j in others) / len(others)))
            update = attn[b, layer, head][real] @ u[b, head]  # (N, d) U = A·u over real queries
            sv = torch.linalg.svdvals(update)
            per["srank"].append(float((sv**2).sum() / sv[0] ** 2))
            per["rank1"].append(float(sv[0] ** 2 / (sv**2).sum()))
            per["common"].append(float(update.mean(0).pow(2).sum() / update.pow(2).sum(-1).mean()))
            cols = [j for j in range(t) if not math.isnan(low[b, layer, head, j])]
            per["eps"].append(any(low[b, layer, head, j] >= 1 - th["eps_event"] for j in cols))
            per["relaxed"].append(any(routed[b, layer, head, j] >= th["relaxed_share"] for j in cols))
    cache[layer] = per
    return per


def _mean(values) -> float:
    return sum(values) / len(values)


def _top(r, layer) -> int:
    """The most common dominant position (the smallest on a tie)."""
    return sorted(Counter(_heads(r, layer)["dom"]).items(), key=lambda kv: (-kv[1], kv[0]))[0][0]


@reference("sink_rate_0")
def _sink_rate_0(r, layer):
    mass, _, _, _ = _column_stats(r)
    s, _, h, _ = mass.shape
    return 100 * _mean([sum(float(mass[b, layer, head, 0]) > r["th"]["eps"] for head in range(h)) / h
                        for b in range(s)])


@reference("sink_strength")
def _sink_strength(r, layer):
    return _mean(_heads(r, layer)["strength"])


@reference("top_position")
def _top_position(r, layer):
    return _top(r, layer)


@reference("top_position_pct")
def _top_position_pct(r, layer):
    dom = _heads(r, layer)["dom"]
    return 100 * dom.count(_top(r, layer)) / len(dom)


@reference("eps_sink_pct")
def _eps_sink_pct(r, layer):
    return 100 * _mean(_heads(r, layer)["eps"])


@reference("relaxed_sink_pct")
def _relaxed_sink_pct(r, layer):
    return 100 * _mean(_heads(r, layer)["relaxed"])


@reference("value_norm_ratio")
def _value_norm_ratio(r, layer):
    return _mean(_heads(r, layer)["ratio"])


@reference("value_norm_ratio_out")
def _value_norm_ratio_out(r, layer):
    return _mean(_heads(r, layer)["ratio_out"])


@reference("update_stable_rank")
def _update_stable_rank(r, layer):
    return _mean(_heads(r, layer)["srank"])


@reference("update_rank1_energy")
def _update_rank1_energy(r, layer):
    return _mean(_heads(r, layer)["rank1"])


@reference("common_mode")
def _common_mode(r, layer):
    return _mean(_heads(r, layer)["common"])


@reference("qk_sigma_ratio")
def _qk_sigma_ratio(r, layer):
    block = r["model"].model.layers[layer].self_attn
    wq = block.q_proj.weight.detach().double().view(4, 8, -1)
    wk = block.k_proj.weight.detach().double().view(2, 8, -1)
    ratios = []
    for head in range(4):
        sv = torch.linalg.svdvals(wq[head].T @ wk[head // 2])
        ratios.append(float(sv[0] / sv[1]))
    return _mean(ratios)


def _block_rows(r, layer):
    """Per sample: the real tokens' rows of the block's output (T_real, d), float64."""
    x = r["blocks"][layer]  # (S, T, d)
    return [x[b, [j for j in range(x.shape[1]) if r["mask"][b, j]]] for b in range(x.shape[0])]


@reference("hidden_norm_ratio_0")
def _hidden_norm_ratio_0(r, layer):
    ratios = []
    for rows in _block_rows(r, layer):
        norms = [float(row.norm()) for row in rows]
        ratios.append(norms[0] / _lower_median(norms[1:]))
    return _mean(ratios)


@reference("high_norm_tokens")
def _high_norm_tokens(r, layer):
    high = []
    for rows in _block_rows(r, layer):
        norms = [float(row.norm()) for row in rows]
        med = _lower_median(norms)
        mad = _lower_median([abs(z - med) for z in norms])
        high.append(sum(z > med + r["th"]["high_norm_k"] * 1.4826 * mad for z in norms))
    return _mean(high)


@reference("massive_tokens")
def _massive_tokens(r, layer):
    th, massive = r["th"], []
    for rows in _block_rows(r, layer):
        absval = rows.abs()
        a_med = _lower_median(absval.flatten().tolist())
        massive.append(sum(float(m) > th["massive_abs"] and float(m) >= th["massive_ratio"] * a_med
                           for m in absval.amax(-1)))
    return _mean(massive)


@reference("max_activation")
def _max_activation(r, layer):
    return max(float(rows.abs().max()) for rows in _block_rows(r, layer))


@reference("learned_sink_mass")
def _learned_sink_mass(r, layer):
    return 1.0 - float(r["attn"][:, layer].sum(-1)[r["vis"][:, layer].any(-1)].mean())  # no learned slot: 0


@pytest.fixture(scope="module")
def scanned(ref):
    """The registry table of a scan of the same model (same weights, sdpa, captured); ``ref["th"]``: its thresholds."""
    scan = sinklab.scan_inputs(_model(ref["inputs"]), [ref["inputs"]], [["t"] * 12] * 3)
    ref["th"] = scan.meta["thresholds"]
    return scan.per_layer()


@pytest.mark.parametrize("row", [row.name for row in sinklab.REGISTRY])
def test_registry_row_equals_a_naive_float64_computation(ref, scanned, row):
    assert row in REFERENCES, (f"registry row {row!r} has no naive float64 reference: add one to "
                               f"tests/test_diagnose_reference.py, decorated with @reference({row!r})")
    want = [REFERENCES[row](ref, layer) for layer in range(ref["attn"].shape[1])]
    assert scanned[row] == pytest.approx(want, rel=1e-4, abs=1e-5), row


def test_every_reference_is_a_registry_row():
    assert set(REFERENCES) <= {row.name for row in sinklab.REGISTRY}, "a reference of a row that is gone"


def test_the_injected_massive_activation_is_seen(scanned):
    assert scanned["massive_tokens"][0] >= 1.0 / 3  # the injected activation (sample 0's first token id)
    assert scanned["max_activation"][0] > 2000


# ----------------------------------------------------------------------------- diagnose rules and classes
@pytest.mark.parametrize("rule", ["strict", "relaxed", "mass"])
def test_sink_rules_select_the_naive_heads(ref, rule):
    mass, low, routed, _ = _column_stats(ref)
    dom = _dominant(ref)[..., None]
    at_dom = {"strict": low, "relaxed": routed, "mass": mass}[rule].gather(-1, dom)[..., 0].flatten().sort().values
    cut = float(at_dom[len(at_dom) // 2 - 1] + at_dom[len(at_dom) // 2]) / 2  # between two values: splits the heads
    assert at_dom[0] < cut < at_dom[-1]
    rules = {"strict": {"eps_event": 1 - cut}, "relaxed": {"relaxed_share": cut}, "mass": {"sink_mass": cut}}[rule]
    d = diagnose_inputs(_model(ref["inputs"]), [ref["inputs"]], [["t"] * 12] * 3, rules={"rule": rule, **rules},
                        edits=False)
    want = set()
    for b, layer, head in torch.cartesian_prod(torch.arange(3), torch.arange(2), torch.arange(4)).tolist():
        p = int(dom[b, layer, head])
        ok = {"strict": low[b, layer, head, p] >= 1 - d.rules["eps_event"],
              "relaxed": routed[b, layer, head, p] >= d.rules["relaxed_share"],
              "mass": mass[b, layer, head, p] > d.rules["sink_mass"]}[rule]
        if ok:
            want.add((b, layer, head, p))
    got = {(r.sample, r.layer, r.head, r.token_index) for r in d.records}
    assert got == want and 0 < len(want) < 24


def test_classes_use_the_output_space_value_ratio(ref):
    """Layer 0's W_O^h annihilates position 0's value: r_out ≈ 0 (NOP) while the head-space ratio is ordinary."""
    model = build("llama-gqa")
    inputs = {k: v.clone() for k, v in ref["inputs"].items()}
    inputs["input_ids"][:, 0] = 5  # the same first token: position 0's value is the same in every sample
    block = model.model.layers[0]
    with torch.no_grad():
        x0 = block.input_layernorm(model.model.embed_tokens.weight[5][None, None])
        v0 = block.self_attn.v_proj(x0).view(2, 8).double()  # (Hkv, dh)
        wo = block.self_attn.o_proj.weight.detach().double().view(-1, 4, 8)  # (d, H, dh)
        for head in range(4):
            direction = v0[head // 2] / v0[head // 2].norm()
            wo[:, head] = wo[:, head] - (wo[:, head] @ direction)[:, None] * direction[None]
        block.self_attn.o_proj.weight.copy_(wo.view(block.self_attn.o_proj.weight.shape).float())
    d = diagnose_inputs(model, [inputs], [["t"] * 12] * 3, rules={"sink_mass": 0.0}, edits=False)
    first = [r for r in d.records if r.layer == 0 and r.token_index == 0]
    assert first, "position 0 should dominate some layer-0 heads"
    for r in first:
        assert r.value_norm_ratio_out < 1e-3 and r.value_norm_ratio > 0.3
        assert r.kind == "nop"  # classified by r_out; by the head-space ratio it would not be NOP
    kinds = metrics.classify_sink(torch.tensor([r.value_norm_ratio for r in first]),
                                  torch.tensor([r.stable_rank for r in first]))
    assert (kinds != 1).any()


# ----------------------------------------------------------------------------- causal edits
def _edited_final(model, inputs, layer, head, changes, removed=None):
    """Final hidden states with value vectors replaced by a separately written float64 attention.

    ``changes`` maps sample -> (position, new value or None for zero); ``removed`` sample -> position.
    """
    encoder = hasattr(model, "encoder")  # a BERT encoder (bidirectional) or a Llama-style decoder (causal)
    target = model.encoder.layer[layer].attention.self if encoder else model.model.layers[layer].self_attn
    before = model.config._attn_implementation

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        hq, hkv = query.shape[1], key.shape[1]
        k = key.double().repeat_interleave(hq // hkv, dim=1)
        v = value.double().repeat_interleave(hq // hkv, dim=1).clone()
        t = query.shape[2]
        scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
        allowed = torch.ones(t, t, dtype=torch.bool) if encoder else torch.tril(torch.ones(t, t, dtype=torch.bool))
        allowed = allowed.expand(query.shape[0], hq, t, t).clone()
        if attention_mask is not None:
            allowed &= attention_mask
        if module is target:
            for b, (p, new) in changes.items():
                v[b, head, p] = 0.0 if new is None else new.double()
            for b, p in (removed or {}).items():
                allowed[b, head, :, p] = False
        probs = torch.softmax((query.double() @ k.transpose(-1, -2) * scaling).masked_fill(~allowed, -math.inf), -1)
        return (probs.nan_to_num(0.0) @ v).to(query.dtype).transpose(1, 2).contiguous(), None

    AttentionInterface.register("sinklab_test_edit_ref", attention)
    AttentionMaskInterface.register("sinklab_test_edit_ref", sdpa_mask)
    model.set_attn_implementation("sinklab_test_edit_ref")
    try:
        with torch.no_grad():
            return (model if encoder else model.model)(**inputs).last_hidden_state.double()
    finally:
        model.set_attn_implementation(before)


def test_every_causal_edit_equals_an_independent_reference(ref):
    model = _model(ref["inputs"])
    inputs = ref["inputs"]
    d = diagnose_inputs(model, [inputs], [["t"] * 12] * 3, rules={"sink_mass": 0.0}, edits=[(LAYER, HEAD)], seed=3)
    edit = d.edits[0]
    mask = ref["mask"]
    dom = _dominant(ref)[:, LAYER, HEAD].tolist()
    assert edit.positions == dom
    v, _ = _values(ref, LAYER)  # (S, H, T, dh)
    gen = torch.Generator().manual_seed(3)
    ordinary, control = [], []
    for b in range(3):
        others = [j for j in range(12) if mask[b, j] and j != dom[b]]
        norms = v[b, HEAD, others].norm(dim=-1)
        ordinary.append(others[int(norms.argsort()[len(others) // 2])])
    for b in range(3):
        others = [j for j in range(12) if mask[b, j] and j != dom[b]]
        control.append(others[int(torch.randint(len(others), (1,), generator=gen))])
    sink = [v[b, HEAD, dom[b]] for b in range(3)]
    changes = {
        "zero": {b: (dom[b], None) for b in range(3)},
        "mean_sink": {b: (dom[b], sum(sink) / 3) for b in range(3)},
        "donor": {b: (dom[b], sink[(b - 1) % 3]) for b in range(3)},
        "ordinary": {b: (dom[b], v[b, HEAD, ordinary[b]]) for b in range(3)},
        "remove_column": {},
        "control": {b: (control[b], None) for b in range(3)},
    }
    base = _edited_final(model, inputs, LAYER, HEAD, {})
    keep = mask[..., None].expand(base.shape)
    for name in EDITS:
        removed = {b: dom[b] for b in range(3)} if name == "remove_column" else None
        got = _edited_final(model, inputs, LAYER, HEAD, changes[name], removed)
        want = float(((got - base)[keep] ** 2).sum().sqrt() / (base[keep] ** 2).sum().sqrt())
        assert edit.hidden[name] == pytest.approx(want, rel=2e-3, abs=2e-5), name
    assert len({round(x, 5) for x in edit.hidden.values()}) == len(EDITS)  # every edit does something different


@pytest.mark.parametrize("name", ["llama-gqa", "gpt2", "bert", "mistral-sliding", "gpt-oss-learned-sinks", "dinov2"])
def test_a_resumed_pass_equals_the_full_pass(name):
    model = build(name)
    inputs = inputs_for(name)
    with AttentionCapture(model) as cap:
        cap.run(keep_inputs=True, **inputs)
        kept = cap.last_inputs
        assert kept.resumable
        rows = kept.token_mask if kept.token_mask is not None else torch.ones(kept.final.shape[:2], dtype=torch.bool)
        for start in (0, 1):
            torch.testing.assert_close(cap.final_states(kept, start)[rows], kept.final[rows], atol=1e-6, rtol=1e-6)
        edit = ValueEdit(1, 1, torch.zeros(kept.final.shape[0], dtype=torch.long), "zero")
        cap.edit = edit
        resumed = cap.final_states(kept, 1)
        cap.edit = None
    with AttentionCapture(model, edit=edit) as cap:
        full = cap.forward(**inputs).last_hidden_state
    torch.testing.assert_close(resumed[rows], full[rows], atol=1e-6, rtol=1e-6)
    assert (full - kept.final)[rows].abs().max() > 1e-4  # the edit changed the output


@pytest.mark.parametrize("name", ["llama-gqa", "gpt2", "mistral-sliding", "gpt-oss-learned-sinks", "bert"])
def test_stacked_edits_equal_one_pass_per_edit(name, one_thread):
    """The six edits of a head run as one forward over six stacked copies == one resumed pass per edit."""
    from sinklab.edits import causal_edits
    from sinklab.scan import capture_config, check_thresholds, scan_result

    model = build(name)
    inputs = inputs_for(name, batch=3)
    thresholds = check_thresholds({})
    with AttentionCapture(model, capture_config((0, 1), 0, thresholds)) as cap:
        stats = cap.run(keep_inputs=True, **inputs)
        kept = [(slice(0, 3), cap.last_inputs)]
        scan = scan_result([stats], [["t"] * 12] * 3, candidates=(0, 1), thresholds=thresholds)
        for layer, head in ((0, 1), (1, 3)):
            stacked = causal_edits(cap, kept, scan, layer, head, seed=5)
            alone = causal_edits(cap, kept, scan, layer, head, seed=5, stack=False)
            assert stacked.positions == alone.positions
            for edit in EDITS:
                assert stacked.hidden[edit] == pytest.approx(alone.hidden[edit], rel=1e-4, abs=1e-7), (layer, edit)
            assert len({round(x, 6) for x in alone.hidden.values()}) > 1  # the edits did something different


def test_edit_layers_spread_from_the_first_to_the_last_sinking_layer(ref):
    from sinklab.diagnose import spread_layers

    assert spread_layers(list(range(1, 30)), 5) == [1, 8, 15, 22, 29]
    assert spread_layers([2, 3, 7], 5) == [2, 3, 7] and spread_layers([4, 9], None) == [4, 9]
    assert spread_layers([0, 1, 2, 3], 2) == [0, 3] and spread_layers([5, 6], 1) == [5]
    model = _model(ref["inputs"])
    tokens = [["t"] * 12] * 3
    every = diagnose_inputs(model, [ref["inputs"]], tokens, rules={"sink_mass": 0.0}, seed=3)
    one = diagnose_inputs(model, [ref["inputs"]], tokens, rules={"sink_mass": 0.0}, seed=3, edit_layers=1)
    assert [e.layer for e in every.edits] == [0, 1] and [e.layer for e in one.edits] == [0]
    assert one.edits[0].hidden == pytest.approx(every.edits[0].hidden, rel=1e-6)
    assert one.scan.meta["edit_layers"] == 1
