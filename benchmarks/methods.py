"""Per quantization method and serving dtype: the run's verdict, its largest errors and its wall time.

Each case is one in-process model-level run (the default options: auto mode) on a tiny Llama fixture of the
method, through the real CPU engine. Written per case: the mode, the largest token relative error of the
logits (as judged, and propagated), the least ``token_rtol`` every tap would pass at, the prompt log-probs'
largest difference, and the wall time as a ratio to the fp control run first in the same process (after one discarded warm-up run).

    python benchmarks/methods.py [--repeat N] [--out benchmarks/results/methods.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# (label, fixture maker name, serving dtype)
CASES = [("fp control", "fp", "float32"), ("ternary (seed-article)", "seed-article", "float32"),
         ("ternary (seed-article)", "seed-article", "bfloat16"), ("ternary (seed-article)", "seed-article", "float16"),
         ("int8x", "int8x", "bfloat16"), ("compressed-tensors FP8_DYNAMIC", "ct-fp8-dynamic", "float32"),
         ("compressed-tensors FP8_DYNAMIC", "ct-fp8-dynamic", "bfloat16"),
         ("compressed-tensors W8A8 int8", "ct-w8a8", "float32")]


def _fixture(name: str, out: Path):
    from vllm_parity.fixtures.checkpoints import Dims, make_fixture
    from vllm_parity.fixtures.compressed_tensors import make_ct_fixture

    dims = Dims(hidden=128, layers=3, heads=2, kv_heads=1, intermediate=256, vocab=1024)
    return make_ct_fixture(name, out, dims=dims) if name.startswith("ct-") else make_fixture(name, out, dims=dims)


def run_case(name: str, dtype: str, tmp: Path) -> dict:
    from vllm_parity.harness.session import Options, ParitySession

    model = _fixture(name, tmp / name)
    t0 = time.perf_counter()
    s = ParitySession(Options(model=str(model), level="model", dtype=dtype, report_dir=str(tmp / "r"),
                              snapshot_dir=str(tmp / "snap"), root=str(tmp)))
    try:
        taps = s.judgement().taps
        judged = [t.isolated or t for t in taps]
        logits = next(t for t in taps if t.name == "logits")
        checks = {c: s.check(c) for c in ("greedy", "topk", "logprobs")}
        hints = sorted({h.kind for h in s.diagnosis().hints})
    finally:
        s.finish()
    wall = time.perf_counter() - t0
    return {"mode": s.mode, "passed": all(t.verdict for t in taps) and all(c["passed"] for c in checks.values()),
            "logits_token_rel": (logits.isolated or logits).metrics.token_rel,
            "logits_token_rel_propagated": logits.metrics.token_rel,
            "min_passing_token_rtol": max(t.metrics.token_rel for t in judged if t.metrics is not None),
            "logprobs_max_abs": checks["logprobs"]["max_abs"], "hints": hints, "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "methods.json"))
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        run_case("fp", "float32", Path(tmp) / "warmup")  # the process's first engine start imports and compiles
        for label, name, dtype in CASES:
            runs = [run_case(name, dtype, Path(tmp) / f"{name}-{dtype}-{i}") for i in range(args.repeat)]
            row = {"method": label, "fixture": name, "dtype": dtype, **runs[-1],
                   "wall_s": statistics.median(r["wall_s"] for r in runs), "repeat": args.repeat}
            rows.append(row)
            print(json.dumps(row), flush=True)
    base = rows[0]["wall_s"]
    for row in rows:
        row["wall_vs_fp_control"] = row["wall_s"] / base
    out = {"machine": platform.processor() or platform.machine(), "python": sys.version.split()[0],
           "fixture": "llama, hidden 128, 3 layers, 4 prompts x 64 tokens", "rows": rows}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
