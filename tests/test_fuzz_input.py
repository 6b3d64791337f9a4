"""Fuzzing what reads a checkpoint: the safetensors header reader, the checkpoint reader on a tiny checkpoint with
one file mutated, and every format's decoder on arbitrary stored tensors. Whatever the input, the only error is
the project's clean input error (``ParityInputError``: ``CheckpointError``, ``FormatError``, ``DecodeError``), and
what the reader accepts, safetensors reads. 25 examples a test in CI, 10,000 under the nightly profile."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tests.strategies import ternary_specs
from vllm_parity.errors import ParityInputError
from vllm_parity.fixtures.checkpoints import Dims, make_fixture
from vllm_parity.reference.checkpoint import Checkpoint, read_safetensors_header
from vllm_parity.reference.formats import int8x, ternary
from vllm_parity.reference.formats.awq import AwqSpec
from vllm_parity.reference.formats.gptq import GptqSpec
from vllm_parity.reference.formats.int8x import Int8xSpec

TINY = Dims(hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64, vocab=32)
EXAMPLES = 10_000 if settings.get_current_profile_name() == "nightly" else 25
FUZZ = settings(max_examples=EXAMPLES, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.data_too_large])

# JSON values of every type, small: what a header entry or a config key may be replaced with.
JSON = st.recursive(st.none() | st.booleans() | st.integers(-2, 70) | st.floats(allow_nan=True)
                    | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=8)
OFFSET = st.one_of(st.integers(-2 ** 70, 2 ** 70), st.integers(-8, 4096), JSON)


@pytest.fixture(scope="module")
def fixtures_dir(tmp_path_factory) -> dict[str, Path]:
    """Tiny checkpoints of the project's formats and of compressed-tensors' schemes."""
    from vllm_parity.fixtures.compressed_tensors import SCHEMES, make_ct_fixture

    root = tmp_path_factory.mktemp("fuzz")
    out = {fmt: make_fixture(fmt, root / fmt, dims=TINY) for fmt in ("seed-article", "int8x", "hf-bitnet")}
    return {**out, **{name: make_ct_fixture(name, root / name, dims=TINY) for name in SCHEMES}}


def _split(data: bytes) -> tuple[dict, bytes]:
    (hlen,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + hlen]), data[8 + hlen:]


def _join(header, body: bytes) -> bytes:
    raw = json.dumps(header).encode() if not isinstance(header, bytes) else header
    return struct.pack("<Q", len(raw)) + raw + body


@st.composite
def header_mutations(draw, data: bytes) -> bytes:
    """A valid file with its header changed: an entry's field of another type or value, a key removed, an entry
    added or replaced, offsets huge, negative or reversed, the metadata of any type."""
    header, body = _split(data)
    names = sorted(n for n in header if n != "__metadata__")
    for _ in range(draw(st.integers(1, 3))):
        name = draw(st.sampled_from(names))
        kind = draw(st.sampled_from(["field", "drop", "entry", "offsets", "reverse", "metadata", "new"]))
        entry = header.get(name)
        if not isinstance(entry, dict):
            entry = header[name] = {}
        if kind == "field":
            entry[draw(st.sampled_from(["dtype", "shape", "data_offsets"]))] = draw(JSON)
        elif kind == "drop" and entry:
            entry.pop(draw(st.sampled_from(sorted(entry))))
        elif kind == "entry":
            header[name] = draw(JSON)
        elif kind == "offsets":
            entry["data_offsets"] = [draw(OFFSET), draw(OFFSET)]
        elif kind == "reverse" and isinstance(entry.get("data_offsets"), list):
            entry["data_offsets"] = entry["data_offsets"][::-1]
        elif kind == "metadata":
            header["__metadata__"] = draw(JSON)
        elif kind == "new":
            header[draw(st.text(max_size=6))] = {"dtype": draw(st.sampled_from(["F32", "U8", "I32", "X"])),
                                                 "shape": draw(st.lists(st.integers(-1, 9), max_size=3)),
                                                 "data_offsets": [draw(OFFSET), draw(OFFSET)]}
    return _join(header, body)


@st.composite
def byte_mutations(draw, data: bytes) -> bytes:
    """A valid file cut short, with bytes overwritten, its header length changed, or its header text garbled."""
    kind = draw(st.sampled_from(["truncate", "overwrite", "length", "header_bytes", "garbage"]))
    if kind == "truncate":
        return data[:draw(st.integers(0, len(data) - 1))]
    if kind == "overwrite":
        at = draw(st.integers(0, len(data) - 1))
        junk = draw(st.binary(min_size=1, max_size=16))
        return data[:at] + junk + data[at + len(junk):]
    if kind == "length":
        return struct.pack("<Q", draw(st.integers(0, 2 ** 64 - 1))) + data[8:]
    if kind == "header_bytes":
        (hlen,) = struct.unpack("<Q", data[:8])
        raw = bytearray(data[8:8 + hlen])
        for _ in range(draw(st.integers(1, 4))):
            raw[draw(st.integers(0, len(raw) - 1))] = draw(st.integers(0, 255))
        return data[:8] + bytes(raw) + data[8 + hlen:]
    return draw(st.binary(max_size=64))


def _file_mutations(data: bytes):
    return st.one_of(header_mutations(data), byte_mutations(data))


def _read_everything(ckpt_dir: Path) -> None:
    """What the reference does with a checkpoint before its model runs: open it, parse its format, read every
    tensor, and read and decode every quantized projection."""
    ckpt = Checkpoint(ckpt_dir)
    spec = ckpt.spec
    for name in ckpt.keys():
        ckpt.tensor(name)
    for module, (n, k) in ckpt.linear_shapes().items():
        if spec is not None and not spec.is_ignored(module):
            spec.decode(spec.read_stored(ckpt, module, n, k), n, k, module)


def _only_clean_errors(action) -> None:
    try:
        action()
    except ParityInputError:
        pass


@FUZZ
@given(data=st.data())
def test_the_header_reader_raises_nothing_but_clean_errors(fixtures_dir, tmp_path_factory, data):
    source = data.draw(st.sampled_from(sorted(fixtures_dir)))
    good = (fixtures_dir[source] / "model.safetensors").read_bytes()
    mutated = data.draw(_file_mutations(good))
    d = tmp_path_factory.mktemp("hdr")
    shutil.copy(fixtures_dir[source] / "config.json", d / "config.json")
    (d / "model.safetensors").write_bytes(mutated)
    try:
        infos = read_safetensors_header(d / "model.safetensors")
    except ParityInputError:
        return
    ckpt = Checkpoint(d)  # a header the reader accepts is one safetensors reads, tensor by tensor
    for name, info in infos.items():
        t = ckpt.tensor(name)
        assert t.dtype == info.dtype and tuple(t.shape) == info.shape


@FUZZ
@given(data=st.data())
def test_the_checkpoint_reader_raises_nothing_but_clean_errors(fixtures_dir, tmp_path_factory, data):
    source = data.draw(st.sampled_from(sorted(fixtures_dir)))
    d = tmp_path_factory.mktemp("ckpt") / "m"
    shutil.copytree(fixtures_dir[source], d)
    target = data.draw(st.sampled_from(["model.safetensors", "config.json"]))
    if target == "model.safetensors":
        f = d / target
        f.write_bytes(data.draw(_file_mutations(f.read_bytes())))
    else:
        config = json.loads((d / target).read_text())
        kind = data.draw(st.sampled_from(["value", "drop", "quant", "text"]))
        if kind == "value":
            config[data.draw(st.sampled_from(sorted(config)))] = data.draw(JSON)
        elif kind == "drop":
            config.pop(data.draw(st.sampled_from(sorted(config))))
        elif kind == "quant" and isinstance(config.get("quantization_config"), dict):
            q = config["quantization_config"]
            q[data.draw(st.sampled_from(sorted(q) + ["bogus"]))] = data.draw(JSON)
        (d / target).write_text(json.dumps(config) if kind != "text" else data.draw(st.text(max_size=40)))
    _only_clean_errors(lambda: _read_everything(d))


# -- the decoders -------------------------------------------------------------------------------------------------

DTYPES = [torch.uint8, torch.int8, torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float32]
SIZES = st.integers(-2, 24)


@st.composite
def tensors(draw, shape=None, dtype=None) -> torch.Tensor:
    """Any small tensor: arbitrary bytes, shape and dtype, floats with NaN, Inf, zeros and huge values."""
    dtype = dtype if dtype is not None else draw(st.sampled_from(DTYPES))
    shape = shape if shape is not None else tuple(draw(st.lists(st.integers(0, 9), max_size=3)))
    n = 1
    for s in shape:
        n *= s
    size = torch.empty((), dtype=dtype).element_size()
    raw = draw(st.binary(min_size=n * size, max_size=n * size))
    t = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape) if n else \
        torch.empty(shape, dtype=dtype)
    return t.clone()


def _mostly(draw, good: torch.Tensor) -> torch.Tensor:
    """The well-formed tensor, its content replaced, or anything."""
    kind = draw(st.sampled_from(["keep", "content", "any"]))
    if kind == "keep":
        return good
    if kind == "content":
        return draw(tensors(shape=tuple(good.shape), dtype=good.dtype))
    return draw(tensors())


@FUZZ
@given(data=st.data(), spec=ternary_specs(group_sizes=(4, 8)))
def test_the_ternary_decoder_raises_nothing_but_clean_errors(data, spec):
    n, k = data.draw(SIZES), data.draw(SIZES)
    try:
        packed_shape, scale_shape = spec.packed_shape(n, k), spec.scale_shape(n, k)
    except ParityInputError:
        packed_shape, scale_shape = (4, 4), (4,)
    packed = data.draw(st.one_of(tensors(shape=packed_shape if min(packed_shape) >= 0 else (1,), dtype=torch.uint8),
                                 tensors()))
    scale = data.draw(st.one_of(tensors(shape=scale_shape if min(scale_shape) >= 0 else (1,),
                                        dtype=data.draw(st.sampled_from(DTYPES[4:]))), tensors()))
    _only_clean_errors(lambda: ternary.decode(packed, scale, spec, n, k, name="w"))


@FUZZ
@given(data=st.data(), block=st.sampled_from([32, 64, 1024]))
def test_the_int8x_decoder_raises_nothing_but_clean_errors(data, block):
    n, k = data.draw(st.integers(1, 12)), data.draw(st.integers(1, 12))
    q = data.draw(tensors(shape=(n, k), dtype=torch.int8))
    spec = Int8xSpec(block_size=block)
    stored = int8x.encode(q, 0.5, spec)
    for suffix in data.draw(st.lists(st.sampled_from(sorted(stored)), max_size=3, unique=True)):
        if data.draw(st.booleans()):
            stored[suffix] = _mostly(data.draw, stored[suffix])
        else:
            stored.pop(suffix)
    _only_clean_errors(lambda: int8x.decode(stored, spec, name="w"))


@FUZZ
@given(data=st.data(), method=st.sampled_from(["awq", "gptq"]))
def test_the_awq_and_gptq_decoders_raise_nothing_but_clean_errors(data, method):
    group = data.draw(st.sampled_from([8, 16]))
    n, k = 8 * data.draw(st.integers(1, 3)), group * data.draw(st.integers(1, 3))
    g = k // group
    if method == "awq":
        spec = AwqSpec(group_size=group)
        good = {"qweight": (k, n // 8), "qzeros": (g, n // 8), "scales": (g, n)}
    else:
        spec = GptqSpec(group_size=group)
        good = {"qweight": (k // 8, n), "qzeros": (g, n // 8), "scales": (g, n), "g_idx": (k,)}
    stored = {}
    for role, shape in good.items():
        dtype = torch.float16 if role == "scales" else torch.int32
        stored[role] = _mostly(data.draw, data.draw(tensors(shape=shape, dtype=dtype)))
    if method == "gptq" and data.draw(st.booleans()):
        stored["g_idx"] = torch.arange(k, dtype=torch.int32) // group  # the stored order, as often
    n_, k_ = data.draw(st.sampled_from([(n, k), (n, k), (data.draw(SIZES), data.draw(SIZES))]))
    _only_clean_errors(lambda: spec.decode(stored, n_, k_, "w"))


@pytest.fixture(scope="module")
def ct_stored(fixtures_dir) -> dict[str, tuple]:
    """Per compressed-tensors scheme: its spec, one projection's stored tensors, and the projection's (N, K)."""
    from vllm_parity.fixtures.compressed_tensors import SCHEMES

    out, module = {}, "model.layers.0.mlp.down_proj"
    for name in SCHEMES:
        ckpt = Checkpoint(fixtures_dir[name])
        n, k = ckpt.linear_shapes()[module]
        out[name] = (ckpt.spec, ckpt.spec.read_stored(ckpt, module, n, k), n, k)
    return out


@FUZZ
@given(data=st.data())
def test_the_compressed_tensors_decoder_raises_nothing_but_clean_errors(ct_stored, data):
    spec, good, n, k = ct_stored[data.draw(st.sampled_from(sorted(ct_stored)))]
    stored = dict(good)
    for role in data.draw(st.lists(st.sampled_from(sorted(stored)), min_size=1, max_size=2, unique=True)):
        if data.draw(st.booleans()):
            stored[role] = _mostly(data.draw, stored[role])
        else:
            stored.pop(role)
    _only_clean_errors(lambda: spec.decode(stored, n, k, "model.layers.0.mlp.down_proj"))
