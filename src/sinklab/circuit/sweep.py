"""``circuit_sweep``: the P0 circuit on every checkpoint of a training run — the convergence indicator.

Checkpoints can be ``sinklab train`` run folders (their ``checkpoint-<step>/`` and ``final/`` are found
automatically, plus the exact random initialisation rebuilt from ``train_config.json`` as step 0), single
checkpoint folders, or hub ids with a revision (``org/model@step1000``). Bigram-Backcopy runs have no
tokenizer: their inputs are rebuilt from the run's ``train_config.json``. A checkpoint that fails is
reported with its error and the sweep goes on.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import InputError, SinklabError
from .analysis import CircuitResult, json_clean, circuit, circuit_inputs
from .inputs import bb_inputs
from .stage import LAYER_SINK_THRESHOLD, LOCATION_RULE, STAGE_RULE

__all__ = [
    "SWEEP_SCHEMA",
    "Checkpoint",
    "SweepResult",
    "circuit_source",
    "circuit_sweep",
    "discover_checkpoints",
    "load_source",
]

SWEEP_SCHEMA = "sinklab.circuit-sweep/1"


@dataclass
class Checkpoint:
    """One checkpoint to measure: ``kind`` is ``local``, ``hub`` or ``init`` (the run's rebuilt initialisation)."""

    label: str
    step: int
    source: str
    kind: str = "local"
    revision: str | None = None
    run_dir: str | None = None  # folder holding train_config.json, if any


def _train_config(folder: Path) -> dict | None:
    path = folder / "train_config.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _step_of(name: str, fallback: int) -> int:
    match = re.search(r"(\d+)$", name)
    return int(match.group(1)) if match else fallback


def discover_checkpoints(sources: list[str], *, include_init: bool = True) -> list[Checkpoint]:
    """Expand run folders into their checkpoints (sorted by step); keep other sources as given."""
    found: list[Checkpoint] = []
    for index, source in enumerate(sources):
        path = Path(source)
        cfg = _train_config(path) if path.is_dir() else None
        if path.is_dir() and cfg is not None and not list(path.glob("*.safetensors")):
            run = []
            for sub in path.iterdir():
                if sub.is_dir() and sub.name.startswith("checkpoint-"):
                    run.append(Checkpoint(sub.name, _step_of(sub.name, 0), str(sub), run_dir=str(path)))
            if (path / "final").is_dir():
                run.append(Checkpoint("final", int(cfg["steps"]), str(path / "final"), run_dir=str(path)))
            if not run:
                raise InputError(f"{path}: a sinklab train run folder without checkpoints")
            if include_init:
                run.append(Checkpoint("init", 0, str(path), kind="init", run_dir=str(path)))
            found.extend(sorted(run, key=lambda c: c.step))
        elif path.is_dir():
            parent_cfg = _train_config(path.parent)
            run_dir = str(path) if cfg is not None else (str(path.parent) if parent_cfg is not None else None)
            step = int(parent_cfg["steps"]) if path.name == "final" and parent_cfg else _step_of(path.name, index)
            found.append(Checkpoint(path.name, step, str(path), run_dir=run_dir))
        elif path.exists():
            raise InputError(f"{source}: not a folder (give a checkpoint folder, a run folder or a hub id)")
        else:
            name, _, revision = source.partition("@")
            found.append(Checkpoint(source, _step_of(revision, index) if revision else index, name, kind="hub",
                                    revision=revision or None))
    if not found:
        raise InputError("no checkpoints given")
    return found


def load_source(ck: Checkpoint, device_map: str | None = None):
    """``(model, tokenizer or None, train_config or None)`` for one checkpoint (``device_map``: accelerate dispatch)."""
    cfg = _train_config(Path(ck.run_dir)) if ck.run_dir else None
    if ck.kind == "hub":
        from ..models import load_model

        loaded = load_model(ck.source, revision=ck.revision, device_map=device_map)
        return loaded.model, loaded.tokenizer, None
    if ck.kind == "init":
        return _init_model(Path(ck.run_dir), cfg)  # type: ignore[arg-type]  # an init checkpoint is in a run folder
    from ..models import load_model

    loaded = load_model(ck.source, device_map=device_map)  # strict loading; a bb checkpoint (no tokenizer files) gives tokenizer=None
    return loaded.model, loaded.tokenizer, cfg


def _init_model(run_dir: Path, cfg: dict):
    """The run's exact initialisation: ``sinklab.train.build_model`` seeds itself with the run's seed."""
    from ..train import TrainConfig, build_model

    config = TrainConfig(**cfg)
    if cfg["data"] == "bb":
        model = build_model(config, cfg["bb_vocab"] + 1, cfg["bb_vocab"], None, None)
        return model.eval(), None, cfg
    from transformers import AutoTokenizer

    tok_dir = run_dir / "final"
    tokenizer = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    model = build_model(config, len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    return model.eval(), tokenizer, cfg


def circuit_source(model, tokenizer, train_config: dict | None, *, texts=None, seq_len: int = 64, samples: int = 16,
                   source: str | None = None, progress: Callable[[int], None] | None = None,
                   set_total: Callable[[int], None] | None = None, **kwargs) -> CircuitResult:
    """The circuit of a loaded checkpoint: Bigram-Backcopy inputs when it has no tokenizer, else text windows."""
    if tokenizer is None:
        if train_config is None or train_config.get("data") != "bb":
            raise InputError(f"{source}: no tokenizer and no Bigram-Backcopy train_config.json beside it; "
                             "the circuit needs one of the two to build inputs")
        inputs = bb_inputs(train_config, samples=samples)
        return circuit_inputs(model, inputs, progress=progress, set_total=set_total,
                              meta={"model": source, "inputs": "bigram-backcopy"}, **kwargs)
    return circuit(model, tokenizer, texts, seq_len=seq_len, samples=samples, source=source, progress=progress,
                   set_total=set_total, **kwargs)


@dataclass
class SweepResult:
    """One row per checkpoint (``error`` set where it failed) plus the rules used."""

    checkpoints: list[dict]
    rules: dict
    results: dict = field(default_factory=dict)  # label -> CircuitResult.to_json()
    meta: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"schema": SWEEP_SCHEMA, **json_clean(asdict(self))}

    @classmethod
    def from_json(cls, data: dict) -> SweepResult:
        if data.get("schema") != SWEEP_SCHEMA:
            raise InputError(f"not a {SWEEP_SCHEMA} document (schema {data.get('schema')!r})")
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})

    def stages(self) -> list[tuple[int, str | None]]:
        return [(c["step"], c.get("stage")) for c in self.checkpoints]



def circuit_sweep(sources: list[str], *, include_init: bool = True, texts=None, seq_len: int = 64, samples: int = 16,
                  on_checkpoint: Callable[[Checkpoint, dict], None] | None = None,
                  progress: Callable[[int], None] | None = None, set_total: Callable[[int], None] | None = None,
                  **kwargs) -> SweepResult:
    """Run :func:`sinklab.circuit` on every checkpoint of ``sources`` (see :func:`discover_checkpoints`)."""
    rows, results = [], {}
    for ck in discover_checkpoints(sources, include_init=include_init):
        row = {"label": ck.label, "step": ck.step, "source": ck.source, "kind": ck.kind, "revision": ck.revision,
               "error": None}
        try:
            model, tokenizer, cfg = load_source(ck)
            result = circuit_source(model, tokenizer, cfg, texts=texts, seq_len=seq_len, samples=samples,
                                    source=ck.source, progress=progress, set_total=set_total, **kwargs)
        except (SinklabError, OSError, ValueError, RuntimeError, KeyError) as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"
        else:
            row.update(stage=result.stage["stage"], location=result.stage["location"],
                       amplification_layer=result.amplification_layer, amplification_blocks=result.amplification_blocks,
                       first_sink_layer=result.stage["first_sink_layer"],
                       sink_rate=[result.sink_rate(position=p) for p in range(len(result.conditions["as_tokenized"]["sink_rate"]))],
                       ratio=result.ratio, verdict=result.ablation["verdict"],
                       loss=result.conditions["as_tokenized"]["loss"])
            results[f"{ck.label}@{ck.step}"] = result.to_json()
        rows.append(row)
        if on_checkpoint is not None:
            on_checkpoint(ck, row)
    rules = {"stage": STAGE_RULE, "location": LOCATION_RULE, "threshold": kwargs.get("layer_threshold",
                                                                                     LAYER_SINK_THRESHOLD)}
    return SweepResult(rows, rules, results, meta={"sources": list(sources), "seq_len": seq_len, "samples": samples})
