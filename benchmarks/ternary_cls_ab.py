"""The tensor-core kernel at one token on offset-binary tiles (``ternary_cls.cu``) against the op's kernel on its
tiles, torch fp16 and the read of the same bytes, in one process, seed layout, fp16, weights rotated.

The layout keeps the op's tile (16 rows x 128 inputs, a uint4 a lane) but stores u = w + 1 in each field, at the
bits where the A register of its step reads it: 9 instructions decode a word's 16 weights against the op's 15.
Its outputs are checked against the op's before any timing.

    python3 benchmarks/ternary_cls_ab.py --out benchmarks/results/ternary_cls_ab_h200.json
    python3 benchmarks/ternary_cls_ab.py --emulate      (CPU: the layout and the kernel's arithmetic in torch)

Runs on a CUDA GPU with nvcc, except ``--emulate``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

SHAPES = ((4096, 14336), (14336, 4096), (4096, 4096), (11008, 4096), (4096, 11008))


def _cls_index():
    """(row, input, bit) of every field of a tile, indexed (lane, word, step, half)."""
    lane, j, s, h = torch.meshgrid(torch.arange(32), torch.arange(4), torch.arange(8), torch.arange(2), indexing="ij")
    g, t = lane // 4, lane % 4
    return g + 8 * (j % 2), 16 * s + 4 * t + h + 2 * (j // 2), 2 * s + 16 * h


def pack_cls(values: torch.Tensor) -> torch.Tensor:
    """Ternary values (N, K), N a multiple of 16 and K of 128 -> int32 tiles (N/16, K/128, 32, 4), fields u = w + 1."""
    n, k = values.shape
    u = (values.to(torch.int64) + 1).reshape(n // 16, 16, k // 128, 128)
    row, col, bit = (i.to(values.device) for i in _cls_index())
    picked = u[:, row, :, col]  # (32, 4, 8, 2, NT, KC)
    words = (picked << bit[..., None, None]).sum(dim=(2, 3)).permute(2, 3, 0, 1)
    return (words - ((words >> 31) << 32)).to(torch.int32).contiguous()


def emulate(tiles: torch.Tensor, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The kernel's arithmetic in fp64 on the CPU: each step's A registers as the fp16 values of the masked words,
    its x in column s, the columns scaled back and sum(x) taken off."""
    nt, kc = tiles.shape[:2]
    words = tiles.to(torch.int64) & 0xFFFFFFFF  # (NT, KC, 32, 4)
    lane = torch.arange(32)
    g, t = lane // 4, lane % 4
    y = torch.zeros(nt * 16, dtype=torch.float64)
    for s in range(8):
        src = words if s < 6 else words >> 12
        masked = src & (0x00030003 << (2 * (s % 6)))
        halves = torch.stack([masked & 0xFFFF, masked >> 16], -1).to(torch.int16)  # int16 holds 0..0x0C00
        a_vals = halves.view(torch.float16).to(torch.float64)  # (NT, KC, 32, 4, 2)
        # A[row][kk]: word j of lane (g, t): row g + 8 (j % 2), kk 2 t + h + 8 (j // 2)
        a = torch.zeros(nt, kc, 16, 16, dtype=torch.float64)
        for j in range(4):
            for h in range(2):
                a[:, :, g + 8 * (j % 2), 2 * t + h + 8 * (j // 2)] = a_vals[:, :, :, j, h]
        # B[kk] of column s: x at 128 c + 16 s + 4 t + e (kk = 2 t + e), + 2 (kk = 2 t + 8 + e)
        xs = x.to(torch.float64).reshape(kc, 8, 4, 4)[:, s]  # (KC, t, 4)
        b = torch.cat([xs[:, :, 0:2].reshape(kc, 8), xs[:, :, 2:4].reshape(kc, 8)], 1)  # kk order
        d = torch.einsum("nckq,cq->nk", a, b)  # column s
        y += d.reshape(-1) * 2.0 ** (24 - 2 * (s % 6))
    return ((y - x.to(torch.float64).sum()) * scale.to(torch.float64)).to(torch.float32)


def check_emulation() -> int:
    gen = torch.Generator().manual_seed(0)
    for n, k in ((16, 128), (48, 384)):
        values = torch.randint(-1, 2, (n, k), generator=gen)
        x = torch.randn(k, generator=gen).to(torch.float16)
        scale = torch.rand(n, generator=gen) + 0.5
        want = (values.to(torch.float64) @ x.to(torch.float64)) * scale.to(torch.float64)
        got = emulate(pack_cls(values), x, scale)
        err = (got.double() - want).abs().max().item()
        print(f"emulated {n}x{k}: max |err| {err:.3e}")
        if err > 1e-4:
            return 1
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/ternary_cls_ab.json")
    ap.add_argument("--emulate", action="store_true")
    ap.add_argument("--build-only", action="store_true", help="build the kernel and stop")
    args = ap.parse_args(argv)
    if args.emulate:
        return check_emulation()

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from kernels import graph_us, read_floor_rows, rotating, spec_of, ternary_weights  # noqa: E402

    from vllm_parity.serving import ternary_cuda
    from vllm_parity.serving.cuda_build import LazyExtension
    from vllm_parity.serving.ternary_repack import unpack_tiles

    mod = LazyExtension("ternary_cls_ab", os.path.join(os.path.dirname(os.path.abspath(__file__)), "ternary_cls.cu"),
                        "the offset-binary tile kernels")()
    if args.build_only:
        return 0
    floor = read_floor_rows()
    print(f"read of the tiles {floor[0]['median_us']:.2f} us", flush=True)
    rows = []
    for k, n in SHAPES:
        base = ternary_weights(k, n, spec_of("seed-article"), seed=k * 7 + n)
        values = unpack_tiles(base.tiles, n, k)
        cls = pack_cls(values)
        scale = base.scale.reshape(-1).float().contiguous()
        x = torch.randn(1, k, device="cuda", dtype=torch.float16)
        cfg = ternary_cuda._fit_instance(ternary_cuda.mma_config(1, n, k), 0)
        op_y = ternary_cuda.linear_mma(x, base.tiles, base.scale, None, n, k, 0, False, config=cfg)
        want = (x.double() @ (values.double() * scale.double()[:, None]).T)
        variants = [(cfg["tn"], cfg["loads"])] + [(tn, ld) for tn in (1, 2, 4) for ld in (4, 8)
                                                   if (tn, ld) != (cfg["tn"], cfg["loads"])]
        for tn, ld in variants:
            y = mod.cls_linear(x, cls, scale, n, k, tn, cfg["warps"], ld, cfg["pdl"])
            err = (y.double() - want).abs().max().item()
            op_err = (op_y.double() - want).abs().max().item()
            if err > 4 * op_err + 1e-2:
                raise SystemExit(f"{k}x{n} tn={tn} loads={ld}: max |err| {err:.3e} against the op's {op_err:.3e}")
        tiles_copies, next_tiles = rotating(lambda: base.tiles.clone(), base.tiles.numel() * 4)
        cls_copies, next_cls = rotating(lambda: cls.clone(), cls.numel() * 4)
        wf = torch.randn(n, k, device="cuda", dtype=torch.float16) * 0.02
        dense, next_dense = rotating(lambda: wf.clone(), wf.numel() * 2, cap=32)
        fp16 = graph_us(lambda: F.linear(x, next_dense()), len(dense))
        op = graph_us(lambda: ternary_cuda.linear_mma(x, next_tiles(), base.scale, None, n, k, 0, False, config=cfg),
                      len(tiles_copies))
        row = dict(K=k, N=n, M=1, config=cfg, fp16_us=round(fp16, 3), op_us=round(op, 3),
                   op_speedup=round(fp16 / op, 3), err=err, op_err=op_err)
        for tn, ld in variants:
            us = graph_us(lambda: mod.cls_linear(x, next_cls(), scale, n, k, tn, cfg["warps"], ld, cfg["pdl"]),
                          len(cls_copies))
            row[f"cls_tn{tn}_l{ld}_us"] = round(us, 3)
        best = min(v for key, v in row.items() if key.startswith("cls_"))
        row.update(cls_best_us=best, cls_best_speedup=round(fp16 / best, 3), cls_vs_op=round(op / best, 3))
        print("  ".join(f"{key} {val}" for key, val in row.items()), flush=True)
        rows.append(row)
        del tiles_copies, cls_copies, dense
    with open(args.out, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(0), floor=floor, rows=rows), f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
