"""Scheduling a run's requests in waves so that each branch of the serving kernels' row-count dispatch is taken.

A serving method says which kernel it runs for a number of rows (``kernel_for``); the row ranges of each kernel
are probed once (:func:`kernel_ranges`), and :func:`plan_waves` picks the grouping of the prompts whose forwards
(a wave's prefills together, then its decode steps, one row a sequence) take the most kernels, with the fewest
waves: all at once unless another grouping takes a branch that one batch leaves untaken. :func:`why_untaken` says
why a branch no schedule of these prompts takes is left.
"""

from __future__ import annotations

import itertools
from typing import Callable

_PROBE_LIMIT = 1 << 20  # rows: beyond any forward's batch
_PROBE_GRID = sorted({*range(1, 257), *(m for i in range(100) if (m := int(256 * 1.125 ** i)) < _PROBE_LIMIT),
                      _PROBE_LIMIT})


def kernel_ranges(choose: Callable[[int], str]) -> list[tuple[str, int, int | None]]:
    """``(kernel, first, last)`` runs of ``choose`` over 1.._PROBE_LIMIT rows: a grid (every count up to 256),
    each change between grid points located by bisection (one change between neighbours assumed)."""
    grid = _PROBE_GRID
    runs: list[list] = []
    prev_m, prev_k = None, None
    for m in grid:
        k = choose(m)
        if prev_k is not None and k != prev_k:
            lo, hi = prev_m, m  # choose(lo) == prev_k, choose(hi) == k
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if choose(mid) == prev_k else (lo, mid)
            runs[-1][2] = lo
            runs.append([k, hi, None])
        elif prev_k is None:
            runs.append([k, m, None])
        prev_m, prev_k = m, k
    return [tuple(r) for r in runs]


def merge(ranges: list[list[int | None]]) -> list[list[int | None]]:
    """Overlapping or touching ``[first, last]`` row ranges merged (last None: no end)."""
    out: list[list] = []
    for first, last in sorted(ranges, key=lambda r: r[0]):
        if out and (out[-1][1] is None or out[-1][1] + 1 >= first):
            out[-1][1] = None if out[-1][1] is None or last is None else max(out[-1][1], last)
        else:
            out.append([first, last])
    return out


EXHAUSTIVE = 8  # prompts up to which every split into waves is tried


def splits(n: int, lens: list[int]) -> list[list[list[int]]]:
    """Candidate schedules of ``n`` prompts, each a list of waves (prompt lists), all at once first: every set
    partition up to EXHAUSTIVE prompts; beyond, up to three waves of consecutive prompts by length."""
    if n <= EXHAUSTIVE:
        def partitions(items):
            if not items:
                yield []
                return
            head, rest = items[0], items[1:]
            for part in partitions(rest):
                yield [[head], *part]
                for i in range(len(part)):
                    yield [*part[:i], [head, *part[i]], *part[i + 1:]]
        out = [sorted(sorted(w) for w in part) for part in partitions(list(range(n)))]
    else:
        order = sorted(range(n), key=lambda p: (lens[p], p))
        out = [[sorted(order[a:b]) for a, b in zip((0, *cuts), (*cuts, n))]
               for k in range(3) for cuts in itertools.combinations(range(1, n), k)]
    # all at once first, fewer waves before more; each schedule's smaller waves first
    return sorted((sorted(waves, key=lambda w: (len(w), w)) for waves in out), key=lambda ws: (len(ws), ws))


def row_counts(waves: list[list[int]], lens: list[int], decode_steps: int) -> set[int]:
    """The rows each forward of a schedule runs: a wave's prefills together, then its decode steps."""
    counts = {sum(lens[p] for p in w) for w in waves}
    return counts | ({len(w) for w in waves} if decode_steps else set())


def plan_waves(lens: list[int], decode_steps: int, kernels_at: Callable[[int], set[str]] | None = None,
               possible: list[str] = ()) -> tuple[list[list[int]], set[str]]:
    """The schedule of the prompts (of lengths ``lens``) taking the most of the ``possible`` kernels
    (``kernels_at(rows)``: those some layer takes for that many rows), with the fewest waves: all at once unless
    another wave takes a branch otherwise untaken. Returns the waves and the kernels they take."""
    n = len(lens)
    if kernels_at is None or not possible:
        return [list(range(n))], set()
    best: tuple | None = None
    for waves in splits(n, lens):
        taken = set().union(*(kernels_at(m) for m in row_counts(waves, lens, decode_steps))) & set(possible)
        if best is None or len(taken) > len(best[1]):
            best = (waves, taken)
        if len(taken) == len(set(possible)):
            break
    return best


def _rows_text(ranges: list[list[int | None]]) -> str:
    def one(first, last):
        return f">= {first}" if last is None else str(first) if first == last else f"<= {last}" if first == 1 \
            else f"{first}..{last}"
    return " or ".join(one(*r) for r in ranges) + (" row" if ranges == [[1, 1]] else " rows")


def why_untaken(kernel: str, ranges: list[list[int | None]], lens: list[int], decode_steps: int,
                counts: set[int], chunk: int | None = None) -> str:
    """Why no forward of the run took ``kernel`` (taken for ``ranges`` rows; ``counts``: the rows a forward of
    any schedule of these prompts runs; ``chunk``: the engine's token budget a step, when prefills are chunked)."""
    if not ranges:
        return "no layer chooses it for any row count in this dtype"
    most, fewest = max(counts), min(counts)
    need = _rows_text(ranges)  # "... rows"
    if all(first > most for first, _ in ranges):
        limit = f" (chunked prefill: {chunk} tokens a step)" if chunk else ""
        return f"needs {need}; the prompts give at most {most}{limit}"
    if all(last is not None and last < fewest for _, last in ranges):
        off = "; decode steps are off" if not decode_steps else ""
        return f"needs {need}; a forward here runs at least {fewest} (shortest prompt {min(lens)}{off})"
    if not any(first <= m and (last is None or m <= last) for m in counts for first, last in ranges):
        return f"needs {need}; no grouping of these prompts (lengths {sorted(set(lens))}) runs that many"
    return f"needs {need}; no one schedule of these prompts takes it along with the other branches"
