"""The model-level checks as functions of the two sides' data (no engine)."""

import math

import pytest
import torch

from vllm_parity.harness import model_checks
from vllm_parity.harness.dumps import DumpReader, DumpWriter, key
from vllm_parity.harness.metrics import Tolerance


def _logits(path, rows: list[list[list[float]]]) -> DumpReader:
    w = DumpWriter(path, {"side": "x"})
    w.write("logits", {key("logits", p): torch.tensor(r) for p, r in enumerate(rows)})
    return DumpReader(w.close())


def test_greedy_names_the_first_token_that_differs():
    got = model_checks.greedy([[5, 6, 7], [1, 2]], [[5, 6, 7], [1, 3]])
    assert not got["passed"]
    assert [r["first_mismatch"] for r in got["prompts"]] == [None, 1]
    assert model_checks.greedy([[4]], [[4]])["passed"]


def test_topk_agreement_both_ways(tmp_path):
    ref = _logits(tmp_path / "r", [[[3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0]]])
    # position 0: top-1 swapped with the second, still within each other's top-2; position 1: the
    # candidate's top-1 (token 0) is outside the reference's top-2 (tokens 3, 2)
    cand = _logits(tmp_path / "c", [[[2.0, 3.0, 1.0, 0.0], [9.0, 1.0, 2.0, 3.0]]])
    got = model_checks.topk(ref, cand, k=2)
    assert (got["agree"], got["total"], got["passed"]) == (1, 2, False)
    assert got["disagree_at"] == [{"prompt": 0, "position": 1}]


def test_logprobs_within_tolerance_and_top1_in_the_others_topk(tmp_path):
    ref = _logits(tmp_path / "r", [[[2.0, 1.0, 0.0], [0.0, 0.0, 0.0]]])
    lp = torch.log_softmax(torch.tensor([2.0, 1.0, 0.0], dtype=torch.float64), dim=-1).tolist()
    near = [[None, {0: lp[0] + 1e-4, 1: lp[1]}]]  # position 1 is predicted by the logits at position 0
    got = model_checks.logprobs(ref, near, k=2, tol=Tolerance(atol=1e-3))
    assert got["passed"] and got["positions"] == 1 and math.isclose(got["max_abs"], 1e-4, rel_tol=1e-6)
    far = [[None, {0: lp[0] + 1e-2, 1: lp[1]}]]
    assert not model_checks.logprobs(ref, far, k=2, tol=Tolerance(atol=1e-3))["passed"]
    swapped = [[None, {2: lp[0], 1: lp[1]}]]  # the candidate's top-1 (token 2) is not in the reference's top-2
    got = model_checks.logprobs(ref, swapped, k=2, tol=Tolerance(atol=10.0))
    assert not got["passed"] and got["mismatches"][0]["candidate_top"][0] == 2


def test_logprobs_accept_a_top1_tied_beyond_the_top_k(tmp_path):
    """A saturated soft cap gives more tokens the top log-prob than k: any of them is a top-1."""
    row = [30.0, 30.0, 30.0, 30.0, 1.0]
    ref = _logits(tmp_path / "r", [[row, row]])
    lp = torch.log_softmax(torch.tensor(row, dtype=torch.float64), dim=-1).tolist()
    tied = [[None, {3: lp[3], 2: lp[2]}]]  # tokens 0 and 1 are the reference's top-2, token 3 ties with them
    got = model_checks.logprobs(ref, tied, k=2, tol=Tolerance(atol=1e-3))
    assert got["passed"], got["mismatches"]
    below = [[None, {4: lp[4] , 3: lp[3]}]]  # token 4 ranked first although the reference puts it far below
    assert not model_checks.logprobs(ref, below, k=2, tol=Tolerance(atol=100.0))["passed"]


def test_greedy_tokens_tied_within_the_logit_error_pass():
    logits = [[torch.tensor([0.0, 3.0, 2.99]), torch.tensor([1.0, 0.0, 0.0])]]
    tied = model_checks.greedy([[1, 0]], [[2, 1]], logits, tie=0.05)
    assert tied["passed"] and tied["prompts"][0]["tie"] and tied["prompts"][0]["margin"] == pytest.approx(0.01)
    apart = model_checks.greedy([[1, 0]], [[2, 1]], logits, tie=0.001)
    assert not apart["passed"] and "tie" not in apart["prompts"][0]
    assert not model_checks.greedy([[1, 0]], [[2, 1]])["passed"]  # no logits: tokens must be equal
