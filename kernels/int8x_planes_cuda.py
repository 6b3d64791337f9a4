"""CUDA kernels for the int8x planes layout (``csrc/int8x_planes.cu``): fused decode-GEMV and decode.

The extension is built with ``torch.utils.cpp_extension.load`` on first use, never at import, so importing this
module works on machines without nvcc or a GPU. The kernels take the layout's tensors as
:func:`vllm_parity.serving.int8x_planes.check` accepts them; they read no tensor value on the host and run on the
current stream, so they can be captured in CUDA graphs.
"""

from __future__ import annotations

import functools

import torch

from vllm_parity.serving.cuda_build import LazyExtension, available  # noqa: F401  (available: re-exported)
from vllm_parity.serving.int8x_planes import Int8xPlanes, check

__all__ = ["available", "extension", "decode", "linear", "resolve_config", "default_config", "device_limits",
           "smem_bytes"]

# Launch bound of the GEMV kernels (csrc/int8x_planes.cu, MAX_THREADS): threads a CTA.
MAX_THREADS = 512
MAX_TILES_PER_CTA = 16
MAX_WARPS = 16
# CTAs of a cluster that split a tile's chunks along K (compute capability 9; csrc MAX_SPLITS).
MAX_SPLITS = 8
# Blocks of the plane in flight per warp (cp.async), the one computed included: 2 or 3 at one token, 2 for more.
STAGES = (2, 3)
# Shared memory of a CTA (csrc/int8x_planes.cu, linear_smem): each warp of a tile stages x for its chunk run
# (one token: a row of XSTRIDE elements and the chunk again in B-fragment order; XT = 8 or 16 tokens: the chunk
# transposed, XT tokens a column), every warp its records
# (16-byte vectors of positions and codes) and its blocks of the plane in flight (STAGES); the reduction reuses
# the same bytes.
XSTRIDE, REC_BYTES, BLOCK_BYTES, TILE_ROWS, CHUNK = 512 + 8, 65 * 16 + 33 * 16, 640 * 4, 16, 512

extension = LazyExtension("vllm_parity_int8x_planes", "int8x_planes.cu", "int8x planes CUDA kernels")


def _check_cuda(layout: Int8xPlanes, *tensors: torch.Tensor) -> None:
    for t in (*layout.tensors, *tensors):
        if t.device.type != "cuda":
            raise ValueError(f"int8x planes cuda kernels need CUDA tensors, got {t.device}; use the torch backend")
    check(layout.tensors, layout.n, layout.k)
    # The GEMV copies the records in 16-byte vectors (checked here: an error raised inside the extension ends the
    # process on some CUDA images).
    for name in ("fx_pos", "fx_h"):
        t = getattr(layout, name)
        if t.data_ptr() % 16:
            raise ValueError(f"int8x planes cuda kernels: {name} must start on a 16-byte boundary, got address "
                             f"{t.data_ptr():#x} (a view into a larger tensor?); pass .clone()")


def decode(layout: Int8xPlanes, dtype: torch.dtype = torch.bfloat16, out: torch.Tensor | None = None) -> torch.Tensor:
    """The dense weight ``q * scale`` (n, k) in ``dtype`` (fp32, fp16 or bf16), or written into ``out``.

    One warp per block of 16 rows x 256 columns, 8 warps a CTA; rows are written with 16-byte stores where the
    row length allows (K * element size a multiple of 16), elementwise otherwise."""
    if out is None:
        out = torch.empty((layout.n, layout.k), dtype=dtype, device=layout.planes.device)
    elif tuple(out.shape) != (layout.n, layout.k) or not out.is_contiguous():
        raise ValueError(f"int8x planes cuda decode: out must be contiguous ({layout.n}, {layout.k}), got "
                         f"{tuple(out.shape)} strides {out.stride()}")
    _check_cuda(layout, out)
    extension().decode(*layout.tensors, layout.n, layout.k, out)
    return out


def _parse(config) -> tuple[int, int, int | None, int]:
    """(warps, tiles_per_cta, stages or None, splits) of a config tuple or dict."""
    if isinstance(config, dict):
        warps, tpc, stages, splits = (config.get("warps"), config.get("tiles_per_cta", 1), config.get("stages"),
                                      config.get("splits", 1))
        values = (warps, tpc, splits) + ((stages,) if stages is not None else ())
    elif isinstance(config, (tuple, list)) and len(config) in (2, 3, 4):
        warps, tpc = config[0], config[1]
        stages = config[2] if len(config) > 2 else None
        splits = config[3] if len(config) > 3 else 1
        values = tuple(config)
    else:
        values = (None,)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ValueError(f"int8x planes cuda linear: config must be (warps, tiles_per_cta[, stages[, splits]]), ints, "
                         f"got {config!r}")
    return warps, tpc, stages, splits


def resolve_config(config, k: int, m: int = 1) -> tuple[int, int, int, int, int]:
    """The launch an explicit ``config = (warps, tiles_per_cta[, stages[, splits]])`` gives for ``k`` columns and
    ``m`` tokens: ``(warps_per_tile, chunks_per_warp, tiles_per_cta, stages, splits)``. A tile's ceil(k / 512)
    chunks are split along K over a cluster of ``splits`` CTAs (default 1; compute capability 9), each with at most
    ``warps`` warps a tile: ceil(chunks / (warps * splits)) chunks a warp, as few warps and CTAs as that needs.
    ``stages``: blocks of the plane in flight per warp at one token, 2 (the default) or 3; more tokens always
    take 2. ``ValueError`` for a config the kernels cannot launch (shared memory is checked at the launch, against the
    device)."""
    warps, tpc, stages, splits = _parse(config)
    if not 1 <= warps <= MAX_WARPS:
        raise ValueError(f"int8x planes cuda linear: config warps must be 1 .. {MAX_WARPS}, got {warps}")
    if not 1 <= tpc <= MAX_TILES_PER_CTA:
        raise ValueError(f"int8x planes cuda linear: config tiles_per_cta must be 1 .. {MAX_TILES_PER_CTA}, got {tpc}")
    if stages is not None and stages not in STAGES:
        raise ValueError(f"int8x planes cuda linear: config stages must be one of {STAGES}, got {stages}")
    if not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"int8x planes cuda linear: config splits must be 1 .. {MAX_SPLITS}, got {splits}")
    chunks = -(-k // CHUNK)
    cpw = -(-chunks // (warps * splits))
    runs = -(-chunks // cpw)
    wpt = -(-runs // splits)
    if wpt * tpc * 32 > MAX_THREADS:
        raise ValueError(f"int8x planes cuda linear: config {config!r} gives {wpt} warps per tile x {tpc} tiles "
                         f"per CTA = {wpt * tpc * 32} threads for K={k}, more than the kernel's {MAX_THREADS}")
    return wpt, cpw, tpc, stages if m == 1 and stages else 2, -(-runs // wpt)


@functools.lru_cache(maxsize=None)
def device_limits(device: torch.device) -> tuple[int, int, int]:
    """SMs, the shared memory a CTA may take and the compute capability's major number, of a CUDA device: the
    arguments after ``(m, n, k)`` of :func:`default_config`, as :func:`linear` passes them."""
    props = torch.cuda.get_device_properties(device)
    return props.multi_processor_count, getattr(props, "shared_memory_per_block_optin", 227 * 1024), props.major


@functools.lru_cache(maxsize=4096)
def default_config(m: int, n: int, k: int, sms: int, smem_max: int = 227 * 1024,
                   major: int = 9) -> tuple[int, int, int, int, int]:
    """The launch :func:`linear` takes when no config is given, as
    ``(warps_per_tile, chunks_per_warp, tiles_per_cta, stages, splits)``: runs of 4 chunks a warp (at M = 1: 2 up
    to 8 chunks, 1 where that would leave fewer than 16 warps an SM, else 3) so each warp has its next block and its
    records in flight while it computes, 2 blocks in flight a warp (less shared memory a warp, more warps an SM).
    M = 1: one tile a CTA. M = 2 .. 8: 4 or 2 tiles a CTA share each chunk's staged x where 16 warps, half a CTA an
    SM and shared memory allow. M > 8 on compute capability 9: one warp a tile in a CTA of 8 tiles (fewer where
    shared memory is short), the tile's chunks over a cluster of CTAs along K, in runs of 4 or fewer where that
    leaves fewer CTAs than SMs (at most 8 CTAs), so that 8 tiles share each staged x of 16 tokens whatever N is."""
    chunks, tiles = -(-k // CHUNK), -(-n // TILE_ROWS)
    stages = 2
    if m > 8 and major >= 9:
        tpc = next((t for t in (8, 4, 2) if smem_bytes(m, 1, t) <= smem_max), 1)
        splits = min(MAX_SPLITS, chunks, max(-(-chunks // 4), -(-sms // -(-tiles // tpc))))
        cpw = -(-chunks // splits)
        return 1, cpw, tpc, stages, -(-chunks // cpw)
    run = 4
    if m == 1:
        run = 3 if chunks > 8 else 2 if tiles * -(-chunks // 2) >= 16 * sms else 1
    warps = min(-(-chunks // run), 8 if m > 8 else MAX_WARPS)
    while True:  # fewer warps a tile where a device has less shared memory
        cpw = -(-chunks // warps)
        wpt = -(-chunks // cpw)
        if warps == 1 or smem_bytes(m, wpt, 1, stages) <= smem_max:
            break
        warps -= 1
    tpc = 1
    if m > 1:
        tpc = next((t for t in (4, 2) if wpt * t <= MAX_WARPS and tiles * 2 >= t * sms
                    and smem_bytes(m, wpt, t, stages) <= smem_max), 1)
    return wpt, cpw, tpc, stages, 1


def smem_bytes(m: int, wpt: int, tpc: int, stages: int | None = None) -> int:
    """The shared memory a CTA of ``wpt`` warps per tile and ``tpc`` tiles takes for ``m`` rows of x, with
    ``stages`` blocks in flight a warp at one token (default 2; more tokens take 2)."""
    mt = 1 if m == 1 else 8 if m <= 8 else 16
    per_warp = REC_BYTES + (stages if mt == 1 and stages else 2) * BLOCK_BYTES
    staged = wpt * (XSTRIDE * 2 + CHUNK * 2 if mt == 1 else CHUNK * mt * 2) + wpt * tpc * per_warp
    # The reduction: per warp its rows x tokens and its sum of x, then the CTA's partial outputs.
    return max(staged, (wpt * tpc * (TILE_ROWS * mt + 1) + tpc * TILE_ROWS * mt) * 4)


def linear(x: torch.Tensor, layout: Int8xPlanes, out: torch.Tensor | None = None, config=None) -> torch.Tensor:
    """``y = x @ W^T`` for 2-D fp16 / bf16 ``x`` of shape ``(M, K)`` on the tensor cores, W decoded in registers;
    ``y`` in x's dtype (or written into ``out``, any strides).

    One pass over the weight per 16 rows of x (grid.y slices larger M), fp32 accumulation. On compute capability 9
    the kernel is a programmatic dependent launch: its first weight blocks load while the kernel before it in the
    stream finishes; it reads x only after that kernel's writes are visible. ``x`` may have any
    row stride; a column stride other than 1 costs a contiguous copy. ``config``: None (the kernel's choice by
    shape, :func:`default_config`) or ``(warps, tiles_per_cta[, stages[, splits]])`` (or a dict with those keys),
    see :func:`resolve_config`; tiles of one CTA share each chunk's staged x, the CTAs of a cluster (``splits``,
    compute capability 9) split K and add their partial sums in a fixed order."""
    m = x.shape[0] if x.dim() == 2 else 2
    if config is not None:
        wpt, _, tpc, stages, splits = resolve_config(config, layout.k, m)
        # Checked here, not in the extension: an error raised inside it ends the process on some CUDA images.
        _, allowed, major = device_limits(x.device)
        need = smem_bytes(m, wpt, tpc, stages)
        if need > allowed:
            raise ValueError(f"int8x planes cuda linear: config {config!r} needs {need} bytes of shared memory for "
                             f"M={x.shape[0] if x.dim() == 2 else '?'}, the device allows {allowed}")
        if splits > 1 and major < 9:
            raise ValueError(f"int8x planes cuda linear: config {config!r} splits K over a cluster of CTAs, which "
                             f"needs compute capability 9, the device has {major}")
    if x.dim() != 2 or x.shape[1] != layout.k:
        raise ValueError(f"int8x planes cuda linear: x must be (M, {layout.k}), got {tuple(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"int8x planes cuda linear: x must be fp16 or bf16, got {x.dtype}")
    if out is None:
        out = torch.empty((x.shape[0], layout.n), dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != (x.shape[0], layout.n) or out.dtype != x.dtype:
        raise ValueError(f"int8x planes cuda linear: out must be {x.dtype} ({x.shape[0]}, {layout.n}), got "
                         f"{out.dtype} {tuple(out.shape)}")
    _check_cuda(layout, x, out)
    if x.shape[0] == 0:
        return out
    if x.stride(1) != 1 and layout.k > 1:
        x = x.contiguous()
    if config is None:
        wpt, _, tpc, stages, splits = default_config(x.shape[0], layout.n, layout.k, *device_limits(x.device))
    extension().linear(x, *layout.tensors, layout.n, layout.k, out, wpt, tpc, stages, splits)
    return out
