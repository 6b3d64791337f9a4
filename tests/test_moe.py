"""The mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE): fixtures in the checkpoints' per-expert
layout, the reference's fused experts, and the real vLLM engine against it."""

import importlib.util
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_parity.fixtures.checkpoints import Dims, make_fixture
from vllm_parity.reference.checkpoint import parameter_shapes, stored_names

from tests.engine_runs import session

MOE = ["mixtral", "qwen2_moe", "qwen3_moe"]
SMALL = Dims(hidden=128, layers=3, heads=2, kv_heads=1, intermediate=256, vocab=1024)
TINY = Dims(hidden=64, layers=2, heads=2, kv_heads=1, intermediate=128, vocab=256)

pytest_plugins = ["pytester"]


def _files(path):
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def _header(path):
    with open(path / "model.safetensors", "rb") as f:
        return {k: v for k, v in json.loads(f.read(int.from_bytes(f.read(8), "little"))).items()
                if k != "__metadata__"}


@pytest.mark.parametrize("arch", MOE)
def test_moe_fixture_is_the_checkpoint_layout_transformers_loads(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    a = make_fixture("fp", tmp_path / "a", seed=3, dims=TINY, arch=arch)
    assert _files(a) == _files(make_fixture("fp", tmp_path / "b", seed=3, dims=TINY, arch=arch))
    assert _files(a) != _files(make_fixture("fp", tmp_path / "c", seed=4, dims=TINY, arch=arch))
    config = json.loads((a / "config.json").read_text())
    header = _header(a)
    # one tensor per expert and projection on disk, none of transformers' fused 3-D parameters
    assert not any(name.endswith(("experts.gate_up_proj", "experts.down_proj")) for name in header)
    experts = config.get("num_local_experts") or config["num_experts"]
    per_expert = [n for n in header if ".experts.3." in n and n.startswith("model.layers.0.")]
    assert experts == 4 and len(per_expert) == 3
    want = {s: shape for sources in stored_names(config).values() for s, shape in sources.items()}
    assert {n: tuple(h["shape"]) for n, h in header.items()} == want
    model, info = AutoModelForCausalLM.from_pretrained(a, output_loading_info=True)
    assert type(model).__name__ == config["architectures"][0]
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    params = dict(model.named_parameters())
    assert params["model.layers.0.mlp.experts.gate_up_proj"].dim() == 3
    # the per-expert tensors on disk are what transformers fused: expert 2's gate rows of layer 0
    gate = next(n for n in header if n.startswith("model.layers.0.") and ".experts.2." in n
                and n.endswith(("w1.weight", "gate_proj.weight")))
    from safetensors import safe_open

    with safe_open(str(a / "model.safetensors"), "pt") as f:
        stored = f.get_tensor(gate)
    assert torch.equal(params["model.layers.0.mlp.experts.gate_up_proj"][2, : stored.shape[0]], stored)
    if arch == "mixtral":
        assert "model.layers.0.block_sparse_moe.gate.weight" in header
    if arch == "qwen3_moe":  # layer 1 is dense (mlp_only_layers)
        assert "model.layers.1.mlp.gate_proj.weight" in header and "model.layers.1.mlp.gate.weight" not in header
        assert set(parameter_shapes(config)) >= {"model.layers.1.mlp.down_proj.weight",
                                                  "model.layers.0.mlp.experts.down_proj"}


@pytest.mark.parametrize("arch", MOE)
def test_moe_reference_equals_transformers(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    from vllm_parity.fixtures.prompts import load_prompts
    from vllm_parity.reference.model import build_reference_model

    path = make_fixture("fp", tmp_path / arch, dims=SMALL, arch=arch)
    ids = torch.tensor([p[:32] for p in load_prompts()])
    ref = build_reference_model(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        a, b = ref(ids).logits, hf(ids).logits
    assert a.shape == (4, 32, SMALL.vocab) and a.std() > 0.1
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch", MOE)
def test_tap_rows_follow_the_layer_kind(arch):
    from vllm_parity.architectures import lookup
    from vllm_parity.harness.taps import canonical_order, inputs_of

    family = lookup(arch)
    config = SMALL.config(arch)
    taps = canonical_order(3, family, config)
    dense_layers = {1} if arch == "qwen3_moe" else set()
    for i in range(3):
        assert (f"layers.{i}.moe.out" in taps) == (i not in dense_layers)
        assert (f"layers.{i}.mlp.down" in taps) == (i in dense_layers)
        assert (f"layers.{i}.moe.shared" in taps) == (arch == "qwen2_moe")
        # a layer's output reads the MLP it has
        mlp = "mlp.down" if i in dense_layers else "moe.out"
        assert [t for t in inputs_of(f"layers.{i}.output", 3, family) if t in taps] == \
            [f"layers.{i}.input", f"layers.{i}.attn.o", f"layers.{i}.{mlp}"]
    assert inputs_of("layers.0.moe.router", 3, family) == ["layers.0.mlp.norm"]
    # transformers' config object names the expert count otherwise for Qwen3-MoE: the same layers
    from transformers import AutoConfig

    as_object = AutoConfig.for_model(arch, **{k: v for k, v in config.items() if k != "model_type"})
    assert canonical_order(3, family, as_object) == taps
    # without a config every row is kept: a superset, in the same order
    assert [t for t in canonical_order(3, family) if t in taps] == taps


# per layer: the attention's taps (Qwen3-MoE's with its head norms), the MLP's norm, then a sparse layer's
# router (Qwen2-MoE: shared expert input and output) and block, or a dense layer's four MLP taps
OP_TAPS = {"mixtral": 3 * (6 + 1 + 2), "qwen2_moe": 3 * (6 + 1 + 4), "qwen3_moe": 2 * (8 + 1 + 2) + (8 + 1 + 4)}


# vLLM is not imported at module level: the engine runs in process (ParitySession starts it), and the one
# pytester run below is a subprocess
NEEDS_VLLM = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")


def _run(model, tmp_path, name, llm=None, keep_engine=False, checks=("routing", "greedy", "topk", "logprobs")):
    """One in-process run at every level (on ``llm`` when given), everything the tests read of it made before
    its dumps go: the verdicts, ``checks`` (the op and model checks), the diagnosis, the record;
    ``keep_engine``: the engine is handed over (``llm`` of the result) instead of closed."""
    from types import SimpleNamespace

    s = session(model, tmp_path, name, llm=llm, level="model")
    try:
        judgement = s.judgement()
        results = {c: s.check(c) for c in checks}
        run = SimpleNamespace(judgement=judgement, checks=results, op_checks=s.op_checks(),
                              hints={(h.tap, h.kind) for h in s.diagnosis().hints}, record=s.record(),
                              config=s.ckpt.config, llm=None)
    finally:
        if keep_engine:
            llm = s.hand_over()
        s.finish()
    run.llm = llm if keep_engine else None
    return run


def _every_level_passes(run, arch):
    """Every tap of the family's canonical order compared and passing, the routing check among the op-level
    items, the model-level checks passing."""
    from vllm_parity.architectures import lookup
    from vllm_parity.harness.taps import canonical_order

    taps = [t.name for t in run.judgement.taps]
    assert taps == [t for t in canonical_order(SMALL.layers, lookup(arch), run.config) if not t.endswith(".input")]
    # embed, the op taps, 3 layer outputs, final_norm + logits
    assert len(taps) == 1 + OP_TAPS[arch] + 3 + 2 and taps[0] == "embed" and taps[-2:] == ["final_norm", "logits"]
    failed = [(t.name, t.metrics.as_dict() if t.metrics else t.message) for t in run.judgement.taps if not t.passed]
    assert not failed, failed
    assert run.judgement.passed and run.op_checks == ["routing"]
    for check in ("routing", "greedy", "topk", "logprobs"):
        assert run.checks[check]["passed"], (check, run.checks[check])
    assert run.record.checks["routing"] == run.checks["routing"]  # the record (and report) carries it


def _fp_control(run, arch):
    _every_level_passes(run, arch)
    assert run.record.run["architecture"] == arch and run.record.run["format"] == "fp"
    assert run.judgement["layers.0.moe.router"].passed
    assert run.judgement["layers.2.moe.out"].metrics.cosine > 0.999999
    routing = run.checks["routing"]
    sparse = 2 if arch == "qwen3_moe" else 3
    assert routing["passed"] and routing["first_disagreement"] is None and routing["k"] == 2
    assert routing["total"] == sparse * 4 * 64 and routing["agree"] + routing["ties"] == routing["total"]
    assert routing["fraction"] == routing["agree"] / routing["total"] > 0.99


@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_moe"])  # Mixtral's: TestMixtralEngine
@pytest.mark.vllm
@pytest.mark.slow
@NEEDS_VLLM
def test_fp_control_moe(tmp_path, arch):
    """Stock vLLM against stock transformers on each MoE family: every level passes, routing agrees."""
    _fp_control(_run(make_fixture("fp", tmp_path / "fp", dims=SMALL, arch=arch), tmp_path, "fp"), arch)


def _routers(path, rows: dict[int, list[list[float]]]):
    from vllm_parity.harness.dumps import DumpReader, DumpWriter, key

    w = DumpWriter(path, {"side": "x"})
    for layer, r in rows.items():
        w.write(f"layers.{layer}", {key(f"layers.{layer}.moe.router", 0): torch.tensor(r)})
    return DumpReader(w.close())


def test_routing_agreement_counts_tokens_and_names_the_first_disagreement(tmp_path):
    from vllm_parity.harness import model_checks
    from vllm_parity.harness.metrics import Tolerance

    tol = Tolerance(row_rtol=1e-3)
    routers = {0: "layers.0.moe.router", 1: "layers.1.moe.router"}
    ref = _routers(tmp_path / "r", {0: [[3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0]],
                                    1: [[1.0, 1.0005, 0.0, 5.0], [4.0, 3.0, 0.0, 0.0]]})
    # layer 0 token 0: the same set in another order; layer 1 token 0: a tie at the k-th place (experts 0
    # and 1 within the element bound, 2.6e-3 there) resolved otherwise; layer 1 token 1: experts {0, 1}
    # against {0, 2}
    cand = _routers(tmp_path / "c", {0: [[2.0, 3.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0]],
                                     1: [[1.1, 0.9, 0.0, 5.0], [4.0, 0.0, 3.0, 0.0]]})
    got = model_checks.routing(ref, cand, routers, k=2, tol=tol)
    assert (got["agree"], got["total"], got["ties"], got["passed"]) == (2, 4, 1, False)
    assert got["first_disagreement"] == {"layer": 1, "prompt": 0, "position": 1, "reference": [0, 1],
                                         "candidate": [0, 2]}
    assert got["layers"] == {"0": 1.0, "1": 0.0} and got["fraction"] == 0.5
    assert model_checks.routing(ref, ref, routers, k=2, tol=tol)["passed"]
    # the tie alone does not fail
    cand_tie = _routers(tmp_path / "t", {0: [[3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0]],
                                         1: [[1.1, 0.9, 0.0, 5.0], [4.0, 3.0, 0.0, 0.0]]})
    got = model_checks.routing(ref, cand_tie, routers, k=2, tol=tol)
    assert got["passed"] and got["ties"] == 1 and got["agree"] == 3


def _plant(model, checkpoint, fault: str, layer: int, expert: int):
    """A forward hook planting one mixture-of-experts fault in ``layer`` of the loaded vLLM Mixtral (removed
    by :func:`_unplant`). ``expert``: the block's output as if ``expert``'s down projection were 10 % off (its
    own contribution, computed from the checkpoint's tensors, added once more at a tenth: the down projection
    is linear in its weight). ``router``: the experts renumbered, the gate's output columns rolled by one (on
    its output: the CPU gemm packs the weight)."""
    prefix = f"model.layers.{layer}.block_sparse_moe"
    block = model.get_submodule(prefix)
    if fault == "expert":
        from safetensors import safe_open

        with safe_open(str(checkpoint / "model.safetensors"), "pt") as f:
            gate = f.get_tensor(f"{prefix}.gate.weight").float()
            w1, w2, w3 = (f.get_tensor(f"{prefix}.experts.{expert}.{w}.weight").float() for w in ("w1", "w2", "w3"))
        k = int(json.loads((checkpoint / "config.json").read_text())["num_experts_per_tok"])

        def more_of_one_expert(mod, args, out):
            x = args[0].reshape(-1, gate.shape[1]).float()
            top = torch.softmax(x @ gate.T, dim=-1).topk(k, dim=-1)  # Mixtral: softmax, top-k, renormalized
            weight = (top.values * (top.indices == expert)).sum(-1, keepdim=True) / top.values.sum(-1, keepdim=True)
            own = (torch.nn.functional.silu(x @ w1.T) * (x @ w3.T)) @ w2.T
            return out + (0.1 * weight * own).reshape(out.shape).to(out.dtype)

        handle = block.register_forward_hook(more_of_one_expert)
    else:
        perm = torch.roll(torch.arange(block.gate.output_size), 1)
        handle = block.gate.register_forward_hook(lambda mod, args, out: (out[0][:, perm], *out[1:]))
    model._parity_test_faults = [*getattr(model, "_parity_test_faults", []), handle]
    return True


def _unplant(model):
    for handle in getattr(model, "_parity_test_faults", []):
        handle.remove()
    model._parity_test_faults = []
    return True


def _faulty_run(mixtral_fp, fault):
    """A run on the clean run's engine with ``fault`` planted in layer 1 (expert 1), the fault removed after."""
    model, tmp, clean = mixtral_fp
    clean.llm.apply_model(lambda m: _plant(m, model, fault, layer=1, expert=1))
    try:
        return _run(model, tmp, f"faulty-{fault}", llm=clean.llm, keep_engine=True, checks=("routing",))
    finally:
        clean.llm.apply_model(_unplant)


@pytest.mark.vllm
@pytest.mark.slow
@NEEDS_VLLM
class TestMixtralEngine:
    """One fp Mixtral engine serves the fp control's clean run, then a run with each planted fault (the
    class's fixture closes it when the class is done, before any other engine starts: vLLM's in-process
    engines share one distributed state)."""

    @pytest.fixture(scope="class")
    @classmethod
    def mixtral_fp(cls, tmp_path_factory):
        tmp = tmp_path_factory.mktemp("mixtral-fp")
        model = make_fixture("fp", tmp / "fp", dims=SMALL, arch="mixtral")
        run = _run(model, tmp, "clean", keep_engine=True)
        try:
            yield model, tmp, run
        finally:
            from vllm_parity.harness.engine import close_llm

            close_llm(run.llm)

    def test_fp_control_moe(self, mixtral_fp):
        """Stock vLLM against stock transformers: every level passes, routing agrees."""
        _fp_control(mixtral_fp[2], "mixtral")

    @pytest.mark.parametrize("fault", ["expert", "router"])
    def test_planted_moe_fault_is_localized(self, mixtral_fp, fault):
        """One expert's weight wrong in layer 1: that layer's block output is the first source, routing still
        agrees there. The experts renumbered in layer 1: the router is the source, and routing disagrees."""
        from vllm_parity.harness.items import _describe_check

        run = _faulty_run(mixtral_fp, fault)
        tap = "layers.1.moe.out" if fault == "expert" else "layers.1.moe.router"
        taps = [t.name for t in run.judgement.taps]
        by = {t.name: t for t in run.judgement.taps}
        assert all(by[t].passed for t in taps[: taps.index(tap)]), "taps before the fault must pass"
        assert not by[tap].passed and (run.judgement.first.name, run.judgement.first.layer) == (tap, 1)
        assert [t for t in taps if by[t].role == "source"] == [tap]
        routing = run.checks["routing"]
        assert run.record.checks["routing"] == routing
        assert routing["layers"]["0"] > 0.99  # ties aside, every token of layer 0 routes alike
        if fault == "expert":
            # layer 1 routes alike; layer 2's routers read the wrong block output and may part
            assert by["layers.1.moe.router"].passed and routing["layers"]["1"] > 0.99
            assert routing["first_disagreement"] is None or routing["first_disagreement"]["layer"] == 2
        else:
            assert by["layers.1.moe.out"].role == "inherited"
            assert routing["layers"]["1"] < 0.5 and not routing["passed"]
            assert routing["first_disagreement"]["layer"] == 1
            assert routing["first_disagreement"]["prompt"] == 0
            # the hint names the renumbering: candidate expert j holds the reference's expert j - 1
            (hint, *_) = run.record.diagnosis.of(tap)
            assert hint.kind == "routing" and "with the experts renumbered (candidate expert ← reference " \
                "expert: 0←3, 1←0, 2←1, 3←2;" in hint.evidence, hint
            assert "chosen in place of" in hint.evidence and "model.layers.1.mlp.gate" in hint.fix
            # what the op-routing item fails with (its item: test_the_routing_item_names_the_first_disagreement)
            assert _describe_check("routing", routing).startswith(
                f"routing: {routing['agree']}/{routing['total']} tokens routed to the reference's top-2 experts "
                f"({routing['ties']} more at a tie); first disagreement at layer 1, prompt 0, position ")


ROUTER_FAULT_PLUGIN = '''
"""A test-only engine factory: the loaded vLLM Mixtral's experts renumbered in layer 1."""
import torch


def _plant(model):
    moe = model.model.layers[1].block_sparse_moe
    # the gate's rows permuted (on its output, the CPU gemm packs the weight)
    perm = torch.roll(torch.arange(moe.gate.output_size), 1)
    moe.gate.register_forward_hook(lambda mod, args, out: (out[0][:, perm], *out[1:]))
    return True


def pytest_configure(config):
    from vllm_parity.harness import engine

    original = engine.make_run_llm

    def make_run_llm(*args, **kwargs):
        llm = original(*args, **kwargs)
        llm.apply_model(_plant)
        return llm

    engine.make_run_llm = make_run_llm
'''


@pytest.mark.vllm
@pytest.mark.slow
@NEEDS_VLLM
def test_the_routing_item_names_the_first_disagreement(pytester, tmp_path):
    """What only the pytest items show: an MoE run has an ``op-routing`` item, and with the experts renumbered
    it fails with the first disagreement (the one subprocess of this file)."""
    from tests.engine_runs import run

    model = make_fixture("fp", tmp_path / "fp", dims=SMALL, arch="mixtral")
    pytester.makeconftest(ROUTER_FAULT_PLUGIN)
    # the two layers' routers only: the routing item judges those
    result = run(pytester, "--parity-level=op", "--parity-taps=layers.[01].moe.router", f"--parity-model={model}",
                 "-v")
    result.assert_outcomes(passed=1, failed=2)
    result.stdout.fnmatch_lines(["parity::test_parity?op-layers.0.moe.router? PASSED*",
                                 "parity::test_parity?op-layers.1.moe.router? FAILED*",
                                 "parity::test_parity?op-routing? FAILED*",
                                 "routing: * first disagreement at layer 1, prompt 0, position *"])


@pytest.mark.parametrize("fmt, arch", [("seed-article", "mixtral"), ("int8x", "mixtral"),
                                       pytest.param("seed-article", "qwen2_moe", marks=pytest.mark.nightly),
                                       pytest.param("int8x", "qwen2_moe", marks=pytest.mark.nightly),
                                       pytest.param("int8x", "qwen3_moe", marks=pytest.mark.nightly)])
@pytest.mark.vllm
@pytest.mark.slow
@NEEDS_VLLM
def test_quantized_experts_pass_every_level(tmp_path, fmt, arch):
    """The project's formats on the experts: vLLM's FusedMoE layers served by this plugin's methods (serving
    decoders), against the reference's fused experts (reference decoders); Qwen2-MoE's shared expert is a
    quantized MLP, its gate float (vLLM builds it unquantized); Qwen3-MoE's dense layer a quantized MLP.
    One run per format in CI (Mixtral), the other families nightly."""
    model = make_fixture(fmt, tmp_path / fmt, dims=SMALL, arch=arch)
    stored = _header(model)
    suffix = "weight_ternary" if fmt == "seed-article" else "weight_b1"
    block = "block_sparse_moe" if arch == "mixtral" else "mlp"
    assert f"model.layers.2.{block}.experts.3.{'w2' if arch == 'mixtral' else 'down_proj'}.{suffix}" in stored
    assert f"model.layers.2.{block}.gate.weight" in stored  # the router stays float, as vLLM's gate
    if arch == "qwen2_moe":
        assert "model.layers.2.mlp.shared_expert_gate.weight" in stored
        assert f"model.layers.2.mlp.shared_expert.down_proj.{suffix}" in stored
        assert "shared_expert_gate" in json.loads((model / "config.json").read_text())["quantization_config"]["ignore"]
    run = _run(model, tmp_path, fmt)
    _every_level_passes(run, arch)
    assert run.record.run["format"] == ("ternary" if fmt == "seed-article" else "int8x")


@pytest.mark.vllm
@pytest.mark.slow
@NEEDS_VLLM
@pytest.mark.parametrize("fmt, arch", [("fp", "qwen2_moe"),
                                       pytest.param("seed-article", "qwen2_moe", marks=pytest.mark.nightly)])
def test_tensor_parallel_moe_dumps_equal_single_rank(tmp_path, fmt, arch):
    """Qwen2-MoE's experts split over two ranks (each holds a slice of every expert's intermediate features;
    the block's output is reduced inside it; the shared expert leaves its down projection unreduced, a
    partial sum on each rank): the gathered dumps equal one rank's, stock and with ternary experts."""
    from vllm_parity.fixtures.prompts import load_prompts

    from tests.engine_runs import assert_same_dumps, tensor_parallel_dumps

    model = make_fixture(fmt, tmp_path / "m", dims=SMALL, arch=arch)
    dumps = tensor_parallel_dumps(model, arch, load_prompts()[:2], tmp_path)
    one, two = dumps[1], dumps[2]
    assert {"layers.1.moe.router", "layers.1.moe.shared", "layers.1.moe.out"} <= set(one.taps())
    assert two.manifest["parallel"]["layers.1.moe.shared"] == "partial"
    assert_same_dumps(one, two)


def _experts_layer(experts: int, tp_size: int = 1, tp_rank: int = 0):
    """A stand-in for vLLM's RoutedExperts: what the method reads of it."""
    from types import SimpleNamespace

    layer = torch.nn.Module()
    layer.moe_config = SimpleNamespace(moe_parallel_config=SimpleNamespace(tp_size=tp_size, tp_rank=tp_rank,
                                                                           use_ep=False))
    layer.activation, layer.global_num_experts = "silu", experts
    layer.ckpt_gate_proj_name, layer.ckpt_down_proj_name, layer.ckpt_up_proj_name = "w1", "w2", "w3"
    return layer


def _load_experts(method, layer, stored, skip=None):
    for (e, shard), tensors in stored.items():
        fused = "w2" if shard == "w2" else "w13"
        for suffix, t in tensors.items():
            if (e, shard, suffix) != skip:
                param = getattr(layer, f"{fused}_{suffix}")
                assert param.weight_loader(param, t, f"x.{fused}_{suffix}", shard, e, return_success=True)
    method.process_weights_after_loading(layer)


PREFIX = "model.layers.0.block_sparse_moe.experts"


@NEEDS_VLLM
@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_moe_methods_decode_each_expert_as_the_reference(data):
    """Any ternary variant (no activation quantization) or int8x, any expert count and sizes: the serving
    side's stacked experts equal the reference's decoding of each, and the product equals the dense
    mixture; under tensor parallelism a rank holds its slice of every expert's intermediate features."""
    import numpy as np

    from tests.strategies import ternary_specs
    from vllm_parity.fixtures.checkpoints import int8_weight, ternary_weight
    from vllm_parity.reference.formats import int8x
    from vllm_parity.reference.formats.int8x import Int8xSpec
    from vllm_parity.reference.formats.ternary import decode as ternary_decode
    from vllm_parity.serving.vllm.moe import Int8xMoEMethod, TernaryMoEMethod

    fmt = data.draw(st.sampled_from(["ternary", "int8x"]))
    experts, h, i = data.draw(st.integers(1, 3)), 8 * data.draw(st.integers(1, 3)), 8 * data.draw(st.integers(1, 3))
    rng = np.random.Generator(np.random.PCG64(data.draw(st.integers(0, 2**32 - 1))))
    shapes = {"w1": (i, h), "w3": (i, h), "w2": (h, i)}
    stored, want = {}, {}
    if fmt == "ternary":
        spec = data.draw(ternary_specs(group_sizes=(4, 8)))
        from dataclasses import replace

        spec = replace(spec, activation_quant=None)
        method = TernaryMoEMethod(spec, None, PREFIX)
        for e in range(experts):
            for shard, (n, k) in shapes.items():
                t = ternary_weight(rng, spec, n, k, torch.float16)
                stored[(e, shard)] = t
                want[(e, shard)] = ternary_decode(t[spec.weight_name], t[spec.scale_name], spec, n, k)
    else:
        spec = Int8xSpec()
        method = Int8xMoEMethod(spec, None, PREFIX)
        for e in range(experts):
            for shard, (n, k) in shapes.items():
                q, scale = int8_weight(rng, n, k)
                stored[(e, shard)] = int8x.encode(q, scale, spec)
                want[(e, shard)] = int8x.decode(stored[(e, shard)], spec)
    tp = data.draw(st.sampled_from([d for d in (1, 2, 4) if i % d == 0]))
    rank = data.draw(st.integers(0, tp - 1))
    part = slice(rank * i // tp, (rank + 1) * i // tp)
    want = {(e, s): w[:, part] if s == "w2" else w[part] for (e, s), w in want.items()}
    layer = _experts_layer(experts, tp, rank)
    method.create_weights(layer, experts, h, i // tp, torch.float32)
    _load_experts(method, layer, stored)
    for e in range(experts):
        assert torch.equal(layer.parity_w13[e], torch.cat([want[(e, "w1")], want[(e, "w3")]]))
        assert torch.equal(layer.parity_w2[e], want[(e, "w2")])
    x = torch.randn(5, h, dtype=torch.float32)
    k = min(2, experts)
    topk_weights, topk_ids = torch.rand(5, experts).topk(k, dim=-1)
    got = method.apply(layer, x, topk_weights, topk_ids)
    dense = torch.zeros_like(x)
    for t in range(5):
        for w, e in zip(topk_weights[t].tolist(), topk_ids[t].tolist()):
            act = torch.nn.functional.silu(want[(e, "w1")] @ x[t]) * (want[(e, "w3")] @ x[t])
            dense[t] += w * (want[(e, "w2")] @ act)
    torch.testing.assert_close(got, dense, rtol=1e-5, atol=1e-5)


@NEEDS_VLLM
def test_a_missing_expert_tensor_is_named():
    import numpy as np

    from vllm_parity.errors import CheckpointError
    from vllm_parity.fixtures.checkpoints import ternary_weight
    from vllm_parity.reference.formats.ternary import PRESETS
    from vllm_parity.serving.vllm.moe import TernaryMoEMethod

    spec, rng = PRESETS["seed-article"], np.random.Generator(np.random.PCG64(0))
    stored = {(e, s): ternary_weight(rng, spec, *((16, 8) if s != "w2" else (8, 16)), torch.float16)
              for e in range(2) for s in ("w1", "w2", "w3")}
    method = TernaryMoEMethod(spec, None, PREFIX)
    layer = _experts_layer(2)
    method.create_weights(layer, 2, 8, 16, torch.float32)
    with pytest.raises(CheckpointError, match=r"1 tensor\(s\) missing for the ternary experts "
                                              rf"{PREFIX}: '{PREFIX}\.1\.w3\.weight_scale'"):
        _load_experts(method, layer, stored, skip=(1, "w3", "weight_scale"))
    # an activation the plain product does not compute is refused at creation, naming the layer
    layer = _experts_layer(2)
    layer.activation = "gelu"
    with pytest.raises(Exception, match=rf"{PREFIX}: experts with activation 'gelu'"):
        method.create_weights(layer, 2, 8, 16, torch.float32)
