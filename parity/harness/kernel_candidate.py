"""The ``kernels`` candidate: the reference's modeling code with the serving side's kernel linears.

It runs where vLLM is absent (a GPU machine without vLLM, a laptop): the same transformers model as
the reference, every quantized projection computed by its format's kernel linear
(:mod:`vllm_parity.serving.linears`) instead of a decoded fp32 weight, so a difference between the two
is the kernels' alone.
"""

from __future__ import annotations

from torch import nn

from vllm_parity.reference.checkpoint import Checkpoint
from vllm_parity.reference.linear import ReferenceLinear
from vllm_parity.reference.model import build_reference_model
from vllm_parity.serving.linears import linear_for


def build_kernel_model(ckpt: Checkpoint, backend: str | None = None) -> nn.Module:
    model = build_reference_model(ckpt, cache=False)
    for name, module in list(model.named_modules()):
        if isinstance(module, ReferenceLinear):
            parent, child = name.rsplit(".", 1)
            factory = linear_for(module.spec.quant_method)
            kernel = factory(module.spec, module.stored, module.out_features, module.in_features, module.name, backend)
            setattr(model.get_submodule(parent), child, kernel)
    return model
