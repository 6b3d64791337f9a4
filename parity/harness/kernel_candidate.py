"""The ``kernels`` candidate: the reference's modeling code with the serving side's kernel linears.

It runs where vLLM is absent (a GPU machine without vLLM, a laptop): the same transformers model as
the reference, every quantized projection computed by its format's kernel linear
(:mod:`vllm_parity.serving.linears`) instead of a decoded fp32 weight, so a difference between the two
is the kernels' alone.
"""

from __future__ import annotations

import torch
from torch import nn

from vllm_parity.reference.checkpoint import Checkpoint
from vllm_parity.reference.linear import ReferenceLinear
from vllm_parity.reference.model import build_reference_model
from vllm_parity.serving.linears import linear_for


def build_kernel_model(ckpt: Checkpoint, backend: str | None = None, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The model in the serving ``dtype``: its float tensors cast to it, the kernels fed it."""
    model = build_reference_model(ckpt, cache=False)
    for name, module in list(model.named_modules()):
        if isinstance(module, ReferenceLinear):
            parent, child = name.rsplit(".", 1)
            factory = linear_for(module.spec.quant_method)
            kernel = factory(module.spec, module.stored, module.out_features, module.in_features, module.name, backend)
            setattr(model.get_submodule(parent), child, kernel if module.bias is None else _Biased(kernel, module.bias))
    return model if dtype == torch.float32 else model.to(dtype)


class _Biased(nn.Module):
    """A kernel linear and the projection's float bias (kernels compute ``x @ W^T`` only)."""

    def __init__(self, kernel: nn.Module, bias: torch.Tensor):
        super().__init__()
        self.kernel, self.bias = kernel, bias
        self.in_features, self.out_features = kernel.in_features, kernel.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.kernel(x)
        return y + self.bias.to(y.dtype)
