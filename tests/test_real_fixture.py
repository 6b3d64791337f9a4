"""The real model's derived formats, from a small state dict: what the converter writes decodes, with the
reference's own decoders, to absmean ternary and per-tensor int8 of the float weights."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from vllm_parity.fixtures.real_model import derive
from vllm_parity.reference.formats import int8x, ternary
from vllm_parity.reference.formats.int8x import Int8xSpec
from vllm_parity.reference.formats.ternary import TernarySpec
from vllm_parity.reference.formats import parse_quantization_config

MODULE = "model.layers.0.mlp.down_proj"


@given(st.integers(1, 4), st.integers(1, 3), st.sampled_from(["seed-article", "seed-article-g64", "int8x"]),
       st.integers(0, 1000))
def test_derived_formats_decode_to_their_quantization(rows4, groups, fmt, seed):
    n, k = 4 * rows4, 64 * groups
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 0.1
    tensors, config = derive({f"{MODULE}.weight": w.float(), "model.norm.weight": torch.ones(8)}, {}, fmt)
    assert f"{MODULE}.weight" not in tensors and tensors["model.norm.weight"].equal(torch.ones(8))
    spec = parse_quantization_config(config["quantization_config"])
    w = w.float().double()
    if fmt == "int8x":
        assert isinstance(spec, Int8xSpec)
        stored = {s.removeprefix(MODULE + "."): t for s, t in tensors.items() if s.startswith(MODULE)}
        scale = float(w.abs().max()) / 127
        assert torch.equal(int8x.decode_int8(stored).double(), torch.round(w / scale).clamp(-127, 127))
        assert int8x.scale_of(stored) == pytest.approx(scale, rel=1e-7)
        return
    assert isinstance(spec, TernarySpec) and spec.pack_layout == "interleaved" and spec.bit_order == "lsb"
    group = spec.group_size if spec.scale_granularity == "group" else k
    g = w.reshape(n, k // group, group)
    absmean = g.abs().mean(dim=2)
    values = ternary.unpack_values(tensors[f"{MODULE}.{spec.weight_name}"], spec)
    expected = torch.round(g / absmean.clamp(min=1e-8)[:, :, None]).clamp(-1, 1).reshape(n, k)
    assert torch.equal(values.double(), expected)
    stored_scale = tensors[f"{MODULE}.{spec.scale_name}"]
    assert stored_scale.dtype == torch.float16 and tuple(stored_scale.shape) == spec.scale_shape(n, k)
    torch.testing.assert_close(stored_scale.double().reshape(n, -1), absmean, rtol=1e-3, atol=1e-6)
