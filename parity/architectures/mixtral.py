"""Mixtral (``MixtralForCausalLM``): Llama's attention; every layer's MLP is a sparse mixture of experts.

transformers fuses each layer's experts into 3-D parameters (no per-expert module to hook), so the taps are
the router's logits (``moe.router``; transformers' router returns ``(logits, scores, indices)``, vLLM's gate
``(logits, bias)``: the first on both) and the block's output (``moe.out``). vLLM names the block
``block_sparse_moe``, as Mixtral's checkpoints do.
"""

from vllm_parity.architectures import PRE_NORM_DECODER, Architecture, TapPoint
from vllm_parity.architectures.llama import LLAMA

ROUTER = TapPoint("layers.{i}.moe.router", "model.layers.{i}.mlp.gate", "output")
BLOCK = TapPoint("layers.{i}.moe.out", "model.layers.{i}.mlp", "output")


def with_moe(taps: tuple[TapPoint, ...], moe: tuple[TapPoint, ...], keep_mlp=None) -> tuple[TapPoint, ...]:
    """``taps`` with ``moe`` after the MLP's norm, in place of the dense MLP's taps (which are kept, limited
    to the layers ``keep_mlp`` holds for, when it is given)."""
    at = next(j for j, p in enumerate(taps) if p.tap == "layers.{i}.mlp.norm") + 1
    dense = tuple(p for p in taps if p.tap.startswith("layers.{i}.mlp.") and p.tap != "layers.{i}.mlp.norm")
    rest = tuple(p for p in taps[at:] if p not in dense)
    kept = () if keep_mlp is None else tuple(TapPoint(p.tap, p.module, p.hook, p.take, keep_mlp) for p in dense)
    return taps[:at] + kept + moe + rest


# the router reads the MLP's norm; the block, the norm through the router; the layer adds the block
MOE_DECODER = {**{k: v for k, v in PRE_NORM_DECODER.items() if not k.startswith("mlp.") or k == "mlp.norm"},
               "moe.router": ("mlp.norm",), "moe.out": ("mlp.norm", "moe.router"),
               "output": ("input", "attn.o", "moe.out")}

MIXTRAL = Architecture(
    model_type="mixtral",
    taps=with_moe(LLAMA.taps, (ROUTER, BLOCK)),
    layer_inputs=MOE_DECODER,
    renames={"mlp": "block_sparse_moe"},
    fixture_config={"architectures": ["MixtralForCausalLM"], "num_local_experts": 4, "num_experts_per_tok": 2,
                    "sliding_window": None, "router_jitter_noise": 0.0},
)
