"""Gemma3 text (``Gemma3ForCausalLM``, ``model_type`` gemma3_text): Gemma2's four norms a layer, scaled
embedding and taps, plus an RMSNorm over each head of q and of k (``q_norm`` / ``k_norm``), which
transformers applies to ``[batch, heads, tokens, head_dim]`` and vLLM to ``[tokens, heads, head_dim]``. It has
no final soft cap and an ``lm_head`` on both sides (tied to the embedding); sliding and full attention layers
have their own rope base."""

from vllm_parity.architectures import Architecture, TapPoint
from vllm_parity.architectures.gemma2 import GEMMA2_TAPS, SANDWICH_NORM_DECODER, SCALED_EMBEDDING
from vllm_parity.architectures.qwen3 import with_head_norms

GEMMA3 = Architecture(
    model_type="gemma3_text",
    taps=with_head_norms(GEMMA2_TAPS, (
        TapPoint("layers.{i}.attn.q_norm", "model.layers.{i}.self_attn.q_norm", "output", "heads_first_flat"),
        TapPoint("layers.{i}.attn.k_norm", "model.layers.{i}.self_attn.k_norm", "output", "heads_first_flat"),
    )),
    norm_offset=1.0,
    layer_inputs={**SANDWICH_NORM_DECODER, "attn.q_norm": ("attn.q",), "attn.k_norm": ("attn.k",),
                  "attn.context": ("attn.q_norm", "attn.k_norm", "attn.v")},
    serving={**SCALED_EMBEDDING,
             "layers.{i}.attn.q_norm": TapPoint("layers.{i}.attn.q_norm", "model.layers.{i}.self_attn.q_norm",
                                                "output", "heads_flat"),
             "layers.{i}.attn.k_norm": TapPoint("layers.{i}.attn.k_norm", "model.layers.{i}.self_attn.k_norm",
                                                "output", "heads_flat")},
    fixture_config={"architectures": ["Gemma3ForCausalLM"], "hidden_act": "gelu_pytorch_tanh",
                    "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True,
                    "query_pre_attn_scalar": 64, "sliding_window": 16,
                    "layer_types": None, "sliding_window_pattern": 2,
                    "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}},
)
