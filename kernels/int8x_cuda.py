"""CUDA kernels for ``int8x`` weights (``csrc/int8x.cu``): decode and fused decode-GEMV.

Same calls and semantics as :mod:`vllm_parity.serving.int8x_triton` (``decode``, ``linear``, with ``out=``), on CUDA
tensors only. The extension is built with ``torch.utils.cpp_extension.load`` on first use, never at import,
so importing this module works on machines without nvcc or a GPU.

The kernels take the FORMATS.md tensors unvalidated (validate them once at load time with
``vllm_parity.serving.int8x_load.decode_streams``) plus the shape and block size as Python ints; they read no tensor value on
the host and run on the current stream, so they can be captured in CUDA graphs.
"""

from __future__ import annotations

import torch

from vllm_parity.serving.cuda_build import LazyExtension, available  # noqa: F401  (available: re-exported)
from vllm_parity.serving.int8x_triton import linear_out

__all__ = ["available", "extension", "decode", "linear"]

extension = LazyExtension("vllm_parity_int8x", "int8x.cu", "int8x CUDA kernels")


def _check_cuda(*tensors: torch.Tensor) -> None:
    device = tensors[0].device
    if device.type != "cuda":
        raise ValueError(f"int8x cuda kernels need CUDA tensors, got {device}; use the torch or triton backend")
    for t in tensors:
        if t.device != device:
            raise ValueError(f"int8x cuda: tensors on {device} and {t.device}")


_STREAM_DTYPES = (("b1", torch.int32), ("b2", torch.int32), ("l1", torch.int32), ("l2", torch.int32),
                  ("l3", torch.uint8), ("b1_blk", torch.int32), ("b2_blk", torch.int32), ("scale", torch.float32))


def _check_streams(streams: tuple, n_rows: int, n_cols: int, block_size: int) -> None:
    """Dtypes, ranks and the lengths fixed by the shape, checked here so every mistake is a Python error
    naming the tensor (the kernels index by these lengths without further checks)."""
    if n_rows <= 0 or n_cols <= 0:
        raise ValueError(f"int8x cuda: n_rows and n_cols must be positive, got {n_rows}, {n_cols}")
    if block_size <= 0 or block_size % 32:
        raise ValueError(f"int8x cuda: block_size must be a positive multiple of 32, got {block_size}")
    for (name, dtype), t in zip(_STREAM_DTYPES, streams):
        if t.dtype != dtype:
            raise ValueError(f"int8x cuda: {name} must be {dtype}, got {t.dtype}")
        if t.dim() != 1 or not t.is_contiguous():
            raise ValueError(f"int8x cuda: {name} must be a contiguous 1-D tensor, got shape {tuple(t.shape)}")
    n = n_rows * n_cols
    b1, b1_blk, b2_blk, scale = streams[0], streams[5], streams[6], streams[7]
    if b1.numel() != -(-n // 32):
        raise ValueError(f"int8x cuda: b1 has {b1.numel()} words, expected ceil(n/32) = {-(-n // 32)} for n = {n}")
    blocks = -(-n // block_size)
    if b1_blk.numel() != blocks or b2_blk.numel() != blocks:
        raise ValueError(f"int8x cuda: b1_blk / b2_blk have {b1_blk.numel()} / {b2_blk.numel()} entries, "
                         f"expected ceil(n/block_size) = {blocks}")
    if scale.numel() < 1:
        raise ValueError("int8x cuda: scale is empty")


def decode(b1: torch.Tensor, b2: torch.Tensor, l1: torch.Tensor, l2: torch.Tensor, l3: torch.Tensor,
           b1_blk: torch.Tensor, b2_blk: torch.Tensor, scale: torch.Tensor, n_rows: int, n_cols: int,
           block_size: int, dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
    """The weight ``q * scale`` of shape ``(n_rows, n_cols)`` in ``dtype`` (or written into ``out``, in its dtype).

    One warp per 32 b1 words (1024 elements), the lanes one word each; see csrc/int8x.cu.
    """
    if out is None:
        out = torch.empty((n_rows, n_cols), dtype=dtype, device=b1.device)
    elif out.shape != (n_rows, n_cols) or not out.is_contiguous():
        raise ValueError(f"int8x cuda decode: out must be contiguous ({n_rows}, {n_cols}), "
                         f"got {tuple(out.shape)} strides {out.stride()}")
    _check_cuda(out, b1, b2, l1, l2, l3, b1_blk, b2_blk, scale)
    _check_streams((b1, b2, l1, l2, l3, b1_blk, b2_blk, scale), n_rows, n_cols, block_size)
    # The kernel stores 16 bytes at a time; a misaligned out (a view) gets a bounce buffer.
    target = out if out.data_ptr() % 16 == 0 else torch.empty_like(out)
    extension().decode(b1, b2, l1, l2, l3, b1_blk, b2_blk, scale, n_rows, n_cols, block_size, target)
    if target is not out:
        out.copy_(target)
    return out


def linear(x: torch.Tensor, b1: torch.Tensor, b2: torch.Tensor, l1: torch.Tensor, l2: torch.Tensor,
           l3: torch.Tensor, b1_blk: torch.Tensor, b2_blk: torch.Tensor, scale: torch.Tensor, n_rows: int,
           n_cols: int, block_size: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """``y = x @ W^T`` for 2-D ``x`` of shape ``(M, K)``, decoding ``W`` in registers only; ``y`` in x's dtype.

    One pass over the weight for up to 16 rows of ``x`` (larger M: one pass per 16 rows), fp32 accumulation.
    ``x`` may have any row stride; a column stride other than 1 costs a contiguous copy.
    """
    out = linear_out(x, n_rows, n_cols, out, "cuda")
    m_rows = x.shape[0]
    _check_cuda(x, out, b1, b2, l1, l2, l3, b1_blk, b2_blk, scale)
    _check_streams((b1, b2, l1, l2, l3, b1_blk, b2_blk, scale), n_rows, n_cols, block_size)
    if m_rows == 0:
        return out
    if x.stride(1) != 1 and n_cols > 1:
        x = x.contiguous()
    extension().linear(x, b1, b2, l1, l2, l3, b1_blk, b2_blk, scale, n_rows, n_cols, block_size, out)
    return out
