"""CUDA kernels for the int8x planes layout (``csrc/int8x_planes.cu``): fused decode-GEMV and decode.

The extension is built with ``torch.utils.cpp_extension.load`` on first use, never at import, so importing this
module works on machines without nvcc or a GPU. The kernels take the layout's tensors as
:func:`vllm_parity.serving.int8x_planes.check` accepts them; they read no tensor value on the host and run on the
current stream, so they can be captured in CUDA graphs.
"""

from __future__ import annotations

import torch

from vllm_parity.serving.cuda_build import LazyExtension, available  # noqa: F401  (available: re-exported)
from vllm_parity.serving.int8x_planes import Int8xPlanes, check

__all__ = ["available", "extension", "decode", "linear"]

extension = LazyExtension("vllm_parity_int8x_planes", "int8x_planes.cu", "int8x planes CUDA kernels")


def _check_cuda(layout: Int8xPlanes, *tensors: torch.Tensor) -> None:
    for t in (*layout.tensors, *tensors):
        if t.device.type != "cuda":
            raise ValueError(f"int8x planes cuda kernels need CUDA tensors, got {t.device}; use the torch backend")
    check(layout.tensors, layout.n, layout.k)


def decode(layout: Int8xPlanes, dtype: torch.dtype = torch.bfloat16, out: torch.Tensor | None = None) -> torch.Tensor:
    """The dense weight ``q * scale`` (n, k) in ``dtype`` (fp32, fp16 or bf16), or written into ``out``.

    One warp per block of 16 rows x 256 columns, 8 warps a CTA; rows are written with 16-byte stores where the
    row length allows (K * element size a multiple of 16), elementwise otherwise."""
    if out is None:
        out = torch.empty((layout.n, layout.k), dtype=dtype, device=layout.planes.device)
    elif tuple(out.shape) != (layout.n, layout.k) or not out.is_contiguous():
        raise ValueError(f"int8x planes cuda decode: out must be contiguous ({layout.n}, {layout.k}), got "
                         f"{tuple(out.shape)} strides {out.stride()}")
    _check_cuda(layout, out)
    extension().decode(*layout.tensors, layout.n, layout.k, out)
    return out


def linear(x: torch.Tensor, layout: Int8xPlanes, out: torch.Tensor | None = None) -> torch.Tensor:
    """``y = x @ W^T`` for 2-D fp16 / bf16 ``x`` of shape ``(M, K)`` on the tensor cores, W decoded in registers;
    ``y`` in x's dtype (or written into ``out``, any strides).

    One pass over the weight per 16 rows of x (grid.y slices larger M), fp32 accumulation. ``x`` may have any
    row stride; a column stride other than 1 costs a contiguous copy."""
    if x.dim() != 2 or x.shape[1] != layout.k:
        raise ValueError(f"int8x planes cuda linear: x must be (M, {layout.k}), got {tuple(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"int8x planes cuda linear: x must be fp16 or bf16, got {x.dtype}")
    if out is None:
        out = torch.empty((x.shape[0], layout.n), dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != (x.shape[0], layout.n) or out.dtype != x.dtype:
        raise ValueError(f"int8x planes cuda linear: out must be {x.dtype} ({x.shape[0]}, {layout.n}), got "
                         f"{out.dtype} {tuple(out.shape)}")
    _check_cuda(layout, x, out)
    if x.shape[0] == 0:
        return out
    if x.stride(1) != 1 and layout.k > 1:
        x = x.contiguous()
    extension().linear(x, *layout.tensors, layout.n, layout.k, out)
    return out
