"""Numbers of the inspection: per-tensor statistics, decoded vs float weights, and the report's plain data."""

from __future__ import annotations

import math
import re
from typing import Any

import torch

FEW = 16  # distinct values listed up to this many

# byte value -> how many of its four 2-bit fields hold code c (the same for every layout and bit order)
_BYTE = torch.arange(256)
_CODES_PER_BYTE = torch.stack(
    [sum(((_BYTE >> (2 * f)) & 3 == c).long() for f in range(4)) for c in range(4)], dim=1)


def _few_distinct(flat: torch.Tensor) -> list | None:
    """The distinct values when there are at most FEW, else None; stops early on large tensors."""
    head = torch.unique(flat[:4096])
    if head.numel() > FEW:
        return None
    if bool(torch.isin(flat, head).all()):
        return head.tolist()
    seen = head
    step = 1 << 20
    for i in range(0, flat.numel(), step):
        seen = torch.unique(torch.cat([seen, torch.unique(flat[i:i + step])]))
        if seen.numel() > FEW:
            return None
    return seen.tolist()


def tensor_stats(t: torch.Tensor) -> dict[str, Any]:
    """Range, distinct values (when few), non-finite count and, for uint8, the 2-bit code histogram."""
    out: dict[str, Any] = {"min": None, "max": None, "distinct": None, "nonfinite": 0, "code_histogram": None}
    if t.numel() == 0:
        out["distinct"] = []
        return out
    flat = t.reshape(-1)
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):  # its values exactly, in a dtype torch reduces
        flat = flat.to(torch.float32)
    if t.dtype == torch.uint8:
        counts = torch.bincount(flat, minlength=256)
        present = counts.nonzero().flatten()
        out["min"], out["max"] = int(present[0]), int(present[-1])
        out["distinct"] = present.tolist() if present.numel() <= FEW else None
        out["code_histogram"] = (counts[:, None] * _CODES_PER_BYTE).sum(0).tolist()
        return out
    if t.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    if flat.dtype.is_floating_point:
        finite = torch.isfinite(flat)
        out["nonfinite"] = int(flat.numel() - int(finite.sum()))
        if out["nonfinite"]:
            flat = flat[finite]
            if flat.numel() == 0:
                return out
    lo, hi = torch.aminmax(flat)
    out["min"], out["max"] = lo.item(), hi.item()
    out["distinct"] = _few_distinct(flat)
    return out


def compare(decoded: torch.Tensor, w: torch.Tensor) -> dict[str, Any]:
    """Decoded weights, rounded to W's dtype, vs W: equal up to that dtype's rounding.

    Errors are measured after the rounding, so a decoder that matches the producer bit for bit
    reports 0; a producer that rounded differently (fp64 products, reciprocal scales) stays within
    ``tolerance_ratio <= 1`` (two units of rounding).
    """
    dq = decoded.to(w.dtype)
    if dq.shape == w.shape and torch.equal(dq, w):  # the common case, in two passes
        return {"max_abs_error": 0.0, "tolerance_ratio": 0.0, "mismatches": 0, "exact": True, "worst": None}
    if dq.shape != w.shape:
        return {"max_abs_error": None, "exact": False,
                "error": f"decoded shape {tuple(dq.shape)} != float shape {tuple(w.shape)}"}
    wide = torch.float64 if w.dtype == torch.float64 else torch.float32
    wf = w.to(wide)
    diff = dq.to(wide).sub_(wf).abs_()
    fi = torch.finfo(w.dtype)
    ratio = diff / wf.abs().mul_(2 * fi.eps).add_(fi.tiny)
    n_bad = int((~(ratio <= 1)).sum())  # NaN counts as bad
    worst = int(torch.nan_to_num(diff, nan=math.inf).argmax())
    idx = [worst // w.shape[1], worst % w.shape[1]] if w.dim() == 2 else [worst]
    return {
        "max_abs_error": float(diff.max()), "tolerance_ratio": float(ratio.max()), "mismatches": n_bad,
        "exact": n_bad == 0,
        "worst": {"index": idx, "decoded": float(dq.reshape(-1)[worst]), "float": float(wf.reshape(-1)[worst])},
    }


def decode_dtype(w: torch.Tensor) -> torch.dtype:
    """The dtype to decode in before comparing with the float weights ``w``."""
    return torch.float64 if w.dtype == torch.float64 else torch.float32


def natural_sorted(names) -> list[str]:
    """Names in layer order (layers.2 before layers.10)."""
    return sorted(names, key=lambda s: [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", s)])


def show(value: Any) -> str:
    return repr(list(value)) if isinstance(value, tuple) else repr(value)


def jsonable(x: Any) -> Any:
    """Tuples to lists; NaN / inf to strings (strict JSON has no spelling for them)."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    return x
