"""Model classes the plugin adds to vLLM's registry (lazily, by name: see ``vllm_parity.serving.vllm.register``)."""
