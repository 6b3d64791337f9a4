"""The canonical tap vocabulary: levels, layers, the dataflow between taps, and how a tap's tensor is
taken from what a hook sees.

Where each tap sits on either side is architecture data (:mod:`vllm_parity.architectures`). Every
taken tensor has the token axis first and features last; adapters turn tokens into ``(prompt, position)``.
"""

from __future__ import annotations

import fnmatch
import re
from typing import Any, Callable, Mapping

import torch
from torch import nn

from vllm_parity.architectures import Architecture, TapPoint, lookup

LLAMA = "llama"


def _first(x: Any) -> torch.Tensor:
    return x[0] if isinstance(x, (tuple, list)) else x


def _hidden_plus_residual(x: Any) -> torch.Tensor:
    hs, residual = x[0], x[1]
    return hs if residual is None else hs + residual


def _times_sqrt_width(t: torch.Tensor) -> torch.Tensor:
    return t * torch.tensor(t.shape[-1] ** 0.5, dtype=t.dtype)  # in the tensor's dtype, as both sides scale


def _part(j: int) -> Callable[[Any, nn.Module], torch.Tensor]:
    def take(x: Any, module: nn.Module) -> torch.Tensor:
        return _first(x).split(list(module.output_partition_sizes), dim=-1)[j]  # this rank's slices
    return take


# take(seen, module): ``seen`` is the hook's output, or its positional args for input hooks.
TAKE: dict[str, Callable[[Any, nn.Module], torch.Tensor]] = {
    "first": lambda x, module: _first(x),
    "arg0": lambda x, module: x[0],
    # a per-head norm's output, [..., heads, head_dim] (token-major) or [batch, heads, tokens, head_dim]
    "heads_flat": lambda x, module: _first(x).flatten(-2),
    "heads_first_flat": lambda x, module: _first(x).transpose(-3, -2).flatten(-2),
    # the model's own output logits (a final soft cap applied after the output embedding)
    "logits_attr": lambda x, module: x.logits,
    # a projection of a single-head latent, [batch, 1, tokens, features] (MiniCPM3's kv_b_proj)
    "one_head": lambda x, module: _first(x).squeeze(-3),
    # an embedding scaled by the square root of its width outside its module
    "times_sqrt_width": lambda x, module: _times_sqrt_width(_first(x)),
    "hidden_plus_residual": lambda x, module: _hidden_plus_residual(x),
    "hidden_plus_residual_args": lambda x, module: _hidden_plus_residual(x[1:3]),
    **{f"part.{j}": _part(j) for j in range(8)},
    # a projection transformers fuses too (Phi3's gate_up_proj): its halves, as its modeling code chunks it
    **{f"halves.{j}": (lambda x, module, j=j: _first(x).chunk(2, dim=-1)[j]) for j in range(2)},
}


def _qkv(j: int) -> Callable[[Any], Callable[[Any, nn.Module], torch.Tensor]]:
    def of(config: Any) -> Callable[[Any, nn.Module], torch.Tensor]:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        sizes = [config.num_attention_heads * head_dim] + 2 * [config.num_key_value_heads * head_dim]
        return lambda x, module: _first(x).split(sizes, dim=-1)[j]
    return of


def _times_scale_emb(config: Any) -> Callable[[Any, nn.Module], torch.Tensor]:
    return lambda x, module: _first(x) * config.scale_emb


# takes that read the model's config: Phi3's qkv_proj on transformers' side (q, k, v by the config's heads);
# MiniCPM's embedding, which vLLM scales by scale_emb after its module
CONFIG_TAKES: dict[str, Callable[[Any], Callable[[Any, nn.Module], torch.Tensor]]] = {
    **{f"qkv.{j}": _qkv(j) for j in range(3)},
    "times_scale_emb": _times_scale_emb,
}


def take_for(name: str, config: Any) -> Callable[[Any, nn.Module], torch.Tensor]:
    """The take of ``name``: a key of TAKE, or of CONFIG_TAKES (made for ``config``, the model's)."""
    if name in CONFIG_TAKES:
        return CONFIG_TAKES[name](config)
    if name not in TAKE:
        raise KeyError(f"no take {name!r}; the takes are {sorted(TAKE) + sorted(CONFIG_TAKES)}")
    return TAKE[name]


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


def as_mapping(config: Any) -> Mapping[str, Any] | None:
    """config.json's keys, from the dict itself or a model's config object."""
    return config if config is None or isinstance(config, Mapping) else config.to_dict()


def expand(points: tuple[TapPoint, ...], num_layers: int, config: Any = None) -> list[tuple[str, TapPoint, str]]:
    """(canonical tap, point, module path) for every layer, in forward order; a row that exists on some
    layers only (``TapPoint.layers``) is kept on those of ``config`` (on every layer without one)."""
    config = as_mapping(config)
    out = []
    for p in points:
        if "{i}" in p.tap:
            continue
        if p.tap == "embed":
            out.append((p.tap, p, p.module))
    for i in range(num_layers):
        for p in points:
            if "{i}" in p.tap and (p.layers is None or config is None or p.layers(config, i)):
                out.append((p.tap.format(i=i), p, p.module.format(i=i)))
    for p in points:
        if "{i}" not in p.tap and p.tap != "embed":
            out.append((p.tap, p, p.module))
    return out


def canonical_order(num_layers: int, arch: Architecture | None = None, config: Any = None) -> list[str]:
    """Every tap in forward order (``arch``: Llama's taps when None; ``config``: the model's, for taps of
    some layers only)."""
    return [tap for tap, _, _ in expand((arch or lookup(LLAMA)).taps, num_layers, config)]


def select(taps: list[str], pattern: str | None) -> list[str]:
    return taps if not pattern else [t for t in taps if fnmatch.fnmatchcase(t, pattern)]
