"""Wall time and peak memory of ``pytest --parity-level=block``, with its breakdown.

Runs the README's main command in a subprocess (so its peak RSS is its own) on the embedded default,
and optionally on the generated 1.2 B-parameter ternary fixture (24 layers, hidden 2048, intermediate
5632, vocab 32000). The breakdown comes from the run's report.json: engine start, reference and
candidate capture, compare, report; "startup" is the rest (interpreter, imports, collection).

    python benchmarks/harness.py [--large] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LARGE = dict(hidden=2048, layers=24, heads=16, kv_heads=8, intermediate=5632, vocab=32000)


def run_block(model: Path | None, label: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pytest", "--parity-level=block", "-q", "-p", "no:cacheprovider",
               "--parity-report", f"{tmp}/report", "--parity-snapshot-dir", f"{tmp}/snap"]
        if model is not None:
            cmd += ["--parity-model", str(model)]
        before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        if proc.returncode != 0:
            sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
            raise SystemExit(f"{label}: pytest exited {proc.returncode}")
        rep = json.loads((Path(tmp) / "report" / "report.json").read_text())
    t = rep["run"]["timings"]
    accounted = sum(t.get(k, 0.0) for k in ("engine_start_s", "reference_s", "candidate_s", "compare_s", "report_s"))
    return {
        "label": label, "model": rep["run"]["model"], "taps": len(rep["taps"]), "passed": rep["passed"],
        "wall_s": wall, "startup_and_collection_s": wall - accounted, **t,
        # ru_maxrss only grows: the figure is valid for the first (largest) child measured after it.
        "peak_rss_gib": peak / 2**20 if peak > before else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--large", action="store_true", help="also run the 1.2 B-parameter fixture")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "harness.json"))
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from fixtures.checkpoints import Dims, make_fixture
    from fixtures.default_model import cache_root

    rows = []
    if args.large:
        ckpt = cache_root() / "bench-1.2b-seed-article"
        if not (ckpt / "config.json").is_file():
            make_fixture("seed-article", ckpt, seed=0, dims=Dims(**LARGE), overwrite=False)
        rows.append(run_block(ckpt, "1.2B seed-article, block level"))  # first: the largest peak
    rows.append(run_block(None, "embedded default, block level"))
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
