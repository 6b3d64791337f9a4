"""Reverse engineering of a checkpoint's quantization format from its tensors (``parity inspect``).

config.json's architecture gives every projection's logical ``(N, K)``; the scan asks each registered
format whether a projection's tensors look like it (:mod:`.layout`), the checkpoint's format infers its
``quantization_config`` keys from their shapes and names, and with ``--against`` from the dequantized
float weights (``fit``); one pass reads every tensor once (statistics, each matrix's entry, verification
by decoding it with the reference decoder), and the report adds the vLLM mapping (:mod:`.mapping`).

A format is one module here (``ternary``, ``int8x``, ``compressed_tensors``, ``awq``, ``gptq``) registering a :class:`Format` under its
``quant_method`` (:mod:`.registry`); the rest never names one. Everything returns plain data (dicts,
lists); :mod:`vllm_parity.tools.inspect` renders it.
"""

from __future__ import annotations

from vllm_parity.tools.inference.inspection import SCHEMA, Inspection, inspect_checkpoint
from vllm_parity.tools.inference.layout import Matrix
from vllm_parity.tools.inference.registry import Format, register, registered
from vllm_parity.tools.inference.stats import compare, natural_sorted, tensor_stats

# The built-in formats, registered on import; this order is the report's (its messages list formats in it).
from vllm_parity.tools.inference import ternary, int8x, compressed_tensors, awq, gptq  # isort: skip

__all__ = ["SCHEMA", "Format", "Inspection", "Matrix", "awq", "compare", "compressed_tensors", "gptq",
           "inspect_checkpoint", "int8x", "natural_sorted", "register", "registered", "tensor_stats", "ternary"]
