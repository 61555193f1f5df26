"""sinklab under torchrun (2 CPU processes, gloo): split scan / diagnose, the monitor under DDP and FSDP2, failures.

One torchrun job (tests/distributed_worker.py) runs every multi-process check; each test here compares one
of its outputs with the single-process result computed in this process on the same weights and inputs.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from distributed_worker import PROBE, SCAN_ARGS, TRAIN_ARGS, tiny_llama
from sinklab import distributed, load_model
from sinklab.cli import app
from sinklab.diagnose import diagnose
from sinklab.monitor import SinkMonitor
from sinklab.scan import _PER_SAMPLE, scan

HERE = Path(__file__).resolve().parent
#: Collective timeout inside the job, and the most the whole job may take (a hang fails the test, not the suite).
JOB_TIMEOUT_S, JOB_LIMIT_S = 60, 240
pytestmark = pytest.mark.long  # one torchrun job of two processes, set up by the first test


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent / "src"), str(HERE), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", distributed.TIMEOUT_ENV: str(JOB_TIMEOUT_S)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(HERE / "distributed_worker.py"), str(out)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=JOB_LIMIT_S, check=False)
    crashes = {p.name: p.read_text() for p in out.glob("crash-*")}
    assert not crashes, crashes
    assert (out / "failure-0.txt").exists(), proc.stderr[-4000:]  # the job got through every check
    return out, proc, time.perf_counter() - start


@pytest.fixture(scope="module")
def tiny_lm():
    return load_model("builtin:tiny-lm")


def _close(a, b, rel: float, path: str = "") -> None:
    """Nested JSON values equal: strings/ints/None exactly, floats within ``rel`` relative (NaN == NaN)."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _close(a[k], b[k], rel, f"{path}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _close(x, y, rel, f"{path}[{i}]")
    elif isinstance(a, float) and not isinstance(b, str):
        assert (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=rel, abs_tol=rel), (path, a, b)
    else:
        assert a == b, (path, a, b)


def _expected_split(samples: int, batch_size: int, world: int) -> dict:
    """The documented split, written out here: batches of ``batch_size`` in order; rank r takes the whole batches
    whose first sample falls in the r-th 1/world of the samples (docs/distributed.md)."""
    firsts = list(range(0, samples, batch_size))
    owner = [min(world - 1, first * world // samples) for first in firsts]
    batches = [[owner.index(r), len(owner) - owner[::-1].index(r)] for r in range(world)]
    ends = [min(samples, f + batch_size) for f in firsts]
    return {"batches_per_rank": batches,
            "samples_per_rank": [[firsts[a], ends[b - 1]] for a, b in batches]}


def test_expected_split_helper():
    assert _expected_split(6, 2, 2) == {"batches_per_rank": [[0, 2], [2, 3]], "samples_per_rank": [[0, 4], [4, 6]]}
    assert _expected_split(7, 2, 2) == {"batches_per_rank": [[0, 2], [2, 4]], "samples_per_rank": [[0, 4], [4, 7]]}


def test_scan_split_over_two_ranks_equals_one_process(job, tiny_lm):
    out, _, _ = job
    single = scan(tiny_lm.model, tiny_lm.tokenizer, **SCAN_ARGS)
    for rank in (0, 1):  # every rank returns the whole result
        got = torch.load(out / f"scan-{rank}.pt")
        meta = dict(got["meta"])
        assert isinstance(meta.pop("split"), str)  # a description of the rule
        assert meta == {"world_size": 2, **_expected_split(SCAN_ARGS["samples"], SCAN_ARGS["batch_size"], 2)}
        for name in (*_PER_SAMPLE, "attention_maps"):
            torch.testing.assert_close(got[name], getattr(single, name), rtol=1e-6, atol=0, equal_nan=True, msg=name)
    # `sinklab scan` under torchrun wrote one scan.json equal to one process's, number by number.
    one = json.loads(json.dumps(single.to_json()))
    two = json.loads((out / "cli-scan" / "scan.json").read_text())
    assert two["meta"]["distributed"]["world_size"] == 2 and "distributed" not in one["meta"]
    assert {k: v for k, v in one.items() if k != "meta"} == {k: v for k, v in two.items() if k != "meta"}
    for key in ("thresholds", "seq_len", "num_samples", "warnings", "output_space"):  # (the rest: provenance)
        assert one["meta"][key] == two["meta"][key]


def test_diagnose_split_over_two_ranks_equals_one_process(job, tiny_lm):
    out, _, _ = job
    single = diagnose(tiny_lm.model, tiny_lm.tokenizer, **SCAN_ARGS, edit_samples=2).to_json()
    split = json.loads((out / "diagnosis.json").read_text())
    assert split["meta"].pop("distributed")["world_size"] == 2
    assert len(single["edits"]) >= 2 and single["records"]  # edits on several heads, so both ranks edit
    _close(json.loads(json.dumps(single)), split, 1e-6)


def _check_monitor(folder: Path, steps: list[int], tokens: list[int], reference: dict | None = None) -> None:
    """One JSONL (main process), records equal to a single-process monitor on the same weights and probe.

    ``reference`` maps a step to the state dict a single process reaches by itself (then the job's weights must
    equal it, and the monitor runs on it); without it, on the weights the job saved."""
    records = json.loads((folder / "records-0.json").read_text())
    assert json.loads((folder / "records-1.json").read_text()) == []  # rank 1 keeps none, writes none
    assert [json.loads(line) for line in (folder / "monitor.jsonl").read_text().splitlines()] == records
    assert [(r["step"], r["tokens"]) for r in records] == list(zip(steps, tokens, strict=True))
    for record in records:
        model = tiny_llama()
        saved = torch.load(folder / f"weights-{record['step']}.pt")
        if reference is not None:
            want = reference[record["step"]]
            assert set(saved) <= set(want)
            for name, value in saved.items():  # the sharded run's weights are the single process's
                torch.testing.assert_close(value, want[name], atol=5e-5, rtol=1e-4, msg=name)
            saved = want
        missing, unexpected = model.load_state_dict(saved, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embedding
        expected = SinkMonitor(model, PROBE).measure()
        _close(expected, {k: record[k] for k in expected}, 1e-5)
    assert records[0]["attention_to_0"] != records[1]["attention_to_0"]  # the weights moved between records


def test_monitor_under_ddp_trainer_with_gradient_accumulation(job):
    # Trainer: 2 ranks × 2 micro-batches of 2 × 32 tokens per optimiser step; records at steps 2 and 4.
    _check_monitor(job[0] / "ddp", [2, 4], [2 * 256, 4 * 256])


def _fsdp_loop_in_one_process() -> dict[int, dict]:
    """tests/distributed_worker.py's FSDP2 loop in one process: each step on both ranks' batches at once (FSDP
    averages the two ranks' gradients of equal-size batches = the gradient of the mean loss on their union)."""
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gens = [torch.Generator().manual_seed(11 + rank) for rank in (0, 1)]
    states = {}
    for step in range(1, 5):
        batch = torch.cat([torch.randint(0, 64, (2, 32), generator=g) for g in gens])
        model(input_ids=batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad()
        if step % 2 == 0:
            states[step] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return states


def test_monitor_under_fsdp2_plain_loop(job):
    _check_monitor(job[0] / "fsdp", [2, 4], [2 * 128, 4 * 128], reference=_fsdp_loop_in_one_process())


@pytest.mark.filterwarnings("ignore::sinklab.scan.ShortSequenceWarning")  # 16-token Bigram-Backcopy probes
def test_train_under_torchrun_equals_one_process_on_the_whole_batch(job, tmp_path):
    from sinklab.train import TrainConfig, train

    folder = job[0] / "train"
    single = train(TrainConfig(**TRAIN_ARGS), tmp_path)
    split = json.loads((folder / "summary.json").read_text())
    assert split["world_size"] == 2 and split["tokens"] == single["tokens"] == 4 * 4 * 16
    # DDP averages the two slices' gradients: the single-process step on the whole batch, up to float rounding.
    one, two = ([json.loads(line) for line in (d / "monitor.jsonl").read_text().splitlines()] for d in (tmp_path, folder))
    assert [r["step"] for r in two] == [2, 4]  # one JSONL, written once
    _close(one, two, 1e-4)
    assert math.isclose(split["final_loss"], single["final_loss"], rel_tol=1e-5)


def test_a_failing_rank_stops_every_rank(job):
    out, proc, seconds = job
    # A rank raising inside sinklab (NaN weights on rank 1 only): both ranks raise.
    assert (out / "failure-1.txt").read_text().startswith("ModelWeightsError")
    assert (out / "failure-0.txt").read_text().startswith("DistributedError: scan: rank(s) [1] of 2 failed")
    # A rank that hangs: the other's collective times out after SINKLAB_DIST_TIMEOUT (3 s there), and the job ends.
    hang = (out / "hang-0.txt").read_text()
    assert hang.startswith("DistributedError after") and "did not answer within 3 s" in hang, hang
    assert "timed out" in hang  # gloo's own reason: the wait ran out (rank 1 was alive, not gone)
    assert proc.returncode != 0 and seconds < JOB_LIMIT_S


def test_unsupported_command_under_a_launcher_says_so():
    result = CliRunner().invoke(app, ["circuit", "builtin:tiny-lm"], env={"WORLD_SIZE": "2"})
    assert result.exit_code == 2
    assert "does not run under a multi-process launcher" in result.output and "scan, diagnose, train" in result.output


def test_helpers_are_no_ops_in_one_process():
    x = torch.tensor([1.0, math.nan])
    assert distributed.all_reduce(x) is x and distributed.gather_rows(x, 0, 2) is x
    assert (distributed.rank(), distributed.world_size(), distributed.is_main()) == (0, 1, True)
    assert distributed.gather_objects("a") == ["a"] and distributed.broadcast_object(3) == 3
    with pytest.raises(ValueError), distributed.together("x"):
        raise ValueError("the body's own error passes through")


def test_batch_shares_are_contiguous_balanced_and_cover_every_batch():
    assert distributed.batch_shares([2, 2, 2], 2) == [(0, 2), (2, 3)]
    assert distributed.batch_shares([8, 8], 2) == [(0, 1), (1, 2)]
    assert distributed.batch_shares([4, 2, 2, 2, 2, 2, 2], 3) == [(0, 2), (2, 5), (5, 7)]
    for sizes in ([1] * 7, [5, 1, 1, 1, 1], [3, 3, 3, 1]):
        for world in (1, 2, 3, 4):
            shares = distributed.batch_shares(sizes, world)
            assert shares[0][0] == 0 and shares[-1][1] == len(sizes)
            assert all(a < b for a, b in shares) and all(s[1] == t[0] for s, t in zip(shares, shares[1:]))
    with pytest.raises(distributed.DistributedError, match="2 batch"):
        distributed.batch_shares([4, 4], 3)


def test_timeout_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(distributed.TIMEOUT_ENV, raising=False)
    assert distributed.timeout_seconds() == distributed.DEFAULT_TIMEOUT_S
    monkeypatch.setenv(distributed.TIMEOUT_ENV, "7.5")
    assert distributed.timeout_seconds() == 7.5
    for bad in ("soon", "0"):
        monkeypatch.setenv(distributed.TIMEOUT_ENV, bad)
        with pytest.raises(distributed.DistributedError, match=distributed.TIMEOUT_ENV):
            distributed.timeout_seconds()
