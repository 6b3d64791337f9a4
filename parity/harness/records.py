"""What each stage of a parity run returns: a typed record with a JSON round trip (``as_dict`` and
``from_dict``), so that a stage's output can be written, read back and passed to the next stage without
the stage that made it.

capture -> :class:`Capture` (where both sides' dumps are), judge -> :class:`Judgement` (a verdict per tap),
diagnose -> :class:`Diagnosis` (hints), the model-level checks -> a dict each, report -> :class:`RunRecord`
(``report.json`` itself).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_parity.harness import report
from vllm_parity.harness.compare import TapResult
from vllm_parity.harness.diagnosis import Hint
from vllm_parity.harness.dumps import DumpReader


def _reader(path: str | None) -> DumpReader | None:
    return None if path is None else DumpReader(path)


@dataclass(frozen=True)
class Capture:
    """Both sides' dumps. ``isolated``: the candidate again with every layer fed the reference's input;
    ``steps``: the same for each decode step (its rows: one position per prompt)."""

    reference: DumpReader
    candidate: DumpReader | None = None
    isolated: DumpReader | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    steps: tuple["Capture", ...] = ()

    def at(self, step: int | None) -> "Capture":
        """The prefill's dumps (``step`` None) or decode step ``step``'s."""
        return self if step is None else self.steps[step]

    @property
    def judged(self) -> DumpReader:
        """The candidate dump whose errors are the taps' own: the isolated one where it was made."""
        return self.isolated if self.isolated is not None else self.candidate

    def pair(self, tap: str) -> tuple[torch.Tensor, torch.Tensor]:
        """A tap's rows on both sides (every prompt's, in order)."""
        return self.reference.stacked(tap)[0], self.candidate.stacked(tap)[0]

    def as_dict(self) -> dict[str, Any]:
        return {"reference": str(self.reference.root),
                "candidate": None if self.candidate is None else str(self.candidate.root),
                "isolated": None if self.isolated is None else str(self.isolated.root), "seconds": dict(self.seconds),
                **({"steps": [s.as_dict() for s in self.steps]} if self.steps else {})}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Capture:
        return cls(DumpReader(d["reference"]), _reader(d["candidate"]), _reader(d["isolated"]), dict(d["seconds"]),
                   tuple(cls.from_dict(s) for s in d.get("steps", ())))


@dataclass(frozen=True)
class Judgement:
    """A verdict per compared tap, in canonical order."""

    taps: list[TapResult]
    seconds: float = 0.0

    def __getitem__(self, name: str) -> TapResult:
        """The tap's prefill result."""
        for r in self.taps:
            if r.name == name:
                return r
        raise KeyError(f"{name!r} was not compared in this run")

    def phases(self, name: str) -> list[TapResult]:
        """The tap's results: the prefill's, then each decode step's."""
        found = [r for r in self.taps if r.name == name]
        if not found:
            raise KeyError(f"{name!r} was not compared in this run")
        return found

    @property
    def first(self) -> TapResult | None:
        """The first source of a divergence."""
        return next((r for r in self.taps if r.role == "source"), None)

    @property
    def passed(self) -> bool:
        return all(r.verdict for r in self.taps)

    def as_dict(self) -> dict[str, Any]:
        return {"taps": [r.as_dict() for r in self.taps], "seconds": self.seconds}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Judgement:
        return cls([TapResult.from_dict(t) for t in d["taps"]], d.get("seconds", 0.0))


@dataclass(frozen=True)
class Diagnosis:
    """Hints for each source of a divergence and for drift; ``errors``: taps whose shape it could not read."""

    hints: list[Hint] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def of(self, tap: str) -> list[Hint]:
        return [h for h in self.hints if h.tap == tap]

    def as_dict(self) -> dict[str, Any]:
        return {"hints": [h.as_dict() for h in self.hints], "errors": list(self.errors), "seconds": self.seconds}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Diagnosis:
        return cls([Hint(**h) for h in d["hints"]], list(d.get("errors", [])), d.get("seconds", 0.0))


@dataclass(frozen=True)
class RunRecord:
    """One run's report: what ran (``run``), the judgement, the diagnosis, and the checks beside the taps
    (model-level checks, calibration, a golden written), each a dict with ``passed``."""

    run: dict[str, Any]
    judgement: Judgement
    diagnosis: Diagnosis
    checks: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.judgement.passed and all(c["passed"] for c in self.checks.values())

    def as_dict(self) -> dict[str, Any]:
        """The report (``report.json``, schema ``parity-report/1``)."""
        first = self.judgement.first
        errors = self.diagnosis.errors
        extras = {**self.checks, **({"diagnosis_errors": {"passed": True, "errors": errors}} if errors else {})}
        rep = report.build({**self.run, "extras": extras}, [r.as_dict() for r in self.judgement.taps],
                           None if first is None else {"name": first.name, "layer": first.layer,
                                                       **({"phase": first.phase, "step": first.step}
                                                          if first.phase != "prefill" else {})},
                           [h.as_dict() for h in self.diagnosis.hints])
        rep["passed"] = self.passed
        return rep

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunRecord:
        if d.get("schema") != report.SCHEMA:
            raise ValueError(f"a run record of schema {d.get('schema')!r}; expected {report.SCHEMA!r}")
        run = {k: v for k, v in d["run"].items() if k != "extras"}
        checks = dict(d["run"].get("extras", {}))
        errors = checks.pop("diagnosis_errors", {}).get("errors", [])
        timings = run.get("timings", {})
        return cls(run, Judgement([TapResult.from_dict(t) for t in d["taps"]], timings.get("compare_s", 0.0)),
                   Diagnosis([Hint(**h) for h in d["hints"]], list(errors), timings.get("diagnose_s", 0.0)), checks)
