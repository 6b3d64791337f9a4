"""Llama (``LlamaForCausalLM``): transformers' modules of each canonical tap. vLLM fuses q/k/v and
gate/up, and its decoder layers pass the residual apart: both derived (see the package)."""

from vllm_parity.architectures import PRE_NORM_DECODER, Architecture, TapPoint

LLAMA = Architecture(
    model_type="llama",
    taps=(
        TapPoint("embed", "model.embed_tokens", "output"),
        TapPoint("layers.{i}.input", "model.layers.{i}", "input", "arg0"),
        TapPoint("layers.{i}.attn.norm", "model.layers.{i}.input_layernorm", "output"),
        TapPoint("layers.{i}.attn.q", "model.layers.{i}.self_attn.q_proj", "output"),
        TapPoint("layers.{i}.attn.k", "model.layers.{i}.self_attn.k_proj", "output"),
        TapPoint("layers.{i}.attn.v", "model.layers.{i}.self_attn.v_proj", "output"),
        TapPoint("layers.{i}.attn.context", "model.layers.{i}.self_attn.o_proj", "input", "arg0"),
        TapPoint("layers.{i}.attn.o", "model.layers.{i}.self_attn.o_proj", "output"),
        TapPoint("layers.{i}.mlp.norm", "model.layers.{i}.post_attention_layernorm", "output"),
        TapPoint("layers.{i}.mlp.gate", "model.layers.{i}.mlp.gate_proj", "output"),
        TapPoint("layers.{i}.mlp.up", "model.layers.{i}.mlp.up_proj", "output"),
        TapPoint("layers.{i}.mlp.act", "model.layers.{i}.mlp.down_proj", "input", "arg0"),
        TapPoint("layers.{i}.mlp.down", "model.layers.{i}.mlp.down_proj", "output"),
        TapPoint("layers.{i}.output", "model.layers.{i}", "output"),
        TapPoint("final_norm", "model.norm", "output"),
        TapPoint("logits", "lm_head", "output"),
    ),
    layer_inputs=PRE_NORM_DECODER,
    fixture_config={"architectures": ["LlamaForCausalLM"], "attention_bias": False, "mlp_bias": False},
)
