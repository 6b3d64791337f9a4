"""Golden references and the nightly trend — no engine needed."""

import json
from pathlib import Path

import pytest
import torch

from vllm_parity.harness import golden, report, trend
from vllm_parity.harness.compare import compare_dumps
from vllm_parity.harness.dumps import DumpReader, DumpWriter
from vllm_parity.harness.golden import GoldenCorrupt, GoldenError, GoldenMismatch, GoldenMissing
from vllm_parity.harness.taps import canonical_order
from vllm_parity.harness.tolerances import ToleranceTable

MODEL, PROMPTS = "a" * 64, "b" * 64
TAPS = canonical_order(2)


def _dump(root, seed=0, meta=None, taps=TAPS):
    g = torch.Generator().manual_seed(seed)
    w = DumpWriter(root, {"side": "reference", "model": "m", "model_sha256": MODEL, "prompts_sha256": PROMPTS,
                          "format": "ternary", "versions": {"torch": torch.__version__}, **(meta or {})})
    for tap in taps:
        w.write(tap, {f"{tap}@{p}": torch.randn(3 + p, 8, generator=g) for p in range(2)})
    return DumpReader(w.close())


def _flip_last_byte(path):
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # inside the last tensor's data: the header, and so the shapes, stay valid
    path.write_bytes(bytes(data))


def test_fixture_names(tmp_path, monkeypatch):
    monkeypatch.setenv("PARITY_CACHE_DIR", str(tmp_path / "cache"))
    assert golden.fixture_name(None) == "default"
    assert golden.fixture_name(tmp_path / "cache" / "default-seed-article-0123456789ab") == "default"
    assert golden.fixture_name(tmp_path / "models" / "my-int8x") == "my-int8x"
    assert golden.golden_path(tmp_path, "default", writing=True) == tmp_path / "references" / "golden" / "default"
    assert golden.golden_path(tmp_path, "my-int8x") == tmp_path / "references" / "golden" / "my-int8x"
    for bad in ("", "..", "a/b", ".hidden"):
        with pytest.raises(ValueError, match="cannot name a golden directory"):
            golden.golden_path(tmp_path, bad)


def test_a_root_without_the_default_golden_reads_the_installed_one(tmp_path):
    import vllm_parity.reference

    shipped = golden.golden_path(tmp_path, "default")
    assert shipped == Path(vllm_parity.reference.__file__).parent / "golden" / "default"
    assert (shipped / "manifest.json").exists()
    (tmp_path / "references" / "golden" / "default").mkdir(parents=True)
    assert golden.golden_path(tmp_path, "default") == tmp_path / "references" / "golden" / "default"


def test_write_and_load_round_trip(tmp_path):
    src = _dump(tmp_path / "ref")
    dest = golden.write_golden(src, golden.golden_path(tmp_path, "default", writing=True))
    assert sorted(p.name for p in dest.parent.iterdir()) == ["default"]  # no temporary directory left behind
    g = golden.load_golden(dest, MODEL, PROMPTS)
    assert g.taps() == src.taps()
    for tap in TAPS:
        for p in src.prompts(tap):
            assert torch.equal(g.get(tap, p), src.get(tap, p))
            assert g.entry(tap, p)["sha256"] == src.entry(tap, p)["sha256"]
    assert g.manifest["versions"] == {"torch": torch.__version__} and g.manifest["golden"]["written"]
    g.verify_all()
    assert golden.describe(g)["taps"] == len(TAPS)


def test_write_replaces_an_existing_golden_whole(tmp_path):
    dest = golden.golden_path(tmp_path, "fx")
    golden.write_golden(_dump(tmp_path / "one", seed=1), dest)
    second = _dump(tmp_path / "two", seed=2, taps=TAPS[:3])
    golden.write_golden(second, dest)
    g = golden.load_golden(dest, MODEL, PROMPTS)
    assert g.taps() == TAPS[:3]
    assert torch.equal(g.get(TAPS[0], 0), second.get(TAPS[0], 0))
    assert len(list(dest.glob("*.safetensors"))) == 3  # nothing of the first golden survives
    assert sorted(p.name for p in dest.parent.iterdir()) == ["fx"]


def test_extras_round_trip(tmp_path):
    greedy = {"greedy": {"0": [5, 17, 17, 3], "1": [9, 9, 2, 0]}}
    dest = golden.write_golden(_dump(tmp_path / "ref"), tmp_path / "g", extras=greedy)
    assert golden.extras_of(golden.load_golden(dest, MODEL, PROMPTS)) == greedy
    plain = golden.write_golden(_dump(tmp_path / "ref2"), tmp_path / "g2")
    assert golden.extras_of(golden.load_golden(plain, MODEL, PROMPTS)) == {}


def test_write_a_subset_of_taps(tmp_path):
    dest = golden.write_golden(_dump(tmp_path / "ref"), tmp_path / "g", taps=["embed", "logits"])
    assert golden.load_golden(dest, MODEL, PROMPTS).taps() == ["embed", "logits"]
    with pytest.raises(GoldenError, match=r"no tap\(s\) \['nope'\]"):
        golden.write_golden(_dump(tmp_path / "ref2"), tmp_path / "g2", taps=["nope"])


def test_a_corrupt_source_never_becomes_a_golden(tmp_path):
    dest = golden.write_golden(_dump(tmp_path / "good"), tmp_path / "g")
    bad = _dump(tmp_path / "bad", seed=5)
    _flip_last_byte(bad.root / bad.entry("logits", 1)["file"])
    with pytest.raises(GoldenCorrupt, match=r"logits@1 does not match its manifest sha256"):
        golden.write_golden(DumpReader(bad.root), dest)
    assert golden.load_golden(dest, MODEL, PROMPTS).get("logits", 1).shape == (4, 8)  # the old one is intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad", "g", "good"]


def test_a_dump_without_hashes_is_refused(tmp_path):
    src = _dump(tmp_path / "ref", meta={"model_sha256": None})
    with pytest.raises(GoldenError, match="no model_sha256"):
        golden.write_golden(src, tmp_path / "g")


def test_missing_golden(tmp_path):
    with pytest.raises(GoldenMissing, match=r"nowhere: no golden reference .*--parity-update-golden") as exc:
        golden.load_golden(tmp_path / "nowhere", MODEL, PROMPTS)
    assert isinstance(exc.value, GoldenError)


def test_corrupt_tensor_is_caught_on_first_read(tmp_path):
    dest = golden.write_golden(_dump(tmp_path / "ref"), tmp_path / "g")
    g0 = golden.load_golden(dest, MODEL, PROMPTS)
    fname = g0.entry("layers.1.mlp.up", 1)["file"]
    _flip_last_byte(dest / fname)
    g = golden.load_golden(dest, MODEL, PROMPTS)  # headers still agree: found when the tensor is read
    assert g.get("layers.1.mlp.up", 0).shape == (3, 8)
    with pytest.raises(GoldenCorrupt, match=rf"{fname}: tensor layers\.1\.mlp\.up@1 has sha256 .* records"):
        g.get("layers.1.mlp.up", 1)
    with pytest.raises(GoldenCorrupt, match=r"layers\.1\.mlp\.up@1"):
        golden.load_golden(dest, MODEL, PROMPTS).verify_all()


def test_structural_damage_is_caught_on_load(tmp_path):
    dest = golden.write_golden(_dump(tmp_path / "ref"), tmp_path / "g")
    man = json.loads((dest / "manifest.json").read_text())
    f_embed = man["taps"]["embed"]["0"]["file"]
    (dest / f_embed).unlink()
    with pytest.raises(GoldenCorrupt, match=rf"{f_embed}: missing; the golden manifest lists 2 tensor\(s\)"):
        golden.load_golden(dest, MODEL, PROMPTS)
    f_logits = man["taps"]["logits"]["0"]["file"]
    (dest / f_embed).write_bytes((dest / f_logits).read_bytes())  # a file holding other tensors
    with pytest.raises(GoldenCorrupt, match=r"tensor embed@0 listed in the golden manifest is not in the file"):
        golden.load_golden(dest, MODEL, PROMPTS)
    (dest / f_embed).write_bytes(b"\x00" * 5)  # truncated
    with pytest.raises(GoldenCorrupt, match="not a readable safetensors file"):
        golden.load_golden(dest, MODEL, PROMPTS)
    (dest / "manifest.json").write_text("{")
    with pytest.raises(GoldenCorrupt, match="corrupt manifest"):
        golden.load_golden(dest, MODEL, PROMPTS)


def test_golden_made_for_another_input(tmp_path):
    dest = golden.write_golden(_dump(tmp_path / "ref"), tmp_path / "g")
    other = "c" * 64
    with pytest.raises(GoldenMismatch, match=rf"model sha256 {MODEL} \(this run's model: {other}\)"):
        golden.load_golden(dest, other, PROMPTS)
    with pytest.raises(GoldenMismatch, match=rf"prompts sha256 {PROMPTS} \(this run's prompts: {other}\)") as exc:
        golden.load_golden(dest, MODEL, other)
    assert "model sha256" not in str(exc.value)


def test_unused_taps_after_a_comparison(tmp_path):
    dest = golden.write_golden(_dump(tmp_path / "ref"), tmp_path / "g")
    g = golden.load_golden(dest, MODEL, PROMPTS)
    cand = _dump(tmp_path / "cand", meta={"side": "candidate"})
    compared = [t for t in TAPS if t.startswith("layers.0.")]
    results = compare_dumps(g, cand, compared, ToleranceTable())
    assert all(r.passed for r in results)  # the same seed: identical tensors
    assert golden.read_taps(g) == set(compared)
    assert golden.unused_taps(g, golden.read_taps(g)) == [t for t in TAPS if t not in compared]
    assert golden.unused_taps(g, set(TAPS)) == []
    g.verify_all()  # checking integrity does not count as a comparison reading the tap
    assert golden.read_taps(g) == set(compared)


# -- trend ------------------------------------------------------------------------------------


def _report(i, values, model=MODEL, passed=None, atol=1e-4):
    taps = []
    for name, v in values.items():
        ok = passed.get(name, True) if passed else True
        taps.append({"name": name, "level": "op", "layer": None, "shape": [2, 3, 8],
                     "metrics": {"max_abs": v, "max_rel": 0.0, "mean_abs": 0.0, "cosine": 1.0, "sqnr_db": 90.0,
                                 "mismatch_frac": 0.0},
                     "tolerance": {"atol": atol, "rtol": 1e-4, "max_mismatch_frac": 0.0, "min_cosine": -1.0},
                     "passed": ok, "growth": None, "min_tolerance": {"atol": v, "rtol": 1e-4}})
    run = {"id": f"run{i}", "started": f"2026-11-{i + 1:02d}T03:17:00+0000", "model": "/m", "format": "ternary",
           "level": "model", "mode": "propagated", "prompts_sha256": PROMPTS, "versions": {},
           "model_sha256": model}
    return report.build(run, taps, None, [])


def _fill(path, series, **kw):
    for i in range(len(next(iter(series.values())))):
        trend.append(path, _report(i, {t: s[i] for t, s in series.items()}, **kw))


def test_trend_append_and_load(tmp_path):
    f = tmp_path / "nightly" / "trend.jsonl"
    row = trend.append(f, _report(0, {"embed": 0.0, "logits": 3e-5}, passed={"logits": False}))
    trend.append(f, _report(1, {"embed": 0.0, "logits": 4e-5}))
    rows = trend.load(f)
    assert [r["run"] for r in rows] == ["run0", "run1"] and rows[0] == row
    assert rows[0]["model_sha256"] == MODEL and rows[0]["date"] == "2026-11-01T03:17:00+0000"
    # an elementwise-only tolerance (no token_rtol): its minimum passing atol is what trends
    assert rows[0]["taps"]["logits"] == {"measure": "min_atol", "value": 3e-5, "bound": 1e-4, "passed": False}
    assert len(f.read_text().splitlines()) == 2


def test_trend_line_cut_short_does_not_swallow_the_next(tmp_path):
    f = tmp_path / "trend.jsonl"
    trend.append(f, _report(0, {"embed": 0.0}))
    f.write_text(f.read_text() + '{"schema": "parity-tr')  # a writer killed mid-line
    trend.append(f, _report(1, {"embed": 0.0}))
    assert json.loads(f.read_text().splitlines()[-1])["run"] == "run1"
    with pytest.raises(ValueError, match=r"trend\.jsonl:2: not a JSON line"):
        trend.load(f)


def test_trend_rejects_other_files(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_text('{"schema": "parity-report/1"}\n')
    with pytest.raises(ValueError, match=r"t\.jsonl:1: not a parity-trend/1 line"):
        trend.load(f)
    with pytest.raises(FileNotFoundError, match="no trend file"):
        trend.load(tmp_path / "none.jsonl")
    with pytest.raises(ValueError, match="expected 'parity-report/1'"):
        trend.append(f, {"schema": "x"})


def test_drift_flags_growth_not_flat_noise(tmp_path):
    f = tmp_path / "trend.jsonl"
    _fill(f, {
        "layers.0.output": [1e-6 * 1.5 ** i for i in range(7)],  # 11x over 7 nights, still inside atol
        "layers.1.output": [2e-6, 2.2e-6, 1.9e-6, 2.1e-6, 2e-6, 2.2e-6, 2e-6],  # noise around a level
        "embed": [0.0] * 7,
        "logits": [0.0, 1e-9, 0.0, 3e-9, 0.0, 2e-9, 5e-9],  # rounding noise far below 1 % of atol
    })
    found = trend.drift(trend.load(f))
    assert [d["tap"] for d in found] == ["layers.0.output"]
    d = found[0]
    assert d["kind"] == "growth" and d["ratio"] == pytest.approx(1.5 ** 6) and d["runs"] == 7
    assert (d["from_run"], d["to_run"]) == ("run0", "run6") and d["passed"]
    assert "grew 11.4x over 7 runs" in d["message"] and "of its atol 0.0001" in d["message"]
    assert trend.drift(trend.load(f), tap="layers.1.*") == []


def test_drift_flags_a_slow_monotonic_rise_over_a_full_window(tmp_path):
    f = tmp_path / "trend.jsonl"
    _fill(f, {"layers.0.mlp.down": [1e-5 * (1 + 0.05 * i) for i in range(7)]})  # 1.3x: under the factor
    rows = trend.load(f)
    found = trend.drift(rows, window=7)
    assert [(d["tap"], d["kind"]) for d in found] == [("layers.0.mlp.down", "monotonic")]
    assert "rose in each of the last 7 runs" in found[0]["message"]
    assert trend.drift(rows[:3], window=7) == []  # too few nights to call a rise a trend
    assert trend.drift(rows, window=7, factor=1.2)[0]["kind"] == "growth"


def test_drift_restarts_when_the_model_changes(tmp_path):
    f = tmp_path / "trend.jsonl"
    _fill(f, {"logits": [1e-6] * 4}, model="old" * 20)
    _fill(f, {"logits": [5e-5] * 3})  # another model: larger error, but flat since the change
    rows = trend.load(f)
    assert trend.drift(rows) == []
    assert "changed within these runs" in trend.table(rows)


def test_trend_table(tmp_path):
    f = tmp_path / "trend.jsonl"
    _fill(f, {"embed": [0.0, 0.0], "logits": [1e-5, 2e-5]})
    trend.append(f, _report(2, {"embed": 0.0, "logits": 3e-4}, passed={"logits": False}))
    text = trend.table(trend.load(f))
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["tap", "11-01", "03:17"] and lines[0].split()[-1] == "bound"
    logits = next(line for line in lines if line.startswith("logits"))
    assert logits.split() == ["logits", "1.00e-05", "2.00e-05", "3.00e-04!", "atol=0.0001"]
    assert [line.split()[0] for line in lines[2:]] == ["embed", "logits"]
    assert "embed" not in trend.table(trend.load(f), tap="log*")
