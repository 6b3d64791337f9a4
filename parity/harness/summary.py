"""What the terminal shows at the end of a parity run, from its record: the first divergence, its sources
with their hints, the separation, goldens, where the report and the snapshot are."""

from __future__ import annotations

from vllm_parity.harness.report import describe_branches, describe_schedule, describe_separation
from vllm_parity.harness.session import Finished

RED, YELLOW = {"red": True}, {"yellow": True}


def lines(finished: Finished | None, failures: list[tuple[str, str]]) -> list[tuple[str, dict]]:
    """(text, terminal markup) per line."""
    out: list[tuple[str, dict]] = []
    record = finished.record if finished is not None else None
    if record is not None:
        judgement, hints = record.judgement, record.diagnosis.hints
        first = judgement.first
        if first is None:
            steps = 1 + max((r.step for r in judgement.taps if r.step is not None), default=-1)
            each = f", each at the prefill and {steps} decode step(s)" if steps else ""
            out.append((f"no divergence over {len({r.name for r in judgement.taps})} taps{each} (model "
                        f"{record.run['model']}, candidate {record.run['candidate']})", {}))
        else:
            out.append((f"first divergence: {first.label} (layer {first.layer})", RED))
            for r in (r for r in judgement.taps if r.role == "source"):
                out.append((f"  source {r.message}", {}))
                for h in record.diagnosis.of(r.name):
                    out += [(f"    hint ({h.kind}): {h.evidence}", YELLOW), (f"      fix: {h.fix}", YELLOW)]
            inherited = sum(1 for r in judgement.taps if r.role == "inherited")
            if inherited:
                out.append((f"  {inherited} later failing tap(s) inherit from these sources", {}))
        sep = describe_separation(record.as_dict()["separation"])
        if sep:
            out.append((f"separation: {sep}", {}))
        out += [(f"hint ({h.kind}): {h.evidence} — {h.fix}", YELLOW) for h in hints if h.kind == "drift"]
        branches = describe_branches(record.run.get("kernel_branches"))
        if branches:
            out.append((f"kernel branches: {branches}", {}))
        schedule = describe_schedule(record.run.get("schedule"))
        if schedule:
            out.append((f"schedule: {schedule}", {}))
        unused = record.run.get("unused_golden_taps") or []
        if unused:
            out.append((f"unused golden taps (no comparison read them): {unused[:10]}"
                        f"{' …' if len(unused) > 10 else ''}", YELLOW))
        if "golden_written" in record.checks:
            out.append((f"golden reference written: {record.checks['golden_written']['path']}", YELLOW))
    elif finished is not None and finished.error is not None:
        out.append((f"the parity run failed before comparing: {finished.error!r}", RED))
    elif failures:
        out.append((f"first failure: {failures[0][0]} (level {failures[0][1]})", {}))
    written = finished.written if finished is not None else None
    if written is not None:
        if written.report_error is None:
            out.append((f"report: {written.report / 'report.html'}", {}))
        else:
            out.append((f"no report written under {written.report}: {written.report_error}", RED))
        if written.trend_error is not None:
            out.append((f"no trend line appended: {written.trend_error}", RED))
        if written.snapshot is not None:
            out.append((f"snapshot of the failing taps: {written.snapshot}", {}))
        if written.snapshot_error is not None:
            out.append((f"no snapshot of the failing taps: {written.snapshot_error}", RED))
    return out
