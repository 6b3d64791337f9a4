"""Per quantization method and serving dtype: the run's verdict, its largest errors and its wall time.

Each case is one in-process model-level run (the default options: auto mode) on a tiny Llama fixture of the
method, through the real CPU engine. Written per case: the mode, the largest token relative error of the
logits (as judged, and propagated), the least ``token_rtol`` every tap would pass at, the prompt log-probs'
largest difference, and the wall time as a ratio to the fp control run first in the same process (after one discarded warm-up run).

    python benchmarks/methods.py [--repeat N] [--only FIXTURE:DTYPE ...] [--out benchmarks/results/methods.json]

With ``--only`` just those cases run (and the fp control, for the ratio); their rows replace the same cases' in
the existing file, the other rows kept. Each row names the CPU it ran on: vLLM's CPU kernels differ by ISA
(the 4-bit ones need AVX-512; with AMX in bf16 vLLM takes its W4A8 kernel).
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

from vllm_parity.errors import EngineUnsupported

ROOT = Path(__file__).resolve().parents[1]

# (label, fixture maker name, serving dtype)
CASES = [("fp control", "fp", "float32"), ("ternary (seed-article)", "seed-article", "float32"),
         ("ternary (seed-article)", "seed-article", "bfloat16"), ("ternary (seed-article)", "seed-article", "float16"),
         ("int8x", "int8x", "bfloat16"), ("compressed-tensors FP8_DYNAMIC", "ct-fp8-dynamic", "float32"),
         ("compressed-tensors FP8_DYNAMIC", "ct-fp8-dynamic", "bfloat16"),
         ("compressed-tensors FP8_DYNAMIC", "ct-fp8-dynamic", "float16"),
         ("compressed-tensors W8A8 int8", "ct-w8a8", "float32"),
         ("compressed-tensors W8A8 int8", "ct-w8a8", "bfloat16"),
         ("compressed-tensors W8A8 int8", "ct-w8a8", "float16")] + [
         (label, name, dtype) for label, name in (("compressed-tensors W4A16", "ct-w4a16"),
                                                  ("compressed-tensors W4A16 asym", "ct-w4a16-asym"),
                                                  ("AWQ (GEMM)", "awq"), ("GPTQ", "gptq"))
         for dtype in ("bfloat16", "float16")]


def _fixture(name: str, out: Path):
    from vllm_parity.fixtures.awq import make_awq_fixture
    from vllm_parity.fixtures.checkpoints import Dims, make_fixture
    from vllm_parity.fixtures.compressed_tensors import make_ct_fixture
    from vllm_parity.fixtures.gptq import make_gptq_fixture

    dims = Dims(hidden=128, layers=3, heads=2, kv_heads=1, intermediate=256, vocab=1024)
    if name.startswith("ct-"):
        return make_ct_fixture(name, out, dims=dims)
    makers = {"awq": make_awq_fixture, "gptq": make_gptq_fixture}
    return makers[name](out, dims=dims) if name in makers else make_fixture(name, out, dims=dims)


def _cpu() -> str:
    """The CPU's model name and the ISA extensions vLLM's CPU kernels choose by."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "")
    flags = set(next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), []))
    isa = [f for f in ("avx2", "avx512f", "avx512_vnni", "amx_int8", "amx_bf16") if f in flags]
    return f"{model} ({', '.join(isa)})"


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
    ap.add_argument("--only", nargs="+", metavar="FIXTURE:DTYPE", help="run these cases, merge their rows")
    args = ap.parse_args()
    known = {f"{name}:{dtype}" for _, name, dtype in CASES}
    if args.only and set(args.only) - known:
        ap.error(f"unknown case(s) {sorted(set(args.only) - known)}; known: {sorted(known)}")
    cases = [c for i, c in enumerate(CASES) if i == 0 or not args.only or f"{c[1]}:{c[2]}" in args.only]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        run_case("fp", "float32", Path(tmp) / "warmup")  # the process's first engine start imports and compiles
        for label, name, dtype in cases:
            try:
                runs = [run_case(name, dtype, Path(tmp) / f"{name}-{dtype}-{i}") for i in range(args.repeat)]
            except EngineUnsupported as e:  # vLLM refuses the case on this CPU: a row that says so
                row = {"method": label, "fixture": name, "dtype": dtype, "refused": str(e), "cpu": _cpu()}
            else:
                row = {"method": label, "fixture": name, "dtype": dtype, **runs[-1],
                       "wall_s": statistics.median(r["wall_s"] for r in runs), "repeat": args.repeat, "cpu": _cpu()}
            rows.append(row)
            print(json.dumps(row), flush=True)
    base = rows[0]["wall_s"]
    for row in rows:
        if "wall_s" in row:
            row["wall_vs_fp_control"] = row["wall_s"] / base
    if args.only:
        if "fp:float32" not in args.only:
            rows = rows[1:]  # the control ran for the ratio only
        fresh = {(r["fixture"], r["dtype"]): r for r in rows}
        kept = json.loads(Path(args.out).read_text())["rows"] if Path(args.out).exists() else []
        merged = [fresh.pop((r["fixture"], r["dtype"]), r) for r in kept]
        order = {(name, dtype): i for i, (_, name, dtype) in enumerate(CASES)}
        rows = sorted(merged + list(fresh.values()), key=lambda r: order.get((r["fixture"], r["dtype"]), len(order)))
    out = {"machine": platform.processor() or platform.machine(), "python": sys.version.split()[0],
           "fixture": "llama, hidden 128, 3 layers, 4 prompts x 64 tokens", "rows": rows}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
