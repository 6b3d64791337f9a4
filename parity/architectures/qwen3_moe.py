"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3's attention (per-head q / k norms); its sparse layers are a
mixture of experts without a shared expert (router and block output, as Mixtral's), and the layers of
``mlp_only_layers`` (or off ``decoder_sparse_step``) a dense MLP with Llama's taps."""

from vllm_parity.architectures import Architecture
from vllm_parity.architectures.mixtral import BLOCK, ROUTER, with_moe
from vllm_parity.architectures.qwen2_moe import SPARSE_DECODER, dense, on_sparse
from vllm_parity.architectures.qwen3 import HEAD_NORM_DECODER, QWEN3

QWEN3_MOE = Architecture(
    model_type="qwen3_moe",
    taps=with_moe(QWEN3.taps, on_sparse((ROUTER, BLOCK)), keep_mlp=dense),
    layer_inputs={**SPARSE_DECODER, **{k: v for k, v in HEAD_NORM_DECODER.items() if k.startswith("attn.")}},
    fixture_config={"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4, "num_experts_per_tok": 2,
                    "moe_intermediate_size": 64, "decoder_sparse_step": 1, "mlp_only_layers": [1],
                    "norm_topk_prob": True, "use_sliding_window": False, "sliding_window": None},
)
