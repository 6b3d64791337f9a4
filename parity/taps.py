"""The canonical tap map: one vocabulary for the reference (transformers) and vLLM, as data.

Each row names a canonical tap, the module whose hook yields it, which side of the call it reads
(``input`` = the forward pre-hook's arguments, ``output`` = the forward hook's result) and how the
tensor is taken from what the hook sees (``take``, a key of :data:`TAKE`). Every taken tensor has
the token axis first and features last; adapters turn tokens into ``(prompt, position)``.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass(frozen=True)
class TapPoint:
    tap: str  # canonical name; "{i}" is the decoder layer index
    module: str  # module path on that side; "{i}" likewise
    hook: str  # "input" or "output"
    take: str = "first"


HF_LLAMA: tuple[TapPoint, ...] = (
    TapPoint("embed", "model.embed_tokens", "output"),
    TapPoint("layers.{i}.input", "model.layers.{i}", "input", "arg0"),
    TapPoint("layers.{i}.attn.norm", "model.layers.{i}.input_layernorm", "output"),
    TapPoint("layers.{i}.attn.q", "model.layers.{i}.self_attn.q_proj", "output"),
    TapPoint("layers.{i}.attn.k", "model.layers.{i}.self_attn.k_proj", "output"),
    TapPoint("layers.{i}.attn.v", "model.layers.{i}.self_attn.v_proj", "output"),
    TapPoint("layers.{i}.attn.context", "model.layers.{i}.self_attn.o_proj", "input", "arg0"),
    TapPoint("layers.{i}.attn.o", "model.layers.{i}.self_attn.o_proj", "output"),
    TapPoint("layers.{i}.mlp.norm", "model.layers.{i}.post_attention_layernorm", "output"),
    TapPoint("layers.{i}.mlp.gate", "model.layers.{i}.mlp.gate_proj", "output"),
    TapPoint("layers.{i}.mlp.up", "model.layers.{i}.mlp.up_proj", "output"),
    TapPoint("layers.{i}.mlp.act", "model.layers.{i}.mlp.down_proj", "input", "arg0"),
    TapPoint("layers.{i}.mlp.down", "model.layers.{i}.mlp.down_proj", "output"),
    TapPoint("layers.{i}.output", "model.layers.{i}", "output"),
    TapPoint("final_norm", "model.norm", "output"),
    TapPoint("logits", "lm_head", "output"),
)

# vLLM's Llama: fused qkv / gate_up projections, (output, bias) pairs from linears, and decoder
# layers that pass (hidden_states, residual) with the residual add deferred to the next norm.
VLLM_LLAMA: tuple[TapPoint, ...] = (
    TapPoint("embed", "model.embed_tokens", "output"),
    TapPoint("layers.{i}.input", "model.layers.{i}", "input", "hidden_plus_residual_args"),
    TapPoint("layers.{i}.attn.norm", "model.layers.{i}.input_layernorm", "output"),
    TapPoint("layers.{i}.attn.q", "model.layers.{i}.self_attn.qkv_proj", "output", "qkv.q"),
    TapPoint("layers.{i}.attn.k", "model.layers.{i}.self_attn.qkv_proj", "output", "qkv.k"),
    TapPoint("layers.{i}.attn.v", "model.layers.{i}.self_attn.qkv_proj", "output", "qkv.v"),
    TapPoint("layers.{i}.attn.context", "model.layers.{i}.self_attn.o_proj", "input", "arg0"),
    TapPoint("layers.{i}.attn.o", "model.layers.{i}.self_attn.o_proj", "output"),
    TapPoint("layers.{i}.mlp.norm", "model.layers.{i}.post_attention_layernorm", "output"),
    TapPoint("layers.{i}.mlp.gate", "model.layers.{i}.mlp.gate_up_proj", "output", "halves.0"),
    TapPoint("layers.{i}.mlp.up", "model.layers.{i}.mlp.gate_up_proj", "output", "halves.1"),
    TapPoint("layers.{i}.mlp.act", "model.layers.{i}.mlp.down_proj", "input", "arg0"),
    TapPoint("layers.{i}.mlp.down", "model.layers.{i}.mlp.down_proj", "output"),
    TapPoint("layers.{i}.output", "model.layers.{i}", "output", "hidden_plus_residual"),
    TapPoint("final_norm", "model.norm", "output"),
    TapPoint("logits", "logits_processor", "output"),
)

# How the tensor-parallel ranks' tensors of a tap combine, keyed by the tap without "layers.{i}.":
# column-parallel outputs are shards along features (k/v shards repeat when kv heads < ranks);
# everything else is replicated or already reduced, and rank 0 holds it whole.
TP_GATHER = {"attn.q": "column", "attn.k": "column_kv", "attn.v": "column_kv", "attn.context": "column",
             "mlp.gate": "column", "mlp.up": "column", "mlp.act": "column"}

FAMILIES = {"llama": {"hf": HF_LLAMA, "vllm": VLLM_LLAMA}}


def _first(x: Any) -> torch.Tensor:
    return x[0] if isinstance(x, (tuple, list)) else x


def _hidden_plus_residual(x: Any) -> torch.Tensor:
    hs, residual = x[0], x[1]
    return hs if residual is None else hs + residual


def _qkv(part: int) -> Callable[[Any, dict], torch.Tensor]:
    def take(x: Any, sizes: dict) -> torch.Tensor:
        return _first(x).split([sizes["q"], sizes["kv"], sizes["kv"]], dim=-1)[part]
    return take


def _half(part: int) -> Callable[[Any, dict], torch.Tensor]:
    def take(x: Any, sizes: dict) -> torch.Tensor:
        return _first(x).chunk(2, dim=-1)[part]
    return take


# take(seen, sizes): ``seen`` is the hook's output, or its positional args for input hooks.
TAKE: dict[str, Callable[[Any, dict], torch.Tensor]] = {
    "first": lambda x, sizes: _first(x),
    "arg0": lambda x, sizes: x[0],
    "hidden_plus_residual": lambda x, sizes: _hidden_plus_residual(x),
    "hidden_plus_residual_args": lambda x, sizes: _hidden_plus_residual(x[1:3]),
    "qkv.q": _qkv(0), "qkv.k": _qkv(1), "qkv.v": _qkv(2),
    "halves.0": _half(0), "halves.1": _half(1),
}

# What each tap computes from (within a layer): a failing tap whose inputs all pass is a source.
_LAYER_INPUTS = {
    "attn.norm": ("input",), "attn.q": ("attn.norm",), "attn.k": ("attn.norm",), "attn.v": ("attn.norm",),
    "attn.context": ("attn.q", "attn.k", "attn.v"), "attn.o": ("attn.context",),
    "mlp.norm": ("input", "attn.o"), "mlp.gate": ("mlp.norm",), "mlp.up": ("mlp.norm",),
    "mlp.act": ("mlp.gate", "mlp.up"), "mlp.down": ("mlp.act",), "output": ("input", "attn.o", "mlp.down"),
}

# Op taps that are a projection's output: (module under "model.layers.{i}.", the tap holding its input),
# and the taps computed from the same fused vLLM layer.
PROJECTION_OF = {
    "attn.q": ("self_attn.q_proj", "attn.norm"), "attn.k": ("self_attn.k_proj", "attn.norm"),
    "attn.v": ("self_attn.v_proj", "attn.norm"), "attn.o": ("self_attn.o_proj", "attn.context"),
    "mlp.gate": ("mlp.gate_proj", "mlp.norm"), "mlp.up": ("mlp.up_proj", "mlp.norm"),
    "mlp.down": ("mlp.down_proj", "mlp.act"),
}
FUSED_WITH = {"attn.q": ("attn.k", "attn.v"), "attn.k": ("attn.q", "attn.v"), "attn.v": ("attn.q", "attn.k"),
              "mlp.gate": ("mlp.up",), "mlp.up": ("mlp.gate",)}

LEVEL_OP, LEVEL_BLOCK, LEVEL_MODEL = "op", "block", "model"
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


def level_of(tap: str) -> str:
    """op: operators and norms inside a layer (and the embedding); block: a layer's output; model: the rest."""
    m = _LAYER.match(tap)
    if m:
        return LEVEL_BLOCK if m.group(2) in ("output", "input") else LEVEL_OP
    return LEVEL_OP if tap == "embed" else LEVEL_MODEL


def inputs_of(tap: str, num_layers: int) -> list[str]:
    """The taps whose values ``tap`` is computed from."""
    m = _LAYER.match(tap)
    if m:
        i, part = int(m.group(1)), m.group(2)
        if part == "input":
            return ["embed"] if i == 0 else [f"layers.{i - 1}.output"]
        return [f"layers.{i}.{p}" for p in _LAYER_INPUTS[part]]
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


def canonical_order(num_layers: int) -> list[str]:
    return [tap for tap, _, _ in expand(HF_LLAMA, num_layers)]


def select(taps: list[str], pattern: str | None) -> list[str]:
    return taps if not pattern else [t for t in taps if fnmatch.fnmatchcase(t, pattern)]
