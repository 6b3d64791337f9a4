"""The project as a wheel: one namespace (``vllm_parity``), complete (CUDA sources, prompt sets, the
default golden), installed beside Hugging Face's ``kernels`` and testing-cabal's ``fixtures`` without
taking either name, and the README's main command passing from an empty directory."""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
WHEELHOUSE = Path(sys.prefix) / "wheelhouse"  # scripts/setup.sh downloads the two other packages here
OTHERS = ("kernels", "fixtures")
# the repository's folders and where they sit in the installed namespace
FOLDERS = {"parity": "vllm_parity", "references": "vllm_parity/reference", "kernels": "vllm_parity/serving",
           "fixtures": "vllm_parity/fixtures"}

PROBE = textwrap.dedent("""
    import importlib.util, json
    from transformers.utils import is_kernels_available
    out = {"kernels_available": is_kernels_available()}
    for name in ("kernels", "fixtures", "vllm_parity", "parity", "references"):
        spec = importlib.util.find_spec(name)
        out[name] = spec.origin if spec else None
    if out["kernels"]:
        import kernels, fixtures
        out["hf_kernels"] = hasattr(kernels, "get_kernel")
        out["cabal_fixtures"] = hasattr(fixtures, "Fixture")
    print(json.dumps(out))
""")


def _sources(dest: Path) -> Path:
    """The checkout's files as a clean checkout has them: tracked, and new ones git does not ignore."""
    names = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True,
                           text=True, check=True).stdout.split("\n")
    for name in filter(None, names):
        src = REPO / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


def _run(cmd: list[str], cwd: Path, timeout: int = 600, **env) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "TRITON_"))}
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env={**environ, **env})
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} exited {proc.returncode}:\n" \
                                 f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    src = _sources(tmp / "src")
    _run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", str(src),
          "-w", str(tmp / "dist")], cwd=tmp)
    (whl,) = (tmp / "dist").glob("vllm_parity-*.whl")
    return whl


def test_the_wheel_is_one_namespace_and_complete(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"vllm_parity", next(t for t in tops if t.endswith(".dist-info"))}, tops
    for folder, package in FOLDERS.items():  # every module of every floor
        for path in (REPO / folder).rglob("*.py"):
            inside = f"{package}/{path.relative_to(REPO / folder).as_posix()}"
            assert inside in names, f"{wheel.name} lacks {inside} ({path.relative_to(REPO)})"
    csrc = [f"vllm_parity/serving/csrc/{p.name}" for p in sorted((REPO / "kernels" / "csrc").iterdir())]
    assert "vllm_parity/serving/csrc/launch.cuh" in csrc  # every CUDA source and header the extensions include
    for needed in (*csrc, "vllm_parity/fixtures/prompts/default.json",
                   "vllm_parity/fixtures/prompts/short.json", "vllm_parity/reference/golden/default/manifest.json"):
        assert needed in names, f"{wheel.name} lacks {needed}"
    golden = json.loads(zipfile.ZipFile(wheel).read("vllm_parity/reference/golden/default/manifest.json"))
    files = {e["file"] for prompts in golden["taps"].values() for e in prompts.values()}
    assert files and all(f"vllm_parity/reference/golden/default/{f}" in names for f in files)
    for s in range(golden["decode"]["steps"]):  # the decode steps' dumps, each in its own folder
        assert f"vllm_parity/reference/golden/default/decode{s}/manifest.json" in names
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    for line in ("parity = vllm_parity.tools.cli:main", "parity = vllm_parity.harness.plugin",
                 "vllm_parity = vllm_parity.serving.vllm:register"):
        assert line in entry_points


@pytest.mark.slow
@pytest.mark.vllm
def test_installed_beside_hf_kernels_and_cabal_fixtures_the_main_command_passes(wheel, tmp_path):
    others = sorted(p for p in WHEELHOUSE.glob("*.whl") if p.name.split("-")[0] in OTHERS)
    if len(others) != len(OTHERS):
        pytest.skip(f"{WHEELHOUSE} holds no wheels of {OTHERS}: run scripts/setup.sh")
    env = tmp_path / "env"
    _run([sys.executable, "-m", "venv", "--without-pip", str(env)], cwd=tmp_path)
    python = env / "bin" / "python"
    (own,) = Path(_run([str(python), "-c", "import site; print(site.getsitepackages()[0])"],
                       cwd=tmp_path).stdout.strip()).parent.glob("site-packages")
    # the heavy dependencies (torch, vLLM, transformers) come from this environment, after the new one's own
    (own / "heavy.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps", "--no-index"]
    empty = tmp_path / "empty"
    empty.mkdir()

    _run([*pip, *map(str, others)], cwd=empty)
    before = json.loads(_run([str(python), "-c", PROBE], cwd=empty).stdout.strip().splitlines()[-1])
    _run([*pip, str(wheel)], cwd=empty)
    after = json.loads(_run([str(python), "-c", PROBE], cwd=empty).stdout.strip().splitlines()[-1])

    assert after["hf_kernels"] and after["cabal_fixtures"], after
    for name in OTHERS:
        assert Path(after[name]).is_relative_to(own), f"import {name} gives {after[name]}, not the installed package"
    assert after["kernels_available"] == before["kernels_available"], (before, after)
    assert Path(after["vllm_parity"]).is_relative_to(own), after
    assert after["parity"] is None and after["references"] is None, after

    run = _run([str(python), "-m", "pytest", "--parity-level=block", "-p", "no:cacheprovider",
                "--parity-report=report", "--parity-snapshot-dir=snapshots"], cwd=empty, timeout=900)
    assert " passed" in run.stdout and "failed" not in run.stdout, run.stdout[-3000:]
    report = json.loads((empty / "report" / "report.json").read_text())
    assert report["passed"] and len(report["taps"]) > 0
