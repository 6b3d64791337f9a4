"""What the vLLM plugin's schemes share: the config's common part (parse the spec, resolve fused layers to
checkpoint modules, honour ``ignore``) and the strict loading of checkpoint tensors.

Parameters carry the checkpoint's own tensor names (``<module>.<weight_name>`` ...), so vLLM's stock
name mapping (``q_proj`` -> ``qkv_proj`` shard ``"q"``) and its weight loaders place every tensor,
fused layers and tensor-parallel shards included. Every loader is wrapped to check the tensor's shape
and dtype against the checkpoint module it comes from and to record that it arrived: vLLM does not
check completeness for quantized models, so ``process_weights_after_loading`` does, before repacking.
"""

from __future__ import annotations

import json
import os
from abc import abstractmethod
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch
from vllm.model_executor.layers.linear import (
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    UnquantizedLinearMethod,
)
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase

from vllm_parity.errors import CheckpointError, FormatError
from vllm_parity.reference.formats import FormatSpec, parse_quantization_config

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # what a stored scale may be

_QKV_INDEX = {"q": 0, "k": 1, "v": 2}


# Llama's fused layers and the checkpoint modules each one holds, in shard order. vLLM hands the
# model's own mapping to the config (SupportsQuant); this is the fallback for models that do not.
DEFAULT_PACKED_MODULES = {
    "qkv_proj": ["q_proj", "k_proj", "v_proj"],
    "gate_up_proj": ["gate_proj", "up_proj"],
}


class ParityQuantConfig(QuantizationConfig):
    """Common part: parse the spec, resolve fused layers to checkpoint modules, honour ``ignore``."""

    spec_type: type = object
    method_name: str = ""

    def __init__(self, spec: FormatSpec):
        super().__init__()  # creates packed_modules_mapping, which SupportsQuant updates
        if not isinstance(spec, self.spec_type):
            raise FormatError(f"{type(self).__name__} needs a {self.spec_type.__name__}, got {spec!r}")
        self.spec = spec

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r})"

    # -- QuantizationConfig API ---------------------------------------------------------------

    def get_name(self) -> str:
        return self.method_name

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.float16, torch.bfloat16]

    @classmethod
    def get_min_capability(cls) -> int:
        # Checked on GPUs only; the Triton kernels need Volta or newer.
        return 70

    @staticmethod
    def get_config_filenames() -> list[str]:
        # The format lives in config.json's quantization_config; no separate file is read.
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ParityQuantConfig:
        try:
            spec = parse_quantization_config(config)
        except FormatError as exc:
            raise FormatError(f"config.json quantization_config: {exc}") from None
        if not isinstance(spec, cls.spec_type):
            raise FormatError(f"config.json quantization_config has quant_method "
                              f"{config.get('quant_method')!r}, which {cls.__name__} ({cls.method_name!r}) "
                              f"does not read")
        return cls(spec)

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        if isinstance(layer, RoutedExperts):  # a mixture-of-experts layer's experts (vllm_parity.serving.vllm.moe)
            if self.spec.is_ignored(prefix):
                return UnquantizedFusedMoEMethod(layer.moe_config)
            return self.make_moe_method(layer, prefix)
        if not isinstance(layer, LinearBase):
            return None  # embeddings, lm_head, attention: unquantized
        if isinstance(layer, GateLinear):
            return UnquantizedLinearMethod()  # a router: transformers' is a bare parameter, stored float
        modules = self.checkpoint_modules(prefix)
        ignored = [m for m in modules if self.spec.is_ignored(m)]
        if len(ignored) == len(modules):
            return UnquantizedLinearMethod()
        if ignored:
            kept = [m for m in modules if m not in ignored]
            raise FormatError(
                f"quantization_config ignore {list(self.spec.ignore)} leaves {ignored} unquantized but "
                f"not {kept}; vLLM fuses them into one layer ({prefix}), so they must be quantized alike")
        return self.make_method(modules)

    # -- helpers ------------------------------------------------------------------------------

    def checkpoint_modules(self, prefix: str) -> list[str]:
        """The checkpoint module names a vLLM layer holds: 3 for qkv_proj, 2 for gate_up_proj, else 1."""
        parent, _, last = prefix.rpartition(".")
        # Llama's names where the model's mapping lacks them: Qwen3-MoE adds gate_up_proj to its mapping in
        # its __init__, after SupportsQuant copied the mapping here
        parts = (self.packed_modules_mapping or {}).get(last) or DEFAULT_PACKED_MODULES.get(last)
        if not parts:
            return [prefix]
        return [f"{parent}.{p}" if parent else p for p in parts]

    @abstractmethod
    def make_method(self, modules: list[str]) -> QuantizeMethodBase:
        """The scheme's linear method for a vLLM layer holding these checkpoint modules."""

    def make_moe_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase:
        """The scheme's method for the experts of a mixture-of-experts layer (``prefix``: ``...experts``)."""
        raise FormatError(f"{self.method_name}: {prefix}: this format has no method for mixture-of-experts layers")


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
    if len(modules) == 1 and len(sizes) > 1:
        # fused in the checkpoint too (Phi3's qkv_proj, gate_up_proj): one tensor of the layer's whole width,
        # which vLLM's loader splits into its logical shards (shard id None)
        return [Shard(modules[0], sum(sizes), k)]
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
        from vllm_parity.reference.checkpoint import read_safetensors_header

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


def _release(layer: torch.nn.Module, names) -> None:
    """Drop the checkpoint-layout parameters once the kernel layout holds the weight."""
    for name in names:
        if name in layer._parameters:
            del layer._parameters[name]
