"""The fp32 reference model: transformers' own modeling code for the checkpoint's ``model_type``
(``AutoModelForCausalLM``), with reference linears.

The model is built on the meta device, then every tensor is materialized from the checkpoint one at a
time: float tensors as read, each quantized projection decoded into a :class:`ReferenceLinear`. No
random initialization runs and no second copy of the model ever exists.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from vllm_parity.errors import CheckpointError
from vllm_parity.reference.checkpoint import Checkpoint, expert_linears, stored_names, to_parameters
from vllm_parity.reference.formats import FLOAT_DTYPES
from vllm_parity.reference.linear import ReferenceLinear, read_stored


def model_config(ckpt: Checkpoint, attn_implementation: str = "eager") -> PretrainedConfig:
    """transformers' config class of the checkpoint's ``model_type``, from its config.json."""
    cfg = {k: v for k, v in ckpt.config.items() if k not in ("quantization_config", "model_type")}
    model_type = ckpt.config.get("model_type")
    try:
        config = AutoConfig.for_model(model_type, **cfg)
    except ValueError as exc:
        raise CheckpointError(f"{ckpt.path}/config.json: model_type {model_type!r} is not one transformers "
                              f"knows ({exc})") from None
    config._attn_implementation = attn_implementation
    return config


def _float_tensor(ckpt: Checkpoint, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
    t = ckpt.expect(name, shape, FLOAT_DTYPES)
    if not bool(torch.isfinite(t).all()):
        raise CheckpointError(f"{ckpt.info(name).file.name}: tensor {name!r} holds NaN or Inf")
    return nn.Parameter(t.to(dtype), requires_grad=False)


def _converted(ckpt: Checkpoint, name: str, stored: dict[str, tuple[int, ...]], shape: tuple[int, ...],
               dtype: torch.dtype) -> nn.Parameter:
    """A parameter transformers converts at load (a renamed one; the fused 3-D experts), from its stored
    tensors: each quantized expert decoded first, then transformers' own conversion."""
    spec, experts = ckpt.spec, expert_linears(ckpt.config)
    tensors = {}
    for source, source_shape in stored.items():
        module = source.removesuffix(".weight")
        if spec is not None and module in experts and not spec.is_ignored(module):
            if spec.activation_of(module) is not None:
                raise CheckpointError(f"{ckpt.path}: {module}: quantized experts with activation quantization "
                                      f"({spec.activation_of(module)}) are not supported (they are fused into one "
                                      f"3-D parameter)")
            n, k = experts[module]
            tensors[source] = spec.decode(read_stored(ckpt, module, spec, n, k), n, k, module, dtype)
        else:
            tensors[source] = _float_tensor(ckpt, source, source_shape, dtype).data
    value = to_parameters(ckpt.config, tensors)[name]
    if tuple(value.shape) != shape:
        raise CheckpointError(f"{ckpt.path}: {name} converted from {list(stored)} has shape "
                              f"{tuple(value.shape)}, expected {shape}")
    return nn.Parameter(value.to(dtype), requires_grad=False)


def build_reference_model(path: str | Path | Checkpoint, dtype: torch.dtype = torch.float32,
                          cache: bool = True, attn_implementation: str = "eager",
                          on_decoded: Callable[[int, int, str], None] | None = None,
                          activations_in: torch.dtype | None = None) -> PreTrainedModel:
    """The reference model of any FORMATS.md checkpoint directory, in ``dtype`` (fp32, or fp64).
    ``on_decoded(i, n, module)``: after the i-th of the n quantized projections is decoded (a run's progress).
    ``activations_in``: the serving dtype, where the format quantizes activations (its quantizers take them
    rounded to it)."""
    ckpt = path if isinstance(path, Checkpoint) else Checkpoint(path)
    spec = ckpt.spec
    config = model_config(ckpt, attn_implementation)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    shapes = ckpt.linear_shapes()
    quantized = {m for m in shapes if spec is not None and not spec.is_ignored(m)}
    sources = stored_names(ckpt.config)

    for name, param in list(model.named_parameters()):
        module_name, attr = name.rsplit(".", 1)
        if module_name in quantized and attr == "weight":
            continue
        if name == "lm_head.weight" and config.tie_word_embeddings and name not in ckpt:
            continue
        module = model.get_submodule(module_name)
        stored = sources.get(name, {name: tuple(param.shape)})
        if list(stored) == [name]:
            setattr(module, attr, _float_tensor(ckpt, name, tuple(param.shape), dtype))
        else:
            setattr(module, attr, _converted(ckpt, name, stored, tuple(param.shape), dtype))
    if config.tie_word_embeddings and "lm_head.weight" not in ckpt:
        model.lm_head.weight = model.model.embed_tokens.weight

    for i, module_name in enumerate(sorted(quantized), 1):
        n, k = shapes[module_name]
        stored = read_stored(ckpt, module_name, spec, n, k)
        bias = model.get_submodule(module_name).bias  # loaded above as a float tensor where the family has one
        linear = ReferenceLinear(module_name, spec, stored, n, k, dtype=dtype, cache=cache,
                                 bias=None if bias is None else bias.data, activations_in=activations_in)
        parent_name, child = module_name.rsplit(".", 1)
        setattr(model.get_submodule(parent_name), child, linear)
        if on_decoded is not None:
            on_decoded(i, len(quantized), module_name)

    _compute_buffers(model)
    leftover = [n for n, p in model.named_parameters() if p.is_meta]
    leftover += [n for n, b in model.named_buffers() if b is not None and b.is_meta]
    if leftover:
        raise CheckpointError(f"{ckpt.path}: tensors never loaded: {leftover[:5]}")
    if dtype != torch.float32:
        model.to(dtype)
    return model.eval()


def _compute_buffers(model: PreTrainedModel) -> None:
    """The non-persistent buffers (rotary frequencies, an embedding's scale) were computed on the meta device:
    transformers' own initialization computes them again, every loaded tensor marked as initialized."""
    for p in model.parameters():
        p._is_hf_initialized = True
    for module in model.modules():
        meta = [n for n, b in module.named_buffers(recurse=False) if b is not None and b.is_meta]
        for n in meta:
            setattr(module, n, torch.empty_like(getattr(module, n), device="cpu"))
        if meta:
            model._init_weights(module)


def set_precision(model: PreTrainedModel, dtype: torch.dtype) -> PreTrainedModel:
    """Switch a reference model between fp32 and fp64 (calibration), reference linears included."""
    model.to(dtype)
    for m in model.modules():
        if isinstance(m, ReferenceLinear):
            m.set_dtype(dtype)
    return model
