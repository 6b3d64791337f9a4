"""The ``int8x`` format (shared FORMATS.md section 2): its spec and reference codec.

INT8 weights ``q`` of shape ``(N, K)``, flattened row-major to ``v[0..n-1]``, are split by absolute
value into three fixed-length levels (L1: ``|v| <= 3`` as 3 bits, L2: ``|v| <= 15`` as 5 bits,
L3: the int8 byte), located by two nested bitmaps (``b1`` over all elements, ``b2`` over the
non-L1 ones), with per-block prefix counts of both bitmaps so a decoder can start at any block.

Everything is vectorized with numpy's ``packbits``/``unpackbits(bitorder="little")``: stream bit
``t`` is bit ``t % 8`` of byte ``t // 8``, which on a little-endian int32 view is bit ``t % 32`` of
word ``t // 32`` — exactly the layout FORMATS.md prescribes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from vllm_parity.errors import CheckpointError, DecodeError, FormatError
from vllm_parity.reference.formats import FormatSpec, build, register

if TYPE_CHECKING:
    from vllm_parity.reference.checkpoint import Checkpoint

@register
@dataclass(frozen=True)
class Int8xSpec(FormatSpec):
    """The ``int8x`` format: INT8 weights stored losslessly in 3/5/8-bit levels."""

    levels: tuple[int, ...] = (3, 5, 8)
    block_size: int = 1024
    ignore: tuple[str, ...] = ("lm_head",)

    quant_method = "int8x"
    suffixes = ("weight_shape", "weight_scale", "weight_b1", "weight_b2", "weight_l1",
                "weight_l2", "weight_l3", "weight_b1_blk", "weight_b2_blk")

    def __post_init__(self) -> None:
        if tuple(self.levels) != (3, 5, 8):
            raise FormatError(f"int8x levels must be [3, 5, 8] in this version, got {list(self.levels)}")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) \
                or self.block_size <= 0 or self.block_size % 32:
            raise FormatError(f"int8x block_size must be a positive multiple of 32, got {self.block_size!r}")

    def tensor_names(self, module: str) -> dict[str, str]:
        return {s: f"{module}.{s}" for s in self.suffixes}

    @classmethod
    def from_config(cls, body: dict[str, Any]) -> Int8xSpec:
        return build(cls, body, {"levels", "block_size", "ignore"}, ("levels", "ignore"))

    def read_stored(self, ckpt: Checkpoint, module: str, n: int, k: int) -> dict[str, torch.Tensor]:
        stored = {}
        for suffix, name in self.tensor_names(module).items():
            info = ckpt.info(name)
            if info.dtype != DTYPES[suffix]:
                raise CheckpointError(f"{info.file.name}: tensor {name!r} has dtype "
                                      f"{str(info.dtype).removeprefix('torch.')}, expected "
                                      f"{str(DTYPES[suffix]).removeprefix('torch.')}")
            stored[suffix] = ckpt.tensor(name)
        shape = tuple(int(v) for v in stored["weight_shape"].tolist())
        if shape != (n, k):
            raise CheckpointError(f"{ckpt.path}: tensor {module}.weight_shape is {list(shape)}, "
                                  f"expected [{n}, {k}] from config.json")
        return stored

    def decode(self, stored: dict[str, torch.Tensor], n: int, k: int, name: str,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return decode(stored, self, name=name, dtype=dtype)

    def code_step(self, ckpt: Checkpoint, module: str) -> torch.Tensor:
        scale = scale_of({"weight_scale": ckpt.tensor(f"{module}.weight_scale")}, module)
        return torch.tensor([abs(scale)], dtype=torch.float64)

    def to_config(self) -> dict[str, Any]:
        return {"quant_method": self.quant_method, "levels": list(self.levels),
                "block_size": self.block_size, "ignore": list(self.ignore)}


L1_MAX = 3
L2_MAX = 15
L1_BITS = 3
L2_BITS = 5
INT32_MAX = 2**31 - 1

# Tensor suffix -> stored dtype (FORMATS.md table).
DTYPES: dict[str, torch.dtype] = {
    "weight_shape": torch.int64,
    "weight_scale": torch.float32,
    "weight_b1": torch.int32,
    "weight_b2": torch.int32,
    "weight_l1": torch.int32,
    "weight_l2": torch.int32,
    "weight_l3": torch.uint8,
    "weight_b1_blk": torch.int32,
    "weight_b2_blk": torch.int32,
}
PAYLOAD = ("weight_b1", "weight_b2", "weight_l1", "weight_l2", "weight_l3")
BLOCK_TABLES = ("weight_b1_blk", "weight_b2_blk")

# Values per chunk in the stream helpers: bounds the (values x width) bit matrix to ~tens of MB.
# A multiple of 8 so every chunk starts on a byte boundary of the stream.
_CHUNK = 1 << 22


def n_words(n_bits: int) -> int:
    """Number of 32-bit words holding ``n_bits`` stream bits."""
    return -(-n_bits // 32)


def n_blocks(n: int, block_size: int) -> int:
    return -(-n // block_size)


# -- bit streams --------------------------------------------------------------------------------


def _np(t: torch.Tensor | np.ndarray) -> np.ndarray:
    if isinstance(t, np.ndarray):
        return t
    return t.detach().cpu().contiguous().numpy()


def _words_to_torch(stream_bytes: np.ndarray, count_bits: int) -> torch.Tensor:
    """Little-endian bytes of a stream -> int32 words, zero-padded to ceil(count_bits/32) words."""
    words = np.zeros(n_words(count_bits) * 4, dtype=np.uint8)
    words[: stream_bytes.size] = stream_bytes
    return torch.from_numpy(words.view("<i4").astype(np.int32))


def _word_bytes(words: torch.Tensor | np.ndarray) -> np.ndarray:
    """The stream bytes of int32 words, least significant byte first whatever the host order."""
    return np.ascontiguousarray(_np(words).astype("<i4", copy=False)).view(np.uint8)


def pack_bits(bits: torch.Tensor | np.ndarray) -> torch.Tensor:
    """Bits (bool, or uint8 holding 0/1; flattened) -> int32 words, bit ``t`` in word ``t//32`` at bit ``t%32``."""
    b = _np(bits).reshape(-1)
    if b.dtype != np.bool_:
        if b.size and (b.min() < 0 or b.max() > 1):
            raise ValueError("pack_bits: bits must be 0 or 1")
        b = b.astype(np.bool_)
    return _words_to_torch(np.packbits(b, bitorder="little"), b.size)


def unpack_bits(words: torch.Tensor | np.ndarray, count: int) -> torch.Tensor:
    """The first ``count`` bits of int32 words, as uint8 0/1 (inverse of :func:`pack_bits`)."""
    raw = _word_bytes(words)
    if count < 0 or count > raw.size * 8:
        raise ValueError(f"unpack_bits: {count} bits asked of {raw.size // 4} words ({raw.size * 8} bits)")
    return torch.from_numpy(np.unpackbits(raw, count=count, bitorder="little"))


def _check_width(width: int) -> None:
    if isinstance(width, bool) or not isinstance(width, int) or not 1 <= width <= 31:
        raise ValueError(f"stream width must be an integer in 1..31, got {width!r}")


def pack_stream(values: torch.Tensor | np.ndarray, width: int) -> torch.Tensor:
    """Integers -> one continuous bit stream of ``width``-bit two's complement fields, as int32 words.

    The value at position ``i`` occupies stream bits ``i*width .. i*width+width-1``, its bit ``j`` at
    stream bit ``i*width + j``. Values must fit ``width`` bits (signed or unsigned range).
    """
    _check_width(width)
    v = _np(values).reshape(-1).astype(np.int64)
    if v.size and (v.min() < -(1 << (width - 1)) or v.max() >= (1 << width)):
        raise ValueError(f"pack_stream: values in [{v.min()}, {v.max()}] do not fit {width} bits")
    nbytes = -(-width // 8)
    out = np.empty(-(-v.size * width // 8), dtype=np.uint8)
    for i0 in range(0, v.size, _CHUNK):
        chunk = v[i0:i0 + _CHUNK]
        # Low `width` bits of each value (two's complement), as little-endian bytes -> bit rows.
        u = (chunk & ((1 << width) - 1)).astype("<u4").view(np.uint8).reshape(-1, 4)[:, :nbytes]
        rows = np.unpackbits(u, axis=1, bitorder="little")[:, :width]
        packed = np.packbits(rows.reshape(-1), bitorder="little")
        start = i0 * width // 8  # exact: i0 is a multiple of 8
        out[start:start + packed.size] = packed
    return _words_to_torch(out, v.size * width)


def unpack_stream(words: torch.Tensor | np.ndarray, count: int, width: int, signed: bool = True) -> torch.Tensor:
    """The first ``count`` ``width``-bit fields of a stream (inverse of :func:`pack_stream`), as int32."""
    _check_width(width)
    raw = _word_bytes(words)
    if count < 0 or count * width > raw.size * 8:
        raise ValueError(f"unpack_stream: {count} values of {width} bits need {count * width} bits, "
                         f"the stream has {raw.size * 8}")
    nbytes = -(-width // 8)
    out = np.empty(count, dtype=np.int32)
    for i0 in range(0, count, _CHUNK):
        c = min(_CHUNK, count - i0)
        start = i0 * width // 8
        bits = np.unpackbits(raw[start:start + -(-c * width // 8)], count=c * width, bitorder="little")
        rows = np.zeros((c, 8 * nbytes), dtype=np.uint8)
        rows[:, :width] = bits.reshape(c, width)
        # Rows are contiguous, so packing them flat gives each value's little-endian bytes in order
        # (numpy packs a flat array ~5x faster than along a short axis).
        u = np.packbits(rows.reshape(-1), bitorder="little").reshape(c, nbytes)
        if nbytes == 1:
            val = u[:, 0].astype(np.int64)
        else:
            full = np.zeros((c, 4), dtype=np.uint8)
            full[:, :nbytes] = u
            val = full.view("<u4").reshape(c).astype(np.int64)
        if signed:  # int64 so that width 31 does not overflow
            val -= (val >> (width - 1) & 1) << width
        out[i0:i0 + c] = val
    return torch.from_numpy(out)


# -- levels -------------------------------------------------------------------------------------


def _flat_int8(q: torch.Tensor, what: str) -> np.ndarray:
    if not isinstance(q, torch.Tensor) or q.dtype != torch.int8:
        raise FormatError(f"int8x {what}: q must be an int8 tensor, got "
                          f"{q.dtype if isinstance(q, torch.Tensor) else type(q).__name__}")
    return _np(q).reshape(-1)


def levels(q: torch.Tensor) -> dict:
    """Level statistics of int8 weights: counts ``n1, n2, n3`` and fractions ``l1, l2, l3``."""
    a = np.abs(_flat_int8(q, "levels").astype(np.int16))
    n = a.size
    n3 = int(np.count_nonzero(a > L2_MAX))
    n2 = int(np.count_nonzero(a > L1_MAX)) - n3
    n1 = n - n2 - n3
    frac = (lambda c: c / n) if n else (lambda c: 0.0)
    return {"n": n, "n1": n1, "n2": n2, "n3": n3, "l1": frac(n1), "l2": frac(n2), "l3": frac(n3)}


# -- encode -------------------------------------------------------------------------------------


def _exclusive_cumsum(bits: np.ndarray) -> np.ndarray:
    """c[i] = number of ones in bits[:i], for i in 0..len(bits)."""
    c = np.zeros(bits.size + 1, dtype=np.int32)  # n < 2**31; int32 also runs ~5x faster than int64 here
    np.cumsum(bits, dtype=np.int32, out=c[1:])
    return c


def block_tables(nonl1: np.ndarray, is_l3: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """``(b1_blk, b2_blk)`` from the b1 bits (n) and b2 bits (m) as bool arrays.

    b1_blk[b] = ones of b1 before element b*block_size = the non-L1 index of the first non-L1 element at
    or after that position, so b2_blk[b] = ones of b2 before that non-L1 index (all of them if none is left).
    """
    starts = np.arange(n_blocks(nonl1.size, block_size), dtype=np.int64) * block_size
    b1_blk = _exclusive_cumsum(nonl1)[starts]
    b2_blk = _exclusive_cumsum(is_l3)[b1_blk]
    return b1_blk.astype(np.int32), b2_blk.astype(np.int32)


def encode(q: torch.Tensor, scale: float | torch.Tensor, spec: Int8xSpec = Int8xSpec()) -> dict[str, torch.Tensor]:
    """Int8 weights ``(N, K)`` and a per-tensor scale -> the 9 int8x tensors, keyed by suffix."""
    v = _flat_int8(q, "encode")
    if q.dim() != 2 or q.shape[0] <= 0 or q.shape[1] <= 0:
        raise FormatError(f"int8x encode: q must be a non-empty 2-D (N, K) tensor, got shape {tuple(q.shape)}")
    n = v.size
    if n > INT32_MAX:
        raise FormatError(f"int8x encode: {n} elements exceed the int32 counts of the block tables")
    s = torch.as_tensor(scale, dtype=torch.float32).detach().cpu().reshape(-1)
    if s.numel() != 1 or not bool(torch.isfinite(s).all()):
        raise FormatError(f"int8x encode: scale must be one finite number, got {scale!r}")

    a = np.abs(v.astype(np.int16))
    nonl1 = a > L1_MAX
    is_l3_all = a > L2_MAX
    is_l3 = is_l3_all[nonl1]  # the b2 bits, over non-L1 elements in order
    b1_blk, b2_blk = block_tables(nonl1, is_l3, spec.block_size)
    return {
        "weight_shape": torch.tensor([q.shape[0], q.shape[1]], dtype=torch.int64),
        "weight_scale": s.clone(),
        "weight_b1": pack_bits(nonl1),
        "weight_b2": pack_bits(is_l3),
        "weight_l1": pack_stream(v[~nonl1], L1_BITS),
        "weight_l2": pack_stream(v[nonl1 & ~is_l3_all], L2_BITS),
        "weight_l3": torch.from_numpy(v[is_l3_all].view(np.uint8).copy()),
        "weight_b1_blk": torch.from_numpy(b1_blk),
        "weight_b2_blk": torch.from_numpy(b2_blk),
    }


# -- decode -------------------------------------------------------------------------------------


class _Checker:
    """Validation helpers whose messages name ``<name>.<suffix>``."""

    def __init__(self, tensors: dict[str, torch.Tensor], name: str):
        self.tensors = tensors
        self.name = name

    def label(self, suffix: str) -> str:
        return f"{self.name}.{suffix}"

    def get(self, suffix: str, shape: tuple[int, ...], why: str = "") -> torch.Tensor:
        if suffix not in self.tensors:
            raise FormatError(f"{self.label(suffix)}: missing (int8x needs {', '.join(Int8xSpec.suffixes)})")
        t = self.tensors[suffix]
        if not isinstance(t, torch.Tensor):
            raise FormatError(f"{self.label(suffix)}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dtype != DTYPES[suffix]:
            raise FormatError(f"{self.label(suffix)}: dtype {t.dtype}, expected {DTYPES[suffix]}")
        if tuple(t.shape) != shape:
            raise FormatError(f"{self.label(suffix)}: shape {tuple(t.shape)}, expected {shape}{why}")
        return t

    def trailing_zero(self, suffix: str, words: torch.Tensor, used_bits: int) -> None:
        """Bits past ``used_bits`` (all in the last word, lengths being exact) must be 0."""
        rem = used_bits % 32
        if rem == 0 or words.numel() == 0:
            return
        last = int(words[-1]) & 0xFFFFFFFF
        if last >> rem:
            raise DecodeError(f"{self.label(suffix)}: unused trailing bits {rem}..31 of the last word are "
                              f"not 0 (word 0x{last:08x}, {used_bits} bits used)")

    def in_level(self, suffix: str, values: np.ndarray, ok: np.ndarray, what: str) -> None:
        if not ok.all():
            bad = np.flatnonzero(~ok)
            raise DecodeError(f"{self.label(suffix)}: {bad.size} stored value(s) outside {what} "
                              f"(first at position {bad[0]}: {int(values[bad[0]])}); the bitmaps place "
                              f"them in this level")


def _shape_of(c: _Checker) -> tuple[int, int]:
    shape = c.get("weight_shape", (2,))
    n_rows, n_cols = (int(x) for x in shape)
    if n_rows <= 0 or n_cols <= 0:
        raise FormatError(f"{c.label('weight_shape')}: [{n_rows}, {n_cols}], expected 2 positive ints [N, K]")
    if n_rows * n_cols > INT32_MAX:
        raise FormatError(f"{c.label('weight_shape')}: [{n_rows}, {n_cols}] has more than 2**31-1 elements")
    return n_rows, n_cols


def decode_int8(tensors: dict[str, torch.Tensor], spec: Int8xSpec = Int8xSpec(), name: str = "weight") -> torch.Tensor:
    """The int8 weights ``(N, K)`` of an int8x tensor set, after strict validation of every tensor."""
    c = _Checker(tensors, name)
    n_rows, n_cols = _shape_of(c)
    n = n_rows * n_cols
    c.get("weight_scale", (1,))
    nb = n_blocks(n, spec.block_size)
    for suffix in BLOCK_TABLES:  # structure before content: a missing table is reported as missing
        c.get(suffix, (nb,), f" = ceil(n/block_size) for n={n}, block_size={spec.block_size}")

    b1 = c.get("weight_b1", (n_words(n),), f" = ceil(n/32) for n={n}")
    c.trailing_zero("weight_b1", b1, n)
    nonl1 = unpack_bits(b1, n).numpy().astype(np.bool_)
    m = int(np.count_nonzero(nonl1))

    b2 = c.get("weight_b2", (n_words(m),), f" = ceil(m/32) for the m={m} one bits of b1")
    c.trailing_zero("weight_b2", b2, m)
    is_l3 = unpack_bits(b2, m).numpy().astype(np.bool_)
    n3 = int(np.count_nonzero(is_l3))
    n2, n1 = m - n3, n - m

    l1w = c.get("weight_l1", (n_words(L1_BITS * n1),), f" = ceil(3*n1/32) for n1={n1} L1 values")
    l2w = c.get("weight_l2", (n_words(L2_BITS * n2),), f" = ceil(5*n2/32) for n2={n2} L2 values")
    l3b = c.get("weight_l3", (n3,), " = n3, the one bits of b2")
    c.trailing_zero("weight_l1", l1w, L1_BITS * n1)
    c.trailing_zero("weight_l2", l2w, L2_BITS * n2)

    want_b1_blk, want_b2_blk = block_tables(nonl1, is_l3, spec.block_size)
    for suffix, want in zip(BLOCK_TABLES, (want_b1_blk, want_b2_blk)):
        got = _np(tensors[suffix])
        if not np.array_equal(got, want):
            b = int(np.flatnonzero(got != want)[0])
            bitmap = "b1" if suffix == "weight_b1_blk" else "b2"
            raise DecodeError(f"{c.label(suffix)}: disagrees with {bitmap} at block {b}: stored {int(got[b])}, "
                              f"the bitmaps give {int(want[b])} (block_size={spec.block_size})")

    l1 = unpack_stream(l1w, n1, L1_BITS).numpy()
    l2 = unpack_stream(l2w, n2, L2_BITS).numpy()
    l3 = _np(l3b).view(np.int8)
    c.in_level("weight_l1", l1, np.abs(l1) <= L1_MAX, "L1 (|v| <= 3)")
    c.in_level("weight_l2", l2, (np.abs(l2) > L1_MAX) & (np.abs(l2) <= L2_MAX), "L2 (3 < |v| <= 15)")
    c.in_level("weight_l3", l3, np.abs(l3.astype(np.int16)) > L2_MAX, "L3 (|v| > 15)")

    out = np.empty(n, dtype=np.int8)
    out[~nonl1] = l1
    where = np.flatnonzero(nonl1)
    out[where[~is_l3]] = l2
    out[where[is_l3]] = l3
    return torch.from_numpy(out.reshape(n_rows, n_cols))


def scale_of(tensors: dict[str, torch.Tensor], name: str = "weight") -> float:
    """The validated per-tensor scale (fp32 ``(1,)``, finite)."""
    s = _Checker(tensors, name).get("weight_scale", (1,))
    value = float(s[0])
    if not math.isfinite(value):
        raise DecodeError(f"{name}.weight_scale: {value} is not finite")
    return value


def decode(tensors: dict[str, torch.Tensor], spec: Int8xSpec = Int8xSpec(), name: str = "weight",
           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float weight ``W = q * scale`` of shape ``(N, K)`` in ``dtype``.

    The product of an int8 and an fp32 is exact in fp64, so it is formed there and rounded once to
    ``dtype`` (for fp32 the fp32 product is that same single rounding).
    """
    scale = scale_of(tensors, name)
    q = decode_int8(tensors, spec, name)
    if dtype == torch.float32:
        return q.to(torch.float32) * torch.tensor(scale, dtype=torch.float32)
    return (q.to(torch.float64) * scale).to(dtype)


# -- sizes --------------------------------------------------------------------------------------


def bits_per_weight(tensors: dict[str, torch.Tensor]) -> dict:
    """Storage cost: effective bits/weight of b1, b2, l1, l2, l3 (FORMATS.md) and the rest apart."""
    n_rows, n_cols = (int(x) for x in tensors["weight_shape"])
    n = n_rows * n_cols
    nbytes = {s: tensors[s].numel() * tensors[s].element_size() for s in DTYPES}
    payload = sum(nbytes[s] for s in PAYLOAD)
    tables = sum(nbytes[s] for s in BLOCK_TABLES)
    return {
        "n": n,
        "bits_per_weight": payload * 8 / n,
        "per_stream": {s: nbytes[s] * 8 / n for s in PAYLOAD},
        "block_tables_bits_per_weight": tables * 8 / n,
        "scale_and_shape_bytes": nbytes["weight_scale"] + nbytes["weight_shape"],
        "total_bits_per_weight": sum(nbytes.values()) * 8 / n,
    }
