"""The ``ternary`` format (shared FORMATS.md section 1): its spec, and pure-torch pack/unpack and decode of
every variant.

Readable first: one function per step (fields of a byte -> codes along the packed axis -> values ->
scaled weight), each vectorized so a 4096 x 14336 matrix takes well under a second.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from vllm_parity.errors import DecodeError, FormatError
from vllm_parity.reference.formats import FLOAT_DTYPES, FormatSpec, build, choice, register

if TYPE_CHECKING:
    from vllm_parity.reference.checkpoint import Checkpoint

TERNARY_VALUES = (-1, 0, 1)


@register
@dataclass(frozen=True)
class TernarySpec(FormatSpec):
    """The ``ternary`` format: 2-bit codes packed 4 per byte, with a float scale."""

    pack_axis: str = "input"
    pack_layout: str = "interleaved"
    bit_order: str = "lsb"
    code_map: tuple[int | None, ...] = (0, 1, -1, None)
    scale_granularity: str = "channel"
    group_size: int = 128
    scale_mode: str = "multiply"
    weight_name: str = "weight_ternary"
    scale_name: str = "weight_scale"
    activation_quant: str | None = None
    ignore: tuple[str, ...] = ("lm_head",)

    quant_method = "ternary"

    def __post_init__(self) -> None:
        choice("pack_axis", self.pack_axis, ("input", "output"))
        choice("pack_layout", self.pack_layout, ("interleaved", "blocked"))
        choice("bit_order", self.bit_order, ("lsb", "msb"))
        choice("scale_granularity", self.scale_granularity, ("tensor", "channel", "group"))
        choice("scale_mode", self.scale_mode, ("multiply", "divide"))
        choice("activation_quant", self.activation_quant, (None, "per_token_absmax_int8"))
        if len(self.code_map) != 4:
            raise FormatError(f"code_map must list 4 entries (codes 0..3), got {list(self.code_map)}")
        for code, value in enumerate(self.code_map):
            if value is not None and (isinstance(value, bool) or value not in TERNARY_VALUES):
                raise FormatError(
                    f"code_map[{code}] = {value!r}: each entry must be -1, 0, 1 or null"
                )
        if all(v is None for v in self.code_map):
            raise FormatError("code_map maps every code to null: no weight could be stored")
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or self.group_size <= 0:
            raise FormatError(f"group_size must be a positive integer, got {self.group_size!r}")
        for key in ("weight_name", "scale_name"):
            value = getattr(self, key)
            if not isinstance(value, str) or not value or "." in value:
                raise FormatError(f"{key} must be a non-empty key suffix without dots, got {value!r}")
        if self.weight_name == self.scale_name:
            raise FormatError(f"weight_name and scale_name are both {self.weight_name!r}")

    # -- shapes -----------------------------------------------------------------------------

    def packed_shape(self, n: int, k: int) -> tuple[int, int]:
        """Shape of the packed uint8 tensor for a logical ``(N, K)`` weight."""
        self.check_shape(n, k)
        return (n, k // 4) if self.pack_axis == "input" else (n // 4, k)

    def scale_shape(self, n: int, k: int) -> tuple[int, ...]:
        self.check_shape(n, k)
        if self.scale_granularity == "tensor":
            return (1,)
        if self.scale_granularity == "channel":
            return (n,)
        return (n, k // self.group_size)

    def check_shape(self, n: int, k: int, name: str = "weight") -> None:
        """Raise FormatError when ``(N, K)`` cannot be stored in this format."""
        axis_len = k if self.pack_axis == "input" else n
        if axis_len % 4:
            raise FormatError(
                f"{name}: packed axis ({self.pack_axis}, length {axis_len}) of logical shape "
                f"({n}, {k}) is not divisible by 4"
            )
        if self.scale_granularity == "group" and k % self.group_size:
            raise FormatError(
                f"{name}: in_features K={k} is not divisible by group_size={self.group_size}"
            )

    # -- names ------------------------------------------------------------------------------

    def tensor_names(self, module: str) -> dict[str, str]:
        return {"weight": f"{module}.{self.weight_name}", "scale": f"{module}.{self.scale_name}"}

    @classmethod
    def from_config(cls, body: dict[str, Any]) -> TernarySpec:
        return build(cls, body, {f.name for f in dataclasses.fields(cls)}, ("code_map", "ignore"))

    def read_stored(self, ckpt: Checkpoint, module: str, n: int, k: int) -> dict[str, torch.Tensor]:
        names = self.tensor_names(module)
        self.check_shape(n, k, module)
        return {"packed": ckpt.expect(names["weight"], self.packed_shape(n, k), (torch.uint8,)),
                "scale": ckpt.expect(names["scale"], self.scale_shape(n, k), FLOAT_DTYPES)}

    def decode(self, stored: dict[str, torch.Tensor], n: int, k: int, name: str,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return decode(stored["packed"], stored["scale"], self, n, k, name=name, dtype=dtype)

    def code_step(self, ckpt: Checkpoint, module: str) -> torch.Tensor:
        s = ckpt.tensor(self.tensor_names(module)["scale"]).double().abs()
        return s if self.scale_mode == "multiply" else 1.0 / s

    def to_config(self) -> dict[str, Any]:
        """The ``quantization_config`` dict, every key of FORMATS.md spelled out."""
        out: dict[str, Any] = {"quant_method": self.quant_method}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out



PRESETS: dict[str, TernarySpec] = {
    "seed-article": TernarySpec(),
    "hf-bitnet": TernarySpec(
        pack_axis="output",
        pack_layout="blocked",
        bit_order="lsb",
        code_map=(-1, 0, 1, None),
        scale_granularity="tensor",
        scale_mode="divide",
        weight_name="weight",
        scale_name="weight_scale",
        activation_quant="per_token_absmax_int8",
    ),
}


def preset(name: str) -> TernarySpec:
    try:
        return PRESETS[name]
    except KeyError:
        raise FormatError(f"unknown preset {name!r}; known: {sorted(PRESETS)}") from None


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

