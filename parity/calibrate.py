"""Measured tolerances: each tap's noise floor, with headroom, capped by what the format can resolve.

The noise floor of a tap is the larger of
- the reference's own rounding: the fp32 reference against the same reference in fp64, and
- the candidate's nondeterminism: the candidate against itself over two runs.
Times ``headroom`` it becomes the tap's atol. For a quantized projection the format sets an upper
limit: one code off by one moves one output by ``scale x |x_j|``; the tolerance is kept below half the
smallest such move over the typical input, so that a single wrong code still fails.
"""

from __future__ import annotations

from pathlib import Path

import torch

from parity.dumps import DumpReader
from parity.taps import PROJECTION_OF
from parity.tolerances import ToleranceTable
from references.checkpoint import Checkpoint
from references.formats import Int8xSpec, TernarySpec
from references.int8x import scale_of



def _max_abs(a: DumpReader, b: DumpReader, tap: str) -> tuple[float, float]:
    """(max |a - b|, max |a|) over every prompt of a tap."""
    diff = mag = 0.0
    for p in a.prompts(tap):
        x, y = a.get(tap, p).double(), b.get(tap, p).double()
        diff = max(diff, float((x - y).abs().max()))
        mag = max(mag, float(x.abs().max()))
    return diff, mag


def format_cap(ckpt: Checkpoint, reference: DumpReader, tap: str) -> float | None:
    """Half the output change of one code off by one, for the projection behind an op tap."""
    parts = tap.split(".", 2)
    if len(parts) < 3 or parts[0] != "layers" or parts[2] not in PROJECTION_OF or ckpt.spec is None:
        return None
    module_suffix, input_tap = PROJECTION_OF[parts[2]]
    module = f"model.layers.{parts[1]}.{module_suffix}"
    spec = ckpt.spec
    if spec.is_ignored(module):
        return None
    if isinstance(spec, TernarySpec):
        s = ckpt.tensor(f"{module}.{spec.scale_name}").double().abs()
        step = s if spec.scale_mode == "multiply" else 1.0 / s
    elif isinstance(spec, Int8xSpec):
        step = torch.tensor([abs(scale_of({"weight_scale": ckpt.tensor(f"{module}.weight_scale")}, module))],
                            dtype=torch.float64)
    else:
        return None
    source = f"layers.{parts[1]}.{input_tap}"
    x = torch.cat([reference.get(source, p) for p in reference.prompts(source)]).double().abs()
    typical_x = float(x.median())
    return 0.5 * float(torch.quantile(step.flatten(), 0.1)) * typical_x


def calibrate(ckpt: Checkpoint, taps: list[str], ref32: DumpReader, ref64: DumpReader, cand_a: DumpReader,
              cand_b: DumpReader, headroom: float = 10.0, max_growth: float = 10.0) -> tuple[ToleranceTable, dict]:
    """A tolerance table with one exact rule per tap, and the measurements behind it."""
    rules, notes = [], {}
    for tap in taps:
        ref_noise, mag = _max_abs(ref64, ref32, tap)
        cand_noise, _ = _max_abs(cand_a, cand_b, tap)
        floor = max(ref_noise, cand_noise, 1e-7 * mag, 1e-12)
        atol = headroom * floor
        cap = format_cap(ckpt, ref32, tap)
        capped = cap is not None and atol > cap
        if capped:
            atol = cap
        rules.append((tap, {"atol": float(f"{atol:.3g}"), "rtol": 0.0}))
        notes[tap] = {"reference_fp32_vs_fp64": ref_noise, "candidate_vs_itself": cand_noise, "magnitude": mag,
                      "format_cap": cap, "capped": capped, "atol": atol}
    return ToleranceTable(rules=rules, max_growth=max_growth, source="calibrated"), notes


def write(table: ToleranceTable, notes: dict, path: str | Path, headroom: float) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = ["# Calibrated by `pytest --parity-calibrate`: atol = headroom x max(fp32-vs-fp64 noise of the",
             f"# reference, candidate-vs-itself noise), headroom {headroom:g}; quantized projections capped at",
             "# half the output change of one code off by one.", ""]
    body = table.to_toml().splitlines()
    for line in body:
        lines.append(line)
        tap = line.split('"')[1] if line.startswith('"') else None
        if tap and notes[tap]["capped"]:
            noise = max(notes[tap]["reference_fp32_vs_fp64"], notes[tap]["candidate_vs_itself"])
            lines[-1] += f"  # capped by the format (noise x headroom: {headroom * noise:.3g})"
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(path)
    return path

