"""Time the reference codecs (pure torch/numpy) on one weight matrix, default 4096 x 14336.

    .venv/bin/python benchmarks/codecs.py [--runs 3] [--n 4096] [--k 14336] [--out benchmarks/results/codecs.json]

int8x: encode (int8 -> 9 tensors), decode_int8 (-> int8), decode (-> fp32 q*scale), on Laplacian-like
weights with about 55 / 40 / 4-5 % of L1 / L2 / L3 values. ternary: pack_values and decode for the
``seed-article`` and ``hf-bitnet`` presets on uniform {-1, 0, 1} weights. Each op is timed ``--runs``
times; the median is reported. Results go to a JSON file: a header, then one row per (codec, variant, op).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vllm_parity.reference.formats import int8x, ternary  # noqa: E402
from vllm_parity.reference.formats.int8x import Int8xSpec  # noqa: E402
from vllm_parity.reference.formats.ternary import PRESETS  # noqa: E402


def laplacian_int8(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """95 % Laplace(b=4.1) + 5 % Laplace(b=20), rounded: about 55 / 40 / 4.5 % L1 / L2 / L3.

    A pure Laplacian with 55 % L1 has only ~3 % L3; the wide component gives the heavier tail of
    real int8 weight matrices.
    """
    rng = np.random.default_rng(seed)
    b = np.where(rng.random(n * k) < 0.95, 4.1, 20.0)
    v = np.clip(np.rint(rng.laplace(0.0, b)), -128, 127).astype(np.int8)
    return torch.from_numpy(v.reshape(n, k))


def timed(fn, runs: int) -> tuple[float, list[float], object]:
    times, result = [], None
    for _ in range(runs):
        result = None  # free the previous result before the next run
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times, result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--k", type=int, default=14336)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "codecs.json")
    args = ap.parse_args(argv)
    n, k, runs = args.n, args.k, args.runs
    rows = []

    def row(codec, variant, op, median, times, **extra):
        rows.append({"codec": codec, "variant": variant, "N": n, "K": k, "op": op,
                     "median_s": round(median, 4), "runs": runs, "times_s": [round(t, 4) for t in times], **extra})
        print(f"{codec:8s} {variant:13s} {op:12s} median {median:8.3f} s  ({runs} runs)", flush=True)

    # -- int8x
    spec = Int8xSpec()
    q = laplacian_int8(n, k)
    lv = int8x.levels(q)
    med, ts, enc = timed(lambda: int8x.encode(q, 0.01, spec), runs)
    bpw = int8x.bits_per_weight(enc)
    stats = {"levels": {key: round(lv[key], 4) for key in ("l1", "l2", "l3")},
             "bits_per_weight": round(bpw["bits_per_weight"], 4),
             "block_tables_bits_per_weight": round(bpw["block_tables_bits_per_weight"], 4),
             "block_size": spec.block_size}
    row("int8x", "default", "encode", med, ts, **stats)
    med, ts, out = timed(lambda: int8x.decode_int8(enc, spec), runs)
    if not torch.equal(out, q):
        raise SystemExit("int8x: decode_int8(encode(q)) != q")
    row("int8x", "default", "decode_int8", med, ts)
    out = None
    med, ts, _ = timed(lambda: int8x.decode(enc, spec), runs)
    row("int8x", "default", "decode_fp32", med, ts)
    del q, enc

    # -- ternary
    rng = np.random.default_rng(1)
    values = torch.from_numpy(rng.integers(-1, 2, size=(n, k), dtype=np.int8))
    for variant in ("seed-article", "hf-bitnet"):
        tspec = PRESETS[variant]
        scale = torch.rand(tspec.scale_shape(n, k), generator=torch.Generator().manual_seed(2)) + 0.5
        med, ts, packed = timed(lambda: ternary.pack_values(values, tspec), runs)
        row("ternary", variant, "encode", med, ts)
        med, ts, w = timed(lambda: ternary.decode(packed, scale, tspec, n, k), runs)
        row("ternary", variant, "decode_fp32", med, ts)
        w = None

    header = {
        "torch": torch.__version__, "numpy": np.__version__, "python": platform.python_version(),
        "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "loadavg_1m_at_end": round(os.getloadavg()[0], 2),  # the machine is shared: high load inflates times
        "machine": platform.machine(), "processor": platform.processor() or None,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(args.out.suffix + ".tmp")
    tmp.write_text(json.dumps({"header": header, "rows": rows}, indent=1) + "\n")
    tmp.replace(args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
