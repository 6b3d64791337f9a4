"""A user's own format as its own package (``examples/parity-example-int4``, installed into the test
environment by ``scripts/setup.sh``): its reference side found through the ``vllm_parity.formats`` entry point,
its vLLM method through ``vllm.general_plugins``; both decoders agree on hand-worked bytes and on arbitrary
ones, every level passes, and a planted fault is localized with a hint that needs no knowledge of the format."""

import importlib.metadata
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st

from vllm_parity.fixtures.checkpoints import Dims, make_fixture
from vllm_parity.reference.formats import parse_quantization_config

from tests.engine_runs import checked_engine, doubled_channel_is_found

example = pytest.importorskip("parity_example_int4.reference",
                              reason="the example package is installed by scripts/setup.sh")
serving = pytest.importorskip("parity_example_int4.serving")

SMALL = Dims(hidden=128, layers=3, heads=2, kv_heads=1, intermediate=256, vocab=1024)


def test_the_package_is_found_through_its_entry_point():
    eps = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="vllm_parity.formats")}
    assert eps["example_int4"] == "parity_example_int4.reference:ExampleInt4Spec"
    spec = parse_quantization_config({"quant_method": "example_int4", "group_size": 16})
    assert isinstance(spec, example.ExampleInt4Spec) and spec.group_size == 16


def test_both_decoders_on_hand_worked_bytes():
    # 0x9F: the low nibble 15 (the first input, 15 - 8 = 7), the high nibble 9 (1); the scale 0.5
    stored = {"qweight": torch.tensor([[0x9F, 0x08]], dtype=torch.uint8), "qscale": torch.tensor([[0.5]]).half()}
    spec = example.ExampleInt4Spec(group_size=4)
    assert spec.decode(stored, 1, 4, "m").tolist() == [[3.5, 0.5, 0.0, -4.0]]
    assert serving.dequantize(stored["qweight"], stored["qscale"], 4).tolist() == [[3.5, 0.5, 0.0, -4.0]]


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 9), groups=st.integers(1, 3), seed=st.integers(0, 2**31 - 1))
def test_both_decoders_agree_on_any_weight(n, groups, seed):
    weight = torch.randn(n, 32 * groups, generator=torch.Generator().manual_seed(seed))
    stored = example.encode(weight)
    mine = example.ExampleInt4Spec().decode(stored, n, 32 * groups, "m")
    assert torch.equal(mine, serving.dequantize(stored["qweight"], stored["qscale"], 32))
    step = stored["qscale"].float().repeat_interleave(32, dim=1)
    assert bool(((mine - weight).abs() <= 0.5 * step + 1e-6).all())


@pytest.mark.vllm
@pytest.mark.slow
def test_every_level_passes_and_a_planted_fault_is_localized(tmp_path):
    pytest.importorskip("vllm", reason="the candidate is the vLLM engine")
    with tempfile.TemporaryDirectory() as tmp:
        model = example.quantize(make_fixture("fp", Path(tmp) / "fp", dims=SMALL), tmp_path / "int4")

    def passes(s):
        judgement = s.judgement()
        assert s.record().run["format"] == "example_int4" and s.mode == "propagated"
        assert not [(t.name, t.message) for t in judgement.taps if not t.passed]
        for check in ("greedy", "topk", "logprobs"):
            assert s.check(check)["passed"], (check, s.check(check))

    llm = checked_engine(model, tmp_path, passes, level="model")

    def double_channel(m):  # the method's dense weight with one output channel's scales doubled
        m.get_submodule("model.layers.1.mlp.down_proj").dense[5] *= 2
        return True

    doubled_channel_is_found(llm, model, tmp_path, double_channel)
