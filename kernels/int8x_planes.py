"""The "planes" layout for ``int8x`` weights, repacked once at load: a 5-bit main plane plus fixup records.

Where weights beyond -8..7 are common (the seed mix: 44.5 % of them), the native layout's 32-bit outliers
(kernels/int8x_native.py) make it larger than the stored streams, and the streams' GEMV costs ~17 instructions
per weight (benchmarks/NOTES.md). This layout keeps every weight at a fixed place in 5 bits and corrects the
few that do not fit 5 bits with short records, at about 5.49 bits a weight on the seed mix (the streams: 5.46
plus their block tables: 5.52):

* main plane: every weight as ``c = (q + 16) & 31``, i.e. ``v5 + 16`` where ``v5`` is the low 5 bits of q read
  as two's complement (``v5 = q`` for -16 <= q <= 15). The GPU turns a pair of codes into two fp16 / bf16
  numbers with one OR into the mantissa of 1024 / 128 and one subtraction, and feeds them to the tensor cores
  as the A operand of ``mma.m16n8k16`` directly; the plane is therefore ordered by fragments:
  the weight is split in tiles of 16 rows and steps of 256 columns (rows padded to a multiple of 16, columns to a
  multiple of 512, with code 16 = weight 0), and each (tile, step) is one block of 640 int32 words,
  ``planes[tile, step]``:

  - words ``128 G + 4 lane + s`` (G, s in 0..3, lane in 0..31; g = lane // 4, t = lane % 4) hold the low 4
    bits of the 8 codes that lane ``lane`` needs for k-step ``4 G + s`` (columns ``256 step + 16 (4 G + s)``
    onwards): pair p in 0..3 is rows ``g + 8 (p % 2)`` and columns ``2 t + 8 (p // 2) + e`` (e = 0, 1); its
    nibbles sit at bits ``4 p + 16 e``.
  - words ``512 + 4 lane + G`` hold bit 4 of the same codes for the 4 k-steps of G: pair p of k-step s at bits
    ``4 s + p + 16 e``.

  So one 16-byte load per lane and group gives 4 k-steps of A fragments, a warp's loads are 512 contiguous
  bytes, and a weight costs 5 bits.
* fixups: every weight with ``q != v5`` (|q| >= 16 except -16) has a 12-bit record, grouped by chunks of 512
  columns (two steps): ``fx_pos`` (uint8) the low 8 bits of its column within the chunk, ``fx_h`` a nibble
  (record e at bits ``4 (e % 2)`` of byte ``e // 2``) whose bits 0..2 code ``h = (q - v5) / 32`` in -4..-1,
  1..4 (``h + 4`` for h < 0, ``h + 3`` for h > 0) and bit 3 is the column's bit 8. Records are sorted by (tile,
  chunk, row, column); ``fx_base[b]`` (int32) is the first record of ``b = tile * chunks + chunk``
  (``fx_base[-1]`` = all of them) and ``fx_ends[16 b + r]`` (int16) the number of b's records in rows 0..r.
  A kernel adds ``32 h x[k]`` per record, reading x from the slice it staged for the chunk anyway.

    torch.ops.vllm_parity.int8x_planes_linear(x, planes, fx_pos, fx_h, fx_base, fx_ends, scale, n_rows, n_cols,
                                              backend) -> x @ W^T, shape (..., n_rows), x.dtype
    backend "torch", "cuda" or "auto" (cuda on CUDA tensors where the kernels build, else torch; the torch
    backend decodes the weight on every call with :func:`decode_q`)

Whether a weight is served in this layout (``PARITY_INT8X_LAYOUT``), its backend and its kernel for M rows of x
are chosen by ``vllm_parity.serving.choose`` (kernels/choose.py). No backend reads tensor values on the host,
so the op is safe under torch.compile and CUDA graphs.
"""

from __future__ import annotations

import sys
from typing import NamedTuple

import torch

from vllm_parity.serving import choose

TILE_ROWS = 16
STEP_COLS = 256          # columns per block of the plane
CHUNK_COLS = 512         # columns per group of fixup records
BLOCK_WORDS = 640        # 512 nibble words + 128 bit-4 words
NIBBLE_WORDS = 512
TENSORS = ("planes", "fx_pos", "fx_h", "fx_base", "fx_ends", "scale")


class Int8xPlanes(NamedTuple):
    planes: torch.Tensor   # int32 (ceil(N/16), ceil(K/256), 640)
    fx_pos: torch.Tensor   # uint8 (E,)
    fx_h: torch.Tensor     # uint8 (ceil(E/2),)
    fx_base: torch.Tensor  # int32 (groups + 1,), groups = ceil(N/16) * ceil(K/512)
    fx_ends: torch.Tensor  # int16 (16 * groups,)
    scale: torch.Tensor    # fp32 (1,)
    n: int
    k: int

    @property
    def chunk(self) -> int:
        """Columns of one group of fixup records (two blocks of the plane)."""
        return CHUNK_COLS

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, name) for name in TENSORS)

    @property
    def nbytes(self) -> int:
        """Resident bytes: the plane (with its padding), the records, their tables and the scale."""
        return sum(t.numel() * t.element_size() for t in self.tensors)

    @property
    def bits_per_weight(self) -> float:
        return self.nbytes * 8 / (self.n * self.k)

    @property
    def fixups(self) -> int:
        return self.fx_pos.numel()

    def to(self, device) -> "Int8xPlanes":
        return self._replace(**{name: getattr(self, name).to(device) for name in TENSORS})


def padded_shape(n: int, k: int) -> tuple[int, int]:
    """Rows and columns of the plane: N up to a multiple of 16, K of 512 (the padding holds weight 0)."""
    return -(-n // TILE_ROWS) * TILE_ROWS, -(-k // CHUNK_COLS) * CHUNK_COLS


def _fixup_code(h: torch.Tensor) -> torch.Tensor:
    return torch.where(h < 0, h + 4, h + 3)


def _fixup_h(code: torch.Tensor) -> torch.Tensor:
    return code - 4 + (code >> 2)


def _words(fields: torch.Tensor, width: int) -> torch.Tensor:
    """int32 words from the last dimension of ``fields`` (32 / width fields, field i at bits width * i)."""
    shifts = torch.arange(0, 32, width, dtype=torch.int64, device=fields.device)
    w = (fields.to(torch.int64) << shifts).sum(-1)  # disjoint bit fields: the sum is their OR
    return torch.where(w >= 1 << 31, w - (1 << 32), w).to(torch.int32)


def pack(q: torch.Tensor, scale: torch.Tensor) -> Int8xPlanes:
    """The planes layout of int8 weights ``q`` (N, K) with their per-tensor fp32 ``scale`` (1,)."""
    if q.dtype != torch.int8 or q.dim() != 2 or q.shape[0] == 0 or q.shape[1] == 0:
        raise ValueError(f"int8x planes: q must be a non-empty 2-D int8 tensor, got {q.dtype} {tuple(q.shape)}")
    scale = torch.as_tensor(scale, dtype=torch.float32)
    if scale.numel() != 1:
        raise ValueError(f"int8x planes: scale must hold one number, got shape {tuple(scale.shape)}")
    n, k = q.shape
    n_pad, k_pad = padded_shape(n, k)
    if n_pad * k_pad >= 1 << 40:
        raise ValueError(f"int8x planes: ({n}, {k}) is too large")
    dev = q.device
    v = torch.zeros(n_pad, k_pad, dtype=torch.int32, device=dev)
    v[:n, :k] = q.to(torch.int32)
    code = (v + 16) & 31
    h = (v - (code - 16)) >> 5  # exact: q - v5 is a multiple of 32
    tiles, steps = n_pad // TILE_ROWS, k_pad // STEP_COLS
    # Row 8 p0 + g of a tile, column 16 (4 G + s) + 8 p1 + 2 t + e of a step; pair p = 2 p1 + p0.
    c = code.view(tiles, 2, 8, steps, 4, 4, 2, 4, 2)  # tile, p0, g, step, G, s, p1, t, e
    nib = c.permute(0, 3, 4, 2, 7, 5, 8, 6, 1) & 15   # tile, step, G, g, t, s | e, p1, p0
    nib_words = _words(nib.reshape(tiles, steps, NIBBLE_WORDS, 8), 4)
    hib = c.permute(0, 3, 2, 7, 4, 8, 5, 6, 1) >> 4   # tile, step, g, t, G | e, s, p1, p0
    hib_words = _words(hib.reshape(tiles, steps, BLOCK_WORDS - NIBBLE_WORDS, 32), 1)
    planes = torch.cat([nib_words, hib_words], dim=2).contiguous()

    # Records in (tile, chunk, row, column) order.
    chunks = k_pad // CHUNK_COLS
    hb = h.view(tiles, TILE_ROWS, chunks, CHUNK_COLS).permute(0, 2, 1, 3)  # tile, chunk, row, col
    tl, ch, row, col = (hb != 0).nonzero(as_tuple=True)
    hv = hb[tl, ch, row, col]
    blocks = tiles * chunks
    per_row = torch.bincount((tl * chunks + ch) * TILE_ROWS + row, minlength=blocks * TILE_ROWS)
    per_row = per_row.view(blocks, TILE_ROWS)
    fx_ends = per_row.cumsum(1).reshape(-1).to(torch.int16)
    counts = per_row.sum(1)
    fx_base = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32)
    fx_pos = (col & 255).to(torch.uint8)
    hc = (_fixup_code(hv) | ((col >> 8) << 3)).to(torch.int32)
    if hc.numel() % 2:
        hc = torch.cat([hc, hc.new_zeros(1)])
    fx_h = (hc[0::2] | (hc[1::2] << 4)).to(torch.uint8)
    return Int8xPlanes(planes, fx_pos.contiguous(), fx_h.contiguous(), fx_base, fx_ends.contiguous(),
                       scale.reshape(1).clone(), n, k)


def unpack(layout: Int8xPlanes) -> torch.Tensor:
    """The int8 weights (N, K) back from the layout, with torch ops only (no host reads).

    Written from the layout's description (word and bit of every weight, then each record applied), apart from
    :func:`pack`'s permutes, so that the tests catch a mistake in either."""
    n, k = layout.n, layout.k
    n_pad, k_pad = padded_shape(n, k)
    dev = layout.planes.device
    steps, chunks = k_pad // STEP_COLS, k_pad // CHUNK_COLS
    row = torch.arange(n_pad, device=dev).view(-1, 1)
    col = torch.arange(k_pad, device=dev).view(1, -1)
    tile, r = row // TILE_ROWS, row % TILE_ROWS
    step, cs = col // STEP_COLS, col % STEP_COLS
    g, p0 = r % 8, r // 8
    ks, cc = cs // 16, cs % 16
    grp, s = ks // 4, ks % 4
    p1, t, e = cc // 8, (cc % 8) // 2, cc % 2
    lane, p = 4 * g + t, 2 * p1 + p0
    words = layout.planes.reshape(-1).to(torch.int64) & 0xFFFFFFFF
    block = (tile * steps + step) * BLOCK_WORDS
    low = (words[block + 128 * grp + 4 * lane + s] >> (4 * p + 16 * e)) & 15
    bit4 = (words[block + NIBBLE_WORDS + 4 * lane + grp] >> (4 * s + p + 16 * e)) & 1
    q = (low | (bit4 << 4)) - 16

    # Records: block and row from the tables, column from fx_pos.
    n_rec = layout.fx_pos.numel()
    idx = torch.arange(n_rec, device=dev)
    blk = torch.searchsorted(layout.fx_base, idx.to(layout.fx_base.dtype), right=True) - 1
    ends = layout.fx_ends.to(torch.int64).view(-1, TILE_ROWS)
    in_block = idx - layout.fx_base.to(torch.int64)[blk]
    rr = (in_block.view(-1, 1) >= ends[blk]).sum(1)  # rows of the block whose records all come before
    nib = (layout.fx_h.to(torch.int64)[idx // 2] >> (4 * (idx % 2))) & 15
    rows = (blk // chunks) * TILE_ROWS + rr
    cols = (blk % chunks) * CHUNK_COLS + ((nib >> 3) << 8) + layout.fx_pos.to(torch.int64)
    q[rows, cols] += 32 * _fixup_h(nib & 7)
    return q[:n, :k].to(torch.int8)


def decode_q(layout: Int8xPlanes) -> torch.Tensor:
    """The int8 weights (N, K), as the torch backend serves them: the nibble words read as bytes (a byte holds
    pair p1 of half e, p0 = 0 low and 1 high), the bit-4 words as 32 bits, both put in place by one permute
    (:func:`pack`'s inverted), the records placed through their tables' counts (no search); about 7 times
    :func:`unpack`'s speed on the CPU. Tested against :func:`unpack`, which reads the layout's description."""
    n, k = layout.n, layout.k
    n_pad, k_pad = padded_shape(n, k)
    tiles, steps, chunks = n_pad // TILE_ROWS, k_pad // STEP_COLS, k_pad // CHUNK_COLS
    words = layout.planes.view(tiles, steps, BLOCK_WORDS)
    b = words[..., :NIBBLE_WORDS].contiguous().view(torch.uint8).view(tiles, steps, 4, 8, 4, 4, 4)
    if sys.byteorder == "big":  # a byte view lists a word's bytes most significant first there
        b = b.flip(-1)
    b = b.reshape(tiles, steps, 4, 8, 4, 4, 2, 2)  # byte 2 e + p1 of the word
    nib = torch.stack((b & 15, b >> 4), dim=-1)  # tile, step, G, g, t, s, e, p1, p0
    bits = torch.arange(32, dtype=torch.int32, device=words.device)
    hib = ((words[..., NIBBLE_WORDS:].reshape(-1, 1) >> bits) & 1).to(torch.uint8)
    hib = hib.view(tiles, steps, 8, 4, 4, 2, 4, 2, 2).permute(0, 1, 4, 2, 3, 6, 5, 7, 8)  # as nib
    code = (nib | (hib << 4)).permute(0, 8, 3, 1, 2, 5, 7, 4, 6)  # tile, p0, g, step, G, s, p1, t, e
    q = code.reshape(n_pad, k_pad).to(torch.int16) - 16
    n_rec = layout.fx_pos.numel()
    if n_rec:
        ends = layout.fx_ends.to(torch.int64).view(-1, TILE_ROWS)  # records in rows 0 .. r of each group
        per_row = torch.diff(ends, dim=1, prepend=ends.new_zeros(ends.shape[0], 1))
        block_row = torch.repeat_interleave(torch.arange(per_row.numel(), device=q.device), per_row.reshape(-1),
                                            output_size=n_rec)  # (tile * chunks + chunk) * 16 + row, per record
        blk, r = block_row // TILE_ROWS, block_row % TILE_ROWS
        idx = torch.arange(n_rec, device=q.device)
        code = (layout.fx_h.to(torch.int64)[idx // 2] >> (4 * (idx % 2))) & 15
        rows = (blk // chunks) * TILE_ROWS + r
        cols = (blk % chunks) * CHUNK_COLS + ((code >> 3) << 8) + layout.fx_pos.to(torch.int64)
        q[rows, cols] += (32 * _fixup_h(code & 7)).to(q.dtype)
    return q[:n, :k].to(torch.int8)


def stored_bytes(tensors: dict[str, torch.Tensor]) -> int:
    """Bytes of the stored int8x tensors the layout replaces (streams and block tables)."""
    return sum(t.numel() * t.element_size() for s, t in tensors.items() if s not in ("weight_shape", "weight_scale"))


def estimate_bytes(q: torch.Tensor) -> int:
    """The layout's :attr:`Int8xPlanes.nbytes` for ``q`` without packing it (counts only)."""
    n, k = q.shape
    n_pad, k_pad = padded_shape(n, k)
    v = q.to(torch.int32)
    fixups = int(((v > 15) | (v < -16)).sum())
    blocks = (n_pad // TILE_ROWS) * (k_pad // CHUNK_COLS)
    return n_pad * k_pad * 5 // 8 + fixups + (fixups + 1) // 2 + 4 * (blocks + 1) + 2 * TILE_ROWS * blocks + 4


# `auto` serves the planes up to this fraction larger than the stored tensors they replace: on a real model's level
# mix they are 0.2 % larger, and their GEMV is several times faster than the streams' (benchmarks/NOTES.md).
AUTO_MARGIN = 0.03


def _within_margin(nbytes: int, tensors: dict[str, torch.Tensor]) -> bool:
    return nbytes <= stored_bytes(tensors) * (1 + AUTO_MARGIN)


def fits(layout: Int8xPlanes, tensors: dict[str, torch.Tensor]) -> bool:
    """Whether the layout takes at most AUTO_MARGIN more memory than the stored tensors it would replace."""
    return _within_margin(layout.nbytes, tensors)


# -- the op ---------------------------------------------------------------------------------------

_DTYPES = (("planes", torch.int32, 3), ("fx_pos", torch.uint8, 1), ("fx_h", torch.uint8, 1),
           ("fx_base", torch.int32, 1), ("fx_ends", torch.int16, 1), ("scale", torch.float32, 1))


def check(tensors: tuple[torch.Tensor, ...], n_rows: int, n_cols: int) -> None:
    """Dtypes, ranks and the lengths the shape fixes, so that a mistake is a Python error naming the tensor
    (the kernels index by these lengths without further checks). Reads no tensor value."""
    if n_rows <= 0 or n_cols <= 0:
        raise ValueError(f"int8x planes: n_rows and n_cols must be positive, got {n_rows}, {n_cols}")
    for (name, dtype, dim), t in zip(_DTYPES, tensors):
        if t.dtype != dtype or t.dim() != dim or not t.is_contiguous():
            raise ValueError(f"int8x planes: {name} must be a contiguous {dim}-D {dtype} tensor, got "
                             f"{t.dtype} {tuple(t.shape)} strides {t.stride()}")
    planes, fx_pos, fx_h, fx_base, fx_ends, scale = tensors
    n_pad, k_pad = padded_shape(n_rows, n_cols)
    blocks = (n_pad // TILE_ROWS) * (k_pad // CHUNK_COLS)
    want = {"planes": (planes, (n_pad // TILE_ROWS, k_pad // STEP_COLS, BLOCK_WORDS)),
            "fx_base": (fx_base, (blocks + 1,)), "fx_ends": (fx_ends, (TILE_ROWS * blocks,)),
            "fx_h": (fx_h, ((fx_pos.numel() + 1) // 2,)), "scale": (scale, (1,))}
    for name, (t, shape) in want.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"int8x planes: {name} has shape {tuple(t.shape)}, expected {shape} for a "
                             f"({n_rows}, {n_cols}) weight" + (f" with {fx_pos.numel()} records" if name == "fx_h"
                                                               else ""))
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"int8x planes: the layout's tensors are on several devices: {sorted(map(str, devices))}")


def torch_linear(x2: torch.Tensor, layout: Int8xPlanes) -> torch.Tensor:
    """``x2 @ W^T`` for 2-D ``x2`` by unpacking W (fp32 products, result in x's dtype): the reference path."""
    w = decode_q(layout).to(torch.float32)
    return ((x2.to(torch.float32) @ w.t()) * layout.scale.to(torch.float32)).to(x2.dtype)


def torch_decode(layout: Int8xPlanes, dtype: torch.dtype) -> torch.Tensor:
    """The dense weight ``q * scale`` rounded once to ``dtype``."""
    return (decode_q(layout).to(torch.float32) * layout.scale.to(torch.float32)).to(dtype)


@torch.library.custom_op("vllm_parity::int8x_planes_linear", mutates_args=())
def int8x_planes_linear(x: torch.Tensor, planes: torch.Tensor, fx_pos: torch.Tensor, fx_h: torch.Tensor,
                        fx_base: torch.Tensor, fx_ends: torch.Tensor, scale: torch.Tensor, n_rows: int,
                        n_cols: int, backend: str) -> torch.Tensor:
    if x.shape[-1] != n_cols:
        raise ValueError(f"int8x_planes_linear: x has {x.shape[-1]} input features, the weight ({n_rows}, {n_cols})")
    layout = Int8xPlanes(planes, fx_pos, fx_h, fx_base, fx_ends, scale, n_rows, n_cols)
    backend = choose.int8x_planes_op_backend(backend, x.device)
    x2 = x.reshape(-1, n_cols)
    kernel = choose.int8x_planes_kernel(backend, x2.shape[0])
    if kernel == "cuda_gemv":
        from vllm_parity.serving import int8x_planes_cuda

        y = int8x_planes_cuda.linear(x2, layout)
    elif kernel == "cuda_gemm":  # many rows of x: decode once, then the dense GEMM
        from vllm_parity.serving import int8x_planes_cuda

        y = torch.nn.functional.linear(x2, int8x_planes_cuda.decode(layout, x.dtype))
    else:  # (the CUDA kernels' wrappers check the layout themselves, once)
        check(layout.tensors, n_rows, n_cols)
        y = torch_linear(x2, layout)
    return y.reshape(*x.shape[:-1], n_rows)


@torch.library.register_fake("vllm_parity::int8x_planes_linear")
def _int8x_planes_linear_fake(x, planes, fx_pos, fx_h, fx_base, fx_ends, scale, n_rows, n_cols, backend):
    return x.new_empty((*x.shape[:-1], n_rows))


def linear(x: torch.Tensor, layout: Int8xPlanes, bias: torch.Tensor | None = None,
           backend: str = "auto") -> torch.Tensor:
    """``x @ W^T (+ bias)`` for ``x`` of shape ``(..., K)`` through the op; result in ``x.dtype``."""
    y = torch.ops.vllm_parity.int8x_planes_linear(x, *layout.tensors, layout.n, layout.k, backend)
    return y if bias is None else y + bias


def for_serving(q: torch.Tensor, tensors: dict[str, torch.Tensor], layout: str | None = None) -> Int8xPlanes | None:
    """The planes layout to serve an int8x tensor set with (its validated int8 weights ``q``), or None.
    ``layout`` (default :func:`choose.int8x_layout`): ``planes`` always; ``auto`` where it is at most AUTO_MARGIN
    larger than the stored tensors (the caller tries the native layout first); otherwise None."""
    choice = layout or choose.int8x_layout()
    if choice not in ("planes", "auto"):
        return None
    if choice == "auto" and not _within_margin(estimate_bytes(q), tensors):
        return None
    return pack(q, tensors["weight_scale"].cpu())
