"""Qwen2-MoE (``Qwen2MoeForCausalLM``): Qwen2's attention (q/k/v biases); each sparse layer's MLP is a
mixture of routed experts plus a shared expert, scaled by a sigmoid gate.

Besides the router and the block output (as Mixtral's), the shared expert's output before its gate
(``moe.shared``, the output of its ``down_proj``: vLLM applies the gate inside the shared expert's own
forward, transformers in the block) and the input of that projection (``moe.shared_act``). vLLM's experts
output already includes the shared expert, transformers' does not: the block's output is what compares.
"""

from typing import Any, Mapping

from vllm_parity.architectures import Architecture, TapPoint
from vllm_parity.architectures.llama import LLAMA
from vllm_parity.architectures.mixtral import BLOCK, MOE_DECODER, ROUTER, with_moe


def sparse(config: Mapping[str, Any], i: int) -> bool:
    """Whether decoder layer ``i`` is a mixture of experts (transformers' and vLLM's rule; transformers'
    config object of Qwen3-MoE keeps ``num_experts`` as ``num_local_experts``)."""
    experts = config.get("num_experts", config.get("num_local_experts")) or 0
    return (i not in (config.get("mlp_only_layers") or []) and int(experts) > 0
            and (i + 1) % int(config.get("decoder_sparse_step") or 1) == 0)


def dense(config: Mapping[str, Any], i: int) -> bool:
    return not sparse(config, i)


def on_sparse(points: tuple[TapPoint, ...]) -> tuple[TapPoint, ...]:
    return tuple(TapPoint(p.tap, p.module, p.hook, p.take, sparse) for p in points)


SHARED = (
    TapPoint("layers.{i}.moe.shared_act", "model.layers.{i}.mlp.shared_expert.down_proj", "input", "arg0"),
    TapPoint("layers.{i}.moe.shared", "model.layers.{i}.mlp.shared_expert.down_proj", "output"),
)

# a dense layer's output reads mlp.down, a sparse one's moe.out: each layer has one of the two
SPARSE_DECODER = {**MOE_DECODER, "mlp.gate": ("mlp.norm",), "mlp.up": ("mlp.norm",), "mlp.act": ("mlp.gate", "mlp.up"),
                  "mlp.down": ("mlp.act",), "output": ("input", "attn.o", "mlp.down", "moe.out")}
SHARED_DECODER = {**SPARSE_DECODER, "moe.shared_act": ("mlp.norm",), "moe.shared": ("moe.shared_act",),
                  "moe.out": ("mlp.norm", "moe.router", "moe.shared")}

QWEN2_MOE = Architecture(
    model_type="qwen2_moe",
    taps=with_moe(LLAMA.taps, on_sparse((ROUTER, *SHARED, BLOCK)), keep_mlp=dense),
    layer_inputs=SHARED_DECODER,
    float_modules=("shared_expert_gate",),
    fixture_config={"architectures": ["Qwen2MoeForCausalLM"], "num_experts": 4, "num_experts_per_tok": 2,
                    "moe_intermediate_size": 64, "shared_expert_intermediate_size": 128, "decoder_sparse_step": 1,
                    "mlp_only_layers": [], "norm_topk_prob": False, "qkv_bias": True,
                    "use_sliding_window": False, "sliding_window": None},
)
