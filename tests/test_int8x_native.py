"""The native int8x layout (4-bit codes + outliers): lossless repack, its op on every backend, against fp64.

On a CPU the Triton GEMV runs through the interpreter (``TRITON_INTERPRET=1``, set by the int8x kernel
tests' module before the kernels are imported when CUDA is absent); outputs are NaN-poisoned before each
launch, so an unwritten element fails.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.test_int8x_kernels import (DTYPES, LINEAR_BOUND, SETTINGS, TRITON_DEVICE, accumulation_slack,  # noqa: I001
                                      activations, assert_rel_close, needs_triton, poisoned_allocations,
                                      requires_gpu)
from vllm_parity.serving import choose
from vllm_parity.serving import int8x_native as nv
from vllm_parity.reference.formats import int8x

SMALL = np.arange(-8, 8)
OUTLIERS = np.concatenate([np.arange(-128, -8), np.arange(8, 128)])


@st.composite
def int8_weights(draw, max_n: int = 6):
    """q (N, K): K around multiples of 8, values all small, all outliers, or mixed with -128, 127, -9, 8."""
    n = draw(st.integers(1, max_n))
    k = draw(st.one_of(st.integers(1, 70), st.sampled_from([7, 8, 9, 15, 16, 17, 64, 65])))
    mode = draw(st.sampled_from(["mixed", "mixed", "small", "outliers", "edges"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if mode == "small":
        v = rng.choice(SMALL, n * k)
    elif mode == "outliers":
        v = rng.choice(OUTLIERS, n * k)
    elif mode == "edges":
        v = rng.choice(np.array([-128, 127, -9, 8, -8, 7, 0, -1]), n * k)
    else:
        frac = rng.uniform(0, 1)
        v = np.where(rng.uniform(size=n * k) < frac, rng.choice(OUTLIERS, n * k), rng.choice(SMALL, n * k))
    return torch.from_numpy(v.astype(np.int8).reshape(n, k))


def _native(q: torch.Tensor, scale: float = 0.0371, device: str = "cpu") -> nv.Int8xNative:
    return nv.pack(q, torch.tensor([scale])).to(device)


def _ref(x: torch.Tensor, q: torch.Tensor, scale: float = 0.0371) -> torch.Tensor:
    return x.detach().cpu().to(torch.float64) @ (q.to(torch.float64) * torch.tensor(scale, dtype=torch.float32)).t()


@settings(**SETTINGS)
@given(q=int8_weights())
def test_pack_is_lossless_and_well_formed(q):
    nat = nv.pack(q, torch.tensor([0.5]))
    n, k = q.shape
    assert tuple(nat.codes.shape) == (n, -(-k // 8)) and nat.codes.dtype == torch.int32
    outlier = (q.to(torch.int32) < -8) | (q.to(torch.int32) > 7)
    assert nat.outliers.numel() == int(outlier.sum()), "one entry per weight beyond 4 bits"
    assert nat.row_ptr.tolist() == [0] + outlier.sum(1).cumsum(0).tolist(), "row pointers"
    assert torch.equal(nv.unpack(nat), q), "unpack(pack(q)) != q"


def test_codes_bit_layout():
    """Code i of word j of row n sits at bits 4i..4i+3 as two's complement; outliers read (k << 8) | byte."""
    q = torch.tensor([[1, -1, 7, -8, 0, 2, 3, -4, 100, -5], [-128, 0, 0, 0, 0, 0, 0, 0, 0, 9]], dtype=torch.int8)
    nat = nv.pack(q, torch.tensor([1.0]))
    word0 = 0x1 | 0xF << 4 | 0x7 << 8 | 0x8 << 12 | 0x0 << 16 | 0x2 << 20 | 0x3 << 24 | 0xC << 28
    assert nat.codes[0, 0].item() == word0 - (1 << 32), "int32 words: code 7 holds the sign bit"
    assert nat.codes[0, 1].item() == 0xB << 4, "100 -> code 0 plus an outlier; -5 -> 0xB"
    assert nat.outliers.tolist() == [8 << 8 | 100, 0 << 8 | 0x80, 9 << 8 | 9]
    assert nat.row_ptr.tolist() == [0, 1, 3]


def test_fits_only_when_no_larger_than_the_streams():
    g = torch.Generator().manual_seed(0)
    narrow = (torch.randn(64, 512, generator=g) * 2.5).round().clamp(-127, 127).to(torch.int8)
    wide = (torch.randn(64, 512, generator=g) * 30).round().clamp(-127, 127).to(torch.int8)
    for q, want in ((narrow, True), (wide, False)):
        enc = int8x.encode(q, 0.01)
        nat = nv.pack(q, enc["weight_scale"])
        assert nv.fits(nat, enc) is want, (nat.nbytes, nv.stored_bytes(enc))
    enc = int8x.encode(narrow, 0.01)
    assert nv.stored_bytes(enc) == sum(enc[s].numel() * enc[s].element_size() for s in
                                       ("weight_b1", "weight_b2", "weight_l1", "weight_l2", "weight_l3",
                                        "weight_b1_blk", "weight_b2_blk"))


def test_layout_choice(monkeypatch):
    g = torch.Generator().manual_seed(0)
    narrow = (torch.randn(64, 512, generator=g) * 2.5).round().clamp(-127, 127).to(torch.int8)
    wide = (torch.randn(64, 512, generator=g) * 30).round().clamp(-127, 127).to(torch.int8)
    enc_n, enc_w = int8x.encode(narrow, 0.01), int8x.encode(wide, 0.01)
    monkeypatch.delenv(choose.ENV_INT8X_LAYOUT, raising=False)
    assert torch.equal(nv.unpack(nv.for_serving(narrow, enc_n)), narrow), "auto: native where it fits"
    assert nv.for_serving(wide, enc_w) is None, "auto: the streams where the native layout is larger"
    monkeypatch.setenv(choose.ENV_INT8X_LAYOUT, "native")
    assert nv.for_serving(wide, enc_w) is not None
    monkeypatch.setenv(choose.ENV_INT8X_LAYOUT, "streams")
    assert nv.for_serving(narrow, enc_n) is None
    monkeypatch.setenv(choose.ENV_INT8X_LAYOUT, "dense")
    with pytest.raises(ValueError, match="PARITY_INT8X_LAYOUT = 'dense'"):
        nv.for_serving(narrow, enc_n)


def _backends() -> list:
    return ["torch", pytest.param("triton", marks=needs_triton)]


def _device(backend: str) -> str:
    return TRITON_DEVICE if backend == "triton" else ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("backend", _backends())
@settings(**SETTINGS)
@given(q=int8_weights(), dtype=st.sampled_from(DTYPES), data=st.data())
def test_linear_matches_reference(backend, q, dtype, data):
    device = _device(backend)
    x, layout = data.draw(activations(q.shape[1], dtype, device, max_m=20))
    with poisoned_allocations():
        y = nv.linear(x, _native(q, device=device), backend=backend)
    assert y.dtype == dtype and y.shape == (*x.shape[:-1], q.shape[0])
    assert_rel_close(y, _ref(x, q), LINEAR_BOUND[dtype], f"{backend} {layout} {dtype} q{tuple(q.shape)}",
                     accumulation_slack(x, q.float() * 0.0371))


@needs_triton
@settings(**SETTINGS)
@given(q=int8_weights(), dtype=st.sampled_from(DTYPES))
def test_triton_decode_is_exact(q, dtype):
    """The dense weight is q * scale rounded once to the dtype, every element (outliers land last)."""
    from vllm_parity.serving import int8x_native_triton

    nat = _native(q, device=TRITON_DEVICE)
    with poisoned_allocations():
        w = int8x_native_triton.decode(nat, dtype)
    want = (q.to(torch.float32) * torch.tensor(0.0371)).to(dtype)
    assert torch.equal(w.cpu(), want), f"{int((w.cpu() != want).sum())} elements differ, q{tuple(q.shape)} {dtype}"


@needs_triton
def test_triton_blocks_of_many_outliers():
    """More outliers per block of rows than one step of the outlier loop, rows without any, ragged N and K."""
    g = torch.Generator().manual_seed(5)
    q = torch.randint(-8, 8, (37, 203), generator=g, dtype=torch.int8)
    q[3, :] = 100
    q[4, ::3] = -128
    q[20:30, 7] = 127
    x = torch.randn(2, 203, generator=g).to(TRITON_DEVICE)
    with poisoned_allocations():
        y = nv.linear(x, _native(q, device=TRITON_DEVICE), backend="triton")
    assert_rel_close(y, _ref(x, q), LINEAR_BOUND[torch.float32], "dense outlier rows")


@pytest.mark.parametrize("backend", _backends())
def test_opcheck(backend):
    q = torch.randint(-128, 128, (5, 70), dtype=torch.int8, generator=torch.Generator().manual_seed(1))
    q[:, ::2] //= 20  # mostly codes, some outliers
    nat = _native(q, device=_device(backend))
    x = torch.randn(2, 3, 70, device=_device(backend))
    torch.library.opcheck(torch.ops.vllm_parity.int8x_native_linear,
                          (x, nat.codes, nat.row_ptr, nat.outliers, nat.scale, 5, 70, backend))


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="2-D int8"):
        nv.pack(torch.zeros(3, 4), torch.tensor([1.0]))
    with pytest.raises(ValueError, match="does not fit an outlier entry"):
        nv.pack(torch.zeros(1, nv.MAX_COLS, dtype=torch.int8), torch.tensor([1.0]))
    nat = _native(torch.zeros(2, 16, dtype=torch.int8))
    with pytest.raises(ValueError, match="x has 15 input features"):
        nv.linear(torch.randn(1, 15), nat, backend="torch")
    with pytest.raises(ValueError, match="backend 'cuda'"):
        nv.linear(torch.randn(1, 16), nat, backend="cuda")


@needs_triton
def test_triton_launchers_check_the_layout():
    from vllm_parity.serving import int8x_native_triton

    nat = _native(torch.zeros(4, 24, dtype=torch.int8), device=TRITON_DEVICE)
    x = torch.randn(1, 24, device=TRITON_DEVICE)
    bad = {"codes": nat.codes.t().contiguous().t(), "row_ptr": nat.row_ptr.long(), "scale": nat.scale.half()}
    for name, t in bad.items():
        with pytest.raises(ValueError, match=f"int8x native: {name} must be contiguous"):
            int8x_native_triton.linear(x, nat._replace(**{name: t}))
    with pytest.raises(ValueError, match=r"codes must be contiguous torch.int32 \(4, 4\) for a \(4, 25\) "
                                         r"weight, got torch.int32 \(4, 3\)"):
        int8x_native_triton.decode(nat._replace(k=25), torch.float16)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("m", [1, 7, 16, 40])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_large_sync_free_and_graphed(m, dtype):
    g = torch.Generator().manual_seed(3)
    q = torch.distributions.Laplace(0.0, 2.0).sample((1000, 4096)).round().clamp(-128, 127).to(torch.int8)
    q[0, 0], q[-1, -1], q[5, :] = -128, 127, 64
    nat = _native(q, device="cuda")
    x = torch.randn(m, 4096, generator=g).to("cuda", dtype)
    nv.linear(x, nat)  # compile outside the checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host sync inside the op raises
    try:
        with poisoned_allocations():
            y = nv.linear(x, nat)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert_rel_close(y, _ref(x, q), LINEAR_BOUND[dtype] * 4, f"gpu M={m} {dtype}")
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        nv.linear(x, nat)
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        yg = nv.linear(x, nat)
    x.copy_(torch.randn(m, 4096, generator=g).to("cuda", dtype))
    graph.replay()
    torch.cuda.synchronize()
    assert_rel_close(yg, _ref(x, q), LINEAR_BOUND[dtype] * 4, f"gpu graph replay M={m} {dtype}")
