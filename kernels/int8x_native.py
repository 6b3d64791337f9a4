"""A native layout for ``int8x`` weights, repacked once at load: 4-bit codes plus a short outlier list.

The stored streams (shared FORMATS.md section 2) locate every value through two nested bitmaps; decoding
them costs a GEMV about 17 instructions per weight, more than a bf16 GEMV spends in all
(benchmarks/NOTES.md). Repacked, each weight with ``-8 <= q <= 7`` is a 4-bit two's complement code at a
fixed place: code ``i`` of word ``j`` of row ``n`` (int32 ``codes[n, j]``, bits ``4i .. 4i+3``) is
``q[n, 8j + i]``. Every other weight has code 0 and one int32 outlier entry ``(k << 8) | (q & 0xFF)``;
the entries are sorted by row, ``row_ptr[n] .. row_ptr[n+1]`` holding row ``n``'s. The repack is lossless;
:func:`fits` says whether it is also no larger than the stored tensors it replaces, which holds when
values beyond 4 bits are much rarer than values beyond 3 bits (each outlier costs 32 bits, each L2 / L3
value of the stored format 3 / 6 bits more than an L1 value).

    torch.ops.vllm_parity.int8x_native_linear(x, codes, row_ptr, outliers, scale, n_rows, n_cols, backend)
        -> x @ W^T, shape (..., n_rows), x.dtype; backend "torch", "triton" or "auto" (triton on CUDA)

Whether a weight is served in this layout (``PARITY_INT8X_LAYOUT``), its backend and its kernel for M rows
of x are chosen by ``vllm_parity.serving.choose`` (kernels/choose.py).

No backend reads tensor values on the host, so the op is safe under torch.compile and CUDA graphs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from vllm_parity.serving import choose

CODES_PER_WORD = 8
MAX_COLS = 1 << 23  # an outlier entry keeps k in its upper 24 bits


class Int8xNative(NamedTuple):
    codes: torch.Tensor     # int32 (N, ceil(K / 8))
    row_ptr: torch.Tensor   # int32 (N + 1,)
    outliers: torch.Tensor  # int32 (E,): (k << 8) | (q & 0xFF), sorted by row
    scale: torch.Tensor     # fp32 (1,)
    n: int
    k: int

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.row_ptr, self.outliers))

    def to(self, device) -> "Int8xNative":
        return self._replace(codes=self.codes.to(device), row_ptr=self.row_ptr.to(device),
                             outliers=self.outliers.to(device), scale=self.scale.to(device))


def pack(q: torch.Tensor, scale: torch.Tensor) -> Int8xNative:
    """The native layout of int8 weights ``q`` (N, K) with their per-tensor fp32 ``scale`` (1,)."""
    if q.dtype != torch.int8 or q.dim() != 2:
        raise ValueError(f"int8x native: q must be a 2-D int8 tensor, got {q.dtype} {tuple(q.shape)}")
    n, k = q.shape
    if k >= MAX_COLS:
        raise ValueError(f"int8x native: K = {k} does not fit an outlier entry (K < {MAX_COLS})")
    v = q.to(torch.int32)
    small = (v >= -8) & (v <= 7)
    words = -(-k // CODES_PER_WORD)
    nib = torch.zeros(n, words * CODES_PER_WORD, dtype=torch.int32, device=q.device)
    nib[:, :k] = torch.where(small, v, 0) & 0xF
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=q.device)
    # Sum of disjoint bit fields = their OR; int64 so that code 7 of word j (bit 31) does not overflow.
    codes = (nib.view(n, words, CODES_PER_WORD).to(torch.int64) << shifts.to(torch.int64)).sum(-1)
    codes = torch.where(codes >= 1 << 31, codes - (1 << 32), codes).to(torch.int32)
    rows, cols = (~small).nonzero(as_tuple=True)  # row-major order: sorted by row, then k
    outliers = (cols.to(torch.int32) << 8) | (v[rows, cols] & 0xFF)
    counts = torch.bincount(rows, minlength=n) if n else torch.zeros(0, dtype=torch.int64, device=q.device)
    row_ptr = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32)
    return Int8xNative(codes.contiguous(), row_ptr, outliers.to(torch.int32).contiguous(),
                       scale.to(torch.float32).reshape(1).contiguous(), n, k)


def unpack(native: Int8xNative) -> torch.Tensor:
    """The int8 weights (N, K) back from the layout, with torch ops only (no host reads)."""
    n, k = native.n, native.k
    shifts = torch.arange(28, -4, -4, dtype=torch.int32, device=native.codes.device)
    # Move code i onto bits 28..31, then an arithmetic shift right sign-extends it.
    q = ((native.codes[:, :, None] << shifts) >> 28).reshape(n, -1)[:, :k]
    e = torch.arange(native.outliers.numel(), device=q.device)
    rows = torch.searchsorted(native.row_ptr, e.to(native.row_ptr.dtype), right=True) - 1
    cols = native.outliers >> 8
    vals = (native.outliers << 24) >> 24
    q[rows, cols] = vals  # q is a view of a fresh tensor: no copy needed
    return q.to(torch.int8)


def stored_bytes(tensors: dict[str, torch.Tensor]) -> int:
    """Bytes of the stored int8x tensors the native layout replaces (streams and block tables)."""
    return sum(t.numel() * t.element_size() for s, t in tensors.items() if s not in ("weight_shape", "weight_scale"))


def fits(native: Int8xNative, tensors: dict[str, torch.Tensor]) -> bool:
    """Whether the native layout takes no more memory than the stored tensors."""
    return native.nbytes <= stored_bytes(tensors)


def for_serving(q: torch.Tensor, tensors: dict[str, torch.Tensor]) -> Int8xNative | None:
    """The native layout to serve an int8x tensor set with (its validated int8 weights ``q``), or None to
    keep the stored streams. ``PARITY_INT8X_LAYOUT``: ``auto`` (default) where it takes no more memory than
    the stored tensors, ``native`` always, ``streams`` never."""
    choice = choose.int8x_layout()
    if choice == "streams":
        return None
    native = pack(q, tensors["weight_scale"].cpu())
    return native if choice == "native" or fits(native, tensors) else None


# -- the op ---------------------------------------------------------------------------------------


@torch.library.custom_op("vllm_parity::int8x_native_linear", mutates_args=())
def int8x_native_linear(x: torch.Tensor, codes: torch.Tensor, row_ptr: torch.Tensor, outliers: torch.Tensor,
                        scale: torch.Tensor, n_rows: int, n_cols: int, backend: str) -> torch.Tensor:
    backend = choose.int8x_native_op_backend(backend, x.device)
    if x.shape[-1] != n_cols:
        raise ValueError(f"int8x_native_linear: x has {x.shape[-1]} input features, the weight ({n_rows}, {n_cols})")
    x2 = x.reshape(-1, n_cols)
    native = Int8xNative(codes, row_ptr, outliers, scale, n_rows, n_cols)
    kernel = choose.int8x_native_kernel(backend, x2.shape[0])
    if kernel == "triton_gemv":
        from vllm_parity.serving import int8x_native_triton

        y = int8x_native_triton.linear(x2, native)
    elif kernel == "triton_gemm":  # many rows of x: decode once, then the dense GEMM
        from vllm_parity.serving import int8x_native_triton

        y = torch.nn.functional.linear(x2, int8x_native_triton.decode(native, x.dtype))
    else:
        w = unpack(native).to(torch.float32)
        y = ((x2.to(torch.float32) @ w.t()) * scale.to(torch.float32)).to(x.dtype)
    return y.reshape(*x.shape[:-1], n_rows)


@torch.library.register_fake("vllm_parity::int8x_native_linear")
def _int8x_native_linear_fake(x, codes, row_ptr, outliers, scale, n_rows, n_cols, backend):
    return x.new_empty((*x.shape[:-1], n_rows))


def linear(x: torch.Tensor, native: Int8xNative, bias: torch.Tensor | None = None,
           backend: str = "auto") -> torch.Tensor:
    """``x @ W^T (+ bias)`` for ``x`` of shape ``(..., K)`` through the op; result in ``x.dtype``."""
    y = torch.ops.vllm_parity.int8x_native_linear(x, native.codes, native.row_ptr, native.outliers, native.scale,
                                                  native.n, native.k,
                                                  choose.int8x_native_op_backend(backend, x.device))
    return y if bias is None else y + bias
