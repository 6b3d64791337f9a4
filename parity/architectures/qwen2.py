"""Qwen2 (``Qwen2ForCausalLM``): Llama's modules and dataflow, with a bias on q, k and v (in both sides' q/k/v
taps; vLLM's fused ``qkv_proj`` carries the three)."""

from vllm_parity.architectures import Architecture
from vllm_parity.architectures.llama import LLAMA

QWEN2 = Architecture(
    model_type="qwen2",
    taps=LLAMA.taps,
    layer_inputs=LLAMA.layer_inputs,
    fixture_config={"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": False, "sliding_window": None},
)
