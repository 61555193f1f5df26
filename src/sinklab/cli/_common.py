"""Shared pieces of the command line: the Typer app, consoles, error handling, loading, outputs, progress.

Every command wraps its body in :func:`user_errors`, checks ``--out`` with :func:`check_out_dir` before
loading anything, and writes its outputs through :func:`sinklab.atomic.atomic_dir` (or a writer that is atomic itself),
so bad input gives one red line and exit code 2, Ctrl-C gives exit code 130, and neither leaves a partial
output folder behind.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ..errors import InputError, SinklabError, SinklabWarning
from ..models import BUILTIN_MODELS
from ._console import console, err

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Find, explain, use and fix attention sinks.")

#: Help text of every command's MODEL argument: each builtin, a local folder or a hub id.
MODEL_HELP = ", ".join(sorted(BUILTIN_MODELS)) + ", a .gguf file (dequantised once, cached), a local model folder or a hub id"
#: Help text of every ``--trust-remote-code`` flag.
TRUST_HELP = "run the Python code of the model repository (off unless given)"


def trust_remote_code_option():
    """``--trust-remote-code`` as a flag: ``Annotated[bool, trust_remote_code_option()] = False``.

    ``metavar=""`` keeps the help from showing a ``<bool>`` value type: the flag takes no value.
    """
    return typer.Option("--trust-remote-code", help=TRUST_HELP, metavar="")


#: Help text of every ``--device-map`` option.
DEVICE_MAP_HELP = ("spread the model with accelerate's big-model dispatch: auto, balanced, sequential "
                   "(GPUs, then CPU memory, then disk)")


def device_map_option():
    """``--device-map``: ``Annotated[str | None, device_map_option()] = None``."""
    return typer.Option("--device-map", help=DEVICE_MAP_HELP)


def record_run(meta: dict, loaded, texts: list[str] | None, *, device: str | None = None,
               dtype: str | None = None) -> dict:
    """Add the run's provenance (command line, versions, timestamp, input hash) and the weights' notes to ``meta``."""
    import sys

    from ..provenance import provenance

    meta["provenance"] = provenance(sys.argv, loaded, device, dtype, texts)
    if loaded.notes:
        meta["weights_notes"] = dict(loaded.notes)
    return meta


def prepare_run(model: str, text: str | None, file: Path | None, out: Path, seq_len: int, **load_kwargs):
    """What every text analysis does before its work: read the texts, check ``--out``, load, check positions.

    Returns ``(texts, out, loaded)``; bad input fails here, before anything heavy runs.
    """
    from ..checks import check_positions

    texts = read_texts(text, file)
    out = check_out_dir(out)
    loaded = load_for_command(model, **load_kwargs)
    if loaded.tokenizer is not None:  # (a vision model's positions are its patches, not --seq-len)
        check_positions(loaded.model, seq_len)
    return texts, out, loaded


def vision_run(loaded, texts: list[str] | None, *, samples: int, batch_size: int, seed: int, source: str):
    """``(backbone, batches, labels, meta)`` when ``loaded`` is a vision transformer (scan/diagnose then run
    on the embedded shapes images, see :mod:`sinklab.vit.inputs`), else ``None``."""
    from ..vit.inputs import image_batches, is_vision_model

    if not is_vision_model(loaded.model):
        return None
    if texts is not None:
        raise InputError(f"{source} is a vision transformer: it reads images, not --text/--file (it is scanned "
                         "on sinklab's embedded shapes images; from Python pass pixel_values to sinklab.scan_inputs)")
    base, batches, labels, meta = image_batches(loaded.model, samples=samples, batch_size=batch_size, seed=seed)
    meta["model"] = source
    return base, batches, labels, meta


def analysis_run(model: str, text: str | None, file: Path | None, out: Path, seq_len: int, *, samples: int,
                 batch_size: int, seed: int, phases: dict[str, str], on_texts, on_images, **load_kwargs):
    """The body scan and diagnose share: load (:func:`prepare_run`), then run the analysis under progress bars.

    ``on_texts(loaded, texts, progress)`` runs on a language model, ``on_images(base, batches, labels, meta,
    progress)`` on a vision transformer (sinklab's embedded shapes images, :func:`vision_run`); ``phases`` names
    the progress bars. Returns ``(result, loaded, texts, out)``, or ``None`` on a rank that is not the main
    process under a launcher (the main process writes the one report).
    """
    from .. import distributed
    from ._progress import PhaseBars

    texts, out, loaded = prepare_run(model, text, file, out, seq_len, images_ok=True, **load_kwargs)
    vision = vision_run(loaded, texts, samples=samples, batch_size=batch_size, seed=seed, source=model)
    with PhaseBars(phases) as progress:
        if vision is not None:  # a ViT / DINOv2: the embedded shapes images, positions [CLS], reg<i>, patch<i>
            result = on_images(*vision, progress)
        else:
            result = on_texts(loaded, texts, progress)
    if not distributed.is_main():
        return None
    return result, loaded, texts, out


def _version(value: bool) -> None:
    if value:
        import torch
        import transformers

        from .. import __version__

        console.print(f"sinklab {__version__} (transformers {transformers.__version__}, torch {torch.__version__})",
                      highlight=False)
        raise typer.Exit()


#: Commands that run as one process per rank under ``torchrun`` / ``accelerate launch`` (docs/distributed.md).
DISTRIBUTED_COMMANDS = ("scan", "diagnose", "train")


@app.callback()
def _main(
    ctx: typer.Context,
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, metavar="",
                                          help="print the versions and exit")] = False,
) -> None:
    """sinklab: attention-sink scanning for Hugging Face transformers models."""
    from .. import distributed

    if distributed.launched() and ctx.invoked_subcommand not in DISTRIBUTED_COMMANDS:
        err.print(f"[red]error:[/red] `sinklab {ctx.invoked_subcommand}` does not run under a multi-process launcher "
                  f"(WORLD_SIZE={os.environ.get('WORLD_SIZE')}); run it as one process. Distributed: "
                  f"{', '.join(DISTRIBUTED_COMMANDS)} (docs/distributed.md)", highlight=False, soft_wrap=True)
        raise typer.Exit(code=2)


def join_ranks(device: str | None, device_map: str | None = None) -> str | None:
    """Under ``torchrun`` / ``accelerate launch``: join the process group and quiet every rank but the main one.

    Returns the device this rank runs on (``cuda`` becomes ``cuda:LOCAL_RANK``). ``--device-map`` (one model
    spread over devices) does not combine with one process per rank. One process: ``device`` unchanged.
    """
    import atexit

    from .. import distributed

    if not distributed.launched():
        return device
    if device_map is not None:
        raise InputError("--device-map spreads one model over devices and does not combine with a multi-process "
                         "launch (one model per process); drop one of them (docs/distributed.md)")
    device = distributed.local_device(device)
    if distributed.init(device):
        atexit.register(distributed.shutdown)
        if not distributed.is_main():
            console.quiet = True  # the main process prints the tables; errors still print on every rank
    return device


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ARG001
    err.print(f"[yellow]warning:[/yellow] {message}", highlight=False, soft_wrap=True)


@contextmanager
def user_errors(interrupted: str | None = None) -> Iterator[None]:
    """Turn sinklab's input errors into one red line and exit code 2 (no traceback, no partial output).

    Ctrl-C prints one line (``interrupted``, e.g. where the checkpoints are) and exits with 130, the shell's
    code for SIGINT. :class:`~sinklab.errors.SinklabWarning` s print as one yellow line each.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("always", SinklabWarning)
        previous = warnings.showwarning
        warnings.showwarning = lambda m, c, *a, **k: (_show_warning(m, c, *a, **k) if issubclass(c, SinklabWarning)
                                                      else previous(m, c, *a, **k))
        try:
            yield
        except SinklabError as exc:
            err.print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
            raise typer.Exit(code=2) from None
        except KeyboardInterrupt:
            err.print(f"[red]interrupted:[/red] {interrupted or 'no output written'}", highlight=False, soft_wrap=True)
            raise typer.Exit(code=130) from None
        finally:
            warnings.showwarning = previous


def check_out_dir(out: Path | str, option: str = "--out") -> Path:
    """Raise :class:`InputError` unless ``out`` can become an output folder; call it before loading a model.

    ``out`` may exist (a folder: files in it are replaced) or not (its nearest existing parent must be a
    folder sinklab can create entries in — tried for real, so it also holds for read-only mounts). Nothing
    is left behind by the check.
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise InputError(f"{option} {out}: is an existing file, not a folder; give a folder path")
    probe = out
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if not probe.is_dir():
        raise InputError(f"{option} {out}: {probe} is a file, so no folder can be made under it")
    try:
        Path(tempfile.mkdtemp(prefix=".sinklab-check-", dir=probe)).rmdir()
    except OSError as exc:
        raise InputError(f"{option} {out}: cannot write in {probe} ({exc.strerror or exc}); choose another folder") from exc
    return out


def load_for_command(model: str, *, needs_tokenizer: bool = True, images_ok: bool = False, **kwargs):
    """Load ``model`` with a spinner; text commands need its tokenizer (a token-id checkpoint has none).

    ``images_ok``: the command also runs a vision transformer (scan, diagnose: on the embedded images)."""
    from ..models import load_model
    from ..vit.inputs import is_vision_model

    with console.status(f"loading {model} …"):
        loaded = load_model(model, **kwargs)
    if loaded.tokenizer is None and is_vision_model(loaded.model):
        if images_ok:
            return loaded
        raise InputError(f"{model} is a vision transformer: `sinklab scan` and `sinklab diagnose` run it (on "
                         "sinklab's embedded images); this command is for language models")
    if needs_tokenizer and loaded.tokenizer is None:
        raise InputError(f"{model}: this checkpoint has no tokenizer, so it cannot read text (a `sinklab train "
                         "--data bb` checkpoint works on token ids only); use a model folder with tokenizer files")
    return loaded


def needs(flag: str, value, default, condition: bool, without: str) -> None:
    """``flag`` set away from its default while what it modifies is off (``condition`` false): one error, not a
    silent no-op. ``without`` names what is missing, e.g. ``"with --no-edits"``."""
    if value != default and not condition:
        raise InputError(f"{flag} {value} has no effect {without}; drop it")


def read_texts(text: str | None, file: Path | None, option: str = "--text") -> list[str] | None:
    """``[text]``, ``[contents of file]`` or ``None`` (neither: the command's default corpus)."""
    if text is not None and file is not None:
        raise InputError(f"give either {option} or --file, not both")
    if text is not None:
        if not text.strip():
            raise InputError(f"{option} is empty; give some text, or leave it out for the default corpus")
        return [text]
    if file is not None:
        if file.is_dir():
            raise InputError(f"--file {file}: is a folder, not a text file")
        if not file.is_file():
            raise InputError(f"--file {file}: no such file")
        try:
            body = file.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise InputError(f"--file {file}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset "
                             f"{exc.start}); give a UTF-8 text file") from None
        if not body.strip():
            raise InputError(f"--file {file} is empty (or only whitespace)")
        return [body]
    return None


def check_count(value: int | None, option: str, minimum: int = 1) -> None:
    """Raise :class:`InputError` if an integer option is below ``minimum`` (``None`` means "default")."""
    if value is not None and value < minimum:
        raise InputError(f"{option} must be ≥ {minimum}, got {value}")


def progress_bar(total: int | None = None) -> Progress:
    """A transient bar on stderr: description, bar, done/total, elapsed (give each task its total)."""
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=err, transient=True)


def print_table(title: str, header: tuple[str, ...] | list[str], rows: list[tuple[str, ...]]) -> None:
    """Print right-aligned rows of formatted cells under ``header`` as one rich table."""
    table = Table(title=title)
    for col in header:
        table.add_column(col, justify="right")
    for row in rows:
        table.add_row(*row)
    console.print(table)


def policy_help() -> str:
    """``--policy``'s help, its names read off :data:`sinklab.stream.policy.POLICIES`."""
    from ..stream.policy import POLICIES, ScoredPolicy

    recency = [name for name, cls in POLICIES.items() if not issubclass(cls, ScoredPolicy)]
    scored = [name for name, cls in POLICIES.items() if issubclass(cls, ScoredPolicy)]
    return (f"what each head keeps: {', '.join(recency)} (sinks + the most recent tokens, default), "
            f"{', '.join(scored)} (sinks + recent + the best-scored tokens), auto (per-head budgets from a scan of "
            "the model: --plan, or a quick scan now)")


def policy_option():
    return typer.Option("--policy", help=policy_help())


def plan_option():
    return typer.Option("--plan", help="with --policy auto: a retention_plan.json (`sinklab diagnose` writes one)")


def retention(loaded, policy: str, plan: Path | None, sinks: int, window: int) -> dict:
    """The ``policy``/``plan`` arguments of a stream for ``--policy``/``--plan`` (``auto`` without a plan: a quick
    scan of the model on the default texts, 16 × 256 tokens, makes it)."""
    from ..stream.policy import policy_names

    if policy not in policy_names():
        raise InputError(f"--policy {policy!r} is not a retention policy; choose one of {', '.join(policy_names())}")
    if plan is not None and policy != "auto":
        raise InputError("--plan gives the per-head budgets of --policy auto; add --policy auto")
    if policy != "auto":
        return {"policy": policy}
    if plan is not None:
        from ..stream.plan import load_plan

        return {"policy": "auto", "plan": load_plan(plan).with_budget(sinks, window)}
    from ..scan import scan
    from ..stream.plan import plan_from_scan

    err.print("[dim]--policy auto: scanning the model (16 × 256 tokens) for its local heads …[/dim]", highlight=False)
    result = scan(loaded.model, loaded.tokenizer, seq_len=256, samples=16)
    made = plan_from_scan(loaded.model, result, num_sinks=sinks, window=window)
    s = made.summary()
    err.print(f"[dim]plan: {s['local_heads']} of {s['heads']} key-value heads local ({s['local_budget']} tokens), "
              f"the others {s['far_budget']} tokens[/dim]", highlight=False)
    return {"policy": "auto", "plan": made}


def save_retention_plan(loaded, scan, out: Path) -> None:
    """Beside a causal LM's scan or diagnosis report: ``retention_plan.json`` (the ``auto`` policy's per-head budgets
    at S = 4, W = 1020; ``--policy auto --plan FILE --window W`` re-budgets it) and one line saying what it found."""
    from ..errors import UnsupportedModelError
    from ..stream.plan import plan_from_scan

    if getattr(loaded, "kind", "causal-lm") not in ("causal-lm", None) or not hasattr(loaded.model, "generate"):
        return
    try:
        plan = plan_from_scan(loaded.model, scan)
    except (InputError, UnsupportedModelError) as exc:
        console.print(f"[dim]no retention plan: {exc}[/dim]", highlight=False)
        return
    s = plan.summary()
    path = plan.save(out / "retention_plan.json")
    console.print(f"retention: {s['local_heads']} of {s['heads']} key-value heads are local (sinks + last "
                  f"{plan.local_window} tokens ≥ {plan.threshold:.0%} of their attention); stream with "
                  f"--policy auto --plan {path}", highlight=False)
