"""Score-based retention policies against an independent float64 reference, and the auto plan."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from sinklab.scan import scan_inputs
from sinklab.errors import InputError, UnsupportedModelError
from sinklab.models import tiny_llama
from sinklab.stream import SinkCache
from sinklab.stream.plan import RetentionPlan, load_plan, plan_from_scan
from sinklab.stream.policy import POLICIES, TOVA, Recency, ScoredPolicy, SnapKV
from tests.retention_reference import RetentionReference


def _ids(n: int, seed: int = 5) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 30000, (n,), generator=g).tolist()


def _model():
    return tiny_llama(seed=1)


#: The token-by-token test's sizes: a policy field at a larger default is cut to this (fields it lacks are not set).
SMALL = {"recent": 3, "window": 4, "kernel": 3}


def _small(cls: type[ScoredPolicy]) -> ScoredPolicy:
    """``cls`` with its size fields cut to :data:`SMALL`, so that eviction starts within a few tokens."""
    return cls(**{f.name: min(SMALL[f.name], f.default) for f in dataclasses.fields(cls)
                  if f.init and f.name in SMALL and isinstance(f.default, int)})


#: Every score-based row of POLICIES, read off the table: (name, policy, sinks, window of the cache).
CASES = [(name, _small(cls), 2 + i % 2, 8 + i % 3)
         for i, (name, cls) in enumerate((n, c) for n, c in POLICIES.items() if issubclass(c, ScoredPolicy))]


def test_every_policy_row_is_checked_token_by_token():
    """The score-based rows run below against tests/retention_reference.py; the one other row, StreamingLLM's
    recency ring, is checked token by token against tests/stream_reference.py (tests/test_stream.py)."""
    assert {name for name, *_ in CASES} == {n for n, c in POLICIES.items() if c is not Recency}, (
        "a policy that is neither score-based nor the recency ring: give it a token-by-token reference test")


@pytest.mark.parametrize("name,policy,sinks,window", CASES, ids=[case[0] for case in CASES])
def test_policy_matches_float64_reference_token_by_token(name, policy, sinks, window):
    """Decoding from the first token past the budget: same logits and the very same kept tokens in every head."""
    model = _model()
    budget = sinks + window
    ref = RetentionReference(model, name, sinks, budget, policy.recent, window=1,
                             kernel=getattr(policy, "kernel", 1))
    ids = _ids(40)
    with torch.no_grad(), SinkCache(model, num_sinks=sinks, window=window, policy=policy) as cache:
        for t, tok in enumerate(ids):
            ours = model(input_ids=torch.tensor([[tok]]), cache=cache).logits[0, -1]
            theirs = ref.forward([tok])[-1]
            torch.testing.assert_close(ours.double(), theirs, rtol=1e-4, atol=1e-4, msg=f"{name} step {t}")
        for i, layer in enumerate(cache.layers):
            kept = [sorted(x for x in row if x >= 0) for row in layer.sidx[0].tolist()]
            assert kept == [sorted(h) for h in ref.kept(i)], f"{name} layer {i}"
            assert all(set(range(sinks)) <= set(h) for h in kept)  # the sinks, always
            assert all(len(h) == budget for h in kept)
    assert ref.t0 > budget + policy.recent  # decoding went past the budget: tokens were evicted


def test_snapkv_prefill_compression_matches_reference():
    """A 48-token prompt in one forward compressed to 16 per head from the last 8 queries' pooled attention, then
    decoding past the budget."""
    model = _model()
    policy = SnapKV(recent=4, window=8, kernel=5)
    ref = RetentionReference(model, "snapkv", 4, 16, 4, window=8, kernel=5)
    ids = _ids(60, seed=9)
    with torch.no_grad(), SinkCache(model, num_sinks=4, window=12, policy=policy) as cache:
        ours = model(input_ids=torch.tensor([ids[:48]]), cache=cache).logits[0]
        torch.testing.assert_close(ours.double(), ref.forward(ids[:48]), rtol=1e-4, atol=1e-4)
        assert cache.layers[0].kept_tokens().tolist() == [[16, 16]]
        ref.window = 1  # one query per decode step
        for tok in ids[48:]:
            ours = model(input_ids=torch.tensor([[tok]]), cache=cache).logits[0, -1]
            torch.testing.assert_close(ours.double(), ref.forward([tok])[-1], rtol=1e-4, atol=1e-4)
        for i, layer in enumerate(cache.layers):
            kept = [sorted(x for x in row if x >= 0) for row in layer.sidx[0].tolist()]
            assert kept == [sorted(h) for h in ref.kept(i)]


@pytest.mark.parametrize("grow_before", [False, True], ids=["after-prompt", "before-prompt"])
def test_grow_keeps_the_next_tokens_whole_then_holds_the_budget_again(grow_before):
    """A 48-token prompt compressed to 16 per head, ``grow(6)``: the next 6 tokens evict nothing (the kept set is the
    compressed prompt's plus them), later ones hold 22 per head — logits and kept sets equal the float64 reference
    whose budget is raised by 6 at the same point. Grown before the first forward, the prompt itself keeps 22."""
    model = _model()
    policy = SnapKV(recent=4, window=8, kernel=5)
    ref = RetentionReference(model, "snapkv", 4, 16, 4, window=8, kernel=5)
    ids = _ids(64, seed=11)
    with torch.no_grad(), SinkCache(model, num_sinks=4, window=12, policy=policy) as cache:
        if grow_before:
            cache.grow(6)
            ref.budget = 22
        ours = model(input_ids=torch.tensor([ids[:48]]), cache=cache).logits[0]
        torch.testing.assert_close(ours.double(), ref.forward(ids[:48]), rtol=1e-4, atol=1e-4)
        before = [layer.kept_indices() for layer in cache.layers]
        if not grow_before:
            cache.grow(6)
            ref.budget = 22
        ref.window = 1
        for t, tok in enumerate(ids[48:]):
            ours = model(input_ids=torch.tensor([[tok]]), cache=cache).logits[0, -1]
            torch.testing.assert_close(ours.double(), ref.forward([tok])[-1], rtol=1e-4, atol=1e-4)
            if t == 5 and not grow_before:  # six tokens appended whole
                for layer, kept in zip(cache.layers, before):
                    assert layer.kept_indices() == [h + list(range(48, 54)) for h in kept]
        for i, layer in enumerate(cache.layers):
            assert layer.kept_indices() == [sorted(h) for h in ref.kept(i)]
            assert layer.kept_tokens().tolist() == [[22, 22]]
    with SinkCache(model, num_sinks=4, window=12) as ring:
        with pytest.raises(InputError, match="score-based"):
            ring.grow(6)
        with pytest.raises(InputError, match="tokens"):
            SinkCache(model, num_sinks=4, window=12, policy="tova").grow(-1)


@pytest.mark.parametrize("name", list(POLICIES))
def test_every_policy_equals_the_dense_forward_until_it_evicts(name):
    model = _model()
    ids = torch.tensor([_ids(30)])
    with torch.no_grad():
        dense = model(ids).logits
        with SinkCache(model, num_sinks=4, window=40, policy=name) as cache:
            first = model(input_ids=ids[:, :20], cache=cache).logits
            rest = [model(input_ids=ids[:, t:t + 1], cache=cache).logits for t in range(20, 30)]
    torch.testing.assert_close(torch.cat([first, *rest], 1), dense, rtol=1e-5, atol=1e-5)


def test_original_positions_keep_true_distances():
    """``positions="original"`` (kvpress's convention): no re-rotation, so the kept keys sit where they were."""
    model = _model()
    ids = torch.tensor([_ids(40)])
    with torch.no_grad(), SinkCache(model, num_sinks=2, window=8, policy="tova", positions="original") as cache:
        model(input_ids=ids, cache=cache)
        layer = cache.layers[0]
        real = layer.sidx >= 0
        assert torch.equal(layer.pos[real], layer.sidx[real])
    with torch.no_grad(), SinkCache(model, num_sinks=2, window=8, policy="tova") as cache:
        model(input_ids=ids, cache=cache)
        layer = cache.layers[0]
        # by slot: the k-th newest kept key sits k − 1 positions before the newest token
        pos = layer.pos[0, 0][layer.sidx[0, 0] >= 0]
        assert pos.tolist() == list(range(39 - 9, 40))


def test_policy_errors_are_clear():
    model = _model()
    with pytest.raises(InputError, match="unknown retention policy 'lru'.*snapkv"):
        SinkCache(model, policy="lru")
    with pytest.raises(InputError, match="needs a plan"):
        SinkCache(model, policy="auto")
    with pytest.raises(InputError, match="kv_bits"):
        SinkCache(model, policy="tova", kv_bits=4)
    with pytest.raises(InputError, match="recent"):
        TOVA(recent=0)
    cache = SinkCache(model, num_sinks=4, window=2, policy="snapkv")  # 32 recent tokens do not fit in 6
    with pytest.raises(InputError, match="cannot hold"), torch.no_grad():
        model(input_ids=torch.tensor([_ids(10)]), cache=cache)
    cache.close()


def test_generate_and_beams_run_through_a_scored_policy():
    model = _model()
    ids = torch.tensor([_ids(24)])
    with torch.no_grad(), SinkCache(model, num_sinks=2, window=10, policy=TOVA(recent=2)) as cache:
        out = model.generate(ids, cache=cache, max_new_tokens=6, do_sample=False, num_beams=2)
    assert out.shape == (1, 30)
    assert int(cache.layers[0].kept_tokens().max()) == 12


def _scan_of(model, n: int = 2, t: int = 160):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 30000, (n, t), generator=g)
    return scan_inputs(model, [{"input_ids": ids, "attention_mask": torch.ones_like(ids)}],
                                    [[str(i) for i in range(t)]] * n, split=False)


def test_local_mass_matches_a_naive_band_sum():
    """The scan's local share equals a float64 sum of each query's attention over its last 64 keys."""
    model = _model()
    scan = _scan_of(model, n=1, t=100)
    ids = torch.randint(0, 30000, (1, 100), generator=torch.Generator().manual_seed(0))
    eager = tiny_llama(seed=1, attn_implementation="eager").double()
    with torch.no_grad():
        att = eager(ids, output_attentions=True).attentions  # L × (1, H, T, T)
    for layer, a in enumerate(att):
        band = torch.stack([a[0, :, i, max(0, i - 63):i + 1].sum(-1) for i in range(100)], -1)  # (H, T)
        torch.testing.assert_close(scan.local_mass[0, layer].double(), band, rtol=1e-4, atol=1e-5)


def test_auto_plan_budgets_sum_to_the_uniform_total_and_reload(tmp_path):
    model = _model()
    scan = _scan_of(model)
    plan = plan_from_scan(model, scan, num_sinks=4, window=60, recent=8, threshold=0.5)
    uniform = 4 * 2 * 64
    assert plan.total_tokens <= uniform and uniform - plan.total_tokens < 2 * 4
    summary = plan.summary()
    assert summary["heads"] == 8
    for row, flags, cov in zip(plan.budgets, plan.local, plan.coverage):
        for b, f, c in zip(row, flags, cov):
            assert f == (c >= 0.5)
            assert b == (4 + 60 if f else summary["far_budget"])
    path = plan.save(tmp_path / "plan.json")
    again = load_plan(path)
    assert again == plan
    ids = torch.tensor([_ids(200)])
    with torch.no_grad():
        with SinkCache(model, policy="auto", plan=plan) as a:
            la = model(input_ids=ids, cache=a).logits
            kept = [layer.kept_tokens()[0].tolist() for layer in a.layers]
        with SinkCache(model, policy="auto", plan=str(path)) as b:
            lb = model(input_ids=ids, cache=b).logits
    torch.testing.assert_close(la, lb)
    assert kept == plan.budgets


def test_auto_plan_refuses_another_model_and_bad_files(tmp_path):
    model = _model()
    plan = plan_from_scan(model, _scan_of(model), num_sinks=4, window=60, recent=8)
    other = tiny_llama(num_hidden_layers=2)
    with pytest.raises(InputError, match="made for a llama with 4 layers"):
        SinkCache(other, policy="auto", plan=plan)
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"format": "something else"}))
    with pytest.raises(InputError, match="not a sinklab retention plan"):
        load_plan(bad)
    with pytest.raises(InputError, match="no retention plan"):
        load_plan(tmp_path / "missing.json")
    with pytest.raises(InputError, match="policy='auto'"):
        SinkCache(model, policy="tova", plan=plan)
    assert isinstance(plan, RetentionPlan)


def test_latent_attention_refused_for_scored_policies():
    from tests.test_architectures import arch

    model = arch.build("deepseek_v3").model
    with pytest.raises(UnsupportedModelError, match="default policy"):
        SinkCache(model, policy="tova")


def test_plan_from_a_scan_directly_and_rebudgeted():
    """``plan=scan`` makes the plan at the cache's own budget; a saved plan given another window is re-budgeted."""
    model = _model()
    scan = _scan_of(model)
    direct = SinkCache(model, num_sinks=4, window=60, policy="auto", plan=scan)
    made = plan_from_scan(model, scan, num_sinks=4, window=60, recent=32)
    assert direct.plan.budgets == made.budgets
    direct.close()
    wider = SinkCache(model, num_sinks=4, window=120, policy="auto", plan=made)
    assert wider.plan.window == 120 and wider.plan.local == made.local
    assert wider.plan.total_tokens == plan_from_scan(model, scan, num_sinks=4, window=120, recent=32).total_tokens
    wider.close()


def test_session_reports_kept_tokens_saves_and_refuses_crop_after_eviction(tmp_path):
    """A scored stream reports its kept tokens and saves (tests/test_stream_persistence.py resumes it); once it has
    evicted, crop is refused."""
    from sinklab.stream import StreamSession

    model = _model()
    with StreamSession(model, num_sinks=2, window=10, policy=TOVA(recent=2), chunk_size=8) as s:
        s.feed(torch.tensor([_ids(30)]))
        assert s.cache_tokens() == 12
        s.save(tmp_path / "s.safetensors")
        with pytest.raises(InputError, match="cannot take back"):
            s.cache.crop(-1)
    assert (tmp_path / "s.safetensors").exists()


def test_cli_stream_with_a_policy_and_bad_policies():
    from tests.test_cli_errors import fails, run

    result, text = run("stream", "builtin:tiny-llama", "--prompt", "a b c d e f", "--window", "12",
                       "--max-new-tokens", "20", "--policy", "tova")
    assert result.exit_code == 0, text
    assert "cache 20 / 16 tokens" in text or "/ 16 tokens" in text
    fails(["stream", "builtin:tiny-llama", "--prompt", "x", "--policy", "lru"], 2, "not a retention policy",
          "snapkv")
    fails(["stream", "builtin:tiny-llama", "--prompt", "x", "--plan", "p.json"], 2, "add --policy auto")


def test_eval_stream_scores_policies_beside_the_sinks():
    from sinklab.evaluation.stream import EvalPlan, evaluate_stream

    model = _model()
    ids = torch.tensor(_ids(90))
    plan = EvalPlan(methods=("dense", "sinks"), sinks=(4,), cache_size=100, start=10, chunk_size=16,
                    policies=("tova", "knorm"))
    assert plan.methods == ("dense", "sinks", "policies")
    result = evaluate_stream(model, ids, plan)
    dense = result.curve("dense").nll
    for label in ("tova S=4", "knorm S=4"):  # nothing evicted inside 100 tokens: the dense NLL
        torch.testing.assert_close(result.curve(label).nll, dense, rtol=1e-4, atol=1e-4)
    with pytest.raises(InputError, match="auto needs a plan"):
        EvalPlan(policies=("auto",))


def test_a_sliding_window_layer_keeps_its_own_window_under_a_scored_policy():
    """A layer of the model's own sliding window (24) wider than the budget (20): the prompt's forward equals the
    model's own (no query sees past its window, sinks included: a sliding layer keeps them only with
    sliding_sinks=True), and what stays is inside the window."""
    import transformers as tf

    cfg = tf.MistralConfig(vocab_size=30522, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=24,
                           max_position_embeddings=512)
    torch.manual_seed(0)
    model = tf.MistralForCausalLM(cfg).eval()
    ids = torch.tensor([_ids(40)])
    with torch.no_grad():
        dense = model(ids).logits
        with SinkCache(model, num_sinks=4, window=16, policy=TOVA(recent=4)) as cache:
            ours = model(input_ids=ids, cache=cache).logits
            kept = cache.layers[0].sidx[0]
    torch.testing.assert_close(ours, dense, rtol=1e-4, atol=1e-4)
    kept = kept[kept >= 0]
    assert kept.numel() == 2 * 20 and bool((kept > 39 - 24).all())  # inside the window of the next query
    with torch.no_grad(), SinkCache(model, num_sinks=4, window=16, policy=TOVA(recent=4), sliding_sinks=True) as cache:
        model(input_ids=ids, cache=cache)
        kept = cache.layers[0].sidx[0]
    assert set(range(4)) <= set(kept[0].tolist())  # with sliding_sinks the sinks stay
