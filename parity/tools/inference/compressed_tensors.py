"""llm-compressor's ``compressed-tensors`` checkpoints in ``parity inspect``: the storage format, bits, scheme
(per tensor, channel or group, with the group size), zero points and activation order, from the tensors'
names, shapes and dtypes; each matrix decoded with the compressed-tensors library (the reference's reading).

Dynamic activation quantization leaves no tensor: it is taken from config.json, and said so.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from vllm_parity.reference.formats.compressed_tensors import CompressedTensorsSpec
from vllm_parity.tools.inference.keys import Keys
from vllm_parity.tools.inference.layout import Matrix
from vllm_parity.tools.inference.registry import Format, decoded_entry, register
from vllm_parity.tools.inference.text import pct, shape

if TYPE_CHECKING:
    from vllm_parity.tools.inference.inspection import Inspection, TensorPass

KEYS = ("format", "num_bits", "type", "symmetric", "strategy", "group_size", "actorder", "input_activations")
STORED = {torch.int32: "pack-quantized", torch.int8: "int-quantized", torch.float8_e4m3fn: "float-quantized"}


class _Flat:
    """A spec's first config group as flat keys (what ``Keys`` reads with getattr)."""

    def __init__(self, spec: CompressedTensorsSpec | None):
        s = spec.schemes[0][1] if spec is not None and spec.schemes else None
        a = s.scheme.input_activations if s is not None else None
        self.format = s.format if s else "pack-quantized"
        self.num_bits = s.num_bits if s else 4
        self.type = s.type if s else "int"
        self.symmetric = s.symmetric if s else True
        self.strategy = s.strategy if s else "group"
        self.group_size = s.group_size if s else 128
        self.actorder = ("group" if s.actorder else None) if s else None
        self.input_activations = a.model_dump(mode="json", exclude_none=True) if a is not None else None
        self.ignore = list(spec.ignore) if spec is not None else ["lm_head"]
        self.raw = {k: getattr(self, k) for k in (*KEYS, "ignore")} if s is not None else {}


def scan_projection(module: str, n: int, k: int, entries: dict, info: dict, roles: dict) -> Matrix | None:
    """A projection stored as compressed-tensors stores one: ``weight_packed`` + ``weight_shape``, or an int8 /
    fp8 ``weight`` beside a ``weight_scale``."""
    if "weight_packed" in entries:
        stored = "pack-quantized"
    elif "weight" in entries and "weight_scale" in entries and info["weight"].dtype in STORED \
            and info["weight"].dtype != torch.int32 and tuple(info["weight"].shape) == (n, k):
        stored = STORED[info["weight"].dtype]
    else:
        return None
    m = Matrix(module, n, k, "compressed-tensors")
    m.stored = stored
    names = ("weight_packed", "weight_shape", "weight_scale", "weight_zero_point", "weight_g_idx") \
        if stored == "pack-quantized" else ("weight", "weight_scale", "weight_zero_point")
    for s in names:
        if s in entries:
            m.keys[s] = entries[s]
            roles[entries[s]] = f"compressed-tensors {s.removeprefix('weight_') if s != 'weight' else 'codes'}"
    m.stored_shape = tuple(info[next(iter(m.keys))].shape)
    for s in ("weight_scale",) + (("weight_shape",) if stored == "pack-quantized" else ()):
        if s not in entries:
            m.problems.append(f"{module}: compressed-tensors {stored} needs {module}.{s}, absent")
    return m


def _scheme_of(m: Matrix, info: dict) -> dict[str, Any]:
    """What one matrix's tensors show of its scheme."""
    scale = tuple(info[m.keys["weight_scale"]].shape)
    out: dict[str, Any] = {"format": m.stored, "symmetric": "weight_zero_point" not in m.keys,
                           "actorder": "group" if "weight_g_idx" in m.keys else None,
                           "type": "float" if m.stored == "float-quantized" else "int"}
    if m.stored == "pack-quantized":
        cols = int(info[m.keys["weight_packed"]].shape[-1])
        out["num_bits"] = 32 // -(-m.k // cols) if cols else None
    else:
        out["num_bits"] = 8
    if scale in ((1,), ()):
        out["strategy"], out["group_size"] = "tensor", None
    elif scale == (m.n, 1):
        out["strategy"], out["group_size"] = "channel", None
    elif len(scale) == 2 and scale[0] == m.n and scale[1] and m.k % scale[1] == 0:
        out["strategy"], out["group_size"] = "group", m.k // scale[1]
    else:
        out["strategy"], out["group_size"] = None, None
    return out


@register
class CompressedTensorsFormat(Format):
    quant_method = "compressed-tensors"
    looks_like = "compressed-tensors weights (weight_packed, or int8/fp8 weight + weight_scale)"
    specificity = 2  # weight_packed is its own; its weight_shape is int8x's name too
    key_order = ("quant_method", "ignore", *KEYS)
    consequences = {"group_size": "vLLM applies each scale to the wrong inputs",
                    "symmetric": "vLLM ignores or expects zero points",
                    "num_bits": "vLLM unpacks the wrong number of values per word",
                    "strategy": "vLLM reads the scales with another shape"}

    def scan(self, module, n, k, entries, info, declared, roles) -> Matrix | None:
        return scan_projection(module, n, k, entries, info, roles)

    def fit(self, insp: Inspection) -> None:
        declared = insp.declared if isinstance(insp.declared, CompressedTensorsSpec) else None
        flat = _Flat(declared)
        keys = insp.keys = Keys(None, None, _Flat(None))
        keys.declared, keys.raw = (flat, flat.raw) if declared is not None else (None, {})
        keys.set("quant_method", self.quant_method, "inferred")
        keys.take_fallback("ignore")
        mats = insp.good(self.quant_method)
        if not mats:
            insp.failure = "no compressed-tensors matrix could be read (see the warnings)"
            return
        infos = insp.ckpt.tensors
        shown = {m.module: _scheme_of(m, infos) for m in mats}
        for key in KEYS[:-1]:
            insp.shared(keys, key, {module: s[key] for module, s in shown.items()})
            if insp.failure:
                return
        if declared is not None:  # dynamic activations leave no tensor: what config.json says
            keys.set("input_activations", flat.input_activations, "declared")
        else:
            keys.set("input_activations", None, "guessed")
            insp.notes.append("input_activations: dynamic activation quantization leaves no tensor; without a "
                              "declared config the scheme is read as weight-only")
        insp.build_spec()

    def build_spec(self, values: dict[str, Any]) -> CompressedTensorsSpec:
        weights = {"num_bits": values["num_bits"], "type": values["type"], "symmetric": values["symmetric"],
                   "strategy": values["strategy"]}
        if values["group_size"] is not None:
            weights["group_size"] = values["group_size"]
        if values["actorder"] is not None:
            weights["actorder"] = values["actorder"]
        group = {"targets": ["Linear"], "format": values["format"], "weights": weights}
        if values.get("input_activations") is not None:
            group["input_activations"] = values["input_activations"]
        return CompressedTensorsSpec.from_config({"format": values["format"], "config_groups": {"group_0": group},
                                                  "ignore": list(values["ignore"])})

    def describe(self, insp: Inspection, m: Matrix, entry: dict[str, Any], tensor_pass: TensorPass) -> None:
        t = {s: tensor_pass.read(key) for s, key in m.keys.items()}
        s = _scheme_of(m, insp.ckpt.tensors)
        stored_bits = sum(v.numel() * v.element_size() * 8 for v in t.values())
        entry.update(stored=m.stored, scheme={k: s[k] for k in KEYS[1:-1]},
                     bits_per_weight=stored_bits / (m.n * m.k))
        decoded_entry(insp, m, entry, tensor_pass, CompressedTensorsSpec)

    def disagrees(self, key, data, said, declared) -> bool:
        return data != said

    def text_row(self, entry: dict[str, Any]) -> list[str]:
        s = entry.get("scheme", {})
        scheme = f"{s.get('num_bits')}-bit {s.get('type')}, {s.get('strategy')}" + \
            (f" {s['group_size']}" if s.get("group_size") else "") + ("" if s.get("symmetric") else ", zero points") + \
            (", g_idx" if s.get("actorder") else "")
        return [entry["module"], shape(entry["logical_shape"]), entry.get("stored", "?"), "-", scheme,
                pct(entry.get("zero_fraction")), "-", f"{entry['bits_per_weight']:.3f}"]
