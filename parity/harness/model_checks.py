"""The model-level checks: each a function of the two sides' data, returning a JSON-ready record with
``passed``. The session gathers their inputs (greedy tokens, logits, vLLM's prompt log-probs) and keeps the
records among the run's extras."""

from __future__ import annotations

from typing import Any

import torch

from vllm_parity.harness.dumps import DumpReader
from vllm_parity.harness.metrics import Tolerance


def greedy(reference: list[list[int]], candidate: list[list[int]],
           logits: list[list[torch.Tensor]] | None = None, tie: float = 0.0) -> dict[str, Any]:
    """Each prompt's greedy continuation on both sides, token by token, and where they first part.

    ``logits``: the reference's logits at each of its greedy steps; where the candidate picks another token
    whose reference logit is within ``tie`` of the reference's choice (the logits' own error, measured), the
    two tokens are tied for this candidate: the continuation stops being compared there, and passes.
    """
    rows = []
    for p, (ref_tokens, cand_tokens) in enumerate(zip(reference, candidate)):
        first = next((i for i, (a, b) in enumerate(zip(ref_tokens, cand_tokens)) if a != b), None)
        row = {"prompt": p, "reference": ref_tokens, "candidate": cand_tokens, "first_mismatch": first}
        if first is not None and logits is not None and first < len(logits[p]):
            step = logits[p][first].to(torch.float64)
            margin = float(step[ref_tokens[first]] - step[cand_tokens[first]])
            row["margin"] = margin
            if margin <= tie:
                row["tie"] = True
        rows.append(row)
    return {"passed": all(r["first_mismatch"] is None or r.get("tie") for r in rows), "prompts": rows,
            "tie": tie}


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
    two top-1 tokens must each be in the other's top-k, and every returned log-prob within ``tol``. A token
    the reference ties (to a few fp32 steps of its logits) with its k-th counts as in its top-k: a
    saturated soft cap gives more than k tokens the top log-prob."""
    worst, misses, checked = 0.0, [], 0
    for p, entries in enumerate(prompt_logprobs):
        logits = reference.get("logits", p).double()
        ref = torch.log_softmax(logits, dim=-1)
        for t, entry in enumerate(entries):
            if entry is None:
                continue  # position 0 has nothing before it
            row = ref[t - 1]
            tie = 4 * torch.finfo(torch.float32).eps * float(logits[t - 1].abs().max())
            ref_top = row.topk(k).indices.tolist()
            kth = float(row[ref_top[-1]])
            cand_top = [tok for tok, _ in sorted(entry.items(), key=lambda kv: -kv[1])][:k]
            diffs = [(abs(lp - float(row[tok])), abs(float(row[tok]))) for tok, lp in entry.items()]
            diff = max(d for d, _ in diffs)
            worst = max(worst, diff)
            checked += 1
            close = all(d <= tol.atol + tol.rtol * r for d, r in diffs)
            cand_in_ref = cand_top[0] in ref_top or float(row[cand_top[0]]) >= kth - tie
            ref_in_cand = ref_top[0] in entry or float(row[ref_top[0]]) <= min(float(row[tok]) for tok in entry) + tie
            if not ref_in_cand or not cand_in_ref or not close:
                misses.append({"prompt": p, "position": t, "max_abs": diff,
                               "reference_top": ref_top[:3], "candidate_top": cand_top[:3]})
    return {"passed": not misses, "k": k, "positions": checked, "max_abs": worst, "atol": tol.atol,
            "mismatches": misses[:10]}


def routing(reference: DumpReader, candidate: DumpReader, routers: dict[int, str], k: int,
            tol: Tolerance) -> dict[str, Any]:
    """Per token and mixture-of-experts layer, whether the candidate routes to the reference's top-``k`` set of
    experts (from each side's router logits, ``routers``: layer -> tap). A token whose reference logits tie at
    the k-th place (the k-th and the next within ``tol``'s element bound) may route either way: counted apart,
    and no failure."""
    agree = total = ties = 0
    first, layers = None, {}
    for layer, tap in sorted(routers.items()):
        layer_agree = layer_total = 0
        for p in reference.prompts(tap):
            r, c = reference.get(tap, p).double(), candidate.get(tap, p).double()
            same = (r.topk(k, dim=-1).indices.sort(-1).values == c.topk(k, dim=-1).indices.sort(-1).values).all(-1)
            tied = torch.zeros_like(same)
            if k < r.shape[-1]:
                top = r.topk(k + 1, dim=-1).values
                bound = tol.atol + tol.rtol * top[:, k - 1].abs() + tol.row_rtol * r.pow(2).mean(-1).sqrt()
                tied = ~same & (top[:, k - 1] - top[:, k] <= bound)
            layer_agree += int(same.sum())
            layer_total += same.numel()
            ties += int(tied.sum())
            bad = (~same & ~tied).nonzero().flatten()
            if first is None and len(bad):
                t = int(bad[0])
                first = {"layer": layer, "prompt": p, "position": t,
                         "reference": sorted(r[t].topk(k).indices.tolist()),
                         "candidate": sorted(c[t].topk(k).indices.tolist())}
        layers[str(layer)] = layer_agree / max(1, layer_total)
        agree, total = agree + layer_agree, total + layer_total
    return {"passed": first is None, "k": k, "agree": agree, "total": total, "ties": ties,
            "fraction": agree / max(1, total), "first_disagreement": first, "layers": layers}
