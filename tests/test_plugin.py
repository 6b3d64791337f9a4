"""The pytest face: options, level selection and the funnel, run through pytester."""

import json

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
    pytester.makepyfile(ITEMS.format(op_ok=op_ok))
    return pytester.runpytest("-rs", "--parity-report", str(pytester.path / "rep"), *args)


def test_without_parity_level_everything_runs(pytester):
    pytester.makepyfile(ITEMS.format(op_ok=True))
    result = pytester.runpytest()
    result.assert_outcomes(passed=4)


def test_level_selects_parity_items_up_to_it(pytester):
    result = _run(pytester, True, "--parity-level=block")
    result.assert_outcomes(passed=2, deselected=2)
    data = json.loads((pytester.path / "rep" / "results.json").read_text())
    assert [r["level"] for r in data["items"].values()] == ["op", "block"]
    assert data["passed"] is True and data["first_failure"] is None
    assert "no divergence up to level 'block'" in result.stdout.str()


def test_funnel_skips_levels_above_a_failure(pytester):
    result = _run(pytester, False, "--parity-level=model")
    result.assert_outcomes(failed=1, skipped=2, deselected=1)
    result.stdout.fnmatch_lines(["*funnel: level 'op' failed first at *test_op_a*"])
    data = json.loads((pytester.path / "rep" / "results.json").read_text())
    assert data["first_failure"]["level"] == "op"
    assert data["items"][next(k for k in data["items"] if k.endswith("test_model"))]["outcome"] == "skipped"
    assert "First failure" in (pytester.path / "rep" / "summary.md").read_text()


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
