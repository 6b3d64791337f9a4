"""Reference linears: the decoded weight of one projection and the plain-torch product.

A reference linear keeps the checkpoint's own compact tensors and decodes them (fp32, or fp64 for
calibration); with ``cache=False`` it decodes on every forward, so a large model's reference never
holds all its float weights at once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vllm_parity.errors import FormatError
from vllm_parity.reference.checkpoint import Checkpoint
from vllm_parity.reference.formats import FormatSpec


def activation_fake_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token absmax int8 fake quantization (FORMATS.md; vLLM's dynamic int8, max/127): returns
    ``(x_q, s_x)`` with ``x ≈ x_q / s_x``."""
    s_x = 127.0 / x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-5)
    return (x * s_x).round().clamp(-128, 127), s_x


FP8_MAX = 448.0  # float8_e4m3fn's largest value


def fp8_fake_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token absmax fp8 (e4m3) quantization as vLLM's dynamic FP8 serves it (``QuantFP8``): the scale
    max/448 (at least 1/(448·512)) in fp32, the values times its reciprocal rounded to e4m3. Returns
    ``(x_q, s_x)`` with ``x ≈ x_q / s_x``."""
    xf = x if x.dtype == torch.float64 else x.to(torch.float32)
    scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=1.0 / (FP8_MAX * 512.0))
    inverse = scale.reciprocal()
    x_q = (xf * inverse).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(x.dtype)
    return x_q, inverse.to(x.dtype)


# The activation quantizers a format may name (FormatSpec.activation_of).
ACTIVATION_QUANT = {"per_token_absmax_int8": activation_fake_quant, "per_token_absmax_fp8_e4m3": fp8_fake_quant}


def read_stored(ckpt: Checkpoint, module: str, spec: FormatSpec, n: int, k: int) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of one quantized projection, checked for name, shape and dtype."""
    return spec.read_stored(ckpt, module, n, k)


class ReferenceLinear(nn.Module):
    """``y = x @ W^T (+ b)`` with ``W`` decoded from the stored tensors of one projection; ``b`` is the
    checkpoint's float bias, where the family has one (Qwen2's q/k/v)."""

    def __init__(self, name: str, spec: FormatSpec, stored: dict[str, torch.Tensor], n: int, k: int,
                 dtype: torch.dtype = torch.float32, cache: bool = True, bias: torch.Tensor | None = None,
                 activations_in: torch.dtype | None = None):
        super().__init__()
        self.name, self.spec = name, spec
        # The dtype the served model's activations reach the quantizer in: an engine serving in bf16 quantizes
        # bf16 values, and rounding there moves codes across their boundaries (2-3 % of a token in fp8).
        self.activations_in = activations_in
        self.in_features, self.out_features = k, n
        self.dtype = dtype
        self.activation_quant = spec.activation_of(name)
        if self.activation_quant is not None and self.activation_quant not in ACTIVATION_QUANT:
            raise FormatError(f"{name}: activation quantizer {self.activation_quant!r} is not known; known: "
                              f"{sorted(ACTIVATION_QUANT)}")
        weight = spec.decode(stored, n, k, name, dtype)  # validates eagerly, even when not cached
        self.stored = stored  # compact: kept so that a precision switch decodes afresh
        self.register_buffer("cached_weight", weight if cache else None, persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.to(dtype), requires_grad=False)

    def weight(self) -> torch.Tensor:
        if self.cached_weight is not None:
            return self.cached_weight
        return self.spec.decode(self.stored, self.out_features, self.in_features, self.name, self.dtype)

    def set_dtype(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        if self.cached_weight is not None:  # decode again: rounding the fp32 weight would not be fp64
            self.cached_weight = self.spec.decode(self.stored, self.out_features, self.in_features, self.name,
                                                  dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.dtype)
        w = self.weight().to(x.device)  # uncached: decoded where the compact tensors live
        if self.activation_quant is not None:
            if self.activations_in is not None:
                x = x.to(self.activations_in).to(self.dtype)
            x_q, s_x = ACTIVATION_QUANT[self.activation_quant](x)
            y = F.linear(x_q, w) / s_x
            return y if self.bias is None else y + self.bias
        return F.linear(x, w, self.bias)

    def extra_repr(self) -> str:
        fmt = self.spec.quant_method
        return f"{self.name}: {fmt}, in={self.in_features}, out={self.out_features}, dtype={self.dtype}"

