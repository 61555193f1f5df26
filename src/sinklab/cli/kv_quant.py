"""``sinklab kv-quant``: packed KV caches at several bit widths, with and without exact sinks, against the full cache."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from ..errors import SinklabError
from ..provenance import provenance
from ._common import (
    MODEL_HELP,
    load_for_command,
    progress_bar,
    user_errors,
    app,
    check_out_dir,
    console,
    needs,
    print_table,
    trust_remote_code_option,
)
from .eval_stream import read_long_text


def _ints(text: str, option: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise SinklabError(f"{option} takes comma-separated integers, got {text!r}") from exc


@app.command("kv-quant")
def kv_quant_command(
    model: Annotated[str, typer.Argument(help="a causal LM: " + MODEL_HELP)],
    file: Annotated[Path | None, typer.Option("--file", help="long UTF-8 text (default: Python's pydoc topics)")] = None,
    bits: Annotated[str, typer.Option("--bits", help="comma-separated bit widths from 2, 3, 4, 8")] = "8,4,3,2",
    protect: Annotated[str, typer.Option("--protect", help="comma-separated: none,first,detected")] =
        "none,first,detected",
    num_first: Annotated[int, typer.Option("--first", help="S: tokens the 'first' protection keeps exact")] = 4,
    context: Annotated[int, typer.Option("--context", help="tokens cached per sample")] = 1024,
    score: Annotated[int, typer.Option("--score", help="next tokens scored per sample")] = 256,
    samples: Annotated[int, typer.Option("--samples", help="consecutive windows of the text")] = 4,
    group_size: Annotated[int, typer.Option("--group-size", help="G: tokens per key block at 3, 4, 8 bits")] = 64,
    group_size_2bit: Annotated[int, typer.Option("--group-size-2bit", help="G: tokens per key block at 2 bits")] = 32,
    value_group: Annotated[int, typer.Option("--value-group", help="channels per value scale (≤ head width)")] = 64,
    residual: Annotated[int, typer.Option("--residual", help="R: most recent tokens kept in full precision")] = 32,
    clip: Annotated[bool | None, typer.Option("--clip/--no-clip", help="least-squares range per group, or min/max "
                                              "(default: least squares at 2 bits only)")] = None,
    decode_steps: Annotated[int, typer.Option("--decode-steps", help="timed one-token forwards per cache")] = 16,
    hf_backend: Annotated[str, typer.Option("--hf-backend", help="also transformers' QuantizedCache with these "
                                           "comma-separated backends (quanto, hqq; must be installed)")] = "",
    out: Annotated[Path, typer.Option("--out")] = Path("sinklab-kv-quant"),
    dtype: Annotated[str | None, typer.Option("--dtype")] = None,
    device: Annotated[str | None, typer.Option("--device")] = None,
    trust_remote_code: Annotated[bool, trust_remote_code_option()] = False,
) -> None:
    """KL, top-1, PPL, bytes per token and decode time of packed KV caches (KIVI layout) at each bit width, keeping
    nothing, the first S tokens or the detected sinks in full precision. Writes kv_quant.json, a figure and HTML."""
    from ..kvquant.evaluate import KvQuantPlan, kv_quant_text
    from ..report import save
    from ..report.kvquant import table_header, table_rows

    with user_errors():
        needs("--first", num_first, 4, "first" in protect.split(","), "without 'first' in --protect")
        plan = KvQuantPlan(bits=_ints(bits, "--bits"), protect=tuple(p.strip() for p in protect.split(",") if p.strip()),
                           num_first=num_first, context=context, score=score, samples=samples, group_size=group_size,
                           group_size_2bit=group_size_2bit, value_group=value_group, residual=residual, clip=clip,
                           decode_steps=decode_steps,
                           hf_backends=tuple(b.strip() for b in hf_backend.split(",") if b.strip()))
        text, source = read_long_text(file)
        check_out_dir(out)
        loaded = load_for_command(model, dtype=dtype, device=device, trust_remote_code=trust_remote_code)
        total = plan.work()
        with progress_bar(total) as progress:
            task = progress.add_task("kv-quant", total=total)
            result = kv_quant_text(loaded.model, loaded.tokenizer, text, plan,
                                   progress=lambda label, n: progress.update(task, advance=n, description=label))
        result.meta = {"model": model, "text": source, "provenance": provenance(sys.argv, loaded, texts=[text]),
                       **result.meta}
        data = result.to_json()
        print_table(f"{model}: {plan.samples} × ({plan.context} cached + {plan.score} scored) tokens; 16-bit cache "
                    f"{data['dense_bytes_per_token_16bit']:,} bytes/token", table_header(data), table_rows(data))
        console.print("detected sinks per sample: " + "; ".join(str(d) for d in result.detected))
        report = save(result, out)
        console.print(f"wrote {out / 'kv_quant.json'}, {out / 'kl_vs_bytes.png'} and {report}")
