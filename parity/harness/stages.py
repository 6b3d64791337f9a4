"""The stages after capture, each a function of records that returns a record: judge, diagnose, write."""

from __future__ import annotations

import dataclasses
import errno
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from vllm_parity.architectures import Architecture
from vllm_parity.harness import report, snapshots
from vllm_parity.harness.compare import TapResult, at_step, attribute_phases, compare_dumps, merge_isolated
from vllm_parity.harness.records import Capture, Diagnosis, Judgement, RunRecord
from vllm_parity.harness.tolerances import ToleranceTable
from vllm_parity.reference.checkpoint import Checkpoint


def judge(capture: Capture, taps: list[str], shown: list[str], table: ToleranceTable, num_layers: int,
          arch: Architecture, on_tap: Callable[[], None] | None = None) -> Judgement:
    """Every captured tap (layer inputs included: they decide source against inherited), then the roles from
    the isolated run where there is one; the prefill's, then each decode step's; the verdicts of the ``shown``
    taps. ``on_tap``: after each tap of each comparison."""
    t0 = time.perf_counter()

    def one(c: Capture) -> list[TapResult]:
        results = compare_dumps(c.reference, c.candidate, taps, table, num_layers, arch, on_tap)
        if c.isolated is not None:
            results = merge_isolated(results, compare_dumps(c.reference, c.isolated, taps, table, num_layers, arch,
                                                            on_tap))
        return results
    results = one(capture)
    for s, c in enumerate(capture.steps):
        results += at_step(one(c), s)
    keep = set(shown)
    return Judgement([r for r in attribute_phases(results, num_layers, arch) if r.name in keep],
                     time.perf_counter() - t0)


def diagnose(judgement: Judgement, capture: Capture, ckpt: Checkpoint, arch: Architecture,
             tp_size: int = 1) -> Diagnosis:
    """Hints for every source of a divergence, and for drift across the layers' outputs."""
    from vllm_parity.harness.diagnosis import (DRIFT_MIN_GROWTH, DRIFT_MIN_GROWTH_RELATIVE, diagnose_depth,
                                               diagnose_tap, linear_context)
    from vllm_parity.harness.op_hints import op_hints

    t0 = time.perf_counter()
    hints, errors = [], []
    for r in judgement.taps:
        if r.role != "source" or r.metrics is None:
            continue
        ref, cand = capture.at(r.step).reference, capture.at(r.step).judged
        if r.phase == "decode" and r.name.endswith(".attn.context"):
            try:
                hints.append(_kv_cache_hint(r, judgement, capture, ckpt, arch))
            except ValueError as exc:
                errors.append(f"{r.label}: {exc}")
            continue
        linear = None
        projection = arch.projection(r.name, ckpt.linear_shapes())
        spec = ckpt.spec
        if projection is not None and spec is not None and not spec.is_ignored(projection[0]):
            module, input_tap = projection
            linear = linear_context(ckpt, module, ref.stacked(input_tap)[0], cand.manifest.get("dtype"))
        # What the candidate's side recorded of its own layout: fused layers and tensor-parallel spread.
        group = [t for t in cand.manifest.get("fused", {}).get(r.name, []) if t in ref.taps()]
        siblings = {t: (ref.stacked(t)[0], cand.stacked(t)[0]) for t in group} if len(group) > 1 else None
        try:
            found = diagnose_tap(r.name, ref.stacked(r.name)[0], cand.stacked(r.name)[0], linear, tp_size=tp_size,
                                 siblings=siblings, parallel=cand.manifest.get("parallel", {}).get(r.name))
            # attention at a decode step reads positions its step's dump does not hold: kv_cache's check
            more = op_hints(r.name, ref, cand, ckpt, arch) if r.phase == "prefill" else []
            real = [h for h in found + more if h.kind != "undecided"]  # what was ruled out only when none holds
            hints += [_at_step(h, r) for h in real or found + more]
        except ValueError as exc:  # a shape the diagnosis cannot read is not a reason to lose the run
            errors.append(f"{r.label}: {exc}")
    outputs = [r for r in judgement.taps if r.name.endswith(".output") and r.metrics is not None
               and r.phase == "prefill"]  # drift is read across the layers of one forward
    if outputs:
        tol = outputs[-1].tolerance
        if tol.elementwise_only:
            errs, bound, growth = [(r.name, r.metrics.max_abs) for r in outputs], (tol.atol, "max_abs", "atol"), \
                DRIFT_MIN_GROWTH
        else:
            errs = [(r.name, r.metrics.token_rel) for r in outputs]
            bound, growth = (tol.token_rtol, "token relative error", "token_rtol"), DRIFT_MIN_GROWTH_RELATIVE
        last = outputs[-1].name
        judged = capture.judged
        half = judged.entry(last, judged.prompts(last)[0]).get("dtype") in ("float16", "bfloat16")
        hints += diagnose_depth(errs, *bound, min_growth=growth, rounding=half)
    return Diagnosis(hints, errors, time.perf_counter() - t0)


def _kv_cache_hint(r: TapResult, judgement: Judgement, capture: Capture, ckpt: Checkpoint, arch: Architecture):
    """Attention failing at a decode step while its prefill passes: whether the KV cache explains it."""
    from vllm_parity.harness.diagnosis import ruled_out
    from vllm_parity.harness.op_hints import kv_cache

    prefill = judgement.phases(r.name)[0]
    if prefill.phase != "prefill" or not prefill.verdict:
        return ruled_out(r.name, [("kv_cache", float("inf"))], why=f" at decode step {r.step}: the prefill fails too")
    phases = [capture, *capture.steps]
    return kv_cache(r.name, r.step, [c.reference for c in phases], [c.judged for c in phases], ckpt, arch)


def _at_step(hint, r: TapResult):
    """A hint of a decode step's tap says which step it read."""
    if r.phase == "prefill":
        return hint
    return dataclasses.replace(hint, evidence=f"decode step {r.step}: {hint.evidence}")


@dataclass(frozen=True)
class Written:
    """Where a run's record went: the report directory, and the snapshot of its failing taps (if any)."""

    report: Path
    snapshot: Path | None = None
    snapshot_error: str | None = None
    report_error: str | None = None  # why the report, or the trend line, could not be written: the run fails
    trend_error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"report": str(self.report), "snapshot": None if self.snapshot is None else str(self.snapshot),
                "snapshot_error": self.snapshot_error, "report_error": self.report_error,
                "trend_error": self.trend_error}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Written:
        return cls(Path(d["report"]), None if d["snapshot"] is None else Path(d["snapshot"]), d["snapshot_error"],
                   d.get("report_error"), d.get("trend_error"))

    @property
    def failed(self) -> bool:
        """Something the run was asked to write is not on disk (a missing snapshot is in the report instead)."""
        return self.report_error is not None or self.trend_error is not None


def write(record: RunRecord, capture: Capture, root: Path, snapshot_dir: str, command: list[str], keep: int,
          max_gb: float, trend: str | None = None) -> tuple[RunRecord, Written]:
    """report.json (with the first failing tap's heatmap), the trend line, and a snapshot of every failing
    tap; a snapshot that cannot be written fails the run's record, and loses nothing written before; a report or
    trend line that cannot be written (a full disk) is said in what this returns, and nothing else is lost."""
    failing = [r for r in record.judgement.taps if not r.verdict and r.metrics is not None]
    heat = None
    if failing:
        f = record.judgement.first or failing[0]
        at = capture.at(f.step)
        ref, rows = at.reference.stacked(f.name)  # every prompt's rows; the error the tap is judged on
        heat = report.heatmap_of(f.label, ref, at.judged.stacked(f.name)[0], rows)
    snapshot, snapshot_error = None, None
    if failing:
        try:
            snapshot = _snapshot(record, capture, failing, root, snapshot_dir, command)
        except snapshots.SnapshotError as exc:
            snapshot_error = str(exc)
            record = RunRecord(record.run, record.judgement, record.diagnosis,
                               {**record.checks, "snapshot_error": {"passed": False, "message": snapshot_error}})
        else:
            snapshots.prune(snapshot_dir, keep, max_gb, protect=snapshot)
    rep = record.as_dict()
    report_error = trend_error = None
    try:
        report.write(root, rep, heat)
    except OSError as exc:
        report_error = _why(exc)
    if trend:
        from vllm_parity.harness import trend as trend_mod

        try:
            trend_mod.append(trend, rep, model_sha256=record.run["model_sha256"])
        except OSError as exc:
            trend_error = _why(exc)
    return record, Written(root, snapshot, snapshot_error, report_error, trend_error)


def _why(exc: OSError) -> str:
    what = "the disk is full" if exc.errno == errno.ENOSPC else exc.strerror or str(exc)
    return f"{what} (writing {exc.filename})" if exc.filename else what


def _snapshot(record: RunRecord, capture: Capture, failing: list[TapResult], root: Path, snapshot_dir: str,
              command: list[str]) -> Path:
    ref, cand, diff = {}, {}, {}
    for r in failing:
        at = capture.at(r.step)
        name = r.name if r.phase == "prefill" else f"{r.name}#decode{r.step}"
        for p in at.reference.prompts(r.name):
            ref[f"{name}@{p}"] = at.reference.get(r.name, p)
            cand[f"{name}@{p}"] = at.candidate.get(r.name, p)
        diff[name] = r.as_dict()
    run = record.run
    meta = {"run": run["id"], "model": run["model"], "format": run["format"], "level": run["level"],
            "command": " ".join(command), "report": str(root), "prompts_sha256": run["prompts_sha256"]}
    return snapshots.write(snapshot_dir, run["id"], ref, cand, diff, meta)
