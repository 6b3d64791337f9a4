"""Phi3 (``Phi3ForCausalLM``): Llama's dataflow with q/k/v and gate/up fused on disk and in transformers too
(``qkv_proj``, ``gate_up_proj``): each tap is its slice of the fused output on both sides (transformers'
split by the config's heads and halves, vLLM's by the fused layer's output sizes)."""

from vllm_parity.architectures import PRE_NORM_DECODER, Architecture, TapPoint
from vllm_parity.architectures.llama import LLAMA

_SPLIT = {
    "layers.{i}.attn.q": TapPoint("layers.{i}.attn.q", "model.layers.{i}.self_attn.qkv_proj", "output", "qkv.0"),
    "layers.{i}.attn.k": TapPoint("layers.{i}.attn.k", "model.layers.{i}.self_attn.qkv_proj", "output", "qkv.1"),
    "layers.{i}.attn.v": TapPoint("layers.{i}.attn.v", "model.layers.{i}.self_attn.qkv_proj", "output", "qkv.2"),
    "layers.{i}.mlp.gate": TapPoint("layers.{i}.mlp.gate", "model.layers.{i}.mlp.gate_up_proj", "output", "halves.0"),
    "layers.{i}.mlp.up": TapPoint("layers.{i}.mlp.up", "model.layers.{i}.mlp.gate_up_proj", "output", "halves.1"),
}

PHI3 = Architecture(
    model_type="phi3",
    taps=tuple(_SPLIT.get(p.tap, p) for p in LLAMA.taps),
    layer_inputs=PRE_NORM_DECODER,
    fixture_config={"architectures": ["Phi3ForCausalLM"], "sliding_window": None, "resid_pdrop": 0.0,
                    "embd_pdrop": 0.0, "original_max_position_embeddings": 512, "pad_token_id": 0},
)
