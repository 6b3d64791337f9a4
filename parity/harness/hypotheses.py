"""Weight-side hypotheses of a projection tap that no format owns: its float bias missing, doubled or another
one; its activations quantized another way than the format says; its group scales applied to other groups,
the order recovered from the candidate itself. Each returns :class:`~vllm_parity.harness.diagnosis._Hyp`\\ s
that :class:`~vllm_parity.harness.diagnosis.WeightProjection` screens and scores like its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_parity.harness.diagnosis import SCREEN_ROWS, _g, _Hyp, _pct, _runs, _sample
from vllm_parity.reference.linear import FP8_MAX

MATCH_SCALE = 1e-2  # a fitted group scale is a stored one within this relative difference
LISTED = 8  # runs of channels (or moved groups) named in an evidence line, the rest counted


# -- the bias ---------------------------------------------------------------------------------------


def bias(p) -> list[_Hyp]:
    """The candidate as the reference plus a vector on every row: the bias missing, added twice, or another
    projection's of the same layer in its place."""
    b = p.bias
    if b is None or not float(b.abs().max()) > 0:
        return []
    fix = f"add {p.module}'s own bias ({p.module}.bias, {b.numel()} values) once, after the product"
    out = [_Hyp("bias", f"candidate ≡ reference − bias on every row: the bias of {p.module} "
                        f"(norm {_g(float(b.norm()))}) never added", fix, offset=-b),
           _Hyp("bias", f"candidate ≡ reference + bias on every row: the bias of {p.module} added twice (in the "
                        f"kernel and again after it)", fix, offset=b.clone())]
    for module, other in sorted(p.other_biases.items()):
        if other.shape == b.shape and not torch.equal(other, b):
            out.append(_Hyp("bias", f"candidate ≡ reference − bias + the bias of {module} on every row: "
                                    f"{p.module} adds {module}'s bias instead of its own", fix, offset=other - b))
    return out


def fitted_offset(p, channels: torch.Tensor) -> _Hyp | None:
    """The candidate as the reference plus its own mean offset per channel, when the deviating channels deviate
    by the same vector on every row: what bias the candidate added, read against the reference's."""
    rows = p.ref.shape[0]
    if rows < 4:
        return None  # too few rows to tell a constant from an error of the product
    d = torch.zeros(p.n, dtype=torch.float64)
    d[channels] = (p.cand[:, channels] - p.ref[:, channels]).mean(0)
    if not bool(torch.isfinite(d).all()):
        return None
    b = p.bias if p.bias is not None else torch.zeros(p.n, dtype=torch.float64)
    used = b + d  # the bias the candidate added
    scale = max(float(b.abs().max()), float(used.abs().max()), 1e-30)
    tol = 1e-3 * scale
    off = channels[(d[channels].abs() > tol)]
    if not len(off):
        return None
    what, fix = _offset_reading(p, b, used, off, channels, tol)
    return _Hyp("bias", what, fix, offset=d)


def _offset_reading(p, b, used, off, channels, tol) -> tuple[str, str]:
    fix = f"add {p.module}'s own bias ({p.module}.bias) once, to the output channel it belongs to"
    head = f"candidate ≡ reference + a vector on every row, on {_pct(len(off), len(channels))} channels"
    if p.bias is None:
        return (f"{head} (norm {_g(float(used.norm()))}, channels {_listed(off)}): a bias {p.module} does not have",
                f"{p.module} has no bias in the checkpoint: drop the one its kernel adds")
    zero = off[used[off].abs() <= tol]
    if len(zero) == len(off):
        return f"{head}: the bias missing on channels {_listed(off)}", fix
    # a permutation of the true bias: each channel's added value found among the stored ones
    src = (used[channels, None] - b[None, :]).abs().argmin(1)  # (every channel: a value equal by chance moves too)
    if bool(((used[channels] - b[src]).abs() <= tol).all()):
        moved = channels[src != channels]
        shifts = (src - channels)[src != channels]
        runs, parts = [], []
        for s in sorted(set(shifts.tolist())):
            mask = torch.zeros(p.n, dtype=torch.bool)
            mask[moved[shifts == s]] = True
            runs += [(a, e, s) for a, e in _runs(mask)]
        runs.sort()
        parts = [f"{a}..{e} ← {a + s}..{e + s}" if a != e else f"{a} ← {a + s}" for a, e, s in runs[:LISTED]]
        more = f", … ({len(runs)} runs)" if len(runs) > LISTED else ""
        return (f"{head}: the bias applied to the wrong channels, each channel adding the bias of another "
                f"(channel ← bias of channel: {', '.join(parts)}{more})",
                f"{fix}: the bias of {p.module} is permuted (a sharded or fused bias loaded in another order)")
    return (f"{head} (channels {_listed(off)}), of norm {_g(float((used - b)[off].norm()))} against the bias's "
            f"{_g(float(b.norm()))}: the bias the candidate added is not {p.module}'s", fix)


def _listed(idx: torch.Tensor) -> str:
    mask = torch.zeros(int(idx.max()) + 1, dtype=torch.bool)
    mask[idx] = True
    runs = _runs(mask)
    s = ", ".join(f"{a}..{e}" if a != e else f"{a}" for a, e in runs[:LISTED])
    return s + (f", … ({len(runs)} runs)" if len(runs) > LISTED else "")


# -- the activation quantizer -----------------------------------------------------------------------


def _int8(num: float, lo: int, per_token: bool = True):
    def quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        amax = x.abs().amax(dim=-1, keepdim=True) if per_token else x.abs().amax().expand(x.shape[0], 1)
        s = num / amax.clamp(min=1e-5)
        return (x * s).round().clamp(lo, 127), s
    return quant


def _fp8_per_tensor(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (x.abs().amax() / FP8_MAX).clamp(min=1.0 / (FP8_MAX * 512.0))
    inverse = scale.reciprocal().expand(x.shape[0], 1)
    return (x * inverse).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(x.dtype), inverse


def _none(x: torch.Tensor) -> tuple[torch.Tensor, None]:
    return x, None


# What each quantizer is said as, and the other quantizers a kernel may use in its place.
SAID = {"per_token_absmax_int8": "s = 127 / max|x| per token, rounded, clamped to [-128, 127] (vLLM's dynamic int8)",
        "per_token_absmax_fp8_e4m3": "s = 448 / max|x| per token, rounded to float8 e4m3 (vLLM's dynamic FP8)"}
OTHERS = {
    "per_token_absmax_int8": [
        ("s = 127.5 / max|x| per token, clamped to [-128, 127] (compressed-tensors' fake quantization)",
         _int8(127.5, -128)),
        ("s = 127.5 / max|x| per token, clamped to [-127, 127]", _int8(127.5, -127)),
        ("s = 127 / max|x| over the whole tensor (per-tensor, not per token)", _int8(127.0, -128, per_token=False)),
        ("not quantized at all (the float input)", _none)],
    "per_token_absmax_fp8_e4m3": [
        ("s = 448 / max|x| over the whole tensor (per-tensor fp8, not per token)", _fp8_per_tensor),
        ("not quantized at all (the float input)", _none)],
}


def activation(p) -> list[_Hyp]:
    """The reference's weight applied to the reference's input quantized by another activation quantizer."""
    if p.quant not in OTHERS or p.x_raw is None:
        return []
    out = []
    for said, quant in OTHERS[p.quant]:
        out.append(_Hyp("activation_quant",
                        f"the input of {p.module} quantized with {said} instead of {SAID[p.quant]}",
                        f"quantize {p.module}'s input as the format says ({p.quant}: {SAID[p.quant]}) in its kernel",
                        output=_requantized(p, quant)))
    return out


def _requantized(p, quant):
    cache: list = []

    def output(idx: torch.Tensor, rsel: torch.Tensor) -> torch.Tensor:
        if not cache:
            cache.append(quant(p.x_raw))  # over every row: a per-tensor scale sees them all
        xq, s = cache[0]
        y = F.linear(xq[rsel], p.weight()[idx]).to(torch.float64)
        return y if s is None else y / s[rsel].to(torch.float64)
    return output


# -- group scales in another order ------------------------------------------------------------------


def regrouped(p, idx: torch.Tensor, rsel: torch.Tensor) -> list[_Hyp]:
    """The scales the candidate applied, per (channel, group), fitted by least squares (the output of a channel
    is linear in its groups' scales: y = Σ_g s_g · (x_g · c_g)), then found among the stored scales: which
    group's scale each group read. Only an order that holds for most sampled channels becomes a hypothesis."""
    unscaled = getattr(p, "_unscaled", None)
    if p.granularity != "group" or unscaled is None or p.x is None or p.scale.dim() != 2:
        return []
    groups = p.scale.shape[1]
    if groups < 2 or p.k % groups:
        return []
    size = p.k // groups
    rows = _sample(p.ref.shape[0], max(SCREEN_ROWS, 4 * groups))
    v = unscaled(idx)
    if v is None or len(rows) < groups + 2:
        return []
    v = v.to(torch.float64).reshape(len(idx), groups, size)
    x = p.x[rows].to(torch.float64).reshape(len(rows), groups, size)
    parts = torch.einsum("rgk,cgk->crg", x, v)  # (channels, rows, groups): each group's product before its scale
    if p.post is not None:
        parts = parts / p.post[rows].to(torch.float64).reshape(1, -1, 1)
    y = p.cand[rows][:, idx] - (p.bias[idx] if p.bias is not None else 0.0)
    live = torch.isfinite(y).all(0)
    if int(live.sum()) < 0.5 * len(idx):
        return []
    fitted = torch.linalg.lstsq(parts[live], y[:, live].t().unsqueeze(-1)).solution.squeeze(-1)  # (C', groups)
    stored = p.scale[idx][live].to(torch.float64)
    target = stored if p.scale_mode == "multiply" else 1.0 / stored  # what multiplies a group's product
    rel = (fitted[:, :, None] - target[:, None, :]).abs() / target[:, None, :].abs().clamp_min(1e-300)
    best_rel, read = rel.min(-1)
    matched = (best_rel <= MATCH_SCALE).all(1)
    ident = torch.arange(groups)
    if not bool(matched.any()):
        p.checked.append(("scale_groups", 1.0))  # no order of the stored scales fits: the stored order is best
        return []
    orders, counts = torch.unique(read[matched], dim=0, return_counts=True)
    order = orders[counts.argmax()]
    known = [ident, *(ident // m for m in range(2, groups + 1)), *getattr(p, "known_orders", [])]
    if any(torch.equal(order, k) for k in known):
        return []  # the stored order, a wider group size, or an order the format's own hypotheses name
    holds = int(counts.max())
    fit = torch.einsum("crg,cg->cr", parts[live], fitted).t()
    dev = float((p.cand[rows][:, idx][:, live] - p.ref[rows][:, idx][:, live]).norm())
    residual = float((y[:, live] - fit).norm()) / dev if dev > 0 else float("inf")
    what = (f"the group scales applied to the wrong groups: {describe_order(order)} — the scales the candidate "
            f"applied, fitted per channel and group by least squares from the reference's input and the stored "
            f"codes ({len(rows)} rows, {groups} groups of {size} inputs), are the stored ones in that order on "
            f"{_pct(holds, len(idx))} sampled channels (fit residual {_g(residual)} of the deviation)")
    fix = (f"index {p.module}'s scales with input // {size}: group g reads scale[n, g] (check the scale's "
           f"layout after repacking and the group index of the kernel)")
    return [_Hyp("scale_groups", what, fix, rows=_rows_in_order(p, unscaled, order, size))]


def describe_order(order: torch.Tensor) -> str:
    """How group g's scale index ``order[g]`` departs from g, in words."""
    n = len(order)
    ident = torch.arange(n)
    for s in (1, -1, 2, -2):
        sign = f"g{s:+d}"
        by = f"{abs(s)} group{'s' if abs(s) > 1 else ''}"
        end = "last" if s > 0 else "first"
        if torch.equal(order, (ident + s) % n):
            return f"group g read the scale of group {sign} (shifted by {by}, the {end} wrapping around)"
        if torch.equal(order, (ident + s).clamp(0, n - 1)):
            return f"group g read the scale of group {sign} (shifted by {by}, the {end} clamped to its own)"
    moved = (order != ident).nonzero().flatten().tolist()
    if torch.equal(order[order], ident):  # exchanges only
        pairs = [f"groups {i} and {int(order[i])} exchanged" for i in moved if i < int(order[i])]
        return ", ".join(pairs[:LISTED]) + (f", … ({len(pairs)} exchanges)" if len(pairs) > LISTED else "")
    said = ", ".join(f"{i}→{int(order[i])}" for i in moved[:LISTED])
    return f"group → scale it read: {said}" + (f", … ({len(moved)} groups moved)" if len(moved) > LISTED else "")


def _rows_in_order(p, unscaled, order: torch.Tensor, size: int):
    def rows(idx: torch.Tensor) -> torch.Tensor:
        s = p.scale[idx][:, order].to(torch.float32).repeat_interleave(size, dim=1)
        v = unscaled(idx).to(torch.float32)
        return v * s if p.scale_mode == "multiply" else v / s
    return rows
