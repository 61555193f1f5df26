"""One process of the 2-rank job that tests/test_distributed.py launches with torchrun (gloo, CPU).

Several checks share one launch (process start-up with torch + transformers costs seconds): each writes
what the test compares into the folder ``argv[1]``; the single-process references are computed by the test.

1. ``scan`` of builtin:tiny-lm split over the ranks (library), the ``sinklab scan`` command in-process, and
   ``diagnose`` (statistics split by batch, causal edits split by head);
2. ``sinklab train`` (DDP) in-process, as ``torchrun -m sinklab train`` runs it;
3. SinkMonitor through a transformers ``Trainer`` (DDP, gradient accumulation 2) — weights kept per record;
4. SinkMonitor in a plain loop on an FSDP2 model (``fully_shard``) — full weights kept per record;
5. a rank whose weights hold a NaN: every rank must raise (rank 0 a DistributedError);
6. rank 1 hangs: rank 0's collective must time out (``SINKLAB_DIST_TIMEOUT`` = 3 s) and the job end.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import transformers as tf

from sinklab import distributed, load_model
from sinklab.diagnose import diagnose
from sinklab.monitor import SinkMonitor, SinkMonitorCallback
from sinklab.scan import _PER_SAMPLE as PER_SAMPLE
from sinklab.scan import scan

def tiny_llama() -> tf.LlamaForCausalLM:
    cfg = tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=64)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(cfg)


#: How long rank 1 "hangs" in check 6 (far longer than the 3 s timeout; torchrun ends it sooner).
JOB_HANG_S = 600

#: The monitor's probe batch (32 tokens: long enough for Sink^ε to mean something).
PROBE = {"input_ids": torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(7))}

#: The scan / diagnose settings of check 1 (3 batches: rank 0 takes samples 0–3, rank 1 samples 4–5).
SCAN_ARGS = {"seq_len": 32, "samples": 6, "batch_size": 2}


def cli_args() -> list[str]:
    """:data:`SCAN_ARGS` as ``sinklab scan`` options."""
    return [x for k, v in SCAN_ARGS.items() for x in (f"--{k.replace('_', '-')}", str(v))]


def check_scan(out: Path, rank: int) -> None:
    loaded = load_model("builtin:tiny-lm")
    result = scan(loaded.model, loaded.tokenizer, **SCAN_ARGS)
    torch.save({**{name: getattr(result, name) for name in PER_SAMPLE}, "attention_maps": result.attention_maps,
                "meta": result.meta["distributed"]}, out / f"scan-{rank}.pt")
    from sinklab.cli import app

    app(["scan", "builtin:tiny-lm", *cli_args(), "--out", str(out / "cli-scan")], standalone_mode=False)
    d = diagnose(loaded.model, loaded.tokenizer, **SCAN_ARGS, edit_samples=2)
    if distributed.is_main():
        (out / "diagnosis.json").write_text(json.dumps(d.to_json()))


#: ``sinklab train`` options of check 2b (Bigram-Backcopy: no tokenizer to train).
TRAIN_ARGS = {"data": "bb", "layers": 2, "width": 32, "heads": 4, "seq_len": 16, "batch": 4, "steps": 4,
              "monitor_every": 2, "warmup": 1}


def check_train_cli(out: Path, rank: int) -> None:
    """``sinklab train`` in-process under the launcher (what ``torchrun -m sinklab train`` runs)."""
    from sinklab.cli import app

    args = [x for k, v in TRAIN_ARGS.items() for x in (f"--{k.replace('_', '-').replace('batch', 'batch-size')}", str(v))]
    app(["train", *args, "--out", str(out / "train")], standalone_mode=False)


def check_trainer_ddp(out: Path, rank: int) -> None:
    model = tiny_llama()
    data = [{"input_ids": x, "labels": x} for x in torch.randint(0, 64, (16, 32), generator=torch.Generator().manual_seed(3))]
    monitor = SinkMonitor(model, PROBE, every=2, path=out / "ddp" / "monitor.jsonl")

    class KeepWeights(tf.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % 2 == 0 and distributed.is_main():
                torch.save(model.state_dict(), out / "ddp" / f"weights-{state.global_step}.pt")

    args = tf.TrainingArguments(output_dir=str(out / "trainer"), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                                max_steps=4, learning_rate=1e-2, logging_steps=1, report_to=[], save_strategy="no",
                                use_cpu=True, ddp_backend="gloo", ddp_find_unused_parameters=False, disable_tqdm=True, seed=0,
                                include_num_input_tokens_seen=True)
    trainer = tf.Trainer(model=model, args=args, train_dataset=data,
                         callbacks=[SinkMonitorCallback(monitor), KeepWeights()])
    trainer.train()
    (out / "ddp" / f"records-{rank}.json").write_text(json.dumps(monitor.records))


def check_fsdp(out: Path, rank: int) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    model = tiny_llama()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    monitor = SinkMonitor(model, PROBE, every=2, path=out / "fsdp" / "monitor.jsonl")
    gen = torch.Generator().manual_seed(11 + rank)
    for step in range(1, 5):
        batch = torch.randint(0, 64, (2, 32), generator=gen)
        model(input_ids=batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad()
        monitor.step(step, tokens=step * 2 * 2 * 32)
        if step % 2 == 0:  # a collective: every rank takes part, the main process saves
            full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
            if distributed.is_main():
                torch.save(full, out / "fsdp" / f"weights-{step}.pt")
    (out / "fsdp" / f"records-{rank}.json").write_text(json.dumps(monitor.records))


def check_failure(out: Path, rank: int) -> None:
    from sinklab.scan import scan_inputs

    model = tiny_llama()
    if rank == 1:
        with torch.no_grad():
            model.model.layers[0].mlp.up_proj.weight[0, 0] = float("nan")
    try:
        scan_inputs(model, [PROBE, PROBE], [[""] * 32] * 8)
        outcome = "no error"
    except Exception as exc:  # noqa: BLE001 - the outcome is what the test checks
        outcome = f"{type(exc).__name__}: {exc}"
    (out / f"failure-{rank}.txt").write_text(outcome)


def main() -> None:
    out = Path(sys.argv[1])
    distributed.init()
    rank = distributed.rank()
    for name in ("ddp", "fsdp"):
        (out / name).mkdir(parents=True, exist_ok=True)
    for check in (check_scan, check_train_cli, check_trainer_ddp, check_fsdp, check_failure):
        try:
            check(out, rank)
        except Exception:
            (out / f"crash-{check.__name__}-{rank}.txt").write_text(traceback.format_exc())
            raise
    # 6. rank 1 hangs outside sinklab; rank 0 waits in a collective and must time out, not wait forever.
    if rank == 1:
        time.sleep(JOB_HANG_S)  # torchrun stops this rank once rank 0 exits with an error
    os.environ[distributed.TIMEOUT_ENV] = "3"
    start = time.perf_counter()
    try:
        distributed.all_reduce(torch.ones(1))
        outcome = "no error"
    except distributed.DistributedError as exc:
        outcome = f"DistributedError after {time.perf_counter() - start:.1f} s: {exc}"
    (out / "hang-0.txt").write_text(outcome)
    raise SystemExit(f"rank 0 stops: {outcome}")


if __name__ == "__main__":
    main()
