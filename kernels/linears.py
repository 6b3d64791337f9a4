"""The kernel linear of each format, by ``quant_method``: an ``nn.Module`` computing ``x @ W^T`` with the
format's kernels from its stored checkpoint tensors (what the ``kernels`` candidate puts where the
reference holds a decoded weight). A built-in format's is ``KernelLinear`` of
``vllm_parity.serving.<quant_method>_ops``; another is made known with :func:`register`.
"""

from __future__ import annotations

import importlib
from typing import Callable

from torch import nn

from vllm_parity.errors import FormatError

# factory(spec, stored, n, k, name, backend) -> nn.Module
Factory = Callable[..., nn.Module]
_LINEARS: dict[str, Factory] = {}


def register(quant_method: str, factory: Factory) -> Factory:
    _LINEARS[quant_method] = factory
    return factory


def linear_for(quant_method: str) -> Factory:
    if quant_method not in _LINEARS:
        try:
            module = importlib.import_module(f"{__package__}.{quant_method}_ops")
        except ModuleNotFoundError:
            module = None
        if module is not None and hasattr(module, "KernelLinear"):
            register(quant_method, module.KernelLinear)
    if quant_method not in _LINEARS:
        raise FormatError(f"no kernel linear for quant_method {quant_method!r} (known: {sorted(_LINEARS)}); "
                          f"register one with vllm_parity.serving.linears.register")
    return _LINEARS[quant_method]
