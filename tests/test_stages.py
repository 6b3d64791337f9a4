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
