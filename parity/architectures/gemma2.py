"""Gemma2 (``Gemma2ForCausalLM``): four norms a layer, each ``x̂·(1+w)``: the attention's output and the MLP's
output are normed before their residual add (``attn.post_norm``, ``mlp.post_norm``), and the MLP reads
``pre_feedforward_layernorm`` (``mlp.norm``).

transformers scales the embedding by √hidden inside ``embed_tokens``, vLLM after it (the ``embed`` tap scales
vLLM's). The final logit soft cap comes after transformers' ``lm_head`` (the ``logits`` tap is the model's
output there) and inside vLLM's logits processor. Attention soft caps and sliding windows are inside the
attention on both sides; the fixtures' prompts are longer than their window.
"""

from dataclasses import replace

from vllm_parity.architectures import VLLM_DECODER, Architecture, TapPoint
from vllm_parity.architectures.llama import LLAMA

_L = "model.layers.{i}"


def _sandwich(p: TapPoint) -> tuple[TapPoint, ...]:
    """Llama's row, as Gemma2 has it: the post-sublayer norms after each sublayer's output."""
    if p.tap == "layers.{i}.attn.o":
        return p, TapPoint("layers.{i}.attn.post_norm", f"{_L}.post_attention_layernorm", "output")
    if p.tap == "layers.{i}.mlp.norm":
        return (replace(p, module=f"{_L}.pre_feedforward_layernorm"),)
    if p.tap == "layers.{i}.mlp.down":
        return p, TapPoint("layers.{i}.mlp.post_norm", f"{_L}.post_feedforward_layernorm", "output")
    if p.tap == "logits":
        return (TapPoint("logits", "", "output", "logits_attr"),)
    return (p,)


GEMMA2_TAPS = tuple(q for p in LLAMA.taps for q in _sandwich(p))

# each half of the layer is normed after its sublayer too, before the residual add
SANDWICH_NORM_DECODER = {
    "attn.norm": ("input",), "attn.q": ("attn.norm",), "attn.k": ("attn.norm",), "attn.v": ("attn.norm",),
    "attn.context": ("attn.q", "attn.k", "attn.v"), "attn.o": ("attn.context",),
    "attn.post_norm": ("attn.o",), "mlp.norm": ("input", "attn.post_norm"), "mlp.gate": ("mlp.norm",),
    "mlp.up": ("mlp.norm",), "mlp.act": ("mlp.gate", "mlp.up"), "mlp.down": ("mlp.act",),
    "mlp.post_norm": ("mlp.down",), "output": ("input", "attn.post_norm", "mlp.post_norm"),
}

SCALED_EMBEDDING = {**VLLM_DECODER, "embed": TapPoint("embed", "model.embed_tokens", "output", "times_sqrt_width")}

GEMMA2 = Architecture(
    model_type="gemma2",
    taps=GEMMA2_TAPS,
    layer_inputs=SANDWICH_NORM_DECODER,
    serving=SCALED_EMBEDDING,
    norm_offset=1.0,
    fixture_config={"architectures": ["Gemma2ForCausalLM"], "hidden_act": "gelu_pytorch_tanh",
                    "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True,
                    "query_pre_attn_scalar": 64, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
                    "sliding_window": 16},
)
