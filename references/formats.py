"""Format specifications parsed from a checkpoint's ``quantization_config`` (shared FORMATS.md).

One parser for the whole project: the reference model, the fixtures, ``parity inspect`` and the
vLLM plugin all read a checkpoint's format through :func:`parse_quantization_config`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from references.errors import FormatError

TERNARY_VALUES = (-1, 0, 1)


def _choice(key: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise FormatError(f"{key} = {value!r} is not one of {list(allowed)}")


def _no_unknown(body: dict, known: set[str], method: str) -> None:
    unknown = sorted(set(body) - known)
    if unknown:
        raise FormatError(f"unknown key(s) {unknown} in a {method!r} quantization_config; known: {sorted(known)}")


def _build(cls: type, body: dict, known: set[str], list_keys: tuple[str, ...]) -> FormatSpec:
    _no_unknown(body, known, cls.quant_method)
    return cls(**{k: _as_tuple(k, v) if k in list_keys else v for k, v in body.items()})


def _as_tuple(key: str, value: Any) -> tuple:
    if not isinstance(value, (list, tuple)):
        raise FormatError(f"{key} must be a list, got {value!r}")
    return tuple(value)


def _is_ignored(module: str, ignore: tuple[str, ...]) -> bool:
    return any(module == pat or module.endswith("." + pat) for pat in ignore)


@dataclass(frozen=True)
class TernarySpec:
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
        _choice("pack_axis", self.pack_axis, ("input", "output"))
        _choice("pack_layout", self.pack_layout, ("interleaved", "blocked"))
        _choice("bit_order", self.bit_order, ("lsb", "msb"))
        _choice("scale_granularity", self.scale_granularity, ("tensor", "channel", "group"))
        _choice("scale_mode", self.scale_mode, ("multiply", "divide"))
        _choice("activation_quant", self.activation_quant, (None, "per_token_absmax_int8"))
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

    def is_ignored(self, module: str) -> bool:
        return _is_ignored(module, self.ignore)

    def tensor_names(self, module: str) -> dict[str, str]:
        return {"weight": f"{module}.{self.weight_name}", "scale": f"{module}.{self.scale_name}"}

    def to_config(self) -> dict[str, Any]:
        """The ``quantization_config`` dict, every key of FORMATS.md spelled out."""
        out: dict[str, Any] = {"quant_method": self.quant_method}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out


@dataclass(frozen=True)
class Int8xSpec:
    """The ``int8x`` format: INT8 weights stored losslessly in 3/5/8-bit levels."""

    levels: tuple[int, ...] = (3, 5, 8)
    block_size: int = 1024
    ignore: tuple[str, ...] = ("lm_head",)

    quant_method = "int8x"
    suffixes = ("weight_shape", "weight_scale", "weight_b1", "weight_b2", "weight_l1",
                "weight_l2", "weight_l3", "weight_b1_blk", "weight_b2_blk")

    def __post_init__(self) -> None:
        if tuple(self.levels) != (3, 5, 8):
            raise FormatError(f"int8x levels must be [3, 5, 8] in this version, got {list(self.levels)}")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) \
                or self.block_size <= 0 or self.block_size % 32:
            raise FormatError(f"int8x block_size must be a positive multiple of 32, got {self.block_size!r}")

    def is_ignored(self, module: str) -> bool:
        return _is_ignored(module, self.ignore)

    def tensor_names(self, module: str) -> dict[str, str]:
        return {s: f"{module}.{s}" for s in self.suffixes}

    def to_config(self) -> dict[str, Any]:
        return {"quant_method": self.quant_method, "levels": list(self.levels),
                "block_size": self.block_size, "ignore": list(self.ignore)}


FormatSpec = TernarySpec | Int8xSpec

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

_TERNARY_KEYS = {f.name for f in dataclasses.fields(TernarySpec)}
_INT8X_KEYS = {"levels", "block_size", "ignore"}


def parse_quantization_config(config: dict[str, Any] | None) -> FormatSpec | None:
    """Parse ``quantization_config`` (None for a plain floating-point checkpoint)."""
    if config is None:
        return None
    if not isinstance(config, dict):
        raise FormatError(f"quantization_config must be an object, got {type(config).__name__}")
    method = config.get("quant_method")
    if not isinstance(method, str):
        raise FormatError(f"quantization_config has no quant_method string: {config!r}")
    method = method.lower()
    body = {k: v for k, v in config.items() if k != "quant_method"}
    if method == "ternary":
        return _build(TernarySpec, body, _TERNARY_KEYS, ("code_map", "ignore"))
    if method == "int8x":
        return _build(Int8xSpec, body, _INT8X_KEYS, ("levels", "ignore"))
    raise FormatError(f"unknown quant_method {config.get('quant_method')!r}: expected 'ternary' or 'int8x'")


def preset(name: str) -> TernarySpec:
    try:
        return PRESETS[name]
    except KeyError:
        raise FormatError(f"unknown preset {name!r}; known: {sorted(PRESETS)}") from None
