"""Verdicts on a real model: SmolLM2-135M-Instruct (real weights, real prompts, massive activations),
through the real engine, with default options — and the faults of the zoo still found on it."""

import json

import pytest

from vllm_parity.harness.compare import compare_dumps, merge_isolated
from vllm_parity.harness.dumps import DumpReader
from vllm_parity.harness.session import Options, ParitySession
from vllm_parity.harness.tolerances import load
from tests.engine_runs import ZOO_PLUGIN, report, run

pytest.importorskip("vllm", reason="the harness's default candidate is the vLLM engine")
real_model = pytest.importorskip("vllm_parity.fixtures.real_model")
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.real_model]
pytest_plugins = ["pytester"]

LAYERS = 30
TAPS = 1 + LAYERS * 12 + 2  # embed, 11 op taps and the output of every layer, final_norm, logits
REAL_ZOO = [  # (fault class, projection, the tap where it must show); the real model's kv size is 3 x 64
    ("channel_scale", "model.layers.2.mlp.gate_proj", "layers.2.mlp.gate"),
    ("code_table", "model.layers.4.self_attn.o_proj", "layers.4.attn.o"),
    ("bit_order", "model.layers.7.mlp.down_proj", "layers.7.mlp.down"),
    ("pack_layout", "model.layers.10.self_attn.o_proj", "layers.10.attn.o"),
    ("scale_missing", "model.layers.13.mlp.down_proj", "layers.13.mlp.down"),
    ("scale_inverted", "model.layers.16.self_attn.o_proj", "layers.16.attn.o"),
    ("scale_dtype", "model.layers.19.mlp.down_proj", "layers.19.mlp.down"),
    ("group_size", "model.layers.22.mlp.down_proj", "layers.22.mlp.down"),
    ("slices_swapped", "model.layers.25.self_attn.k_proj", "layers.25.attn.k"),
]


@pytest.fixture(scope="module")
def prompts():
    try:
        return str(real_model.prompts_path())
    except real_model.RealModelUnavailable as exc:
        pytest.skip(str(exc))


def _model(fmt):
    return str(real_model.model_dir(fmt))


def test_the_real_model_is_real(prompts):
    """The converted checkpoint is the model transformers loads from the GGUF file, with its
    massive activation, and the prompts are its own tokens."""
    from vllm_parity.reference.checkpoint import Checkpoint
    from vllm_parity.reference.model import build_reference_model

    ckpt = Checkpoint(_model("fp"))
    assert ckpt.config["num_hidden_layers"] == LAYERS and ckpt.config["vocab_size"] == 49152
    ids = json.loads(open(prompts).read())
    assert len(ids) == 3 and ids[0] == [504, 3575, 282, 4649, 314]  # "The capital of France is"
    import torch

    model = build_reference_model(ckpt)
    with torch.no_grad():
        out = model(torch.tensor([ids[0]]), output_hidden_states=True)
    assert int(out.logits[0, -1].argmax()) == 7042  # " Paris"
    assert float(out.hidden_states[20].abs().max()) > 10_000  # a massive activation in the residual stream


# The project's formats from the real weights in the nightly gate (the CI budget): CI keeps the stock control
# here and the seed format's real weights in the fault zoo, where every tap but the planted ones passes with
# default options; the formats' tiny fixtures run in CI everywhere
@pytest.mark.parametrize("fmt", ["fp", pytest.param("seed-article", marks=pytest.mark.nightly),
                                 pytest.param("int8x", marks=pytest.mark.nightly)])
def test_every_level_passes_with_default_options(pytester, prompts, fmt):
    """Stock vLLM against stock transformers (fp), and the project's formats made from the real weights."""
    result = run(pytester, "--parity-level=model", f"--parity-model={_model(fmt)}", f"--parity-prompts={prompts}")
    result.assert_outcomes(passed=TAPS + 3)
    rep = report(pytester)
    assert rep["passed"] and rep["first_divergence"] is None and rep["hints"] == []
    # the worst correct tap is far inside its tolerance: 1/4.9 on an AVX-512/AMX CPU (layers.2.mlp.act, a
    # small row of token 1 under the row-scaled element bound), more elsewhere; the faults of the zoo sit above 1
    assert rep["separation"]["worst_passing"]["margin"] > 3
    result.stdout.fnmatch_lines(["*separation: the passing tap closest to its tolerance is *"])


def _zoo(pytester, monkeypatch, *args):
    pytester.makeconftest(ZOO_PLUGIN)
    monkeypatch.setenv("PARITY_TEST_FAULTS", ",".join(f"{m}={k}" for k, m, _ in REAL_ZOO))
    monkeypatch.setenv("PARITY_TEST_KV", "192")
    return run(pytester, "--parity-level=op", f"--parity-model={_model('seed-article-g64')}",
               "--parity-mode=isolated", *args)


def _zoo_sources(pytester, monkeypatch, prompts, dumps) -> list[str]:
    """The zoo run (dumps kept in ``dumps``) and its checks; the sources it marked."""
    _zoo(pytester, monkeypatch, f"--parity-prompts={prompts}", f"--parity-dump-dir={dumps}")
    rep = report(pytester)
    sources = [t["name"] for t in rep["taps"] if t["role"] == "source"]
    assert sources == [tap for _, _, tap in REAL_ZOO] + ["layers.25.attn.v"]
    assert rep["first_divergence"]["name"] == "layers.2.mlp.gate"
    kinds = {}
    for h in rep["hints"]:
        kinds.setdefault(h["tap"], []).append(h["kind"])
    for kind, _, tap in REAL_ZOO[1:]:
        assert kinds.get(tap, [None])[0] == kind, (tap, kinds.get(tap))
    channel = next(t for t in rep["taps"] if t["name"] == "layers.2.mlp.gate")
    assert channel["isolated"]["metrics"]["token_rel"] < channel["tolerance"]["token_rtol"]  # the element check found it
    return sources


def test_the_fault_zoo_is_found_on_the_real_model(pytester, monkeypatch, prompts, tmp_path):
    """One engine, nine faulty layers: isolated mode marks exactly the planted taps as sources (every other tap
    passes with default options), one output channel 1 % off among them; each zoo fault gets its hint first."""
    _zoo_sources(pytester, monkeypatch, prompts, tmp_path / "dumps")


@pytest.mark.nightly  # a second engine run (the CI time budget)
def test_calibrated_tolerances_keep_the_real_zoo_sources(pytester, monkeypatch, prompts, tmp_path):
    """Calibrated on the correct model, the candidate passes, and the zoo's dumps judged with those tolerances
    show the same sources."""
    dumps = tmp_path / "dumps"
    sources = _zoo_sources(pytester, monkeypatch, prompts, dumps)
    calibrated = tmp_path / "calibrated.toml"
    opts = Options(model=_model("seed-article-g64"), prompts=prompts, level="block", calibrate=str(calibrated),
                   report_dir=str(tmp_path / "cal-report"), snapshot_dir=str(tmp_path / "snap"), root=str(tmp_path))
    session = ParitySession(opts)
    try:
        results = session.judgement().taps
    finally:
        session.finish()
    assert all(r.passed for r in results), [r.message for r in results if not r.passed][:3]
    table = load(calibrated)
    ref, cand, iso = (DumpReader(dumps / side) for side in ("reference", "candidate", "candidate-isolated"))
    taps = [t for t in ref.taps() if t != "logits"]
    judged = compare_dumps(ref, cand, taps, table, LAYERS)
    judged = merge_isolated(judged, compare_dumps(ref, iso, taps, table, LAYERS))
    assert [r.name for r in judged if r.role == "source" and not r.name.endswith(".input")] == sources
