"""Wall time and peak memory of ``pytest --parity-level=block``, with its breakdown.

Runs the README's main command in a subprocess (so its peak RSS is its own) on the embedded default,
and optionally on generated ternary fixtures: 1.2 B parameters (``--large``: 24 layers, hidden 2048,
intermediate 5632, vocab 32000) and a 7B shape (``--xl``: Llama-2-7B's 32 layers, hidden 4096, intermediate
11008, vocab 32000; random weights generated on the first run into the fixture cache, never committed). The
breakdown comes from the run's report.json: engine start, reference and candidate capture (prefill and decode
steps), compare, report; "startup" is the rest (interpreter, imports, collection).

    python benchmarks/harness.py [--large] [--xl] [--no-default] [--repeat N] [--baseline ROOT=PYTHON] [--out FILE]

``--baseline`` runs the same command, alternating with this checkout's, from another checkout with the
interpreter that has it installed (an earlier version, say): every figure is then a median over
``--repeat`` runs of each, with the ratio of this checkout's to the baseline's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LARGE = dict(hidden=2048, layers=24, heads=16, kv_heads=8, intermediate=5632, vocab=32000)
XL = dict(hidden=4096, layers=32, heads=32, kv_heads=32, intermediate=11008, vocab=32000)


# Runs one command and prints its peak RSS: each measured run is the only child of its own wrapper.
_WRAP = ("import json, resource, subprocess, sys; rc = subprocess.run(sys.argv[1:]).returncode; "
         "print(json.dumps({'rc': rc, 'maxrss_kib': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}))")


def run_block(model: Path | None, label: str, root: Path = ROOT, python: str = sys.executable) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [python, "-m", "pytest", "--parity-level=block", "-q", "-p", "no:cacheprovider",
               "--parity-report", f"{tmp}/report", "--parity-snapshot-dir", f"{tmp}/snap"]
        if model is not None:
            cmd += ["--parity-model", str(model)]
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", _WRAP, *cmd], cwd=root, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        status = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.stdout.strip() else {"rc": proc.returncode}
        if status["rc"] != 0:
            sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
            raise SystemExit(f"{label}: pytest exited {status['rc']}")
        rep = json.loads((Path(tmp) / "report" / "report.json").read_text())
    t = rep["run"]["timings"]
    accounted = sum(t.get(k, 0.0) for k in ("engine_start_s", "reference_s", "reference_decode_s", "candidate_s",
                                            "compare_s", "report_s"))
    return {
        "label": label, "model": rep["run"]["model"], "taps": len(rep["taps"]), "passed": rep["passed"],
        "wall_s": wall, "startup_and_collection_s": wall - accounted, **t,
        "peak_rss_gib": status["maxrss_kib"] / 2**20,
    }


def _median_row(runs: list[dict]) -> dict:
    out = dict(runs[0])
    for k, v in runs[0].items():
        if isinstance(v, float) and k != "peak_rss_gib":
            out[k] = statistics.median(r[k] for r in runs)
    out["peak_rss_gib"] = max(r["peak_rss_gib"] for r in runs)
    out["runs"] = len(runs)
    out["wall_s_each"] = [round(r["wall_s"], 2) for r in runs]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--large", action="store_true", help="also run the 1.2 B-parameter fixture")
    parser.add_argument("--xl", action="store_true", help="also run the 7B-shape fixture")
    parser.add_argument("--no-default", action="store_true", help="leave out the embedded default")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "harness.json"))
    parser.add_argument("--repeat", type=int, default=1, help="runs of each command (the figures are medians)")
    parser.add_argument("--baseline", default=None, metavar="ROOT=PYTHON",
                        help="also run the command from checkout ROOT with interpreter PYTHON, alternating")
    args = parser.parse_args()
    from vllm_parity.fixtures.checkpoints import Dims, make_fixture
    from vllm_parity.fixtures.default_model import cache_root

    models = []
    for wanted, name, dims, label in ((args.large, "bench-1.2b-seed-article", LARGE, "1.2B seed-article"),
                                      (args.xl, "bench-7b-seed-article", XL, "7B-shape seed-article")):
        if wanted:
            ckpt = cache_root() / name
            if not (ckpt / "config.json").is_file():
                t0 = time.perf_counter()
                make_fixture("seed-article", ckpt, seed=0, dims=Dims(**dims), overwrite=False)
                print(f"{label}: generated in {time.perf_counter() - t0:.0f} s", flush=True)
            models.append((ckpt, f"{label}, block level"))
    if not args.no_default:
        models.append((None, "embedded default, block level"))
    sides = {"this checkout": (ROOT, sys.executable)}
    if args.baseline:
        root, python = args.baseline.split("=", 1)
        sides = {"baseline": (Path(root), python), **sides}
    rows = []
    for model, label in models:
        runs: dict[str, list[dict]] = {side: [] for side in sides}
        for _ in range(args.repeat):
            for side, (root, python) in sides.items():
                runs[side].append(run_block(model, label, root, python))
        medians = {side: {**_median_row(r), "side": side, "root": str(sides[side][0])} for side, r in runs.items()}
        if "baseline" in medians:
            ours, base = medians["this checkout"], medians["baseline"]
            ours["wall_ratio_to_baseline"] = ours["wall_s"] / base["wall_s"]
            ours["peak_rss_ratio_to_baseline"] = ours["peak_rss_gib"] / base["peak_rss_gib"]
        rows += list(medians.values())
    for r in rows:
        print(json.dumps(r))
    import torch

    result = {"benchmark": "harness_block_level", "command": "pytest --parity-level=block",
              "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
              "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
