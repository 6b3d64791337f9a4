"""A user's format on the serving floor: the vLLM QuantizationConfig and LinearMethod of ``parity_dummy_int8``,
and its kernel linear for the ``kernels`` candidate. It dequantizes with its own code, not the reference's."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests.extensions.dummy_int8_reference import DummyInt8Spec
from vllm_parity.serving import linears


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.to(torch.float32) * scale.to(torch.float32).unsqueeze(1)


class KernelLinear(nn.Module):
    def __init__(self, spec: DummyInt8Spec, stored: dict, n: int, k: int, name: str = "weight", backend=None):
        super().__init__()
        self.weight = dequantize(stored["q"], stored["scale"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(x.dtype))


linears.register(DummyInt8Spec.quant_method, KernelLinear)


def register_with_vllm() -> None:
    from vllm.model_executor.layers.linear import LinearMethodBase, register_weight_loader_v2_supported_method
    from vllm.model_executor.layers.quantization import register_quantization_config
    from vllm.model_executor.parameter import ChannelQuantScaleParameter, ModelWeightParameter

    from vllm_parity.serving.vllm.common import ParityQuantConfig

    @register_weight_loader_v2_supported_method
    class DummyInt8Method(LinearMethodBase):
        def __init__(self, spec, modules):
            self.spec, self.modules = spec, modules

        def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                           params_dtype, **extra):
            n, loader = sum(output_partition_sizes), extra["weight_loader"]
            layer.register_parameter("weight_q", ModelWeightParameter(
                data=torch.empty(n, input_size_per_partition, dtype=torch.int8), input_dim=1, output_dim=0,
                weight_loader=loader))
            layer.register_parameter("weight_scale", ChannelQuantScaleParameter(
                data=torch.empty(n, dtype=torch.float32), output_dim=0, weight_loader=loader))

        def process_weights_after_loading(self, layer):
            layer.register_buffer("dense", dequantize(layer.weight_q.data, layer.weight_scale.data), persistent=False)

        def apply(self, layer, x, bias=None):
            return F.linear(x, layer.dense.to(x.dtype), bias)

    @register_quantization_config(DummyInt8Spec.quant_method)
    class DummyInt8Config(ParityQuantConfig):
        spec_type = DummyInt8Spec
        method_name = DummyInt8Spec.quant_method

        def make_method(self, modules):
            return DummyInt8Method(self.spec, modules)
