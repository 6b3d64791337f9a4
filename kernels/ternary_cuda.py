"""CUDA ternary kernels (``csrc/ternary.cu``): naive, vectorized, tensor-core (tiled layout), dequantize.

Built with ``torch.utils.cpp_extension.load`` on first use only, so importing this module never
compiles anything and works on machines without nvcc or a GPU.
"""

from __future__ import annotations

import functools

import torch

from kernels.cuda_build import LazyExtension, available  # noqa: F401  (available: re-exported)

extension = LazyExtension("vllm_parity_ternary", "ternary.cu", "ternary CUDA kernels")


def ternary_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                   k: int, group_size: int, act_quant: bool, kernel: str) -> torch.Tensor:
    """``y = x @ W^T (+ bias)`` for a 2-D ``x`` on the native layout; ``kernel``: ``"naive"`` or ``"vec"``."""
    if kernel not in ("naive", "vec"):
        raise ValueError(f"unknown cuda kernel {kernel!r}; expected 'naive' or 'vec'")
    if kernel == "vec" and x.stride(-1) != 1:
        x = x.contiguous()
    return extension().ternary_linear(x, qweight, scale, bias, k, group_size, act_quant, kernel == "vec")


def mma_config(m: int, n: int, k: int) -> dict:
    """Row tiles per block, token fragments, warps and loads in flight for the tensor-core kernel.

    From the H200 sweeps in benchmarks/NOTES.md: up to 8 tokens, blocks of 16 warps and enough of them
    to give each multiprocessor about two (fewer row tiles per block for small N); 9-16 tokens, about
    four 128-input chunks per warp and a block per multiprocessor; above, 4 tiles per block.
    """
    sms = _num_sms()
    nt, kc = -(-n // 16), -(-k // 128)

    def tiles(min_blocks: float) -> int:
        tn = 4
        while tn > 1 and -(-nt // tn) < min_blocks:
            tn //= 2
        return tn

    if m <= 8:
        return {"tn": tiles(1.6 * sms), "mb": 1, "warps": max(1, min(16, kc // 2)), "loads": 4}
    if m <= 16:
        return {"tn": tiles(0.9 * sms), "mb": 2, "warps": max(1, min(16, kc // 4)), "loads": 4}
    return {"tn": 4, "mb": 2, "warps": max(1, min(16, kc // 8)), "loads": 4}


@functools.lru_cache(maxsize=None)
def _num_sms() -> int:
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


def _fit_instance(cfg: dict, group_size: int) -> dict:
    """The nearest compiled instance: 8 loads in flight only for mb 1 without group scales, which also
    allow no more than 2 tiles at mb 2."""
    if cfg["mb"] != 1:
        cfg["loads"] = 4
    if group_size:
        cfg["loads"] = 4
        if cfg["mb"] == 2:
            cfg["tn"] = min(cfg["tn"], 2)
    return cfg


def linear_mma(x: torch.Tensor, tiles: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, n: int, k: int,
               group_size: int, act_quant: bool, config: dict | None = None) -> torch.Tensor:
    """``y = x @ W^T (+ bias)`` on the tiled layout with tensor cores; x fp16 or bf16 (M, K)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    cfg = _fit_instance(dict(mma_config(x.shape[0], n, k), **(config or {})), group_size)
    return extension().ternary_linear_mma(x, tiles, scale, bias, n, k, group_size, act_quant, cfg["tn"], cfg["mb"],
                                          cfg["warps"], cfg["loads"])


def dequant(qweight: torch.Tensor, scale: torch.Tensor, k: int, group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """The dense weight ``(N, K)`` in ``dtype``, scale folded in."""
    out = torch.empty((qweight.shape[0], k), dtype=dtype, device=qweight.device)
    return extension().ternary_dequant(qweight, scale, k, group_size, out)


def linear_dequant(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, k: int,
                   group_size: int, act_quant: bool) -> torch.Tensor:
    """``y = x @ W^T (+ bias)`` through the dense weight and torch's GEMM (large M); fp16 / bf16 x."""
    if act_quant:
        raise ValueError("ternary kernel 'cuda_dequant' does not quantize activations; use cuda_vec or triton_mm")
    if x.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"ternary kernel 'cuda_dequant' takes fp16 or bf16 x, got {x.dtype}")
    w = dequant(qweight, scale, k, group_size, x.dtype)
    return torch.nn.functional.linear(x, w, None if bias is None else bias.to(x.dtype))
