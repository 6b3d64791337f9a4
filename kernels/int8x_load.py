"""Load-time reading of an ``int8x`` tensor set (shared FORMATS.md section 2) on the serving side.

:func:`decode_streams` validates every tensor and returns the int8 weights, which the native repack
(:mod:`vllm_parity.serving.int8x_native`) needs and the stream ops (:mod:`vllm_parity.serving.int8x_ops`)
then trust. It is written apart from the reference's codec (``vllm_parity.reference.formats.int8x``, numpy bit
matrices) on purpose, in torch word arithmetic: a bug shared by both would be invisible to parity.
"""

from __future__ import annotations

import torch

from vllm_parity.errors import DecodeError, FormatError

# The stored dtypes of FORMATS.md's table, kept here as well as in the reference codec (see above).
DTYPES: dict[str, torch.dtype] = {
    "weight_shape": torch.int64, "weight_scale": torch.float32,
    "weight_b1": torch.int32, "weight_b2": torch.int32, "weight_l1": torch.int32, "weight_l2": torch.int32,
    "weight_l3": torch.uint8, "weight_b1_blk": torch.int32, "weight_b2_blk": torch.int32,
}
WIDTH = {"weight_l1": 3, "weight_l2": 5}
LIMIT = {"weight_l1": (0, 3, "L1"), "weight_l2": (4, 15, "L2"), "weight_l3": (16, 128, "L3")}  # lo <= |v| <= hi


def _words(n_bits: int) -> int:
    return (n_bits + 31) // 32


def _bits(words: torch.Tensor, count: int) -> torch.Tensor:
    """Stream bits ``0 .. count-1`` (bit ``t % 32`` of word ``t // 32``), as bool."""
    shifts = torch.arange(32, dtype=torch.int32)
    return ((words.unsqueeze(-1) >> shifts) & 1).flatten()[:count].bool()


def _fields(words: torch.Tensor, count: int, width: int, chunk: int = 1 << 22) -> torch.Tensor:
    """The first ``count`` two's complement fields of ``width`` bits, as int64, a chunk of fields at a time."""
    wide = words.to(torch.int64) & 0xFFFFFFFF
    out = torch.empty(count, dtype=torch.int64)
    for i0 in range(0, count, chunk):
        start = torch.arange(i0, min(count, i0 + chunk), dtype=torch.int64) * width
        value = torch.zeros_like(start)
        for j in range(width):
            pos = start + j
            value |= ((wide[pos // 32] >> (pos % 32)) & 1) << j
        out[i0:i0 + start.numel()] = value - ((value >> (width - 1)) << width)
    return out


class _Set:
    def __init__(self, tensors: dict[str, torch.Tensor], name: str):
        self.tensors, self.name = tensors, name

    def get(self, suffix: str, length: int, why: str) -> torch.Tensor:
        label = f"{self.name}.{suffix}"
        t = self.tensors.get(suffix)
        if t is None:
            raise FormatError(f"{label}: missing (int8x needs {', '.join(DTYPES)})")
        if not isinstance(t, torch.Tensor):
            raise FormatError(f"{label}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dtype != DTYPES[suffix]:
            raise FormatError(f"{label}: dtype {t.dtype}, expected {DTYPES[suffix]}")
        if tuple(t.shape) != (length,):
            raise FormatError(f"{label}: shape {tuple(t.shape)}, expected ({length},){why}")
        return t.cpu()

    def unused_bits_zero(self, suffix: str, words: torch.Tensor, used: int) -> None:
        if used % 32 and words.numel():
            last = int(words[-1]) & 0xFFFFFFFF
            if last >> (used % 32):
                raise DecodeError(f"{self.name}.{suffix}: unused trailing bits {used % 32}..31 of the last word are "
                                  f"not 0 (word 0x{last:08x}, {used} bits used)")

    def in_level(self, suffix: str, values: torch.Tensor) -> None:
        lo, hi, level = LIMIT[suffix]
        bad = ((values.abs() < lo) | (values.abs() > hi)).nonzero().flatten()
        if bad.numel():
            raise DecodeError(f"{self.name}.{suffix}: {bad.numel()} stored value(s) outside {level} "
                              f"({lo} <= |v| <= {hi}) (first at position {int(bad[0])}: {int(values[bad[0]])}); "
                              f"the bitmaps place them in this level")


def decode_streams(tensors: dict[str, torch.Tensor], block_size: int, name: str = "weight") -> torch.Tensor:
    """The int8 weights ``(N, K)`` of one int8x tensor set, every tensor checked; errors name ``name.suffix``."""
    s = _Set(tensors, name)
    n_rows, n_cols = (int(v) for v in s.get("weight_shape", 2, " = [N, K]"))
    if n_rows <= 0 or n_cols <= 0 or n_rows * n_cols >= 2**31:
        raise FormatError(f"{name}.weight_shape: [{n_rows}, {n_cols}], expected 2 positive ints [N, K] "
                          f"with fewer than 2**31 elements")
    n = n_rows * n_cols
    s.get("weight_scale", 1, " (one per-tensor scale)")
    blocks = (n + block_size - 1) // block_size
    tables = {t: s.get(t, blocks, f" = ceil(n/block_size) for n={n}, block_size={block_size}")
              for t in ("weight_b1_blk", "weight_b2_blk")}

    b1 = s.get("weight_b1", _words(n), f" = ceil(n/32) for n={n}")
    s.unused_bits_zero("weight_b1", b1, n)
    outside_l1 = _bits(b1, n)
    m = int(outside_l1.sum())
    b2 = s.get("weight_b2", _words(m), f" = ceil(m/32) for the m={m} one bits of b1")
    s.unused_bits_zero("weight_b2", b2, m)
    in_l3 = _bits(b2, m)
    n3 = int(in_l3.sum())
    counts = {"weight_l1": n - m, "weight_l2": m - n3}

    # Block tables: the one bits of b1 before each block's first element, and of b2 before that many.
    ones_b1 = torch.cat([torch.zeros(1, dtype=torch.int64), outside_l1.cumsum(0)])
    ones_b2 = torch.cat([torch.zeros(1, dtype=torch.int64), in_l3.cumsum(0)])
    want_b1 = ones_b1[torch.arange(blocks) * block_size]
    want = {"weight_b1_blk": want_b1, "weight_b2_blk": ones_b2[want_b1]}
    for t, stored in tables.items():
        differ = (stored.to(torch.int64) != want[t]).nonzero().flatten()
        if differ.numel():
            b = int(differ[0])
            raise DecodeError(f"{name}.{t}: disagrees with {t[7:9]} at block {b}: stored {int(stored[b])}, the "
                              f"bitmaps give {int(want[t][b])} (block_size={block_size})")

    values = {}
    for t, width in WIDTH.items():
        words = s.get(t, _words(width * counts[t]), f" = ceil({width}*count/32) for {counts[t]} values")
        s.unused_bits_zero(t, words, width * counts[t])
        values[t] = _fields(words, counts[t], width)
    values["weight_l3"] = s.get("weight_l3", n3, " = n3, the one bits of b2").view(torch.int8).to(torch.int64)
    for t, v in values.items():
        s.in_level(t, v)

    out = torch.empty(n, dtype=torch.int64)
    out[~outside_l1] = values["weight_l1"]
    where = outside_l1.nonzero().flatten()
    out[where[~in_l3]] = values["weight_l2"]
    out[where[in_l3]] = values["weight_l3"]
    return out.to(torch.int8).reshape(n_rows, n_cols)
