"""The formats a checkpoint's ``quantization_config`` may name, registered by ``quant_method``.

A format is one module: its spec (a frozen dataclass parsed from ``quantization_config``), its codec and
the reference's reading and decoding of its tensors. The built-in ones are the modules of this package
(shared FORMATS.md: ``ternary``, ``int8x``; llm-compressor's ``compressed-tensors``), found by name at first
use; another package's through the entry-point group ``vllm_parity.formats``, or with :func:`register`.
One parser for the whole project: the reference model, the fixtures, ``parity inspect`` and the vLLM plugin
all read a checkpoint's format through :func:`parse_quantization_config`.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import pkgutil
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from vllm_parity.errors import FormatError

if TYPE_CHECKING:
    from vllm_parity.reference.checkpoint import Checkpoint

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # what a stored float may be


def choice(key: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise FormatError(f"{key} = {value!r} is not one of {list(allowed)}")


def _no_unknown(body: dict, known: set[str], method: str) -> None:
    unknown = sorted(set(body) - known)
    if unknown:
        raise FormatError(f"unknown key(s) {unknown} in a {method!r} quantization_config; known: {sorted(known)}")


def build(cls: type, body: dict, known: set[str], list_keys: tuple[str, ...]) -> FormatSpec:
    _no_unknown(body, known, cls.quant_method)
    return cls(**{k: _as_tuple(k, v) if k in list_keys else v for k, v in body.items()})


NAME_LISTS = ("ignore", "modules_to_not_convert")  # lists of module names


def _as_tuple(key: str, value: Any) -> tuple:
    if not isinstance(value, (list, tuple)):
        raise FormatError(f"{key} must be a list, got {value!r}")
    if key in NAME_LISTS and not all(isinstance(v, str) for v in value):
        raise FormatError(f"{key} must list module names (strings), got {list(value)!r}")
    return tuple(value)


def _is_ignored(module: str, ignore: tuple[str, ...]) -> bool:
    return any(module == pat or module.endswith("." + pat) for pat in ignore)


def expect_stored(stored: dict[str, torch.Tensor], want: dict[str, tuple[tuple[int, ...], tuple[torch.dtype, ...]]],
                  name: str) -> None:
    """The stored tensors a decoder reads, each of its shape and one of its dtypes (what ``read_stored`` checks on
    the checkpoint, checked again for tensors that come from elsewhere); FormatError naming the one that is not."""
    for role, (shape, dtypes) in want.items():
        t = stored.get(role)
        if not isinstance(t, torch.Tensor):
            raise FormatError(f"{name}.{role}: missing (expected a tensor of shape {tuple(shape)})")
        if tuple(t.shape) != tuple(shape):
            raise FormatError(f"{name}.{role}: shape {tuple(t.shape)}, expected {tuple(shape)}")
        if t.dtype not in dtypes:
            raise FormatError(f"{name}.{role}: dtype {str(t.dtype).removeprefix('torch.')}, expected "
                              f"{' or '.join(str(d).removeprefix('torch.') for d in dtypes)}")


def unpack_nibbles(words: torch.Tensor) -> torch.Tensor:
    """``(R, C)`` int32 words -> ``(R, C, 8)`` 4-bit fields, field ``i`` from bits ``4i..4i+3`` (AWQ's and GPTQ's
    words)."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    return torch.stack([(w >> (4 * i)) & 0xF for i in range(8)], dim=-1)


def pack_nibbles(fields: torch.Tensor, what: str) -> torch.Tensor:
    """``(R, C, 8)`` values 0..15 -> ``(R, C)`` int32 words (the inverse of :func:`unpack_nibbles`)."""
    if fields.shape[-1] != 8 or bool(((fields < 0) | (fields > 15)).any()):
        raise FormatError(f"{what} packs codes 0..15, 8 a word")
    word = sum(fields[..., i].to(torch.int64) << (4 * i) for i in range(8))
    return torch.where(word >= 2 ** 31, word - 2 ** 32, word).to(torch.int32)


class FormatSpec(ABC):
    """What every format's spec provides (a frozen dataclass subclassing this)."""

    quant_method: ClassVar[str]
    ignore: tuple[str, ...]
    activation_quant: str | None = None

    @classmethod
    @abstractmethod
    def from_config(cls, body: dict[str, Any]) -> FormatSpec:
        """The spec of a ``quantization_config`` (without its ``quant_method``); FormatError when invalid."""

    @abstractmethod
    def to_config(self) -> dict[str, Any]:
        """The ``quantization_config`` dict, every key spelled out."""

    def is_ignored(self, module: str) -> bool:
        return _is_ignored(module, self.ignore)

    def activation_of(self, module: str) -> str | None:
        """The quantizer of ``module``'s input activations (``vllm_parity.reference.linear.ACTIVATION_QUANT``)."""
        return self.activation_quant

    @abstractmethod
    def tensor_names(self, module: str) -> dict[str, str]:
        """Role -> checkpoint tensor name of one quantized projection."""

    @abstractmethod
    def read_stored(self, ckpt: Checkpoint, module: str, n: int, k: int) -> dict[str, torch.Tensor]:
        """The checkpoint tensors of one projection of logical shape ``(N, K)``, checked for name, shape, dtype."""

    @abstractmethod
    def decode(self, stored: dict[str, torch.Tensor], n: int, k: int, name: str,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight ``(N, K)`` in ``dtype``; DecodeError for data that must not occur."""

    @abstractmethod
    def code_step(self, ckpt: Checkpoint, module: str) -> torch.Tensor:
        """The weight change of one code off by one, per output channel (or one for the tensor), fp64; reads
        only the scales."""


class GroupScaled4Bit:
    """What AutoAWQ's and GPTQ's specs share: ``modules_to_not_convert`` (skipped as vLLM skips them:
    ``lm_head``, and every module whose name contains one), and a ``scales`` tensor ``(groups, N)``."""

    modules_to_not_convert: tuple[str, ...] | None

    @property
    def ignore(self) -> tuple[str, ...]:
        return ("lm_head", *(self.modules_to_not_convert or ()))

    def is_ignored(self, module: str) -> bool:
        return module == "lm_head" or module.endswith(".lm_head") or \
            any(m in module for m in self.modules_to_not_convert or ())

    def code_step(self, ckpt: Checkpoint, module: str) -> torch.Tensor:
        return ckpt.tensor(f"{module}.scales").double().abs().T


FORMATS: dict[str, type[FormatSpec]] = {}


def register(spec_class: type[FormatSpec]) -> type[FormatSpec]:
    """Make a format known under its ``quant_method`` (usable as a class decorator)."""
    FORMATS[spec_class.quant_method] = spec_class
    return spec_class


ENTRY_POINTS = "vllm_parity.formats"  # the group through which another package supplies a format


def known() -> list[str]:
    """Every format's ``quant_method``: the built-in modules of this package, and the names of the installed
    entry points of the group ``vllm_parity.formats`` (each a FormatSpec subclass, loaded when first named)."""
    _builtins()
    return sorted(set(FORMATS) | {ep.name.lower() for ep in importlib.metadata.entry_points(group=ENTRY_POINTS)})


def _builtins() -> None:
    for info in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{info.name}")


def _find(method: str) -> type[FormatSpec] | None:
    """The format of ``method``: registered, built in, or another package's entry point."""
    if method not in FORMATS:
        _builtins()
    if method not in FORMATS:
        for ep in importlib.metadata.entry_points(group=ENTRY_POINTS):
            if ep.name.lower() == method:
                _load(ep)
                break
    return FORMATS.get(method)


def _load(ep) -> None:
    try:
        spec_class = ep.load()
    except Exception as exc:  # a broken plugin names itself, and the rest still load
        raise FormatError(f"the {ENTRY_POINTS} entry point {ep.name!r} ({ep.value}) does not load: "
                          f"{type(exc).__name__}: {exc}") from None
    if not (isinstance(spec_class, type) and issubclass(spec_class, FormatSpec)):
        raise FormatError(f"the {ENTRY_POINTS} entry point {ep.name!r} ({ep.value}) is not a FormatSpec "
                          f"subclass: {spec_class!r}")
    if spec_class.quant_method.lower() != ep.name.lower():
        raise FormatError(f"the {ENTRY_POINTS} entry point {ep.name!r} ({ep.value}) has quant_method "
                          f"{spec_class.quant_method!r}: name the entry point after it")
    register(spec_class)


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
    spec_class = _find(method)
    if spec_class is None:
        raise FormatError(f"unknown quant_method {config.get('quant_method')!r}: no reference decoder is installed "
                          f"for it (known: {known()}); a package supplies one as a FormatSpec subclass under the "
                          f"entry-point group {ENTRY_POINTS!r} named after its quant_method (README: your own "
                          f"format), or registers it with vllm_parity.reference.formats.register")
    return spec_class.from_config({k: v for k, v in config.items() if k != "quant_method"})
