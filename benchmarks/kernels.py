"""Ternary (and INT8-X) kernel benchmarks on a GPU -> benchmarks/results/kernels_h200.json.

Every time is per call inside a CUDA graph of back-to-back calls (median over replays), with the
weights rotated among copies that together exceed the L2 four times over; only the copy bandwidth
and the standalone INT8-X decode use ``triton.testing.do_bench`` (median, L2 flushed per call).
Each row carries its baseline, torch fp16 ``F.linear`` on the same (K, N, M), measured in the same
run, and the fraction of the device-to-device copy bandwidth measured at the start of the run.

    python3 benchmarks/kernels.py [--out PATH] [--quick] [--sweep]     (with the project installed)
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from vllm_parity.fixtures.weights import DISTS  # noqa: E402
from vllm_parity.reference.formats.ternary import PRESETS, TernarySpec  # noqa: E402
from vllm_parity.reference.formats.ternary import pack_values  # noqa: E402
from vllm_parity.serving import choose, ternary_ops, ternary_triton  # noqa: E402
from vllm_parity.serving.ternary_repack import repack  # noqa: E402

SHAPES = [(2048, 2048), (2048, 5632), (5632, 2048), (4096, 4096), (4096, 14336), (14336, 4096)]  # (K, N)
MS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
ROTATE_BYTES = 256 << 20  # weights rotated over at least this much memory (the H200's L2 is 60 MB)


def median_us(fn, rep_ms: int = 100) -> float:
    return do_bench(fn, warmup=25, rep=rep_ms, return_mode="median") * 1e3


def graph_us(fn, calls: int, reps: int = 15) -> float:
    """Median time of one call inside a CUDA graph of ``calls`` back-to-back calls.

    Graphs remove the host's launch cost (tens of microseconds through Python, more than the
    kernels themselves at small M), as vLLM's decode does; ``fn`` rotates the weight copies, so
    one replay streams every copy once.
    """
    fn()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    times.sort()
    return times[len(times) // 2]


def copy_bandwidth() -> float:
    """Device-to-device copy of 2 GiB, bytes read plus written per second (GB/s)."""
    src = torch.empty(1 << 30, dtype=torch.float16, device="cuda").uniform_()
    dst = torch.empty_like(src)
    us = median_us(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / us / 1e3


def rotating(make, nbytes: int, cap: int = 64):
    copies = [make() for _ in range(max(8, min(cap, math.ceil(ROTATE_BYTES / max(nbytes, 1)))))]
    state = itertools.cycle(copies)
    return copies, lambda: next(state)


def rotated(base, dtype: torch.dtype = torch.float16):
    """Copies of the ternary weight ``base`` and of a dense ``dtype`` weight of its shape, each with the function
    that hands out the next copy: a graph of calls then streams every copy once, from memory, not from L2."""
    natives, next_native = rotating(lambda: repack_copy(base), base.nbytes)
    wf = torch.randn(base.n, base.k, device="cuda", dtype=dtype) * 0.02
    dense, next_dense = rotating(lambda: wf.clone(), wf.numel() * wf.element_size(), cap=32)
    return natives, next_native, dense, next_dense


def ternary_weights(k: int, n: int, spec: TernarySpec, seed: int):
    gen = torch.Generator().manual_seed(seed)
    values = torch.randint(-1, 2, (n, k), generator=gen)
    scale = torch.rand(spec.scale_shape(n, k), generator=gen) + 0.5
    return repack(pack_values(values, spec).cuda(), scale.to(torch.float16).cuda(), spec, n, k).with_tiles()


def spec_of(name: str) -> TernarySpec:
    """A preset by name, or ``group-G``: scales of G inputs (the seed layout otherwise)."""
    if name.startswith("group-"):
        return TernarySpec(scale_granularity="group", group_size=int(name[6:]))
    return PRESETS[name]


def bench_shape(k: int, n: int, ms: list[int], kernels: list[str], copy_gbps: float, spec_name: str,
                dtype=torch.float16) -> list[dict]:
    spec = spec_of(spec_name)
    rows = []
    base = ternary_weights(k, n, spec, seed=k * 7 + n)
    # Bytes a kernel must read: the tensor-core kernel reads the tiled copy, the others the row layout.
    row_bytes = base.qweight.numel() * 4 + base.scale.numel() * 4
    tile_bytes = base.tiles.numel() * 4 + base.scale.numel() * 4
    natives, next_native, fp16_weights, next_fp16 = rotated(base, dtype)
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        io_bytes = (m * k + m * n) * x.element_size()
        base_us = graph_us(lambda: F.linear(x, next_fp16()), len(fp16_weights))
        for kernel in kernels:
            if kernel == "cuda_naive" and m > 2:
                continue
            if kernel in ("triton_gemv", "cuda_vec") and m > 16 or kernel in ("cuda_mma", "cuda_mma_rows") and m > 64:
                continue
            if kernel == "cuda_dequant" and (m < 16 or spec.activation_quant):
                continue
            if kernel == "cuda_gemm" and m < 16:
                continue
            if kernel in ("tiles_linear", "cuda_dequant_tiles") and m < 16:
                continue  # cuda_mma's own rows there (the same C++ kernel)
            fn = _kernel_fn(kernel, x, next_native)
            try:
                fn()
                torch.cuda.synchronize()
                us = graph_us(fn, len(natives), reps=5 if kernel == "cuda_naive" else 15)
            except Exception as exc:  # one kernel failing must not lose the others' numbers
                rows.append(dict(kernel=kernel, K=k, N=n, M=m, dtype=str(dtype), preset=spec_name,
                                 error=f"{type(exc).__name__}: {exc}"[:500]))
                print(f"  {kernel} K={k} N={n} M={m}: FAILED {exc}", file=sys.stderr)
                continue
            chosen = choose.ternary_kernel("auto", m, dtype, base.group_size, base.act_quant, tiled=True)
            if kernel in ("tiles_linear", "cuda_dequant_tiles"):
                chosen = choose.ternary_tiles_kernel(m, dtype, base.group_size, base.act_quant)
            nat_bytes = tile_bytes if (chosen if kernel in ("ternary", "tiles_linear") else kernel) in (
                "cuda_mma", "cuda_gemm", "cuda_dequant_tiles") else row_bytes  # cuda_mma_rows: the row layout
            gbps = (nat_bytes + io_bytes) / us / 1e3
            rows.append(dict(kernel=kernel, K=k, N=n, M=m, dtype=str(dtype).replace("torch.", ""),
                             preset=spec_name, median_us=round(us, 3), gbps=round(gbps, 1),
                             bw_frac=round(gbps / copy_gbps, 4), baseline="torch_fp16_linear",
                             baseline_us=round(base_us, 3), speedup=round(base_us / us, 3),
                             chosen=chosen))
            r = rows[-1]
            print(f"  {kernel:12s} K={k:5d} N={n:5d} M={m:3d} {us:9.2f} us {gbps:7.0f} GB/s "
                  f"({r['bw_frac']:.2f} of copy)  fp16 {base_us:9.2f} us  x{r['speedup']:.2f}", flush=True)
    del natives, fp16_weights
    return rows


def repack_copy(native):
    tiles = None if native.tiles is None else native.tiles.clone()
    return type(native)(qweight=native.qweight.clone(), scale=native.scale.clone(), n=native.n, k=native.k,
                        group_size=native.group_size, act_quant=native.act_quant, tiles=tiles)


def _kernel_fn(kernel: str, x: torch.Tensor, next_native):
    if kernel == "ternary":  # the public entry point with its default choice of kernel (backend auto)
        return lambda: ternary_ops.ternary_linear(x, next_native())
    if kernel == "cuda_mma_rows":  # the tensor-core kernel on the row layout (the C++ op, its own choice of launch)
        def rows_run():
            nat = next_native()
            return ternary_cuda_ops().mma_rows(x, nat.qweight, nat.scale, None, nat.n, nat.k, nat.group_size,
                                               nat.act_quant)
        return rows_run
    if kernel in ("tiles_linear", "cuda_dequant_tiles"):
        # The vLLM method's one resident copy: every M from the tiles alone (its choice, or one of its kernels).
        which = None if kernel == "tiles_linear" else kernel

        def tiles_run():
            nat = next_native()
            return ternary_ops.tiles_linear(x, nat.tiles, nat.scale, None, nat.n, nat.k, nat.group_size,
                                            nat.act_quant, kernel=which)
        return tiles_run

    def run():
        nat = next_native()
        return ternary_ops.ternary_linear_op(x, nat.qweight, nat.scale, None, nat.k, nat.group_size,
                                             nat.act_quant, kernel, nat.tiles)
    return run


def eager_us(fn, calls: int = 200, reps: int = 9) -> float:
    """Median per-call time of ``calls`` back-to-back calls without a CUDA graph (events around the batch):
    the larger of the host's cost per call (Python, dispatch, launch) and the device's."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    times.sort()
    return times[len(times) // 2]


def eager_rows(copy_gbps: float) -> list[dict]:
    """Goal 3: the M = 1 call outside a CUDA graph (eager decode, small batches) at the target shapes, against
    torch fp16 ``F.linear`` outside a graph; weights rotated as in the graph rows. ``ternary``: the public entry
    point (the C++ op ``parity_ternary.mma``, configuration chosen in C++); ``parity_ternary.mma``: that op
    called directly; ``python_op``: the Python custom op ``vllm_parity::ternary_linear`` with ``cuda_mma`` (the
    previous path: its config chosen in Python per call)."""
    rows = []
    for k, n in [(4096, 14336), (14336, 4096)]:
        base = ternary_weights(k, n, PRESETS["seed-article"], seed=k + n)
        natives, next_native, fp16_weights, next_fp16 = rotated(base)
        x = torch.randn(1, k, device="cuda", dtype=torch.float16)
        base_us = eager_us(lambda: F.linear(x, next_fp16()))
        mma = ternary_cuda_ops().mma

        def direct():
            nat = next_native()
            return mma(x, nat.tiles, nat.scale, None, nat.n, nat.k, nat.group_size, nat.act_quant)

        def python_op():
            nat = next_native()
            return ternary_ops.ternary_linear_op(x, nat.qweight, nat.scale, None, nat.k, nat.group_size,
                                                 nat.act_quant, "cuda_mma", nat.tiles)
        def tiles():
            nat = next_native()
            return ternary_ops.tiles_linear(x, nat.tiles, nat.scale, None, nat.n, nat.k, nat.group_size,
                                            nat.act_quant)
        mma_rows = ternary_cuda_ops().mma_rows

        def rows_direct():
            nat = next_native()
            return mma_rows(x, nat.qweight, nat.scale, None, nat.n, nat.k, nat.group_size, nat.act_quant)
        fns = [("ternary", lambda: ternary_ops.ternary_linear(x, next_native())), ("parity_ternary.mma", direct),
               ("parity_ternary.mma_rows", rows_direct), ("tiles_linear", tiles), ("python_op", python_op)]
        for name, fn in fns:
            us = eager_us(fn)
            rows.append(dict(kernel=name, mode="eager", K=k, N=n, M=1, dtype="float16", preset="seed-article",
                             median_us=round(us, 3), baseline="torch_fp16_linear_eager", baseline_us=round(base_us, 3),
                             speedup=round(base_us / us, 3)))
            print(f"  eager {name:20s} K={k:5d} N={n:5d} M=1 {us:8.2f} us  fp16 eager {base_us:8.2f} us  "
                  f"x{base_us / us:.2f}", flush=True)
        del natives, fp16_weights
    return rows


def ternary_cuda_ops():
    from vllm_parity.serving import ternary_cuda

    return ternary_cuda.ops()


def floor_rows() -> list[dict]:
    """Per-call time of near-empty work in the same graph harness: what every kernel pays at least."""
    from vllm_parity.serving import ternary_cuda

    rows = []
    small = torch.empty(16, device="cuda")
    rows.append(dict(kernel="zero_16_floats", median_us=round(graph_us(lambda: small.zero_(), 64), 3)))
    x = torch.randn(1, 128, device="cuda", dtype=torch.float16)
    w = torch.randn(16 * 264, 128, device="cuda", dtype=torch.float16)
    rows.append(dict(kernel="torch_fp16_linear_tiny", K=128, N=w.shape[0], M=1,
                     median_us=round(graph_us(lambda: F.linear(x, w), 64), 3)))
    if ternary_cuda.available():
        nat = ternary_weights(128, w.shape[0], PRESETS["seed-article"], seed=2)
        rows.append(dict(kernel="cuda_mma_tiny", K=128, N=w.shape[0], M=1, median_us=round(graph_us(
            lambda: ternary_cuda.linear_mma(x, nat.tiles, nat.scale, None, nat.n, nat.k, 0, False), 64), 3)))
    rows += read_floor_rows()
    for r in rows:
        print(f"  floor {r['kernel']:24s} {r['median_us']:8.2f} us", flush=True)
    return rows


@triton.jit
def _read_kernel(src, out, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """Reads ITERS * BLOCK consecutive int32 and stores their XOR: a pure stream of the bytes."""
    base = tl.program_id(0).to(tl.int64) * BLOCK * ITERS
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for i in range(ITERS):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        acc ^= tl.load(src + offs, mask=offs < n, other=0)
    tl.store(out + tl.program_id(0), tl.xor_sum(acc, axis=0))


def read_floor_rows() -> list[dict]:
    """The time to merely read the tiled weights of the M = 1 targets (K=4096, N=14336), rotated as in the
    benchmark, in the same graph harness: the memory floor a kernel at that shape cannot beat. Best of a
    few grids of a streaming Triton reader, and torch's sum over the same bytes."""
    base = ternary_weights(4096, 14336, PRESETS["seed-article"], seed=1)
    natives, next_native = rotating(lambda: repack_copy(base), base.nbytes)
    n = base.tiles.numel()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    best = None
    for block, warps, waves in itertools.product((1024, 2048, 4096), (4, 8), (1, 2, 4, 8)):
        iters = max(1, -(-n // (block * sms * waves)))
        grid = -(-n // (block * iters))
        out = torch.empty(grid, dtype=torch.int32, device="cuda")
        us = graph_us(lambda: _read_kernel[(grid,)](next_native().tiles, out, n, BLOCK=block, ITERS=iters,
                                                    num_warps=warps), len(natives))
        if best is None or us < best["median_us"]:
            best = dict(kernel="read_tiles_triton", K=4096, N=14336, bytes=n * 4, median_us=round(us, 3),
                        config=dict(BLOCK=block, ITERS=iters, grid=grid, num_warps=warps))
    rows = [best, dict(kernel="read_tiles_torch_sum", K=4096, N=14336, bytes=n * 4, median_us=round(graph_us(
        lambda: next_native().tiles.sum(dtype=torch.int64), len(natives)), 3))]
    del natives
    return rows


def time_candidates(kernel: str, k: int, n: int, m: int, cands: list, calls: int, **extra) -> list[dict]:
    """Graph-time each ``(config, fn)``; a failing candidate is reported and skipped. Prints the best."""
    rows = []
    for cfg, fn in cands:
        try:
            us = graph_us(fn, calls, reps=7)
        except Exception as exc:
            print(f"  sweep {kernel} K={k} N={n} M={m} {cfg}: FAILED {type(exc).__name__}: {str(exc)[:200]}",
                  file=sys.stderr)
            continue
        rows.append(dict(kernel=kernel, K=k, N=n, M=m, config=cfg, median_us=round(us, 3), **extra))
    best = min(rows, key=lambda r: r["median_us"], default=None)
    rule = next((r["median_us"] for r in rows if r["config"] == extra.get("default")), None)
    print(f"  best {kernel} K={k} N={n} M={m}: {best}" + (f"; the rule's launch {rule} us" if rule else ""),
          flush=True)
    return rows


def mma_candidates(m: int, n: int, k: int, group_size: int = 0) -> list[dict]:
    """Configurations of the tensor-core kernel worth timing at one shape, with and without the
    programmatic dependent launch; with ``group_size`` those compiled with group scales."""
    from vllm_parity.serving import ternary_cuda

    mbs = (1, 2) if 8 < m <= 16 else (ternary_cuda.mma_config(m, n, k)["mb"],)
    cands = []
    for mb, tn, warps, loads, pdl in itertools.product(mbs, (1, 2, 4), (4, 8, 16), (4, 8), (False, True)):
        if loads == 8 and (mb != 1 or warps < 16):
            continue
        cfg = dict(tn=tn, mb=mb, warps=warps, loads=loads, pdl=pdl)
        fit = ternary_cuda._fit_instance(dict(cfg), group_size)
        if all(fit[key] == cfg[key] for key in ("tn", "mb", "warps", "loads")):  # compiled as asked
            cands.append(cfg)
    return cands


def sweep_mma(copy_gbps: float, rows: bool = False, group_size: int = 0, only_ms=None) -> list[dict]:
    """Blocks, pipelines and launch modes of the tensor-core kernel at the target shapes and smaller ones
    (small M); ``rows``: on the row layout, at the target shapes; ``group_size``: with group scales, at the
    target shapes; ``only_ms``: those token counts alone, at every shape."""
    from vllm_parity.serving import ternary_cuda

    out = []
    ms_all = (1, 4, 8, 9, 16)
    shapes = [((4096, 14336), ms_all), ((14336, 4096), ms_all), ((4096, 4096), ms_all), ((11008, 4096), ms_all),
              ((5632, 2048), ms_all), ((2048, 5632), ms_all), ((2048, 2048), (9, 16)), ((4096, 12288), (9, 16)),
              ((4096, 22016), (9, 16))]
    spec = spec_of(f"group-{group_size}" if group_size else "seed-article")
    for (k, n), ms in shapes[:2] if rows or group_size else shapes:
        ms = list(only_ms) if only_ms is not None else ms
        if not ms:
            continue
        base = ternary_weights(k, n, spec, seed=1)
        natives, next_native = rotating(lambda: repack_copy(base), base.nbytes)
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.float16)
            cands = []
            for cfg in mma_candidates(m, n, k, group_size):
                def fn(cfg=cfg):
                    nat = next_native()
                    return ternary_cuda.linear_mma(x, nat.qweight if rows else nat.tiles, nat.scale, None, nat.n,
                                                   nat.k, nat.group_size, nat.act_quant, config=cfg, rows=rows)
                cands.append((cfg, fn))
            out += time_candidates("cuda_mma_rows" if rows else "cuda_mma", k, n, m, cands, len(natives),
                                   default=ternary_cuda._fit_instance(
                                       ternary_cuda.mma_config(m, n, k, rows, group_size), group_size),
                                   group_size=group_size)
        del natives
    return out


def sweep_gemm(copy_gbps: float) -> list[dict]:
    """Instances and splits of K of the GEMM on the tiles at the target shapes, 32 to 512 tokens; with group
    scales of 128 at fewer points."""
    from vllm_parity.serving import ternary_cuda

    out = []
    for (k, n), group in itertools.product([(4096, 14336), (14336, 4096)], (0, 128)):
        spec = TernarySpec(scale_granularity="group", group_size=group) if group else PRESETS["seed-article"]
        base = ternary_weights(k, n, spec, seed=1)
        natives, next_native = rotating(lambda: repack_copy(base), base.nbytes)
        for m in (64, 128, 256, 512) if group else (32, 64, 96, 128, 192, 256, 384, 512):
            x = torch.randn(m, k, device="cuda", dtype=torch.float16)
            cands = []
            instances = [(*i, False) for i in (ternary_cuda.GEMM_GROUP_INSTANCES if group else
                                                ternary_cuda.GEMM_INSTANCES)]
            instances += [] if group else [(*i, True) for i in ternary_cuda.GEMM_WS_INSTANCES]
            for (bn, wg, stages, ws), split in itertools.product(instances, (1, 2, 4, 8)):
                cfg = dict(bn=bn, wg=wg, stages=stages, split=split, ws=ws)

                def fn(cfg=cfg):
                    nat = next_native()
                    return ternary_cuda.linear_gemm(x, nat.tiles, nat.scale, None, nat.n, nat.k, nat.group_size,
                                                    False, config=cfg)
                cands.append((cfg, fn))
            out += time_candidates("cuda_gemm", k, n, m, cands, len(natives), group_size=group,
                                   default=ternary_cuda.gemm_config(m, n, k, group))
        del natives
    return out


def sweep(copy_gbps: float) -> list[dict]:
    """Block-size candidates for the Triton kernels at the target shapes, graph-timed (prints the best)."""
    out = []
    mm_small = [dict(BM=16, BN=bn, BKW=bkw, GROUP_M=1, SWAP_AB=False, num_warps=w, num_stages=s)
                for bn, bkw, w, s in [(256, 4, 4, 3), (128, 8, 4, 4), (64, 8, 4, 4), (128, 16, 4, 3),
                                      (256, 8, 8, 3), (64, 16, 4, 3), (128, 4, 4, 5), (32, 16, 4, 4)]]
    mm_large = [dict(BM=bm, BN=bn, BKW=bkw, GROUP_M=8, SWAP_AB=sw, num_warps=w, num_stages=s)
                for bm, bn, bkw, sw, w, s in [(128, 128, 4, False, 4, 4), (128, 128, 8, False, 4, 3),
                                              (128, 256, 4, False, 8, 3), (128, 256, 8, False, 8, 3),
                                              (128, 128, 4, True, 4, 4), (256, 128, 4, True, 8, 3),
                                              (64, 256, 4, True, 4, 4), (128, 128, 8, True, 8, 3)]]
    gemv = [dict(BN=bn, BKW=bkw, num_warps=w, num_stages=s)
            for bn, bkw, w, s in [(16, 16, 4, 3), (16, 64, 4, 1), (32, 32, 4, 2), (32, 16, 4, 3),
                                  (64, 16, 8, 2), (16, 32, 4, 2), (8, 64, 4, 2)]]
    for (k, n) in [(4096, 14336), (14336, 4096)]:
        base = ternary_weights(k, n, PRESETS["seed-article"], seed=1)
        natives, next_native = rotating(lambda: repack_copy(base), base.nbytes)
        for m, kernel, cands in [(1, "gemv", gemv), (1, "mm", mm_small), (16, "mm", mm_small),
                                 (512, "mm", mm_large)]:
            x = torch.randn(m, k, device="cuda", dtype=torch.float16)
            splits = [None, 1, 2, 4, 8, 16] if kernel == "mm" and m <= 16 else [None]
            timed = []
            for cfg, split in itertools.product(cands, splits):
                cfg = dict(cfg)
                if split is not None:
                    cfg["SPLIT_K"] = split

                def fn(cfg=cfg):
                    nat = next_native()
                    return ternary_triton.ternary_linear(x, nat.qweight, nat.scale, None, nat.k, nat.group_size,
                                                         nat.act_quant, kernel, config=cfg)
                timed.append((cfg, fn))
            out += time_candidates(kernel, k, n, m, timed, len(natives))
        del natives
    return out


def int8x_rows(copy_gbps: float) -> list[dict]:
    """INT8-X standalone decode and fused decode-GEMV (M=1, K=4096, N=14336) against torch bf16 F.linear."""
    from vllm_parity.reference.formats.int8x import encode
    from vllm_parity.serving import int8x_native, int8x_ops

    k, n = 4096, 14336
    q = (torch.randn(n, k, generator=torch.Generator().manual_seed(3)) * 2.5).round().clamp(-127, 127)
    tensors = {key: v.cuda() for key, v in encode(q.to(torch.int8), 0.01).items()}
    stream_bytes = int8x_native.stored_bytes(tensors)
    rows = []
    wb = (q * 0.01).to(torch.bfloat16).cuda()
    copies, next_wb = rotating(lambda: wb.clone(), wb.numel() * 2, cap=4)
    backends = ["triton"]
    try:
        from vllm_parity.serving import int8x_cuda

        if int8x_cuda.available():
            backends.append("cuda")
    except ImportError:
        pass
    dec_bytes = stream_bytes + n * k * 2
    for backend in backends:
        for m in (1, 16):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            base_us = graph_us(lambda: F.linear(x, next_wb()), len(copies))
            if m == 1:
                dec_us = median_us(lambda: int8x_ops.decode(tensors, (n, k), dtype=torch.bfloat16, backend=backend))
                rows.append(dict(kernel=f"int8x_decode_{backend}", K=k, N=n, M=0, dtype="bfloat16",
                                 median_us=round(dec_us, 3), gbps=round(dec_bytes / dec_us / 1e3, 1),
                                 bw_frac=round(dec_bytes / dec_us / 1e3 / copy_gbps, 4),
                                 baseline="torch_bf16_linear", baseline_us=round(base_us, 3),
                                 speedup=round(base_us / dec_us, 3), bytes="streams read + bf16 weight written"))
            try:
                lin_us = graph_us(lambda: int8x_ops.linear(x, tensors, (n, k), backend=backend), 8)
            except Exception as exc:  # not capturable: events around single calls instead
                print(f"  int8x_linear in a CUDA graph failed ({exc}); timing plain calls", file=sys.stderr)
                lin_us = median_us(lambda: int8x_ops.linear(x, tensors, (n, k), backend=backend))
            lin_bytes = stream_bytes + (k + n) * 2 * m
            rows.append(dict(kernel=f"int8x_linear_{backend}", K=k, N=n, M=m, dtype="bfloat16",
                             median_us=round(lin_us, 3), gbps=round(lin_bytes / lin_us / 1e3, 1),
                             bw_frac=round(lin_bytes / lin_us / 1e3 / copy_gbps, 4),
                             baseline="torch_bf16_linear", baseline_us=round(base_us, 3),
                             speedup=round(base_us / lin_us, 3)))
    rows += int8x_native_rows(q.to(torch.int8), tensors, stream_bytes, copy_gbps, next_wb, len(copies))
    for r in rows:
        print(f"  {r['kernel']:22s} M={r['M']:2d} {r['median_us']:9.2f} us {r['gbps']:7.0f} GB/s  bf16 linear "
              f"{r['baseline_us']:8.2f} us  x{r['speedup']:.2f}", flush=True)
    del copies
    return rows


def int8x_native_rows(q: torch.Tensor, tensors: dict, stream_bytes: int, copy_gbps: float, next_wb,
                      n_wb: int) -> list[dict]:
    """The GEMV on the native layout (4-bit codes + outliers, repacked at load), its copies rotated over
    256 MiB; at M = 1 the best of a few block sizes is reported too (``config``)."""
    from vllm_parity.serving import int8x_native, int8x_native_triton

    n, k = q.shape
    base = int8x_native.pack(q, tensors["weight_scale"].cpu()).to("cuda")
    natives, next_native = rotating(lambda: base._replace(codes=base.codes.clone(), outliers=base.outliers.clone(),
                                                          row_ptr=base.row_ptr.clone()), base.nbytes)
    bits = dict(native_bits_per_weight=round(base.nbytes * 8 / (n * k), 3),
                stored_bits_per_weight=round(stream_bytes * 8 / (n * k), 3), outliers=base.outliers.numel())
    rows = []
    for m in (1, 16):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        base_us = graph_us(lambda: F.linear(x, next_wb()), n_wb)
        cands = [(None, lambda: int8x_native_triton.linear(x, next_native()))]
        if m == 1:
            for bn, bkw, warps, stages in [(16, 16, 4, 3), (8, 32, 4, 2), (16, 32, 4, 2), (32, 16, 4, 3),
                                           (32, 8, 4, 3), (16, 64, 8, 2), (64, 8, 8, 2), (8, 64, 4, 2)]:
                cfg = dict(BN=bn, BKW=bkw, num_warps=warps, num_stages=stages)
                cands.append((cfg, lambda cfg=cfg: int8x_native_triton.linear(x, next_native(), cfg=cfg)))
        timed = [(cfg, graph_us(fn, len(natives))) for cfg, fn in cands]
        for cfg, us in timed if m == 1 else timed[:1]:
            lin_bytes = base.nbytes + (k + n) * 2 * m
            rows.append(dict(kernel="int8x_native_linear_triton", K=k, N=n, M=m, dtype="bfloat16", config=cfg,
                             median_us=round(us, 3), gbps=round(lin_bytes / us / 1e3, 1),
                             bw_frac=round(lin_bytes / us / 1e3 / copy_gbps, 4), baseline="torch_bf16_linear",
                             baseline_us=round(base_us, 3), speedup=round(base_us / us, 3), **bits))
    out = torch.empty(n, k, device="cuda", dtype=torch.bfloat16)
    us = graph_us(lambda: int8x_native_triton.decode(next_native(), torch.bfloat16, out), len(natives))
    dec_bytes = base.nbytes + n * k * 2
    rows.append(dict(kernel="int8x_native_decode_triton", K=k, N=n, M=0, dtype="bfloat16", median_us=round(us, 3),
                     gbps=round(dec_bytes / us / 1e3, 1), bw_frac=round(dec_bytes / us / 1e3 / copy_gbps, 4),
                     baseline="torch_bf16_linear", baseline_us=rows[0]["baseline_us"],
                     speedup=round(rows[0]["baseline_us"] / us, 3), bytes="layout read + bf16 weight written", **bits))
    del natives
    return rows


@functools.lru_cache(maxsize=None)
def planes_weight(k: int, n: int, dist: str):
    """q (n, k) int8 of the seed level mix, a real model's level mix or round(N(0, 2.5^2)) (``dist``: seed-mix,
    real-mix, gaussian-2.5) and its planes layout on the GPU (scale 0.01), made once per run: the rows and the sweep
    share them (the level mixes take tens of seconds on the host)."""
    from vllm_parity.fixtures.weights import by_name
    from vllm_parity.serving import int8x_planes

    q = by_name(dist, n, k, seed=3)
    return q, int8x_planes.pack(q, torch.tensor([0.01])).to("cuda")


PLANES_TARGETS = list(itertools.product([(4096, 14336), (14336, 4096)], ("seed-mix", "gaussian-2.5")))
# The rows also time a real model's level mix (12 % fixup records, 6.47 bits a weight); the sweep does not.
PLANES_ROW_TARGETS = list(itertools.product([(4096, 14336), (14336, 4096)], DISTS))


def planes_rotations(k: int, n: int, dist: str):
    """The layout of :func:`planes_weight` and its bf16 weight, each with copies rotated over 256 MiB:
    ``base, (layouts, next_layout), (bf16 copies, next_wb)``."""
    from vllm_parity.serving import int8x_planes

    q, base = planes_weight(k, n, dist)
    layouts = rotating(lambda: base._replace(**{name: getattr(base, name).clone() for name in int8x_planes.TENSORS}),
                       base.nbytes)
    wb = (q.to(torch.float32) * 0.01).to(torch.bfloat16).cuda()
    return base, layouts, rotating(lambda: wb.clone(), wb.numel() * 2, cap=32)


def int8x_planes_rows(copy_gbps: float) -> list[dict]:
    """The planes layout (5-bit plane + fixup records, kernels/int8x_planes.py) at both target shapes on the seed
    level mix, a real model's level mix and round(N(0, 2.5^2)): the tensor-core GEMV at M = 1 and 16 (bf16 x) and
    the decode to a dense bf16 weight, its copies rotated over 256 MiB, against torch bf16 F.linear measured beside
    it."""
    from vllm_parity.serving import int8x_planes_cuda

    if not int8x_planes_cuda.available():
        return [dict(kernel="int8x_planes", error="no nvcc: the planes kernels cannot be built")]
    rows = []
    for (k, n), dist in PLANES_ROW_TARGETS:
        base, (layouts, next_layout), (copies, next_wb) = planes_rotations(k, n, dist)
        info = dict(K=k, N=n, dist=dist, dtype="bfloat16", bits_per_weight=round(base.bits_per_weight, 4),
                    fixups=base.fixups, baseline="torch_bf16_linear")
        base_us = None
        for m in (1, 16):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            base_us = graph_us(lambda: F.linear(x, next_wb()), len(copies))
            us = graph_us(lambda: int8x_planes_cuda.linear(x, next_layout()), len(layouts))
            moved = base.nbytes + (k + n) * 2 * m
            rows.append(dict(kernel="int8x_planes_linear_cuda", M=m, median_us=round(us, 3),
                             gbps=round(moved / us / 1e3, 1), bw_frac=round(moved / us / 1e3 / copy_gbps, 4),
                             baseline_us=round(base_us, 3), speedup=round(base_us / us, 3), **info))
        out = torch.empty(n, k, device="cuda", dtype=torch.bfloat16)
        us = graph_us(lambda: int8x_planes_cuda.decode(next_layout(), torch.bfloat16, out), len(layouts))
        moved = base.nbytes + n * k * 2
        rows.append(dict(kernel="int8x_planes_decode_cuda", M=0, median_us=round(us, 3),
                         gbps=round(moved / us / 1e3, 1), bw_frac=round(moved / us / 1e3 / copy_gbps, 4),
                         baseline_us=round(base_us, 3), speedup=round(base_us / us, 3),
                         bytes="layout read + bf16 weight written", **info))
        del layouts, copies
    for r in rows:
        if "error" not in r:
            print(f"  {r['kernel']:26s} K={r['K']:5d} N={r['N']:5d} M={r['M']:2d} {r['dist']:12s} "
                  f"{r['bits_per_weight']:.3f} b/w {r['median_us']:9.2f} us ({r['bw_frac']:.2f} of copy)  "
                  f"bf16 linear {r['baseline_us']:8.2f} us  x{r['speedup']:.2f}", flush=True)
    return rows


PLANES_SWEEP_WARPS = (1, 2, 3, 4, 6, 8, 12, 16)
PLANES_SWEEP_TILES = (1, 2, 3, 4, 8, 16)
PLANES_SWEEP_SPLITS = (1, 2, 4, 7, 8)


def int8x_planes_sweep(copy_gbps: float) -> list[dict]:
    """The planes GEMV's launch configurations (``config = (warps, tiles_per_cta, stages, splits)``, see
    ``int8x_planes_cuda.resolve_config``; stages at M = 1 only) at both target shapes, both weight distributions
    and M in 1, 4, 16
    (bf16 x), each timed like the rows (CUDA graph, copies rotated over 256 MiB) beside the default and torch
    bf16 F.linear; configs that give the same launch are timed once, ones the device cannot hold are rows with
    an error. Prints the best per (shape, dist, M)."""
    from vllm_parity.serving import int8x_planes_cuda

    if not int8x_planes_cuda.available():
        return [dict(kernel="int8x_planes_sweep", error="no nvcc: the planes kernels cannot be built")]
    rows = []
    t0 = time.time()
    for (k, n), dist in PLANES_TARGETS:
        base, (layouts, next_layout), (copies, next_wb) = planes_rotations(k, n, dist)
        info = dict(kernel="int8x_planes_linear_cuda_sweep", K=k, N=n, dist=dist, dtype="bfloat16",
                    bits_per_weight=round(base.bits_per_weight, 4), baseline="torch_bf16_linear")
        for m in (1, 4, 16):
            configs, seen = [None], set()
            for cfg in itertools.product(PLANES_SWEEP_WARPS, PLANES_SWEEP_TILES,
                                         int8x_planes_cuda.STAGES if m == 1 else (2,), PLANES_SWEEP_SPLITS):
                try:
                    launch = int8x_planes_cuda.resolve_config(cfg, k, m)
                except ValueError:
                    continue
                if launch not in seen:
                    seen.add(launch)
                    configs.append(cfg)
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            base_us = graph_us(lambda: F.linear(x, next_wb()), len(copies))
            moved = base.nbytes + (k + n) * 2 * m
            limits = int8x_planes_cuda.device_limits(x.device)
            for cfg in configs:
                launch = (int8x_planes_cuda.default_config(m, n, k, *limits) if cfg is None
                          else int8x_planes_cuda.resolve_config(cfg, k, m))
                row = dict(info, M=m, config="default" if cfg is None else list(cfg),
                           launch=dict(warps_per_tile=launch[0], chunks_per_warp=launch[1], tiles_per_cta=launch[2],
                                       stages=launch[3], splits=launch[4]),
                           baseline_us=round(base_us, 3))
                try:
                    us = graph_us(lambda cfg=cfg: int8x_planes_cuda.linear(x, next_layout(), config=cfg),
                                  len(layouts))
                except (ValueError, RuntimeError) as exc:  # e.g. more shared memory than the device allows
                    rows.append(dict(row, error=str(exc).splitlines()[0][:300]))
                    continue
                rows.append(dict(row, median_us=round(us, 3), gbps=round(moved / us / 1e3, 1),
                                 bw_frac=round(moved / us / 1e3 / copy_gbps, 4), speedup=round(base_us / us, 3)))
        del layouts, copies
    print(f"  planes sweep: {len(rows)} rows in {time.time() - t0:.0f} s", flush=True)
    best = {}
    for r in rows:
        key = (r["K"], r["N"], r["dist"], r["M"])
        if "error" not in r and (key not in best or r["median_us"] < best[key]["median_us"]):
            best[key] = r
    default = {(r["K"], r["N"], r["dist"], r["M"]): r for r in rows if r["config"] == "default" and "error" not in r}
    for key, r in sorted(best.items()):
        d = default.get(key)
        print(f"  best K={key[0]:5d} N={key[1]:5d} {key[2]:12s} M={key[3]:2d} config {str(r['config']):8s} "
              f"{r['launch']} {r['median_us']:8.2f} us x{r['speedup']:.2f} ({r['bw_frac']:.2f} of copy)"
              + (f"  default {d['median_us']:8.2f} us x{d['speedup']:.2f}" if d else ""), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "benchmarks/results"), "kernels_h200.json"))
    ap.add_argument("--quick", action="store_true", help="target shapes and M in {1, 16, 512} only")
    ap.add_argument("--sweep", action="store_true", help="also sweep the tensor-core kernel's blocks at the targets")
    ap.add_argument("--rows-sweep", action="store_true",
                    help="also sweep the tensor-core kernel on the row layout at the target shapes")
    ap.add_argument("--gemm-sweep", action="store_true",
                    help="also sweep the GEMM on the tiles (instances, splits) at the target shapes")
    ap.add_argument("--group", action="store_true", help="also the rows of group scales (128 inputs)")
    ap.add_argument("--sweep-ms", default=None,
                    help="comma-separated M values: --sweep at these alone, at every shape")
    ap.add_argument("--only-sweeps", action="store_true", help="stop after the sweeps asked for")
    ap.add_argument("--group-sweep", action="store_true",
                    help="also sweep the tensor-core kernel's blocks with group scales (128 inputs) at the targets")
    ap.add_argument("--no-bitnet", action="store_true", help="skip the BitNet layout's rows")
    ap.add_argument("--sweep-triton", action="store_true", help="also sweep Triton block sizes at the targets")
    ap.add_argument("--floor", action="store_true", help="also time near-empty calls in the same harness")
    ap.add_argument("--only-int8x", action="store_true", help="INT8-X rows only")
    ap.add_argument("--only-int8x-planes", action="store_true", help="the INT8-X planes layout's rows only")
    ap.add_argument("--planes-sweep", action="store_true",
                    help="also sweep the INT8-X planes GEMV's launch configurations (int8x_planes_sweep)")
    ap.add_argument("--ms", default=None, help="comma-separated M values (default: all, or 1,16,512 with --quick)")
    ap.add_argument("--no-cuda", action="store_true", help="skip the CUDA extension kernels")
    ap.add_argument("--no-int8x", action="store_true", help="skip the INT8-X rows")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/kernels.py needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    t0 = time.time()
    copy_gbps = copy_bandwidth()
    props = torch.cuda.get_device_properties(0)
    header = dict(device=torch.cuda.get_device_name(0), sms=props.multi_processor_count,
                  copy_gbps=round(copy_gbps, 1), torch=torch.__version__, triton=triton.__version__,
                  cuda=torch.version.cuda, python=platform.python_version(),
                  method="per-call time inside CUDA graphs, median of replays; weights rotated over >= 256 MiB",
                  started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    print(f"{header['device']}: copy bandwidth {copy_gbps:.0f} GB/s (read + write)", flush=True)
    kernels = ["ternary", "triton_mm", "triton_gemv"]
    if not args.no_cuda:
        from vllm_parity.serving import ternary_cuda

        if ternary_cuda.available():
            t = time.time()
            ternary_cuda.extension()
            print(f"CUDA extension ready in {time.time() - t:.0f} s", flush=True)
            kernels += ["cuda_mma", "cuda_mma_rows", "tiles_linear", "cuda_dequant_tiles", "cuda_dequant", "cuda_vec",
                        "cuda_naive"]
            if ternary_cuda.gemm_supported():
                t = time.time()
                ternary_cuda.gemm_extension()
                print(f"CUDA GEMM extension ready in {time.time() - t:.0f} s", flush=True)
                kernels.append("cuda_gemm")
    shapes = [(4096, 14336), (14336, 4096)] if args.quick else SHAPES
    ms = [int(v) for v in args.ms.split(",")] if args.ms else [1, 16, 512] if args.quick else MS
    result = dict(header=header, rows=[], sweep=[], int8x=[], floor=[], eager=[])
    out_path = Path(args.out)

    def save():  # also between stages: what is measured survives a failing stage or a time limit
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(result, indent=1))

    def finish() -> int:
        header["seconds"] = round(time.time() - t0, 1)
        save()
        print(f"wrote {args.out}")
        return 0

    if args.only_int8x_planes:
        result["int8x"] = int8x_planes_rows(copy_gbps)
        if args.planes_sweep:
            save()
            result["planes_sweep"] = int8x_planes_sweep(copy_gbps)
        return finish()
    if args.floor:
        result["floor"] = floor_rows()
    if "cuda_mma" in kernels and not args.only_int8x and not args.only_sweeps:
        result["eager"] = eager_rows(copy_gbps)
    if args.sweep_triton:
        result["sweep"] += sweep(copy_gbps)
    sweep_ms = [int(v) for v in args.sweep_ms.split(",")] if args.sweep_ms else None
    if args.sweep and "cuda_mma" in kernels:
        result["sweep"] += sweep_mma(copy_gbps, only_ms=sweep_ms)
    if args.gemm_sweep and "cuda_gemm" in kernels:
        result["sweep"] += sweep_gemm(copy_gbps)
        save()
    if args.rows_sweep and "cuda_mma" in kernels:
        result["sweep"] += sweep_mma(copy_gbps, rows=True)
        save()
    if args.group_sweep and "cuda_mma" in kernels:
        result["sweep"] += sweep_mma(copy_gbps, group_size=128)
        save()
    if args.only_sweeps:
        return finish()
    if args.only_int8x:
        shapes = []
    for k, n in shapes:
        result["rows"] += bench_shape(k, n, ms, kernels, copy_gbps, "seed-article")
        save()
    # The BitNet layout (activation quantization, divide, tensor scale) at the two target shapes.
    for k, n in [] if args.only_int8x or args.no_bitnet else [(4096, 14336), (14336, 4096)]:
        result["rows"] += bench_shape(k, n, [1, 16, 128, 512], ["ternary", "tiles_linear", "triton_mm"], copy_gbps,
                                      "hf-bitnet")
        save()
    # Group scales of 128 inputs: the kernels each copy of the weight serves them with.
    for k, n in [(4096, 14336), (14336, 4096)] if args.group else []:
        result["rows"] += bench_shape(k, n, [1, 16, 64, 128, 256, 512], ["ternary", "tiles_linear", "triton_mm",
                                                                      "cuda_mma", "cuda_dequant"], copy_gbps,
                                      "group-128")
        save()
    if not args.no_int8x and Path("kernels/int8x_ops.py").exists() and Path("kernels/int8x_triton.py").exists():
        try:
            result["int8x"] = int8x_rows(copy_gbps)
            result["int8x"] += int8x_planes_rows(copy_gbps)
            if args.planes_sweep:
                result["planes_sweep"] = int8x_planes_sweep(copy_gbps)
        except Exception as exc:
            result["int8x"] = [dict(error=f"{type(exc).__name__}: {exc}"[:500])]
            print(f"int8x: FAILED {exc}", file=sys.stderr)
    print(summary(result))
    return finish()


def summary(result: dict) -> str:
    """The targets, each a ratio from this run."""
    rows = {(r["kernel"], r["K"], r["N"], r["M"], r.get("preset")): r for r in result["rows"] if "error" not in r}
    lines = ["target                                   kernel        us     fp16 us   speedup  bw_frac"]
    for (k, n) in [(4096, 14336), (14336, 4096)]:
        for m, preset in ((1, "seed-article"), (16, "seed-article"), (512, "seed-article"), (1, "group-128")):
            r = rows.get(("ternary", k, n, m, preset))
            if r:
                label = "" if preset == "seed-article" else preset
                lines.append(f"K={k:5d} N={n:5d} M={m:3d} {label:17s} ternary {r['median_us']:9.2f} "
                             f"{r['baseline_us']:9.2f} {r['speedup']:8.2f} {r['bw_frac']:8.2f}")
        r1, r16 = rows.get(("ternary", k, n, 1, "seed-article")), rows.get(("ternary", k, n, 16, "seed-article"))
        if r1 and r16:
            lines.append(f"K={k:5d} N={n:5d} M=16 / M=1 time ratio: {r16['median_us'] / r1['median_us']:.2f}")
        for m in (16, 64, 128, 256, 512):
            r = rows.get(("tiles_linear", k, n, m, "seed-article"))
            if r:
                lines.append(f"K={k:5d} N={n:5d} M={m:3d} one copy (tiles) {r['chosen']:>12s} {r['median_us']:9.2f} "
                             f"{r['baseline_us']:9.2f} {r['speedup']:8.2f} {r['bw_frac']:8.2f}")
    # One resident copy (the tiles: tiles_linear's choice) against two (the row layout's kernels beside cuda_mma on
    # the tiles: choose.ternary_kernel for an untiled weight, cuda_mma taken from the tiles).
    lines.append("one copy against two                      one copy      us   two copies      us    ratio")
    for (kernel, k, n, m, preset), r in sorted(rows.items(), key=lambda kv: (kv[0][4], kv[0][1], kv[0][3])):
        if kernel != "tiles_linear":
            continue
        spec = spec_of(preset)
        group = spec.group_size if spec.scale_granularity == "group" else 0
        two = choose.ternary_kernel("auto", m, torch.float16, group, spec.activation_quant is not None)
        t = rows.get((two, k, n, m, preset))
        if t:
            lines.append(f"{preset:12s} K={k:5d} N={n:5d} M={m:3d} {r['chosen']:>18s} {r['median_us']:7.2f} "
                         f"{two:>12s} {t['median_us']:7.2f} {t['median_us'] / r['median_us']:8.2f}")
    for r in result.get("eager", []):
        lines.append(f"eager K={r['K']:5d} N={r['N']:5d} M=1 {r['kernel']:>20s} {r['median_us']:9.2f} "
                     f"{r['baseline_us']:9.2f} {r['speedup']:8.2f}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
