"""One decoder layer's projections of a 7B shape at M = 1 in one CUDA graph -> benchmarks/results/layer_h200.json.

Llama-2-7B's shapes (hidden 4096, intermediate 11008): the fused qkv (4096 -> 12288), o (4096 -> 4096), the fused
gate_up (4096 -> 22016) and down (11008 -> 4096), one token, back to back as a decode step runs them. Each variant's
time is one layer's, from a CUDA graph of layers over weight copies rotated past the L2 (``kernels.graph_us``):

  fp16 / bf16       torch ``F.linear`` on dense weights (the baselines)
  ternary           ``ternary_ops.ternary_linear`` on the seed-article preset, fp16 x (the serving choice at M = 1)
  int8x_planes      the INT8-X planes layout on the seed's level mix (``fixtures.weights.seed_mix``), bf16 x

Each row: ``median_us``, ``speedup`` against its baseline measured in the same run, the resident bytes and
``bw_frac`` (those bytes over the copy bandwidth measured at the start).

    python3 benchmarks/layer.py [--out PATH]     (with the project installed, on a CUDA machine)
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels import copy_bandwidth, graph_us, rotating, ternary_weights  # noqa: E402

HIDDEN, INTERMEDIATE = 4096, 11008
PROJECTIONS = {"qkv": (HIDDEN, 3 * HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (HIDDEN, 2 * INTERMEDIATE),
               "down": (INTERMEDIATE, HIDDEN)}  # name: (K, N)


def dense_layer(dtype: torch.dtype) -> tuple[dict, int]:
    ws = {name: torch.randn(n, k, device="cuda", dtype=dtype) * 0.02 for name, (k, n) in PROJECTIONS.items()}
    return ws, sum(w.numel() * w.element_size() for w in ws.values())


def ternary_layer() -> tuple[dict, int]:
    from vllm_parity.reference.formats.ternary import PRESETS

    ws = {name: ternary_weights(k, n, PRESETS["seed-article"], seed=k + n) for name, (k, n) in PROJECTIONS.items()}
    nbytes = sum(w.tiles.numel() * 4 + w.scale.numel() * w.scale.element_size() for w in ws.values())
    return ws, nbytes


def planes_layer() -> tuple[dict, int]:
    from vllm_parity.fixtures.weights import seed_mix
    from vllm_parity.serving import int8x_planes

    ws = {name: int8x_planes.pack(seed_mix(n, k, seed=k + n), torch.tensor([0.01])).to("cuda")
          for name, (k, n) in PROJECTIONS.items()}
    return ws, sum(w.nbytes for w in ws.values())


def clone(layer: dict) -> dict:
    out = {}
    for name, w in layer.items():
        if isinstance(w, torch.Tensor):
            out[name] = w.clone()
        elif hasattr(w, "_replace"):  # a NamedTuple layout: its tensors copied
            out[name] = w._replace(**{f: getattr(w, f).clone() for f in w._fields if isinstance(getattr(w, f),
                                                                                                torch.Tensor)})
        else:  # the ternary native layout
            from kernels import repack_copy

            out[name] = repack_copy(w)
    return out


def measure(make, run, dtype: torch.dtype) -> tuple[float, int]:
    """One layer's time at M = 1: ``run(x, layer)`` over copies of ``make()`` rotated past the L2."""
    layer, nbytes = make()
    copies, next_layer = rotating(lambda: clone(layer), nbytes, cap=16)
    x = torch.randn(1, HIDDEN, device="cuda", dtype=dtype)
    xd = torch.randn(1, INTERMEDIATE, device="cuda", dtype=dtype)

    def step():
        w = next_layer()
        for name in PROJECTIONS:
            run(xd if name == "down" else x, w[name])
    us = graph_us(step, len(copies))
    del copies
    torch.cuda.empty_cache()
    return us, nbytes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "layer_h200.json"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("layer: no CUDA device")
    from vllm_parity.serving import int8x_planes_cuda, ternary_ops

    copy_gbps = copy_bandwidth()
    variants = {
        "fp16": (lambda: dense_layer(torch.float16), F.linear, torch.float16, None),
        "bf16": (lambda: dense_layer(torch.bfloat16), F.linear, torch.bfloat16, None),
        "ternary": (ternary_layer, ternary_ops.ternary_linear, torch.float16, "fp16"),
        "int8x_planes": (planes_layer, lambda x, w: int8x_planes_cuda.linear(x, w), torch.bfloat16, "bf16"),
    }
    rows, times = [], {}
    for name, (make, run, dtype, baseline) in variants.items():
        try:
            us, nbytes = measure(make, run, dtype)
        except Exception as exc:  # noqa: BLE001 - recorded, the other variants go on
            rows.append(dict(kernel=name, error=repr(exc)[:500]))
            print(f"{name}: {exc!r}"[:300], flush=True)
            continue
        times[name] = us
        row = dict(kernel=name, M=1, projections=PROJECTIONS, dtype=str(dtype).removeprefix("torch."),
                   median_us=round(us, 3), resident_bytes=nbytes,
                   bw_frac=round(nbytes / us / 1e3 / copy_gbps, 4),
                   floor_us=round(nbytes / copy_gbps / 1e3, 3))
        if baseline in times:
            row.update(baseline=f"torch_{baseline}_linear", baseline_us=round(times[baseline], 3),
                       speedup=round(times[baseline] / us, 3))
        if name == "int8x_planes":
            row["dist"] = "seed-mix"
        rows.append(row)
        print(f"{name:14s} {us:8.2f} us  {nbytes / 1e6:7.1f} MB  floor {row['floor_us']:6.2f} us"
              + (f"  x{row['speedup']:.2f} vs {baseline}" if "speedup" in row else ""), flush=True)
    env = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
           "python": platform.python_version(), "copy_gbps": round(copy_gbps, 1),
           "method": "one layer's time from a CUDA graph of layers over rotated weight copies, median of replays"}
    Path(args.out).write_text(json.dumps({"env": env, "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
