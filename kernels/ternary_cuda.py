"""CUDA ternary kernels (``csrc/ternary.cu``): naive, vectorized, tensor-core (tiled layout), dequantize.

Built with ``torch.utils.cpp_extension.load`` on first use only, so importing this module never
compiles anything and works on machines without nvcc or a GPU.
"""

from __future__ import annotations

import functools
import os
import threading

import torch

from vllm_parity.serving.cuda_build import LazyExtension, available  # noqa: F401  (available: re-exported)

extension = LazyExtension("vllm_parity_ternary", "ternary.cu", "ternary CUDA kernels")
ENV_PDL = "PARITY_MMA_PDL"  # "0": launch the tensor-core kernel without programmatic dependent launch


_fakes_lock = threading.Lock()
_fakes_done = False


def ops():
    """``torch.ops.parity_ternary``: the C++ ops of ``csrc/ternary.cu`` (``TORCH_LIBRARY``), which choose
    their configuration in C++ (the rules of :func:`mma_config`), so that an eager call runs no Python
    between torch's dispatcher and the launch. Builds / loads the extension and registers the ops' fake
    implementations (torch.compile) on the first call; call it once at load, outside any compiled region.

    - ``mma(x, tiles, scale, bias, n, k, group_size, act_quant)``: the tensor-core kernel, x fp16 / bf16
      ``(..., K)`` (any strides), output ``(..., N)``.
    - ``mma_rows(x, qweight, scale, bias, n, k, group_size, act_quant)``: the same kernel reading the row layout
      (``NativeTernary.qweight``) instead of the tiles.
    - ``dequant_tiles(tiles, scale, n, k, group_size, dtype)``: the dense ``(N, K)`` weight (scale folded
      in) from the tiled layout.
    """
    global _fakes_done
    if not _fakes_done:
        extension()
        with _fakes_lock:
            if not _fakes_done:
                _register_fakes()
                _fakes_done = True
    return torch.ops.parity_ternary


def _register_fakes() -> None:
    @torch.library.register_fake("parity_ternary::mma")
    def _mma_fake(x, tiles, scale, bias, n, k, group_size, act_quant):
        return x.new_empty((*x.shape[:-1], n))

    @torch.library.register_fake("parity_ternary::mma_rows")
    def _mma_rows_fake(x, qweight, scale, bias, n, k, group_size, act_quant):
        return x.new_empty((*x.shape[:-1], n))

    @torch.library.register_fake("parity_ternary::dequant_tiles")
    def _dequant_tiles_fake(tiles, scale, n, k, group_size, dtype):
        return tiles.new_empty((n, k), dtype=dtype)


def mma_cpp_config(m: int, n: int, k: int, group_size: int, rows: bool = False) -> dict:
    """The configuration the C++ op ``parity_ternary.mma`` (``mma_rows`` with ``rows``) launches for this shape
    (for tests)."""
    tn, mb, warps, loads, pdl = extension().mma_auto_config(m, n, k, group_size, rows)
    return {"tn": tn, "mb": mb, "warps": warps, "loads": loads, "pdl": bool(pdl)}


def dequant_tiles(tiles: torch.Tensor, scale: torch.Tensor, n: int, k: int, group_size: int,
                  dtype: torch.dtype) -> torch.Tensor:
    """The dense weight ``(N, K)`` in ``dtype`` (scale folded in) from the tiled layout."""
    return ops().dequant_tiles(tiles, scale, n, k, group_size, dtype)


def ternary_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                   k: int, group_size: int, act_quant: bool, kernel: str) -> torch.Tensor:
    """``y = x @ W^T (+ bias)`` for a 2-D ``x`` on the native layout; ``kernel``: ``"naive"`` or ``"vec"``."""
    if kernel not in ("naive", "vec"):
        raise ValueError(f"unknown cuda kernel {kernel!r}; expected 'naive' or 'vec'")
    if kernel == "vec" and x.stride(-1) != 1:
        x = x.contiguous()
    if kernel == "vec" and (k + 15) // 16 * 17 * 4 > 227 * 1024:
        raise ValueError(f"ternary cuda_vec kernel: K = {k} does not fit its activation row in shared memory")
    return extension().ternary_linear(x, qweight, scale, bias, k, group_size, act_quant, kernel == "vec")


def mma_config(m: int, n: int, k: int, rows: bool = False) -> dict:
    """Row tiles per block, token fragments, warps, loads in flight and launch of the tensor-core kernel.

    ``pdl`` makes it a programmatic dependent launch: it starts, and reads its first weights, during the
    previous kernel's tail, and waits for that kernel only before reading x (default on compute
    capability 9 and later unless ``PARITY_MMA_PDL=0``). From the H200 sweeps in
    benchmarks/NOTES.md: up to 8 tokens, blocks of 16 warps, as many row tiles per block as leave at
    least 1.2 blocks per multiprocessor (0.9 above 4 tokens: each tile more shares the loads of x), and
    8 loads in flight where the grid has no more blocks than multiprocessors (registers then do not
    limit residency); 9-16 tokens, about four 128-input chunks per warp and a block per multiprocessor;
    above, 4 tiles and up to 8 warps per block. On the row layout (``rows``) up to 8 tokens: as many tiles as
    leave 0.9 blocks per multiprocessor, a warp for every two 256-input chunks (up to 16), 4 loads in flight;
    9-16 tokens: 4 tiles a block (the H200 sweep of the row layout in benchmarks/NOTES.md).
    """
    sms = _num_sms()
    nt, kc = -(-n // 16), -(-k // 128)

    def tiles(min_blocks: float) -> int:
        tn = 4
        while tn > 1 and -(-nt // tn) < min_blocks:
            tn //= 2
        return tn

    launch = {"loads": 4, "pdl": _pdl_supported() and os.environ.get(ENV_PDL, "1") != "0"}
    if m <= 8 and rows:
        return {"tn": tiles(0.9 * sms), "mb": 1, "warps": max(1, min(16, -(-k // 256) // 2)), **launch}
    if m <= 8:
        tn = tiles((1.2 if m <= 4 else 0.9) * sms)
        loads = 8 if -(-nt // tn) <= sms else 4
        return {"tn": tn, "mb": 1, "warps": max(1, min(16, kc)), **launch, "loads": loads}
    if m <= 16:
        return {"tn": 4 if rows else tiles(0.9 * sms), "mb": 2, "warps": max(1, min(16, kc // 4)), **launch}
    return {"tn": 4, "mb": 2, "warps": max(1, min(8, kc // 4)), **launch}


@functools.lru_cache(maxsize=None)
def _num_sms() -> int:
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


@functools.lru_cache(maxsize=None)
def _pdl_supported() -> bool:
    """Programmatic dependent launch needs compute capability 9.0 (Hopper) or later."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability(torch.cuda.current_device())[0] >= 9


def _fit_instance(cfg: dict, group_size: int) -> dict:
    """The nearest compiled instance: 8 loads in flight only for mb 1 without group scales, which also
    allow no more than 2 tiles at mb 2; 1 to 16 warps."""
    cfg["warps"] = max(1, min(16, int(cfg["warps"])))
    cfg["pdl"] = bool(cfg["pdl"]) and _pdl_supported()
    if cfg["mb"] != 1 or group_size:
        cfg["loads"] = 4
    if group_size and cfg["mb"] == 2:
        cfg["tn"] = min(cfg["tn"], 2)
    return cfg


def _check_mma_args(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, n: int, k: int, group_size: int,
                    rows: bool = False) -> None:
    """The extension's preconditions as Python errors of the usual types, naming the argument (the device
    last, so that everything else is checked wherever the tensors live); ``w`` the tiles, or the row layout
    (``rows``)."""
    if x.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"ternary mma kernel: x must be fp16 or bf16, got {x.dtype}")
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"ternary mma kernel: x must be (M, K={k}), got {tuple(x.shape)}")
    what, want = ("qweight", (n, -(-k // 16))) if rows else ("tiles", (-(-n // 16), -(-k // 128), 32, 4))
    if w.dtype != torch.int32 or tuple(w.shape) != want or not w.is_contiguous():
        raise ValueError(f"ternary mma kernel: {what} must be contiguous int32 {want} for N={n} K={k}, got "
                         f"{w.dtype} {tuple(w.shape)}")
    if scale.dtype != torch.float32 or scale.dim() != 2 or scale.shape[0] != n or not scale.is_contiguous():
        raise ValueError(f"ternary mma kernel: scale must be contiguous fp32 (N={n}, G), got {scale.dtype} "
                         f"{tuple(scale.shape)}")
    if group_size % 128:
        raise ValueError(f"ternary mma kernel: group size {group_size} is not a multiple of 128")
    if x.device.type != "cuda" or w.device != x.device or scale.device != x.device:
        raise ValueError(f"ternary mma kernel: x, {what} and scale must be on one CUDA device, got {x.device}, "
                         f"{w.device}, {scale.device}")


def linear_mma(x: torch.Tensor, tiles: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, n: int, k: int,
               group_size: int, act_quant: bool, config: dict | None = None, rows: bool = False) -> torch.Tensor:
    """``y = x @ W^T (+ bias)`` on the tiled layout with tensor cores, or on the row layout (``rows``: ``tiles`` is
    then ``NativeTernary.qweight``); x fp16 or bf16 (M, K)."""
    _check_mma_args(x, tiles, scale, n, k, group_size, rows)
    if x.stride(-1) != 1:
        x = x.contiguous()
    cfg = _fit_instance(dict(mma_config(x.shape[0], n, k, rows), **(config or {})), group_size)
    launch = extension().ternary_linear_mma_rows if rows else extension().ternary_linear_mma
    return launch(x, tiles, scale, bias, n, k, group_size, act_quant, cfg["tn"], cfg["mb"], cfg["warps"],
                  cfg["loads"], bool(cfg["pdl"]))


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
