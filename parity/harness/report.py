"""Reports of one parity run: ``report.json`` (schema parity-report/1), ``summary.md``, ``report.html``.

``render(run_dir)`` rebuilds the Markdown and HTML from ``report.json`` alone, so a report can be
re-rendered (``parity report RUN_DIR``) long after the dumps are gone.
"""

from __future__ import annotations

import html
import json
import math
import os
from pathlib import Path
from typing import Any

import torch

SCHEMA = "parity-report/1"


def build(run: dict[str, Any], taps: list[dict[str, Any]], first: dict | None, hints: list[dict]) -> dict:
    return {"schema": SCHEMA, "run": run, "taps": taps, "first_divergence": first, "hints": hints,
            "separation": separation(taps), "passed": all(t.get("verdict", t["passed"]) for t in taps)}


def separation(taps: list[dict[str, Any]]) -> dict[str, Any]:
    """How far the verdicts sit from the tolerances: the passing tap closest to its tolerance (its
    margin: how many times its error could grow before it failed) and the failing source furthest
    below it (a margin under 1: the tolerance over the error)."""
    passing = [t for t in taps if t["passed"] and t.get("margin") is not None]
    sources = [t for t in taps if t.get("role") == "source" and t.get("margin") is not None]
    worst = min(passing, key=lambda t: t["margin"], default=None)
    fault = max(sources, key=lambda t: t["margin"], default=None)
    return {"worst_passing": None if worst is None else {"tap": worst["name"], "margin": worst["margin"]},
            "closest_source": None if fault is None else {"tap": fault["name"], "margin": fault["margin"]}}


def describe_separation(sep: dict[str, Any] | None) -> str:
    if not sep:
        return ""
    parts = []
    if sep.get("worst_passing"):
        w = sep["worst_passing"]
        parts.append(f"the passing tap closest to its tolerance is {w['tap']}, at 1/{w['margin']:.3g} of it")
    if sep.get("closest_source"):
        f = sep["closest_source"]
        parts.append(f"the failing source closest to passing is {f['tap']}, at {1 / max(f['margin'], 1e-300):.3g}x "
                     f"its tolerance")
    return "; ".join(parts)


def write(run_dir: str | Path, report: dict, heatmap: dict | None = None) -> Path:
    """Write report.json (atomically), then render summary.md and report.html."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / f".report.json.{os.getpid()}"
    tmp.write_text(json.dumps(json_clean(report), indent=1, allow_nan=False) + "\n")
    os.replace(tmp, run_dir / "report.json")
    if heatmap is not None:
        (run_dir / "heatmap.json").write_text(json.dumps(heatmap) + "\n")
    render(run_dir)
    return run_dir


def heatmap_of(name: str, ref: torch.Tensor, cand: torch.Tensor, max_rows: int = 64, max_cols: int = 128) -> dict:
    """|candidate - reference| of one tensor, pooled by max to at most max_rows x max_cols cells."""
    d = (cand.double() - ref.double()).abs()
    d = torch.nan_to_num(d, nan=math.inf).reshape(-1, d.shape[-1]) if d.dim() > 1 else d.reshape(1, -1)
    rows, cols = d.shape
    rs, cs = max(1, math.ceil(rows / max_rows)), max(1, math.ceil(cols / max_cols))
    pooled = torch.nn.functional.max_pool2d(d[None, None].clamp(max=1e30), (rs, cs), ceil_mode=True)[0, 0]
    return {"tap": name, "rows": rows, "cols": cols, "row_step": rs, "col_step": cs, "cells": pooled.tolist()}


def render(run_dir: str | Path) -> None:
    run_dir = Path(run_dir)
    report = json.loads((run_dir / "report.json").read_text())
    if report.get("schema") != SCHEMA:
        raise ValueError(f"{run_dir}/report.json: schema {report.get('schema')!r}, expected {SCHEMA!r}")
    heat = run_dir / "heatmap.json"
    heatmap = json.loads(heat.read_text()) if heat.is_file() else None
    (run_dir / "summary.md").write_text(markdown(report))
    (run_dir / "report.html").write_text(html_page(report, heatmap))


def fmt(v: Any, none: str = "—", spec: str = ".3g") -> str:
    """A report's value as text: floats to ``spec``, None as ``none``."""
    if v is None:
        return none
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


def markdown(report: dict) -> str:
    run = report["run"]
    lines = [f"# parity report {run['id']}", "",
             f"model `{run['model']}` · format {run['format']} · level {run['level']} · mode {run['mode']} · "
             f"{'PASSED' if report['passed'] else 'FAILED'}", ""]
    first = report["first_divergence"]
    lines.append(f"First divergence: **{first['name']}** (layer {first['layer']})" if first else
                 "No divergence.")
    sep = describe_separation(report.get("separation"))
    if sep:
        lines += ["", f"Separation: {sep}."]
    for h in report["hints"]:
        lines += ["", f"- hint `{h['tap']}` ({h['kind']}): {h['evidence']} — {h['fix']}"]
    lines += ["", "| tap | level | token rel | token_rtol | min row_rtol | row_rtol | max_abs | isolated max_abs | "
                  "cosine | sqnr dB | mismatch | margin | growth | result |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for t in report["taps"]:
        m = t["metrics"] or {}
        mt = t.get("min_tolerance") or {}
        iso = (t.get("isolated") or {}).get("metrics") or {}
        result = "pass" if t.get("verdict", t["passed"]) and t.get("role", "pass") == "pass" else t.get("role", "fail")
        tol = t["tolerance"]
        lines.append(f"| {t['name']} | {t['level']} | {fmt(m.get('token_rel'))} | {fmt(tol.get('token_rtol'))} | "
                     f"{fmt(mt.get('row_rtol'))} | {fmt(tol.get('row_rtol'))} | {fmt(m.get('max_abs'))} | "
                     f"{fmt(iso.get('max_abs'))} | {fmt(m.get('cosine'))} | {fmt(m.get('sqnr_db'))} | "
                     f"{fmt(m.get('mismatch_frac'))} | {fmt(t.get('margin'))} | {fmt(t.get('growth'))} | {result} |")
    return "\n".join(lines) + "\n"


def _error_plot(taps: list[dict]) -> str:
    """Inline SVG: the token relative error of each layer's output against the layer index (log scale)."""
    pts = [(t["layer"], t["metrics"].get("token_rel") or t["metrics"]["max_abs"], t["passed"]) for t in taps
           if t["name"].endswith(".output") and t["layer"] is not None and t["metrics"]]
    if not pts:
        return "<p>No layer outputs compared.</p>"
    w, h, pad = 640, 240, 40
    vals = [max(v, 1e-12) for _, v, _ in pts]
    lo, hi = math.log10(min(vals)), math.log10(max(vals))
    hi = hi if hi > lo else lo + 1
    n = max(p[0] for p in pts) or 1
    def xy(layer, v):
        return pad + (w - 2 * pad) * layer / n, h - pad - (h - 2 * pad) * (math.log10(max(v, 1e-12)) - lo) / (hi - lo)
    coords = [xy(l, v) for l, v, _ in pts]
    poly = " ".join(f"{x:.1f},{y:.1f}" for x, y in coords)
    dots = "".join(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="4" fill="{"#2a7" if ok else "#d33"}"/>'
                   for (x, y), (_, _, ok) in zip(coords, pts))
    return (f'<svg width="{w}" height="{h}" role="img" aria-label="token relative error per layer">'
            f'<polyline points="{poly}" fill="none" stroke="#555"/>{dots}'
            f'<text x="{pad}" y="{h - 8}">layer 0 … {n}</text>'
            f'<text x="4" y="{pad - 12}">token rel err 1e{hi:.1f}</text><text x="4" y="{h - pad + 14}">1e{lo:.1f}</text></svg>')


def _heatmap_html(heatmap: dict | None) -> str:
    if not heatmap:
        return ""
    cells = heatmap["cells"]
    top = max((max(r) for r in cells), default=0.0) or 1.0
    rows = []
    for r in cells:
        tds = "".join(f'<td style="background:rgba(220,40,40,{min(1.0, v / top):.3f})" title="{v:.3g}"></td>' for v in r)
        rows.append(f"<tr>{tds}</tr>")
    return (f"<h2>Heatmap of |candidate − reference|: {html.escape(heatmap['tap'])}</h2>"
            f"<p>{heatmap['rows']} rows × {heatmap['cols']} features, max-pooled {heatmap['row_step']}×"
            f"{heatmap['col_step']}; darkest = {top:.3g}</p>"
            f'<table class="heat">{"".join(rows)}</table>')


def html_page(report: dict, heatmap: dict | None) -> str:
    run = report["run"]
    first = report["first_divergence"]
    rows = []
    for t in report["taps"]:
        m = t["metrics"] or {}
        mt = t.get("min_tolerance") or {}
        cls = "ok" if t.get("verdict", t["passed"]) else "bad"
        iso = (t.get("isolated") or {}).get("metrics") or {}
        rows.append("<tr class='{}'>{}</tr>".format(cls, "".join(f"<td>{html.escape(fmt(v))}</td>" for v in (
            t["name"], t["level"], m.get("token_rel"), t["tolerance"].get("token_rtol"), mt.get("row_rtol"),
            t["tolerance"].get("row_rtol"), m.get("max_abs"), iso.get("max_abs"), m.get("max_rel"), m.get("mean_abs"),
            m.get("cosine"), m.get("sqnr_db"), m.get("mismatch_frac"), t["tolerance"]["atol"], t["tolerance"]["rtol"],
            mt.get("atol"), t.get("margin"), t.get("growth"),
            "pass" if t.get("verdict", t["passed"]) else t.get("role", "fail")))))
    hints = "".join(f"<li><b>{html.escape(h['tap'])}</b> ({html.escape(h['kind'])}): {html.escape(h['evidence'])}"
                    f" — {html.escape(h['fix'])}</li>" for h in report["hints"])
    head = ("tap", "level", "token rel", "token_rtol", "min passing row_rtol", "row_rtol", "max abs",
            "isolated max abs", "max rel", "mean abs", "cosine", "SQNR dB", "mismatch", "atol", "rtol",
            "min passing atol", "margin", "growth", "result")
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>parity {html.escape(run['id'])}</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;
padding:2px 6px;font-size:13px}}tr.bad{{background:#fdd}}table.heat td{{width:5px;height:5px;padding:0;border:0}}</style>
</head><body><h1>parity report {html.escape(run['id'])}</h1>
<p>model <code>{html.escape(str(run['model']))}</code> · format {html.escape(str(run['format']))} ·
level {html.escape(str(run['level']))} · mode {html.escape(str(run['mode']))} ·
<b>{'PASSED' if report['passed'] else 'FAILED'}</b></p>
<p>First divergence: {html.escape(first['name']) if first else 'none'}</p>
<p>Separation: {html.escape(describe_separation(report.get('separation')) or 'nothing compared')}</p>
<ul>{hints}</ul><h2>Error against layer</h2>{_error_plot(report['taps'])}
{_heatmap_html(heatmap)}
<h2>Taps</h2><table><tr>{''.join(f'<th>{h}</th>' for h in head)}</tr>{''.join(rows)}</table></body></html>
"""


def json_clean(o: Any) -> Any:
    """JSON has no NaN or Infinity: non-finite floats become null."""
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: json_clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [json_clean(v) for v in o]
    return o
