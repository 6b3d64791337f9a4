"""The int8x planes layout (5-bit plane + fixup records): lossless repack, its bytes, its op against fp64.

GPU tests (``@pytest.mark.gpu``) add the CUDA kernels (csrc/int8x_planes.cu): the tensor-core GEMV against the
torch path for M in 1, 7, 16, 40 and every M in 1..40 (the staged x of 1, 8 and 16 tokens, grid.y slices), with
explicit launch configurations (warps per tile, tiles per CTA sharing the staged x), sync-free and CUDA-graph
checks, NaN propagation, and the decode kernel bit-exact against :func:`unpack`. Outputs are NaN-poisoned before each launch, so an unwritten element fails.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.test_int8x_kernels import (DTYPES, LINEAR_BOUND, SETTINGS, accumulation_slack, activations,  # noqa: I001
                                      assert_rel_close, poisoned_allocations, requires_gpu)
from vllm_parity.fixtures.weights import gaussian, real_mix, seed_mix
from vllm_parity.reference.formats import int8x
from vllm_parity.serving import choose
from vllm_parity.serving import int8x_planes as pl
from vllm_parity.serving.int8x_load import decode_streams

EDGES = np.array([-128, 127, -17, -16, 16, 15, -15, 0, -1, 31, 32, -33, -32, 47, -48, 4, -4])
POOLS = {
    "L1": np.arange(-3, 4),
    "L2": np.concatenate([np.arange(-15, -3), np.arange(4, 16)]),
    "L3": np.concatenate([np.arange(-128, -15), np.arange(16, 128)]),
}


@st.composite
def int8_weights(draw, max_n: int = 40):
    """q (N, K): N across a tile (1, 15, 16, 17, ...), K around 256 (padding), every level mix and the edges."""
    n = draw(st.one_of(st.integers(1, max_n), st.sampled_from([1, 15, 16, 17, 33])))
    k = draw(st.one_of(st.integers(1, 600), st.sampled_from([1, 31, 32, 255, 256, 257, 512, 513])))
    mode = draw(st.sampled_from(["mixed", "mixed", "L1", "L2", "L3", "edges", "fixups"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    size = n * k
    if mode == "mixed":
        level = rng.choice(3, size=size, p=rng.dirichlet([1.0, 1.0, 1.0]))
        v = np.choose(level, [rng.choice(POOLS[p], size) for p in ("L1", "L2", "L3")])
    elif mode == "edges":
        v = rng.choice(EDGES, size)
    elif mode == "fixups":  # every weight a fixup
        v = rng.choice(np.array([127, -128]), size)
    else:
        v = rng.choice(POOLS[mode], size)
    return torch.from_numpy(v.astype(np.int8).reshape(n, k))


def _layout(q: torch.Tensor, scale: float = 0.0371, device: str = "cpu") -> pl.Int8xPlanes:
    return pl.pack(q, torch.tensor([scale])).to(device)


def _ref(x: torch.Tensor, q: torch.Tensor, scale: float = 0.0371) -> torch.Tensor:
    return x.detach().cpu().to(torch.float64) @ (q.to(torch.float64) * torch.tensor(scale, dtype=torch.float32)).t()


@settings(**SETTINGS)
@given(q=int8_weights(), device=st.sampled_from(["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]))
def test_the_torch_backends_decode_matches_the_layouts_description(q, device):
    """decode_q (permutes, byte views, records placed by their counts) against unpack (the word and bit of every
    weight, the records by search), and both against q."""
    lay = _layout(q, device=device)
    got = pl.decode_q(lay)
    assert got.dtype == torch.int8 and got.device.type == device
    assert torch.equal(got.cpu(), q)
    assert torch.equal(pl.unpack(lay).cpu(), q)


@settings(**SETTINGS)
@given(q=int8_weights())
def test_pack_is_lossless_and_well_formed(q):
    lay = pl.pack(q, torch.tensor([0.5]))
    n, k = q.shape
    pl.check(lay.tensors, n, k)
    v = q.to(torch.int32)
    assert lay.fixups == int(((v > 15) | (v < -16)).sum()), "one record per weight outside -16..15"
    assert int(lay.fx_base[-1]) == lay.fixups and lay.nbytes == pl.estimate_bytes(q)
    assert torch.equal(pl.unpack(lay), q), "unpack(pack(q)) != q"


@settings(**SETTINGS)
@given(q=int8_weights(max_n=12))
def test_repack_from_the_stored_streams(q):
    """Reference encoder -> stored streams -> the serving loader's q -> planes -> q == the reference decoder's."""
    enc = int8x.encode(q, 0.25)
    want = int8x.decode_int8(enc)
    got = decode_streams(enc, int8x.Int8xSpec().block_size)
    assert torch.equal(got, want)
    assert torch.equal(pl.unpack(pl.pack(got, enc["weight_scale"])), want)


def test_hand_worked_bytes():
    """One 1 x 3 weight: codes, plane words and records computed by hand from the module docstring."""
    q = torch.tensor([[5, -16, 127]], dtype=torch.int8)
    lay = pl.pack(q, torch.tensor([1.0]))
    assert tuple(lay.planes.shape) == (1, 2, 640)  # K padded to one chunk of 512: two blocks
    # Codes (q + 16) & 31: 5 -> 21 (0b10101), -16 -> 0, 127 -> 15 (v5 = -1, fixup h = 4); padding -> 16.
    # Row 0 is g = 0, p0 = 0; columns 0, 1 are k-step 0 (G = 0, s = 0), t = 0, p1 = 0: pair p = 0 of word 0,
    # e = 0 -> bits 0..3, e = 1 -> bits 16..19. Pair p = 1 (row 8) and 2 (columns 8, 9) are padding: nibble 0.
    w = lay.planes.reshape(-1).to(torch.int64) & 0xFFFFFFFF
    assert int(w[0]) == (21 & 15) | (0 << 16)
    # Column 2 is t = 1 (lane 1): word 4 * 1 + 0 = 4, pair 0, e = 0 -> 15 at bits 0..3, e = 1 (column 3,
    # padding) -> 0.
    assert int(w[4]) == 15
    # Bit 4 of the codes: word 512 + 4 lane + G, bit 4 s + p + 16 e. Column 0 (21) has it; columns 1, 2 not.
    # Padding code 16 has it: lane 0 pairs 1..3 (both e) and column 1's partner pairs; lane 1 e = 1 of pair 0.
    assert int(w[512]) == 0b1111_1111_1111_1111_1111_1111_1111_1111 & ~(1 << 16)
    assert int(w[512 + 4]) == 0xFFFFFFFF & ~1
    assert lay.fx_pos.tolist() == [2] and lay.fx_h.tolist() == [4 + 3]  # h = 4 -> code h + 3; column bit 8 = 0
    assert lay.fx_base.tolist() == [0, 1] and lay.fx_ends.tolist() == [1] * 16
    assert lay.nbytes == 2 * 640 * 4 + 1 + 1 + 8 + 32 + 4


@pytest.mark.parametrize("dist,bound", [("seed-mix", 5.6), ("gaussian-2.5", 5.2)])
def test_bits_per_weight(dist, bound):
    q = seed_mix(256, 4096, seed=1) if dist == "seed-mix" else gaussian(256, 4096, 2.5, seed=1)
    if dist == "seed-mix":
        a = q.to(torch.int32).abs()
        assert abs(float((a <= 3).float().mean()) - 0.555) < 1e-4 and abs(float((a > 15).float().mean()) - 0.041) < 1e-4
    lay = pl.pack(q, torch.tensor([0.01]))
    assert lay.bits_per_weight <= bound, lay.bits_per_weight
    enc = int8x.encode(q, 0.01)
    if dist == "seed-mix":  # smaller than the stored streams with their block tables, so `auto` takes it
        assert pl.fits(lay, enc) and lay.nbytes < pl.stored_bytes(enc)


def test_auto_serves_a_real_models_mix_from_the_planes():
    """A real model's level mix (12 % of the weights beyond the 5-bit window) makes the planes 0.2 % larger than the
    stored streams, whose GEMV is several times slower: `auto` still takes the planes, up to AUTO_MARGIN more bytes."""
    q = real_mix(256, 4096, seed=1)
    a = q.to(torch.int32).abs()
    assert abs(float((a <= 3).float().mean()) - 0.33) < 1e-4 and abs(float((a > 15).float().mean()) - 0.13) < 1e-4
    enc = int8x.encode(q, 0.01)
    stored = pl.stored_bytes(enc)
    assert stored < pl.estimate_bytes(q) <= stored * (1 + pl.AUTO_MARGIN)
    lay = pl.for_serving(q, enc, layout="auto")
    assert lay is not None and torch.equal(pl.unpack(lay), q)


def test_layout_choice(monkeypatch):
    q = seed_mix(64, 512, seed=2)
    enc = int8x.encode(q, 0.01)
    monkeypatch.setenv(choose.ENV_INT8X_LAYOUT, "planes")
    assert torch.equal(pl.unpack(pl.for_serving(q, enc)), q)
    monkeypatch.setenv(choose.ENV_INT8X_LAYOUT, "streams")
    assert pl.for_serving(q, enc) is None
    wide = gaussian(64, 512, 60.0, seed=3)  # mostly fixups: larger than the streams
    assert pl.for_serving(wide, int8x.encode(wide, 0.01), layout="auto") is None


def _backend() -> str:
    return "cuda" if torch.cuda.is_available() else "torch"


@settings(**SETTINGS)
@given(q=int8_weights(max_n=20), dtype=st.sampled_from(DTYPES), data=st.data())
def test_torch_linear_matches_reference(q, dtype, data):
    x, layout = data.draw(activations(q.shape[1], dtype, "cpu", max_m=20))
    with poisoned_allocations():
        y = pl.linear(x, _layout(q), backend="torch")
    assert y.dtype == dtype and y.shape == (*x.shape[:-1], q.shape[0])
    assert_rel_close(y, _ref(x, q), LINEAR_BOUND[dtype], f"torch {layout} {dtype} q{tuple(q.shape)}",
                     accumulation_slack(x, q.float() * 0.0371))


def test_torch_linear_where_the_products_cancel():
    """One output whose 350 products cancel (to what rounding x to fp32 leaves, ~1e-9 of their scale): fp32
    accumulation misses it by more than 1e-5 of itself, so the relative bound alone fails a correct kernel and the
    accumulation slack judges it."""
    g = torch.Generator().manual_seed(21)
    q = seed_mix(1, 350, seed=21)
    w = q.to(torch.float64) * torch.tensor(0.0371, dtype=torch.float32).item()
    x = torch.randn(1, 350, generator=g, dtype=torch.float64)
    j = int(q[0].abs().argmax())
    x[0, j] -= (x @ w.t()).item() / w[0, j].item()
    x = x.to(torch.float32)
    ref = _ref(x, q)
    assert 0 < abs(ref.item()) < 1e-7 * (x.double().abs() @ w.abs().t()).item()
    y = pl.linear(x, _layout(q), backend="torch")
    slack = accumulation_slack(x, q.float() * 0.0371)
    with pytest.raises(AssertionError, match="> 1.0e-05"):
        assert_rel_close(y, ref, LINEAR_BOUND[torch.float32], "relative bound alone")
    assert_rel_close(y, ref, LINEAR_BOUND[torch.float32], "with the accumulation slack", slack)


def test_opcheck_cpu():
    q = seed_mix(17, 300, seed=4)
    lay = _layout(q)
    x = torch.randn(2, 3, 300)
    torch.library.opcheck(torch.ops.vllm_parity.int8x_planes_linear, (x, *lay.tensors, 17, 300, "torch"))


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="2-D int8"):
        pl.pack(torch.zeros(3, 4), torch.tensor([1.0]))
    lay = _layout(torch.zeros(2, 16, dtype=torch.int8))
    with pytest.raises(ValueError, match="x has 15 input features"):
        pl.linear(torch.randn(1, 15), lay, backend="torch")
    with pytest.raises(ValueError, match="backend 'cuda' needs CUDA tensors"):
        pl.linear(torch.randn(1, 16), lay, backend="cuda")
    with pytest.raises(ValueError, match=r"fx_ends must be a contiguous 1-D torch.int16"):
        pl.linear(torch.randn(1, 16), lay._replace(fx_ends=lay.fx_ends.int()), backend="torch")
    with pytest.raises(ValueError, match=r"planes has shape \(1, 2, 640\), expected \(1, 4, 640\)"):
        pl.linear(torch.randn(1, 600), lay._replace(k=600), backend="torch")


def test_cuda_config_validation():
    """Explicit GEMV configurations are checked on the host, without a GPU."""
    from vllm_parity.serving import int8x_planes_cuda as kc

    assert kc.resolve_config((8, 1), 4096) == (8, 1, 1, 2, 1)      # 8 chunks: one a warp; 2 blocks in flight
    assert kc.resolve_config((3, 2), 4096) == (3, 3, 2, 2, 1)      # 3 chunks a warp -> 3 warps
    assert kc.resolve_config((16, 1), 14336) == (14, 2, 1, 2, 1)   # 28 chunks
    assert kc.resolve_config({"warps": 4, "tiles_per_cta": 4}, 600) == (2, 1, 4, 2, 1)
    assert kc.resolve_config((4, 1, 3), 4096) == (4, 2, 1, 3, 1)   # 3 blocks in flight at M = 1
    assert kc.resolve_config({"warps": 4, "tiles_per_cta": 1, "stages": 3}, 4096) == (4, 2, 1, 3, 1)
    assert kc.resolve_config((4, 1, 3), 4096, m=5) == (4, 2, 1, 2, 1)  # more tokens always take 2
    # split along K over a cluster: ceil(chunks / (warps x splits)) chunks a warp, as few CTAs as that needs
    assert kc.resolve_config((1, 4, 2, 7), 14336, m=16) == (1, 4, 4, 2, 7)
    assert kc.resolve_config((2, 8, 2, 4), 14336, m=16) == (2, 4, 8, 2, 4)  # 7 runs: the last CTA has one
    assert kc.resolve_config((1, 16, 2, 8), 1024, m=16) == (1, 1, 16, 2, 2)  # 2 chunks: 2 CTAs
    assert kc.resolve_config({"warps": 2, "tiles_per_cta": 8, "splits": 3}, 4096, m=9) == (2, 2, 8, 2, 2)
    # the launch taken without a config (H200: 132 SMs): runs of 4 chunks a warp (M = 1: 2 up to 8 chunks, or 1
    # where runs of 2 leave fewer than 16 warps an SM; else 3) and 2 blocks in flight; at M = 2 .. 8 tiles a CTA as
    # 16 warps and half a CTA an SM allow; above 8 tokens one warp a tile, 8 tiles a CTA, the chunks over a cluster
    # along K in runs of 4, or fewer where that leaves fewer CTAs than SMs
    assert kc.default_config(1, 14336, 4096, 132) == (4, 2, 1, 2, 1)
    assert kc.default_config(1, 4096, 4096, 132) == (8, 1, 1, 2, 1)     # 256 tiles x 4 warps < 16 x 132
    assert kc.default_config(1, 8448, 4096, 132) == (4, 2, 1, 2, 1)     # 528 tiles x 4 warps = 16 x 132
    assert kc.default_config(1, 4096, 14336, 132) == (10, 3, 1, 2, 1)
    assert kc.default_config(1, 4096, 11008, 132) == (8, 3, 1, 2, 1)
    assert kc.default_config(4, 14336, 4096, 132) == (2, 4, 4, 2, 1)
    assert kc.default_config(16, 14336, 4096, 132) == (1, 4, 8, 2, 2)    # 112 x 2 CTAs
    assert kc.default_config(16, 4096, 14336, 132) == (1, 4, 8, 2, 7)    # 32 x 7 CTAs
    assert kc.default_config(9, 4096, 65536, 132) == (1, 16, 8, 2, 8)    # at most 8 CTAs a cluster
    assert kc.default_config(16, 4096, 4096, 132) == (1, 2, 8, 2, 4)     # runs of 2: 32 x 4 CTAs
    assert kc.default_config(5, 100, 600, 132) == (1, 2, 1, 2, 1)        # 7 tiles: one a CTA
    assert kc.default_config(16, 100, 600, 132) == (1, 1, 8, 2, 2)       # a chunk a CTA
    assert kc.default_config(16, 14336, 4096, 132, smem_max=40 * 1024) == (1, 4, 2, 2, 2)  # fewer tiles where less fits
    assert kc.default_config(16, 4096, 14336, 132, major=8) == (7, 4, 2, 2, 1)  # no clusters: 128 CTAs
    assert kc.default_config(16, 4096, 65536, 132, major=8) == (8, 16, 1, 2, 1)  # 8 warps at most (shared memory)
    assert kc.default_config(16, 14336, 4096, 132, smem_max=40 * 1024, major=8) == (1, 8, 2, 2, 1)  # fewer warps
    for bad, match in [((0, 1), "warps must be 1 .. 16"), ((17, 1), "warps must be 1 .. 16"),
                       ((4, 0), "tiles_per_cta must be 1 .. 16"), ((4, 17), "tiles_per_cta must be 1 .. 16"),
                       ((4, 1, 4), r"stages must be one of \(2, 3\)"), ((4, 1, 1), "stages must be one of"),
                       ((4, 1, 2, 0), "splits must be 1 .. 8"), ((4, 1, 2, 9), "splits must be 1 .. 8"),
                       ({"warps": 4, "splits": 9}, "splits must be 1 .. 8"),
                       ((4,), "ints"), ((4.0, 1), "ints"), ("8x1", "ints"), ((4, 1, 3, 1, 1), "ints"),
                       ((4, 1, True), "ints"), ((True, 1), "ints"), ((4, 1, None, 2), "ints"),
                       ({"warps": 4, "splits": 2.0}, "ints")]:
        with pytest.raises(ValueError, match=match):
            kc.resolve_config(bad, 4096)
    with pytest.raises(ValueError, match="1024 threads for K=4096, more than the kernel's 512"):
        kc.resolve_config((8, 4), 4096)
    with pytest.raises(ValueError, match="1024 threads for K=4096, more than the kernel's 512"):
        kc.resolve_config((4, 8, 2, 2), 4096)  # 4 warps a tile in each of 2 CTAs, 8 tiles
    # shared memory, as the kernel lays it out: x staged per warp of a tile (one token: a row of 520 elements and
    # the chunk again in B-fragment order, 1024 bytes; 8 or 16 tokens: the chunk's 512 columns transposed), per
    # warp 1568 bytes of records and 2 (or 3 at one token, where asked) blocks of 2560 bytes, or the reduction's
    # bytes if more: (16 rows x tokens + 1) x 4 per warp, then 16 rows x tokens x 4 per tile (the CTA's partials)
    assert kc.smem_bytes(1, 8, 1) == 8 * (1040 + 1024) + 8 * (1568 + 2 * 2560)
    assert kc.smem_bytes(1, 8, 1, 3) == 8 * (1040 + 1024) + 8 * (1568 + 3 * 2560)
    assert kc.smem_bytes(5, 4, 2, 3) == kc.smem_bytes(5, 4, 2)  # more tokens: 2 blocks whatever stages says
    assert kc.smem_bytes(5, 4, 2) == 4 * 8 * 1024 + 8 * (1568 + 2 * 2560)
    assert kc.smem_bytes(16, 16, 1) == 16 * 16 * 1024 + 16 * (1568 + 2 * 2560) > 227 * 1024  # the device cannot
    assert kc.smem_bytes(16, 1, 4) == 16 * 1024 + 4 * (1568 + 2 * 2560)
    assert kc.smem_bytes(16, 1, 16) == 16 * 1024 + 16 * (1568 + 2 * 2560)
    assert kc.smem_bytes(1, 1, 16) == max(1040 + 1024 + 16 * (1568 + 2 * 2560), (16 * 17 + 16 * 16) * 4)
    assert kc.smem_bytes(1, 1, 1) == max(1040 + 1024 + 1568 + 2 * 2560, (17 + 16) * 4)


def test_cuda_split_along_k_needs_clusters(monkeypatch):
    """A config that splits K over a cluster of CTAs is refused in Python on a device before compute capability 9
    (an error raised inside the extension ends the process on some CUDA images)."""
    from vllm_parity.serving import int8x_planes_cuda as kc

    monkeypatch.setattr(kc, "device_limits", lambda device: (108, 163 * 1024, 8))
    lay = _layout(seed_mix(16, 1024, seed=3))
    with pytest.raises(ValueError, match=r"config \(1, 4, 2, 2\) splits K over a cluster of CTAs, which needs compute "
                                         "capability 9, the device has 8"):
        kc.linear(torch.randn(16, 1024, dtype=torch.bfloat16), lay, config=(1, 4, 2, 2))


# -- GPU ------------------------------------------------------------------------------------------



def _cuda_ready():
    from vllm_parity.serving import int8x_planes_cuda

    if not int8x_planes_cuda.available():
        pytest.skip("the int8x planes CUDA kernels need nvcc")
    return int8x_planes_cuda


@pytest.mark.gpu
@requires_gpu
@settings(**SETTINGS)
@given(q=int8_weights(), dtype=st.sampled_from([torch.float16, torch.bfloat16]), data=st.data())
def test_gpu_linear_matches_torch(q, dtype, data):
    kc = _cuda_ready()
    x, layout = data.draw(activations(q.shape[1], dtype, "cuda", max_m=40))
    lay = _layout(q, device="cuda")
    with poisoned_allocations():
        y = pl.linear(x, lay, backend="cuda")
    assert_rel_close(y, _ref(x, q), LINEAR_BOUND[dtype], f"cuda {layout} {dtype} q{tuple(q.shape)}",
                     accumulation_slack(x, q.float() * 0.0371))
    x2 = x.reshape(-1, q.shape[1])
    with poisoned_allocations():  # the GEMV kernel itself for every M (grid.y slices of 16 rows)
        y2 = kc.linear(x2, lay)
    assert_rel_close(y2, _ref(x2, q), LINEAR_BOUND[dtype], f"cuda gemv {layout} {dtype} q{tuple(q.shape)}",
                     accumulation_slack(x2, q.float() * 0.0371))


def _fixup_heavy(n: int, k: int, seed: int) -> torch.Tensor:
    """The seed mix with the extremes and whole rows of fixups, so every row and chunk has records."""
    q = seed_mix(n, k, seed=seed)
    q[0, 0], q[-1, -1], q[n // 2, :] = -128, 127, 64
    q[:, k // 2] = -100
    return q


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_linear_every_m(dtype):
    """M = 1 .. 40 one by one (staged x of 1, 8 or 16 tokens, zero tokens past M, grid.y slices), K past a chunk
    boundary (1104: 16-byte staging; 1037: not a multiple of 8, elementwise), N past a tile; contiguous x and x with a
    row stride that is not 16-byte aligned."""
    kc = _cuda_ready()
    g = torch.Generator().manual_seed(11)
    for n, k in [(50, 1104), (33, 1037)]:
        q = _fixup_heavy(n, k, seed=n)
        lay = _layout(q, device="cuda")
        for m in range(1, 41):
            wide = torch.randn(m, k + 3, generator=g).to("cuda", dtype)
            for x in (wide[:, :k].contiguous(), wide[:, :k]):
                with poisoned_allocations():
                    y = kc.linear(x, lay)
                assert_rel_close(y, _ref(x, q), LINEAR_BOUND[dtype], f"M={m} {dtype} q{tuple(q.shape)} "
                                 f"stride {x.stride()}")


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_linear_every_weight_a_fixup(dtype):
    """Every weight beyond -16..15: 8192 records a chunk, eight windows of staged records per warp."""
    kc = _cuda_ready()
    g = torch.Generator().manual_seed(16)
    mag = torch.randint(16, 128, (48, 1536), generator=g)
    q = torch.where(torch.rand(48, 1536, generator=g) < 0.5, -mag, mag.clamp(max=127)).to(torch.int8)
    lay = _layout(q, device="cuda")
    assert lay.fixups == (q.to(torch.int32) != -16).sum().item()
    for m in (1, 5, 16):
        x = torch.randn(m, 1536, generator=g).to("cuda", dtype)
        for config in (None, (1, 1), (3, 2)):
            with poisoned_allocations():
                y = kc.linear(x, lay, config=config)
            assert_rel_close(y, _ref(x, q), LINEAR_BOUND[dtype], f"M={m} {dtype} config {config}")


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_linear_record_windows_above_one_token(dtype):
    """Above one token, a tile's chunk of records in one staged window (at most 1024) or in several, each record
    reading its column's tokens from the transposed x: chunks of 1350, the seed mix's few, exactly 1024 and 1025
    records, and chunks with none."""
    kc = _cuda_ready()
    g = torch.Generator().manual_seed(21)
    n, k = 40, 5 * 512
    q = seed_mix(n, k, seed=22)
    q[:, 2 * 512:] = q[:, 2 * 512:].clamp(-16, 15)  # chunks 2 .. 4 without records

    def fill(tile, chunk, idx, value):  # weights idx (row-major in the tile's chunk) to value
        q[16 * tile + idx // 512, 512 * chunk + idx % 512] = value

    fill(0, 0, torch.arange(1100), 100)
    fill(0, 2, torch.randperm(8192, generator=g)[:1024], -77)
    fill(1, 2, torch.randperm(8192, generator=g)[:1025], 90)
    lay = _layout(q, device="cuda")
    for m in (2, 8, 9, 16):
        x = torch.randn(m, k, generator=g).to("cuda", dtype)
        for config in (None, (1, 8, 2, 4), (5, 1), (2, 2)):
            with poisoned_allocations():
                y = kc.linear(x, lay, config=config)
            assert_rel_close(y, _ref(x, q), LINEAR_BOUND[dtype], f"M={m} {dtype} config {config}")


GPU_CONFIGS = [(1, 1), (2, 1), (3, 1), (8, 1), (16, 1), (1, 2), (2, 2), (3, 3), (4, 4), (8, 2), (4, 2), (1, 1, 3),
               (3, 1, 3), (16, 1, 3), (2, 2, 3), (1, 8), (2, 8), (1, 16), (1, 2, 2, 2), (2, 4, 2, 4), (1, 8, 2, 8),
               (1, 16, 2, 8), (3, 3, 2, 2), (1, 1, 3, 4), (2, 1, 2, 3)]


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("config", GPU_CONFIGS, ids=["w{}t{}".format(*c) + "".join(f"{k}{v}" for k, v in zip("sk", c[2:]))
                                                     for c in GPU_CONFIGS])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_linear_configs(config, dtype):
    """Explicit (warps, tiles_per_cta[, stages[, splits]]) against the reference for M in 1, 5, 8, 9, 16, 23, 40: 7
    tiles (a partial last CTA for 2, 3, 4, 8 tiles a CTA, tiles past N in a CTA of 8 or 16), 6 chunks (uneven runs;
    split over 2 to 6 CTAs of a cluster, some with an idle warp)."""
    kc = _cuda_ready()
    g = torch.Generator().manual_seed(12)
    n, k = 100, 2600
    q = _fixup_heavy(n, k, seed=13)
    lay = _layout(q, device="cuda")
    for m in (1, 5, 8, 9, 16, 23, 40):
        x = torch.randn(m, k, generator=g).to("cuda", dtype)
        with poisoned_allocations():
            y = kc.linear(x, lay, config=config)
        assert_rel_close(y, _ref(x, q), LINEAR_BOUND[dtype], f"config {config} M={m} {dtype}")


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("m", [1, 9, 16])
def test_gpu_linear_split_along_k_is_deterministic(m):
    """A cluster's CTAs add their partial sums in rank order: the same bits on every call."""
    kc = _cuda_ready()
    g = torch.Generator().manual_seed(16)
    q = seed_mix(256, 8 * 512, seed=17)
    lay = _layout(q, device="cuda")
    x = torch.randn(m, 8 * 512, generator=g).to("cuda", torch.bfloat16)
    ys = [kc.linear(x, lay, config=(1, 4, 2, 8)) for _ in range(4)]
    assert_rel_close(ys[0], _ref(x, q), LINEAR_BOUND[torch.bfloat16], f"split over 8 CTAs, M={m}")
    for y in ys[1:]:
        assert torch.equal(y, ys[0])


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("m", [1, 5, 16])
def test_gpu_linear_dependent_launch_waits_for_its_input(m):
    """Two GEMVs chained in a CUDA graph, each a programmatic dependent launch on compute capability 9: the second
    reads the first's output only after it is written (both outputs hold NaN before every replay)."""
    kc = _cuda_ready()
    g = torch.Generator().manual_seed(15)
    q = seed_mix(1024, 1024, seed=16)
    lay = _layout(q, scale=0.01, device="cuda")
    x = torch.randn(m, 1024, generator=g).to("cuda", torch.bfloat16)
    kc.linear(kc.linear(x, lay), lay)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y1 = kc.linear(x, lay)
        y2 = kc.linear(y1, lay)
    for i in range(3):
        y1.fill_(float("nan"))
        y2.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_rel_close(y1, _ref(x, q, 0.01), LINEAR_BOUND[torch.bfloat16], f"first GEMV, replay {i}")
        assert_rel_close(y2, _ref(y1, q, 0.01), LINEAR_BOUND[torch.bfloat16], f"second GEMV, replay {i}")


@pytest.mark.gpu
@requires_gpu
def test_gpu_linear_config_too_much_shared_memory():
    kc = _cuda_ready()
    q = seed_mix(16, 16 * 512, seed=14)
    lay = _layout(q, device="cuda")
    x = torch.randn(16, 16 * 512, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bytes of shared memory"):  # raised before the launch, in Python
        kc.linear(x, lay, config=(16, 1))  # 16 warps x 16 staged tokens
    assert_rel_close(kc.linear(x, lay, config=(8, 1)), _ref(x, q), LINEAR_BOUND[torch.bfloat16], "8 warps")


@pytest.mark.gpu
@requires_gpu
def test_gpu_records_not_on_a_16_byte_boundary_are_refused():
    kc = _cuda_ready()
    q = seed_mix(32, 1024, seed=15)
    lay = _layout(q, device="cuda")
    assert lay.fixups > 0
    shifted = torch.empty(lay.fx_pos.numel() + 1, dtype=torch.uint8, device="cuda")[1:]
    shifted.copy_(lay.fx_pos)
    x = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="fx_pos must start on a 16-byte boundary"):
        kc.linear(x, lay._replace(fx_pos=shifted))
    assert_rel_close(kc.linear(x, lay._replace(fx_pos=shifted.clone())), _ref(x, q), LINEAR_BOUND[torch.bfloat16],
                     "cloned")


@pytest.mark.gpu
@requires_gpu
@settings(**SETTINGS)
@given(q=int8_weights(), dtype=st.sampled_from(DTYPES))
def test_gpu_decode_is_exact(q, dtype):
    kc = _cuda_ready()
    with poisoned_allocations():
        w = kc.decode(_layout(q, device="cuda"), dtype)
    want = (q.to(torch.float32) * torch.tensor(0.0371)).to(dtype)
    assert torch.equal(w.cpu(), want), f"{int((w.cpu() != want).sum())} elements differ, q{tuple(q.shape)} {dtype}"


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("m", [1, 7, 16, 40])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_large_sync_free_and_graphed(m, dtype):
    _cuda_ready()
    g = torch.Generator().manual_seed(3)
    q = seed_mix(1000, 4096, seed=5)
    q[0, 0], q[-1, -1], q[5, :], q[6, :] = -128, 127, 64, 0
    lay = _layout(q, device="cuda")
    x = torch.randn(m, 4096, generator=g).to("cuda", dtype)
    pl.linear(x, lay)  # build outside the checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host sync inside the op raises
    try:
        with poisoned_allocations():
            y = pl.linear(x, lay)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert_rel_close(y, _ref(x, q), LINEAR_BOUND[dtype] * 4, f"gpu M={m} {dtype}")
    if m > 16:
        return
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        pl.linear(x, lay)
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        yg = pl.linear(x, lay)
    x.copy_(torch.randn(m, 4096, generator=g).to("cuda", dtype))
    graph.replay()
    torch.cuda.synchronize()
    assert_rel_close(yg, _ref(x, q), LINEAR_BOUND[dtype] * 4, f"gpu graph replay M={m} {dtype}")


@pytest.mark.gpu
@requires_gpu
def test_gpu_nan_propagates_and_3d_noncontiguous():
    _cuda_ready()
    q = seed_mix(48, 1024, seed=6)
    lay = _layout(q, device="cuda")
    x = torch.randn(2, 3, 1024, 2, device="cuda", dtype=torch.bfloat16)[..., 0]  # 3-D, column stride 2
    x[0, 1, 17] = float("nan")
    y = pl.linear(x, lay)
    assert torch.isnan(y[0, 1]).all() and torch.isfinite(y[0, 0]).all() and torch.isfinite(y[1]).all()
    x[0, 1, 17] = 0
    assert_rel_close(pl.linear(x, lay), _ref(x, q), LINEAR_BOUND[torch.bfloat16], "3-D non-contiguous")


@pytest.mark.gpu
@requires_gpu
def test_gpu_opcheck():
    _cuda_ready()
    q = seed_mix(17, 300, seed=4)
    lay = _layout(q, device="cuda")
    x = torch.randn(2, 3, 300, device="cuda", dtype=torch.float16)
    torch.library.opcheck(torch.ops.vllm_parity.int8x_planes_linear, (x, *lay.tensors, 17, 300, "cuda"))
