"""The format's vLLM quantization method: a ``QuantizationConfig`` and ``LinearMethodBase`` registered through
vLLM's ``vllm.general_plugins`` entry point. It unpacks the nibbles with its own code, apart from the reference
side (``reference.py``), so that parity can tell the two apart."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

QUANT_METHOD = "example_int4"


def dequantize(qweight: torch.Tensor, qscale: torch.Tensor, group_size: int) -> torch.Tensor:
    # deliberately its own unpacking (not reference.decode): shared code would hide a shared bug from parity
    low = (qweight & 0x0F).to(torch.float32) - 8.0
    high = (qweight >> 4).to(torch.float32) - 8.0
    w = torch.empty(qweight.shape[0], qweight.shape[1] * 2)
    w[:, 0::2], w[:, 1::2] = low, high
    return w * torch.repeat_interleave(qscale.to(torch.float32), group_size, dim=1)


def register() -> None:
    from vllm.model_executor.layers.linear import (LinearBase, LinearMethodBase, UnquantizedLinearMethod,
                                                   register_weight_loader_v2_supported_method)
    from vllm.model_executor.layers.quantization import register_quantization_config
    from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
    from vllm.model_executor.parameter import GroupQuantScaleParameter, ModelWeightParameter

    if QUANT_METHOD in _registered:
        return
    _registered.add(QUANT_METHOD)

    @register_weight_loader_v2_supported_method
    class ExampleInt4Method(LinearMethodBase):
        def __init__(self, group_size: int):
            self.group_size = group_size

        def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                           params_dtype, **extra):
            n, k, loader = sum(output_partition_sizes), input_size_per_partition, extra["weight_loader"]
            layer.register_parameter("qweight", ModelWeightParameter(
                data=torch.empty(n, k // 2, dtype=torch.uint8), input_dim=1, output_dim=0, weight_loader=loader))
            layer.register_parameter("qscale", GroupQuantScaleParameter(
                data=torch.empty(n, k // self.group_size, dtype=torch.float16), input_dim=1, output_dim=0,
                weight_loader=loader))

        def process_weights_after_loading(self, layer):
            dense = dequantize(layer.qweight.data, layer.qscale.data, self.group_size)
            layer.register_buffer("dense", dense.to(layer.qscale.device), persistent=False)

        def apply(self, layer, x, bias=None):
            return F.linear(x, layer.dense.to(x.dtype), bias)

    @register_quantization_config(QUANT_METHOD)
    class ExampleInt4Config(QuantizationConfig):
        def __init__(self, group_size: int, ignore: list[str]):
            super().__init__()
            self.group_size, self.ignore = group_size, ignore

        def get_name(self):
            return QUANT_METHOD

        def get_supported_act_dtypes(self):
            return [torch.float32, torch.float16, torch.bfloat16]

        @classmethod
        def get_min_capability(cls):
            return 70

        @staticmethod
        def get_config_filenames():
            return []

        @classmethod
        def from_config(cls, config: dict[str, Any]):
            return cls(int(config.get("group_size", 32)), list(config.get("ignore", ["lm_head"])))

        def get_quant_method(self, layer, prefix):
            if not isinstance(layer, LinearBase):
                return None
            if any(prefix == p or prefix.endswith("." + p) for p in self.ignore):
                return UnquantizedLinearMethod()
            return ExampleInt4Method(self.group_size)


_registered: set[str] = set()
