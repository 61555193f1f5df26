"""eval-stream: every method scored on the same positions, each against an independent reference."""

from __future__ import annotations

import json

import pytest
import torch
import transformers as tf
from typer.testing import CliRunner

from sinklab.errors import InputError
from sinklab.stream import StreamSession
from sinklab.evaluation.stream import EvalPlan, evaluate_stream, recompute_nll

V = 97


def llama(layers: int) -> tf.LlamaForCausalLM:
    cfg = tf.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(1)
    model = tf.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # sharper attention than the random init, so evicting a token matters
        for name, p in model.named_parameters():
            if "q_proj" in name or "k_proj" in name:
                p.mul_(4.0)
    return model


@pytest.fixture(scope="module")
def two_layer():
    return llama(2)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, V, (70,), generator=torch.Generator().manual_seed(3))


def _ce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.double(), target, reduction="none")


@torch.no_grad()
def _forward_last(model, tokens: torch.Tensor) -> torch.Tensor:
    """A plain forward (positions 0 … n−1, no cache): logits at the last token ``[V]``."""
    return model(input_ids=tokens[None], use_cache=False).logits[0, -1]


# ------------------------------------------------------------------------------------------------ the plan
def test_plan_scores_every_method_on_the_same_positions_after_the_first_eviction(two_layer, ids):
    plan = EvalPlan(sinks=(0, 1, 4), cache_size=12, stride=3, chunk_size=16)
    result = evaluate_stream(two_layer, ids, plan)
    assert result.positions.tolist() == list(range(13, 70, 3))  # C + 1 = the first token that lost context
    labels = [c.run.label for c in result.curves]
    assert labels == ["dense", "window", "recompute", "sinks S=0", "sinks S=1", "sinks S=4"]
    assert all(c.nll.shape == result.positions.shape for c in result.curves)
    # The ablation keeps the total cache size: S + W = C for every sink count.
    assert {c.run.num_sinks + c.run.window for c in result.curves if c.run.num_sinks is not None} == {12}
    # S = 0 is the window-only run (reused, not recomputed).
    assert torch.equal(result.curve("sinks S=0").nll, result.curve("window").nll)
    data = result.to_json(bins=19)
    assert data["positions"] == {"first": 13, "last": 67, "stride": 3, "count": 19, "windows_spanned": 55 / 12}
    assert data["scored_positions"] == result.positions.tolist()
    assert all(len(c["nll"]) == 19 for c in data["curves"].values())
    # Binned means are means of the per-token NLLs (equal-count bins cover every scored token once).
    b = data["curves"]["dense"]["binned"]
    assert len(b["mean_nll"]) == 19 and b["mean_nll"] == pytest.approx(result.curve("dense").nll.tolist(), abs=1e-6)


def test_plan_work_is_the_progress_total(two_layer, ids):
    plan = EvalPlan(methods=("window", "recompute", "sinks"), sinks=(0, 2), cache_size=10, stride=4, chunk_size=9)
    done: dict[str, int] = {}
    evaluate_stream(two_layer, ids, plan, progress=lambda label, n: done.__setitem__(label, done.get(label, 0) + n))
    pos = plan.positions(70)
    assert done == {"window": int(pos[-1]), "recompute": len(pos), "sinks S=2": int(pos[-1])}
    assert sum(done.values()) == plan.work(70)


@pytest.mark.parametrize("kwargs, message", [
    ({"methods": ("dense", "bogus")}, "unknown"),
    ({"methods": "dense,sinks"}, "methods is a sequence of method names"),  # a comma list is the CLI's to split
    ({"sinks": (0, -1)}, "≥ 0"),
    ({"sinks": (2, "x")}, "≥ 0"),
    ({"sinks": "0,4"}, "sinks is a sequence of sink counts"),
    ({"policies": "tova"}, "policies is a sequence of policy names"),
    ({"sinks": (12,), "cache_size": 12}, "leave a window"),
    ({"stride": 0}, "stride"),
])
def test_plan_rejects_bad_settings(kwargs, message):
    with pytest.raises(InputError, match=message):
        EvalPlan(**kwargs)


def test_plan_rejects_a_text_too_short_to_evict():
    with pytest.raises(InputError, match="first eviction"):
        EvalPlan(cache_size=12).positions(13)


def test_auto_stride_bounds_recompute_and_is_one_without_it():
    assert EvalPlan(cache_size=100).positions(1101).tolist() == list(range(101, 1101, 8))  # ≤ 128 windows
    assert EvalPlan(methods=("dense", "sinks"), cache_size=100).resolved_stride(1101) == 1


# ------------------------------------------------------------------------------------------------ references
def test_dense_equals_one_full_forward(two_layer, ids):
    """Chunked dense prefill (chunks not aligned with the scored positions) = one causal forward's cross-entropy."""
    result = evaluate_stream(two_layer, ids, EvalPlan(methods=("dense",), cache_size=12, stride=2, chunk_size=7))
    with torch.no_grad():
        logits = two_layer(input_ids=ids[None], use_cache=False).logits[0]  # (N, V)
    pos = result.positions
    ref = _ce(logits[pos - 1], ids[pos])
    torch.testing.assert_close(result.curve("dense").nll.double(), ref, atol=1e-5, rtol=0)


def test_one_layer_streams_equal_a_forward_over_exactly_the_kept_tokens(ids):
    """With one layer a token's key/value depend on the token alone, so a stream's NLL at ``t`` equals a plain
    forward over its kept tokens re-positioned 0 … n−1: the last C for the window, ids[:S] ⧺ the last W for sinks."""
    model = llama(1)
    c, s = 12, 3
    result = evaluate_stream(model, ids, EvalPlan(methods=("window", "recompute", "sinks"), sinks=(s,), cache_size=c,
                                                  stride=5, chunk_size=8))
    window_ref, sinks_ref = [], []
    for t in result.positions.tolist():
        window_ref.append(_ce(_forward_last(model, ids[t - c : t])[None], ids[t : t + 1]))
        kept = torch.cat([ids[:s], ids[t - (c - s) : t]])
        sinks_ref.append(_ce(_forward_last(model, kept)[None], ids[t : t + 1]))
    torch.testing.assert_close(result.curve("window").nll.double(), torch.cat(window_ref), atol=1e-5, rtol=0)
    torch.testing.assert_close(result.curve(f"sinks S={s}").nll.double(), torch.cat(sinks_ref), atol=1e-5, rtol=0)
    # The sinks change the prediction (the test would not notice a stream that ignores them otherwise).
    assert (result.curve(f"sinks S={s}").nll - result.curve("window").nll).abs().max() > 1e-2


def test_recompute_equals_a_fresh_forward_over_the_last_c_tokens(two_layer, ids):
    c = 12
    pos = torch.arange(20, 70, 7)
    nll = recompute_nll(two_layer, ids, pos, c, batch_tokens=3 * c)  # batched three windows at a time
    ref = torch.cat([_ce(_forward_last(two_layer, ids[t - c : t])[None], ids[t : t + 1]) for t in pos.tolist()])
    torch.testing.assert_close(nll.double(), ref, atol=1e-5, rtol=0)


def test_sinks_chunked_equal_token_by_token_decoding(two_layer, ids):
    """Multi-layer: the chunked stream's NLL equals decoding one token at a time (the stream's own step path)."""
    s, c = 2, 12
    short = ids[:40]
    result = evaluate_stream(two_layer, short, EvalPlan(methods=("sinks",), sinks=(s,), cache_size=c, chunk_size=9))
    step = []
    with StreamSession(two_layer, num_sinks=s, window=c - s) as session:
        for t in range(int(result.positions[-1])):
            step.append(session.step(short[t : t + 1]))
    logits = torch.cat(step)  # (N − 1, V): row t predicts ids[t + 1]
    ref = _ce(logits[result.positions - 1], short[result.positions])
    torch.testing.assert_close(result.curve(f"sinks S={s}").nll.double(), ref, atol=1e-4, rtol=0)
    # … and differs from dense attention once tokens are evicted (two layers carry evicted context).
    dense = evaluate_stream(two_layer, short, EvalPlan(methods=("dense",), cache_size=c, chunk_size=9)).curve("dense")
    assert (dense.nll - result.curve(f"sinks S={s}").nll).abs().max() > 1e-2


# ------------------------------------------------------------------------------------------------ CLI
@pytest.fixture(scope="module")
def cli():
    from sinklab.cli import app

    runner = CliRunner()
    return lambda *args: runner.invoke(app, ["eval-stream", *map(str, args)])


def test_cli_writes_json_figures_and_report(cli, tmp_path):
    out = tmp_path / "run"
    r = cli("builtin:tiny-lm", "--tokens", 160, "--window", 28, "--sinks", "0,4", "--stride", 4, "--out", out)
    assert r.exit_code == 0, r.output
    assert "every method scored on positions 33–157, stride 4 (32 tokens per method" in " ".join(r.output.split())
    assert sorted(p.name for p in out.iterdir()) == ["eval_stream.json", "nll_by_position.png", "report.html",
                                                     "sink_ablation.png"]
    data = json.loads((out / "eval_stream.json").read_text())
    assert data["cache_size"] == 32 and data["positions"]["first"] == 33
    assert set(data["curves"]) == {"dense", "window", "recompute", "sinks S=0", "sinks S=4"}
    assert {len(c["nll"]) for c in data["curves"].values()} == {data["positions"]["count"]}
    # tiny-lm was trained on 64-token windows (see its model card): the window-only baseline collapses once its
    # first tokens are evicted and 4 sinks restore it, as in StreamingLLM.
    assert data["curves"]["window"]["ppl"] > 1.5 * data["curves"]["sinks S=4"]["ppl"]
    assert not list(tmp_path.glob(".sinklab-*"))  # no temporary folder left


@pytest.fixture
def no_model(monkeypatch):
    """Fail the test if the CLI gets as far as loading a model."""
    import sinklab.cli.eval_stream as mod

    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr(mod, "load_for_command", refuse)


def test_cli_rejects_bad_input_before_loading_the_model(cli, tmp_path, no_model):
    binary = tmp_path / "blob.bin"
    binary.write_bytes(b"\x7fELF\x02\x01\x01\x00\x00\x00")  # valid UTF-8, but NUL bytes: an executable
    latin = tmp_path / "latin.txt"
    latin.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")  # a PNG: not UTF-8
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    regular = tmp_path / "taken"
    regular.write_text("x")
    out = tmp_path / "out"
    cases = [
        (["--file", tmp_path / "missing.txt"], "no such file"),
        (["--file", binary], "looks binary"),
        (["--file", latin], "not UTF-8"),
        (["--file", empty], "is empty"),
        (["--file", tmp_path], "is a folder"),
        (["--methods", "dense,fast"], "unknown"),
        (["--sinks", "-1"], "≥ 0"),
        (["--sinks", "2,x"], "--sinks must be comma-separated integers such as 0,1,2,4,8, got '2,x'"),
        (["--methods", " , "], "methods: unknown or empty []"),
        (["--policy", "tova,auto"], "'auto' cannot be evaluated here"),
        (["--stride", "0"], "--stride must be an integer ≥ 1"),
        (["--sinks", "4", "--cache-size", "4"], "leave a window"),
        (["--window", "0"], "--window must be an integer ≥ 1"),
        (["--tokens", "100", "--window", "96"], "after the first eviction"),
        (["--quality", "recall,speed"], "--quality: unknown or empty ['speed']"),
        (["--quality", " , "], "--quality: unknown or empty"),
        (["--quality", "recall", "--recall-distances", "32,far"], "comma-separated integers"),
        (["--quality", "recall", "--recall-distances", "0,32"], "distances ≥ 1"),
        (["--quality", "recall", "--recall-facts", "11"], "--recall-facts must be between 1 and 10"),
        (["--quality", "prompts", "--prompts", "0"], "--prompts must be between 1 and 32"),
        (["--quality", "endless", "--endless-tokens", "0"], "--endless-tokens must be an integer ≥ 1"),
        (["--quality", "prompts", "--answer-tokens", "-3"], "--answer-tokens must be an integer ≥ 1"),
        (["--quality", "endless", "--sinks", "0"], "needs ≥ 1 sink"),
        (["--seed", "3", "--prompts", "4"], "--seed, --prompts apply only with --quality"),
        (["--prompts", "4"], "--prompts applies only with --quality"),
        (["--quality", "endless", "--recall-facts", "3"], "--recall-facts sets the recall measure, which --quality "
                                                          "endless does not run"),
        (["--quality", "recall", "--prompts", "2"], "--prompts sets the prompts measure"),
        (["--quality", "recall,prompts", "--seed", "3"], "--seed sets the endless measure"),
    ]
    for args, message in cases:
        r = cli("builtin:tiny-lm", *args, "--out", out)
        assert r.exit_code == 2, (args, r.output)
        assert message in " ".join(r.output.split()), (args, r.output)
        assert "Traceback" not in r.output
    r = cli("builtin:tiny-lm", "--out", regular)
    assert r.exit_code == 2 and "is an existing file, not a folder" in " ".join(r.output.split())
    assert not out.exists() and regular.read_text() == "x"


def test_cli_leaves_nothing_behind_on_failure_or_interrupt(cli, tmp_path, monkeypatch):
    import sinklab.report.stream_figures as figures
    from sinklab.evaluation import stream as evaluate

    args = ("builtin:tiny-lm", "--tokens", 120, "--window", 28, "--methods", "window")
    monkeypatch.setattr(figures, "render_eval_stream", lambda *a: 1 / 0)  # fails while writing the report
    r = cli(*args, "--out", tmp_path / "a")
    assert r.exit_code != 0 and not (tmp_path / "a").exists()

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(evaluate, "stream_nll", interrupted)  # Ctrl-C during the evaluation
    r = cli(*args, "--out", tmp_path / "b")
    assert r.exit_code == 130 and "interrupted" in r.output and not (tmp_path / "b").exists()
    assert not list(tmp_path.glob(".sinklab-*"))


def test_cli_quality_measures_match_independent_runs(cli, tmp_path):
    """--quality: recall, endless and many prompts in eval-stream's JSON and report, each checked against
    transformers' own generate / a DynamicCache / a plain forward while nothing is evicted (tiny-lm)."""
    import sinklab
    from transformers import DynamicCache

    from sinklab._compat import cache_kwarg_name
    from sinklab.evaluation import quality
    from sinklab.stream.session import sample_token

    out = tmp_path / "q"
    r = cli("builtin:tiny-lm", "--tokens", 120, "--window", 96, "--sinks", 4, "--methods", "sinks", "--quality",
            "recall,endless,prompts", "--recall-distances", "150,4", "--recall-facts", 1, "--endless-tokens", 40,
            "--seed", 5, "--prompts", 2, "--answer-tokens", 6, "--out", out)
    assert r.exit_code == 0, r.output
    assert {"quality_recall.png", "quality_endless.png", "quality_prompts.png"} <= {p.name for p in out.iterdir()}
    q = json.loads((out / "eval_stream.json").read_text())["quality"]
    assert set(q) == {"recall", "endless_s4", "endless_s0", "prompts"}
    html = (out / "report.html").read_text()
    assert "Quality beyond perplexity" in html and quality.PROMPTS[1] in html
    loaded = sinklab.load_model("builtin:tiny-lm")
    model, tok = loaded.model, loaded.tokenizer

    # recall: per-cell accuracy is the share of correct answers; at d = 4 the whole prompt fits every cache
    rec = q["recall"]
    assert rec["distances"] == [4, 150] and rec["num_sinks"] == 4 and rec["window"] == 96
    for m in quality.RECALL_METHODS:
        for i, d in enumerate(rec["distances"]):
            cell = [a for a in rec["answers"] if a["method"] == m and a["distance"] == d]
            assert len(cell) == 1 and rec["accuracy"][m][i] == float(cell[0]["correct"])
    assert len({a["answer"] for a in rec["answers"] if a["distance"] == 4}) == 1

    # endless: prompt + 40 tokens < C = 100, nothing evicted: both runs are seeded sampling with a DynamicCache
    prompt = tok(quality.ENDLESS_PROMPT)["input_ids"]
    gen, cache, tokens, nll = torch.Generator().manual_seed(5), DynamicCache(config=model.config), [], []
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt]), **{cache_kwarg_name(model): cache}).logits[:, -1]
        for _ in range(40):
            t = sample_token(logits, 0.7, 50, gen)
            tokens.append(int(t[0]))
            nll.append(float(-torch.log_softmax(logits[0].double(), -1)[tokens[-1]]))
            logits = model(input_ids=t[:, None], **{cache_kwarg_name(model): cache}).logits[:, -1]
    for name, sinks, window in (("endless_s4", 4, 96), ("endless_s0", 0, 100)):
        run = q[name]
        assert (run["num_sinks"], run["window"], run["tokens"]) == (sinks, window, tokens)
        got = torch.tensor(run["nll"], dtype=torch.float64)
        torch.testing.assert_close(got, torch.tensor(nll, dtype=torch.float64), atol=1e-4, rtol=0)
        grams = list(zip(tokens, tokens[1:], tokens[2:], tokens[3:]))
        assert run["blocks"]["distinct"] == [len(set(grams)) / len(grams)]
        assert run["blocks"]["mean_nll"] == pytest.approx([sum(run["nll"]) / 40], abs=1e-12)

    # prompts: the first answer is the fresh one; both equal greedy generate after the plain chat layout, and
    # the NLL is a plain float64 forward over prompt + answer
    rows = q["prompts"]["rows"]
    assert [row["prompt"] for row in rows] == list(quality.PROMPTS[:2])
    ids = tok(f"User: {quality.PROMPTS[0]}\nAssistant:")["input_ids"]
    stop = [tok.eos_token_id] if tok.eos_token_id is not None else None
    with torch.no_grad():
        gen_ids = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, eos_token_id=stop,
                                 pad_token_id=0)[0, len(ids):].tolist()
        answer = [t for t in gen_ids if t not in (stop or [])]
        logits = model(input_ids=torch.tensor([ids + answer])).logits[0, len(ids) - 1:-1].double()
    ref = float(-torch.log_softmax(logits, -1).gather(1, torch.tensor(answer)[:, None]).mean())
    first = rows[0]
    assert first["evicted_before"] == 0 and first["fresh_tokens"] == first["stream_tokens"] == len(answer)
    assert first["stream_answer"] == first["fresh_answer"] == tok.decode(answer, skip_special_tokens=True)
    assert first["fresh_nll"] == pytest.approx(ref, abs=1e-4) and first["stream_nll"] == pytest.approx(ref, abs=1e-4)


def test_more_tokens_than_the_text_holds_is_refused(tmp_path):
    """--tokens beyond the text used to be cut to the text silently (a long run on the default corpus, or a
    shorter evaluation than asked for); now it is one line before any work."""
    from typer.testing import CliRunner

    from sinklab.cli import app

    text = tmp_path / "short.txt"
    text.write_text("The rule of the code is that every function returns a value. " * 20, encoding="utf-8")
    r = CliRunner().invoke(app, ["eval-stream", "builtin:tiny-lm", "--file", str(text), "--tokens", "100000",
                                 "--window", "12", "--sinks", "4", "--methods", "sinks", "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "--tokens 100000: the text has only" in " ".join(r.output.split()), r.output
    assert not (tmp_path / "o").exists()
