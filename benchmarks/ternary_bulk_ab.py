"""The bulk kernel (``ternary_linear_bulk``: each block's run of row tiles streamed into shared memory by bulk
copies) against the tensor-core kernel at the op's launch, torch fp16 beside, in one process; seed layout and 128-group scales, M <= 8.
Checks its outputs against the op's first (fp16 and bf16, ragged shapes, bias, activation quantization, a ring
that wraps), then times every launch given.

    python3 benchmarks/ternary_bulk_ab.py --out benchmarks/results/ternary_bulk_ab_h200.json

Runs on a CUDA GPU of compute capability 9 with nvcc.
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
from kernels import graph_us, read_floor_rows, rotated, spec_of, ternary_weights  # noqa: E402

from vllm_parity.serving import ternary_cuda  # noqa: E402

SHAPES = ((4096, 14336), (14336, 4096), (4096, 12288), (4096, 22016), (11008, 4096), (4096, 4096), (2048, 2048),
          (5632, 2048), (2048, 5632))
CHECKS = ((4096, 14336), (14336, 4096), (1000, 100), (2048, 2080), (256, 16), (384, 40), (8192, 1024))


def bulk(x, native, cfg, bias=None, act_quant=False):
    return ternary_cuda.linear_bulk(x, native.tiles, native.scale, bias, native.n, native.k, native.group_size,
                                    act_quant, **cfg)


def op(x, native, bias=None, act_quant=False):
    """The tensor-core kernel at the op's launch (``mma_config``)."""
    return ternary_cuda.linear_mma(x, native.tiles, native.scale, bias, native.n, native.k, native.group_size,
                                   act_quant)


def check(shapes=CHECKS) -> list[dict]:
    """Each case's largest difference from the op, relative to the op's largest output."""
    out = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for (k, n), dtype, spec in itertools.product(shapes, (torch.float16, torch.bfloat16), ("seed-article", "group-128")):
        if spec != "seed-article" and k % 128:
            continue
        native = ternary_weights(k, n, spec_of(spec), seed=k + n)
        bias = torch.randn(n, device="cuda", dtype=dtype)
        for m, warps, blocks, slots, with_bias, act in ((1, 16, 0, 0, False, False), (2, 8, 0, 0, True, False),
                                                        (3, 16, 0, 2, False, False), (5, 8, 2 * sms, 1, True, False),
                                                        (8, 16, 64, 3, False, False), (1, 8, 0, 0, True, True),
                                                        (8, 16, 0, 0, True, True)):
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            b = bias if with_bias else None
            got = bulk(x, native, dict(warps=warps, blocks=blocks, slots=slots), b, act)
            want = op(x, native, b, act)
            err = ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-6)).item()
            ok = err < (2e-3 if dtype == torch.float16 else 1.6e-2) and bool(torch.isfinite(got).all())
            out.append(dict(K=k, N=n, M=m, spec=spec, dtype=str(dtype), warps=warps, blocks=blocks, slots=slots, bias=with_bias,
                            act_quant=act, rel_err=err, ok=ok))
            if not ok:
                print("MISMATCH", out[-1], flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/ternary_bulk_ab.json")
    ap.add_argument("--ms", default="1,2,4,8")
    ap.add_argument("--warps", default="8,16")
    ap.add_argument("--blocks", default="0", help="grid sizes (0: one block a multiprocessor)")
    ap.add_argument("--slots", default="0", help="ring stages (0: the block's whole run where it fits)")
    ap.add_argument("--shapes", type=int, default=len(SHAPES), help="the first this many shapes")
    ap.add_argument("--group-ms", default="1", help="token counts timed with 128-group scales (target shapes)")
    ap.add_argument("--checks", type=int, default=len(CHECKS), help="check the first this many shapes")
    ap.add_argument("--no-floor", action="store_true", help="skip the read of the tiles")
    args = ap.parse_args(argv)
    checks = check(CHECKS[:args.checks])
    print(f"checks: {sum(c['ok'] for c in checks)} of {len(checks)} within tolerance", flush=True)
    floor = [] if args.no_floor else read_floor_rows()
    if floor:
        print(f"read of the tiles {floor[0]['median_us']:.2f} us", flush=True)
    cfgs = [dict(warps=int(w), blocks=int(b), slots=int(s)) for w, b, s in
            itertools.product(args.warps.split(","), args.blocks.split(","), args.slots.split(","))]
    rows = []
    runs = [(k, n, "seed-article", args.ms) for k, n in SHAPES[:args.shapes]]
    runs += [(k, n, "group-128", args.group_ms) for k, n in SHAPES[:2] if args.group_ms]
    for k, n, spec, ms in runs:
        base = ternary_weights(k, n, spec_of(spec), seed=1)
        natives, next_native, fp16s, next_fp16 = rotated(base)
        for m in (int(v) for v in ms.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.float16)
            fp16 = graph_us(lambda: F.linear(x, next_fp16()), len(fp16s))
            mma = graph_us(lambda: op(x, next_native()), len(natives))
            row = dict(K=k, N=n, M=m, spec=spec, fp16_us=round(fp16, 3), op_us=round(mma, 3), op_speedup=round(fp16 / mma, 3),
                       bulk=[])
            for cfg in cfgs:
                try:
                    us = graph_us(lambda: bulk(x, next_native(), cfg), len(natives))
                except RuntimeError as e:
                    row["bulk"].append(dict(cfg, error=str(e).splitlines()[0]))
                    continue
                row["bulk"].append(dict(cfg, us=round(us, 3), speedup=round(fp16 / us, 3), vs_op=round(mma / us, 3)))
            best = min((b for b in row["bulk"] if "us" in b), key=lambda b: b["us"], default=None)
            print(f"{spec} K={k} N={n} M={m} fp16 {fp16:.2f} op {mma:.2f} ({fp16 / mma:.2f}x)"
                  + (f" bulk best {best['us']:.2f} ({best['speedup']:.2f}x, {best['vs_op']:.2f}x op) {best}"
                     if best else " bulk: none ran"), flush=True)
            rows.append(row)
            with open(args.out, "w") as f:  # after every row: a run cut short keeps what it measured
                json.dump(dict(device=torch.cuda.get_device_name(0), floor=floor, checks=checks, rows=rows), f,
                          indent=1)
        del natives, fp16s
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
