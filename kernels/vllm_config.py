"""vLLM ``QuantizationConfig`` classes for the FORMATS.md formats ``ternary`` and ``int8x``.

Config (this module) reads ``quantization_config`` through the project's one parser and picks a
method per layer; the methods (``kernels.vllm_methods``) declare, load, repack and apply the weights;
the kernels (``kernels.ternary_ops``, ``kernels.int8x_ops``) compute.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase

from references.errors import FormatError
from references.formats import FormatSpec, Int8xSpec, TernarySpec, parse_quantization_config

# Llama's fused layers and the checkpoint modules each one holds, in shard order. vLLM hands the
# model's own mapping to the config (SupportsQuant); this is the fallback for models that do not.
DEFAULT_PACKED_MODULES = {
    "qkv_proj": ["q_proj", "k_proj", "v_proj"],
    "gate_up_proj": ["gate_proj", "up_proj"],
}


class ParityQuantConfig(QuantizationConfig):
    """Common part: parse the spec, resolve fused layers to checkpoint modules, honour ``ignore``."""

    spec_type: type = object
    method_name: str = ""

    def __init__(self, spec: FormatSpec):
        super().__init__()  # creates packed_modules_mapping, which SupportsQuant updates
        if not isinstance(spec, self.spec_type):
            raise FormatError(f"{type(self).__name__} needs a {self.spec_type.__name__}, got {spec!r}")
        self.spec = spec

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r})"

    # -- QuantizationConfig API ---------------------------------------------------------------

    def get_name(self) -> str:
        return self.method_name

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.float16, torch.bfloat16]

    @classmethod
    def get_min_capability(cls) -> int:
        # Checked on GPUs only; the Triton kernels need Volta or newer.
        return 70

    @staticmethod
    def get_config_filenames() -> list[str]:
        # The format lives in config.json's quantization_config; no separate file is read.
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ParityQuantConfig:
        try:
            spec = parse_quantization_config(config)
        except FormatError as exc:
            raise FormatError(f"config.json quantization_config: {exc}") from None
        if not isinstance(spec, cls.spec_type):
            raise FormatError(f"config.json quantization_config has quant_method "
                              f"{config.get('quant_method')!r}, which {cls.__name__} ({cls.method_name!r}) "
                              f"does not read")
        return cls(spec)

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        if not isinstance(layer, LinearBase):
            return None  # embeddings, lm_head, attention: unquantized
        modules = self.checkpoint_modules(prefix)
        ignored = [m for m in modules if self.spec.is_ignored(m)]
        if len(ignored) == len(modules):
            return UnquantizedLinearMethod()
        if ignored:
            kept = [m for m in modules if m not in ignored]
            raise FormatError(
                f"quantization_config ignore {list(self.spec.ignore)} leaves {ignored} unquantized but "
                f"not {kept}; vLLM fuses them into one layer ({prefix}), so they must be quantized alike")
        return self.make_method(modules)

    # -- helpers ------------------------------------------------------------------------------

    def checkpoint_modules(self, prefix: str) -> list[str]:
        """The checkpoint module names a vLLM layer holds: 3 for qkv_proj, 2 for gate_up_proj, else 1."""
        parent, _, last = prefix.rpartition(".")
        mapping = self.packed_modules_mapping or DEFAULT_PACKED_MODULES
        parts = mapping.get(last)
        if not parts:
            return [prefix]
        return [f"{parent}.{p}" if parent else p for p in parts]

    def make_method(self, modules: list[str]) -> QuantizeMethodBase:
        raise NotImplementedError


class TernaryConfig(ParityQuantConfig):
    """``quant_method: ternary`` (FORMATS.md section 1)."""

    spec_type = TernarySpec
    method_name = "ternary"

    def make_method(self, modules: list[str]) -> QuantizeMethodBase:
        from kernels.vllm_methods import TernaryLinearMethod

        return TernaryLinearMethod(self.spec, modules)


class Int8xConfig(ParityQuantConfig):
    """``quant_method: int8x`` (FORMATS.md section 2)."""

    spec_type = Int8xSpec
    method_name = "int8x"

    def make_method(self, modules: list[str]) -> QuantizeMethodBase:
        from kernels.vllm_methods import Int8xLinearMethod

        return Int8xLinearMethod(self.spec, modules)


CONFIGS: dict[str, type[ParityQuantConfig]] = {"ternary": TernaryConfig, "int8x": Int8xConfig}
