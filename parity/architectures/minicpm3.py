"""MiniCPM3 (``MiniCPM3ForCausalLM``): multi-head latent attention (low-rank q through ``q_a_proj``, its norm and
``q_b_proj``; one latent for k and v through ``kv_a_proj_with_mqa``, its norm and ``kv_b_proj``), an embedding
scaled by ``scale_emb``, sublayer outputs scaled by ``scale_depth / √layers`` before their residual add, and
the final norm's output divided by ``hidden / dim_model_base`` before the output embedding.

vLLM scales the embedding after ``embed_tokens`` (the ``embed`` tap scales vLLM's), adds each residual inline
(its layers return no residual), and divides the final hidden state in its forward, not in ``compute_logits``
(``logits_divisor``). transformers projects the kv latent as a one-head ``[batch, 1, tokens, features]`` tensor.
"""

from vllm_parity.architectures import VLLM_DECODER, Architecture, TapPoint
from vllm_parity.architectures.llama import LLAMA

_A = "model.layers.{i}.self_attn"

_MLA = (
    TapPoint("layers.{i}.attn.q_a", f"{_A}.q_a_proj", "output"),
    TapPoint("layers.{i}.attn.q_a_norm", f"{_A}.q_a_layernorm", "output"),
    TapPoint("layers.{i}.attn.q", f"{_A}.q_b_proj", "output"),
    TapPoint("layers.{i}.attn.kv_a", f"{_A}.kv_a_proj_with_mqa", "output"),
    TapPoint("layers.{i}.attn.kv_a_norm", f"{_A}.kv_a_layernorm", "output"),
    TapPoint("layers.{i}.attn.kv", f"{_A}.kv_b_proj", "output", "one_head"),
)

_QKV = ("layers.{i}.attn.q", "layers.{i}.attn.k", "layers.{i}.attn.v")

MINICPM3 = Architecture(
    model_type="minicpm3",
    taps=tuple(q for p in LLAMA.taps if p.tap not in _QKV
               for q in ((p, *_MLA) if p.tap == "layers.{i}.attn.norm" else (p,))),
    layer_inputs={
        "attn.norm": ("input",), "attn.q_a": ("attn.norm",), "attn.q_a_norm": ("attn.q_a",),
        "attn.q": ("attn.q_a_norm",), "attn.kv_a": ("attn.norm",), "attn.kv_a_norm": ("attn.kv_a",),
        "attn.kv": ("attn.kv_a_norm",), "attn.context": ("attn.q", "attn.kv_a", "attn.kv"),
        "attn.o": ("attn.context",), "mlp.norm": ("input", "attn.o"), "mlp.gate": ("mlp.norm",),
        "mlp.up": ("mlp.norm",), "mlp.act": ("mlp.gate", "mlp.up"), "mlp.down": ("mlp.act",),
        "output": ("input", "attn.o", "mlp.down"),
    },
    serving={**VLLM_DECODER,
             "embed": TapPoint("embed", "model.embed_tokens", "output", "times_scale_emb"),
             "layers.{i}.attn.kv": TapPoint("layers.{i}.attn.kv", f"{_A}.kv_b_proj", "output")},
    logits_divisor="scale_width",
    # rms_norm_eps 1e-6: transformers' q_a / kv_a norms take their class default (1e-6), vLLM's the config's
    fixture_config={"architectures": ["MiniCPM3ForCausalLM"], "rms_norm_eps": 1e-6, "q_lora_rank": 96,
                    "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
                    "head_dim": 16, "scale_emb": 12, "scale_depth": 1.4, "dim_model_base": 64, "tie_word_embeddings": False},
)
