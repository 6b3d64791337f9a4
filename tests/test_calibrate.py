"""Calibration's measurements: the spread of two correct implementations, the variants, the rules."""

import math

import pytest
import torch
import torch.nn.functional as F

from vllm_parity.architectures import lookup
from vllm_parity.harness.calibrate import FLOOR, calibrate, reversed_summation
from vllm_parity.harness.dumps import DumpReader, DumpWriter
from vllm_parity.harness.metrics import Tolerance, compare, passes, spread


def test_reversed_summation_rounds_another_way_and_restores():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(16, 1024, generator=g), torch.randn(64, 1024, generator=g)
    plain = F.linear(x, w)
    with reversed_summation():
        other = F.linear(x, w)
        module = torch.nn.Linear(1024, 64, bias=False)
        module.weight.data.copy_(w)
        through_module = module(x)
    assert F.linear(x, w).equal(plain)  # restored
    assert not other.equal(plain) and through_module.equal(other)
    exact = (x.double() @ w.double().T)
    torch.testing.assert_close(other.double(), exact, rtol=1e-5, atol=1e-4)


def test_spread_is_the_least_passing_tolerance():
    g = torch.Generator().manual_seed(1)
    ref = torch.randn(8, 32, generator=g, dtype=torch.float64)
    ref[0, 3] = 5000.0
    other = ref * (1 + 1e-6 * torch.randn(8, 32, generator=g, dtype=torch.float64))
    token, element = spread(ref, other)
    assert spread(ref, ref) == (0.0, 0.0)
    at = Tolerance(rtol=element * 1.001, row_rtol=element * 1.001, token_rtol=token * 1.001)
    assert passes(compare(ref, other, at), at)
    below = Tolerance(rtol=element * 0.99, row_rtol=element * 0.99, token_rtol=math.inf)
    assert not passes(compare(ref, other, below), below)


def _dump(root, tensors):
    w = DumpWriter(root, {})
    for tap, t in tensors.items():
        w.write(tap, {f"{tap}@0": t})
    return DumpReader(w.close())


def test_calibrate_takes_the_widest_spread_with_headroom(tmp_path):
    from vllm_parity.fixtures.checkpoints import Dims, make_fixture
    from vllm_parity.reference.checkpoint import Checkpoint

    ckpt = Checkpoint(make_fixture("fp", tmp_path / "m", dims=Dims(hidden=32, layers=1, heads=2, kv_heads=1,
                                                                   intermediate=64, vocab=64)))
    g = torch.Generator().manual_seed(2)
    ref = torch.randn(6, 32, generator=g)
    taps = {"layers.0.output": ref}
    ref32 = _dump(tmp_path / "r", taps)
    variants = {"fp64": _dump(tmp_path / "v1", {"layers.0.output": ref * (1 + 1e-7)}),
                "sdpa": _dump(tmp_path / "v2", {"layers.0.output": ref * (1 + 3e-6)})}
    cand = _dump(tmp_path / "c", taps)
    table, notes = calibrate(ckpt, lookup("llama"), ["layers.0.output"], ref32, variants, cand, cand, headroom=10)
    tol = table.resolve("layers.0.output")
    assert notes["layers.0.output"]["widest"] == "sdpa"
    assert tol.token_rtol == pytest.approx(3e-5, rel=0.01) and tol.row_rtol == tol.rtol
    assert not tol.elementwise_only
    exact, _ = calibrate(ckpt, lookup("llama"), ["layers.0.output"], ref32, {"fp64": ref32}, cand, cand, headroom=10)
    assert exact.resolve("layers.0.output").token_rtol == pytest.approx(10 * FLOOR)  # exact taps stay judgeable


def test_the_format_cap_reads_the_inputs_that_move_a_code(tmp_path):
    """Behind relu² most of down_proj's inputs are exactly zero; a zero moves no code, so the cap comes from
    the others (a median of zero would give a tolerance of zero)."""
    from vllm_parity.fixtures.checkpoints import Dims, make_fixture
    from vllm_parity.harness.calibrate import format_cap
    from vllm_parity.reference.checkpoint import Checkpoint

    dims = Dims(hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64, vocab=64)
    ckpt = Checkpoint(make_fixture("seed-article", tmp_path / "m", dims=dims))
    g = torch.Generator().manual_seed(3)
    act = torch.randn(8, dims.intermediate, generator=g)
    down = torch.randn(8, dims.hidden, generator=g)
    dense = format_cap(ckpt, lookup("llama"), _dump(tmp_path / "d", {"layers.0.mlp.act": act,
                                                                      "layers.0.mlp.down": down}), "layers.0.mlp.down")
    sparse_act = torch.where(torch.rand(act.shape, generator=g) < 0.6, torch.zeros_like(act), act)
    sparse = format_cap(ckpt, lookup("llama"), _dump(tmp_path / "s", {"layers.0.mlp.act": sparse_act,
                                                                       "layers.0.mlp.down": down}), "layers.0.mlp.down")
    assert all(c > 0 for c in sparse)
    assert sparse[0] == pytest.approx(dense[0], rel=0.5) and sparse[1] == pytest.approx(dense[1], rel=0.5)


def test_a_spread_beyond_one_code_step_is_not_capped_below_itself(tmp_path):
    """Correct implementations of a format that quantizes activations differ by flipped codes, more than one
    weight code step moves the output: capping their tolerance there would fail the correct candidate."""
    from vllm_parity.fixtures.checkpoints import Dims, make_fixture
    from vllm_parity.harness.calibrate import format_cap
    from vllm_parity.reference.checkpoint import Checkpoint

    ckpt = Checkpoint(make_fixture("seed-article", tmp_path / "m", dims=Dims(hidden=32, layers=1, heads=2,
                                                                             kv_heads=1, intermediate=64, vocab=64)))
    g = torch.Generator().manual_seed(3)
    act, down = torch.randn(6, 64, generator=g), torch.randn(6, 32, generator=g)
    ref32 = _dump(tmp_path / "r", {"layers.0.mlp.act": act, "layers.0.mlp.down": down})
    cap = format_cap(ckpt, lookup("llama"), ref32, "layers.0.mlp.down")
    results = {}
    for name, rel in (("within", 0.3 * cap[0]), ("beyond", 30 * cap[0])):
        other = _dump(tmp_path / name, {"layers.0.mlp.act": act, "layers.0.mlp.down": down * (1 + rel)})
        table, notes = calibrate(ckpt, lookup("llama"), ["layers.0.mlp.down"], ref32, {"fp64": other}, ref32, ref32)
        results[name] = (table.resolve("layers.0.mlp.down").token_rtol, notes["layers.0.mlp.down"])
    tol, note = results["within"]
    assert note["capped"] and not note["spread_above_cap"] and tol == pytest.approx(cap[0], rel=0.01)
    tol, note = results["beyond"]
    assert not note["capped"] and note["spread_above_cap"] and tol == pytest.approx(10 * 30 * cap[0], rel=0.01)
