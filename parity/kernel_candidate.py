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
            from kernels import int8x_native
            from references.int8x import decode_int8

            self.tensors = dict(ref.stored)
            # The layout vLLM would serve: native where it fits (PARITY_INT8X_LAYOUT), else the streams.
            self.native = int8x_native.for_serving(decode_int8(self.tensors, ref.spec, name=ref.name), self.tensors)
        else:
            raise TypeError(f"{ref.name}: no kernel for {type(ref.spec).__name__}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.spec, TernarySpec):
            from kernels import ternary_ops

            return ternary_ops.ternary_linear(x, self.native, backend=self.backend)
        if self.native is not None:
            from kernels import int8x_native

            if self.native.codes.device != x.device:
                self.native = self.native.to(x.device)
            return int8x_native.linear(x, self.native, backend=int8x_native.backend_for(x.device, self.backend))
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
