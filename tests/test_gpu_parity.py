"""The ``kernels`` candidate on CUDA (``--parity-device=cuda``): the serving dtypes, prefill and decode steps, the
decode step replayed from a CUDA graph with every kernel branch, and a fault of one CUDA branch localized."""

import json
import sys

import pytest
import torch

from vllm_parity.fixtures.checkpoints import Dims, make_fixture
from vllm_parity.harness.session import Options, ParitySession

pytest_plugins = ["pytester"]
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (--parity-device=cuda)")]

FEW_ROWS = 8  # decode steps run one row a prompt, the default's prefills 64
SMALL = Dims(hidden=256, layers=2, heads=2, kv_heads=1, intermediate=512, vocab=1024)


def _run(tmp_path, **opts) -> ParitySession:
    return ParitySession(Options(candidate="kernels", device="cuda", report_dir=str(tmp_path / "report"),
                                 snapshot_dir=str(tmp_path / "snap"), root=str(tmp_path), **opts))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("level", ["block", "model"])
def test_kernel_candidate_on_cuda_passes_prefill_and_decode(tmp_path, level, dtype):
    s = _run(tmp_path, level=level, dtype=dtype, decode_steps=2)
    try:
        capture = s.capture()
        judgement = s.judgement()
        checks = {name: s.check(name) for name in ("greedy", "topk")} if level == "model" else {}
        record = s.record().as_dict()
    finally:
        s.finish()
    failing = [(r.name, r.step) for r in judgement.taps if not r.verdict]
    assert not failing, failing
    assert {(r.phase, r.step) for r in judgement.taps} == {("prefill", None), ("decode", 0), ("decode", 1)}
    assert capture.candidate.manifest["decode_graph"] is True
    branches = record["run"]["kernel_branches"]["exercised"]
    assert branches["decode"] and branches["prefill"], branches
    assert all(c.get("passed") for c in checks.values()), checks


def test_fault_of_one_cuda_branch_is_localized_to_its_decode_step(tmp_path, monkeypatch):
    """``cuda_mma`` doubles output channel 5 of layer 1's down projection only for few rows (its decode steps, the
    graph captures it): that tap at decode step 0 is the only source, and the prefill (64 rows, the same kernel)
    passes."""
    from vllm_parity.serving import choose, ternary_ops

    s = _run(tmp_path, level="block", dtype="float16", decode_steps=2)
    target = s._kernel_model().get_submodule("model.layers.1.mlp.down_proj").native
    plain = ternary_ops.ternary_linear

    def faulty(x, native, bias=None, backend=None):
        y = plain(x, native, bias, backend)
        m = x.numel() // x.shape[-1]
        kernel = choose.ternary_kernel(choose.ternary_backend(backend, x.device), m, x.dtype, native.group_size,
                                       native.act_quant)
        if native is target and kernel == "cuda_mma" and m <= FEW_ROWS:
            y[..., 5] *= 2
        return y
    monkeypatch.setattr(ternary_ops, "ternary_linear", faulty)
    try:
        judgement = s.judgement()
    finally:
        s.finish()
    sources = {(r.name, r.step) for r in judgement.taps if r.role == "source"}
    assert sources == {("layers.1.mlp.down", 0)}, sources
    assert all(r.verdict for r in judgement.taps if r.phase == "prefill")
    down = judgement.phases("layers.1.mlp.down")
    assert [(r.phase, r.kernels) for r in down] == [("prefill", ["cuda_mma"]), ("decode", ["cuda_mma"]),
                                                    ("decode", ["cuda_mma"])]


# (format, PARITY_INT8X_LAYOUT, PARITY_KERNEL_BACKEND, choose.py thresholds, the kernel every projection runs at M=1)
BRANCHES = [
    ("seed-article", None, "torch", {}, "torch"),
    ("seed-article", None, "triton", {}, "triton_gemv"),
    ("seed-article", None, "triton", {"TRITON_GEMV_MAX_M": 0}, "triton_mm"),
    ("seed-article", None, "cuda", {}, "cuda_mma"),
    ("seed-article", None, "cuda", {"MMA_MAX_M": 0}, "cuda_vec"),
    ("seed-article", None, "cuda", {"MMA_MAX_M": 0, "DEQUANT_MIN_M": 1}, "cuda_dequant"),
    ("int8x", "native", "torch", {}, "native_torch"),
    ("int8x", "native", "triton", {}, "native_triton_gemv"),
    ("int8x", "native", "triton", {"INT8X_NATIVE_GEMV_MAX_M": 0}, "native_triton_gemm"),
    ("int8x", "streams", "torch", {}, "streams_torch"),
    ("int8x", "streams", "triton", {}, "streams_triton"),
    ("int8x", "streams", "cuda", {}, "streams_cuda"),
    ("int8x", "planes", "torch", {}, "planes_torch"),
    ("int8x", "planes", "cuda", {}, "planes_cuda_gemv"),
    ("int8x", "planes", "cuda", {"INT8X_PLANES_GEMV_MAX_M": 0}, "planes_cuda_gemm"),
]


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    root = tmp_path_factory.mktemp("fixtures")
    return {fmt: make_fixture(fmt, root / fmt, dims=SMALL) for fmt in ("seed-article", "int8x")}


@pytest.mark.parametrize("fmt, layout, backend, thresholds, kernel", BRANCHES, ids=[b[-1] for b in BRANCHES])
def test_decode_graph_replays_every_kernel_branch(fixtures, tmp_path, monkeypatch, fmt, layout, backend,
                                                  thresholds, kernel):
    """The decode steps replayed from the captured graph give the eager steps' taps, with the branch forced."""
    from vllm_parity.harness import kernel_decode
    from vllm_parity.harness.kernel_candidate import build_kernel_model
    from vllm_parity.serving import choose

    monkeypatch.setenv("PARITY_KERNEL_BACKEND", backend)
    if layout:
        monkeypatch.setenv("PARITY_INT8X_LAYOUT", layout)
    for name, value in thresholds.items():
        monkeypatch.setattr(choose, name, value)
    s = ParitySession(Options(model=str(fixtures[fmt]), candidate="kernels"))
    model = build_kernel_model(s.ckpt, dtype=torch.float16, device="cuda")
    prompts = [p[:24] for p in s.prompts[:2]]
    graphed = kernel_decode.capture(model, s.arch, prompts, tmp_path / "graph", decode_steps=2, graph=True)
    eager = kernel_decode.capture(model, s.arch, prompts, tmp_path / "eager", decode_steps=2, graph=False,
                                  forced=graphed.manifest["decode"]["tokens"])
    assert graphed.manifest["decode_graph"] and not eager.manifest["decode_graph"]
    for g, e in zip(graphed.steps(), eager.steps()):
        assert set(g.taps()) == set(e.taps())
        for tap in g.taps():
            for p in g.prompts(tap):
                a, b = g.get(tap, p).float(), e.get(tap, p).float()
                assert (a - b).norm() <= 1e-3 * b.norm() + 1e-6, (tap, p, g.manifest["decode_step"])
        used = {k for ks in g.manifest["kernels"].values() for k in ks}
        assert used == {kernel}, used


def test_plugin_runs_the_kernels_candidate_on_cuda(pytester, tmp_path):
    result = pytester.run(sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--parity-level=model",
                          "--parity-candidate=kernels", "--parity-device=cuda", "--parity-dtype=bfloat16",
                          "--parity-decode-steps=2", f"--parity-report={tmp_path / 'report'}", timeout=540)
    assert result.ret == 0, result.outlines[-20:]
    rep = json.loads((tmp_path / "report" / "report.json").read_text())
    assert rep["passed"] and rep["run"]["decode_steps"] == 2 and "decode_skipped" not in rep["run"]
    assert {t["step"] for t in rep["taps"] if t.get("phase") == "decode"} == {0, 1}
