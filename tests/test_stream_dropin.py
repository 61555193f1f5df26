"""``sinklab.SinkCache`` as a drop-in for transformers' removed SinkCache: no ``with`` block, old names, multi-turn
chat, ``pipeline`` and streamers — each checked against the independent float64 reference or another driver."""

from __future__ import annotations

import gc
import threading
import warnings

import pytest
import torch
import transformers as tf
from stream_reference import Reference
from tiny_models import build
from transformers import TextIteratorStreamer, TextStreamer

import sinklab
from sinklab.errors import InputError
from sinklab.stream import SinkCache, StreamSession
from sinklab.stream.attention import ATTN_NAME

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: a second thread only spins

V = 97
WORDS = ("the a cat dog sat on mat ran far away and then it was very happy sad big small red blue tell me story "
         "about day night sun moon tree house").split()


def _gen(model, ids, cache=None, **kwargs):
    """``model.generate`` the way old-SinkCache users call it: ``past_key_values=cache``."""
    kwargs = dict(dict(do_sample=False, pad_token_id=0, eos_token_id=None), **kwargs)
    if cache is not None:
        kwargs["past_key_values"] = cache
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers 5 renamed past_key_values to cache
        return model.generate(ids, **kwargs)


def _tokens(n: int, seed: int = 3) -> torch.Tensor:
    return torch.randint(2, V, (n,), generator=torch.Generator().manual_seed(seed))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def _check_against_reference(model, sequence, logits, start, num_sinks, window):
    """Teacher-force ``sequence`` through the float64 reference; ``logits[k]`` predicted token ``start + k``."""
    ref = Reference(model, num_sinks, window)
    worst = 0.0
    for i, token in enumerate(sequence[: start + len(logits) - 1].tolist()):
        out = ref.step(token)
        if i + 1 >= start:
            worst = max(worst, _rel(logits[i + 1 - start], out))
    return worst


@pytest.fixture(scope="module")
def chat():
    """A tiny random Llama with a word-level tokenizer and a chat template (no files, no hub)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["<pad>", "<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|end|>"]
                                        + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")
    tok = tf.PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                     unk_token="<unk>")
    tok.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    cfg = tf.LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(5)
    model = tf.LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = None  # always max_new_tokens: the random model may say </s> anywhere
    model.generation_config.pad_token_id = 0
    return model, tok


def test_generate_without_a_with_block_just_works_and_is_released():
    model = build("llama-gqa")
    ids = _tokens(10)[None]
    with torch.no_grad():
        dense = model(input_ids=ids).logits
    kw = dict(max_new_tokens=20, output_logits=True, return_dict_in_generate=True)
    cache = sinklab.SinkCache(model, num_sinks=2, window=6)
    out = _gen(model, ids, cache, **kw)  # raised AttributeError 'is_compileable' before
    assert model.config._attn_implementation == ATTN_NAME  # activated on first use
    with SinkCache(model, num_sinks=2, window=6) as other:  # a second cache takes the model over
        assert torch.equal(_gen(model, ids, other, **kw).sequences, out.sequences)
    assert _check_against_reference(model, out.sequences[0], out.logits, 10, 2, 6) < 1e-4
    with torch.no_grad():  # a forward without the cache is the model's own again
        torch.testing.assert_close(model(input_ids=ids).logits, dense, rtol=0, atol=0)
    assert model.config._attn_implementation == "sdpa"
    more = _gen(model, out.sequences, cache, max_new_tokens=5)  # and the stream goes on where it stopped
    assert more.shape[1] == 35
    del cache, out
    gc.collect()
    assert not model.model._forward_pre_hooks and not model.model._forward_hooks  # nothing left on the model
    assert model.config._attn_implementation == "sdpa"
    closed = SinkCache(model, num_sinks=2, window=6)
    closed.close()
    with pytest.raises(InputError, match="closed"):
        _gen(model, ids, closed, max_new_tokens=2)


def test_old_transformers_names_are_aliases():
    """transformers' ``window_length`` was the whole cache (sinks + recent tokens, the new one included)."""
    model = build("qwen2")
    ids = _tokens(8, seed=4)[None]
    with pytest.warns(FutureWarning, match="num_sinks=2, window=6"):
        old = SinkCache(model, window_length=8, num_sink_tokens=2)
    assert (old.state.num_sinks, old.state.window, old.state.capacity) == (2, 6, 8)
    new = SinkCache(model, num_sinks=2, window=6)
    assert torch.equal(_gen(model, ids, old, max_new_tokens=12), _gen(model, ids, new, max_new_tokens=12))
    with pytest.raises(InputError, match="not both"):
        SinkCache(model, window=6, window_length=8)


def _three_turns(model, tok, cache):
    """transformers' own SinkCache test: one cache, three user turns appended to the growing input_ids."""
    prompt = "tell me a story about a cat and a dog on a big red mat"
    input_ids = torch.zeros(1, 0, dtype=torch.long)
    logits, starts = [], []
    for _ in range(3):
        turn = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                       return_tensors="pt")["input_ids"]
        input_ids = torch.cat([input_ids, turn], dim=1)
        starts.append(input_ids.shape[1])
        out = _gen(model, input_ids, cache, max_new_tokens=100, output_logits=True, return_dict_in_generate=True)
        logits.append(out.logits)
        input_ids = out.sequences
    return input_ids, logits, starts


def test_multi_turn_chat_with_and_without_with(chat):
    model, tok = chat
    cache = SinkCache(model, num_sinks=4, window=60)
    seq, logits, starts = _three_turns(model, tok, cache)
    cache.close()
    assert seq.shape[1] > 1.5 * 64 and seq.shape[1] == starts[-1] + 100  # well past the cache size
    with SinkCache(model, num_sinks=4, window=60) as cache:
        again, _, _ = _three_turns(model, tok, cache)
    assert torch.equal(seq, again)
    ref = Reference(model, 4, 60)
    worst = 0.0
    for i, token in enumerate(seq[0, :-1].tolist()):
        out = ref.step(token)
        for turn, start in enumerate(starts):
            if start <= i + 1 < start + 100:
                worst = max(worst, _rel(logits[turn][i + 1 - start][0], out))
    assert worst < 1e-4, worst


def test_pipeline_and_streamers(chat, capsys):
    model, tok = chat
    prompt = "the cat sat on the mat and then it ran far away"
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    with StreamSession(model, num_sinks=2, window=5) as s:  # another driver: greedy by hand
        logits, mine = s.feed(ids), []
        for _ in range(16):
            mine.append(int(logits.argmax(-1)))
            logits = s.step(logits.argmax(-1))
    expected = tok.decode(mine, skip_special_tokens=True)

    pipe = tf.pipeline("text-generation", model=model, tokenizer=tok)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        got = pipe(prompt, past_key_values=SinkCache(model, num_sinks=2, window=5), max_new_tokens=16,
                   do_sample=False, return_full_text=False)[0]["generated_text"]
    assert got.strip() == expected.strip()

    capsys.readouterr()
    _gen(model, ids, SinkCache(model, num_sinks=2, window=5), max_new_tokens=16,
         streamer=TextStreamer(tok, skip_prompt=True, skip_special_tokens=True))
    assert " ".join(capsys.readouterr().out.split()) == " ".join(expected.split())

    streamer = TextIteratorStreamer(tok, skip_prompt=True, skip_special_tokens=True)
    with SinkCache(model, num_sinks=2, window=5) as cache:  # generate() in another thread, as the docs show
        worker = threading.Thread(target=_gen, args=(model, ids, cache), kwargs=dict(max_new_tokens=16, streamer=streamer))
        worker.start()
        live = "".join(streamer)
        worker.join()
    assert " ".join(live.split()) == " ".join(expected.split())


def test_stream_generate_prints_no_special_tokens():
    import sinklab

    loaded = sinklab.load_model("builtin:tiny-lm")
    eos = loaded.tokenizer.eos_token_id
    # Make </s> the argmax at every step: the stream must still print text only.
    hook = loaded.model.lm_head.register_forward_hook(lambda m, i, out: out.index_add(
        -1, torch.tensor([eos]), torch.full((*out.shape[:-1], 1), 1e4)))
    try:
        pieces = list(sinklab.stream_generate(loaded.model, loaded.tokenizer, "Return the value", num_sinks=2,
                                              window=16, max_new_tokens=3, stop_at_eos=False))
    finally:
        hook.remove()
    assert len(pieces) == 3 and pieces == ["", "", ""]
    assert loaded.tokenizer.decode([eos]) == loaded.tokenizer.eos_token != ""  # it would have printed this
