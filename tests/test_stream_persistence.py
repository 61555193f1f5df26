"""One stream configuration and symmetric persistence: a stream saved half-way and resumed in a new session gives
exactly the logits of the uninterrupted stream, under every retention policy (each row of ``POLICIES`` and ``auto``),
a packed window, pinned spans, sliding-window and hybrid models and a compiled decode step; the configuration
round-trips through JSON and refuses bad values; a score-based stream can be cropped while nothing was evicted."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from sinklab.errors import InputError
from sinklab.models import tiny_llama
from sinklab.stream import SinkCache, StreamSession
from sinklab.stream.config import StreamConfig
from sinklab.stream.plan import RetentionPlan, allocate
from sinklab.stream.policy import POLICIES, KeyNorm
from sinklab.stream.session import split_tree
from tests.tiny_models import build

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def llama():
    return tiny_llama(seed=1)


def _tokens(n: int, vocab: int, batch: int = 1, seed: int = 5) -> torch.Tensor:
    return torch.randint(2, vocab, (batch, n), generator=torch.Generator().manual_seed(seed))


def _plan(model, num_sinks: int, window: int) -> RetentionPlan:
    """An ``auto`` plan written by hand: the first key-value head of every layer local, the others far."""
    cfg = model.config
    layers, kv = cfg.num_hidden_layers, cfg.num_key_value_heads
    local = [[h == 0 for h in range(kv)] for _ in range(layers)]
    return RetentionPlan(cfg.model_type, layers, kv, num_sinks, window, 3, 6, 0.9,
                         allocate(local, num_sinks, window, 6), [[0.95] * kv for _ in range(layers)], local)


def _small(name: str):
    """The policy of ``POLICIES[name]`` with a few newest tokens protected (tiny budgets leave room to evict)."""
    policy = POLICIES[name]()
    return dataclasses.replace(policy, recent=2, window=min(policy.window, 4)) if policy.scored else policy


def _resumes_exactly(model, tmp_path, *, prompt: int = 20, steps: int = 24, save_at: int = 6, batch: int = 1,
                     pad: bool = False, vocab: int | None = None, **settings) -> StreamSession:
    """Feed a prompt, decode ``steps`` greedy tokens saving after ``save_at`` of them; a session loaded from the file
    and fed the same tokens gives the same logits bit for bit (eviction and re-bases happen after the save)."""
    vocab = vocab or model.config.vocab_size
    ids = _tokens(prompt, vocab, batch)
    mask = None
    if pad:  # row 1 left-padded by 3
        mask = torch.ones_like(ids)
        mask[1, :3] = 0
    path = tmp_path / "stream.safetensors"
    fed, straight = [], []
    with StreamSession(model, chunk_size=8, **settings) as s:
        logits = s.feed(ids, mask)
        for i in range(steps):
            token = logits.argmax(-1)
            if i == save_at:
                s.save(path)
            if i >= save_at:
                fed.append(token)
            logits = s.step(token)
            if i >= save_at:
                straight.append(logits)
        evicted = s.cache_tokens() < prompt + steps
        final = split_tree(s.sink.state_dict())
    assert evicted, "the test must evict after the save"
    resumed = StreamSession.load(model, path)
    assert resumed.config == s.config and resumed.chunk_size == s.chunk_size
    assert resumed.compile_options == s.compile_options
    with resumed:
        assert resumed.tokens_seen == prompt + save_at
        again = [resumed.step(token) for token in fed]
        tensors, plain = split_tree(resumed.sink.state_dict())
    for x, y in zip(straight, again):
        torch.testing.assert_close(y, x, atol=0, rtol=0)
    assert plain == final[1] and tensors.keys() == final[0].keys()  # every counter, buffer and position as well
    for key, value in tensors.items():
        assert torch.equal(value, final[0][key]), key
    return resumed


@pytest.mark.parametrize("policy", list(POLICIES))
def test_every_policy_resumes_exactly(llama, tmp_path, policy):
    _resumes_exactly(llama, tmp_path, num_sinks=2, window=8, rebase_every=12, policy=_small(policy))


def test_auto_plan_and_pinned_spans_resume_exactly(llama, tmp_path):
    plan = _plan(llama, 2, 8)
    resumed = _resumes_exactly(llama, tmp_path, num_sinks=2, window=8, policy="auto", plan=plan, pinned=[(4, 7)])
    assert resumed.config.plan == plan and resumed.sink.plan.budgets == plan.budgets


@pytest.mark.parametrize("settings", [
    dict(policy="streaming", pinned=[(3, 6), (9, 11)]),
    dict(policy=_small("tova"), pinned=[(3, 6)], positions="original"),
    dict(policy=KeyNorm(recent=2), start_position=1000),
])
def test_pinned_spans_positions_and_offsets_resume_exactly(llama, tmp_path, settings):
    _resumes_exactly(llama, tmp_path, num_sinks=2, window=8, **settings)


def test_a_padded_batch_and_a_packed_window_resume_exactly(llama, tmp_path):
    resumed = _resumes_exactly(llama, tmp_path, num_sinks=2, window=8, batch=2, pad=True, kv_bits=4,
                               kv_group_size=8, rebase_every=10)
    assert resumed.kv_bits == 4 and resumed.kv_group_size == 8


@pytest.mark.parametrize("name, settings", [
    ("gpt-oss-learned-sinks", dict(policy=_small("tova"))),  # a sliding and a full layer: two budgets
    ("mistral-sliding", dict(sliding_sinks=True, policy=_small("snapkv"))),
    ("mistral-sliding", dict(kv_bits=8)),
])
def test_sliding_window_models_resume_exactly(tmp_path, name, settings):
    _resumes_exactly(build(name), tmp_path, num_sinks=2, window=6, **settings)


def test_a_hybrid_model_resumes_exactly(tmp_path):
    from tests.test_stream_hybrid import _qwen3_next

    _resumes_exactly(_qwen3_next(), tmp_path, num_sinks=2, window=6, policy=_small("knorm"), steps=16)


def test_the_compiled_path_resumes_exactly_and_keeps_its_settings(llama, tmp_path):
    """Decoding through torch.compile (dynamo with the eager backend: seconds, not an inductor build); the loaded
    session compiles its steps the same way."""
    resumed = _resumes_exactly(llama, tmp_path, num_sinks=2, window=8, compile={"backend": "eager"}, steps=14)
    assert resumed.compile_options == {"backend": "eager"}


def test_the_config_round_trips_through_json(llama):
    config = StreamConfig(num_sinks=3, window=8, pinned=[(4, 6)], start_position=7, rebase_every=20,
                          sliding_sinks=True, check_every=5, compile_plan=True, policy="auto", plan=_plan(llama, 3, 8),
                          positions="original")
    back = StreamConfig.from_json(json.loads(json.dumps(config.to_json())))
    assert back == config and back.policy.name == "snapkv" and back.policy.recent == 3
    packed = StreamConfig(kv_bits=3, kv_group_size=8, policy="streaming")
    assert StreamConfig.from_json(json.loads(json.dumps(packed.to_json()))) == packed
    assert SinkCache(llama, config=config).config is config
    assert dataclasses.replace(config, window=16).plan.window == 16  # a plan follows the budget (same local heads)


@pytest.mark.parametrize("settings, message", [
    (dict(window=0), "window must be an integer ≥ 1"),
    (dict(num_sinks=-1), "num_sinks must be an integer ≥ 0"),
    (dict(num_sinks=True), "num_sinks must be an integer"),
    (dict(pinned=[(5, 2)]), "pinned"),
    (dict(rebase_every=0), "rebase_every must be an integer ≥ 1"),
    (dict(check_every=0), "check_every must be an integer ≥ 1"),
    (dict(kv_bits=5), "kv_bits must be one of"),
    (dict(kv_group_size=8), "it needs kv_bits"),
    (dict(compile_plan="yes"), "compile_plan is True or False"),
    (dict(positions="absolute"), "positions is 'slot'"),
    (dict(policy="lru"), "unknown retention policy"),
    (dict(policy="auto"), "needs a plan"),
    (dict(policy="tova", kv_bits=4), "keeps its tokens unpacked"),
])
def test_bad_config_values_are_input_errors(settings, message):
    with pytest.raises(InputError, match=message):
        StreamConfig(**settings)


def test_bad_saved_configs_and_old_files_are_refused(llama, tmp_path):
    with pytest.raises(InputError, match="not a sinklab stream configuration"):
        StreamConfig.from_json({"window": 8})
    with pytest.raises(InputError, match="unknown settings"):
        StreamConfig.from_json({**StreamConfig().to_json(), "turbo": True})
    with pytest.raises(InputError, match="saved policy"):
        StreamConfig.from_json({**StreamConfig().to_json(), "policy": {"name": "lru"}})
    with pytest.raises(InputError, match="give the stream's settings either"):
        SinkCache(llama, window=8, config=StreamConfig())
    from safetensors.torch import save_file

    old = tmp_path / "old.safetensors"
    save_file({"state.n_real": torch.zeros(1, dtype=torch.long)}, str(old),
              metadata={"sinklab": json.dumps({"format": "sinklab.stream/1"})})
    with pytest.raises(InputError, match="format sinklab.stream/1"):
        StreamSession.load(llama, old)


@pytest.mark.parametrize("policy", list(POLICIES))
def test_crop_takes_tokens_back_until_something_is_evicted(llama, policy):
    """Cropping the last tokens of a stream that evicted nothing gives the stream that never saw them (its next
    logits up to float32 rounding: the chunks differ); once a head evicted a token, crop is an InputError."""
    ids = _tokens(12, llama.config.vocab_size)
    with StreamSession(llama, num_sinks=2, window=10, policy=_small(policy), chunk_size=4) as s:
        s.feed(ids[:, :9])
        s.cache.crop(-3)
        cropped = s.step(ids[0, 6:7])
        assert s.state.columns == 7
    with StreamSession(llama, num_sinks=2, window=10, policy=_small(policy), chunk_size=4) as s:
        s.feed(ids[:, :6])
        torch.testing.assert_close(s.step(ids[0, 6:7]), cropped, atol=1e-5, rtol=1e-5)  # (other chunk bounds)
        s.feed(ids[:, 7:12])
        s.feed(ids[:, :3])  # 15 tokens through a budget of 12: evicted
        with pytest.raises(InputError, match="already evicted"):
            s.cache.crop(-1)


def test_chat_with_policy_auto_survives_save_and_load(tmp_path):
    """`sinklab chat --policy auto`: /save, /reset, /load resumes the scored stream where it was (the same transcript
    as a chat that never stopped), its plan and policy read back from the file."""
    import sinklab
    from tests.test_chat import _cli

    loaded = sinklab.load_model("builtin:tiny-lm")
    plan = _plan(loaded.model, 4, 8)
    plan_path = plan.save(tmp_path / "plan.json")
    saved = tmp_path / "chat.safetensors"
    common = ("--window", "8", "--max-new-tokens", "6", "--policy", "auto", "--plan", plan_path)
    straight = _cli(*common, input="Return the value\nWhat next?\n")
    around = _cli(*common, input=f"Return the value\n/save {saved}\n/reset\n/load {saved}\nWhat next?\n")
    assert straight.exit_code == 0 and around.exit_code == 0, around.output
    assert straight.stdout == around.stdout and around.stdout.count("assistant:") == 2
    resumed = StreamSession.load(loaded.model, saved)
    assert resumed.config.plan == plan.with_budget(4, 8) and resumed.sink.policy.scored


def test_every_config_field_is_round_tripped_and_documented():
    """A new `StreamConfig` field is picked up here: the round-trip configs above set every field to a value other
    than its default, and docs/stream.md's settings list names each one."""
    import inspect
    from pathlib import Path

    source = inspect.getsource(test_the_config_round_trips_through_json)
    docs = (Path(__file__).resolve().parents[1] / "docs" / "stream.md").read_text()
    section = docs[docs.index("## One configuration, saved streams"):]
    section = section[:section.index("\n## ", 5)]
    names = {"num_sinks": "sinks", "window": "window", "pinned": "pinned", "start_position": "start position",
             "rebase_every": "re-base", "policy": "policy", "plan": "plan"}
    for f in dataclasses.fields(StreamConfig):
        assert f"{f.name}=" in source, f"set StreamConfig.{f.name} in test_the_config_round_trips_through_json"
        assert names.get(f.name, f.name) in section, f"name StreamConfig.{f.name} in docs/stream.md's settings list"
