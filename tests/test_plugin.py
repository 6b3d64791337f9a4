"""The pytest face: options, level selection and the funnel, run through pytester."""

pytest_plugins = ["pytester"]

ITEMS = """
import pytest

@pytest.mark.parity(level="op")
def test_op_a():
    assert {op_ok}

@pytest.mark.parity(level="block")
def test_block():
    pass

@pytest.mark.parity(level="model")
def test_model():
    pass

def test_plain():
    pass
"""


def _run(pytester, op_ok, *args):
    """User-marked items only: the glob selects no built-in tap."""
    pytester.makepyfile(ITEMS.format(op_ok=op_ok))
    return pytester.runpytest("-rs", "--parity-taps", "no-such-tap", *args)


def test_without_parity_level_everything_runs(pytester):
    pytester.makepyfile(ITEMS.format(op_ok=True))
    result = pytester.runpytest()
    result.assert_outcomes(passed=4)


def test_level_selects_parity_items_up_to_it(pytester):
    result = _run(pytester, True, "--parity-level=block", "-v")
    result.assert_outcomes(passed=2, deselected=2)
    result.stdout.fnmatch_lines(["*test_op_a PASSED*", "*test_block PASSED*"])


def test_funnel_skips_levels_above_a_failure(pytester):
    result = _run(pytester, False, "--parity-level=model")
    result.assert_outcomes(failed=1, skipped=2, deselected=1)
    result.stdout.fnmatch_lines(["*funnel: level 'op' failed first at *test_op_a*"])
    result.stdout.fnmatch_lines(["*first failure: *test_op_a (level op)*"])


def test_no_funnel_runs_all_levels(pytester):
    result = _run(pytester, False, "--parity-level=model", "--parity-no-funnel")
    result.assert_outcomes(failed=1, passed=2, deselected=1)


def test_bad_marker_level_is_a_usage_error(pytester):
    pytester.makepyfile("""
import pytest
@pytest.mark.parity(level="layer")
def test_x():
    pass
""")
    result = pytester.runpytest("--parity-level=op")
    assert result.ret != 0
    assert "level 'layer' is not one of" in result.stderr.str() + result.stdout.str()


def test_tap_glob_selects_per_layer_nodes(pytester):
    result = pytester.runpytest("--parity-level=block", "--parity-taps=layers.2.*", "--collect-only", "-q")
    lines = [line for line in result.stdout.lines if line.startswith("parity::")]
    assert lines == [f"parity::test_parity[op-layers.2.{t}]" for t in (
        "attn.norm", "attn.q", "attn.k", "attn.v", "attn.context", "attn.o", "mlp.norm", "mlp.gate", "mlp.up",
        "mlp.act", "mlp.down")] + ["parity::test_parity[block-layers.2.output]"]
    model = pytester.runpytest("--parity-level=model", "--collect-only", "-q")
    assert sum(line.startswith("parity::") for line in model.stdout.lines) == 1 + 44 + 4 + 2 + 3
