"""``sinklab eval-stream``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from ..errors import SinklabError
from ._common import _load, _progress, _user_errors, app, console


@app.command("eval-stream")
def eval_stream(
    model: Annotated[str, typer.Argument(help="a RoPE causal LM: builtin:tiny-llama, a local path or a hub id")],
    file: Annotated[Path | None, typer.Option("--file", help="long UTF-8 text (default: Python's pydoc topics)")] = None,
    tokens: Annotated[int, typer.Option("--tokens", help="tokens to evaluate")] = 4000,
    sinks: Annotated[int, typer.Option("--sinks")] = 4,
    window: Annotated[int, typer.Option("--window")] = 256,
    dense_limit: Annotated[int, typer.Option("--dense-limit", help="dense attention stops here")] = 2048,
    recompute_limit: Annotated[int, typer.Option("--recompute-limit", help="recompute is O(W)/token")] = 300,
    out: Annotated[Path, typer.Option("--out")] = Path("sinklab-eval-stream"),
    dtype: Annotated[str | None, typer.Option("--dtype")] = None,
    device: Annotated[str | None, typer.Option("--device")] = None,
    trust_remote_code: Annotated[bool, typer.Option("--trust-remote-code")] = False,
) -> None:
    """Running perplexity over a long text: dense, window-only, recompute, sinks + window (JSON and a plot)."""
    import json

    import torch

    from ..stream.evaluate import evaluate_stream, running_ppl
    from ..texts import default_texts

    with _user_errors():
        if tokens < 2 or window < 1 or sinks < 0:
            raise SinklabError("--tokens must be ≥ 2, --window ≥ 1 and --sinks ≥ 0")
        text = file.read_text(encoding="utf-8") if file is not None else "\n\n".join(default_texts())
        if file is not None and not text.strip():
            raise SinklabError(f"--file {file} is empty")
        loaded = _load(model, dtype=dtype, device=device, trust_remote_code=trust_remote_code)
        ids = torch.tensor(loaded.tokenizer(text, add_special_tokens=True, verbose=False)["input_ids"][:tokens])
        with _progress(tokens) as progress:
            task = progress.add_task("sinks + window", total=ids.numel() - 1)
            result = evaluate_stream(loaded.model, ids, num_sinks=sinks, window=window, dense_limit=dense_limit,
                                     recompute_limit=recompute_limit, progress=lambda n: progress.advance(task, n))
        result["model"] = model
        table = Table(title=f"{model}: running perplexity over {ids.numel()} tokens (S={sinks}, W={window})")
        for col in ("method", "tokens", "PPL", "s/token"):
            table.add_column(col, justify="right")
        for name, curve in result["curves"].items():
            table.add_row(name, str(curve["tokens"]), "–" if curve["ppl"] is None else f"{curve['ppl']:.2f}",
                          f"{curve['seconds_per_token'] * 1e3:.2f} ms")
        console.print(table)
        out.mkdir(parents=True, exist_ok=True)
        (out / "eval_stream.json").write_text(json.dumps(result, indent=1))
        from ..report.figures import plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for name, curve in result["curves"].items():
            ppl = running_ppl(torch.tensor(curve["nll"]))
            if ppl:
                ax.plot(range(1, len(ppl) + 1), ppl, label=name)
        ax.set_yscale("log")
        ax.set_xlabel("tokens")
        ax.set_ylabel("running perplexity")
        ax.axvline(sinks + window, color="grey", ls=":", lw=1, label="first eviction")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "eval_stream.png", dpi=110)
        console.print(f"wrote {out / 'eval_stream.json'} and {out / 'eval_stream.png'}")
