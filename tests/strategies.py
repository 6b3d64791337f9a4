"""Hypothesis strategies shared by the tests: format variants and ternary matrices."""

import itertools

import torch
from hypothesis import strategies as st

from vllm_parity.reference.formats.ternary import TernarySpec

# Every placement of {-1, 0, 1} and one null over the 4 codes, plus maps without a null.
CODE_MAPS = sorted({tuple(p) for p in itertools.permutations((-1, 0, 1, None))}
                   | {(0, 1, -1, 1), (-1, 0, 1, 0)}, key=str)


@st.composite
def ternary_specs(draw, group_sizes=(4, 8, 32, 128)):
    return TernarySpec(
        pack_axis=draw(st.sampled_from(["input", "output"])),
        pack_layout=draw(st.sampled_from(["interleaved", "blocked"])),
        bit_order=draw(st.sampled_from(["lsb", "msb"])),
        code_map=draw(st.sampled_from(CODE_MAPS)),
        scale_granularity=draw(st.sampled_from(["tensor", "channel", "group"])),
        group_size=draw(st.sampled_from(group_sizes)),
        scale_mode=draw(st.sampled_from(["multiply", "divide"])),
        activation_quant=draw(st.sampled_from([None, "per_token_absmax_int8"])),
    )


@st.composite
def ternary_matrices(draw, spec: TernarySpec, max_quads: int = 12):
    """(values int8 (N, K), seed) with N, K fitting the spec's packed axis and group size."""
    quads = st.integers(1, max_quads)
    if spec.pack_axis == "input":
        n, k = draw(st.integers(1, 24)), 4 * draw(quads)
    else:
        n, k = 4 * draw(quads), draw(st.integers(1, 24))
    if spec.scale_granularity == "group":
        k = spec.group_size * draw(st.integers(1, 3))
        n = n if spec.pack_axis == "input" else 4 * draw(quads)
    kind = draw(st.sampled_from(["random", "zeros", "plus", "minus"]))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    if kind == "random":
        values = torch.randint(-1, 2, (n, k), generator=g, dtype=torch.int8)
    else:
        values = torch.full((n, k), {"zeros": 0, "plus": 1, "minus": -1}[kind], dtype=torch.int8)
    return values
