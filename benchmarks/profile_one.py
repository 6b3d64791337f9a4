"""Run one ternary kernel a few times on a target shape, for a profiler (ncu) to attach to.

    ncu --clock-control none -k regex:mma_kernel -c 1 python3 benchmarks/profile_one.py cuda_mma 4096 14336 1

A fifth argument, a JSON object, sets the tensor-core kernel's configuration (``vllm_parity.serving.ternary_cuda.mma_config``).

The int8x planes GEMV (kernels/int8x_planes_cuda.py) on the seed mix, bf16 x, three calls (skip two: the first
builds nothing but may touch cold memory):

    ncu --set full -k regex:linear_kernel --launch-skip 2 --launch-count 1 \
        python3 benchmarks/profile_one.py planes --m 1 [--k 4096 --n 14336 --dist seed-mix --config 8,1]
        [--cache /tmp/planes.safetensors]
"""

from __future__ import annotations

import json
import os
import sys

import safetensors
import safetensors.torch
import torch

from vllm_parity.reference.formats.ternary import PRESETS, pack_values
from vllm_parity.serving import ternary_cuda, ternary_ops
from vllm_parity.serving.ternary_repack import repack


def planes(argv: list[str]) -> int:
    import argparse

    from vllm_parity.fixtures.weights import DISTS, by_name
    from vllm_parity.serving import int8x_planes, int8x_planes_cuda

    ap = argparse.ArgumentParser(prog="profile_one.py planes")
    ap.add_argument("--m", type=int, default=1)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--n", type=int, default=14336)
    ap.add_argument("--dist", choices=DISTS, default="seed-mix",
                    help="the weights: the seed's level mix, a real model's, or round(N(0, 2.5^2))")
    ap.add_argument("--config", default=None, help="warps,tiles_per_cta[,stages[,splits]] (default: the kernel's choice)")
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--cache", default=None, help="a file for the packed layout: read if there, else written")
    args = ap.parse_args(argv)
    if args.cache and os.path.exists(args.cache):  # safetensors: the layout's tensors, n and k in the metadata
        with safetensors.safe_open(args.cache, "pt") as f:
            meta = f.metadata()
            layout = int8x_planes.Int8xPlanes(**{name: f.get_tensor(name) for name in int8x_planes.TENSORS},
                                              n=int(meta["n"]), k=int(meta["k"]))
        if (layout.n, layout.k) != (args.n, args.k):
            raise SystemExit(f"{args.cache} holds a ({layout.n}, {layout.k}) weight, not ({args.n}, {args.k})")
    else:  # the seed mix takes tens of seconds on the host
        q = by_name(args.dist, args.n, args.k, seed=3)
        layout = int8x_planes.pack(q, torch.tensor([0.01]))
        if args.cache:
            safetensors.torch.save_file(dict(zip(int8x_planes.TENSORS, layout.tensors)), args.cache,
                                        metadata={"n": str(layout.n), "k": str(layout.k)})
    layout = layout.to("cuda")
    config = tuple(int(v) for v in args.config.split(",")) if args.config else None
    x = torch.randn(args.m, args.k, device="cuda", dtype=torch.bfloat16)
    int8x_planes_cuda.extension()  # built (or loaded) before the profiled calls
    for _ in range(args.calls):
        int8x_planes_cuda.linear(x, layout, config=config)
    torch.cuda.synchronize()
    return 0


def main(argv: list[str]) -> int:
    if argv and argv[0] == "planes":
        return planes(argv[1:])
    kernel, k, n, m = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    spec = PRESETS["seed-article"]
    values = torch.randint(-1, 2, (n, k), generator=torch.Generator().manual_seed(0))
    nat = repack(pack_values(values, spec).cuda(), torch.rand(n).cuda() + 0.5, spec, n, k).with_tiles()
    x = torch.randn(m, k, device="cuda", dtype=torch.float16)
    config = json.loads(argv[4]) if len(argv) > 4 else None
    for _ in range(3):
        if config is not None:
            ternary_cuda.linear_mma(x, nat.tiles, nat.scale, None, n, k, nat.group_size, nat.act_quant, config=config)
        else:
            ternary_ops.ternary_linear_op(x, nat.qweight, nat.scale, None, k, nat.group_size, nat.act_quant, kernel,
                                          nat.tiles)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
