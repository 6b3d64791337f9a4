"""The format's reference side for vllm-parity: parse its ``quantization_config``, read and decode its tensors
(this package's truth; its vLLM method decodes with its own code, ``serving.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vllm_parity.errors import DecodeError, FormatError
from vllm_parity.reference.formats import FLOAT_DTYPES, FormatSpec, build


@dataclass(frozen=True)
class ExampleInt4Spec(FormatSpec):
    group_size: int = 32
    ignore: tuple[str, ...] = ("lm_head",)

    quant_method = "example_int4"

    def __post_init__(self) -> None:
        if not isinstance(self.group_size, int) or self.group_size <= 0 or self.group_size % 2:
            raise FormatError(f"example_int4 group_size must be a positive even integer, got {self.group_size!r}")

    @classmethod
    def from_config(cls, body: dict[str, Any]) -> ExampleInt4Spec:
        return build(cls, body, {"group_size", "ignore"}, ("ignore",))

    def to_config(self) -> dict[str, Any]:
        return {"quant_method": self.quant_method, "group_size": self.group_size, "ignore": list(self.ignore)}

    def tensor_names(self, module: str) -> dict[str, str]:
        return {"qweight": f"{module}.qweight", "qscale": f"{module}.qscale"}

    def read_stored(self, ckpt, module: str, n: int, k: int) -> dict[str, torch.Tensor]:
        if k % self.group_size:
            raise FormatError(f"{module}: in_features {k} is not divisible by group_size {self.group_size}")
        names = self.tensor_names(module)
        return {"qweight": ckpt.expect(names["qweight"], (n, k // 2), (torch.uint8,)),
                "qscale": ckpt.expect(names["qscale"], (n, k // self.group_size), FLOAT_DTYPES)}

    def decode(self, stored, n: int, k: int, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        b = stored["qweight"].to(torch.int16)
        codes = torch.stack([b & 0xF, b >> 4], dim=-1).reshape(n, k)  # the low nibble is the first input
        scale = stored["qscale"].to(dtype)
        if not bool(torch.isfinite(scale).all()):
            raise DecodeError(f"{name}.qscale holds NaN or Inf")
        return (codes.to(dtype) - 8) * scale.repeat_interleave(self.group_size, dim=1)

    def code_step(self, ckpt, module: str) -> torch.Tensor:
        return ckpt.tensor(self.tensor_names(module)["qscale"]).double().abs()


def encode(weight: torch.Tensor, group_size: int = 32) -> dict[str, torch.Tensor]:
    """Round-to-nearest codes and scales of one ``(N, K)`` float weight."""
    n, k = weight.shape
    w = weight.to(torch.float32).reshape(n, k // group_size, group_size)
    scale = (w.abs().amax(-1) / 7).clamp(min=1e-8).to(torch.float16)
    codes = ((w / scale.to(torch.float32)[..., None]).round().clamp(-8, 7) + 8).to(torch.uint8).reshape(n, k)
    return {"qweight": codes[:, 0::2] | (codes[:, 1::2] << 4), "qscale": scale}


def quantize(src, out, group_size: int = 32):
    """A float checkpoint directory with every projection but ``lm_head`` stored as ``example_int4``."""
    from vllm_parity.fixtures.checkpoints import read_float_checkpoint, write_checkpoint
    from vllm_parity.reference.checkpoint import linear_shapes

    config, tensors = read_float_checkpoint(src)
    for module in linear_shapes(config):
        if module != "lm_head" and f"{module}.weight" in tensors:
            for key, t in encode(tensors.pop(f"{module}.weight"), group_size).items():
                tensors[f"{module}.{key}"] = t
    config["quantization_config"] = ExampleInt4Spec(group_size=group_size).to_config()
    return write_checkpoint(out, config, tensors)
