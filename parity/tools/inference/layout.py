"""The checkpoint's layout: which tensors belong to which projection, and how each is stored.

config.json's architecture gives every projection's logical ``(N, K)``; its tensors are the checkpoint's
``<module>.<suffix>`` keys. Each registered format is asked whether they look like it (the most specific
first); a projection no format claims is float when it has a float weight of shape ``(N, K)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_parity.errors import CheckpointError
from vllm_parity.reference.checkpoint import Checkpoint, linear_shapes
from vllm_parity.tools.inference import registry


@dataclass
class Matrix:
    """One linear projection of the checkpoint and how it is stored (a format may add its own fields)."""

    module: str
    n: int
    k: int
    kind: str  # a registered quant_method | float | missing | unknown
    keys: dict[str, str] = field(default_factory=dict)  # role or suffix -> checkpoint key
    stored_shape: tuple[int, ...] | None = None
    problems: list[str] = field(default_factory=list)


def fmt_shape(shape) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ")"


def scan(ckpt: Checkpoint, shapes: dict[str, tuple[int, int]], declared: Any) -> tuple[list[Matrix], dict[str, str]]:
    """Classify every projection (from its tensors' headers alone) and give each tensor a role."""
    by_module: dict[str, dict[str, str]] = {}
    for key in ckpt.tensors:
        module, _, suffix = key.rpartition(".")
        by_module.setdefault(module, {})[suffix] = key
    roles: dict[str, str] = {}
    matrices = []
    for module, (n, k) in shapes.items():
        entries = by_module.get(module, {})
        if not entries:
            m = Matrix(module, n, k, "missing")
            m.problems.append(f"{module}: no tensor in the checkpoint (expected {module}.<suffix>)")
            matrices.append(m)
            continue
        info = {s: ckpt.tensors[key] for s, key in entries.items()}
        matrices.append(_claimed(module, n, k, entries, info, declared, roles)
                        or _float(module, n, k, entries, info, roles))
    for key in ckpt.tensors:
        roles.setdefault(key, "float" if ckpt.tensors[key].dtype.is_floating_point else "other")
    return matrices, roles


def _claimed(module: str, n: int, k: int, entries: dict[str, str], info: dict[str, Any], declared: Any,
             roles: dict) -> Matrix | None:
    for fmt in registry.by_specificity():
        m = fmt.scan(module, n, k, entries, info, declared, roles)
        if m is not None:
            return m
    return None


def _float(module: str, n: int, k: int, entries: dict[str, str], info: dict[str, Any], roles: dict) -> Matrix:
    m = Matrix(module, n, k, "unknown")
    weights = [s for s, i in info.items() if i.dtype.is_floating_point and i.shape == (n, k)]
    if weights:
        s = "weight" if "weight" in weights else sorted(weights)[0]
        m.kind = "float"
        m.keys["weight"] = entries[s]
        m.stored_shape = (n, k)
        roles[entries[s]] = "float weight"
        return m
    found = ", ".join(f"{s} {fmt_shape(i.shape)} {str(i.dtype).removeprefix('torch.')}"
                      for s, i in sorted(info.items()))
    formats = "".join(f"{f.looks_like}, " for f in registry.registered())
    m.problems.append(f"{module}: neither {formats}nor a float weight of shape ({n}, {k}); found {found}")
    return m


def open_against(path: str | Path, ckpt: Checkpoint, shapes: dict[str, tuple[int, int]],
                 matrices: list[Matrix]) -> Checkpoint:
    """The float checkpoint, checked up front: same architecture, a float ``<module>.weight`` per matrix."""
    fck = Checkpoint(path)
    if fck.spec is not None:
        raise CheckpointError(
            f"{fck.path}: declares a quantization_config ({fck.spec.quant_method}); --against needs a float "
            f"checkpoint holding the dequantized weights under <module>.weight")
    if not shapes:
        raise CheckpointError(f"{ckpt.path}: config.json has no Llama architecture fields, so the float "
                              f"weights cannot be matched to projections")
    try:
        theirs = linear_shapes(fck.config)
    except CheckpointError as exc:
        raise CheckpointError(f"{fck.path}: {exc}") from None
    for module, shape in shapes.items():
        if theirs.get(module) != shape:
            got = theirs.get(module)
            raise CheckpointError(
                f"{fck.path}: architecture does not match {ckpt.path}: {module} is "
                f"{'absent' if got is None else fmt_shape(got)} there but {fmt_shape(shape)} here "
                f"(compare hidden_size, intermediate_size, num_*_heads, num_hidden_layers in both config.json)")
    for m in matrices:
        if registry.get(m.kind) is None:
            continue
        key = f"{m.module}.weight"
        if key not in fck:
            raise CheckpointError(f"{fck.path}: float weight {key!r} is missing (needed to check {m.module})")
        info = fck.info(key)
        if not info.dtype.is_floating_point:
            raise CheckpointError(f"{fck.path}: {key!r} is {str(info.dtype).removeprefix('torch.')}, not a "
                                  f"float weight: --against needs the dequantized float checkpoint")
        if info.shape != (m.n, m.k):
            raise CheckpointError(f"{fck.path}: {key!r} has shape {fmt_shape(info.shape)}, but {m.module} is "
                                  f"({m.n}, {m.k}) in {ckpt.path}/config.json")
    return fck
