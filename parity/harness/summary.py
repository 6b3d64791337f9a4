"""What the terminal shows at the end of a parity run: the first divergence, its sources with their
hints, the separation, goldens, where the report and the snapshot are."""

from __future__ import annotations

from vllm_parity.harness.compare import first_divergence
from vllm_parity.harness.report import describe_separation, separation
from vllm_parity.harness.session import ParitySession

RED, YELLOW = {"red": True}, {"yellow": True}


def lines(s: ParitySession | None, failures: list[tuple[str, str]]) -> list[tuple[str, dict]]:
    """(text, terminal markup) per line."""
    out: list[tuple[str, dict]] = []
    if s is not None and s.results is not None:
        first = first_divergence(list(s.results.values()))
        if first is None:
            out.append((f"no divergence over {len(s.results)} taps (model {s.model_dir}, candidate "
                        f"{s.opts.candidate})", {}))
        else:
            out.append((f"first divergence: {first.name} (layer {first.layer})", RED))
            for r in (r for r in s.results.values() if r.role == "source"):
                out.append((f"  source {r.message}", {}))
                for h in (h for h in s.hints if h["tap"] == r.name):
                    out += [(f"    hint ({h['kind']}): {h['evidence']}", YELLOW), (f"      fix: {h['fix']}", YELLOW)]
            inherited = sum(1 for r in s.results.values() if r.role == "inherited")
            if inherited:
                out.append((f"  {inherited} later failing tap(s) inherit from these sources", {}))
        sep = describe_separation(separation([r.as_dict() for r in s.results.values()]))
        if sep:
            out.append((f"separation: {sep}", {}))
        out += [(f"hint ({h['kind']}): {h['evidence']} — {h['fix']}", YELLOW) for h in s.hints if h["kind"] == "drift"]
    elif s is not None and s.error is not None:
        out.append((f"the parity run failed before comparing: {s.error!r}", RED))
    elif failures:
        out.append((f"first failure: {failures[0][0]} (level {failures[0][1]})", {}))
    if s is None:
        return out
    if s.golden is not None:
        unused = s.unused_golden()
        if unused:
            out.append((f"unused golden taps (no comparison read them): {unused[:10]}"
                        f"{' …' if len(unused) > 10 else ''}", YELLOW))
    if "golden_written" in s.extras:
        out.append((f"golden reference written: {s.extras['golden_written']['path']}", YELLOW))
    if s.report_dir is not None:
        out.append((f"report: {s.report_dir / 'report.html'}", {}))
    if s.snapshot is not None:
        out.append((f"snapshot of the failing taps: {s.snapshot}", {}))
    return out
