"""Every variant usable everywhere: capture (scan/diagnose), KV-cache generation and SinkCache streaming of
models with a sink logit, kv-bias slot, output gate or register tokens, each against an independent float64
reference; and the sink-logit initialisation (``sink_init``)."""

from __future__ import annotations

import math

import pytest
import torch

import sinklab
from sinklab.capture import AttentionCapture, CaptureConfig
from sinklab.errors import InputError
from sinklab.train import TrainConfig, train
from sinklab.variants import apply_variant

from stream_reference import Reference
from tiny_models import tiny_vit
import variant_cases
from variant_reference import V, naive_forward, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: a second thread only spins

CASES = variant_cases.EVERYWHERE


def variant_model(name: str, seed: int = 0, layers: int = 2):
    model = tiny_llama(layers=layers)
    model.config.max_position_embeddings = 256
    handle = apply_variant(model, name)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # move every new parameter away from its initial value
        for pname, p in model.named_parameters():
            if "sinklab_" in pname:
                p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.7)
    return model.eval(), handle.config


@pytest.mark.parametrize("name", CASES)
def test_capture_matches_naive_float64(name):
    """Column mass, learned-slot mass and the model output under the capture == a naive float64 forward."""
    model, cfg = variant_model(name)
    ids = torch.randint(0, V, (1, 11), generator=torch.Generator().manual_seed(1))
    weights: list = []
    ref_logits = naive_forward(model, ids, cfg, weights)
    with torch.no_grad(), AttentionCapture(model, CaptureConfig(candidates=(0,), map_len=0)) as cap:
        batch = cap.run(full_model=True, input_ids=ids)
    torch.testing.assert_close(cap.last_output.logits.double(), ref_logits, atol=2e-5, rtol=1e-5)
    t = ids.shape[1] + cfg.registers
    assert batch.column_mass.shape[-1] == t and bool(batch.token_mask.all())
    for layer, w in enumerate(weights):  # w: (H, T, T) over the tokens only
        col = torch.stack([w[:, j:, j].mean(-1) for j in range(t)], dim=-1)  # causal: queries i ≥ j see j
        torch.testing.assert_close(batch.column_mass[0, layer].double(), col, atol=2e-6, rtol=1e-5)
        slot = (1.0 - w.sum(-1)).mean(-1)  # (H,) share on the sink logit / kv-bias slot
        torch.testing.assert_close(batch.learned_sink_mass[0, layer].double(), slot, atol=2e-6, rtol=1e-5)
    if cfg.kv_bias or cfg.sink_logit or cfg.softmax1:
        assert float(batch.learned_sink_mass.min()) > 1e-3  # the learned slot really holds mass here


def test_registers_under_capture_keep_the_padding_mask():
    """Registers sit in front of the mask: a right-padded row scans like the same row alone."""
    model, cfg = variant_model("gated+registers")
    ids = torch.randint(0, V, (2, 10), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, 7:] = 0
    n = cfg.registers
    with torch.no_grad(), AttentionCapture(model, CaptureConfig(candidates=(0,), map_len=0)) as cap:
        both = cap.run(input_ids=ids, attention_mask=mask)
        alone = cap.run(input_ids=ids[1:, :7])
    assert both.token_mask.shape == (2, n + 10)
    assert both.token_mask[1].tolist() == [True] * (n + 7) + [False] * 3
    torch.testing.assert_close(both.column_mass[1, ..., : n + 7], alone.column_mass[0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(both.column_queries[1, :, : n + 7], alone.column_queries[0])
    assert both.column_queries[1, 0, n].item() == 7  # the first token is seen by the 7 real queries only


def test_scan_and_diagnose_label_registers(tmp_path):
    """A register model saved and loaded by path: scan and diagnose label the registers reg0… (role
    register) ahead of the tokens, and the token statistics sit after them."""
    loaded = sinklab.models.load_model("builtin:tiny-lm")
    apply_variant(loaded.model, "registers", registers=3)
    sinklab.save(loaded.model, tmp_path / "reg")
    loaded.tokenizer.save_pretrained(str(tmp_path / "reg"))
    again = sinklab.models.load_model(str(tmp_path / "reg"))
    assert sinklab.variants.register_count(again.model) == 3
    scan = sinklab.scan(again.model, again.tokenizer, seq_len=32, samples=2, batch_size=2)
    assert all(t[:3] == ["reg0", "reg1", "reg2"] and len(t) == 35 for t in scan.tokens)
    assert scan.column_mass.shape[-1] == 35 and scan.meta["registers"] == 3
    d = sinklab.diagnose(again.model, again.tokenizer, seq_len=32, samples=2, batch_size=2, edits=False)
    roles = {r.token_index: r.role for r in d.records}
    assert roles and all((role == "register") == (i < 3) for i, role in roles.items())
    code, text = _cli("circuit", tmp_path / "reg", "--seq-len", "32", "--samples", "2", "--out", tmp_path / "c")
    assert code == 2 and "register tokens" in text and not (tmp_path / "c").exists()  # P0 is a register here


@pytest.mark.parametrize("name", variant_cases.KV_CACHE)
def test_kv_cache_generation_matches_full_forwards(name):
    """Prefill + token-by-token decoding with a DynamicCache == full forwards of the whole sequence."""
    model, cfg = variant_model(name)
    ids = torch.randint(0, V, (1, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        cache, logits = out.past_key_values, [out.logits]
        assert cache.get_seq_length() == 9 + cfg.registers  # the registers live in the cache
        seq = ids
        for step in range(5):
            nxt = torch.randint(0, V, (1, 1), generator=torch.Generator().manual_seed(10 + step))
            seq = torch.cat([seq, nxt], 1)
            mask = torch.ones_like(seq)
            pos = torch.tensor([[seq.shape[1] - 1]])  # token positions, as generate() passes them
            logits.append(model(input_ids=nxt, cache=cache, attention_mask=mask, position_ids=pos,
                                cache_position=pos[0], use_cache=True).logits)
        full = model(input_ids=seq, use_cache=False).logits
    torch.testing.assert_close(torch.cat(logits, 1), full, atol=1e-10, rtol=1e-9)
    torch.testing.assert_close(full, naive_forward(model, seq, cfg), atol=1e-10, rtol=1e-9)
    greedy = model.generate(ids, max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)
    seq = ids
    for step in range(6):
        ref = naive_forward(model, seq, cfg)[:, -1]
        torch.testing.assert_close(greedy.logits[step].double(), ref, atol=1e-5, rtol=1e-5)  # float32 scores
        seq = torch.cat([seq, ref.argmax(-1, keepdim=True)], 1)
    assert torch.equal(greedy.sequences, seq)


@pytest.mark.parametrize("name", CASES)
def test_sinkcache_stream_matches_float64_reference(name):
    """SinkCache over a variant model: dense before eviction, == the float64 StreamingLLM reference after."""
    model, cfg = variant_model(name, seed=1)
    sinks, window = cfg.registers + 2, 5
    tokens = torch.randint(0, V, (1, 24), generator=torch.Generator().manual_seed(4))
    first = 5  # first chunk: registers + 5 tokens fit in sinks + window, so no eviction yet
    cache = sinklab.SinkCache(model, num_sinks=sinks, window=window)
    with torch.no_grad():
        chunk = model(input_ids=tokens[:, :first], cache=cache).logits
        torch.testing.assert_close(chunk, model(input_ids=tokens[:, :first], use_cache=False).logits,
                                   atol=2e-5, rtol=1e-4)
        ours = [chunk[0, i] for i in range(first)]
        for i in range(first, tokens.shape[1]):
            ours.append(model(input_ids=tokens[:, i : i + 1], cache=cache).logits[0, -1])
    cache.close()
    ref = Reference(model, sinks, window)
    if cfg.registers:
        ref.feed_registers()
    theirs = [ref.step(int(t)) for t in tokens[0]]
    assert ref.kept(0) == sinks + window  # eviction happened
    torch.testing.assert_close(torch.stack(ours).double(), torch.stack(theirs), atol=5e-5, rtol=1e-4)
    # the variant matters: the bare model's stream is far from it
    bare = Reference(tiny_llama(), sinks, window)
    far = torch.stack([bare.step(int(t)) for t in tokens[0]])
    assert float((far - torch.stack(theirs)).abs().max()) > 1e-2


def test_stream_generate_with_registers_counts_them_as_sinks():
    model, cfg = variant_model("registers")
    ids = torch.randint(0, V, (1, 6), generator=torch.Generator().manual_seed(6))
    with sinklab.SinkCache(model, num_sinks=cfg.registers, window=64) as cache:
        out = model.generate(ids, cache=cache, max_new_tokens=6, do_sample=False)
        assert cache.get_seq_length() == cfg.registers + 11  # registers + prompt + 5 fed back tokens
    assert torch.equal(out, model.generate(ids, max_new_tokens=6, do_sample=False))


# ----------------------------------------------------------------------------- sink_init
def test_sink_init_sets_the_start_and_is_checked():
    model = tiny_llama()
    handle = apply_variant(model, "sink-logit+gated", sink_init=4.0)
    assert all(torch.equal(layer.self_attn.sinklab_sink_logit, torch.full((4,), 4.0, dtype=torch.float64))
               for layer in model.model.layers)
    handle.remove()
    handle = apply_variant(model, "sink-logit")  # default unchanged: 0
    assert float(model.model.layers[0].self_attn.sinklab_sink_logit.detach().abs().max()) == 0.0
    handle.remove()
    with pytest.raises(InputError, match="no sink logit"):
        apply_variant(model, "gated", sink_init=4.0)
    with pytest.raises(InputError, match="finite"):
        apply_variant(model, "sink-logit", sink_init=math.nan)
    with pytest.raises(InputError, match="contradict"):
        apply_variant(model, "sink-logit", init="off", sink_init=1.0)
    with pytest.raises(InputError, match="sink-logit variant"):
        TrainConfig(data="bb", variant="gated", sink_init=4.0)


@pytest.mark.long
def test_sink_init_lets_the_sink_logit_replace_the_bos_sink(tmp_path):
    """Reduced docs/sink_logit.md: BB, one head, 150 steps. From 0 the BOS sink forms (non-trigger queries
    park on BOS); from 4 the learned sink takes that mass (measured 0.79 vs 0.007)."""
    found = {}
    for s0 in (None, 4.0):
        cfg = TrainConfig(data="bb", layers=1, heads=1, width=64, seq_len=32, batch=32, steps=150, warmup=20,
                          variant="sink-logit", sink_init=s0, monitor_every=150)
        summary = train(cfg, tmp_path / f"run{s0}")
        found[s0] = summary["bb"]["bos_attention_non_trigger"]
        model = sinklab.models.load_model(str(tmp_path / f"run{s0}" / "final")).model
        assert sinklab.variants.register_count(model) == 0 and model.config.sinklab_variant["sink_logit"]
    assert found[None] > 0.5 and found[4.0] < 0.1, found


# ----------------------------------------------------------------------------- the CLI, by path
def _cli(*args):
    from typer.testing import CliRunner

    from sinklab.cli import app

    result = CliRunner().invoke(app, [str(a) for a in args])
    return result.exit_code, " ".join(result.output.split())


def test_cli_scans_and_diagnoses_vision_models_by_path(tmp_path):
    """A transformers ViT folder and a sinklab ViT checkpoint with kv-bias + registers, by path: scan and
    diagnose run on the embedded images and label [CLS], reg<i>, patch<i>; text commands refuse clearly."""
    import json

    from sinklab.vit import apply_vit_variant, save_vit

    tiny_vit("vit", image_size=16).save_pretrained(str(tmp_path / "hf"))
    model = tiny_vit("dinov2", image_size=16)
    apply_vit_variant(model, "kv-bias+registers", registers=2)
    save_vit(model, tmp_path / "sl")
    for folder, tokens, registers in ((tmp_path / "hf", 1 + 16, 0), (tmp_path / "sl", 1 + 2 + 16, 2)):
        code, text = _cli("scan", folder, "--samples", "3", "--out", folder / "scan")
        assert code == 0, text
        scan = json.loads((folder / "scan" / "scan.json").read_text())
        assert scan["meta"]["registers"] == registers and "shapes images" in scan["meta"]["corpus"]
        assert len(scan["tokens"][0]) == tokens and scan["tokens"][0][:2] == ["[CLS]", "reg0" if registers else "patch0"]
        code, text = _cli("diagnose", folder, "--samples", "3", "--out", folder / "diag")
        assert code == 0 and (folder / "diag" / "diagnosis.json").is_file(), text
    code, text = _cli("scan", tmp_path / "sl", "--text", "hello", "--out", tmp_path / "x")
    assert code == 2 and "vision transformer" in text and "Traceback" not in text
    code, text = _cli("stream", tmp_path / "sl", "--prompt", "hello")
    assert code == 2 and "vision transformer" in text and "language models" in text


def test_cli_points_a_run_folder_to_its_model(tmp_path):
    code, text = _cli("train", "--data", "bb", "--out", tmp_path / "run", "--layers", "1", "--heads", "1",
                      "--width", "16", "--seq-len", "8", "--batch-size", "4", "--steps", "2", "--variant",
                      "kv-bias", "--monitor-every", "2", "--sink-init", "3")
    assert code == 2 and "sink-logit" in text  # --sink-init needs a sink logit
    code, text = _cli("train", "--data", "bb", "--out", tmp_path / "run", "--layers", "1", "--heads", "1",
                      "--width", "16", "--seq-len", "8", "--batch-size", "4", "--steps", "2", "--variant",
                      "sink-logit", "--monitor-every", "2", "--sink-init", "3")
    assert code == 0, text
    model = sinklab.models.load_model(str(tmp_path / "run" / "final")).model
    assert 2.0 < float(model.model.layers[0].self_attn.sinklab_sink_logit.detach().min()) < 4.0  # from 3, 2 steps
    code, text = _cli("stream", tmp_path / "run", "--prompt", "x")
    assert code == 2 and f"its model is {tmp_path / 'run' / 'final'}" in text


def test_pin_prompt_counts_the_registers():
    """stream_generate(pin_prompt=True) on a register model keeps registers + the whole prompt: == dense greedy."""
    loaded = sinklab.load_model("builtin:tiny-lm")
    apply_variant(loaded.model, "registers", registers=3)
    with torch.no_grad():
        loaded.model.model.sinklab_registers.mul_(50.0)  # registers the model cannot ignore
    prompt = "The first rule of the code is that every function returns a value. The second rule of the code is that"
    ids = loaded.tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        dense = loaded.model.generate(ids, do_sample=False, max_new_tokens=8)
    expected = loaded.tokenizer.decode(dense[0, ids.shape[1]:], skip_special_tokens=True)
    pinned = "".join(sinklab.stream_generate(loaded.model, loaded.tokenizer, prompt, num_sinks=1, window=7,
                                             max_new_tokens=8, pin_prompt=True))
    assert pinned.strip() == expected.strip()
    # the pinned span is counted in stream tokens: registers + prompt (a session pinned on the prompt alone is short)
    t = ids.shape[1]
    short = sinklab.StreamSession(loaded.model, 1, 7, pinned=[(0, t)])
    with pytest.raises(InputError, match=rf"\(0, {t + 3}\)"):
        next(sinklab.stream_generate(loaded.model, loaded.tokenizer, prompt, pin_prompt=True, session=short))
    short.sink.close()


def test_a_switched_off_sink_logit_is_not_a_corrupt_weight():
    """init="off" puts the sink logit at −inf: scan and stream accept it (and equal the bare model); NaN or
    +inf in it is still refused."""
    from sinklab.errors import ModelWeightsError

    model = tiny_llama()
    ids = torch.randint(0, V, (1, 12), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        bare = sinklab.scan_inputs(model, [{"input_ids": ids}], [[str(int(i)) for i in ids[0]]])
        handle = apply_variant(model, "sink-logit", init="off")
        off = sinklab.scan_inputs(model, [{"input_ids": ids}], [[str(int(i)) for i in ids[0]]])
        torch.testing.assert_close(off.column_mass, bare.column_mass)
        with sinklab.StreamSession(model, num_sinks=2, window=4) as s:
            s.feed(ids)
        model.model.layers[1].self_attn.sinklab_sink_logit[0] = float("nan")
        with pytest.raises(ModelWeightsError, match="sinklab_sink_logit"):
            sinklab.scan_inputs(model, [{"input_ids": ids}], [[str(int(i)) for i in ids[0]]])
        model.model.layers[1].self_attn.sinklab_sink_logit[0] = float("inf")
        with pytest.raises(ModelWeightsError, match="sinklab_sink_logit"):
            sinklab.StreamSession(model, num_sinks=2, window=4)
    handle.remove()
