"""The ``kernels`` candidate: the reference's modeling code with the project's kernel linears.

It runs where vLLM is absent (a GPU machine without vLLM, a laptop): the same transformers Llama as
the reference, every quantized projection computed by the kernels' custom ops instead of a decoded
fp32 weight, so a difference between the two is the kernels' alone.
"""

from __future__ import annotations

import torch
from torch import nn

from references.checkpoint import Checkpoint
from references.formats import Int8xSpec, TernarySpec
from references.linear import ReferenceLinear
from references.model import build_reference_model


class KernelLinear(nn.Module):
    def __init__(self, ref: ReferenceLinear, backend: str | None = None):
        super().__init__()
        self.name, self.spec, self.backend = ref.name, ref.spec, backend
        self.in_features, self.out_features = ref.in_features, ref.out_features
        n, k = ref.out_features, ref.in_features
        if isinstance(ref.spec, TernarySpec):
            from kernels import ternary_ops

            self.native = ternary_ops.repack(ref.stored["packed"], ref.stored["scale"], ref.spec, n, k)
            if self.native.device.type == "cuda":
                self.native = self.native.with_tiles()  # for the tensor-core kernel
        elif isinstance(ref.spec, Int8xSpec):
            self.tensors = dict(ref.stored)
        else:
            raise TypeError(f"{ref.name}: no kernel for {type(ref.spec).__name__}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.spec, TernarySpec):
            from kernels import ternary_ops

            return ternary_ops.ternary_linear(x, self.native, backend=self.backend)
        from kernels import int8x_ops

        return int8x_ops.linear(x, self.tensors, shape=(self.out_features, self.in_features), spec=self.spec,
                                backend=self.backend)


def build_kernel_model(ckpt: Checkpoint, backend: str | None = None) -> nn.Module:
    model = build_reference_model(ckpt, cache=False)
    for name, module in list(model.named_modules()):
        if isinstance(module, ReferenceLinear):
            parent, child = name.rsplit(".", 1)
            setattr(model.get_submodule(parent), child, KernelLinear(module, backend))
    return model
