"""Peak memory and time to build the fp32 reference of a 1.2 B-parameter ternary checkpoint.

Each configuration runs in a fresh subprocess so its peak RSS is its own. The checkpoint
(24 layers, hidden 2048, intermediate 5632, vocab 32000, seed-article layout) is generated once
into the cache directory. Writes benchmarks/results/reference_memory.json.

    python benchmarks/reference_memory.py [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

DIMS = dict(hidden=2048, layers=24, heads=16, kv_heads=8, intermediate=5632, vocab=32000)

CHILD = r"""
import json, resource, sys, time, torch
from vllm_parity.reference.model import build_reference_model
t0 = time.perf_counter()
model = build_reference_model(sys.argv[1], cache=sys.argv[2] == "1")
t1 = time.perf_counter()
with torch.no_grad():
    model(torch.tensor([list(range(1, 65))]))
t2 = time.perf_counter()
params = sum(p.numel() for p in model.parameters())
print(json.dumps({"build_s": t1 - t0, "forward_64_tokens_s": t2 - t1, "float_params": params,
                  "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "reference_memory.json"))
    args = parser.parse_args()

    import torch

    from vllm_parity.fixtures.checkpoints import Dims, make_fixture
    from vllm_parity.fixtures.default_model import cache_root

    ckpt = cache_root() / "bench-1.2b-seed-article"
    t0 = time.perf_counter()
    if not (ckpt / "config.json").is_file():
        make_fixture("seed-article", ckpt, seed=0, dims=Dims(**DIMS), overwrite=False)
    gen_s = time.perf_counter() - t0
    size = sum(f.stat().st_size for f in ckpt.iterdir())
    rows = []
    for cache in (False, True):
        out = subprocess.run([sys.executable, "-c", CHILD, str(ckpt), "1" if cache else "0"],
                             capture_output=True, text=True, check=True,
                             cwd=Path(__file__).resolve().parents[1])
        row = json.loads(out.stdout.strip().splitlines()[-1])
        row["cache_decoded_weights"] = cache
        rows.append(row)
        print(row)
    result = {
        "benchmark": "reference_memory",
        "checkpoint": {"dims": DIMS, "format": "seed-article", "bytes_on_disk": size,
                       "generate_s": gen_s},
        "fp32_full_model_gib": None,
        "machine": {"cpus": __import__("os").cpu_count(), "python": platform.python_version(),
                    "torch": torch.__version__},
        "rows": rows,
    }
    # Two fp32 copies of every weight would be the naive builder's floor.
    linear_params = DIMS["layers"] * (2 * DIMS["hidden"] ** 2 + 2 * DIMS["hidden"] * DIMS["hidden"] // 2
                                      + 3 * DIMS["hidden"] * DIMS["intermediate"])
    float_params = 2 * DIMS["vocab"] * DIMS["hidden"] + (2 * DIMS["layers"] + 1) * DIMS["hidden"]
    result["fp32_full_model_gib"] = (linear_params + float_params) * 4 / 2**30
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
