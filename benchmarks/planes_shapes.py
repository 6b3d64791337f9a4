"""The INT8-X planes GEMV above 8 tokens at the 7B layer's other shapes -> results/int8x_planes_m16_shapes_h200.json.

Llama-2-7B's qkv (4096 -> 12288), o (4096 -> 4096), gate_up (4096 -> 22016) and down (11008 -> 4096) on the seed's
level mix, M = 9 and 16, bf16 x: the default launch (``int8x_planes_cuda.default_config``) against a few explicit
``(warps, tiles_per_cta, stages, splits)``, each timed like ``kernels.py``'s rows (CUDA graph, copies rotated past
the L2) beside torch's bf16 ``F.linear``. Configs the device cannot hold are left out.

    python3 benchmarks/planes_shapes.py [--out PATH]     (with the project installed, on a CUDA machine)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels import graph_us, planes_rotations  # noqa: E402

SHAPES = [(4096, 4096), (4096, 12288), (4096, 22016), (11008, 4096)]
CONFIGS = [None, (1, 8, 2, 8), (1, 4, 2, 8), (1, 8, 2, 4), (1, 4, 2, 4), (1, 8, 2, 2), (1, 16, 2, 4), (2, 4, 2, 1)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "benchmarks/results"),
                                                  "int8x_planes_m16_shapes_h200.json"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/planes_shapes.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from vllm_parity.serving import int8x_planes_cuda as kc

    rows = []
    for k, n in SHAPES:
        base, (layouts, next_layout), (copies, next_wb) = planes_rotations(k, n, "seed-mix")
        for m in (9, 16):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            base_us = graph_us(lambda: F.linear(x, next_wb()), len(copies))
            for cfg in CONFIGS:
                try:
                    us = graph_us(lambda cfg=cfg: kc.linear(x, next_layout(), config=cfg), len(layouts))
                except (ValueError, RuntimeError):  # more shared memory than the device allows
                    continue
                launch = (kc.default_config(m, n, k, *kc.device_limits(x.device)) if cfg is None
                          else kc.resolve_config(cfg, k, m))
                rows.append(dict(K=k, N=n, M=m, config=cfg, launch=launch, us=round(us, 2), bf16_us=round(base_us, 2),
                                 speedup=round(base_us / us, 3)))
                print(rows[-1], flush=True)
        del layouts, copies
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
