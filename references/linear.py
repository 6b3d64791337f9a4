"""Reference linears: the decoded weight of one projection and the plain-torch product.

A reference linear keeps the checkpoint's own compact tensors and decodes them (fp32, or fp64 for
calibration); with ``cache=False`` it decodes on every forward, so a large model's reference never
holds all its float weights at once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from references import int8x, ternary
from references.checkpoint import Checkpoint
from references.errors import CheckpointError
from references.formats import FormatSpec, TernarySpec

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def activation_fake_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token absmax int8 fake quantization (FORMATS.md): returns ``(x_q, s_x)``."""
    s_x = 127.0 / x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-5)
    return (x * s_x).round().clamp(-128, 127), s_x


def read_stored(ckpt: Checkpoint, module: str, spec: FormatSpec, n: int, k: int) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of one quantized projection, checked for name, shape and dtype."""
    if isinstance(spec, TernarySpec):
        names = spec.tensor_names(module)
        spec.check_shape(n, k, module)
        return {
            "packed": ckpt.expect(names["weight"], spec.packed_shape(n, k), (torch.uint8,)),
            "scale": ckpt.expect(names["scale"], spec.scale_shape(n, k), FLOAT_DTYPES),
        }
    stored = {}
    for suffix, name in spec.tensor_names(module).items():
        info = ckpt.info(name)
        if info.dtype != int8x.DTYPES[suffix]:
            raise CheckpointError(f"{info.file.name}: tensor {name!r} has dtype "
                                  f"{str(info.dtype).removeprefix('torch.')}, expected "
                                  f"{str(int8x.DTYPES[suffix]).removeprefix('torch.')}")
        stored[suffix] = ckpt.tensor(name)
    shape = tuple(int(v) for v in stored["weight_shape"].tolist())
    if shape != (n, k):
        raise CheckpointError(f"{ckpt.path}: tensor {module}.weight_shape is {list(shape)}, "
                              f"expected [{n}, {k}] from config.json")
    return stored


def decode_stored(stored: dict[str, torch.Tensor], spec: FormatSpec, n: int, k: int, name: str,
                  dtype: torch.dtype) -> torch.Tensor:
    if isinstance(spec, TernarySpec):
        return ternary.decode(stored["packed"], stored["scale"], spec, n, k, name=name, dtype=dtype)
    return int8x.decode(stored, spec, name=name, dtype=dtype)


class ReferenceLinear(nn.Module):
    """``y = x @ W^T`` with ``W`` decoded from the stored tensors of one projection."""

    def __init__(self, name: str, spec: FormatSpec, stored: dict[str, torch.Tensor], n: int, k: int,
                 dtype: torch.dtype = torch.float32, cache: bool = True):
        super().__init__()
        self.name, self.spec = name, spec
        self.in_features, self.out_features = k, n
        self.dtype = dtype
        self.activation_quant = getattr(spec, "activation_quant", None)
        weight = decode_stored(stored, spec, n, k, name, dtype)  # validates eagerly, even when not cached
        self.stored = stored  # compact: kept so that a precision switch decodes afresh
        self.register_buffer("cached_weight", weight if cache else None, persistent=False)

    def weight(self) -> torch.Tensor:
        if self.cached_weight is not None:
            return self.cached_weight
        return decode_stored(self.stored, self.spec, self.out_features, self.in_features, self.name, self.dtype)

    def set_dtype(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        if self.cached_weight is not None:  # decode again: rounding the fp32 weight would not be fp64
            self.cached_weight = decode_stored(self.stored, self.spec, self.out_features, self.in_features,
                                               self.name, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.dtype)
        w = self.weight()
        if self.activation_quant == "per_token_absmax_int8":
            x_q, s_x = activation_fake_quant(x)
            return F.linear(x_q, w) / s_x
        return F.linear(x, w)

    def extra_repr(self) -> str:
        fmt = self.spec.quant_method
        return f"{self.name}: {fmt}, in={self.in_features}, out={self.out_features}, dtype={self.dtype}"

