"""``quant_method: ternary`` (FORMATS.md section 1) in vLLM: the config and the linear method, which
declares the checkpoint's tensors, loads them strictly, repacks them once into the kernels' layout and
applies the kernels."""

from __future__ import annotations

import dataclasses

import torch
from vllm.distributed import tensor_model_parallel_all_gather
from vllm.model_executor.layers.linear import (
    LinearMethodBase,
    RowParallelLinear,
    register_weight_loader_v2_supported_method,
)
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
from vllm.model_executor.parameter import (
    ChannelQuantScaleParameter,
    GroupQuantScaleParameter,
    ModelWeightParameter,
    PackedvLLMParameter,
    PerTensorScaleParameter,
)
from vllm.model_executor.utils import set_weight_attrs

from vllm_parity.errors import FormatError
from vllm_parity.reference.formats.ternary import TernarySpec
from vllm_parity.serving import choose, ternary_ops
from vllm_parity.serving.vllm.common import FLOAT_DTYPES, LoadTracker, ParityQuantConfig, Shard, _release, layer_shards


def _fields(packed: torch.Tensor, spec: TernarySpec) -> torch.Tensor:
    """(other, P, 4): field f of every byte along the packed axis (bytes on the last axis first)."""
    rows = packed if spec.pack_axis == "input" else packed.t()
    f = torch.arange(4, dtype=torch.uint8, device=packed.device)
    shifts = 2 * f if spec.bit_order == "lsb" else 6 - 2 * f
    return (rows.unsqueeze(-1) >> shifts) & 3


def to_interleaved(packed: torch.Tensor, spec: TernarySpec) -> torch.Tensor:
    """A ``blocked`` packed tensor re-laid out as ``interleaved`` (same axis, bit order and codes).

    vLLM shards and fuses packed tensors by byte ranges, which hold a contiguous range of elements only
    in the interleaved layout; a lossless permutation of the 2-bit fields at load makes that true.
    """
    fields = _fields(packed, spec)  # blocked: field f of byte b is element f * P + b
    other, p, _ = fields.shape
    codes = fields.transpose(1, 2).reshape(other, p, 4)  # element order, regrouped 4 per byte
    f = torch.arange(4, dtype=torch.uint8, device=packed.device)
    shifts = 2 * f if spec.bit_order == "lsb" else 6 - 2 * f
    out = (codes << shifts).sum(dim=-1, dtype=torch.uint8)
    return (out if spec.pack_axis == "input" else out.t()).contiguous()


@register_weight_loader_v2_supported_method
class TernaryLinearMethod(LinearMethodBase):
    """2-bit ternary weights: checkpoint tensors -> ``vllm_parity.serving.ternary_ops`` native layout -> ternary GEMM."""

    def __init__(self, spec: TernarySpec, modules: list[str]):
        self.spec = spec
        self.modules = modules
        # What the kernel is told about the loaded tensors: blocked data arrives re-laid out.
        self.load_spec = dataclasses.replace(spec, pack_layout="interleaved")

    def create_weights(self, layer, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs):
        spec = self.spec
        shards = layer_shards(layer, self.modules)
        for s in shards:
            spec.check_shape(s.n, s.k, s.module)
        k, n = input_size_per_partition, sum(output_partition_sizes)
        tp = getattr(layer, "tp_size", 1)
        if spec.pack_axis == "input" and k % 4:
            raise FormatError(f"{layer.prefix}: tensor_parallel_size={tp} leaves {k} input features per rank, "
                              f"not a multiple of 4, so the input-packed bytes cannot be split")
        if spec.pack_axis == "output" and any(p % 4 for p in output_partition_sizes):
            raise FormatError(f"{layer.prefix}: tensor_parallel_size={tp} leaves {output_partition_sizes} output "
                              f"features per rank and tensor, not multiples of 4, so the output-packed bytes "
                              f"cannot be split")
        if spec.scale_granularity == "group" and k % spec.group_size:
            raise FormatError(f"{layer.prefix}: tensor_parallel_size={tp} leaves {k} input features per rank, "
                              f"not a multiple of group_size={spec.group_size}")

        weight_loader = extra_weight_attrs.pop("weight_loader")
        tracker = LoadTracker(layer, shards, "ternary")
        layer.parity_tracker = tracker
        layer.parity_n, layer.parity_k = n, k
        layer.parity_params_dtype = params_dtype
        # the per-rank rows of each checkpoint tensor: one for a tensor fused on disk
        layer.parity_partitions = [n] if len(shards) == 1 else list(output_partition_sizes)

        def check_packed(tensor: str, s: Shard, t: torch.Tensor) -> torch.Tensor:
            tracker.check(tensor, t, spec.packed_shape(s.n, s.k), (torch.uint8,),
                          f" (pack_axis={spec.pack_axis!r}, logical ({s.n}, {s.k}))")
            _check_null_codes(tracker, tensor, t, spec)
            return to_interleaved(t, spec) if spec.pack_layout == "blocked" else t

        def check_scale(tensor: str, s: Shard, t: torch.Tensor) -> torch.Tensor:
            tracker.check(tensor, t, spec.scale_shape(s.n, s.k), FLOAT_DTYPES,
                          f" ({spec.scale_granularity} scales of a ({s.n}, {s.k}) weight)")
            t32 = t.to(torch.float32)  # fp16 / bf16 widen exactly, as the reference does
            if not bool(torch.isfinite(t32).all()):
                raise tracker.fail(tensor, "holds NaN or Inf")
            if spec.scale_mode == "divide" and bool((t32 == 0).any()):
                raise tracker.fail(tensor, "holds zeros, but scale_mode 'divide' divides by it")
            return t32

        packed_loader = tracker.wrap(layer, spec.weight_name, weight_loader, check_packed)
        if spec.pack_axis == "input":
            packed = ModelWeightParameter(data=torch.empty(n, k // 4, dtype=torch.uint8),
                                          input_dim=1, output_dim=0, weight_loader=packed_loader)
        else:
            packed = PackedvLLMParameter(data=torch.empty(n // 4, k, dtype=torch.uint8), input_dim=1,
                                         output_dim=0, packed_dim=0, packed_factor=4, weight_loader=packed_loader)
        layer.register_parameter(spec.weight_name, packed)

        scale_loader = tracker.wrap(layer, spec.scale_name, weight_loader, check_scale)
        if spec.scale_granularity == "tensor":
            # One slot per checkpoint tensor: q, k and v each carry their own scale (one fused on disk, one).
            scale = PerTensorScaleParameter(data=torch.empty(len(shards), dtype=torch.float32),
                                            weight_loader=scale_loader)
        elif spec.scale_granularity == "channel":
            scale = ChannelQuantScaleParameter(data=torch.empty(n, dtype=torch.float32), output_dim=0,
                                               weight_loader=scale_loader)
        else:
            scale = GroupQuantScaleParameter(data=torch.empty(n, k // spec.group_size, dtype=torch.float32),
                                             output_dim=0, input_dim=1, weight_loader=scale_loader)
        layer.register_parameter(spec.scale_name, scale)
        set_weight_attrs(packed, extra_weight_attrs)
        set_weight_attrs(scale, extra_weight_attrs)

    def process_weights_after_loading(self, layer) -> None:
        layer.parity_tracker.check_complete()
        spec = self.load_spec
        packed = getattr(layer, spec.weight_name).data
        scale = getattr(layer, spec.scale_name).data
        parts = layer.parity_partitions
        if spec.scale_granularity == "tensor" and len(parts) > 1:
            # A fused layer of per-tensor scales is a per-channel scale: each slot over its own rows.
            sizes = torch.tensor(parts, device=scale.device)
            scale = torch.repeat_interleave(scale, sizes)
            spec = dataclasses.replace(spec, scale_granularity="channel")
        native = ternary_ops.repack(packed, scale, spec, layer.parity_n, layer.parity_k)
        _release(layer, (spec.weight_name, spec.scale_name))
        layer.parity_group_size = native.group_size
        layer.parity_backend = choose.ternary_backend(None, packed.device)
        # One resident copy of the weight (2 bits a weight), the tiled layout, where the GEMM on the tiles serves
        # this layer (or PARITY_TERNARY_RESIDENT=tiles where the tensor-core kernel does): every row count is then
        # served from it (ternary_ops.tiles_linear); =rows: the row layout alone; else the row layout + tiles on
        # CUDA (choose.ternary_resident). Buffers, so that moving the module moves the kernel-layout weight with it.
        resident = choose.ternary_resident(layer.parity_backend, getattr(layer, "parity_params_dtype", None),
                                           native.group_size)
        layer.parity_tiles_only = resident == "tiles"
        if layer.parity_tiles_only:
            from vllm_parity.serving import ternary_cuda

            tiles = native.with_tiles().tiles
            layer.register_buffer("parity_qweight", None, persistent=False)  # the row layout is freed
            layer.register_buffer("parity_tiles", tiles, persistent=False)
            ternary_cuda.ops()  # the C++ ops and their fakes, loaded now: apply calls them directly
        else:
            # PARITY_TERNARY_RESIDENT=two / rows, or a layer cuda_mma does not serve: the row layout, and (two) the
            # tensor-core kernel's tiled copy (2 more bits per weight) where a CUDA kernel may run.
            layer.register_buffer("parity_qweight", native.qweight, persistent=False)
            tiles = native.with_tiles().tiles if resident == "rows+tiles" else None
            layer.register_buffer("parity_tiles", tiles, persistent=False)
        # cuda_mma through the C++ op (its configuration chosen in C++: no Python per call), loaded now.
        layer.parity_cpp_mma = layer.parity_backend in ("cuda", "auto") and _cuda_builds()
        layer.register_buffer("parity_scale", native.scale, persistent=False)
        act_quant = native.act_quant
        del native
        # A row-parallel rank sees only its slice of each token's features, but the per-token absmax
        # of activation_quant is over the whole row: such layers quantize here with the all-ranks max.
        layer.parity_global_act_quant = act_quant and isinstance(layer, RowParallelLinear) and layer.tp_size > 1
        layer.parity_act_quant = act_quant and not layer.parity_global_act_quant

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        x2 = x.reshape(-1, layer.parity_k)
        # The kernel for this many rows, chosen on shapes, dtype and flags (Python values), never on tensor values;
        # the same answer the harness records (kernel_for).
        kernel = _kernel(layer, x2.shape[0], x2.dtype)
        if layer.parity_global_act_quant:
            xf = x2.to(torch.float32)
            amax = tensor_model_parallel_all_gather(xf.abs().amax(dim=-1, keepdim=True)).amax(dim=-1, keepdim=True)
            s_x = 127.0 / amax.clamp(min=1e-5)
            x_q = (xf * s_x).round().clamp(-128, 127).to(x.dtype)  # integers: exact in fp16 / bf16
            y = (_ternary_op(layer, x_q, None, kernel).to(torch.float32) / s_x).to(x.dtype)
            if bias is not None:
                y = y + bias
        else:
            y = _ternary_op(layer, x2, bias, kernel)
        return y.reshape(*x.shape[:-1], layer.parity_n)

    def kernel_for(self, layer, m: int, dtype: torch.dtype) -> str:
        """The kernel ``apply`` runs for ``m`` rows of ``dtype`` (what the parity harness records per tap)."""
        return _kernel(layer, m, dtype)

    def kernels(self, layer, dtype: torch.dtype) -> tuple[str, ...]:
        """Every kernel ``apply`` may run on this layer, over all row counts: its choice on each side of every
        M threshold (the branches a run may leave untaken)."""
        rows = sorted({1, *(b + d for b in choose.TERNARY_M_BOUNDS for d in (0, 1))})
        return tuple(dict.fromkeys(self.kernel_for(layer, m, dtype) for m in rows))


def _kernel(layer, m: int, dtype: torch.dtype) -> str:
    if layer.parity_tiles_only:
        return choose.ternary_tiles_kernel(m, dtype, layer.parity_group_size, layer.parity_act_quant)
    return choose.ternary_kernel(layer.parity_backend, m, dtype, layer.parity_group_size, layer.parity_act_quant,
                                 tiled=layer.parity_tiles is not None)


def _cuda_builds() -> bool:
    from vllm_parity.serving import ternary_cuda

    if not ternary_cuda.available():
        return False
    ternary_cuda.ops()
    return True


def _ternary_op(layer, x2: torch.Tensor, bias: torch.Tensor | None, kernel: str) -> torch.Tensor:
    if layer.parity_tiles_only:  # the C++ ops on the one tiled copy
        return ternary_ops.tiles_linear(x2, layer.parity_tiles, layer.parity_scale, bias, layer.parity_n,
                                        layer.parity_k, layer.parity_group_size, layer.parity_act_quant, kernel)
    if kernel == "cuda_mma" and layer.parity_cpp_mma:  # on the tiles, or the rows alone (PARITY_TERNARY_RESIDENT=rows)
        return ternary_ops.cpp_mma(x2, layer.parity_qweight, layer.parity_tiles, layer.parity_scale, bias,
                                   layer.parity_n, layer.parity_k, layer.parity_group_size, layer.parity_act_quant)
    return torch.ops.vllm_parity.ternary_linear(x2, layer.parity_qweight, layer.parity_scale, bias, layer.parity_k,
                                                layer.parity_group_size, layer.parity_act_quant, kernel,
                                                layer.parity_tiles)


def _check_null_codes(tracker: LoadTracker, tensor: str, packed: torch.Tensor, spec: TernarySpec) -> None:
    """Refuse a packed tensor holding a code that ``code_map`` marks as must-not-occur, naming it."""
    illegal = [c for c, v in enumerate(spec.code_map) if v is None]
    if not illegal:
        return
    fields = _fields(packed, spec)
    bad = torch.zeros(fields.shape[:2], dtype=torch.bool, device=packed.device)
    for c in illegal:
        bad |= (fields == c).any(dim=-1)
    count = int(bad.sum())
    if count:
        first = [int(i) for i in bad.nonzero()[0]]
        first = first if spec.pack_axis == "input" else first[::-1]
        raise tracker.fail(tensor, f"has {count} byte(s) holding code(s) {illegal}, which code_map "
                                   f"{list(spec.code_map)} marks as must-not-occur (first at packed index "
                                   f"{tuple(first)})")



class TernaryConfig(ParityQuantConfig):
    """``quant_method: ternary`` (FORMATS.md section 1)."""

    spec_type = TernarySpec
    method_name = "ternary"

    def make_method(self, modules: list[str]) -> QuantizeMethodBase:
        return TernaryLinearMethod(self.spec, modules)

    def make_moe_method(self, layer, prefix: str) -> QuantizeMethodBase:
        from vllm_parity.serving.vllm.moe import TernaryMoEMethod

        return TernaryMoEMethod(self.spec, layer.moe_config, prefix)


CONFIG = TernaryConfig
