"""Triton GEMV ``y = x @ W^T`` on the native int8x layout (:mod:`vllm_parity.serving.int8x_native`).

A program owns ``BN`` rows of W and ``BM`` rows of x. It streams a ``(BN, BKW)`` tile of code words per
step and decodes it in registers: code ``i`` of a word is ``(w << (28 - 4 i)) >> 28`` (an arithmetic shift
sign-extends it), then, for one row of x, one FMA per weight in fp32, or for up to 16 rows one ``tl.dot``
of the decoded tile (exact in fp16 / bf16) with an fp32 accumulator. After the dense part it adds its rows'
outliers: the entries ``row_ptr[n0] .. row_ptr[n0 + BN]``, each one gather of x, attributed to its row by
comparing the entry index with the rows' ``row_ptr`` bounds. The per-tensor scale is applied last.
Larger M decodes once and runs a dense GEMM (the op's caller decides; this module only launches).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_parity.serving.int8x_native import CODES_PER_WORD, Int8xNative
from vllm_parity.serving.int8x_triton import check_device, interpreted, linear_out

_INT32_MAX = tl.constexpr(2147483647)


@triton.jit
def _code(w, i: tl.constexpr):
    return ((w << (28 - 4 * i)) >> 28).to(tl.float32)


@triton.jit
def _decode(w, R: tl.constexpr, C: tl.constexpr):
    """Words ``(R, C)`` -> weights ``(R, 8 C)`` in k order: each join level picks one bit of the code index,
    most significant first, so the row-major flattening of the new axes is the index."""
    p0 = tl.join(_code(w, 0), _code(w, 4))
    p1 = tl.join(_code(w, 1), _code(w, 5))
    p2 = tl.join(_code(w, 2), _code(w, 6))
    p3 = tl.join(_code(w, 3), _code(w, 7))
    return tl.reshape(tl.join(tl.join(p0, p2), tl.join(p1, p3)), (R, C * 8))


@triton.jit
def _outliers(e0, hi, ends, out_ptr, BN: tl.constexpr, BE: tl.constexpr):
    """Entries e0 .. e0 + BE - 1 (those below hi): column, value, and a (BE, BN) one-hot of their row among
    the block's rows (an entry belongs to the first row whose end exceeds it)."""
    e = e0 + tl.arange(0, BE)
    e_mask = e < hi
    entry = tl.load(out_ptr + e, mask=e_mask, other=0)
    col = (entry >> 8) & 0xFFFFFF
    val = ((entry << 24) >> 24).to(tl.float32)
    row = tl.sum((e[:, None] >= ends[None, :]).to(tl.int32), axis=1)
    hit = (row[:, None] == tl.arange(0, BN)[None, :]) & e_mask[:, None]
    return col, val, e_mask, hit


@triton.jit(do_not_specialize=["M", "K"])
def _gemv_kernel(x_ptr, codes_ptr, row_ptr, out_ptr, scale_ptr, y_ptr, M, N, K, KW,
                 stride_xm, stride_xk, stride_ym, stride_yn,
                 EVEN: tl.constexpr, BN: tl.constexpr, BKW: tl.constexpr, BE: tl.constexpr):
    """One row of x (program axis 0) against rows ``BN * pid ..`` of W: one FMA per weight in fp32."""
    BK: tl.constexpr = BKW * 8
    m = tl.program_id(0)  # fastest: the M programs of one weight tile run together and share it in L2
    n0 = tl.program_id(1) * BN
    offs_n = n0 + tl.arange(0, BN)
    n_mask = offs_n < N
    offs_w = tl.arange(0, BKW)
    offs_k = tl.arange(0, BK)
    x_row = x_ptr + m * stride_xm
    acc = tl.zeros([BN, BK], dtype=tl.float32)
    for kw0 in range(0, KW, BKW):
        w_ptrs = codes_ptr + offs_n[:, None] * KW + (kw0 + offs_w)[None, :]
        k = kw0 * 8 + offs_k
        if EVEN:
            w = tl.load(w_ptrs)
            xk = tl.load(x_row + k * stride_xk)
        else:
            w = tl.load(w_ptrs, mask=n_mask[:, None] & ((kw0 + offs_w) < KW)[None, :], other=0)
            xk = tl.load(x_row + k * stride_xk, mask=k < K, other=0.0)
        acc += _decode(w, BN, BKW) * xk.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    # Outliers of rows n0 .. n0 + BN - 1; rows past N get an upper bound no entry reaches.
    hi = tl.load(row_ptr + tl.minimum(n0 + BN, N))
    ends = tl.load(row_ptr + offs_n + 1, mask=n_mask, other=_INT32_MAX)
    for e0 in range(tl.load(row_ptr + n0), hi, BE):
        col, val, e_mask, hit = _outliers(e0, hi, ends, out_ptr, BN, BE)
        xv = tl.load(x_row + col * stride_xk, mask=e_mask, other=0.0).to(tl.float32)
        y += tl.sum(tl.where(hit, (xv * val)[:, None], 0.0), axis=0)
    y = y * tl.load(scale_ptr)
    tl.store(y_ptr + m * stride_ym + offs_n * stride_yn, y.to(y_ptr.dtype.element_ty), mask=n_mask)


@triton.jit(do_not_specialize=["M", "K"])
def _mm_kernel(x_ptr, codes_ptr, row_ptr, out_ptr, scale_ptr, y_ptr, M, N, K, KW,
               stride_xm, stride_xk, stride_ym, stride_yn,
               EVEN: tl.constexpr, DOT_DTYPE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
               BKW: tl.constexpr, BE: tl.constexpr):
    """Rows ``BM * pid_m ..`` of x against rows ``BN * pid_n ..`` of W: the decoded tile (exact in any float
    type, |code| <= 8) goes to ``tl.dot`` in DOT_DTYPE; the outliers as a second product with their rows'
    one-hot matrix."""
    BK: tl.constexpr = BKW * 8
    offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
    m_mask = offs_m < M
    n0 = tl.program_id(1) * BN
    offs_n = n0 + tl.arange(0, BN)
    n_mask = offs_n < N
    offs_w = tl.arange(0, BKW)
    offs_k = tl.arange(0, BK)
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for kw0 in range(0, KW, BKW):
        w_ptrs = codes_ptr + offs_n[:, None] * KW + (kw0 + offs_w)[None, :]
        k = kw0 * 8 + offs_k
        if EVEN:
            w = tl.load(w_ptrs)
            xk = tl.load(x_rows + k[None, :] * stride_xk, mask=m_mask[:, None], other=0.0)
        else:
            w = tl.load(w_ptrs, mask=n_mask[:, None] & ((kw0 + offs_w) < KW)[None, :], other=0)
            xk = tl.load(x_rows + k[None, :] * stride_xk, mask=m_mask[:, None] & (k < K)[None, :], other=0.0)
        acc = tl.dot(xk.to(DOT_DTYPE), tl.trans(_decode(w, BN, BKW).to(DOT_DTYPE)), acc, input_precision="ieee")
    hi = tl.load(row_ptr + tl.minimum(n0 + BN, N))
    ends = tl.load(row_ptr + offs_n + 1, mask=n_mask, other=_INT32_MAX)
    for e0 in range(tl.load(row_ptr + n0), hi, BE):
        col, val, e_mask, hit = _outliers(e0, hi, ends, out_ptr, BN, BE)
        xv = tl.load(x_rows + col[None, :] * stride_xk, mask=m_mask[:, None] & e_mask[None, :], other=0.0)
        acc = tl.dot(xv.to(tl.float32) * val[None, :], hit.to(tl.float32), acc, input_precision="ieee")
    y = acc * tl.load(scale_ptr)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn, y.to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _decode_kernel(codes_ptr, row_ptr, out_ptr, scale_ptr, w_ptr, N, K, KW,
                   BN: tl.constexpr, BKW: tl.constexpr, BE: tl.constexpr):
    """Rows ``BN * pid ..`` of ``W = q * scale`` in w's dtype: the codes tile by tile, then, after a barrier
    (so that they land last), the rows' outliers over the zeros their codes wrote."""
    BK: tl.constexpr = BKW * 8
    n0 = tl.program_id(0) * BN
    offs_n = n0 + tl.arange(0, BN)
    n_mask = offs_n < N
    offs_w = tl.arange(0, BKW)
    offs_k = tl.arange(0, BK)
    scale = tl.load(scale_ptr)
    for kw0 in range(0, KW, BKW):
        w = tl.load(codes_ptr + offs_n[:, None] * KW + (kw0 + offs_w)[None, :],
                    mask=n_mask[:, None] & ((kw0 + offs_w) < KW)[None, :], other=0)
        k = kw0 * 8 + offs_k
        tl.store(w_ptr + offs_n[:, None] * K + k[None, :], (_decode(w, BN, BKW) * scale).to(w_ptr.dtype.element_ty),
                 mask=n_mask[:, None] & (k < K)[None, :])
    tl.debug_barrier()
    hi = tl.load(row_ptr + tl.minimum(n0 + BN, N))
    ends = tl.load(row_ptr + offs_n + 1, mask=n_mask, other=_INT32_MAX)
    for e0 in range(tl.load(row_ptr + n0), hi, BE):
        col, val, e_mask, hit = _outliers(e0, hi, ends, out_ptr, BN, BE)
        row = n0 + tl.sum(hit.to(tl.int32) * tl.arange(0, BN)[None, :], axis=1)
        tl.store(w_ptr + row * K + col, (val * scale).to(w_ptr.dtype.element_ty), mask=e_mask)


def _check(native: Int8xNative) -> int:
    """The layout's tensors as the kernels read them (contiguous int32, fp32 scale); returns words per row."""
    n, k = native.n, native.k
    words = -(-k // CODES_PER_WORD)
    want = {"codes": ((n, words), torch.int32), "row_ptr": ((n + 1,), torch.int32),
            "outliers": ((native.outliers.numel(),), torch.int32), "scale": ((1,), torch.float32)}
    for name, (shape, dtype) in want.items():
        t = getattr(native, name)
        if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous():
            raise ValueError(f"int8x native: {name} must be contiguous {dtype} {shape} for a ({n}, {k}) weight, "
                             f"got {t.dtype} {tuple(t.shape)}{'' if t.is_contiguous() else ' (not contiguous)'}")
    return words


def decode(native: Int8xNative, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """The dense weight ``q * scale`` (N, K) in ``dtype`` (rounded once from fp32), on the layout's device."""
    n, k = native.n, native.k
    words = _check(native)
    if out is None:
        out = torch.empty((n, k), dtype=dtype, device=native.codes.device)
    check_device(out, native.codes, native.row_ptr, native.outliers, native.scale)
    if n == 0 or k == 0:
        return out
    if interpreted() and dtype == torch.bfloat16:
        # The interpreter truncates fp32 -> bf16; decode in fp32 and let torch round to nearest.
        return out.copy_(decode(native, torch.float32))
    cfg = {"BN": 4, "BKW": 8, "BE": 16, "num_warps": 1} if interpreted() else \
        {"BN": 8, "BKW": 64, "BE": 64, "num_warps": 4}
    outliers = native.outliers if native.outliers.numel() else native.row_ptr  # never read when empty
    _decode_kernel[(triton.cdiv(n, cfg["BN"]),)](native.codes, native.row_ptr, outliers, native.scale, out, n, k,
                                                words, **cfg)
    return out


def config(m: int, n: int, k: int) -> dict:
    """Block sizes measured on an H200 at K=4096 N=14336 (benchmarks/NOTES.md)."""
    if interpreted():
        return {"BM": 1 if m == 1 else 16, "BN": 16, "BKW": 4, "BE": 16, "num_warps": 1, "num_stages": 1}
    if m == 1:
        return {"BM": 1, "BN": 8, "BKW": 64, "BE": 64, "num_warps": 2, "num_stages": 3}
    return {"BM": 16, "BN": 16, "BKW": 8, "BE": 32, "num_warps": 4, "num_stages": 2}


def linear(x: torch.Tensor, native: Int8xNative, out: torch.Tensor | None = None,
           cfg: dict | None = None) -> torch.Tensor:
    """``y = x @ W^T`` for a 2-D ``x`` (M, K) of any strides; ``out`` (M, N) in x's dtype may be given."""
    n, k = native.n, native.k
    out = linear_out(x, n, k, out, "int8x native")
    words = _check(native)
    check_device(x, out, native.codes, native.row_ptr, native.outliers, native.scale)
    m = x.shape[0]
    if m == 0 or n == 0:
        return out
    cfg = dict(config(m, n, k), **(cfg or {}))
    outliers = native.outliers if native.outliers.numel() else native.row_ptr  # never read when empty
    even = n % cfg["BN"] == 0 and words % cfg["BKW"] == 0 and k == words * CODES_PER_WORD
    args = (x, native.codes, native.row_ptr, outliers, native.scale, out, m, n, k, words,
            x.stride(0), x.stride(1), out.stride(0), out.stride(1))
    bm = cfg.pop("BM")
    if bm == 1:
        _gemv_kernel[(m, triton.cdiv(n, cfg["BN"]))](*args, EVEN=even, **cfg)
        return out
    if x.dtype == torch.float32 or interpreted():
        dot_dtype = tl.float32  # ieee: fp32 FMAs (the interpreter multiplies bf16 tiles as raw bits)
    else:
        dot_dtype = tl.float16 if x.dtype == torch.float16 else tl.bfloat16
    _mm_kernel[(triton.cdiv(m, bm), triton.cdiv(n, cfg["BN"]))](*args, EVEN=even, DOT_DTYPE=dot_dtype, BM=bm, **cfg)
    return out
