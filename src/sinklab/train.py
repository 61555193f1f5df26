"""``sinklab train``: train a small Llama-style causal LM on CPU with a sink monitor, saving safetensors.

Data: ``pydoc`` (English prose that ships with Python, see :mod:`sinklab.corpus`, with a byte-level BPE
trained on it), a UTF-8 text file, or ``bb`` (the Bigram-Backcopy task). Every run writes into ``out``:
``train_config.json``, ``monitor.jsonl`` (sink metrics vs tokens seen), ``summary.json`` and checkpoints
(``checkpoint-<step>/`` on the schedule and ``final/``) loadable with ``sinklab.load``. The emergence
figure is rendered from ``monitor.jsonl`` by :func:`sinklab.report.monitor_figures.write_emergence`
(``sinklab train`` writes it as ``emergence.png``).

Under ``torchrun`` (``torchrun --standalone --nproc-per-node N -m sinklab train …``, DDP; gloo on CPU) every
rank draws the same global batch of ``batch`` samples and trains on its ``batch / N`` slice, so a step is
the single-process step on the whole batch (gradients averaged over equal slices); the main process
writes every output.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor, nn

from . import _compat, distributed
from .atomic import atomic_dir, write_json
from .errors import InputError, check_int
from .monitor import SinkMonitor

if TYPE_CHECKING:
    from transformers import PreTrainedConfig, PreTrainedModel

__all__ = ["ARCHS", "TrainConfig", "build_model", "train", "bb_metrics"]

ARCHS = ("llama", "qwen3-next")


@dataclass
class TrainConfig:
    """Everything a run needs (each field has a default)."""

    data: str = "pydoc"  # pydoc | bb | path to a UTF-8 text file
    layers: int = 4
    width: int = 128
    heads: int = 4
    kv_heads: int | None = None  # None: as many as heads
    seq_len: int = 64  # tokens per sample, BOS included
    batch: int = 32
    steps: int = 2000
    lr: float = 3e-3
    weight_decay: float = 0.1
    warmup: int = 100
    vocab_size: int = 4096  # BPE size for text data (bb uses its own)
    variant: str | None = None  # e.g. "sink-logit", "gated", "gated+registers" (sinklab.variants)
    arch: str = "llama"  # llama | qwen3-next (transformers' Qwen3-Next: gated attention, attention layers only)
    output_gate: bool = True  # qwen3-next: False holds the gate logits at 0 (σ = ½ everywhere: no gate)
    sink_init: float | None = None  # start of the learned sink logit (sink-logit variants; None: 0)
    seed: int = 0
    checkpoint_every: int = 0  # 0: only the final checkpoint
    monitor_every: int = 100
    max_chars: int | None = None  # cap the text corpus (None: all of it)
    bb_vocab: int = 64
    bb_triggers: int = 3

    def __post_init__(self) -> None:
        for name in ("layers", "width", "heads", "seq_len", "batch", "steps", "monitor_every"):
            check_int(name, getattr(self, name), 1)
        if self.width % self.heads:
            raise InputError(f"width {self.width} is not a multiple of heads {self.heads}")
        if self.seq_len < 3:
            raise InputError("seq_len must be ≥ 3")
        if not (self.lr > 0 and self.weight_decay >= 0):
            raise InputError("lr must be > 0 and weight_decay ≥ 0")
        for name in ("warmup", "checkpoint_every"):
            check_int(name, getattr(self, name), 0)
        if self.max_chars is not None:
            check_int("max_chars", self.max_chars, 1, " (or None for the whole corpus)")
        if self.sink_init is not None and (not self.variant or "sink-logit" not in self.variant.split("+")):
            raise InputError("sink_init needs a sink-logit variant (e.g. variant='sink-logit')")
        if self.sink_init is not None and not math.isfinite(self.sink_init):
            raise InputError(f"sink_init must be a finite number, got {self.sink_init!r}")
        if self.kv_heads is not None and (check_int("kv_heads", self.kv_heads, 1) and self.heads % self.kv_heads):
            raise InputError(f"kv_heads {self.kv_heads} must be ≥ 1 and divide heads {self.heads}")
        if self.arch not in ARCHS:
            raise InputError(f"arch {self.arch!r} is not one of {', '.join(ARCHS)}")
        if self.arch != "qwen3-next" and not self.output_gate:
            raise InputError("output_gate=False needs arch='qwen3-next' (the Llama model has no output gate; "
                             "sinklab's own gate is variant='gated')")
        if self.arch == "qwen3-next" and self.variant:
            raise InputError("variants apply to arch='llama'; Qwen3-Next has its own output gate (output_gate)")


def build_model(cfg: TrainConfig, vocab: int, bos_id: int | None, eos_id: int | None, pad_id: int | None) -> nn.Module:
    """The configured causal LM, seeded: a Llama-style model (RoPE, RMSNorm, SwiGLU), or transformers' Qwen3-Next with
    every layer softmax attention, a dense MLP and its query-dependent sigmoid output gate (``arch="qwen3-next"``)."""
    common: dict[str, Any]
    common = dict(vocab_size=vocab, hidden_size=cfg.width, intermediate_size=4 * cfg.width,
                  num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads,
                  num_key_value_heads=cfg.kv_heads or cfg.heads, max_position_embeddings=max(2048, cfg.seq_len),
                  tie_word_embeddings=True, bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id)
    config: PreTrainedConfig
    cls: type[PreTrainedModel]
    if cfg.arch == "qwen3-next":
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        config = Qwen3NextConfig(**common, head_dim=cfg.width // cfg.heads, layer_types=["full_attention"] * cfg.layers,
                                 mlp_only_layers=list(range(cfg.layers)), initializer_range=0.02)
        config.sinklab_output_gate = cfg.output_gate
        cls = Qwen3NextForCausalLM
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        config, cls = LlamaConfig(**common), LlamaForCausalLM
    config.sinklab_trained_positions = cfg.seq_len  # RoPE runs longer than this warn (sinklab.models.max_positions)
    _compat.set_config_attention(config, "sdpa")
    torch.manual_seed(cfg.seed)
    model = cls(config)  # type: ignore[arg-type]  # each class gets its own config class
    if cfg.arch == "qwen3-next" and not cfg.output_gate:
        hold_output_gate_shut(model, cfg.heads, cfg.width // cfg.heads)
    if cfg.variant:
        from .variants import apply_variant

        apply_variant(model, cfg.variant, sink_init=cfg.sink_init)
    return model


def hold_output_gate_shut(model: nn.Module, heads: int, head_dim: int) -> None:
    """Qwen3-Next without its output gate, on the same architecture: the gate half of every ``q_proj`` row block is set
    to 0 and its gradient masked, so ``σ(gate) = ½`` for every query (a constant the output projection absorbs).
    AdamW's decoupled weight decay keeps a zero at zero, so the rows stay 0 through training."""
    for layer in _compat.find_layers(model):
        q_proj = cast(nn.Linear, layer.get_submodule("self_attn.q_proj"))
        weight = q_proj.weight  # [heads · 2 · head_dim, width]: per head, query rows then gate rows
        keep = torch.ones(heads, 2, head_dim, 1, dtype=weight.dtype)
        keep[:, 1] = 0
        keep = keep.reshape(-1, 1)
        with torch.no_grad():
            weight.mul_(keep)
        weight.register_hook(lambda grad, keep=keep: grad * keep.to(grad.device, grad.dtype))
        bias = q_proj.bias
        if bias is not None:
            with torch.no_grad():
                bias.mul_(keep[:, 0])
            bias.register_hook(lambda grad, keep=keep[:, 0]: grad * keep.to(grad.device, grad.dtype))


def _text_data(cfg: TrainConfig):
    from .corpus import stdlib_corpus, token_stream, train_tokenizer

    if cfg.data == "pydoc":
        texts = stdlib_corpus(cfg.max_chars)
    else:
        path = Path(cfg.data)
        if not path.is_file():
            raise InputError(f"data {cfg.data!r} is neither 'pydoc', 'bb' nor a readable text file")
        texts = [p for p in path.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    tokenizer = train_tokenizer(texts, cfg.vocab_size)
    stream = token_stream(tokenizer, texts)
    if stream.numel() < cfg.seq_len + 1:
        raise InputError(f"the corpus has {stream.numel()} tokens, fewer than one sequence of {cfg.seq_len}")
    bos = tokenizer.bos_token_id

    def sample(batch: int, gen: torch.Generator) -> Tensor:
        starts = torch.randint(0, stream.numel() - cfg.seq_len, (batch,), generator=gen)
        body = torch.stack([stream[s : s + cfg.seq_len - 1] for s in starts.tolist()])
        return torch.cat([torch.full((batch, 1), bos, dtype=torch.long), body], dim=1)

    return tokenizer, sample, len(tokenizer), stream.numel()


def bb_metrics(model: nn.Module, task, probe: Tensor) -> dict:
    """Bigram-Backcopy signatures: attention to BOS from non-trigger vs trigger queries, copy attention, BOS value."""
    from .capture import AttentionCapture, CaptureConfig

    with torch.no_grad(), AttentionCapture(model, CaptureConfig(candidates=(0,), map_len=probe.shape[1])) as cap:
        rows = []
        for i in range(probe.shape[0]):  # sample by sample: the attention map of each (seq_len ≤ map_len)
            b = cap.run(input_ids=probe[i : i + 1])
            rows.append((b.attention_maps[0, 0], b.value_norm_out[0, 0, 0]))  # type: ignore[index]  # map_len > 0
    trig = task.is_trigger(probe)
    to_bos, copy_att, non_trig_bos, ratio = [], [], [], []
    for i, (amap, vnorm) in enumerate(rows):
        q = torch.arange(2, probe.shape[1])
        is_t = trig[i, q]
        non_trig_bos.append(amap[q[~is_t], 0])
        to_bos.append(amap[q[is_t], 0])
        copy_att.append(amap[q[is_t], q[is_t] - 1])
        ratio.append(float(vnorm[0] / vnorm[1:].mean()))
    cat = lambda xs: torch.cat(xs).double().mean().item() if sum(x.numel() for x in xs) else float("nan")  # noqa: E731
    return {"bos_attention_non_trigger": cat(non_trig_bos), "bos_attention_trigger": cat(to_bos),
            "copy_attention_trigger": cat(copy_att), "bos_value_norm_ratio_out": sum(ratio) / len(ratio),
            "trigger_share": float(trig[:, 1:].double().mean())}


def train(cfg: TrainConfig, out: str | Path, progress: Callable[[int, float], None] | None = None,
          phase: Callable[[str], None] | None = None) -> dict:
    """Train, monitor and checkpoint; returns a summary (also written to ``out/summary.json``).

    ``progress(step, loss)`` after every step; ``phase(name)`` when a stage starts ("training the tokenizer",
    "training", "measuring"). ``out`` is created only once the data is ready, so bad data leaves nothing;
    checkpoints written before an error or Ctrl-C stay (a run can be inspected or continued from them).
    """
    from .checkpoint import save

    phase = phase or (lambda name: None)
    out = Path(out)
    world, rank, main = distributed.world_size(), distributed.rank(), distributed.is_main()
    if cfg.batch % world:
        raise InputError(f"batch {cfg.batch} does not split over {world} processes: give a multiple of {world}")
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    tokenizer, task = None, None
    if cfg.data == "bb":
        from .synth.bigram_backcopy import BigramBackcopy

        task = BigramBackcopy(vocab=cfg.bb_vocab, triggers=cfg.bb_triggers, seq_len=cfg.seq_len, seed=cfg.seed)
        sample, vocab, corpus_tokens = task.sample, cfg.bb_vocab + 1, None
        model = build_model(cfg, vocab, task.bos, None, None)
    else:
        phase("training the tokenizer")
        tokenizer, sample, vocab, corpus_tokens = _text_data(cfg)
        model = build_model(cfg, vocab, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    if main:
        write_json(out / "train_config.json", asdict(cfg))
    probe = sample(8, torch.Generator().manual_seed(cfg.seed + 99))
    monitor = SinkMonitor(model, {"input_ids": probe}, every=cfg.monitor_every, path=out / "monitor.jsonl")
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "sinklab_" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2 or "sinklab_" in n]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / max(1, cfg.warmup)) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / cfg.steps))))
    trained = distributed.data_parallel(model)  # DDP under a launcher (gradients averaged), else the model
    model.train()
    phase("training")
    tokens = 0
    start = time.perf_counter()
    loss_value = float("nan")
    for step in range(1, cfg.steps + 1):
        batch = sample(cfg.batch, gen)  # the same global batch on every rank; each trains on its slice
        part = batch.chunk(world)[rank]
        # LlamaForCausalLM shifts the labels itself: pass the inputs, not pre-shifted targets.
        loss = trained(input_ids=part, labels=part, use_cache=False).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        schedule.step()
        tokens += batch.numel()
        loss_value = distributed.all_reduce(loss.detach()).item() / world  # mean over equal slices
        if not math.isfinite(loss_value):
            raise InputError(f"training diverged at step {step} (loss {loss_value}); lower --lr")
        monitor.step(step, loss=loss_value, tokens=tokens, force=step == cfg.steps)
        if progress:
            progress(step, loss_value)
        if main and cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and step != cfg.steps:
            _checkpoint(model, tokenizer, out / f"checkpoint-{step}", save)
    model.eval()
    phase("measuring")
    summary = {"steps": cfg.steps, "tokens": tokens, "seconds": time.perf_counter() - start, "final_loss": loss_value,
               "corpus_tokens": corpus_tokens, "world_size": world}
    if not main:  # the main process writes the checkpoint and the summary
        return summary
    final = _checkpoint(model, tokenizer, out / "final", save)
    summary.update(last=monitor.records[-1], checkpoint=str(final))
    if task is not None:
        summary["bb"] = bb_metrics(model, task, sample(16, torch.Generator().manual_seed(cfg.seed + 7)))
    write_json(out / "summary.json", summary)
    return summary


def _checkpoint(model: nn.Module, tokenizer, path: Path, save) -> Path:
    """Write a checkpoint folder atomically (a temporary sibling renamed into place): never half a checkpoint."""
    with atomic_dir(path, replace=True) as tmp:
        save(model, tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
    return path
