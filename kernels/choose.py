"""Which backend and which kernel runs, for every format: the one module that decides.

Every decision here is pure Python on the device type, M (rows of ``x``), dtypes, flags and the environment;
none reads a tensor value or syncs with the device, so the ops stay safe under torch.compile and CUDA graphs.
The M thresholds were measured on an H200 (benchmarks/NOTES.md). The kernel modules are imported inside the
functions that ask whether their kernels can be built (``available()``), never at import, so the ops modules
import this one freely.

Environment: ``PARITY_KERNEL_BACKEND`` (:data:`ENV_BACKEND`) = ``torch | triton | cuda | auto`` for both
formats, a backend argument winning over it; ``PARITY_INT8X_LAYOUT`` (:data:`ENV_INT8X_LAYOUT`) =
``auto | native | planes | streams``.

ternary (kernels/ternary_ops.py; the op ``vllm_parity::ternary_linear`` runs the kernel it is named)
    backend, :func:`ternary_backend`: the argument, else the environment, else ``auto`` on CUDA and ``torch``
    elsewhere; ``cuda`` and ``auto`` need CUDA tensors, ``triton`` on CPU tensors ``TRITON_INTERPRET=1``.
    kernel, :func:`ternary_kernel` (:data:`TERNARY_KERNELS`):
      ``torch``          backend ``torch``
      ``triton_gemv``    backend ``triton``, M <= TRITON_GEMV_MAX_M; else ``triton_mm``
      on backend ``cuda``, or ``auto`` where the CUDA kernels build (``ternary_cuda.available()``):
      ``cuda_gemm``      the weight tiled, GEMM_MIN_M <= M < DEQUANT_MIN_M, or < GEMM_ROW_SCALE_MIN_DENSE_M with
                         one scale a row (any M >= GEMM_MIN_M with activation quantization),
                         :func:`ternary_gemm_eligible` (``cuda_mma``'s cases, on compute capability 9.0: wgmma)
      ``cuda_mma``       M <= MMA_MAX_M, fp16 / bf16, group size a multiple of 128 (:func:`ternary_mma_eligible`;
                         0 = no groups); on the tiled weight where there is one, else on the row layout
      ``cuda_dequant``   M >= DEQUANT_MIN_M, fp16 / bf16, no activation quantization
      ``cuda_vec``       any other case of backend ``cuda``; of ``auto``, M <= AUTO_CUDA_VEC_MAX_M only
      ``auto`` otherwise: the ``triton`` choice for M. ``cuda_naive`` is never chosen (tests and benchmarks
      name it).
    resident copies (the vLLM method), :func:`ternary_resident`: ``PARITY_TERNARY_RESIDENT``
    (:data:`ENV_TERNARY_RESIDENT`) = ``rows`` keeps only the row layout (every kernel above but ``cuda_gemm``
    reads it); ``tiles`` only the tiled layout (:func:`ternary_tiles_only`: backend ``cuda`` / ``auto`` builds the
    CUDA kernels and the layer's dtype and group size suit ``cuda_mma``); ``two`` the row layout and the tiles;
    ``auto`` (default) the tiles alone where ``cuda_gemm`` serves the layer, else two copies. From the tiles
    alone, :func:`ternary_tiles_kernel` (:data:`TERNARY_TILES_KERNELS`): ``cuda_gemm`` where eligible as above,
    else ``cuda_mma`` for M <= MMA_MAX_M, else ``cuda_dequant_tiles`` (dense weight from the tiles, torch's GEMM).

int8x (kernels/int8x_ops.py: the stored streams; kernels/int8x_native.py: the native layout; kernels/vllm/int8x.py)
    layout, :func:`int8x_layout`: ``auto`` (default) serves the native layout where it takes no more memory
    than the streams (``int8x_native.fits``), else the planes layout (kernels/int8x_planes.py) where it takes
    less than the streams, else the streams; ``native`` / ``planes`` always that layout, ``streams`` never a
    repacked one.
    streams backend, :func:`int8x_backend` (:data:`INT8X_BACKENDS`): the argument, else the environment, else
    ``auto``; ``auto`` = ``cuda`` on CUDA tensors where nvcc builds csrc/int8x.cu (``int8x_cuda.available()``),
    ``triton`` on other CUDA tensors, ``torch`` elsewhere; ``cuda`` needs CUDA tensors. The ops resolve the
    backend they are given with :func:`int8x_op_backend`; the vLLM method takes :func:`int8x_vllm_backend`.
    streams kernel: the ops run what they are called as (``int8x_decode`` or the fused decode-GEMV
    ``int8x_linear``); the vLLM method, :func:`int8x_uses_gemm`: M > INT8X_GEMM_MIN_M decodes the weight once
    and runs the dense GEMM, else the fused decode-GEMV.
    native backend, :func:`int8x_native_backend`: ``torch`` or ``triton`` (no CUDA C++ kernel: ``cuda`` and
    ``auto`` mean ``triton`` on CUDA tensors, ``torch`` elsewhere); its op resolves what it is given with
    :func:`int8x_native_op_backend` (:data:`INT8X_NATIVE_BACKENDS`).
    native kernel, :func:`int8x_native_kernel` (:data:`INT8X_NATIVE_KERNELS`): ``torch`` on backend ``torch``;
    on ``triton``, ``triton_gemv`` for M <= INT8X_NATIVE_GEMV_MAX_M, else ``triton_gemm`` (the weight decoded
    once, then the dense GEMM).
    planes backend, :func:`int8x_planes_op_backend` (:data:`INT8X_PLANES_BACKENDS`): ``torch`` or ``cuda``
    (csrc/int8x_planes.cu); ``auto`` = ``cuda`` on CUDA tensors where nvcc builds it, else ``torch``.
    planes kernel, :func:`int8x_planes_kernel` (:data:`INT8X_PLANES_KERNELS`): ``torch`` on backend
    ``torch``; on ``cuda``, ``cuda_gemv`` (tensor-core decode-GEMV) for M <= INT8X_PLANES_GEMV_MAX_M, else
    ``cuda_gemm`` (the weight decoded once, then the dense GEMM).
"""

from __future__ import annotations

import os

import torch

ENV_BACKEND = "PARITY_KERNEL_BACKEND"
ENV_INT8X_LAYOUT = "PARITY_INT8X_LAYOUT"
HALF_DTYPES = (torch.float16, torch.bfloat16)

# -- ternary ----------------------------------------------------------------------------------------

TERNARY_BACKENDS = ("torch", "triton", "cuda", "auto")
TERNARY_KERNELS = ("torch", "triton_gemv", "triton_mm", "cuda_naive", "cuda_vec", "cuda_mma", "cuda_gemm",
                   "cuda_dequant")
# From the tiled copy alone (the vLLM method's one resident copy; ternary_ops.tiles_linear).
TERNARY_TILES_KERNELS = ("cuda_mma", "cuda_gemm", "cuda_dequant_tiles")

# M thresholds between kernels (measured on an H200, benchmarks/NOTES.md).
TRITON_GEMV_MAX_M = 1
AUTO_CUDA_VEC_MAX_M = 2
MMA_MAX_M = 64
GEMM_MIN_M = 33
DEQUANT_MIN_M = 384
# With one scale a row cuda_gemm's warp-specialized kernel serves up to here (the dense weight from here on).
GEMM_ROW_SCALE_MIN_DENSE_M = 1024
# The last row count before each switch of ternary kernel above: a choice on each side of every one of them is
# every kernel a layer may run.
TERNARY_M_BOUNDS = (TRITON_GEMV_MAX_M, AUTO_CUDA_VEC_MAX_M, GEMM_MIN_M - 1, MMA_MAX_M, DEQUANT_MIN_M,
                    GEMM_ROW_SCALE_MIN_DENSE_M - 1)


def ternary_backend(backend: str | None, device: torch.device) -> str:
    """The ternary backend for tensors on ``device``: ``backend``, else ``PARITY_KERNEL_BACKEND``, else the
    device's default; checked against the device (``auto`` stays ``auto``: :func:`ternary_kernel` resolves it)."""
    backend = backend or os.environ.get(ENV_BACKEND) or ("auto" if device.type == "cuda" else "torch")
    if backend not in TERNARY_BACKENDS:
        raise ValueError(f"unknown ternary backend {backend!r}; expected one of {TERNARY_BACKENDS}")
    if backend in ("cuda", "auto") and device.type != "cuda":
        raise ValueError(f"ternary backend {backend!r} needs CUDA tensors, got {device}")
    if backend == "triton" and device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        raise ValueError("ternary backend 'triton' on CPU tensors needs TRITON_INTERPRET=1 "
                         "(set before triton is imported)")
    return backend


def ternary_mma_eligible(dtype: torch.dtype | None, group_size: int) -> bool:
    """Whether the tensor-core kernel ``cuda_mma`` takes the case, whatever M (on the tiles, or on the row layout
    where a weight has no tiles)."""
    return dtype in HALF_DTYPES and group_size % 128 == 0


def ternary_gemm_eligible(dtype: torch.dtype | None, group_size: int) -> bool:
    """Whether the GEMM on the tiles ``cuda_gemm`` takes the case, whatever M: ``cuda_mma``'s cases, where it
    runs (compute capability 9.0 and nvcc: ``ternary_cuda.gemm_supported``)."""
    if not ternary_mma_eligible(dtype, group_size):
        return False
    from vllm_parity.serving import ternary_cuda

    return ternary_cuda.gemm_supported()


def _gemm_rows(m: int, act_quant: bool, group_size: int) -> bool:
    """The row counts ``cuda_gemm`` serves (benchmarks/NOTES.md): from GEMM_MIN_M, below DEQUANT_MIN_M (with one
    scale a row below GEMM_ROW_SCALE_MIN_DENSE_M) where the dense weight and cuBLAS are faster, which do not
    quantize activations."""
    dense_from = DEQUANT_MIN_M if group_size else GEMM_ROW_SCALE_MIN_DENSE_M
    return m >= GEMM_MIN_M and (m < dense_from or act_quant)


def ternary_kernel(backend: str, m: int, dtype: torch.dtype | None = None, group_size: int = 0,
                   act_quant: bool = False, tiled: bool = False) -> str:
    """The kernel a backend runs for ``m`` rows: a Python decision on shapes, dtypes and flags only; ``tiled``:
    the weight has its tiled copy (``cuda_gemm`` reads only that)."""
    if backend == "torch":
        return "torch"
    if backend == "triton":
        return "triton_gemv" if m <= TRITON_GEMV_MAX_M else "triton_mm"
    from vllm_parity.serving import ternary_cuda

    cuda = backend == "cuda" or ternary_cuda.available()
    half = dtype in HALF_DTYPES
    if cuda and tiled and _gemm_rows(m, act_quant, group_size) and ternary_gemm_eligible(dtype, group_size):
        return "cuda_gemm"
    if cuda and m <= MMA_MAX_M and ternary_mma_eligible(dtype, group_size):
        return "cuda_mma"
    if cuda and m >= DEQUANT_MIN_M and half and not act_quant:
        return "cuda_dequant"
    if backend == "cuda" or cuda and m <= AUTO_CUDA_VEC_MAX_M:
        return "cuda_vec"
    return ternary_kernel("triton", m)


ENV_TERNARY_RESIDENT = "PARITY_TERNARY_RESIDENT"
TERNARY_RESIDENT = ("auto", "two", "rows", "tiles")
# What the vLLM method keeps when PARITY_TERNARY_RESIDENT is unset: the tiles alone where cuda_gemm serves the
# layer (from them every M is as fast as from two copies, or faster: benchmarks/NOTES.md), else the row layout
# and the tiles (from the tiles alone 65 <= M <= ~200 would run 1.25-1.4x slower, the dense weight's GEMM
# against triton_mm on the row layout).
TERNARY_RESIDENT_DEFAULT = "auto"


def ternary_resident(backend: str, dtype: torch.dtype | None, group_size: int) -> str:
    """The ternary weight copies the vLLM method keeps: ``rows`` (the row layout alone, 2 bits a weight: other
    backends than ``cuda`` / ``auto``, or ``PARITY_TERNARY_RESIDENT`` = ``rows``), ``tiles`` (only the tiled layout,
    2 bits a weight: where :func:`ternary_tiles_only`, for ``PARITY_TERNARY_RESIDENT`` = ``tiles``, and for ``auto``
    where :func:`ternary_gemm_eligible` too) or ``rows+tiles`` (the row layout and the tiled copy, 4 bits a weight:
    backend ``cuda`` / ``auto`` otherwise)."""
    choice = os.environ.get(ENV_TERNARY_RESIDENT) or TERNARY_RESIDENT_DEFAULT
    if choice not in TERNARY_RESIDENT:
        raise ValueError(f"{ENV_TERNARY_RESIDENT} = {choice!r}, expected one of {TERNARY_RESIDENT}")
    if backend not in ("cuda", "auto") or choice == "rows":
        return "rows"
    if choice == "auto":
        choice = "tiles" if ternary_gemm_eligible(dtype, group_size) else "two"
    return "tiles" if choice == "tiles" and ternary_tiles_only(backend, dtype, group_size) else "rows+tiles"


def ternary_tiles_only(backend: str, dtype: torch.dtype | None, group_size: int) -> bool:
    """Whether a layer keeps only the tiled copy of its weight (the vLLM method: one resident copy, 2 bits a
    weight): backend ``cuda`` or ``auto`` where the CUDA kernels build, activations (the layer's dtype) fp16 /
    bf16 and group scales a multiple of 128, i.e. where the tensor-core kernel serves small M; every row count
    is then served from the tiles (:func:`ternary_tiles_kernel`). Otherwise the row layout alone."""
    if backend not in ("cuda", "auto") or not ternary_mma_eligible(dtype, group_size):
        return False
    from vllm_parity.serving import ternary_cuda

    return ternary_cuda.available()


def ternary_tiles_kernel(m: int, dtype: torch.dtype | None, group_size: int, act_quant: bool = False) -> str:
    """The kernel for ``m`` rows from the tiled copy alone (``ternary_ops.tiles_linear``): ``cuda_gemm`` where
    it serves (as in :func:`ternary_kernel`), else ``cuda_mma`` for M <= MMA_MAX_M where eligible, else
    ``cuda_dequant_tiles`` (the dense weight decoded from the tiles, then torch's GEMM; any dtype)."""
    if _gemm_rows(m, act_quant, group_size) and ternary_gemm_eligible(dtype, group_size):
        return "cuda_gemm"
    if m <= MMA_MAX_M and ternary_mma_eligible(dtype, group_size):
        return "cuda_mma"
    return "cuda_dequant_tiles"


# -- int8x ------------------------------------------------------------------------------------------

INT8X_BACKENDS = ("torch", "triton", "cuda", "auto")
INT8X_LAYOUTS = ("auto", "native", "planes", "streams")
# Above this many rows of x the vLLM method decodes the streams once and runs a dense GEMM; up to it, the
# fused decode-GEMV op.
INT8X_GEMM_MIN_M = 16

INT8X_NATIVE_BACKENDS = ("torch", "triton", "auto")
INT8X_NATIVE_KERNELS = ("torch", "triton_gemv", "triton_gemm")
# Above this many rows of x the native layout's triton backend decodes the weight once and runs a dense GEMM.
INT8X_NATIVE_GEMV_MAX_M = 16


def _int8x_auto(device: torch.device) -> str:
    if device.type != "cuda":
        return "torch"
    from vllm_parity.serving import int8x_cuda

    return "cuda" if int8x_cuda.available() else "triton"


def int8x_backend(backend: str | None, device: torch.device) -> str:
    """The concrete int8x backend (never ``"auto"``) for tensors on ``device``: ``backend``, else
    ``PARITY_KERNEL_BACKEND``, else ``auto`` on CUDA tensors and ``torch`` elsewhere."""
    chosen = backend or os.environ.get(ENV_BACKEND) or ("auto" if device.type == "cuda" else "torch")
    if chosen not in INT8X_BACKENDS:
        source = "backend argument" if backend else ENV_BACKEND
        raise ValueError(f"int8x: {source} = {chosen!r}, expected one of {INT8X_BACKENDS}")
    if chosen == "cuda" and device.type != "cuda":
        raise ValueError(f"int8x backend 'cuda' needs CUDA tensors, got {device}; use 'torch' or 'triton'")
    return _int8x_auto(device) if chosen == "auto" else chosen


def int8x_vllm_backend(device: torch.device) -> str:
    """The vLLM method's streams backend: ``PARITY_KERNEL_BACKEND`` when set (shared with the ternary op), else
    int8x's own default for the device (a bad value is reported as the backend argument)."""
    return int8x_backend(os.environ.get(ENV_BACKEND) or "auto", device)


def int8x_op_backend(backend: str, device: torch.device) -> str:
    """The backend an int8x op runs on, from the one it was given (``auto`` resolved from its tensors' device)."""
    if backend not in INT8X_BACKENDS:
        raise ValueError(f"int8x op: backend {backend!r}, expected one of {INT8X_BACKENDS}")
    return _int8x_auto(device) if backend == "auto" else backend


def int8x_uses_gemm(m: int) -> bool:
    """Whether the vLLM method serves ``m`` rows of x from stored streams by decoding the weight once and running
    a dense GEMM (else the fused decode-GEMV op)."""
    return m > INT8X_GEMM_MIN_M


def int8x_layout() -> str:
    """``PARITY_INT8X_LAYOUT`` (default ``auto``), checked: ``auto``, ``native``, ``planes`` or ``streams``."""
    choice = os.environ.get(ENV_INT8X_LAYOUT) or "auto"
    if choice not in INT8X_LAYOUTS:
        raise ValueError(f"{ENV_INT8X_LAYOUT} = {choice!r}, expected one of {INT8X_LAYOUTS}")
    return choice


def int8x_native_op_backend(backend: str, device: torch.device) -> str:
    """The backend the native layout's op runs on, from the one it was given: ``torch`` or ``triton``."""
    if backend not in INT8X_NATIVE_BACKENDS:
        raise ValueError(f"int8x_native_linear: backend {backend!r}, expected one of {INT8X_NATIVE_BACKENDS}")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return backend


def int8x_native_backend(backend: str | None, device: torch.device) -> str:
    """``torch`` or ``triton`` from a requested int8x backend (or ``PARITY_KERNEL_BACKEND``): the layout has
    no CUDA C++ kernel, so ``cuda`` and ``auto`` mean Triton on CUDA tensors and torch elsewhere."""
    chosen = backend or os.environ.get(ENV_BACKEND) or "auto"
    return chosen if chosen in ("torch", "triton") else int8x_native_op_backend("auto", device)


def int8x_native_kernel(backend: str, m: int) -> str:
    """The native layout's kernel on a resolved backend (``torch`` or ``triton``) for ``m`` rows of x."""
    if backend != "triton":
        return "torch"
    return "triton_gemv" if m <= INT8X_NATIVE_GEMV_MAX_M else "triton_gemm"


INT8X_PLANES_BACKENDS = ("torch", "cuda", "auto")
INT8X_PLANES_KERNELS = ("torch", "cuda_gemv", "cuda_gemm")
# Up to this many rows of x the planes layout runs its fused decode-GEMV (one pass over the weight serves 16
# rows on the tensor cores); above, the weight is decoded once and the dense GEMM runs.
INT8X_PLANES_GEMV_MAX_M = 16


def int8x_planes_op_backend(backend: str, device: torch.device) -> str:
    """The backend the planes layout's op runs on, from the one it was given: ``torch`` or ``cuda``."""
    if backend not in INT8X_PLANES_BACKENDS:
        raise ValueError(f"int8x_planes_linear: backend {backend!r}, expected one of {INT8X_PLANES_BACKENDS}")
    if backend == "auto":
        if device.type != "cuda":
            return "torch"
        from vllm_parity.serving import int8x_planes_cuda

        return "cuda" if int8x_planes_cuda.available() else "torch"
    if backend == "cuda" and device.type != "cuda":
        raise ValueError(f"int8x_planes_linear: backend 'cuda' needs CUDA tensors, got {device}; use 'torch'")
    return backend


def int8x_planes_backend(backend: str | None, device: torch.device) -> str:
    """The planes op's backend from a requested int8x backend (or ``PARITY_KERNEL_BACKEND``): ``torch`` stays,
    anything else is ``auto`` (the layout has no Triton kernel)."""
    chosen = backend or os.environ.get(ENV_BACKEND) or "auto"
    return "torch" if chosen == "torch" else "auto"


def int8x_planes_kernel(backend: str, m: int) -> str:
    """The planes layout's kernel on a resolved backend (``torch`` or ``cuda``) for ``m`` rows of x."""
    if backend != "cuda":
        return "torch"
    return "cuda_gemv" if m <= INT8X_PLANES_GEMV_MAX_M else "cuda_gemm"
