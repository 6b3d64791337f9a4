"""vllm-parity: layer-by-layer parity of quantized models served by vLLM."""
