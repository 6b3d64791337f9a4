"""The canonical tap vocabulary: levels, layers, the dataflow between taps, and how a tap's tensor is
taken from what a hook sees.

Where each tap sits on either side is architecture data (:mod:`vllm_parity.architectures`). Every
taken tensor has the token axis first and features last; adapters turn tokens into ``(prompt, position)``.
"""

from __future__ import annotations

import fnmatch
import re
from typing import Any, Callable

import torch
from torch import nn

from vllm_parity.architectures import Architecture, TapPoint, lookup

LLAMA = "llama"


def _first(x: Any) -> torch.Tensor:
    return x[0] if isinstance(x, (tuple, list)) else x


def _hidden_plus_residual(x: Any) -> torch.Tensor:
    hs, residual = x[0], x[1]
    return hs if residual is None else hs + residual


def _part(j: int) -> Callable[[Any, nn.Module], torch.Tensor]:
    def take(x: Any, module: nn.Module) -> torch.Tensor:
        return _first(x).split(list(module.output_partition_sizes), dim=-1)[j]  # this rank's slices
    return take


# take(seen, module): ``seen`` is the hook's output, or its positional args for input hooks.
TAKE: dict[str, Callable[[Any, nn.Module], torch.Tensor]] = {
    "first": lambda x, module: _first(x),
    "arg0": lambda x, module: x[0],
    "hidden_plus_residual": lambda x, module: _hidden_plus_residual(x),
    "hidden_plus_residual_args": lambda x, module: _hidden_plus_residual(x[1:3]),
    **{f"part.{j}": _part(j) for j in range(8)},
}

LEVEL_OP, LEVEL_BLOCK, LEVEL_MODEL = "op", "block", "model"
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


def level_of(tap: str) -> str:
    """op: operators and norms inside a layer (and the embedding); block: a layer's output; model: the rest."""
    m = _LAYER.match(tap)
    if m:
        return LEVEL_BLOCK if m.group(2) in ("output", "input") else LEVEL_OP
    return LEVEL_OP if tap == "embed" else LEVEL_MODEL


def inputs_of(tap: str, num_layers: int, arch: Architecture | None = None) -> list[str]:
    """The taps whose values ``tap`` is computed from (``arch``: Llama's dataflow when None)."""
    m = _LAYER.match(tap)
    if m:
        i, part = int(m.group(1)), m.group(2)
        if part == "input":
            return ["embed"] if i == 0 else [f"layers.{i - 1}.output"]
        return [f"layers.{i}.{p}" for p in (arch or lookup(LLAMA)).layer_inputs[part]]
    if tap == "final_norm":
        return [f"layers.{num_layers - 1}.output"]
    if tap == "logits":
        return ["final_norm"]
    return []


def layer_of(tap: str) -> int | None:
    m = _LAYER.match(tap)
    return int(m.group(1)) if m else None


def expand(points: tuple[TapPoint, ...], num_layers: int) -> list[tuple[str, TapPoint, str]]:
    """(canonical tap, point, module path) for every layer, in forward order."""
    out = []
    for p in points:
        if "{i}" in p.tap:
            continue
        if p.tap == "embed":
            out.append((p.tap, p, p.module))
    for i in range(num_layers):
        for p in points:
            if "{i}" in p.tap:
                out.append((p.tap.format(i=i), p, p.module.format(i=i)))
    for p in points:
        if "{i}" not in p.tap and p.tap != "embed":
            out.append((p.tap, p, p.module))
    return out


def canonical_order(num_layers: int, arch: Architecture | None = None) -> list[str]:
    """Every tap in forward order (``arch``: Llama's taps when None)."""
    return [tap for tap, _, _ in expand((arch or lookup(LLAMA)).taps, num_layers)]


def select(taps: list[str], pattern: str | None) -> list[str]:
    return taps if not pattern else [t for t in taps if fnmatch.fnmatchcase(t, pattern)]
