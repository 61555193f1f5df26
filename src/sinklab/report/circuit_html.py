"""HTML report section of the P0 sink circuit and of a checkpoint sweep (every token string escaped)."""

from __future__ import annotations

import html
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

from .circuit_figures import circuit_figures, sweep_figures
from .html import images_html, page, write_outputs

if TYPE_CHECKING:  # pragma: no cover
    from ..circuit import CircuitResult
    from ..circuit.sweep import SweepResult

__all__ = ["circuit_section", "render_circuit_html", "render_sweep_html", "write_circuit_report", "write_sweep_report"]


def _f(x, fmt: str = "{:.2f}") -> str:
    return "–" if x is None or (isinstance(x, float) and not math.isfinite(x)) else fmt.format(x)


def circuit_section(result: CircuitResult, images: dict[str, bytes] | None = None) -> str:
    """The circuit as an HTML fragment (a ``<section>``), for this report or another one."""
    esc = html.escape
    conds = result.conditions
    names = list(conds)
    head = "".join(f"<th>Sink_0 {esc(n)}</th>" for n in names)
    rows = []
    for layer in range(result.num_layers):
        cells = "".join(f"<td>{_f(conds[n]['sink_rate'][0][layer], '{:.0f}')}</td>" for n in names)
        amp = " ★" if layer in result.amplification_blocks else ""
        rows.append(f"<tr><th>{layer}{amp}</th><td>{_f(result.ratio[layer + 1])}</td>"
                    f"<td>{_f(result.contributions['attn'][layer])}</td><td>{_f(result.contributions['mlp'][layer])}</td>"
                    f"<td>{_f(result.direction_cosine[layer + 1], '{:.3f}')}</td>{cells}"
                    f"<td>{result.massive[layer + 1]['massive_tokens']} ({result.massive[layer + 1]['on_position_0']})</td></tr>")
    desc = "".join(f"<li><code>{esc(n)}</code>: {esc(c['description'])}, loss {_f(c['loss'], '{:.4f}')}</li>"
                   for n, c in conds.items())
    toks = "".join(f"<span class='tok'>{esc(t)}</span>" for t in result.tokens[0][:24]) if result.tokens else ""
    rules = "".join(f"<li><b>{esc(k)}</b>: {esc(v)}</li>" for k, v in result.rules.items())
    figs = images_html(images or {})
    return f"""<section><h2>P0 sink circuit</h2>
<p>{esc(result.summary()).replace(chr(10), '<br>')}</p>
<p>{result.num_samples} samples × T = {result.seq_len}, ε = {result.eps}; uniform causal attention would give
position 0 a column mass of {result.uniform_baseline:.3f} at this T. Embeddings: r = {_f(result.ratio[0])}.</p>
<ul>{desc}</ul><p>First sample: {toks}</p>
<table><tr><th>block (★ amplifies)</th><th>r</th><th>c_attn</th><th>c_mlp</th><th>cos x₀ across texts</th>{head}
<th>massive tokens (on pos. 0)</th></tr>{''.join(rows)}</table>
{_destinations_html(result)}<h3>Rules</h3><ul>{rules}</ul>{figs}</section>"""


def _destinations_html(result: CircuitResult) -> str:
    """Where the attention goes under the sink-losing condition, as tokenized in brackets (tokens escaped)."""
    esc = html.escape
    name = result.ablation.get("attention_condition")
    if not name:
        return ""
    ref, cond = result.ablation["attention"]["as_tokenized"], result.ablation["attention"][name]
    pair = lambda key, fmt="{:.3f}": f"{_f(cond[key][i], fmt)} ({_f(ref[key][i], fmt)})"  # type: ignore[has-type]  # noqa: E731
    rows = []
    for i in range(result.num_layers):
        tok = cond["other_sink_token"][i]
        rows.append(f"<tr><th>{i}</th><td>{_f(result.conditions[name]['sink_rate'][0][i], '{:.0f}')} "
                    f"({_f(result.conditions['as_tokenized']['sink_rate'][0][i], '{:.0f}')})</td>"
                    f"<td>{pair('entropy', '{:.2f}')}</td><td>{pair('position0_mass')}</td>"
                    f"<td>{cond['top_position'][i]} ({esc(repr(cond['top_token'][i]))})</td>"
                    f"<td>{_f(cond['top_share'][i], '{:.3f}')}</td><td>{pair('diagonal')}</td><td>{pair('previous')}</td>"
                    f"<td>{_f(cond['other_sink_pct'][i], '{:.0f}')}{'' if tok is None else ' (' + esc(repr(tok)) + ')'}"
                    f"</td><td>{pair('out_norm', '{:.3g}')}</td></tr>")
    return f"""<h3>Where the attention goes under {esc(name)}</h3>
<p>{esc(result.ablation.get('attention_text', ''))} As tokenized in brackets.</p>
<table><tr><th>block</th><th>Sink_0</th><th>entropy (nats)</th><th>position-0 mass</th><th>top position (token)</th>
<th>share</th><th>diagonal</th><th>previous</th><th>other sink % (token)</th><th>‖out‖</th></tr>{''.join(rows)}</table>"""


def render_circuit_html(result: CircuitResult, images: dict[str, bytes]) -> str:
    meta = result.meta
    body = (f"<h1>sinklab circuit: {html.escape(str(meta.get('model')))}</h1>{circuit_section(result, images)}"
            f"<h2>Provenance</h2><pre>{html.escape(json.dumps(meta, indent=2, default=str))}</pre>")
    return page(f"sinklab circuit — {meta.get('model')}", body)


def write_circuit_report(result: CircuitResult, out_dir: Path) -> Path:
    """``circuit.json``, ``*.png`` and ``report.html`` into ``out_dir`` (atomically)."""
    return write_outputs(out_dir, result.to_json(), circuit_figures(result),
                         lambda images: render_circuit_html(result, images), "circuit.json")


def render_sweep_html(sweep: SweepResult, images: dict[str, bytes]) -> str:
    esc = html.escape
    rows = []
    for c in sweep.checkpoints:
        if c.get("error"):
            rows.append(f"<tr><th>{esc(str(c['label']))}</th><td>{c['step']}</td><td colspan='4'>failed: "
                        f"{esc(c['error'])}</td></tr>")
            continue
        s0 = c["sink_rate"][0]
        rows.append(f"<tr><th>{esc(str(c['label']))}</th><td>{c['step']}</td><td>{esc(c['stage'])}</td>"
                    f"<td>{esc(c['location'])}</td><td>{_f(c['amplification_layer'], '{}')}</td>"
                    f"<td>{' '.join(_f(v, '{:.0f}') for v in s0)}</td></tr>")
    body = f"""<h1>sinklab circuit-sweep</h1>
<p>{len(sweep.checkpoints)} checkpoints. Stage rule: {esc(sweep.rules['stage'])}</p>
<p>Location rule: {esc(sweep.rules['location'])} (τ = {sweep.rules['threshold']:g} %)</p>
<table><tr><th>checkpoint</th><th>step</th><th>stage</th><th>sink location</th><th>amplification layer</th>
<th>Sink_0 % per layer</th></tr>{''.join(rows)}</table>{images_html(images)}"""
    return page("sinklab circuit-sweep", body)


def write_sweep_report(sweep: SweepResult, out_dir: Path) -> Path:
    """``sweep.json``, ``*.png`` and ``report.html`` into ``out_dir`` (atomically)."""
    return write_outputs(out_dir, sweep.to_json(), sweep_figures(sweep), lambda images: render_sweep_html(sweep, images),
                         "sweep.json")
