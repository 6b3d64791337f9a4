"""The whole inspection: scan, the format's fit, one pass over every tensor, verification, the report.

The checkpoint's format is the one registered format its quantized matrices share (``mixed`` when they
do not, ``float`` or ``unknown`` when none is quantized); every step that depends on it asks that
format (:mod:`vllm_parity.tools.inference.registry`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from vllm_parity.errors import CheckpointError, ParityInputError
from vllm_parity import architectures
from vllm_parity.reference.checkpoint import Checkpoint, linear_shapes, parameter_shapes, stored_names
from vllm_parity.reference.formats import FormatSpec
from vllm_parity.tools.inference import registry
from vllm_parity.tools.inference.keys import Keys
from vllm_parity.tools.inference.layout import Matrix, fmt_shape, open_against, scan
from vllm_parity.tools.inference.mapping import vllm_mapping
from vllm_parity.tools.inference.stats import jsonable, natural_sorted, show, tensor_stats

SCHEMA = "parity-inspect/1"
DIAGNOSE_FAILED = 4  # matrices failing verification that are searched again to explain the failure
QUANT_METHOD_CONSEQUENCE = "a loader picks the wrong decoder"


class TensorPass:
    """The one read of the checkpoint's tensors: each one's statistics, each matrix's entry, the checks."""

    def __init__(self, insp: Inspection):
        self.insp = insp
        self.tensors: dict[str, dict] = {}
        self.entries: list[dict] = []
        self.checks: list[dict] = []

    def read(self, key: str) -> torch.Tensor:
        """The tensor ``key``, its statistics recorded in ``tensors[key]``."""
        ckpt = self.insp.ckpt
        t = ckpt.tensor(key)
        info = ckpt.tensors[key]
        self.tensors[key] = {"name": key, "shape": list(info.shape), "dtype": str(info.dtype).removeprefix("torch."),
                             "file": info.file.name, "role": self.insp.roles.get(key, "float"), **tensor_stats(t)}
        return t


class Inspection:
    """``parity inspect``: reads a checkpoint one tensor at a time and builds the report (plain data).

    What a format's methods use of it: ``ckpt``, ``fck`` (the float checkpoint or None), ``declared`` and
    ``declared_raw``, ``good``, ``shared`` and ``build_spec``; what they set: ``keys``, ``failure``,
    ``warnings``, ``notes``, and the report's ``hypotheses`` and ``code_table`` sections.
    """

    def __init__(self, path: str | Path, against: str | Path | None = None):
        self.ckpt = Checkpoint(path)
        self.declared_raw = self.ckpt.config.get("quantization_config")
        self.declared = self.ckpt.spec
        self.warnings: list[str] = []
        self.notes: list[str] = []
        self.disagreements: list[dict[str, Any]] = []
        self.architecture = self._architecture()
        try:
            self.shapes = linear_shapes(self.ckpt.config)
            self.params = set(parameter_shapes(self.ckpt.config))
        except CheckpointError as exc:
            self.shapes, self.params = {}, set()
            self.warnings.append(f"{self.ckpt.path}/config.json: {exc}; packed axes cannot be inferred")
        self.matrices, self.roles = scan(self.ckpt, self.shapes, self.declared)
        self.by_module = {m.module: m for m in self.matrices}
        for m in self.matrices:
            self.warnings.extend(m.problems)
        self.fck = open_against(against, self.ckpt, self.shapes, self.matrices) if against else None
        self.format = self._format()
        self.keys: Keys | None = None
        self.spec: FormatSpec | None = None
        self.failure: str | None = None
        self.hypotheses: dict[str, Any] | None = None
        self.code_table: dict[str, Any] | None = None

    def _quantized_kinds(self) -> list[str]:
        kinds = {m.kind for m in self.matrices}
        return [f.quant_method for f in registry.registered() if f.quant_method in kinds]

    def _format(self) -> str:
        quantized = self._quantized_kinds()
        if len(quantized) > 1:
            return "mixed"
        if quantized:
            return quantized[0]
        return "float" if "float" in {m.kind for m in self.matrices} else "unknown"

    @staticmethod
    def quantized(m: Matrix) -> bool:
        return registry.get(m.kind) is not None

    def good(self, kind: str) -> list[Matrix]:
        return [m for m in self.matrices if m.kind == kind and not m.problems]

    def shared(self, keys: Keys, key: str, per_matrix: dict[str, Any]) -> Any:
        """The value of ``key`` every matrix shows (inferred); else a failure naming who shows what."""
        values = sorted(set(per_matrix.values()), key=str)
        if len(values) == 1:
            keys.set(key, values[0], "inferred")
            return values[0]
        by_value: dict[Any, list[str]] = {}
        for module, v in per_matrix.items():
            by_value.setdefault(v, []).append(module)
        detail = "; ".join(f"{v!r} in {len(ms)} (e.g. {ms[0]})" for v, ms in by_value.items())
        self.failure = f"the matrices do not share one {key}: {detail}"
        self.warnings.append(f"{key}: {self.failure} - one quantization_config cannot describe them")
        return None

    def build_spec(self) -> None:
        if self.keys is None or self.failure:
            return
        try:
            self.spec = registry.get(self.keys.values["quant_method"]).build_spec(self.keys.values)
        except ParityInputError as exc:
            self.failure = f"the inferred keys do not form a valid config: {exc}"
            self.warnings.append(self.failure)

    def _architecture(self) -> dict[str, Any]:
        """The family of config.json's model_type, and the architecture file the harness reads it from."""
        model_type = self.ckpt.config.get("model_type")
        try:
            arch = architectures.lookup(model_type, f"{self.ckpt.path}/config.json")
        except ParityInputError as exc:
            self.warnings.append(str(exc))
            return {"model_type": model_type, "known": False, "taps": []}
        return {"model_type": model_type, "known": True, "taps": [p.tap for p in arch.taps]}

    def run(self) -> dict[str, Any]:
        fmt = registry.get(self.format)
        if fmt is not None:
            fmt.fit(self)
        elif self.format == "mixed":
            kinds = " and some ".join(self._quantized_kinds())
            self.failure = f"some matrices are {kinds}: no single quantization_config"
            self.warnings.append(self.failure)
        tensor_pass = self.tensor_pass()
        if fmt is not None:
            fmt.after_pass(self, tensor_pass.entries)
        self.check_stored(tensor_pass.tensors)
        verification = self.verification(tensor_pass.checks)
        self.check_declared()
        return self.report(tensor_pass.tensors, tensor_pass.entries, verification)

    def tensor_pass(self) -> TensorPass:
        tp = TensorPass(self)
        for m in self.matrices:
            entry: dict[str, Any] = {"module": m.module, "kind": m.kind, "logical_shape": [m.n, m.k],
                                     "stored_shape": list(m.stored_shape) if m.stored_shape else None}
            fmt = registry.get(m.kind)
            if fmt is not None:
                fmt.describe(self, m, entry, tp)
            else:
                for key in m.keys.values():
                    tp.read(key)
            for key in m.keys.values():
                tp.tensors[key]["module"] = m.module
            tp.entries.append(entry)
        for key in natural_sorted(self.ckpt.tensors):
            if key not in tp.tensors:
                tp.read(key)
        return tp

    # -- after the pass ---------------------------------------------------------------------------

    def check_stored(self, tensors: dict[str, dict]) -> None:
        """What no checkpoint may hold, named by file and tensor: NaN or Inf, and a float tensor whose shape
        differs from the one transformers' model of config.json gives it."""
        try:
            expected = {k: v for sources in stored_names(self.ckpt.config).values() for k, v in sources.items()}
        except CheckpointError:  # already a warning: the architecture cannot be built from config.json
            expected = {}
        for key in natural_sorted(tensors):
            t = tensors[key]
            where = f"{t['file']}: tensor {key!r}"
            if t["nonfinite"]:
                self.warnings.append(f"{where} holds {t['nonfinite']} NaN or Inf value(s); expected finite numbers")
            want = expected.get(key)
            if want is not None and t["role"] in ("float", "float weight") and tuple(t["shape"]) != tuple(want):
                self.warnings.append(f"{where} has shape {fmt_shape(t['shape'])}, expected {fmt_shape(want)} "
                                     f"from config.json")

    def verification(self, checks: list[dict]) -> dict[str, Any] | None:
        if self.fck is None:
            return None
        if self.spec is None:
            return {"performed": False, "reason": self.failure or "nothing quantized to verify", "matrices": [],
                    "passed": False if self.format != "float" else None}
        failed = [c for c in checks if not c["exact"]]
        errors = [c["max_abs_error"] for c in checks if c.get("max_abs_error") is not None]
        out = {"performed": True, "config": self.spec.to_config(), "matrices": checks, "checked": len(checks),
               "passed": not failed and bool(checks), "max_abs_error": max(errors) if errors else None,
               "failed": [c["module"] for c in failed], "diagnoses": []}
        for c in failed:
            why = c.get("error") or (f"max abs error {c['max_abs_error']:.3g}, {c['mismatches']} element(s) "
                                     f"beyond the float dtype's rounding")
            self.warnings.append(f"{c['module']}: does not decode to its float weights with the inferred config: {why}")
        for c in failed[:DIAGNOSE_FAILED]:
            m = self.by_module[c["module"]]
            fmt = registry.get(m.kind)
            diagnosis = fmt.diagnose(self, m) if fmt is not None else None
            if diagnosis is not None:
                out["diagnoses"].append(diagnosis)
        if self.spec is not None and out["passed"]:
            self.notes.append(f"verified: all {len(checks)} quantized matrices decode to the float weights "
                              f"(max abs error {out['max_abs_error']:.3g})")
        return out

    def check_declared(self) -> None:
        """Loud warnings where config.json says one thing and the data another."""
        declared = self.declared
        fmt = registry.get(self.format)
        if fmt is not None and declared is None:
            self.warnings.append(
                f"quant_method: config.json declares no quantization_config, but the linear weights are stored "
                f"as {self.format}: a loader treats the checkpoint as plain floating point")
            self.disagreements.append({"key": "quant_method", "declared": None, "data": self.format, "explicit": False})
        elif declared is not None and fmt is not None and declared.quant_method != self.format:
            self.warnings.append(f"quant_method: config.json declares {declared.quant_method!r}, but the weights are "
                                 f"stored as {self.format!r}: {QUANT_METHOD_CONSEQUENCE}")
            self.disagreements.append({"key": "quant_method", "declared": declared.quant_method,
                                       "data": self.format, "explicit": True})
        elif declared is not None and self.format == "float":
            self.warnings.append(f"quant_method: config.json declares {declared.quant_method!r}, but every linear "
                                 f"weight is stored as float")
        if self.keys is None or self.keys.declared is None:
            self._check_ignore()
            return
        for key, source in self.keys.sources.items():
            if source != "inferred" or key == "quant_method":
                continue
            data, said = self.keys.values[key], getattr(self.keys.declared, key)  # the keys' view of config.json
            if not fmt.disagrees(key, data, said, declared):
                continue
            explicit = key in self.keys.raw
            how = "declares" if explicit else "omits it, so it defaults to"
            evidence = "the float weights" if key in fmt.weight_keys else "the tensors' shapes and names"
            self.warnings.append(f"{key}: config.json {how} {show(said)}, but {evidence} show {show(data)}: "
                                 f"{fmt.consequences.get(key, '')}")
            self.disagreements.append({"key": key, "declared": jsonable(said), "data": jsonable(data),
                                       "explicit": explicit})
        self._check_ignore()

    def _check_ignore(self) -> None:
        spec = self.spec
        if spec is None:
            return
        for m in self.matrices:
            if m.kind == "float" and not spec.is_ignored(m.module):
                self.warnings.append(f"ignore: {m.module} is stored as float but not listed in ignore "
                                     f"{list(spec.ignore)}: a loader looks for its quantized tensors")
            elif self.quantized(m) and spec.is_ignored(m.module):
                self.warnings.append(f"ignore: {m.module} is stored quantized but matches ignore "
                                     f"{list(spec.ignore)}: a loader reads it as a float weight")

    def report(self, tensors: dict, entries: list[dict], verification: dict | None) -> dict[str, Any]:
        keys = self.keys
        fmt = registry.get(self.format)
        sources = dict(keys.sources) if keys else {}
        config = self.spec.to_config() if self.spec is not None else None
        quantized = [m for m in self.matrices if self.quantized(m)]
        params = sum(m.n * m.k for m in quantized)
        quant_keys = {k for m in quantized for k in m.keys.values()}
        params += sum(math.prod(i.shape) for k, i in self.ckpt.tensors.items() if k not in quant_keys)
        order = fmt.key_order if fmt is not None else ()
        return {
            "schema": SCHEMA,
            "checkpoint": str(self.ckpt.path),
            "against": str(self.fck.path) if self.fck is not None else None,
            "format": self.format,
            "architecture": self.architecture,
            "declared_config": jsonable(self.declared_raw),
            "quantization_config": config,
            "partial_config": None if config is not None or keys is None else jsonable(
                {k: keys.values[k] for k in order if k in keys.values}),
            "key_sources": sources,
            "inferred_keys": [k for k, s in sources.items() if s == "inferred"],
            "declared_keys": [k for k, s in sources.items() if s == "declared"],
            "default_keys": [k for k, s in sources.items() if s == "default"],
            "guessed_keys": [k for k, s in sources.items() if s == "guessed"],
            "failure": self.failure,
            "disagreements": self.disagreements,
            "summary": {"files": len({i.file for i in self.ckpt.tensors.values()}), "tensors": len(tensors),
                        "parameters": params, "quantized_matrices": len(quantized),
                        "float_matrices": sum(m.kind == "float" for m in self.matrices)},
            "tensors": [jsonable(tensors[k]) for k in natural_sorted(tensors)],
            "matrices": jsonable(entries),
            "code_table": jsonable(self.code_table),
            "hypotheses": jsonable(self.hypotheses),
            "verification": jsonable(verification),
            "mapping": vllm_mapping(natural_sorted(self.ckpt.tensors), self.shapes, self.by_module, self.roles,
                                    keys.values if keys else {}, self.params, self.architecture["model_type"]),
            "warnings": self.warnings,
            "notes": self.notes,
        }


def inspect_checkpoint(path: str | Path, against: str | Path | None = None) -> dict[str, Any]:
    """The report of ``parity inspect PATH [--against FLOAT]`` as plain data (the --json output)."""
    return Inspection(path, against).run()
