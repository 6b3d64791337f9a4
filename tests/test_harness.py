"""The harness end to end on the CPU: the real vLLM engine against the fp32 reference."""

import json
import re
import shutil

import pytest
import torch

from vllm_parity.harness.dumps import DumpReader
from vllm_parity.fixtures.checkpoints import Dims, make_fixture
from tests.engine_runs import ZOO_PLUGIN, assert_same_dumps, tensor_parallel_dumps
from tests.engine_runs import report as _report
from tests.engine_runs import run as _run

pytest.importorskip("vllm", reason="the harness's default candidate is the vLLM engine")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]
pytest_plugins = ["pytester"]

SMALL = Dims(hidden=128, layers=3, heads=2, kv_heads=1, intermediate=256, vocab=1024)


def test_embedded_default_passes_every_level(pytester):
    result = _run(pytester, "--parity-level=model")
    # embed, 4 layers x 11 op taps, 4 layer outputs, final_norm + logits, greedy + top-k + logprobs
    result.assert_outcomes(passed=1 + 44 + 4 + 2 + 3)
    rep = _report(pytester)
    assert rep["schema"] == "parity-report/1" and rep["passed"] is True and rep["first_divergence"] is None
    assert rep["run"]["format"] == "ternary" and rep["run"]["level"] == "model"
    assert {t["name"] for t in rep["taps"]} >= {"embed", "layers.3.output", "layers.0.attn.q", "logits"}
    assert all(t["metrics"]["cosine"] > 0.999999 for t in rep["taps"])
    extras = rep["run"]["extras"]
    assert extras["greedy"]["passed"] and extras["topk"]["agree"] == 4 * 64
    assert extras["logprobs"]["passed"] and extras["logprobs"]["positions"] == 4 * 63
    for name in ("report.html", "summary.md"):
        assert (pytester.path / "report" / name).stat().st_size > 1000
    page = (pytester.path / "report" / "report.html").read_text()
    assert 'id="plot-layers"' in page and page.count("<tr class=") == len(rep["taps"])
    # and the same 51 taps at each of the default 2 decode steps (the KV cache), against the reference's forward
    # over the tokens the engine generated
    decode = [t for t in rep["taps"] if t.get("phase") == "decode"]
    assert rep["run"]["decode_steps"] == 2 and len(decode) == 2 * 51 and {t["step"] for t in decode} == {0, 1}
    assert all(t["verdict"] and t["role"] == "pass" for t in decode) and 'id="plot-steps"' in page
    result.stdout.fnmatch_lines(["parity: engine start (vLLM, tensor parallel 1)",
                                 "parity: reference capture (4 prompts, 2 decode steps in one forward)",
                                 "parity: compare */* taps (*s)"])
    counted = [(int(i), int(n)) for i, n in re.findall(r"parity: compare (\d+)/(\d+) taps", result.stdout.str())]
    assert counted and all(i <= n for i, n in counted) and counted[-1][0] == counted[-1][1], counted[-3:]
    result.stdout.fnmatch_lines(["*no divergence over 51 taps, each at the prefill and 2 decode step(s)*"])
    assert not (pytester.path / "snap").exists()


def test_golden_gate_on_the_embedded_default(pytester):
    """The nightly gate, in CI: the committed golden of the embedded default, no fp32 reference built."""
    from pathlib import Path

    golden = Path(__file__).resolve().parents[1] / "references" / "golden" / "default"
    (pytester.path / "references" / "golden").mkdir(parents=True)
    (pytester.path / "references" / "golden" / "default").symlink_to(golden)
    result = _run(pytester, "--parity-level=model", "--parity-against=golden", "-v")
    result.assert_outcomes(passed=1 + 44 + 4 + 2 + 3)
    result.stdout.fnmatch_lines(["parity::test_parity?block-layers.2.output? PASSED*"])
    rep = _report(pytester)
    assert rep["run"]["against"] == "golden" and rep["run"]["unused_golden_taps"] == []
    assert "reference_s" not in rep["run"]["timings"]
    # its decode steps ran the reference's own greedy tokens, and the engine was made to run them
    decode = [t for t in rep["taps"] if t.get("phase") == "decode"]
    assert rep["run"]["decode_steps"] == 2 and "decode_skipped" not in rep["run"]
    assert len(decode) == 2 * 51 and all(t["verdict"] and t["role"] == "pass" for t in decode)


def test_a_golden_without_decode_steps_says_so(pytester, tmp_path):
    """A golden written before it held decode steps still gates the prefill, and the run says why it compared
    no decode step."""
    import json
    from pathlib import Path

    golden = Path(__file__).resolve().parents[1] / "references" / "golden" / "default"
    dest = pytester.path / "references" / "golden" / "default"
    shutil.copytree(golden, dest, ignore=shutil.ignore_patterns("decode*"))
    manifest = json.loads((dest / "manifest.json").read_text())
    del manifest["decode"]
    (dest / "manifest.json").write_text(json.dumps(manifest))
    result = _run(pytester, "--parity-level=block", "--parity-against=golden")
    result.assert_outcomes(passed=1 + 44 + 4)
    rep = _report(pytester)
    assert rep["run"]["decode_steps"] == 0 and "holds no decode steps" in rep["run"]["decode_skipped"]


# qwen3: per-head norms, sharded by head as q and k are (nightly: the CI time budget)
@pytest.mark.parametrize("arch", ["llama", pytest.param("qwen3", marks=pytest.mark.nightly)])
def test_tensor_parallel_dumps_equal_single_rank(tmp_path, arch):
    from vllm_parity.fixtures.prompts import load_prompts

    model = make_fixture("seed-article", tmp_path / "m", dims=SMALL, arch=arch)
    dumps = tensor_parallel_dumps(model, arch, load_prompts()[:2], tmp_path)
    assert_same_dumps(dumps[1], dumps[2])
    shutil.rmtree(tmp_path / "m")


FAULTY_PLUGIN = '''
"""A test-only variant of the vLLM plugin: one projection's method carries a planted fault."""
import dataclasses, os

import torch


def pytest_configure(config):
    from vllm.model_executor.layers.quantization import register_quantization_config

    from vllm_parity.serving import vllm as vllm_plugin
    from vllm_parity.serving.vllm.ternary import TernaryConfig
    from vllm_parity.serving.vllm.ternary import TernaryLinearMethod

    kind, target = os.environ["PARITY_TEST_FAULT"].split(":")
    vllm_plugin.register()  # the real registration first; the engine's own call is then a no-op

    class ScaleMissing(TernaryLinearMethod):
        def process_weights_after_loading(self, layer):
            super().process_weights_after_loading(layer)
            layer.parity_scale.fill_(1.0)  # the kernel-layout scale: as if the kernel never applied it

    class FaultyTernaryConfig(TernaryConfig):
        def make_method(self, modules):
            if modules == [target] and kind == "bit_order":
                flipped = "msb" if self.spec.bit_order == "lsb" else "lsb"
                return TernaryLinearMethod(dataclasses.replace(self.spec, bit_order=flipped), modules)
            if modules == [target] and kind == "scale_missing":
                return ScaleMissing(self.spec, modules)
            return super().make_method(modules)

    register_quantization_config("ternary")(FaultyTernaryConfig)
'''


# one fault class here (the debugger, the funnel, the snapshot); every class is localized in test_fault_zoo
@pytest.mark.parametrize("fault, module, tap", [("bit_order", "model.layers.2.mlp.down_proj", "layers.2.mlp.down")])
def test_planted_fault_fails_at_exactly_its_tap(pytester, monkeypatch, fault, module, tap):
    pytester.makeconftest(FAULTY_PLUGIN)
    monkeypatch.setenv("PARITY_TEST_FAULT", f"{fault}:{module}")
    # --parity-pdb stops at the source with the tensors loaded; the debugger reads these commands
    commands = b"p ('DIFF', tuple(diff.shape), float(diff.abs().max()) > 0.1)\nc\n"
    result = _run(pytester, "--parity-level=model", "-v", "-rfs", "--parity-pdb", stdin=commands)
    result.stdout.fnmatch_lines([f"parity: first source {tap}: *", "*('DIFF', (256, *), True)*"])
    failing = f"parity::test_parity[op-{tap}]"
    pattern = failing.replace("[", "?").replace("]", "?")  # fnmatch reads brackets as a character set
    rep = _report(pytester)
    prefill = [t for t in rep["taps"] if t.get("phase") != "decode"]
    taps = [t["name"] for t in prefill]
    by = {t["name"]: t for t in prefill}
    assert all(by[t]["passed"] for t in taps[: taps.index(tap)]), "taps before the fault must pass"
    assert not by[tap]["passed"] and by[tap]["role"] == "source"
    assert rep["first_divergence"] == {"name": tap, "layer": int(tap.split(".")[1])}
    result.stdout.fnmatch_lines([f"FAILED {pattern}*"])
    # the funnel: block and model items are skipped, naming the first failure below them
    result.stdout.fnmatch_lines([f"SKIPPED * funnel: level 'op' failed first at {pattern}; no block-level*",
                                 f"SKIPPED * funnel: level 'op' failed first at {pattern}; no model-level*"])
    outcomes = result.parseoutcomes()
    op_before = [t for t in taps[: taps.index(tap)] if by[t]["level"] == "op"]
    assert outcomes["skipped"] == 4 + 2 + 3 and outcomes.get("passed", 0) == len(op_before)
    snaps = list((pytester.path / "snap").iterdir())
    assert len(snaps) == 1
    meta = json.loads((snaps[0] / "meta.json").read_text())
    assert "--parity-level=model" in meta["command"]
    assert tap in json.loads((snaps[0] / "diff.json").read_text())


def test_isolated_mode_marks_only_the_faulty_layer(pytester, monkeypatch):
    pytester.makeconftest(FAULTY_PLUGIN)
    monkeypatch.setenv("PARITY_TEST_FAULT", "bit_order:model.layers.1.self_attn.o_proj")
    result = _run(pytester, "--parity-level=block", "--parity-mode=isolated")
    rep = _report(pytester)
    by = {t["name"]: t for t in rep["taps"] if t.get("phase") != "decode"}
    sources = [t["name"] for t in rep["taps"] if t["role"] == "source"]  # at the decode steps, the same fault again
    assert sources == ["layers.1.attn.o"]
    assert rep["first_divergence"]["name"] == "layers.1.attn.o"
    # propagated, every later layer fails too; isolated, layers 2 and 3 are clean
    assert not by["layers.3.output"]["passed"] and by["layers.3.output"]["isolated"]["passed"]
    assert by["layers.3.output"]["role"] == "inherited"
    assert not by["layers.1.output"]["isolated"]["passed"]
    outcomes = result.parseoutcomes()
    # isolated items fail on their own error: layer 1's attn.o and mlp.norm (the residual stream it joins); the
    # projections after it, each fed the reference's input, pass; the block level waits for the op level (funnel)
    assert (outcomes["failed"], outcomes["skipped"]) == (2, 4), outcomes
    assert by["layers.1.mlp.down"]["role"] == "inherited" and by["layers.1.mlp.gate"]["isolated"]["passed"]
    assert not by["layers.1.mlp.norm"]["isolated"]["passed"]


def test_calibrated_tolerances_are_written_and_consumed(pytester):
    tol, dumps = pytester.path / "calibrated.toml", pytester.path / "dumps"
    result = _run(pytester, "--parity-level=block", f"--parity-calibrate={tol}", f"--parity-dump-dir={dumps}")
    result.assert_outcomes(passed=49)
    import tomllib

    table = tomllib.loads(tol.read_text())
    assert set(table["tolerances"]) >= {"embed", "layers.3.output", "layers.0.input"}
    down = table["tolerances"]["layers.2.mlp.down"]
    assert 0 < down["token_rtol"] < 1e-2 and 0 < down["row_rtol"] < 1e-2 and down["rtol"] == down["row_rtol"]
    assert "# widest: " in tol.read_text()
    rep = _report(pytester)
    assert rep["run"]["extras"]["calibration"]["file"] == str(tol)
    assert sum(rep["run"]["extras"]["calibration"]["widest_spread"].values()) == len(table["tolerances"])
    # the file, read as --parity-tolerances reads it, judges the run's own dumps: every tap inside
    from vllm_parity.architectures import lookup
    from vllm_parity.harness.compare import compare_dumps
    from vllm_parity.harness.tolerances import load

    ref, cand = DumpReader(dumps / "reference"), DumpReader(dumps / "candidate")
    by = {r.name: r for r in compare_dumps(ref, cand, ref.taps(), load(tol), 4, lookup("llama"))}
    assert by["layers.2.mlp.down"].tolerance.token_rtol == down["token_rtol"]
    assert all(r.passed for r in by.values()) and by["layers.2.mlp.down"].metrics.margin >= 1


@pytest.mark.nightly  # three runs of the engine (the CI time budget); CI keeps the embedded default's golden gate
def test_golden_round_trip_and_gate(pytester, monkeypatch, tmp_path):
    model = make_fixture("seed-article", tmp_path / "tiny", dims=SMALL)
    golden = pytester.path / "references" / "golden" / "tiny"
    args = ("--parity-level=model", f"--parity-model={model}", "--parity-against=golden")
    # a missing golden is written from the live reference, and the run fails: nothing was checked
    result = _run(pytester, *args)
    assert result.ret == 1 and (golden / "manifest.json").is_file()
    result.stdout.fnmatch_lines(["*was written now from the live reference*", "*golden reference written*"])
    # a tap that no comparison reads, added to the golden, is reported
    from vllm_parity.harness.dumps import DumpWriter
    from vllm_parity.harness.golden import write_golden

    src = DumpReader(golden)
    extended = DumpWriter(tmp_path / "extended", {k: v for k, v in src.manifest.items() if k not in ("taps", "schema")})
    for tap in src.taps():
        extended.write(tap, {f"{tap}@{p}": src.get(tap, p) for p in src.prompts(tap)})
    extended.write("stale", {"layers.7.output@0": torch.zeros(2, 128)})
    from vllm_parity.harness.dumps import step_dir

    for s in range(src.manifest["decode"]["steps"]):  # the decode steps go along (a dump keeps them beside it)
        shutil.copytree(golden / f"decode{s}", step_dir(tmp_path / "extended", s))
    write_golden(DumpReader(extended.close()), golden, extras=src.manifest.get("golden", {}).get("extras"))
    # a clean run passes against it without building the fp32 reference
    result = _run(pytester, *args)
    result.assert_outcomes(passed=1 + 33 + 3 + 2 + 3)
    timings = _report(pytester)["run"]["timings"]
    assert "reference_s" not in timings and "candidate_s" in timings
    result.stdout.fnmatch_lines(["*unused golden taps (no comparison read them): ?'layers.7.output'?*"])
    assert _report(pytester)["run"]["unused_golden_taps"] == ["layers.7.output"]
    # a planted fault fails against the golden, still with no reference built
    pytester.makeconftest(FAULTY_PLUGIN)
    monkeypatch.setenv("PARITY_TEST_FAULT", "scale_missing:model.layers.1.mlp.down_proj")
    result = _run(pytester, *args)
    rep = _report(pytester)
    assert rep["first_divergence"]["name"] == "layers.1.mlp.down" and "reference_s" not in rep["run"]["timings"]



ZOO = [  # (fault class, projection, the tap where it must show)
    ("code_table", "model.layers.0.self_attn.o_proj", "layers.0.attn.o"),
    ("bit_order", "model.layers.1.mlp.down_proj", "layers.1.mlp.down"),
    ("pack_layout", "model.layers.2.self_attn.o_proj", "layers.2.attn.o"),
    ("scale_missing", "model.layers.3.mlp.down_proj", "layers.3.mlp.down"),
    ("scale_inverted", "model.layers.4.self_attn.o_proj", "layers.4.attn.o"),
    ("scale_dtype", "model.layers.5.mlp.down_proj", "layers.5.mlp.down"),
    ("group_size", "model.layers.6.mlp.down_proj", "layers.6.mlp.down"),
    ("slices_swapped", "model.layers.7.self_attn.k_proj", "layers.7.attn.k"),
]


def test_fault_zoo(pytester, monkeypatch, tmp_path):
    """One engine, eight layers, a different planted fault in each: isolated mode marks exactly the
    planted taps as sources, the first one is the first divergence, and each hint names its class."""
    from vllm_parity.fixtures.checkpoints import with_spec

    spec = with_spec("seed-article", scale_granularity="group", group_size=32)
    model = make_fixture("ternary", tmp_path / "zoo", spec=spec, scale_dtype="float16",
                         dims=Dims(hidden=128, layers=8, heads=2, kv_heads=1, intermediate=256, vocab=1024))
    pytester.makeconftest(ZOO_PLUGIN)
    monkeypatch.setenv("PARITY_TEST_FAULTS", ",".join(f"{m}={k}" for k, m, _ in ZOO))
    _run(pytester, "--parity-level=op", f"--parity-model={model}", "--parity-mode=isolated")
    rep = _report(pytester)
    sources = [t["name"] for t in rep["taps"] if t["role"] == "source"]
    assert sources == [tap for _, _, tap in ZOO] + ["layers.7.attn.v"]
    assert rep["first_divergence"]["name"] == "layers.0.attn.o"
    kinds = {}
    for h in rep["hints"]:
        kinds.setdefault(h["tap"], []).append(h["kind"])
    for kind, _, tap in ZOO:
        assert kinds.get(tap, [None])[0] == kind, (tap, kinds.get(tap))


def _corrupt_rank1(worker, module):
    """Runs in each tensor-parallel worker: rank 1's shard of one layer gets its scales negated."""
    from vllm.distributed import get_tensor_model_parallel_rank

    if get_tensor_model_parallel_rank() == 1:
        worker.model_runner.get_model().get_submodule(module).parity_scale.mul_(-1.0)
    return True


def _widen_norm_eps(model, eps):
    for m in model.modules():
        if hasattr(m, "variance_epsilon"):
            m.variance_epsilon = eps
    return True


def _session(model, tmp_path, **opts):
    from vllm_parity.harness.session import Options, ParitySession

    return ParitySession(Options(model=str(model), report_dir=str(tmp_path / "report"),
                                 snapshot_dir=str(tmp_path / "snap"), root=str(tmp_path), **opts))


def test_one_wrong_tensor_parallel_shard_is_named(tmp_path):
    model = make_fixture("seed-article", tmp_path / "m", dims=SMALL)
    s = _session(model, tmp_path, level="op", tensor_parallel_size=2)
    try:
        s.llm().collective_rpc(_corrupt_rank1, args=("model.layers.1.mlp.gate_up_proj",))
        results = s.judgement()
        hints = {(h.tap, h.kind) for h in s.diagnosis().hints}
    finally:
        s.finish()
    assert [r.name for r in results.taps if r.role == "source"] == ["layers.1.mlp.gate", "layers.1.mlp.up"]
    assert ("layers.1.mlp.gate", "tp_shard") in hints and ("layers.1.mlp.up", "tp_shard") in hints


def test_norm_epsilon_drift_is_named(tmp_path):
    model = make_fixture("seed-article", tmp_path / "m",
                         dims=Dims(hidden=128, layers=8, heads=2, kv_heads=1, intermediate=256, vocab=1024))
    s = _session(model, tmp_path, level="block")
    try:
        s.llm().apply_model(lambda m: _widen_norm_eps(m, 3e-4))  # the checkpoint says 1e-5
        hints = [h for h in s.diagnosis().hints if h.kind == "drift"]
    finally:
        s.finish()
    assert hints
    assert "token relative error of the layer outputs grows steadily" in hints[0].evidence
