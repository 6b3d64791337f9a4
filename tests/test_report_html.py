"""report.html: its figures from report.json alone, and the page as a browser shows it (headless Chromium)."""

import json
import re
import shutil
import subprocess
from html.parser import HTMLParser

import pytest
import torch

from vllm_parity.harness import plots, report, trend
from vllm_parity.harness.compare import TapResult, attribute, merge_isolated
from vllm_parity.harness.diagnosis import Hint
from vllm_parity.harness.metrics import Tolerance, compare, passes
from vllm_parity.harness.records import Diagnosis, Judgement, RunRecord
from vllm_parity.harness.taps import layer_of, level_of

LAYERS, KINDS = 3, ("attn.q", "attn.o", "mlp.down", "output")
TAPS = ["embed"] + [f"layers.{i}.{k}" for i in range(LAYERS) for k in KINDS] + ["final_norm", "logits"]
SOURCE = "layers.1.mlp.down"
TOL = Tolerance(atol=0.0, rtol=1e-3, row_rtol=1e-3, token_rtol=1e-3)


def _results(fault_from: int | None, own_only: bool) -> list[TapResult]:
    """Every tap of a 3-layer model, the fault planted at SOURCE; propagated (``own_only`` False) it reaches
    every later tap, isolated only SOURCE itself."""
    g = torch.Generator().manual_seed(0)
    out = []
    for n, name in enumerate(TAPS):
        ref = torch.randn(2 * 8, 32, generator=g)
        noise = 1e-6 * (1 + n) * torch.randn(ref.shape, generator=g)
        faulty = fault_from is not None and (n == fault_from or (n > fault_from and not own_only))
        cand = ref + noise + (0.05 * torch.randn(ref.shape, generator=g) if faulty else 0)
        m = compare(ref, cand, TOL)
        out.append(TapResult(name, level_of(name), layer_of(name), [2, 8, 32], m, TOL, passes(m, TOL)))
    return attribute(out, LAYERS)


def _record(decode: bool = False) -> dict:
    at = TAPS.index(SOURCE)
    taps = merge_isolated(_results(at, own_only=False), _results(at, own_only=True))
    hints = [Hint(SOURCE, "scale_wrong", "channel 3's scale is 1.05x the reference's", "read the scale of channel 3")]
    run = {"id": "r-html", "started": "2026-01-01T00:00:00+0000", "model": "/m", "format": "ternary",
           "architecture": "llama", "level": "model", "mode": "isolated", "mode_reason": "a test",
           "dtype": "float32", "candidate": "vllm", "prompts_sha256": "p", "model_sha256": "m",
           "versions": {"torch": "2"}, "timings": {"reference_s": 1.5}, "against": "live"}
    rep = RunRecord(run, Judgement(taps), Diagnosis(hints), {"greedy": {"passed": True, "agree": 8}}).as_dict()
    if decode:  # the shape a decode-step tap takes in a report
        for step in range(3):
            rep["taps"].append({**rep["taps"][TAPS.index("logits")], "phase": "decode", "step": step})
    return rep


def _heat() -> dict:
    ref = torch.zeros(3 * 70, 300)
    cand = ref.clone()
    cand[2 * 70 + 65, 201] = 7.0  # prompt 2, position 65, feature 201
    rows = [(p, i) for p in range(3) for i in range(70)]
    return report.heatmap_of(SOURCE, ref, cand, rows)


def _write(tmp_path, decode: bool = False):
    return report.write(tmp_path / "rep", _record(decode), _heat())


def test_heatmap_keeps_every_prompt_pooled():
    heat = _heat()
    assert heat["features"] == 300 and heat["col_step"] == 3
    assert [p["prompt"] for p in heat["prompts"]] == [0, 1, 2]
    for p in heat["prompts"]:
        assert p["positions"] == 70 and p["row_step"] == 2
        assert len(p["cells"]) == 35 and all(len(r) == 100 for r in p["cells"])
    assert max(max(r) for r in heat["prompts"][0]["cells"]) == 0.0
    assert heat["prompts"][2]["cells"][65 // 2][201 // 3] == 7.0
    assert sum(v > 0 for r in heat["prompts"][2]["cells"] for v in r) == 1
    many = report.heatmap_of("t", torch.zeros(9 * 4, 8), torch.ones(9 * 4, 8), [(p, i) for p in range(9) for i in range(4)])
    assert [p["prompt"] for p in many["prompts"]] == [0, 1, 2, 3]  # a few prompts: the page stays small


def test_a_decode_steps_heatmap_is_drawn_at_the_positions_it_computed():
    """A decode step's rows sit at len(prompt) + step: the heatmap's rows are labelled with those positions."""
    from vllm_parity.harness import plots

    cand = torch.zeros(2, 8)
    cand[1, 3] = 1.0
    heat = report.heatmap_of("layers.0.attn.q", torch.zeros(2, 8), cand, [(0, 66), (1, 71)])
    assert [p["first"] for p in heat["prompts"]] == [66, 71]
    fig = plots.heatmap(heat)
    assert [list(t.y) for t in fig.data] == [[66], [71]]


def test_error_against_layer_plots_each_kind_at_its_primary_error():
    rep = _record()
    fig = plots.error_against_layer(rep)
    series = {(t.name, t.xaxis): t for t in fig.data if not t.name.startswith("tolerance")}
    assert {name for name, _ in series} == {"embed", *KINDS, "final_norm", "logits"}
    assert {axis for _, axis in series} == {"x", "x2"}  # propagated and isolated side by side
    down = series[("mlp.down", "x")]
    expected = [trend.primary(t)["value"] for t in rep["taps"] if plots.kind_of(t["name"]) == "mlp.down"]
    assert list(down.y) == pytest.approx(expected)
    assert [round(x) for x in down.x] == [0, 1, 2] and len({round(x - round(x), 9) for x in down.x}) == 1
    within = [series[(k, "x")].x[1] for k in KINDS]  # a layer's taps in dataflow order across it
    assert within == sorted(within) and 1 - 0.5 < within[0] and within[-1] < 1 + 0.5
    assert list(down.marker.symbol) == ["circle", "x", "x"]  # propagated: the fault reaches layer 2
    assert list(series[("mlp.down", "x2")].marker.symbol) == ["circle", "x", "circle"]  # isolated: its own only
    assert list(series[("embed", "x")].x) == [-1] and list(series[("logits", "x")].x) == [LAYERS]
    (tolerance,) = [t for t in fig.data if t.name.startswith("tolerance") and t.xaxis == "x"]
    assert list(tolerance.y) == [1e-3, 1e-3] and tolerance.name == "tolerance token_rtol=0.001"
    assert fig.layout.yaxis.type == "log"
    marks = [s for s in fig.layout.shapes if s.type == "line" and s.x0 == s.x1]
    assert len(marks) == 2 and marks[0].x0 == down.x[1]  # the first divergence, on both panels
    assert any(a.text == f"first divergence: {SOURCE}" for a in fig.layout.annotations)


def test_propagated_run_has_one_panel_and_no_decode_section(tmp_path):
    at = TAPS.index(SOURCE)
    rep = RunRecord({"id": "p", "mode": "propagated"}, Judgement(_results(at, own_only=False)), Diagnosis()).as_dict()
    fig = plots.error_against_layer(rep)
    assert {t.xaxis for t in fig.data} <= {None, "x"} and "xaxis2" not in fig.layout
    assert plots.error_against_step(rep) is None


def test_decode_taps_are_plotted_against_their_step():
    rep = _record(decode=True)
    fig = plots.error_against_step(rep)
    (logits,) = [t for t in fig.data if t.name == "logits"]
    assert list(logits.x) == [0, 1, 2]
    layer_fig = plots.error_against_layer(rep)
    assert sum(len(t.x) for t in layer_fig.data if t.name == "logits") == 2  # prefill only, both panels


def test_a_tap_without_a_finite_error_is_drawn_failed_at_the_top():
    rep = _record()
    broken = next(t for t in rep["taps"] if t["name"] == "layers.2.attn.q")
    broken.update(metrics=None, min_tolerance=None, passed=False, message="layers.2.attn.q: shapes differ")
    fig = plots.error_against_layer(rep)
    (q,) = [t for t in fig.data if t.name == "attn.q" and t.xaxis == "x"]
    assert q.y[2] == pytest.approx(10 ** fig.layout.yaxis.range[1]) and q.marker.symbol[2] == "x"
    assert "shapes differ" in q.text[2]


def test_page_is_self_contained(tmp_path):
    out = _write(tmp_path, decode=True)
    page = (out / "report.html").read_text()
    assert not re.search(r"<(script|link|img)[^>]+(src|href)\s*=\s*[\"']?(https?:)?//", page)
    assert page.count("<script") >= 4  # plotly.js once, a figure each, the table's script
    assert len(re.findall(r"<script>/\*\*\s*\* plotly\.js", page)) <= 1
    for div_id in ("plot-layers", "plot-steps", "plot-heatmap", "taps", "tap-filter", "hints"):
        assert f'id="{div_id}"' in page
    assert page.count("<tr class=") == len(TAPS) + 3
    report.render(out)  # again from report.json and heatmap.json alone
    assert (out / "report.html").read_text().count("<tr class=") == len(TAPS) + 3


def test_an_older_heatmap_still_renders(tmp_path):
    out = report.write(tmp_path / "old", _record())
    (out / "heatmap.json").write_text(json.dumps({"tap": SOURCE, "rows": 4, "cols": 2, "row_step": 1,
                                                  "col_step": 1, "cells": [[0.0, 1.0]] * 4}))
    report.render(out)
    assert 'id="plot-heatmap"' in (out / "report.html").read_text()


# -- in a browser ------------------------------------------------------------------------------


def _chromium() -> str | None:
    return next((b for b in ("chromium-headless-shell", "chromium", "chrome-headless-shell", "google-chrome")
                 if shutil.which(b)), None)


def _browse(tmp_path, url: str, *args: str) -> subprocess.CompletedProcess:
    """Chromium, headless, with every host name unresolvable: a page that needs the network shows nothing."""
    cmd = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
           "--hide-scrollbars", f"--user-data-dir={tmp_path / 'profile'}", "--host-resolver-rules=MAP * ~NOTFOUND",
           "--virtual-time-budget=15000", *args, url]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)


class _Elements(HTMLParser):
    """Each element's tag, attributes, and the ids of the elements around it."""

    VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}

    def __init__(self):
        super().__init__()
        self.stack, self.found = [], []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.found.append((tag, a, [x.get("id") for _, x in self.stack if x.get("id")]))
        if tag not in self.VOID:
            self.stack.append((tag, a))

    def handle_startendtag(self, tag, attrs):
        self.found.append((tag, dict(attrs), [x.get("id") for _, x in self.stack if x.get("id")]))

    def handle_endtag(self, tag):
        for i in range(len(self.stack) - 1, -1, -1):
            if self.stack[i][0] == tag:
                del self.stack[i:]
                break

    def within(self, element_id: str, cls: str | None = None, tag: str | None = None) -> list[dict]:
        return [a for t, a, ids in self.found if element_id in ids and (tag is None or t == tag)
                and (cls is None or cls in (a.get("class") or "").split())]


@pytest.mark.skipif(_chromium() is None, reason="no Chromium binary (the Debian package chromium-headless-shell; "
                                                "scripts/setup.sh installs it when run as root)")
def test_report_in_headless_chromium(tmp_path):
    out = _write(tmp_path)
    url = (out / "report.html").resolve().as_uri()
    # a view to link to: the filter and the sort are the table's own script at work
    dom = _browse(tmp_path, url + "#filter=layers.1&sort=token_rel&dir=desc", "--dump-dom").stdout
    page = _Elements()
    page.feed(dom)
    for plot in ("plot-layers", "plot-heatmap"):
        assert page.within(plot, cls="main-svg"), f"{plot}: plotly drew nothing"
    assert len(page.within("plot-layers", cls="trace")) >= 2 * 7  # a series per kind, on both panels
    assert page.within("plot-heatmap", cls="updatemenu-header"), "no prompt selector on the heatmap"
    assert page.within("plot-heatmap", cls="hm") or page.within("plot-heatmap", tag="image")
    assert any(a.get("id") == "tap-filter" and a.get("value", "") == "" for t, a, _ in page.found if t == "input")
    rows = page.within("taps", tag="tr")[1:]
    assert len(rows) == len(TAPS)
    shown = [r for r in rows if "hidden" not in r]
    assert len(shown) == len(KINDS) and all(r["data-search"].startswith("layers.1.") for r in shown)
    rep = json.loads((out / "report.json").read_text())
    worst = max(rep["taps"], key=lambda t: t["metrics"]["token_rel"])["name"]
    assert rows[0]["data-search"].startswith(worst + " ")  # sorted by token rel, largest first
    assert f">{len(KINDS)} of {len(TAPS)} taps<" in dom

    shot = tmp_path / "shot.png"
    _browse(tmp_path, url, f"--screenshot={shot}", "--window-size=1200,1400")
    image = pytest.importorskip("PIL.Image", reason="Pillow reads the screenshot").open(shot).convert("RGB")
    assert image.size == (1200, 1400)
    colors = image.getcolors(maxcolors=1 << 22)
    white = next((n for n, c in colors if c == (255, 255, 255)), 0)
    assert len(colors) > 200, f"{len(colors)} distinct colours: the page looks blank"
    assert white < 0.9 * image.size[0] * image.size[1], "the page is nearly all white"
