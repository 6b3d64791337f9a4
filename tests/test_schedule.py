"""Scheduling the requests in waves, so that every kernel branch the serving methods report is taken where the
prompts allow it, and why a branch stays untaken."""

import pytest

from vllm_parity.harness.report import describe_branches, describe_schedule
from vllm_parity.harness.schedule import kernel_ranges, plan_waves, splits, why_untaken
from vllm_parity.serving import choose


def _triton(m: int) -> set[str]:
    return {choose.ternary_kernel("triton", m)}


def test_one_kernel_runs_every_prompt_at_once():
    assert plan_waves([64] * 4, 2, lambda m: {"torch"}, ["torch"]) == ([[0, 1, 2, 3]], {"torch"})
    assert plan_waves([64] * 4, 2) == ([[0, 1, 2, 3]], set())  # no method reports its kernels


def test_a_one_row_branch_takes_a_decode_with_one_sequence():
    """Triton's GEMV (M <= 1): one prompt alone (its decode steps run one row), then the rest together."""
    assert plan_waves([64] * 4, 2, _triton, ["triton_gemv", "triton_mm"]) == (
        [[0], [1, 2, 3]], {"triton_gemv", "triton_mm"})
    # without decode steps no forward runs one row: no extra wave
    assert plan_waves([64] * 4, 0, _triton, ["triton_gemv", "triton_mm"]) == ([[0, 1, 2, 3]], {"triton_mm"})
    # a one-token prompt's prefill is one row
    waves, taken = plan_waves([1, 64, 64], 0, _triton, ["triton_gemv", "triton_mm"])
    assert [0] in waves and taken == {"triton_gemv", "triton_mm"}


def test_row_ranges_of_several_branches():
    """The CUDA branches by M (mma <= 64 < vec < 384 <= dequant): decode with one, prefills small and large."""
    def cuda(m):
        return "mma" if m <= 64 else "vec" if m < 384 else "dequant"

    assert kernel_ranges(cuda) == [("mma", 1, 64), ("vec", 65, 383), ("dequant", 384, None)]
    lens = [5, 97, 40, 12]
    # all at once: the prefill runs 154 rows (vec), the decode steps 4 (mma)
    assert plan_waves(lens, 1, lambda m: {cuda(m)}, ["mma", "vec", "dequant"]) == ([[0, 1, 2, 3]], {"mma", "vec"})
    # prefills only: a small one besides
    waves, taken = plan_waves(lens, 0, lambda m: {cuda(m)}, ["mma", "vec", "dequant"])
    assert taken == {"mma", "vec"} and len(waves) == 2 and sorted(sum(waves, [])) == [0, 1, 2, 3], waves
    assert min(sum(lens[p] for p in w) for w in waves) <= 64
    counts = set().union(*({sum(lens[p] for p in w) for w in ws} | {len(w) for w in ws} for ws in splits(4, lens)))
    assert why_untaken("dequant", [[384, None]], lens, 1, counts) == "needs >= 384 rows; the prompts give at most 154"
    assert why_untaken("gemv", [[1, 1]], [64] * 4, 0, {64, 128, 192, 256}) == \
        "needs 1 row; a forward here runs at least 64 (shortest prompt 64; decode steps are off)"
    assert why_untaken("x", [[100, 120]], [64] * 4, 0, {64, 128, 192, 256}) == \
        "needs 100..120 rows; no grouping of these prompts (lengths [64]) runs that many"
    assert why_untaken("y", [], [64], 0, {64}) == "no layer chooses it for any row count in this dtype"


def test_many_prompts_try_waves_of_consecutive_lengths():
    lens = [64] * 12
    schedules = splits(12, lens)
    assert schedules[0] == [list(range(12))] and all(len(ws) <= 3 for ws in schedules)
    assert plan_waves(lens, 1, _triton, ["triton_gemv", "triton_mm"])[0] == [[0], list(range(1, 12))]


def test_the_schedule_is_said_in_one_line():
    """A run's waves, the positions the prefix cache served and the forwards each chunked prefill took."""
    assert describe_schedule(None) == ""
    assert describe_schedule({"waves": [[0, 1, 2, 3]]}) == "1 wave: [0, 1, 2, 3]"
    both = {"waves": [[0, 1, 2, 3]], "prefix_cached": [32, 32, 0, 32], "prefill_chunks": [2, 2, 3, 2],
            "engine_features": {"chunked_prefill": 24, "prefix_caching": True}}
    assert describe_schedule(both) == ("1 wave: [0, 1, 2, 3]; prefix caching: 32, 32, 0, 32 positions from the "
                                       "cache; chunked prefill (24 tokens a step): 2, 2, 3, 2 forwards")


@pytest.mark.vllm
@pytest.mark.slow
def test_the_engine_runs_the_waves_and_reports_untaken_branches(tmp_path):
    """On the default (4 prompts of 64 tokens, 2 decode steps) a stand-in method with a one-row branch and one
    from 384 rows: one prompt runs alone, so its decode steps take the one-row branch; the other branch is
    reported untaken, with why. Isolated, with the decode steps running the propagated run's tokens."""
    pytest.importorskip("vllm", reason="the engine's own scheduling")
    from vllm_parity.harness.engine import close_llm
    from vllm_parity.harness.session import Options, ParitySession

    def report_rows(model):
        method = model.model.layers[0].mlp.down_proj.quant_method
        method.kernel_for = lambda layer, m, dtype: "one_row" if m <= 1 else "huge" if m >= 384 else "many_rows"
        method.kernels = lambda layer, dtype: ("one_row", "many_rows", "huge")

    s = ParitySession(Options(report_dir=str(tmp_path / "report"), snapshot_dir=str(tmp_path / "snap"),
                              root=str(tmp_path), level="op", mode="isolated", decode_steps=2,
                              taps="layers.0.mlp.*"))
    try:
        s.llm().apply_model(report_rows)
        judgement = s.judgement()
        run = s.record().run
        capture = s.capture()
    finally:
        llm = s.hand_over()
        s.finish()
        close_llm(llm)
    assert not [t.label for t in judgement.taps if not t.verdict]
    for dump in (capture.candidate, capture.isolated):
        assert dump.manifest["waves"] == [[0], [1, 2, 3]]
    assert run["schedule"] == {"waves": [[0], [1, 2, 3]],
                               "engine_features": {"chunked_prefill": 0, "prefix_caching": False}}
    assert describe_schedule(run["schedule"]) == "2 waves: [0] then [1, 2, 3]"
    assert capture.isolated.manifest["decode"]["tokens"] == capture.candidate.manifest["decode"]["tokens"]
    down = judgement.phases("layers.0.mlp.down")
    assert [(r.phase, r.kernels) for r in down] == [("prefill", ["many_rows"]), ("decode", ["many_rows", "one_row"]),
                                                    ("decode", ["many_rows", "one_row"])]
    branches = run["kernel_branches"]
    assert branches["exercised"] == {"prefill": ["many_rows", "torch"], "decode": ["many_rows", "one_row", "torch"]}
    assert branches["not_exercised"] == ["huge"]
    assert branches["why_not"] == {"huge": "needs >= 384 rows; the prompts give at most 256"}
    assert "not exercised: huge (needs >= 384 rows; the prompts give at most 256)" in describe_branches(branches)


TRITON_RUN = '''
import json, sys
from vllm_parity.harness.session import Options, ParitySession
s = ParitySession(Options(model=sys.argv[1], prompts=sys.argv[2], root=sys.argv[3], report_dir=sys.argv[3] + "/report",
                          snapshot_dir=sys.argv[3] + "/snap", level="op", decode_steps=1))
try:
    failed = [t.label for t in s.judgement().taps if not t.verdict]
    print("RESULT " + json.dumps({"failed": failed, "branches": s.record().run["kernel_branches"],
                                  "waves": s.capture().candidate.manifest["waves"]}))
finally:
    s.finish()
'''


@pytest.mark.vllm
@pytest.mark.slow
def test_the_triton_backend_run_takes_the_gemv_and_the_gemm(tmp_path):
    """PARITY_KERNEL_BACKEND=triton (the interpreter on the CPU): one prompt runs alone, its decode step taking
    triton_gemv (one row), the rest triton_mm; the report lists both, nothing untaken. A small checkpoint and
    short prompts: the interpreter is slow."""
    pytest.importorskip("vllm", reason="the engine's own scheduling")
    import json
    import os
    import subprocess
    import sys

    from vllm_parity.fixtures.checkpoints import Dims, make_fixture

    model = make_fixture("seed-article", tmp_path / "m",
                         dims=Dims(hidden=128, layers=1, heads=2, kv_heads=1, intermediate=256, vocab=1024))
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([[1, 5, 9, 13, 17, 21], [2, 6, 10, 14], [3, 7, 11, 15, 19]]))
    env = {**os.environ, "PARITY_KERNEL_BACKEND": "triton", "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", TRITON_RUN, str(model), str(prompts), str(tmp_path / "run")],
                          env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    result = json.loads(lines[-1].removeprefix("RESULT "))
    assert result["failed"] == [] and result["waves"] == [[0], [1, 2]]
    assert result["branches"] == {"exercised": {"prefill": ["triton_mm"], "decode": ["triton_gemv", "triton_mm"]},
                                  "not_exercised": []}
