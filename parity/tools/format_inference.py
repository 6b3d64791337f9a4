"""Reverse engineering of a checkpoint's quantization format from its tensors (``parity inspect``).

The seed article's method, as code:

- config.json's architecture gives every projection's logical ``(N, K)``; a uint8 tensor of shape
  ``(N, K/4)`` is packed along the input axis, ``(N/4, K)`` along the output axis.
- The 2-bit fields of all bytes give the codes in use (independent of bit order and layout); a code
  that never occurs is ``null``.
- With the dequantized float weights ``W``: each (pack_layout, bit_order) is tried; the right one
  is the one under which every code carries a single sign of ``W`` (that sign is its ``code_map``
  entry). The scale's shape gives its granularity; decoding with ``multiply`` and ``divide`` tells
  which reproduces ``W``. The result is verified by decoding every matrix with the reference decoder.

Everything here returns plain data (dicts, lists); :mod:`vllm_parity.tools.inspect` renders it.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vllm_parity.reference.formats import int8x, ternary
from vllm_parity.reference.checkpoint import Checkpoint, linear_shapes
from vllm_parity.errors import CheckpointError, ParityInputError
from vllm_parity.reference.formats.int8x import Int8xSpec
from vllm_parity.reference.formats.ternary import TernarySpec

SCHEMA = "parity-inspect/1"
PACK_FACTOR = 4
FEW = 16  # distinct values listed up to this many
HYPOTHESES = (("interleaved", "lsb"), ("interleaved", "msb"), ("blocked", "lsb"), ("blocked", "msb"))
MODES = ("multiply", "divide")
SAMPLE_MATRICES = 7  # matrices searched exhaustively with --against (one layer); the rest are verified
SCREEN_ELEMENTS = 1 << 20  # hypotheses are screened on a slice this large before a full-matrix check
DIAGNOSE_FAILED = 4  # matrices failing verification that are searched again to explain the failure
TERNARY_DEFAULT = TernarySpec()
INT8X_DEFAULT = Int8xSpec()
TERNARY_KEYS = tuple(TERNARY_DEFAULT.to_config())
_ORDER = TERNARY_KEYS + tuple(k for k in INT8X_DEFAULT.to_config() if k not in TERNARY_KEYS)

# What a loader following a wrong key gets wrong: said beside each disagreement.
CONSEQUENCE = {
    "quant_method": "a loader picks the wrong decoder",
    "pack_axis": "a loader unpacks along the wrong axis",
    "pack_layout": "a loader scrambles the 4 weights that share a byte",
    "bit_order": "a loader reverses the 4 weights that share a byte",
    "code_map": "a loader decodes wrong signs or zeros",
    "scale_granularity": "a loader broadcasts the scale wrongly",
    "group_size": "a loader applies each scale to the wrong columns",
    "scale_mode": "a loader inverts the scale",
    "weight_name": "a loader does not find the packed weights",
    "scale_name": "a loader does not find the scales",
    "block_size": "a loader rejects the block tables",
}

# byte value -> how many of its four 2-bit fields hold code c (the same for every layout and bit order)
_BYTE = torch.arange(256)
_CODES_PER_BYTE = torch.stack(
    [sum(((_BYTE >> (2 * f)) & 3 == c).long() for f in range(4)) for c in range(4)], dim=1)


# -- per-tensor statistics ------------------------------------------------------------------------


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


# -- the checkpoint's layout: which tensors belong to which projection, and how ----------------------


@dataclass
class Matrix:
    """One linear projection of the checkpoint and how it is stored."""

    module: str
    n: int
    k: int
    kind: str  # ternary | int8x | float | missing | unknown
    keys: dict[str, str] = field(default_factory=dict)  # weight / scale, or the int8x suffixes -> key
    pack_axis: str | None = None
    stored_shape: tuple[int, ...] | None = None
    scale_granularity: str | None = None
    group_size: int | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def weight_suffix(self) -> str | None:
        key = self.keys.get("weight")
        return key.rpartition(".")[2] if key else None

    @property
    def scale_suffix(self) -> str | None:
        key = self.keys.get("scale")
        return key.rpartition(".")[2] if key else None


_INT8X_OWN = set(Int8xSpec.suffixes) - {"weight_scale"}  # a ternary scale may share that name


def pack_axis_from_shape(shape: tuple[int, ...], n: int, k: int) -> str | None:
    if len(shape) != 2:
        return None
    if k % PACK_FACTOR == 0 and shape == (n, k // PACK_FACTOR):
        return "input"
    if n % PACK_FACTOR == 0 and shape == (n // PACK_FACTOR, k):
        return "output"
    return None


def granularity_from_shape(shape: tuple[int, ...], n: int, k: int) -> tuple[str, int | None] | None:
    if shape == (1,):
        return "tensor", None
    if shape == (n,):
        return "channel", None
    if len(shape) == 2 and shape[0] == n and shape[1] > 0 and k % shape[1] == 0:
        return "group", k // shape[1]
    return None


def _fmt_shape(shape) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ")"


def scan(ckpt: Checkpoint, shapes: dict[str, tuple[int, int]], declared: Any) -> tuple[list[Matrix], dict[str, str]]:
    """Classify every projection (from its tensors' headers alone) and give each tensor a role."""
    by_module: dict[str, dict[str, str]] = {}
    for key in ckpt.tensors:
        module, _, suffix = key.rpartition(".")
        by_module.setdefault(module, {})[suffix] = key
    roles: dict[str, str] = {}
    matrices = []
    for module, (n, k) in shapes.items():
        entries = by_module.get(module, {})
        m = Matrix(module, n, k, "unknown")
        matrices.append(m)
        if not entries:
            m.kind = "missing"
            m.problems.append(f"{module}: no tensor in the checkpoint (expected {module}.<suffix>)")
            continue
        info = {s: ckpt.tensors[key] for s, key in entries.items()}
        if any(s in _INT8X_OWN for s in entries):
            m.kind = "int8x"
            for s in Int8xSpec.suffixes:
                if s in entries:
                    m.keys[s] = entries[s]
                    roles[entries[s]] = f"int8x {s.removeprefix('weight_')}"
            missing = [s for s in Int8xSpec.suffixes if s not in entries]
            if missing:
                m.problems.append(f"{module}: int8x tensors missing: {', '.join(module + '.' + s for s in missing)}")
            continue
        packed = [s for s, i in info.items() if i.dtype == torch.uint8]
        if len(packed) > 1:
            m.problems.append(f"{module}: several uint8 tensors ({', '.join(sorted(packed))}); "
                              f"expected one packed weight")
            continue
        if packed:
            _scan_ternary(m, packed[0], entries, info, declared, roles)
            continue
        weights = [s for s, i in info.items() if i.dtype.is_floating_point and i.shape == (n, k)]
        if weights:
            s = "weight" if "weight" in weights else sorted(weights)[0]
            m.kind = "float"
            m.keys["weight"] = entries[s]
            m.stored_shape = (n, k)
            roles[entries[s]] = "float weight"
            continue
        found = ", ".join(f"{s} {_fmt_shape(i.shape)} {str(i.dtype).removeprefix('torch.')}"
                          for s, i in sorted(info.items()))
        m.problems.append(f"{module}: neither a packed uint8 weight, int8x streams, nor a float weight of "
                          f"shape ({n}, {k}); found {found}")
    for key in ckpt.tensors:
        roles.setdefault(key, "float" if ckpt.tensors[key].dtype.is_floating_point else "other")
    return matrices, roles


def _scan_ternary(m: Matrix, wsuffix: str, entries: dict, info: dict, declared: Any, roles: dict) -> None:
    n, k = m.n, m.k
    m.kind = "ternary"
    m.keys["weight"] = entries[wsuffix]
    m.stored_shape = info[wsuffix].shape
    roles[entries[wsuffix]] = "packed weight"
    m.pack_axis = pack_axis_from_shape(m.stored_shape, n, k)
    if m.pack_axis is None:
        why = []
        if k % PACK_FACTOR:
            why.append(f"K={k} is not divisible by 4")
        if n % PACK_FACTOR:
            why.append(f"N={n} is not divisible by 4")
        m.problems.append(
            f"{m.keys['weight']}: stored shape {_fmt_shape(m.stored_shape)} is neither (N, K/4) (input-packed) "
            f"nor (N/4, K) (output-packed) for the logical ({n}, {k}) of config.json"
            + (f" ({'; '.join(why)})" if why else ""))
    scales = {s: granularity_from_shape(i.shape, n, k) for s, i in info.items()
              if s != wsuffix and i.dtype.is_floating_point}
    scales = {s: g for s, g in scales.items() if g is not None}
    if len(scales) > 1:
        prefer = [getattr(declared, "scale_name", None), TERNARY_DEFAULT.scale_name]
        pick = next((s for s in prefer if s in scales), None)
        if pick is None:
            m.problems.append(f"{m.module}: several tensors could be the scale ({', '.join(sorted(scales))})")
            return
        scales = {pick: scales[pick]}
    if not scales:
        others = ", ".join(f"{s} {_fmt_shape(i.shape)}" for s, i in sorted(info.items()) if s != wsuffix)
        m.problems.append(f"{m.module}: no float scale of shape (1,), ({n},) or ({n}, K/group_size) "
                          f"beside the packed weight; found: {others or 'nothing'}")
        return
    (ssuffix, (gran, gsize)), = scales.items()
    m.keys["scale"] = entries[ssuffix]
    m.scale_granularity, m.group_size = gran, gsize
    roles[entries[ssuffix]] = "scale"


# -- fitting the ternary hypotheses to the float weights ----------------------------------------


def _spec(m: Matrix, **kw: Any) -> TernarySpec:
    return TernarySpec(pack_axis=m.pack_axis, scale_granularity=m.scale_granularity,
                       group_size=m.group_size or TERNARY_DEFAULT.group_size, **kw)


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


def _decode_dtype(w: torch.Tensor) -> torch.dtype:
    return torch.float64 if w.dtype == torch.float64 else torch.float32


def _sign_table(codes: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """(4, 3) counts: rows code 0..3, columns sign -1 / 0 / +1 of W."""
    idx = codes.reshape(-1).to(torch.uint8) * 3 + (signs.reshape(-1) + 1).to(torch.uint8)
    return torch.bincount(idx, minlength=12).reshape(4, 3)


def _code_map(table: torch.Tensor) -> tuple[list, list[dict]]:
    code_map, conflicts = [], []
    for c in range(4):
        row = [int(x) for x in table[c]]
        present = [v for v, cnt in zip((-1, 0, 1), row) if cnt]
        if len(present) > 1:
            conflicts.append({"code": c, "signs": {"-1": row[0], "0": row[1], "+1": row[2]}})
        code_map.append(present[0] if len(present) == 1 else None)
    return code_map, conflicts


def _screen(m: Matrix, packed: torch.Tensor, scale: torch.Tensor, w: torch.Tensor):
    """A slice along the non-packed axis (all of the packed axis): packed, scale, W, n, k."""
    n, k = m.n, m.k
    if n * k <= SCREEN_ELEMENTS:
        return packed, scale, w, n, k
    if m.pack_axis == "input":
        rows = max(1, SCREEN_ELEMENTS // k)
        s = scale if m.scale_granularity == "tensor" else scale[:rows]
        return packed[:rows], s, w[:rows], rows, k
    cols = max(1, SCREEN_ELEMENTS // n)
    if m.scale_granularity == "group":
        cols = max(m.group_size, cols // m.group_size * m.group_size)
        return packed[:, :cols], scale[:, :cols // m.group_size], w[:, :cols], n, cols
    return packed[:, :cols], scale, w[:, :cols], n, cols


def _scale_deviation(m: Matrix, spec: TernarySpec, packed, scale, w) -> dict[str, float | None]:
    """How far |W|/|T| is from the stored scale (multiply) and from its inverse (divide)."""
    t = ternary.unpack_values(packed, spec).to(torch.float64)
    s = ternary.expand_scale(scale, spec, m.n, m.k, dtype=torch.float64).expand(m.n, m.k)
    nz = t != 0
    if not bool(nz.any()):
        return {"multiply": None, "divide": None}
    r = w.to(torch.float64).abs()[nz] / t.abs()[nz]
    s = s[nz].abs()
    return {"multiply": float(((r - s).abs() / s.clamp_min(1e-300)).max()),
            "divide": float((r * s - 1).abs().max())}


def fit_ternary(m: Matrix, packed: torch.Tensor, scale: torch.Tensor, w: torch.Tensor) -> list[dict[str, Any]]:
    """Every (pack_layout, bit_order) hypothesis on one matrix: consistency, code_map, scale modes."""
    signs = torch.sign(w).to(torch.int8)
    if bool((scale < 0).any()):  # a negative scale flips the sign of its weights
        s = ternary.expand_scale(scale, _spec(m), m.n, m.k)
        signs = signs * torch.sign(s).to(torch.int8)
    sp, ss, sw, sn, sk = _screen(m, packed, scale, w)
    sub_signs = signs if sw is w else (signs[:sn] if m.pack_axis == "input" else signs[:, :sk])
    dtype = _decode_dtype(w)
    fits = []
    for layout, order in HYPOTHESES:
        spec = _spec(m, pack_layout=layout, bit_order=order)
        fit: dict[str, Any] = {"module": m.module, "pack_layout": layout, "bit_order": order}
        table = _sign_table(ternary.unpack_codes(sp, spec), sub_signs)
        code_map, conflicts = _code_map(table)
        if not conflicts and sw is not w:
            code_map, conflicts = _code_map(_sign_table(ternary.unpack_codes(packed, spec), signs))
        fit.update(consistent=not conflicts, code_map=code_map, conflicts=conflicts, modes={})
        fits.append(fit)
        if conflicts:
            continue
        if all(v is None for v in code_map):
            fit["consistent"] = False
            continue
        for mode in MODES:
            full = _spec(m, pack_layout=layout, bit_order=order, code_map=tuple(code_map), scale_mode=mode)
            result: dict[str, Any]
            try:
                # Screen on the slice; only a mode that fits there is decoded in full.
                result = compare(ternary.decode(sp, ss, full, sn, sk, dtype=dtype), sw)
                if result["exact"] and sw is not w:
                    result = compare(ternary.decode(packed, scale, full, m.n, m.k, dtype=dtype), w)
            except ParityInputError as exc:
                result = {"exact": False, "error": str(exc), "max_abs_error": None}
            fit["modes"][mode] = {"fits": result["exact"], "max_abs_error": result.get("max_abs_error"),
                                  **({"error": result["error"]} if "error" in result else {})}
        if not any(v["fits"] for v in fit["modes"].values()):
            spec_cm = _spec(m, pack_layout=layout, bit_order=order, code_map=tuple(code_map))
            fit["scale_deviation"] = _scale_deviation(m, spec_cm, packed, scale, w)
    return fits


def _why_not(fit: dict[str, Any]) -> str:
    where = fit["module"]
    if fit["conflicts"]:
        parts = []
        for c in fit["conflicts"]:
            held = ", ".join(f"{s} x{n}" for s, n in c["signs"].items() if n)
            parts.append(f"code {c['code']} holds {held}")
        return f"mixed signs per code in {where}: " + "; ".join(parts)
    if not fit["consistent"]:
        return f"no code occurs in {where}"
    dev = fit.get("scale_deviation") or {}
    errors = [v["error"] for v in fit["modes"].values() if v.get("error")]
    msg = f"neither scale mode reproduces W in {where}"
    if dev.get("multiply") is not None:
        msg += (f": |W|/|T| deviates from the stored scale by up to {dev['multiply']:.3g} (relative; multiply) "
                f"and |W|/|T| x scale from 1 by up to {dev['divide']:.3g} (divide)")
    if errors:
        msg += f" ({errors[0]})"
    return msg


def combine_fits(fits_by_module: dict[str, list[dict]]) -> tuple[list[dict], list[dict]]:
    """Hypotheses that hold in every sampled matrix (merged code_map, scale modes), and why the others fail.

    Each rejected hypothesis counts the matrices it does fit: one that fits all but a few points at
    those few (a corrupt or differently packed matrix) rather than at the format.
    """
    survivors, rejected = [], []
    for layout, order in HYPOTHESES:
        code_map: list = [None] * 4
        modes = set(MODES)
        failures: list[tuple[str, str]] = []
        for module, fits in fits_by_module.items():
            fit = next(f for f in fits if f["pack_layout"] == layout and f["bit_order"] == order)
            fitting = {mode for mode, r in fit["modes"].items() if r["fits"]}
            if not fit["consistent"] or not fitting:
                failures.append((module, _why_not(fit)))
                continue
            clash = [c for c, v in enumerate(fit["code_map"])
                     if v is not None and code_map[c] is not None and code_map[c] != v]
            if clash:
                failures.append((module, f"code {clash[0]} stands for {fit['code_map'][clash[0]]} in {module} but "
                                         f"for {code_map[clash[0]]} in the matrices before it"))
                continue
            if not modes & fitting:
                failures.append((module, f"{module} needs scale_mode {'/'.join(sorted(fitting))}, the matrices "
                                         f"before it {'/'.join(sorted(modes))}"))
                continue
            code_map = [v if v is not None else code_map[c] for c, v in enumerate(fit["code_map"])]
            modes &= fitting
        entry = {"pack_layout": layout, "bit_order": order}
        if not failures:
            survivors.append({**entry, "code_map": code_map, "scale_modes": [m for m in MODES if m in modes]})
        else:
            rejected.append({**entry, "reason": failures[0][1], "fits": len(fits_by_module) - len(failures),
                             "of": len(fits_by_module), "fails_in": [m for m, _ in failures]})
    rejected.sort(key=lambda r: -r["fits"])
    return survivors, rejected


# -- int8x --------------------------------------------------------------------------------------


def int8x_block_sizes(tensors: dict[str, torch.Tensor], n: int) -> tuple[set[int] | None, int]:
    """Block sizes (multiples of 32) whose prefix counts match ``weight_b1_blk``.

    Returns (candidates, lower_bound): candidates None means any multiple of 32 >= lower_bound
    (a single block says nothing more).
    """
    blk = tensors["weight_b1_blk"].to(torch.int64).reshape(-1)
    nb = blk.numel()
    if nb <= 1:
        return None, n
    nonl1 = int8x.unpack_bits(tensors["weight_b1"], n).to(torch.int64)
    cum = torch.zeros(n + 1, dtype=torch.int64)
    torch.cumsum(nonl1, 0, out=cum[1:])
    lo = -(-n // nb)
    hi = -(-n // (nb - 1)) - 1  # ceil(n / bs) == nb  <=>  n / nb <= bs < n / (nb - 1)
    cands = torch.arange(-(-lo // 32) * 32, hi + 1, 32)
    cands = cands[cum[cands.clamp(max=n)] == blk[1]]  # the first table entry screens them all at once
    ok = set()
    starts = torch.arange(nb)
    for bs in cands.tolist()[:64]:
        if torch.equal(cum[(starts * bs).clamp(max=n)], blk):
            ok.add(int(bs))
    return ok, 0


# -- float checkpoint checks ----------------------------------------------------------------------


def open_against(path: str | Path, ckpt: Checkpoint, shapes: dict[str, tuple[int, int]],
                 matrices: list[Matrix]) -> Checkpoint:
    """The float checkpoint, checked up front: same architecture, a float ``<module>.weight`` per matrix."""
    fck = Checkpoint(path)
    if fck.spec is not None:
        raise CheckpointError(
            f"{fck.path}: declares a quantization_config ({fck.spec.quant_method}); --against needs a float "
            f"checkpoint holding the dequantized weights under <module>.weight")
    if not shapes:
        raise CheckpointError(f"{ckpt.path}: config.json has no Llama architecture fields, so the float "
                              f"weights cannot be matched to projections")
    try:
        theirs = linear_shapes(fck.config)
    except CheckpointError as exc:
        raise CheckpointError(f"{fck.path}: {exc}") from None
    for module, shape in shapes.items():
        if theirs.get(module) != shape:
            got = theirs.get(module)
            raise CheckpointError(
                f"{fck.path}: architecture does not match {ckpt.path}: {module} is "
                f"{'absent' if got is None else _fmt_shape(got)} there but {_fmt_shape(shape)} here "
                f"(compare hidden_size, intermediate_size, num_*_heads, num_hidden_layers in both config.json)")
    for m in matrices:
        if m.kind not in ("ternary", "int8x"):
            continue
        key = f"{m.module}.weight"
        if key not in fck:
            raise CheckpointError(f"{fck.path}: float weight {key!r} is missing (needed to check {m.module})")
        info = fck.info(key)
        if not info.dtype.is_floating_point:
            raise CheckpointError(f"{fck.path}: {key!r} is {str(info.dtype).removeprefix('torch.')}, not a "
                                  f"float weight: --against needs the dequantized float checkpoint")
        if info.shape != (m.n, m.k):
            raise CheckpointError(f"{fck.path}: {key!r} has shape {_fmt_shape(info.shape)}, but {m.module} is "
                                  f"({m.n}, {m.k}) in {ckpt.path}/config.json")
    return fck


# -- code tables without the float weights ------------------------------------------------------


def code_table_candidates(hist: list[int]) -> list[dict[str, Any]]:
    """Code maps compatible with which codes occur; 'plausible' when the +1 and -1 codes balance.

    Without the float weights the sign of the two nonzero codes cannot be told apart, so
    candidates come in mirrored pairs; the zero code is the one whose removal leaves a balanced pair
    (ternary weights are symmetric around zero).
    """
    occurring = [c for c in range(4) if hist[c]]
    total = sum(hist)
    out = []
    if not occurring or len(occurring) == 4:
        return out
    for values in itertools.permutations((-1, 0, 1), len(occurring)):
        cm: list = [None] * 4
        for c, v in zip(occurring, values):
            cm[c] = v
        plus = hist[cm.index(1)] if 1 in cm else 0
        minus = hist[cm.index(-1)] if -1 in cm else 0
        pair = plus + minus
        plausible = pair > 0 and abs(plus - minus) <= max(5 * math.sqrt(pair), 0.02 * pair)
        zero = hist[cm.index(0)] if 0 in cm else 0
        out.append({"code_map": cm, "zero_fraction": zero / total if total else None,
                    "sign_imbalance": abs(plus - minus) / pair if pair else None, "plausible": plausible})
    out.sort(key=lambda e: (not e["plausible"], e["sign_imbalance"] if e["sign_imbalance"] is not None else 2))
    return out


def compatible_code_map(code_map, hist: list[int]) -> bool:
    """Every occurring code has a value (a code marked null must not occur)."""
    return all(code_map[c] is not None for c in range(4) if hist[c])


# -- the vLLM mapping ---------------------------------------------------------------------------

_LINEAR_KEY = re.compile(r"^(?P<prefix>model\.layers\.\d+\.(?:self_attn|mlp))\.(?P<proj>[a-z]+_proj)\.(?P<suffix>[^.]+)$")
_STACKED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
            "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
_SHARDS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_ROW_PARALLEL = ("o_proj", "down_proj")


def vllm_mapping(keys: list[str], shapes: dict[str, tuple[int, int]], matrices: dict[str, Matrix],
                 roles: dict[str, str], layout: str | None) -> list[dict[str, Any]]:
    """checkpoint key -> vLLM parameter, with the merge into fused layers and the tensor-parallel split."""
    rows_out = []
    for key in keys:
        row: dict[str, Any] = {"checkpoint_key": key, "vllm_param": key, "op": "as is", "shard": None,
                               "rows": None, "packed_rows": None, "slot": None, "tp_split": None,
                               "transpose": False, "note": None}
        rows_out.append(row)
        role = roles.get(key, "")
        mt = _LINEAR_KEY.match(key)
        if mt and (mt["proj"] in _STACKED or mt["proj"] in _ROW_PARALLEL):
            module = f"{mt['prefix']}.{mt['proj']}"
            m = matrices.get(module)
            if mt["proj"] in _STACKED:
                _stacked_row(row, mt, module, m, role, shapes, layout)
            else:
                _row_parallel_row(row, m, role)
        elif key == "model.embed_tokens.weight" or key.startswith("lm_head."):
            row["tp_split"] = "dim 0 (vocab)"
        elif "norm" in key.rpartition(".")[0]:
            row["tp_split"] = "replicated"
        else:
            row["note"] = "not a Llama parameter: vLLM's loader skips or rejects it"
    return rows_out


def _stacked_row(row, mt, module, m, role, shapes, layout) -> None:
    fused, shard = _STACKED[mt["proj"]]
    row["vllm_param"] = f"{mt['prefix']}.{fused}.{mt['suffix']}"
    row["op"] = "merge"
    row["shard"] = shard
    members = _SHARDS[fused]
    start = 0
    for member in members:
        size = shapes.get(f"{mt['prefix']}.{member}", (0, 0))[0]
        if member == mt["proj"]:
            row["rows"] = [start, start + size]
            break
        start += size
    row["tp_split"] = "dim 0"
    if m is None:
        return
    if role == "packed weight" and m.pack_axis == "output":
        lo, hi = row["rows"]
        row["packed_rows"] = [lo // PACK_FACTOR, hi // PACK_FACTOR]
        row["tp_split"] = "dim 0 (packed rows: each rank's shard rows must divide by 4)"
        if layout == "blocked":
            row["note"] = ("blocked output packing: each shard's bytes block its own rows "
                           "(P = shard rows / 4): decode per shard, not the fused tensor as one")
    elif role == "scale" and m.scale_granularity == "tensor":
        row["rows"] = None
        row["slot"] = members.index(mt["proj"])
        row["tp_split"] = "replicated"
        row["note"] = "one scale per shard (a per-tensor scale slot of the fused layer)"
    elif role.startswith("int8x"):
        row["tp_split"] = "not sliceable"
        row["note"] = "int8x streams are flat bit streams: one stream set per shard, not row slices"


def _row_parallel_row(row, m, role) -> None:
    row["tp_split"] = "dim 1"
    if m is None:
        return
    if role == "packed weight" and m.pack_axis == "input":
        row["tp_split"] = "dim 1 (packed columns: each rank's K must divide by 4)"
    elif role == "scale":
        row["tp_split"] = {"tensor": "replicated", "channel": "replicated", "group": "dim 1 (groups)"}.get(
            m.scale_granularity, "dim 1")
    elif role.startswith("int8x"):
        row["tp_split"] = "not sliceable"
        row["note"] = "int8x streams are flat bit streams: not split by columns"


# -- the whole inspection -----------------------------------------------------------------------


class _Keys:
    """Resolved config values with where each came from: inferred / declared / default / guessed."""

    def __init__(self, declared_raw: Any, declared: Any, default: TernarySpec | Int8xSpec):
        same = declared is not None and type(declared) is type(default)
        self.raw = declared_raw if same and isinstance(declared_raw, dict) else {}
        self.declared = declared if same else None
        self.default = default
        self.values: dict[str, Any] = {}
        self.sources: dict[str, str] = {}

    def set(self, key: str, value: Any, source: str) -> None:
        self.values[key], self.sources[key] = value, source

    def fallback(self, key: str) -> tuple[Any, str]:
        if self.declared is not None and key in self.raw:
            return getattr(self.declared, key), "declared"
        return getattr(self.default, key), "default"

    def take_fallback(self, key: str) -> None:
        self.set(key, *self.fallback(key))

    def choose(self, key: str, candidates: list) -> Any:
        """One data-inferred candidate; among several the data cannot tell apart, the declared/default one."""
        if len(candidates) == 1:
            self.set(key, candidates[0], "inferred")
            return candidates[0]
        value, source = self.fallback(key)
        if value in candidates:
            self.set(key, value, source)
        else:
            value = candidates[0]
            self.set(key, value, "inferred")
        return value


class Inspection:
    """``parity inspect``: reads a checkpoint one tensor at a time and builds the report (plain data)."""

    def __init__(self, path: str | Path, against: str | Path | None = None):
        self.ckpt = Checkpoint(path)
        self.declared_raw = self.ckpt.config.get("quantization_config")
        self.declared = self.ckpt.spec
        self.warnings: list[str] = []
        self.notes: list[str] = []
        self.disagreements: list[dict[str, Any]] = []
        try:
            self.shapes = linear_shapes(self.ckpt.config)
        except CheckpointError as exc:
            self.shapes = {}
            self.warnings.append(f"{self.ckpt.path}/config.json: {exc}; packed axes cannot be inferred")
        self.matrices, self.roles = scan(self.ckpt, self.shapes, self.declared)
        self.by_module = {m.module: m for m in self.matrices}
        for m in self.matrices:
            self.warnings.extend(m.problems)
        self.fck = open_against(against, self.ckpt, self.shapes, self.matrices) if against else None
        self.format = self._format()
        self.keys: _Keys | None = None
        self.spec: TernarySpec | Int8xSpec | None = None
        self.failure: str | None = None
        self.hypotheses: dict[str, Any] | None = None
        self.code_table: dict[str, Any] | None = None

    def _format(self) -> str:
        kinds = {m.kind for m in self.matrices}
        if "ternary" in kinds and "int8x" in kinds:
            return "mixed"
        if "ternary" in kinds or "int8x" in kinds:
            return "ternary" if "ternary" in kinds else "int8x"
        return "float" if "float" in kinds else "unknown"

    def good(self, kind: str) -> list[Matrix]:
        return [m for m in self.matrices if m.kind == kind and not m.problems]

    # -- ternary ---------------------------------------------------------------------------------

    def _one(self, keys: _Keys, key: str, per_matrix: dict[str, Any]) -> Any:
        values = sorted(set(per_matrix.values()), key=str)
        if len(values) == 1:
            keys.set(key, values[0], "inferred")
            return values[0]
        by_value: dict[Any, list[str]] = {}
        for module, v in per_matrix.items():
            by_value.setdefault(v, []).append(module)
        detail = "; ".join(f"{v!r} in {len(ms)} (e.g. {ms[0]})" for v, ms in by_value.items())
        self.failure = f"the matrices do not share one {key}: {detail}"
        self.warnings.append(f"{key}: {self.failure} - one quantization_config cannot describe them")
        return None

    def resolve_ternary(self) -> None:
        mats = self.good("ternary")
        keys = self.keys = _Keys(self.declared_raw, self.declared, TERNARY_DEFAULT)
        keys.set("quant_method", "ternary", "inferred")
        if not mats:
            self.failure = "no ternary matrix could be read (see the warnings)"
            return
        self._one(keys, "pack_axis", {m.module: m.pack_axis for m in mats})
        gran = self._one(keys, "scale_granularity", {m.module: m.scale_granularity for m in mats})
        if gran == "group":
            self._one(keys, "group_size", {m.module: m.group_size for m in mats})
        else:
            keys.take_fallback("group_size")
        self._one(keys, "weight_name", {m.module: m.weight_suffix for m in mats})
        self._one(keys, "scale_name", {m.module: m.scale_suffix for m in mats})
        keys.take_fallback("activation_quant")
        keys.take_fallback("ignore")
        if self.fck is not None:
            self._fit_ternary(mats, keys)
        else:
            for key in ("pack_layout", "bit_order", "scale_mode"):
                keys.take_fallback(key)

    def _fit_ternary(self, mats: list[Matrix], keys: _Keys) -> None:
        sample = mats[:SAMPLE_MATRICES]
        fits = {m.module: fit_ternary(m, self.ckpt.tensor(m.keys["weight"]), self.ckpt.tensor(m.keys["scale"]),
                                      self.fck.tensor(f"{m.module}.weight")) for m in sample}
        survivors, rejected = combine_fits(fits)
        self.hypotheses = {"sampled": list(fits), "survivors": survivors, "rejected": rejected,
                           "per_matrix": [f for fs in fits.values() for f in fs]}
        if not survivors:
            best = rejected[0]
            if best["fits"]:
                why = (f"the closest, {best['pack_layout']}/{best['bit_order']}, fits {best['fits']} of {best['of']} "
                       f"sampled matrices but not {', '.join(best['fails_in'])}: {best['reason']}")
            else:
                why = f"every (pack_layout, bit_order) fails, e.g. {best['pack_layout']}/{best['bit_order']}: {best['reason']}"
            self.failure = "no hypothesis reproduces the float weights"
            self.warnings.append(f"no quantization_config reproduces the float weights of {self.fck.path}: {why}")
            for key in ("pack_layout", "bit_order", "scale_mode"):
                keys.take_fallback(key)
            return
        pairs = [(s["pack_layout"], s["bit_order"]) for s in survivors]
        fb = (keys.fallback("pack_layout")[0], keys.fallback("bit_order")[0])
        chosen = survivors[pairs.index(fb)] if fb in pairs else survivors[0]
        for key in ("pack_layout", "bit_order"):
            options = sorted({s[key] for s in survivors})
            if len(options) == 1:
                keys.set(key, chosen[key], "inferred")
            else:
                value, source = keys.fallback(key)
                keys.set(key, chosen[key], source if value == chosen[key] else "inferred")
        if len(survivors) > 1:
            self.notes.append(f"the sampled matrices fit {len(survivors)} (pack_layout, bit_order) pairs equally: "
                              f"{', '.join('/'.join(p) for p in pairs)}; took {'/'.join(pairs[survivors.index(chosen)])}")
        keys.set("code_map", tuple(chosen["code_map"]), "inferred")
        if len(chosen["scale_modes"]) > 1:
            self.notes.append("multiply and divide both reproduce the weights (every scale is 1): scale_mode "
                              "cannot be told from the data")
        keys.choose("scale_mode", chosen["scale_modes"])

    def resolve_code_map_without_weights(self, hist: list[int]) -> None:
        keys = self.keys
        cands = code_table_candidates(hist)
        plausible = [c for c in cands if c["plausible"]]
        value, source = keys.fallback("code_map")
        if source == "declared":
            keys.set("code_map", value, source)
            return
        default_fits = compatible_code_map(value, hist) and any(
            all(value[i] == c["code_map"][i] for i in range(4) if hist[i]) for c in plausible)
        if default_fits or (not plausible and compatible_code_map(value, hist)):
            keys.set("code_map", value, "default")
        elif plausible or cands:
            keys.set("code_map", tuple((plausible or cands)[0]["code_map"]), "guessed")
        else:
            keys.set("code_map", value, "default")

    # -- int8x -----------------------------------------------------------------------------------

    def resolve_int8x(self) -> None:
        mats = self.good("int8x")
        keys = self.keys = _Keys(self.declared_raw, self.declared, INT8X_DEFAULT)
        keys.set("quant_method", "int8x", "inferred")
        keys.take_fallback("ignore")
        if not mats:
            keys.take_fallback("levels")
            keys.take_fallback("block_size")
            self.failure = "no int8x matrix could be read (see the warnings)"
            return
        keys.set("levels", INT8X_DEFAULT.levels, "inferred")  # fixed in this version; decoding checks the widths
        exact: set[int] | None = None
        bound = 0
        for m in mats:
            t = {s: self.ckpt.tensor(m.keys[s]) for s in ("weight_shape", "weight_b1", "weight_b1_blk")}
            try:
                n = int(t["weight_shape"][0]) * int(t["weight_shape"][1])
                cands, lo = int8x_block_sizes(t, n)
            except (ValueError, IndexError, RuntimeError) as exc:
                self.warnings.append(f"{m.module}: int8x bitmaps unreadable: {exc}")
                continue
            bound = max(bound, lo)
            if cands is not None:
                exact = cands if exact is None else exact & cands
                if not exact:
                    self.warnings.append(f"{m.module}: weight_b1_blk matches no block_size shared with the "
                                         f"matrices before it")
                    break
        options = sorted(b for b in exact if b >= bound) if exact is not None else []
        if exact is None:
            value, source = keys.fallback("block_size")
            if value >= bound:
                keys.set("block_size", value, source)
            else:
                keys.set("block_size", -(-bound // 32) * 32, "inferred")
        elif options:
            keys.choose("block_size", options)
        else:
            keys.take_fallback("block_size")
            self.failure = "no block_size (multiple of 32) matches the block tables"
            self.warnings.append(f"int8x: {self.failure}")

    # -- the pass over all tensors ----------------------------------------------------------------

    def build_spec(self) -> None:
        if self.keys is None or self.failure:
            return
        v = self.keys.values
        try:
            if v["quant_method"] == "ternary":
                self.spec = TernarySpec(**{k: v[k] for k in TERNARY_KEYS if k != "quant_method"})
            else:
                self.spec = Int8xSpec(levels=tuple(v["levels"]), block_size=v["block_size"], ignore=tuple(v["ignore"]))
        except ParityInputError as exc:
            self.failure = f"the inferred keys do not form a valid config: {exc}"
            self.warnings.append(self.failure)

    def run(self) -> dict[str, Any]:
        if self.format == "ternary":
            self.resolve_ternary()
        elif self.format == "int8x":
            self.resolve_int8x()
        elif self.format == "mixed":
            self.failure = "some matrices are ternary and some int8x: no single quantization_config"
            self.warnings.append(self.failure)
        # Code maps are known before the pass with --against or a declared config; otherwise after it.
        if self.keys is not None and "code_map" not in self.keys.values and self.format == "ternary" \
                and isinstance(self.declared, TernarySpec):
            self.keys.take_fallback("code_map")
        if self.keys is not None and "code_map" in self.keys.values or self.format != "ternary":
            self.build_spec()
        tensors, entries, checks = self.tensor_pass()
        if self.format == "ternary" and self.keys is not None:
            hist = [sum(e["code_histogram"][c] for e in entries if e.get("code_histogram")) for c in range(4)]
            if "code_map" not in self.keys.values:
                self.resolve_code_map_without_weights(hist)
                self.build_spec()
            self.ternary_code_table(hist, entries)
        verification = self.verification(checks)
        self.check_declared()
        return self.report(tensors, entries, verification)

    def tensor_pass(self) -> tuple[dict[str, dict], list[dict], list[dict]]:
        tensors: dict[str, dict] = {}
        entries: list[dict] = []
        checks: list[dict] = []
        spec = self.spec

        def stats(key: str) -> torch.Tensor:
            t = self.ckpt.tensor(key)
            info = self.ckpt.tensors[key]
            tensors[key] = {"name": key, "shape": list(info.shape), "dtype": str(info.dtype).removeprefix("torch."),
                            "file": info.file.name, "role": self.roles.get(key, "float"), **tensor_stats(t)}
            return t

        for m in self.matrices:
            entry: dict[str, Any] = {"module": m.module, "kind": m.kind, "logical_shape": [m.n, m.k],
                                     "stored_shape": list(m.stored_shape) if m.stored_shape else None}
            if m.kind == "ternary":
                packed = stats(m.keys["weight"])
                scale = stats(m.keys["scale"]) if "scale" in m.keys else None
                entry.update(pack_axis=m.pack_axis, pack_factor=PACK_FACTOR if m.pack_axis else None,
                             scale_granularity=m.scale_granularity, group_size=m.group_size,
                             code_histogram=tensors[m.keys["weight"]]["code_histogram"])
                for key in (m.keys["weight"], m.keys.get("scale")):
                    if key:
                        tensors[key].update(module=m.module, pack_axis=m.pack_axis,
                                            pack_factor=entry["pack_factor"] if key == m.keys["weight"] else None)
                if self.fck is not None and isinstance(spec, TernarySpec) and not m.problems:
                    checks.append(self._check_ternary(m, packed, scale, spec))
            elif m.kind == "int8x":
                t = {s: stats(key) for s, key in m.keys.items()}
                self._int8x_entry(m, t, entry, checks)
            else:
                for key in m.keys.values():
                    stats(key)
            for key in m.keys.values():
                tensors[key]["module"] = m.module
            entries.append(entry)
        for key in natural_sorted(self.ckpt.tensors):
            if key not in tensors:
                stats(key)
        return tensors, entries, checks

    def _check_ternary(self, m: Matrix, packed, scale, spec: TernarySpec) -> dict[str, Any]:
        w = self.fck.tensor(f"{m.module}.weight")
        try:
            decoded = ternary.decode(packed, scale, spec, m.n, m.k, name=m.keys["weight"], dtype=_decode_dtype(w))
            return {"module": m.module, **compare(decoded, w)}
        except ParityInputError as exc:
            return {"module": m.module, "exact": False, "error": str(exc), "max_abs_error": None}

    def _int8x_entry(self, m: Matrix, t: dict, entry: dict, checks: list) -> None:
        if m.problems:
            return
        spec = self.spec if isinstance(self.spec, Int8xSpec) else Int8xSpec(
            block_size=self.keys.values.get("block_size", INT8X_DEFAULT.block_size) if self.keys else 1024)
        try:
            q = int8x.decode_int8(t, spec, m.module)
            scale = int8x.scale_of(t, m.module)
        except ParityInputError as exc:
            self.warnings.append(f"{m.module}: int8x streams do not decode: {exc}")
            entry["error"] = str(exc)
            if self.fck is not None:
                checks.append({"module": m.module, "exact": False, "error": str(exc), "max_abs_error": None})
            return
        if tuple(q.shape) != (m.n, m.k):
            self.warnings.append(f"{m.keys['weight_shape']}: [{q.shape[0]}, {q.shape[1]}], but config.json gives "
                                 f"{m.module} the shape ({m.n}, {m.k})")
        lv = int8x.levels(q)
        bpw = int8x.bits_per_weight(t)
        entry.update(scale=scale, levels={"l1": lv["l1"], "l2": lv["l2"], "l3": lv["l3"]},
                     level_counts={"n1": lv["n1"], "n2": lv["n2"], "n3": lv["n3"]},
                     bits_per_weight=bpw["bits_per_weight"],
                     block_tables_bits_per_weight=bpw["block_tables_bits_per_weight"],
                     per_stream_bits_per_weight=bpw["per_stream"],
                     zero_fraction=float((q == 0).sum()) / q.numel(), zero_fraction_source="int8 values")
        if self.fck is not None and tuple(q.shape) == (m.n, m.k):
            w = self.fck.tensor(f"{m.module}.weight")
            # q * scale is exact in fp64: the reference decode (int8x.decode) rounds it once to W's dtype.
            checks.append({"module": m.module, **compare(q.to(torch.float64) * scale, w)})

    # -- after the pass ---------------------------------------------------------------------------

    def ternary_code_table(self, hist: list[int], entries: list[dict]) -> None:
        keys = self.keys
        code_map = keys.values.get("code_map")
        source = keys.sources.get("code_map")
        cands = code_table_candidates(hist)
        declared_map = self.declared.code_map if isinstance(self.declared, TernarySpec) else None
        for c in cands:
            occ = range(4)
            c["declared"] = declared_map is not None and all(declared_map[i] == c["code_map"][i] for i in occ if hist[i])
            c["chosen"] = code_map is not None and all(code_map[i] == c["code_map"][i] for i in occ if hist[i])
        balanced = [c for c in cands if c["plausible"] and 0 in c["code_map"]]
        # Zero fractions need the code table: verified by the data, else declared, else guessed from balance.
        table, zsource = None, None
        if code_map is not None and source in ("inferred", "declared"):
            table, zsource = list(code_map), source
        elif len({c["code_map"].index(0) for c in balanced}) == 1:
            table, zsource = balanced[0]["code_map"], "guessed (code balance)"
        for e in entries:
            h = e.get("code_histogram")
            if not h:
                continue
            total = sum(h)
            e["code_fractions"] = [x / total for x in h] if total else None
            if table is not None and total:
                e["zero_fraction"] = sum(h[c] for c in range(4) if table[c] == 0) / total
                e["zero_fraction_source"] = zsource
            else:
                e["zero_fraction"], e["zero_fraction_source"] = None, None
        self.code_table = {
            "histogram": hist, "occurring_codes": [c for c in range(4) if hist[c]],
            "never_occurring_codes": [c for c in range(4) if not hist[c]],
            "candidates": cands, "zero_fraction_source": zsource,
        }
        if code_map is not None and not compatible_code_map(code_map, hist):
            bad = [c for c in range(4) if hist[c] and code_map[c] is None]
            where = "config.json's" if source == "declared" else f"the {source}"
            self.warnings.append(
                f"code_map: {where} code_map {list(code_map)} marks code(s) {bad} as must-not-occur, but they "
                f"occur {sum(hist[c] for c in bad)} times: decoding this checkpoint fails")
        if len(hist) and sum(1 for x in hist if x) == 4:
            self.notes.append("all four 2-bit codes occur: two codes share a value, or the data is not ternary")

    def verification(self, checks: list[dict]) -> dict[str, Any] | None:
        if self.fck is None:
            return None
        if self.spec is None:
            return {"performed": False, "reason": self.failure or "nothing quantized to verify", "matrices": [],
                    "passed": False if self.format != "float" else None}
        failed = [c for c in checks if not c["exact"]]
        errors = [c["max_abs_error"] for c in checks if c.get("max_abs_error") is not None]
        out = {"performed": True, "config": self.spec.to_config(), "matrices": checks, "checked": len(checks),
               "passed": not failed and bool(checks), "max_abs_error": max(errors) if errors else None,
               "failed": [c["module"] for c in failed], "diagnoses": []}
        for c in failed:
            why = c.get("error") or (f"max abs error {c['max_abs_error']:.3g}, {c['mismatches']} element(s) "
                                     f"beyond the float dtype's rounding")
            self.warnings.append(f"{c['module']}: does not decode to its float weights with the inferred config: {why}")
        for c in failed[:DIAGNOSE_FAILED]:
            m = self.by_module[c["module"]]
            if m.kind != "ternary":
                continue
            fits = fit_ternary(m, self.ckpt.tensor(m.keys["weight"]), self.ckpt.tensor(m.keys["scale"]),
                               self.fck.tensor(f"{m.module}.weight"))
            survivors, rejected = combine_fits({m.module: fits})
            if survivors:
                s = survivors[0]
                text = (f"pack_layout={s['pack_layout']}, bit_order={s['bit_order']}, code_map={s['code_map']}, "
                        f"scale_mode={'/'.join(s['scale_modes'])}")
                self.warnings.append(f"{m.module}: fits {text} on its own: the matrices do not share one format")
            else:
                text = "; ".join(r["reason"] for r in rejected)
            out["diagnoses"].append({"module": m.module, "survivors": survivors, "rejected": rejected, "text": text})
        if self.spec is not None and out["passed"]:
            self.notes.append(f"verified: all {len(checks)} quantized matrices decode to the float weights "
                              f"(max abs error {out['max_abs_error']:.3g})")
        return out

    def check_declared(self) -> None:
        """Loud warnings where config.json says one thing and the data another."""
        declared, raw = self.declared, self.declared_raw if isinstance(self.declared_raw, dict) else {}
        if self.format in ("ternary", "int8x") and declared is None:
            self.warnings.append(
                f"quant_method: config.json declares no quantization_config, but the linear weights are stored "
                f"as {self.format}: a loader treats the checkpoint as plain floating point")
            self.disagreements.append({"key": "quant_method", "declared": None, "data": self.format, "explicit": False})
        elif declared is not None and self.format in ("ternary", "int8x") and declared.quant_method != self.format:
            self.warnings.append(f"quant_method: config.json declares {declared.quant_method!r}, but the weights are "
                                 f"stored as {self.format!r}: {CONSEQUENCE['quant_method']}")
            self.disagreements.append({"key": "quant_method", "declared": declared.quant_method,
                                       "data": self.format, "explicit": True})
        elif declared is not None and self.format == "float":
            self.warnings.append(f"quant_method: config.json declares {declared.quant_method!r}, but every linear "
                                 f"weight is stored as float")
        if self.keys is None or self.keys.declared is None:
            self._check_ignore()
            return
        for key, source in self.keys.sources.items():
            if source != "inferred" or key == "quant_method":
                continue
            data, said = self.keys.values[key], getattr(declared, key)
            if key == "group_size" and getattr(declared, "scale_granularity", None) != "group":
                continue
            if key == "code_map":
                # A code the data never uses is null in the inference; a declared value for it is harmless.
                wrong = [c for c in range(4) if data[c] is not None and said[c] != data[c]]
                if not wrong:
                    continue
            elif data == said:
                continue
            explicit = key in raw
            how = "declares" if explicit else "omits it, so it defaults to"
            evidence = "the float weights" if key in ("pack_layout", "bit_order", "code_map", "scale_mode") \
                else "the tensors' shapes and names"
            self.warnings.append(
                f"{key}: config.json {how} {_show(said)}, but {evidence} show {_show(data)}: {CONSEQUENCE.get(key, '')}")
            self.disagreements.append({"key": key, "declared": _jsonable(said), "data": _jsonable(data),
                                       "explicit": explicit})
        self._check_ignore()

    def _check_ignore(self) -> None:
        spec = self.spec if self.spec is not None else None
        if spec is None:
            return
        for m in self.matrices:
            if m.kind == "float" and not spec.is_ignored(m.module):
                self.warnings.append(f"ignore: {m.module} is stored as float but not listed in ignore "
                                     f"{list(spec.ignore)}: a loader looks for its quantized tensors")
            elif m.kind in ("ternary", "int8x") and spec.is_ignored(m.module):
                self.warnings.append(f"ignore: {m.module} is stored quantized but matches ignore "
                                     f"{list(spec.ignore)}: a loader reads it as a float weight")

    def report(self, tensors: dict, entries: list[dict], verification: dict | None) -> dict[str, Any]:
        keys = self.keys
        sources = dict(keys.sources) if keys else {}
        config = self.spec.to_config() if self.spec is not None else None
        layout = keys.values.get("pack_layout") if keys else None
        params = sum(m.n * m.k for m in self.matrices if m.kind in ("ternary", "int8x"))
        quant_keys = {k for m in self.matrices if m.kind in ("ternary", "int8x") for k in m.keys.values()}
        params += sum(math.prod(i.shape) for k, i in self.ckpt.tensors.items() if k not in quant_keys)
        return {
            "schema": SCHEMA,
            "checkpoint": str(self.ckpt.path),
            "against": str(self.fck.path) if self.fck is not None else None,
            "format": self.format,
            "declared_config": _jsonable(self.declared_raw),
            "quantization_config": config,
            "partial_config": None if config is not None or keys is None else _jsonable(
                {k: keys.values[k] for k in _ORDER if k in keys.values}),
            "key_sources": sources,
            "inferred_keys": [k for k, s in sources.items() if s == "inferred"],
            "declared_keys": [k for k, s in sources.items() if s == "declared"],
            "default_keys": [k for k, s in sources.items() if s == "default"],
            "guessed_keys": [k for k, s in sources.items() if s == "guessed"],
            "failure": self.failure,
            "disagreements": self.disagreements,
            "summary": {"files": len({i.file for i in self.ckpt.tensors.values()}), "tensors": len(tensors),
                        "parameters": params,
                        "quantized_matrices": sum(m.kind in ("ternary", "int8x") for m in self.matrices),
                        "float_matrices": sum(m.kind == "float" for m in self.matrices)},
            "tensors": [_jsonable(tensors[k]) for k in natural_sorted(tensors)],
            "matrices": _jsonable(entries),
            "code_table": _jsonable(self.code_table),
            "hypotheses": _jsonable(self.hypotheses),
            "verification": _jsonable(verification),
            "mapping": vllm_mapping(natural_sorted(self.ckpt.tensors), self.shapes, self.by_module, self.roles, layout),
            "warnings": self.warnings,
            "notes": self.notes,
        }


def natural_sorted(names) -> list[str]:
    """Names in layer order (layers.2 before layers.10)."""
    return sorted(names, key=lambda s: [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", s)])


def _show(value: Any) -> str:
    return repr(list(value)) if isinstance(value, tuple) else repr(value)


def _jsonable(x: Any) -> Any:
    """Tuples to lists; NaN / inf to strings (strict JSON has no spelling for them)."""
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    return x


def inspect_checkpoint(path: str | Path, against: str | Path | None = None) -> dict[str, Any]:
    """The report of ``parity inspect PATH [--against FLOAT]`` as plain data (the --json output)."""
    return Inspection(path, against).run()
