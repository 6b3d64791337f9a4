"""The GPU machine's scripts run every GPU test: each test file with ``gpu``-marked tests is named by
``scripts/gpu_suite.sh`` (the kernels) or ``scripts/gpu_parity.sh`` (the parity runs)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _gpu_test_files() -> set[str]:
    marked = re.compile(r"pytest\.mark\.gpu\b")
    return {f"tests/{p.name}" for p in (ROOT / "tests").glob("test_*.py") if marked.search(p.read_text())}


def test_gpu_scripts_name_every_file_of_gpu_tests():
    suite = re.search(r"PARITY_GPU_TESTS:-([^}]*)\}", (ROOT / "scripts" / "gpu_suite.sh").read_text())
    assert suite, "scripts/gpu_suite.sh: no default list of test files (${PARITY_GPU_TESTS:-...})"
    named = set(suite.group(1).split())
    named |= set(re.findall(r"tests/test_\w+\.py", (ROOT / "scripts" / "gpu_parity.sh").read_text()))
    assert _gpu_test_files() - named == set(), "GPU tests that neither script runs"
    assert {f for f in named if not (ROOT / f).exists()} == set(), "the scripts name test files that do not exist"
