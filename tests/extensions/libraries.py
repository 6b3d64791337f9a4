"""What the tests assume of the libraries: transformers and vLLM know the dummy architecture (Llama's
classes under another name), and vLLM serves the dummy format (its serving file)."""

from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM


class DummyLlamaConfig(LlamaConfig):
    model_type = "parity_dummy_llama"


class DummyLlamaForCausalLM(LlamaForCausalLM):
    config_class = DummyLlamaConfig


def teach_transformers() -> None:
    AutoConfig.register("parity_dummy_llama", DummyLlamaConfig, exist_ok=True)
    AutoModelForCausalLM.register(DummyLlamaConfig, DummyLlamaForCausalLM, exist_ok=True)


def teach_vllm() -> None:
    from vllm import ModelRegistry

    ModelRegistry.register_model("DummyLlamaForCausalLM", "vllm.model_executor.models.llama:LlamaForCausalLM")
