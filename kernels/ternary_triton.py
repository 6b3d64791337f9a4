"""Triton ternary linear ``y = x @ W^T (+ bias)`` on the native layout of :mod:`vllm_parity.serving.ternary_repack`.

Two kernels:

- ``gemv``: CUDA-core FMA kernel for small M. Bandwidth-bound: each program streams a
  ``(BKW words, BN channels)`` tile of 2-bit weights and decodes it in registers, per field a shift,
  an AND and an FMA (the masked field *is* the fp32 bit pattern of +-2.0 or 0, against x / 2).
- ``mm``: tensor-core kernel for larger M: the weight tile is decoded to +-2 / 0 in the dot dtype
  (exact in fp16 and bf16) and fed to ``tl.dot`` with an fp32 accumulator, halved in the epilogue.

Both apply the fp32 scale per output channel in the epilogue (group scales per word or per
element, see ``SCALE_MODE``), then the per-token activation scale and the bias, all in fp32.
Activation quantization (FORMATS.md ``per_token_absmax_int8``) runs first in ``_act_quant_kernel``,
which writes the integer-valued x_q as bf16 (exact) and s_x; the main kernels divide by s_x.
Which kernel runs for which M is decided by the caller (:mod:`vllm_parity.serving.ternary_ops`), never here.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from vllm_parity.serving.ternary_repack import WORD_CODES

# Bit pattern of int32 0xC0000000: the two bits a field is shifted into (fp32 sign and exponent MSB).
_FIELD_MASK = tl.constexpr(-1073741824)
# 1.5 * 2**23: adding and subtracting it rounds |v| < 2**22 to the nearest integer, ties to even.
_RINT_MAGIC = tl.constexpr(12582912.0)

# SCALE_MODE of the kernels: one scale per channel (epilogue), per K tile, per element.
SCALE_CHANNEL, SCALE_GROUP_TILE, SCALE_GROUP_ELEMENT = 0, 1, 2


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# --------------------------------------------------------------------------------------------
# kernels


@triton.jit
def _act_quant_kernel(x_ptr, xq_ptr, sx_ptr, K, stride_xm, stride_xk,
                      BLOCK_K: tl.constexpr):
    """One program per token row: s_x = 127 / max(max|x|, 1e-5); x_q = clamp(rint(x * s_x), -128, 127)."""
    m = tl.program_id(0)
    offs = tl.arange(0, BLOCK_K)
    row = x_ptr + m * stride_xm
    amax = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs
        v = tl.load(row + k * stride_xk, mask=k < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(v))
    s_x = tl.math.div_rn(tl.full([BLOCK_K], 127.0, tl.float32),
                         tl.maximum(tl.max(amax, axis=0), 1e-5))
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs
        v = tl.load(row + k * stride_xk, mask=k < K, other=0.0).to(tl.float32)
        q = (v * s_x + _RINT_MAGIC) - _RINT_MAGIC  # launched without FMA fusion: x*s_x rounds first
        q = tl.minimum(tl.maximum(q, -128.0), 127.0)
        tl.store(xq_ptr + m * K + k, q.to(tl.bfloat16), mask=k < K)
    tl.store(sx_ptr + m + offs, s_x, mask=offs < 1)


@triton.jit
def _field(w, e: tl.constexpr):
    """Weight e (= k % 16) of each int32 word as fp32 +-2.0 or 0: its field moved onto bits 30..31."""
    return ((w << (30 - (2 * (e // 2) + 16 * (e % 2)))) & _FIELD_MASK).to(tl.float32, bitcast=True)


@triton.jit
def _pair(w, i: tl.constexpr):
    """Weights 2i and 2i+1 of each word as 16-bit patterns of +-2.0 / 0 (fp16 and bf16 alike).

    One shift and one AND leave both fields in place as a packed half2; the asm only names its halves.
    """
    return tl.inline_asm_elementwise(
        "{ .reg .b32 t; and.b32 t, $2, 0xC000C000; mov.b32 {$0, $1}, t; }",
        "=h,=h,r", [w << (14 - 2 * i)], dtype=(tl.int16, tl.int16), is_pure=True, pack=1)


@triton.jit
def _decode16(w, R: tl.constexpr, C: tl.constexpr, DT: tl.constexpr):
    """Words ``(R, C)`` -> weights ``(R, 16 * C)`` as fp16 / bf16 +-2 / 0, in k order (GPU only)."""
    e0, e1 = _pair(w, 0)
    e2, e3 = _pair(w, 1)
    e4, e5 = _pair(w, 2)
    e6, e7 = _pair(w, 3)
    e8, e9 = _pair(w, 4)
    e10, e11 = _pair(w, 5)
    e12, e13 = _pair(w, 6)
    e14, e15 = _pair(w, 7)
    # Same join order as _decode: the last join pairs e with e + 1, so each pair stays one register.
    q0 = tl.join(tl.join(e0, e8), tl.join(e4, e12))
    q1 = tl.join(tl.join(e1, e9), tl.join(e5, e13))
    q2 = tl.join(tl.join(e2, e10), tl.join(e6, e14))
    q3 = tl.join(tl.join(e3, e11), tl.join(e7, e15))
    d = tl.join(tl.join(q0, q2), tl.join(q1, q3))
    return tl.reshape(d, (R, C * 16)).to(DT, bitcast=True)


@triton.jit
def _decode(w, R: tl.constexpr, C: tl.constexpr):
    """Words ``(R, C)`` -> weights ``(R, 16 * C)`` (fp32 +-2 / 0) in k order.

    tl.join keeps the new axis inside a thread, so all 16 fields of a word stay in registers;
    each level selects one bit of the field index, most significant first, so that the row-major
    flattening of the four new axes is the field index (= k % 16).
    """
    p0 = tl.join(_field(w, 0), _field(w, 8))
    p1 = tl.join(_field(w, 1), _field(w, 9))
    p2 = tl.join(_field(w, 2), _field(w, 10))
    p3 = tl.join(_field(w, 3), _field(w, 11))
    p4 = tl.join(_field(w, 4), _field(w, 12))
    p5 = tl.join(_field(w, 5), _field(w, 13))
    p6 = tl.join(_field(w, 6), _field(w, 14))
    p7 = tl.join(_field(w, 7), _field(w, 15))
    q0 = tl.join(p0, p4)
    q1 = tl.join(p1, p5)
    q2 = tl.join(p2, p6)
    q3 = tl.join(p3, p7)
    r0 = tl.join(q0, q2)
    r1 = tl.join(q1, q3)
    return tl.reshape(tl.join(r0, r1), (R, C * 16))


@triton.jit(do_not_specialize=["K", "G", "GS"])
def _gemv_kernel(x_ptr, qw_ptr, s_ptr, b_ptr, sx_ptr, y_ptr,
                 N, K, KW, G, GS, stride_xm, stride_xk, stride_ym,
                 SCALE_MODE: tl.constexpr, ACT_QUANT: tl.constexpr, HAS_BIAS: tl.constexpr,
                 EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
                 BN: tl.constexpr, BKW: tl.constexpr):
    BK: tl.constexpr = BKW * 16
    m = tl.program_id(0)  # fastest: the M programs of one weight tile run together and share it in L2
    pid_n = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_w = tl.arange(0, BKW)
    offs_k = tl.arange(0, BK)
    n_mask = offs_n < N
    x_row = x_ptr + m * stride_xm
    acc = tl.zeros([BN, BK], dtype=tl.float32)
    acc1 = tl.zeros([BN], dtype=tl.float32)
    for kw0 in range(0, KW, BKW):
        kw = kw0 + offs_w
        k = kw0 * 16 + offs_k
        w_ptrs = qw_ptr + offs_n[:, None] * KW + kw[None, :]
        if EVEN_K and EVEN_N:
            w = tl.load(w_ptrs)
        else:
            w = tl.load(w_ptrs, mask=n_mask[:, None] & (kw[None, :] < KW), other=0)
        if EVEN_K:
            xk = tl.load(x_row + k * stride_xk)
        else:
            xk = tl.load(x_row + k * stride_xk, mask=k < K, other=0.0)
        # Halved once per tile, so the +-2.0 decoded weights contribute exactly +-x.
        xk = xk.to(tl.float32) * 0.5
        f = _decode(w, BN, BKW)
        if SCALE_MODE == 0:
            acc += f * xk[None, :]
        elif SCALE_MODE == 1:
            # The tile lies in one group: reduce it, then scale per channel.
            s = tl.load(s_ptr + offs_n * G + (kw0 * 16) // GS, mask=n_mask, other=0.0)
            acc1 += tl.sum(f * xk[None, :], axis=1) * s
        else:
            s = tl.load(s_ptr + offs_n[:, None] * G + (k // GS)[None, :],
                        mask=n_mask[:, None] & (k[None, :] < K), other=0.0)
            acc += (f * s) * xk[None, :]
    if SCALE_MODE == 1:
        y = acc1
    else:
        y = tl.sum(acc, axis=1)
    if SCALE_MODE == 0:
        y = y * tl.load(s_ptr + offs_n, mask=n_mask, other=0.0)
    if ACT_QUANT:
        y = tl.math.div_rn(y, tl.load(sx_ptr + m + offs_n * 0))  # (BN,) copies of s_x[m]
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + m * stride_ym + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_mask)


@triton.jit(do_not_specialize=["M", "K", "G", "GS", "KW_SPLIT", "SPLIT_K"])
def _mm_kernel(x_ptr, qw_ptr, s_ptr, b_ptr, sx_ptr, y_ptr, ws_ptr, cnt_ptr,
               M, N, K, KW, G, GS, KW_SPLIT, SPLIT_K, stride_xm, stride_xk, stride_ym,
               SCALE_MODE: tl.constexpr, ACT_QUANT: tl.constexpr, HAS_BIAS: tl.constexpr,
               EVEN_K: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
               ASM_DECODE: tl.constexpr, USE_SPLIT: tl.constexpr, SWAP_AB: tl.constexpr,
               BM: tl.constexpr, BN: tl.constexpr, BKW: tl.constexpr, GROUP_M: tl.constexpr):
    BK: tl.constexpr = BKW * 16
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    # Grouped order: GROUP_M row blocks share each weight tile while it is in L2.
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    m_mask = offs_m < M
    n_mask = offs_n < N
    offs_k = tl.arange(0, BK)
    offs_w = tl.arange(0, BKW)
    # SWAP_AB accumulates y^T = W x^T: the decoded weights become the MMA's A operand.
    if SWAP_AB:
        acc = tl.zeros([BN, BM], dtype=tl.float32)
    else:
        acc = tl.zeros([BM, BN], dtype=tl.float32)
    kw_lo = pid_k * KW_SPLIT
    kw_hi = tl.minimum(kw_lo + KW_SPLIT, KW)
    for kw0 in range(kw_lo, kw_hi, BKW):
        k = kw0 * 16 + offs_k
        kw = kw0 + offs_w
        a_ptrs = x_ptr + offs_m[:, None] * stride_xm + k[None, :] * stride_xk
        if EVEN_K:
            a = tl.load(a_ptrs, mask=m_mask[:, None], other=0.0)
            w = tl.load(qw_ptr + offs_n[:, None] * KW + kw[None, :], mask=n_mask[:, None], other=0)
        else:
            a = tl.load(a_ptrs, mask=m_mask[:, None] & (k[None, :] < K), other=0.0)
            w = tl.load(qw_ptr + offs_n[:, None] * KW + kw[None, :],
                        mask=n_mask[:, None] & (kw[None, :] < kw_hi), other=0)
        if SCALE_MODE == 2:
            s = tl.load(s_ptr + offs_n[:, None] * G + (k // GS)[None, :],
                        mask=n_mask[:, None] & (k[None, :] < K), other=0.0)
            f = _decode(w, BN, BKW) * s
            if SWAP_AB:
                acc = tl.dot(f, tl.trans(a.to(tl.float32)), acc, input_precision="ieee")
            else:
                acc = tl.dot(a.to(tl.float32), tl.trans(f), acc, input_precision="ieee")
        else:
            if ASM_DECODE:
                f = _decode16(w, BN, BKW, DOT_DTYPE)  # (BN, BK) +-2 / 0
            else:
                f = _decode(w, BN, BKW).to(DOT_DTYPE)
            if SCALE_MODE == 1:
                # BK divides the group size: one scale per channel for the whole tile.
                s = tl.load(s_ptr + offs_n * G + (kw0 * 16) // GS, mask=n_mask, other=0.0)
                if SWAP_AB:
                    acc += tl.dot(f, tl.trans(a.to(DOT_DTYPE)), input_precision=PRECISION) * s[:, None]
                else:
                    acc += tl.dot(a.to(DOT_DTYPE), tl.trans(f), input_precision=PRECISION) * s[None, :]
            else:
                if SWAP_AB:
                    acc = tl.dot(f, tl.trans(a.to(DOT_DTYPE)), acc, input_precision=PRECISION)
                else:
                    acc = tl.dot(a.to(DOT_DTYPE), tl.trans(f), acc, input_precision=PRECISION)
    if SWAP_AB:
        acc = tl.trans(acc)
    mn_mask = m_mask[:, None] & n_mask[None, :]
    if USE_SPLIT:
        # Serial split-K: each program parks its partial tile; the last to arrive sums all of them
        # in split order (deterministic) and finishes the tile. Counters are left at zero.
        ws_tile = ws_ptr + offs_m[:, None] * N + offs_n[None, :]
        tl.store(ws_tile + pid_k * M * N, acc, mask=mn_mask)
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + pid, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            acc = tl.zeros([BM, BN], dtype=tl.float32)
            for sk in range(0, SPLIT_K):
                acc += tl.load(ws_tile + sk * M * N, mask=mn_mask, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(cnt_ptr + pid, 0, sem="relaxed", scope="gpu")
            _mm_epilogue(acc, s_ptr, b_ptr, sx_ptr, y_ptr, offs_m, offs_n, m_mask, n_mask, stride_ym,
                         SCALE_MODE, ACT_QUANT, HAS_BIAS)
    else:
        _mm_epilogue(acc, s_ptr, b_ptr, sx_ptr, y_ptr, offs_m, offs_n, m_mask, n_mask, stride_ym,
                     SCALE_MODE, ACT_QUANT, HAS_BIAS)


@triton.jit
def _mm_epilogue(acc, s_ptr, b_ptr, sx_ptr, y_ptr, offs_m, offs_n, m_mask, n_mask, stride_ym,
                 SCALE_MODE: tl.constexpr, ACT_QUANT: tl.constexpr, HAS_BIAS: tl.constexpr):
    y = acc * 0.5  # the decoded weights are +-2
    if SCALE_MODE == 0:
        y = y * tl.load(s_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
    if ACT_QUANT:
        y = tl.math.div_rn(y, tl.load(sx_ptr + offs_m, mask=m_mask, other=1.0)[:, None])
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


# --------------------------------------------------------------------------------------------
# configurations (measured on an H200, see benchmarks/NOTES.md)

_SMS = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    if device.index not in _SMS:
        _SMS[device.index] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[device.index]


def gemv_config(m: int, n: int, k: int) -> dict:
    if interpreting():
        return {"BN": 32, "BKW": 8, "num_warps": 1, "num_stages": 1}
    if k >= 8192:
        # Long rows: more programs (fewer rows each) and longer contiguous runs per row.
        return {"BN": 8, "BKW": 64, "num_warps": 4, "num_stages": 2}
    return {"BN": 16, "BKW": 16, "num_warps": 4, "num_stages": 3}


def mm_config(m: int, n: int, k: int, elem_bytes: int = 2) -> dict:
    if interpreting():
        return {"BM": 16, "BN": 32, "BKW": 4, "GROUP_M": 4, "SWAP_AB": m % 2 == 1, "num_warps": 1,
                "num_stages": 1}
    if m <= 16:
        return {"BM": 16, "BN": 256, "BKW": 4, "GROUP_M": 1, "SWAP_AB": False, "num_warps": 4, "num_stages": 3}
    if m <= 64:
        return {"BM": 64, "BN": 128, "BKW": 4, "GROUP_M": 1, "SWAP_AB": False, "num_warps": 4, "num_stages": 4}
    # fp32 operands take twice the shared memory per stage.
    return {"BM": 128, "BN": 128, "BKW": 4, "GROUP_M": 8, "SWAP_AB": False, "num_warps": 4,
            "num_stages": 4 if elem_bytes <= 2 else 2}


def _split_k(tiles: int, kw: int, bkw: int, sms: int, requested: int | None) -> int:
    """Split K until there are about two programs per multiprocessor (small M, few N tiles)."""
    steps = -(-kw // bkw)
    if requested is not None:
        return max(1, min(requested, steps))
    split = 1
    while tiles * split * 2 <= 2 * sms and split * 2 <= steps and split < 16:
        split *= 2
    return split


_COUNTERS: dict = {}


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """Persistent zeroed arrival counters for split-K (every launch leaves them at zero)."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf


# --------------------------------------------------------------------------------------------
# launchers


def _fit_group(cfg: dict, group_size: int) -> int:
    """Shrink the K tile so that it never straddles a group; returns the kernels' SCALE_MODE."""
    if group_size == 0:
        return SCALE_CHANNEL
    if group_size % WORD_CODES:
        return SCALE_GROUP_ELEMENT
    while group_size % (cfg["BKW"] * WORD_CODES):
        cfg["BKW"] //= 2
    return SCALE_GROUP_TILE


def act_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token absmax int8 fake quantization of a 2-D x: (x_q as bf16 integers, s_x fp32 (M,))."""
    m, k = x.shape
    xq = torch.empty((m, k), dtype=torch.bfloat16, device=x.device)
    sx = torch.empty((m,), dtype=torch.float32, device=x.device)
    if m:
        # Without FMA fusion x * s_x is rounded to fp32 before rounding to an integer, as in torch.
        extra = {} if interpreting() else {"enable_fp_fusion": False}
        _act_quant_kernel[(m,)](x, xq, sx, k, x.stride(0), x.stride(1),
                                BLOCK_K=1024 if k > 512 else 128, num_warps=4, **extra)
    return xq, sx


def ternary_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                   k: int, group_size: int, act_quant_flag: bool, kernel: str,
                   out: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """``y = x @ W^T (+ bias)`` for a 2-D ``x`` (M, K); ``kernel`` is ``"gemv"`` or ``"mm"``.

    ``out`` (M, N) in x's dtype may be given (tests poison it); ``config`` overrides block sizes
    (and ``SPLIT_K`` for ``mm``).
    """
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be (M, {k}), got {tuple(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"x must be fp16, bf16 or fp32, got {x.dtype}")
    if kernel not in ("gemv", "mm"):
        raise ValueError(f"unknown triton kernel {kernel!r}; expected 'gemv' or 'mm'")
    m = x.shape[0]
    n, kw = qweight.shape
    g = scale.shape[1]
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if interpreting() and out.dtype == torch.bfloat16:
        # The interpreter truncates fp32 -> bf16; the kernel writes fp32 and torch rounds to nearest.
        y32 = torch.full((m, n), float("nan"), dtype=torch.float32)
        ternary_linear(x, qweight, scale, bias, k, group_size, act_quant_flag, kernel, y32, config)
        return out.copy_(y32)
    if act_quant_flag:
        xa, sx = act_quant(x)
    else:
        xa, sx = x, scale  # sx unused
    b = bias if bias is not None else scale  # unused when HAS_BIAS is False
    common = dict(ACT_QUANT=act_quant_flag, HAS_BIAS=bias is not None)
    fusion = {} if interpreting() else {"enable_fp_fusion": True}
    if kernel == "gemv":
        cfg = dict(gemv_config(m, n, k), **(config or {}))
        scale_mode = _fit_group(cfg, group_size)
        even_k = k == kw * WORD_CODES and kw % cfg["BKW"] == 0
        grid = (m, triton.cdiv(n, cfg["BN"]))
        _gemv_kernel[grid](xa, qweight, scale, b, sx, out, n, k, kw, g, max(group_size, 1),
                           xa.stride(0), xa.stride(1), out.stride(0),
                           SCALE_MODE=scale_mode, EVEN_K=even_k, EVEN_N=n % cfg["BN"] == 0,
                           **common, **cfg, **fusion)
        return out
    cfg = dict(mm_config(m, n, k, x.element_size()), **(config or {}))
    requested = cfg.pop("SPLIT_K", None)
    scale_mode = _fit_group(cfg, group_size)
    if act_quant_flag:
        dot_dtype, precision = tl.bfloat16, "ieee"  # integers up to 128 and +-2 are exact in bf16
    elif x.dtype == torch.float32:
        dot_dtype, precision = tl.float32, "tf32x3"  # weights exact in tf32, x split in two parts
    else:
        dot_dtype, precision = (tl.float16 if x.dtype == torch.float16 else tl.bfloat16), "ieee"
    if dot_dtype == tl.bfloat16 and interpreting():
        # The interpreter multiplies bf16 tiles as their raw uint16 bits; fp32 holds them exactly.
        dot_dtype = tl.float32
    tiles = triton.cdiv(m, cfg["BM"]) * triton.cdiv(n, cfg["BN"])
    split = _split_k(tiles, kw, cfg["BKW"], _num_sms(x.device), requested)
    kw_split = triton.cdiv(triton.cdiv(kw, split), cfg["BKW"]) * cfg["BKW"]
    split = triton.cdiv(kw, kw_split)
    even_k = k == kw * WORD_CODES and kw % cfg["BKW"] == 0
    if split > 1:
        ws = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
        cnt = _counters(x.device, tiles)
    else:
        ws = cnt = scale  # unused
    _mm_kernel[(tiles, split)](xa, qweight, scale, b, sx, out, ws, cnt, m, n, k, kw, g, max(group_size, 1),
                               kw_split, split, xa.stride(0), xa.stride(1), out.stride(0),
                               SCALE_MODE=scale_mode, EVEN_K=even_k, DOT_DTYPE=dot_dtype,
                               PRECISION=precision, ASM_DECODE=dot_dtype != tl.float32 and not interpreting(),
                               USE_SPLIT=split > 1, **common, **cfg, **fusion)
    return out
