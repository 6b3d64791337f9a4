"""The backend and kernel decisions of every format (kernels/choose.py): pure Python, no kernel runs here.

The fixed cases are those the format tests made before the decisions moved here; the property tests draw
backend, device type, M, dtype, group size and flags (and whether the CUDA kernels build) and check that
every choice is one the format lists and eligible for its case.
"""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_parity.serving import choose, int8x_cuda, ternary_cuda

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
DTYPES = [None, torch.float32, torch.float16, torch.bfloat16]
# Around every M threshold of choose.py, and far from them.
MS = st.one_of(st.sampled_from([1, 2, 3, 8, 15, 16, 17, 63, 64, 65, 383, 384, 385]), st.integers(1, 512),
               st.integers(1, 8192))
BACKEND_VALUES = st.sampled_from([None, "", "torch", "triton", "cuda", "auto", "bogus", "numpy", "Auto"])
DEVICES = st.sampled_from(["cpu", "cuda", "meta"])
# Pure Python and fast: more examples than the profile's, so that rare combinations come up.
PROPERTY = settings(max_examples=max(400, settings.default.max_examples), deadline=None)


def _set_env(mp: pytest.MonkeyPatch, value: str | None) -> None:
    if value is None:
        mp.delenv(choose.ENV_BACKEND, raising=False)
    else:
        mp.setenv(choose.ENV_BACKEND, value)


def _known(exc: pytest.ExceptionInfo, known: tuple[str, ...]) -> bool:
    return str(known) in str(exc.value)


# -- ternary ----------------------------------------------------------------------------------------


def test_ternary_backend(monkeypatch):
    monkeypatch.delenv(choose.ENV_BACKEND, raising=False)
    assert choose.ternary_backend(None, CPU) == "torch"
    assert choose.ternary_backend(None, CUDA) == "auto"
    monkeypatch.setenv(choose.ENV_BACKEND, "cuda")
    with pytest.raises(ValueError, match="'cuda' needs CUDA tensors"):
        choose.ternary_backend(None, CPU)
    with pytest.raises(ValueError, match="'auto' needs CUDA tensors"):
        choose.ternary_backend("auto", CPU)
    assert choose.ternary_backend("torch", CPU) == "torch", "the argument must win over the environment"
    monkeypatch.setenv(choose.ENV_BACKEND, "bogus")
    with pytest.raises(ValueError, match="unknown ternary backend 'bogus'"):
        choose.ternary_backend(None, CPU)
    monkeypatch.delenv(choose.ENV_BACKEND)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="'triton' on CPU tensors needs TRITON_INTERPRET=1"):
        choose.ternary_backend("triton", CPU)
    assert choose.ternary_backend("triton", CUDA) == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert choose.ternary_backend("triton", CPU) == "triton"


def test_ternary_kernel_choice_is_by_shape_only():
    assert choose.ternary_kernel("torch", 1) == "torch"
    small = choose.ternary_kernel("triton", 1)
    large = choose.ternary_kernel("triton", 4096)
    assert large == "triton_mm", f"large M must take the tensor-core kernel, got {large}"
    assert small in ("triton_gemv", "triton_mm")
    half = torch.float16
    assert choose.ternary_kernel("cuda", 1) == "cuda_vec"
    assert choose.ternary_kernel("cuda", 1, half, 0) == "cuda_mma", "on the tiles, or the rows where none"
    assert choose.ternary_kernel("cuda", 16, torch.bfloat16, 256) == "cuda_mma"
    assert choose.ternary_kernel("cuda", 16, half, 64) == "cuda_vec", "group 64 is not mma's"
    assert choose.ternary_kernel("cuda", 8, torch.float32, 0) == "cuda_vec"
    assert choose.ternary_kernel("cuda", 4096, half) == "cuda_dequant"
    assert choose.ternary_kernel("cuda", 4096, half, act_quant=True) == "cuda_vec"
    assert choose.ternary_kernel("auto", 4096) == "triton_mm"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ternary_cuda, "gemm_supported", lambda: True)
        assert choose.ternary_kernel("cuda", 64, half, 0, tiled=True) == "cuda_gemm"
        assert choose.ternary_kernel("cuda", 64, half, 0) == "cuda_mma", "cuda_gemm reads only the tiles"
        assert choose.ternary_kernel("cuda", 32, half, 0, tiled=True) == "cuda_mma"
        assert choose.ternary_kernel("cuda", 383, torch.bfloat16, 256, tiled=True) == "cuda_gemm"
        assert choose.ternary_kernel("cuda", 384, torch.bfloat16, 256, tiled=True) == "cuda_dequant"
        assert choose.ternary_kernel("cuda", 1023, half, 0, tiled=True) == "cuda_gemm", "one scale a row: ws"
        assert choose.ternary_kernel("cuda", 1024, half, 0, tiled=True) == "cuda_dequant"
        assert choose.ternary_kernel("cuda", 4096, half, 0, act_quant=True, tiled=True) == "cuda_gemm"
        assert choose.ternary_kernel("cuda", 64, half, 64, tiled=True) == "cuda_vec", "group 64 is not the GEMM's"
        mp.setattr(ternary_cuda, "gemm_supported", lambda: False)
        assert choose.ternary_kernel("cuda", 64, half, 0, tiled=True) == "cuda_mma"
    if ternary_cuda.available():
        assert choose.ternary_kernel("auto", 1) == "cuda_vec"
        assert choose.ternary_kernel("auto", 1, half, 0) == "cuda_mma"
        assert choose.ternary_kernel("auto", 4096, half) == "cuda_dequant"
    else:
        assert choose.ternary_kernel("auto", 1, half, 0) == small
        assert choose.ternary_kernel("auto", 4096, half) == "triton_mm"


def test_ternary_mma_eligible():
    assert choose.ternary_mma_eligible(torch.float16, 0)
    assert choose.ternary_mma_eligible(torch.bfloat16, 256)
    assert not choose.ternary_mma_eligible(torch.float16, 64), "group 64 is not mma's"
    assert not choose.ternary_mma_eligible(torch.float32, 128)
    assert not choose.ternary_mma_eligible(None, 0)


def _gemm_serves(m: int, dtype, group: int, act_quant: bool, gemm_runs: bool) -> bool:
    """choose.py's docstring for cuda_gemm, written independently of its code (the weight tiled, a CUDA backend)."""
    dense_from = choose.DEQUANT_MIN_M if group else choose.GEMM_ROW_SCALE_MIN_DENSE_M
    return (gemm_runs and dtype in (torch.float16, torch.bfloat16) and group % 128 == 0 and m >= choose.GEMM_MIN_M
            and (m < dense_from or act_quant))


def _ternary_eligible(kernel: str, backend: str, m: int, dtype, group: int, act_quant: bool,
                      cuda_builds: bool, tiled: bool = False, gemm_runs: bool = False) -> bool:
    """What choose.py's docstring promises for each kernel, written independently of its code."""
    half = dtype in (torch.float16, torch.bfloat16)
    cuda = backend == "cuda" or backend == "auto" and cuda_builds
    if kernel == "cuda_gemm":
        return cuda and tiled and _gemm_serves(m, dtype, group, act_quant, gemm_runs)
    if kernel == "torch":
        return backend == "torch"
    if kernel == "triton_gemv":
        return backend in ("triton", "auto") and m <= choose.TRITON_GEMV_MAX_M
    if kernel == "triton_mm":
        return backend in ("triton", "auto") and m > choose.TRITON_GEMV_MAX_M
    if kernel == "cuda_mma":
        return cuda and m <= choose.MMA_MAX_M and half and group % 128 == 0
    if kernel == "cuda_dequant":
        return cuda and m >= choose.DEQUANT_MIN_M and half and not act_quant
    if kernel == "cuda_vec":
        return cuda and (backend == "cuda" or m <= choose.AUTO_CUDA_VEC_MAX_M)
    return False  # cuda_naive: never chosen


@PROPERTY
@given(backend=BACKEND_VALUES, env=BACKEND_VALUES, device=DEVICES, interpret=st.booleans())
def test_ternary_backend_is_listed_or_refused(backend, env, device, interpret):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1" if interpret else "0")
        _set_env(mp, env)
        requested = backend or env or ("auto" if device == "cuda" else "torch")
        if requested not in choose.TERNARY_BACKENDS:
            with pytest.raises(ValueError, match=re.escape(f"unknown ternary backend {requested!r}")) as exc:
                choose.ternary_backend(backend, torch.device(device))
            assert _known(exc, choose.TERNARY_BACKENDS), f"{exc.value} does not name the known backends"
        elif (requested in ("cuda", "auto") and device != "cuda"
              or requested == "triton" and device == "cpu" and not interpret):
            with pytest.raises(ValueError, match=re.escape(f"ternary backend {requested!r}")):
                choose.ternary_backend(backend, torch.device(device))
        else:
            assert choose.ternary_backend(backend, torch.device(device)) == requested


@PROPERTY
@given(backend=st.sampled_from(choose.TERNARY_BACKENDS), m=MS, dtype=st.sampled_from(DTYPES),
       group=st.sampled_from([0, 4, 32, 64, 128, 192, 256, 512]), act_quant=st.booleans(),
       cuda_builds=st.booleans(), tiled=st.booleans(), gemm_runs=st.booleans())
def test_ternary_kernel_is_listed_and_eligible(backend, m, dtype, group, act_quant, cuda_builds, tiled, gemm_runs):
    """Every choice is listed and eligible; cuda_gemm is taken wherever it serves (its rows, a tiled weight)."""
    gemm_runs = gemm_runs and cuda_builds  # it runs only where the CUDA kernels build
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ternary_cuda, "available", lambda: cuda_builds)
        mp.setattr(ternary_cuda, "gemm_supported", lambda: gemm_runs)
        kernel = choose.ternary_kernel(backend, m, dtype, group, act_quant, tiled=tiled)
    what = f"{kernel} chosen for backend={backend} m={m} {dtype} group={group} act_quant={act_quant} tiled={tiled}"
    assert kernel in choose.TERNARY_KERNELS
    assert _ternary_eligible(kernel, backend, m, dtype, group, act_quant, cuda_builds, tiled, gemm_runs), what
    cuda = backend == "cuda" or backend == "auto" and cuda_builds
    assert (kernel == "cuda_gemm") == (cuda and tiled and _gemm_serves(m, dtype, group, act_quant, gemm_runs)), what


@PROPERTY
@given(backend=st.sampled_from(choose.TERNARY_BACKENDS), dtype=st.sampled_from(DTYPES),
       group=st.sampled_from([0, 4, 64, 128, 192, 256, 512]), cuda_builds=st.booleans(), m=MS,
       act_quant=st.booleans(), gemm_runs=st.booleans())
def test_ternary_one_resident_copy(backend, dtype, group, cuda_builds, m, act_quant, gemm_runs):
    """The vLLM method may keep only the tiles exactly where the tensor-core kernel serves the layer; from the tiles
    alone every M has a kernel: cuda_gemm where it serves, else cuda_mma up to MMA_MAX_M where eligible, else the
    dense weight from the tiles."""
    gemm_runs = gemm_runs and cuda_builds
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ternary_cuda, "available", lambda: cuda_builds)
        mp.setattr(ternary_cuda, "gemm_supported", lambda: gemm_runs)
        only = choose.ternary_tiles_only(backend, dtype, group)
        kernel = choose.ternary_tiles_kernel(m, dtype, group, act_quant)
    half = dtype in (torch.float16, torch.bfloat16)
    assert only == (backend in ("cuda", "auto") and cuda_builds and half and group % 128 == 0)
    assert kernel in choose.TERNARY_TILES_KERNELS
    eligible = half and group % 128 == 0
    gemm = _gemm_serves(m, dtype, group, act_quant, gemm_runs)
    assert (kernel == "cuda_gemm") == gemm, (kernel, m, dtype, group, act_quant)
    assert (kernel == "cuda_mma") == (not gemm and m <= choose.MMA_MAX_M and eligible), (kernel, m, dtype, group)


@PROPERTY
@given(backend=st.sampled_from(choose.TERNARY_BACKENDS), dtype=st.sampled_from(DTYPES),
       group=st.sampled_from([0, 64, 128, 256]), cuda_builds=st.booleans(), gemm_runs=st.booleans(),
       env=st.sampled_from([None, "", "auto", "one", "two", "rows", "tiles", "both"]))
def test_ternary_resident(backend, dtype, group, cuda_builds, gemm_runs, env):
    """By default on CUDA backends the tiles alone where cuda_gemm serves the layer, else two copies (rows and
    tiles); two copies when asked for; the row layout alone when asked for and off CUDA backends; the tiles alone
    when asked for where they serve every M; a bad value is refused, naming the variable."""
    gemm_runs = gemm_runs and cuda_builds
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ternary_cuda, "available", lambda: cuda_builds)
        mp.setattr(ternary_cuda, "gemm_supported", lambda: gemm_runs)
        if env is None:
            mp.delenv(choose.ENV_TERNARY_RESIDENT, raising=False)
        else:
            mp.setenv(choose.ENV_TERNARY_RESIDENT, env)
        if env in ("both", "one"):
            with pytest.raises(ValueError, match=choose.ENV_TERNARY_RESIDENT):
                choose.ternary_resident(backend, dtype, group)
            return
        got = choose.ternary_resident(backend, dtype, group)
        only = choose.ternary_tiles_only(backend, dtype, group)
    choice = env or choose.TERNARY_RESIDENT_DEFAULT
    gemm = gemm_runs and dtype in (torch.float16, torch.bfloat16) and group % 128 == 0
    if backend not in ("cuda", "auto") or env == "rows":
        assert got == "rows"
    elif only and (choice == "tiles" or choice == "auto" and gemm):
        assert got == "tiles"
    else:
        assert got == "rows+tiles"


# -- int8x: the streams ---------------------------------------------------------------------------


def test_int8x_backend_selection(monkeypatch):
    gpu_default = "cuda" if int8x_cuda.available() else "triton"
    monkeypatch.delenv(choose.ENV_BACKEND, raising=False)
    assert choose.int8x_backend(None, CPU) == "torch"
    assert choose.int8x_backend(None, CUDA) == gpu_default, "auto: cuda where nvcc builds it, else triton"
    assert choose.int8x_backend("auto", CPU) == "torch"
    assert choose.int8x_backend("cuda", CUDA) == "cuda"
    monkeypatch.setenv(choose.ENV_BACKEND, "triton")
    assert choose.int8x_backend(None, CPU) == "triton"
    assert choose.int8x_backend("torch", CPU) == "torch", "the argument must win over the environment"
    monkeypatch.setenv(choose.ENV_BACKEND, "auto")
    assert choose.int8x_backend(None, CPU) == "torch"
    assert choose.int8x_backend(None, CUDA) == gpu_default
    monkeypatch.setenv(choose.ENV_BACKEND, "cuda")
    with pytest.raises(ValueError, match="'cuda' needs CUDA tensors, got cpu"):
        choose.int8x_backend(None, CPU)
    monkeypatch.setenv(choose.ENV_BACKEND, "numpy")
    with pytest.raises(ValueError, match="PARITY_KERNEL_BACKEND = 'numpy'"):
        choose.int8x_backend(None, CPU)
    with pytest.raises(ValueError, match="backend argument = 'numpy'"):
        choose.int8x_backend("numpy", CPU)


def test_int8x_vllm_backend(monkeypatch):
    gpu_default = "cuda" if int8x_cuda.available() else "triton"
    monkeypatch.delenv(choose.ENV_BACKEND, raising=False)
    assert (choose.int8x_vllm_backend(CPU), choose.int8x_vllm_backend(CUDA)) == ("torch", gpu_default)
    monkeypatch.setenv(choose.ENV_BACKEND, "triton")
    assert choose.int8x_vllm_backend(CPU) == "triton"
    monkeypatch.setenv(choose.ENV_BACKEND, "numpy")
    with pytest.raises(ValueError, match="backend argument = 'numpy'"):  # as it read before choose.py
        choose.int8x_vllm_backend(CPU)


def test_int8x_op_backend():
    assert choose.int8x_op_backend("auto", CPU) == "torch"
    assert choose.int8x_op_backend("cuda", CPU) == "cuda", "the op trusts an explicit backend"
    with pytest.raises(ValueError, match="int8x op: backend 'numpy'"):
        choose.int8x_op_backend("numpy", CPU)


def test_int8x_uses_gemm_above_16_rows():
    assert [choose.int8x_uses_gemm(m) for m in (1, 15, 16, 17, 4096)] == [False, False, False, True, True]


@PROPERTY
@given(backend=BACKEND_VALUES, env=BACKEND_VALUES, device=DEVICES, cuda_builds=st.booleans(), m=MS)
def test_int8x_choice_is_listed_and_eligible(backend, env, device, cuda_builds, m):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(int8x_cuda, "available", lambda: cuda_builds)
        _set_env(mp, env)
        requested = backend or env or ("auto" if device == "cuda" else "torch")
        if requested not in choose.INT8X_BACKENDS:
            with pytest.raises(ValueError, match=re.escape(f"= {requested!r}, expected one of")) as exc:
                choose.int8x_backend(backend, torch.device(device))
            assert _known(exc, choose.INT8X_BACKENDS)
        elif requested == "cuda" and device != "cuda":
            with pytest.raises(ValueError, match="needs CUDA tensors"):
                choose.int8x_backend(backend, torch.device(device))
        else:
            chosen = choose.int8x_backend(backend, torch.device(device))
            assert chosen in ("torch", "triton", "cuda"), "never auto"
            assert chosen == requested or requested == "auto"
            if requested == "auto":
                assert chosen == ("torch" if device != "cuda" else "cuda" if cuda_builds else "triton")
            assert choose.int8x_op_backend(chosen, torch.device(device)) == chosen
        native = choose.int8x_native_backend(backend, torch.device(device))
    assert native in ("torch", "triton")
    if (backend or env) not in ("torch", "triton"):
        assert native == ("triton" if device == "cuda" else "torch"), "cuda / auto / unset: triton on CUDA only"
    kernel = choose.int8x_native_kernel(native, m)
    assert kernel in choose.INT8X_NATIVE_KERNELS
    assert (kernel == "torch") == (native == "torch")
    assert kernel != "triton_gemv" or m <= choose.INT8X_NATIVE_GEMV_MAX_M
    assert kernel != "triton_gemm" or m > choose.INT8X_NATIVE_GEMV_MAX_M
    assert choose.int8x_uses_gemm(m) == (m > choose.INT8X_GEMM_MIN_M)


# -- int8x: the native layout ------------------------------------------------------------------------


def test_int8x_native_backend(monkeypatch):
    monkeypatch.delenv("PARITY_KERNEL_BACKEND", raising=False)
    assert (choose.int8x_native_backend(None, CPU), choose.int8x_native_backend(None, CUDA)) == ("torch", "triton")
    assert choose.int8x_native_backend("cuda", CUDA) == "triton" and choose.int8x_native_backend("torch", CUDA) == "torch"
    monkeypatch.setenv("PARITY_KERNEL_BACKEND", "triton")
    assert choose.int8x_native_backend(None, CPU) == "triton"


def test_int8x_native_op_backend_and_kernel():
    assert choose.int8x_native_op_backend("auto", CPU) == "torch"
    assert choose.int8x_native_op_backend("auto", CUDA) == "triton"
    assert choose.int8x_native_op_backend("triton", CPU) == "triton"
    with pytest.raises(ValueError, match=re.escape("int8x_native_linear: backend 'cuda', expected one of "
                                                   "('torch', 'triton', 'auto')")):
        choose.int8x_native_op_backend("cuda", CUDA)
    assert [choose.int8x_native_kernel("triton", m) for m in (1, 16, 17)] == ["triton_gemv", "triton_gemv",
                                                                             "triton_gemm"]
    assert choose.int8x_native_kernel("torch", 1) == "torch"


def test_int8x_layout(monkeypatch):
    monkeypatch.delenv(choose.ENV_INT8X_LAYOUT, raising=False)
    assert choose.int8x_layout() == "auto"
    for layout in choose.INT8X_LAYOUTS:
        monkeypatch.setenv(choose.ENV_INT8X_LAYOUT, layout)
        assert choose.int8x_layout() == layout
    monkeypatch.setenv(choose.ENV_INT8X_LAYOUT, "dense")
    with pytest.raises(ValueError, match=re.escape("PARITY_INT8X_LAYOUT = 'dense', expected one of "
                                                   "('auto', 'native', 'planes', 'streams')")):
        choose.int8x_layout()


def test_choose_imports_no_kernel_module():
    """The ops modules import choose.py at their top; it must not import them (or a kernel) back."""
    import subprocess
    import sys

    code = ("import sys; import vllm_parity.serving.choose; "
            "print(sorted(m for m in sys.modules if m.startswith('vllm_parity.serving.') and m != "
            "'vllm_parity.serving.choose'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
