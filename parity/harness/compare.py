"""Comparing two dumps tap by tap: metrics, tolerance, growth bound, source versus inherited."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from vllm_parity.architectures import Architecture
from vllm_parity.harness.dumps import DumpReader
from vllm_parity.harness.metrics import Metrics, ShapeMismatch, Tolerance, compare, describe, passes
from vllm_parity.harness.taps import LEVEL_BLOCK, inputs_of, layer_of, level_of
from vllm_parity.harness.tolerances import ToleranceTable

DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class TapResult:
    name: str
    level: str
    layer: int | None
    shape: list[int]
    metrics: Metrics | None
    tolerance: Tolerance
    passed: bool
    growth: float | None = None
    message: str = ""
    role: str = "pass"  # "pass", "source" or "inherited"
    fed_by: list[str] = field(default_factory=list)
    isolated: "TapResult | None" = None  # the same tap with every layer fed the reference's input
    phase: str = "prefill"  # or "decode": the tap at decode step ``step`` (one row per prompt, from the KV cache)
    step: int | None = None
    kernels: list[str] = field(default_factory=list)  # the serving kernels that computed it (where reported)

    @property
    def label(self) -> str:
        """The tap and, at a decode step, which one."""
        return self.name if self.phase == "prefill" else f"{self.name} (decode step {self.step})"

    @property
    def verdict(self) -> bool:
        """Whether the tap passes as judged: by its isolated run's error where there is one (isolated mode)."""
        return self.isolated.passed if self.isolated is not None else self.passed

    def as_dict(self) -> dict[str, Any]:
        m = self.metrics.as_dict() if self.metrics else None
        return {
            "name": self.name, "level": self.level, "layer": self.layer, "shape": self.shape,
            "metrics": None if m is None else {k: m[k] for k in ("max_abs", "max_rel", "mean_abs", "cosine",
                                                                  "sqnr_db", "mismatch_frac", "token_rel",
                                                                  "worst_token", "nonfinite", "numel")},
            "tolerance": self.tolerance.as_dict(), "passed": self.passed, "verdict": self.verdict, "growth": self.growth,
            "margin": None if m is None else m["margin"],
            "min_tolerance": None if m is None else {"atol": m["min_atol"], "rtol": self.tolerance.rtol,
                                                     "row_rtol": m["min_row_rtol"], "token_rtol": m["token_rel"]},
            "worst": None if m is None else {"index": m["worst_index"], "reference": m["worst_ref"],
                                             "candidate": m["worst_cand"]},
            "role": self.role, "fed_by": self.fed_by, "message": self.message,
            **({"isolated": self.isolated.as_dict()} if self.isolated is not None else {}),
            **({"phase": self.phase, "step": self.step} if self.phase != "prefill" else {}),
            **({"kernels": list(self.kernels)} if self.kernels else {}),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TapResult:
        """The result a report holds (inverse of :meth:`as_dict`)."""
        metrics = None
        if d["metrics"] is not None:
            metrics = Metrics.from_dict({**d["metrics"], "margin": d["margin"], "min_atol": d["min_tolerance"]["atol"],
                                         "min_row_rtol": d["min_tolerance"]["row_rtol"],
                                         "worst_index": d["worst"]["index"], "worst_ref": d["worst"]["reference"],
                                         "worst_cand": d["worst"]["candidate"]})
        return cls(d["name"], d["level"], d["layer"], list(d["shape"]), metrics, Tolerance.from_dict(d["tolerance"]),
                   d["passed"], d["growth"], d["message"], d["role"], list(d["fed_by"]),
                   cls.from_dict(d["isolated"]) if d.get("isolated") is not None else None,
                   d.get("phase", "prefill"), d.get("step"), list(d.get("kernels", ())))


def compare_tap(ref: DumpReader, cand: DumpReader, tap: str, table: ToleranceTable) -> TapResult:
    level, layer = level_of(tap), layer_of(tap)
    prompts = ref.prompts(tap)
    dtype = DTYPES.get(ref.entry(tap, prompts[0])["dtype"], torch.float32) if prompts else torch.float32
    cand_dtype = DTYPES.get(cand.entry(tap, cand.prompts(tap)[0])["dtype"], dtype) if cand.prompts(tap) else dtype
    # the looser of the two sides' dtypes sets the default
    tol = table.resolve(tap, max((dtype, cand_dtype), key=lambda d: _looseness(table.resolve(tap, d))))
    missing = sorted(set(prompts) - set(cand.prompts(tap)))
    if not prompts or missing:
        why = "absent from the reference" if not prompts else f"prompts {missing} missing in the candidate"
        return TapResult(tap, level, layer, [], None, tol, False, message=f"{tap}: {why}")
    r, rows = ref.stacked(tap, prompts)
    c, _ = cand.stacked(tap, prompts)
    try:
        m = compare(r, c, tol)
    except ShapeMismatch as exc:
        return TapResult(tap, level, layer, list(r.shape), None, tol, False, message=f"{tap}: {exc}")
    p, pos = rows[m.worst_index[0]]
    m = Metrics(**{**m.__dict__, "worst_index": (p, pos, *m.worst_index[1:])})
    ok = passes(m, tol)
    tp, tpos = rows[m.worst_token]
    return TapResult(tap, level, layer, [len(prompts), *list(r.shape)], m, tol, ok,
                     message="" if ok else describe(tap, m, tol, row=f"prompt {tp}, position {tpos}"),
                     kernels=list(cand.manifest.get("kernels", {}).get(tap, ())))


def _looseness(tol: Tolerance) -> tuple[float, float, float]:
    return tol.token_rtol if math.isfinite(tol.token_rtol) else 0.0, tol.row_rtol + tol.rtol, tol.atol


def compare_dumps(ref: DumpReader, cand: DumpReader, taps: list[str], table: ToleranceTable,
                  num_layers: int | None = None, arch: Architecture | None = None,
                  on_tap: Callable[[], None] | None = None) -> list[TapResult]:
    """``on_tap``: called after each tap is compared (a run's progress)."""
    results = []
    for t in taps:
        results.append(compare_tap(ref, cand, t, table))
        if on_tap is not None:
            on_tap()
    return attribute(apply_growth(results, table), num_layers, arch)


def merge_isolated(propagated: list[TapResult], isolated: list[TapResult]) -> list[TapResult]:
    """Roles from both runs: a tap that fails with every layer fed the reference's input (and whose
    inputs pass there) is a source; one that fails only when errors propagate inherits them."""
    iso = {r.name: r for r in isolated}
    merged = []
    for r in propagated:
        i = iso.get(r.name)
        if i is None:
            merged.append(dataclasses.replace(r, isolated=None))
        elif i.role == "source":
            merged.append(dataclasses.replace(r, isolated=i, role="source", fed_by=[]))
        elif not r.passed or not i.passed:
            merged.append(dataclasses.replace(r, isolated=i, role="inherited", fed_by=r.fed_by or i.fed_by))
        else:
            merged.append(dataclasses.replace(r, isolated=i, role="pass"))
    return merged


GROWTH_FLOOR = 0.01  # of the tolerance: below it an error is rounding noise, and growth from it no jump


def apply_growth(results: list[TapResult], table: ToleranceTable) -> list[TapResult]:
    """Flag a layer output whose error jumps by more than max_growth x the previous layer's.

    The error is the per-token relative one (a layer that adds a massive activation grows the absolute
    error with the signal, not the relative one); tables judged elementwise only keep the absolute one.
    """
    out, prev = [], None
    for r in results:
        if r.level != LEVEL_BLOCK or not r.name.endswith(".output") or r.metrics is None:
            out.append(r)
            continue
        if prev is not None and prev.metrics is not None:
            relative = not r.tolerance.elementwise_only
            err, before = ((r.metrics.token_rel, prev.metrics.token_rel) if relative
                           else (r.metrics.max_abs, prev.metrics.max_abs))
            bound = r.tolerance.token_rtol if relative else r.tolerance.atol
            growth = err / max(before, GROWTH_FLOOR * bound, 1e-300)
            r = dataclasses.replace(r, growth=growth)
            if growth > table.max_growth and r.passed:
                what = "token relative error" if relative else "error"
                r = dataclasses.replace(r, passed=False, message=(
                    f"{r.name}: {what} grew {growth:.1f}x over {prev.name} ({before:.3g} -> {err:.3g}), above "
                    f"max_growth {table.max_growth:g}, although inside tolerance"))
        out.append(r)
        prev = r
    return out


def attribute(results: list[TapResult], num_layers: int | None = None,
              arch: Architecture | None = None) -> list[TapResult]:
    """A failing tap whose inputs all pass is a source; one with a failing input inherits from it.

    Inputs follow the architecture's dataflow (``vllm_parity.harness.taps.inputs_of``); an input that was not
    compared counts as passing, so narrowing the taps can only make more taps sources.
    """
    layers = num_layers if num_layers is not None else 1 + max((r.layer for r in results if r.layer is not None),
                                                               default=-1)
    failed = {r.name for r in results if not r.passed}
    out = []
    for r in results:
        bad = [] if r.passed else [t for t in inputs_of(r.name, layers, arch) if t in failed]
        role = "pass" if r.passed else "inherited" if bad else "source"
        out.append(dataclasses.replace(r, role=role, fed_by=bad))
    return out


KV_INPUTS = (".attn.k", ".attn.k_norm", ".attn.v")  # the taps a layer's KV cache holds


def at_step(results: list[TapResult], step: int) -> list[TapResult]:
    """Results of one decode step's comparison, marked as such (and their isolated runs)."""
    def mark(r: TapResult) -> TapResult:
        return dataclasses.replace(r, phase="decode", step=step,
                                   message=r.message and f"decode step {step}: {r.message}")
    return [dataclasses.replace(mark(r), isolated=None if r.isolated is None else mark(r.isolated)) for r in results]


def attribute_phases(results: list[TapResult], num_layers: int,
                     arch: Architecture | None = None) -> list[TapResult]:
    """Roles across phases. A decode step's source that is the same tap's source at the prefill or an earlier
    step is that fault again (one fault, one source: where it first shows). One that reads the KV cache (its inputs
    are a layer's keys and values) inherits from those keys or values where they failed at the prefill or an
    earlier step: the cache holds them."""
    def at(s: int | None) -> str:
        return " (prefill)" if s is None else f" (decode step {s})"
    failed = {(r.name, r.step) for r in results if not r.verdict}
    sources = {(r.name, r.step) for r in results if r.role == "source"}
    out = []
    for r in results:
        if r.phase == "decode" and r.role == "source":
            earlier = [None, *range(r.step)]
            kv = [t for t in inputs_of(r.name, num_layers, arch) if t.endswith(KV_INPUTS)]
            bad = [r.name + at(s) for s in earlier if (r.name, s) in sources][:1] or \
                [t + at(s) for s in earlier for t in kv if (t, s) in failed]
            if bad:
                r = dataclasses.replace(r, role="inherited", fed_by=bad)
        out.append(r)
    return out


def kernel_branches(results: list[TapResult], possible: dict[str, list[str]],
                    why: dict[str, str] | None = None) -> dict[str, Any]:
    """The serving kernels the compared taps were computed by, per phase, and those the methods may choose
    (``possible``: per tap) that no compared tap ran; ``why``: per kernel, why no forward of the run took it (the
    candidate's ``kernel_untaken``), kept for those not exercised (``why_not``)."""
    ran = {phase: sorted({k for r in results if r.phase == phase for k in r.kernels})
           for phase in ("prefill", "decode")}
    every = {k for r in results for k in r.kernels}
    could = {k for t in {r.name for r in results} for k in possible.get(t, ())}
    out = {"exercised": {p: k for p, k in ran.items() if k}, "not_exercised": sorted(could - every)}
    reasons = {k: why[k] for k in out["not_exercised"] if why and k in why}
    return {**out, "why_not": reasons} if reasons else out


def first_divergence(results: list[TapResult]) -> TapResult | None:
    return next((r for r in results if r.role == "source"), None)
