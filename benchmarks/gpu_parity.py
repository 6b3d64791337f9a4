"""The ``kernels`` candidate's parity runs on a GPU: block and model levels, prefill and decode steps, per model.

Each run is one ``ParitySession`` (``--parity-candidate=kernels --parity-device=cuda``) in this process: the fp32
reference and the candidate in its serving dtype, both on CUDA, the decode steps replayed from a CUDA graph. The
JSON holds, per model, level and dtype: the verdict, the taps compared per phase, the failing ones, the run's
timings (the candidate's prefill and decode phases apart, the graph's capture), the kernel branches exercised, and
the peak GPU memory.

    python benchmarks/gpu_parity.py [--models default,large,int8x] [--levels block,model] [--dtypes bfloat16]
                                    [--decode-steps 2] [--budget-s 400] [--prompts branches] [--out FILE]

``large`` is ``harness.py``'s 1.2B seed-article fixture (LARGE), ``int8x`` an int8x fixture of the default's
dims; both are generated into the fixture cache on first use. Runs past ``--budget-s`` are skipped (said so).
The prompts (``--prompts branches``, the default) are three of 8, 224 and 400 tokens, so that the prefills, each
run alone, take every row-count branch of the ternary dispatch; each run's ``kernel_branches`` says which ran.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


def model_dir(name: str) -> tuple[str | None, float]:
    """The checkpoint of ``name`` (None: the embedded default) and the seconds its generation took."""
    from vllm_parity.fixtures.checkpoints import Dims, make_fixture
    from vllm_parity.fixtures.default_model import cache_root

    if name == "default":
        return None, 0.0
    t0 = time.perf_counter()
    if name == "large":
        from harness import LARGE

        path = make_fixture("seed-article", cache_root() / "bench-1.2b-seed-article", seed=0, dims=Dims(**LARGE),
                            overwrite=False)
    elif name == "int8x":
        path = make_fixture("int8x", cache_root() / "bench-int8x-default-dims", seed=0, dims=Dims(), overwrite=False)
    else:
        raise SystemExit(f"unknown model {name!r}: default, large or int8x")
    return str(path), time.perf_counter() - t0


def branch_prompts(model: str | None, decode_steps: int, seed: int = 0) -> list[list[int]]:
    """Three prompts whose prefills, each run alone, take every row-count branch of the ternary CUDA dispatch
    (kernels/choose.py: up to MMA_MAX_M rows, between, from DEQUANT_MIN_M), the decode steps taking one row."""
    from vllm_parity.fixtures.default_model import default_model_dir
    from vllm_parity.serving.choose import DEQUANT_MIN_M, MMA_MAX_M

    config = json.loads((Path(model or default_model_dir()) / "config.json").read_text())
    lens = [8, (MMA_MAX_M + DEQUANT_MIN_M) // 2, DEQUANT_MIN_M + 16]
    if lens[-1] + decode_steps > config["max_position_embeddings"]:
        raise SystemExit(f"gpu_parity: the branch prompts need {lens[-1] + decode_steps} positions, the model has "
                         f"{config['max_position_embeddings']}")
    gen = torch.Generator().manual_seed(seed)
    return [[1] + torch.randint(2, config["vocab_size"], (n - 1,), generator=gen).tolist() for n in lens]


def run(model: str | None, level: str, dtype: str, decode_steps: int, device: str = "cuda",
        prompts: str | None = None) -> dict:
    from vllm_parity.harness.session import Options, ParitySession

    with tempfile.TemporaryDirectory() as tmp:
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        s = ParitySession(Options(model=model, level=level, candidate="kernels", device=device, dtype=dtype,
                                  decode_steps=decode_steps, prompts=prompts, report_dir=f"{tmp}/report",
                                  snapshot_dir=f"{tmp}/snap", root=tmp, command=["benchmarks/gpu_parity.py"]))
        try:
            capture = s.capture()
            judgement = s.judgement()
            checks = {n: s.check(n).get("passed") for n in ("greedy", "topk")} if level == "model" else {}
            record = s.record().as_dict()
        finally:
            s.finish()
        wall = time.perf_counter() - t0
    phases: dict[str, int] = {}
    for r in judgement.taps:
        name = "prefill" if r.phase == "prefill" else f"decode{r.step}"
        phases[name] = phases.get(name, 0) + 1
    cand = capture.candidate.manifest
    lens = [len(p) for p in json.loads(Path(prompts).read_text())] if prompts else None
    return {"model": record["run"]["model"], "format": record["run"]["format"], "level": level, "dtype": dtype,
            "prompt_lengths": lens,
            "mode": record["run"]["mode"], "passed": all(r.verdict for r in judgement.taps) and all(checks.values()),
            "checks": checks, "taps": phases,
            "failing": sorted({f"{r.name}@{r.phase}{'' if r.step is None else r.step}"
                               for r in judgement.taps if not r.verdict})[:20],
            "wall_s": wall, "timings": record["run"]["timings"], "candidate_phases_s": cand.get("seconds", {}),
            "decode_graph": cand.get("decode_graph"), "decode_tokens": cand.get("decode", {}).get("tokens"),
            "kernel_branches": record["run"].get("kernel_branches"),
            "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="default,int8x,large")
    ap.add_argument("--levels", default="block,model")
    ap.add_argument("--dtypes", default="bfloat16")
    ap.add_argument("--decode-steps", type=int, default=2)
    ap.add_argument("--budget-s", type=float, default=400.0)
    ap.add_argument("--prompts", default="branches",
                    help="branches (default: three prompts taking every kernel branch), default (the harness's "
                         "prompt set) or a prompt file")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu_parity_h200.json"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_parity: no CUDA device")
    start, runs, skipped = time.perf_counter(), [], []
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": torch.cuda.get_device_name(0),
           "python": platform.python_version()}
    for name in args.models.split(","):
        if time.perf_counter() - start > args.budget_s:
            skipped.append(name)
            print(f"{name}: skipped, past the {args.budget_s:.0f} s budget", flush=True)
            continue
        path, made = model_dir(name)
        prompts = None if args.prompts == "default" else args.prompts
        if args.prompts == "branches":
            prompts = str(Path(tempfile.mkdtemp()) / "branches.json")
            Path(prompts).write_text(json.dumps(branch_prompts(path, args.decode_steps)))
        for level in args.levels.split(","):
            for dtype in args.dtypes.split(","):
                try:
                    r = run(path, level, dtype, args.decode_steps, prompts=prompts)
                except Exception as exc:  # noqa: BLE001 - recorded, the other runs go on
                    r = {"model": name, "level": level, "dtype": dtype, "passed": False, "error": repr(exc)[:2000]}
                r.update(label=name, fixture_generation_s=made)
                runs.append(r)
                print(json.dumps({k: r.get(k) for k in ("label", "level", "dtype", "mode", "passed", "taps", "wall_s",
                                                        "candidate_phases_s", "kernel_branches", "failing",
                                                        "error")}), flush=True)
                Path(args.out).write_text(json.dumps({"env": env, "runs": runs, "skipped": skipped}, indent=1) + "\n")
    Path(args.out).write_text(json.dumps({"env": env, "runs": runs, "skipped": skipped}, indent=1) + "\n")
    if not all(r["passed"] for r in runs):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
