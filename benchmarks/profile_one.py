"""Run one ternary kernel a few times on a target shape, for a profiler (ncu) to attach to.

    ncu --clock-control none -k regex:mma_kernel -c 1 python3 benchmarks/profile_one.py cuda_mma 4096 14336 1

A fifth argument, a JSON object, sets the tensor-core kernel's configuration (``vllm_parity.serving.ternary_cuda.mma_config``).
"""

from __future__ import annotations

import json
import sys

import torch

from vllm_parity.reference.formats.ternary import PRESETS, pack_values
from vllm_parity.serving import ternary_cuda, ternary_ops
from vllm_parity.serving.ternary_repack import repack


def main(argv: list[str]) -> int:
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
