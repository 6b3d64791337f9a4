"""The INT8-X planes layout's torch backend on the CPU -> benchmarks/results/int8x_cpu.json.

The torch backend decodes the whole weight on every call (the layout stays resident, as on the GPU). Timed here:
``decode_q`` (the serving decode: byte views and one permute) against ``unpack`` (the layout's description, word
and bit of every weight, records found by search: what the backend ran before), and the op at M = 1 against a
dense fp32 ``F.linear`` on the same weight, each the median of ``--runs`` calls in this process, on the seed's
level mix and on round(N(0, 2.5^2)), at SmolLM2-135M's MLP shapes and a 4096 x 4096 one.

    .venv/bin/python benchmarks/int8x_cpu.py [--runs 7] [--out benchmarks/results/int8x_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vllm_parity.fixtures.weights import gaussian, seed_mix  # noqa: E402
from vllm_parity.serving import int8x_planes as pl  # noqa: E402

SHAPES = [(1536, 576), (576, 1536), (4096, 4096)]  # (N, K): SmolLM2-135M's up / down, a 7B-like square


def median_ms(fn, runs: int) -> float:
    fn()  # warm
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "int8x_cpu.json"))
    args = ap.parse_args(argv)
    rows = []
    for n, k in SHAPES:
        for dist in ("seed-mix", "gaussian-2.5"):
            q = seed_mix(n, k, seed=5) if dist == "seed-mix" else gaussian(n, k, 2.5, seed=5)
            lay = pl.pack(q, torch.tensor([0.01]))
            if not torch.equal(pl.decode_q(lay), q):
                raise SystemExit(f"decode_q is not lossless on {dist} ({n}, {k})")
            x = torch.randn(1, k)
            w = q.float() * 0.01
            unpack = median_ms(lambda: pl.unpack(lay), args.runs)
            decode = median_ms(lambda: pl.decode_q(lay), args.runs)
            op = median_ms(lambda: pl.linear(x, lay, backend="torch"), args.runs)
            dense = median_ms(lambda: F.linear(x, w), args.runs)
            row = dict(N=n, K=k, dist=dist, fixups=lay.fixups, bits_per_weight=round(lay.bits_per_weight, 3),
                       unpack_ms=round(unpack, 3), decode_q_ms=round(decode, 3),
                       decode_speedup=round(unpack / decode, 2), op_m1_ms=round(op, 3),
                       dense_fp32_m1_ms=round(dense, 4), op_vs_dense=round(op / dense, 1))
            rows.append(row)
            print(f"  ({n:5d}, {k:5d}) {dist:12s} unpack {unpack:8.2f} ms  decode_q {decode:7.2f} ms "
                  f"(x{unpack / decode:.1f})  op M=1 {op:7.2f} ms  dense {dense:.3f} ms", flush=True)
    out = dict(env=dict(machine=platform.machine(), processor=platform.processor(), torch=torch.__version__,
                        threads=torch.get_num_threads(), runs=args.runs,
                        method="median of --runs calls after one warm call, one process"), rows=rows)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
