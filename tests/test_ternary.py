import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from vllm_parity.reference.formats import ternary
from vllm_parity.errors import DecodeError, FormatError
from vllm_parity.reference.formats.ternary import PRESETS, TernarySpec

from tests.strategies import ternary_matrices, ternary_specs


def _field(byte: int, f: int, bit_order: str) -> int:
    """FORMATS.md's definition, one element at a time."""
    return (byte >> (2 * f)) & 3 if bit_order == "lsb" else (byte >> (6 - 2 * f)) & 3


def _slow_codes(packed: torch.Tensor, spec: TernarySpec) -> torch.Tensor:
    """Codes by the contract's element-wise rules: an independent oracle for the vectorized code."""
    p = packed.tolist()
    rows, cols = packed.shape
    if spec.pack_axis == "input":
        n, k, length = rows, 4 * cols, 4 * cols
    else:
        n, k, length = 4 * rows, cols, 4 * rows
    big_p = length // 4
    out = torch.empty((n, k), dtype=torch.uint8)
    for i in range(n):
        for j in range(k):
            e, other = (j, i) if spec.pack_axis == "input" else (i, j)
            byte_i, f = (e // 4, e % 4) if spec.pack_layout == "interleaved" else (e % big_p, e // big_p)
            byte = p[other][byte_i] if spec.pack_axis == "input" else p[byte_i][other]
            out[i, j] = _field(byte, f, spec.bit_order)
    return out


@given(spec=ternary_specs(), data=st.data())
def test_pack_unpack_round_trip(spec, data):
    values = data.draw(ternary_matrices(spec))
    packed = ternary.pack_values(values, spec)
    assert packed.dtype == torch.uint8
    assert tuple(packed.shape) == spec.packed_shape(*values.shape)
    assert torch.equal(ternary.unpack_values(packed, spec), values)


@given(spec=ternary_specs(), data=st.data())
def test_unpack_follows_the_contract_element_by_element(spec, data):
    values = data.draw(ternary_matrices(spec, max_quads=3))
    packed = ternary.pack_values(values, spec)
    assert torch.equal(ternary.unpack_codes(packed, spec), _slow_codes(packed, spec))


def test_hand_worked_bytes():
    # byte 0b11_10_01_00 = 0xE4: lsb fields (0, 1, 2, 3), msb fields (3, 2, 1, 0)
    packed = torch.tensor([[0xE4, 0x1B]], dtype=torch.uint8)
    lsb = TernarySpec(code_map=(0, 1, -1, -1))
    assert ternary.unpack_codes(packed, lsb).tolist() == [[0, 1, 2, 3, 3, 2, 1, 0]]
    msb = dataclasses.replace(lsb, bit_order="msb")
    assert ternary.unpack_codes(packed, msb).tolist() == [[3, 2, 1, 0, 0, 1, 2, 3]]
    blocked = dataclasses.replace(lsb, pack_layout="blocked")  # e -> byte e % 2, field e // 2
    assert ternary.unpack_codes(packed, blocked).tolist() == [[0, 3, 1, 2, 2, 1, 3, 0]]
    out_axis = dataclasses.replace(lsb, pack_axis="output")  # one byte column per input element
    assert ternary.unpack_codes(packed, out_axis).tolist() == [[0, 3], [1, 2], [2, 1], [3, 0]]


@given(values=st.integers(1, 6).flatmap(
    lambda quads: st.lists(st.lists(st.sampled_from([-1, 0, 1]), min_size=3, max_size=3),
                           min_size=4 * quads, max_size=4 * quads)))
def test_hf_bitnet_preset_equals_transformers_pack_weights(values):
    from transformers.integrations.bitnet import pack_weights, unpack_weights

    w = torch.tensor(values, dtype=torch.int8)  # (N, K) with N divisible by 4
    spec = PRESETS["hf-bitnet"]
    ours = ternary.pack_values(w, spec)
    assert torch.equal(ours, pack_weights(w.float()))
    assert torch.equal(unpack_weights(ours, torch.float32), ternary.unpack_values(ours, spec).float())


@given(spec=ternary_specs(), data=st.data())
def test_decode_applies_code_map_and_scale(spec, data):
    values = data.draw(ternary_matrices(spec, max_quads=4))
    n, k = values.shape
    scale = torch.rand(spec.scale_shape(n, k), generator=torch.Generator().manual_seed(n * k)) + 0.5
    packed = ternary.pack_values(values, spec)
    w = ternary.decode(packed, scale, spec, n, k, dtype=torch.float64)
    for i in range(n):
        for j in range(k):
            s = {"tensor": lambda: scale[0], "channel": lambda: scale[i],
                 "group": lambda: scale[i, j // spec.group_size]}[spec.scale_granularity]().double()
            want = values[i, j].double() * s if spec.scale_mode == "multiply" else values[i, j].double() / s
            assert w[i, j] == want, (i, j)


def test_illegal_code_names_tensor_and_byte_count():
    spec = TernarySpec()  # code 3 is null
    packed = torch.zeros((4, 2), dtype=torch.uint8)
    packed[1, 0] = 0b11_00_00_00  # field 3 of one byte
    packed[2, 1] = 0b11_11_00_00  # two fields of another byte
    with pytest.raises(DecodeError, match=r"model.layers.0.mlp.up_proj: 2 of 8 bytes hold code\(s\) \[3\]"
                                          r".*first at packed index \(1, 0\), byte value 192"):
        ternary.unpack_values(packed, spec, "model.layers.0.mlp.up_proj")


def test_illegal_code_along_output_axis_reports_packed_index():
    spec = PRESETS["hf-bitnet"]
    packed = torch.full((2, 3), 0b01_01_01_01, dtype=torch.uint8)
    packed[1, 2] = 0b01_11_01_01
    with pytest.raises(DecodeError, match=r"1 of 6 bytes .*packed index \(1, 2\)"):
        ternary.unpack_values(packed, spec, "w")


def test_decode_rejects_wrong_shapes_and_bad_scales():
    spec = TernarySpec()
    packed = torch.zeros((4, 2), dtype=torch.uint8)
    with pytest.raises(FormatError, match=r"q: packed shape \(4, 2\), expected \(4, 4\)"):
        ternary.decode(packed, torch.ones(4), spec, 4, 16, name="q")
    with pytest.raises(FormatError, match=r"q scale: scale shape \(3,\), expected \(4,\)"):
        ternary.decode(packed, torch.ones(3), spec, 4, 8, name="q")
    with pytest.raises(FormatError, match="must be uint8"):
        ternary.decode(packed.to(torch.int8), torch.ones(4), spec, 4, 8)
    with pytest.raises(FormatError, match="must be a float tensor"):
        ternary.decode(packed, torch.ones(4, dtype=torch.int32), spec, 4, 8)
    with pytest.raises(DecodeError, match="NaN or Inf"):
        ternary.decode(packed, torch.tensor([1.0, float("nan"), 1.0, 1.0]), spec, 4, 8)
    divide = dataclasses.replace(spec, scale_mode="divide")
    with pytest.raises(DecodeError, match="zeros"):
        ternary.decode(packed, torch.tensor([1.0, 0.0, 1.0, 1.0]), divide, 4, 8)


def test_pack_rejects_values_without_a_code():
    spec = TernarySpec(code_map=(0, 1, None, None))
    with pytest.raises(FormatError, match="value -1 occurs but code_map"):
        ternary.pack_values(torch.tensor([[-1, 0, 1, 0]], dtype=torch.int8), spec)
    with pytest.raises(FormatError, match=r"values must lie in \{-1, 0, 1\}"):
        ternary.pack_values(torch.tensor([[2, 0, 1, 0]], dtype=torch.int8), TernarySpec())
