"""The ``int8x`` format in ``parity inspect``: INT8 weights stored losslessly as 3/5/8-bit level streams.

Its tensors bear names of their own (``weight_b1``, ``weight_l3``, ...); the block size is the one whose
prefix counts of the level bitmap reproduce the block tables; the levels, bits per weight and zero
fraction come from decoding the streams.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from vllm_parity.errors import ParityInputError
from vllm_parity.reference.formats import int8x
from vllm_parity.reference.formats.int8x import Int8xSpec
from vllm_parity.tools.inference.keys import Keys
from vllm_parity.tools.inference.layout import Matrix
from vllm_parity.tools.inference.registry import Format, register
from vllm_parity.tools.inference.stats import compare
from vllm_parity.tools.inference.text import pct, shape

if TYPE_CHECKING:
    from vllm_parity.tools.inference.inspection import Inspection, TensorPass

DEFAULT = Int8xSpec()
_OWN = set(Int8xSpec.suffixes) - {"weight_scale"}  # a ternary scale may share that name


def scan_projection(module: str, n: int, k: int, entries: dict, info: dict, declared: Any,
                    roles: dict) -> Matrix | None:
    """A projection with any of int8x's own stream names: its streams, each one's role."""
    if not any(s in _OWN for s in entries):
        return None
    m = Matrix(module, n, k, "int8x")
    for s in Int8xSpec.suffixes:
        if s in entries:
            m.keys[s] = entries[s]
            roles[entries[s]] = f"int8x {s.removeprefix('weight_')}"
    missing = [s for s in Int8xSpec.suffixes if s not in entries]
    if missing:
        m.problems.append(f"{module}: int8x tensors missing: {', '.join(module + '.' + s for s in missing)}")
    return m


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


@register
class Int8xFormat(Format):
    quant_method = "int8x"
    looks_like = "int8x streams"
    specificity = 1  # its stream names are its own
    key_order = ("quant_method", "ignore", "levels", "block_size")  # the keys common with ternary's first
    consequences = {"block_size": "a loader rejects the block tables"}

    def scan(self, module, n, k, entries, info, declared, roles) -> Matrix | None:
        return scan_projection(module, n, k, entries, info, declared, roles)

    def fit(self, insp: Inspection) -> None:
        self._block_size(insp)
        insp.build_spec()

    def _block_size(self, insp: Inspection) -> None:
        mats = insp.good("int8x")
        keys = insp.keys = Keys(insp.declared_raw, insp.declared, DEFAULT)
        keys.set("quant_method", "int8x", "inferred")
        keys.take_fallback("ignore")
        if not mats:
            keys.take_fallback("levels")
            keys.take_fallback("block_size")
            insp.failure = "no int8x matrix could be read (see the warnings)"
            return
        keys.set("levels", DEFAULT.levels, "inferred")  # fixed in this version; decoding checks the widths
        exact: set[int] | None = None
        bound = 0
        for m in mats:
            t = {s: insp.ckpt.tensor(m.keys[s]) for s in ("weight_shape", "weight_b1", "weight_b1_blk")}
            try:
                n = int(t["weight_shape"][0]) * int(t["weight_shape"][1])
                cands, lo = int8x_block_sizes(t, n)
            except (ValueError, IndexError, RuntimeError) as exc:
                insp.warnings.append(f"{m.module}: int8x bitmaps unreadable: {exc}")
                continue
            bound = max(bound, lo)
            if cands is not None:
                exact = cands if exact is None else exact & cands
                if not exact:
                    insp.warnings.append(f"{m.module}: weight_b1_blk matches no block_size shared with the "
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
            insp.failure = "no block_size (multiple of 32) matches the block tables"
            insp.warnings.append(f"int8x: {insp.failure}")

    def build_spec(self, values: dict[str, Any]) -> Int8xSpec:
        return Int8xSpec(levels=tuple(values["levels"]), block_size=values["block_size"],
                         ignore=tuple(values["ignore"]))

    def describe(self, insp: Inspection, m: Matrix, entry: dict[str, Any], tensor_pass: TensorPass) -> None:
        t = {s: tensor_pass.read(key) for s, key in m.keys.items()}
        if m.problems:
            return
        spec = insp.spec if isinstance(insp.spec, Int8xSpec) else Int8xSpec(
            block_size=insp.keys.values.get("block_size", DEFAULT.block_size) if insp.keys else 1024)
        try:
            q = int8x.decode_int8(t, spec, m.module)
            scale = int8x.scale_of(t, m.module)
        except ParityInputError as exc:
            insp.warnings.append(f"{m.module}: int8x streams do not decode: {exc}")
            entry["error"] = str(exc)
            if insp.fck is not None:
                tensor_pass.checks.append({"module": m.module, "exact": False, "error": str(exc),
                                           "max_abs_error": None})
            return
        if tuple(q.shape) != (m.n, m.k):
            insp.warnings.append(f"{m.keys['weight_shape']}: [{q.shape[0]}, {q.shape[1]}], but config.json gives "
                                 f"{m.module} the shape ({m.n}, {m.k})")
        lv = int8x.levels(q)
        bpw = int8x.bits_per_weight(t)
        entry.update(scale=scale, levels={"l1": lv["l1"], "l2": lv["l2"], "l3": lv["l3"]},
                     level_counts={"n1": lv["n1"], "n2": lv["n2"], "n3": lv["n3"]},
                     bits_per_weight=bpw["bits_per_weight"],
                     block_tables_bits_per_weight=bpw["block_tables_bits_per_weight"],
                     per_stream_bits_per_weight=bpw["per_stream"],
                     zero_fraction=float((q == 0).sum()) / q.numel(), zero_fraction_source="int8 values")
        if insp.fck is not None and tuple(q.shape) == (m.n, m.k):
            w = insp.fck.tensor(f"{m.module}.weight")
            # q * scale is exact in fp64: the reference decode (int8x.decode) rounds it once to W's dtype.
            tensor_pass.checks.append({"module": m.module, **compare(q.to(torch.float64) * scale, w)})

    def stacked_row(self, row, m, role, slot, values) -> None:
        if role.startswith("int8x"):
            row["tp_split"] = "not sliceable"
            row["note"] = "int8x streams are flat bit streams: one stream set per shard, not row slices"

    def row_parallel_row(self, row, m, role) -> None:
        if role.startswith("int8x"):
            row["tp_split"] = "not sliceable"
            row["note"] = "int8x streams are flat bit streams: not split by columns"

    def text_row(self, entry: dict[str, Any]) -> list[str]:
        lv = entry.get("levels")
        detail = (f"L1/L2/L3 {pct(lv['l1'])}/{pct(lv['l2'])}/{pct(lv['l3'])}" if lv
                  else f"error: {entry.get('error', '?')}")
        bpw = f"{entry['bits_per_weight']:.3f}" if "bits_per_weight" in entry else "-"
        if "block_tables_bits_per_weight" in entry:
            bpw += f" (+{entry['block_tables_bits_per_weight']:.3f} tables)"
        return [entry["module"], shape(entry["logical_shape"]), "int8x streams", "-", "tensor",
                pct(entry.get("zero_fraction")), detail, bpw]
