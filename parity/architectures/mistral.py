"""Mistral (``MistralForCausalLM``): Llama's modules and dataflow; its sliding window is off in the fixtures
(vLLM's Mistral is its Llama model)."""

from vllm_parity.architectures import Architecture
from vllm_parity.architectures.llama import LLAMA

MISTRAL = Architecture(
    model_type="mistral",
    taps=LLAMA.taps,
    layer_inputs=LLAMA.layer_inputs,
    fixture_config={"architectures": ["MistralForCausalLM"], "sliding_window": None},
)
