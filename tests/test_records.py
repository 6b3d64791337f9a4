"""The comparison's records round-trip through their JSON form (what report.json holds)."""

import json
import math

from hypothesis import given
from hypothesis import strategies as st

from vllm_parity.harness.compare import TapResult
from vllm_parity.harness.metrics import Metrics, Tolerance

anything = st.floats(allow_nan=True, allow_infinity=True)
finite = st.floats(allow_nan=False, allow_infinity=False, width=32)
tolerances = st.builds(Tolerance, atol=finite, rtol=finite, row_rtol=finite,
                       token_rtol=st.one_of(finite, st.just(math.inf)), max_mismatch_frac=finite, min_cosine=finite)
metrics = st.builds(Metrics, max_abs=anything, max_rel=anything, mean_abs=anything, cosine=anything,
                    sqnr_db=anything, mismatch_frac=finite, nonfinite=st.integers(0, 9),
                    worst_index=st.tuples(st.integers(0, 9), st.integers(0, 99), st.integers(0, 999)),
                    worst_ref=anything, worst_cand=anything, min_atol=anything, numel=st.integers(0, 10**6),
                    token_rel=anything, worst_token=st.integers(0, 99), min_row_rtol=anything, margin=anything)


def results(isolated):
    return st.builds(TapResult, name=st.sampled_from(["embed", "layers.2.mlp.down", "logits"]),
                     level=st.sampled_from(["op", "block", "model"]), layer=st.none() | st.integers(0, 40),
                     shape=st.lists(st.integers(1, 64), max_size=2), metrics=st.none() | metrics,
                     tolerance=tolerances, passed=st.booleans(), growth=st.none() | finite, message=st.text(max_size=20),
                     role=st.sampled_from(["pass", "source", "inherited"]), fed_by=st.lists(st.sampled_from(["embed"])),
                     isolated=isolated, phase=st.sampled_from(["prefill", "decode"]),
                     step=st.none() | st.integers(0, 7), kernels=st.lists(st.sampled_from(["torch", "triton_mm"]), max_size=2))


@given(results(st.none() | results(st.none())))
def test_a_tap_result_round_trips_through_json(r):
    stored = json.loads(json.dumps(r.as_dict()))
    back = TapResult.from_dict(stored)
    assert json.loads(json.dumps(back.as_dict())) == stored
    assert (back.metrics is None) == (r.metrics is None) and (back.isolated is None) == (r.isolated is None)
    if r.metrics is not None and math.isfinite(r.metrics.max_abs):
        assert back.metrics.max_abs == r.metrics.max_abs


def test_an_unbounded_tolerance_stays_unbounded():
    t = Tolerance(atol=1e-4, rtol=1e-4)
    assert t.as_dict()["token_rtol"] is None and Tolerance.from_dict(t.as_dict()) == t
