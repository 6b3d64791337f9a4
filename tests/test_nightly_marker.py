"""Tests marked ``nightly`` are skipped, with the reason, unless PARITY_NIGHTLY=1."""

from pathlib import Path

pytest_plugins = ["pytester"]

ROOT_CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"


def test_nightly_tests_run_only_in_the_nightly_gate(pytester, monkeypatch):
    pytester.makeconftest(ROOT_CONFTEST.read_text())
    pytester.makeini("[pytest]\nmarkers =\n    nightly: runs only in the nightly gate\n")
    pytester.makepyfile("""
        import pytest

        @pytest.mark.nightly
        def test_wide():
            pass

        def test_every_day():
            pass
    """)
    monkeypatch.delenv("PARITY_NIGHTLY", raising=False)
    result = pytester.runpytest("-rs")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(["*nightly: runs in the nightly gate (PARITY_NIGHTLY=1)*"])
    monkeypatch.setenv("PARITY_NIGHTLY", "1")
    pytester.runpytest().assert_outcomes(passed=2)
