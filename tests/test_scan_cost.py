"""What makes an analysis cheap stays correct: reduced-side spectra, weight caches, the weight check, the LM head.

References: float64 SVD (spectra), float64 QR/SVD of the current weights (QK spectra, output factors),
``torch.isfinite`` (weight check), the model's own ``.logits`` with ``cross_entropy`` in float64 (loss).
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from tiny_models import build

from sinklab import metrics
from sinklab.capture import weights as weight_stats
from sinklab.capture.heads import update_spectrum
from sinklab.capture.loss import head_matches, token_losses
from sinklab.errors import ModelWeightsError
from sinklab import fingerprint
from sinklab.fingerprint import forget
from sinklab.checks import _CHECKED, check_weights
from sinklab.scan import scan_inputs


# ----------------------------------------------------------------------------- spectra on the smaller Gram side
@pytest.mark.parametrize("tq, dv", [(5, 16), (16, 16), (24, 8)])
def test_update_spectrum_equals_float64_svd(tq, dv):
    gen = torch.Generator().manual_seed(tq * dv)
    # a dominant rank-1 part plus noise, and masked (zero) rows: the shape of real head updates
    u = torch.randn(3, 2, tq, 1, generator=gen) * torch.randn(3, 2, 1, dv, generator=gen) * 5
    u = u + 0.1 * torch.randn(3, 2, tq, dv, generator=gen)
    u[0, :, tq // 2 :] = 0.0
    ref = torch.linalg.svdvals(u.double())  # (3, 2, min(tq, dv))
    got = update_spectrum(u)
    assert got.shape == (3, 2, dv) and got.dtype == torch.float32
    m = min(tq, dv)
    # float32 Gram: each singular value within √ε·σ₁ (~3e-4 σ₁) absolute; the derived ratios to 1e-5
    torch.testing.assert_close(got[..., :m].double(), ref, atol=1e-3 * float(ref.amax()), rtol=1e-5)
    assert bool((got[..., m:] == 0).all())
    torch.testing.assert_close(metrics.stable_rank_from_singular_values(got), metrics.stable_rank(u), atol=0, rtol=1e-5)
    torch.testing.assert_close(metrics.rank1_energy_from_singular_values(got), metrics.rank1_energy(u), atol=0, rtol=1e-5)
    bad = u.clone()
    bad[1, 1, 0, 0] = float("nan")
    assert not bool(torch.isfinite(update_spectrum(bad)).all())


# ----------------------------------------------------------------------------- weight-only statistics, cached
def _reference_qk(model, layer: int) -> torch.Tensor:
    attn = model.model.layers[layer].self_attn
    h, hkv = model.config.num_attention_heads, model.config.num_key_value_heads
    dh = model.config.hidden_size // h
    wq = attn.q_proj.weight.detach().double().reshape(h, dh, -1)
    wk = attn.k_proj.weight.detach().double().reshape(hkv, dh, -1).repeat_interleave(h // hkv, 0)
    return torch.stack([torch.linalg.svdvals(wq[i].T @ wk[i])[:dh] for i in range(h)])


def _scan(model):
    ids = torch.arange(3, 27).reshape(2, 12)
    return scan_inputs(model, [{"input_ids": ids, "attention_mask": torch.ones_like(ids)}], [[""] * 12] * 2,
                       candidates=(0,), map_len=0)


def test_weight_statistics_are_computed_once_and_never_stale(monkeypatch):
    model = build("llama-gqa")
    calls = []
    real = weight_stats._layer_weights
    monkeypatch.setattr(weight_stats, "_layer_weights", lambda *a: calls.append(a[0]) or real(*a))
    first = _scan(model)
    assert len(calls) == 2  # one per layer
    _scan(model)
    assert len(calls) == 2  # unchanged weights: served from the cache
    torch.testing.assert_close(first.qk_spectrum[0].double(), _reference_qk(model, 0), atol=1e-5, rtol=1e-5)

    # a training step between two probes (as under SinkMonitor): every block's entry is recomputed
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model.train()
    ids = torch.arange(3, 27).reshape(2, 12)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    model.eval()
    trained = _scan(model)
    assert len(calls) == 4
    for layer in (0, 1):
        torch.testing.assert_close(trained.qk_spectrum[layer].double(), _reference_qk(model, layer), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(trained.qk_spectrum, first.qk_spectrum)

    # a fused optimizer (transformers' Trainer default) writes without bumping the version counter
    fused = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    versions = [p._version for p in model.parameters()]
    model(input_ids=ids, labels=ids).loss.backward()
    fused.step()
    assert [p._version for p in model.parameters()] == versions  # (why the fingerprint samples values too)
    stepped = _scan(model)
    assert len(calls) == 6
    for layer in (0, 1):
        torch.testing.assert_close(stepped.qk_spectrum[layer].double(), _reference_qk(model, layer), atol=1e-5, rtol=1e-5)

    # a swapped parameter (a variant applied, p.data = …) and an in-place edit under no_grad
    attn = model.model.layers[1].self_attn
    attn.q_proj.weight.data = attn.q_proj.weight.data * 3.0
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.weight.mul_(0.5)
    edited = _scan(model)
    assert len(calls) == 8
    for layer in (0, 1):
        torch.testing.assert_close(edited.qk_spectrum[layer].double(), _reference_qk(model, layer), atol=1e-5, rtol=1e-5)

    # a write through .data that misses every sampled element bypasses both: forget() is the documented remedy
    monkeypatch.setattr(fingerprint, "SAMPLE", 2)  # samples elements 0 and numel/2 of each weight
    _scan(model)
    assert len(calls) == 10  # (a new sample size: new fingerprints)
    attn.q_proj.weight.data[0, 1] += 1.0
    _scan(model)
    assert len(calls) == 10  # unseen, as documented
    forget(model)
    again = _scan(model)
    assert len(calls) == 12
    torch.testing.assert_close(again.qk_spectrum[1].double(), _reference_qk(model, 1), atol=1e-5, rtol=1e-5)


def test_weight_check_runs_once_and_still_refuses_a_nan_weight(monkeypatch):
    model = build("llama-gqa")
    import sinklab.checks as models

    calls = []
    real = models._check_finite
    monkeypatch.setattr(models, "_check_finite", lambda m, **kw: calls.append(1) or real(m, **kw))
    check_weights(model)
    check_weights(model)
    assert len(calls) == 1
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[3, 4] = float("nan")  # after a passed check
    with pytest.raises(ModelWeightsError, match="layers.1.mlp.up_proj.weight"):
        check_weights(model)
    with pytest.raises(ModelWeightsError):  # a failed check is not cached
        _scan(model)
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[3, 4] = 1e38  # finite; the sum overflows to inf
        model.model.layers[1].mlp.up_proj.weight[3, 5] = 1e38
    check_weights(model)  # the exact entry-wise test clears it
    assert bool(torch.isfinite(model.model.layers[1].mlp.up_proj.weight).all())
    assert model in _CHECKED._store


def test_a_scan_checks_the_token_table_only_at_the_rows_it_looks_up():
    """No LM head in a scan: a NaN in an embedding row it never looks up changes nothing (and is not read); one in
    a row it does look up is refused by name; the full check (circuit, stream: the LM head) still refuses both."""
    model = build("llama-gqa")
    clean = _scan(model)  # ids 3 … 26
    with torch.no_grad():
        model.model.embed_tokens.weight[60, 2] = float("nan")
    again = _scan(model)
    torch.testing.assert_close(again.column_mass, clean.column_mass, equal_nan=True)
    with pytest.raises(ModelWeightsError, match="embed_tokens"):
        check_weights(model)
    with torch.no_grad():
        model.model.embed_tokens.weight[60, 2] = 0.0
        model.model.embed_tokens.weight[7, 1] = float("inf")
    with pytest.raises(ModelWeightsError, match="embed_tokens"):
        _scan(model)


# ----------------------------------------------------------------------------- the LM head at the scored rows only
def _tiny_gemma3():
    config = tf.Gemma3TextConfig(vocab_size=211, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                 max_position_embeddings=64, final_logit_softcapping=3.0, sliding_window=4)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return tf.Gemma3ForCausalLM(config).eval()


@pytest.mark.parametrize("which", ["llama", "gemma3-softcap"])
def test_token_losses_equal_the_models_own_logits(which):
    model = build("llama-gqa") if which == "llama" else _tiny_gemma3()
    assert head_matches(model)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 90, (3, 9), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    mask[2, 1:] = 0  # one real token: nothing to score
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits.double()
        hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
    valid = mask[:, :-1].bool() & mask[:, 1:].bool()
    ce = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
    ref = torch.where(valid, ce.view(valid.shape), 0.0).sum(-1)
    got, count = token_losses(model, hidden, ids, mask, chunk_elements=3 * model.config.vocab_size)  # 3 rows a chunk
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert count.tolist() == [8.0, 5.0, 0.0]
    # every 3rd target counting back from each row's last, picked by hand from the pair list
    picked = torch.zeros_like(valid)
    for row in range(valid.shape[0]):
        for j in [j for j in range(valid.shape[1]) if valid[row, j]][::-1][::3]:
            picked[row, j] = True
    ref3 = torch.where(picked, ce.view(valid.shape), 0.0).sum(-1)
    got3, count3 = token_losses(model, hidden, ids, mask, chunk_elements=3 * model.config.vocab_size, stride=3)
    torch.testing.assert_close(got3, ref3, atol=1e-5, rtol=1e-5)
    assert count3.tolist() == [3.0, 2.0, 0.0]


def test_a_model_whose_logits_the_head_does_not_give_is_detected():
    class Scaled(tf.Gemma3ForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 2.0
            return out

    model = _tiny_gemma3()
    scaled = Scaled(model.config).eval()
    scaled.load_state_dict(model.state_dict())
    assert head_matches(model) and not head_matches(scaled)
