"""Measured tolerances: the spread between independent correct implementations, with headroom,
capped by what the format can resolve.

A correct candidate differs from the fp32 reference by what any two correct implementations differ
by: other kernels, another summation order, fused operations. Calibration measures that spread per tap
as the largest of
- the fp32 reference against the same reference in fp64 (its own rounding),
- against itself with another attention implementation (``sdpa`` instead of ``eager``),
- against itself with every linear summed in the reverse order of its input features,
- the candidate against itself over two runs (its nondeterminism),
each as the two criteria of a tolerance (``vllm_parity.harness.metrics.spread``): the largest per-token relative
error, and the largest element error relative to ``|r| + rms(row)``. Times ``headroom`` they become the
tap's ``token_rtol`` and ``rtol = row_rtol``. For a quantized projection the format sets an upper limit:
one code off by one moves one output by ``scale x |x_j|``; both are kept below half of that move over
typical inputs and outputs, so that a single wrong code still fails.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from vllm_parity.architectures import Architecture
from vllm_parity.harness.dumps import DumpReader
from vllm_parity.harness.metrics import row_scale, spread
from vllm_parity.harness.tolerances import ToleranceTable
from vllm_parity.reference.checkpoint import Checkpoint

FLOOR = 1e-6  # no tolerance tighter than this (about 16 fp32 roundings): exact taps stay judgeable
VARIANTS = {
    "fp64": "the reference in fp64",
    "sdpa": "the reference with sdpa attention",
    "reversed": "the reference with every linear summed in reverse input order",
}
# A candidate served in half precision: its noise floor is that of the reference computed in that dtype.
SERVING_VARIANTS = {"bfloat16": "the reference in bf16 (the candidate's dtype)",
                    "float16": "the reference in fp16 (the candidate's dtype)"}


def variants_for(dtype: str) -> list[str]:
    """The reference variants a calibration in ``dtype`` runs: the fp32 ones, and the serving dtype's own."""
    return [*VARIANTS, *([dtype] if dtype in SERVING_VARIANTS else [])]


@contextlib.contextmanager
def reversed_summation():
    """Every ``F.linear`` (the reference's linears and nn.Linear) sums its input features in reverse
    order: mathematically the same product, rounded another way."""
    plain = F.linear

    def linear(x, weight, bias=None):
        return plain(x.flip(-1), weight.flip(-1), bias)

    F.linear = linear
    try:
        yield
    finally:
        F.linear = plain


def format_cap(ckpt: Checkpoint, arch: Architecture, reference: DumpReader, tap: str) -> tuple[float, float] | None:
    """(token_rtol, row_rtol) at half the output change of one code off by one, for the projection
    behind an op tap."""
    projection = arch.projection(tap, ckpt.linear_shapes())
    if projection is None or ckpt.spec is None:
        return None
    module, input_tap = projection
    spec = ckpt.spec
    if spec.is_ignored(module):
        return None
    step = spec.code_step(ckpt, module)
    x = reference.stacked(input_tap)[0].double().abs()
    x = x[x > 0] if bool((x > 0).any()) else x  # a zero input (most of them behind relu²) moves no code
    move = float(torch.quantile(step.flatten(), 0.1)) * float(x.median())  # one code off by one
    y = reference.stacked(tap)[0].double()
    s = row_scale(y)
    per_element = float((y.abs() + s).median())
    per_token = float(s.median()) * math.sqrt(y.shape[1])
    return 0.5 * move / per_token, 0.5 * move / per_element


def calibrate(ckpt: Checkpoint, arch: Architecture, taps: list[str], ref32: DumpReader, variants: dict[str, DumpReader],
              cand_a: DumpReader, cand_b: DumpReader, headroom: float = 10.0,
              max_growth: float = 10.0) -> tuple[ToleranceTable, dict]:
    """A tolerance table with one exact rule per tap, and the measurements behind it."""
    rules, notes = [], {}
    for tap in taps:
        ref = ref32.stacked(tap)[0]
        measured = {name: spread(ref, dump.stacked(tap)[0]) for name, dump in variants.items()}
        measured["candidate_vs_itself"] = spread(cand_a.stacked(tap)[0], cand_b.stacked(tap)[0])
        token = max(FLOOR, *(t for t, _ in measured.values()))
        element = max(FLOOR, *(e for _, e in measured.values()))
        token_rtol, row_rtol = headroom * token, headroom * element
        cap = format_cap(ckpt, arch, ref32, tap)
        # correct implementations differing by more than one code step (activation codes flipped by their
        # rounding noise) leave the cap unreachable: the measured spread wins
        above = cap is not None and (token > cap[0] or element > cap[1])
        capped = cap is not None and not above and (token_rtol > cap[0] or row_rtol > cap[1])
        if capped:
            token_rtol, row_rtol = min(token_rtol, cap[0]), min(row_rtol, cap[1])
        row_rtol = float(f"{row_rtol:.3g}")
        rules.append((tap, {"token_rtol": float(f"{token_rtol:.3g}"), "row_rtol": row_rtol, "rtol": row_rtol,
                            "atol": 0.0}))
        notes[tap] = {"spread": {k: {"token_rel": t, "element": e} for k, (t, e) in measured.items()},
                      "widest": max(measured, key=lambda k: measured[k][0]),
                      "format_cap": None if cap is None else {"token_rtol": cap[0], "row_rtol": cap[1]},
                      "capped": capped, "spread_above_cap": above, "token_rtol": token_rtol, "row_rtol": row_rtol}
    return ToleranceTable(rules=rules, max_growth=max_growth, source="calibrated"), notes


def write(table: ToleranceTable, notes: dict, path: str | Path, headroom: float) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    used = {**VARIANTS, **SERVING_VARIANTS}
    ran = sorted({k for n in notes.values() for k in n["spread"] if k in used}, key=list(used).index)
    lines = ["# Calibrated by `pytest --parity-calibrate`: per tap, headroom x the widest spread between",
             "# correct implementations (" + "; ".join(used[k] for k in ran) + "; the candidate against itself),",
             f"# headroom {headroom:g}: token_rtol from the per-token relative error, rtol = row_rtol from the",
             "# element error relative to |r| + rms(row); quantized projections capped at half the output",
             "# change of one code off by one.", ""]
    for line in table.to_toml().splitlines():
        lines.append(line)
        tap = line.split('"')[1] if line.startswith('"') else None
        if tap:
            n = notes[tap]
            lines[-1] += f"  # widest: {n['widest']}" + (" (capped by the format)" if n["capped"] else "")
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(path)
    return path
