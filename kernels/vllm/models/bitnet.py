"""BitNet b1.58 (``BitNetForCausalLM``, transformers' ``model_type`` "bitnet") in vLLM, which has none.

vLLM's Llama with two sub-norms and relu²: ``self_attn.attn_sub_norm`` (RMSNorm over the attention output,
before ``o_proj``) and ``mlp.ffn_sub_norm`` (over ``relu(gate)² * up``, before ``down_proj``). Module names are
transformers' and Llama's (q/k/v fused into ``qkv_proj``, gate/up into ``gate_up_proj``, as
``packed_modules_mapping`` says), so Llama's stacked weight mapping loads the checkpoint, every quantization
method of the plugin serves the projections, and the parity harness's tap map is derived as for Llama.
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    split_tensor_along_last_dim,
    tensor_model_parallel_all_gather,
)
from vllm.model_executor.layers.activation import get_act_fn
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from vllm.model_executor.layers.quantization import QuantizationConfig
from vllm.model_executor.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM

# Tensor parallelism: a sub-norm's statistics span the whole row (all heads, all intermediate features),
# while each rank holds a slice of it. The sub-norms gather the row, normalize it whole on every rank (the
# single-rank computation, bit for bit, with the weight replicated), and each rank hands its own slice to
# the row-parallel projection. The gather costs one all-gather of the activation per sub-norm; it keeps the
# sub-norm's input and output whole tensors, alike on every rank.


def _whole(x: torch.Tensor) -> torch.Tensor:
    """All ranks' features of a column-parallel activation, in rank order."""
    return tensor_model_parallel_all_gather(x.contiguous()) if get_tensor_model_parallel_world_size() > 1 else x


def _own(x: torch.Tensor) -> torch.Tensor:
    """This rank's features of a whole row: the input a row-parallel layer expects."""
    tp = get_tensor_model_parallel_world_size()
    if tp == 1:
        return x
    return split_tensor_along_last_dim(x, tp)[get_tensor_model_parallel_rank()].contiguous()


class BitNetMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, rms_norm_eps: float,
                 quant_config: QuantizationConfig | None = None, prefix: str = ""):
        super().__init__()
        if hidden_act != "relu2":
            raise ValueError(f"{prefix}: BitNet's MLP computes relu2(gate) * up; config.json's hidden_act is "
                             f"{hidden_act!r}")
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=False,
                                                       quant_config=quant_config, prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=False, quant_config=quant_config,
                                           prefix=f"{prefix}.down_proj")
        self.act_fn = get_act_fn(hidden_act)
        self.ffn_sub_norm = RMSNorm(intermediate_size, eps=rms_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up, _ = self.gate_up_proj(x)
        gate, up = gate_up.chunk(2, dim=-1)
        x, _ = self.down_proj(_own(self.ffn_sub_norm(_whole(self.act_fn(gate) * up))))
        return x


class BitNetAttention(LlamaAttention):
    def __init__(self, *, config, **kwargs):
        super().__init__(config=config, **kwargs)
        self.attn_sub_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        context = _whole(self.attn(q, k, v))
        output, _ = self.o_proj(_own(self.attn_sub_norm(context)))
        return output


class BitNetDecoderLayer(LlamaDecoderLayer):
    """Llama's decoder layer (its ``(hidden_states, residual)`` forward) with BitNet's attention and MLP."""

    def __init__(self, vllm_config: VllmConfig, prefix: str = "", config=None):
        nn.Module.__init__(self)  # Llama's own __init__ builds a SiLU MLP
        config = config or vllm_config.model_config.hf_config
        quant_config = self.get_quant_config(vllm_config)
        bias = getattr(config, "attention_bias", False)
        self.hidden_size = config.hidden_size
        self.self_attn = BitNetAttention(
            config=config, hidden_size=config.hidden_size, num_heads=config.num_attention_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", config.num_attention_heads),
            max_position_embeddings=getattr(config, "max_position_embeddings", 8192), quant_config=quant_config,
            bias=bias, bias_o_proj=bias, cache_config=vllm_config.cache_config, prefix=f"{prefix}.self_attn")
        self.mlp = BitNetMLP(config.hidden_size, config.intermediate_size, config.hidden_act, config.rms_norm_eps,
                             quant_config=quant_config, prefix=f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class BitNetForCausalLM(LlamaForCausalLM):
    """Llama's model, head, logits processor and weight loading (``LlamaModel.hf_to_vllm_mapper`` stacks
    ``q_proj``/``k_proj``/``v_proj`` into ``qkv_proj`` shards "q"/"k"/"v" and ``gate_proj``/``up_proj`` into
    ``gate_up_proj`` shards 0/1) over BitNet's decoder layers."""

    packed_modules_mapping = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=BitNetDecoderLayer)
