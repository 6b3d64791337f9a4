"""The candidate in the dtype it is served in (``--parity-dtype``): the reference stays fp32, the run is judged
isolated (each layer and projection fed the reference's input), with tolerances derived from the dtype's
unit roundoff; a fault of the zoo is still localized with its hint in bf16."""

import pytest
import torch

from vllm_parity.fixtures.checkpoints import Dims, make_fixture

from tests.engine_runs import checked_engine, other_bit_order, session

pytest.importorskip("vllm", reason="the candidate is the vLLM engine")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SMALL = Dims(hidden=128, layers=3, heads=2, kv_heads=1, intermediate=256, vocab=1024)
O_PROJ = "model.layers.0.self_attn.o_proj"


def _passes_in(s, dtype: str) -> None:
    assert s.mode == "isolated"
    judgement = s.judgement()
    cand = s.capture().candidate
    assert {cand.entry(t, 0)["dtype"] for t in ("layers.0.attn.q", "logits")} == {dtype}
    assert s.capture().reference.entry("logits", 0)["dtype"] == "float32"
    failed = [(t.name, t.isolated.message) for t in judgement.taps if not t.verdict]
    assert not failed, failed
    for check in ("greedy", "topk", "logprobs"):
        assert s.check(check)["passed"], (check, s.check(check))
    run = s.record().run
    assert run["dtype"] == dtype and run["mode"] == "isolated" and dtype in run["mode_reason"]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_ternary_served_in_half_precision_passes_and_a_bit_order_fault_is_localized(tmp_path, dtype):
    model = make_fixture("seed-article", tmp_path / "t", dims=SMALL)
    llm = checked_engine(model, tmp_path, lambda s: _passes_in(s, dtype), level="model", dtype=dtype)
    flipped = other_bit_order(model, O_PROJ)

    def plant(m):
        def o_proj(mod, args, out):
            y = args[0] @ flipped.to(args[0].dtype).T
            return (y, *out[1:]) if isinstance(out, tuple) else y
        m.get_submodule(O_PROJ).register_forward_hook(o_proj)
        return True

    llm.apply_model(plant)
    faulty = session(model, tmp_path, "faulty", llm=llm, level="op", dtype=dtype)
    try:
        judgement = faulty.judgement()
        assert [t.name for t in judgement.taps if t.role == "source"] == ["layers.0.attn.o"]
        hints = [h for h in faulty.diagnosis().hints if h.tap == "layers.0.attn.o"]
        assert hints and hints[0].kind == "bit_order", hints
    finally:
        faulty.finish()


def test_int8x_served_in_bf16_passes(tmp_path):
    model = make_fixture("int8x", tmp_path / "i", dims=SMALL)
    s = session(model, tmp_path, "int8x", level="model", dtype="bfloat16")
    try:
        _passes_in(s, "bfloat16")
    finally:
        s.finish()


def test_the_kernels_candidate_runs_in_the_serving_dtype(tmp_path):
    model = make_fixture("seed-article", tmp_path / "t", dims=SMALL)
    s = session(model, tmp_path, "kernels", level="model", dtype="bfloat16", candidate="kernels")
    try:
        assert s.capture().candidate.entry("layers.0.attn.q", 0)["dtype"] == "bfloat16"
        assert s.judgement().passed and s.check("greedy")["passed"] and s.check("topk")["passed"]
    finally:
        s.finish()


def test_fp32_keeps_propagated_judging():
    from vllm_parity.harness.session import Options, ParitySession

    s = ParitySession(Options(level="block"))
    assert s.mode == "propagated" and s.why_isolated() is None
    assert ParitySession(Options(level="block", dtype="float16")).why_isolated() == "the candidate computes in float16"
    assert ParitySession(Options(level="block", mode="propagated", dtype="float16")).mode == "propagated"


def test_half_precision_defaults_follow_the_unit_roundoff_and_the_tap_kind():
    from vllm_parity.harness.tolerances import ToleranceTable

    table = ToleranceTable()
    bf16, fp16 = table.resolve("layers.0.attn.o", torch.bfloat16), table.resolve("layers.0.attn.o", torch.float16)
    assert bf16.token_rtol == pytest.approx(8 * fp16.token_rtol) and fp16.token_rtol == pytest.approx(32 * 2 ** -11)
    assert table.resolve("layers.0.attn.context", torch.float16).row_rtol == pytest.approx(2 * fp16.row_rtol)
    assert table.resolve("layers.2.mlp.act", torch.bfloat16).row_rtol == pytest.approx(256 * 2 ** -8)
    assert table.resolve("logprobs", torch.bfloat16).atol > table.resolve("logprobs", torch.float32).atol
    assert table.resolve("logprobs", torch.float32, ("per_token_absmax_fp8_e4m3",)).atol == 2.0
    # a rule still wins over the derived default
    ruled = ToleranceTable(rules=[("layers.*.attn.o", {"token_rtol": 0.5})])
    assert ruled.resolve("layers.0.attn.o", torch.bfloat16).token_rtol == 0.5


@pytest.mark.parametrize("error, says", [
    (AttributeError("'_OpNamespace' '_C' object has no attribute 'cpu_gemm_wna16'"),
     ["vLLM cannot serve this ckpt on this machine: its build here has no kernel 'cpu_gemm_wna16' (built for "
      "AVX-512 (x86), RVV or s390x", "vLLM's reason: '_OpNamespace' '_C' object has no attribute"]),
    (NotImplementedError('"cpu_gemm_wna16" not implemented for \'Float\''),
     ["vLLM serves this ckpt only in other dtypes than float32 here: run it with --parity-dtype=bfloat16 (or "
      "float16)"]),
    (ValueError("torch.float32 is not supported for quantization method awq. Supported dtypes: [torch.bfloat16]"),
     ["--parity-dtype=bfloat16", "Supported dtypes: [torch.bfloat16]"]),
])
def test_vllms_refusals_are_said_with_what_would_run(error, says):
    from vllm_parity.harness.engine import explain

    explained = explain(error, "this ckpt", "float32")
    assert explained is not None and all(s in str(explained) for s in says), explained
    assert explain(RuntimeError("CUDA out of memory"), "this ckpt", "float32") is None


def test_calibration_in_bf16_measures_the_reference_in_bf16(tmp_path):
    """A half-precision candidate's noise floor is the reference's own in that dtype: calibration runs it
    beside the fp32 variants, and the candidate passes the tolerances it writes."""
    model = make_fixture("seed-article", tmp_path / "t", dims=SMALL)
    table = tmp_path / "bf16.toml"
    s = session(model, tmp_path, "cal", level="block", dtype="bfloat16", calibrate=str(table))
    try:
        judgement = s.judgement()
        assert not [(t.name, t.isolated.message) for t in judgement.taps if not t.verdict]
        widest = s.record().checks["calibration"]["widest_spread"]
        assert max(widest, key=widest.get) == "bfloat16", widest
        assert "the reference in bf16 (the candidate's dtype)" in table.read_text()
    finally:
        s.finish()
