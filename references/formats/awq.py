"""The ``awq`` format (AutoAWQ's GEMM checkpoints), by its documented layout: 4-bit unsigned codes with a zero
point and an fp16 scale per group of ``group_size`` inputs and output channel.

- ``qweight`` int32 ``(K, N/8)``: each word packs 8 output channels, nibble ``i`` (bits ``4i..4i+3``) holding
  channel ``8j + ORDER[i]``, ``ORDER = (0, 2, 4, 6, 1, 3, 5, 7)``;
- ``qzeros`` int32 ``(K/group_size, N/8)``, packed the same way; ``scales`` ``(K/group_size, N)``;
- ``W[n, k] = (q[k, n] - z[k // g, n]) · s[k // g, n]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from vllm_parity.errors import DecodeError, FormatError
from vllm_parity.reference.formats import (FLOAT_DTYPES, FormatSpec, GroupScaled4Bit, build, expect_stored,
                                         pack_nibbles, register, unpack_nibbles)

if TYPE_CHECKING:
    from vllm_parity.reference.checkpoint import Checkpoint

ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds output channel 8j + ORDER[i]


@register
@dataclass(frozen=True)
class AwqSpec(GroupScaled4Bit, FormatSpec):
    """An AutoAWQ ``quantization_config``."""

    bits: int = 4
    group_size: int = 128
    zero_point: bool = True
    version: str = "gemm"
    modules_to_not_convert: tuple[str, ...] | None = None

    quant_method = "awq"

    def __post_init__(self) -> None:
        if self.bits != 4:
            raise FormatError(f"awq bits = {self.bits!r}: the GEMM layout packs 4-bit codes")
        if self.version != "gemm":
            raise FormatError(f"awq version = {self.version!r}: only the GEMM layout is decoded (gemv, marlin: "
                              f"not yet)")
        if not isinstance(self.group_size, int) or isinstance(self.group_size, bool) or self.group_size <= 0:
            raise FormatError(f"awq group_size must be a positive integer, got {self.group_size!r}")
        if not self.zero_point:
            raise FormatError("awq zero_point = false is not decoded (AutoAWQ's GEMM kernels store zero points)")

    @classmethod
    def from_config(cls, body: dict[str, Any]) -> AwqSpec:
        body = {k: v for k, v in body.items() if not (k == "modules_to_not_convert" and v is None)}
        body["version"] = str(body.get("version", "gemm")).lower()
        known = {"bits", "w_bit", "group_size", "q_group_size", "zero_point", "version", "modules_to_not_convert"}
        if "w_bit" in body:  # AutoAWQ's own spelling
            body["bits"] = body.pop("w_bit")
        if "q_group_size" in body:
            body["group_size"] = body.pop("q_group_size")
        return build(cls, body, known, ("modules_to_not_convert",))

    def to_config(self) -> dict[str, Any]:
        return {"quant_method": "awq", "bits": self.bits, "group_size": self.group_size,
                "zero_point": self.zero_point, "version": self.version,
                "modules_to_not_convert": list(self.modules_to_not_convert or []) or None}

    def tensor_names(self, module: str) -> dict[str, str]:
        return {r: f"{module}.{r}" for r in ("qweight", "qzeros", "scales")}

    def stored_shapes(self, module: str, n: int, k: int) -> dict[str, tuple[tuple[int, ...], tuple[torch.dtype, ...]]]:
        if n <= 0 or k <= 0 or n % 8 or k % self.group_size:
            raise FormatError(f"{module}: ({n}, {k}) cannot be stored as awq: out_features must divide by 8 and "
                              f"in_features by group_size={self.group_size}")
        g = k // self.group_size
        return {"qweight": ((k, n // 8), (torch.int32,)), "qzeros": ((g, n // 8), (torch.int32,)),
                "scales": ((g, n), FLOAT_DTYPES)}

    def read_stored(self, ckpt: Checkpoint, module: str, n: int, k: int) -> dict[str, torch.Tensor]:
        names = self.tensor_names(module)
        return {role: ckpt.expect(names[role], shape, dtypes)
                for role, (shape, dtypes) in self.stored_shapes(module, n, k).items()}

    def decode(self, stored: dict[str, torch.Tensor], n: int, k: int, name: str,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
        expect_stored(stored, self.stored_shapes(name, n, k), name)
        q, z = unpack(stored["qweight"]), unpack(stored["qzeros"])  # (K, N), (G, N)
        s = stored["scales"].to(dtype)
        if not bool(torch.isfinite(s).all()):
            raise DecodeError(f"{name}.scales holds NaN or Inf")
        g = torch.arange(k) // self.group_size
        return ((q.to(dtype) - z[g].to(dtype)) * s[g]).T.contiguous()


def unpack(words: torch.Tensor) -> torch.Tensor:
    """``(R, C)`` int32 words -> ``(R, 8C)`` codes 0..15 in channel order."""
    nibbles = unpack_nibbles(words)
    out = torch.empty_like(nibbles)
    out[..., list(ORDER)] = nibbles  # nibble i -> channel ORDER[i]
    return out.reshape(words.shape[0], -1)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """``(R, 8C)`` codes 0..15 in channel order -> ``(R, C)`` int32 words (the inverse of :func:`unpack`)."""
    if codes.shape[-1] % 8:
        raise FormatError("awq packs 8 channels a word")
    return pack_nibbles(codes.reshape(codes.shape[0], -1, 8)[..., list(ORDER)], "awq")  # channel ORDER[i] -> nibble i
