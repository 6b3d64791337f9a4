"""CUDA ternary kernels (``csrc/ternary.cu``): naive, vectorized, tensor-core (tiled layout), dequantize; and
the GEMM on the tiles for many tokens (``csrc/ternary_gemm.cu``, wgmma: compute capability 9.0 only).

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
gemm_extension = LazyExtension("vllm_parity_ternary_gemm", "ternary_gemm.cu", "the ternary GEMM (wgmma)")
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
    - ``gemm(x, tiles, scale, bias, n, k, group_size, act_quant)``: the GEMM on the tiles (``csrc/ternary_gemm.cu``,
      its launch chosen in C++), where it runs (:func:`gemm_supported`).
    """
    global _fakes_done
    if not _fakes_done:
        extension()
        if gemm_supported():
            gemm_extension()
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

    if gemm_supported():
        @torch.library.register_fake("parity_ternary::gemm")
        def _gemm_fake(x, tiles, scale, bias, n, k, group_size, act_quant):
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
    """The dense weight ``(N, K)`` in ``dtype`` (scale folded in) from the tiled layout; its arguments are checked
    here first, as :func:`linear_mma`'s are."""
    op = "ternary dequant_tiles"
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"{op}: dtype must be fp16, bf16 or fp32, got {dtype}")
    _check_weight_args(tiles, scale, n, k, False, op)
    groups = scale.shape[1]
    if groups != 1 and (group_size <= 0 or groups * group_size != k):
        raise ValueError(f"{op}: scale has {groups} groups, group size {group_size}, K={k}: expected one scale a "
                         f"row or K / group size a row")
    _check_one_cuda_device(op, tiles=tiles, scale=scale)
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


def mma_config(m: int, n: int, k: int, rows: bool = False, group_size: int = 0) -> dict:
    """Row tiles per block, token fragments, warps, loads in flight and launch of the tensor-core kernel.

    ``pdl`` makes it a programmatic dependent launch: it starts, and reads its first weights, during the
    previous kernel's tail, and waits for that kernel only before reading x (default on compute
    capability 9 and later unless ``PARITY_MMA_PDL=0``). From the H200 sweeps in
    benchmarks/NOTES.md: up to 8 tokens, blocks of 16 warps, as many row tiles per block as leave at
    least 1.2 blocks per multiprocessor (0.9 above 4 tokens: each tile more shares the loads of x), and
    8 loads in flight where the grid has no more blocks than multiprocessors (registers then do not
    limit residency); 9-16 tokens, a block per multiprocessor and 16 warps a block where the blocks make one wave,
    else 8 (at most a warp a 128-input chunk; with group scales a warp for every four chunks), except at
    12-16 tokens on the tiles without group scales where K <= 6144 and one-fragment blocks make at most 1.5
    waves: there one token fragment a block (two blocks along M), 16 warps, 8 loads in flight where the
    blocks make one wave (the sweeps at 12-16 tokens: 1.01-1.22x);
    above, 4 tiles and up to 8 warps per block. On the row layout (``rows``) up to 8 tokens: as many tiles as
    leave 0.9 blocks per multiprocessor, a warp for every two 256-input chunks (up to 16), 4 loads in flight;
    9-16 tokens: 4 tiles a block (the H200 sweep of the row layout in benchmarks/NOTES.md). With ``group_size``
    scales at 4 tiles and one fragment, at most 8 warps: that kernel takes 80 registers (84-100 where the scales
    are loaded with the weights instead of staged in shared memory), so a 16-warp block would be alone on its
    multiprocessor (the H100 A/Bs in benchmarks/NOTES.md).
    """
    sms = _num_sms()
    nt, kc = -(-n // 16), -(-k // 128)

    def tiles(min_blocks: float) -> int:
        tn = 4
        while tn > 1 and -(-nt // tn) < min_blocks:
            tn //= 2
        return tn

    launch = {"loads": 4, "pdl": _pdl_supported() and os.environ.get(ENV_PDL, "1") != "0"}
    # One token fragment a block: ceil(M / 8) blocks along M, the row tiles shared out so that all of them together
    # leave the blocks a multiprocessor asked for.
    mblocks = -(-m // 8)
    tn1 = tiles((1.2 if m <= 4 else 0.9) * sms / mblocks)
    blocks1 = mblocks * -(-nt // tn1)
    if m <= 8 and rows:
        cfg = {"tn": tiles(0.9 * sms), "mb": 1, "warps": max(1, min(16, -(-k // 256) // 2)), **launch}
    elif m <= 8 or (12 <= m <= 16 and not (rows or group_size) and kc <= 48 and blocks1 <= 1.5 * sms):
        cfg = {"tn": tn1, "mb": 1, "warps": max(1, min(16, kc)), **launch, "loads": 8 if blocks1 <= sms else 4}
    elif m <= 16:
        tn = 4 if rows else tiles(0.9 * sms)
        if rows or group_size:  # a warp for every four chunks
            warps = max(1, min(16, kc // 4))
        else:  # 16 warps where the blocks make one wave, else 8, a chunk a warp at least
            warps = min(16 if -(-nt // tn) <= sms else 8, kc)
        cfg = {"tn": tn, "mb": 2, "warps": warps, **launch}
    else:
        cfg = {"tn": 4, "mb": 2, "warps": max(1, min(8, kc // 4)), **launch}
    if group_size and cfg["mb"] == 1 and cfg["tn"] == 4:
        cfg["warps"] = min(cfg["warps"], 8)
    return cfg


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


def _check_weight_args(w: torch.Tensor, scale: torch.Tensor, n: int, k: int, rows: bool, op: str) -> str:
    """The weight's and scale's preconditions of the extension as ValueErrors naming the argument (not their device);
    ``w`` the tiles, or the row layout (``rows``). Returns the weight's name."""
    what, want = ("qweight", (n, -(-k // 16))) if rows else ("tiles", (-(-n // 16), -(-k // 128), 32, 4))
    if w.dtype != torch.int32 or tuple(w.shape) != want or not w.is_contiguous():
        raise ValueError(f"{op}: {what} must be contiguous int32 {want} for N={n} K={k}, got "
                         f"{w.dtype} {tuple(w.shape)}")
    if not rows and w.data_ptr() % 16:
        raise ValueError(f"{op}: tiles must start 16-byte aligned (a lane's tile is one 16-byte load), got an "
                         f"address {w.data_ptr() % 16} bytes past")
    if scale.dtype != torch.float32 or scale.dim() != 2 or scale.shape[0] != n or not scale.is_contiguous():
        raise ValueError(f"{op}: scale must be contiguous fp32 (N={n}, G), got {scale.dtype} "
                         f"{tuple(scale.shape)}")
    return what


def _check_mma_args(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, n: int, k: int, group_size: int,
                    rows: bool = False, op: str = "ternary mma kernel") -> None:
    """The extension's preconditions as Python errors of the usual types, naming the argument (the device
    last, so that everything else is checked wherever the tensors live); ``w`` the tiles, or the row layout
    (``rows``); ``op`` the kernel the messages name."""
    if x.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"{op}: x must be fp16 or bf16, got {x.dtype}")
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"{op}: x must be (M, K={k}), got {tuple(x.shape)}")
    what = _check_weight_args(w, scale, n, k, rows, op)
    if group_size % 128:
        raise ValueError(f"{op}: group size {group_size} is not a multiple of 128")
    _check_one_cuda_device(op, x=x, **{what: w}, scale=scale)


def _check_one_cuda_device(op: str, **tensors: torch.Tensor) -> None:
    """A ValueError naming the arguments unless all of them are on one CUDA device."""
    devices = [t.device for t in tensors.values()]
    if devices[0].type != "cuda" or any(d != devices[0] for d in devices):
        *first, last = tensors
        raise ValueError(f"{op}: {', '.join(first)} and {last} must be on one CUDA device, got "
                         f"{', '.join(map(str, devices))}")


def linear_mma(x: torch.Tensor, tiles: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, n: int, k: int,
               group_size: int, act_quant: bool, config: dict | None = None, rows: bool = False) -> torch.Tensor:
    """``y = x @ W^T (+ bias)`` on the tiled layout with tensor cores, or on the row layout (``rows``: ``tiles`` is
    then ``NativeTernary.qweight``); x fp16 or bf16 (M, K)."""
    _check_mma_args(x, tiles, scale, n, k, group_size, rows)
    if x.stride(-1) != 1:
        x = x.contiguous()
    cfg = _fit_instance(dict(mma_config(x.shape[0], n, k, rows, group_size), **(config or {})), group_size)
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


@torch.compiler.assume_constant_result  # compiled callers see a constant, not a device query
def gemm_supported() -> bool:
    """Whether the GEMM on the tiles runs here: wgmma, built for sm_90a, needs compute capability 9.0."""
    return available() and _capability() == (9, 0)


@functools.lru_cache(maxsize=None)
def _capability() -> tuple[int, int]:
    return torch.cuda.get_device_capability(torch.cuda.current_device())


def tile_order(k: int) -> torch.Tensor:
    """Where each input of K sits in the tiles' k order (the GEMM's copy of x): input 128 c + r at 128 c + p(r),
    with lane t = r // 32, step s = (r // 4) % 8, element e = r % 4 of a chunk at column 2 t + e (e < 2) or
    8 + 2 t + e - 2 of step s (the mma.m16n8k16 A fragment that lane's tile uint4 decodes to)."""
    r = torch.arange(128)
    t, s, e = r // 32, (r // 4) % 8, r % 4
    pos = 16 * s + torch.where(e < 2, 2 * t + e, 8 + 2 * t + e - 2)
    kc = -(-k // 128)
    return (torch.arange(kc).unsqueeze(1) * 128 + pos).reshape(-1)[:k]


# (bn, wg, stages) compiled: tokens and warpgroups (64 rows each) a block, shared-memory stages.
GEMM_INSTANCES = ((64, 1, 4), (64, 1, 6), (64, 2, 4), (64, 4, 4), (128, 1, 3), (128, 2, 3), (128, 2, 4), (128, 4, 3),
                  (128, 4, 4))
GEMM_GROUP_INSTANCES = ((64, 1, 4), (64, 2, 4), (128, 2, 3))  # with group scales
# the warp-specialized kernel (``ws``: A through shared memory, a producer and wg consumer warpgroups), no group
# scales, its stages whole 128-input chunks at 128 tokens and halves at 256; it serves one scale a row from
# GEMM_WS_MIN_M tokens (benchmarks/NOTES.md)
GEMM_WS_INSTANCES = ((128, 2, 3), (256, 2, 4))
GEMM_WS_MIN_M = 128
WS_128_COST = 1.25  # a token of the 128-token ws instance against the 256-token one's (H100 sweep, NOTES)


def gemm_config(m: int, n: int, k: int, group_size: int = 0, ws: bool | None = None) -> dict:
    """Tokens (bn) and warpgroups (wg, 64 rows each) a block, pipeline stages, split of K and kernel (ws: the
    warp-specialized one) of the GEMM, the rule of the C++ op (``gemm_auto_config``). One scale a row from
    GEMM_WS_MIN_M tokens: ws, blocks of 128 tokens x 128 rows up to 128 tokens; above, 128 or 256 tokens, whichever
    takes fewer waves of blocks x tokens a block / split, a 128-token block's token counted 1.25 times (WS_128_COST).
    Else up to 64 tokens blocks of 64 tokens x 256 rows (x 128 with group scales), above 128 x 128. K split in two
    until the grid would pass the blocks a multiprocessor holds (2 of the register-A kernel's 128 x 128 without
    group scales, else 1), at most 8 ways and 8 chunks a split. From the sweeps in benchmarks/NOTES.md. ``ws``
    False: the register-A kernel's launch whatever M (benchmarks compare the two)."""
    sms, kc = _num_sms(), -(-k // 128)

    def blocks_split(bn: int, wg: int, per_sm: int) -> tuple[int, int]:
        blocks, split = -(-n // (64 * wg)) * -(-m // bn), 1
        while split < 8 and blocks * split * 2 <= per_sm * sms and kc // (split * 2) >= 8:
            split *= 2
        return blocks * split, split

    if not group_size and m >= GEMM_WS_MIN_M and ws is not False:
        grids = {bn: blocks_split(bn, 2, 1) for bn in (128, 256)}
        cost = {bn: -(-blocks // sms) * bn / split * (WS_128_COST if bn == 128 else 1.0)
                for bn, (blocks, split) in grids.items()}
        bn = 128 if m <= 128 or cost[128] < cost[256] else 256
        return {"bn": bn, "wg": 2, "stages": 3 if bn == 128 else 4, "split": grids[bn][1], "ws": True}
    bn, wg, stages = (64, 2 if group_size else 4, 4) if m <= 64 else (128, 2, 3)
    per_sm = 2 if (bn, wg) == (128, 2) and not group_size else 1
    return {"bn": bn, "wg": wg, "stages": stages, "split": blocks_split(bn, wg, per_sm)[1], "ws": False}


def gemm_cpp_config(m: int, n: int, k: int, group_size: int) -> dict:
    """The launch the C++ op ``parity_ternary.gemm`` chooses for this shape (for tests)."""
    bn, wg, stages, split, ws = gemm_extension().gemm_auto_config(m, n, k, group_size)
    return {"bn": bn, "wg": wg, "stages": stages, "split": split, "ws": bool(ws)}


def linear_gemm(x: torch.Tensor, tiles: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, n: int, k: int,
                group_size: int, act_quant: bool, config: dict | None = None) -> torch.Tensor:
    """``y = x @ W^T (+ bias)`` on the tiled layout with the weight decoded inside the GEMM (wgmma); x fp16 or
    bf16 (M, K), any strides; group sizes a multiple of 128 (0: one scale a row)."""
    _check_mma_args(x, tiles, scale, n, k, group_size, op="ternary gemm")
    if not gemm_supported():
        raise RuntimeError("ternary gemm needs a GPU of compute capability 9.0 (wgmma) and nvcc")
    cfg = dict(gemm_config(x.shape[0], n, k, group_size), **(config or {}))
    ws = bool(cfg.get("ws", False))
    if ws and group_size:
        raise ValueError("ternary gemm: the warp-specialized kernel (ws) takes one scale a row, not group scales")
    instances = GEMM_WS_INSTANCES if ws else GEMM_GROUP_INSTANCES if group_size else GEMM_INSTANCES
    if (cfg["bn"], cfg["wg"], cfg["stages"]) not in instances:
        raise ValueError(f"ternary gemm: no instance for {cfg}{' with group scales' if group_size else ''}; "
                         f"compiled (bn, wg, stages): {instances}")
    if int(cfg["split"]) < 1:
        raise ValueError(f"ternary gemm: split must be >= 1, got {cfg['split']}")
    return gemm_extension().gemm(x, tiles, scale, bias, n, k, group_size, act_quant, cfg["bn"], cfg["wg"],
                                 cfg["stages"], int(cfg["split"]), ws)
