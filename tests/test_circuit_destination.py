"""Where the attention goes when the sink is gone: the circuit's per-layer destination rows against eager
attention recomputed in float64, and the ablation verdicts of the two real families (Gemma 3: tied to
``<bos>``; SmolLM2: structural) at small settings.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from sinklab.circuit import circuit, measure_rows
from sinklab.circuit.destination import destination_summary
from sinklab.models import tiny_llama

V = 61


SINK = 7  # a token built to be a sink that is not the first token


def _model():
    """Random weights plus one built-in sink: token 7's embedding is the basis vector e_0 (no other token has an
    e_0 component), every key head reads e_0 into its slowest-rotating RoPE dimension and every query has a
    bias there, so most queries of every layer put most of their attention on token 7 wherever it stands."""
    model = tiny_llama(seed=3, vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, attention_bias=True)
    dh = model.config.head_dim
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb[:, 0] = 0.0
        emb[SINK] = 0.0
        emb[SINK, 0] = 1.0
        for block in model.model.layers:
            attn = block.self_attn
            attn.q_proj.bias.zero_()
            attn.k_proj.bias.zero_()
            attn.q_proj.bias[dh - 1 :: dh] = torch.tensor([2.0, 1.0, 0.5, 0.0])  # four heads, four strengths
            attn.k_proj.weight[dh - 1 :: dh, 0] = 1.0
    return model


def _reference(model, rows: list[list[int]], eps: float) -> dict[str, list]:
    """Every row alone through transformers' eager attention; the statistics recomputed in float64."""
    model = model.double()
    model.set_attn_implementation("eager")
    per_row = []
    with torch.no_grad():
        for r in rows:
            ids = torch.tensor([r])
            out = model(input_ids=ids, output_attentions=True, output_hidden_states=True)
            t = len(r)
            stats = []
            for layer, attn in enumerate(out.attentions):
                a = attn[0]  # (H, T, T)
                block = model.model.layers[layer]
                x = block.input_layernorm(out.hidden_states[layer][0])  # (T, d)
                h, dh = a.shape[0], model.config.head_dim
                v = block.self_attn.v_proj(x).view(t, -1, dh).repeat_interleave(h // model.config.num_key_value_heads, 1)
                o = torch.einsum("hij,jhd->hid", a, v)  # (H, T, dh)
                w_o = block.self_attn.o_proj.weight.view(-1, h, dh)  # (d, H, dh)
                out_norm = torch.einsum("ehd,hid->hie", w_o, o).norm(dim=-1).mean(-1)  # (H,)
                cols = a.sum(1) / torch.arange(t, 0, -1, dtype=torch.float64)  # mean over the queries that see j
                need = min(max(8, math.ceil(t / 8)), t)
                dom = cols[:, : t - need + 1].argmax(-1)  # keys seen by ≥ need queries: j ≤ t − need
                stats.append({
                    "cols": cols, "dom": dom, "mass": cols.gather(-1, dom[:, None])[:, 0],
                    "entropy": -(torch.special.xlogy(a, a)).sum(-1).mean(-1),
                    "diagonal": a.diagonal(dim1=-2, dim2=-1).mean(-1),
                    "previous": a.diagonal(offset=-1, dim1=-2, dim2=-1).mean(-1), "out_norm": out_norm})
            per_row.append(stats)
    summary: dict[str, list] = {k: [] for k in ("entropy", "top_position", "top_share", "position0_mass", "diagonal",
                                                "previous", "other_sink_pct", "out_norm")}
    for layer in range(len(per_row[0])):
        st = [s[layer] for s in per_row]
        doms = torch.stack([s["dom"] for s in st])  # (S, H)
        counts = Counter(doms.flatten().tolist())
        top = min(p for p, c in counts.items() if c == max(counts.values()))  # torch.mode: the smallest of ties
        summary["top_position"].append(top)
        summary["top_share"].append(torch.stack([s["cols"][:, top] for s in st]).mean().item())
        summary["position0_mass"].append(torch.stack([s["cols"][:, 0] for s in st]).mean().item())
        for key in ("entropy", "diagonal", "previous", "out_norm"):
            summary[key].append(torch.stack([s[key] for s in st]).mean().item())
        other = (doms != 0) & (torch.stack([s["mass"] for s in st]) > eps)
        summary["other_sink_pct"].append(other.double().mean().item() * 100)
    return summary


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_destination_rows_equal_eager_attention(padding_side):
    model = _model()
    gen = torch.Generator().manual_seed(7)
    rows = [torch.randint(SINK + 1, V, (n,), generator=gen).tolist() for n in (20, 20, 17)]
    rows[0][5] = rows[1][5] = rows[2][3] = SINK
    rec = measure_rows(model, rows, batch_size=2, padding_side=padding_side)
    ours = destination_summary(rec, [[f"t{i}" for i in r] for r in rows], eps=0.3)
    ref = _reference(model, rows, eps=0.3)
    assert ours["top_position"] == ref["top_position"]
    assert ours["other_sink_pct"] == pytest.approx(ref["other_sink_pct"], abs=1e-9)
    for key in ("entropy", "top_share", "position0_mass", "diagonal", "previous", "out_norm"):
        assert ours[key] == pytest.approx(ref[key], rel=1e-3), key
    assert max(ref["other_sink_pct"]) > 0 and min(ref["previous"]) > 0  # the case exercises the rows
    assert ours["top_token"][0] in {f"t{r[ref['top_position'][0]]}" for r in rows}


def test_gemma3_is_token_tied_and_its_attention_moves(gemma3):
    r = circuit(gemma3.model, gemma3.tokenizer, seq_len=20, samples=2, causal=False)
    assert r.ablation["verdict"] == "token-tied", r.ablation["text"]
    assert len(r.ablation["sink_layers"]["as_tokenized"]) >= 12 and not r.ablation["sink_layers"]["bos_removed"]
    assert r.ablation["attention_condition"] in ("bos_removed", "first_swapped")
    ref, gone = r.ablation["attention"]["as_tokenized"], r.ablation["attention"]["bos_removed"]
    assert sum(g < a for g, a in zip(gone["position0_mass"], ref["position0_mass"])) >= 14
    assert "Where the attention goes under" in r.summary()


def test_smollm2_is_structural(smollm2):
    r = circuit(smollm2.model, smollm2.tokenizer, seq_len=20, samples=2, causal=False)
    assert r.ablation["verdict"] == "structural", r.ablation["text"]
    assert set(r.ablation["attention"]) == {"as_tokenized", "bos_prepended", "first_swapped"}
