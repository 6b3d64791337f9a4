"""BitNet b1.58 (``BitNetForCausalLM``): Llama's modules plus two sub-norms, ``self_attn.attn_sub_norm`` over
the attention output before ``o_proj`` and ``mlp.ffn_sub_norm`` over ``act(gate) * up`` before ``down_proj``,
with activation ``relu2``.

``attn.context`` and ``mlp.act`` are the sub-norms' inputs (not the inputs of ``o_proj`` / ``down_proj``, which
are the sub-norms' outputs). The vLLM side is this package's own model (``vllm_parity.serving.vllm.models.bitnet``),
which keeps transformers' module names, so every tap sits on the same path on both sides; its q/k/v and
gate/up fusions are derived as for Llama.
"""

from vllm_parity.architectures import PRE_NORM_DECODER, Architecture, TapPoint
from vllm_parity.architectures.llama import LLAMA

_SUB_NORMS = {
    "layers.{i}.attn.context": (
        TapPoint("layers.{i}.attn.context", "model.layers.{i}.self_attn.attn_sub_norm", "input", "arg0"),
        TapPoint("layers.{i}.attn.sub_norm", "model.layers.{i}.self_attn.attn_sub_norm", "output"),
    ),
    "layers.{i}.mlp.act": (
        TapPoint("layers.{i}.mlp.act", "model.layers.{i}.mlp.ffn_sub_norm", "input", "arg0"),
        TapPoint("layers.{i}.mlp.sub_norm", "model.layers.{i}.mlp.ffn_sub_norm", "output"),
    ),
}

BITNET = Architecture(
    model_type="bitnet",
    taps=tuple(q for p in LLAMA.taps for q in _SUB_NORMS.get(p.tap, (p,))),
    layer_inputs={
        **PRE_NORM_DECODER,
        "attn.sub_norm": ("attn.context",), "attn.o": ("attn.sub_norm",),
        "mlp.sub_norm": ("mlp.act",), "mlp.down": ("mlp.sub_norm",),
    },
    fixture_config={"architectures": ["BitNetForCausalLM"], "hidden_act": "relu2", "attention_bias": False},
)
