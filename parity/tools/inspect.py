"""``parity inspect CKPT [--json] [--against FLOAT_CKPT]``: reverse-engineer a checkpoint's format.

Lists every tensor (shape, dtype, range, distinct values, 2-bit code histograms), which projections
are quantized and how they are packed, the candidate code tables, and the checkpoint key -> vLLM
parameter mapping. With ``--against`` (a float checkpoint of the dequantized weights) it infers the
``quantization_config`` that reproduces them exactly, verifies it on every matrix, and warns when
config.json disagrees. Exit status: 0 clean, 1 when there are warnings, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from vllm_parity.tools.inference import inspect_checkpoint, registry
from vllm_parity.tools.inference.text import g as _g, pct as _pct, shape as _shape


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.split("\n\n")[1].replace("\n", " ").replace("``", "")
    parser.add_argument("checkpoint", help="checkpoint directory (config.json + *.safetensors)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON (for tools)")
    parser.add_argument("--against", metavar="FLOAT_CKPT",
                        help="float checkpoint of the same architecture holding the dequantized weights "
                             "under <module>.weight: infer and verify the exact quantization_config")


def run(args: argparse.Namespace) -> int:
    report = inspect_checkpoint(args.checkpoint, args.against)
    if args.json:
        print(json.dumps(report, indent=2, allow_nan=False))
        for w in report["warnings"]:
            print(f"parity inspect: warning: {w}", file=sys.stderr)
    else:
        print(render(report))
    return 1 if report["warnings"] else 0


# -- text ---------------------------------------------------------------------------------------


def _j(x: Any) -> str:
    return json.dumps(x)


def _table(headers: list[str], rows: list[list[Any]], indent: str = "  ") -> list[str]:
    cells = [[str(c) for c in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    fmt = lambda r: indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return [fmt(headers), fmt(["-" * w for w in widths])] + [fmt(r) for r in cells]


def _values(t: dict) -> str:
    if t.get("code_histogram"):
        h = t["code_histogram"]
        total = sum(h) or 1
        out = "codes " + " ".join(f"{c}:{100 * n / total:.1f}%" if n else f"{c}:0" for c, n in enumerate(h))
    elif t.get("distinct") is not None:
        out = "{" + ", ".join(_g(v) for v in t["distinct"]) + "}"
    else:
        out = "many"
    if t.get("nonfinite"):
        out += f" ({t['nonfinite']} non-finite)"
    return out


def render(r: dict[str, Any]) -> str:
    out: list[str] = []
    s = r["summary"]
    out.append(f"parity inspect {r['checkpoint']}")
    out.append(f"  {s['files']} file(s), {s['tensors']} tensors, {s['parameters']:,} parameters; format: {r['format']} "
               f"({s['quantized_matrices']} quantized, {s['float_matrices']} float linear matrices)")
    a = r["architecture"]
    out.append(f"  architecture: {a['model_type']} " + (f"({len(a['taps'])} tap rows)" if a["known"] else
                                                       "(not one the harness knows: see the warnings)"))
    out.append("  declared quantization_config: " + (_j(r["declared_config"]) if r["declared_config"] is not None
                                                     else "none (plain floating point)"))
    if r["against"]:
        out.append(f"  against: {r['against']}")

    out += ["", "TENSORS"]
    out += _table(["name", "shape", "dtype", "role", "min", "max", "values"],
                  [[t["name"], _shape(t["shape"]), t["dtype"], _role(t), _g(t["min"]), _g(t["max"]), _values(t)]
                   for t in r["tensors"]])

    quant = [m for m in r["matrices"] if registry.get(m["kind"]) is not None]
    if quant:
        out += ["", "QUANTIZED MATRICES"]
        out += _matrix_table(quant)
        srcs = {m.get("zero_fraction_source") for m in quant if m.get("zero_fraction_source")}
        if srcs:
            out.append(f"  zero fraction from: {', '.join(sorted(srcs))} "
                       f"(the share of multiply-adds a sparsity-skipping kernel could drop)")
    if r["code_table"]:
        out += ["", "CODE TABLE"] + _code_table(r)
    if r["hypotheses"]:
        out += ["", f"HYPOTHESES (searched in full on {len(r['hypotheses']['sampled'])} matrices)"]
        out += _hypotheses(r["hypotheses"])
    hint = not r["against"] and (r["quantization_config"] or r["partial_config"])
    out += ["", "QUANTIZATION_CONFIG" + (" (keys the tensors cannot show come from config.json or the defaults; "
                                         "--against FLOAT_CKPT infers them)" if hint else "")]
    out += _config(r)
    if r["verification"]:
        out += ["", "VERIFICATION"] + _verification(r["verification"])
    out += ["", "MAPPING: checkpoint key -> vLLM parameter"]
    out += _table(["checkpoint key", "vLLM parameter", "op", "shard", "rows", "packed rows", "TP split"],
                  [[m["checkpoint_key"], m["vllm_param"], m["op"], _shard(m),
                    _range(m["rows"]), _range(m["packed_rows"]), m["tp_split"] or "-"] for m in r["mapping"]])
    out.append("  no tensor is transposed: Hugging Face and vLLM both store linear weights as (out_features, in_features)")
    for note in sorted({m["note"] for m in r["mapping"] if m["note"]}):
        out.append(f"  note: {note}")
    if r["notes"]:
        out += ["", "NOTES"] + [f"  - {n}" for n in r["notes"]]
    if r["warnings"]:
        bar = "!" * 100
        out += ["", bar, f"!!! WARNINGS ({len(r['warnings'])})"]
        out += [f"!!! {w}" for w in r["warnings"]]
        out.append(bar)
    return "\n".join(out)


def _role(t: dict) -> str:
    if t["role"] == "packed weight" and t.get("pack_axis"):
        return f"packed ({t['pack_axis']} x{t['pack_factor']})"
    return t["role"]


def _shard(m: dict) -> str:
    if m["shard"] is None:
        return "-"
    return repr(m["shard"]) + (f" slot {m['slot']}" if m["slot"] is not None else "")


def _range(r) -> str:
    return "-" if r is None else f"{r[0]}:{r[1]}"


def _matrix_table(quant: list[dict]) -> list[str]:
    rows = [registry.get(m["kind"]).text_row(m) for m in quant]
    return _table(["module", "logical", "stored", "packed", "scale", "zero frac", "codes 0/1/2/3 | levels",
                   "bits/weight"], rows)


def _code_table(r: dict) -> list[str]:
    ct = r["code_table"]
    total = sum(ct["histogram"]) or 1
    out = ["  codes in use: " + ", ".join(f"{c} ({100 * ct['histogram'][c] / total:.1f}%)" for c in ct["occurring_codes"])
           + ("; never occurring (-> null): " + ", ".join(map(str, ct["never_occurring_codes"]))
              if ct["never_occurring_codes"] else "")]
    if not ct["candidates"]:
        return out + ["  no candidate code table: all four codes occur"]
    if not r["against"]:
        out.append("  without --against the +1 and -1 codes cannot be told apart; the zero code is the one whose "
                   "removal leaves a balanced pair")
    rows = []
    for c in ct["candidates"]:
        marks = [m for m, on in (("plausible", c["plausible"]), ("declared", c["declared"]),
                                 ("chosen", c["chosen"])) if on]
        rows.append([_j(c["code_map"]), _pct(c["zero_fraction"]), _pct(c["sign_imbalance"]), " ".join(marks)])
    return out + _table(["code_map", "zero", "+/- imbalance", ""], rows)


def _hypotheses(h: dict) -> list[str]:
    rows = []
    for s in h["survivors"]:
        rows.append([f"{s['pack_layout']}/{s['bit_order']}", "fits",
                     f"code_map {_j(s['code_map'])}, scale_mode {' or '.join(s['scale_modes'])}"])
    for s in h["rejected"]:
        rows.append([f"{s['pack_layout']}/{s['bit_order']}", f"no ({s['fits']}/{s['of']})", s["reason"]])
    return _table(["layout/bit order", "fits", "evidence (first matrix it fails)"], rows)


def _config(r: dict) -> list[str]:
    config = r["quantization_config"] or r["partial_config"]
    if config is None:
        return ["  none: " + (r["failure"] or "no quantized matrices (plain floating point)")]
    declared = r["declared_config"] if isinstance(r["declared_config"], dict) else None
    rows = []
    for key, value in config.items():
        if declared is None:
            said = "-"
        elif key in declared:
            said = _j(declared[key])
        else:
            said = "(omitted)"
        rows.append([key, _j(value), r["key_sources"].get(key, "-"), said])
    out = _table(["key", "value", "source", "config.json"], rows)
    if r["quantization_config"] is None:
        out.append(f"  incomplete: {r['failure']}")
    else:
        out.append("  " + _j(r["quantization_config"]))
    return out


def _verification(v: dict) -> list[str]:
    if not v["performed"]:
        return [f"  not performed: {v['reason']}"]
    failed = v["failed"]
    out = [f"  decoded {v['checked']} quantized matrices with the config above and compared them with the float "
           f"weights: {'all exact' if v['passed'] else f'{len(failed)} differ'} (max abs error {_g(v['max_abs_error'])})"]
    for c in v["matrices"]:
        if not c["exact"]:
            why = c.get("error") or (f"max abs error {_g(c['max_abs_error'])}, {c['mismatches']} mismatches, worst at "
                                     f"{c['worst']['index']}: decoded {_g(c['worst']['decoded'])} vs "
                                     f"float {_g(c['worst']['float'])}")
            out.append(f"  FAIL {c['module']}: {why}")
    for d in v["diagnoses"]:
        out.append(f"  {d['module']} on its own: {d['text']}")
    return out
