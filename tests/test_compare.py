"""Metrics, tolerances, dumps, comparison, reports and snapshots — no engine needed."""

import dataclasses
import errno
import json
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from vllm_parity.harness import report, snapshots
from vllm_parity.harness.compare import attribute, compare_dumps, first_divergence
from vllm_parity.harness.dumps import DumpReader, DumpWriter
from vllm_parity.harness.metrics import Tolerance, compare, passes
from vllm_parity.harness.taps import canonical_order, level_of
from vllm_parity.harness.tolerances import ToleranceTable, load, parse


@given(st.integers(1, 6), st.integers(1, 40), st.floats(1e-6, 1e3), st.integers(0, 10_000))
def test_metrics_find_the_worst_element(rows, cols, scale, seed):
    g = torch.Generator().manual_seed(seed)
    ref = torch.randn(rows, cols, generator=g) * scale
    cand = ref.clone()
    i, j = seed % rows, (seed // 7) % cols
    cand[i, j] += scale  # one element off by a full scale
    m = compare(ref, cand, Tolerance(atol=1e-3 * scale))
    assert m.worst_index == (i, j)
    assert m.worst_ref == pytest.approx(float(ref[i, j]))
    assert m.max_abs == pytest.approx(scale, rel=1e-5)
    assert m.mismatch_frac == pytest.approx(1 / (rows * cols))
    assert m.min_atol == pytest.approx(scale, rel=1e-5)
    assert not passes(m, Tolerance(atol=1e-3 * scale))
    loose = Tolerance(atol=1.01 * scale)
    assert passes(compare(ref, cand, loose), loose)


def test_identical_tensors():
    t = torch.randn(3, 4)
    m = compare(t, t.clone(), Tolerance(atol=0.0))
    assert m.max_abs == 0 and m.cosine == pytest.approx(1.0) and math.isinf(m.sqnr_db) and passes(m, Tolerance(0.0))


def test_nonfinite_candidate_always_fails():
    ref = torch.ones(4)
    cand = ref.clone()
    cand[2] = float("nan")
    m = compare(ref, cand, Tolerance(atol=1e9))
    assert m.nonfinite == 1 and m.worst_index == (2,) and not passes(m, Tolerance(atol=1e9))
    ref[1] = float("inf")  # where the reference itself is not finite the element is not judged
    cand = ref.clone()
    assert passes(compare(ref, cand, Tolerance(0.0)), Tolerance(0.0))


def test_rtol_and_mismatch_fraction():
    ref = torch.tensor([1.0, 100.0, 1000.0, 1e4])
    cand = ref * 1.001
    assert passes(compare(ref, cand, Tolerance(atol=0, rtol=2e-3)), Tolerance(atol=0, rtol=2e-3))
    tol = Tolerance(atol=0, rtol=1e-4, max_mismatch_frac=0.5)
    assert not passes(compare(ref, cand, tol), tol)


def test_most_specific_pattern_wins_and_keys_fall_back():
    table = parse({"max_growth": 5, "tolerances": {
        "*": {"atol": 1e-3}, "layers.*": {"rtol": 0.5}, "layers.*.mlp.down": {"atol": 7e-3},
        "logits": {"max_mismatch_frac": 0.01}}}, "test")
    down = table.resolve("layers.3.mlp.down")
    assert (down.atol, down.rtol) == (7e-3, 0.5)
    assert table.resolve("layers.3.attn.q").atol == 1e-3
    assert table.resolve("logits").max_mismatch_frac == 0.01 and table.resolve("logits").atol == 1e-3
    assert table.pattern_for("layers.3.mlp.down") == "layers.*.mlp.down"
    assert table.max_growth == 5
    assert ToleranceTable().resolve("x", torch.bfloat16).token_rtol > ToleranceTable().resolve("x", torch.float32).token_rtol


def test_tolerance_files(tmp_path):
    f = tmp_path / "tol.toml"
    f.write_text('[tolerances]\n"layers.*" = { atol = 2e-4 }\n')
    assert load(f).resolve("layers.0.output").atol == 2e-4
    f.write_text('[tolerances]\n"layers.*" = { atoll = 2e-4 }\n')
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['atoll'\]"):
        load(f)
    f.write_text("not toml [")
    with pytest.raises(ValueError, match="cannot read tolerances"):
        load(f)
    py = tmp_path / "pyproject.toml"
    py.write_text('[tool.parity]\nmax_growth = 3.0\n[tool.parity.tolerances]\nlogits = { atol = 0.5 }\n')
    table = load(None, py)
    assert table.resolve("logits").atol == 0.5 and table.max_growth == 3.0
    assert parse(json.loads(json.dumps({"tolerances": dict(table.rules)})), "x").rules == table.rules


def _dump(root, taps, tensors, meta=None):
    w = DumpWriter(root, meta or {})
    for tap in taps:
        w.write(tap, {f"{tap}@{p}": t for p, t in enumerate(tensors[tap])})
    return DumpReader(w.close())


def _pair(tmp_path, fault_tap=None, scale=1.0):
    taps = canonical_order(2)
    g = torch.Generator().manual_seed(0)
    ref = {t: [torch.randn(5, 8, generator=g), torch.randn(3, 8, generator=g)] for t in taps}
    cand = {t: [x.clone() for x in v] for t, v in ref.items()}
    if fault_tap is not None:
        start = taps.index(fault_tap)
        for t in taps[start:]:
            cand[t] = [x + scale * (1 + taps.index(t) - start) for x in cand[t]]
    return _dump(tmp_path / "r", taps, ref), _dump(tmp_path / "c", taps, cand), taps


def test_dump_round_trip_and_manifest(tmp_path):
    ref, _, taps = _pair(tmp_path)
    assert ref.taps() == taps and ref.prompts("logits") == [0, 1]
    assert ref.verify("layers.1.mlp.up", 1).shape == (3, 8)
    with pytest.raises(KeyError, match="no tensor for tap 'nope', prompt 0"):
        ref.get("nope", 0)
    with pytest.raises(FileExistsError, match="already holds a dump"):
        DumpWriter(tmp_path / "r")


def test_compare_finds_the_planted_source(tmp_path):
    # every tap from mlp.act on is off: act is the source, what is computed from it inherits
    ref, cand, taps = _pair(tmp_path, fault_tap="layers.1.mlp.act")
    results = compare_dumps(ref, cand, [t for t in taps if not t.endswith(".input")], ToleranceTable())
    by = {r.name: r for r in results}
    assert all(by[t].passed for t in taps[: taps.index("layers.1.mlp.act")] if t in by)
    assert first_divergence(results).name == "layers.1.mlp.act"
    assert (by["layers.1.mlp.down"].role, by["layers.1.mlp.down"].fed_by) == ("inherited", ["layers.1.mlp.act"])
    assert (by["layers.1.output"].role, by["layers.1.output"].fed_by) == ("inherited", ["layers.1.mlp.down"])
    assert by["logits"].role == "inherited"
    assert by["layers.1.mlp.act"].metrics.worst_index[:2] in {(0, i) for i in range(5)} | {(1, i) for i in range(3)}
    assert "token relative error" in by["layers.1.mlp.act"].message
    assert "above token_rtol=0.001 (prompt " in by["layers.1.mlp.act"].message


def test_independent_failures_are_each_a_source(tmp_path):
    ref, _, taps = _pair(tmp_path)
    results = compare_dumps(ref, ref, ["layers.0.attn.norm", "layers.0.attn.k", "layers.0.attn.v",
                                       "layers.0.attn.context"], ToleranceTable())
    # k and v both wrong, both computed from attn.norm, which passes
    results = attribute([dataclasses.replace(r, passed=i == 0) for i, r in enumerate(results)])
    assert [r.role for r in results] == ["pass", "source", "source", "inherited"]
    assert results[3].fed_by == ["layers.0.attn.k", "layers.0.attn.v"]


def _rows(value, rows=2, cols=4):
    return torch.full((rows, cols), float(value))


def test_growth_bound_flags_a_jump_of_the_relative_error_inside_tolerance(tmp_path):
    taps = canonical_order(3)
    ref = {t: [_rows(1.0)] for t in taps}
    cand = {t: [_rows(1.0)] for t in taps}
    cand["layers.0.output"] = [_rows(1 + 1e-7)]
    cand["layers.1.output"] = [_rows(1 + 1e-7)]
    # 500x the previous relative error, still under token_rtol 1e-3; growth is measured against a
    # floor of 1 % of token_rtol (1e-5) so that fp32 rounding noise alone never counts as a jump: 50x
    cand["layers.2.output"] = [_rows(1 + 5e-4)]
    results = compare_dumps(_dump(tmp_path / "r", taps, ref), _dump(tmp_path / "c", taps, cand),
                            ["layers.0.output", "layers.1.output", "layers.2.output"], ToleranceTable())
    assert [r.passed for r in results] == [True, True, False]
    assert "token relative error grew 50.0x" in results[2].message


def test_growth_with_the_signal_is_no_jump(tmp_path):
    """A layer that adds a massive activation grows the absolute error with the signal (as on a real
    model: 2.5e-5 -> 5.8e-4 at 118 dB); the relative error stays, and so does the verdict."""
    taps = canonical_order(2)
    ref = {t: [_rows(1.0)] for t in taps}
    cand = {t: [_rows(1 + 2e-6)] for t in taps}
    ref["layers.1.output"] = [_rows(3000.0)]
    cand["layers.1.output"] = [_rows(3000.0 * (1 + 2e-6))]
    results = compare_dumps(_dump(tmp_path / "r", taps, ref), _dump(tmp_path / "c", taps, cand),
                            ["layers.0.output", "layers.1.output"], ToleranceTable())
    assert [r.passed for r in results] == [True, True]
    assert results[1].metrics.max_abs / results[0].metrics.max_abs > 1000 and results[1].growth < 1.5
    legacy = parse({"tolerances": {"*": {"atol": 1e-4, "rtol": 1e-4}}}, "old.toml")
    # the same outputs under an elementwise table of before: judged by the absolute error, as then
    results = compare_dumps(_dump(tmp_path / "r2", taps, ref), _dump(tmp_path / "c2", taps, cand),
                            ["layers.0.output", "layers.1.output"], legacy)
    assert results[1].growth > 1000 and not results[1].passed and "error grew" in results[1].message


def test_token_criterion_and_row_scaled_elements():
    """Rows of a real model's residual stream: one massive feature sets the row's scale. An error that
    scales with each row passes; the same absolute error on a small row, or one channel 1 % off, fails."""
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(6, 64, generator=g, dtype=torch.float64)
    ref[:2, 5] = 20000.0  # massive activations of two tokens
    tol = ToleranceTable().resolve("layers.3.output")
    noise = torch.randn(6, 64, generator=g, dtype=torch.float64)
    scale = ref.pow(2).mean(dim=1, keepdim=True).sqrt()
    correct = ref + 2e-5 * scale * noise / noise.abs().max()
    m = compare(ref, correct, tol)
    assert passes(m, tol) and m.margin > 10
    # elementwise absolute tolerances of before fail it, on the massive rows
    assert not passes(compare(ref, correct, Tolerance(atol=1e-4, rtol=1e-4)), Tolerance(atol=1e-4, rtol=1e-4))
    channel = ref.clone()
    channel[:, 17] *= 1.01  # one output channel's scale off by 1 %
    m = compare(ref, channel, tol)
    assert not passes(m, tol) and m.worst_index[1] == 17 and m.token_rel < tol.token_rtol and m.margin < 1
    broad = ref + 0.01 * scale * torch.randn(6, 64, generator=g, dtype=torch.float64)
    m = compare(ref, broad, tol)
    assert not passes(m, tol) and m.token_rel > tol.token_rtol


@given(st.integers(1, 8), st.integers(1, 50), st.floats(1e-3, 1e4), st.floats(1e-7, 1e-1), st.integers(0, 10_000))
def test_margin_is_how_far_the_error_may_grow(rows, cols, magnitude, error, seed):
    g = torch.Generator().manual_seed(seed)
    ref = torch.randn(rows, cols, generator=g, dtype=torch.float64) * magnitude
    cand = ref + error * magnitude * torch.randn(rows, cols, generator=g, dtype=torch.float64)
    tol = ToleranceTable().resolve("layers.0.attn.q")
    m = compare(ref, cand, tol)
    assert passes(m, tol) == (m.margin >= 1)
    if math.isfinite(m.margin) and 0.01 < m.margin < 100:
        grown = ref + (cand - ref) * m.margin * 1.001
        assert not passes(compare(ref, grown, tol), tol)
        shrunk = ref + (cand - ref) * m.margin * 0.999
        assert passes(compare(ref, shrunk, tol), tol)


def test_elementwise_tables_of_before_keep_their_meaning():
    old = parse({"tolerances": {"*": {"atol": 1e-4, "rtol": 1e-4}, "logits": {"atol": 2e-3}}}, "old.toml")
    assert old.resolve("layers.0.output") == Tolerance(atol=1e-4, rtol=1e-4)
    assert old.resolve("logits") == Tolerance(atol=2e-3, rtol=1e-4)
    assert old.resolve("logits").elementwise_only
    new = parse({"tolerances": {"*": {"token_rtol": 1e-3}, "logits": {"atol": 2e-3}}}, "new.toml")
    assert not new.resolve("logits").elementwise_only and new.resolve("logits").atol == 2e-3
    assert new.resolve("logits").row_rtol == ToleranceTable().resolve("logits").row_rtol


def test_levels():
    assert [level_of(t) for t in ("embed", "layers.0.attn.q", "layers.2.output", "final_norm", "logits")] == \
        ["op", "op", "block", "model", "model"]


def test_report_round_trip(tmp_path):
    ref, cand, taps = _pair(tmp_path, fault_tap="layers.0.output")
    results = compare_dumps(ref, cand, [t for t in taps if not t.endswith(".input")], ToleranceTable())
    first = first_divergence(results)
    rep = report.build({"id": "r1", "started": "now", "model": "m", "format": "ternary", "level": "model",
                        "mode": "propagated", "prompts_sha256": "x", "versions": {}},
                       [r.as_dict() for r in results], {"name": first.name, "layer": first.layer}, [])
    heat = report.heatmap_of(first.name, torch.zeros(8, 300), torch.ones(8, 300))
    out = report.write(tmp_path / "rep", rep, heat)
    data = json.loads((out / "report.json").read_text())
    assert data["schema"] == "parity-report/1" and data["passed"] is False
    assert set(data) == {"schema", "run", "taps", "first_divergence", "hints", "separation", "passed"}
    assert data["separation"]["closest_source"]["tap"] == "layers.0.output"
    assert data["separation"]["worst_passing"] is None  # every passing tap is exact: no margin to speak of
    assert set(data["run"]) >= {"id", "started", "model", "format", "level", "mode", "prompts_sha256", "versions"}
    assert set(data["taps"][0]) >= {"name", "level", "layer", "shape", "metrics", "tolerance", "passed", "growth"}
    assert set(data["taps"][0]["metrics"]) == {"max_abs", "max_rel", "mean_abs", "cosine", "sqnr_db", "mismatch_frac",
                                               "token_rel", "worst_token", "nonfinite", "numel"}
    assert "margin" in data["taps"][0]
    page = (out / "report.html").read_text()
    assert "layers.0.output" in page and 'id="plot-layers"' in page and 'id="plot-heatmap"' in page
    assert "First divergence: **layers.0.output**" in (out / "summary.md").read_text()
    (out / "summary.md").unlink()
    report.render(out)  # re-rendered from report.json alone
    assert (out / "summary.md").is_file()


def _snap(root, run_id="run"):
    return snapshots.write(root, run_id, {"a@0": torch.ones(2)}, {"a@0": torch.zeros(2)}, {"a": {}}, {"command": "x"})


def test_snapshots_never_overwrite_and_prune(tmp_path):
    a = _snap(tmp_path)
    b = _snap(tmp_path)
    assert a.name == "run" and b.name == "run-2"
    assert json.loads((a / "meta.json").read_text())["command"] == "x"
    c = _snap(tmp_path, "later")
    removed = snapshots.prune(tmp_path, keep=1, max_gb=10, protect=c)
    assert set(removed) == {a, b} and snapshots.runs(tmp_path) == [c]
    snapshots.prune(tmp_path, keep=5, max_gb=0.0, protect=c)
    assert snapshots.runs(tmp_path) == [c]  # the protected one survives even over the size cap


def test_full_disk_while_writing_a_snapshot_loses_nothing(tmp_path, monkeypatch):
    first = _snap(tmp_path, "old")

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(snapshots, "save_file", full)
    with pytest.raises(snapshots.SnapshotError, match="the disk is full"):
        _snap(tmp_path, "new")
    assert snapshots.runs(tmp_path) == [first]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
