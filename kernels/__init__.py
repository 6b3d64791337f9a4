"""The system under test: the kernels and the vLLM plugin that serves the formats."""
