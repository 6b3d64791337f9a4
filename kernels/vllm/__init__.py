"""The vLLM plugin: one module per scheme (``ternary``, ``int8x``), each holding its QuantizationConfig
(``CONFIG``) and LinearMethod; ``common`` holds what they share.

vLLM calls :func:`register` (entry point ``vllm.general_plugins: vllm_parity``) once in every process it
starts (the front end, the engine core, each tensor-parallel worker), so the quantization methods exist
wherever a model is built, without the user importing anything.
"""

from __future__ import annotations

import importlib
import pkgutil

_registered = False


def schemes() -> dict[str, type]:
    """quant_method -> QuantizationConfig class, for every scheme module of this package."""
    out = {}
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        config = getattr(module, "CONFIG", None)
        if config is not None:
            out[config.method_name] = config
    return out


def register() -> None:
    """Register every scheme's config, and the model classes vLLM lacks, with vLLM; safe to call repeatedly."""
    global _registered
    if _registered:
        return
    from vllm import ModelRegistry
    from vllm.model_executor.layers.quantization import register_quantization_config

    for name, config in schemes().items():
        register_quantization_config(name)(config)
    # By "module:class": the module is imported only where a checkpoint names the architecture.
    ModelRegistry.register_model("BitNetForCausalLM", "vllm_parity.serving.vllm.models.bitnet:BitNetForCausalLM")
    _registered = True
