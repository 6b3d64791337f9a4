"""The figures of ``report.html``, drawn with plotly from ``report.json`` and ``heatmap.json`` alone.

Each tap is plotted at its error under its primary criterion (``trend.primary``: the token relative
error, or for a tap judged elementwise only the least atol that would have passed), against its layer,
one series per tap kind (the name without ``layers.{i}.``). A decode-step tap is a report tap with
``"phase": "decode"`` and an integer ``"step"``; such taps are plotted against the step instead.
"""

from __future__ import annotations

import math
import re
from typing import Any

import plotly.graph_objects as go
from plotly.colors import qualitative
from plotly.offline import get_plotlyjs
from plotly.subplots import make_subplots

from vllm_parity.harness.trend import MEASURES, primary

_LAYER = re.compile(r"^layers\.(\d+)\.")
PALETTE = qualitative.Dark24
CONFIG = {"displaylogo": False, "responsive": True}


def plotly_js() -> str:
    """plotly.js itself, for one inline script per page: the report opens offline."""
    return get_plotlyjs()


def div(fig: go.Figure, div_id: str) -> str:
    return fig.to_html(full_html=False, include_plotlyjs=False, div_id=div_id, config=CONFIG)


def kind_of(name: str) -> str:
    """``layers.3.attn.q`` -> ``attn.q``; a tap outside the layers is its own kind."""
    return _LAYER.sub("", name)


def is_decode(tap: dict[str, Any]) -> bool:
    return tap.get("phase") == "decode" and isinstance(tap.get("step"), int)


def _placer(taps: list[dict[str, Any]]):
    """Where a tap sits on the layer axis: a layer's taps spread over it in dataflow order (the report's
    order), the embedding before layer 0, the model's head after the last layer."""
    num_layers = 1 + max((t["layer"] for t in taps if t.get("layer") is not None), default=-1)
    kinds = list(dict.fromkeys(kind_of(t["name"]) for t in taps if t.get("layer") is not None))
    width = 0.6 / max(len(kinds) - 1, 1)
    offset = {k: -0.3 + i * width if len(kinds) > 1 else 0.0 for i, k in enumerate(kinds)}

    def x(tap: dict[str, Any]) -> float:
        if tap.get("layer") is not None:
            return tap["layer"] + offset[kind_of(tap["name"])]
        return -1 if tap["name"] == "embed" else num_layers
    return x, num_layers


def _point(tap: dict[str, Any]) -> dict[str, Any]:
    return {**primary(tap), "failed": not tap["passed"], "role": tap.get("role", "pass")}


def _axis(values: list[float], bounds: list[float]) -> tuple[float, float]:
    """The log axis' floor (where an exact zero is drawn) and ceiling (a failure with no finite error)."""
    finite = [v for v in values + bounds if v is not None and math.isfinite(v) and v > 0]
    lo, hi = (min(finite), max(finite)) if finite else (1e-6, 1.0)
    return 10 ** (math.floor(math.log10(lo)) - 1), 10 ** (math.ceil(math.log10(hi)) + 1)


def _series(taps: list[dict], x_of, key, floor: float, ceiling: float) -> dict[str, dict[str, list]]:
    """Per series (``key`` of a tap): x, y, marker symbols and hover texts."""
    out: dict[str, dict[str, list]] = {}
    for t in taps:
        p = _point(t)
        v = p["value"]
        if v is None and not p["failed"]:
            continue
        what = MEASURES.get(p["measure"], (p["measure"],))[0]
        if v is None:
            y, shown = ceiling, "no finite error" if t.get("metrics") else (t.get("message") or "not compared")
        else:
            y, shown = max(v, floor), f"{v:.3g}" + (" (drawn at the floor)" if v < floor else "")
        s = out.setdefault(key(t), {"x": [], "y": [], "symbol": [], "text": []})
        s["x"].append(x_of(t))
        s["y"].append(y)
        s["symbol"].append("x" if p["failed"] else "circle")
        bound = "—" if p["bound"] is None else f"{p['bound']:.3g}"
        s["text"].append(f"{t['name']}<br>{what}: {shown}<br>bound: {bound}<br>{p['role']}")
    return out


def _tolerances(taps: list[dict], key) -> dict[tuple[str, float], list[str]]:
    """Each distinct (measure, bound), with the series judged by it."""
    out: dict[tuple[str, float], list[str]] = {}
    for t in taps:
        p = primary(t)
        if p["bound"] is not None:
            judged = out.setdefault((p["measure"], p["bound"]), [])
            if key(t) not in judged:
                judged.append(key(t))
    return out


def _colors(kinds: list[str]) -> dict[str, str]:
    return {k: PALETTE[i % len(PALETTE)] for i, k in enumerate(kinds)}


def _add(fig: go.Figure, panels: list[list[dict]], x_of, x_range: tuple[float, float], key=None) -> None:
    """Every panel's series (one per tap kind, or per ``key`` of a tap) and tolerance lines, one legend
    entry per series across the panels."""
    key = key or (lambda t: kind_of(t["name"]))
    all_taps = [t for panel in panels for t in panel]
    points = [_point(t) for t in all_taps]
    floor, ceiling = _axis([p["value"] for p in points], [p["bound"] for p in points])
    color = _colors(list(dict.fromkeys(key(t) for t in all_taps)))
    tolerances = _tolerances(all_taps, key)
    for col, panel in enumerate(panels, 1):
        where = {"row": 1, "col": col} if len(panels) > 1 else {}
        for kind, s in _series(panel, x_of, key, floor, ceiling).items():
            fig.add_trace(go.Scatter(x=s["x"], y=s["y"], mode="lines+markers", name=kind, legendgroup=kind,
                                     showlegend=col == 1, line={"color": color[kind], "width": 1.5},
                                     marker={"symbol": s["symbol"], "size": 8, "color": color[kind]},
                                     text=s["text"], hovertemplate="%{text}<extra></extra>"), **where)
        for (measure, bound), judged in tolerances.items():
            label = f"tolerance {MEASURES.get(measure, (0, measure))[1]}={bound:g}"
            if len(tolerances) > 1:
                label += f" ({', '.join(judged)})"
            fig.add_trace(go.Scatter(x=list(x_range), y=[bound, bound], mode="lines", name=label,
                                     legendgroup=label, showlegend=col == 1,
                                     line={"color": "#222", "dash": "dash", "width": 1},
                                     hovertemplate=f"{label}<extra></extra>"), **where)
    fig.update_yaxes(type="log", exponentformat="power", dtick=1, range=[math.log10(floor), math.log10(ceiling)])


def error_against_layer(report: dict[str, Any]) -> go.Figure | None:
    """Propagated (and, in an isolated run, isolated) error of every prefill tap against its layer."""
    taps = [t for t in report["taps"] if not is_decode(t)]
    if not taps:
        return None
    x_of, num_layers = _placer(taps)
    isolated = [t["isolated"] for t in taps if t.get("isolated")]
    panels = [taps] + ([isolated] if isolated else [])
    titles = ["propagated (errors accumulate)", "isolated (each layer fed the reference's input)"]
    fig = make_subplots(rows=1, cols=len(panels), shared_yaxes=True, horizontal_spacing=0.04,
                        subplot_titles=titles[:len(panels)])
    _add(fig, panels, x_of, (-1.5, num_layers + 0.5))
    ticks = sorted({t["layer"] if t.get("layer") is not None else x_of(t) for t in taps})
    text = ["embed" if x == -1 else "head" if x == num_layers else str(x) for x in ticks]
    fig.update_xaxes(tickvals=ticks, ticktext=text, title_text="layer", range=[-1.5, num_layers + 0.5])
    fig.update_yaxes(title_text="error (token relative; elementwise-only taps: least passing atol)", col=1)
    first = report.get("first_divergence")
    if first and not is_decode(first):  # a decode step's is marked on the plot against the step
        source = next((t for t in taps if t["name"] == first["name"]), None)
        if source is not None:
            fig.add_vline(x=x_of(source), line={"color": "#c00", "dash": "dot", "width": 2},
                          annotation_text=f"first divergence: {first['name']}", annotation_font_color="#c00",
                          row="all", col="all")
    fig.update_layout(height=460, margin={"t": 60, "l": 70, "r": 20, "b": 50}, legend={"font": {"size": 11}},
                      hovermode="closest", template="plotly_white")
    return fig


def error_against_step(report: dict[str, Any]) -> go.Figure | None:
    """Decode-step taps' error against the step, one series per tap (None: no decode taps)."""
    taps = [t for t in report["taps"] if is_decode(t)]
    if not taps:
        return None
    steps = [t["step"] for t in taps]
    fig = go.Figure()
    _add(fig, [taps], lambda t: t["step"], (min(steps) - 0.5, max(steps) + 0.5), key=lambda t: t["name"])
    fig.update_xaxes(title_text="decode step", dtick=1)
    fig.update_yaxes(title_text="error (token relative; elementwise-only taps: least passing atol)")
    first = report.get("first_divergence")
    if first and is_decode(first):
        fig.add_vline(x=first["step"], line={"color": "#c00", "dash": "dot", "width": 2},
                      annotation_text=f"first divergence: {first['name']}", annotation_font_color="#c00")
    fig.update_layout(height=380, margin={"t": 30, "l": 70, "r": 20, "b": 50}, template="plotly_white")
    return fig


def heatmap(heat: dict[str, Any] | None) -> go.Figure | None:
    """|candidate - reference| of the first failing tensor, positions x features, one trace per prompt
    with a selector (heatmap.json as ``report.heatmap_of`` writes it; an older one is one panel of rows)."""
    if not heat:
        return None
    prompts = heat.get("prompts") or [{"prompt": None, "positions": heat["rows"], "row_step": heat["row_step"],
                                       "cells": heat["cells"]}]
    col_step = heat["col_step"]
    peaks = [max((max(r) for r in p["cells"] if r), default=0.0) for p in prompts]
    top = max(peaks) or 1.0
    shown = peaks.index(max(peaks))  # the prompt with the largest difference first
    fig = go.Figure()
    for i, p in enumerate(prompts):
        cells = p["cells"]
        fig.add_trace(go.Heatmap(
            z=cells, x=[j * col_step for j in range(len(cells[0]) if cells else 0)],
            y=[p.get("first", 0) + j * p["row_step"] for j in range(len(cells))], zmin=0, zmax=top, colorscale="Reds",
            visible=i == shown, name="rows" if p["prompt"] is None else f"prompt {p['prompt']}",
            colorbar={"title": {"text": "|cand − ref|"}},
            hovertemplate="position %{y}, feature %{x}: %{z:.3g}<extra></extra>"))

    def title(p):
        pooled = f"max-pooled {p['row_step']}×{col_step}"
        who = "all rows" if p["prompt"] is None else f"prompt {p['prompt']}, {p['positions']} positions"
        return f"{heat['tap']}: {who}, {heat.get('features', heat.get('cols'))} features ({pooled})"
    if len(prompts) > 1:
        buttons = [{"label": f"prompt {p['prompt']}", "method": "update",
                    "args": [{"visible": [j == i for j in range(len(prompts))]}, {"title.text": title(p)}]}
                   for i, p in enumerate(prompts)]
        fig.update_layout(updatemenus=[{"type": "dropdown", "buttons": buttons, "direction": "down",
                                        "x": 0, "xanchor": "left", "y": 1.16, "yanchor": "top",
                                        "showactive": True, "active": shown}])
    fig.update_xaxes(title_text="feature")
    fig.update_yaxes(title_text="position" if prompts[0]["prompt"] is not None else "row", autorange="reversed")
    fig.update_layout(title={"text": title(prompts[shown]), "x": 0.25, "font": {"size": 14}}, height=460,
                      margin={"t": 80, "l": 70, "r": 20, "b": 50}, template="plotly_white")
    return fig
