"""A user's format on the reference floor: ``parity_dummy_int8``, int8 weights with one fp32 scale per output
channel (``<module>.weight_q``, ``<module>.weight_scale``); spec, encoder and the reference's decoder."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vllm_parity.reference.formats import FLOAT_DTYPES, FormatSpec, build, register


@register
@dataclass(frozen=True)
class DummyInt8Spec(FormatSpec):
    ignore: tuple[str, ...] = ("lm_head",)

    quant_method = "parity_dummy_int8"

    @classmethod
    def from_config(cls, body: dict[str, Any]) -> DummyInt8Spec:
        return build(cls, body, {"ignore"}, ("ignore",))

    def to_config(self) -> dict[str, Any]:
        return {"quant_method": self.quant_method, "ignore": list(self.ignore)}

    def tensor_names(self, module: str) -> dict[str, str]:
        return {"q": f"{module}.weight_q", "scale": f"{module}.weight_scale"}

    def read_stored(self, ckpt, module: str, n: int, k: int) -> dict[str, torch.Tensor]:
        names = self.tensor_names(module)
        return {"q": ckpt.expect(names["q"], (n, k), (torch.int8,)),
                "scale": ckpt.expect(names["scale"], (n,), FLOAT_DTYPES)}

    def decode(self, stored, n: int, k: int, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (stored["q"].double() * stored["scale"].double()[:, None]).to(dtype)

    def code_step(self, ckpt, module: str) -> torch.Tensor:
        return ckpt.tensor(self.tensor_names(module)["scale"]).double().abs()


def encode(w: torch.Tensor) -> dict[str, torch.Tensor]:
    scale = (w.abs().amax(dim=1) / 127).clamp_min(1e-8).float()
    return {"q": (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8), "scale": scale}
