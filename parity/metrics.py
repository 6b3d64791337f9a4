"""Comparison metrics of one tap: candidate against reference, as plain data.

Every metric is computed in float64. NaN or Inf in the candidate where the reference is finite fails
the tap whatever the tolerance says.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class Tolerance:
    """An element passes when ``|c - r| <= atol + rtol * |r|``; a tap when at most
    ``max_mismatch_frac`` of its elements fail and its cosine similarity is at least ``min_cosine``."""

    atol: float
    rtol: float = 0.0
    max_mismatch_frac: float = 0.0
    min_cosine: float = -1.0

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Metrics:
    max_abs: float
    max_rel: float
    mean_abs: float
    cosine: float
    sqnr_db: float
    mismatch_frac: float
    nonfinite: int  # elements non-finite in the candidate but finite in the reference
    worst_index: tuple[int, ...]
    worst_ref: float
    worst_cand: float
    min_atol: float  # the smallest atol (at this rtol) under which every element would pass
    numel: int

    def as_dict(self) -> dict:
        d = asdict(self)
        d["worst_index"] = list(self.worst_index)
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}


class ShapeMismatch(ValueError):
    pass


def compare(ref: torch.Tensor, cand: torch.Tensor, tol: Tolerance) -> Metrics:
    if tuple(ref.shape) != tuple(cand.shape):
        raise ShapeMismatch(f"shapes differ: reference {tuple(ref.shape)}, candidate {tuple(cand.shape)}")
    r = ref.detach().to(torch.float64).reshape(-1)
    c = cand.detach().to(torch.float64).reshape(-1)
    n = r.numel()
    if n == 0:
        return Metrics(0.0, 0.0, 0.0, 1.0, math.inf, 0.0, 0, (), 0.0, 0.0, 0.0, 0)
    ref_finite = torch.isfinite(r)
    bad = ref_finite & ~torch.isfinite(c)
    nonfinite = int(bad.sum())
    diff = (c - r).abs()
    diff = torch.where(bad, torch.full_like(diff, math.inf), diff)
    diff = torch.where(ref_finite, diff, torch.zeros_like(diff))  # the reference's own non-finite: not judged
    allowed = tol.atol + tol.rtol * r.abs()
    mismatch = diff > allowed
    flat = int(torch.argmax(torch.where(mismatch, diff - allowed, diff) if bool(mismatch.any()) else diff))
    worst_index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), tuple(ref.shape)))
    rel = diff / r.abs().clamp(min=1e-12)
    finite_r, finite_c = torch.where(ref_finite, r, 0), torch.where(torch.isfinite(c), c, 0)
    dot = float((finite_r * finite_c).sum())
    norms = float(finite_r.norm() * finite_c.norm())
    cosine = dot / norms if norms > 0 else (1.0 if float(finite_r.norm()) == float(finite_c.norm()) else 0.0)
    noise = float(((finite_c - finite_r) ** 2).sum())
    signal = float((finite_r ** 2).sum())
    sqnr = math.inf if noise == 0 else (10 * math.log10(signal / noise) if signal > 0 else -math.inf)
    if nonfinite:
        cosine, sqnr = float("nan"), -math.inf
    return Metrics(
        max_abs=float(diff.max()), max_rel=float(rel.max()), mean_abs=float(diff.mean()),
        cosine=cosine, sqnr_db=sqnr, mismatch_frac=float(mismatch.double().mean()), nonfinite=nonfinite,
        worst_index=worst_index, worst_ref=float(r[flat]), worst_cand=float(c[flat]),
        min_atol=float((diff - tol.rtol * r.abs()).clamp(min=0).max()), numel=n,
    )


def passes(m: Metrics, tol: Tolerance) -> bool:
    if m.nonfinite:
        return False
    return m.mismatch_frac <= tol.max_mismatch_frac and (m.cosine >= tol.min_cosine or m.numel == 0)


def describe(name: str, m: Metrics, tol: Tolerance) -> str:
    """One line in the manner of torch.testing.assert_close: the worst element, its index, both values."""
    if m.nonfinite:
        head = f"{name}: {m.nonfinite} non-finite candidate element(s) where the reference is finite"
    else:
        head = f"{name}: {m.mismatch_frac:.2%} of {m.numel} elements outside atol={tol.atol:g} rtol={tol.rtol:g}"
    return (f"{head}; worst at {m.worst_index}: reference {m.worst_ref:.6g}, candidate {m.worst_cand:.6g} "
            f"(max_abs {m.max_abs:.3g}, cosine {m.cosine:.6f}, sqnr {m.sqnr_db:.1f} dB, "
            f"min passing atol {m.min_atol:.3g})")
