"""The GPU machine's scripts run every GPU test: each test file with ``gpu``-marked tests is named by
``scripts/gpu_suite.sh`` (the kernels) or ``scripts/gpu_parity.sh`` (the parity runs)."""

import os
import re
import subprocess
import sys
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


def test_gpu_suite_runs_past_a_test_that_crashes_or_hangs(tmp_path):
    """gpu_suite.sh's isolation of the kernel tests (its own lines, run here): a test that kills its process with a
    segmentation fault and one that never returns each fail alone, and the tests after them still run and pass."""
    (tmp_path / "test_crash.py").write_text(
        "import os, signal, time\n"
        "def test_before():\n    pass\n"
        "def test_segfault():\n    os.kill(os.getpid(), signal.SIGSEGV)\n"
        "def test_hangs():\n    time.sleep(120)\n"
        "def test_after():\n    pass\n")
    script = (ROOT / "scripts" / "gpu_suite.sh").read_text()
    lines = script[script.index("test_s="):script.index("tests=()")]
    run = subprocess.run(
        ["bash", "-c", f'py="{sys.executable}"\n{lines}\n[ ${{#isolate[@]}} -gt 0 ] || {{ echo "no isolation"; exit 9; }}\n'
         f'"$py" -m pytest -p no:cacheprovider -q --rootdir "{tmp_path}" "${{isolate[@]}}" '
         f'"{tmp_path / "test_crash.py"}"'],
        capture_output=True, text=True, timeout=240, cwd=tmp_path, env={**os.environ, "PARITY_GPU_TEST_S": "5"})
    out = run.stdout + run.stderr
    assert run.returncode == 1, out[-3000:]
    assert "2 failed, 2 passed" in out, out[-3000:]
    assert re.search(r"crashed while running .*test_segfault", out), out[-3000:]
