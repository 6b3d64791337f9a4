"""Decode steps of the ``kernels`` candidate on the CPU: its prefill and greedy decode steps on a static KV cache,
each step's taps dumped as the engine's are and compared with the reference over the prompt and its tokens."""

import pytest
import torch

from vllm_parity.harness.session import Options, ParitySession

FEW_ROWS = 8  # the default's decode steps run one row, its prefills 64


def _run(tmp_path, **opts) -> ParitySession:
    return ParitySession(Options(candidate="kernels", report_dir=str(tmp_path / "report"),
                                 snapshot_dir=str(tmp_path / "snap"), root=str(tmp_path), **opts))


def _judged(s: ParitySession):
    try:
        return s.judgement(), s.record().as_dict()
    finally:
        s.finish()


def test_kernel_candidate_passes_prefill_and_decode_steps(tmp_path):
    s = _run(tmp_path, level="block", decode_steps=2)
    assert s.why_no_decode() is None and s.decode_steps == 2
    judgement, record = _judged(s)
    assert judgement.taps and all(r.verdict for r in judgement.taps), [r.name for r in judgement.taps if not r.verdict]
    assert {(r.phase, r.step) for r in judgement.taps} == {("prefill", None), ("decode", 0), ("decode", 1)}
    assert record["run"]["decode_steps"] == 2 and "decode_skipped" not in record["run"]
    # the torch backend on the CPU: one kernel for every row count, recorded at each phase
    assert record["run"]["kernel_branches"]["exercised"] == {"prefill": ["torch"], "decode": ["torch"]}


def test_isolated_decode_runs_the_propagated_tokens(tmp_path):
    """bf16 is judged isolated: every layer fed the reference's input at each step, decoding the tokens the
    propagated run sampled."""
    s = _run(tmp_path, level="block", decode_steps=1, dtype="bfloat16")
    assert s.mode == "isolated"
    try:
        capture = s.capture()
        judgement = s.judgement()
    finally:
        s.finish()
    assert capture.isolated.manifest["decode"]["tokens"] == capture.candidate.manifest["decode"]["tokens"]
    assert len(capture.steps) == 1 and capture.steps[0].isolated is not None
    assert all(r.verdict for r in judgement.taps), [r.name for r in judgement.taps if not r.verdict]


def test_fault_of_the_few_rows_branch_is_localized_to_its_decode_step(tmp_path):
    """Layer 1's down projection doubles output channel 5 only when few rows reach it (a decode-only branch): its
    tap fails at decode step 0 and is the source, and the prefill passes."""
    s = _run(tmp_path, level="block", decode_steps=2)
    down = s._kernel_model().get_submodule("model.layers.1.mlp.down_proj")
    plain = down.forward

    def faulty(x):
        y = plain(x)
        if x.numel() // x.shape[-1] <= FEW_ROWS:
            y[..., 5] *= 2
        return y
    down.forward = faulty
    judgement, _ = _judged(s)
    sources = {(r.name, r.step) for r in judgement.taps if r.role == "source"}
    assert sources == {("layers.1.mlp.down", 0)}, sources
    assert all(r.verdict for r in judgement.taps if r.phase == "prefill")
    assert not judgement.phases("layers.1.mlp.down")[1].verdict


def test_decode_capture_refuses_what_it_cannot_run(tmp_path):
    from vllm_parity.harness import kernel_decode

    s = ParitySession(Options(candidate="kernels"))
    model = s._kernel_model()
    with pytest.raises(ValueError, match="needs the model on CUDA"):
        kernel_decode.capture(model, s.arch, s.prompts[:1], tmp_path / "a", decode_steps=1, graph=True)
    with pytest.raises(ValueError, match="forced tokens: 2 for each of 1 prompts"):
        kernel_decode.capture(model, s.arch, s.prompts[:1], tmp_path / "b", decode_steps=2, forced=[[1]])
    with pytest.raises(ValueError, match="needs the reference's dump of the prefill and of each step"):
        kernel_decode.capture(model, s.arch, s.prompts[:1], tmp_path / "c", decode_steps=1, isolate_from=[])


def test_kernel_choice_follows_the_kernel_linear(monkeypatch):
    """The recorded kernel is the one the linear runs: the ternary choice from choose.py for the call's rows."""
    from vllm_parity.harness.kernel_candidate import kernel_for, kernels_of

    s = ParitySession(Options(candidate="kernels"))
    q = s._kernel_model().get_submodule("model.layers.0.self_attn.q_proj")
    cpu = torch.device("cpu")
    assert kernel_for(q, 1, torch.float32, cpu) == "torch" and kernels_of(q, torch.float32, cpu) == ["torch"]
    monkeypatch.setenv("PARITY_KERNEL_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert [kernel_for(q, m, torch.float32, cpu) for m in (1, 2)] == ["triton_gemv", "triton_mm"]
    assert kernels_of(q, torch.float32, cpu) == ["triton_gemv", "triton_mm"]
    assert kernel_for(torch.nn.Linear(2, 2), 1, torch.float32, cpu) is None


def test_recorded_kernel_of_a_tiled_ternary_linear_is_the_gemm_where_it_runs(monkeypatch):
    """A kernel linear holds its tiles on CUDA, and the GEMM on them runs 33..1023 rows where it builds (one scale a
    row): the record names it there, and on both sides of its bounds."""
    from vllm_parity.harness.kernel_candidate import kernel_for, kernels_of
    from vllm_parity.serving import ternary_cuda

    s = ParitySession(Options(candidate="kernels"))
    q = s._kernel_model().get_submodule("model.layers.0.self_attn.q_proj")
    q.native = q.native.with_tiles()  # as on CUDA (tiled on the CPU: the choice reads only whether there are tiles)
    monkeypatch.setattr(ternary_cuda, "available", lambda: True)
    monkeypatch.setattr(ternary_cuda, "gemm_supported", lambda: True)
    cuda = torch.device("cuda")
    assert q.native.group_size == 0
    assert [kernel_for(q, m, torch.bfloat16, cuda) for m in (32, 33, 384, 1023, 1024)] == \
        ["cuda_mma", "cuda_gemm", "cuda_gemm", "cuda_gemm", "cuda_dequant"]
    assert kernels_of(q, torch.bfloat16, cuda) == ["cuda_mma", "cuda_gemm", "cuda_dequant"]


# in CI the sliding-window and expert families; the rest in the nightly gate
FAMILIES = ["gemma2", "mixtral", *(pytest.param(a, marks=pytest.mark.nightly)
                                   for a in ("qwen2", "gemma3_text", "phi3", "bitnet"))]


@pytest.mark.parametrize("arch", FAMILIES)
def test_kernel_candidate_decodes_every_family(tmp_path, arch):
    """The static-cache decode of each family (Gemma's sliding-window layers masked by their own window), prefill
    and two decode steps passing at block level."""
    from vllm_parity.fixtures.checkpoints import Dims, make_fixture

    dims = Dims(hidden=128, layers=2, heads=2, kv_heads=1, intermediate=256, vocab=1024)
    model = make_fixture("seed-article", tmp_path / arch, dims=dims, arch=arch)
    judgement, record = _judged(_run(tmp_path, model=str(model), level="block", decode_steps=2))
    assert {(r.phase, r.step) for r in judgement.taps} == {("prefill", None), ("decode", 0), ("decode", 1)}
    assert all(r.verdict for r in judgement.taps), [(r.name, r.phase, r.message) for r in judgement.taps
                                                   if not r.verdict][:3]


def test_a_sliding_window_shorter_than_the_prompts_is_masked_at_every_step(tmp_path):
    """Gemma2 with a window of 16 positions against 64-token prompts: the sliding layers attend to their window
    only, in the prefill and at each decode step, as the reference does."""
    import json

    from vllm_parity.fixtures.checkpoints import Dims, make_fixture

    model = make_fixture("seed-article", tmp_path / "g", arch="gemma2",
                         dims=Dims(hidden=128, layers=2, heads=2, kv_heads=1, intermediate=256, vocab=1024))
    config = json.loads((model / "config.json").read_text())
    config["sliding_window"] = 16
    (model / "config.json").write_text(json.dumps(config))
    judgement, _ = _judged(_run(tmp_path, model=str(model), level="block", decode_steps=2))
    assert {r.step for r in judgement.taps if r.phase == "decode"} == {0, 1}
    assert all(r.verdict for r in judgement.taps), [(r.name, r.phase, r.message) for r in judgement.taps
                                                   if not r.verdict][:3]


def test_latent_attention_says_why_its_decode_steps_are_not_compared(tmp_path):
    """MiniCPM3's latent attention caches compressed keys and applies kv_b over every cached position, so a
    static cache's rows are not the forward's: the kernels candidate compares its prefill only, and says why."""
    from vllm_parity.fixtures.checkpoints import Dims, make_fixture

    dims = Dims(hidden=128, layers=2, heads=2, kv_heads=2, intermediate=256, vocab=1024)
    model = make_fixture("seed-article", tmp_path / "m", dims=dims, arch="minicpm3")
    s = _run(tmp_path, model=str(model), level="block", decode_steps=2)
    assert "latent attention" in s.why_no_decode()
    judgement, record = _judged(s)
    assert {r.phase for r in judgement.taps} == {"prefill"} and all(r.verdict for r in judgement.taps)
    assert "latent attention" in record["run"]["decode_skipped"]
