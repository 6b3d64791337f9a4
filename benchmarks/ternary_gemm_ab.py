"""The ternary GEMM's two kernels against each other, the dense weight from the tiles + cuBLAS and torch fp16, in
one process: the two target shapes (or ``--shapes``) at 32 .. 1024 tokens, each a CUDA-graph median with the weights
rotated.

    python3 benchmarks/ternary_gemm_ab.py --out benchmarks/results/ternary_gemm_ws_ab.json

Per row: torch fp16, the register-A kernel at its own launch (``gemm``), the dense path (``dense_tiles``), every
compiled instance of the warp-specialized kernel (``ws``, split 1, 2, 4) with its largest error relative to the
register-A kernel's output, and the launch the op chooses now (``default``). Compute capability 9.0 only.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernels import copy_bandwidth, graph_us, rotated, ternary_weights  # noqa: E402

from vllm_parity.reference.formats.ternary import PRESETS  # noqa: E402
from vllm_parity.serving import ternary_cuda, ternary_ops  # noqa: E402

SHAPES = ((4096, 14336), (14336, 4096))  # (K, N)
MS = (32, 64, 128, 256, 384, 512, 1024)


def shape_rows(k: int, n: int, ms) -> list[dict]:
    base = ternary_weights(k, n, PRESETS["seed-article"], seed=1)
    natives, next_native, fp16s, next_fp16 = rotated(base)
    rows = []
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.float16)

        def gemm(cfg):
            def fn():
                nat = next_native()
                return ternary_cuda.linear_gemm(x, nat.tiles, nat.scale, None, nat.n, nat.k, 0, False, config=cfg)
            return fn

        def dense():
            nat = next_native()
            return ternary_ops.tiles_linear(x, nat.tiles, nat.scale, None, nat.n, nat.k, 0, False,
                                            kernel="cuda_dequant_tiles")

        reg_a = ternary_cuda.gemm_config(m, n, k, 0, ws=False)
        r = dict(K=k, N=n, M=m, fp16_us=graph_us(lambda: F.linear(x, next_fp16()), len(fp16s)), gemm=reg_a,
                 gemm_us=graph_us(gemm(reg_a), len(natives), reps=7),
                 dense_tiles_us=graph_us(dense, len(natives), reps=7))
        ref = ternary_cuda.linear_gemm(x, base.tiles, base.scale, None, n, k, 0, False, config=reg_a).float()
        r["ws"] = []
        for (bn, wg, stages), split in itertools.product(ternary_cuda.GEMM_WS_INSTANCES, (1, 2, 4)):
            cfg = dict(bn=bn, wg=wg, stages=stages, split=split, ws=True)
            out = ternary_cuda.linear_gemm(x, base.tiles, base.scale, None, n, k, 0, False, config=cfg).float()
            err = ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
            r["ws"].append(dict(cfg=cfg, us=graph_us(gemm(cfg), len(natives), reps=7), rel_err=err))
        r["default"] = ternary_cuda.gemm_config(m, n, k, 0)
        r["default_us"] = next((w["us"] for w in r["ws"] if w["cfg"] == r["default"]), r["gemm_us"])
        best = min(r["ws"], key=lambda w: w["us"])
        r["ws_best"] = best
        print(f"{k:5d}x{n:5d} M={m:4d} fp16 {r['fp16_us']:7.2f} gemm {r['gemm_us']:7.2f} dense "
              f"{r['dense_tiles_us']:7.2f} ws best {best['us']:7.2f} {best['cfg']} default {r['default_us']:7.2f} "
              f"(x{r['fp16_us'] / r['default_us']:.2f} fp16) max err {max(w['rel_err'] for w in r['ws']):.1e}",
              flush=True)
        rows.append(r)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="ternary_gemm_ab.json", help="JSON results")
    ap.add_argument("--ms", default=",".join(map(str, MS)), help="token counts, comma-separated")
    ap.add_argument("--shapes", default=",".join(f"{k}x{n}" for k, n in SHAPES), help="K x N, comma-separated")
    args = ap.parse_args(argv)
    if not ternary_cuda.gemm_supported():
        print("the ternary GEMM needs a GPU of compute capability 9.0 and nvcc", file=sys.stderr)
        return 2
    ternary_cuda.ops()
    ms = [int(v) for v in args.ms.split(",")]
    result = dict(copy_gbps=copy_bandwidth(), device=torch.cuda.get_device_name(0), rows=[])
    for shape in args.shapes.split(","):
        k, n = map(int, shape.split("x"))
        result["rows"] += shape_rows(k, n, ms)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
