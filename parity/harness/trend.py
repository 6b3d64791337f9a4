"""The trend of a nightly gate: one JSON line per run, so a slow drift shows before it fails.

Each line (schema ``parity-trend/1``) holds the run id and date, the model and prompt-set hashes,
whether the run passed, and per tap the error of its primary criterion (``measure``): the token
relative error against its ``token_rtol``, or, for a tap judged elementwise only, the minimum atol that
would have passed against its atol; and whether it passed. Lines of before, which hold only
``min_atol`` / ``atol``, read as the latter.

:func:`drift` looks at the last ``window`` runs made on the same model and prompt set as the latest
one (a change of either restarts the trend: the numbers are not comparable across it) and flags a
tap whose error grew more than ``factor`` times from the first of those runs to the last, or rose in
every one of them.
"""

from __future__ import annotations

import fnmatch
import json
import os
import time
from pathlib import Path
from typing import Any

from vllm_parity.harness.report import tap_key

SCHEMA = "parity-trend/1"


def row_of(report: dict, model_sha256: str | None = None) -> dict[str, Any]:
    """The trend line of one report.json (schema parity-report/1)."""
    if report.get("schema") != "parity-report/1":
        raise ValueError(f"report schema {report.get('schema')!r}, expected 'parity-report/1'")
    run = report["run"]
    taps = {tap_key(t): primary(t) for t in report["taps"]}
    return {"schema": SCHEMA, "run": run.get("id"), "date": run.get("started") or time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "model": run.get("model"), "model_sha256": model_sha256 or run.get("model_sha256"),
            "prompts_sha256": run.get("prompts_sha256"), "format": run.get("format"), "level": run.get("level"),
            "versions": run.get("versions", {}), "passed": bool(report.get("passed")), "taps": taps}


def primary(tap: dict[str, Any]) -> dict[str, Any]:
    """A report tap's error under its primary criterion: ``measure``, ``value`` (None where it was not
    measured), ``bound`` (its tolerance), ``passed``."""
    mt, tol = tap.get("min_tolerance") or {}, tap.get("tolerance") or {}
    if tol.get("token_rtol") is not None:
        return {"measure": "token_rel", "value": mt.get("token_rtol"), "bound": tol["token_rtol"],
                "passed": bool(tap["passed"])}
    return {"measure": "min_atol", "value": mt.get("atol"), "bound": tol.get("atol"), "passed": bool(tap["passed"])}


def append(trend_file: str | Path, report: dict, model_sha256: str | None = None) -> dict[str, Any]:
    """Append the line of ``report`` to ``trend_file`` (created if absent) and return it."""
    path = Path(trend_file)
    row = row_of(report, model_sha256)
    line = json.dumps(row, separators=(",", ":"), allow_nan=False) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        if size:
            with open(path, "rb") as f:  # a line cut short by a killed writer must not swallow this one
                f.seek(size - 1)
                if f.read(1) != b"\n":
                    line = "\n" + line
        os.write(fd, line.encode())  # one write of an O_APPEND descriptor: lines never interleave
        os.fsync(fd)
    finally:
        os.close(fd)
    return row


def load(trend_file: str | Path) -> list[dict[str, Any]]:
    """Every line of the trend file, oldest first."""
    path = Path(trend_file)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no trend file") from None
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{n}: not a JSON line ({exc}); fix or delete that line") from None
        if not isinstance(row, dict) or row.get("schema") != SCHEMA or not isinstance(row.get("taps"), dict):
            schema = row.get("schema") if isinstance(row, dict) else None
            raise ValueError(f"{path}:{n}: not a {SCHEMA} line (schema {schema!r})")
        rows.append(row)
    return rows


def _same_inputs(rows: list[dict]) -> list[dict]:
    """The latest run's contiguous stretch of rows with its model and prompt set."""
    if not rows:
        return []
    k = (rows[-1].get("model_sha256"), rows[-1].get("prompts_sha256"))
    i = len(rows)
    while i > 0 and (rows[i - 1].get("model_sha256"), rows[i - 1].get("prompts_sha256")) == k:
        i -= 1
    return rows[i:]


MEASURES = {"token_rel": ("token relative error", "token_rtol"), "min_atol": ("minimum passing atol", "atol")}


def _point(entry: dict) -> tuple[str, float | None, float | None]:
    """(measure, value, bound) of one tap's trend entry, lines of before included."""
    if "measure" in entry:
        return entry["measure"], entry.get("value"), entry.get("bound")
    return "min_atol", entry.get("min_atol"), entry.get("atol")


def drift(rows: list[dict], tap: str | None = None, window: int = 7, factor: float = 2.0) -> list[dict[str, Any]]:
    """Taps (matching glob ``tap``) whose error grew more than ``factor`` times over the last ``window``
    comparable runs, or rose in each of ``window`` (at least 3) consecutive runs."""
    if window < 2:
        raise ValueError(f"window must be at least 2 runs, got {window}")
    recent = _same_inputs(rows)[-window:]
    if not recent:
        return []
    out = []
    for name, last in recent[-1]["taps"].items():
        if tap and not fnmatch.fnmatchcase(name, tap):
            continue
        measure, _, bound = _point(last)
        points = [(r, _point(r["taps"][name])) for r in recent if name in r["taps"]]
        series = [(r, v) for r, (m, v, _) in points if m == measure and v is not None]
        if len(series) < 2:
            continue
        what, bound_name = MEASURES.get(measure, (measure, "tolerance"))
        atol = bound or 0.0
        # below 1 % of the tolerance an error is rounding noise: growth from 0 to 1e-9 is not drift
        floor = max(0.01 * atol, 1e-30)
        vals = [max(v, floor) for _, v in series]
        ratio = vals[-1] / vals[0]
        monotonic = len(vals) >= max(window, 3) and all(b > a for a, b in zip(vals, vals[1:]))
        if ratio <= factor and not monotonic:
            continue
        (r0, v0), (r1, v1) = series[0], series[-1]
        kind = "growth" if ratio > factor else "monotonic"
        how = (f"grew {ratio:.1f}x over {len(series)} runs" if kind == "growth"
               else f"rose in each of the last {len(series)} runs ({ratio:.2f}x)")
        headroom = f", now {v1 / atol:.0%} of its {bound_name} {atol:g}" if atol else ""
        out.append({"tap": name, "kind": kind, "ratio": ratio, "runs": len(series), "first": v0, "last": v1,
                    "from_run": r0.get("run"), "to_run": r1.get("run"), "from_date": r0.get("date"),
                    "to_date": r1.get("date"), "atol": atol or None, "measure": measure,
                    "passed": bool(last.get("passed")),
                    "message": f"{name}: {what} {how}: {v0:.3g} ({r0.get('run')}) -> "
                               f"{v1:.3g} ({r1.get('run')}){headroom}"})
    return out


def table(rows: list[dict], tap: str | None = None, last: int = 10) -> str:
    """Taps down, the last ``last`` runs across: each cell the tap's error (its token relative error, or
    the minimum passing atol of a tap judged elementwise), ``!`` where failed; last, the bound."""
    if not rows:
        return "(no runs)\n"
    recent = rows[-last:]
    names = [n for n in recent[-1]["taps"] if not tap or fnmatch.fnmatchcase(n, tap)]
    head = ["tap"] + [_short_date(r) for r in recent] + ["bound"]
    body = []
    for name in names:
        cells = [name]
        for r in recent:
            t = r["taps"].get(name)
            value = None if t is None else _point(t)[1]
            if value is None:
                cells.append("—" if t is None else ("n/a!" if not t.get("passed") else "n/a"))
            else:
                cells.append(f"{value:.2e}" + ("" if t.get("passed") else "!"))
        measure, _, bound = _point(recent[-1]["taps"][name])
        cells.append("—" if bound is None else f"{MEASURES.get(measure, (0, measure))[1]}={bound:g}")
        body.append(cells)
    widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head))]

    def fmt(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    lines = [fmt(head), fmt(["-" * w for w in widths])] + [fmt(c) for c in body]
    if recent[-1].get("model_sha256") != recent[0].get("model_sha256") or \
            recent[-1].get("prompts_sha256") != recent[0].get("prompts_sha256"):
        lines.append("(the model or prompt set changed within these runs; drift is judged since the change)")
    return "\n".join(lines) + "\n"


def _short_date(row: dict) -> str:
    """``MM-DD HH:MM`` of an ISO date (several runs a day stay apart), else the run id."""
    d = str(row.get("date") or "")
    if len(d) >= 16 and d[4] == "-" and d[10] == "T":
        return f"{d[5:10]} {d[11:16]}"
    return str(row.get("run") or "?")
