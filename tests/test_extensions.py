"""Extending the harness: a new architecture needs one data file (``tests/extensions/dummy_llama.py``), a new
format only its own files, one per floor (``dummy_int8_reference.py``, ``dummy_int8_serving.py``), registered
by name. The dummy architecture is Llama under another ``model_type``; the dummy format int8 weights with a
scale per output channel."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.engine_runs import report, run
from vllm_parity.fixtures.checkpoints import Dims, make_fixture
from vllm_parity.harness.taps import canonical_order

pytest_plugins = ["pytester"]
REPO = Path(__file__).resolve().parents[1]
DIMS = Dims(hidden=128, layers=2, heads=2, kv_heads=1, intermediate=256, vocab=1024)


@pytest.fixture(scope="module")
def dummy_checkpoint(tmp_path_factory) -> Path:
    """The fp fixture as a ``parity_dummy_llama`` checkpoint quantized to ``parity_dummy_int8``."""
    from tests.extensions import libraries
    from tests.extensions.dummy_int8_reference import encode
    from vllm_parity.reference.checkpoint import linear_shapes

    out = make_fixture("fp", tmp_path_factory.mktemp("dummy") / "m", dims=DIMS)
    config = json.loads((out / "config.json").read_text())
    libraries.teach_transformers()
    config.update(model_type="parity_dummy_llama", architectures=["DummyLlamaForCausalLM"],
                  quantization_config={"quant_method": "parity_dummy_int8", "ignore": ["lm_head"]})
    (out / "config.json").write_text(json.dumps(config, indent=1))
    (weights,) = out.glob("*.safetensors")
    tensors = load_file(weights)
    for module in linear_shapes(config):
        enc = encode(tensors.pop(f"{module}.weight").double())
        tensors[f"{module}.weight_q"], tensors[f"{module}.weight_scale"] = enc["q"], enc["scale"]
    save_file({k: v.contiguous() for k, v in tensors.items()}, weights, metadata={"format": "pt"})
    return out


def _run(pytester, monkeypatch, ckpt: Path, *args: str, without: str = "", candidate: str = "vllm"):
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    monkeypatch.setenv("PARITY_TEST_WITHOUT", without)
    monkeypatch.setenv("PARITY_TEST_CANDIDATE", candidate)
    return run(pytester, "-p", "tests.extensions.plugin", f"--parity-model={ckpt}",
               f"--parity-candidate={candidate}", *args)


def _check_every_tap_passed(pytester, result, level_taps: int) -> None:
    assert result.ret == 0, result.stdout.str()[-3000:]
    rep = report(pytester)
    assert rep["passed"] and len([t for t in rep["taps"] if t.get("phase") != "decode"]) == level_taps
    assert rep["run"]["format"] == "parity_dummy_int8"


def test_the_kernels_candidate_on_a_new_architecture_and_format(pytester, monkeypatch, dummy_checkpoint):
    result = _run(pytester, monkeypatch, dummy_checkpoint, "--parity-level=block", candidate="kernels")
    block_taps = [t for t in canonical_order(DIMS.layers) if not t.endswith(".input") and t not in
                  ("final_norm", "logits")]
    _check_every_tap_passed(pytester, result, len(block_taps))


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_on_a_new_architecture_and_format(pytester, monkeypatch, dummy_checkpoint):
    result = _run(pytester, monkeypatch, dummy_checkpoint, "--parity-level=model")
    taps = [t for t in canonical_order(DIMS.layers) if not t.endswith(".input")]
    _check_every_tap_passed(pytester, result, len(taps))
    extras = report(pytester)["run"]["extras"]
    assert all(extras[check]["passed"] for check in ("greedy", "topk", "logprobs")), extras


@pytest.mark.parametrize("without, says", [
    ("architecture", ("model_type 'parity_dummy_llama' is not an architecture the harness knows (known: [",
                      "'llama', ", "]); add one as a module of vllm_parity.architectures")),
    ("format", ("unknown quant_method 'parity_dummy_int8': no reference decoder is installed for it (known: "
                "['awq', 'compressed-tensors', ", "'gptq', 'int8x', 'ternary']); a package supplies one as a "
                "FormatSpec subclass under the entry-point group 'vllm_parity.formats' named after its quant_method")),
])
def test_without_its_file_the_run_says_what_to_add(pytester, monkeypatch, dummy_checkpoint, without, says):
    result = _run(pytester, monkeypatch, dummy_checkpoint, "--parity-level=op", without=without, candidate="kernels")
    out = result.stdout.str() + result.stderr.str()
    assert all(part in out for part in says), out[-3000:]
    # a usage error with the message alone, not a traceback out of the plugin's collection hook
    assert result.ret == pytest.ExitCode.USAGE_ERROR and "INTERNALERROR" not in out and "Traceback" not in out


def test_the_dummy_format_decodes_alike_on_both_floors(dummy_checkpoint):
    from tests.extensions import dummy_int8_serving
    from tests.extensions.dummy_int8_reference import DummyInt8Spec
    from vllm_parity.reference.checkpoint import Checkpoint

    ckpt = Checkpoint(dummy_checkpoint)
    module = "model.layers.0.mlp.down_proj"
    n, k = ckpt.linear_shapes()[module]
    stored = ckpt.spec.read_stored(ckpt, module, n, k)
    assert isinstance(ckpt.spec, DummyInt8Spec)
    assert torch.equal(ckpt.spec.decode(stored, n, k, module),
                       dummy_int8_serving.dequantize(stored["q"], stored["scale"]))
    # hand-worked: q = [[2, -3]], scale [0.5] -> [[1.0, -1.5]]
    assert dummy_int8_serving.dequantize(torch.tensor([[2, -3]], dtype=torch.int8), torch.tensor([0.5])).tolist() \
        == [[1.0, -1.5]]
