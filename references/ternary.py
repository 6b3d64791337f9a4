"""Pure-torch pack/unpack and decode of the ``ternary`` format, every variant of FORMATS.md.

Readable first: one function per step (fields of a byte -> codes along the packed axis -> values ->
scaled weight), each vectorized so a 4096 x 14336 matrix takes well under a second.
"""

from __future__ import annotations

import torch

from references.errors import DecodeError, FormatError
from references.formats import TernarySpec

_FIELDS = torch.arange(4)


def _shifts(spec: TernarySpec) -> torch.Tensor:
    """Bit offset of field f (0..3) inside a byte."""
    return 2 * _FIELDS if spec.bit_order == "lsb" else 6 - 2 * _FIELDS


def _packed_to_axis_last(packed: torch.Tensor, spec: TernarySpec) -> torch.Tensor:
    return packed if spec.pack_axis == "input" else packed.t()


def _check_packed(packed: torch.Tensor, name: str) -> None:
    if packed.dtype != torch.uint8:
        raise FormatError(f"{name}: packed ternary weight must be uint8, got {packed.dtype}")
    if packed.dim() != 2:
        raise FormatError(f"{name}: packed ternary weight must be 2-D, got shape {tuple(packed.shape)}")


def byte_fields(spec: TernarySpec) -> torch.Tensor:
    """(256, 4) uint8: the code in field f of every byte value."""
    return (torch.arange(256, dtype=torch.uint8).unsqueeze(-1) >> _shifts(spec).to(torch.uint8)) & 3


def _per_byte_to_logical(per_byte: torch.Tensor, spec: TernarySpec) -> torch.Tensor:
    """(other, P, 4) per byte and field -> the logical (N, K) tensor."""
    other, p, _ = per_byte.shape
    if spec.pack_layout == "interleaved":
        flat = per_byte.reshape(other, 4 * p)  # element e = 4 * byte + field
    else:
        flat = per_byte.transpose(1, 2).reshape(other, 4 * p)  # element e = field * P + byte
    return flat if spec.pack_axis == "input" else flat.t().contiguous()


def unpack_codes(packed: torch.Tensor, spec: TernarySpec, name: str = "weight") -> torch.Tensor:
    """The 2-bit codes (0..3, uint8) of a packed tensor, in the logical ``(N, K)`` shape."""
    _check_packed(packed, name)
    rows = _packed_to_axis_last(packed, spec)  # (other, P): bytes along the packed axis
    fields = (rows.unsqueeze(-1) >> _shifts(spec).to(torch.uint8).to(rows.device)) & 3  # (other, P, 4)
    return _per_byte_to_logical(fields, spec)


def pack_codes(codes: torch.Tensor, spec: TernarySpec, name: str = "weight") -> torch.Tensor:
    """Inverse of :func:`unpack_codes`: codes (0..3) of shape ``(N, K)`` to packed uint8."""
    if codes.dim() != 2:
        raise FormatError(f"{name}: codes must be 2-D (N, K), got shape {tuple(codes.shape)}")
    n, k = codes.shape
    spec.check_shape(n, k, name)
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) > 3):
        raise FormatError(f"{name}: codes must lie in 0..3")
    rows = codes.to(torch.uint8)
    rows = rows if spec.pack_axis == "input" else rows.t()
    other, length = rows.shape
    p = length // 4
    if spec.pack_layout == "interleaved":
        fields = rows.reshape(other, p, 4)
    else:
        fields = rows.reshape(other, 4, p).transpose(1, 2)
    packed = (fields << _shifts(spec).to(torch.uint8)).sum(dim=-1, dtype=torch.uint8)
    packed = packed if spec.pack_axis == "input" else packed.t()
    return packed.contiguous()


def code_values(spec: TernarySpec) -> torch.Tensor:
    """Lookup table code -> value (int8); a null code maps to 0 and is checked separately."""
    return torch.tensor([0 if v is None else v for v in spec.code_map], dtype=torch.int8)


def check_bytes(packed: torch.Tensor, spec: TernarySpec, name: str) -> None:
    """Raise DecodeError naming the tensor and the number of bytes holding a code that must not occur."""
    illegal = [c for c, v in enumerate(spec.code_map) if v is None]
    if not illegal:
        return
    bad_value = torch.isin(byte_fields(spec), torch.tensor(illegal, dtype=torch.uint8)).any(-1)
    bad = bad_value.to(packed.device)[packed.long()]  # per byte, in the packed tensor's own layout
    if not bool(bad.any()):
        return
    first = tuple(int(i) for i in bad.nonzero()[0])
    raise DecodeError(
        f"{name}: {int(bad.sum())} of {packed.numel()} bytes hold code(s) {illegal}, which code_map "
        f"{list(spec.code_map)} marks as must-not-occur (first at packed index {first}, "
        f"byte value {int(packed[first])})"
    )


def unpack_values(packed: torch.Tensor, spec: TernarySpec, name: str = "weight") -> torch.Tensor:
    """Ternary values (int8 in {-1, 0, 1}) of shape ``(N, K)``; illegal codes raise DecodeError."""
    _check_packed(packed, name)
    lut = code_values(spec)[byte_fields(spec).long()].to(packed.device)  # (256, 4) values per byte value
    values = _per_byte_to_logical(lut[_packed_to_axis_last(packed, spec).long()], spec)
    check_bytes(packed, spec, name)
    return values


def values_to_codes(values: torch.Tensor, spec: TernarySpec, name: str = "weight") -> torch.Tensor:
    """Each value's code: the lowest code that ``code_map`` maps to it."""
    codes = torch.empty(values.shape, dtype=torch.uint8)
    seen = torch.zeros(values.shape, dtype=torch.bool)
    for v in (-1, 0, 1):
        mask = values == v
        if not bool(mask.any()):
            continue
        if v not in spec.code_map:
            raise FormatError(f"{name}: value {v} occurs but code_map {list(spec.code_map)} has no code for it")
        codes[mask] = spec.code_map.index(v)
        seen |= mask
    if not bool(seen.all()):
        raise FormatError(f"{name}: values must lie in {{-1, 0, 1}}")
    return codes


def pack_values(values: torch.Tensor, spec: TernarySpec, name: str = "weight") -> torch.Tensor:
    """Ternary values ``(N, K)`` to the packed uint8 tensor of the format."""
    return pack_codes(values_to_codes(values, spec, name), spec, name)


def expand_scale(scale: torch.Tensor, spec: TernarySpec, n: int, k: int, name: str = "scale",
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The scale broadcast to ``(N, K)`` (or a broadcastable view), in ``dtype``."""
    want = spec.scale_shape(n, k)
    if tuple(scale.shape) != want:
        raise FormatError(f"{name}: scale shape {tuple(scale.shape)}, expected {want} "
                          f"for {spec.scale_granularity} scales of a ({n}, {k}) weight")
    if not scale.dtype.is_floating_point:
        raise FormatError(f"{name}: scale must be a float tensor, got {scale.dtype}")
    s = scale.to(dtype)
    if spec.scale_granularity == "tensor":
        return s.reshape(1, 1)
    if spec.scale_granularity == "channel":
        return s.reshape(n, 1)
    return s.repeat_interleave(spec.group_size, dim=1)


def decode(packed: torch.Tensor, scale: torch.Tensor, spec: TernarySpec, n: int, k: int,
           name: str = "weight", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float weight ``W`` of logical shape ``(N, K)``: code_map[code] * scale (or / scale)."""
    want = spec.packed_shape(n, k)
    if tuple(packed.shape) != want:
        raise FormatError(f"{name}: packed shape {tuple(packed.shape)}, expected {want} "
                          f"(pack_axis={spec.pack_axis!r}, logical ({n}, {k}))")
    values = unpack_values(packed, spec, name).to(dtype)
    s = expand_scale(scale, spec, n, k, name + " scale", dtype)
    if not bool(torch.isfinite(s).all()):
        raise DecodeError(f"{name}: scale holds NaN or Inf")
    if spec.scale_mode == "multiply":
        return values * s
    if bool((s == 0).any()):
        raise DecodeError(f"{name}: scale holds zeros, but scale_mode 'divide' divides by it")
    return values / s

