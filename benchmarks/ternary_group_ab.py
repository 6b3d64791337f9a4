"""The tensor-core kernel with group scales as an earlier revision built it against the kernel now, in one process:
the revision's ``csrc/ternary.cu`` built beside the installed extension, timed at the launch it chose (the rule
without the group size) and at the launch chosen now, the op now at its launch, torch fp16 beside; outputs compared
bit for bit where the launches match.

    python3 benchmarks/ternary_group_ab.py --rev 080bc62 --out benchmarks/results/ternary_group_ab.json

Runs in a git checkout (the revision's source comes from ``git show``) on a CUDA GPU with nvcc.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernels import graph_us, rotated, spec_of, ternary_weights  # noqa: E402

from vllm_parity.serving import ternary_cuda  # noqa: E402
from vllm_parity.serving.cuda_build import LazyExtension, available  # noqa: E402

SHAPES = ((4096, 14336), (14336, 4096))  # (K, N)


def without_op_registrations(source: str) -> str:
    """ternary.cu with its TORCH_LIBRARY blocks compiled out (the installed extension holds those op names); its
    pybind functions stay."""
    return re.sub(r"(TORCH_LIBRARY(?:_IMPL)?\(parity_ternary[^\n]*\n(?:.*\n)*?\}\n)", r"#if 0\n\1#endif\n", source)


def build_revision(rev: str):
    """The revision's ternary.cu as a Python module of its pybind functions."""
    source = subprocess.run(["git", "show", f"{rev}:kernels/csrc/ternary.cu"], check=True, capture_output=True,
                            text=True).stdout
    path = os.path.join(tempfile.mkdtemp(), "ternary_rev.cu")
    with open(path, "w") as f:
        f.write(without_op_registrations(source))
    return LazyExtension(f"ternary_rev_{re.sub(r'[^0-9A-Za-z]', '_', rev)}", path, f"ternary.cu of {rev}")()


def shape_rows(before, k: int, n: int, group: int, ms) -> list[dict]:
    base = ternary_weights(k, n, spec_of(f"group-{group}" if group else "seed-article"), seed=1)
    natives, next_native, fp16s, next_fp16 = rotated(base)
    rows = []
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.float16)
        fp16 = graph_us(lambda: F.linear(x, next_fp16()), len(fp16s))
        new_cfg = ternary_cuda._fit_instance(ternary_cuda.mma_config(m, n, k, group_size=group), group)
        old_cfg = ternary_cuda._fit_instance(ternary_cuda.mma_config(m, n, k), group)

        def run_old(cfg, nat):
            return before.ternary_linear_mma(x, nat.tiles, nat.scale, None, n, k, group, False, cfg["tn"], cfg["mb"],
                                             cfg["warps"], cfg["loads"], cfg["pdl"])

        def run_new(cfg, nat):
            return ternary_cuda.linear_mma(x, nat.tiles, nat.scale, None, n, k, group, False, config=cfg)

        row = dict(K=k, N=n, M=m, group=group, fp16_us=fp16, old_cfg=old_cfg, new_cfg=new_cfg)
        ref = run_old(new_cfg, base).float()
        for name, fn, cfg in (("old", run_old, old_cfg), ("old_newcfg", run_old, new_cfg), ("new", run_new, new_cfg)):
            row[name + "_us"] = graph_us(lambda: fn(cfg, next_native()), len(natives))
            row[name + "_equal_to_old_at_same_cfg"] = (bool(torch.equal(fn(cfg, base).float(), ref))
                                                       if cfg == new_cfg else None)
        row.update(speedup_new_vs_old=row["old_us"] / row["new_us"], x_fp16_new=fp16 / row["new_us"],
                   x_fp16_old=fp16 / row["old_us"])
        rows.append(row)
        print(f"K={k:5d} N={n:5d} M={m:2d} g={group:3d} fp16 {fp16:6.2f} old {row['old_us']:6.2f} "
              f"old@new {row['old_newcfg_us']:6.2f} new {row['new_us']:6.2f} (x{row['x_fp16_new']:.2f} fp16, "
              f"{row['speedup_new_vs_old']:.2f}x old) equal {row['new_equal_to_old_at_same_cfg']} "
              f"cfg {old_cfg['tn']},{old_cfg['warps']} -> {new_cfg['tn']},{new_cfg['warps']}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rev", required=True, help="the git revision whose kernel is the baseline")
    ap.add_argument("--out", default="ternary_group_ab.json", help="JSON results")
    ap.add_argument("--ms", default="1,4,8,16", help="token counts with groups of 128, comma-separated")
    args = ap.parse_args(argv)
    if not available():
        print("the tensor-core kernel needs a CUDA GPU and nvcc", file=sys.stderr)
        return 2
    before = build_revision(args.rev)
    ternary_cuda.extension()
    ms = [int(v) for v in args.ms.split(",")]
    rows = []
    for (k, n), group in itertools.product(SHAPES, (128, 256, 0)):  # 256: groups of two chunks; 0: no groups
        rows += shape_rows(before, k, n, group, ms if group == 128 else [1])
    with open(args.out, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(0), rev=args.rev, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
