"""``sinklab eval-stream``: per-token NLL of dense / window / recompute / sinks on the same positions of a long text."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from ..errors import SinklabError, check_int
from ..provenance import provenance
from ._common import (
    MODEL_HELP,
    load_for_command,
    progress_bar,
    read_texts,
    user_errors,
    app,
    check_out_dir,
    console,
    print_table,
    err,
    trust_remote_code_option,
)

_DEFAULT_TEXT = "Python's pydoc topics (sinklab.texts.default_texts)"


def read_long_text(file: Path | None) -> tuple[str, str]:
    """The text and where it came from; a missing, binary, non-UTF-8 or empty ``--file`` is an error."""
    from ..texts import default_texts

    if file is None:
        return "\n\n".join(default_texts()), _DEFAULT_TEXT
    (text,) = read_texts(None, file)  # type: ignore[misc]  # a file: one text
    if "\x00" in text:
        raise SinklabError(f"--file {file} looks binary (it contains NUL bytes); give a UTF-8 text file")
    return text, str(file)


@app.command("eval-stream")
def eval_stream(
    model: Annotated[str, typer.Argument(help="a RoPE causal LM: " + MODEL_HELP)],
    file: Annotated[Path | None, typer.Option("--file", help="long UTF-8 text (default: Python's pydoc topics)")] = None,
    tokens: Annotated[int, typer.Option("--tokens", help="length of the evaluated text, in tokens")] = 4096,
    methods: Annotated[str, typer.Option("--methods", help="comma-separated: dense,window,recompute,sinks")] =
        "dense,window,recompute,sinks",
    sinks: Annotated[str, typer.Option("--sinks", help="sink counts S, e.g. 4 or the ablation 0,1,2,4,8")] = "4",
    window: Annotated[int, typer.Option("--window", help="window W of the largest S; cache size C = max(S) + W")] = 1020,
    cache_size: Annotated[int | None, typer.Option("--cache-size", help="total cache C = S + W (overrides --window)")] = None,
    stride: Annotated[int | None, typer.Option("--stride", help="score every k-th position (default: 1, or ≤ 128 "
                                                               "recompute windows when recompute runs)")] = None,
    chunk_size: Annotated[int, typer.Option("--chunk-size", help="tokens per forward in chunked prefill")] = 256,
    policy: Annotated[str, typer.Option("--policy", help="also stream these score-based retention policies at S = "
                                        "max(--sinks), comma-separated: snapkv,tova,knorm (docs/retention.md)")] = "",
    out: Annotated[Path, typer.Option("--out")] = Path("sinklab-eval-stream"),
    dtype: Annotated[str | None, typer.Option("--dtype")] = None,
    device: Annotated[str | None, typer.Option("--device")] = None,
    trust_remote_code: Annotated[bool, trust_remote_code_option()] = False,
    quality: Annotated[str | None, typer.Option("--quality", help="also run quality measures, comma-separated: "
                                                "recall,endless,prompts (at S = max(--sinks), W = C − S)")] = None,
    recall_distances: Annotated[str | None, typer.Option("--recall-distances", help="recall: tokens between fact and "
                                                         "question (default 16, W/2, C+32, 2C, 4C)")] = None,
    recall_facts: Annotated[int | None, typer.Option("--recall-facts", help="recall: facts per distance (≤ 10)")] = \
        None,
    endless_tokens: Annotated[int | None, typer.Option("--endless-tokens", help="endless: sampled tokens per run "
                                                       "(default 2000)")] = None,
    seed: Annotated[int | None, typer.Option("--seed", help="endless: sampling seed (default 0)")] = None,
    prompts: Annotated[int | None, typer.Option("--prompts", help="prompts: how many of the project's 32")] = None,
    answer_tokens: Annotated[int | None, typer.Option("--answer-tokens", help="prompts: tokens per answer "
                                                      "(default 48)")] = None,
) -> None:
    """Per-token NLL over a long text: dense, window-only, recompute and sinks + window, all at cache size
    C = S + W and scored on the same positions (from the first eviction on). Writes JSON, figures and HTML.
    With --quality, also what the stream forgets (recall), whether it stays fluent (endless) and many prompts
    through one stream, into the same JSON and report."""
    from ..report import save
    from ..evaluation.stream import evaluate_stream

    with user_errors():
        plan = _eval_plan(methods, sinks, window, cache_size, stride, chunk_size, policy, tokens)
        s, c = max(plan.sinks), plan.cache_size
        qplan = _quality_plan(quality, s, c - s, chunk_size, recall_distances=recall_distances, facts=recall_facts,
                              endless_tokens=endless_tokens, seed=seed, prompts=prompts, answer_tokens=answer_tokens)
        text, source = read_long_text(file)
        check_out_dir(out)

        loaded = load_for_command(model, dtype=dtype, device=device, trust_remote_code=trust_remote_code)
        tok = loaded.tokenizer
        ids = _encode(tok, text, tokens, plan.first, c)
        total = plan.work(ids.numel())
        with progress_bar(total) as progress:
            task = progress.add_task("eval-stream", total=total)
            result = evaluate_stream(loaded.model, ids, plan,
                                     progress=lambda label, n: progress.update(task, advance=n, description=label))
        if qplan is not None:
            result.quality = _run_quality(loaded.model, tok, qplan, text, model)
        first = int(ids[0])
        result.meta = {
            "model": model, "text": source,
            "first_token": {"id": first, "text": tok.convert_ids_to_tokens(first),
                            "special": first in set(getattr(tok, "all_special_ids", []) or [])},
            "provenance": provenance(sys.argv, loaded, texts=[text]),
        }
        _print_table(result.to_json(), model)
        if result.quality:
            from ..report.quality_figures import quality_tables

            console.print(quality_tables(result.quality, answers=False), highlight=False, markup=False, soft_wrap=True)
        report = save(result, out)
        console.print(f"wrote {out / 'eval_stream.json'}, figures and {report}")


def comma_names(text: str) -> list[str]:
    """A comma list of names from the command line: ``"dense, sinks"`` → ``["dense", "sinks"]`` (blanks dropped)."""
    return [n.strip() for n in text.split(",") if n.strip()]


def comma_ints(text: str, option: str, example: str) -> list[int]:
    """A comma list of integers from the command line (``option`` and an ``example`` for the error)."""
    try:
        return [int(x) for x in comma_names(text)]
    except ValueError as exc:
        raise SinklabError(f"{option} must be comma-separated integers such as {example}, got {text!r}") from exc


def _eval_plan(methods: str, sinks: str, window: int, cache_size: int | None, stride: int | None, chunk_size: int,
               policy: str, tokens: int):
    """The :class:`~sinklab.evaluation.stream.EvalPlan` of the command line; ``--tokens`` must reach past the first
    eviction."""
    from ..evaluation.stream import EvalPlan, check_sinks

    check_int("--window", window, 1)
    if stride is not None:
        check_int("--stride", stride, 1)
    counts = check_sinks(comma_ints(sinks, "--sinks", "0,1,2,4,8"))
    c = cache_size if cache_size is not None else max(counts) + window
    plan = EvalPlan(methods=comma_names(methods), sinks=counts, cache_size=c, stride=stride, chunk_size=chunk_size,
                    policies=comma_names(policy))
    if tokens <= plan.first:
        raise SinklabError(f"--tokens {tokens}: scoring starts after the first eviction, at position {plan.first} "
                           f"(cache size {c}); ask for more tokens (several cache lengths, e.g. {4 * c})")
    return plan


def _encode(tok, text: str, tokens: int, first: int, c: int):
    """The first ``tokens`` tokens of ``text`` ``[T]``; a text too short to score, or shorter than asked, is an
    error."""
    import torch

    encoded = tok(text[: tokens * 16], add_special_tokens=True, verbose=False)["input_ids"]
    if len(encoded) < tokens:
        encoded = tok(text, add_special_tokens=True, verbose=False)["input_ids"]
    ids = torch.tensor(encoded[:tokens])
    if ids.numel() <= first:
        raise SinklabError(f"the text has only {ids.numel()} tokens; scoring starts at position {first} "
                           f"(cache size {c}): give a longer --file or a smaller cache")
    if ids.numel() < tokens:  # the whole text is evaluated, not what was asked for: say so up front
        raise SinklabError(f"--tokens {tokens}: the text has only {ids.numel():,} tokens; ask for at most that "
                           "many, or give a longer --file")
    return ids


def _run_quality(model, tok, qplan, text: str, model_name: str) -> dict:
    """The ``--quality`` measures (:func:`sinklab.evaluation.quality.evaluate_quality`), filler text from ``text``."""
    import torch

    from ..evaluation.quality import evaluate_quality

    longest = max(qplan.recall_distances()) if "recall" in qplan.measures else 0
    filler = torch.tensor(tok(text[: longest * 16 + 64], add_special_tokens=False, verbose=False)["input_ids"])
    if "recall" in qplan.measures and filler.numel() < longest:
        raise SinklabError(f"the text has only {filler.numel()} tokens; the recall distance {longest} needs "
                           "that many between a fact and its question: give a longer --file or shorter "
                           "--recall-distances")
    with progress_bar(qplan.work()) as progress:
        task = progress.add_task("quality", total=qplan.work())
        return evaluate_quality(
            model, tok, qplan, filler, model_name=model_name,
            progress=lambda label, n: progress.update(task, advance=n, description=f"quality: {label}"))


_OWNER = {"facts": "recall", "recall_distances": "recall", "endless_tokens": "endless", "seed": "endless",
          "prompts": "prompts", "answer_tokens": "prompts"}  # the quality measure each option belongs to


def _quality_plan(measures: str | None, num_sinks: int, window: int, chunk_size: int, **options):
    """The :class:`QualityPlan` of ``--quality`` (``None`` without it); its options without it, or without the
    measure they belong to, are an error."""
    from ..evaluation.quality import QualityPlan, parse_quality

    given = {k: v for k, v in options.items() if v is not None}
    flag = lambda k: "--" + k.replace("_", "-").replace("facts", "recall-facts")  # noqa: E731
    if measures is None:
        if given:
            names = ", ".join(flag(k) for k in given)
            raise SinklabError(f"{names} {'applies' if len(given) == 1 else 'apply'} only with --quality "
                               "(e.g. --quality recall,endless,prompts)")
        return None
    chosen = parse_quality(measures)
    for key in given:  # an option of a measure that is not run would be silently ignored
        if _OWNER[key] not in chosen:
            raise SinklabError(f"{flag(key)} sets the {_OWNER[key]} measure, which --quality {measures} does not run")
    if "recall_distances" in given:
        given["distances"] = given.pop("recall_distances")
    return QualityPlan(measures=measures, num_sinks=num_sinks, window=window,  # type: ignore[arg-type]
                       chunk_size=chunk_size, **given)


def _print_table(data: dict, model: str) -> None:
    from ..report.stream_figures import TABLE_HEADER, scored_note, table_rows

    p = data["positions"]
    print_table(f"{model}: {data['num_tokens']} tokens, cache S + W = {data['cache_size']}; every method "
                f"scored on {scored_note(data)}", TABLE_HEADER, table_rows(data))
    if p["windows_spanned"] < 2:
        err.print(f"[yellow]warning:[/yellow] the scored range spans only {p['windows_spanned']:.1f} cache lengths; "
                  "window-only collapse and recovery need several (give more --tokens)", highlight=False)
    trained = data.get("trained_positions")
    if trained and p["last"] > trained:
        console.print(f"note: positions past {trained} are beyond the model's trained positions "
                      "(dense attention extrapolates there; the bounded methods never see a distance above C)")
