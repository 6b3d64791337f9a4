"""The vLLM mapping: checkpoint key -> vLLM parameter, the merge into fused layers, the tensor-parallel split.

What depends on how a quantized tensor is stored (packed rows, per-shard scale slots, unsliceable
streams) its format adds through ``Format.stacked_row`` and ``Format.row_parallel_row``.
"""

from __future__ import annotations

import re
from typing import Any

from vllm_parity.tools.inference import registry
from vllm_parity.tools.inference.layout import Matrix

_LINEAR_KEY = re.compile(r"^(?P<prefix>model\.layers\.\d+\.(?:self_attn|mlp))\.(?P<proj>[a-z]+_proj)\.(?P<suffix>[^.]+)$")
_STACKED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
            "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
_SHARDS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_ROW_PARALLEL = ("o_proj", "down_proj")
# one tensor per expert on disk, one slice of FusedMoE's w13 (w1, w3) or w2 per expert in vLLM
_EXPERT_KEY = re.compile(r"^(?P<experts>model\.layers\.\d+\.[a-z_]+\.experts)\.(?P<e>\d+)\.(?P<proj>[a-z0-9_]+)"
                         r"\.(?P<suffix>[^.]+)$")
_EXPERT_SHARDS = {"w1": "w1", "gate_proj": "w1", "w3": "w3", "up_proj": "w3", "w2": "w2", "down_proj": "w2"}
_FUSED_ON_DISK = tuple(f".{fused}" for fused in _SHARDS)  # Phi3's q/k/v and gate/up, stored fused


def vllm_mapping(keys: list[str], shapes: dict[str, tuple[int, int]], matrices: dict[str, Matrix],
                 roles: dict[str, str], values: dict[str, Any], params: set[str] | None = None,
                 model_type: str | None = None) -> list[dict[str, Any]]:
    """checkpoint key -> vLLM parameter, with the merge into fused layers and the tensor-parallel split.

    ``values``: the resolved quantization_config keys of the checkpoint's format (empty when it has none).
    ``params``: the parameter names of transformers' model of the checkpoint (``model_type``): a key among
    them that no rule below merges or splits is loaded as is.
    """
    params = params or set()
    rows_out = []
    for key in keys:
        row: dict[str, Any] = {"checkpoint_key": key, "vllm_param": key, "op": "as is", "shard": None,
                               "rows": None, "packed_rows": None, "slot": None, "tp_split": None,
                               "transpose": False, "note": None}
        rows_out.append(row)
        role = roles.get(key, "")
        mt = _LINEAR_KEY.match(key)
        if mt and (mt["proj"] in _STACKED or mt["proj"] in _ROW_PARALLEL):
            module = f"{mt['prefix']}.{mt['proj']}"
            m = matrices.get(module)
            if mt["proj"] in _STACKED:
                _stacked_row(row, mt, m, role, shapes, values)
            else:
                _row_parallel_row(row, m, role)
        elif (me := _EXPERT_KEY.match(key)) and me["proj"] in _EXPERT_SHARDS:
            shard = _EXPERT_SHARDS[me["proj"]]
            row.update(vllm_param=f"{me['experts']}.{'w2' if shard == 'w2' else 'w13'}_{me['suffix']}", op="merge",
                       shard=shard, note=f"expert {me['e']}")
            # both split the intermediate axis; the plugin's methods decode each expert whole first
            row["tp_split"] = ("dim 1" if shard == "w2" else "dim 0") + (" after decoding" if values else "")
        elif key == "model.embed_tokens.weight" or key.startswith("lm_head."):
            row["tp_split"] = "dim 0 (vocab)"
        elif "norm" in key.rpartition(".")[0]:
            row["tp_split"] = "replicated"
        elif key.rpartition(".")[0] in shapes and key.rpartition(".")[0].endswith(_FUSED_ON_DISK):
            row["tp_split"] = "dim 0"  # vLLM's fused layer shards each of its parts
        elif key not in params:
            row["note"] = f"not a parameter of transformers' {model_type} model: vLLM's loader skips or rejects it"
    return rows_out


def _stacked_row(row, mt, m, role, shapes, values) -> None:
    fused, shard = _STACKED[mt["proj"]]
    row["vllm_param"] = f"{mt['prefix']}.{fused}.{mt['suffix']}"
    row["op"] = "merge"
    row["shard"] = shard
    members = _SHARDS[fused]
    start = 0
    for member in members:
        size = shapes.get(f"{mt['prefix']}.{member}", (0, 0))[0]
        if member == mt["proj"]:
            row["rows"] = [start, start + size]
            break
        start += size
    row["tp_split"] = "dim 0"
    fmt = registry.get(m.kind) if m is not None else None
    if fmt is not None:
        fmt.stacked_row(row, m, role, members.index(mt["proj"]), values)


def _row_parallel_row(row, m, role) -> None:
    row["tp_split"] = "dim 1"
    fmt = registry.get(m.kind) if m is not None else None
    if fmt is not None:
        fmt.row_parallel_row(row, m, role)
