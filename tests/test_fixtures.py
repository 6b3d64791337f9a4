import json

import pytest
import torch

from vllm_parity.architectures import lookup
from vllm_parity.errors import ParityInputError
from vllm_parity.fixtures import default_model
from vllm_parity.fixtures.checkpoints import FORMATS, Dims, make_fixture
from vllm_parity.fixtures.prompts import DEFAULT, SHORT, load_prompts, prompts_sha256
from vllm_parity.reference.formats import int8x, ternary
from vllm_parity.reference.checkpoint import Checkpoint, parameter_shapes
from vllm_parity.reference.formats.ternary import PRESETS
from vllm_parity.reference.formats.int8x import Int8xSpec

TINY = Dims(hidden=64, layers=2, heads=2, kv_heads=1, intermediate=128, vocab=256)

# sha256 over the embedded default's files (vllm_parity.fixtures.default_model.checkpoint_sha256): a change in
# the generator, numpy's stream or safetensors' layout shows here first.
DEFAULT_MODEL_SHA256 = "2529d69e60da11c631ec23648b6994403dfd9e9034365444782666bed062e225"


def _files(path):
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


@pytest.mark.parametrize("fmt", FORMATS)
def test_same_arguments_give_byte_identical_files(tmp_path, fmt):
    a = make_fixture(fmt, tmp_path / "a", seed=3, dims=TINY)
    b = make_fixture(fmt, tmp_path / "b", seed=3, dims=TINY)
    c = make_fixture(fmt, tmp_path / "c", seed=4, dims=TINY)
    assert _files(a) == _files(b)
    assert _files(a)["model.safetensors"] != _files(c)["model.safetensors"]


@pytest.mark.parametrize("arch", ["mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "minicpm3", "bitnet"])
def test_a_family_fixture_holds_transformers_own_parameters(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    a = make_fixture("fp", tmp_path / "a", seed=3, dims=TINY, arch=arch)
    assert _files(a) == _files(make_fixture("fp", tmp_path / "b", seed=3, dims=TINY, arch=arch))
    llama = _files(make_fixture("fp", tmp_path / "l", seed=3, dims=TINY))
    assert _files(a)["config.json"] != llama["config.json"]
    # the draws keep one order: the parameters both families have get the same values
    assert (_files(a)["model.safetensors"] == llama["model.safetensors"]) == (arch == "mistral")
    config = json.loads((a / "config.json").read_text())
    assert config["model_type"] == arch and config["architectures"] == [lookup(arch).fixture_config["architectures"][0]]
    with open(a / "model.safetensors", "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    names = {k for k in header if k != "__metadata__"}
    assert names == set(parameter_shapes(config))
    assert all(tuple(header[n]["shape"]) == shape for n, shape in parameter_shapes(config).items())
    model, info = AutoModelForCausalLM.from_pretrained(a, output_loading_info=True)
    assert type(model).__name__ == config["architectures"][0]
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    if arch == "qwen2":
        assert "model.layers.0.self_attn.q_proj.bias" in names
    # a norm is drawn as the scale it applies: Gemma's stores that scale less its offset of 1
    from safetensors.torch import load_file

    norms = [load_file(d / "model.safetensors")["model.norm.weight"] for d in (a, tmp_path / "l")]
    torch.testing.assert_close(norms[0] + lookup(arch).norm_offset, norms[1], rtol=0, atol=1e-6)


def test_a_family_without_a_fixture_config_is_named(tmp_path, monkeypatch):
    import vllm_parity.architectures as families
    from vllm_parity.architectures.llama import LLAMA

    families.known()  # every shipped family first, then one more for this test only
    monkeypatch.setitem(families._REGISTRY, "parity_test_bare", families.Architecture("parity_test_bare", LLAMA.taps))
    with pytest.raises(ValueError, match=r"'parity_test_bare' gives no fixture config; families with one: "
                                         r"\[.*'mistral'.*'qwen2'"):
        make_fixture("fp", tmp_path / "x", dims=TINY, arch="parity_test_bare")
    with pytest.raises(ParityInputError, match="'gpt_nope' is not an architecture the harness knows"):
        make_fixture("fp", tmp_path / "y", dims=TINY, arch="gpt_nope")


@pytest.mark.parametrize("fmt", ["seed-article", "hf-bitnet"])
def test_ternary_fixture_is_realistic(tmp_path, fmt):
    ckpt = Checkpoint(make_fixture(fmt, tmp_path / fmt, dims=TINY))
    spec = ckpt.spec
    assert spec == PRESETS[fmt]
    assert ckpt.config["num_key_value_heads"] < ckpt.config["num_attention_heads"]  # GQA
    for module, (n, k) in ckpt.linear_shapes().items():
        values = ternary.unpack_values(ckpt.tensor(f"{module}.{spec.weight_name}"), spec)
        zero = (values == 0).float().mean().item()
        assert 0.18 <= zero <= 0.32, (module, zero)
        assert abs((values == 1).float().mean().item() - (values == -1).float().mean().item()) < 0.05
        w = ternary.decode(ckpt.tensor(f"{module}.{spec.weight_name}"), ckpt.tensor(f"{module}.{spec.scale_name}"),
                           spec, n, k)
        assert 0.3 < w.std().item() * k ** 0.5 < 3.0, module  # effective std near 1/sqrt(K)
    assert ckpt.info(f"model.layers.0.self_attn.q_proj.{spec.scale_name}").dtype == (
        torch.float16 if fmt == "seed-article" else torch.float32)


def test_int8x_fixture_level_statistics(tmp_path):
    ckpt = Checkpoint(make_fixture("int8x", tmp_path / "x", dims=Dims(hidden=256, layers=1, intermediate=512)))
    assert ckpt.spec == Int8xSpec()
    tensors = {s: ckpt.tensor(f"model.layers.0.mlp.up_proj.{s}") for s in Int8xSpec.suffixes}
    q = int8x.decode_int8(tensors)
    stats = int8x.levels(q)
    assert 0.50 <= stats["l1"] <= 0.60 and 0.35 <= stats["l2"] <= 0.45 and 0.03 <= stats["l3"] <= 0.07, stats


def test_fp_fixture_has_no_quantization_config(tmp_path):
    ckpt = Checkpoint(make_fixture("fp", tmp_path / "fp", dims=TINY))
    assert ckpt.spec is None and "quantization_config" not in ckpt.config
    assert ckpt.info("model.layers.1.mlp.down_proj.weight").shape == (64, 128)


def test_sharded_fixture_loads_through_its_index(tmp_path):
    out = make_fixture("seed-article", tmp_path / "s", dims=TINY, shard_bytes=40_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    single = make_fixture("seed-article", tmp_path / "one", dims=TINY)
    a, b = Checkpoint(out), Checkpoint(single)
    assert a.keys() == b.keys()
    assert all(torch.equal(a.tensor(k), b.tensor(k)) for k in a.keys())


def test_prompt_sets():
    default = load_prompts(DEFAULT)
    assert len(default) == 4 and all(len(p) == 64 for p in default)
    assert len(load_prompts(SHORT)[0]) < 16
    assert max(max(p) for p in default) < 1024
    assert prompts_sha256(default) == prompts_sha256(json.loads(DEFAULT.read_text()))


@pytest.mark.parametrize("content, match", [
    ("[]", "non-empty JSON array"), ("[[1, 2], []]", "prompt 1 is not"), ('[[1, "a"]]', "position 1"),
    ("[[1, -3]]", "not a token id"), ("[[1, 5000]]", "token 5000 >= vocab_size 2048"), ("{", "not a readable"),
])
def test_bad_prompt_files(tmp_path, content, match):
    f = tmp_path / "p.json"
    f.write_text(content)
    with pytest.raises(ValueError, match=match):
        load_prompts(f, vocab_size=2048)


def test_embedded_default_is_generated_once_and_stable(tmp_path, monkeypatch):
    monkeypatch.setenv("PARITY_CACHE_DIR", str(tmp_path))
    path = default_model.default_model_dir()
    assert Checkpoint(path).spec == PRESETS["seed-article"]
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert default_model.default_model_dir() == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime  # reused, not rewritten
    assert default_model.checkpoint_sha256(path) == DEFAULT_MODEL_SHA256


def test_make_fixture_command(tmp_path, capsys):
    from vllm_parity.tools.cli import main

    out = tmp_path / "cli"
    assert main(["make-fixture", "--format", "hf-bitnet", "--out", str(out), "--seed", "5", "--hidden", "64",
                 "--layers", "1", "--heads", "2", "--kv-heads", "1", "--intermediate", "128", "--vocab", "64"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    same = make_fixture("hf-bitnet", tmp_path / "api", seed=5,
                        dims=Dims(hidden=64, layers=1, heads=2, kv_heads=1, intermediate=128, vocab=64))
    assert _files(out) == _files(same)
