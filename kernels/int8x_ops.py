"""``torch.library`` custom ops for ``int8x`` weights (shared FORMATS.md section 2).

    torch.ops.vllm_parity.int8x_decode(b1, b2, l1, l2, l3, b1_blk, b2_blk, scale,
                                       n_rows, n_cols, block_size, dtype, backend) -> W (n_rows, n_cols)
    torch.ops.vllm_parity.int8x_linear(x, b1, b2, l1, l2, l3, b1_blk, b2_blk, scale,
                                       n_rows, n_cols, block_size, backend) -> x @ W^T  (..., n_rows), x.dtype

``backend`` is ``"torch"`` (pure torch, any device), ``"triton"`` (kernels/int8x_triton.py: a GPU, or the CPU
under ``TRITON_INTERPRET=1``), ``"cuda"`` (kernels/int8x_cuda.py, csrc/int8x.cu: CUDA tensors, built with nvcc on
first use) or ``"auto"``: cuda for CUDA tensors where nvcc can build it, else triton on CUDA, torch elsewhere.
:func:`decode` and :func:`linear` pick it from their argument, else from
``PARITY_KERNEL_BACKEND=torch|triton|cuda|auto``, else ``auto`` for CUDA tensors and torch elsewhere; the ops
also accept ``"auto"`` and resolve it from their tensors' device. Both choices are made by
``vllm_parity.serving.choose`` (kernels/choose.py: ``int8x_backend``, ``int8x_op_backend``).

The shape comes in as Python ints and the scale stays a tensor, so no backend reads tensor values on the host
or branches on them: all are safe under torch.compile and CUDA graphs. Validate the tensors once
at load time (``vllm_parity.serving.int8x_load.decode_streams``); the ops trust them.
"""

from __future__ import annotations

import torch

from vllm_parity.reference.formats.int8x import Int8xSpec
from vllm_parity.serving import choose

STREAMS = ("weight_b1", "weight_b2", "weight_l1", "weight_l2", "weight_l3", "weight_b1_blk", "weight_b2_blk",
           "weight_scale")

# Blocks decoded per step of the torch path: bounds its int64 temporaries to ~tens of MB.
_TORCH_CHUNK_ELEMS = 1 << 20
_MASK32 = 0xFFFFFFFF


# -- pure torch ---------------------------------------------------------------------------------


def _padded(t: torch.Tensor, extra: int) -> torch.Tensor:
    """Words as int64 (their uint32 value) with ``extra`` zero words appended, so clamped gathers stay in range."""
    return torch.cat([t.to(torch.int64) & _MASK32, t.new_zeros(extra, dtype=torch.int64)])


def _field(words: torch.Tensor, n_words: int, idx: torch.Tensor, width: int) -> torch.Tensor:
    """Signed ``width``-bit field ``idx`` of a stream; ``words`` padded by 2. Lanes of other levels give junk."""
    t = idx * width
    w = (t >> 5).clamp(0, n_words)
    u = ((words[w] | (words[w + 1] << 32)) >> (t & 31)) & ((1 << width) - 1)
    return torch.where(u >= 1 << (width - 1), u - (1 << width), u)


def _torch_decode_q(b1, b2, l1, l2, l3, b1_blk, b2_blk, n: int, block_size: int) -> torch.Tensor:
    """int32 values (n,), decoded block by block with the block tables, as the Triton kernel does."""
    device = b1.device
    n_blocks = -(-n // block_size)
    words1 = _padded(b1, n_blocks * block_size // 32 - b1.numel())  # every lane of the last block has a word
    words2, words_l1, words_l2 = _padded(b2, 2), _padded(l1, 2), _padded(l2, 2)
    bytes3 = torch.cat([l3.view(torch.int8).to(torch.int64), l3.new_zeros(1, dtype=torch.int64)])
    sizes = (b2.numel(), l1.numel(), l2.numel(), l3.numel())
    out = torch.empty(n, dtype=torch.int32, device=device)
    step = max(1, _TORCH_CHUNK_ELEMS // block_size)
    for first in range(0, n_blocks, step):  # trip count from shapes only
        blocks = torch.arange(first, min(first + step, n_blocks), device=device)
        e = blocks[:, None] * block_size + torch.arange(block_size, device=device)
        valid = e < n
        non_l1 = torch.where(valid, (words1[e >> 5] >> (e & 31)) & 1, 0)
        j = b1_blk[blocks].to(torch.int64)[:, None] + non_l1.cumsum(1) - non_l1
        l3_bit = torch.where(non_l1 == 1, (words2[(j >> 5).clamp(0, sizes[0])] >> (j & 31)) & 1, 0)
        i3 = b2_blk[blocks].to(torch.int64)[:, None] + l3_bit.cumsum(1) - l3_bit
        v1 = _field(words_l1, sizes[1], e - j, 3)
        v2 = _field(words_l2, sizes[2], j - i3, 5)
        v3 = bytes3[i3.clamp(0, sizes[3])]
        q = torch.where(l3_bit == 1, v3, torch.where(non_l1 == 1, v2, v1))
        lo = first * block_size
        out[lo:lo + e.numel()] = q.reshape(-1)[: n - lo].to(torch.int32)
    return out


# -- the ops ------------------------------------------------------------------------------------


@torch.library.custom_op("vllm_parity::int8x_decode", mutates_args=())
def int8x_decode(b1: torch.Tensor, b2: torch.Tensor, l1: torch.Tensor, l2: torch.Tensor, l3: torch.Tensor,
                 b1_blk: torch.Tensor, b2_blk: torch.Tensor, scale: torch.Tensor, n_rows: int, n_cols: int,
                 block_size: int, dtype: torch.dtype, backend: str) -> torch.Tensor:
    backend = choose.int8x_op_backend(backend, b1.device)
    if backend == "triton":
        from vllm_parity.serving import int8x_triton

        return int8x_triton.decode(b1, b2, l1, l2, l3, b1_blk, b2_blk, scale, n_rows, n_cols, block_size, dtype)
    if backend == "cuda":
        from vllm_parity.serving import int8x_cuda

        return int8x_cuda.decode(b1, b2, l1, l2, l3, b1_blk, b2_blk, scale, n_rows, n_cols, block_size, dtype)
    q = _torch_decode_q(b1, b2, l1, l2, l3, b1_blk, b2_blk, n_rows * n_cols, block_size)
    return (q.to(torch.float32) * scale.to(torch.float32)).to(dtype).reshape(n_rows, n_cols)


@torch.library.register_fake("vllm_parity::int8x_decode")
def _int8x_decode_fake(b1, b2, l1, l2, l3, b1_blk, b2_blk, scale, n_rows, n_cols, block_size, dtype, backend):
    return b1.new_empty((n_rows, n_cols), dtype=dtype)


@torch.library.custom_op("vllm_parity::int8x_linear", mutates_args=())
def int8x_linear(x: torch.Tensor, b1: torch.Tensor, b2: torch.Tensor, l1: torch.Tensor, l2: torch.Tensor,
                 l3: torch.Tensor, b1_blk: torch.Tensor, b2_blk: torch.Tensor, scale: torch.Tensor, n_rows: int,
                 n_cols: int, block_size: int, backend: str) -> torch.Tensor:
    backend = choose.int8x_op_backend(backend, x.device)
    if x.shape[-1] != n_cols:
        raise ValueError(f"int8x_linear: x has {x.shape[-1]} input features, the weight ({n_rows}, {n_cols})")
    x2 = x.reshape(-1, n_cols)
    if backend == "triton":
        from vllm_parity.serving import int8x_triton

        y = int8x_triton.linear(x2, b1, b2, l1, l2, l3, b1_blk, b2_blk, scale, n_rows, n_cols, block_size)
    elif backend == "cuda":
        from vllm_parity.serving import int8x_cuda

        y = int8x_cuda.linear(x2, b1, b2, l1, l2, l3, b1_blk, b2_blk, scale, n_rows, n_cols, block_size)
    else:
        q = _torch_decode_q(b1, b2, l1, l2, l3, b1_blk, b2_blk, n_rows * n_cols, block_size)
        w = q.to(torch.float32).reshape(n_rows, n_cols)
        y = ((x2.to(torch.float32) @ w.t()) * scale.to(torch.float32)).to(x.dtype)
    return y.reshape(*x.shape[:-1], n_rows)


@torch.library.register_fake("vllm_parity::int8x_linear")
def _int8x_linear_fake(x, b1, b2, l1, l2, l3, b1_blk, b2_blk, scale, n_rows, n_cols, block_size, backend):
    return x.new_empty((*x.shape[:-1], n_rows))


# -- convenience wrappers over a FORMATS.md tensor dict -----------------------------------------


def _shape(tensors: dict[str, torch.Tensor], shape: tuple[int, int] | None) -> tuple[int, int]:
    if shape is not None:
        return int(shape[0]), int(shape[1])
    # Reads weight_shape on the host: for eager use; pass shape= inside compiled or captured code.
    n_rows, n_cols = (int(v) for v in tensors["weight_shape"].tolist())
    return n_rows, n_cols


def decode(tensors: dict[str, torch.Tensor], shape: tuple[int, int] | None = None,
           spec: Int8xSpec = Int8xSpec(), dtype: torch.dtype = torch.float32,
           backend: str | None = None) -> torch.Tensor:
    """``W = q * scale`` of an int8x tensor dict (keys are FORMATS.md suffixes) through the op."""
    n_rows, n_cols = _shape(tensors, shape)
    args = [tensors[s] for s in STREAMS]
    return torch.ops.vllm_parity.int8x_decode(*args, n_rows, n_cols, spec.block_size, dtype,
                                              choose.int8x_backend(backend, args[0].device))


def linear(x: torch.Tensor, tensors: dict[str, torch.Tensor], shape: tuple[int, int] | None = None,
           spec: Int8xSpec = Int8xSpec(), bias: torch.Tensor | None = None,
           backend: str | None = None) -> torch.Tensor:
    """``x @ W^T (+ bias)`` for ``x`` of shape ``(..., K)``, through the op; result in ``x.dtype``."""
    n_rows, n_cols = _shape(tensors, shape)
    args = [tensors[s] for s in STREAMS]
    y = torch.ops.vllm_parity.int8x_linear(x, *args, n_rows, n_cols, spec.block_size,
                                           choose.int8x_backend(backend, x.device))
    return y if bias is None else y + bias


def serving_layout(q: torch.Tensor, tensors: dict[str, torch.Tensor]) -> tuple[str, object | None]:
    """The layout a validated int8x tensor set (its int8 weights ``q``) is served in, by ``PARITY_INT8X_LAYOUT``
    (``choose.int8x_layout``): ``("native", Int8xNative)`` where that fits, else ``("planes", Int8xPlanes)`` where
    that is at most ``int8x_planes.AUTO_MARGIN`` larger than the stored tensors (``auto``; ``native`` / ``planes``
    force one), else ``("streams", None)``. The vLLM method and the kernels candidate both serve what this says."""
    from vllm_parity.serving import int8x_native, int8x_planes

    choice = choose.int8x_layout()
    if choice in ("auto", "native"):
        native = int8x_native.for_serving(q, tensors)
        if native is not None:
            return "native", native
    if choice in ("auto", "planes"):
        planes = int8x_planes.for_serving(q, tensors, choice)
        if planes is not None:
            return "planes", planes
    return "streams", None


class KernelLinear(torch.nn.Module):
    """An int8x projection on the kernels, in the layout vLLM would serve (:func:`serving_layout`); validated
    once by the serving side's own decoder."""

    def __init__(self, spec: Int8xSpec, stored: dict[str, torch.Tensor], n: int, k: int, name: str = "weight",
                 backend: str | None = None):
        super().__init__()
        from vllm_parity.serving.int8x_load import decode_streams

        self.spec, self.name, self.backend, self.in_features, self.out_features = spec, name, backend, k, n
        self.tensors = dict(stored)
        self.layout, self.packed = serving_layout(decode_streams(self.tensors, spec.block_size, name=name),
                                                  self.tensors)

    @property
    def native(self):
        """The native layout, where served (else None)."""
        return self.packed if self.layout == "native" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.layout != "streams":
            from vllm_parity.serving import int8x_native, int8x_planes

            if self.packed.scale.device != x.device:
                self.packed = self.packed.to(x.device)
            if self.layout == "native":
                return int8x_native.linear(x, self.packed,
                                           backend=choose.int8x_native_backend(self.backend, x.device))
            return int8x_planes.linear(x, self.packed, backend=choose.int8x_planes_backend(self.backend, x.device))
        return linear(x, self.tensors, shape=(self.out_features, self.in_features), spec=self.spec,
                      backend=self.backend)
