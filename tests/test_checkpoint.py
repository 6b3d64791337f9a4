"""Bad input: every broken checkpoint gives a clear error naming the file and the tensor."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from vllm_parity.fixtures.checkpoints import Dims, make_fixture
from vllm_parity.reference.checkpoint import Checkpoint
from vllm_parity.errors import CheckpointError, DecodeError, FormatError, ParityInputError
from vllm_parity.reference.model import build_reference_model

TINY = Dims(hidden=64, layers=1, heads=2, kv_heads=1, intermediate=128, vocab=64)
Q = "model.layers.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def seed_dir(tmp_path_factory):
    return make_fixture("seed-article", tmp_path_factory.mktemp("ckpt") / "seed", dims=TINY)


@pytest.fixture
def broken(seed_dir, tmp_path):
    """A fresh copy of the seed-article fixture, to break."""
    out = tmp_path / "broken"
    shutil.copytree(seed_dir, out)
    return out


def _rewrite(path, change):
    tensors = load_file(str(path / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_truncated_safetensors(broken):
    f = broken / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match=r"model.safetensors: truncated: tensor '[^']+' needs bytes"):
        build_reference_model(broken)


def test_truncated_inside_the_header(broken):
    f = broken / "model.safetensors"
    f.write_bytes(f.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="model.safetensors: truncated or not safetensors: header claims"):
        Checkpoint(broken)


def test_corrupt_header(broken):
    f = broken / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[8:20] = b"\xff" * 12
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="model.safetensors: corrupt safetensors header"):
        Checkpoint(broken)


def test_packed_tensor_of_the_wrong_shape(broken):
    _rewrite(broken, lambda t: t.__setitem__(f"{Q}.weight_ternary", torch.zeros((64, 8), dtype=torch.uint8)))
    with pytest.raises(CheckpointError, match=rf"tensor '{Q}.weight_ternary' has shape \(64, 8\), expected \(64, 16\)"):
        build_reference_model(broken)


def test_packed_tensor_of_the_wrong_dtype(broken):
    _rewrite(broken, lambda t: t.__setitem__(f"{Q}.weight_ternary", torch.zeros((64, 16), dtype=torch.int8)))
    with pytest.raises(CheckpointError, match=rf"'{Q}.weight_ternary' has dtype int8, expected uint8"):
        build_reference_model(broken)


def test_illegal_code(broken):
    def plant(t):
        w = t[f"{Q}.weight_ternary"]
        w[3, 5] = 0xFF
        w[7, 0] |= 0b11
    _rewrite(broken, plant)
    with pytest.raises(DecodeError, match=rf"{Q}: 2 of 1024 bytes hold code\(s\) \[3\]"):
        build_reference_model(broken)


def test_missing_scale(broken):
    _rewrite(broken, lambda t: t.pop(f"{Q}.weight_scale"))
    with pytest.raises(CheckpointError, match=rf"tensor '{Q}.weight_scale' is missing"):
        build_reference_model(broken)


def test_nan_in_a_float_tensor(broken):
    _rewrite(broken, lambda t: t["model.norm.weight"].__setitem__(3, float("nan")))
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor 'model.norm.weight' holds NaN or Inf"):
        build_reference_model(broken)


def test_inf_in_a_scale(broken):
    _rewrite(broken, lambda t: t[f"{Q}.weight_scale"].__setitem__(0, float("inf")))
    with pytest.raises(DecodeError, match=f"{Q}: scale holds NaN or Inf"):
        build_reference_model(broken)


def test_pickle_checkpoint_is_refused(broken):
    (broken / "model.safetensors").unlink()
    (broken / "pytorch_model.bin").write_bytes(b"\x80\x04not really loaded")
    with pytest.raises(CheckpointError, match="only pickle weight files \\(pytorch_model.bin\\); pickle "
                                              "checkpoints are refused"):
        build_reference_model(broken)


def test_pickle_beside_safetensors_is_never_read(broken):
    (broken / "pytorch_model.bin").write_bytes(b"garbage that would fail to unpickle")
    assert Checkpoint(broken).keys()  # reads the safetensors only


def test_bad_config(broken):
    (broken / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json: not valid JSON"):
        Checkpoint(broken)
    cfg = json.loads((make_fixture("fp", broken.parent / "fp", dims=TINY) / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "ternary", "bit_order": "middle"}
    (broken / "config.json").write_text(json.dumps(cfg))
    ckpt = Checkpoint(broken)  # tensors stay listable; the format is refused when asked for
    assert ckpt.keys()
    with pytest.raises(FormatError, match="config.json: quantization_config: bit_order = 'middle'"):
        ckpt.spec


def test_index_naming_a_missing_shard(broken):
    (broken / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "gone.safetensors"}}))
    with pytest.raises(CheckpointError, match="index.json: names gone.safetensors, which does not exist"):
        Checkpoint(broken)


def test_not_a_directory(tmp_path):
    with pytest.raises(CheckpointError, match="not a checkpoint directory"):
        Checkpoint(tmp_path / "nowhere")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="no \\*.safetensors weight files"):
        Checkpoint(tmp_path)


def test_errors_are_input_errors_not_deep_tracebacks(broken):
    f = broken / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1])
    with pytest.raises(ParityInputError) as info:
        build_reference_model(broken)
    assert info.traceback[-1].path.name in {"checkpoint.py"}

