"""Triton kernels for ``int8x`` weights (shared FORMATS.md section 2): block decode and fused decode-GEMV.

Both kernels decode with the same block-local scheme. A program owns one block of ``block_size``
consecutive elements of the row-major flattened weight (``e = row * K + col``):

* its b1 bits, read from the words ``b1[e >> 5]`` (a block starts on a word: ``block_size % 32 == 0``);
* the non-L1 index ``j`` of each element = ``b1_blk[block]`` + the exclusive ``tl.cumsum`` of the b1 bits
  inside the block; the L1 index is ``e - j``;
* its b2 bit ``b2[j >> 5] >> (j & 31)``; the L3 index = ``b2_blk[block]`` + the exclusive cumsum of the
  b2 bits of the block's non-L1 elements (``b2_blk`` counts b2 ones before the block's first non-L1
  element); the L2 index = ``j`` - the L3 index;
* L1 / L2 values are 3 / 5-bit fields at stream bit ``3*i`` / ``5*i``; a field may straddle two words, so
  the kernel joins the word and its successor into 64 bits before shifting.

The launchers take plain tensors and Python ints (the weight's ``N, K`` and ``block_size``) and never read
tensor values on the host, so they are safe inside CUDA graphs. They run on any device Triton drives; on the
CPU only through the interpreter (``TRITON_INTERPRET=1`` set before this module is imported).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["decode", "linear", "interpreted", "MAX_BLOCK_M"]

MAX_BLOCK_M = 16  # rows of x per GEMV program; larger M runs as more programs along grid axis 1


@triton.jit
def _field(words_ptr, idx, mask, WIDTH: tl.constexpr, WIDE: tl.constexpr):
    """Signed ``WIDTH``-bit field number ``idx`` of a bit stream (int32 words), as int32.

    Index math stays in int32 (cheaper on GPUs) unless ``WIDE``: bit positions reach 2**31.
    """
    if WIDE:
        t = idx.to(tl.int64) * WIDTH
    else:
        t = idx * WIDTH
    word = t >> 5
    off = (t & 31).to(tl.uint32)
    lo = tl.load(words_ptr + word, mask=mask, other=0).to(tl.uint32, bitcast=True)
    # The successor word is read only when the field crosses into it (it may not exist otherwise); then
    # off > 0, and where it is not read hi is 0, so the shift by (32 - off) & 31 never needs the value 32.
    hi = tl.load(words_ptr + word + 1, mask=mask & (off + WIDTH > 32), other=0).to(tl.uint32, bitcast=True)
    u = (((lo >> off) | (hi << ((32 - off) & 31))) & ((1 << WIDTH) - 1)).to(tl.int32)
    return tl.where(u >= (1 << (WIDTH - 1)), u - (1 << WIDTH), u)


@triton.jit
def _block_q(block, n, b1_ptr, b2_ptr, l1_ptr, l2_ptr, l3_ptr, b1_blk_ptr, b2_blk_ptr,
             BLOCK: tl.constexpr, BLOCK_P2: tl.constexpr, WIDE: tl.constexpr):
    """int32 values, flat element indices and validity of block ``block`` (``BLOCK_P2`` lanes).

    Element and level indices are int32: n < 2**31, which the int32 block tables imply.
    """
    lane = tl.arange(0, BLOCK_P2)
    e = block * BLOCK + lane
    valid = (lane < BLOCK) & (e < n)

    w1 = tl.load(b1_ptr + (e >> 5), mask=valid, other=0)
    non_l1 = tl.where(valid, (w1 >> (e & 31)) & 1, 0)
    j = tl.load(b1_blk_ptr + block) + (tl.cumsum(non_l1, 0) - non_l1)
    is_non_l1 = non_l1 != 0

    w2 = tl.load(b2_ptr + (j >> 5), mask=is_non_l1, other=0)
    l3_bit = tl.where(is_non_l1, (w2 >> (j & 31)) & 1, 0)
    i3 = tl.load(b2_blk_ptr + block) + (tl.cumsum(l3_bit, 0) - l3_bit)
    is_l3 = l3_bit != 0
    is_l2 = is_non_l1 & (l3_bit == 0)

    v1 = _field(l1_ptr, e - j, valid & (non_l1 == 0), 3, WIDE)
    v2 = _field(l2_ptr, j - i3, is_l2, 5, WIDE)
    v3 = tl.load(l3_ptr + i3, mask=is_l3, other=0).to(tl.int32)
    v3 = tl.where(v3 > 127, v3 - 256, v3)  # the uint8 byte of an int8
    q = tl.where(is_l3, v3, tl.where(is_l2, v2, v1))
    return q, e, valid


@triton.jit
def _decode_kernel(out_ptr, scale_ptr, b1_ptr, b2_ptr, l1_ptr, l2_ptr, l3_ptr, b1_blk_ptr, b2_blk_ptr, n,
                   BLOCK: tl.constexpr, BLOCK_P2: tl.constexpr, WIDE: tl.constexpr):
    block = tl.program_id(0)
    q, e, valid = _block_q(block, n, b1_ptr, b2_ptr, l1_ptr, l2_ptr, l3_ptr, b1_blk_ptr, b2_blk_ptr,
                           BLOCK, BLOCK_P2, WIDE)
    scale = tl.load(scale_ptr)
    tl.store(out_ptr + e.to(tl.int64), (q.to(tl.float32) * scale).to(out_ptr.dtype.element_ty), mask=valid)


@triton.jit
def _linear_kernel(y_ptr, x_ptr, scale_ptr, b1_ptr, b2_ptr, l1_ptr, l2_ptr, l3_ptr, b1_blk_ptr, b2_blk_ptr,
                   M, K, n, stride_xm, stride_xk, stride_ym, stride_yn,
                   BLOCK: tl.constexpr, BLOCK_P2: tl.constexpr, BLOCK_M: tl.constexpr, ALIGNED: tl.constexpr,
                   WIDE: tl.constexpr):
    row = tl.program_id(0)
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < M
    x_rows = x_ptr + m.to(tl.int64)[:, None] * stride_xm
    row_start = row * K  # < n < 2**31
    row_end = row_start + K
    acc = tl.zeros((BLOCK_M,), dtype=tl.float32)
    # The blocks overlapping this row; with K % BLOCK == 0 exactly K / BLOCK whole blocks.
    for block in range(row_start // BLOCK, (row_end - 1) // BLOCK + 1):
        q, e, valid = _block_q(block, n, b1_ptr, b2_ptr, l1_ptr, l2_ptr, l3_ptr, b1_blk_ptr, b2_blk_ptr,
                               BLOCK, BLOCK_P2, WIDE)
        if ALIGNED:
            lanes = valid
        else:
            lanes = valid & (e >= row_start) & (e < row_end)  # a block straddling rows: keep this row's
        xt = tl.load(x_rows + (e - row_start)[None, :] * stride_xk, mask=m_ok[:, None] & lanes[None, :], other=0.0)
        w = tl.where(lanes, q.to(tl.float32), 0.0)
        acc += tl.sum(xt.to(tl.float32) * w[None, :], axis=1)
    scale = tl.load(scale_ptr)
    y = acc * scale  # sum_k x*q*s == s * sum_k x*q: one multiply per output instead of per weight
    tl.store(y_ptr + m.to(tl.int64) * stride_ym + row * stride_yn, y.to(y_ptr.dtype.element_ty), mask=m_ok)


# -- launchers ----------------------------------------------------------------------------------


def interpreted() -> bool:
    """Whether this module's kernels were built for the Triton interpreter (TRITON_INTERPRET=1)."""
    return not isinstance(_decode_kernel, triton.runtime.JITFunction)


def check_device(*tensors: torch.Tensor) -> None:
    device = tensors[0].device
    for t in tensors:
        if t.device != device:
            raise ValueError(f"int8x triton: tensors on {device} and {t.device}")
    if device.type == "cpu" and not interpreted():
        raise RuntimeError("int8x triton: CPU tensors need the Triton interpreter; set TRITON_INTERPRET=1 "
                           "before vllm_parity.serving.int8x_triton is imported, or use the torch backend")


def linear_out(x: torch.Tensor, n_rows: int, n_cols: int, out: torch.Tensor | None, who: str) -> torch.Tensor:
    """The ``(M, n_rows)`` output of ``linear`` in x's dtype, or ``out`` once its shape is checked; ``x``
    must be ``(M, n_cols)``. Shared by the Triton and CUDA backends (``who`` names the caller)."""
    if x.dim() != 2 or x.shape[1] != n_cols:
        raise ValueError(f"int8x {who} linear: x must be (M, {n_cols}), got {tuple(x.shape)}")
    if out is None:
        return torch.empty((x.shape[0], n_rows), dtype=x.dtype, device=x.device)
    if out.shape != (x.shape[0], n_rows):
        raise ValueError(f"int8x {who} linear: out must be ({x.shape[0]}, {n_rows}), got {tuple(out.shape)}")
    return out


def _wide(n: int) -> bool:
    # Stream bit positions (3 or 5 per value) reach 2**31 only for weights of ~430M+ elements.
    return 5 * n >= 2**31


def _streams(b1, b2, l1, l2, l3):
    # An empty stream (no L2 values, say) still needs an address to pass; a 1-element tensor is never read.
    return [t if t.numel() else t.new_zeros(1) for t in (b1, b2, l1, l2, l3)]


def decode(b1: torch.Tensor, b2: torch.Tensor, l1: torch.Tensor, l2: torch.Tensor, l3: torch.Tensor,
           b1_blk: torch.Tensor, b2_blk: torch.Tensor, scale: torch.Tensor, n_rows: int, n_cols: int,
           block_size: int, dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
    """The weight ``q * scale`` of shape ``(n_rows, n_cols)`` in ``dtype`` (or written into ``out``).

    One program per block of ``block_size`` flattened elements. Inputs are the FORMATS.md tensors, unvalidated:
    validate them once at load time with ``vllm_parity.serving.int8x_load.decode_streams``.
    """
    n = n_rows * n_cols
    if out is None:
        out = torch.empty((n_rows, n_cols), dtype=dtype, device=b1.device)
    elif out.shape != (n_rows, n_cols) or not out.is_contiguous():
        raise ValueError(f"int8x triton decode: out must be contiguous ({n_rows}, {n_cols}), "
                         f"got {tuple(out.shape)} strides {out.stride()}")
    check_device(out, b1, b2, l1, l2, l3, b1_blk, b2_blk, scale)
    grid = (triton.cdiv(n, block_size),)
    _decode_kernel[grid](out, scale, *_streams(b1, b2, l1, l2, l3), b1_blk, b2_blk, n,
                         BLOCK=block_size, BLOCK_P2=triton.next_power_of_2(block_size), WIDE=_wide(n))
    return out


def linear(x: torch.Tensor, b1: torch.Tensor, b2: torch.Tensor, l1: torch.Tensor, l2: torch.Tensor,
           l3: torch.Tensor, b1_blk: torch.Tensor, b2_blk: torch.Tensor, scale: torch.Tensor, n_rows: int,
           n_cols: int, block_size: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """``y = x @ W^T`` for 2-D ``x`` of shape ``(M, K)`` (any strides), decoding ``W`` in registers only.

    Grid: one program per output feature (row of ``W``) and per tile of up to ``MAX_BLOCK_M`` rows of ``x``;
    the program walks the blocks of its row and accumulates in fp32, so the decoded weight never reaches
    memory. Built for small M (decode-time GEMV, 1..16 tokens). (Splitting a row's blocks over several
    programs with a second reduction pass measured no faster on an H200 at 4096 x 14336: the block decode,
    not the grid's parallelism, bounds the time.)

    Blocks run over the flattened weight, so a block may span rows. When ``K % block_size == 0`` each row is
    a whole number of blocks and every decoded lane is used (the fast path). Otherwise a program decodes each
    block overlapping its row and masks the lanes of other rows: still exact, but a block is decoded by every
    row it touches (up to ``block_size / K + 1`` times when ``K < block_size``).
    """
    out = linear_out(x, n_rows, n_cols, out, "triton")
    m_rows = x.shape[0]
    check_device(x, out, b1, b2, l1, l2, l3, b1_blk, b2_blk, scale)
    if m_rows == 0:
        return out
    block_m = min(MAX_BLOCK_M, triton.next_power_of_2(m_rows))
    _linear_kernel[(n_rows, triton.cdiv(m_rows, block_m))](
        out, x, scale, *_streams(b1, b2, l1, l2, l3), b1_blk, b2_blk,
        m_rows, n_cols, n_rows * n_cols, x.stride(0), x.stride(1), out.stride(0), out.stride(1),
        BLOCK=block_size, BLOCK_P2=triton.next_power_of_2(block_size), BLOCK_M=block_m,
        ALIGNED=n_cols % block_size == 0, WIDE=_wide(n_rows * n_cols))
    return out
