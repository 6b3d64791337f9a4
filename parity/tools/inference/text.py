"""How the report's numbers are written in the text of ``parity inspect`` (the renderer's and each
format's row of the quantized-matrix table)."""

from __future__ import annotations

import functools

from vllm_parity.harness.report import fmt

g = functools.partial(fmt, none="-", spec=".4g")


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def shape(s) -> str:
    return "x".join(str(d) for d in s) if s else "()"
