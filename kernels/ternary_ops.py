"""``torch.library`` custom op ``vllm_parity::ternary_linear`` and its public entry point.

The op takes the kernel by name and does nothing that depends on tensor values or needs a host
sync, so it can be captured in CUDA graphs and traced by torch.compile (a fake implementation
gives its output shape). Which kernel runs for a given M is decided in Python before the op is
called, by ``vllm_parity.serving.choose`` (kernels/choose.py: ``ternary_backend``, ``ternary_kernel``).

Backends (argument ``backend`` or env ``PARITY_KERNEL_BACKEND``): ``torch`` (pure torch, any
device), ``triton`` (GPU, or the CPU through ``TRITON_INTERPRET=1``), ``cuda`` (``csrc/ternary.cu``),
``auto`` (per M, the fastest measured on an H200, benchmarks/NOTES.md). Default: ``torch`` on the
CPU, ``auto`` on CUDA.

CUDA kernels: ``cuda_mma`` (tensor cores on the tiled layout, fp16 / bf16 activations, small M; needs
``NativeTernary.tiles`` and group sizes that are multiples of 128), ``cuda_gemm`` (the GEMM on the tiles for
many tokens, wgmma: compute capability 9.0), ``cuda_dequant`` (the dense weight once, then torch's GEMM: large
M), ``cuda_vec`` (CUDA cores, any dtype), ``cuda_naive``.

``cuda_mma`` in eager mode skips the Python op: :func:`ternary_linear` calls the C++ op
``torch.ops.parity_ternary.mma`` (``csrc/ternary.cu``, ``TORCH_LIBRARY``; its configuration chosen in C++), or
``mma_rows`` (the same kernel on the row layout) where the weight has no tiles.
:func:`tiles_linear` serves every M from the tiled copy alone (the vLLM method's single resident copy where
``cuda_gemm`` runs, or under ``PARITY_TERNARY_RESIDENT=tiles``): ``parity_ternary.gemm``, that op, or
``parity_ternary.dequant_tiles`` and torch's GEMM, by ``choose.ternary_tiles_kernel``.
"""

from __future__ import annotations

import os

import torch

from vllm_parity.reference.formats.ternary import TernarySpec
from vllm_parity.serving import choose
from vllm_parity.serving.ternary_repack import (WORD_CODES, NativeTernary, native_weight,  # noqa: F401
                                                 repack, unpack_native)


def _quantized(xf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FORMATS.md per_token_absmax_int8 of fp32 rows: ``(x_q, s_x)`` with ``x ≈ x_q / s_x``."""
    sx = 127.0 / xf.abs().amax(dim=-1, keepdim=True).clamp(min=1e-5)
    return (xf * sx).round().clamp(-128, 127), sx


def _torch_impl(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                k: int, group_size: int, act_quant: bool) -> torch.Tensor:
    """``x @ W^T`` with the weight decoded in the words' own field order, one table lookup a byte, and x's
    features permuted to that order: no pass over the weight reorders it, and a per-channel scale multiplies
    the output (a large model's forward on the CPU is dominated by decoding its weights)."""
    n, kw = qweight.shape
    xf = x.to(torch.float32)
    sx = None
    if act_quant:
        xf, sx = _quantized(xf)  # per row: the permutation below leaves it alone
    if group_size % WORD_CODES:
        w = native_weight(NativeTernary(qweight=qweight, scale=scale, n=n, k=k, group_size=group_size,
                                        act_quant=act_quant), torch.float32)
        y = xf @ w.t()
    else:
        w = _field_order_values(qweight)  # (N, Kw, 16)
        if group_size:
            word_group = torch.arange(kw, device=qweight.device) * WORD_CODES // group_size
            w.mul_(scale[:, word_group].unsqueeze(-1))
        lead = xf.shape[:-1]
        xp = torch.nn.functional.pad(xf.reshape(-1, k), (0, kw * WORD_CODES - k))
        xp = xp.view(-1, kw, WORD_CODES // 2, 2).transpose(-1, -2).reshape(-1, kw * WORD_CODES)
        y = (xp @ w.view(n, -1).t()).view(*lead, n)
        if not group_size:
            y = y * scale.view(n)
    if sx is not None:
        y = y / sx
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype)


_LUTS: dict[torch.device, torch.Tensor] = {}
# Scratch of the decoded weight and its byte indices, reused from call to call: a fresh allocation of a large
# projection's fp32 weight costs more in page faults than the decode itself.
_SCRATCH: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _scratch(device: torch.device, dtype: torch.dtype, numel: int) -> torch.Tensor:
    buf = _SCRATCH.get((device, dtype))
    if buf is None or buf.numel() < numel:
        with torch.inference_mode(False):  # a normal tensor: written in place inside inference mode and outside
            buf = _SCRATCH[(device, dtype)] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel]


def _field_order_values(qweight: torch.Tensor) -> torch.Tensor:
    """The float32 values ``(N, Kw, 16)`` of int32 words, field q of a word (bits 2q, 2q+1 of its little-endian
    bytes) at q: by FIELD_BIT, element ``2 * (q % 8) + q // 8``. A view of this module's scratch: valid until the
    next call."""
    lut = _LUTS.get(qweight.device)
    if lut is None:
        byte = torch.arange(256, device=qweight.device)
        field = torch.stack([(byte >> (2 * f)) & 3 for f in range(4)], dim=-1)  # (256, 4)
        values = ((field & 1) * (1 - (field & 2))).to(torch.float32)  # 0b01 +1, 0b11 -1
        # a byte's four values as one 16-byte element: one gather a byte (several times faster than a row gather)
        lut = _LUTS[qweight.device] = values.contiguous().view(torch.complex128).view(256)
    n, kw = qweight.shape
    by = qweight.contiguous().view(torch.uint8).reshape(-1)
    index = _scratch(qweight.device, torch.int32, by.numel()).copy_(by)
    out = _scratch(qweight.device, torch.complex128, by.numel())
    return torch.index_select(lut, 0, index, out=out).view(torch.float32).view(n, kw, WORD_CODES)


@torch.library.custom_op("vllm_parity::ternary_linear", mutates_args=())
def ternary_linear_op(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                      k: int, group_size: int, act_quant: bool, kernel: str,
                      tiles: torch.Tensor | None = None) -> torch.Tensor:
    """``y = x @ W^T (+ bias)`` for a 2-D ``x`` (M, K) and a native ternary weight (see ternary_repack).

    ``tiles`` is the tiled copy of the weight, which ``cuda_mma`` reads where it is given (else the row layout).
    """
    if kernel == "torch":
        return _torch_impl(x, qweight, scale, bias, k, group_size, act_quant)
    if kernel in ("triton_gemv", "triton_mm"):
        from vllm_parity.serving import ternary_triton

        return ternary_triton.ternary_linear(x, qweight, scale, bias, k, group_size, act_quant, kernel[7:])
    if kernel in ("cuda_naive", "cuda_vec"):
        from vllm_parity.serving import ternary_cuda

        return ternary_cuda.ternary_linear(x, qweight, scale, bias, k, group_size, act_quant, kernel[5:])
    if kernel == "cuda_mma":
        from vllm_parity.serving import ternary_cuda

        rows = tiles is None
        return ternary_cuda.linear_mma(x, qweight if rows else tiles, scale, bias, qweight.shape[0], k, group_size,
                                       act_quant, rows=rows)
    if kernel == "cuda_gemm":
        from vllm_parity.serving import ternary_cuda

        if tiles is None:
            raise ValueError("ternary kernel 'cuda_gemm' reads the tiled layout: the weight has no tiles "
                             "(NativeTernary.with_tiles)")
        return ternary_cuda.linear_gemm(x, tiles, scale, bias, qweight.shape[0], k, group_size, act_quant)
    if kernel == "cuda_dequant":
        from vllm_parity.serving import ternary_cuda

        return ternary_cuda.linear_dequant(x, qweight, scale, bias, k, group_size, act_quant)
    raise ValueError(f"unknown ternary kernel {kernel!r}; expected one of {choose.TERNARY_KERNELS}")


@torch.library.register_fake("vllm_parity::ternary_linear")
def _ternary_linear_fake(x, qweight, scale, bias, k, group_size, act_quant, kernel, tiles=None):
    return x.new_empty((x.shape[0], qweight.shape[0]))


def ternary_linear(x: torch.Tensor, native: NativeTernary, bias: torch.Tensor | None = None,
                   backend: str | None = None) -> torch.Tensor:
    """``y = x @ W^T (+ bias)`` for ``x`` of shape ``(..., K)``; returns ``(..., N)`` in x's dtype."""
    if x.shape[-1] != native.k:
        raise ValueError(f"x has {x.shape[-1]} input features, the ternary weight expects {native.k}")
    if (backend is None and x.is_cuda and not torch.compiler.is_compiling()
            and x.numel() <= choose.MMA_MAX_M * native.k and _eager_mma(x.dtype, native.group_size)
            and (x.numel() < choose.GEMM_MIN_M * native.k or native.tiles is None
                 or not choose.ternary_gemm_eligible(x.dtype, native.group_size))):
        # Eager and small M: the C++ op (configuration chosen in C++), no Python op wrapper per call; the same
        # decision as choose.ternary_kernel below (cuda_mma up to MMA_MAX_M rows, but for the rows cuda_gemm takes
        # from a tiled weight), made once per (dtype, group size, environment). Compiled callers keep the Python
        # custom op below, which runs the same kernel.
        if native.tiles is None:  # the row layout alone
            return _MMA_OP[1](x, native.qweight, native.scale, bias, native.n, native.k, native.group_size,
                              native.act_quant)
        return _MMA_OP[0](x, native.tiles, native.scale, bias, native.n, native.k, native.group_size,
                          native.act_quant)
    x2 = x.reshape(-1, native.k)
    kernel = choose.ternary_kernel(choose.ternary_backend(backend, x.device), x2.shape[0], x.dtype,
                                   native.group_size, native.act_quant, tiled=native.tiles is not None)
    if kernel in ("cuda_mma", "cuda_gemm") and not torch.compiler.is_compiling():
        from vllm_parity.serving import ternary_cuda

        ternary_cuda.ops()
        if kernel == "cuda_gemm":  # the C++ op, its launch chosen in C++
            return torch.ops.parity_ternary.gemm(x, native.tiles, native.scale, bias, native.n, native.k,
                                                 native.group_size, native.act_quant)
        return cpp_mma(x, native.qweight, native.tiles, native.scale, bias, native.n, native.k, native.group_size,
                       native.act_quant)
    y = torch.ops.vllm_parity.ternary_linear(x2, native.qweight, native.scale, bias, native.k,
                                             native.group_size, native.act_quant, kernel, native.tiles)
    return y.reshape(*x.shape[:-1], native.n)


def cpp_mma(x: torch.Tensor, qweight: torch.Tensor, tiles: torch.Tensor | None, scale: torch.Tensor,
            bias: torch.Tensor | None, n: int, k: int, group_size: int, act_quant: bool) -> torch.Tensor:
    """``cuda_mma`` through the C++ op, x ``(..., K)``: on the tiles where there are any, else on the row layout
    (``parity_ternary.mma_rows``). Load the ops first (``ternary_cuda.ops()``), outside compiled code."""
    if tiles is None:
        return torch.ops.parity_ternary.mma_rows(x, qweight, scale, bias, n, k, group_size, act_quant)
    return torch.ops.parity_ternary.mma(x, tiles, scale, bias, n, k, group_size, act_quant)


_EAGER_MMA: dict = {}
_MMA_OP: list = []


def _eager_mma(dtype: torch.dtype, group_size: int) -> bool:
    """Whether backend ``None`` (the environment, else ``auto``) runs ``cuda_mma`` for a weight of this dtype
    and group size at every M <= MMA_MAX_M on CUDA tensors: choose.ternary_kernel's answer, cached per
    environment value (a bad value is left to the full path, which raises)."""
    env = os.environ.get(choose.ENV_BACKEND)
    key = (dtype, group_size, env)
    ok = _EAGER_MMA.get(key)
    if ok is None:
        try:
            backend = choose.ternary_backend(None, torch.device("cuda"))
            ok = choose.ternary_kernel(backend, 1, dtype, group_size, False) == "cuda_mma"
        except ValueError:
            ok = False
        if ok and not _MMA_OP:
            from vllm_parity.serving import ternary_cuda

            _MMA_OP.extend((ternary_cuda.ops().mma.default, ternary_cuda.ops().mma_rows.default))
        _EAGER_MMA[key] = ok
    return ok


def tiles_linear(x: torch.Tensor, tiles: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, n: int, k: int,
                 group_size: int, act_quant: bool, kernel: str | None = None) -> torch.Tensor:
    """``y = x @ W^T (+ bias)`` for ``x`` ``(..., K)`` from the tiled copy alone (``NativeTernary.tiles``: the one
    resident copy of the vLLM method, 2 bits a weight), by :func:`choose.ternary_tiles_kernel` (or ``kernel``):
    ``cuda_gemm`` (the C++ GEMM op), ``cuda_mma`` (the C++ tensor-core op) or ``cuda_dequant_tiles`` (the dense
    weight decoded from the tiles, then torch's GEMM). Calls
    ``torch.ops.parity_ternary`` directly: load it first (``ternary_cuda.ops()``), outside compiled code."""
    m = x.numel() // k if k else 0
    kernel = kernel or choose.ternary_tiles_kernel(m, x.dtype, group_size, act_quant)
    if kernel == "cuda_mma":
        return torch.ops.parity_ternary.mma(x, tiles, scale, bias, n, k, group_size, act_quant)
    if kernel == "cuda_gemm":
        return torch.ops.parity_ternary.gemm(x, tiles, scale, bias, n, k, group_size, act_quant)
    if kernel != "cuda_dequant_tiles":
        raise ValueError(f"unknown tiles kernel {kernel!r}; expected one of {choose.TERNARY_TILES_KERNELS}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    w = torch.ops.parity_ternary.dequant_tiles(tiles, scale, n, k, group_size, x.dtype)
    if act_quant:
        # The quantized activations go to the GEMM dequantized in x's dtype (x_q / s_x: a GEMM of x_q itself
        # could overflow fp16 before the division).
        xq, sx = _quantized(x2.to(torch.float32))
        x2 = (xq / sx).to(x.dtype)
    y = torch.nn.functional.linear(x2, w, None if bias is None else bias.to(x.dtype))
    return y.reshape(*lead, n)


class KernelLinear(torch.nn.Module):
    """A ternary projection on the kernels: its checkpoint tensors repacked once (and tiled on CUDA)."""

    def __init__(self, spec: TernarySpec, stored: dict[str, torch.Tensor], n: int, k: int, name: str = "weight",
                 backend: str | None = None):
        super().__init__()
        self.name, self.backend, self.in_features, self.out_features = name, backend, k, n
        self.native = repack(stored["packed"], stored["scale"], spec, n, k, name)
        if self.native.device.type == "cuda":
            self.native = self.native.with_tiles()  # for the tensor-core kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ternary_linear(x, self.native, backend=self.backend)
