"""Property tests of every ternary kernel against the fp64 reference (shared FORMATS.md section 1).

Reference: ``vllm_parity.reference.formats.ternary.decode`` in float64, then ``x.double() @ W.T`` (+ bias), with the
per-token activation quantization emulated in float64. Every FORMATS.md variant goes through
``vllm_parity.serving.ternary_repack.repack`` first. On the CPU the Triton kernels run in the interpreter
(TRITON_INTERPRET=1, set below before triton is imported) beside the pure-torch op; the Triton and
CUDA kernels on a GPU are marked ``gpu``.

Error bound per output, from the arithmetic itself rather than a guess:
``||out - ref|| <= u_out * ||ref|| + eps_acc * || |x| @ |W|^T || + quantization ties`` where
``u_out`` is the unit roundoff of the output dtype, ``eps_acc`` covers fp32 accumulation over K
(and tf32x3 on tensor cores), and an activation whose scaled value lies within fp32 rounding of a
.5 tie may quantize either way (its whole weight column is allowed to move by one step).
"""

from __future__ import annotations

import os

if not os.environ.get("TRITON_INTERPRET"):
    import torch as _torch

    if not _torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

import difflib
import importlib.util
import itertools
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from vllm_parity.errors import DecodeError, FormatError
from vllm_parity.reference.formats.ternary import PRESETS, TernarySpec
from vllm_parity.reference.formats.ternary import decode, pack_codes, unpack_values

from vllm_parity.serving import choose, ternary_cuda, ternary_ops, ternary_triton
from vllm_parity.serving.ternary_repack import (NativeTernary, native_weight, pack_native, pack_tiles, repack, tiles_from_native,
                                    tiles_shape, unpack_tiles)

CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}

# --------------------------------------------------------------------------------------------
# drawing cases


@st.composite
def specs(draw) -> TernarySpec:
    values = [-1, 0, 1, draw(st.sampled_from([None, -1, 0, 1]))]  # a 4th code: null or a duplicate
    code_map = tuple(draw(st.permutations(values)))
    return TernarySpec(
        pack_axis=draw(st.sampled_from(["input", "output"])),
        pack_layout=draw(st.sampled_from(["interleaved", "blocked"])),
        bit_order=draw(st.sampled_from(["lsb", "msb"])),
        code_map=code_map,
        scale_granularity=draw(st.sampled_from(["tensor", "channel", "group"])),
        group_size=128,  # replaced below once K is known
        scale_mode=draw(st.sampled_from(["multiply", "divide"])),
        activation_quant=draw(st.sampled_from([None, None, "per_token_absmax_int8"])),
    )


def _dims(draw, spec: TernarySpec, max_n: int, max_k: int) -> tuple[int, int]:
    # K across boundaries: 4, 12, 4 * odd, just past a word (16) or a tile (64, 128), multiples of 128.
    k = draw(st.one_of(st.sampled_from([4, 12, 20, 28, 44, 60, 68, 124, 132, 196]),
                       st.integers(1, max_k // 4).map(lambda v: 4 * v),
                       st.sampled_from([128, 256])))
    k = min(k, max_k)
    if spec.pack_axis == "output":
        k = draw(st.sampled_from([k, max(1, k - draw(st.integers(0, 3)))]))  # K need not be a multiple of 4
        n = 4 * draw(st.integers(1, max_n // 4))
    else:
        n = draw(st.integers(1, max_n))
    return n, k


@st.composite
def cases(draw, max_m: int, max_n: int, max_k: int, dtypes=DTYPES):
    spec = draw(specs())
    n, k = _dims(draw, spec, max_n, max_k)
    if spec.scale_granularity == "group":
        divisors = [g for g in range(1, k + 1) if k % g == 0]
        spec = TernarySpec(**{**spec.__dict__, "group_size": draw(st.sampled_from(divisors))})
    m = draw(st.integers(1, max_m))
    return dict(
        spec=spec, m=m, n=n, k=k,
        dtype=draw(st.sampled_from(dtypes)),
        scale_dtype=draw(st.sampled_from(DTYPES)),
        weights=draw(st.sampled_from(["random", "random", "zero", "plus", "minus", "plusminus"])),
        activations=draw(st.sampled_from(["normal", "normal", "extreme", "integer"])),
        layout=draw(st.sampled_from(["contiguous", "transposed", "strided", "3d"])),
        bias=draw(st.booleans()),
        seed=draw(st.integers(0, 2 ** 31 - 1)),
    )


def build(case: dict, device: str = "cpu"):
    """Checkpoint tensors, the native weight, x, bias and the fp64 reference output."""
    spec, m, n, k = case["spec"], case["m"], case["n"], case["k"]
    gen = torch.Generator().manual_seed(case["seed"])
    legal = {v: [c for c, cv in enumerate(spec.code_map) if cv == v] for v in (-1, 0, 1)}
    allowed = {"random": [c for c, v in enumerate(spec.code_map) if v is not None],
               "zero": legal[0], "plus": legal[1], "minus": legal[-1],
               "plusminus": legal[1] + legal[-1]}[case["weights"]]
    choice = torch.tensor(allowed)[torch.randint(len(allowed), (n, k), generator=gen)]
    packed = pack_codes(choice, spec)
    sshape = spec.scale_shape(n, k)
    mag = torch.exp(torch.empty(sshape, dtype=torch.float64).uniform_(math.log(0.05), math.log(4.0), generator=gen))
    sign = torch.where(torch.rand(sshape, generator=gen) < 0.2, -1.0, 1.0)
    scale = (mag * sign).to(case["scale_dtype"])
    w64 = decode(packed, scale, spec, n, k, dtype=torch.float64)

    dtype = case["dtype"]
    finfo = torch.finfo(dtype)
    wmax = max(float(w64.abs().max()), 1.0)
    if case["activations"] == "normal":
        x = torch.randn(m, k, generator=gen, dtype=torch.float64)
    elif case["activations"] == "integer":
        x = torch.randint(-8, 9, (m, k), generator=gen).to(torch.float64)
    else:
        # Magnitudes from the smallest normal up to where K * |x| * |W| still fits the dtype 8 times over.
        big = finfo.max / (8.0 * max(k, 1) * wmax)
        lo, hi = math.log(finfo.tiny), math.log(big)
        x = torch.exp(torch.empty(m, k, dtype=torch.float64).uniform_(lo, hi, generator=gen))
        x = x * torch.where(torch.rand(m, k, generator=gen) < 0.5, -1.0, 1.0)
    x = x.to(dtype)
    bias = (torch.randn(n, generator=gen, dtype=torch.float64) * 4).to(dtype) if case["bias"] else None

    native = repack(packed.to(device), scale.to(device), spec, n, k)
    return dict(packed=packed, scale=scale, native=native, x=x.to(device),
                bias=None if bias is None else bias.to(device), w64=w64, **expected(x, w64, spec, bias))


def expected(x: torch.Tensor, w64: torch.Tensor, spec: TernarySpec, bias: torch.Tensor | None) -> dict:
    """The fp64 reference of ``x @ W^T (+ bias)`` with the terms of the error bound (see the module doc)."""
    xd = x.double().cpu()
    slack = torch.zeros(xd.shape[0], w64.shape[0], dtype=torch.float64)
    if spec.activation_quant:
        sx = 127.0 / xd.abs().amax(dim=-1, keepdim=True).clamp(min=1e-5)
        v = xd * sx
        xq = v.round().clamp(-128, 127)
        ref = (xq @ w64.t()) / sx
        # Within fp32 rounding of a tie, fp32 arithmetic may round the other way: allow one step.
        ties = ((v.abs() - v.abs().floor()) - 0.5).abs() < 1e-4
        slack = (ties.double() @ w64.abs().t()) / sx
        magnitude = (xq.abs() @ w64.abs().t()) / sx
    else:
        ref = xd @ w64.t()
        magnitude = xd.abs() @ w64.abs().t()
    if bias is not None:
        ref = ref + bias.double().cpu()
        magnitude = magnitude + bias.double().cpu().abs()
    return dict(ref=ref, magnitude=magnitude, slack=slack)


def shaped(x: torch.Tensor, layout: str) -> torch.Tensor:
    """The same values as a 2-D (M, K) x with the given memory layout."""
    m, k = x.shape
    if layout == "transposed":
        return x.t().contiguous().t()  # stride (1, M)
    if layout == "strided":
        wide = torch.full((m, 2 * k + 3), float("nan"), dtype=x.dtype, device=x.device)
        wide[:, 1:2 * k + 1:2] = x
        return wide[:, 1:2 * k + 1:2]  # stride (2K + 3, 2), garbage (NaN) in between
    return x


def check(out: torch.Tensor, built: dict, case: dict, what: str, weight_rounding: bool = False) -> None:
    """||out - ref|| within the bound, no NaN where ref is finite; messages name the worst element.

    ``weight_rounding``: the weight (scale folded in) was rounded to the output dtype first, and the
    GEMM library may reduce in it: one more unit roundoff per term on top of the accumulation.
    """
    ref, spec = built["ref"], case["spec"]
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)}, expected {tuple(ref.shape)}"
    assert out.dtype == case["dtype"], f"{what}: dtype {out.dtype}, expected {case['dtype']}"
    o = out.detach().cpu().double()
    bad = ~torch.isfinite(o)
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0])
        raise AssertionError(f"{what}: {int(bad.sum())} of {o.numel()} outputs are not finite (unwritten "
                             f"outputs stay NaN); first at {idx}: out={o[idx].item()!r}, ref={ref[idx].item()!r}; "
                             f"case {describe(case)}")
    k = case["k"]
    u_out = UNIT_ROUNDOFF[case["dtype"]]
    eps_acc = (k + 2) * 2.0 ** -24 + 2.0 ** -20  # fp32 accumulation over K, plus tf32x3 operand splits
    if weight_rounding:
        eps_acc += 2 * u_out
    err = o - ref
    bound = (1.01 * u_out * ref.norm() + eps_acc * built["magnitude"].norm() + built["slack"].norm()).item()
    err_norm = err.norm().item()
    if err_norm > bound or (bound == 0 and err_norm != 0):
        i = int(err.abs().argmax())
        idx = (i // ref.shape[1], i % ref.shape[1])
        rel = err_norm / ref.norm().item() if ref.norm().item() else float("inf")
        raise AssertionError(
            f"{what}: ||out-ref|| = {err_norm:.4g} > bound {bound:.4g} (||out-ref||/||ref|| = {rel:.3g}, "
            f"dtype {case['dtype']}); max |out-ref| = {err.abs().max().item():.4g} at {idx}: "
            f"out={o[idx].item()!r}, ref={ref[idx].item()!r}; case {describe(case)}")


def describe(case: dict) -> str:
    s = case["spec"]
    return (f"M={case['m']} N={case['n']} K={case['k']} {case['dtype']} x={case['activations']}/{case['layout']} "
            f"w={case['weights']} bias={case['bias']} seed={case['seed']} | pack_axis={s.pack_axis} "
            f"layout={s.pack_layout} bit_order={s.bit_order} code_map={list(s.code_map)} "
            f"scale={s.scale_granularity}/{s.group_size}/{s.scale_mode}/{case['scale_dtype']} "
            f"act={s.activation_quant}")


def run_kernel(kernel: str, x: torch.Tensor, native: NativeTernary, bias, poison: bool = True, **kw) -> torch.Tensor:
    """One launch of a kernel on a 2-D x, writing into a NaN-poisoned output where the kernel allows it."""
    m = x.shape[0]
    if kernel in ("triton_gemv", "triton_mm"):
        out = torch.full((m, native.n), float("nan"), dtype=x.dtype, device=x.device) if poison else None
        return ternary_triton.ternary_linear(x, native.qweight, native.scale, bias, native.k, native.group_size,
                                             native.act_quant, kernel[7:], out=out, **kw)
    tiles = native.with_tiles().tiles if kernel == "cuda_mma" else None
    with poisoned_empty():
        return ternary_ops.ternary_linear_op(x, native.qweight, native.scale, bias, native.k,
                                             native.group_size, native.act_quant, kernel, tiles, **kw)


class poisoned_empty:
    """torch.empty fills floats with NaN inside (deterministic mode's fill_uninitialized_memory)."""

    def __enter__(self):
        self.prev = (torch.are_deterministic_algorithms_enabled(),
                     torch.is_deterministic_algorithms_warn_only_enabled(),
                     torch.utils.deterministic.fill_uninitialized_memory)
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = True

    def __exit__(self, *exc):
        torch.use_deterministic_algorithms(self.prev[0], warn_only=self.prev[1])
        torch.utils.deterministic.fill_uninitialized_memory = self.prev[2]


def eligible(kernel: str, case: dict) -> bool:
    """Whether a kernel takes this case (the others are chosen for it by choose.ternary_kernel)."""
    half = case["dtype"] in (torch.float16, torch.bfloat16)
    spec = case["spec"]
    if kernel == "cuda_mma":
        group = spec.group_size if spec.scale_granularity == "group" and spec.group_size < case["k"] else 0
        return choose.ternary_mma_eligible(case["dtype"], group)
    if kernel == "cuda_dequant":
        return half and spec.activation_quant is None
    return True


def run_case(case: dict, kernel: str, device: str) -> None:
    built = build(case, device)
    if kernel == "cuda_mma":
        built["native"] = built["native"].with_tiles()
    x = built["x"]
    what = f"{kernel} on {device}"
    if case["layout"] == "3d":
        # (B, T, K) with a transposed middle, through the public entry point.
        m, k = case["m"], case["k"]
        b, t = (m // 2, 2) if m % 2 == 0 else (m, 1)
        wide = torch.full((b, t, k + 5), float("nan"), dtype=x.dtype, device=x.device)
        wide[..., :k] = x.reshape(b, t, k)
        x3 = wide[..., :k]  # (B, T, K), row stride K + 5, NaN in the gaps
        backend = {"torch": "torch", "triton_gemv": "triton", "triton_mm": "triton"}.get(kernel, "cuda")
        with poisoned_empty():
            out = ternary_ops.ternary_linear(x3, built["native"], built["bias"], backend=backend)
        assert out.shape == (b, t, case["n"]), f"{what}: 3-D output shape {tuple(out.shape)}"
        out = out.reshape(m, case["n"])
    else:
        out = run_kernel(kernel, shaped(x, case["layout"]), built["native"], built["bias"])
    check(out, built, case, what, weight_rounding=kernel == "cuda_dequant" or out_of_dequant(case))


def out_of_dequant(case: dict) -> bool:
    """The public entry point (3-D cases) may itself pick the dense-weight kernel."""
    return (case["layout"] == "3d" and case["m"] >= choose.DEQUANT_MIN_M and CUDA
            and eligible("cuda_dequant", case))


HYP = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                 HealthCheck.filter_too_much])

# --------------------------------------------------------------------------------------------
# repack: every variant decodes to the reference weight


@settings(max_examples=200, **HYP)
@given(cases(max_m=1, max_n=40, max_k=300))
def test_repack_decodes_like_reference(case):
    built = build(case)
    w = native_weight(built["native"], torch.float64)
    ref = built["w64"]
    # Multiply: exact. Divide: x * fp32(1/s) is within fp32 rounding of x / s.
    tol = 0.0 if case["spec"].scale_mode == "multiply" else 2.0 ** -23
    err = (w - ref).abs()
    worst = int(err.argmax()) if err.numel() else 0
    idx = (worst // max(ref.shape[1], 1), worst % max(ref.shape[1], 1))
    assert bool((err <= tol * ref.abs()).all()), (
        f"native weight differs from vllm_parity.reference.formats.ternary.decode: max |diff| {err.max().item():.3g} at {idx}: "
        f"native={w[idx].item()!r}, reference={ref[idx].item()!r}; case {describe(case)}")


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_repack_presets_roundtrip(name):
    spec = PRESETS[name]
    n, k = 8, 32
    values = torch.tensor([-1, 0, 1])[torch.randint(3, (n, k), generator=torch.Generator().manual_seed(1))]
    from vllm_parity.reference.formats.ternary import pack_values

    packed = pack_values(values, spec)
    scale = torch.rand(spec.scale_shape(n, k), generator=torch.Generator().manual_seed(2)) + 0.5
    native = repack(packed, scale, spec, n, k)
    assert native.act_quant == (spec.activation_quant is not None), f"{name}: act_quant flag lost"
    from vllm_parity.serving.ternary_repack import unpack_native

    got = unpack_native(native.qweight, k)
    assert torch.equal(got, unpack_values(packed, spec)), f"{name}: native values differ from the reference"


@pytest.mark.parametrize("pack_axis", ["input", "output"])
def test_repack_rejects_illegal_codes(pack_axis):
    spec = TernarySpec(pack_axis=pack_axis, code_map=(0, None, 1, -1))
    n, k = 8, 16
    packed = pack_codes(torch.zeros(n, k, dtype=torch.uint8), spec)
    packed[1, 2] = 0b01_00_00_00  # code 1 (null) in one field
    scale = torch.ones(spec.scale_shape(n, k))
    with pytest.raises(DecodeError) as ours:
        repack(packed, scale, spec, n, k)
    with pytest.raises(DecodeError) as theirs:
        unpack_values(packed, spec)
    assert str(ours.value) == str(theirs.value), "repack must reject illegal codes as the reference does"
    assert "(1, 2)" in str(ours.value), f"message should name the packed index: {ours.value}"


def test_repack_rejects_bad_inputs():
    spec = PRESETS["seed-article"]
    packed = torch.zeros(4, 4, dtype=torch.uint8)
    with pytest.raises(FormatError, match="packed shape"):
        repack(packed, torch.ones(4), spec, 4, 20)
    with pytest.raises(FormatError, match="uint8"):
        repack(packed.to(torch.int16), torch.ones(4), spec, 4, 16)
    with pytest.raises(FormatError, match="scale: shape"):
        repack(packed, torch.ones(5), spec, 4, 16)
    with pytest.raises(DecodeError, match="NaN or Inf"):
        repack(packed, torch.tensor([1.0, float("inf"), 1.0, 1.0]), spec, 4, 16)
    divide = TernarySpec(scale_mode="divide")
    with pytest.raises(DecodeError, match="zeros"):
        repack(packed, torch.tensor([1.0, 0.0, 1.0, 1.0]), divide, 4, 16)


# --------------------------------------------------------------------------------------------
# kernels on the CPU: the torch op and Triton through the interpreter


@settings(max_examples=100, **HYP)
@given(cases(max_m=24, max_n=48, max_k=300))
def test_torch_op_matches_reference(case):
    run_case(case, "torch", "cpu")


@pytest.mark.skipif(CUDA, reason="GPU runs the Triton kernels in test_gpu_kernels_match_reference")
@settings(max_examples=40, **HYP)
@given(cases(max_m=3, max_n=40, max_k=160))
def test_triton_gemv_interpreted_matches_reference(case):
    run_case(case, "triton_gemv", "cpu")


@pytest.mark.skipif(CUDA, reason="GPU runs the Triton kernels in test_gpu_kernels_match_reference")
@settings(max_examples=60, **HYP)
@given(cases(max_m=40, max_n=48, max_k=160))
def test_triton_mm_interpreted_matches_reference(case):
    run_case(case, "triton_mm", "cpu")


@pytest.mark.skipif(CUDA, reason="GPU runs split-K in test_gpu_split_k_and_graphs")
@pytest.mark.parametrize("split", [2, 3])
def test_triton_mm_split_k_interpreted(split):
    case = dict(spec=PRESETS["seed-article"], m=5, n=20, k=200, dtype=torch.float32, scale_dtype=torch.float16,
                weights="random", activations="normal", layout="contiguous", bias=True, seed=split)
    built = build(case)
    for _ in range(2):  # the second call finds the arrival counters reset
        out = run_kernel("triton_mm", built["x"], built["native"], built["bias"], config={"SPLIT_K": split})
        check(out, built, case, f"triton_mm split_k={split}")


@pytest.mark.parametrize("kernel", ["torch"] + ([] if CUDA else ["triton_gemv", "triton_mm"]))
def test_opcheck(kernel):
    case = dict(spec=PRESETS["hf-bitnet"], m=3, n=8, k=32, dtype=torch.float32, scale_dtype=torch.bfloat16,
                weights="random", activations="normal", layout="contiguous", bias=True, seed=7)
    nat = build(case)["native"]
    x = torch.randn(3, 32)
    torch.library.opcheck(torch.ops.vllm_parity.ternary_linear.default,
                          (x, nat.qweight, nat.scale, torch.randn(8), nat.k, nat.group_size, nat.act_quant, kernel))


def test_public_entry_point_backends(monkeypatch):
    case = dict(spec=PRESETS["seed-article"], m=2, n=12, k=32, dtype=torch.float32, scale_dtype=torch.float32,
                weights="random", activations="normal", layout="contiguous", bias=False, seed=3)
    built = build(case)
    monkeypatch.setenv("PARITY_KERNEL_BACKEND", "cuda")
    with pytest.raises(ValueError, match="'cuda' needs CUDA tensors"):
        ternary_ops.ternary_linear(built["x"], built["native"])
    with pytest.raises(ValueError, match="'auto' needs CUDA tensors"):
        ternary_ops.ternary_linear(built["x"], built["native"], backend="auto")
    monkeypatch.setenv("PARITY_KERNEL_BACKEND", "bogus")
    with pytest.raises(ValueError, match="unknown ternary backend 'bogus'"):
        ternary_ops.ternary_linear(built["x"], built["native"])
    monkeypatch.delenv("PARITY_KERNEL_BACKEND")  # the backend decisions themselves: tests/test_choose.py
    with pytest.raises(ValueError, match="expects 32"):
        ternary_ops.ternary_linear(torch.zeros(2, 31), built["native"])
    out = ternary_ops.ternary_linear(built["x"].reshape(2, 1, 32), built["native"])
    assert out.shape == (2, 1, 12), f"leading dims not kept: {tuple(out.shape)}"
    check(out.reshape(2, 12), built, case, "public entry point, default backend")


def test_cuda_module_imports_without_compiling():
    assert ternary_cuda.extension.module is None, "importing vllm_parity.serving.ternary_cuda must not build the extension"
    if not CUDA:
        assert not ternary_cuda.available()
        with pytest.raises(RuntimeError, match="CUDA GPU"):
            ternary_cuda.extension()


def test_mma_arguments_are_checked_in_python():
    """Every precondition of the tensor-core kernel fails as a Python error naming the argument, before the
    extension is called (on CPU tensors too: the device is checked last)."""
    n, k = 40, 256
    tiles = torch.zeros(tiles_shape(n, k), dtype=torch.int32)
    scale = torch.ones(n, 1)
    x = torch.zeros(2, k, dtype=torch.float16)
    with pytest.raises(ValueError, match="one CUDA device, got cpu"):
        ternary_cuda.linear_mma(x, tiles, scale, None, n, k, 0, False)
    with pytest.raises(TypeError, match="fp16 or bf16, got torch.float32"):
        ternary_cuda.linear_mma(x.float(), tiles, scale, None, n, k, 0, False)
    with pytest.raises(ValueError, match=r"x must be \(M, K=256\)"):
        ternary_cuda.linear_mma(x[:, :100], tiles, scale, None, n, k, 0, False)
    with pytest.raises(ValueError, match="tiles must be contiguous int32"):
        ternary_cuda.linear_mma(x, tiles[:1], scale, None, n, k, 0, False)
    with pytest.raises(ValueError, match="scale must be contiguous fp32"):
        ternary_cuda.linear_mma(x, tiles, scale.half(), None, n, k, 0, False)
    with pytest.raises(ValueError, match="group size 64 is not a multiple of 128"):
        ternary_cuda.linear_mma(x, tiles, scale, None, n, k, 64, False)
    qweight = torch.zeros(n, k // 16, dtype=torch.int32)
    with pytest.raises(ValueError, match="x, qweight and scale must be on one CUDA device, got cpu"):
        ternary_cuda.linear_mma(x, qweight, scale, None, n, k, 0, False, rows=True)
    with pytest.raises(ValueError, match=r"qweight must be contiguous int32 \(40, 16\)"):
        ternary_cuda.linear_mma(x, tiles, scale, None, n, k, 0, False, rows=True)
    # the GEMM on the tiles: the same checks, named for it
    with pytest.raises(ValueError, match="ternary gemm: x, tiles and scale must be on one CUDA device, got cpu"):
        ternary_cuda.linear_gemm(x, tiles, scale, None, n, k, 0, False)
    with pytest.raises(TypeError, match="ternary gemm: x must be fp16 or bf16, got torch.float32"):
        ternary_cuda.linear_gemm(x.float(), tiles, scale, None, n, k, 0, False)
    with pytest.raises(ValueError, match="ternary gemm: tiles must be contiguous int32"):
        ternary_cuda.linear_gemm(x, tiles[:1], scale, None, n, k, 0, False)
    with pytest.raises(ValueError, match="ternary gemm: group size 64 is not a multiple of 128"):
        ternary_cuda.linear_gemm(x, tiles, scale, None, n, k, 64, False)
    # the dense weight from the tiles: the tiles' and scale's checks, named for it
    with pytest.raises(ValueError, match="ternary dequant_tiles: tiles and scale must be on one CUDA device, got cpu"):
        ternary_cuda.dequant_tiles(tiles, scale, n, k, 0, torch.float16)
    with pytest.raises(ValueError, match=r"ternary dequant_tiles: tiles must be contiguous int32 \(3, 2, 32, 4\)"):
        ternary_cuda.dequant_tiles(tiles[:1], scale, n, k, 0, torch.float16)
    with pytest.raises(ValueError, match="ternary dequant_tiles: scale must be contiguous fp32"):
        ternary_cuda.dequant_tiles(tiles, scale[:1], n, k, 0, torch.float16)
    with pytest.raises(ValueError, match="ternary dequant_tiles: scale has 3 groups, group size 64, K=256"):
        ternary_cuda.dequant_tiles(tiles, torch.ones(n, 3), n, k, 64, torch.float16)
    with pytest.raises(TypeError, match="ternary dequant_tiles: dtype must be fp16, bf16 or fp32, got torch.int8"):
        ternary_cuda.dequant_tiles(tiles, scale, n, k, 0, torch.int8)


@settings(max_examples=300, deadline=None)
@given(m=st.integers(1, 8192), n=st.integers(1, 65536), k=st.integers(1, 65536), group=st.sampled_from([0, 128, 256]),
       sms=st.sampled_from([78, 114, 132]))
def test_gemm_config_is_a_compiled_instance(m, n, k, group, sms):
    """Every default launch of the GEMM is one of its compiled instances (group scales: their own; the
    warp-specialized kernel's from GEMM_WS_MIN_M tokens without them), K split into a power of two up to 8 ways,
    8 chunks a split at least where split."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ternary_cuda, "_num_sms", lambda: sms)
        cfg = ternary_cuda.gemm_config(m, n, k, group)
    instances = (ternary_cuda.GEMM_WS_INSTANCES if cfg["ws"] else ternary_cuda.GEMM_GROUP_INSTANCES if group else
                 ternary_cuda.GEMM_INSTANCES)
    assert (cfg["bn"], cfg["wg"], cfg["stages"]) in instances, cfg
    assert cfg["ws"] == (not group and m >= ternary_cuda.GEMM_WS_MIN_M), cfg
    assert cfg["split"] in (1, 2, 4, 8), cfg
    assert cfg["split"] == 1 or -(-k // 128) // cfg["split"] >= 8, cfg


def test_gemm_ws_block_tokens_take_the_fewer_waves(monkeypatch):
    """Above 128 tokens the ws kernel takes blocks of 128 or 256 tokens, whichever takes fewer waves of blocks x
    tokens / split with a 128-token block's token counted 1.25 times (H100 sweep, benchmarks/NOTES.md: 4096 x 14336
    at 384 tokens 104.3 against 120.6 us, at 512 129.1 against 141.3; 4096 x 12288 at 512 107.0 against 126.8)."""
    monkeypatch.setattr(ternary_cuda, "_num_sms", lambda: 132)
    bn = {m: ternary_cuda.gemm_config(m, 14336, 4096)["bn"] for m in (128, 129, 256, 300, 384, 385, 512, 640, 1000)}
    assert bn == {128: 128, 129: 256, 256: 256, 300: 128, 384: 128, 385: 256, 512: 256, 640: 256, 1000: 256}, bn
    assert ternary_cuda.gemm_config(384, 14336, 4096)["stages"] == 3
    assert ternary_cuda.gemm_config(512, 12288, 4096)["bn"] == 128, "192 blocks of 256 are 2 waves, 384 of 128 are 3"
    assert ternary_cuda.gemm_config(384, 4096, 14336) == dict(bn=256, wg=2, stages=4, split=2, ws=True), \
        "a split grid of 256 tokens is one wave"
    assert ternary_cuda.gemm_config(300, 14336, 4096, 128)["bn"] == 128, "group scales: the register-A kernel's"


def _host_rule(tmp_path, program: str, source: str, start: str, end: str):
    """``program`` (a main reading cases from stdin) around the launch rule of ``csrc/<source>`` from the line
    ``start`` to ``end``, built on the host with g++; the returned function answers every case, one line of
    integers each, with the SM count ``sms``."""
    src = (Path(ternary_cuda.__file__).with_name("csrc") / source).read_text()
    (tmp_path / "rule.cpp").write_text(program % src[src.index(start):src.index(end)])
    subprocess.run(["g++", "-std=c++17", "-o", str(tmp_path / "rule"), str(tmp_path / "rule.cpp")], check=True)

    def answer(cases, sms: int) -> list[list[int]]:
        out = subprocess.run([str(tmp_path / "rule")], input="\n".join(" ".join(map(str, c)) for c in cases),
                             capture_output=True, text=True, check=True, env={"SMS": str(sms)}).stdout.split("\n")
        assert len(out) == len(cases) + 1 and out[-1] == "", f"the host build answered {len(out) - 1} of {len(cases)}"
        return [list(map(int, line.split())) for line in out[:-1]]

    return answer


_GEMM_RULE_HOST = r"""
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <utility>
#include <vector>
constexpr int TILE_K = 128;
namespace parity { struct Info { int64_t sms; }; inline Info device_info(int) { return {atoll(getenv("SMS"))}; } }
namespace c10 { namespace cuda { inline int current_device() { return 0; } } }
%s
int main() {
  int64_t m, n, k, g;
  while (scanf("%%ld %%ld %%ld %%ld", &m, &n, &k, &g) == 4) {
    const auto c = gemm_auto_config(m, n, k, g);
    printf("%%ld %%ld %%ld %%ld %%ld\n", c[0], c[1], c[2], c[3], c[4]);
  }
}
"""


def _bench(name: str):
    """A script of benchmarks/ as a module."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_revision_build_compiles_out_only_the_op_registrations(monkeypatch):
    """benchmarks/ternary_group_ab.py builds an earlier ternary.cu beside the installed extension: both
    TORCH_LIBRARY blocks (whose op names the extension holds) go, whole; every other line stays."""
    monkeypatch.setitem(sys.modules, "kernels", _bench("kernels"))  # the script's `kernels`: benchmarks/kernels.py
    module = _bench("ternary_group_ab")
    src = (Path(ternary_cuda.__file__).with_name("csrc") / "ternary.cu").read_text()
    out = module.without_op_registrations(src)
    blocks = out.split("#if 0\n")[1:]
    assert len(blocks) == 2, "both TORCH_LIBRARY blocks, once each"
    assert [b[:b.index("#endif\n")].split("(")[0] for b in blocks] == ["TORCH_LIBRARY", "TORCH_LIBRARY_IMPL"]
    assert all(b[:b.index("#endif\n")].rstrip().endswith("}") for b in blocks), "each block ends at its brace"
    src_lines, out_lines = src.splitlines(), out.splitlines()
    changes = [(tag, src_lines[i1:i2], out_lines[j1:j2]) for tag, i1, i2, j1, j2 in
               difflib.SequenceMatcher(a=src_lines, b=out_lines, autojunk=False).get_opcodes() if tag != "equal"]
    assert changes == [("insert", [], ["#if 0"]), ("insert", [], ["#endif"])] * 2, \
        "only the two blocks' guards added, nothing removed"
    assert "PYBIND11_MODULE" in out.split("#endif\n")[-1], "the pybind functions stay compiled"


def test_parts_variants_take_out_exactly_their_part(monkeypatch):
    """benchmarks/ternary_mma_parts.py times ternary.cu with the decode and/or the MMA taken out or replaced: each
    edit must find its one line in the source as it is now (else the script would time the kernel unchanged), and a
    variant differs from the source only there and in the compiled-out op registrations."""
    monkeypatch.setitem(sys.modules, "kernels", _bench("kernels"))
    monkeypatch.setitem(sys.modules, "ternary_group_ab", _bench("ternary_group_ab"))
    parts = _bench("ternary_mma_parts")
    src = (Path(ternary_cuda.__file__).with_name("csrc") / "ternary.cu").read_text()
    plain = parts.without_op_registrations(src)
    for name, edits in parts.VARIANTS.items():
        out = parts.variant_source(src, edits)
        assert out != plain, name
        for old, new in edits:
            assert old not in out and out.count(new) == 1, (name, old)
            out = out.replace(new, old)
        assert out == plain, f"{name} changes more than its part"
    with pytest.raises(SystemExit, match="expected one"):
        parts.variant_source(src.replace(parts.MMA, ""), parts.VARIANTS["no_mma"])


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to build the C++ rule on the host")
def test_gemm_cpp_rule_is_python_rule_on_the_host(tmp_path, monkeypatch):
    """The C++ op's launch rule (``gemm_auto_config``, compiled on the host with the SM count stubbed) equals
    ``gemm_config`` on a grid of shapes, so that CI checks it where no GPU runs the op."""
    answer = _host_rule(tmp_path, _GEMM_RULE_HOST, "ternary_gemm.cu", "constexpr int64_t WS_MIN_M",
                        "// x (..., K) through the GEMM")
    cases = list(itertools.product((1, 33, 64, 65, 128, 129, 200, 256, 300, 384, 385, 512, 640, 896, 1023, 4000),
                                   (64, 4096, 11008, 12288, 14336, 22016), (256, 4096, 11008, 14336), (0, 128)))
    for sms in (78, 132):
        out = answer(cases, sms)
        monkeypatch.setattr(ternary_cuda, "_num_sms", lambda: sms)
        for (m, n, k, g), (bn, wg, stages, split, ws) in zip(cases, out):
            assert ternary_cuda.gemm_config(m, n, k, g) == dict(bn=bn, wg=wg, stages=stages, split=split,
                                                                  ws=bool(ws)), (sms, m, n, k, g)


_MMA_RULE_HOST = r"""
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
constexpr int TILE_N = 16, TILE_K = 128;
namespace parity {
struct DeviceInfo { int sms = 0, major = 0, minor = 0; };
inline DeviceInfo device_info(int) { DeviceInfo d; d.sms = atoi(getenv("SMS")); d.major = 9; return d; }
}
%s
int main() {
  long m, n, k, g, rows;
  while (scanf("%%ld %%ld %%ld %%ld %%ld", &m, &n, &k, &g, &rows) == 5) {
    const MmaCfg c = mma_auto_config(m, n, k, g, 0, rows != 0);
    printf("%%d %%d %%d %%d %%d\n", c.tn, c.mb, c.warps, c.loads, (int)c.pdl);
  }
}
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to build the C++ rule on the host")
def test_mma_cpp_rule_is_python_rule_on_the_host(tmp_path, monkeypatch):
    """The C++ op's launch rule of the tensor-core kernel (``mma_auto_config``, compiled on the host with the SM
    count stubbed, compute capability 9) equals ``mma_config`` + ``_fit_instance`` with and without group scales,
    on both layouts, so that CI checks what only a GPU test did."""
    answer = _host_rule(tmp_path, _MMA_RULE_HOST, "ternary.cu", "struct MmaCfg {",
                        "std::vector<int64_t> mma_auto_config_py")
    cases = list(itertools.product((1, 3, 4, 5, 8, 9, 12, 16, 17, 40, 64, 200), (77, 200, 2048, 4096, 14336),
                                   (256, 1000, 4096, 14336), (0, 128, 256), (0, 1)))
    monkeypatch.delenv(ternary_cuda.ENV_PDL, raising=False)
    monkeypatch.setattr(ternary_cuda, "_pdl_supported", lambda: True)
    for sms in (78, 132):
        out = answer(cases, sms)
        monkeypatch.setattr(ternary_cuda, "_num_sms", lambda: sms)
        for (m, n, k, g, rows), (tn, mb, warps, loads, pdl) in zip(cases, out):
            want = ternary_cuda._fit_instance(ternary_cuda.mma_config(m, n, k, bool(rows), g), g)
            assert want == dict(tn=tn, mb=mb, warps=warps, loads=loads, pdl=bool(pdl)), (sms, m, n, k, g, rows)


def test_mma_dependent_launch_follows_the_device_and_the_environment(monkeypatch):
    monkeypatch.setattr(ternary_cuda, "_num_sms", lambda: 132)
    monkeypatch.setattr(ternary_cuda, "_pdl_supported", lambda: True)
    assert ternary_cuda.mma_config(1, 4096, 4096)["pdl"] is True
    monkeypatch.setenv(ternary_cuda.ENV_PDL, "0")
    assert ternary_cuda.mma_config(1, 4096, 4096)["pdl"] is False
    monkeypatch.delenv(ternary_cuda.ENV_PDL)
    monkeypatch.setattr(ternary_cuda, "_pdl_supported", lambda: False)
    assert ternary_cuda.mma_config(1, 4096, 4096)["pdl"] is False, "no PDL before compute capability 9"
    cfg = ternary_cuda._fit_instance(dict(tn=1, mb=1, warps=4, loads=4, pdl=True), 0)
    assert cfg["pdl"] is False, "an explicit request cannot turn it on where the device lacks it"


@pytest.mark.parametrize("m, k, n, want", [
    (1, 4096, 14336, (4, 16, 4)), (8, 4096, 14336, (4, 16, 4)),
    (1, 14336, 4096, (1, 16, 4)), (4, 14336, 4096, (1, 16, 4)), (8, 14336, 4096, (2, 16, 8)),
    (8, 11008, 4096, (2, 16, 8)), (1, 5632, 2048, (1, 16, 8)), (8, 5632, 2048, (1, 16, 8)),
    (1, 2048, 5632, (2, 16, 4)), (8, 2048, 5632, (2, 16, 4)),
])
def test_mma_config_small_m_follows_the_h200_sweep(monkeypatch, m, k, n, want):
    """(row tiles, warps, loads) up to 8 tokens: the sweep's best, or within 5 % of it, at each measured
    shape (benchmarks/results/kernels_h200.json)."""
    monkeypatch.setattr(ternary_cuda, "_num_sms", lambda: 132)
    cfg = ternary_cuda.mma_config(m, n, k)
    assert (cfg["tn"], cfg["warps"], cfg["loads"]) == want and cfg["mb"] == 1, cfg


@pytest.mark.parametrize("m, k, n, want", [
    (9, 4096, 4096, (2, 16)), (16, 4096, 14336, (4, 8)), (16, 4096, 12288, (4, 8)),
    (16, 14336, 4096, (2, 16)), (16, 11008, 4096, (2, 16)), (16, 4096, 22016, (4, 8)),
    (9, 2048, 2048, (1, 16)), (9, 2048, 5632, (2, 8)), (9, 5632, 2048, (1, 16)), (9, 1024, 2048, (1, 8)),
])
def test_mma_config_at_9_to_16_tokens_follows_the_sweeps(monkeypatch, m, k, n, want):
    """(row tiles, warps) at 9-16 tokens, seed layout: 16 warps a block where the blocks make one wave, else 8, and
    no more warps than 128-input chunks; at each measured shape the best of 4 / 8 / 16 warps at the rule's tiles
    (benchmarks/results/ternary_mma_split_sweep_h200.json without a split, ternary_mma_sweep_m9_16_h100.json)."""
    monkeypatch.setattr(ternary_cuda, "_num_sms", lambda: 132)
    cfg = ternary_cuda._fit_instance(ternary_cuda.mma_config(m, n, k), 0)
    assert (cfg["tn"], cfg["warps"]) == want and cfg["mb"] == 2, cfg


@pytest.mark.parametrize("m, k, n, want", [
    (12, 4096, 4096, (4, 16, 8)), (14, 4096, 4096, (4, 16, 8)), (16, 4096, 4096, (4, 16, 8)),
    (12, 5632, 2048, (2, 16, 8)), (16, 5632, 2048, (2, 16, 8)), (12, 2048, 2048, (2, 16, 8)),
    (16, 2048, 2048, (2, 16, 8)), (12, 2048, 5632, (4, 16, 4)), (16, 2048, 5632, (4, 16, 4)),
])
def test_mma_config_at_12_to_16_tokens_on_small_weights_takes_a_fragment_a_block(monkeypatch, m, k, n, want):
    """(row tiles, warps, loads) at 12-16 tokens where K <= 6144 and the blocks of one token fragment make at most
    1.5 waves: one fragment a block, two blocks along M, the sweeps' best or within 2 % of it (H200 at 12 / 14 / 16
    tokens, benchmarks/results/ternary_mma_sweep_m12_16_before_h200.json: 1.01-1.22x the two-fragment launch;
    H100 at 16, ternary_mma_sweep_m9_16_h100.json). At 9 tokens, on larger weights, with group scales or on the
    row layout, two fragments a block."""
    monkeypatch.setattr(ternary_cuda, "_num_sms", lambda: 132)
    cfg = ternary_cuda._fit_instance(ternary_cuda.mma_config(m, n, k), 0)
    assert (cfg["tn"], cfg["mb"], cfg["warps"], cfg["loads"]) == (want[0], 1, *want[1:]), cfg
    for other in (ternary_cuda.mma_config(9, n, k), ternary_cuda.mma_config(m, n, k, group_size=128),
                  ternary_cuda.mma_config(m, n, k, rows=True), ternary_cuda.mma_config(m, 14336, k),
                  ternary_cuda.mma_config(m, n, 11008)):
        assert other["mb"] == 2, other


@pytest.mark.parametrize("m, k, n, group_size, want", [
    (1, 4096, 14336, 128, (4, 8)), (8, 4096, 14336, 128, (4, 8)), (1, 4096, 14336, 0, (4, 16)),
    (1, 14336, 4096, 128, (1, 16)), (8, 14336, 4096, 128, (2, 16)), (16, 4096, 14336, 128, (2, 8)),
])
def test_mma_config_with_group_scales_fits_two_blocks_an_sm(monkeypatch, m, k, n, group_size, want):
    """(row tiles, warps) with group scales: at 4 tiles and one token fragment the kernel takes 80 registers (84-100
    with the scales loaded beside the weights), so 8 warps a block, which let two blocks share a multiprocessor (H100,
    benchmarks/results/ternary_group_variants_h100.json: 4096 x 14336 at M = 1 in 10.5 us against 12.5 with 16
    warps)."""
    monkeypatch.setattr(ternary_cuda, "_num_sms", lambda: 132)
    cfg = ternary_cuda._fit_instance(ternary_cuda.mma_config(m, n, k, group_size=group_size), group_size)
    assert (cfg["tn"], cfg["warps"]) == want, cfg


@pytest.mark.parametrize("m, k, n, want", [(1, 4096, 14336, (4, 1, 8, 4)), (4, 4096, 14336, (4, 1, 8, 4)),
                                           (1, 14336, 4096, (2, 1, 16, 4)), (4, 14336, 4096, (2, 1, 16, 4)),
                                           (16, 4096, 14336, (4, 2, 8, 4)), (16, 14336, 4096, (4, 2, 16, 4))])
def test_mma_config_on_the_row_layout_follows_the_h200_sweep(monkeypatch, m, k, n, want):
    """(row tiles, token fragments, warps, loads) on the row layout: the sweep's best at the target shapes up to 4
    tokens, and at 16 tokens its best with two fragments (benchmarks/results/ternary_rows_sweep_h200.json)."""
    monkeypatch.setattr(ternary_cuda, "_num_sms", lambda: 132)
    cfg = ternary_cuda._fit_instance(ternary_cuda.mma_config(m, n, k, rows=True), 0)
    assert (cfg["tn"], cfg["mb"], cfg["warps"], cfg["loads"]) == want, cfg


@settings(max_examples=100, **HYP)
@given(tn=st.sampled_from([1, 2, 4]), mb=st.sampled_from([1, 2]), warps=st.integers(-3, 40),
       loads=st.sampled_from([4, 8]), group_size=st.sampled_from([0, 128, 256]))
def test_mma_config_fits_a_compiled_instance(tn, mb, warps, loads, group_size):
    """Any requested configuration becomes one the extension has compiled."""
    cfg = ternary_cuda._fit_instance(dict(tn=tn, mb=mb, warps=warps, loads=loads, pdl=True), group_size)
    assert 1 <= cfg["warps"] <= 16
    assert cfg["loads"] in ((4, 8) if mb == 1 and not group_size else (4,)), cfg
    if group_size and mb == 2:
        assert cfg["tn"] <= 2, cfg


# --------------------------------------------------------------------------------------------
# tiled layout of the tensor-core kernel


@settings(max_examples=60, **HYP)
@given(n=st.integers(1, 70), k=st.integers(1, 300), seed=st.integers(0, 2 ** 31 - 1))
def test_tiles_roundtrip(n, k, seed):
    gen = torch.Generator().manual_seed(seed)
    values = torch.randint(-1, 2, (n, k), generator=gen)
    tiles = pack_tiles(values)
    assert tuple(tiles.shape) == tiles_shape(n, k) and tiles.dtype == torch.int32
    assert torch.equal(unpack_tiles(tiles, n, k), values.to(torch.int8)), "unpack_tiles(pack_tiles(v)) != v"
    assert torch.equal(tiles_from_native(pack_native(values), k, rows_per_step=32), tiles), \
        "tiles built from the row layout in slabs differ from tiles built from the values"


def _mma_emulated(nt: int, kc: int, x: torch.Tensor, word_pair, ck: int = 128) -> torch.Tensor:
    """x @ W^T computed the way the CUDA kernel does, from the PTX ISA's mma.m16n8k16 fragment layout;
    ``word_pair(tile, c, lane, step, reg)`` is the weight word and pair of fields the kernel decodes into A register
    ``reg`` of ``lane`` at ``step`` of chunk ``c`` (``ck`` inputs, lane t's run ck / 4 of them from ck / 4 t).

    Lane l = 4 g + t: A registers (row g | g+8, cols 2t.. | 2t+8..), B registers (rows 2t.. | 2t+8..,
    col g), each a pair of consecutive columns / rows, the lower half first.
    """
    m = x.shape[0]
    xp = torch.nn.functional.pad(x, (0, kc * ck - x.shape[1]))
    y = torch.zeros(m, nt * 16, dtype=torch.float64)
    for tile in range(nt):
        for c in range(kc):
            for step in range(ck // 16):
                a = _a_fragment(word_pair, tile, c, step)
                b = torch.zeros(16, 8, dtype=torch.float64)
                for lane in range(32):
                    g, t = divmod(lane, 4)
                    if g < m:
                        base = c * ck + ck // 4 * t + 4 * step
                        b[2 * t:2 * t + 2, g] = xp[g, base:base + 2]
                        b[2 * t + 8:2 * t + 10, g] = xp[g, base + 2:base + 4]
                y[:, tile * 16:tile * 16 + 16] += (a @ b)[:, :m].t()
    return y / 2.0


def _decoded(word: int, pair: int, half: int) -> float:
    """The kernel's decode of one field of a register: pair's field on bits 14..15 of the half, read as +-2.0 / 0."""
    f = (word >> (2 * pair + 16 * half)) & 3
    return 2.0 * (f & 1) * (1 - (f & 2))


def _a_fragment(word_pair, tile: int, c: int, step: int) -> torch.Tensor:
    """The 16 x 16 A operand of one k16 step as the lanes' registers hold it (PTX mma.m16n8k16, and each warp's
    share of wgmma m64nNk16): lane 4 g + t, register r at row g + 8 (r % 2), columns 2 t + 8 (r // 2), + 1."""
    a = torch.zeros(16, 16, dtype=torch.float64)
    for lane in range(32):
        g, t = divmod(lane, 4)
        for reg in range(4):
            word, pair = word_pair(tile, c, lane, step, reg)
            row, col = g + 8 * (reg % 2), 2 * t + 8 * (reg // 2)
            for half in range(2):
                a[row, col + half] = _decoded(word, pair, half)
    return a


def _tiles_word_pair(tiles: torch.Tensor):
    words = tiles.to(torch.int64) & 0xFFFFFFFF
    return lambda tile, c, lane, step, reg: (int(words[tile, c, lane, step // 2]), 4 * (step % 2) + reg)


def _rows_word_pair(qweight: torch.Tensor, words_a_lane: int):
    """The row layout as the kernel reads it: lane (g, t) takes ``words_a_lane`` words (2: ROWS8, 4: ROWS16) of
    rows 16 tile + g and + 8 from word (4 c + t) words_a_lane; step s word s / 4 of those, pairs 2 (s % 4) (a0, a1)
    and + 1 (a2, a3); zeros past the rows and words."""
    words = qweight.to(torch.int64) & 0xFFFFFFFF
    n, kw = words.shape

    def word_pair(tile, c, lane, step, reg):
        g, t = divmod(lane, 4)
        row, col = 16 * tile + g + 8 * (reg % 2), words_a_lane * (4 * c + t) + step // 4
        return (int(words[row, col]) if row < n and col < kw else 0), 2 * (step % 4) + reg // 2
    return word_pair


@pytest.mark.parametrize("n, k", [(16, 128), (33, 300), (5, 4)])
def test_tiles_feed_mma_fragments(n, k):
    """The tiled layout, read through the mma fragment layout as the CUDA kernel reads it, is x @ W^T; and so is
    the row layout, read as the kernel reads it without tiles (8 and 16 bytes a row and lane)."""
    gen = torch.Generator().manual_seed(n * 1000 + k)
    values = torch.randint(-1, 2, (n, k), generator=gen)
    x = torch.randn(3, k, generator=gen, dtype=torch.float64)
    ref = x @ values.to(torch.float64).t()
    tiles = pack_tiles(values)
    nt, kc = tiles.shape[:2]
    y = _mma_emulated(nt, kc, x, _tiles_word_pair(tiles))[:, :n]
    assert torch.allclose(y, ref, atol=1e-12), f"tiles: max |err| {(y - ref).abs().max().item()}"
    for words_a_lane, ck in ((2, 128), (4, 256)):
        y = _mma_emulated(nt, -(-k // ck), x, _rows_word_pair(pack_native(values), words_a_lane), ck)[:, :n]
        assert torch.allclose(y, ref, atol=1e-12), f"rows {ck}: max |err| {(y - ref).abs().max().item()}"


@pytest.mark.parametrize("n, k", [(16, 128), (70, 300), (5, 4)])
def test_tile_order_feeds_wgmma(n, k):
    """The GEMM's copy of x (input i at ternary_cuda.tile_order(K)[i], zeros elsewhere), read by wgmma in its
    natural k order as B, against the tiles decoded into the A fragments (each warp of a warpgroup the
    mma.m16n8k16 A fragment of its row tile): x @ W^T."""
    gen = torch.Generator().manual_seed(n * 1000 + k)
    values = torch.randint(-1, 2, (n, k), generator=gen)
    x = torch.randn(5, k, generator=gen, dtype=torch.float64)
    tiles = pack_tiles(values)
    nt, kc = tiles.shape[:2]
    order = ternary_cuda.tile_order(k)
    assert sorted(order.tolist()) == sorted(set(order.tolist())) and int(order.max()) < kc * 128
    xs = torch.zeros(5, kc * 128, dtype=torch.float64)
    xs[:, order] = x
    word_pair = _tiles_word_pair(tiles)
    y = torch.zeros(5, nt * 16, dtype=torch.float64)
    for tile in range(nt):
        for c in range(kc):
            for step in range(8):
                a = _a_fragment(word_pair, tile, c, step)
                base = c * 128 + 16 * step
                y[:, tile * 16:tile * 16 + 16] += (a @ xs[:, base:base + 16].t()).t()
    ref = x @ values.to(torch.float64).t()
    assert torch.allclose(y[:, :n] / 2.0, ref, atol=1e-12), f"max |err| {(y[:, :n] / 2.0 - ref).abs().max()}"


def _swizzled(rows: int) -> tuple[torch.Tensor, callable]:
    """A K-major 64-input half of rows x 128 bytes with the 128-byte swizzle, as fp16 slots: (row, input) sits at
    16-byte vector (input // 8) ^ (row % 8) of the row."""
    buf = torch.full((rows * 64,), float("nan"), dtype=torch.float64)
    return buf, lambda row, kk: row * 64 + (((kk // 8) ^ (row % 8)) * 8) + kk % 8


def _staged_x_blocked(x: torch.Tensor, kc: int, bn: int, ext_pos: list) -> torch.Tensor:
    """x as stage_x_kernel lays it out for the warp-specialized GEMM (BN > 0), by the kernel's own index: token
    blocks of bn, then chunks, then the chunk's two 64-input halves, each bn rows of 128 bytes, swizzled."""
    m, k = x.shape
    mb_count = -(-m // bn)
    xb = torch.zeros(mb_count * kc * 2 * bn * 64, dtype=torch.float64)
    for tok in range(m):
        mb, r = divmod(tok, bn)
        for kk in range(k):
            c, p = kk // 128, ext_pos[kk % 128]
            q = (p & 63) >> 3
            xb[((mb * kc + c) * 2 + (p >> 6)) * bn * 64 + r * 64 + ((q ^ (r & 7)) << 3) + (p & 7)] = x[tok, kk]
    return xb


@pytest.mark.parametrize("hps", [1, 2])
@pytest.mark.parametrize("n, k, m, bn", [(64, 256, 5, 64), (80, 300, 70, 64)])
def test_ws_shared_layouts_feed_wgmma(n, k, m, bn, hps):
    """The warp-specialized GEMM's shared memory, emulated: the producer's stmatrix of each lane's decoded tile
    registers (lanes 8 i .. 8 i + 7 address matrix i's rows, register i of lane 4 r + c / 2 is its element (r, c))
    into one 64-input half, and a stage's one bulk copy of hps halves of the blocked x (stage_x_kernel with BN > 0),
    half hh read at hh x the half's size, both read back through the swizzle as wgmma reads them, give x @ W^T."""
    gen = torch.Generator().manual_seed(n + k + m)
    values = torch.randint(-1, 2, (n, k), generator=gen)
    x = torch.randn(m, k, generator=gen, dtype=torch.float64)
    tiles = pack_tiles(values)
    nt, kc = tiles.shape[:2]
    word_pair = _tiles_word_pair(tiles)
    ext_pos = ternary_cuda.tile_order(128).tolist()  # input r of a chunk at ext_pos[r]
    xb = _staged_x_blocked(x, kc, bn, ext_pos)
    x1, x_at = bn * 64, _swizzled(bn)[1]  # one half of x in a stage, in elements; its swizzled index
    y = torch.zeros(m, nt * 16, dtype=torch.float64)
    for u in range(2 * kc // hps):
        for hh in range(hps):
            c, h = divmod(u * hps + hh, 2)
            # the producer: a 16-row A half per tile (rows of the block's A buffer; one tile here)
            a_half = torch.zeros(nt * 16, 64, dtype=torch.float64)
            for tile in range(nt):
                buf, at = _swizzled(16)
                for ks in range(4):
                    step = 4 * h + ks
                    for lane in range(32):  # the lane giving a row address: matrix i, row r
                        i, r = lane // 8, lane % 8
                        row = r + 8 * (i & 1)
                        addr = row * 64 + (((2 * ks + (lane >> 4)) ^ r) * 8)  # row_off + ((2 ks + hi) ^ r) << 4
                        for col in range(8):  # element (r, col) of matrix i: lane 4 r + col / 2, register i
                            word, pair = word_pair(tile, c, 4 * r + col // 2, step, i)
                            buf[addr + col] = _decoded(word, pair, col % 2)
                for row in range(16):
                    for kk in range(64):
                        a_half[16 * tile + row, kk] = buf[at(row, kk)]
            assert not a_half.isnan().any(), "stmatrix left A slots unwritten"
            # x: each token block's stage is one copy of hps halves from xsrc + u hps halves; half hh at hh x1
            xh = torch.zeros(m, 64, dtype=torch.float64)
            for mb in range(-(-m // bn)):
                stage = xb[(mb * kc * 2 + u * hps) * x1:][:hps * x1]
                half = stage[hh * x1:(hh + 1) * x1]
                for tok in range(min(bn, m - mb * bn)):
                    for kk in range(64):
                        xh[mb * bn + tok, kk] = half[x_at(tok, kk)]
            y += xh @ a_half.t()
    ref = x @ values.to(torch.float64).t()
    assert torch.allclose(y[:, :n] / 2.0, ref, atol=1e-10), f"max |err| {(y[:, :n] / 2.0 - ref).abs().max()}"


def test_native_rejects_bad_tiles():
    nat = repack(pack_codes(torch.zeros(8, 32, dtype=torch.int64), PRESETS["seed-article"]),
                 torch.ones(8), PRESETS["seed-article"], 8, 32)
    assert nat.with_tiles().tiles.shape == tiles_shape(8, 32)
    with pytest.raises(FormatError, match="tiles must be contiguous int32"):
        NativeTernary(qweight=nat.qweight, scale=nat.scale, n=8, k=32, group_size=0, act_quant=False,
                      tiles=torch.zeros(1, 1, 32, 3, dtype=torch.int32))


# --------------------------------------------------------------------------------------------
# GPU


GPU_KERNELS = ["triton_gemv", "triton_mm", "cuda_naive", "cuda_vec", "cuda_mma", "cuda_dequant"]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kernel", GPU_KERNELS)
@settings(max_examples=int(os.environ.get("PARITY_GPU_EXAMPLES", "60")), **HYP)
@given(case=cases(max_m=300, max_n=520, max_k=1100))
def test_gpu_kernels_match_reference(kernel, case):
    assume(eligible(kernel, case))
    if kernel == "cuda_mma":
        assume(case["m"] <= 40)
    if kernel == "cuda_naive":
        assume(case["m"] * case["n"] * case["k"] <= 20_000_000)
    run_case(case, kernel, "cuda")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kernel", GPU_KERNELS)
@pytest.mark.parametrize("m,n,k", [(1, 4096, 4096), (16, 2048, 5632), (300, 1000, 1000), (7, 5632, 2048)])
def test_gpu_kernels_model_shapes(kernel, m, n, k):
    for i, (spec, dtype) in enumerate([(PRESETS["seed-article"], torch.float16),
                                       (PRESETS["hf-bitnet"], torch.bfloat16),
                                       (TernarySpec(scale_granularity="group", group_size=8), torch.bfloat16),
                                       (TernarySpec(scale_granularity="group", group_size=256), torch.float16)]):
        case = dict(spec=spec, m=m, n=n, k=k, dtype=dtype, scale_dtype=torch.bfloat16, weights="random",
                    activations="normal", layout="contiguous", bias=i == 0, seed=11 + i)
        if not eligible(kernel, case) or spec.scale_granularity == "group" and k % spec.group_size:
            continue
        built = build(case, "cuda")
        check(run_kernel(kernel, built["x"], built["native"], built["bias"]), built, case, f"{kernel} {spec}",
              weight_rounding=kernel == "cuda_dequant")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("backend", ["triton", "cuda", "auto"])
def test_gpu_split_k_and_graphs(backend):
    """The public op inside a CUDA graph: replays give the reference every time (split-K counters reset)."""
    case = dict(spec=PRESETS["seed-article"], m=4, n=1024, k=4096, dtype=torch.float16, scale_dtype=torch.float16,
                weights="random", activations="normal", layout="contiguous", bias=True, seed=5)
    built = build(case, "cuda")
    built["native"] = built["native"].with_tiles()  # cuda and auto take the tensor-core kernel at M = 4
    x = built["x"].clone()
    static_out = ternary_ops.ternary_linear(x, built["native"], built["bias"], backend=backend)  # warm up / build
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = ternary_ops.ternary_linear(x, built["native"], built["bias"], backend=backend)
    for i in range(3):
        static_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(static_out, built, case, f"{backend} graph replay {i}")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kernel", ["triton_mm", "triton_gemv", "cuda_vec", "cuda_mma", "cuda_dequant"])
def test_gpu_opcheck(kernel):
    spec = PRESETS["seed-article"] if kernel == "cuda_dequant" else PRESETS["hf-bitnet"]
    case = dict(spec=spec, m=5, n=64, k=96, dtype=torch.bfloat16, scale_dtype=torch.bfloat16,
                weights="random", activations="normal", layout="contiguous", bias=True, seed=13)
    built = build(case, "cuda")
    nat = built["native"].with_tiles()
    torch.library.opcheck(torch.ops.vllm_parity.ternary_linear.default,
                          (built["x"], nat.qweight, nat.scale, built["bias"], nat.k, nat.group_size,
                           nat.act_quant, kernel, nat.tiles))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kernel", ["cuda_vec", "cuda_naive", "triton_gemv", "triton_mm", "cuda_dequant"])
def test_gpu_group_scales_never_read_past_the_row(kernel):
    """K = 4 pads to a 16-weight word: the padding's scale index must not run past the scale tensor,
    whose neighbour here is NaN (a zero weight times NaN is NaN)."""
    spec = TernarySpec(scale_granularity="group", group_size=1)
    case = dict(spec=spec, m=1, n=1, k=4, dtype=torch.bfloat16, scale_dtype=torch.float32, weights="random",
                activations="normal", layout="contiguous", bias=False, seed=0)
    built = build(case, "cuda")
    nat = built["native"]
    buf = torch.full((nat.scale.numel() + 64,), float("nan"), device="cuda")
    buf[:nat.scale.numel()] = nat.scale.reshape(-1)
    nat = NativeTernary(qweight=nat.qweight, scale=buf[:nat.scale.numel()].view(nat.scale.shape), n=nat.n,
                        k=nat.k, group_size=nat.group_size, act_quant=nat.act_quant)
    check(run_kernel(kernel, built["x"], nat, None), built, case, f"{kernel} K=4 group 1",
          weight_rounding=kernel == "cuda_dequant")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tn", [1, 2, 4])
@pytest.mark.parametrize("mb, loads", [(1, 4), (1, 8), (2, 4)])
@pytest.mark.parametrize("warps, pdl", [(1, False), (3, True), (16, True)])
@pytest.mark.parametrize("rows", [False, True])
def test_gpu_mma_every_instance(tn, mb, loads, warps, pdl, rows):
    """Every compiled instance, odd warp counts and both launch modes, on the tiles and on the row layout (words a
    row odd at K = 1000: 4-byte loads; even: 8-byte loads): ragged N, K, M, group scales."""
    for i, (m, n, k, spec) in enumerate([(1, 200, 1000, PRESETS["seed-article"]), (9, 44, 4096, PRESETS["hf-bitnet"]),
                                         (20, 130, 640, TernarySpec(scale_granularity="group", group_size=128)),
                                         (40, 77, 2304, TernarySpec(scale_granularity="group", group_size=256))]):
        case = dict(spec=spec, m=m, n=n, k=k, dtype=(torch.float16, torch.bfloat16)[i % 2],
                    scale_dtype=torch.float32, weights="random", activations="normal", layout="contiguous",
                    bias=i != 1, seed=100 + i)
        built = build(case, "cuda")
        nat = built["native"].with_tiles()
        out = ternary_cuda.linear_mma(built["x"], nat.qweight if rows else nat.tiles, nat.scale, built["bias"], n, k,
                                      nat.group_size, nat.act_quant,
                                      config=dict(tn=tn, mb=mb, loads=loads, warps=warps, pdl=pdl), rows=rows)
        check(out, built, case, f"cuda_mma tn={tn} mb={mb} loads={loads} warps={warps} pdl={pdl} rows={rows}")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tn, mb, warps", [(1, 1, 16), (4, 1, 8), (2, 2, 5)])
@pytest.mark.parametrize("rows", [False, True])
def test_gpu_mma_group_scales_past_shared_memory(tn, mb, warps, rows):
    """Group scales the kernel cannot stage in shared memory (over 64 KB at every launch: K = 140800 in groups of
    128 and 256) are loaded with each chunk's weights instead; ragged N and M."""
    for i, group in enumerate((128, 256)):
        case = dict(spec=TernarySpec(scale_granularity="group", group_size=group), m=3 + 6 * i, n=40, k=140800,
                    dtype=(torch.float16, torch.bfloat16)[i], scale_dtype=torch.float32, weights="random",
                    activations="normal", layout="contiguous", bias=i == 0, seed=300 + i)
        built = build(case, "cuda")
        nat = built["native"].with_tiles()
        out = ternary_cuda.linear_mma(built["x"], nat.qweight if rows else nat.tiles, nat.scale, built["bias"],
                                      nat.n, nat.k, nat.group_size, nat.act_quant,
                                      config=dict(tn=tn, mb=mb, loads=4, warps=warps, pdl=True), rows=rows)
        check(out, built, case, f"cuda_mma K=140800 group {group} tn={tn} mb={mb} warps={warps} rows={rows}")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tn, loads", [(1, 4), (2, 8)])
def test_gpu_mma_dependent_launch_waits_for_its_input(tn, loads):
    """Two layers chained in a CUDA graph, each launched as a programmatic dependent launch: the second
    reads the first's output only after it is written (the buffer holds NaN before every replay)."""
    case = dict(spec=PRESETS["seed-article"], m=3, n=2048, k=2048, dtype=torch.bfloat16, scale_dtype=torch.float32,
                weights="random", activations="normal", layout="contiguous", bias=False, seed=21)
    built = build(case, "cuda")
    nat = built["native"].with_tiles()
    cfg = dict(tn=tn, loads=loads, pdl=True, warps=8)

    def layer(x):
        return ternary_cuda.linear_mma(x, nat.tiles, nat.scale, None, nat.n, nat.k, nat.group_size, nat.act_quant,
                                       config=cfg)

    x = built["x"].clone()
    layer(layer(x))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y1 = layer(x)
        y2 = layer(y1)
    for i in range(3):
        y1.fill_(float("nan"))
        y2.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(y1, built, case, f"first layer, replay {i}")
        check(y2, dict(built, **expected(y1, built["w64"], case["spec"], None)), case, f"second layer, replay {i}")


# The C++ ops' own checks (which Python does not run first), each bad call in its own process so that one that ends
# its process instead of raising names itself and costs nothing else: the error, then a good call in the same process.
_OP_ERROR_PROBE = r"""
import sys

import torch

from vllm_parity.reference.formats.ternary import PRESETS, decode, pack_codes
from vllm_parity.serving import ternary_cuda
from vllm_parity.serving.ternary_repack import repack

spec, n, k = PRESETS["seed-article"], 300, 1000
gen = torch.Generator().manual_seed(52)
codes = torch.tensor([c for c, v in enumerate(spec.code_map) if v is not None])[torch.randint(3, (n, k), generator=gen)]
packed, scale = pack_codes(codes, spec), torch.rand(spec.scale_shape(n, k), generator=gen) + 0.5
nat = repack(packed.cuda(), scale.cuda(), spec, n, k).with_tiles()
tiles, s = nat.tiles, nat.scale
x = torch.randn(1, k, generator=gen).to(torch.float16)
shifted = torch.zeros(tiles.numel() + 1, dtype=torch.int32, device="cuda")[1:].view(tiles.shape)
ops, xc = ternary_cuda.ops(), x.cuda()
try:
    eval(sys.argv[1])
    print("no error")
except RuntimeError as e:
    print("raised:", str(e).splitlines()[0])
ref = x.double() @ decode(packed, scale, spec, n, k, dtype=torch.float64).t()
y = ops.mma(xc, tiles, s, None, n, k, 0, False).double().cpu()
print("after: relative error", float((y - ref).abs().max() / ref.abs().max()))
"""

_OP_ERRORS = {  # the call, the message it must raise
    "mma on tiles 4 bytes past 16": ("ops.mma(xc, shifted, s, None, n, k, 0, False)",
                                     "tiles must start 16-byte aligned .* 4 bytes past"),
    "dequant_tiles on tiles 4 bytes past 16": ("ops.dequant_tiles(shifted, s, n, k, 0, torch.float16)",
                                               "tiles must start 16-byte aligned .* 4 bytes past"),
    "mma on fp32 x": ("ops.mma(xc.float(), tiles, s, None, n, k, 0, False)", "x must be fp16 or bf16, got Float"),
    "mma_rows on the tiles": ("ops.mma_rows(xc, tiles, s, None, n, k, 0, False)",
                              r"qweight must be contiguous int32 \(N, ceil\(K/16\)\) for N=300 K=1000"),
    "mma with a scale of one row": ("ops.mma(xc, tiles, s[:1], None, n, k, 0, False)",
                                    r"scale must be contiguous fp32 \(N, G\)"),
}


@pytest.mark.gpu
@needs_cuda
def test_gpu_op_checks_are_errors_and_the_process_goes_on(tmp_path):
    """Bad arguments to the C++ ops (tiles off 16-byte alignment, a lane's tile being one 16-byte load; x not fp16 /
    bf16; the tiles passed as the row layout; a scale of the wrong shape) are RuntimeErrors that say so, and the next
    call in the process runs and is right."""
    def right(stdout: str, message: str) -> bool:
        lines = stdout.splitlines()
        raised = next((line for line in lines if line.startswith("raised: ")), "")
        after = next((float(line.split()[-1]) for line in lines if line.startswith("after: ")), math.inf)
        return bool(re.search(message, raised)) and after < 2e-3

    failed = _probe_failures(tmp_path / "op_error_probe.py", _OP_ERROR_PROBE, dict(_OP_ERRORS.values()), right)
    assert not failed, {name: failed[call] for name, (call, _) in _OP_ERRORS.items() if call in failed}


def _probe_failures(path: Path, script: str, cases: dict[str, str], right) -> dict[str, str]:
    """Runs ``script`` once per case (its argument), each in its own process; the cases whose process did not exit
    0 or whose output ``right(stdout, expected)`` rejects, each with its exit status and the output's tail."""
    path.write_text(script)
    failed = {}
    for case, expected in cases.items():
        r = subprocess.run([sys.executable, str(path), case], capture_output=True, text=True, timeout=900)
        if r.returncode != 0 or not right(r.stdout, expected):
            failed[case] = f"exit {r.returncode}: " + " | ".join((r.stdout + r.stderr).strip().splitlines()[-6:])
    return failed


def test_extensions_are_built_with_the_shared_flags(monkeypatch):
    """Every extension gets nvcc's flags and the link flags that keep a statically linked C++ runtime to the
    extension (on a machine whose CXX links libstdc++.a, an exported copy crashed every error message holding a
    number; benchmarks/NOTES.md), as the C++-error probe below is built."""
    import torch.utils.cpp_extension as cpp_extension

    from vllm_parity.serving import cuda_build

    seen = {}
    monkeypatch.setattr(cuda_build, "available", lambda: True)
    monkeypatch.setattr(cuda_build, "arch_flags", lambda: ["-gencode=arch=compute_90a,code=sm_90a"])
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: seen.update(kw) or "module")
    assert cuda_build.LazyExtension("parity_probe", "ternary.cu", "probe")() == "module"
    assert seen["extra_ldflags"] == cuda_build.link_flags() == ["-Wl,--exclude-libs,ALL"]
    assert seen["extra_cuda_cflags"] == cuda_build.cuda_cflags()


# A TORCH_CHECK in a .cu built the way the extensions are, reached through pybind and through a TORCH_LIBRARY op, in a
# fresh process and after Triton has compiled a kernel there (as in a test session): each case in its own process.
_CPP_ERROR_PROBE = r'''
import sys

import torch
from torch.utils.cpp_extension import load_inline

from vllm_parity.serving.cuda_build import CSRC, build_flags

CU = """
#include <torch/extension.h>
torch::Tensor check_cu(torch::Tensor x) { TORCH_CHECK(x.numel() == 0, "probe: numel ", x.numel()); return x; }
torch::Tensor check_text(torch::Tensor x) { TORCH_CHECK(x.numel() == 0, "probe: text only"); return x; }
torch::Tensor check_to_string(torch::Tensor x) {
  TORCH_CHECK(x.numel() == 0, "probe: numel ", std::to_string(x.numel()));
  return x;
}
torch::Tensor check_one_string(torch::Tensor x) {
  TORCH_CHECK(x.numel() == 0, std::string("probe: numel ") + std::to_string(x.numel()));
  return x;
}
TORCH_LIBRARY(parity_cpp_error_probe, m) { m.def("check(Tensor x) -> Tensor"); }
TORCH_LIBRARY_IMPL(parity_cpp_error_probe, CUDA, m) { m.impl("check", &check_cu); }
"""
HEADER_CU = """
#include <torch/extension.h>
#include "ternary_tiles.cuh"
torch::Tensor check_tiles_cu(torch::Tensor x) { parity::check_tiles(x, 300, 1000, "probe"); return x; }
TORCH_LIBRARY(parity_cpp_error_probe_header, m) { m.def("check(Tensor x) -> Tensor"); }
TORCH_LIBRARY_IMPL(parity_cpp_error_probe_header, CUDA, m) { m.impl("check", &check_tiles_cu); }
"""
# the cases through pybind: the integer in the message; none; the integer as a string; the message as one string,
# which c10::str passes on as it is, with no stream
PYBIND = {"pybind": "check_cu", "pybind_text": "check_text", "pybind_to_string": "check_to_string",
          "pybind_one_string": "check_one_string"}
mod = load_inline("parity_cpp_error_probe", cpp_sources="".join(f"torch::Tensor {f}(torch::Tensor x);"
                                                                for f in PYBIND.values()),
                  cuda_sources=CU, functions=list(PYBIND.values()), **build_flags())
x = torch.ones(3, device="cuda")
case = sys.argv[1]
if case == "op_after_triton":
    import triton
    import triton.language as tl

    @triton.jit
    def _store_one(p):
        tl.store(p, 1.0)

    _store_one[(1,)](x)
    torch.cuda.synchronize()
if case == "op_project_header":  # the tiles' check of csrc/ternary_tiles.cuh, as the ternary extension has it
    load_inline("parity_cpp_error_probe_header", cpp_sources="", extra_include_paths=[str(CSRC)],
                cuda_sources=HEADER_CU, **build_flags(), is_python_module=False)
try:
    if case in PYBIND:
        getattr(mod, PYBIND[case])(x)
    elif case == "op_project_header":
        torch.ops.parity_cpp_error_probe_header.check(x)
    else:
        torch.ops.parity_cpp_error_probe.check(x)
except RuntimeError as e:
    print("raised:", str(e).splitlines()[0])
'''


@pytest.mark.gpu
@needs_cuda
def test_gpu_cpp_errors_reach_python(tmp_path):
    """The ops' checks are TORCH_CHECKs: on this machine a C++ error from a .cu built as the extensions are must reach
    Python as a RuntimeError, through pybind and through a TORCH_LIBRARY op, also once Triton has compiled a kernel in
    the process, and from the tiles' check of the ternary extension's header. A case that crashes its process names
    itself here (the ops' own error tests would only crash). Three cases tell a message's number from the throw itself:
    one without a number, one with the number given as a string, one whose message is a single string that no stream
    formats (benchmarks/NOTES.md: on a machine whose CXX links libstdc++ statically, every message that streamed an
    integer crashed until the extensions were linked with cuda_build.link_flags)."""
    numel = "raised: probe: numel 3"
    expected = {"pybind": numel, "op": numel, "op_after_triton": numel,
                "op_project_header": "raised: probe: tiles must be contiguous",
                "pybind_text": "raised: probe: text only", "pybind_to_string": numel, "pybind_one_string": numel}
    failed = _probe_failures(tmp_path / "cpp_error_probe.py", _CPP_ERROR_PROBE, expected,
                             lambda stdout, message: message in stdout)
    assert not failed, failed


def test_tensor_core_kernel_rejects_tiles_off_16_byte_alignment():
    """Tiles that do not start 16-byte aligned are a ValueError that says so, before anything reaches the device."""
    nat = repack(pack_codes(torch.zeros(16, 128, dtype=torch.int64), PRESETS["seed-article"]), torch.ones(16),
                 PRESETS["seed-article"], 16, 128).with_tiles()
    shifted = torch.zeros(nat.tiles.numel() + 1, dtype=torch.int32)[1:].view(nat.tiles.shape)
    with pytest.raises(ValueError, match="tiles must start 16-byte aligned .* 4 bytes past"):
        ternary_cuda.linear_mma(torch.zeros(1, 128, dtype=torch.float16), shifted, nat.scale, None, 16, 128, 0, False)
    with pytest.raises(ValueError, match="ternary dequant_tiles: tiles must start 16-byte aligned .* 4 bytes past"):
        ternary_cuda.dequant_tiles(shifted, nat.scale, 16, 128, 0, torch.float16)


@pytest.mark.gpu
@needs_cuda
def test_gpu_torch_compile():
    case = dict(spec=PRESETS["hf-bitnet"], m=8, n=256, k=512, dtype=torch.bfloat16, scale_dtype=torch.bfloat16,
                weights="random", activations="normal", layout="contiguous", bias=False, seed=9)
    built = build(case, "cuda")
    fn = torch.compile(lambda x: ternary_ops.ternary_linear(x, built["native"]), fullgraph=True)
    check(fn(built["x"]), built, case, "torch.compile(ternary_linear)")


# --------------------------------------------------------------------------------------------
# one resident copy (the tiles alone) and the C++ ops (torch.ops.parity_ternary)


def _dequant_tiles_emulated(tiles: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The values (N, K) as csrc/ternary.cu's dequant_tiles_kernel indexes them: word j of lane (g, t), row half
    rs, input e (0..7) -> row 16 nt + g + 8 rs, input 128 c + 32 t + 8 j + e, bit 2 p + 16 (e % 2) with
    p = 4 (e / 4) + 2 ((e / 2) % 2) + rs."""
    nt, kc = tiles.shape[:2]
    words = tiles.to(torch.int64) & 0xFFFFFFFF
    out = torch.zeros(nt * 16, kc * 128, dtype=torch.int8)
    for lane in range(32):
        g, t = divmod(lane, 4)
        for j in range(4):
            for rs in range(2):
                for e in range(8):
                    bit = 2 * (4 * (e >> 2) + 2 * ((e >> 1) & 1) + rs) + 16 * (e & 1)
                    f = (words[:, :, lane, j] >> bit) & 3  # (NT, KC)
                    v = ((f & 1) * (1 - (f & 2))).to(torch.int8)
                    rows = torch.arange(nt) * 16 + g + 8 * rs
                    cols = torch.arange(kc) * 128 + 32 * t + 8 * j + e
                    out[rows[:, None], cols[None, :]] = v
    return out[:n, :k]


@settings(max_examples=25, **HYP)
@given(n=st.integers(1, 40), k=st.integers(1, 300), seed=st.integers(0, 2 ** 31 - 1))
def test_dequant_tiles_indexing(n, k, seed):
    """The dense-from-tiles kernel's field indexing, run in torch, reads back the values packed."""
    values = torch.randint(-1, 2, (n, k), generator=torch.Generator().manual_seed(seed))
    assert torch.equal(_dequant_tiles_emulated(pack_tiles(values), n, k), values.to(torch.int8))


@pytest.mark.gpu
@needs_cuda
@settings(max_examples=int(os.environ.get("PARITY_GPU_EXAMPLES", "60")), **HYP)
@given(n=st.integers(1, 300), k4=st.integers(1, 275), group=st.sampled_from([0, 1, 2, 3, 4]),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2 ** 31 - 1))
def test_gpu_dequant_tiles_matches_row_dequant(n, k4, group, dtype, seed):
    """dequant_tiles (tiled layout) is bit for bit the row layout's dequant and the native weight rounded once."""
    k = 4 * k4  # input-packed: K a multiple of 4
    divisors = [g for g in range(1, k + 1) if k % g == 0]
    group_size = 0 if group == 0 else divisors[(seed + group) % len(divisors)]
    spec = PRESETS["seed-article"] if group_size in (0, k) else TernarySpec(scale_granularity="group",
                                                                            group_size=group_size)
    case = dict(spec=spec, m=1, n=n, k=k, dtype=dtype, scale_dtype=torch.float32, weights="random",
                activations="normal", layout="contiguous", bias=False, seed=seed)
    nat = build(case, "cuda")["native"].with_tiles()
    w = ternary_cuda.dequant_tiles(nat.tiles, nat.scale, n, k, nat.group_size, dtype)
    want = native_weight(nat, torch.float32).to(dtype)
    assert w.dtype == dtype and w.shape == (n, k)
    assert torch.equal(w, want), f"dequant_tiles differs at {int((w != want).sum())} of {w.numel()} (N={n} K={k})"
    assert torch.equal(w, ternary_cuda.dequant(nat.qweight, nat.scale, k, nat.group_size, dtype))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 3, 5, 8, 9, 12, 16, 17, 40, 64, 65, 200, 384])
@pytest.mark.parametrize("n, k", [(200, 1000), (4096, 4096), (77, 2304), (14336, 256)])
def test_gpu_cpp_mma_config_matches_python(m, n, k):
    """The C++ op chooses the configuration Python's mma_config + _fit_instance would."""
    for group_size in (0, 128, 256):
        for rows in (False, True):
            want = ternary_cuda._fit_instance(ternary_cuda.mma_config(m, n, k, rows, group_size), group_size)
            assert ternary_cuda.mma_cpp_config(m, n, k, group_size, rows) == want, (m, n, k, group_size, rows)


@pytest.mark.gpu
@needs_cuda
@settings(max_examples=int(os.environ.get("PARITY_GPU_EXAMPLES", "60")), **HYP)
@given(case=cases(max_m=40, max_n=520, max_k=1100, dtypes=(torch.float16, torch.bfloat16)))
@pytest.mark.parametrize("op_name", ["mma", "mma_rows"])
def test_gpu_cpp_mma_op_matches_reference(op_name, case):
    """torch.ops.parity_ternary.mma (the eager path of the public entry point) on the tiles, and .mma_rows on the
    row layout, every layout of x, 3-D too."""
    assume(eligible("cuda_mma", case))
    built = build(case, "cuda")
    nat = built["native"].with_tiles()
    x = built["x"]
    op = getattr(ternary_cuda.ops(), op_name)
    w = nat.qweight if op_name == "mma_rows" else nat.tiles
    if case["layout"] == "3d":
        m, k = case["m"], case["k"]
        b, t = (m // 2, 2) if m % 2 == 0 else (m, 1)
        wide = torch.full((b, t, k + 5), float("nan"), dtype=x.dtype, device=x.device)
        wide[..., :k] = x.reshape(b, t, k)
        with poisoned_empty():
            out = op(wide[..., :k], w, nat.scale, built["bias"], nat.n, nat.k, nat.group_size, nat.act_quant)
        assert out.shape == (b, t, case["n"])
        out = out.reshape(m, case["n"])
    else:
        with poisoned_empty():
            out = op(shaped(x, case["layout"]), w, nat.scale, built["bias"], nat.n, nat.k, nat.group_size,
                     nat.act_quant)
    check(out, built, case, f"parity_ternary.{op_name}")
    with poisoned_empty():
        public = ternary_ops.ternary_linear(shaped(x, case["layout"]) if case["layout"] != "3d" else x, nat,
                                            built["bias"])
    check(public, built, case, "public entry point (eager C++ op)")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 7, 16, 40, 64, 65, 130, 400])
def test_gpu_tiles_linear_every_m(m):
    """The one resident copy serves every row count: each tiles kernel (cuda_mma, the dense weight from the
    tiles) at every M, and the one chosen for M."""
    for i, (spec, dtype) in enumerate([(PRESETS["seed-article"], torch.float16),
                                       (PRESETS["hf-bitnet"], torch.bfloat16),
                                       (TernarySpec(scale_granularity="group", group_size=128), torch.bfloat16),
                                       (TernarySpec(scale_granularity="group", group_size=256), torch.float16)]):
        case = dict(spec=spec, m=m, n=332, k=1024, dtype=dtype, scale_dtype=torch.bfloat16, weights="random",
                    activations="normal", layout="contiguous", bias=i % 2 == 0, seed=40 + i)
        built = build(case, "cuda")
        nat = built["native"].with_tiles()
        ternary_cuda.ops()
        for kernel in (None,) + choose.TERNARY_TILES_KERNELS:  # the choice for m, then each kernel at any m
            with poisoned_empty():
                out = ternary_ops.tiles_linear(built["x"], nat.tiles, nat.scale, built["bias"], nat.n, nat.k,
                                               nat.group_size, nat.act_quant, kernel=kernel)
            dense = (kernel or choose.ternary_tiles_kernel(m, dtype, nat.group_size)) == "cuda_dequant_tiles"
            check(out, built, case, f"tiles_linear {kernel} {spec}", weight_rounding=dense)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 7, 40])
def test_gpu_public_entry_point_on_the_rows_alone(m):
    """A weight without tiles runs cuda_mma on its row layout: the public entry point (eager C++ op), the Python
    custom op (the compiled path) and both replayed from a CUDA graph, 16- and 8-byte reads a row (group scales)
    and a word a load (K = 1000)."""
    for i, (spec, dtype, k) in enumerate([(PRESETS["seed-article"], torch.float16, 4096),
                                          (PRESETS["hf-bitnet"], torch.bfloat16, 1000),
                                          (TernarySpec(scale_granularity="group", group_size=128), torch.bfloat16,
                                           1024)]):
        case = dict(spec=spec, m=m, n=300, k=k, dtype=dtype, scale_dtype=torch.float32, weights="random",
                    activations="normal", layout="contiguous", bias=i != 1, seed=60 + i)
        built = build(case, "cuda")
        nat = built["native"]
        assert nat.tiles is None
        assert choose.ternary_kernel("auto", m, dtype, nat.group_size, nat.act_quant) == "cuda_mma"
        x = built["x"].clone()

        def both():
            return (ternary_ops.ternary_linear(x, nat, built["bias"]),
                    ternary_ops.ternary_linear_op(x, nat.qweight, nat.scale, built["bias"], nat.k, nat.group_size,
                                                  nat.act_quant, "cuda_mma", None))
        for o, what in zip(both(), ("public entry point", "custom op")):
            check(o, built, case, f"rows alone, {what}")
        _check_graph_replays(both, ("public entry point", "custom op"), built, case, f"rows alone M={m}", 1)


def _check_graph_replays(run, names, built, case, label: str, replays: int) -> None:
    """``run`` (warmed up) captured in one CUDA graph: every replay writes the reference into NaN-poisoned
    outputs."""
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = run()
    for i in range(replays):
        for o in outs:
            o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for o, what in zip(outs, names):
            check(o, built, case, f"{what} {label} graph replay {i}")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 7, 16, 40])
def test_gpu_cpp_ops_in_cuda_graphs(m):
    """The public entry point (eager C++ op) and tiles_linear captured in one CUDA graph: every replay
    writes the reference into NaN-poisoned outputs."""
    case = dict(spec=PRESETS["seed-article"], m=m, n=1024, k=4096, dtype=torch.float16, scale_dtype=torch.float16,
                weights="random", activations="normal", layout="contiguous", bias=True, seed=50 + m)
    built = build(case, "cuda")
    nat = built["native"].with_tiles()
    x = built["x"].clone()
    ternary_cuda.ops()
    both = _entry_and_tiles(x, nat, built["bias"])
    both()
    _check_graph_replays(both, ("public entry point", "tiles_linear"), built, case, f"M={m}", 3)


def _entry_and_tiles(x, nat, bias):
    """Both eager ways to the C++ ops: the public entry point and tiles_linear (the vLLM method's one copy)."""
    def both():
        return (ternary_ops.ternary_linear(x, nat, bias),
                ternary_ops.tiles_linear(x, nat.tiles, nat.scale, bias, nat.n, nat.k, nat.group_size, nat.act_quant))
    return both


@pytest.mark.gpu
@needs_cuda
def test_gpu_cpp_opcheck():
    for spec in (PRESETS["hf-bitnet"], TernarySpec(scale_granularity="group", group_size=128)):
        case = dict(spec=spec, m=5, n=64, k=256, dtype=torch.bfloat16, scale_dtype=torch.bfloat16,
                    weights="random", activations="normal", layout="contiguous", bias=True, seed=13)
        built = build(case, "cuda")
        nat = built["native"].with_tiles()
        ops = ternary_cuda.ops()
        torch.library.opcheck(ops.mma.default, (built["x"], nat.tiles, nat.scale, built["bias"], nat.n, nat.k,
                                                nat.group_size, nat.act_quant))
        torch.library.opcheck(ops.mma.default, (built["x"].reshape(5, 1, 256), nat.tiles, nat.scale, None, nat.n,
                                                nat.k, nat.group_size, nat.act_quant))
        torch.library.opcheck(ops.mma_rows.default, (built["x"], nat.qweight, nat.scale, built["bias"], nat.n, nat.k,
                                                     nat.group_size, nat.act_quant))
        torch.library.opcheck(ops.mma_rows.default, (built["x"].reshape(5, 1, 256), nat.qweight, nat.scale, None,
                                                     nat.n, nat.k, nat.group_size, nat.act_quant))
        torch.library.opcheck(ops.dequant_tiles.default, (nat.tiles, nat.scale, nat.n, nat.k, nat.group_size,
                                                          torch.float16))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("rows", [False, True])
def test_gpu_cpp_mma_propagates_nan(rows):
    """A NaN in a token's activations makes that token's outputs NaN (as the fp64 reference does), and no
    other token's."""
    case = dict(spec=PRESETS["seed-article"], m=4, n=300, k=1000, dtype=torch.float16, scale_dtype=torch.float32,
                weights="random", activations="normal", layout="contiguous", bias=False, seed=77)
    built = build(case, "cuda")
    nat = built["native"].with_tiles()
    x = built["x"].clone()
    x[2, 517] = float("nan")
    ops = ternary_cuda.ops()
    out = (ops.mma_rows(x, nat.qweight, nat.scale, None, nat.n, nat.k, nat.group_size, nat.act_quant) if rows else
           ops.mma(x, nat.tiles, nat.scale, None, nat.n, nat.k, nat.group_size, nat.act_quant))
    assert bool(out[2].isnan().all()), "the NaN token's outputs must all be NaN"
    assert bool(torch.isfinite(out[[0, 1, 3]]).all()), "other tokens must stay finite"


@pytest.mark.gpu
@needs_cuda
def test_gpu_tiles_linear_torch_compile():
    case = dict(spec=PRESETS["seed-article"], m=8, n=256, k=512, dtype=torch.bfloat16, scale_dtype=torch.bfloat16,
                weights="random", activations="normal", layout="contiguous", bias=False, seed=9)
    built = build(case, "cuda")
    nat = built["native"].with_tiles()
    ternary_cuda.ops()  # loaded (and its fakes registered) before tracing, as the vLLM method does at load
    fn = torch.compile(lambda x: ternary_ops.tiles_linear(x, nat.tiles, nat.scale, None, nat.n, nat.k,
                                                          nat.group_size, nat.act_quant), fullgraph=True)
    check(fn(built["x"]), built, case, "torch.compile(tiles_linear)")


# The GEMM on the tiles (csrc/ternary_gemm.cu, wgmma): compute capability 9.0 only.
needs_gemm = pytest.mark.skipif(not (CUDA and ternary_cuda.gemm_supported()),
                                reason="the ternary GEMM needs a GPU of compute capability 9.0 (wgmma) and nvcc")


def _gemm_case(spec, m, n, k, dtype, seed, layout="contiguous", bias=True):
    return dict(spec=spec, m=m, n=n, k=k, dtype=dtype, scale_dtype=torch.bfloat16, weights="random",
                activations="normal", layout=layout, bias=bias, seed=seed)


@pytest.mark.gpu
@needs_gemm
def test_gpu_gemm_stages_x_in_tile_order():
    """The C++ placement of a chunk's inputs is tile_order, the one the CPU test checks against the fragments."""
    ext = ternary_cuda.gemm_extension()
    assert [ext.tile_pos(r) for r in range(128)] == ternary_cuda.tile_order(128).tolist()


_GEMM_SHAPES = [(1, 64, 128, 1), (130, 200, 1000, 1), (300, 520, 2100, 3), (64, 4096, 4096, 4), (257, 1040, 640, 2),
                (200, 300, 1152, 2)]  # (M, N, K, split)


@pytest.mark.gpu
@needs_gemm
@pytest.mark.parametrize("inst, m, n, k, split", [
    *(((*i, False, False), *shape) for i in ternary_cuda.GEMM_INSTANCES for shape in _GEMM_SHAPES),
    # group scales: K a multiple of 128 and more than one group
    *(((*i, True, False), *shape) for i in ternary_cuda.GEMM_GROUP_INSTANCES for shape in _GEMM_SHAPES
      if shape[2] % 128 == 0 and shape[2] > 128),
    *(((*i, False, True), *shape) for i in ternary_cuda.GEMM_WS_INSTANCES for shape in _GEMM_SHAPES)],
    ids=lambda v: "bn{}-wg{}-st{}{}{}".format(*v[:3], "-group" * v[3], "-ws" * v[4]) if isinstance(v, tuple) else None)
def test_gpu_gemm_matches_reference(inst, m, n, k, split):
    """Every compiled instance (the warp-specialized ones too), split or not, ragged M, N and K: fp16 with bias on a
    contiguous x; bf16 with activation quantization on a strided x (NaN between its elements); group scales of 128
    (or 256) inputs."""
    bn, wg, stages, group, ws = inst
    variants = [(PRESETS["seed-article"], torch.float16, "contiguous"), (PRESETS["hf-bitnet"], torch.bfloat16, "strided")]
    if group:
        gs = 256 if k % 256 == 0 else 128
        variants = [(TernarySpec(scale_granularity="group", group_size=gs), dtype, layout)
                    for _, dtype, layout in variants]
    for i, (spec, dtype, layout) in enumerate(variants):
        case = _gemm_case(spec, m, n, k, dtype, seed=m + n + k + i, layout=layout, bias=i == 0)
        built = build(case, "cuda")
        nat = built["native"].with_tiles()
        assert bool(nat.group_size) == group, f"case {describe(case)}: group size {nat.group_size}"
        with poisoned_empty():
            out = ternary_cuda.linear_gemm(shaped(built["x"], layout), nat.tiles, nat.scale, built["bias"], n, k,
                                           nat.group_size, nat.act_quant,
                                           config=dict(bn=bn, wg=wg, stages=stages, split=split, ws=ws))
        check(out, built, case, f"cuda_gemm {inst} split {split} {dtype}")


@pytest.mark.gpu
@needs_gemm
@settings(max_examples=int(os.environ.get("PARITY_GPU_EXAMPLES", "60")), **HYP)
@given(case=cases(max_m=600, max_n=700, max_k=1500, dtypes=(torch.float16, torch.bfloat16)))
def test_gpu_gemm_default_config_hypothesis(case):
    """The default launch on any case it takes (fp16 / bf16, group sizes a multiple of 128), through the op."""
    assume(case["layout"] != "3d")
    assume(eligible("cuda_mma", case))
    built = build(case, "cuda")
    nat = built["native"].with_tiles()
    x = shaped(built["x"], case["layout"])
    with poisoned_empty():
        out = ternary_ops.ternary_linear_op(x, nat.qweight, nat.scale, built["bias"], nat.k, nat.group_size,
                                            nat.act_quant, "cuda_gemm", nat.tiles)
    check(out, built, case, "cuda_gemm")


@pytest.mark.gpu
@needs_gemm
@pytest.mark.parametrize("split, ws", [(1, False), (4, False), (1, True), (4, True)])
def test_gpu_gemm_in_cuda_graph_and_nan(split, ws):
    """Replays of a captured GEMM write the reference every time; a NaN in one token's activations makes
    that token's outputs NaN and no other's."""
    case = _gemm_case(PRESETS["seed-article"], 200, 1024, 4096, torch.float16, seed=90 + split)
    built = build(case, "cuda")
    nat = built["native"].with_tiles()
    x = built["x"].clone()
    cfg = dict(bn=128, wg=2, stages=3, split=split, ws=ws)

    def run():
        return (ternary_cuda.linear_gemm(x, nat.tiles, nat.scale, built["bias"], nat.n, nat.k, 0, False, config=cfg),)
    run()
    _check_graph_replays(run, ("cuda_gemm",), built, case, f"split {split}", 3)
    x[150, 333] = float("nan")
    out = run()[0]
    assert bool(out[150].isnan().all()), "the NaN token's outputs must all be NaN"
    assert bool(torch.isfinite(out[torch.arange(200) != 150]).all()), "other tokens must stay finite"


@pytest.mark.gpu
@needs_gemm
def test_gpu_gemm_refuses_what_it_cannot_take():
    case = _gemm_case(TernarySpec(scale_granularity="group", group_size=64), 80, 64, 256, torch.float16, seed=3)
    built = build(case, "cuda")
    nat = built["native"].with_tiles()
    with pytest.raises(ValueError, match="group size 64 is not a multiple of 128"):
        ternary_cuda.linear_gemm(built["x"], nat.tiles, nat.scale, None, nat.n, nat.k, nat.group_size, False)
    case = _gemm_case(PRESETS["seed-article"], 80, 64, 256, torch.float16, seed=3)
    built = build(case, "cuda")
    nat = built["native"].with_tiles()
    with pytest.raises(ValueError, match="no instance"):
        ternary_cuda.linear_gemm(built["x"], nat.tiles, nat.scale, None, nat.n, nat.k, 0, False,
                                 config=dict(bn=32, wg=1, stages=4, split=1))
    with pytest.raises(ValueError, match="no instance .* with group scales"):
        ternary_cuda.linear_gemm(built["x"], nat.tiles, nat.scale.repeat(1, 2).contiguous(), None, nat.n, nat.k,
                                 128, False, config=dict(bn=128, wg=4, stages=4, split=1))
    with pytest.raises(ValueError, match="has no tiles"):
        ternary_ops.ternary_linear_op(built["x"], nat.qweight, nat.scale, None, nat.k, 0, False, "cuda_gemm")


@pytest.mark.gpu
@needs_gemm
def test_gpu_gemm_cpp_config_is_python_config():
    for m, n, k, group in itertools.product((1, 33, 64, 65, 200, 384, 640, 1000), (64, 4096, 14336), (256, 4096, 14336),
                                            (0, 128)):
        assert ternary_cuda.gemm_cpp_config(m, n, k, group) == ternary_cuda.gemm_config(m, n, k, group), (m, n, k, group)


@pytest.mark.gpu
@needs_gemm
@pytest.mark.parametrize("m", [33, 100, 300])
def test_gpu_public_entry_point_and_tiles_linear_take_the_gemm(m):
    """Where cuda_gemm serves, the public entry point (eager C++ op) and tiles_linear (the vLLM method's one copy)
    run it: the reference, eager, from a CUDA graph and under torch.compile."""
    case = _gemm_case(PRESETS["seed-article"], m, 1000, 2048, torch.bfloat16, seed=60 + m)
    built = build(case, "cuda")
    nat = built["native"].with_tiles()
    assert choose.ternary_kernel("auto", m, torch.bfloat16, 0, False, tiled=True) == "cuda_gemm"
    assert choose.ternary_tiles_kernel(m, torch.bfloat16, 0) == "cuda_gemm"
    x = built["x"].clone()
    ternary_cuda.ops()
    both = _entry_and_tiles(x, nat, built["bias"])
    for out, what in zip(both(), ("public entry point", "tiles_linear")):
        check(out, built, case, f"{what} eager")
    _check_graph_replays(both, ("public entry point", "tiles_linear"), built, case, f"M={m}", 2)
    fn = torch.compile(lambda x: ternary_ops.tiles_linear(x, nat.tiles, nat.scale, built["bias"], nat.n, nat.k,
                                                          nat.group_size, nat.act_quant), fullgraph=True)
    check(fn(x), built, case, "torch.compile(tiles_linear)")
