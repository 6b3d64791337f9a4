"""The ``compressed-tensors`` format (llm-compressor's checkpoints): the ``quantization_config`` parsed, and
each quantized projection decoded, by the compressed-tensors library itself (its ``QuantizationConfig`` and
its compressors' ``decompress``), never by vLLM's loader or kernels.

Known here: integer weights ``pack-quantized`` (1-8 bits, symmetric or with zero points, per tensor, channel
or group, ``g_idx`` of activation ordering), ``int-quantized`` / ``naive-quantized`` (int8) and
``float-quantized`` (fp8 e4m3), weight-only or with dynamic per-token activations of 8 bits (W8A8 int8,
FP8_DYNAMIC), which the reference quantizes as vLLM does (``vllm_parity.reference.linear``). Anything else
is refused by name.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from vllm_parity.errors import DecodeError, FormatError
from vllm_parity.reference.formats import FLOAT_DTYPES, FormatSpec, expect_stored, register

if TYPE_CHECKING:
    from vllm_parity.reference.checkpoint import Checkpoint

WEIGHT_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized")
STRATEGIES = ("tensor", "channel", "group")
INT_DTYPES = (torch.int32, torch.int64)


def _library():
    try:
        import compressed_tensors.compressors  # noqa: F401  (registers the compressors)
        from compressed_tensors.quantization import QuantizationConfig
    except ImportError as exc:
        raise FormatError(f"a compressed-tensors checkpoint needs the compressed-tensors package ({exc}); "
                          f"`pip install compressed-tensors`") from None
    return QuantizationConfig


@functools.lru_cache(maxsize=1)
def _probe_linear() -> torch.nn.Module:
    """What compressed-tensors matches a class target ("Linear") against: every projection is a Linear."""
    return torch.nn.Linear(1, 1, device="meta")


@dataclass(frozen=True)
class Scheme:
    """What the reference needs of one config group's scheme, checked against what it can decode."""

    group: str
    format: str
    num_bits: int
    type: str  # int or float
    symmetric: bool
    strategy: str
    group_size: int | None
    actorder: bool  # weights stored with g_idx
    activation: str | None  # an activation quantizer of vllm_parity.reference.linear
    scheme: Any = field(compare=False, repr=False)  # compressed-tensors' QuantizationScheme

    @property
    def pack_factor(self) -> int:
        return 32 // self.num_bits


def _scheme(group: str, scheme, fmt: str) -> Scheme:
    where = f"compressed-tensors config group {group!r}"
    w = scheme.weights
    if w is None:
        raise FormatError(f"{where}: no weight quantization (only weight-quantized schemes are decoded)")
    if scheme.output_activations is not None:
        raise FormatError(f"{where}: output activation quantization is not reproduced by the reference")
    fmt = str(getattr(scheme.format, "value", scheme.format) or fmt)
    if fmt not in WEIGHT_FORMATS:
        raise FormatError(f"{where}: format {fmt!r} is not decoded here; known: {list(WEIGHT_FORMATS)}")
    strategy = str(getattr(w.strategy, "value", w.strategy))
    if strategy not in STRATEGIES:
        raise FormatError(f"{where}: weight strategy {strategy!r} is not decoded here; known: {list(STRATEGIES)}")
    wtype = str(getattr(w.type, "value", w.type))
    if fmt == "pack-quantized" and wtype != "int":
        raise FormatError(f"{where}: pack-quantized weights must be int, got {wtype!r}")
    if fmt == "float-quantized" and (wtype != "float" or w.num_bits != 8):
        raise FormatError(f"{where}: float-quantized weights must be 8-bit float, got {w.num_bits}-bit {wtype}")
    if fmt in ("int-quantized", "naive-quantized") and (wtype != "int" or w.num_bits != 8):
        raise FormatError(f"{where}: {fmt} weights must be int8, got {w.num_bits}-bit {wtype}")
    actorder = str(getattr(w.actorder, "value", w.actorder)) if w.actorder not in (None, False) else None
    if actorder not in (None, "group", "weight", "static"):
        raise FormatError(f"{where}: actorder {actorder!r} is not known")
    return Scheme(group=group, format=fmt, num_bits=int(w.num_bits), type=wtype, symmetric=bool(w.symmetric),
                  strategy=strategy, group_size=w.group_size if strategy == "group" else None,
                  actorder=actorder == "group", activation=_activation(where, scheme.input_activations),
                  scheme=scheme)


def _activation(where: str, a) -> str | None:
    """The activation quantizer that serves ``input_activations`` as vLLM does, by name."""
    if a is None:
        return None
    kind = f"{a.num_bits}-bit {getattr(a.type, 'value', a.type)}, {getattr(a.strategy, 'value', a.strategy)}, " \
           f"{'dynamic' if a.dynamic else 'static'}, {'symmetric' if a.symmetric else 'asymmetric'}"
    strategy = str(getattr(a.strategy, "value", a.strategy))
    if a.dynamic is True and strategy == "token" and a.symmetric and a.num_bits == 8:
        return {"int": "per_token_absmax_int8", "float": "per_token_absmax_fp8_e4m3"}.get(
            str(getattr(a.type, "value", a.type)))
    raise FormatError(f"{where}: input activations ({kind}) are not reproduced by the reference; known: "
                      f"8-bit int or float, per token, dynamic, symmetric")


@register
@dataclass(frozen=True)
class CompressedTensorsSpec(FormatSpec):
    """A compressed-tensors ``quantization_config``: its config groups, format and ignore list."""

    body: tuple = ()  # the config as (key, value) pairs, written back as given
    schemes: tuple[tuple[tuple[str, ...], Scheme], ...] = ()  # (targets, scheme) per config group
    ignore: tuple[str, ...] = ()
    activation_quant: str | None = None  # the activations' quantizer when every group shares one

    quant_method = "compressed-tensors"

    @classmethod
    def from_config(cls, body: dict[str, Any]) -> CompressedTensorsSpec:
        config_class = _library()
        try:
            config = config_class.model_validate({"quant_method": cls.quant_method, **body})
        except Exception as exc:  # pydantic's ValidationError names the field
            raise FormatError(f"a compressed-tensors quantization_config that compressed-tensors does not "
                              f"accept: {exc}") from None
        if config.kv_cache_scheme is not None:
            raise FormatError("compressed-tensors kv_cache_scheme (a quantized KV cache) is not reproduced by "
                              "the reference")
        schemes = []
        for name, scheme in sorted(config.config_groups.items()):
            if isinstance(scheme, list):
                raise FormatError(f"compressed-tensors config group {name!r} is a preset list {scheme!r}: "
                                  f"a saved checkpoint spells its schemes out")
            schemes.append((tuple(scheme.targets), _scheme(name, scheme, str(config.format))))
        if not schemes:
            raise FormatError("compressed-tensors quantization_config has no config_groups")
        activations = {s.activation for _, s in schemes}
        return cls(body=tuple(sorted(body.items(), key=lambda kv: kv[0])), schemes=tuple(schemes),
                   ignore=tuple(config.ignore or ()),
                   activation_quant=activations.pop() if len(activations) == 1 else None)

    def to_config(self) -> dict[str, Any]:
        return {"quant_method": self.quant_method, **dict(self.body)}

    # -- which scheme a module has --

    def scheme_of(self, module: str) -> Scheme | None:
        """The scheme compressed-tensors gives ``module`` (None: not quantized), by its own matching:
        ignored names first, then an exact name over a regex over a class target."""
        from compressed_tensors.utils.match import is_match, match_name

        probe = _probe_linear()
        if is_match(module, probe, list(self.ignore)):
            return None
        for rank in (lambda t: t == module, lambda t: t.startswith("re:") and match_name(module, t),
                     lambda t: not t.startswith("re:") and is_match(module, probe, t)):
            for targets, scheme in self.schemes:
                if any(rank(t) for t in targets):
                    return scheme
        return None

    def is_ignored(self, module: str) -> bool:
        return self.scheme_of(module) is None

    def activation_of(self, module: str) -> str | None:
        scheme = self.scheme_of(module)
        return None if scheme is None else scheme.activation

    def _scheme(self, module: str) -> Scheme:
        scheme = self.scheme_of(module)
        if scheme is None:
            raise FormatError(f"{module}: no compressed-tensors config group quantizes it")
        return scheme

    # -- tensors --

    def tensor_names(self, module: str) -> dict[str, str]:
        s = self._scheme(module)
        names = {"weight_packed": "weight_packed", "weight_shape": "weight_shape"} \
            if s.format == "pack-quantized" else {"weight": "weight"}
        names["weight_scale"] = "weight_scale"
        if not s.symmetric:
            names["weight_zero_point"] = "weight_zero_point"
        if s.actorder:
            names["weight_g_idx"] = "weight_g_idx"
        return {role: f"{module}.{suffix}" for role, suffix in names.items()}

    def scale_shape(self, s: Scheme, n: int, k: int, module: str) -> tuple[int, ...]:
        if s.strategy == "tensor":
            return (1,)
        if s.strategy == "channel":
            return (n, 1)
        if k % s.group_size:
            raise FormatError(f"{module}: in_features K={k} is not divisible by group_size={s.group_size}")
        return (n, k // s.group_size)

    def stored_shapes(self, module: str, n: int, k: int) -> dict[str, tuple[tuple[int, ...], tuple[torch.dtype, ...]]]:
        """Role -> (shape, dtypes) of one projection's stored tensors."""
        s = self._scheme(module)
        scale_shape = self.scale_shape(s, n, k, module)
        out = {"weight_scale": (scale_shape, FLOAT_DTYPES)}
        if s.format == "pack-quantized":
            out["weight_packed"] = ((n, -(-k // s.pack_factor)), (torch.int32,))
            out["weight_shape"] = ((2,), INT_DTYPES)
        else:
            out["weight"] = ((n, k), (torch.float8_e4m3fn if s.format == "float-quantized" else torch.int8,))
        if not s.symmetric:
            zp_shape = scale_shape if s.format != "pack-quantized" or s.strategy == "tensor" else \
                (-(-n // s.pack_factor), scale_shape[1])
            out["weight_zero_point"] = (zp_shape, (torch.int32,) if s.format == "pack-quantized" and
                                        s.strategy != "tensor" else (torch.int8, *INT_DTYPES))
        if s.actorder:
            out["weight_g_idx"] = ((k,), INT_DTYPES)
        return out

    def read_stored(self, ckpt: Checkpoint, module: str, n: int, k: int) -> dict[str, torch.Tensor]:
        names = self.tensor_names(module)
        out = {role: ckpt.expect(names[role], shape, dtypes)
               for role, (shape, dtypes) in self.stored_shapes(module, n, k).items()}
        self._check_values(out, module, n, k, names)
        return out

    def _check_values(self, stored: dict[str, torch.Tensor], module: str, n: int, k: int,
                      names: dict[str, str]) -> None:
        if "weight_shape" in stored:
            shape = [int(v) for v in stored["weight_shape"]]
            if shape != [n, k]:
                raise FormatError(f"{names['weight_shape']} says {shape}, the model's {module} is ({n}, {k})")
        if "weight_g_idx" in stored:
            g_idx, groups = stored["weight_g_idx"], self.scale_shape(self._scheme(module), n, k, module)[-1]
            if bool(((g_idx < 0) | (g_idx >= groups)).any()):
                raise DecodeError(f"{names['weight_g_idx']}: group indices outside 0..{groups - 1}")

    def decode(self, stored: dict[str, torch.Tensor], n: int, k: int, name: str,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
        from compressed_tensors.compressors import BaseCompressor

        s = self._scheme(name)
        expect_stored(stored, self.stored_shapes(name, n, k), name)  # read_stored's checks, for tensors from elsewhere
        self._check_values(stored, name, n, k, self.tensor_names(name))
        local = dict(stored)
        local["weight_scale"] = stored["weight_scale"].to(dtype)  # exact: the product is formed in ``dtype``
        if "weight_shape" in local:
            local["weight_shape"] = [int(v) for v in stored["weight_shape"]]
        compressor = BaseCompressor.get_value_from_registry(s.format)
        weight = compressor.decompress(local, s.scheme)["weight"].to(dtype)
        if tuple(weight.shape) != (n, k):
            raise DecodeError(f"{name}: compressed-tensors decoded shape {tuple(weight.shape)}, expected ({n}, {k})")
        if not bool(torch.isfinite(weight).all()):
            bad = int((~torch.isfinite(weight)).sum())
            raise DecodeError(f"{name}: {bad} weights decode to NaN or Inf (codes that must not occur, or a "
                              f"non-finite scale in {name}.weight_scale)")
        return weight

    def code_step(self, ckpt: Checkpoint, module: str) -> torch.Tensor:
        s = self._scheme(module)
        scale = ckpt.tensor(self.tensor_names(module)["weight_scale"]).double().abs()
        # fp8 e4m3: 3 mantissa bits, so a typical code (64..448) moves by 8..32 scales
        return scale * 8.0 if s.type == "float" else scale
