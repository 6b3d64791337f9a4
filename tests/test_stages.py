"""The stages after capture as functions of records: judge, diagnose and write, without a session or an engine;
and every record's JSON round trip."""

import dataclasses
import errno
import json

import pytest
import torch

from vllm_parity.architectures import lookup
from vllm_parity.harness import snapshots, stages, summary
from vllm_parity.harness.compare import TapResult
from vllm_parity.harness.dumps import DumpReader, DumpWriter
from vllm_parity.harness.records import Capture, Diagnosis, Judgement, RunRecord
from vllm_parity.harness.session import Finished
from vllm_parity.harness.taps import canonical_order
from vllm_parity.harness.tolerances import ToleranceTable

LLAMA = lookup("llama")
LAYERS = 4


class _Unquantized:
    """What diagnosis asks of a checkpoint, for one without quantized projections."""

    spec = None

    def linear_shapes(self):
        return {}


def _dump(root, tensors):
    w = DumpWriter(root, {"versions": {"torch": torch.__version__}})
    for tap, per_prompt in tensors.items():
        w.write(tap, {f"{tap}@{p}": t for p, t in enumerate(per_prompt)})
    return DumpReader(w.close())


def _capture(tmp_path, fault=None, drift=0.0):
    """Both sides over every tap; from ``fault`` on the candidate is off, and each layer's output drifts."""
    taps = canonical_order(LAYERS, LLAMA)
    g = torch.Generator().manual_seed(0)
    ref = {t: [torch.randn(5, 16, generator=g), torch.randn(3, 16, generator=g)] for t in taps}
    cand = {t: [x.clone() for x in v] for t, v in ref.items()}
    if fault is not None:
        for t in taps[taps.index(fault):]:
            cand[t] = [x + 1.0 for x in cand[t]]
    for i in range(LAYERS):
        t = f"layers.{i}.output"
        cand[t] = [x * (1 + drift * 4 ** i) for x in cand[t]]
    return Capture(_dump(tmp_path / "reference", ref), _dump(tmp_path / "candidate", cand)), taps


def _record(capture, taps):
    shown = [t for t in taps if not t.endswith(".input")]
    judgement = stages.judge(capture, taps, shown, ToleranceTable(), LAYERS, LLAMA)
    diagnosis = stages.diagnose(judgement, capture, _Unquantized(), LLAMA)
    run = {"id": "r1", "started": "now", "model": "m", "format": "fp", "level": "block", "mode": "propagated",
           "prompts_sha256": "p", "versions": {}, "candidate": "vllm", "model_sha256": "s",
           "timings": {"compare_s": judgement.seconds, "diagnose_s": diagnosis.seconds}}
    return RunRecord(run, judgement, diagnosis, {"greedy": {"passed": True, "agree": 8}})


def test_judge_returns_the_verdicts_and_leaves_its_input_alone(tmp_path):
    capture, taps = _capture(tmp_path, fault="layers.2.mlp.act")
    judgement = stages.judge(capture, taps, [t for t in taps if not t.endswith(".input")], ToleranceTable(),
                             LAYERS, LLAMA)
    assert judgement.first.name == "layers.2.mlp.act" and not judgement.passed
    assert judgement["layers.2.mlp.down"].role == "inherited"
    assert not any(r.name.endswith(".input") for r in judgement.taps), "layer inputs decide roles, are not shown"
    with pytest.raises(dataclasses.FrozenInstanceError):
        judgement.taps[0].passed = False
    with pytest.raises(KeyError, match="was not compared"):
        judgement["layers.9.output"]


def test_isolated_dumps_decide_the_roles(tmp_path):
    capture, taps = _capture(tmp_path, fault="layers.2.mlp.act")
    # Fed the reference's inputs, only the planted tap itself is wrong.
    iso = {t: [capture.reference.get(t, p) + (1.0 if t == "layers.2.mlp.act" else 0.0) for p in (0, 1)]
           for t in taps}
    capture = dataclasses.replace(capture, isolated=_dump(tmp_path / "isolated", iso))
    judgement = stages.judge(capture, taps, taps, ToleranceTable(), LAYERS, LLAMA)
    assert [r.name for r in judgement.taps if r.role == "source"] == ["layers.2.mlp.act"]
    assert judgement["layers.3.output"].isolated.passed and judgement["layers.3.output"].role == "inherited"


def test_diagnose_names_drift_across_the_layers(tmp_path):
    capture, taps = _capture(tmp_path, drift=2e-4)
    record = _record(capture, taps)
    assert [h.kind for h in record.diagnosis.hints] == ["drift"], record.diagnosis.hints


def test_every_record_round_trips_through_json(tmp_path):
    capture, taps = _capture(tmp_path, fault="layers.1.attn.o")
    record = _record(capture, taps)
    for rec in (capture, record.judgement, record.diagnosis, record):
        stored = json.loads(json.dumps(rec.as_dict()))
        back = type(rec).from_dict(stored)
        assert json.loads(json.dumps(back.as_dict())) == stored, type(rec).__name__
    back = Capture.from_dict(json.loads(json.dumps(capture.as_dict())))
    assert torch.equal(back.pair("layers.1.attn.o")[1], capture.pair("layers.1.attn.o")[1])
    assert not record.passed and record.as_dict()["first_divergence"] == {"name": "layers.1.attn.o", "layer": 1}
    with pytest.raises(ValueError, match="schema"):
        RunRecord.from_dict({**record.as_dict(), "schema": "parity-report/0"})


def _with_steps(tmp_path, capture, taps, faults):
    """``capture`` and two decode steps (one row per prompt), the candidate off by one where ``faults`` says:
    ``{(tap, step): ...}``, step None the prefill's."""
    def off(c, step):
        return {t: [c.get(t, p) + ((t, step) in faults) for p in (0, 1)] for t in taps}
    ref = {t: [x[:1] for x in v] for t, v in off(capture.reference, -1).items()}
    def cand(s):
        return {t: [x + ((t, s) in faults) for x in v] for t, v in ref.items()}
    steps = tuple(Capture(_dump(tmp_path / f"ref{s}", ref), _dump(tmp_path / f"cand{s}", cand(s))) for s in range(2))
    prefill = _dump(tmp_path / "cand", off(capture.reference, None))
    return Capture(capture.reference, prefill, steps=steps)


def test_decode_steps_are_judged_each_and_attributed_across_the_cache(tmp_path):
    capture, taps = _capture(tmp_path)
    shown = [t for t in taps if not t.endswith(".input")]
    # layer 1's attention wrong at decode step 1 only; layer 2's keys wrong at the prefill: its attention at every
    # decode step reads them from the cache (inherited), though its inputs at the step pass; layer 0's up projection
    # wrong at the prefill and the first step: one fault, its source where it first shows
    faults = {("layers.1.attn.context", 1), ("layers.2.attn.k", None), ("layers.2.attn.context", 0),
              ("layers.2.attn.context", 1), ("layers.0.mlp.up", None), ("layers.0.mlp.up", 0)}
    capture = _with_steps(tmp_path, capture, taps, faults)
    judgement = stages.judge(capture, taps, shown, ToleranceTable(), LAYERS, LLAMA)
    assert len(judgement.taps) == 3 * len(shown) and judgement["embed"].phase == "prefill"
    sources = [(r.name, r.step) for r in judgement.taps if r.role == "source"]
    assert sources == [("layers.0.mlp.up", None), ("layers.2.attn.k", None), ("layers.1.attn.context", 1)], sources
    assert judgement.phases("layers.0.mlp.up")[1].fed_by == ["layers.0.mlp.up (prefill)"]
    cached = judgement.phases("layers.2.attn.context")
    assert [(r.phase, r.step, r.role) for r in cached] == [("prefill", None, "pass"), ("decode", 0, "inherited"),
                                                           ("decode", 1, "inherited")]
    assert cached[1].fed_by == ["layers.2.attn.k (prefill)"] and cached[1].message.startswith("decode step 0: ")
    record = _record(capture, taps)
    rep = record.as_dict()
    assert {t["step"] for t in rep["taps"] if t.get("phase") == "decode"} == {0, 1}
    assert rep["first_divergence"] == {"name": "layers.0.mlp.up", "layer": 0}
    back = Capture.from_dict(json.loads(json.dumps(capture.as_dict())))
    assert torch.equal(back.at(1).pair("layers.1.attn.context")[1], capture.steps[1].pair("layers.1.attn.context")[1])
    assert capture.steps[0].reference.stacked("embed")[1] == [(0, 0), (1, 0)]  # no first_positions: from 0
    _, written = stages.write(record, capture, tmp_path / "report", str(tmp_path / "snap"), ["pytest"], keep=5,
                              max_gb=1.0)
    assert "layers.1.attn.context#decode1" in json.loads((written.snapshot / "diff.json").read_text())


def test_a_report_on_disk_is_its_record(tmp_path):
    capture, taps = _capture(tmp_path, fault="layers.1.attn.o")
    record, written = stages.write(_record(capture, taps), capture, tmp_path / "report", str(tmp_path / "snap"),
                                   ["pytest"], keep=5, max_gb=1.0)
    on_disk = json.loads((written.report / "report.json").read_text())
    assert on_disk == json.loads(json.dumps(record.as_dict()))
    assert RunRecord.from_dict(on_disk).judgement.first.name == "layers.1.attn.o"
    assert written.snapshot is not None and (written.snapshot / "meta.json").exists()
    assert Finished(record, None, written).written.as_dict()["snapshot"] == str(written.snapshot)


def test_a_full_disk_for_the_snapshot_is_in_the_report_and_the_summary(tmp_path, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(snapshots, "save_file", full)
    capture, taps = _capture(tmp_path, fault="layers.1.attn.o")
    record, written = stages.write(_record(capture, taps), capture, tmp_path / "report", str(tmp_path / "snap"),
                                   ["pytest"], keep=5, max_gb=1.0)
    assert written.snapshot is None and "the disk is full" in written.snapshot_error
    extras = json.loads((written.report / "report.json").read_text())["run"]["extras"]
    assert extras["snapshot_error"]["passed"] is False and "the disk is full" in extras["snapshot_error"]["message"]
    text = [line for line, _ in summary.lines(Finished(record, None, written), [])]
    assert any(line.startswith("no snapshot of the failing taps:") for line in text), text
    assert text[0] == "first divergence: layers.1.attn.o (layer 1)"


def test_a_run_that_stopped_before_comparing_says_why():
    text = [line for line, _ in summary.lines(Finished(None, ValueError("no such file"), None), [])]
    assert text == ["the parity run failed before comparing: ValueError('no such file')"]


def test_tap_results_are_values():
    r = TapResult("embed", "op", None, [1], None, ToleranceTable().resolve("embed"), True)
    assert dataclasses.replace(r, passed=False).passed is False and r.passed is True
    assert Diagnosis().as_dict() == {"hints": [], "errors": [], "seconds": 0.0}
    assert Judgement([r]).passed
