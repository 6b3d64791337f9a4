"""Property tests of the int8x Triton and CUDA kernels and custom ops against the fp64 reference codec.

On a CPU the Triton kernels run through the interpreter (``TRITON_INTERPRET=1``, set here before the kernel
module is imported when CUDA is absent); on a GPU they run compiled, and ``@pytest.mark.gpu`` tests add the
CUDA kernels (csrc/int8x.cu, where nvcc can build them) and sync-free and CUDA-graph checks. Every output
buffer is NaN-poisoned before the launch, so a lane a kernel forgets to write fails as non-finite rather than
passing on stale memory.
"""

from __future__ import annotations

import contextlib
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from vllm_parity.serving import int8x_cuda as kc  # noqa: E402
from vllm_parity.serving import int8x_ops as ops  # noqa: E402
from vllm_parity.serving import int8x_triton as kt  # noqa: E402
from vllm_parity.reference.formats import int8x  # noqa: E402
from vllm_parity.reference.formats.int8x import Int8xSpec  # noqa: E402

# Where the Triton kernels run in this process: compiled on CUDA, or the CPU through the interpreter.
TRITON_DEVICE = "cpu" if kt.interpreted() else ("cuda" if torch.cuda.is_available() else None)
needs_triton = pytest.mark.skipif(TRITON_DEVICE is None, reason="Triton needs CUDA or TRITON_INTERPRET=1")
requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CUDA_KERNELS = torch.cuda.is_available() and kc.available()
requires_cuda_kernels = pytest.mark.skipif(not CUDA_KERNELS, reason="the int8x CUDA kernels need a CUDA GPU and nvcc")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# ||out - ref|| / ||ref|| bounds: a few units of each dtype's rounding (fp32 also covers fp32 accumulation
# over K <= a few hundred terms).
DECODE_BOUND = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}
LINEAR_BOUND = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
BLOCK_SIZES = [32, 64, 96]  # 96: a multiple of 32 that is not a power of two (masked lanes)



# Example counts come from the hypothesis profile (conftest.py: dev / ci / nightly).
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

POOLS = {
    "L1": np.arange(-3, 4),
    "L2": np.concatenate([np.arange(-15, -3), np.arange(4, 16)]),
    "L3": np.concatenate([np.arange(-128, -15), np.arange(16, 128)]),
    "extremes": np.array([-128, 127, -16, 16, -15, 15, -4, 4, -3, 3, 0]),
}


@st.composite
def weights(draw, max_n: int = 6, block_sizes=BLOCK_SIZES):
    """(q, block_size): shapes biased towards block boundaries (K = bs, 2bs, bs +- 1, n = multiples of bs)."""
    bs = draw(st.sampled_from(block_sizes))
    n_rows = draw(st.integers(1, max_n))
    n_cols = draw(st.one_of(st.integers(1, 3 * bs), st.sampled_from([bs, 2 * bs, bs - 1, bs + 1, 32, 31, 33])))
    mode = draw(st.sampled_from(["mixed", "mixed", "L1", "L2", "L3", "extremes"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    size = n_rows * n_cols
    if mode == "mixed":
        level = rng.choice(3, size=size, p=rng.dirichlet([1.0, 1.0, 1.0]))
        v = np.choose(level, [rng.choice(POOLS[p], size) for p in ("L1", "L2", "L3")])
    else:
        v = rng.choice(POOLS[mode], size)
    return torch.from_numpy(v.astype(np.int8).reshape(n_rows, n_cols)), bs


@st.composite
def activations(draw, n_cols: int, dtype: torch.dtype, device: str, allow_3d: bool = True, max_m: int = 17):
    """x of shape (M, K) or (B, T, K), contiguous or not; M in 1..16 (GEMV), sometimes 17..max_m."""
    m = draw(st.one_of(st.integers(1, 16), st.integers(17, max_m)))
    layouts = ["contiguous", "transposed", "strided"] + (["3d", "3d-permuted"] if allow_3d else [])
    layout = draw(st.sampled_from(layouts))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    if layout == "contiguous":
        x = torch.randn(m, n_cols, generator=g)
    elif layout == "transposed":
        x = torch.randn(n_cols, m, generator=g).t()
    elif layout == "strided":
        x = torch.randn(m, 2 * n_cols, generator=g)[:, ::2]
    elif layout == "3d":
        x = torch.randn(2, m, n_cols, generator=g)
    else:
        x = torch.randn(m, n_cols, 2, generator=g).permute(2, 0, 1)
    return x.to(device=device, dtype=dtype), layout


def _streams(enc: dict, device) -> list[torch.Tensor]:
    return [enc[s].to(device) for s in ops.STREAMS]


def assert_rel_close(out: torch.Tensor, ref: torch.Tensor, bound: float, what: str, slack: float = 0.0) -> None:
    """||out - ref|| <= bound * ||ref|| + slack (``slack``: what fp32 accumulation may lose where the terms cancel,
    see :func:`accumulation_slack`); the message gives the worst element and the max abs error."""
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)}, expected {tuple(ref.shape)}"
    got = out.detach().cpu().to(torch.float64)
    ref = ref.detach().cpu().to(torch.float64)
    bad = (~torch.isfinite(got)).nonzero()
    assert bad.numel() == 0, (f"{what}: {bad.shape[0]} non-finite outputs (unwritten lanes keep the NaN poison), "
                              f"first at {tuple(bad[0].tolist())} = {got[tuple(bad[0])].item()}")
    err = got - ref
    denom = ref.norm().item()
    rel = (err.norm().item() - slack) / denom if denom else err.norm().item() - slack
    if rel > bound:
        worst = np.unravel_index(int(err.abs().argmax()), tuple(err.shape))
        raise AssertionError(
            f"{what}: ||out-ref||/||ref|| = {rel:.3e} > {bound:.1e}; max abs {err.abs().max().item():.3e} at "
            f"{tuple(int(i) for i in worst)} (out {got[worst].item():.6g}, ref {ref[worst].item():.6g})")


def accumulation_slack(x: torch.Tensor, w: torch.Tensor) -> float:
    """K * 2^-24 * || |x| @ |w|^T ||: the bound on what a sum of K fp32 products may lose. It matters only where
    the products cancel (an output far smaller than its terms); elsewhere the relative bound decides."""
    x64, w64 = x.detach().cpu().to(torch.float64).abs(), w.detach().cpu().to(torch.float64).abs()
    return x.shape[-1] * 2.0**-24 * (x64 @ w64.t()).norm().item()


@contextlib.contextmanager
def poisoned_allocations():
    """torch.empty fills floats with NaN while active, so op outputs start poisoned."""
    det, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(det, warn_only=warn)
        torch.utils.deterministic.fill_uninitialized_memory = fill


def _reference(q: torch.Tensor, bs: int, scale: float = 0.0371):
    spec = Int8xSpec(block_size=bs)
    enc = int8x.encode(q, scale, spec)
    return enc, spec, int8x.decode(enc, spec, dtype=torch.float64)


def _linear_ref(x: torch.Tensor, w64: torch.Tensor) -> torch.Tensor:
    return x.detach().cpu().to(torch.float64) @ w64.t()


# -- the Triton launchers -----------------------------------------------------------------------


@needs_triton
@settings(**SETTINGS)
@given(qb=weights(), dtype=st.sampled_from(DTYPES))
def test_triton_decode(qb, dtype):
    q, bs = qb
    enc, _, w64 = _reference(q, bs)
    out = torch.full(q.shape, float("nan"), dtype=dtype, device=TRITON_DEVICE)
    kt.decode(*_streams(enc, TRITON_DEVICE), *q.shape, bs, out=out)
    assert_rel_close(out, w64, DECODE_BOUND[dtype], f"triton decode {tuple(q.shape)} bs={bs} {dtype}")


@needs_triton
@settings(**SETTINGS)
@given(qb=weights(), dtype=st.sampled_from(DTYPES), data=st.data())
def test_triton_linear(qb, dtype, data):
    q, bs = qb
    enc, _, w64 = _reference(q, bs)
    x, layout = data.draw(activations(q.shape[1], dtype, TRITON_DEVICE, allow_3d=False), label="x")
    out = torch.full((x.shape[0], q.shape[0]), float("nan"), dtype=dtype, device=TRITON_DEVICE)
    kt.linear(x, *_streams(enc, TRITON_DEVICE), *q.shape, bs, out=out)
    assert_rel_close(out, _linear_ref(x, w64), LINEAR_BOUND[dtype],
                     f"triton linear W{tuple(q.shape)} bs={bs} x{tuple(x.shape)} {layout} {dtype}",
                     accumulation_slack(x, w64))


@needs_triton
@pytest.mark.parametrize("n_rows, n_cols, bs", [
    (2, 1024, 1024),  # K % bs == 0 with the default block size: one block per row
    (3, 100, 1024),  # n < one block of 1024: every row lives in block 0
    (1, 32, 32),  # the smallest block, a single word
])
def test_triton_default_block_sizes_all_l3_and_min(n_rows, n_cols, bs):
    q = torch.full((n_rows, n_cols), -128, dtype=torch.int8)
    q[0, ::3] = 127
    enc, _, w64 = _reference(q, bs)
    out = torch.full(q.shape, float("nan"), dtype=torch.float32, device=TRITON_DEVICE)
    kt.decode(*_streams(enc, TRITON_DEVICE), n_rows, n_cols, bs, out=out)
    assert_rel_close(out, w64, DECODE_BOUND[torch.float32], f"decode all-L3 {tuple(q.shape)} bs={bs}")
    x = torch.randn(5, n_cols, device=TRITON_DEVICE)
    y = torch.full((5, n_rows), float("nan"), device=TRITON_DEVICE)
    kt.linear(x, *_streams(enc, TRITON_DEVICE), n_rows, n_cols, bs, out=y)
    assert_rel_close(y, _linear_ref(x, w64), LINEAR_BOUND[torch.float32], f"linear all-L3 {tuple(q.shape)} bs={bs}")


@needs_triton
def test_triton_wide_index_path(monkeypatch):
    # Weights of >= ~430M elements take int64 bit positions; force that path on a small one.
    monkeypatch.setattr(kt, "_wide", lambda n: True)
    q = torch.randint(-128, 128, (3, 70), dtype=torch.int8, generator=torch.Generator().manual_seed(5))
    q[:, ::2] //= 40
    enc, _, w64 = _reference(q, 32)
    out = torch.full(q.shape, float("nan"), device=TRITON_DEVICE)
    kt.decode(*_streams(enc, TRITON_DEVICE), 3, 70, 32, out=out)
    assert_rel_close(out, w64, DECODE_BOUND[torch.float32], "decode, int64 bit positions")
    x = torch.randn(2, 70, device=TRITON_DEVICE)
    y = torch.full((2, 3), float("nan"), device=TRITON_DEVICE)
    kt.linear(x, *_streams(enc, TRITON_DEVICE), 3, 70, 32, out=y)
    assert_rel_close(y, _linear_ref(x, w64), LINEAR_BOUND[torch.float32], "linear, int64 bit positions")


def test_triton_launcher_rejects_bad_out_and_x():
    q = torch.ones(2, 40, dtype=torch.int8)
    enc, _, _ = _reference(q, 32)
    with pytest.raises(ValueError, match=r"out must be contiguous \(2, 40\)"):
        kt.decode(*_streams(enc, "cpu"), 2, 40, 32, out=torch.empty(40, 2).t())
    with pytest.raises(ValueError, match=r"x must be \(M, 40\)"):
        kt.linear(torch.ones(3, 39), *_streams(enc, "cpu"), 2, 40, 32)


# -- the custom ops, both backends --------------------------------------------------------------

OP_BACKENDS = ["torch"] + (["triton"] if TRITON_DEVICE else [])


def _op_device(backend: str) -> str:
    return TRITON_DEVICE if backend == "triton" else "cpu"


@pytest.mark.parametrize("backend", OP_BACKENDS)
@settings(**SETTINGS)
@given(qb=weights(), dtype=st.sampled_from(DTYPES), data=st.data())
def test_ops_match_reference(backend, qb, dtype, data):
    q, bs = qb
    enc, spec, w64 = _reference(q, bs)
    device = _op_device(backend)
    dev_enc = {s: t.to(device) for s, t in enc.items()}
    x, layout = data.draw(activations(q.shape[1], dtype, device), label="x")
    with poisoned_allocations():
        w = ops.decode(dev_enc, tuple(q.shape), spec, dtype=dtype, backend=backend)
        y = ops.linear(x, dev_enc, tuple(q.shape), spec, backend=backend)
    what = f"{backend} W{tuple(q.shape)} bs={bs} {dtype}"
    assert w.dtype == dtype and y.dtype == dtype, f"{what}: dtypes {w.dtype}, {y.dtype}"
    assert_rel_close(w, w64, DECODE_BOUND[dtype], f"int8x_decode {what}")
    assert_rel_close(y, _linear_ref(x, w64), LINEAR_BOUND[dtype], f"int8x_linear {what} x{tuple(x.shape)} {layout}",
                     accumulation_slack(x, w64))


def test_poisoned_allocations_poison():
    # The poison must be real for the op tests above to catch unwritten lanes.
    with poisoned_allocations():
        assert torch.isnan(torch.empty(8)).all(), "torch.empty is not NaN-filled under poisoned_allocations"


def test_linear_bias_and_shape_from_tensors():
    q = torch.randint(-128, 128, (3, 40), dtype=torch.int8, generator=torch.Generator().manual_seed(0))
    enc, spec, w64 = _reference(q, 32)
    x, bias = torch.randn(4, 40), torch.randn(3)
    y = ops.linear(x, enc, None, spec, bias=bias, backend="torch")  # shape read from weight_shape
    assert_rel_close(y, _linear_ref(x, w64) + bias.double(), LINEAR_BOUND[torch.float32], "linear + bias")


@pytest.mark.parametrize("backend", OP_BACKENDS)
@pytest.mark.parametrize("op", ["int8x_decode", "int8x_linear"])
def test_opcheck(op, backend):
    q = torch.randint(-128, 128, (3, 70), dtype=torch.int8, generator=torch.Generator().manual_seed(1))
    q[:, ::2] //= 40  # mix in L1 and L2
    enc, _, _ = _reference(q, 32)
    device = _op_device(backend)
    streams = _streams(enc, device)
    if op == "int8x_decode":
        args = (*streams, 3, 70, 32, torch.float16, backend)
    else:
        args = (torch.randn(2, 5, 70, device=device), *streams, 3, 70, 32, backend)
    torch.library.opcheck(getattr(torch.ops.vllm_parity, op), args)


def test_compiles_without_graph_breaks():
    q = torch.randint(-128, 128, (4, 64), dtype=torch.int8, generator=torch.Generator().manual_seed(2))
    enc, spec, w64 = _reference(q, 32)

    @torch.compile(backend="aot_eager", fullgraph=True, dynamic=True)
    def f(x):
        return ops.linear(x, enc, (4, 64), spec, backend="torch") * 2

    x = torch.randn(3, 64)
    assert_rel_close(f(x), 2 * _linear_ref(x, w64), LINEAR_BOUND[torch.float32], "compiled int8x_linear")


def _ones_2x40() -> tuple[dict, Int8xSpec, list[torch.Tensor]]:
    """A 2 x 40 all-ones int8x weight (block size 32) on the CPU: encoding, spec and the op's stream tensors."""
    enc, spec, _ = _reference(torch.ones(2, 40, dtype=torch.int8), 32)
    return enc, spec, _streams(enc, "cpu")


def test_op_rejects_unknown_backend_and_wrong_k():
    _, _, streams = _ones_2x40()
    with pytest.raises(ValueError, match="backend 'numpy'"):
        torch.ops.vllm_parity.int8x_decode(*streams, 2, 40, 32, torch.float32, "numpy")
    with pytest.raises(ValueError, match="x has 39 input features, the weight \\(2, 40\\)"):
        torch.ops.vllm_parity.int8x_linear(torch.ones(1, 39), *streams, 2, 40, 32, "torch")


def test_op_auto_backend_on_cpu_runs_torch():
    q = torch.randint(-128, 128, (3, 40), dtype=torch.int8, generator=torch.Generator().manual_seed(6))
    enc, _, w64 = _reference(q, 32)
    streams = _streams(enc, "cpu")
    w = torch.ops.vllm_parity.int8x_decode(*streams, 3, 40, 32, torch.float32, "auto")
    assert_rel_close(w, w64, DECODE_BOUND[torch.float32], "int8x_decode auto on cpu")
    x = torch.randn(2, 40)
    y = torch.ops.vllm_parity.int8x_linear(x, *streams, 3, 40, 32, "auto")
    assert_rel_close(y, _linear_ref(x, w64), LINEAR_BOUND[torch.float32], "int8x_linear auto on cpu")


def test_cuda_module_imports_without_compiling():
    assert kc.extension.module is None, "importing vllm_parity.serving.int8x_cuda must not build the extension"
    if not torch.cuda.is_available():
        assert not kc.available()
        with pytest.raises(RuntimeError, match="need a CUDA GPU and nvcc"):
            kc.extension()


def test_cuda_backend_on_cpu_tensors_is_a_clear_error():
    enc, spec, streams = _ones_2x40()
    # Rejected before anything is built, whether or not this machine could build the kernels.
    with pytest.raises(ValueError, match="int8x cuda kernels need CUDA tensors, got cpu"):
        torch.ops.vllm_parity.int8x_decode(*streams, 2, 40, 32, torch.float32, "cuda")
    with pytest.raises(ValueError, match="int8x cuda kernels need CUDA tensors, got cpu"):
        torch.ops.vllm_parity.int8x_linear(torch.ones(3, 40), *streams, 2, 40, 32, "cuda")
    with pytest.raises(ValueError, match="int8x backend 'cuda' needs CUDA tensors, got cpu"):
        ops.linear(torch.ones(3, 40), enc, (2, 40), spec, backend="cuda")
    assert kc.extension.module is None


# -- GPU only -----------------------------------------------------------------------------------


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("backend", ["triton", "torch", pytest.param("cuda", marks=requires_cuda_kernels)])
@pytest.mark.parametrize("n_rows, n_cols, bs", [(512, 4096, 1024), (300, 1000, 1024), (257, 96, 64)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_ops_large_and_sync_free(backend, n_rows, n_cols, bs, dtype):
    g = torch.Generator().manual_seed(3)
    q = torch.distributions.Laplace(0.0, 5.0).sample((n_rows, n_cols)).round().clamp(-128, 127).to(torch.int8)
    q[0, 0], q[-1, -1] = -128, 127
    enc, spec, w64 = _reference(q, bs)
    dev = {s: t.cuda() for s, t in enc.items()}
    x = torch.randn(7, n_cols, generator=g).to("cuda", dtype)
    ops.linear(x, dev, (n_rows, n_cols), spec, backend=backend)  # compile / warm up outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host sync inside the ops raises
    try:
        with poisoned_allocations():
            w = ops.decode(dev, (n_rows, n_cols), spec, dtype=dtype, backend=backend)
            y = ops.linear(x, dev, (n_rows, n_cols), spec, backend=backend)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    what = f"gpu {backend} W({n_rows}, {n_cols}) bs={bs} {dtype}"
    assert_rel_close(w, w64, DECODE_BOUND[dtype], f"int8x_decode {what}")
    assert_rel_close(y, _linear_ref(x, w64), LINEAR_BOUND[dtype] * 4, f"int8x_linear {what}")  # K up to 4096


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("backend", ["triton", "torch", pytest.param("cuda", marks=requires_cuda_kernels)])
def test_gpu_linear_cuda_graph(backend):
    q = torch.randint(-128, 128, (256, 2048), dtype=torch.int8, generator=torch.Generator().manual_seed(4))
    enc, spec, w64 = _reference(q, 1024)
    dev = {s: t.cuda() for s, t in enc.items()}
    x = torch.randn(4, 2048, device="cuda", dtype=torch.float16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ops.linear(x, dev, (256, 2048), spec, backend=backend)  # warm-up on the side stream, as capture needs
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = ops.linear(x, dev, (256, 2048), spec, backend=backend)
    x.copy_(torch.randn(4, 2048, device="cuda", dtype=torch.float16))
    graph.replay()
    torch.cuda.synchronize()
    assert_rel_close(y, _linear_ref(x, w64), LINEAR_BOUND[torch.float16] * 4, f"cuda-graph replay {backend}")


# -- the CUDA kernels (GPU and nvcc) ------------------------------------------------------------

CUDA_BLOCK_SIZES = [32, 64, 96, 1024, 2048]  # 2048: warp steps that start inside a block


@pytest.mark.gpu
@requires_cuda_kernels
@settings(**SETTINGS)
@given(qb=weights(block_sizes=CUDA_BLOCK_SIZES), dtype=st.sampled_from(DTYPES))
def test_cuda_decode(qb, dtype):
    q, bs = qb
    enc, _, w64 = _reference(q, bs)
    out = torch.full(q.shape, float("nan"), dtype=dtype, device="cuda")
    kc.decode(*_streams(enc, "cuda"), *q.shape, bs, out=out)
    assert_rel_close(out, w64, DECODE_BOUND[dtype], f"cuda decode {tuple(q.shape)} bs={bs} {dtype}")


@pytest.mark.gpu
@requires_cuda_kernels
@settings(**SETTINGS)
@given(qb=weights(block_sizes=CUDA_BLOCK_SIZES), dtype=st.sampled_from(DTYPES), data=st.data())
def test_cuda_linear(qb, dtype, data):
    q, bs = qb
    enc, _, w64 = _reference(q, bs)
    x, layout = data.draw(activations(q.shape[1], dtype, "cuda", allow_3d=False, max_m=40), label="x")
    out = torch.full((x.shape[0], q.shape[0]), float("nan"), dtype=dtype, device="cuda")
    kc.linear(x, *_streams(enc, "cuda"), *q.shape, bs, out=out)
    # K reaches 3 * 2048 here: fp32 accumulation over more terms than the CPU cases.
    assert_rel_close(out, _linear_ref(x, w64), LINEAR_BOUND[dtype] * 4,
                     f"cuda linear W{tuple(q.shape)} bs={bs} x{tuple(x.shape)} {layout} {dtype}")


def _laplace_int8(n_rows: int, n_cols: int, seed: int, b: float = 5.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(n_rows, n_cols, generator=g, dtype=torch.float64) - 0.5
    v = -b * torch.sign(u) * torch.log1p(-2 * u.abs())
    return v.round().clamp(-128, 127).to(torch.int8)


@pytest.mark.gpu
@requires_cuda_kernels
@pytest.mark.parametrize("fill", ["all_l3", "all_l1", "all_l2", "laplace"])
@pytest.mark.parametrize("n_rows, n_cols, bs", [
    (3, 1024, 1024),  # one block per row
    (5, 3072, 1024),  # rows of several warp steps: counts carried along the row
    (7, 1000, 1024),  # K % bs != 0 (and K % 32 != 0): blocks and words straddle rows
    (9, 1056, 1024),  # K % 32 == 0, K % bs != 0: rows start inside blocks
    (4, 100, 1024),  # K < bs: every row inside the first block
    (6, 96, 32),  # the smallest block
    (3, 31, 32),  # K < 32: words hold several rows
    (2, 4096, 2048),  # warp steps that start in the middle of a block
])
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_kernels_edge_shapes(fill, n_rows, n_cols, bs, dtype):
    if fill == "all_l3":
        q = torch.full((n_rows, n_cols), -128, dtype=torch.int8)
        q[:, ::3] = 127
        q[:, 1::7] = 16
    elif fill == "all_l1":
        q = torch.randint(-3, 4, (n_rows, n_cols), dtype=torch.int8, generator=torch.Generator().manual_seed(8))
    elif fill == "all_l2":
        q = torch.randint(4, 16, (n_rows, n_cols), dtype=torch.int8, generator=torch.Generator().manual_seed(9))
        q[:, ::2] *= -1
    else:
        q = _laplace_int8(n_rows, n_cols, seed=10)
    enc, _, w64 = _reference(q, bs)
    streams = _streams(enc, "cuda")
    what = f"{fill} W({n_rows}, {n_cols}) bs={bs} {dtype}"
    out = torch.full(q.shape, float("nan"), dtype=dtype, device="cuda")
    kc.decode(*streams, n_rows, n_cols, bs, out=out)
    assert_rel_close(out, w64, DECODE_BOUND[dtype], f"cuda decode {what}")
    g = torch.Generator().manual_seed(11)
    for m in (1, 2, 3, 5, 8, 13, 16, 17, 40):
        x = torch.randn(m, n_cols, generator=g).to("cuda", dtype)
        y = torch.full((m, n_rows), float("nan"), dtype=dtype, device="cuda")
        kc.linear(x, *streams, n_rows, n_cols, bs, out=y)
        assert_rel_close(y, _linear_ref(x, w64), LINEAR_BOUND[dtype] * 4, f"cuda linear M={m} {what}")


@pytest.mark.gpu
@requires_cuda_kernels
def test_cuda_linear_strides_and_out():
    q = _laplace_int8(70, 2048, seed=12)
    enc, _, w64 = _reference(q, 1024)
    streams = _streams(enc, "cuda")
    base = torch.randn(6, 2 * 2048, device="cuda", dtype=torch.bfloat16)
    ref = None
    for m in (1, 3, 6):  # the x of M <= 4 is copied ahead asynchronously where its rows allow it
        for x in (base[:m, ::2], base[:m, 5:5 + 2048], base[:m, :2048].t().contiguous().t(), base[:m, :2048]):
            y = kc.linear(x, *streams, 70, 2048, 1024)
            ref = _linear_ref(x, w64)
            assert y.dtype == torch.bfloat16
            assert_rel_close(y, ref, LINEAR_BOUND[torch.bfloat16] * 4, f"cuda linear M={m} x strides {x.stride()}")
    # out of another dtype and with a column stride: written where it points, rounded to its dtype.
    out = torch.full((70, 6), float("nan"), device="cuda").t()
    kc.linear(base[:, :2048], *streams, 70, 2048, 1024, out=out)
    assert_rel_close(out, ref, LINEAR_BOUND[torch.float32] * 4, "cuda linear into a transposed fp32 out")
    # A misaligned decode target goes through a bounce buffer.
    flat = torch.full((70 * 2048 + 1,), float("nan"), device="cuda", dtype=torch.float16)
    w = flat[1:].view(70, 2048)
    kc.decode(*streams, 70, 2048, 1024, out=w)
    assert_rel_close(w, w64, DECODE_BOUND[torch.float16], "cuda decode into a misaligned out")


@pytest.mark.gpu
@requires_cuda_kernels
def test_cuda_rejects_bad_arguments():
    q = torch.ones(2, 40, dtype=torch.int8)
    enc, _, _ = _reference(q, 32)
    streams = _streams(enc, "cuda")
    with pytest.raises(ValueError, match=r"out must be contiguous \(2, 40\)"):
        kc.decode(*streams, 2, 40, 32, out=torch.empty(40, 2, device="cuda").t())
    with pytest.raises(ValueError, match=r"x must be \(M, 40\)"):
        kc.linear(torch.ones(3, 39, device="cuda"), *streams, 2, 40, 32)
    with pytest.raises(ValueError, match="b1 has 3 words, expected ceil\\(n/32\\) = 4"):
        kc.decode(*streams, 2, 64, 32)
    with pytest.raises(ValueError, match="block_size must be a positive multiple of 32"):
        kc.linear(torch.ones(3, 40, device="cuda"), *streams, 2, 40, 48)
    bad = list(streams)
    bad[0] = bad[0].to(torch.int64)
    with pytest.raises(ValueError, match="b1 must be torch.int32, got torch.int64"):
        kc.decode(*bad, 2, 40, 32)


@pytest.mark.gpu
@requires_cuda_kernels
@pytest.mark.parametrize("op", ["int8x_decode", "int8x_linear"])
@pytest.mark.parametrize("backend", ["cuda", "auto"])
def test_cuda_opcheck(op, backend):
    q = torch.randint(-128, 128, (3, 70), dtype=torch.int8, generator=torch.Generator().manual_seed(1))
    q[:, ::2] //= 40  # mix in L1 and L2
    enc, _, _ = _reference(q, 32)
    streams = _streams(enc, "cuda")
    if op == "int8x_decode":
        args = (*streams, 3, 70, 32, torch.float16, backend)
    else:
        args = (torch.randn(2, 5, 70, device="cuda"), *streams, 3, 70, 32, backend)
    torch.library.opcheck(getattr(torch.ops.vllm_parity, op), args)


@pytest.mark.gpu
@requires_cuda_kernels
@pytest.mark.parametrize("m", [1, 16, 20])
def test_cuda_graph_capture_and_replay(m):
    q = _laplace_int8(300, 4096, seed=13)
    enc, spec, w64 = _reference(q, 1024)
    dev = {s: t.cuda() for s, t in enc.items()}
    x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # build and warm up on the side stream, as capture needs
        ops.linear(x, dev, (300, 4096), spec, backend="cuda")
        ops.decode(dev, (300, 4096), spec, dtype=torch.bfloat16, backend="cuda")
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = ops.linear(x, dev, (300, 4096), spec, backend="cuda")
        w = ops.decode(dev, (300, 4096), spec, dtype=torch.bfloat16, backend="cuda")
    for seed in range(2):
        x.copy_(torch.randn(m, 4096, generator=torch.Generator().manual_seed(seed)).to("cuda", torch.bfloat16))
        y.fill_(float("nan"))
        w.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_rel_close(y, _linear_ref(x, w64), LINEAR_BOUND[torch.bfloat16] * 4, f"cuda-graph replay {seed} M={m}")
        assert_rel_close(w, w64, DECODE_BOUND[torch.bfloat16], f"cuda-graph replay decode {seed}")
