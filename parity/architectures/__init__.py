"""Architectures as data: where each canonical tap sits in transformers' modeling code, and what vLLM does
differently, per ``model_type``.

An architecture is one module of this package holding one :class:`Architecture` (found by name at first
use), or one registered with :func:`register` from anywhere. It lists the taps on transformers' modules
and the decoder layer's dataflow; the vLLM side is derived: a projection that vLLM fuses (its model's
``packed_modules_mapping``) is read as its slice of the fused layer's ``output_partition_sizes``, and the
decoder layers follow vLLM's ``(hidden_states, residual)`` convention unless the architecture says
otherwise (``serving``).
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping

from vllm_parity.errors import ParityInputError


@dataclass(frozen=True)
class TapPoint:
    tap: str  # canonical name; "{i}" is the decoder layer index
    module: str  # module path on that side; "{i}" likewise
    hook: str  # "input" (the forward pre-hook's arguments) or "output" (the forward hook's result)
    take: str = "first"  # how the tensor is taken from what the hook sees (harness.taps.TAKE)
    # only on the decoder layers i where layers(config, i) holds (config: config.json's keys), where a family
    # mixes layer kinds (Qwen3-MoE's dense and sparse layers); a module-level function, so that it pickles
    layers: Callable[[Mapping[str, Any], int], bool] | None = None


# What each tap of a pre-norm decoder layer (Llama and its kin) is computed from: a failing tap whose
# inputs all pass is a source.
PRE_NORM_DECODER: Mapping[str, tuple[str, ...]] = {
    "attn.norm": ("input",), "attn.q": ("attn.norm",), "attn.k": ("attn.norm",), "attn.v": ("attn.norm",),
    "attn.context": ("attn.q", "attn.k", "attn.v"), "attn.o": ("attn.context",),
    "mlp.norm": ("input", "attn.o"), "mlp.gate": ("mlp.norm",), "mlp.up": ("mlp.norm",),
    "mlp.act": ("mlp.gate", "mlp.up"), "mlp.down": ("mlp.act",), "output": ("input", "attn.o", "mlp.down"),
}

# vLLM's decoder layers take and return (hidden_states, residual) with the residual add deferred to the
# next norm, and its logits come from the logits processor.
VLLM_DECODER: Mapping[str, TapPoint] = {
    "layers.{i}.input": TapPoint("layers.{i}.input", "model.layers.{i}", "input", "hidden_plus_residual_args"),
    "layers.{i}.output": TapPoint("layers.{i}.output", "model.layers.{i}", "output", "hidden_plus_residual"),
    "logits": TapPoint("logits", "logits_processor", "output"),
}

_LAYER_TAP = re.compile(r"^layers\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class Architecture:
    model_type: str  # config.json's model_type
    taps: tuple[TapPoint, ...]  # on transformers' modules (the reference), in forward order
    layer_inputs: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: dict(PRE_NORM_DECODER))
    serving: Mapping[str, TapPoint] = field(default_factory=lambda: dict(VLLM_DECODER))
    # config.json keys of a tiny checkpoint of this family beyond the ones every family shares
    # (vllm_parity.fixtures.checkpoints.Dims): its transformers class, its own switches.
    fixture_config: Mapping[str, Any] = field(default_factory=dict)
    # what the norms' stored weight w scales by: offset + w (Gemma's norms store w for 1 + w)
    norm_offset: float = 0.0
    # the vLLM model's attribute dividing the final norm's output in its forward, before compute_logits
    # (MiniCPM's scale_width)
    logits_divisor: str | None = None
    # module path components that vLLM names otherwise (Mixtral's ``mlp`` is ``block_sparse_moe`` there, as
    # in its checkpoints)
    renames: Mapping[str, str] = field(default_factory=dict)
    # linears vLLM builds without the quantization config (Qwen2-MoE's shared_expert_gate): a quantized
    # checkpoint stores them float, in its format's ignore list
    float_modules: tuple[str, ...] = ()

    def serving_points(self, packed_modules_mapping: Mapping[str, list[str]]) -> tuple[TapPoint, ...]:
        """The taps on vLLM's modules: the rows of ``serving``, fused projections read from their slice,
        modules renamed by ``renames``."""
        fused_of = {leaf: (fused, j) for fused, leaves in packed_modules_mapping.items()
                    for j, leaf in enumerate(leaves)}
        out = []
        for p in self.taps:
            if p.tap in self.serving:
                out.append(self.serving[p.tap])
                continue
            parent, _, leaf = ".".join(self.renames.get(c, c) for c in p.module.split(".")).rpartition(".")
            if p.take.startswith(("qkv.", "halves.")):  # fused on both sides: vLLM's slices of the same layer
                out.append(replace(p, module=f"{parent}.{leaf}", take=f"part.{p.take.rsplit('.', 1)[1]}"))
            elif p.hook == "output" and leaf in fused_of:
                fused, j = fused_of[leaf]
                out.append(replace(p, module=f"{parent}.{fused}", take=f"part.{j}"))
            else:
                out.append(replace(p, module=f"{parent}.{leaf}" if parent else leaf))
        return tuple(out)

    def fused_groups(self, packed_modules_mapping: Mapping[str, list[str]]) -> list[list[str]]:
        """The taps computed by one fused vLLM layer, each group in the order of its output's slices
        (``{i}`` kept as a pattern)."""
        by_module: dict[str, list[tuple[int, str]]] = {}
        for p in self.serving_points(packed_modules_mapping):
            if p.take.startswith("part."):
                by_module.setdefault(p.module, []).append((int(p.take[5:]), p.tap))
        return [[tap for _, tap in sorted(group)] for group in by_module.values()]

    def point(self, tap: str) -> tuple[TapPoint, str] | None:
        """The reference row of a concrete tap and its module path."""
        m = _LAYER_TAP.match(tap)
        for p in self.taps:
            if m and p.tap == f"layers.{{i}}.{m.group(2)}":
                return p, p.module.format(i=m.group(1))
            if p.tap == tap:
                return p, p.module
        return None

    def projection(self, tap: str, linears) -> tuple[str, str] | None:
        """(module path, the tap holding its input) when ``tap`` is the output of one of ``linears`` (the
        checkpoint's linear modules); None for any other tap."""
        found, m = self.point(tap), _LAYER_TAP.match(tap)
        if found is None or m is None:
            return None
        p, module = found
        inputs = self.layer_inputs.get(m.group(2), ())
        if p.hook != "output" or p.take != "first" or module not in linears or len(inputs) != 1:
            return None
        return module, f"layers.{m.group(1)}.{inputs[0]}"


_REGISTRY: dict[str, Architecture] = {}


def register(arch: Architecture) -> Architecture:
    """Make ``arch`` known under its ``model_type`` (replacing one of the same name)."""
    _REGISTRY[arch.model_type] = arch
    return arch


def _discover() -> None:
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        for value in vars(module).values():
            if isinstance(value, Architecture) and value.model_type not in _REGISTRY:
                register(value)


def known() -> list[str]:
    _discover()
    return sorted(_REGISTRY)


def lookup(model_type: str | None, where: str = "config.json") -> Architecture:
    """The architecture of ``model_type``; an unknown one is a ParityInputError saying how to add it."""
    if model_type in _REGISTRY:
        return _REGISTRY[model_type]
    names = known()
    if model_type in _REGISTRY:
        return _REGISTRY[model_type]
    raise ParityInputError(
        f"{where}: model_type {model_type!r} is not an architecture the harness knows (known: {names}); "
        f"add one as a module of vllm_parity.architectures (or call vllm_parity.architectures.register) holding "
        f"an Architecture: its taps on transformers' modules, and what vLLM does differently")


def of_config(config: Mapping, where: str = "config.json") -> Architecture:
    return lookup(config.get("model_type"), where)
