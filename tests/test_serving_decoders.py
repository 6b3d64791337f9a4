"""The serving side's own decoders of the checkpoint formats (``serving.ternary_repack.unpack_checkpoint``,
``serving.int8x_load.decode_streams``): against hand-worked bytes, and against the reference's decoders on
arbitrary input, which both must read alike or both reject."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.strategies import ternary_specs
from tests.test_int8x import NAME, SPEC32, _base, _i32, _mutations
from vllm_parity.errors import DecodeError, FormatError
from vllm_parity.reference.formats import int8x, ternary
from vllm_parity.reference.formats.ternary import PRESETS, TernarySpec
from vllm_parity.reference.formats.int8x import Int8xSpec
from vllm_parity.serving.int8x_load import decode_streams
from vllm_parity.serving.ternary_repack import unpack_checkpoint

SEED = PRESETS["seed-article"]  # input axis, interleaved, lsb, code_map [0, 1, -1, null]


# -- ternary ------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec, packed, n, k, values", [
    # 0x24 = 0b00_10_01_00: fields (lsb first) 0, 1, 2, 0 -> 0, +1, -1, 0
    (SEED, [[0x24]], 1, 4, [[0, 1, -1, 0]]),
    # msb: field 0 is bits 6..7: fields 0, 2, 1, 0 -> 0, -1, +1, 0
    (TernarySpec(bit_order="msb"), [[0x24]], 1, 4, [[0, -1, 1, 0]]),
    # blocked over K = 8 (P = 2): element e in byte e % 2, field e // 2; byte 1 = 0x01 holds a +1 in field 0
    (TernarySpec(pack_layout="blocked"), [[0x24, 0x01]], 1, 8, [[0, 1, 1, 0, -1, 0, 0, 0]]),
    # hf-bitnet: packed along the outputs, code_map [-1, 0, 1, null]: a column of N = 4
    (PRESETS["hf-bitnet"], [[0x24]], 4, 1, [[-1], [0], [1], [-1]]),
])
def test_ternary_hand_worked_bytes(spec, packed, n, k, values):
    got = unpack_checkpoint(torch.tensor(packed, dtype=torch.uint8), spec, n, k)
    assert got.dtype == torch.int8 and got.tolist() == values


def test_ternary_illegal_code_names_the_tensor_bytes_and_first_index():
    packed = torch.tensor([[0x00, 0xC0], [0x03, 0x00]], dtype=torch.uint8)  # code 3 in byte (0, 1) and (1, 0)
    with pytest.raises(DecodeError, match=r"w: 2 of 4 bytes hold code\(s\) \[3\].*first at packed index "
                                          r"\(0, 1\), byte value 192"):
        unpack_checkpoint(packed, SEED, 2, 8, "w")


@given(spec=ternary_specs(), data=st.data())
def test_ternary_reads_any_bytes_as_the_reference_does(spec: TernarySpec, data):
    spec = dataclasses.replace(spec, scale_granularity="channel")  # scales play no part in the bytes
    quads, other = data.draw(st.integers(1, 8)), data.draw(st.integers(1, 12))
    n, k = (other, 4 * quads) if spec.pack_axis == "input" else (4 * quads, other)
    raw = data.draw(st.lists(st.integers(0, 255), min_size=n * k // 4, max_size=n * k // 4))
    packed = torch.tensor(raw, dtype=torch.uint8).reshape(spec.packed_shape(n, k))
    step = data.draw(st.integers(1, 13))  # rows decoded at a time
    try:
        want = ternary.unpack_values(packed, spec)
    except DecodeError as exc:
        with pytest.raises(DecodeError) as info:
            unpack_checkpoint(packed, spec, n, k, rows_per_step=step)
        assert str(info.value) == str(exc)
        return
    assert torch.equal(unpack_checkpoint(packed, spec, n, k, rows_per_step=step), want)


# -- int8x --------------------------------------------------------------------------------------


def test_int8x_hand_worked_words():
    # v = [1, -2, 5, -128, 0, 3, -4, 16, 7, -3]: levels L1 L1 L2 L3 L1 L1 L2 L3 L2 L1 (FORMATS.md's order)
    streams = {
        "weight_shape": torch.tensor([2, 5]), "weight_scale": torch.tensor([0.5]),
        "weight_b1": torch.tensor([0b01_1100_1100], dtype=torch.int32),
        "weight_b2": torch.tensor([0b01010], dtype=torch.int32),
        "weight_l1": torch.tensor([0x5631], dtype=torch.int32),  # 1, -2, 0, 3, -3 as 3-bit fields
        "weight_l2": torch.tensor([0x1F85], dtype=torch.int32),  # 5, -4, 7 as 5-bit fields
        "weight_l3": torch.tensor([0x80, 0x10], dtype=torch.uint8),
        "weight_b1_blk": torch.tensor([0], dtype=torch.int32), "weight_b2_blk": torch.tensor([0], dtype=torch.int32),
    }
    assert decode_streams(streams, 32).tolist() == [[1, -2, 5, -128, 0], [3, -4, 16, 7, -3]]


def test_int8x_fields_straddling_words():
    streams = int8x.encode(torch.zeros(4, 5, dtype=torch.int8), 1.0)
    streams.update({
        "weight_b1": torch.tensor([0xFF000], dtype=torch.int32),
        "weight_b2": torch.tensor([0], dtype=torch.int32),
        "weight_l1": torch.tensor([_i32(0xC0000000), 0x4], dtype=torch.int32),  # ten 0s, then 3 and 2
        "weight_l2": torch.tensor([_i32(0xC8421084), 0xD9], dtype=torch.int32),  # six 4s, then 7 and -5
        "weight_b1_blk": torch.tensor([0], dtype=torch.int32),
    })
    assert decode_streams(streams, 1024).flatten().tolist() == [0] * 10 + [3, 2] + [4] * 6 + [7, -5]


@pytest.mark.parametrize("case", _mutations(), ids=lambda c: c[0])
def test_int8x_rejects_what_the_reference_rejects_naming_the_tensor(case):
    _, suffix, error, fragment, mutate = case
    streams = _base()
    mutate(streams)
    with pytest.raises(error) as info:
        decode_streams(streams, SPEC32.block_size, NAME)
    assert f"{NAME}.{suffix}:" in str(info.value) and fragment in str(info.value), str(info.value)


@given(data=st.data())
def test_int8x_decodes_what_the_reference_encodes(data):
    n, k = data.draw(st.integers(1, 20)), data.draw(st.integers(1, 70))
    spread = data.draw(st.sampled_from([1, 4, 40, 128]))
    block = data.draw(st.sampled_from([32, 64, 1024]))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    q = (torch.randn(n, k, generator=g) * spread).round().clamp(-128, 127).to(torch.int8)
    streams = int8x.encode(q, 0.25, Int8xSpec(block_size=block))
    assert torch.equal(decode_streams(streams, block), int8x.decode_int8(streams, Int8xSpec(block_size=block)))


def test_int8x_block_size_disagreeing_with_the_tables():
    streams = int8x.encode(torch.ones(7, 10, dtype=torch.int8), 1.0, Int8xSpec(block_size=32))
    with pytest.raises(FormatError, match=r"w.weight_b1_blk: shape \(3,\), expected \(1,\)"):
        decode_streams(streams, 1024, "w")
