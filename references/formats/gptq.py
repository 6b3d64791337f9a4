"""The ``gptq`` format (AutoGPTQ / GPTQModel checkpoints, ``checkpoint_format: gptq``), by its documented
layout: 4-bit codes with a zero point and an fp16 scale per group and output channel, the group of each input
given by ``g_idx``.

- ``qweight`` int32 ``(K/8, N)``: word ``r`` packs inputs ``8r..8r+7``, input ``8r + i`` in bits ``4i..4i+3``;
- ``qzeros`` int32 ``(G, N/8)``: word ``j`` packs channels ``8j..8j+7`` the same way, each stored as its zero
  point minus one (the ``gptq`` checkpoint format; 7 for a symmetric 4-bit zero point of 8);
- ``scales`` ``(G, N)``; ``g_idx`` int32 ``(K,)`` (``k // group_size`` unless activation order permuted it);
- ``W[n, k] = (q[k, n] - (z[g_idx[k], n] + 1)) · s[g_idx[k], n]``.
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

G_IDX_DTYPES = (torch.int32, torch.int64)


@register
@dataclass(frozen=True)
class GptqSpec(GroupScaled4Bit, FormatSpec):
    """A GPTQ ``quantization_config``."""

    bits: int = 4
    group_size: int = 128
    desc_act: bool = False
    sym: bool = True
    checkpoint_format: str = "gptq"
    modules_to_not_convert: tuple[str, ...] | None = None

    quant_method = "gptq"

    def __post_init__(self) -> None:
        if self.bits != 4:
            raise FormatError(f"gptq bits = {self.bits!r}: only 4-bit codes are decoded (vLLM's CPU kernels serve "
                              f"4-bit only)")
        if self.checkpoint_format != "gptq":
            raise FormatError(f"gptq checkpoint_format = {self.checkpoint_format!r}: only 'gptq' (zero points "
                              f"stored minus one) is decoded")
        if not isinstance(self.group_size, int) or isinstance(self.group_size, bool) or \
                not (self.group_size > 0 or self.group_size == -1):
            raise FormatError(f"gptq group_size must be a positive integer or -1, got {self.group_size!r}")

    @classmethod
    def from_config(cls, body: dict[str, Any]) -> GptqSpec:
        body = {k: v for k, v in body.items() if not (k == "modules_to_not_convert" and v is None)}
        for extra in ("damp_percent", "true_sequential", "static_groups", "model_name_or_path",
                      "model_file_base_name", "quantizer", "meta", "lm_head", "pack_dtype", "damp_auto_increment"):
            body.pop(extra, None)  # how it was quantized, not how it is stored
        return build(cls, body, {"bits", "group_size", "desc_act", "sym", "checkpoint_format",
                                 "modules_to_not_convert"}, ("modules_to_not_convert",))

    def to_config(self) -> dict[str, Any]:
        return {"quant_method": "gptq", "bits": self.bits, "group_size": self.group_size,
                "desc_act": self.desc_act, "sym": self.sym, "checkpoint_format": self.checkpoint_format}

    def groups(self, k: int) -> int:
        return 1 if self.group_size == -1 else k // self.group_size

    def tensor_names(self, module: str) -> dict[str, str]:
        return {r: f"{module}.{r}" for r in ("qweight", "qzeros", "scales", "g_idx")}

    def stored_shapes(self, module: str, n: int, k: int) -> dict[str, tuple[tuple[int, ...], tuple[torch.dtype, ...]]]:
        """Role -> (shape, dtypes) of the stored tensors; ``g_idx`` (optional) is checked apart."""
        if n <= 0 or k <= 0 or k % 8 or n % 8 or (self.group_size != -1 and k % self.group_size):
            raise FormatError(f"{module}: ({n}, {k}) cannot be stored as gptq: in and out features must divide by 8 "
                              f"and in_features by group_size={self.group_size}")
        g = self.groups(k)
        return {"qweight": ((k // 8, n), (torch.int32,)), "qzeros": ((g, n // 8), (torch.int32,)),
                "scales": ((g, n), FLOAT_DTYPES)}

    def read_stored(self, ckpt: Checkpoint, module: str, n: int, k: int) -> dict[str, torch.Tensor]:
        names = self.tensor_names(module)
        out = {role: ckpt.expect(names[role], shape, dtypes)
               for role, (shape, dtypes) in self.stored_shapes(module, n, k).items()}
        if names["g_idx"] in ckpt:
            out["g_idx"] = self._check_g_idx(ckpt.expect(names["g_idx"], (k,), G_IDX_DTYPES), k, names["g_idx"])
        return out

    def _check_g_idx(self, g_idx: torch.Tensor, k: int, where: str) -> torch.Tensor:
        g = self.groups(k)
        if bool(((g_idx < 0) | (g_idx >= g)).any()):
            raise DecodeError(f"{where}: group indices outside 0..{g - 1}")
        return g_idx

    def decode(self, stored: dict[str, torch.Tensor], n: int, k: int, name: str,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
        expect_stored(stored, self.stored_shapes(name, n, k), name)
        if stored.get("g_idx") is not None:
            expect_stored(stored, {"g_idx": ((k,), G_IDX_DTYPES)}, name)
            self._check_g_idx(stored["g_idx"], k, f"{name}.g_idx")
        q = unpack(stored["qweight"].T).T  # (K, N): word r of column n holds inputs 8r..8r+7
        z = unpack(stored["qzeros"]) + 1  # (G, N)
        s = stored["scales"].to(dtype)
        if not bool(torch.isfinite(s).all()):
            raise DecodeError(f"{name}.scales holds NaN or Inf")
        g_idx = stored.get("g_idx")
        g_idx = torch.arange(k) // (k if self.group_size == -1 else self.group_size) if g_idx is None \
            else g_idx.to(torch.int64)
        return ((q.to(dtype) - z[g_idx].to(dtype)) * s[g_idx]).T.contiguous()


def unpack(words: torch.Tensor) -> torch.Tensor:
    """``(R, C)`` int32 words -> ``(R, 8C)`` codes 0..15, value ``8c + i`` from bits ``4i..4i+3`` of word c."""
    return unpack_nibbles(words).reshape(words.shape[0], -1)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """``(R, 8C)`` codes 0..15 -> ``(R, C)`` int32 words (the inverse of :func:`unpack`)."""
    if codes.shape[-1] % 8:
        raise FormatError("gptq packs 8 codes a word")
    return pack_nibbles(codes.reshape(codes.shape[0], -1, 8), "gptq")
