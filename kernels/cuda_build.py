"""The CUDA extensions (``csrc/*.cu``), built with ``torch.utils.cpp_extension.load`` on first use.

Importing a kernel module never compiles anything, so the package imports on machines without nvcc or a
GPU; the first call that needs a kernel builds it (or loads it from torch's extension cache).
"""

from __future__ import annotations

import functools
import os
import shutil
import threading
from pathlib import Path

import torch

CSRC = Path(__file__).with_name("csrc")


@torch.compiler.assume_constant_result  # compiled callers see a constant, not a file-system probe
def available() -> bool:
    """A CUDA device and a CUDA compiler are present (the extensions can be built); asked once."""
    return _probe()


@functools.lru_cache(maxsize=None)
def _probe() -> bool:
    if not torch.cuda.is_available():
        return False
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    return shutil.which("nvcc") is not None or (home is not None and Path(home, "bin", "nvcc").exists())


def arch_flags() -> list[str]:
    """Machine code for the current card, so its own instructions are used: sm_90a on the H100 / H200 (wgmma
    needs the arch-specific target; its code runs on compute capability 9.0 only, which is this card)."""
    major, minor = torch.cuda.get_device_capability()
    arch = f"{major}{minor}" + ("a" if (major, minor) == (9, 0) else "")
    return [f"-gencode=arch=compute_{arch},code=sm_{arch}"]


def cuda_cflags() -> list[str]:
    """nvcc's flags for every extension."""
    return ["-O3", "-std=c++17", *arch_flags()]


def link_flags() -> list[str]:
    """The linker's flags for every extension. A toolchain with only a static C++ runtime (libstdc++.a) links a copy
    of it into each extension; exported, that copy's symbols are bound in part to the process's libstdc++.so at load,
    and an error message that formats a number then crashes the process (benchmarks/NOTES.md). Kept local, the copy
    stays whole; with a shared runtime the flag changes nothing."""
    return ["-Wl,--exclude-libs,ALL"]


def build_flags() -> dict:
    """The compiler and linker flags of every extension, as ``torch.utils.cpp_extension.load`` takes them (a probe
    passes the same to be built as the extensions are)."""
    return dict(extra_cflags=["-O3"], extra_cuda_cflags=cuda_cflags(), extra_ldflags=link_flags())


class LazyExtension:
    """One ``csrc`` source as a Python module, built on the first call; ``module`` stays None until then. A source
    given by an absolute path elsewhere (an earlier revision's, in benchmarks) is built the same way and finds
    ``csrc``'s headers."""

    def __init__(self, name: str, source: str, what: str):
        self.name, self.source, self.what = name, CSRC / source, what
        self.module = None
        self._lock = threading.Lock()

    def __call__(self):
        if self.module is None:
            with self._lock:
                if self.module is None:
                    if not available():
                        raise RuntimeError(f"{self.what} need a CUDA GPU and nvcc")
                    from torch.utils.cpp_extension import load

                    self.module = load(name=self.name, sources=[str(self.source)], **build_flags(),
                                       extra_include_paths=None if self.source.parent == CSRC else [str(CSRC)],
                                       verbose=os.environ.get("PARITY_CUDA_VERBOSE") == "1")
        return self.module
