"""CUDA ternary kernels (``csrc/ternary.cu``): a naive one and a vectorized one.

Built with ``torch.utils.cpp_extension.load`` on first use only, so importing this module never
compiles anything and works on machines without nvcc or a GPU.
"""

from __future__ import annotations

import functools
import os
import shutil
import threading
from pathlib import Path

import torch

_SOURCE = Path(__file__).with_name("csrc") / "ternary.cu"
_LOCK = threading.Lock()
_EXT = None


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """A CUDA device and a CUDA compiler are present (the extension can be built); asked once."""
    if not torch.cuda.is_available():
        return False
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    return shutil.which("nvcc") is not None or (home is not None and Path(home, "bin", "nvcc").exists())


def _arch_flags() -> list[str]:
    major, minor = torch.cuda.get_device_capability()
    cc = f"{major}{minor}"
    # sm_90 machine code for the H100 / H200; another card gets its own.
    return [f"-gencode=arch=compute_{cc},code=sm_{cc}"]


def extension():
    """The compiled extension, built (or loaded from torch's extension cache) on the first call."""
    global _EXT
    if _EXT is None:
        with _LOCK:
            if _EXT is None:
                if not available():
                    raise RuntimeError("ternary CUDA kernels need a CUDA GPU and nvcc")
                from torch.utils.cpp_extension import load

                _EXT = load(name="vllm_parity_ternary", sources=[str(_SOURCE)],
                            extra_cflags=["-O3"],
                            extra_cuda_cflags=["-O3", "-std=c++17", *_arch_flags()],
                            verbose=os.environ.get("PARITY_CUDA_VERBOSE") == "1")
    return _EXT


def ternary_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                   k: int, group_size: int, act_quant: bool, kernel: str) -> torch.Tensor:
    """``y = x @ W^T (+ bias)`` for a 2-D ``x`` on the native layout; ``kernel``: ``"naive"`` or ``"vec"``."""
    if kernel not in ("naive", "vec"):
        raise ValueError(f"unknown cuda kernel {kernel!r}; expected 'naive' or 'vec'")
    if kernel == "vec" and x.stride(-1) != 1:
        x = x.contiguous()
    return extension().ternary_linear(x, qweight, scale, bias, k, group_size, act_quant, kernel == "vec")
