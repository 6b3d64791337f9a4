"""Repack any ``ternary`` checkpoint variant (shared FORMATS.md section 1) into the kernels' one layout.

Done once at load time (vLLM's ``process_weights_after_loading``), so no kernel ever looks at
pack_axis, pack_layout, bit_order, code_map, scale granularity or scale_mode.

Native layout (:class:`NativeTernary`):

- ``qweight``: int32 ``(N, Kw)`` with ``Kw = ceil(K / 16)``. Weight ``(n, k)`` lives in word
  ``(n, k // 16)`` in a 2-bit field, low bit = nonzero, high bit = negative: 0b00 = 0, 0b01 = +1,
  0b11 = -1 (0b10 never written); K pads with zero weights. With ``e = k % 16`` the field starts
  at bit ``FIELD_BIT[e] = 2 * (e // 2) + 16 * (e % 2)``: even e in the low half-word, odd e in
  the high one, so one shift and one AND with 0xC000C000 give the fp16 / bf16 bit patterns of
  +-2.0 or 0 for the adjacent pair (e, e + 1) already packed as a half2, ready for an MMA
  operand; for fp32 a field shifted onto bits 30..31 and masked is +-2.0 or 0 likewise.
- ``scale``: fp32 ``(N, G)``: G = 1 for tensor and channel scales (a tensor scale repeated over N),
  G = K / group_size for group scales, already inverted for ``scale_mode = "divide"``.
- ``group_size``: 0 for one scale per output channel, else the checkpoint's group size.
- ``act_quant``: FORMATS.md ``activation_quant = "per_token_absmax_int8"``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from references.errors import DecodeError, FormatError
from references.formats import TernarySpec
from references.ternary import unpack_values

WORD_CODES = 16  # 2-bit fields per int32 word
FIELD_BIT = tuple(2 * (e // 2) + 16 * (e % 2) for e in range(WORD_CODES))


@dataclass(frozen=True)
class NativeTernary:
    """A ternary weight in the kernels' layout (see the module docstring)."""

    qweight: torch.Tensor  # int32 (N, ceil(K/16))
    scale: torch.Tensor  # float32 (N, G)
    n: int
    k: int
    group_size: int  # 0: per output channel
    act_quant: bool

    def __post_init__(self) -> None:
        kw = -(-self.k // WORD_CODES)
        if self.qweight.dtype != torch.int32 or tuple(self.qweight.shape) != (self.n, kw):
            raise FormatError(f"native qweight must be int32 {(self.n, kw)}, got "
                              f"{self.qweight.dtype} {tuple(self.qweight.shape)}")
        groups = 1 if self.group_size == 0 else self.k // self.group_size
        if self.scale.dtype != torch.float32 or tuple(self.scale.shape) != (self.n, groups):
            raise FormatError(f"native scale must be float32 {(self.n, groups)}, got "
                              f"{self.scale.dtype} {tuple(self.scale.shape)}")
        if self.qweight.device != self.scale.device:
            raise FormatError(f"native qweight on {self.qweight.device}, scale on {self.scale.device}")

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    @property
    def nbytes(self) -> int:
        return self.qweight.numel() * 4 + self.scale.numel() * 4

    def to(self, device: torch.device | str) -> "NativeTernary":
        return replace(self, qweight=self.qweight.to(device), scale=self.scale.to(device))


def repack(packed: torch.Tensor, scale: torch.Tensor, spec: TernarySpec, n: int, k: int,
           name: str = "weight") -> NativeTernary:
    """Checkpoint tensors of any FORMATS.md ternary variant -> :class:`NativeTernary`, on their device.

    Raises FormatError for wrong shapes or dtypes and DecodeError for codes that ``code_map``
    marks as must-not-occur, non-finite scales, or zero scales under ``scale_mode = "divide"``.
    """
    want = spec.packed_shape(n, k)
    if packed.dtype != torch.uint8:
        raise FormatError(f"{name}: packed ternary weight must be uint8, got {packed.dtype}")
    if tuple(packed.shape) != want:
        raise FormatError(f"{name}: packed shape {tuple(packed.shape)}, expected {want} "
                          f"(pack_axis={spec.pack_axis!r}, logical ({n}, {k}))")
    if scale.device != packed.device:
        raise FormatError(f"{name}: packed weight on {packed.device}, scale on {scale.device}")
    values = unpack_values(packed, spec, name)  # int8 (N, K) on packed's device; null codes rejected
    return NativeTernary(qweight=pack_native(values), scale=_native_scale(scale, spec, n, k, name),
                         n=n, k=k, group_size=_native_group(spec, k),
                         act_quant=spec.activation_quant == "per_token_absmax_int8")


def pack_native(values: torch.Tensor) -> torch.Tensor:
    """Ternary values ``(N, K)`` (any integer or float dtype, entries in {-1, 0, 1}) -> int32 ``(N, Kw)``."""
    n, k = values.shape
    kw = -(-k // WORD_CODES)
    v = values.to(torch.int64)
    field = (v != 0).to(torch.int64) | ((v < 0).to(torch.int64) << 1)
    if kw * WORD_CODES != k:
        field = torch.cat([field, field.new_zeros(n, kw * WORD_CODES - k)], dim=1)
    field = field.reshape(n, kw, WORD_CODES)
    words = torch.zeros(n, kw, dtype=torch.int64, device=values.device)
    for e in range(WORD_CODES):
        words |= field[:, :, e] << FIELD_BIT[e]
    # Bit 31 set -> the same bit pattern as a negative int32.
    return (words - ((words >> 31) << 32)).to(torch.int32).contiguous()


def unpack_native(qweight: torch.Tensor, k: int) -> torch.Tensor:
    """Inverse of :func:`pack_native`: int8 values ``(N, K)``."""
    n, kw = qweight.shape
    shifts = torch.tensor(FIELD_BIT, device=qweight.device, dtype=torch.int32)
    field = (qweight.unsqueeze(-1) >> shifts) & 3  # (N, Kw, 16)
    field = field.reshape(n, kw * WORD_CODES)[:, :k]
    values = (field & 1) * (1 - (field & 2))  # 0b01 -> +1, 0b11 -> -1, 0b00 -> 0
    return values.to(torch.int8).contiguous()


def native_weight(native: NativeTernary, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The dense ``(N, K)`` weight that the native layout encodes (values times folded scale)."""
    values = unpack_native(native.qweight, native.k).to(dtype)
    s = native.scale.to(dtype)
    if native.group_size == 0:
        return values * s
    return values * s.repeat_interleave(native.group_size, dim=1)


def _native_group(spec: TernarySpec, k: int) -> int:
    if spec.scale_granularity != "group" or spec.group_size >= k:
        return 0  # one group spanning K is a per-channel scale
    return spec.group_size


def _native_scale(scale: torch.Tensor, spec: TernarySpec, n: int, k: int, name: str) -> torch.Tensor:
    want = spec.scale_shape(n, k)
    if tuple(scale.shape) != want:
        raise FormatError(f"{name} scale: shape {tuple(scale.shape)}, expected {want} "
                          f"for {spec.scale_granularity} scales of a ({n}, {k}) weight")
    if not scale.dtype.is_floating_point:
        raise FormatError(f"{name} scale: must be a float tensor, got {scale.dtype}")
    s = scale.to(torch.float64)
    if not bool(torch.isfinite(s).all()):
        raise DecodeError(f"{name}: scale holds NaN or Inf")
    if spec.scale_mode == "divide":
        if bool((s == 0).any()):
            raise DecodeError(f"{name}: scale holds zeros, but scale_mode 'divide' divides by it")
        # The reciprocal rounded once to fp32: x * fp32(1/s) stays within fp32 rounding of x / s.
        s = 1.0 / s
    s = s.to(torch.float32)
    if spec.scale_granularity == "tensor":
        return s.reshape(1, 1).expand(n, 1).contiguous()
    return s.reshape(n, -1).contiguous()  # (N, 1) per channel, (N, K / group_size) per group
