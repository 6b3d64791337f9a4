"""`parity diff`, `parity snapshots`, `parity report`, `parity trend` — no engine needed."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm_parity.harness import report, snapshots
from vllm_parity.tools.cli import main
from vllm_parity.harness.compare import compare_dumps, first_divergence
from vllm_parity.harness.dumps import DumpReader, DumpWriter
from vllm_parity.harness.taps import canonical_order
from vllm_parity.harness.tolerances import ToleranceTable

TAPS = canonical_order(2)
META = {"side": "reference", "model": "/models/m", "model_sha256": "a" * 64, "prompts_sha256": "b" * 64,
        "format": "ternary", "versions": {"torch": "x"}}


def _tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {t: [torch.randn(5, 8, generator=g), torch.randn(3, 8, generator=g)] for t in TAPS}


def _dump(root, tensors, meta=None):
    w = DumpWriter(root, {**META, **(meta or {})})
    for tap, ts in tensors.items():
        w.write(tap, {f"{tap}@{p}": t for p, t in enumerate(ts)})
    return w.close()


def _planted(tensors, tap, delta=0.01):
    """Every tap from ``tap`` on is off by a growing amount, as error propagates in a forward pass."""
    out = {t: [x.clone() for x in v] for t, v in tensors.items()}
    start = TAPS.index(tap)
    for t in TAPS[start:]:
        out[t] = [x + delta * (1 + TAPS.index(t) - start) for x in out[t]]
    return out


def run(capsys, *argv):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
def dumps(tmp_path):
    ref = _tensors()
    return {"a": _dump(tmp_path / "a", ref), "same": _dump(tmp_path / "same", ref),
            "bad": _dump(tmp_path / "bad", _planted(ref, "layers.1.mlp.gate"), {"side": "candidate"})}


# -- diff -------------------------------------------------------------------------------------


def test_diff_equal_dumps_pass(capsys, dumps):
    rc, out, err = run(capsys, "diff", dumps["a"], dumps["same"])
    assert rc == 0 and err == ""
    assert "all 27 taps pass" in out  # 2 layers x 12 + embed, final_norm, logits; layer inputs not shown
    assert "layers.0.input" not in out
    row = next(line for line in out.splitlines() if line.startswith("logits"))
    # token rel, token_rtol, min passing row_rtol, row_rtol, max_abs, cosine, SQNR, atol, min atol, margin
    assert row.split() == ["logits", "0", "0.001", "0", "0.001", "0", "1.000000", "inf", "0", "0", "—", "pass"]


def test_diff_names_the_planted_tap(capsys, dumps):
    rc, out, _ = run(capsys, "diff", dumps["a"], dumps["bad"])
    assert rc == 1
    assert "first divergence: layers.1.mlp.gate (layer 1)" in out
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith(("layers.", "logits", "embed"))}
    assert rows["layers.1.mlp.norm"].rstrip().endswith("pass")
    assert "FAIL source" in rows["layers.1.mlp.gate"]
    assert "FAIL inherited (layers.1.mlp.act)" in rows["layers.1.mlp.down"]
    assert rows["layers.1.mlp.gate"].split()[5] == "0.01"  # max_abs
    assert "worst at" in out and "min passing row_rtol" in out and "token rel" in out


def test_diff_attributes_through_layer_inputs_in_forward_order(capsys, dumps, tmp_path):
    ref = _tensors()
    cand = _planted(ref, "layers.0.mlp.down")
    # written backwards: the table, the growth bound and attribution still follow the forward pass
    a = _dump(tmp_path / "ra", dict(reversed(list(ref.items()))))
    b = _dump(tmp_path / "rb", dict(reversed(list(cand.items()))))
    rc, out, _ = run(capsys, "diff", a, b, "--json")
    data = json.loads(out)
    assert rc == 1 and [t["name"] for t in data["taps"]] == [t for t in TAPS if not t.endswith(".input")]
    # layer 1 reads layers.1.input, which carries layer 0's error: compared (though not shown), it
    # makes every failure of layer 1 inherited rather than a second source
    assert [t["name"] for t in data["taps"] if t["role"] == "source"] == ["layers.0.mlp.down"]
    assert data["first_divergence"]["name"] == "layers.0.mlp.down"


def test_diff_json(capsys, dumps):
    rc, out, _ = run(capsys, "diff", dumps["a"], dumps["bad"], "--json")
    assert rc == 1
    data = json.loads(out)
    assert data["schema"] == "parity-diff/1"
    assert set(data) == {"schema", "a", "b", "tolerances", "warnings", "taps", "first_divergence", "passed"}
    assert data["passed"] is False and data["warnings"] == []
    assert data["first_divergence"]["name"] == "layers.1.mlp.gate" and data["first_divergence"]["layer"] == 1
    assert data["a"]["path"] == str(dumps["a"]) and data["b"]["side"] == "candidate"
    tap = {t["name"]: t for t in data["taps"]}
    assert len(tap) == 27
    assert set(tap["logits"]) >= {"name", "level", "layer", "shape", "metrics", "tolerance", "passed", "growth",
                                  "min_tolerance", "role"}
    assert tap["logits"]["metrics"]["max_abs"] == pytest.approx(0.07)
    assert tap["embed"]["metrics"]["sqnr_db"] is None  # infinite: JSON has no Infinity
    assert tap["layers.1.mlp.gate"]["role"] == "source" and tap["layers.0.output"]["passed"] is True


def test_diff_taps_glob_and_tolerances(capsys, dumps, tmp_path):
    rc, out, _ = run(capsys, "diff", dumps["a"], dumps["bad"], "--taps", "layers.0.*", "--json")
    data = json.loads(out)
    assert rc == 0 and data["passed"] and {t["name"] for t in data["taps"]} == {
        t for t in TAPS if t.startswith("layers.0.")}  # a glob shows the layer's input too
    loose = tmp_path / "loose.toml"
    # layer 0 is exact, so layer 1's error is an unbounded jump: the growth bound must allow it too
    loose.write_text('max_growth = 1000.0\n[tolerances]\n"*" = { atol = 0.1 }\n')
    rc, out, _ = run(capsys, "diff", dumps["a"], dumps["bad"], "--tolerances", loose)
    assert rc == 0 and f"tolerances: {loose}" in out and "all 27 taps pass" in out


@pytest.mark.parametrize("case, message", [
    ("not_a_dir", "not a directory"),
    ("no_manifest", "no manifest.json — not a dump directory"),
    ("no_common", "no common taps"),
    ("glob", "--taps 'nothing.*' matches none of the 29 common taps"),  # layer inputs count here
    ("bad_tolerances", "unknown key(s) ['atoll']"),
])
def test_diff_bad_input_exits_2(capsys, dumps, tmp_path, case, message):
    b = dumps["same"]
    extra = []
    if case == "not_a_dir":
        b = tmp_path / "missing"
    elif case == "no_manifest":
        b = tmp_path / "empty"
        b.mkdir()
    elif case == "no_common":
        b = _dump(tmp_path / "other", {"x.y": [torch.zeros(2, 2)]})
    elif case == "glob":
        extra = ["--taps", "nothing.*"]
    else:
        f = tmp_path / "t.toml"
        f.write_text('[tolerances]\n"*" = { atoll = 1 }\n')
        extra = ["--tolerances", f]
    rc, out, err = run(capsys, "diff", dumps["a"], b, *extra)
    assert rc == 2 and out == ""
    assert err.startswith("parity diff: error: ") and message in err


def test_diff_warns_about_other_prompts_and_missing_taps(capsys, dumps, tmp_path):
    t = _tensors()
    del t["logits"]
    b = _dump(tmp_path / "other", t, {"prompts_sha256": "c" * 64})
    rc, out, err = run(capsys, "diff", dumps["a"], b)
    assert rc == 0 and "all 26 taps pass" in out
    assert f"different prompt sets: prompts_sha256 {'b' * 64} ({dumps['a']}) vs {'c' * 64} ({b})" in err
    assert f"1 only in {dumps['a']} ['logits']" in err


def test_diff_damaged_tensor_file_exits_2(capsys, dumps):
    reader = DumpReader(dumps["same"])
    (dumps["same"] / reader.entry("layers.0.attn.q", 0)["file"]).write_bytes(b"\x00" * 7)
    rc, _, err = run(capsys, "diff", dumps["a"], dumps["same"])
    assert rc == 2 and "is damaged" in err


def test_diff_console_script_exit_status(dumps):
    # the installed entry point passes main's return value to the shell
    cmd = [sys.executable, "-m", "vllm_parity.tools.cli", "diff", str(dumps["a"]), str(dumps["bad"]), "--taps", "layers.1.*"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).parents[1], timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "first divergence: layers.1.mlp.gate" in proc.stdout


# -- snapshots --------------------------------------------------------------------------------


def _snapshot(root, run_id, ref, cand, mtime, command="pytest --parity-level=block"):
    results = compare_dumps(DumpReader(ref), DumpReader(cand), TAPS, ToleranceTable())
    failing = [r for r in results if not r.passed]
    rdr, cdr = DumpReader(ref), DumpReader(cand)
    path = snapshots.write(root, run_id,
                           {f"{r.name}@{p}": rdr.get(r.name, p) for r in failing for p in rdr.prompts(r.name)},
                           {f"{r.name}@{p}": cdr.get(r.name, p) for r in failing for p in cdr.prompts(r.name)},
                           {r.name: r.as_dict() for r in failing},
                           {"run": run_id, "model": "/models/tiny-ternary", "format": "ternary", "level": "block",
                            "command": command, "report": f"reports/{run_id}", "prompts_sha256": "b" * 64})
    os.utime(path / "meta.json", (mtime, mtime))  # runs() orders by this; same-second writes would tie
    return path


@pytest.fixture
def snaps(tmp_path, dumps):
    ref = _tensors()
    later = _dump(tmp_path / "later", _planted(ref, "layers.1.mlp.up", delta=0.02))
    root = tmp_path / "snaps"
    return root, [_snapshot(root, "night1", dumps["a"], dumps["bad"], 1_000_000),
                  _snapshot(root, "night2", dumps["a"], later, 2_000_000, command="pytest --parity-level=model")]


def test_snapshots_list(capsys, snaps):
    root, _ = snaps
    rc, out, _ = run(capsys, "snapshots", "list", "--dir", root)
    assert rc == 0
    lines = out.splitlines()
    assert lines[0].split() == ["id", "written", "model", "level", "failing", "taps", "size"]
    assert lines[2].startswith("night2") and lines[3].startswith("night1")  # newest first
    assert "7 (source layers.1.mlp.gate +1)" in lines[3] and "tiny-ternary" in lines[3]
    assert "6 (source layers.1.mlp.up)" in lines[2] and "KB" in lines[2]
    rc, out, _ = run(capsys, "snapshots", "list", "--dir", root / "none")
    assert rc == 0 and "no snapshots under" in out


def test_snapshots_show(capsys, snaps):
    root, _ = snaps
    rc, out, _ = run(capsys, "snapshots", "show", "night2", "--dir", root)
    assert rc == 0
    assert "reproduce: pytest --parity-level=model" in out and "failing taps (6):" in out
    up = next(line for line in out.splitlines() if line.startswith("layers.1.mlp.up "))
    assert up.split()[5] == "0.02" and "FAIL source" in up
    assert "layers.1.mlp.gate" not in out
    assert "(12 each, keys TAP@prompt)" in out  # 6 taps x 2 prompts
    assert "  layers.1.mlp.up: token relative error " in out  # the source's worst row and element
    assert "worst at " in out
    assert "  logits: " not in out
    rc, out, _ = run(capsys, "snapshots", "show", "night1", "--dir", root)
    assert "reproduce: pytest --parity-level=block" in out
    rc, _, err = run(capsys, "snapshots", "show", "nope", "--dir", root)
    assert rc == 2 and "'nope': no such snapshot (newest: night1, night2)" in err
    rc, _, err = run(capsys, "snapshots", "show", "night", "--dir", root)
    assert rc == 2 and "2 snapshots start with it" in err


def test_snapshots_diff(capsys, snaps):
    root, _ = snaps
    rc, out, _ = run(capsys, "snapshots", "diff", "night1", "night2", "--dir", root)
    assert rc == 0
    sections = out.split("\n\n")
    assert sections[1].startswith("appeared (failing only in night2): 0")
    assert sections[2].startswith("disappeared (failing only in night1): 1") and "layers.1.mlp.gate" in sections[2]
    assert sections[3].startswith("changed error (failing in both): 5")
    assert "layers.1.mlp.up" not in sections[3]  # the same source, the same error: unchanged
    act = next(line for line in sections[3].splitlines() if line.startswith("layers.1.mlp.act"))
    assert act.split()[1:] == ["0.03", "0.04", "1.33x", "inherited"]
    assert sections[4] == "unchanged (failing in both, same error): 1\n"
    rc, out, _ = run(capsys, "snapshots", "diff", "night1", "night1", "--dir", root)
    assert "changed error (failing in both): 0" in out and "same error): 7" in out
    diff = json.loads((root / "night1" / "diff.json").read_text())
    diff["layers.1.mlp.act"]["role"] = "source"  # the same error, now judged a fault of its own
    snapshots.write(root, "night3", {}, {}, diff, {"run": "night3", "command": "x"})
    rc, out, _ = run(capsys, "snapshots", "diff", "night1", "night3", "--dir", root)
    act = next(line for line in out.splitlines() if line.startswith("layers.1.mlp.act"))
    assert act.split()[1:] == ["0.03", "0.03", "1x", "inherited", "->", "source"]


def test_snapshots_prune(capsys, snaps):
    root, (first, second) = snaps
    rc, out, _ = run(capsys, "snapshots", "prune", "--dir", root, "--keep", "1")
    assert rc == 0 and out.startswith("removed night1 (") and "kept 1 snapshot(s)" in out
    assert snapshots.runs(root) == [second] and not first.exists()
    rc, _, err = run(capsys, "snapshots", "prune", "--dir", root, "--keep", "0")
    assert rc == 2 and "--keep must be at least 1" in err and second.exists()


# -- report -----------------------------------------------------------------------------------


def test_report_rerender(capsys, dumps, tmp_path):
    results = compare_dumps(DumpReader(dumps["a"]), DumpReader(dumps["bad"]), TAPS, ToleranceTable())
    first = first_divergence(results)
    rep = report.build({"id": "r1", "started": "now", "model": "m", "format": "ternary", "level": "block",
                        "mode": "propagated", "prompts_sha256": "x", "versions": {}},
                       [r.as_dict() for r in results], {"name": first.name, "layer": first.layer}, [])
    out_dir = report.write(tmp_path / "rep", rep)
    (out_dir / "summary.md").unlink()
    (out_dir / "report.html").write_text("stale")
    rc, out, _ = run(capsys, "report", out_dir)
    assert rc == 0 and out.splitlines() == [str(out_dir / "summary.md"), str(out_dir / "report.html")]
    assert "First divergence: **layers.1.mlp.gate**" in (out_dir / "summary.md").read_text()
    assert 'id="plot-layers"' in (out_dir / "report.html").read_text()
    rc, _, err = run(capsys, "report", tmp_path)
    assert rc == 2 and "no report.json — not a report directory" in err
    (out_dir / "report.json").write_text(json.dumps({"schema": "parity-report/1", "run": {}}))
    rc, _, err = run(capsys, "report", out_dir)
    assert rc == 2 and "not a complete parity-report/1" in err


# -- trend ------------------------------------------------------------------------------------


def _night(tmp_path, i, down_atol):
    taps = [{"name": name, "level": "op", "layer": 0, "shape": [1], "metrics": None,
             "tolerance": {"atol": 1e-3, "rtol": 0.0, "max_mismatch_frac": 0.0, "min_cosine": -1.0},
             "passed": True, "growth": None, "min_tolerance": {"atol": v, "rtol": 0.0}}
            for name, v in (("layers.0.mlp.down", down_atol), ("layers.0.attn.q", 1e-5))]
    run_ = {"id": f"n{i}", "started": f"2026-12-{i + 1:02d}T03:00:00+0000", "model": str(tmp_path / "no-model"),
            "format": "ternary", "level": "model", "mode": "propagated", "prompts_sha256": "p", "versions": {}}
    return report.write(tmp_path / f"n{i}", report.build(run_, taps, None, []))


def test_trend_append_table_and_drift(capsys, tmp_path):
    f = tmp_path / "trend.jsonl"
    for i in range(6):
        rc, out, err = run(capsys, "trend", f, "--append", _night(tmp_path, i, 1e-5 * 2 ** i))
        assert rc == 0 and f"appended run n{i} (2 taps)" in err
    assert "no model hash" in err  # the report's model directory does not exist here
    rc, out, _ = run(capsys, "trend", f)
    assert rc == 0
    assert "drift: layers.0.mlp.down: minimum passing atol grew 32.0x over 6 runs: 1e-05 (n0) -> 0.00032 (n5)" in out
    assert "layers.0.attn.q:" not in out
    down = next(line for line in out.splitlines() if line.startswith("layers.0.mlp.down"))
    assert down.split()[1:] == ["1.00e-05", "2.00e-05", "4.00e-05", "8.00e-05", "1.60e-04", "3.20e-04", "atol=0.001"]
    rc, out, _ = run(capsys, "trend", f, "--tap", "layers.0.attn.*")
    assert rc == 0 and "no drift over the last 6 comparable run(s)" in out and "mlp.down" not in out
    assert run(capsys, "trend", f, "--fail-on-drift")[0] == 1
    rc, out, _ = run(capsys, "trend", f, "--json")
    assert [d["tap"] for d in json.loads(out)["drift"]] == ["layers.0.mlp.down"]


def test_trend_follows_the_token_relative_error(capsys, tmp_path):
    """Reports judged per token trend their token relative error against token_rtol; a line of before
    (min_atol only) in the same file does not mix with them."""
    from vllm_parity.harness import trend

    f = tmp_path / "trend.jsonl"
    for i in range(4):
        rep = json.loads((_night(tmp_path, i, 1e-5) / "report.json").read_text())
        for t in rep["taps"]:
            t["tolerance"]["token_rtol"] = 1e-3
            t["min_tolerance"]["token_rtol"] = 1e-5 * 3 ** i if t["name"] == "layers.0.mlp.down" else 2e-6
        (tmp_path / f"n{i}" / "report.json").write_text(json.dumps(rep))
        rc, _, _ = run(capsys, "trend", f, "--append", tmp_path / f"n{i}")
        assert rc == 0
    rows = trend.load(f)
    assert rows[-1]["taps"]["layers.0.mlp.down"] == {"measure": "token_rel", "value": 2.7e-4, "bound": 1e-3,
                                                     "passed": True}
    found = trend.drift(rows)
    assert [d["tap"] for d in found] == ["layers.0.mlp.down"] and found[0]["measure"] == "token_rel"
    assert "token relative error grew 27.0x over 4 runs" in found[0]["message"] and "27% of its token_rtol" in \
        found[0]["message"]
    old = dict(rows[0], taps={"layers.0.mlp.down": {"min_atol": 0.5, "atol": 1.0, "passed": True}})
    assert trend.drift([old, *rows[1:]])[0]["runs"] == 3  # the line of before is another measure: left out


def test_trend_bad_input(capsys, tmp_path):
    rc, _, err = run(capsys, "trend", tmp_path / "none.jsonl")
    assert rc == 2 and "none.jsonl: no trend file" in err
    rc, _, err = run(capsys, "trend", tmp_path / "t.jsonl", "--append", tmp_path)
    assert rc == 2 and "report.json: missing" in err
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    rc, _, err = run(capsys, "trend", bad)
    assert rc == 2 and "bad.jsonl:1: not a JSON line" in err


def test_existing_commands_are_still_there(capsys):
    with pytest.raises(SystemExit):
        main(["make-fixture", "--help"])
    assert "--format" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["inspect", "--help"])
    assert "--against" in capsys.readouterr().out
