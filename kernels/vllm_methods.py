"""vLLM linear methods for ``ternary`` and ``int8x`` checkpoints: declare, load strictly, repack, apply.

Parameters carry the checkpoint's own tensor names (``<module>.<weight_name>`` ...), so vLLM's stock
name mapping (``q_proj`` -> ``qkv_proj`` shard ``"q"``) and its weight loaders place every tensor,
fused layers and tensor-parallel shards included. Every loader is wrapped to check the tensor's shape
and dtype against the checkpoint module it comes from and to record that it arrived: vLLM does not
check completeness for quantized models, so ``process_weights_after_loading`` does, before repacking.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Callable, NamedTuple

import torch
from vllm.distributed import tensor_model_parallel_all_gather
from vllm.model_executor.layers.linear import (
    LinearMethodBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    register_weight_loader_v2_supported_method,
)
from vllm.model_executor.parameter import (
    ChannelQuantScaleParameter,
    GroupQuantScaleParameter,
    ModelWeightParameter,
    PackedvLLMParameter,
    PerTensorScaleParameter,
)
from vllm.model_executor.utils import set_weight_attrs

from kernels import int8x_native, int8x_ops, ternary_ops
from references.errors import CheckpointError, DecodeError, FormatError
from references.formats import Int8xSpec, TernarySpec
from references.int8x import DTYPES as INT8X_DTYPES
from references.int8x import decode_int8
from references.linear import FLOAT_DTYPES

_QKV_INDEX = {"q": 0, "k": 1, "v": 2}
NATIVE_TENSORS = ("codes", "row_ptr", "outliers", "scale")


class Shard(NamedTuple):
    """One checkpoint module inside a vLLM layer, with its whole (unsharded) logical shape."""

    module: str
    n: int
    k: int


def layer_shards(layer: torch.nn.Module, modules: list[str]) -> list[Shard]:
    """The checkpoint modules of a layer with their full ``(N, K)``, in vLLM's shard order."""
    k = int(layer.input_size)
    if isinstance(layer, QKVParallelLinear):
        sizes = [layer.total_num_heads * layer.head_size, layer.total_num_kv_heads * layer.head_size,
                 layer.total_num_kv_heads * layer.v_head_size]
    elif isinstance(layer, MergedColumnParallelLinear):
        sizes = [int(s) for s in layer.output_sizes]
    else:
        sizes = [int(layer.output_size)]
    if len(sizes) != len(modules):
        raise FormatError(f"{layer.prefix}: vLLM fuses {len(sizes)} tensors here, the quantization config "
                          f"maps it to {len(modules)} checkpoint modules {modules}")
    return [Shard(m, n, k) for m, n in zip(modules, sizes)]


def _model_dir() -> str | None:
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    return str(config.model_config.model) if config is not None and config.model_config else None


def _file_of(model_dir: str | None, tensor: str) -> str:
    """The safetensors file holding ``tensor`` (error paths only), else the checkpoint directory."""
    if not model_dir or not os.path.isdir(model_dir):
        return model_dir or "checkpoint"
    root = Path(model_dir)
    try:
        index = root / "model.safetensors.index.json"
        if index.is_file():
            found = json.loads(index.read_text())["weight_map"].get(tensor)
            return str(root / found) if found else str(root)
        from references.checkpoint import read_safetensors_header

        for file in sorted(root.glob("*.safetensors")):
            if tensor in read_safetensors_header(file):
                return str(file)
    except Exception:  # a broken checkpoint must not hide the error being reported
        pass
    return str(root)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _shard_index(layer: torch.nn.Module, shard_id, count: int) -> int:
    if shard_id is None:
        if count == 1:
            return 0
        raise CheckpointError(f"{layer.prefix}: got a tensor already fused on disk; FORMATS.md checkpoints store "
                              f"each projection apart")
    if isinstance(shard_id, str) and shard_id in _QKV_INDEX:
        return _QKV_INDEX[shard_id]
    if isinstance(shard_id, int) and 0 <= shard_id < count:
        return shard_id
    raise CheckpointError(f"{layer.prefix}: unexpected shard id {shard_id!r} for {count} fused tensors")


class LoadTracker:
    """Which declared checkpoint tensors of one layer have been loaded; checks shape and dtype on arrival."""

    def __init__(self, layer: torch.nn.Module, shards: list[Shard], method: str):
        self.prefix = layer.prefix
        self.shards = shards
        self.method = method
        self.model_dir = _model_dir()
        self.expected: dict[tuple[str, int], str] = {}
        self.loaded: set[tuple[str, int]] = set()

    def declare(self, suffix: str) -> None:
        for i, shard in enumerate(self.shards):
            self.expected[(suffix, i)] = f"{shard.module}.{suffix}"

    def fail(self, tensor: str, what: str) -> CheckpointError:
        return CheckpointError(f"{_file_of(self.model_dir, tensor)}: tensor {tensor!r} {what}")

    def check(self, tensor: str, t: torch.Tensor, shape: tuple[int, ...] | None,
              dtypes: tuple[torch.dtype, ...], why: str = "") -> None:
        if t.dtype not in dtypes:
            want = " or ".join(_dtype_name(d) for d in dtypes)
            raise self.fail(tensor, f"has dtype {_dtype_name(t.dtype)}, expected {want}")
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise self.fail(tensor, f"has shape {tuple(t.shape)}, expected {tuple(shape)}{why}")

    def wrap(self, layer: torch.nn.Module, suffix: str, inner: Callable,
             check: Callable[[str, Shard, torch.Tensor], torch.Tensor]) -> Callable:
        """A weight loader that checks (and may convert) the tensor, then hands it to ``inner``."""
        self.declare(suffix)

        def weight_loader(param, loaded_weight, *args, **kwargs):
            shard_id = args[0] if args else kwargs.get("loaded_shard_id")
            i = _shard_index(layer, shard_id, len(self.shards))
            tensor = self.expected[(suffix, i)]
            loaded_weight = check(tensor, self.shards[i], loaded_weight)
            inner(param, loaded_weight, *args, **kwargs)
            self.loaded.add((suffix, i))

        return weight_loader

    def check_complete(self) -> None:
        missing = [name for key, name in self.expected.items() if key not in self.loaded]
        if missing:
            shown = ", ".join(repr(m) for m in missing[:6])
            if len(missing) > 6:
                shown += f" and {len(missing) - 6} more"
            raise CheckpointError(f"{self.model_dir or 'checkpoint'}: {len(missing)} tensor(s) missing for the "
                                  f"{self.method} layer {self.prefix}: {shown}")


def int8x_backend(device: torch.device) -> str:
    """``PARITY_KERNEL_BACKEND`` when set (shared with the ternary op), else int8x's own default for the device."""
    return int8x_ops.resolve_backend(os.environ.get(int8x_ops.ENV_BACKEND) or "auto", device)


def _release(layer: torch.nn.Module, names) -> None:
    """Drop the checkpoint-layout parameters once the kernel layout holds the weight."""
    for name in names:
        if name in layer._parameters:
            del layer._parameters[name]


# -- ternary -------------------------------------------------------------------------------------


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
    """2-bit ternary weights: checkpoint tensors -> ``kernels.ternary_ops`` native layout -> ternary GEMM."""

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
        layer.parity_partitions = list(output_partition_sizes)

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
            # One slot per fused tensor: q, k and v each carry their own scale.
            scale = PerTensorScaleParameter(data=torch.empty(len(output_partition_sizes), dtype=torch.float32),
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
        # Buffers, so that moving the module moves the kernel-layout weight with it.
        layer.register_buffer("parity_qweight", native.qweight, persistent=False)
        layer.register_buffer("parity_scale", native.scale, persistent=False)
        layer.parity_group_size = native.group_size
        layer.parity_backend = ternary_ops.resolve_backend(None, packed.device)
        # The tensor-core kernel's tiled copy (2 more bits per weight), where a CUDA kernel may run.
        tiles = native.with_tiles().tiles if layer.parity_backend in ("cuda", "auto") else None
        layer.register_buffer("parity_tiles", tiles, persistent=False)
        # A row-parallel rank sees only its slice of each token's features, but the per-token absmax
        # of activation_quant is over the whole row: such layers quantize here with the all-ranks max.
        layer.parity_global_act_quant = (native.act_quant and isinstance(layer, RowParallelLinear)
                                         and layer.tp_size > 1)
        layer.parity_act_quant = native.act_quant and not layer.parity_global_act_quant

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        x2 = x.reshape(-1, layer.parity_k)
        # The kernel for this many rows, chosen on shapes, dtype and flags (Python values), never on tensor values.
        kernel = ternary_ops.select_kernel(layer.parity_backend, x2.shape[0], x2.dtype, layer.parity_group_size,
                                           layer.parity_tiles is not None, layer.parity_act_quant)
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


def _ternary_op(layer, x2: torch.Tensor, bias: torch.Tensor | None, kernel: str) -> torch.Tensor:
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


# -- int8x ---------------------------------------------------------------------------------------

def _fixed_shape(suffix: str, n: int, k: int, spec: Int8xSpec) -> tuple[int, ...] | None:
    """The shape of a stream whose length follows from the logical shape alone; None for data-dependent ones."""
    numel = n * k
    return {
        "weight_shape": (2,), "weight_scale": (1,), "weight_b1": (-(-numel // 32),),
        "weight_b1_blk": (-(-numel // spec.block_size),), "weight_b2_blk": (-(-numel // spec.block_size),),
    }.get(suffix)


class Int8xLinearMethod(LinearMethodBase):
    """Losslessly compressed int8 weights: one stream set per checkpoint tensor, decoded by the int8x ops.

    The streams are variable-length bit streams over the row-major weight: they cannot be narrowed
    to a tensor-parallel shard nor concatenated across q/k/v, so each checkpoint tensor keeps its own
    container (filled when the loader sees it, as vLLM's GGUF support does) and ``apply`` runs one op
    per container. Tensor parallelism is refused: a shard would have to be decoded and re-encoded.
    At load each container is repacked into the native layout (4-bit codes + outliers,
    kernels/int8x_native.py) where that takes no more memory, else served from its streams
    (``PARITY_INT8X_LAYOUT`` overrides).
    """

    # Above this many rows of x, decode once and run a dense GEMM; below, the fused decode-GEMV op.
    # (Weights served in the native layout, kernels/int8x_native.py, go through its op, which decides.)
    GEMM_MIN_M = 16

    def __init__(self, spec: Int8xSpec, modules: list[str]):
        self.spec = spec
        self.modules = modules

    def create_weights(self, layer, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs):
        tp = getattr(layer, "tp_size", 1)
        if tp > 1:
            raise FormatError(
                f"int8x: {layer.prefix} with tensor_parallel_size={tp} is not supported: each int8x tensor is "
                f"one variable-length bit stream over the whole row-major weight, which cannot be split into "
                f"tensor-parallel shards; serve int8x checkpoints with tensor_parallel_size=1")
        shards = layer_shards(layer, self.modules)
        tracker = LoadTracker(layer, shards, "int8x")
        layer.parity_tracker = tracker
        layer.parity_streams = [{} for _ in shards]
        spec = self.spec

        def make_check(suffix: str):
            def check(tensor: str, s: Shard, t: torch.Tensor) -> torch.Tensor:
                shape = _fixed_shape(suffix, s.n, s.k, spec)
                tracker.check(tensor, t, shape, (INT8X_DTYPES[suffix],),
                              "" if shape is None else f" for a ({s.n}, {s.k}) weight, block_size={spec.block_size}")
                if t.dim() != 1:
                    raise tracker.fail(tensor, f"has shape {tuple(t.shape)}, expected a 1-D stream")
                if suffix == "weight_shape" and [int(v) for v in t.tolist()] != [s.n, s.k]:
                    raise tracker.fail(tensor, f"is {t.tolist()}, expected [{s.n}, {s.k}] from config.json")
                return t
            return check

        for suffix in Int8xSpec.suffixes:
            def store(param, loaded_weight, *args, _suffix=suffix, **kwargs):
                i = _shard_index(layer, args[0] if args else kwargs.get("loaded_shard_id"), len(shards))
                # Own the memory: the loader's tensor may be a view of a memory-mapped file.
                layer.parity_streams[i][_suffix] = loaded_weight.to(param.device).clone()

            # A placeholder: the real length is known only when the tensor arrives.
            param = torch.nn.Parameter(torch.empty(0, dtype=INT8X_DTYPES[suffix]), requires_grad=False)
            set_weight_attrs(param, {"weight_loader": tracker.wrap(layer, suffix, store, make_check(suffix))})
            layer.register_parameter(suffix, param)

    def process_weights_after_loading(self, layer) -> None:
        layer.parity_tracker.check_complete()
        natives = []
        for shard, streams in zip(layer.parity_tracker.shards, layer.parity_streams):
            # Full validation once, naming <module>.<suffix>; the ops trust their input afterwards.
            try:
                q = decode_int8({s: t.cpu() for s, t in streams.items()}, self.spec, name=shard.module)
            except (FormatError, DecodeError) as exc:
                tensor = str(exc).split(":", 1)[0]
                raise CheckpointError(f"{_file_of(layer.parity_tracker.model_dir, tensor)}: {exc}") from None
            natives.append(int8x_native.for_serving(q, streams))
        layer.parity_shapes = [(s.n, s.k) for s in layer.parity_tracker.shards]
        layer.parity_n = sum(n for n, _ in layer.parity_shapes)
        device = layer.parity_streams[0]["weight_b1"].device
        layer.parity_backend = int8x_backend(device)
        layer.parity_native_backend = int8x_native.backend_for(device)
        layer.parity_native = [native is not None for native in natives]
        _release(layer, Int8xSpec.suffixes)
        # Buffers, so that moving the module moves the weights with it; the load-time dicts go.
        for i, (streams, native) in enumerate(zip(layer.parity_streams, natives)):
            if native is None:
                kept = {suffix: streams[suffix] for suffix in int8x_ops.STREAMS}
            else:
                native = native.to(device)
                kept = {name: getattr(native, name) for name in NATIVE_TENSORS}
            for name, t in kept.items():
                layer.register_buffer(f"parity_{i}_{name}", t, persistent=False)
        del layer.parity_streams

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        gemm = x2.shape[0] > self.GEMM_MIN_M
        outs = []
        for i, (n, k) in enumerate(layer.parity_shapes):
            if layer.parity_native[i]:
                args = [getattr(layer, f"parity_{i}_{name}") for name in NATIVE_TENSORS]
                outs.append(torch.ops.vllm_parity.int8x_native_linear(x2, *args, n, k, layer.parity_native_backend))
                continue
            args = [getattr(layer, f"parity_{i}_{suffix}") for suffix in int8x_ops.STREAMS]
            if gemm:
                w = torch.ops.vllm_parity.int8x_decode(*args, n, k, self.spec.block_size, x2.dtype,
                                                       layer.parity_backend)
                outs.append(torch.nn.functional.linear(x2, w))
            else:
                outs.append(torch.ops.vllm_parity.int8x_linear(x2, *args, n, k, self.spec.block_size,
                                                               layer.parity_backend))
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        if bias is not None:
            y = y + bias
        return y.reshape(*x.shape[:-1], layer.parity_n)
