"""Decode steps on the real engine: faults that live only in the decode path (the KV cache, a kernel taken only for
few rows) are localized to their layer's tap at their decode step, and a prefill-only fault at the prefill."""

import pytest

from vllm_parity.harness.session import Options, ParitySession

pytest.importorskip("vllm", reason="decode steps are the engine's own (its KV cache)")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

FEW_ROWS = 8  # the default's decode steps run 4 rows (one per prompt), its prefill 4 x 64


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """One engine on the default for the module's runs (each hands it back; the faults' run, planting hooks for
    good, comes last)."""
    from vllm_parity.harness.engine import close_llm

    s = ParitySession(Options(root=str(tmp_path_factory.mktemp("engine")), decode_steps=2))
    llm = s.hand_over()
    s.finish()
    yield llm
    close_llm(llm)


def _run(engine, tmp_path, **opts) -> ParitySession:
    return ParitySession(Options(report_dir=str(tmp_path / "report"), snapshot_dir=str(tmp_path / "snap"),
                                 root=str(tmp_path), **opts), llm=engine)


def _keys_scaled_after_prefill(layer: int, factor: float):
    """``apply_model``'s change: at the first decode forward after a prefill, the keys layer ``layer`` cached
    (every block; the step's own key is written after) are scaled by ``factor``."""
    def change(model):
        from vllm.forward_context import get_forward_context

        attn = model.model.layers[layer].self_attn.attn
        state = {"after_prefill": False}

        def perturb(mod, args):
            meta = get_forward_context().attn_metadata
            meta = meta.get(mod.layer_name) if isinstance(meta, dict) else meta
            if meta is None:
                return
            if meta.max_query_len > 1:
                state["after_prefill"] = True
            elif state["after_prefill"]:
                state["after_prefill"] = False
                cache = mod.kv_cache[0] if isinstance(mod.kv_cache, (list, tuple)) else mod.kv_cache
                blocks, heads, block_size, width = cache.shape  # keys, then values, in each block's rows
                cache.view(blocks, heads, 2 * block_size, width // 2)[:, :, :block_size].mul_(factor)
        attn.register_forward_pre_hook(perturb)
    return change


def _channel_doubled(module: str, few: bool):
    """``apply_model``'s change: ``module``'s output channel 5 doubled when at most ``FEW_ROWS`` rows reach it
    (``few``; a decode step's kernel branch) or when more do (a prefill's)."""
    def change(model):
        def hook(mod, args, out):
            y = out[0] if isinstance(out, tuple) else out
            if (y.shape[0] <= FEW_ROWS) == few:
                y[:, 5] *= 2
        dict(model.named_modules())[module].register_forward_hook(hook)
    return change


def test_each_tap_records_the_kernel_its_rows_took(engine, tmp_path):
    """The kernels the serving method chose per tap and phase (from a stand-in method reporting its choice by row
    count, as the ternary method does), and the branches no compared tap took."""
    def report_rows(model):
        method = model.model.layers[0].mlp.down_proj.quant_method
        method.kernel_for = lambda layer, m, dtype: "few_rows" if m <= FEW_ROWS else "many_rows"
        method.kernels = lambda layer, dtype: ("few_rows", "many_rows", "one_row")

    s = _run(engine, tmp_path, level="op", decode_steps=1, taps="layers.0.mlp.down")
    try:
        s.llm().apply_model(report_rows)
        judgement = s.judgement()
        run = s.record().run
    finally:
        s.hand_over()
        s.finish()
    down = judgement.phases("layers.0.mlp.down")
    assert [(r.phase, r.kernels) for r in down] == [("prefill", ["many_rows"]), ("decode", ["few_rows"])]
    assert run["kernel_branches"]["exercised"] == {"prefill": ["many_rows"], "decode": ["few_rows"]}
    assert run["kernel_branches"]["not_exercised"] == ["one_row"]


def test_the_ternary_method_reports_the_kernel_apply_runs():
    """Its choice by row count on each side of every threshold: on the Triton backend, the GEMV for one row."""
    from types import SimpleNamespace

    import torch

    from vllm_parity.serving.vllm.ternary import TernaryLinearMethod

    layer = SimpleNamespace(parity_tiles_only=False, parity_tiles=None, parity_backend="triton", parity_group_size=0,
                            parity_act_quant=False)
    method = TernaryLinearMethod.__new__(TernaryLinearMethod)
    assert [method.kernel_for(layer, m, torch.float32) for m in (1, 2, 4)] == ["triton_gemv", "triton_mm", "triton_mm"]
    assert method.kernels(layer, torch.float32) == ("triton_gemv", "triton_mm")
    assert method.kernels(SimpleNamespace(**{**vars(layer), "parity_backend": "torch"}), torch.float32) == ("torch",)


def test_decode_path_faults_are_localized_to_their_step(engine, tmp_path):
    """One engine, three faults: layer 1's cached keys perturbed after the prefill (at its attention, first decode
    step, with the kv_cache hint), layer 2's down projection wrong only for few rows (its decode steps), layer 3's
    attention output projection wrong only for many rows (its prefill). Isolated: each is its layer's own."""
    s = _run(engine, tmp_path, level="op", mode="isolated", decode_steps=2)
    try:
        llm = s.llm()
        llm.apply_model(_keys_scaled_after_prefill(1, 1.5))
        llm.apply_model(_channel_doubled("model.layers.2.mlp.down_proj", few=True))
        llm.apply_model(_channel_doubled("model.layers.3.self_attn.o_proj", few=False))
        judgement = s.judgement()
        hints = s.diagnosis().hints
        record = s.record().as_dict()
    finally:
        s.hand_over()
        s.finish()
    sources = {(r.name, r.step) for r in judgement.taps if r.role == "source"}
    # each fault once, where it first shows; at step 1 it is the same fault again
    assert sources == {("layers.1.attn.context", 0), ("layers.2.mlp.down", 0), ("layers.3.attn.o", None)}, sources
    attention = judgement.phases("layers.1.attn.context")
    assert attention[0].verdict and not attention[2].verdict  # the prefill's attention agrees
    assert attention[2].fed_by == ["layers.1.attn.context (decode step 0)"]
    assert (judgement.first.name, judgement.first.step) == ("layers.3.attn.o", None)
    kv = [h for h in hints if h.tap == "layers.1.attn.context"]
    assert [h.kind for h in kv] == ["kv_cache"], kv
    assert "at decode step 0" in kv[0].evidence and "model.layers.1.self_attn" in kv[0].fix
    down = [h for h in hints if h.tap == "layers.2.mlp.down"]
    assert [h.kind for h in down] == ["scale_wrong"] and down[0].evidence.startswith("decode step 0: "), down
    assert "channel(s) × 2 (channels 5)" in down[0].evidence
    decode = [t for t in record["taps"] if t.get("phase") == "decode"]
    assert {t["step"] for t in decode} == {0, 1} and record["run"]["decode_steps"] == 2
    assert not any(t["name"] == "layers.2.mlp.down" and "phase" not in t and not t["verdict"]
                   for t in record["taps"])


@pytest.mark.nightly
def test_decode_steps_are_the_same_over_ranks(tmp_path):
    """Every decode step's dump of two tensor-parallel ranks (gathered) equals the single rank's."""
    import torch

    from vllm_parity.architectures import lookup
    from vllm_parity.fixtures.checkpoints import Dims, make_fixture
    from vllm_parity.fixtures.prompts import load_prompts
    from vllm_parity.harness import vllm_side
    from vllm_parity.harness.engine import close_llm, make_llm

    model = make_fixture("seed-article", tmp_path / "m",
                         dims=Dims(hidden=128, layers=3, heads=2, kv_heads=1, intermediate=256, vocab=1024))
    dumps = {}
    for name, opts in (("one", {}), ("two", {"tensor_parallel_size": 2})):
        llm = make_llm(model, **opts)
        try:
            dumps[name] = vllm_side.capture(llm, lookup("llama"), load_prompts()[:3], tmp_path / name, decode_steps=3)
        finally:
            close_llm(llm)
    one, other = dumps["one"], dumps["two"]
    assert one.manifest["decode"]["tokens"] == other.manifest["decode"]["tokens"]
    assert len(one.steps()) == len(other.steps()) == 3
    for a, b in zip(one.steps(), other.steps()):
        assert a.taps() == b.taps()
        for tap in a.taps():
            for p in a.prompts(tap):
                torch.testing.assert_close(b.get(tap, p), a.get(tap, p), rtol=1e-4, atol=1e-4,
                                           msg=lambda m: f"{tap}@{p}, step {a.manifest['decode_step']}: {m}")
