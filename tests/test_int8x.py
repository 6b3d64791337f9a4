"""Property and example tests of the int8x reference codec (shared FORMATS.md section 2).

The oracle for layouts is written from the FORMATS.md text with plain Python loops (``_naive_encode``),
independent of the vectorized numpy code under test; the hand examples are literal words derived by hand.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from vllm_parity.reference.formats import int8x
from vllm_parity.errors import DecodeError, FormatError
from vllm_parity.reference.formats.int8x import Int8xSpec



# Example counts come from the hypothesis profile (conftest.py: dev / ci / nightly).
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])

L1_POOL = np.arange(-3, 4)
L2_POOL = np.concatenate([np.arange(-15, -3), np.arange(4, 16)])
L3_POOL = np.concatenate([np.arange(-128, -15), np.arange(16, 128)])
EXTREMES = np.array([-128, 127, -16, 16, -15, 15, -4, 4, -3, 3, 0])


def _i32(word: int) -> int:
    """A uint32 bit pattern as the int32 FORMATS.md stores."""
    return word - (1 << 32) if word >= 1 << 31 else word


@st.composite
def int8_weights(draw, max_n: int = 24, max_k: int = 70) -> torch.Tensor:
    n = draw(st.integers(1, max_n))
    k = draw(st.integers(1, max_k))
    mode = draw(st.sampled_from(["mixed", "L1", "L2", "L3", "extremes"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    size = n * k
    if mode == "mixed":
        level = rng.choice(3, size=size, p=rng.dirichlet([1.0, 1.0, 1.0]))
        v = np.select([level == 0, level == 1],
                      [rng.choice(L1_POOL, size), rng.choice(L2_POOL, size)], rng.choice(L3_POOL, size))
    else:
        pool = {"L1": L1_POOL, "L2": L2_POOL, "L3": L3_POOL, "extremes": EXTREMES}[mode]
        v = rng.choice(pool, size)
    return torch.from_numpy(v.astype(np.int8).reshape(n, k))


# -- the oracle: FORMATS.md section 2 read literally ------------------------------------------


def _level(x: int) -> int:
    return 1 if abs(x) <= 3 else 2 if abs(x) <= 15 else 3


def _naive_stream(fields: list[tuple[int, int]]) -> list[int]:
    """(value, width) fields -> int32 words: value bit i at stream bit t+i, bit t in word t//32 at t%32."""
    bits = []
    for value, width in fields:
        bits += [(value >> i) & 1 for i in range(width)]  # Python's >> on negatives gives two's complement
    words = [0] * math.ceil(len(bits) / 32)
    for t, b in enumerate(bits):
        words[t // 32] |= b << (t % 32)
    return [_i32(w) for w in words]


def _naive_encode(q: torch.Tensor, block_size: int) -> dict[str, list[int]]:
    v = [int(x) for x in q.flatten()]
    n = len(v)
    b1 = [0 if _level(x) == 1 else 1 for x in v]
    non_l1 = [x for x in v if _level(x) != 1]
    b2 = [0 if _level(x) == 2 else 1 for x in non_l1]
    b1_blk, b2_blk = [], []
    for b in range(math.ceil(n / block_size)):
        start = b * block_size
        b1_blk.append(sum(b1[:start]))
        first = next((e for e in range(start, n) if b1[e]), None)
        j = sum(b1[:first]) if first is not None else len(non_l1)  # no non-L1 left: all of b2 lies before
        b2_blk.append(sum(b2[:j]))
    return {
        "weight_shape": list(q.shape),
        "weight_b1": _naive_stream([(b, 1) for b in b1]),
        "weight_b2": _naive_stream([(b, 1) for b in b2]),
        "weight_l1": _naive_stream([(x, 3) for x in v if _level(x) == 1]),
        "weight_l2": _naive_stream([(x, 5) for x in v if _level(x) == 2]),
        "weight_l3": [x & 0xFF for x in v if _level(x) == 3],
        "weight_b1_blk": b1_blk,
        "weight_b2_blk": b2_blk,
    }


def _assert_matches_format(enc: dict[str, torch.Tensor], q: torch.Tensor, block_size: int) -> None:
    want = _naive_encode(q, block_size)
    assert set(enc) == set(Int8xSpec.suffixes), f"suffixes {sorted(enc)}"
    for suffix, dtype in int8x.DTYPES.items():
        assert enc[suffix].dtype == dtype, f"{suffix}: dtype {enc[suffix].dtype}, FORMATS.md says {dtype}"
        assert enc[suffix].dim() == 1, f"{suffix}: shape {tuple(enc[suffix].shape)}, FORMATS.md says 1-D"
    for suffix, words in want.items():
        got = enc[suffix].tolist()
        if got != words:
            first = next((i for i, (a, b) in enumerate(zip(got, words)) if a != b), min(len(got), len(words)))
            raise AssertionError(f"{suffix} (q shape {tuple(q.shape)}, block_size {block_size}): first difference "
                                 f"at index {first}, lengths {len(got)} vs {len(words)} (FORMATS.md oracle)")


# -- hand-written examples ----------------------------------------------------------------------


def test_hand_example_layout():
    # v = [1, -2, 5, -128, 0, 3, -4, 16, 7, -3]: levels L1 L1 L2 L3 L1 L1 L2 L3 L2 L1
    q = torch.tensor([[1, -2, 5, -128, 0], [3, -4, 16, 7, -3]], dtype=torch.int8)
    enc = int8x.encode(q, 0.5, Int8xSpec(block_size=32))
    expected = {
        "weight_shape": [2, 5],
        "weight_scale": [0.5],
        "weight_b1": [0b01_1100_1100],  # non-L1 at e = 2, 3, 6, 7, 8
        "weight_b2": [0b01010],  # non-L1 in order 5, -128, -4, 16, 7 -> L3 at j = 1, 3
        # L1 1, -2, 0, 3, -3 as 3 bits (001, 110, 000, 011, 101) at bits 0, 3, 6, 9, 12
        "weight_l1": [1 | 6 << 3 | 0 << 6 | 3 << 9 | 5 << 12],
        # L2 5, -4, 7 as 5 bits (00101, 11100, 00111) at bits 0, 5, 10
        "weight_l2": [5 | 28 << 5 | 7 << 10],
        "weight_l3": [0x80, 0x10],
        "weight_b1_blk": [0],
        "weight_b2_blk": [0],
    }
    assert expected["weight_l1"] == [0x5631] and expected["weight_l2"] == [0x1F85]
    for suffix, want in expected.items():
        assert enc[suffix].tolist() == want, f"{suffix}: {enc[suffix].tolist()} != hand-derived {want}"
    assert torch.equal(int8x.decode_int8(enc, Int8xSpec(block_size=32)), q)


def test_hand_example_values_straddle_words():
    # L1 stream: ten 0s then 3 (011) at bits 30..32 and 2 (010) at 33..35.
    # L2 stream: six 4s (00100) then 7 (00111) at bits 30..34 and -5 (11011) at 35..39.
    v = [0] * 10 + [3, 2] + [4] * 6 + [7, -5]
    q = torch.tensor(v, dtype=torch.int8).reshape(4, 5)
    enc = int8x.encode(q, 1.0)
    assert enc["weight_b1"].tolist() == [0xFF000], "b1: elements 12..19 are non-L1"
    assert enc["weight_b2"].tolist() == [0], "b2: 8 L2 elements, all bits 0, one word"
    # word 0: bits 30 and 31 are the low two bits of 3; word 1: bit 0 is its high bit (0), bit 2 is 2's bit 1
    assert enc["weight_l1"].tolist() == [_i32(0xC0000000), 0x4]
    # word 0: bit 2 of each 4 at 2, 7, 12, 17, 22, 27, then 7's bits 0, 1 at 30, 31;
    # word 1: 7's bit 2 at bit 0, then -5 = 11011 at bits 3..7
    assert enc["weight_l2"].tolist() == [_i32(0xC8421084), 0xD9]
    assert enc["weight_l3"].tolist() == []
    assert torch.equal(int8x.decode_int8(enc), q)


@pytest.mark.parametrize(
    "non_l1, b1_blk, b2_blk",
    [
        # position -> value; blocks of 32 start at 0, 32, 64 (n = 70)
        ({5: 100, 10: 4, 31: -4, 33: 15, 40: -16, 64: 9}, [0, 3, 5], [0, 1, 2]),
        # last block all L1: b2_blk counts every b2 one (no non-L1 element at or after 64)
        ({5: 100, 40: -16}, [0, 1, 2], [0, 1, 2]),
        # first block all L1: the first non-L1 at or after 0 is at 40 (index 0)
        ({40: -16, 41: 5, 66: 127}, [0, 0, 2], [0, 0, 1]),
    ],
)
def test_hand_example_block_tables(non_l1, b1_blk, b2_blk):
    v = np.zeros(70, dtype=np.int8)
    for e, x in non_l1.items():
        v[e] = x
    enc = int8x.encode(torch.from_numpy(v).reshape(7, 10), 1.0, Int8xSpec(block_size=32))
    assert enc["weight_b1_blk"].tolist() == b1_blk, f"b1_blk {enc['weight_b1_blk'].tolist()}"
    assert enc["weight_b2_blk"].tolist() == b2_blk, f"b2_blk {enc['weight_b2_blk'].tolist()}"


def test_levels_and_bits_per_weight_of_hand_example():
    q = torch.tensor([[1, -2, 5, -128, 0], [3, -4, 16, 7, -3]], dtype=torch.int8)
    lv = int8x.levels(q)
    assert (lv["n1"], lv["n2"], lv["n3"]) == (5, 3, 2), lv
    assert (lv["l1"], lv["l2"], lv["l3"]) == (0.5, 0.3, 0.2), lv
    bpw = int8x.bits_per_weight(int8x.encode(q, 1.0))
    # b1, b2, l1, l2: one int32 word each; l3: 2 bytes -> 18 bytes over 10 weights
    assert bpw["bits_per_weight"] == pytest.approx(18 * 8 / 10), bpw
    assert bpw["block_tables_bits_per_weight"] == pytest.approx(2 * 4 * 8 / 10), bpw


# -- properties ---------------------------------------------------------------------------------


@settings(**SETTINGS)
@given(q=int8_weights(), block_size=st.sampled_from([32, 64, 1024]))
@example(q=torch.tensor([[-128]], dtype=torch.int8), block_size=32)
@example(q=torch.tensor([[127]], dtype=torch.int8), block_size=32)
@example(q=torch.tensor([[0]], dtype=torch.int8), block_size=1024)
@example(q=torch.full((1, 33), -3, dtype=torch.int8), block_size=32)  # n not a multiple of 32
@example(q=torch.full((3, 37), 9, dtype=torch.int8), block_size=64)  # all L2, 5-bit values straddle
@example(q=torch.full((2, 65), -128, dtype=torch.int8), block_size=32)  # all L3
def test_encode_matches_formats_text_and_round_trips(q, block_size):
    spec = Int8xSpec(block_size=block_size)
    enc = int8x.encode(q, 0.25, spec)
    _assert_matches_format(enc, q, block_size)
    out = int8x.decode_int8(enc, spec)
    assert out.dtype == torch.int8 and out.shape == q.shape, f"{out.dtype} {tuple(out.shape)}"
    bad = (out != q).nonzero()
    assert bad.numel() == 0, f"{bad.shape[0]} elements differ, first at {bad[0].tolist()}"


@settings(**SETTINGS)
@given(q=int8_weights(max_n=64, max_k=300), block_size=st.sampled_from([32, 64, 1024]))
def test_round_trip_larger(q, block_size):
    spec = Int8xSpec(block_size=block_size)
    out = int8x.decode_int8(int8x.encode(q, 1.0, spec), spec)
    bad = (out != q).nonzero()
    assert bad.numel() == 0, f"{bad.shape[0]} elements differ, first at {bad[0].tolist()}"


@settings(**SETTINGS)
@given(width=st.one_of(st.integers(1, 8), st.sampled_from([9, 16, 31])), signed=st.booleans(), data=st.data())
def test_stream_helpers(width, signed, data):
    lo, hi = (-(1 << (width - 1)), (1 << (width - 1)) - 1) if signed else (0, (1 << width) - 1)
    values = data.draw(st.lists(st.integers(lo, hi), max_size=80), label="values")
    words = int8x.pack_stream(torch.tensor(values, dtype=torch.int64), width)
    assert words.dtype == torch.int32
    assert words.tolist() == _naive_stream([(x, width) for x in values]), "pack_stream layout"
    back = int8x.unpack_stream(words, len(values), width, signed=signed).tolist()
    assert back == values, f"unpack_stream: {back} != {values}"


@settings(**SETTINGS)
@given(bits=st.lists(st.booleans(), max_size=200))
def test_bit_helpers(bits):
    words = int8x.pack_bits(torch.tensor(bits, dtype=torch.bool))
    assert words.tolist() == _naive_stream([(int(b), 1) for b in bits]), "pack_bits layout"
    assert int8x.unpack_bits(words, len(bits)).tolist() == [int(b) for b in bits]


def test_stream_helpers_reject_bad_input():
    with pytest.raises(ValueError, match="do not fit 3 bits"):
        int8x.pack_stream(torch.tensor([8]), 3)
    with pytest.raises(ValueError, match="need 40 bits"):
        int8x.unpack_stream(torch.zeros(1, dtype=torch.int32), 8, 5)
    with pytest.raises(ValueError, match="bits must be 0 or 1"):
        int8x.pack_bits(torch.tensor([0, 2], dtype=torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_decode_scales_with_one_rounding(dtype):
    q = torch.tensor([[-128, -17, -5, -1, 0], [1, 3, 15, 100, 127]], dtype=torch.int8)
    scale = 0.0123456789
    out = int8x.decode(int8x.encode(q, scale), dtype=dtype)
    s32 = float(torch.tensor(scale, dtype=torch.float32))  # the stored fp32 scale
    want = (q.to(torch.float64) * s32).to(dtype)
    assert out.dtype == dtype
    assert torch.equal(out, want), f"max abs diff {(out.double() - want.double()).abs().max().item()}"


# -- encode input errors ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "q, scale, match",
    [
        (torch.zeros(2, 3, dtype=torch.int16), 1.0, "must be an int8 tensor"),
        (torch.zeros(6, dtype=torch.int8), 1.0, "2-D"),
        (torch.zeros(0, 3, dtype=torch.int8), 1.0, "non-empty"),
        (torch.zeros(2, 3, dtype=torch.int8), float("nan"), "finite"),
        (torch.zeros(2, 3, dtype=torch.int8), torch.ones(2), "one finite number"),
    ],
)
def test_encode_rejects(q, scale, match):
    with pytest.raises(FormatError, match=match):
        int8x.encode(q, scale)


# -- decode validation: each mutated tensor -> the error naming it ------------------------------

NAME = "model.layers.0.mlp.down_proj"
SPEC32 = Int8xSpec(block_size=32)


def _base() -> dict[str, torch.Tensor]:
    # n = 70 (3 blocks of 32); b1 70 bits -> 3 words, 26 unused bits; m = 7 -> b2 7 bits;
    # L1 count 63 -> 189 bits (3 unused); L2 count 3 -> 15 bits; L3 count 4.
    v = np.zeros(70, dtype=np.int8)
    v[[5, 10, 31, 33, 40, 50, 64]] = [100, 4, -4, 15, -16, 20, -128]
    v[:4] = [1, -1, 3, -3]
    enc = int8x.encode(torch.from_numpy(v).reshape(7, 10), 0.5, SPEC32)
    assert torch.equal(int8x.decode_int8(enc, SPEC32, NAME), torch.from_numpy(v).reshape(7, 10))
    return enc


def _set_word(t: torch.Tensor, i: int, fn) -> torch.Tensor:
    t = t.clone()
    t[i] = _i32(fn(int(t[i]) & 0xFFFFFFFF))
    return t


def _mutations():
    # (id, suffix named in the message, error class, message fragment, mutate(enc) -> None)
    cases = []
    for s in Int8xSpec.suffixes:
        cases.append((f"missing-{s}", s, FormatError, "missing", lambda e, s=s: e.pop(s)))
        wrong = torch.float64 if int8x.DTYPES[s] != torch.float64 else torch.float32
        cases.append((f"dtype-{s}", s, FormatError, "dtype", lambda e, s=s, w=wrong: e.__setitem__(s, e[s].to(w))))
        cases.append((f"longer-{s}", s, FormatError, "expected (",
                      lambda e, s=s: e.__setitem__(s, torch.cat([e[s], e[s][:1]]))))
        cases.append((f"2d-{s}", s, FormatError, "shape", lambda e, s=s: e.__setitem__(s, e[s].reshape(1, -1))))
        cases.append((f"shorter-{s}", s, FormatError, "expected (", lambda e, s=s: e.__setitem__(s, e[s][:-1])))
    cases += [
        ("not-a-tensor", "weight_b2", FormatError, "torch.Tensor", lambda e: e.__setitem__("weight_b2", [0])),
        ("shape-zero", "weight_shape", FormatError, "2 positive ints",
         lambda e: e.__setitem__("weight_shape", torch.tensor([0, 70]))),
        ("shape-negative", "weight_shape", FormatError, "2 positive ints",
         lambda e: e.__setitem__("weight_shape", torch.tensor([-7, -10]))),
        # bits 70..95 of b1 are unused
        ("trailing-b1", "weight_b1", DecodeError, "trailing",
         lambda e: e.__setitem__("weight_b1", _set_word(e["weight_b1"], 2, lambda w: w | 1 << 31))),
        ("trailing-b2", "weight_b2", DecodeError, "trailing",
         lambda e: e.__setitem__("weight_b2", _set_word(e["weight_b2"], 0, lambda w: w | 1 << 7))),
        ("trailing-l1", "weight_l1", DecodeError, "trailing",
         lambda e: e.__setitem__("weight_l1", _set_word(e["weight_l1"], 5, lambda w: w | 1 << 31))),
        ("trailing-l2", "weight_l2", DecodeError, "trailing",
         lambda e: e.__setitem__("weight_l2", _set_word(e["weight_l2"], 0, lambda w: w | 1 << 15))),
        ("b1_blk-off", "weight_b1_blk", DecodeError, "disagrees with b1 at block 1",
         lambda e: e["weight_b1_blk"].__setitem__(1, e["weight_b1_blk"][1] + 1)),
        ("b2_blk-off", "weight_b2_blk", DecodeError, "disagrees with b2 at block 2",
         lambda e: e["weight_b2_blk"].__setitem__(2, 0)),
        # L1 value 0 (position 4 of the stream) -> 100 = -4, which is not L1
        ("l1-value", "weight_l1", DecodeError, "outside L1",
         lambda e: e.__setitem__("weight_l1", _set_word(e["weight_l1"], 0, lambda w: w | 1 << 14))),
        # L2 value 4 (00100) -> 00000 = 0
        ("l2-value", "weight_l2", DecodeError, "outside L2",
         lambda e: e.__setitem__("weight_l2", _set_word(e["weight_l2"], 0, lambda w: w & ~(1 << 2)))),
        ("l3-value", "weight_l3", DecodeError, "outside L3", lambda e: e["weight_l3"].__setitem__(0, 15)),
    ]
    return cases


@pytest.mark.parametrize("case", _mutations(), ids=lambda c: c[0])
def test_decode_rejects_mutated_tensor(case):
    _, suffix, error, fragment, mutate = case
    enc = _base()
    mutate(enc)
    with pytest.raises(error) as info:
        int8x.decode_int8(enc, SPEC32, NAME)
    msg = str(info.value)
    assert f"{NAME}.{suffix}:" in msg, f"message does not name {NAME}.{suffix}: {msg!r}"
    assert fragment in msg, f"message lacks {fragment!r}: {msg!r}"


def test_decode_rejects_block_size_mismatch():
    enc = int8x.encode(torch.ones(7, 10, dtype=torch.int8), 1.0, Int8xSpec(block_size=32))
    with pytest.raises(FormatError, match=r"weight\.weight_b1_blk: shape \(3,\), expected \(2,\)"):
        int8x.decode_int8(enc, Int8xSpec(block_size=64))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_decode_rejects_non_finite_scale(value):
    enc = _base()
    enc["weight_scale"] = torch.tensor([value], dtype=torch.float32)
    int8x.decode_int8(enc, SPEC32, NAME)  # the int8 values do not depend on the scale
    with pytest.raises(DecodeError, match=rf"{NAME}\.weight_scale: .* not finite"):
        int8x.decode(enc, SPEC32, NAME)
