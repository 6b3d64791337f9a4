"""Comparison metrics of one tap: candidate against reference, as plain data.

A tap is a stack of token rows ``(tokens, features)``. The error of a correct implementation scales
with the size of each token's row (real models carry massive activations: a few residual features
thousands of times larger than the rest), so the criteria are relative to each row's scale
``s_t = rms(r_t)``:

- per token: the relative error ``||c_t - r_t|| / ||r_t||`` of every row is at most ``token_rtol``
  (the primary criterion: the inverse square root of the row's SQNR);
- per element: ``|c - r| <= atol + rtol * |r| + row_rtol * s_t`` for all but ``max_mismatch_frac``
  of the elements, so that one wrong output channel still fails;
- ``cosine >= min_cosine``.

Every metric is computed in float64. NaN or Inf in the candidate where the reference is finite fails
the tap whatever the tolerance says.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

import torch

ROW_SCALE_FLOOR = 1e-3  # a row's scale is at least this fraction of the tap's rms: all-zero rows stay judgeable


@dataclass(frozen=True)
class Tolerance:
    """An element passes when ``|c - r| <= atol + rtol * |r| + row_rtol * rms(r_row)``; a tap when
    every row's relative error is at most ``token_rtol``, at most ``max_mismatch_frac`` of its elements
    fail, and its cosine similarity is at least ``min_cosine``."""

    atol: float = 0.0
    rtol: float = 0.0
    row_rtol: float = 0.0
    token_rtol: float = math.inf
    max_mismatch_frac: float = 0.0
    min_cosine: float = -1.0

    def as_dict(self) -> dict:
        return {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, d: dict) -> Tolerance:
        """Inverse of :meth:`as_dict` (None is an unbounded criterion)."""
        return cls(**{f.name: math.inf if d.get(f.name, 0) is None else d.get(f.name, f.default) for f in fields(cls)})

    @property
    def elementwise_only(self) -> bool:
        """Judged as before per-token criteria existed: elements against atol + rtol |r| alone."""
        return self.row_rtol == 0 and math.isinf(self.token_rtol)


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
    min_atol: float  # the smallest atol (at this rtol and row_rtol) under which every element would pass
    numel: int
    token_rel: float = 0.0  # the largest per-token relative error ||c_t - r_t|| / ||r_t||
    worst_token: int = 0  # the row where it is
    min_row_rtol: float = 0.0  # the smallest row_rtol (at this atol and rtol) under which every element passes
    margin: float = math.inf  # how many times the error may grow before the tap fails (< 1: it fails)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["worst_index"] = list(self.worst_index)
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}

    @classmethod
    def from_dict(cls, d: dict) -> Metrics:
        """Inverse of :meth:`as_dict` up to the kind of a non-finite value (None: an unbounded margin, any
        other field not a number)."""
        values = {f.name: d[f.name] for f in fields(cls)}
        for name, v in values.items():
            if v is None:
                values[name] = math.inf if name == "margin" else math.nan
        values["worst_index"] = tuple(values["worst_index"])
        return cls(**values)


class ShapeMismatch(ValueError):
    pass


def rows_of(t: torch.Tensor) -> torch.Tensor:
    """``(tokens, features)``: the last axis is the features, every other axis a token row."""
    return t.reshape(1, -1) if t.dim() < 2 else t.reshape(-1, t.shape[-1])


def row_scale(r: torch.Tensor) -> torch.Tensor:
    """``(tokens, 1)``: each row's rms, at least ROW_SCALE_FLOOR of the whole tensor's."""
    scale = r.pow(2).mean(dim=1, keepdim=True).sqrt()
    return scale.clamp(min=max(ROW_SCALE_FLOOR * float(r.pow(2).mean().sqrt()), 1e-30))


def spread(ref: torch.Tensor, other: torch.Tensor) -> tuple[float, float]:
    """(largest token relative error, largest ``|d| / (|r| + rms(row))``) of two finite tensors: the
    smallest ``token_rtol`` and ``rtol = row_rtol`` under which ``other`` passes against ``ref``."""
    r, o = rows_of(ref.detach().double()), rows_of(other.detach().double())
    scale = row_scale(r)
    d = (o - r).abs()
    token = d.pow(2).sum(dim=1).sqrt() / (scale.squeeze(1) * math.sqrt(r.shape[1]))
    return float(token.max()), float((d / (r.abs() + scale)).max())


def compare(ref: torch.Tensor, cand: torch.Tensor, tol: Tolerance) -> Metrics:
    if tuple(ref.shape) != tuple(cand.shape):
        raise ShapeMismatch(f"shapes differ: reference {tuple(ref.shape)}, candidate {tuple(cand.shape)}")
    r = rows_of(ref.detach().to(torch.float64))
    c = rows_of(cand.detach().to(torch.float64))
    n = r.numel()
    if n == 0:
        return Metrics(0.0, 0.0, 0.0, 1.0, math.inf, 0.0, 0, (), 0.0, 0.0, 0.0, 0)
    ref_finite = torch.isfinite(r)
    bad = ref_finite & ~torch.isfinite(c)
    nonfinite = int(bad.sum())
    diff = (c - r).abs()
    diff = torch.where(bad, torch.full_like(diff, math.inf), diff)
    diff = torch.where(ref_finite, diff, torch.zeros_like(diff))  # the reference's own non-finite: not judged
    finite_r, finite_c = torch.where(ref_finite, r, 0), torch.where(torch.isfinite(c), c, 0)
    scale = row_scale(finite_r)
    token = diff.pow(2).sum(dim=1).sqrt() / (scale.squeeze(1) * math.sqrt(r.shape[1]))
    allowed = tol.atol + tol.rtol * r.abs() + tol.row_rtol * scale
    mismatch = diff > allowed
    if bool(mismatch.any()):
        flat = int(torch.argmax(torch.where(mismatch, diff - allowed, torch.full_like(diff, -math.inf))))
    else:
        used = torch.where(allowed > 0, diff / allowed.clamp(min=1e-300), diff)
        flat = int(torch.argmax(used))
    worst_index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), tuple(ref.shape)))
    rel = diff / r.abs().clamp(min=1e-12)
    dot = float((finite_r * finite_c).sum())
    norms = float(finite_r.norm() * finite_c.norm())
    cosine = dot / norms if norms > 0 else (1.0 if float(finite_r.norm()) == float(finite_c.norm()) else 0.0)
    noise = float(((finite_c - finite_r) ** 2).sum())
    signal = float((finite_r ** 2).sum())
    sqnr = math.inf if noise == 0 else (10 * math.log10(signal / noise) if signal > 0 else -math.inf)
    if nonfinite:
        cosine, sqnr = float("nan"), -math.inf
    token_rel = float(token.max())
    return Metrics(
        max_abs=float(diff.max()), max_rel=float(rel.max()), mean_abs=float(diff.mean()),
        cosine=cosine, sqnr_db=sqnr, mismatch_frac=float(mismatch.double().mean()), nonfinite=nonfinite,
        worst_index=worst_index, worst_ref=float(r.reshape(-1)[flat]), worst_cand=float(c.reshape(-1)[flat]),
        min_atol=float((diff - tol.rtol * r.abs() - tol.row_rtol * scale).clamp(min=0).max()), numel=n,
        token_rel=token_rel, worst_token=int(token.argmax()),
        min_row_rtol=float(((diff - tol.atol - tol.rtol * r.abs()).clamp(min=0) / scale).max()),
        margin=_margin(diff, allowed, token_rel, tol),
    )


def _margin(diff: torch.Tensor, allowed: torch.Tensor, token_rel: float, tol: Tolerance) -> float:
    """The factor by which every error could grow before the tap fails: the smaller of the token
    criterion's and the element criterion's (the latter at ``max_mismatch_frac``)."""
    margins = []
    if math.isfinite(tol.token_rtol):
        margins.append(tol.token_rtol / token_rel if token_rel > 0 else math.inf)
    flat_diff, flat_allowed = diff.reshape(-1), allowed.reshape(-1)
    ratio = torch.where(flat_diff > 0, flat_allowed / flat_diff.clamp(min=1e-300),
                        torch.full_like(flat_diff, math.inf))
    k = int(tol.max_mismatch_frac * ratio.numel()) + 1  # the element that would be one too many
    margins.append(float(torch.kthvalue(ratio, min(k, ratio.numel())).values))
    return min(margins)


def passes(m: Metrics, tol: Tolerance) -> bool:
    if m.nonfinite:
        return False
    return (m.token_rel <= tol.token_rtol and m.mismatch_frac <= tol.max_mismatch_frac
            and (m.cosine >= tol.min_cosine or m.numel == 0))


def describe(name: str, m: Metrics, tol: Tolerance, row: str | None = None) -> str:
    """One line in the manner of torch.testing.assert_close: the worst element, its index, both values."""
    if m.nonfinite:
        head = f"{name}: {m.nonfinite} non-finite candidate element(s) where the reference is finite"
    elif m.token_rel > tol.token_rtol:
        head = (f"{name}: token relative error {m.token_rel:.3g} above token_rtol={tol.token_rtol:g} "
                f"({row or f'row {m.worst_token}'}); {m.mismatch_frac:.2%} of {m.numel} elements outside the element bound")
    else:
        head = f"{name}: {m.mismatch_frac:.2%} of {m.numel} elements outside {element_bound(tol)}"
    least = (f"min passing atol {m.min_atol:.3g}" if tol.elementwise_only else
             f"token rel {m.token_rel:.3g}, min passing row_rtol {m.min_row_rtol:.3g}")
    return (f"{head}; worst at {m.worst_index}: reference {m.worst_ref:.6g}, candidate {m.worst_cand:.6g} "
            f"(max_abs {m.max_abs:.3g}, cosine {m.cosine:.6f}, sqnr {m.sqnr_db:.1f} dB, {least})")


def element_bound(tol: Tolerance) -> str:
    if tol.elementwise_only:
        return f"atol={tol.atol:g} rtol={tol.rtol:g}"
    return f"atol={tol.atol:g} + rtol={tol.rtol:g}·|r| + row_rtol={tol.row_rtol:g}·rms(row)"
