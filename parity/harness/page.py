"""``report.html``: one self-contained page (plotly.js inline, no request leaves it) of a report.

The summary (verdict, first divergence, hints, the run's metadata and checks), the error against layer
and against decode step, the heatmap of the first failing tensor, and the per-tap table, which sorts by a
click on a header and filters on a text box (``report.html#filter=source&sort=margin&dir=desc`` opens
that view).
"""

from __future__ import annotations

import html
import json
from typing import Any

from vllm_parity.harness import plots
from vllm_parity.harness.report import describe_branches, describe_schedule, describe_separation, tap_key

# (header, key for #sort=, the value of a tap dict); a number sorts as one, None sorts last
COLUMNS: tuple[tuple[str, str, Any], ...] = (
    ("#", "index", None),  # canonical order, filled in by the row
    ("tap", "tap", lambda t, m, i, mt, tol: t["name"]),
    ("level", "level", lambda t, m, i, mt, tol: t["level"]),
    ("role", "role", lambda t, m, i, mt, tol: t.get("role", "pass")),
    ("result", "result", lambda t, m, i, mt, tol: "pass" if t.get("verdict", t["passed"]) else "fail"),
    ("token rel", "token_rel", lambda t, m, i, mt, tol: m.get("token_rel")),
    ("token_rtol", "token_rtol", lambda t, m, i, mt, tol: tol.get("token_rtol")),
    ("isolated token rel", "isolated_token_rel", lambda t, m, i, mt, tol: i.get("token_rel")),
    ("least passing row_rtol", "min_row_rtol", lambda t, m, i, mt, tol: mt.get("row_rtol")),
    ("row_rtol", "row_rtol", lambda t, m, i, mt, tol: tol.get("row_rtol")),
    ("max abs", "max_abs", lambda t, m, i, mt, tol: m.get("max_abs")),
    ("isolated max abs", "isolated_max_abs", lambda t, m, i, mt, tol: i.get("max_abs")),
    ("max rel", "max_rel", lambda t, m, i, mt, tol: m.get("max_rel")),
    ("mean abs", "mean_abs", lambda t, m, i, mt, tol: m.get("mean_abs")),
    ("cosine", "cosine", lambda t, m, i, mt, tol: m.get("cosine")),
    ("SQNR dB", "sqnr_db", lambda t, m, i, mt, tol: m.get("sqnr_db")),
    ("mismatch", "mismatch", lambda t, m, i, mt, tol: m.get("mismatch_frac")),
    ("atol", "atol", lambda t, m, i, mt, tol: tol.get("atol")),
    ("rtol", "rtol", lambda t, m, i, mt, tol: tol.get("rtol")),
    ("least passing atol", "min_atol", lambda t, m, i, mt, tol: mt.get("atol")),
    ("margin", "margin", lambda t, m, i, mt, tol: t.get("margin")),
    ("growth", "growth", lambda t, m, i, mt, tol: t.get("growth")),
)

STYLE = """body{font-family:system-ui,sans-serif;margin:1.5em 2em;color:#222}h2{margin-top:1.6em}
.verdict{padding:2px 10px;border-radius:4px;color:#fff;font-weight:bold}.passed{background:#2a7a3a}
.failed{background:#c0262d}dl.meta{display:grid;grid-template-columns:max-content auto;gap:2px 14px;font-size:14px}
dl.meta dt{font-weight:bold}dl.meta dd{margin:0}table{border-collapse:collapse;font-size:13px}
td,th{border:1px solid #ccc;padding:2px 6px;text-align:left}#taps th{cursor:pointer;background:#f3f3f3;
position:sticky;top:0}#taps th[aria-sort=ascending]::after{content:" ▲"}
#taps th[aria-sort=descending]::after{content:" ▼"}
#taps td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}tr.fail{background:#fde4e4}tr.source td:nth-child(2)
{font-weight:bold;color:#a00}#tap-filter{width:24em;padding:3px 6px;margin:6px 0}.muted{color:#666}"""

SCRIPT = """(function () {
  const table = document.getElementById("taps"), body = table.tBodies[0], head = table.tHead.rows[0];
  const box = document.getElementById("tap-filter"), count = document.getElementById("tap-count");
  function filter() {
    const terms = box.value.toLowerCase().split(/\\s+/).filter(Boolean);
    let shown = 0;
    for (const row of body.rows) {
      row.hidden = !terms.every(t => row.dataset.search.includes(t));
      if (!row.hidden) shown++;
    }
    count.textContent = shown + " of " + body.rows.length + " taps";
  }
  function sort(col, dir) {
    const key = r => r.cells[col].dataset.v;
    const rows = Array.from(body.rows);
    rows.sort((a, b) => {
      const x = key(a), y = key(b);
      if (x === "" || y === "") return (x === "") - (y === "");  // no value: last either way
      const nx = Number(x), ny = Number(y);
      return dir * (isNaN(nx) || isNaN(ny) ? x.localeCompare(y) : nx - ny);
    });
    rows.forEach(r => body.appendChild(r));
    for (const th of head.cells) th.removeAttribute("aria-sort");
    head.cells[col].setAttribute("aria-sort", dir > 0 ? "ascending" : "descending");
  }
  Array.from(head.cells).forEach((th, col) => th.addEventListener("click",
    () => sort(col, th.getAttribute("aria-sort") === "ascending" ? -1 : 1)));
  box.addEventListener("input", filter);
  const view = new URLSearchParams(location.hash.slice(1));
  if (view.has("filter")) box.value = view.get("filter");
  const col = Array.from(head.cells).findIndex(th => th.dataset.key === view.get("sort"));
  if (col >= 0) sort(col, view.get("dir") === "desc" ? -1 : 1);
  filter();
})();"""


def _e(v: Any) -> str:
    return html.escape(str(v), quote=True)


def _fmt(v: Any) -> str:
    if v is None:
        return "—"
    return format(v, ".3g") if isinstance(v, float) else str(v)


def _cell(v: Any) -> str:
    if v is None or isinstance(v, (int, float)) and not isinstance(v, bool):
        return f'<td class="num" data-v="{"" if v is None else repr(v)}">{_e(_fmt(v))}</td>'
    return f'<td data-v="{_e(v)}">{_e(v)}</td>'


def table(taps: list[dict]) -> str:
    head = "".join(f'<th data-key="{key}">{_e(name)}</th>' for name, key, _ in COLUMNS)
    rows = []
    for n, t in enumerate(taps):
        m, mt, tol = t.get("metrics") or {}, t.get("min_tolerance") or {}, t.get("tolerance") or {}
        iso = (t.get("isolated") or {}).get("metrics") or {}
        values = [n] + [get(t, m, iso, mt, tol) for _, _, get in COLUMNS[1:]]
        name = t["name"] + (f" (decode step {t['step']})" if plots.is_decode(t) else "")
        values[1] = name
        verdict, role = values[4], values[3]
        search = " ".join([name, t["level"], role, verdict, "failed" if verdict == "fail" else "passed"]).lower()
        cls = " ".join(c for c in ("fail" if verdict == "fail" else "", "source" if role == "source" else "") if c)
        rows.append(f'<tr class="{cls}" data-search="{_e(search)}" title="{_e(t.get("message", ""))}">'
                    + "".join(_cell(v) for v in values) + "</tr>")
    return (f'<input id="tap-filter" type="search" placeholder="filter: tap name, level, role, pass/fail" '
            f'aria-label="filter the taps"> <span id="tap-count" class="muted"></span>'
            f'<table id="taps"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>')


def _summary(report: dict) -> tuple[str, str]:
    """The summary at the top of the page, and the run's details at its foot."""
    run = report["run"]
    verdict = "PASSED" if report["passed"] else "FAILED"
    first = report.get("first_divergence")
    source = next((t for t in report["taps"] if first and tap_key(t) == tap_key(first)), None)
    at = f", decode step {first['step']}" if first and first.get("phase") == "decode" else ""
    first_html = ("no divergence" if not first else
                  f"<b>{_e(first['name'])}</b> (layer {_e(_fmt(first.get('layer')))}{_e(at)})"
                  + (f" — {_e(source['message'])}" if source and source.get("message") else ""))
    meta = [("model", run.get("model")), ("architecture", run.get("architecture")), ("format", run.get("format")),
            ("level", run.get("level")),
            ("mode", run.get("mode", "") + (f" ({run['mode_reason']})" if run.get("mode_reason") else "")),
            ("candidate", run.get("candidate")), ("dtype", run.get("dtype")), ("against", run.get("against")),
            ("started", run.get("started")), ("prompts sha256", run.get("prompts_sha256")),
            ("model sha256", run.get("model_sha256")),
            ("decode steps", run.get("decode_steps")),
            ("kernel branches", describe_branches(run.get("kernel_branches"))),
            ("schedule", describe_schedule(run.get("schedule"))),
            ("versions", " · ".join(f"{k} {v}" for k, v in (run.get("versions") or {}).items())),
            ("timings", " · ".join(f"{k.removesuffix('_s')} {v:.2f} s" for k, v in (run.get("timings") or {}).items()
                                   if isinstance(v, (int, float))))]
    dl = "".join(f"<dt>{_e(k)}</dt><dd>{_e(v)}</dd>" for k, v in meta if v not in (None, ""))
    hints = "".join(f"<tr><td>{_e(h['tap'])}</td><td>{_e(h['kind'])}</td><td>{_e(h['evidence'])}</td>"
                    f"<td>{_e(h['fix'])}</td></tr>" for h in report["hints"])
    hints_html = (f'<table id="hints"><thead><tr><th>tap</th><th>kind</th><th>evidence</th><th>fix</th></tr></thead>'
                  f"<tbody>{hints}</tbody></table>" if hints else "<p>No hints.</p>")
    checks = "".join(f"<li><details><summary>{_e(name)}: {'pass' if c.get('passed') else 'FAIL'}</summary>"
                     f"<pre>{_e(json.dumps(c, indent=1))}</pre></details></li>"
                     for name, c in (run.get("extras") or {}).items() if isinstance(c, dict))
    sep = describe_separation(report.get("separation")) or "nothing compared"
    line = " · ".join(_e(f"{k} {run[k]}") for k in ("format", "level", "mode", "dtype") if run.get(k))
    summary = (f'<p><span id="verdict" class="verdict {verdict.lower()}">{verdict}</span> '
               f"{len(report['taps'])} taps compared · <code>{_e(run.get('model', ''))}</code> · {line}</p>"
               f'<p id="first-divergence">First divergence: {first_html}</p><p>Separation: {_e(sep)}.</p>'
               f"<h2>Hints</h2>{hints_html}")
    details = (f"<h2>Checks</h2><ul>{checks}</ul>" if checks else "") + f'<h2>Run</h2><dl class="meta">{dl}</dl>'
    return summary, details


def html_page(report: dict, heatmap: dict | None) -> str:
    run = report["run"]
    summary, details = _summary(report)
    sections = []
    layers = plots.error_against_layer(report)
    if layers is not None:
        sections.append("<h2>Error against layer</h2>" + plots.div(layers, "plot-layers"))
    steps = plots.error_against_step(report)
    if steps is not None:
        sections.append("<h2>Error against decode step</h2>" + plots.div(steps, "plot-steps"))
    heat = plots.heatmap(heatmap)
    if heat is not None:
        sections.append(f"<h2>Heatmap of |candidate − reference|: {_e(heatmap['tap'])}</h2>"
                        + plots.div(heat, "plot-heatmap"))
    return f"""<!doctype html><html lang="en"><head><meta charset="utf-8">
<title>parity {_e(run['id'])}</title><style>{STYLE}</style>
<script>{plots.plotly_js()}</script></head><body>
<h1>parity report {_e(run['id'])}</h1>
{summary}
{''.join(sections)}
<h2>Taps</h2>{table(report['taps'])}
{details}
<script>{SCRIPT}</script></body></html>
"""
