"""The ``kernels`` candidate: the reference's modeling code with the serving side's kernel linears.

It runs where vLLM is absent (a GPU machine without vLLM, a laptop): the same transformers model as
the reference, every quantized projection computed by its format's kernel linear
(:mod:`vllm_parity.serving.linears`) instead of a decoded fp32 weight, so a difference between the two
is the kernels' alone. Its prefill and decode steps are run and dumped by :mod:`vllm_parity.harness.kernel_decode`.
"""

from __future__ import annotations

import torch
from torch import nn

from vllm_parity.reference.checkpoint import Checkpoint
from vllm_parity.reference.linear import ReferenceLinear
from vllm_parity.reference.model import build_reference_model
from vllm_parity.serving import choose
from vllm_parity.serving.linears import linear_for


def build_kernel_model(ckpt: Checkpoint, backend: str | None = None, dtype: torch.dtype = torch.float32,
                       device: str | torch.device = "cpu") -> nn.Module:
    """The model in the serving ``dtype`` on ``device``: its float tensors cast to it, the kernels fed it (each
    kernel linear is made from its stored tensors on ``device``, so it prepares its layouts there: the
    tensor-core tiles on CUDA)."""
    device = torch.device(device)
    model = build_reference_model(ckpt, cache=False)
    for name, module in list(model.named_modules()):
        if isinstance(module, ReferenceLinear):
            parent, child = name.rsplit(".", 1)
            factory = linear_for(module.spec.quant_method)
            stored = {k: v.to(device) for k, v in module.stored.items()}
            kernel = factory(module.spec, stored, module.out_features, module.in_features, module.name, backend)
            setattr(model.get_submodule(parent), child, kernel if module.bias is None else _Biased(kernel, module.bias))
    if device.type != "cpu":
        model = model.to(device)
    return model if dtype == torch.float32 else model.to(dtype)


class _Biased(nn.Module):
    """A kernel linear and the projection's float bias (kernels compute ``x @ W^T`` only)."""

    def __init__(self, kernel: nn.Module, bias: torch.Tensor):
        super().__init__()
        self.kernel, self.bias = kernel, bias
        self.in_features, self.out_features = kernel.in_features, kernel.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.kernel(x)
        return y + self.bias.to(y.dtype)


# -- which kernel a kernel linear runs ---------------------------------------------------------------

# Row counts on each side of every threshold in choose.py: the choices over them are every branch a layer may take.
_BOUNDS = (*choose.TERNARY_M_BOUNDS, choose.INT8X_NATIVE_GEMV_MAX_M, choose.INT8X_GEMM_MIN_M,
           choose.INT8X_PLANES_GEMV_MAX_M)


def kernel_for(module: nn.Module, m: int, dtype: torch.dtype, device: torch.device) -> str | None:
    """The kernel ``module`` (a kernel linear, or one with its bias) runs for ``m`` rows of ``dtype`` on ``device``:
    the decision the kernel linear makes, from :mod:`vllm_parity.serving.choose` (pure Python, no tensor read, so
    it holds at CUDA-graph capture). A registered linear reports its own through ``kernel_for(m, dtype, device)``;
    None where the module is no kernel linear or says nothing."""
    from vllm_parity.serving import int8x_ops, ternary_ops

    module = module.kernel if isinstance(module, _Biased) else module
    if isinstance(module, ternary_ops.KernelLinear):
        native = module.native
        backend = choose.ternary_backend(module.backend, device)
        return choose.ternary_kernel(backend, m, dtype, native.group_size, native.act_quant,
                                     tiled=native.tiles is not None)
    if isinstance(module, int8x_ops.KernelLinear):
        if module.layout == "native":
            return "native_" + choose.int8x_native_kernel(choose.int8x_native_backend(module.backend, device), m)
        if module.layout == "planes":
            backend = choose.int8x_planes_op_backend(choose.int8x_planes_backend(module.backend, device), device)
            return "planes_" + choose.int8x_planes_kernel(backend, m)
        return "streams_" + choose.int8x_backend(module.backend, device)
    own = getattr(module, "kernel_for", None)
    return own(m, dtype, device) if callable(own) else None


def kernels_of(module: nn.Module, dtype: torch.dtype, device: torch.device) -> list[str]:
    """Every kernel :func:`kernel_for` may give ``module`` at ``dtype`` on ``device``, over all row counts."""
    rows = sorted({1, *(b + d for b in _BOUNDS for d in (0, 1) if b + d > 0)})
    return list(dict.fromkeys(k for m in rows for k in [kernel_for(module, m, dtype, device)] if k is not None))
