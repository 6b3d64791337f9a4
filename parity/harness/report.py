"""Reports of one parity run: ``report.json`` (schema parity-report/1), ``summary.md``, ``report.html``.

``render(run_dir)`` rebuilds the Markdown and HTML from ``report.json`` alone, so a report can be
re-rendered (``parity report RUN_DIR``) long after the dumps are gone.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch

SCHEMA = "parity-report/1"


def tap_key(tap: dict[str, Any]) -> str:
    """A report tap's unique name: a decode step's result has its tap's name and ``#decode<step>``."""
    return tap["name"] + (f"#decode{tap['step']}" if tap.get("phase") == "decode" else "")


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
    try:
        tmp.write_text(json.dumps(json_clean(report), indent=1, allow_nan=False) + "\n")
        os.replace(tmp, run_dir / "report.json")
    finally:
        tmp.unlink(missing_ok=True)  # a write cut short (a full disk) leaves no temporary behind
    if heatmap is not None:
        (run_dir / "heatmap.json").write_text(json.dumps(heatmap) + "\n")
    render(run_dir)
    return run_dir


def heatmap_of(name: str, ref: torch.Tensor, cand: torch.Tensor, rows: list[tuple[int, int]] | None = None,
               max_rows: int = 64, max_cols: int = 128, max_prompts: int = 4) -> dict:
    """|candidate - reference| of one tensor, per prompt (``rows``: each row's (prompt, position), as
    ``DumpReader.stacked`` gives them; None: one block of rows), each pooled by max to at most
    max_rows x max_cols cells; the first ``max_prompts`` prompts."""
    d = (cand.double() - ref.double()).abs()
    d = torch.nan_to_num(d, nan=math.inf).reshape(-1, d.shape[-1]) if d.dim() > 1 else d.reshape(1, -1)
    if rows is None:
        blocks = [(None, d, 0)]
    else:
        of = torch.tensor([p for p, _ in rows])
        blocks = [(p, d[of == p], min(i for q, i in rows if q == p))  # a decode step's row is at len(prompt) + s
                  for p in list(dict.fromkeys(p for p, _ in rows))[:max_prompts]]
    cols = d.shape[1]
    cs = max(1, math.ceil(cols / max_cols))
    prompts = []
    for p, block, first in blocks:
        rs = max(1, math.ceil(block.shape[0] / max_rows))
        pooled = torch.nn.functional.max_pool2d(block[None, None].clamp(max=1e30), (rs, cs), ceil_mode=True)[0, 0]
        prompts.append({"prompt": p, "positions": block.shape[0], "first": first, "row_step": rs,
                        "cells": [[float(f"{v:.4g}") for v in r] for r in pooled.tolist()]})
    return {"tap": name, "features": cols, "col_step": cs, "prompts": prompts}


def render(run_dir: str | Path) -> None:
    run_dir = Path(run_dir)
    report = json.loads((run_dir / "report.json").read_text())
    if report.get("schema") != SCHEMA:
        raise ValueError(f"{run_dir}/report.json: schema {report.get('schema')!r}, expected {SCHEMA!r}")
    heat = run_dir / "heatmap.json"
    heatmap = json.loads(heat.read_text()) if heat.is_file() else None
    (run_dir / "summary.md").write_text(markdown(report))
    from vllm_parity.harness.page import html_page  # plotly is loaded only to draw

    (run_dir / "report.html").write_text(html_page(report, heatmap))


def describe_branches(branches: dict[str, Any] | None) -> str:
    """The kernel branches of a run's ``kernel_branches``, as one line ("" where the methods report none)."""
    if not branches or not branches.get("exercised"):
        return ""
    ran = "; ".join(f"{phase}: {', '.join(k)}" for phase, k in branches["exercised"].items())
    why = branches.get("why_not", {})
    untaken = ", ".join(f"{k} ({why[k]})" if k in why else k for k in branches["not_exercised"])
    return f"exercised {ran}; not exercised: {untaken or 'none'}"


def describe_schedule(schedule: dict[str, Any] | None) -> str:
    """How the engine ran a run's requests (its ``schedule``), as one line: the waves, the positions the prefix
    cache served each prompt and the forwards each chunked prefill took ("" where the run says none)."""
    if not schedule or not schedule.get("waves"):
        return ""
    waves = schedule["waves"]
    parts = [f"{len(waves)} wave{'s' if len(waves) > 1 else ''}: " + " then ".join(str(w) for w in waves)]
    if "prefix_cached" in schedule:
        parts.append(f"prefix caching: {', '.join(map(str, schedule['prefix_cached']))} positions from the cache")
    if "prefill_chunks" in schedule:
        tokens = (schedule.get("engine_features") or {}).get("chunked_prefill")
        parts.append(f"chunked prefill{f' ({tokens} tokens a step)' if tokens else ''}: "
                     f"{', '.join(map(str, schedule['prefill_chunks']))} forwards")
    return "; ".join(parts)


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
    at = f", decode step {first['step']}" if first and first.get("phase") == "decode" else ""
    lines.append(f"First divergence: **{first['name']}** (layer {first['layer']}{at})" if first else
                 "No divergence.")
    sep = describe_separation(report.get("separation"))
    if sep:
        lines += ["", f"Separation: {sep}."]
    for label, text in (("Kernel branches", describe_branches(run.get("kernel_branches"))),
                        ("Schedule", describe_schedule(run.get("schedule")))):
        if text:
            lines += ["", f"{label}: {text}."]
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
        lines.append(f"| {tap_key(t)} | {t['level']} | {fmt(m.get('token_rel'))} | {fmt(tol.get('token_rtol'))} | "
                     f"{fmt(mt.get('row_rtol'))} | {fmt(tol.get('row_rtol'))} | {fmt(m.get('max_abs'))} | "
                     f"{fmt(iso.get('max_abs'))} | {fmt(m.get('cosine'))} | {fmt(m.get('sqnr_db'))} | "
                     f"{fmt(m.get('mismatch_frac'))} | {fmt(t.get('margin'))} | {fmt(t.get('growth'))} | {result} |")
    return "\n".join(lines) + "\n"


def json_clean(o: Any) -> Any:
    """JSON has no NaN or Infinity: non-finite floats become null."""
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: json_clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [json_clean(v) for v in o]
    return o
