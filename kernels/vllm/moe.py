"""The mixture-of-experts layers (vLLM's ``RoutedExperts``, under ``FusedMoE``) of this project's formats.

Each expert's projections arrive as the checkpoint stores them, one tensor set per expert and projection,
through vLLM's own expert mapping (``experts.{e}.w1.<suffix>`` -> parameter ``w13_<suffix>``, shard ``w1``, expert
``e``); each is kept as loaded, checked complete, decoded once to fp32 by the serving side's own decoders
and stacked into vLLM's ``w13`` / ``w2`` layout. The product is a plain loop over the experts a step routes
to: speed is not the point, the checkpoint's reading is. Under tensor parallelism each rank keeps its slice of
every expert's intermediate features. vLLM's runner does the routing, adds the shared experts and reduces
over ranks.
"""

from __future__ import annotations

from abc import abstractmethod

import torch
import torch.nn.functional as F
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.utils import set_weight_attrs

from vllm_parity.errors import CheckpointError, FormatError
from vllm_parity.reference.formats import FormatSpec

SHARDS = ("w1", "w2", "w3")  # vLLM's shard ids: gate, down, up


class ParityMoEMethod(FusedMoEMethodBase):
    """Loading, completeness and the per-expert product; a format says which tensors an expert's projection
    has and how they decode."""

    def __init__(self, spec: FormatSpec, moe, prefix: str):
        super().__init__(moe)
        self.spec, self.prefix = spec, prefix

    @property
    @abstractmethod
    def suffixes(self) -> tuple[str, ...]:
        """The checkpoint tensors of one expert's projection, by suffix."""

    @abstractmethod
    def decode(self, tensors: dict[str, torch.Tensor], n: int, k: int, name: str) -> torch.Tensor:
        """The fp32 ``(N, K)`` weight of one expert's projection ``name``."""

    def create_weights(self, layer, num_experts: int, hidden_size: int, intermediate_size_per_partition: int,
                       params_dtype: torch.dtype, **extra_weight_attrs):
        parallel = layer.moe_config.moe_parallel_config
        if parallel.use_ep:
            raise FormatError(f"{self.spec.quant_method}: {self.prefix} with expert parallelism is not supported: "
                              f"every rank holds a slice of every expert (tensor parallelism)")
        activation = getattr(layer.activation, "value", layer.activation)
        if activation != "silu" or self.spec.activation_quant is not None:
            raise FormatError(f"{self.spec.quant_method}: {self.prefix}: experts with activation {activation!r} and "
                              f"activation_quant {self.spec.activation_quant!r}; served: silu, none")
        # Each expert is decoded whole (a packed or streamed tensor cannot be cut before decoding), then each
        # rank keeps its slice of the intermediate features, as vLLM's own loader narrows w13 and w2.
        h, i = hidden_size, intermediate_size_per_partition * parallel.tp_size
        layer.parity_shapes = {"w1": (i, h), "w3": (i, h), "w2": (h, i)}
        layer.parity_slice = slice(parallel.tp_rank * intermediate_size_per_partition,
                                   (parallel.tp_rank + 1) * intermediate_size_per_partition)
        layer.parity_experts = num_experts
        layer.parity_stored = {}  # (expert, shard) -> {suffix: tensor}
        for fused in ("w13", "w2"):
            for suffix in self.suffixes:
                def load(param, loaded_weight, weight_name, shard_id, expert_id, return_success=False, _s=suffix):
                    # Own the memory: the loader's tensor may be a view of a memory-mapped file.
                    layer.parity_stored.setdefault((int(expert_id), shard_id), {})[_s] = loaded_weight.clone()
                    return True if return_success else None

                # A placeholder: one expert's tensors are kept whole until every expert has arrived.
                param = torch.nn.Parameter(torch.empty(0), requires_grad=False)
                set_weight_attrs(param, {"weight_loader": load})
                layer.register_parameter(f"{fused}_{suffix}", param)

    def _name(self, layer, expert: int, shard: str) -> str:
        """The checkpoint module of one expert's projection (``...experts.3.w1``)."""
        ckpt = {"w1": layer.ckpt_gate_proj_name, "w2": layer.ckpt_down_proj_name, "w3": layer.ckpt_up_proj_name}
        return f"{self.prefix}.{expert}.{ckpt[shard]}"

    def process_weights_after_loading(self, layer) -> None:
        stored = layer.parity_stored
        missing = [f"{self._name(layer, e, s)}.{suffix}" for e in range(layer.parity_experts) for s in SHARDS
                   for suffix in self.suffixes if suffix not in stored.get((e, s), {})]
        if missing:
            shown = ", ".join(repr(m) for m in missing[:6])
            shown += f" and {len(missing) - 6} more" if len(missing) > 6 else ""
            raise CheckpointError(f"{len(missing)} tensor(s) missing for the {self.spec.quant_method} experts "
                                  f"{self.prefix}: {shown}")
        weights = {s: torch.stack([self.decode(stored[(e, s)], *layer.parity_shapes[s], self._name(layer, e, s))
                                   for e in range(layer.parity_experts)]) for s in SHARDS}
        part = layer.parity_slice
        weights = {"w1": weights["w1"][:, part], "w3": weights["w3"][:, part],
                   "w2": weights["w2"][:, :, part].contiguous()}
        for fused in ("w13", "w2"):
            for suffix in self.suffixes:
                del layer._parameters[f"{fused}_{suffix}"]
        del layer.parity_stored
        # vLLM's layout: gate rows then up rows of each expert, and its down projection
        layer.register_buffer("parity_w13", torch.cat([weights["w1"], weights["w3"]], dim=1), persistent=False)
        layer.register_buffer("parity_w2", weights["w2"], persistent=False)

    def get_fused_moe_quant_config(self, layer):
        return None  # no modular kernel: apply below is the whole product

    def apply(self, layer, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              shared_experts=None, shared_experts_input=None) -> torch.Tensor:
        xf = x.to(torch.float32)
        out = torch.zeros_like(xf)
        for e in topk_ids.unique().tolist():
            tokens, slot = (topk_ids == e).nonzero(as_tuple=True)
            gate, up = F.linear(xf[tokens], layer.parity_w13[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, layer.parity_w2[e])
            out.index_add_(0, tokens, y * topk_weights[tokens, slot, None].to(torch.float32))
        return out.to(x.dtype)


class TernaryMoEMethod(ParityMoEMethod):
    @property
    def suffixes(self) -> tuple[str, ...]:
        return (self.spec.weight_name, self.spec.scale_name)

    def decode(self, tensors, n, k, name):
        from vllm_parity.serving.ternary_repack import native_weight, repack

        scale = tensors[self.spec.scale_name]
        if not scale.is_floating_point():
            raise CheckpointError(f"{name}.{self.spec.scale_name}: dtype {scale.dtype}, expected a float scale")
        return native_weight(repack(tensors[self.spec.weight_name], scale.to(torch.float32), self.spec, n, k, name))


class Int8xMoEMethod(ParityMoEMethod):
    @property
    def suffixes(self) -> tuple[str, ...]:
        return type(self.spec).suffixes

    def decode(self, tensors, n, k, name):
        from vllm_parity.serving.int8x_load import decode_streams

        q = decode_streams(tensors, self.spec.block_size, name=name)
        if tuple(q.shape) != (n, k):
            raise CheckpointError(f"{name}.weight_shape: {list(q.shape)}, expected [{n}, {k}] from config.json")
        return q.to(torch.float32) * tensors["weight_scale"].to(torch.float32)
