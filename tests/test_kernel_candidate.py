"""The ``kernels`` candidate: the reference's modeling code with the kernel linears, no vLLM needed."""

import json
import sys

import pytest

from vllm_parity.fixtures.checkpoints import Dims, make_fixture

pytest_plugins = ["pytester"]
SMALL = Dims(hidden=128, layers=2, heads=2, kv_heads=1, intermediate=256, vocab=1024)


@pytest.mark.slow
@pytest.mark.parametrize("fmt, layout", [("hf-bitnet", None), ("int8x", "streams"), ("int8x", "native"),
                                         pytest.param("int8x", "planes", marks=pytest.mark.nightly)])
def test_kernel_candidate_passes_every_level(pytester, tmp_path, monkeypatch, fmt, layout):
    if layout:
        monkeypatch.setenv("PARITY_INT8X_LAYOUT", layout)  # the fixture's weights are wide: auto keeps streams
    model = make_fixture(fmt, tmp_path / fmt, dims=SMALL)
    result = pytester.run(sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--parity-level=model",
                          "--parity-candidate=kernels", f"--parity-model={model}",
                          f"--parity-report={tmp_path / 'report'}", "--parity-mode=isolated", timeout=600)
    # embed, 2 x 11 op taps, 2 layer outputs, final_norm + logits, greedy + top-k
    result.assert_outcomes(passed=1 + 22 + 2 + 2 + 2)
    rep = json.loads((tmp_path / "report" / "report.json").read_text())
    assert rep["passed"] and rep["run"]["candidate"] == "kernels" and rep["run"]["mode"] == "isolated"
    assert all(t["isolated"]["passed"] for t in rep["taps"])


@pytest.mark.parametrize("layout, served", [("native", "native"), ("streams", "streams"), ("planes", "planes"),
                                            ("auto", "streams")])
def test_kernel_candidate_serves_int8x_in_the_chosen_layout(tmp_path, monkeypatch, layout, served):
    """PARITY_INT8X_LAYOUT picks the layout, as in the vLLM method; ``auto`` on the small fixture's wide weights:
    the streams (the planes' padding to 512 columns outweighs their saving at K = 128). Each tap reports that
    layout's kernel."""
    import torch

    from vllm_parity.harness.kernel_candidate import build_kernel_model, kernel_for
    from vllm_parity.reference.checkpoint import Checkpoint
    from vllm_parity.serving.int8x_ops import KernelLinear

    monkeypatch.setenv("PARITY_INT8X_LAYOUT", layout)
    model = build_kernel_model(Checkpoint(make_fixture("int8x", tmp_path / "m", dims=SMALL)))
    linears = [m for m in model.modules() if isinstance(m, KernelLinear)]
    assert linears and {m.layout for m in linears} == {served}
    assert kernel_for(linears[0], 1, torch.float32, torch.device("cpu")) == f"{served}_torch"


def test_a_candidate_that_changes_its_weights_in_place_leaves_the_reference_alone(tmp_path):
    """The candidate runs first and the reference is built after it: the two must share no tensor, or a candidate
    writing its own weights would write the truth's too (safetensors hands out views of one mapping per file)."""
    import torch

    from vllm_parity.harness.session import Options, ParitySession

    s = ParitySession(Options(model=str(make_fixture("seed-article", tmp_path / "m", dims=SMALL)),
                              candidate="kernels", root=str(tmp_path)))
    norm = s._kernel_model().model.layers[0].input_layernorm.weight
    before = norm.detach().clone()
    with torch.no_grad():
        norm.mul_(1.5)
    reference = s._build_reference(torch.float32)
    torch.testing.assert_close(reference.model.layers[0].input_layernorm.weight.detach(), before, rtol=0, atol=0)
