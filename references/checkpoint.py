"""Reading checkpoint directories of FORMATS.md: config, format, safetensors tensors, never pickle.

Every tensor is read lazily from its file; headers are validated up front so that a truncated or
corrupt file is reported with its name and the tensor it breaks, not as a traceback from deep inside
a loader.
"""

from __future__ import annotations

import functools
import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from vllm_parity.errors import CheckpointError
from vllm_parity.reference.formats import FormatSpec, parse_quantization_config

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
PROJECTIONS = {
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
             "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """Validate one safetensors file's header against its size, as the format defines it (every entry a
    dtype, a shape of non-negative ints and the byte range it fills; the ranges tiling the data section);
    return its tensors' info."""
    try:
        size = path.stat().st_size
        with path.open("rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: not a safetensors file (only {size} bytes, no header length)")
            (hlen,) = struct.unpack("<Q", head)
            if hlen > size - 8:
                raise CheckpointError(
                    f"{path}: truncated or not safetensors: header claims {hlen} bytes but the file "
                    f"holds {size - 8} after the length field")
            raw = fh.read(hlen)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read: {exc}") from exc
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise CheckpointError(f"{path}: corrupt safetensors header (not JSON: {exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    data_len = size - 8 - hlen
    out: dict[str, TensorInfo] = {}
    spans: list[tuple[int, int, str]] = []
    for name, entry in header.items():
        if name == "__metadata__":
            _check_metadata(path, entry)
            continue
        dtype_s, shape, start, end = _entry(path, name, entry)
        numel = math.prod(shape)
        if end - start != numel * _ITEMSIZE[dtype_s]:
            raise CheckpointError(
                f"{path}: corrupt header: tensor {name!r} of shape {shape} {dtype_s} spans bytes "
                f"[{start}, {end}), expected {numel * _ITEMSIZE[dtype_s]} bytes")
        if end > data_len:
            raise CheckpointError(
                f"{path}: truncated: tensor {name!r} needs bytes [{start}, {end}) of the data section "
                f"but the file holds only {data_len}")
        spans.append((start, end, name))
        out[name] = TensorInfo(name, path, _DTYPES[dtype_s], tuple(shape))
    _check_tiling(path, spans, data_len)
    return out


def _entry(path: Path, name: str, entry: Any) -> tuple[str, list[int], int, int]:
    """One tensor's header entry, checked for its keys and their JSON types."""
    where = f"{path}: corrupt header entry for tensor {name!r}"
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise CheckpointError(f"{where}: expected an object of dtype, shape and data_offsets, got "
                              f"{_short(entry)}")
    dtype_s, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype_s, str) or dtype_s not in _DTYPES:
        raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {_short(dtype_s)} "
                              f"(known: {', '.join(_DTYPES)})")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise CheckpointError(f"{where}: shape must be a list of non-negative integers, got {_short(shape)}")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets):
        raise CheckpointError(f"{where}: data_offsets must be [begin, end], two non-negative integers, got "
                              f"{_short(offsets)}")
    start, end = offsets
    if end < start:
        raise CheckpointError(f"{where}: data_offsets [{start}, {end}] end before they begin")
    return dtype_s, shape, start, end


def _check_tiling(path: Path, spans: list[tuple[int, int, str]], data_len: int) -> None:
    """The tensors' byte ranges fill the data section without overlap or hole, as safetensors requires."""
    at, before = 0, None
    for start, end, name in sorted(spans):
        if start < at:
            raise CheckpointError(f"{path}: corrupt header: tensor {name!r} at bytes [{start}, {end}) overlaps "
                                  f"tensor {before!r}, which ends at byte {at}")
        if start > at:
            raise CheckpointError(f"{path}: corrupt header: no tensor covers bytes [{at}, {start}) of the data "
                                  f"section (before tensor {name!r}); safetensors leaves no holes")
        at, before = end, name
    if at != data_len:
        raise CheckpointError(f"{path}: corrupt header: the tensors cover {at} bytes of the data section, "
                              f"the file holds {data_len}")


def _check_metadata(path: Path, metadata: Any) -> None:
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"{path}: corrupt header: __metadata__ must map strings to strings, got "
                              f"{_short(metadata)}")


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _short(v: Any, limit: int = 120) -> str:
    text = repr(v)
    return text if len(text) <= limit else text[:limit] + "…"


class Checkpoint:
    """A Hugging Face style checkpoint directory: ``config.json`` plus safetensors files."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path}: not a checkpoint directory")
        self.config = self._read_config()
        self.tensors: dict[str, TensorInfo] = {}
        for file in self._weight_files():
            for name, info in read_safetensors_header(file).items():
                if name in self.tensors:
                    raise CheckpointError(
                        f"{file}: tensor {name!r} also stored in {self.tensors[name].file.name}")
                self.tensors[name] = info
        self._handles: dict[Path, Any] = {}

    @functools.cached_property
    def spec(self) -> FormatSpec | None:
        """The format, parsed on first use (so a broken config still lets the tensors be listed)."""
        return _parse_spec(self.config, self.path / "config.json")

    # -- reading ----------------------------------------------------------------------------

    def _read_config(self) -> dict[str, Any]:
        cfg_path = self.path / "config.json"
        if not cfg_path.is_file():
            raise CheckpointError(f"{self.path}: no config.json")
        try:
            cfg = json.loads(cfg_path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{cfg_path}: not valid JSON: {exc}") from None
        if not isinstance(cfg, dict):
            raise CheckpointError(f"{cfg_path}: must hold a JSON object")
        return cfg

    def _weight_files(self) -> list[Path]:
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                files = sorted({self.path / f for f in weight_map.values()})
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
                raise CheckpointError(f"{index}: not a valid safetensors index ({exc!r})") from None
            for f in files:
                if not f.is_file():
                    raise CheckpointError(f"{index}: names {f.name}, which does not exist")
            return files
        files = sorted(self.path.glob("*.safetensors"))
        if files:
            return files
        pickles = sorted(p.name for p in self.path.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise CheckpointError(
                f"{self.path}: only pickle weight files ({', '.join(pickles)}); pickle checkpoints are "
                f"refused because loading them can run arbitrary code — convert them to safetensors")
        raise CheckpointError(f"{self.path}: no *.safetensors weight files")

    def config_int(self, key: str) -> int:
        """A positive integer of config.json (``num_hidden_layers``, ``vocab_size``), or CheckpointError naming it."""
        where = self.path / "config.json"
        if key not in self.config:
            raise CheckpointError(f"{where}: lacks {key} (a positive integer)")
        value = self.config[key]
        if not _is_count(value) or value == 0:
            raise CheckpointError(f"{where}: {key} must be a positive integer, got {_short(value)}")
        return value

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def keys(self) -> list[str]:
        return sorted(self.tensors)

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise CheckpointError(f"{self.path}: tensor {name!r} is missing") from None

    def tensor(self, name: str) -> torch.Tensor:
        info = self.info(name)
        handle = self._handles.get(info.file)
        try:
            if handle is None:
                handle = self._handles[info.file] = safe_open(str(info.file), framework="pt")
            return handle.get_tensor(name)
        except Exception as exc:  # safetensors raises its own error types for corrupt data
            raise CheckpointError(f"{info.file}: cannot read tensor {name!r}: {exc}") from None

    def expect(self, name: str, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
        """Read a tensor, raising CheckpointError unless it has this shape and one of these dtypes."""
        info = self.info(name)
        if info.shape != tuple(shape):
            raise CheckpointError(f"{info.file.name}: tensor {name!r} has shape {info.shape}, expected {tuple(shape)}")
        if info.dtype not in dtypes:
            want = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
            raise CheckpointError(f"{info.file.name}: tensor {name!r} has dtype "
                                  f"{str(info.dtype).removeprefix('torch.')}, expected {want}")
        return self.tensor(name)

    # -- architecture -----------------------------------------------------------------------

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """Logical ``(N, K)`` of every projection, keyed by transformers' module name."""
        return linear_shapes(self.config)


def linear_shapes(config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """Logical ``(N, K)`` of every linear of the model but its output embedding, keyed by module name, as
    transformers' own modeling class of ``model_type`` builds them (on the meta device: nothing allocated)."""
    return dict(_meta_shapes(_key(config))[0])


def parameter_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The shape of every parameter of transformers' model of ``config``, in its ``named_parameters`` order
    (tied ones once)."""
    return dict(_meta_shapes(_key(config))[1])


def stored_names(config: dict[str, Any]) -> dict[str, dict[str, tuple[int, ...]]]:
    """For every parameter of transformers' model of ``config``: the checkpoint tensors (name -> shape) it is
    loaded from. Most are stored under their own name; a mixture-of-experts layer's fused 3-D expert
    parameters come from one tensor per expert and projection, under the names transformers' own conversion
    mapping gives (reverted as ``save_pretrained`` writes them)."""
    return {name: dict(sources) for name, sources in _stored_names(_key(config))}


def expert_linears(config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """Logical ``(N, K)`` of every expert's projection as the checkpoint stores it (one linear per expert and
    projection, keyed by its stored module name), where transformers fuses them into 3-D parameters."""
    out = {}
    for stored in stored_names(config).values():
        if len(stored) > 1 and all(s.endswith(".weight") and len(shape) == 2 for s, shape in stored.items()):
            out.update({s.removesuffix(".weight"): shape for s, shape in stored.items()})
    return out


def to_parameters(config: dict[str, Any], stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' load-time conversion of checkpoint tensors (named as :func:`stored_names` gives them) into
    the model's parameters: renamed, and the experts' tensors stacked and concatenated into the fused ones."""
    import copy

    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    model = _meta_model(_key(config))
    transforms = get_model_conversion_mapping(model, add_legacy=False)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
    out: dict[str, torch.Tensor] = {}
    pending: dict[str, WeightConverter] = {}
    for name in sorted(stored, key=dot_natural_key):  # experts in index order: they are stacked as added
        target, pattern = rename_source_key(name, renamings, converters)
        if pattern is None:
            out[target] = stored[name]
        else:
            pending.setdefault(target, copy.deepcopy(by_pattern[pattern])).add_tensor(target, name, pattern,
                                                                                       stored[name])
    for target, converter in pending.items():
        for name, value in converter.convert(target, model=model, config=model.config).items():
            out[name] = value[0] if isinstance(value, list) else value
    return out


def _key(config: dict[str, Any]) -> str:
    return json.dumps({k: v for k, v in config.items() if k != "quantization_config"}, sort_keys=True)


@functools.lru_cache(maxsize=16)
def _meta_model(config_json: str) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = json.loads(config_json)
    model_type = cfg.pop("model_type", None)
    try:
        config = AutoConfig.for_model(model_type, **cfg)
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    except Exception as exc:  # noqa: BLE001 - transformers' (and huggingface_hub's) validation errors are its own
        raise CheckpointError(f"config.json: transformers cannot build model_type {model_type!r} from it: "
                              f"{type(exc).__name__}: {exc}") from None


@functools.lru_cache(maxsize=16)
def _stored_names(config_json: str) -> tuple[tuple[str, tuple[tuple[str, tuple[int, ...]], ...]], ...]:
    from transformers.core_model_loading import dot_natural_key, revert_weight_conversion

    model = _meta_model(config_json)
    out = []
    for name, p in model.named_parameters():
        stored = revert_weight_conversion(model, {name: p})  # meta tensors: names and shapes only
        out.append((name, tuple((k, tuple(stored[k].shape)) for k in sorted(stored, key=dot_natural_key))))
    return tuple(out)


@functools.lru_cache(maxsize=16)
def _meta_shapes(config_json: str) -> tuple[tuple, tuple]:
    model = _meta_model(config_json)
    head = model.get_output_embeddings()
    linears = tuple((name, (m.out_features, m.in_features)) for name, m in model.named_modules()
                    if isinstance(m, torch.nn.Linear) and m is not head)
    return linears, tuple((name, tuple(p.shape)) for name, p in model.named_parameters())


def _parse_spec(config: dict[str, Any], where: Path) -> FormatSpec | None:
    from vllm_parity.errors import FormatError

    try:
        return parse_quantization_config(config.get("quantization_config"))
    except FormatError as exc:
        raise FormatError(f"{where}: quantization_config: {exc}") from None
