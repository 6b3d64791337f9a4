"""The ``ternary`` format in ``parity inspect``: 2-bit codes packed 4 per byte, with a float scale.

The seed article's method, as code:

- A uint8 tensor of shape ``(N, K/4)`` is packed along the input axis, ``(N/4, K)`` along the output axis
  (``(N, K)`` from config.json); the scale's shape gives its granularity.
- The 2-bit fields of all bytes give the codes in use (independent of bit order and layout); a code
  that never occurs is ``null``.
- With the dequantized float weights ``W``: each (pack_layout, bit_order) is tried; the right one
  is the one under which every code carries a single sign of ``W`` (that sign is its ``code_map``
  entry). Decoding with ``multiply`` and ``divide`` tells which reproduces ``W``. The result is verified
  by decoding every matrix with the reference decoder.
- Without them, the zero code is the one whose removal leaves a balanced pair of codes.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from vllm_parity.errors import ParityInputError
from vllm_parity.reference.formats import ternary
from vllm_parity.reference.formats.ternary import TernarySpec
from vllm_parity.tools.inference.keys import Keys
from vllm_parity.tools.inference.layout import Matrix, fmt_shape
from vllm_parity.tools.inference.registry import Format, register
from vllm_parity.tools.inference.stats import compare, decode_dtype
from vllm_parity.tools.inference.text import pct, shape

if TYPE_CHECKING:
    from vllm_parity.tools.inference.inspection import Inspection, TensorPass

PACK_FACTOR = 4
HYPOTHESES = (("interleaved", "lsb"), ("interleaved", "msb"), ("blocked", "lsb"), ("blocked", "msb"))
MODES = ("multiply", "divide")
SAMPLE_MATRICES = 7  # matrices searched exhaustively with --against (one layer); the rest are verified
SCREEN_ELEMENTS = 1 << 20  # hypotheses are screened on a slice this large before a full-matrix check
DEFAULT = TernarySpec()
KEYS = tuple(DEFAULT.to_config())


@dataclass
class TernaryMatrix(Matrix):
    pack_axis: str | None = None
    scale_granularity: str | None = None
    group_size: int | None = None

    @property
    def weight_suffix(self) -> str | None:
        key = self.keys.get("weight")
        return key.rpartition(".")[2] if key else None

    @property
    def scale_suffix(self) -> str | None:
        key = self.keys.get("scale")
        return key.rpartition(".")[2] if key else None


# -- the tensors' shapes ------------------------------------------------------------------------


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


def scan_projection(module: str, n: int, k: int, entries: dict, info: dict, declared: Any,
                    roles: dict) -> Matrix | None:
    """A projection with a uint8 tensor: the packed weight and its scale, read from their shapes."""
    packed = [s for s, i in info.items() if i.dtype == torch.uint8]
    if not packed:
        return None
    if len(packed) > 1:
        return Matrix(module, n, k, "unknown", problems=[
            f"{module}: several uint8 tensors ({', '.join(sorted(packed))}); expected one packed weight"])
    wsuffix = packed[0]
    m = TernaryMatrix(module, n, k, "ternary")
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
            f"{m.keys['weight']}: stored shape {fmt_shape(m.stored_shape)} is neither (N, K/4) (input-packed) "
            f"nor (N/4, K) (output-packed) for the logical ({n}, {k}) of config.json"
            + (f" ({'; '.join(why)})" if why else ""))
    scales = {s: granularity_from_shape(i.shape, n, k) for s, i in info.items()
              if s != wsuffix and i.dtype.is_floating_point}
    scales = {s: g for s, g in scales.items() if g is not None}
    if len(scales) > 1:
        prefer = [getattr(declared, "scale_name", None), DEFAULT.scale_name]
        pick = next((s for s in prefer if s in scales), None)
        if pick is None:
            m.problems.append(f"{m.module}: several tensors could be the scale ({', '.join(sorted(scales))})")
            return m
        scales = {pick: scales[pick]}
    if not scales:
        others = ", ".join(f"{s} {fmt_shape(i.shape)}" for s, i in sorted(info.items()) if s != wsuffix)
        m.problems.append(f"{m.module}: no float scale of shape (1,), ({n},) or ({n}, K/group_size) "
                          f"beside the packed weight; found: {others or 'nothing'}")
        return m
    (ssuffix, (gran, gsize)), = scales.items()
    m.keys["scale"] = entries[ssuffix]
    m.scale_granularity, m.group_size = gran, gsize
    roles[entries[ssuffix]] = "scale"
    return m


# -- fitting the hypotheses to the float weights --------------------------------------------------


def _spec(m: TernaryMatrix, **kw: Any) -> TernarySpec:
    return TernarySpec(pack_axis=m.pack_axis, scale_granularity=m.scale_granularity,
                       group_size=m.group_size or DEFAULT.group_size, **kw)


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


def _screen(m: TernaryMatrix, packed: torch.Tensor, scale: torch.Tensor, w: torch.Tensor):
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


def _scale_deviation(m: TernaryMatrix, spec: TernarySpec, packed, scale, w) -> dict[str, float | None]:
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


def fit_ternary(m: TernaryMatrix, packed: torch.Tensor, scale: torch.Tensor, w: torch.Tensor) -> list[dict[str, Any]]:
    """Every (pack_layout, bit_order) hypothesis on one matrix: consistency, code_map, scale modes."""
    signs = torch.sign(w).to(torch.int8)
    if bool((scale < 0).any()):  # a negative scale flips the sign of its weights
        s = ternary.expand_scale(scale, _spec(m), m.n, m.k)
        signs = signs * torch.sign(s).to(torch.int8)
    sp, ss, sw, sn, sk = _screen(m, packed, scale, w)
    sub_signs = signs if sw is w else (signs[:sn] if m.pack_axis == "input" else signs[:, :sk])
    dtype = decode_dtype(w)
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


# -- the format, as the inspection asks it ----------------------------------------------------------


@register
class TernaryFormat(Format):
    quant_method = "ternary"
    looks_like = "a packed uint8 weight"
    specificity = 0  # any uint8 tensor: asked after the formats whose tensors bear names of their own
    key_order = KEYS
    weight_keys = ("pack_layout", "bit_order", "code_map", "scale_mode")
    consequences = {
        "pack_axis": "a loader unpacks along the wrong axis",
        "pack_layout": "a loader scrambles the 4 weights that share a byte",
        "bit_order": "a loader reverses the 4 weights that share a byte",
        "code_map": "a loader decodes wrong signs or zeros",
        "scale_granularity": "a loader broadcasts the scale wrongly",
        "group_size": "a loader applies each scale to the wrong columns",
        "scale_mode": "a loader inverts the scale",
        "weight_name": "a loader does not find the packed weights",
        "scale_name": "a loader does not find the scales",
    }

    def scan(self, module, n, k, entries, info, declared, roles) -> Matrix | None:
        return scan_projection(module, n, k, entries, info, declared, roles)

    def fit(self, insp: Inspection) -> None:
        self._from_shapes(insp)
        keys = insp.keys
        # Code maps are known before the pass with --against or a declared config; otherwise after it.
        if "code_map" not in keys.values and isinstance(insp.declared, TernarySpec):
            keys.take_fallback("code_map")
        if "code_map" in keys.values:
            insp.build_spec()

    def _from_shapes(self, insp: Inspection) -> None:
        mats = insp.good("ternary")
        keys = insp.keys = Keys(insp.declared_raw, insp.declared, DEFAULT)
        keys.set("quant_method", "ternary", "inferred")
        if not mats:
            insp.failure = "no ternary matrix could be read (see the warnings)"
            return
        insp.shared(keys, "pack_axis", {m.module: m.pack_axis for m in mats})
        gran = insp.shared(keys, "scale_granularity", {m.module: m.scale_granularity for m in mats})
        if gran == "group":
            insp.shared(keys, "group_size", {m.module: m.group_size for m in mats})
        else:
            keys.take_fallback("group_size")
        insp.shared(keys, "weight_name", {m.module: m.weight_suffix for m in mats})
        insp.shared(keys, "scale_name", {m.module: m.scale_suffix for m in mats})
        keys.take_fallback("activation_quant")
        keys.take_fallback("ignore")
        if insp.fck is not None:
            self._search(insp, mats, keys)
        else:
            for key in ("pack_layout", "bit_order", "scale_mode"):
                keys.take_fallback(key)

    def _search(self, insp: Inspection, mats: list[TernaryMatrix], keys: Keys) -> None:
        sample = mats[:SAMPLE_MATRICES]
        fits = {m.module: fit_ternary(m, insp.ckpt.tensor(m.keys["weight"]), insp.ckpt.tensor(m.keys["scale"]),
                                      insp.fck.tensor(f"{m.module}.weight")) for m in sample}
        survivors, rejected = combine_fits(fits)
        insp.hypotheses = {"sampled": list(fits), "survivors": survivors, "rejected": rejected,
                           "per_matrix": [f for fs in fits.values() for f in fs]}
        if not survivors:
            best = rejected[0]
            if best["fits"]:
                why = (f"the closest, {best['pack_layout']}/{best['bit_order']}, fits {best['fits']} of {best['of']} "
                       f"sampled matrices but not {', '.join(best['fails_in'])}: {best['reason']}")
            else:
                why = f"every (pack_layout, bit_order) fails, e.g. {best['pack_layout']}/{best['bit_order']}: {best['reason']}"
            insp.failure = "no hypothesis reproduces the float weights"
            insp.warnings.append(f"no quantization_config reproduces the float weights of {insp.fck.path}: {why}")
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
            insp.notes.append(f"the sampled matrices fit {len(survivors)} (pack_layout, bit_order) pairs equally: "
                              f"{', '.join('/'.join(p) for p in pairs)}; took {'/'.join(pairs[survivors.index(chosen)])}")
        keys.set("code_map", tuple(chosen["code_map"]), "inferred")
        if len(chosen["scale_modes"]) > 1:
            insp.notes.append("multiply and divide both reproduce the weights (every scale is 1): scale_mode "
                              "cannot be told from the data")
        keys.choose("scale_mode", chosen["scale_modes"])

    def build_spec(self, values: dict[str, Any]) -> TernarySpec:
        return TernarySpec(**{k: values[k] for k in KEYS if k != "quant_method"})

    def describe(self, insp: Inspection, m: TernaryMatrix, entry: dict[str, Any], tensor_pass: TensorPass) -> None:
        tensors = tensor_pass.tensors
        packed = tensor_pass.read(m.keys["weight"])
        scale = tensor_pass.read(m.keys["scale"]) if "scale" in m.keys else None
        entry.update(pack_axis=m.pack_axis, pack_factor=PACK_FACTOR if m.pack_axis else None,
                     scale_granularity=m.scale_granularity, group_size=m.group_size,
                     code_histogram=tensors[m.keys["weight"]]["code_histogram"])
        for key in (m.keys["weight"], m.keys.get("scale")):
            if key:
                tensors[key].update(module=m.module, pack_axis=m.pack_axis,
                                    pack_factor=entry["pack_factor"] if key == m.keys["weight"] else None)
        if insp.fck is not None and isinstance(insp.spec, TernarySpec) and not m.problems:
            tensor_pass.checks.append(self._check(insp, m, packed, scale, insp.spec))

    @staticmethod
    def _check(insp: Inspection, m: TernaryMatrix, packed, scale, spec: TernarySpec) -> dict[str, Any]:
        w = insp.fck.tensor(f"{m.module}.weight")
        try:
            decoded = ternary.decode(packed, scale, spec, m.n, m.k, name=m.keys["weight"], dtype=decode_dtype(w))
            return {"module": m.module, **compare(decoded, w)}
        except ParityInputError as exc:
            return {"module": m.module, "exact": False, "error": str(exc), "max_abs_error": None}

    def after_pass(self, insp: Inspection, entries: list[dict[str, Any]]) -> None:
        hist = [sum(e["code_histogram"][c] for e in entries if e.get("code_histogram")) for c in range(4)]
        if "code_map" not in insp.keys.values:
            self._code_map_without_weights(insp.keys, hist)
            insp.build_spec()
        self._code_table(insp, hist, entries)

    @staticmethod
    def _code_map_without_weights(keys: Keys, hist: list[int]) -> None:
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

    @staticmethod
    def _code_table(insp: Inspection, hist: list[int], entries: list[dict]) -> None:
        keys = insp.keys
        code_map = keys.values.get("code_map")
        source = keys.sources.get("code_map")
        cands = code_table_candidates(hist)
        declared_map = insp.declared.code_map if isinstance(insp.declared, TernarySpec) else None
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
        insp.code_table = {
            "histogram": hist, "occurring_codes": [c for c in range(4) if hist[c]],
            "never_occurring_codes": [c for c in range(4) if not hist[c]],
            "candidates": cands, "zero_fraction_source": zsource,
        }
        if code_map is not None and not compatible_code_map(code_map, hist):
            bad = [c for c in range(4) if hist[c] and code_map[c] is None]
            where = "config.json's" if source == "declared" else f"the {source}"
            insp.warnings.append(
                f"code_map: {where} code_map {list(code_map)} marks code(s) {bad} as must-not-occur, but they "
                f"occur {sum(hist[c] for c in bad)} times: decoding this checkpoint fails")
            _name_illegal_bytes(insp, entries, bad, TernarySpec(code_map=tuple(code_map)))
        if len(hist) and sum(1 for x in hist if x) == 4:
            insp.notes.append("all four 2-bit codes occur: two codes share a value, or the data is not ternary")

    def diagnose(self, insp: Inspection, m: TernaryMatrix) -> dict[str, Any]:
        fits = fit_ternary(m, insp.ckpt.tensor(m.keys["weight"]), insp.ckpt.tensor(m.keys["scale"]),
                           insp.fck.tensor(f"{m.module}.weight"))
        survivors, rejected = combine_fits({m.module: fits})
        if survivors:
            s = survivors[0]
            text = (f"pack_layout={s['pack_layout']}, bit_order={s['bit_order']}, code_map={s['code_map']}, "
                    f"scale_mode={'/'.join(s['scale_modes'])}")
            insp.warnings.append(f"{m.module}: fits {text} on its own: the matrices do not share one format")
        else:
            text = "; ".join(r["reason"] for r in rejected)
        return {"module": m.module, "survivors": survivors, "rejected": rejected, "text": text}

    def disagrees(self, key: str, data: Any, said: Any, declared: Any) -> bool:
        if key == "group_size" and getattr(declared, "scale_granularity", None) != "group":
            return False
        if key == "code_map":
            # A code the data never uses is null in the inference; a declared value for it is harmless.
            return any(data[c] is not None and said[c] != data[c] for c in range(4))
        return data != said

    def stacked_row(self, row, m: TernaryMatrix, role, slot, values) -> None:
        if role == "packed weight" and m.pack_axis == "output":
            lo, hi = row["rows"]
            row["packed_rows"] = [lo // PACK_FACTOR, hi // PACK_FACTOR]
            row["tp_split"] = "dim 0 (packed rows: each rank's shard rows must divide by 4)"
            if values.get("pack_layout") == "blocked":
                row["note"] = ("blocked output packing: each shard's bytes block its own rows "
                               "(P = shard rows / 4): decode per shard, not the fused tensor as one")
        elif role == "scale" and m.scale_granularity == "tensor":
            row["rows"] = None
            row["slot"] = slot
            row["tp_split"] = "replicated"
            row["note"] = "one scale per shard (a per-tensor scale slot of the fused layer)"

    def row_parallel_row(self, row, m: TernaryMatrix, role) -> None:
        if role == "packed weight" and m.pack_axis == "input":
            row["tp_split"] = "dim 1 (packed columns: each rank's K must divide by 4)"
        elif role == "scale":
            row["tp_split"] = {"tensor": "replicated", "channel": "replicated", "group": "dim 1 (groups)"}.get(
                m.scale_granularity, "dim 1")

    def text_row(self, entry: dict[str, Any]) -> list[str]:
        scale = entry["scale_granularity"] or "-"
        if entry["scale_granularity"] == "group":
            scale += f" {entry['group_size']}"
        packed = f"{entry['pack_axis']} x{entry['pack_factor']}" if entry["pack_axis"] else "?"
        detail = "codes " + "/".join(pct(f) for f in entry["code_fractions"]) if entry.get("code_fractions") else "-"
        return [entry["module"], shape(entry["logical_shape"]), shape(entry["stored_shape"]), packed, scale,
                pct(entry.get("zero_fraction")), detail, "2"]


def _name_illegal_bytes(insp: Inspection, entries: list[dict], bad: list[int], spec: TernarySpec) -> None:
    """One warning per packed tensor holding a must-not-occur code: its file, its name, where, which byte."""
    for e in entries:
        h = e.get("code_histogram")
        if not h or not any(h[c] for c in bad):
            continue
        key = insp.by_module[e["module"]].keys["weight"]
        try:
            ternary.check_bytes(insp.ckpt.tensor(key), spec, f"{insp.ckpt.tensors[key].file.name}: tensor {key!r}")
        except ParityInputError as exc:
            insp.warnings.append(str(exc))
