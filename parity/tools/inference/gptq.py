"""GPTQ checkpoints in ``parity inspect``: ``qweight`` ``(K/8, N)``, ``qzeros``, ``scales`` per group and
``g_idx``; the group size from the scales' rows, activation order from ``g_idx``, symmetry from the zero points,
each matrix decoded by the reference."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from vllm_parity.reference.formats import gptq
from vllm_parity.reference.formats.gptq import GptqSpec
from vllm_parity.tools.inference.awq import claim, describe_grouped, text_row_grouped
from vllm_parity.tools.inference.keys import Keys
from vllm_parity.tools.inference.registry import Format, register

if TYPE_CHECKING:
    from vllm_parity.tools.inference.inspection import Inspection

NAMES = ("qweight", "qzeros", "scales")


@register
class GptqFormat(Format):
    quant_method = "gptq"
    looks_like = "GPTQ words (qweight (K/8, N), qzeros, scales, g_idx)"
    specificity = 1
    key_order = ("quant_method", "bits", "group_size", "desc_act", "sym", "checkpoint_format")
    consequences = {"group_size": "vLLM applies each scale to the wrong inputs",
                    "desc_act": "vLLM reads the inputs' groups in the wrong order",
                    "sym": "vLLM subtracts the wrong zero points"}

    def scan(self, module, n, k, entries, info, declared, roles):
        return claim(module, n, k, "gptq", entries, info, roles, (*NAMES, "g_idx"), (k // 8, n))

    def fit(self, insp: Inspection) -> None:
        keys = insp.keys = Keys(insp.declared_raw, insp.declared, GptqSpec())
        keys.set("quant_method", "gptq", "inferred")
        for key in ("checkpoint_format", "modules_to_not_convert"):
            keys.take_fallback(key)
        mats = insp.good("gptq")
        if not mats:
            insp.failure = "no GPTQ matrix could be read (see the warnings)"
            return
        keys.set("bits", 4, "inferred")
        ckpt = insp.ckpt
        groups = {m.module: m.k // ckpt.tensors[m.keys["scales"]].shape[0] for m in mats}
        insp.shared(keys, "group_size", groups)
        if insp.failure:
            return
        g = keys.values["group_size"]
        insp.shared(keys, "desc_act", {m.module: "g_idx" in m.keys and not torch.equal(
            ckpt.tensor(m.keys["g_idx"]).to(torch.int64), torch.arange(m.k) // g) for m in mats})
        insp.shared(keys, "sym", {m.module: bool((gptq.unpack(ckpt.tensor(m.keys["qzeros"])) == 7).all())
                                  for m in mats})
        insp.build_spec()

    def build_spec(self, values: dict[str, Any]) -> GptqSpec:
        return GptqSpec(bits=values["bits"], group_size=values["group_size"], desc_act=values["desc_act"],
                        sym=values["sym"], checkpoint_format=values["checkpoint_format"],
                        modules_to_not_convert=values["modules_to_not_convert"])

    def describe(self, insp, m, entry, tensor_pass) -> None:
        describe_grouped(insp, m, entry, tensor_pass, GptqSpec)

    def text_row(self, entry: dict[str, Any]) -> list[str]:
        return text_row_grouped(entry, "gptq")
