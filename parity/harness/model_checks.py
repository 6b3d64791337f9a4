"""The model-level checks: each a function of the two sides' data, returning a JSON-ready record with
``passed``. The session gathers their inputs (greedy tokens, logits, vLLM's prompt log-probs) and keeps the
records among the run's extras."""

from __future__ import annotations

from typing import Any

import torch

from vllm_parity.harness.dumps import DumpReader
from vllm_parity.harness.metrics import Tolerance


def greedy(reference: list[list[int]], candidate: list[list[int]]) -> dict[str, Any]:
    """Each prompt's greedy continuation on both sides, token by token, and where they first part."""
    rows = []
    for p, (ref_tokens, cand_tokens) in enumerate(zip(reference, candidate)):
        first = next((i for i, (a, b) in enumerate(zip(ref_tokens, cand_tokens)) if a != b), None)
        rows.append({"prompt": p, "reference": ref_tokens, "candidate": cand_tokens, "first_mismatch": first})
    return {"passed": all(r["first_mismatch"] is None for r in rows), "prompts": rows}


def topk(reference: DumpReader, candidate: DumpReader, k: int) -> dict[str, Any]:
    """Top-k agreement of the logits at every prompt position: the reference's top-1 in the candidate's
    top-k and the other way round."""
    worst, agree, total = [], 0, 0
    for p in reference.prompts("logits"):
        r, c = reference.get("logits", p), candidate.get("logits", p)
        rk, ck = r.topk(k, dim=-1).indices, c.topk(k, dim=-1).indices
        ok = (ck == rk[:, :1]).any(-1) & (rk == ck[:, :1]).any(-1)
        agree += int(ok.sum())
        total += ok.numel()
        worst += [{"prompt": p, "position": int(i)} for i in (~ok).nonzero().flatten()[:3]]
    return {"passed": agree == total, "k": k, "agree": agree, "total": total, "disagree_at": worst[:10]}


def logprobs(reference: DumpReader, prompt_logprobs: list[list[dict | None]], k: int,
             tol: Tolerance) -> dict[str, Any]:
    """vLLM's own prompt log-probs (top-k at every position, as its API returns them: ``{token: logprob}``
    per position) against the reference's log-softmax, in the manner of vLLM's check_logprobs_close: the
    two top-1 tokens must each be in the other's top-k, and every returned log-prob within ``tol``."""
    worst, misses, checked = 0.0, [], 0
    for p, entries in enumerate(prompt_logprobs):
        ref = torch.log_softmax(reference.get("logits", p).double(), dim=-1)
        for t, entry in enumerate(entries):
            if entry is None:
                continue  # position 0 has nothing before it
            row = ref[t - 1]
            ref_top = row.topk(k).indices.tolist()
            cand_top = [tok for tok, _ in sorted(entry.items(), key=lambda kv: -kv[1])][:k]
            diffs = [(abs(lp - float(row[tok])), abs(float(row[tok]))) for tok, lp in entry.items()]
            diff = max(d for d, _ in diffs)
            worst = max(worst, diff)
            checked += 1
            close = all(d <= tol.atol + tol.rtol * r for d, r in diffs)
            if ref_top[0] not in entry or cand_top[0] not in ref_top or not close:
                misses.append({"prompt": p, "position": t, "max_abs": diff,
                               "reference_top": ref_top[:3], "candidate_top": cand_top[:3]})
    return {"passed": not misses, "k": k, "positions": checked, "max_abs": worst, "atol": tol.atol,
            "mismatches": misses[:10]}
