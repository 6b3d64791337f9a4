"""AutoAWQ's GEMM checkpoints in ``parity inspect``: ``qweight`` ``(K, N/8)``, ``qzeros`` and ``scales`` per group;
the bits from the words' width, the group size from the scales' rows, each matrix decoded by the reference."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm_parity.reference.formats.awq import AwqSpec
from vllm_parity.tools.inference.keys import Keys
from vllm_parity.tools.inference.layout import Matrix
from vllm_parity.tools.inference.registry import Format, decoded_entry, register
from vllm_parity.tools.inference.text import pct, shape

if TYPE_CHECKING:
    from vllm_parity.tools.inference.inspection import Inspection, TensorPass

NAMES = ("qweight", "qzeros", "scales")


def describe_grouped(insp: Inspection, m: Matrix, entry: dict[str, Any], tensor_pass: TensorPass, spec_type) -> None:
    """A grouped 4-bit matrix's entry (AWQ's or GPTQ's): bits a weight stored, zeros, the check against floats."""
    t = {s: tensor_pass.read(key) for s, key in m.keys.items()}
    entry.update(group_size=m.k // t["scales"].shape[0],
                 bits_per_weight=sum(v.numel() * v.element_size() * 8 for v in t.values()) / (m.n * m.k))
    decoded_entry(insp, m, entry, tensor_pass, spec_type)


def claim(module: str, n: int, k: int, kind: str, entries: dict, info: dict, roles: dict, names: tuple[str, ...],
          packed: tuple[int, int]) -> Matrix | None:
    """A projection of a grouped 4-bit format: its tensors ``names`` present and ``qweight`` of shape ``packed``."""
    if not all(s in entries for s in names[:3]) or tuple(info["qweight"].shape) != packed:
        return None
    m = Matrix(module, n, k, kind, stored_shape=packed)
    for s in names:
        if s in entries:
            m.keys[s] = entries[s]
            roles[entries[s]] = f"{kind} {s}"
    return m


def text_row_grouped(entry: dict[str, Any], what: str) -> list[str]:
    return [entry["module"], shape(entry["logical_shape"]), what, "8 a word", f"group {entry.get('group_size')}",
            pct(entry.get("zero_fraction")), "-", f"{entry['bits_per_weight']:.3f}"]


@register
class AwqFormat(Format):
    quant_method = "awq"
    looks_like = "AWQ words (qweight (K, N/8), qzeros, scales)"
    specificity = 1
    key_order = ("quant_method", "bits", "group_size", "zero_point", "version")
    consequences = {"group_size": "vLLM applies each scale to the wrong inputs"}

    def scan(self, module, n, k, entries, info, declared, roles) -> Matrix | None:
        return claim(module, n, k, "awq", entries, info, roles, NAMES, (k, n // 8))

    def fit(self, insp: Inspection) -> None:
        keys = insp.keys = Keys(insp.declared_raw, insp.declared, AwqSpec())
        keys.set("quant_method", "awq", "inferred")
        for key in ("zero_point", "version", "modules_to_not_convert"):
            keys.take_fallback(key)
        mats = insp.good("awq")
        if not mats:
            insp.failure = "no AWQ matrix could be read (see the warnings)"
            return
        keys.set("bits", 4, "inferred")  # 8 codes a 32-bit word
        insp.shared(keys, "group_size", {m.module: m.k // insp.ckpt.tensors[m.keys["scales"]].shape[0]
                                         for m in mats})
        insp.build_spec()

    def build_spec(self, values: dict[str, Any]) -> AwqSpec:
        return AwqSpec(bits=values["bits"], group_size=values["group_size"], zero_point=values["zero_point"],
                       version=values["version"], modules_to_not_convert=values["modules_to_not_convert"])

    def describe(self, insp, m, entry, tensor_pass) -> None:
        describe_grouped(insp, m, entry, tensor_pass, AwqSpec)

    def text_row(self, entry: dict[str, Any]) -> list[str]:
        return text_row_grouped(entry, "awq gemm")

