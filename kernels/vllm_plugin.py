"""vLLM general plugin (entry point ``vllm.general_plugins: vllm_parity``).

vLLM calls :func:`register` once in every process it starts (the front end, the engine core, each
tensor-parallel worker), so the quantization methods ``ternary`` and ``int8x`` exist wherever a model
is built, without the user importing anything.
"""

from __future__ import annotations

METHODS = ("ternary", "int8x")
_registered = False


def register() -> None:
    """Register the ``ternary`` and ``int8x`` quantization configs with vLLM; safe to call repeatedly."""
    global _registered
    if _registered:
        return
    from vllm.model_executor.layers.quantization import register_quantization_config

    from kernels.vllm_config import CONFIGS

    for name in METHODS:
        register_quantization_config(name)(CONFIGS[name])
    _registered = True
