"""Where the tensor-core kernel's time goes at small M: ``csrc/ternary.cu`` built as it is and with a part taken out,
timed in one process against the op, torch fp16 and the read of the same tiles, seed layout, at the op's own launch.

- ``no_decode``: the A registers are the loaded words themselves (no shift and AND): loads, MMAs and loop only;
- ``no_mma``: each MMA replaced by an XOR of its registers into the accumulator (the decode and the loads kept);
- ``loads_only``: both, which leaves the weight and x loads, the loop and the epilogue;
- ``decode9``: each register of step s is pair s of the lane's four words under a mask, in place (pairs 0-5) or
  after one shift of the word by 12 (pairs 6, 7): 9 instructions a word against 15, the decode of a layout whose
  fields are offset binary (w + 1) at each pair's own bits, read as fp16 subnormals u 2^(2 s - 24) (u 2^-14 at
  bits 10-11), each pair's scale its own class;
- ``decode9_sel``: ``decode9`` with step s's x kept in the lanes of column s only (a select a B register), which
  is where such a kernel at one token keeps each class's sums apart (column s of the accumulator).

Outputs of the variants are not products; only their times are used.

    python3 benchmarks/ternary_mma_parts.py --out benchmarks/results/ternary_mma_parts_h200.json

Runs on a CUDA GPU with nvcc.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernels import graph_us, read_floor_rows, rotated, spec_of, ternary_weights  # noqa: E402
from ternary_group_ab import without_op_registrations  # noqa: E402

from vllm_parity.serving import ternary_cuda  # noqa: E402
from vllm_parity.serving.cuda_build import CSRC, LazyExtension  # noqa: E402

DECODE = "parity::tile_a(wq[i][0], s, a0, a1, a2, a3);"
RAW = "a0 = wq[i][0].x; a1 = wq[i][0].y; a2 = wq[i][0].z; a3 = wq[i][0].w;"
DECODE9 = ((DECODE, "{ const uint4& q = wq[i][0]; const int sh = s < 6 ? 0 : 12; "
                     "const uint32_t mask = 0x00030003u << (2 * (s % 6)); a0 = (q.x >> sh) & mask; "
                     "a1 = (q.y >> sh) & mask; a2 = (q.z >> sh) & mask; a3 = (q.w >> sh) & mask; }"),)
B = "const uint32_t b0 = (s & 1) ? q.z : q.x, b1 = (s & 1) ? q.w : q.y;"
B_SEL = ("const bool own = ((threadIdx.x & 31) >> 2) == s; "
         "const uint32_t b0 = own ? ((s & 1) ? q.z : q.x) : 0u, b1 = own ? ((s & 1) ? q.w : q.y) : 0u;")
MMA = "MmaOp<T>::run(acc[i][mb], a0, a1, a2, a3, b0, b1);"
FOLD = ("acc[i][mb][0] = __int_as_float(__float_as_int(acc[i][mb][0]) ^ a0 ^ a1 ^ b0); "
        "acc[i][mb][1] = __int_as_float(__float_as_int(acc[i][mb][1]) ^ a2 ^ a3 ^ b1);")
VARIANTS = {"no_decode": ((DECODE, RAW),), "no_mma": ((MMA, FOLD),), "loads_only": ((DECODE, RAW), (MMA, FOLD)),
            "decode9": DECODE9, "decode9_sel": DECODE9 + ((B, B_SEL),)}


def variant_source(source: str, edits) -> str:
    for old, new in edits:
        if source.count(old) != 1:
            raise SystemExit(f"csrc/ternary.cu: expected one {old!r}, found {source.count(old)}")
        source = source.replace(old, new)
    return without_op_registrations(source)


def build(name: str, edits):
    """The variant as a module; its source kept at one path (rewritten only when it changes), so that torch's
    extension cache serves a second run."""
    path = os.path.join(tempfile.gettempdir(), "vllm_parity_parts", f"ternary_{name}.cu")
    source = variant_source((CSRC / "ternary.cu").read_text(), edits)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if not os.path.exists(path) or open(path).read() != source:
        with open(path, "w") as f:
            f.write(source)
    return LazyExtension(f"ternary_part_{name}", path, f"ternary.cu, {name}")()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/ternary_mma_parts.json")
    ap.add_argument("--ms", default="1,16")
    ap.add_argument("--build-only", action="store_true", help="build the variants (in parallel) and stop")
    args = ap.parse_args(argv)
    with ThreadPoolExecutor(len(VARIANTS)) as pool:  # each build is its own nvcc process
        mods = dict(zip(VARIANTS, pool.map(lambda item: build(*item), VARIANTS.items())))
    if args.build_only:
        return 0
    ternary_cuda.extension()
    floor = read_floor_rows()
    print(f"read of the tiles {floor[0]['median_us']:.2f} us", flush=True)
    rows = []
    for k, n in ((4096, 14336), (14336, 4096)):
        base = ternary_weights(k, n, spec_of("seed-article"), seed=1)
        natives, next_native, fp16s, next_fp16 = rotated(base)
        for m in (int(v) for v in args.ms.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.float16)
            cfg = ternary_cuda._fit_instance(ternary_cuda.mma_config(m, n, k), 0)
            fp16 = graph_us(lambda: F.linear(x, next_fp16()), len(fp16s))
            op = graph_us(lambda: ternary_cuda.linear_mma(x, next_native().tiles, base.scale, None, n, k, 0, False,
                                                          config=cfg), len(natives))
            row = dict(K=k, N=n, M=m, config=cfg, fp16_us=round(fp16, 3), op_us=round(op, 3),
                       read_us=floor[0]["median_us"])
            for name, mod in mods.items():
                us = graph_us(lambda: mod.ternary_linear_mma(x, next_native().tiles, base.scale, None, n, k, 0, False,
                                                             cfg["tn"], cfg["mb"], cfg["warps"], cfg["loads"],
                                                             cfg["pdl"]), len(natives))
                row[f"{name}_us"] = round(us, 3)
            print("  ".join(f"{key} {val}" for key, val in row.items()), flush=True)
            rows.append(row)
        del natives, fp16s
    with open(args.out, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(0), floor=floor, rows=rows), f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
