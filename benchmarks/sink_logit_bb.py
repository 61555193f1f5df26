"""Why a learned sink logit does not replace the BOS sink on Bigram-Backcopy — and when it does.

Trains the one-layer, one-head Bigram-Backcopy model (``sinklab train --data bb`` settings: width 64,
seq 32, batch 32, lr 3e-3, AdamW, warm-up + cosine) with

* ``baseline`` — plain softmax;
* ``sink-logit`` — a learned per-head sink logit (init 0) — and with init 4, and with 30× lr on the logit;
* ``sink-logit + o_proj bias`` — the same with biases on the attention projections (``attention_bias``),
  so a constant update no longer needs a value to carry it;
* ``kv-bias`` — a learned key *and value* slot (Sun et al.), i.e. a sink that can carry a value;

and, as the contrast, the synthetic NOP task (whose damped queries want exactly a zero update) with and
without a learned sink logit. For each run it logs, every ``--log-every`` steps: the attention non-trigger
queries give BOS, the mass they give the learned sink, the sink logit, the BOS output-space value-norm
ratio; and at the end the RMS change of the outputs when the BOS value is zeroed (for non-trigger queries).

Usage: ``python benchmarks/sink_logit_bb.py --steps 800 --out benchmarks/results/sink_logit_bb``
(writes ``sink_logit_bb.json`` and ``sink_logit_bb.png``).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
from torch import nn

from sinklab.synth.bigram_backcopy import BigramBackcopy
from sinklab.variants import apply_variant
from sinklab.atomic import write_json
from sinklab.report.figures import save_png


def build(kind: str, vocab: int, width: int, seed: int, attention_bias: bool, sink_init: float = 0.0) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=width, intermediate_size=4 * width, num_hidden_layers=1,
                         num_attention_heads=1, num_key_value_heads=1, max_position_embeddings=2048,
                         tie_word_embeddings=True, attention_bias=attention_bias)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    if kind != "baseline":  # the shipped option: apply_variant(..., sink_init=…) (sinklab train --sink-init)
        apply_variant(model, kind, sink_init=sink_init if "sink-logit" in kind.split("+") else None)
    return model


@torch.no_grad()
def probe(model: nn.Module, task: BigramBackcopy, x: torch.Tensor) -> dict:
    """Attention of non-trigger queries to BOS and to the learned sink; BOS value ratio; zero-BOS-value effect."""
    attn = model.model.layers[0].self_attn
    captured = {}

    def grab(module, args, kwargs, output):
        captured["q"] = kwargs.get("hidden_states", args[0] if args else None)

    h = attn.register_forward_hook(grab, with_kwargs=True)
    hook_in = attn.register_forward_pre_hook(lambda m, a, k: captured.__setitem__("x", k.get("hidden_states", a[0] if a else None)),
                                             with_kwargs=True)
    model(input_ids=x, use_cache=False)
    h.remove()
    hook_in.remove()
    xn = captured["x"]  # (B, T, d) normalised block input
    b, t, _ = xn.shape
    pos = torch.arange(t)[None].expand(b, t)
    cos, sin = model.model.rotary_emb(xn, pos)
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    q = attn.q_proj(xn).view(b, t, 1, -1).transpose(1, 2)  # (B, 1, T, dh)
    k = attn.k_proj(xn).view(b, t, 1, -1).transpose(1, 2)
    v = attn.v_proj(xn).view(b, t, 1, -1).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    scale = q.shape[-1] ** -0.5
    scores = (q @ k.transpose(-1, -2))[:, 0] * scale  # (B, T, T)
    scores = scores.masked_fill(torch.triu(torch.ones(t, t, dtype=torch.bool), 1), -math.inf)
    extra = []
    variant = getattr(attn, "sinklab_variant", None)
    if variant is not None and variant.sink_logit:
        extra.append(attn.sinklab_sink_logit.view(1, 1, 1).expand(b, t, 1))
    if variant is not None and variant.kv_bias:
        kb = attn.sinklab_k_bias[0]
        extra.append(((q[:, 0] @ kb) * scale)[..., None])
    full = torch.cat([*extra, scores], -1).softmax(-1)  # (B, T, E + T)
    e = len(extra)
    trig = task.is_trigger(x)
    rows = (~trig) & (torch.arange(t)[None] >= 2)  # non-trigger queries (their next token is a bigram draw)
    u = v[:, 0] @ attn.o_proj.weight.T  # (B, T, d) output-space values
    ratio = float((u[:, 0].norm(dim=-1) / u[:, 1:].norm(dim=-1).mean(-1)).mean())
    return {
        "bos_attention_non_trigger": float(full[..., e][rows].mean()),
        "learned_slot_mass_non_trigger": float(full[..., :e].sum(-1)[rows].mean()) if e else 0.0,
        "bos_value_norm_ratio_out": ratio,
        "sink_logit": float(attn.sinklab_sink_logit) if variant is not None and variant.sink_logit else None,
        "loss": None,
    }


def train_bb(kind: str, *, steps: int, seed: int, lr: float = 3e-3, sink_lr_mult: float = 1.0, sink_init: float = 0.0,
             attention_bias: bool = False, log_every: int = 50, width: int = 64, seq_len: int = 32,
             batch: int = 32) -> dict:
    task = BigramBackcopy(vocab=64, triggers=3, seq_len=seq_len, seed=seed)
    model = build(kind, 65, width, seed, attention_bias, sink_init)
    sink = [p for n, p in model.named_parameters() if "sinklab_sink_logit" in n]
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "sinklab_" not in n]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2 and "sinklab_sink_logit" not in n]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    if sink:
        groups.append({"params": sink, "weight_decay": 0.0, "lr_mult": sink_lr_mult})
    opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(seed)
    x_probe = task.sample(32, torch.Generator().manual_seed(seed + 99))
    log = []
    model.train()
    for step in range(1, steps + 1):
        f = min(1.0, step / 100) * 0.5 * (1 + math.cos(math.pi * step / steps))
        for g in opt.param_groups:
            g["lr"] = lr * f * g.get("lr_mult", 1.0)
        batch_ids = task.sample(batch, gen)
        loss = model(input_ids=batch_ids, labels=batch_ids, use_cache=False).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % log_every == 0 or step == steps:
            model.eval()
            row = probe(model, task, x_probe)
            row.update(step=step, loss=float(loss.detach()))
            log.append(row)
            model.train()
    model.eval()
    return {"kind": kind, "seed": seed, "sink_lr_mult": sink_lr_mult, "sink_init": sink_init,
            "attention_bias": attention_bias, "final": log[-1], "log": log}


def nop_task(sink: bool, steps: int, seed: int, sink_init: float = 0.0) -> dict:
    """The synthetic NOP task with and without a learned sink logit on its one head (no BOS change otherwise)."""
    from sinklab import _compat
    from sinklab.synth import NopTask
    from sinklab.synth.model import SynthConfig, SynthModel, fit
    from sinklab.variants import ATTN_NAME, VariantConfig, variant_attention

    task = NopTask(d=32, n=16, seed=seed)
    torch.manual_seed(seed)
    model = SynthModel(SynthConfig(hidden_size=32, seq_len=16, bos=True, positions=True, mlp=False))
    attn = model.layers[0].attn
    if sink:
        attn.sinklab_variant = VariantConfig(sink_logit=True)
        attn.sinklab_sink_logit = nn.Parameter(torch.full((1,), sink_init))
        _compat.register_attention(ATTN_NAME, variant_attention)
        model.config._attn_implementation = ATTN_NAME
    fit(model, task.sample, steps=steps, batch=128, seed=seed)
    x, _, _ = task.sample(64, torch.Generator().manual_seed(seed + 1))
    damped = ~task.active(x)
    with torch.no_grad():
        h = model.layers[0].ln1(torch.cat([model.bos.expand(64, 1, -1), x], 1) + model.pos)
        q, k = attn.q_proj(h), attn.k_proj(h)
        s = q @ k.transpose(1, 2) / math.sqrt(32)  # (B, 1 + N, 1 + N)
        if sink:
            s = torch.cat([attn.sinklab_sink_logit.view(1, 1, 1).expand(64, 17, 1), s], -1)
        a = s.softmax(-1)
    e = int(sink)
    return {"sink": sink, "sink_init": sink_init, "bos_attention_damped": float(a[:, 1:, e][damped].mean()),
            "sink_mass_damped": float(a[:, 1:, 0][damped].mean()) if sink else 0.0,
            "sink_logit": float(attn.sinklab_sink_logit.detach()) if sink else None}


def figure(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.4))
    for r in results:
        label = f"{r['kind']} init {r['sink_init']:g} lr×{r['sink_lr_mult']:g}{' +attn bias' if r['attention_bias'] else ''}"
        steps = [x["step"] for x in r["log"]]
        axes[0].plot(steps, [x["bos_attention_non_trigger"] for x in r["log"]], label=label)
        axes[1].plot(steps, [x["learned_slot_mass_non_trigger"] for x in r["log"]], label=label)
        axes[2].plot(steps, [x["bos_value_norm_ratio_out"] for x in r["log"]], label=label)
    axes[0].set_title("BOS attention (non-trigger queries)")
    axes[1].set_title("mass on the learned slot (non-trigger)")
    axes[2].set_title("BOS value-norm ratio (output space)")
    for ax in axes:
        ax.set_xlabel("step")
    axes[0].legend(fontsize=6)
    fig.tight_layout()
    save_png(fig, path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/sink_logit_bb"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    runs = [("baseline", {}), ("sink-logit", {}), ("sink-logit", {"sink_init": 4.0}),
            ("sink-logit", {"sink_lr_mult": 30.0}), ("sink-logit", {"attention_bias": True}),
            ("sink-logit", {"attention_bias": True, "sink_init": 4.0}), ("kv-bias", {})]
    results = []
    t0 = time.time()
    for kind, kw in runs:
        results.append(train_bb(kind, steps=args.steps, seed=args.seed, **kw))
        f = results[-1]["final"]
        print(f"{kind:10s} {kw} loss {f['loss']:.3f} BOS {f['bos_attention_non_trigger']:.3f} "
              f"slot {f['learned_slot_mass_non_trigger']:.3f} logit {f['sink_logit']} ratio {f['bos_value_norm_ratio_out']:.3f} "
              f"({time.time() - t0:.0f} s)", flush=True)
    nop = [nop_task(False, 600, args.seed), nop_task(True, 600, args.seed), nop_task(True, 600, args.seed, 4.0)]
    for r in nop:
        print("NOP task", r, flush=True)
    write_json((args.out / "sink_logit_bb.json"), {"bb": results, "nop_task": nop})
    figure(results, args.out / "sink_logit_bb.png")


if __name__ == "__main__":
    main()
