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
- ``tiles`` (optional, CUDA tensor-core kernel): the same 2-bit fields regrouped so that one 16-byte
  load per lane of a warp is that lane's whole share of an ``mma.m16n8k16`` A operand over a
  ``(16 rows, 128 k)`` tile, and a tile is one contiguous 512-byte run (see :func:`pack_tiles`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

import sys

import torch

from vllm_parity.errors import DecodeError, FormatError
from vllm_parity.reference.formats.ternary import TernarySpec

WORD_CODES = 16  # 2-bit fields per int32 word
FIELD_BIT = tuple(2 * (e // 2) + 16 * (e % 2) for e in range(WORD_CODES))
if sys.byteorder != "little":  # the words are built and read as their little-endian bytes
    raise ImportError("vllm_parity.serving.ternary_repack: the ternary layouts assume a little-endian machine")
TILE_N, TILE_K = 16, 128  # rows and inputs of one tile of the tiled layout


@dataclass(frozen=True)
class NativeTernary:
    """A ternary weight in the kernels' layout (see the module docstring)."""

    qweight: torch.Tensor  # int32 (N, ceil(K/16))
    scale: torch.Tensor  # float32 (N, G)
    n: int
    k: int
    group_size: int  # 0: per output channel
    act_quant: bool
    tiles: torch.Tensor | None = None  # int32 (ceil(N/16), ceil(K/128), 32, 4), see pack_tiles

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
        if self.tiles is not None:
            want = tiles_shape(self.n, self.k)
            if self.tiles.dtype != torch.int32 or tuple(self.tiles.shape) != want or not self.tiles.is_contiguous():
                raise FormatError(f"native tiles must be contiguous int32 {want}, got {self.tiles.dtype} "
                                  f"{tuple(self.tiles.shape)}")
            if self.tiles.device != self.qweight.device:
                raise FormatError(f"native tiles on {self.tiles.device}, qweight on {self.qweight.device}")

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    @property
    def nbytes(self) -> int:
        tiles = 0 if self.tiles is None else self.tiles.numel() * 4
        return self.qweight.numel() * 4 + self.scale.numel() * 4 + tiles

    def to(self, device: torch.device | str) -> "NativeTernary":
        tiles = None if self.tiles is None else self.tiles.to(device)
        return replace(self, qweight=self.qweight.to(device), scale=self.scale.to(device), tiles=tiles)

    def with_tiles(self) -> "NativeTernary":
        """This weight with its tiled copy (for the CUDA tensor-core kernel), built on its device."""
        if self.tiles is not None:
            return self
        return replace(self, tiles=tiles_from_native(self.qweight, self.k))


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
    values = unpack_checkpoint(packed, spec, n, k, name)  # int8 (N, K) on packed's device
    return NativeTernary(qweight=pack_native(values), scale=_native_scale(scale, spec, n, k, name),
                         n=n, k=k, group_size=_native_group(spec, k),
                         act_quant=spec.activation_quant == "per_token_absmax_int8")


# The serving side's own reading of the checkpoint bytes, written apart from the reference's decoder
# (vllm_parity.reference.formats.ternary) on purpose: a bug shared by both would be invisible to parity.
def unpack_checkpoint(packed: torch.Tensor, spec: TernarySpec, n: int, k: int, name: str = "weight",
                      rows_per_step: int = 1024) -> torch.Tensor:
    """The ternary values (int8 in {-1, 0, 1}) ``(N, K)`` of a packed checkpoint tensor: field ``f`` of every
    byte (bits ``2f`` (lsb) or ``6 - 2f`` (msb)) holds logical element ``4b + f`` of the packed axis
    (interleaved) or ``f * P + b`` (blocked). Codes that ``code_map`` marks as must-not-occur raise
    DecodeError. Decoded a slab of rows at a time, so the temporaries stay small."""
    along_input = spec.pack_axis == "input"
    rows = packed if along_input else packed.t().contiguous()  # (other axis, P): bytes along the packed axis
    other, p = rows.shape
    # Every byte value's four fields, read once into tables: a byte's values, and whether it holds a code
    # that must not occur (one lookup a byte: a large model's load repacks billions of weights).
    byte = torch.arange(256, device=packed.device)
    codes = torch.stack([(byte >> (2 * f if spec.bit_order == "lsb" else 6 - 2 * f)) & 3 for f in range(4)], dim=-1)
    # value(code) for code = 2h + l, as a polynomial in its two bits: v0 + (v1-v0) l + (v2-v0) h + (v0-v1-v2+v3) hl
    v0, v1, v2, v3 = (0 if v is None else v for v in spec.code_map)
    low, high = codes & 1, codes >> 1
    value_of = ((v1 - v0) * low + (v2 - v0) * high + (v0 - v1 - v2 + v3) * (low & high) + v0).to(torch.int8)
    illegal = [c for c, v in enumerate(spec.code_map) if v is None]
    illegal_in = torch.zeros(256, dtype=torch.bool, device=packed.device)
    for c in illegal:
        illegal_in |= (codes == c).any(-1)
    values = torch.empty(other, 4 * p, dtype=torch.int8, device=packed.device)
    bad = []
    value_words = value_of.contiguous().view(torch.int32).view(256)  # a byte's four values as one word to gather
    for r0 in range(0, other, rows_per_step):
        index = rows[r0:r0 + rows_per_step].to(torch.int64)
        slab = value_words.index_select(0, index.view(-1)).view(torch.int8).view(*index.shape, 4)  # (rows, P, 4)
        hit = illegal_in.index_select(0, index.view(-1)).view(index.shape)
        if bool(hit.any()):
            bad.append((r0, hit))
        values[r0:r0 + rows_per_step] = slab.reshape(-1, 4 * p) if spec.pack_layout == "interleaved" else \
            slab.transpose(1, 2).reshape(-1, 4 * p)
    if bad:
        per_byte = torch.zeros(rows.shape, dtype=torch.bool, device=packed.device)
        for r0, b in bad:
            per_byte[r0:r0 + b.shape[0]] = b
        per_byte = per_byte if along_input else per_byte.t()  # back to the stored layout
        first = tuple(int(i) for i in per_byte.nonzero()[0])
        raise DecodeError(
            f"{name}: {int(per_byte.sum())} of {packed.numel()} bytes hold code(s) {illegal}, which code_map "
            f"{list(spec.code_map)} marks as must-not-occur (first at packed index {first}, byte value "
            f"{int(packed[first])})")
    return values if along_input else values.t().contiguous()


def pack_native(values: torch.Tensor) -> torch.Tensor:
    """Ternary values ``(N, K)`` (any integer or float dtype, entries in {-1, 0, 1}) -> int32 ``(N, Kw)``."""
    n, k = values.shape
    kw = -(-k // WORD_CODES)
    field = (values != 0).to(torch.uint8) | ((values < 0).to(torch.uint8) << 1)
    if kw * WORD_CODES != k:
        field = torch.cat([field, field.new_zeros(n, kw * WORD_CODES - k)], dim=1)
    # Field q of a word (bits 2q, 2q + 1) holds element 2 * (q % 8) + q // 8 (FIELD_BIT): in field order the
    # elements run (parity, pair); byte b of the little-endian word holds fields 4b .. 4b + 3.
    q = field.view(n, kw, WORD_CODES // 2, 2).transpose(-1, -2).reshape(n, kw, 4, 4)
    words = q[..., 0] | (q[..., 1] << 2) | (q[..., 2] << 4) | (q[..., 3] << 6)  # (N, Kw, 4) bytes
    return words.contiguous().view(torch.int32).view(n, kw)


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
    # The checks repeat the reference's (vllm_parity.reference.formats.ternary) on purpose: see unpack_checkpoint.
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


# -- tiled layout ------------------------------------------------------------------------------
#
# mma.m16n8k16 (PTX ISA, "Matrix Fragments for mma.m16n8k16"): lane l = 4 g + t holds A registers
# r0 = (row g, cols 2t, 2t+1), r1 = (row g+8, same cols), r2 = (row g, cols 2t+8, 2t+9),
# r3 = (row g+8, cols 2t+8, 2t+9), and B registers b0 = (rows 2t, 2t+1; col g), b1 = (rows 2t+8,
# 2t+9; col g). A product over k is unchanged by any permutation of k applied to both operands, so
# each 128-input chunk is permuted such that lane (g, t) meets inputs 32 t .. 32 t + 31 of the
# chunk, in order, over the chunk's 8 k16 steps: step s, b0 = inputs 32 t + 4 s + {0, 1},
# b1 = 32 t + 4 s + {2, 3}. The activations are then one contiguous 64-byte run per lane (four
# 16-byte loads) and the weights one uint4 per lane: word j serves steps 2 j and 2 j + 1, its pair
# field p = 4 (s % 2) + r holds register r of step s, the first element of the pair at bits
# 2p..2p+1 and the second at 16+2p..17+2p, so ``(word << (14 - 2p)) & 0xC000C000`` is the half2
# (fp16 or bf16) of +-2.0 / 0 that the MMA takes as that register.


def tiles_shape(n: int, k: int) -> tuple[int, int, int, int]:
    return (-(-n // TILE_N), -(-k // TILE_K), 32, 4)


@lru_cache(maxsize=None)
def _tile_index() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row in tile, input in chunk and bit of every field: tensors of shape (lane 32, word 4, pair 8, half 2)."""
    lane, word, pair, half = torch.meshgrid(torch.arange(32), torch.arange(4), torch.arange(8), torch.arange(2),
                                            indexing="ij")
    g, t = lane // 4, lane % 4
    step, reg = 2 * word + pair // 4, pair % 4
    row = g + 8 * (reg % 2)
    col = 32 * t + 4 * step + 2 * (reg // 2) + half
    bit = 2 * pair + 16 * half
    return row, col, bit


def pack_tiles(values: torch.Tensor) -> torch.Tensor:
    """Ternary values ``(N, K)`` (entries in {-1, 0, 1}) -> int32 tiles ``(ceil(N/16), ceil(K/128), 32, 4)``.

    Fields are 0b00 = 0, 0b01 = +1, 0b11 = -1 as in the row layout; padding rows and inputs are 0.
    """
    n, k = values.shape
    nt, kc = -(-n // TILE_N), -(-k // TILE_K)
    v = values.to(torch.int64)
    field = (v != 0).to(torch.int64) | ((v < 0).to(torch.int64) << 1)
    field = torch.nn.functional.pad(field, (0, kc * TILE_K - k, 0, nt * TILE_N - n))
    field = field.reshape(nt, TILE_N, kc, TILE_K)
    row, col, bit = (i.to(values.device) for i in _tile_index())
    picked = field[:, row, :, col]  # (32, 4, 8, 2, NT, KC): advanced indices first
    words = (picked << bit[..., None, None]).sum(dim=(2, 3))  # (32, 4, NT, KC), disjoint bits
    words = words.permute(2, 3, 0, 1)
    return (words - ((words >> 31) << 32)).to(torch.int32).contiguous()


def unpack_tiles(tiles: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Inverse of :func:`pack_tiles`: int8 values ``(N, K)``."""
    nt, kc = tiles.shape[:2]
    row, col, bit = (i.to(tiles.device) for i in _tile_index())
    words = tiles.to(torch.int64).permute(2, 3, 0, 1)  # (32, 4, NT, KC)
    field = (words[:, :, None, None] >> bit[..., None, None]) & 3  # (32, 4, 8, 2, NT, KC)
    values = (field & 1) * (1 - (field & 2))
    out = torch.zeros(nt, TILE_N, kc, TILE_K, dtype=torch.int8, device=tiles.device)
    out[:, row, :, col] = values.to(torch.int8)
    return out.reshape(nt * TILE_N, kc * TILE_K)[:n, :k].contiguous()


def tiles_from_native(qweight: torch.Tensor, k: int, rows_per_step: int = 1024) -> torch.Tensor:
    """The tiled layout of a row-layout ``qweight``, built a slab of rows at a time (bounded temporaries)."""
    n = qweight.shape[0]
    out = torch.empty(tiles_shape(n, k), dtype=torch.int32, device=qweight.device)
    for r0 in range(0, n, rows_per_step):  # rows_per_step is a multiple of TILE_N
        slab = unpack_native(qweight[r0:r0 + rows_per_step], k)
        t0 = r0 // TILE_N
        out[t0:t0 + -(-slab.shape[0] // TILE_N)] = pack_tiles(slab)
    return out
