"""``quant_method: int8x`` (FORMATS.md section 2) in vLLM: the config and the linear method, which loads
the streams strictly, validates them once (the serving side's own decoder) and serves the native layout
where it fits, else the planes layout where it is at most 3 % larger than the streams (a real model's level mix
makes it slightly larger, and its GEMV is several times faster), else the streams."""

from __future__ import annotations

import torch
from vllm.model_executor.layers.linear import LinearMethodBase
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
from vllm.model_executor.utils import set_weight_attrs

from vllm_parity.errors import CheckpointError, DecodeError, FormatError
from vllm_parity.reference.formats.int8x import Int8xSpec
from vllm_parity.serving import choose, int8x_ops, int8x_planes
from vllm_parity.serving.int8x_load import DTYPES as INT8X_DTYPES
from vllm_parity.serving.int8x_load import decode_streams
from vllm_parity.serving.vllm.common import LoadTracker, ParityQuantConfig, Shard, _file_of, _release, \
    _shard_index, layer_shards

NATIVE_TENSORS = ("codes", "row_ptr", "outliers", "scale")
PLANES_TENSORS = int8x_planes.TENSORS


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
    kernels/int8x_native.py) where that takes no more memory, else into the planes layout (5-bit plane +
    fixup records, kernels/int8x_planes.py) where that takes less, else served from its streams
    (``PARITY_INT8X_LAYOUT`` overrides). Backends and kernels are chosen by ``vllm_parity.serving.choose``:
    for many rows of x (``choose.int8x_uses_gemm``) the streams are decoded once and a dense GEMM runs, else
    the fused decode-GEMV op; weights in the native and planes layouts go through their ops, which decide
    likewise (planes on CUDA: the tensor-core GEMV up to 16 rows, decode + GEMM above; on CPU the torch path).
    """

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
        layouts = []
        for shard, streams in zip(layer.parity_tracker.shards, layer.parity_streams):
            # Full validation once, naming <module>.<suffix>; the ops trust their input afterwards.
            try:
                q = decode_streams(streams, self.spec.block_size, name=shard.module)
            except (FormatError, DecodeError) as exc:
                tensor = str(exc).split(":", 1)[0]
                raise CheckpointError(f"{_file_of(layer.parity_tracker.model_dir, tensor)}: {exc}") from None
            layouts.append(int8x_ops.serving_layout(q, streams))
        layer.parity_shapes = [(s.n, s.k) for s in layer.parity_tracker.shards]
        layer.parity_n = sum(n for n, _ in layer.parity_shapes)
        device = layer.parity_streams[0]["weight_b1"].device
        layer.parity_backend = choose.int8x_vllm_backend(device)
        layer.parity_native_backend = choose.int8x_native_backend(None, device)
        layer.parity_planes_backend = choose.int8x_planes_backend(None, device)
        layer.parity_layout = [kind for kind, _ in layouts]
        _release(layer, Int8xSpec.suffixes)
        # Buffers, so that moving the module moves the weights with it; the load-time dicts go.
        for i, (streams, (kind, packed)) in enumerate(zip(layer.parity_streams, layouts)):
            if kind == "streams":
                kept = {suffix: streams[suffix] for suffix in int8x_ops.STREAMS}
            else:
                packed = packed.to(device)
                names = NATIVE_TENSORS if kind == "native" else PLANES_TENSORS
                kept = {name: getattr(packed, name) for name in names}
            for name, t in kept.items():
                layer.register_buffer(f"parity_{i}_{name}", t, persistent=False)
        del layer.parity_streams

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        gemm = choose.int8x_uses_gemm(x2.shape[0])
        outs = []
        for i, (n, k) in enumerate(layer.parity_shapes):
            if layer.parity_layout[i] == "native":
                args = [getattr(layer, f"parity_{i}_{name}") for name in NATIVE_TENSORS]
                outs.append(torch.ops.vllm_parity.int8x_native_linear(x2, *args, n, k, layer.parity_native_backend))
                continue
            if layer.parity_layout[i] == "planes":
                args = [getattr(layer, f"parity_{i}_{name}") for name in PLANES_TENSORS]
                outs.append(torch.ops.vllm_parity.int8x_planes_linear(x2, *args, n, k, layer.parity_planes_backend))
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


class Int8xConfig(ParityQuantConfig):
    """``quant_method: int8x`` (FORMATS.md section 2)."""

    spec_type = Int8xSpec
    method_name = "int8x"

    def make_method(self, modules: list[str]) -> QuantizeMethodBase:
        return Int8xLinearMethod(self.spec, modules)

    def make_moe_method(self, layer, prefix: str) -> QuantizeMethodBase:
        from vllm_parity.serving.vllm.moe import Int8xMoEMethod

        return Int8xMoEMethod(self.spec, layer.moe_config, prefix)


CONFIG = Int8xConfig
