"""Qwen3 (``Qwen3ForCausalLM``): Llama's modules plus an RMSNorm over each head of q and of k before rope
(``q_norm`` / ``k_norm``); transformers applies it to ``[batch, tokens, heads, head_dim]``, vLLM to
``[tokens, heads, head_dim]``: both flattened to one feature axis."""

from vllm_parity.architectures import PRE_NORM_DECODER, Architecture, TapPoint
from vllm_parity.architectures.llama import LLAMA

_HEAD_NORMS = (
    TapPoint("layers.{i}.attn.q_norm", "model.layers.{i}.self_attn.q_norm", "output", "heads_flat"),
    TapPoint("layers.{i}.attn.k_norm", "model.layers.{i}.self_attn.k_norm", "output", "heads_flat"),
)


def with_head_norms(taps: tuple[TapPoint, ...], head_norms: tuple[TapPoint, ...] = _HEAD_NORMS
                    ) -> tuple[TapPoint, ...]:
    """``taps`` with the per-head norms after the v projection's tap."""
    at = next(j for j, p in enumerate(taps) if p.tap == "layers.{i}.attn.v") + 1
    return taps[:at] + head_norms + taps[at:]


# attention reads q and k through their head norms
HEAD_NORM_DECODER = {**PRE_NORM_DECODER, "attn.q_norm": ("attn.q",), "attn.k_norm": ("attn.k",),
                     "attn.context": ("attn.q_norm", "attn.k_norm", "attn.v")}

QWEN3 = Architecture(
    model_type="qwen3",
    taps=with_head_norms(LLAMA.taps),
    layer_inputs=HEAD_NORM_DECODER,
    fixture_config={"architectures": ["Qwen3ForCausalLM"], "use_sliding_window": False, "sliding_window": None},
)
