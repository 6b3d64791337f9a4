"""Diagnosis hints: each planted fault is named first, with its numbers; a correct candidate gets none, and a
deviation no hypothesis explains gets only ``undecided`` (what was ruled out).

Faulty weights are built here by decoding the stored tensors with a wrong spec (or by hand), not by
the diagnosis module's own reconstructions, so a hint holds only when both agree.
"""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given
from hypothesis import strategies as st

from vllm_parity.fixtures.checkpoints import Dims
from vllm_parity.harness.diagnosis import KINDS, Hint, LinearContext, diagnose_depth, diagnose_tap
from vllm_parity.reference.formats import int8x, ternary
from vllm_parity.reference.formats.ternary import PRESETS, TernarySpec
from vllm_parity.reference.formats.int8x import Int8xSpec
from vllm_parity.reference.linear import ReferenceLinear, activation_fake_quant

from tests.strategies import ternary_specs

MODULE = "model.layers.3.mlp.down_proj"
TAP = "layers.3.mlp.down"
WEIGHT_KINDS = {"code_table", "bit_order", "pack_layout", "scale_missing", "scale_inverted", "scale_dtype",
                "group_size"}


# -- building a projection and its faulty twin --------------------------------------------------


def _shape(spec: TernarySpec, draw) -> tuple[int, int]:
    n = 4 * draw(st.integers(4, 10))
    if spec.scale_granularity == "group":
        k = spec.group_size * 2 * draw(st.integers(1, 2))  # an even number of groups: room for 2x the size
    else:
        k = 4 * draw(st.integers(2, 12))
    return n, k


def _linear(spec, n: int, k: int, seed: int, rows: int = 32, scale_dtype=torch.float32, bias=None):
    """A random ternary projection (25 % zeros, per-channel/group spread as in real models) and an input."""
    g = torch.Generator().manual_seed(seed)
    zero = torch.rand((n, k), generator=g) < 0.25
    values = torch.where(zero, 0, torch.where(torch.rand((n, k), generator=g) < 0.5, -1, 1)).to(torch.int8)
    scale = torch.exp(0.25 * torch.randn(spec.scale_shape(n, k), generator=g, dtype=torch.float64)) \
        / math.sqrt(0.75 * k)
    if spec.scale_mode == "divide":
        scale = 1 / scale
    stored = {"packed": ternary.pack_values(values, spec), "scale": scale.to(scale_dtype)}
    lin = ReferenceLinear(MODULE, spec, stored, n, k, bias=bias)
    x = torch.randn(rows, k, generator=g)
    return lin, x


def _output(spec, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """What a kernel computes with weight ``w`` (the spec's activation quantization included)."""
    if getattr(spec, "activation_quant", None) == "per_token_absmax_int8":
        x_q, s_x = activation_fake_quant(x)
        return F.linear(x_q, w) / s_x
    return F.linear(x, w)


def _decode_as(lin: ReferenceLinear, scale=None, **changes) -> torch.Tensor:
    st_ = lin.stored
    spec = dataclasses.replace(lin.spec, **changes)
    return ternary.decode(st_["packed"], st_["scale"] if scale is None else scale, spec,
                          lin.out_features, lin.in_features)


def _other(value: str, a: str, b: str) -> str:
    return b if value == a else a


def _faulty_weight(lin: ReferenceLinear, fault: str, draw) -> torch.Tensor:
    spec, n, k = lin.spec, lin.out_features, lin.in_features
    if fault == "bit_order":
        return _decode_as(lin, bit_order=_other(spec.bit_order, "lsb", "msb"))
    if fault == "pack_layout":
        return _decode_as(lin, pack_layout=_other(spec.pack_layout, "interleaved", "blocked"))
    if fault == "code_table":
        used = sorted(set(ternary.unpack_codes(lin.stored["packed"], spec).flatten().tolist()))
        table = list(spec.code_map)
        if draw(st.booleans()):  # one sign read as the other everywhere
            table = [None if v is None else -v for v in table]
        else:  # one code in use mapped to another value
            c = draw(st.sampled_from(used))
            table[c] = draw(st.sampled_from([v for v in (-1, 0, 1) if v != table[c]]))
        assume(any(v is not None for v in table))
        return _decode_as(lin, code_map=tuple(table))
    if fault == "scale_missing":
        return ternary.unpack_values(lin.stored["packed"], spec).to(torch.float32)
    if fault == "scale_inverted":
        return _decode_as(lin, scale_mode=_other(spec.scale_mode, "multiply", "divide"))
    if fault == "scale_dtype":
        return _decode_as(lin, scale=lin.stored["scale"].to(draw(st.sampled_from([torch.float16,
                                                                                  torch.bfloat16]))))
    if fault == "group_size":  # a kernel indexing scale[n, k // (2 g)]: the first half of each row
        g2 = 2 * spec.group_size
        s = lin.stored["scale"].to(torch.float32)[:, : k // g2].repeat_interleave(g2, dim=1)
        v = ternary.unpack_values(lin.stored["packed"], spec).to(torch.float32)
        return v * s if spec.scale_mode == "multiply" else v / s
    raise AssertionError(fault)


def _rel_channel_change(ref: torch.Tensor, cand: torch.Tensor) -> float:
    d = (cand.double() - ref.double()).norm(dim=0) / ref.double().norm(dim=0).clamp_min(1e-30)
    return float(d.max())


# -- weight faults: every spec variant, every fault --------------------------------------------


@given(spec=ternary_specs(group_sizes=(4, 8, 16)), data=st.data())
def test_planted_weight_fault_is_named_first(spec, data):
    fault = data.draw(st.sampled_from(sorted(WEIGHT_KINDS - ({"group_size"} if spec.scale_granularity != "group"
                                                              else set()))))
    n, k = _shape(spec, data.draw)
    scale_dtype = data.draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    lin, x = _linear(spec, n, k, data.draw(st.integers(0, 2**31 - 1)), scale_dtype=scale_dtype)
    ref = lin(x)
    w = _faulty_weight(lin, fault, data.draw)
    assume(torch.isfinite(w).all())
    cand = _output(spec, w, x)
    # the fault must show above the noise floor (a tensor scale may be exact in fp16, L=4 has one layout)
    assume(_rel_channel_change(ref, cand) > 3e-4)
    hints = diagnose_tap(TAP, ref, cand, LinearContext(MODULE, x, lin))
    assert hints, f"no hint for a planted {fault} fault in {spec}"
    first = hints[0]
    assert first.kind == fault, [h.evidence for h in hints]
    assert "undecided" not in _kinds(hints)  # what was ruled out comes only when nothing holds
    assert first.tap == TAP and MODULE in first.evidence
    assert f" of {n} (" in first.evidence  # channel counts over all N output channels
    assert first.fix
    if fault == "bit_order":
        assert f"bit_order '{_other(spec.bit_order, 'lsb', 'msb')}' instead of '{spec.bit_order}'" in first.evidence
    if fault == "pack_layout":
        other = _other(spec.pack_layout, "interleaved", "blocked")
        assert f"'{other}' instead of '{spec.pack_layout}'" in first.evidence
    if fault == "scale_inverted" and spec.scale_granularity != "group":
        assert ("1/s²" if spec.scale_mode == "multiply" else "× s²") in first.evidence
    if fault == "group_size":
        assert f"group size {2 * spec.group_size} instead of {spec.group_size}" in first.evidence


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_scale_inverted_evidence_names_the_factor_and_the_share_of_channels(preset):
    spec = dataclasses.replace(PRESETS[preset], scale_granularity="channel")
    lin, x = _linear(spec, 100, 64, seed=3, rows=48)
    ref = lin(x)
    cand = _output(spec, _decode_as(lin, scale_mode=_other(spec.scale_mode, "multiply", "divide")), x)
    cand[:, [5, 50, 77]] = float(cand.std()) * torch.randn(48, 3)  # three channels wrong for another reason
    hints = diagnose_tap(TAP, ref, cand, LinearContext(MODULE, x, lin))
    assert hints[0].kind == "scale_inverted"
    ev = hints[0].evidence
    assert "97 of 100 (97 %)" in ev
    s = lin.stored["scale"].double()
    f = 1 / s ** 2 if spec.scale_mode == "multiply" else s ** 2
    assert f"factor {float(f.min()):.6g} to {float(f.max()):.6g}" in ev


def test_group_size_halved_with_scales_read_past_the_row():
    spec = TernarySpec(scale_granularity="group", group_size=16)
    n, k = 24, 64
    lin, x = _linear(spec, n, k, seed=5)
    flat = lin.stored["scale"].reshape(-1)
    at = torch.arange(n)[:, None] * (k // 16) + torch.arange(k)[None, :] // 8  # scale[n, k // 8] over the flat tensor
    s = torch.where(at < flat.numel(), flat[at.clamp(max=flat.numel() - 1)], torch.zeros(()))  # masked load: 0
    w = ternary.unpack_values(lin.stored["packed"], spec).float() * s
    hints = diagnose_tap(TAP, lin(x), _output(spec, w, x), LinearContext(MODULE, x, lin))
    assert hints[0].kind == "group_size"
    assert "group size 8 instead of 16" in hints[0].evidence and "scale[n, k // 8]" in hints[0].evidence


def test_scale_missing_on_int8x():
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-40, 41, (48, 64), generator=g, dtype=torch.int8)
    spec = Int8xSpec(block_size=64)
    lin = ReferenceLinear(MODULE, spec, int8x.encode(q, 0.0123, spec), 48, 64)
    x = torch.randn(16, 64, generator=g)
    hints = diagnose_tap(TAP, lin(x), F.linear(x, q.float()), LinearContext(MODULE, x, lin))
    assert [h.kind for h in hints] == ["scale_missing"]
    assert "reference × 1/s" in hints[0].evidence and "factor 81.3008" in hints[0].evidence


def test_fault_is_found_through_bf16_noise():
    spec = PRESETS["hf-bitnet"]
    lin, x = _linear(spec, 64, 128, seed=7, rows=48)
    ref = lin(x)
    cand = _output(spec, _decode_as(lin, bit_order="msb"), x).to(torch.bfloat16)
    hints = diagnose_tap(TAP, ref, cand, LinearContext(MODULE, x, lin))
    assert hints and hints[0].kind == "bit_order"


def test_scale_fault_is_found_without_the_input():
    spec = TernarySpec()
    lin, x = _linear(spec, 32, 64, seed=2)
    ref = lin(x)
    cand = _output(spec, ternary.unpack_values(lin.stored["packed"], spec).float(), x)
    hints = diagnose_tap(TAP, ref, cand, LinearContext(MODULE, None, lin))
    assert [h.kind for h in hints] == ["scale_missing"]


# -- no cause without evidence ------------------------------------------------------------------


@given(spec=ternary_specs(group_sizes=(4, 8, 16)), data=st.data())
def test_a_correct_candidate_gets_no_hint(spec, data):
    n, k = _shape(spec, data.draw)
    lin, x = _linear(spec, n, k, data.draw(st.integers(0, 2**31 - 1)))
    ref = lin(x)
    w64 = lin.weight().double()  # the same product in another precision and order: rounding noise only
    x64 = x.double()
    if spec.activation_quant:
        x_q, s_x = activation_fake_quant(x)
        cand = (F.linear(x_q.double(), w64) / s_x.double()).float()
    else:
        cand = F.linear(x64, w64).float()
    tp = data.draw(st.sampled_from([1, 2, 4]))
    assert diagnose_tap(TAP, ref, cand, LinearContext(MODULE, x, lin), tp_size=tp, parallel="row") == []


def _kinds(hints) -> list[str]:
    return [h.kind for h in hints]


@given(spec=ternary_specs(group_sizes=(4, 8, 16)), data=st.data())
def test_random_noise_gets_only_what_was_ruled_out(spec, data):
    n, k = _shape(spec, data.draw)
    lin, x = _linear(spec, n, k, data.draw(st.integers(0, 2**31 - 1)))
    ref = lin(x)
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    sigma = data.draw(st.sampled_from([1e-3, 1e-2, 0.1, 1.0])) * float(ref.std())
    cand = ref + sigma * torch.randn(ref.shape, generator=g)
    tp = data.draw(st.sampled_from([1, 2, 4]))
    hints = diagnose_tap(TAP, ref, cand, LinearContext(MODULE, x, lin), tp_size=tp, parallel="row")
    assert _kinds(hints) == ["undecided"], [h.evidence for h in hints]
    assert "ruled out" in hints[0].evidence and "scale_missing " in hints[0].evidence


def test_an_inherited_error_is_not_blamed_on_the_weight():
    spec = TernarySpec()
    lin, x = _linear(spec, 32, 64, seed=4)
    cand = lin(x + 0.3 * torch.randn_like(x))  # the candidate's input differed: the weight is fine
    (hint,) = diagnose_tap(TAP, lin(x), cand, LinearContext(MODULE, x, lin))
    assert hint.kind == "undecided" and hint.tap == TAP
    ev = hint.evidence
    for kind in ("bit_order", "pack_layout", "code_table", "scale_missing", "scale_inverted", "scale_dtype"):
        assert f"{kind} " in ev, ev  # each checked kind listed with its least residual
    assert "if the tap's input already differs, look upstream" in hint.fix


def test_an_output_never_written_is_not_a_code_table():
    spec = TernarySpec()
    lin, x = _linear(spec, 32, 64, seed=8)
    ref = lin(x)
    assert _kinds(diagnose_tap(TAP, ref, torch.zeros_like(ref), LinearContext(MODULE, x, lin))) == ["undecided"]


def test_without_the_input_only_the_scale_factors_are_ruled_out():
    spec = TernarySpec()
    lin, x = _linear(spec, 32, 64, seed=4)
    ref = lin(x)
    (hint,) = diagnose_tap(TAP, ref, ref + 0.1 * torch.randn_like(ref), LinearContext(MODULE, None, lin))
    assert hint.kind == "undecided" and "no input of the projection was recorded" in hint.evidence
    assert "scale_missing " in hint.evidence and "bit_order" not in hint.evidence


def test_ruled_out_is_generic():
    from vllm_parity.harness.diagnosis import ruled_out

    h = ruled_out("layers.1.attn.norm", [("norm_epsilon", 0.8), ("norm_epsilon", 0.4), ("rope", math.inf)],
                  next_step="compare the norm's weight")
    assert h.kind == "undecided" and h.fix == "compare the norm's weight"
    assert "norm_epsilon 0.4, rope no finite prediction" in h.evidence


def test_no_weight_claim_without_a_linear_context():
    ref = torch.randn(16, 64)
    cand = ref * (1 + torch.rand(64))  # a per-channel ratio on a norm tap: no format to blame
    assert diagnose_tap("layers.0.attn.norm", ref, cand) == []


# -- tensor parallelism -------------------------------------------------------------------------


@given(tp=st.sampled_from([2, 4, 8]), width=st.integers(2, 24), rank=st.data(), how=st.sampled_from(
    ["noise", "zeros", "scaled", "other_rank"]), seed=st.integers(0, 2**31 - 1))
def test_error_confined_to_one_shard_is_tp_shard(tp, width, rank, how, seed):
    r = rank.draw(st.integers(0, tp - 1))
    g = torch.Generator().manual_seed(seed)
    ref = torch.randn(12, tp * width, generator=g)
    cand = ref.clone()
    a, b = r * width, (r + 1) * width
    if how == "noise":
        cand[:, a:b] += torch.randn(12, width, generator=g)
    elif how == "zeros":
        cand[:, a:b] = 0
    elif how == "scaled":
        cand[:, a:b] *= 3.0
    else:
        q = (r + 1) % tp
        cand[:, a:b] = ref[:, q * width:(q + 1) * width]
    hints = diagnose_tap("layers.2.attn.q", ref, cand, tp_size=tp, parallel="column")
    assert hints and hints[0].kind == "tp_shard"
    ev = hints[0].evidence
    assert f"features {a}..{b - 1}, rank {r} of {tp}'s shard" in ev
    note = {"zeros": "all zeros", "scaled": "× 3", "other_rank": f"holds rank {(r + 1) % tp}'s values",
            "noise": "100.0 % of the error energy"}[how]
    assert note in ev
    assert not any(h.kind == "tp_shard" for h in diagnose_tap("layers.2.attn.q", ref, cand, tp_size=1, parallel="column"))
    # a row-parallel output is reduced over ranks, not split by features: a feature block names no rank
    assert diagnose_tap("layers.2.attn.o", ref, cand, tp_size=tp, parallel="row") == []


def test_non_finite_values_in_one_shard():
    g = torch.Generator().manual_seed(6)
    ref = torch.randn(8, 64, generator=g)
    cand = ref + 1e-3 * torch.randn(8, 64, generator=g)  # bf16-like noise everywhere
    cand[2, 40] = math.nan
    hints = diagnose_tap("layers.0.attn.q", ref, cand, tp_size=2, parallel="column")
    assert [h.kind for h in hints] == ["tp_shard"]
    assert "features 32..63, rank 1 of 2's shard" in hints[0].evidence
    assert "1 non-finite values there" in hints[0].evidence


def test_every_wrong_shard_is_named_even_when_one_dominates():
    g = torch.Generator().manual_seed(4)
    ref = torch.randn(16, 128, generator=g)
    cand = ref.clone()
    cand[:, 0:32] += torch.randn(16, 32, generator=g)
    cand[:, 64:96] += 0.05 * torch.randn(16, 32, generator=g)
    hints = diagnose_tap("layers.0.mlp.up", ref, cand, tp_size=4, parallel="column")
    assert [h.kind for h in hints] == ["tp_shard", "tp_shard"]
    assert "rank 0 of 4" in hints[0].evidence and "rank 2 of 4" in hints[1].evidence
    assert "in the 2 clean shard(s)" in hints[0].evidence


def test_one_rank_reading_the_wrong_bit_order_names_the_shard_then_the_cause():
    spec = TernarySpec()
    lin, x = _linear(spec, 64, 32, seed=9)
    ref = lin(x)
    cand = ref.clone()
    cand[:, 32:] = _output(spec, _decode_as(lin, bit_order="msb"), x)[:, 32:]
    hints = diagnose_tap("layers.3.mlp.gate", ref, cand, LinearContext(MODULE, x, lin), tp_size=2,
                         parallel="column")
    assert [h.kind for h in hints] == ["tp_shard", "bit_order"]
    assert "rank 1 of 2" in hints[0].evidence
    assert "within rank 1's shard (features 32..63)" in hints[1].evidence and "32 of 32 (100 %)" in hints[1].evidence


@pytest.mark.parametrize("alpha, says", [(-1.0, "is missing from the sum"), (1.0, "is counted twice")])
def test_row_parallel_partial_sum(alpha, says):
    spec = TernarySpec()
    lin, x = _linear(spec, 32, 64, seed=1)
    ref = lin(x)
    cand = ref + alpha * F.linear(x[:, 48:64], lin.weight()[:, 48:64])
    hints = diagnose_tap(TAP, ref, cand, LinearContext(MODULE, x, lin), tp_size=4, parallel="row")
    assert hints and hints[0].kind == "tp_shard"
    assert "rank 3's partial sum (input features 48..63)" in hints[0].evidence and says in hints[0].evidence


# -- fused slices -------------------------------------------------------------------------------


@given(head_dim=st.sampled_from([4, 8, 16]), kv_heads=st.integers(1, 3), group=st.integers(1, 3),
       rows=st.integers(8, 24), seed=st.integers(0, 2**31 - 1))
def test_k_and_v_swapped(head_dim, kv_heads, group, rows, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, head_dim * kv_heads * group, generator=g)
    k = torch.randn(rows, head_dim * kv_heads, generator=g)
    v = torch.randn(rows, head_dim * kv_heads, generator=g)
    kv = k.shape[1]
    hints = diagnose_tap("layers.1.attn.k", k, v, siblings={"layers.1.attn.q": (q, q), "layers.1.attn.v": (v, k)})
    assert hints and hints[0].kind == "slices_swapped"
    assert f"{kv} of {kv} candidate columns" in hints[0].evidence
    assert f"columns 0..{kv - 1} ≡ reference attn.v columns 0..{kv - 1}" in hints[0].evidence


def test_gate_and_up_swapped():
    g = torch.Generator().manual_seed(0)
    gate, up = torch.randn(16, 96, generator=g), torch.randn(16, 96, generator=g)
    hints = diagnose_tap("layers.0.mlp.gate", gate, up, siblings={"layers.0.mlp.up": (up, gate)})
    assert hints[0].kind == "slices_swapped"
    assert "columns 0..95 ≡ reference mlp.up columns 0..95" in hints[0].evidence
    assert "gate_up_proj" in hints[0].fix


def test_mis_sized_split_shows_where_each_run_comes_from():
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(16, 64, generator=g), torch.randn(16, 32, generator=g), torch.randn(16, 32, generator=g)
    fused = torch.cat([q, k, v], 1)
    cand_q = fused[:, 8:72]  # the split starts 8 columns late
    hints = diagnose_tap("layers.0.attn.q", q, cand_q, siblings={"layers.0.attn.k": (k, fused[:, 72:104]),
                                                                  "layers.0.attn.v": (v, fused[:, 104:128])})
    ev = hints[0].evidence
    assert hints[0].kind == "slices_swapped"
    assert "columns 0..55 ≡ reference attn.q columns 8..63" in ev
    assert "columns 56..63 ≡ reference attn.k columns 0..7" in ev


def test_a_column_shared_by_two_slices_is_not_moved():
    g = torch.Generator().manual_seed(3)
    gate, up = torch.randn(16, 32, generator=g), torch.randn(16, 32, generator=g)
    up[:, 3] = gate[:, 3]  # identical rows in both weights: the candidate's own column must win
    cand = up + 1e-6 * torch.randn(16, 32, generator=g)
    assert diagnose_tap("layers.0.mlp.up", up, cand, siblings={"layers.0.mlp.gate": (gate, gate)}) == []


def test_correct_slices_with_noise_are_not_swapped():
    g = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(16, 64, generator=g), torch.randn(16, 32, generator=g), torch.randn(16, 32, generator=g)
    sib = {"layers.0.attn.k": (k, k), "layers.0.attn.v": (v, v)}
    assert diagnose_tap("layers.0.attn.q", q, q + 1e-6 * torch.randn(16, 64, generator=g), siblings=sib) == []
    assert diagnose_tap("layers.0.attn.q", q, torch.randn(16, 64, generator=g), siblings=sib) == []


# -- depth --------------------------------------------------------------------------------------


@given(growth=st.integers(115, 200).map(lambda g: g / 100), layers=st.integers(4, 40), data=st.data())
def test_steady_growth_is_drift(growth, layers, data):
    cross = data.draw(st.integers(1, layers - 1))
    cross = min(cross, int(3 / math.log10(growth)))  # keep layer 0 above the noise floor (1e-4 atol)
    atol = 1e-3
    errors = [(f"layers.{i}.output", atol * growth ** (i - cross + 0.5)) for i in range(layers)]
    assume(errors[-1][1] / errors[0][1] >= 4)
    hints = diagnose_depth(errors, atol)
    assert [h.kind for h in hints] == ["drift"]
    assert hints[0].tap == f"layers.{cross}.output"
    assert f"×{growth:.3g} per layer" in hints[0].evidence
    assert f"first above atol 0.001 at layers.{cross}.output" in hints[0].evidence


def test_linear_growth_with_jitter_is_drift():
    g = torch.Generator().manual_seed(0)
    jitter = 1 + 0.03 * (2 * torch.rand(32, generator=g) - 1)
    errors = [(f"layers.{i}.output", 5e-5 * (i + 1) * float(jitter[i])) for i in range(32)]
    hints = diagnose_depth(errors, 1e-3)
    assert hints and hints[0].kind == "drift" and "over 32 layers" in hints[0].evidence


@pytest.mark.parametrize("errors", [
    [1e-7, 1.2e-7, 1.1e-7, 5e-2, 5.5e-2, 6e-2],  # one layer jumps
    [1e-5, 1e-4, 1e-2],  # the last layer adds most of the error
    [1e-5 * 1.1 ** i for i in range(10)] + [3e-3 * 1.1 ** i for i in range(10)],  # steady, then a jump
    [1e-3 * 0.8 ** i for i in range(10)],  # shrinking
    [2e-4, 2.1e-4, 1.9e-4, 2e-4, 2.2e-4],  # flat
    [5e-3 * 1.3 ** i for i in range(10)],  # wrong from layer 0 on
])
def test_no_drift(errors):
    assert diagnose_depth([(f"layers.{i}.output", e) for i, e in enumerate(errors)], 1e-3) == []


# -- the API ------------------------------------------------------------------------------------


def test_hint_as_dict_and_kinds():
    h = Hint("layers.0.attn.q", "bit_order", "e", "f")
    assert h.as_dict() == {"tap": "layers.0.attn.q", "kind": "bit_order", "evidence": "e", "fix": "f"}
    assert {"drift", "int8_saturation", "scale_wrong", "scale_groups", "zero_point", "bias", "activation_quant",
            "undecided"} <= set(KINDS) and len(set(KINDS)) == len(KINDS)
    with pytest.raises(ValueError, match="not one of"):
        Hint("t", "gremlins", "e", "f")


def test_shape_errors_are_reported():
    with pytest.raises(ValueError, match="differ in shape"):
        diagnose_tap("logits", torch.zeros(2, 3), torch.zeros(2, 4))
    spec = TernarySpec()
    lin, x = _linear(spec, 16, 32, seed=0)
    with pytest.raises(ValueError, match="ref_input has shape"):
        diagnose_tap(TAP, lin(x), lin(x), LinearContext(MODULE, x[:-1], lin))


# -- group scales in another order, the bias, the scale's precision, the activation quantizer ------------------


@given(spec=ternary_specs(group_sizes=(4, 8, 16)), data=st.data())
def test_group_scales_in_another_order_name_the_order(spec, data):
    spec = dataclasses.replace(spec, scale_granularity="group")
    n, k = _shape(spec, data.draw)
    lin, x = _linear(spec, n, k, data.draw(st.integers(0, 2**31 - 1)), rows=48)
    groups = k // spec.group_size
    ident = torch.arange(groups)
    how = data.draw(st.sampled_from(["shift_clamped", "shift_wrapped", "exchange", "permutation"]))
    if how == "shift_clamped":
        order, says = (ident + 1).clamp(max=groups - 1), "group g read the scale of group g+1 (shifted by 1 group, " \
                                                         "the last clamped to its own)"
    elif how == "shift_wrapped":
        order, says = (ident + 1) % groups, "group g read the scale of group g+1 (shifted by 1 group, the last " \
                                            "wrapping around)"
    elif how == "exchange":
        a, b = sorted(data.draw(st.lists(st.integers(0, groups - 1), min_size=2, max_size=2, unique=True)))
        order = ident.clone()
        order[a], order[b] = b, a
        says = f"groups {a} and {b} exchanged" if groups > 2 else "(shifted by 1 group, the last wrapping around)"
    else:
        order = torch.tensor(data.draw(st.permutations(list(range(groups)))))
        assume(not torch.equal(order, ident))
        says = ""
    w = _decode_as(lin, scale=lin.stored["scale"][:, order])  # the stored scales, taken in that order
    cand = _output(spec, w, x)
    assume(_rel_channel_change(lin(x), cand) > 3e-4)
    hints = diagnose_tap(TAP, lin(x), cand, LinearContext(MODULE, x, lin))
    assert hints and hints[0].kind == "scale_groups", [h.evidence for h in hints]
    assert says in hints[0].evidence and f"({x.shape[0]} rows, {groups} groups of {spec.group_size} inputs)" \
        in hints[0].evidence


def test_a_wider_group_size_is_still_group_size_not_an_order():
    spec = TernarySpec(scale_granularity="group", group_size=8)
    lin, x = _linear(spec, 32, 64, seed=11)
    s = lin.stored["scale"][:, torch.arange(8) // 2]  # scale[n, k // 16]
    hints = diagnose_tap(TAP, lin(x), _output(spec, _decode_as(lin, scale=s), x), LinearContext(MODULE, x, lin))
    assert _kinds(hints)[0] == "group_size" and "scale_groups" not in _kinds(hints)


def _biased_linear(seed: int, spec=TernarySpec()):
    g = torch.Generator().manual_seed(100 + seed)
    b = torch.randn(48, generator=g)
    lin, x = _linear(spec, 48, 64, seed, rows=24, bias=b)
    return lin, x, b, F.linear(x, lin.weight()) if not spec.activation_quant else lin(x) - b


@pytest.mark.parametrize("fault, says", [
    ("missing", "candidate ≡ reference − bias on every row: the bias of model.layers.3.mlp.down_proj"),
    ("twice", "added twice"),
    ("other", "adds model.layers.3.mlp.up_proj's bias instead of its own"),
    ("rolled", "the bias applied to the wrong channels, each channel adding the bias of another (channel ← bias "
               "of channel: 0..39 ← 8..47, 40..47 ← 0..7)"),
    ("partly", "the bias missing on channels 16..31"),
])
@pytest.mark.parametrize("preset", ["seed-article", "hf-bitnet"])
def test_a_wrong_bias_is_named(fault, says, preset):
    lin, x, b, product = _biased_linear(3, PRESETS[preset])
    other = torch.randn(48, generator=torch.Generator().manual_seed(9))
    used = {"missing": torch.zeros(48), "twice": 2 * b, "other": other, "rolled": b.roll(-8),
            "partly": torch.cat([b[:16], torch.zeros(16), b[32:]])}[fault]
    ctx = LinearContext(MODULE, x, lin, biases={"model.layers.3.mlp.up_proj": other})
    hints = diagnose_tap(TAP, lin(x), product + used, ctx)
    assert hints and hints[0].kind == "bias", [h.evidence for h in hints]
    assert says in hints[0].evidence, hints[0].evidence
    assert "48 of 48 (100 %)" in hints[0].evidence or fault == "partly"


def test_a_correct_bias_needs_no_hint_and_a_bias_the_reference_lacks_is_named():
    lin, x, b, product = _biased_linear(4)
    assert diagnose_tap(TAP, lin(x), (product.double() + b.double()).float(), LinearContext(MODULE, x, lin)) == []
    plain, x2 = _linear(TernarySpec(), 48, 64, seed=4, rows=24)
    hints = diagnose_tap(TAP, plain(x2), plain(x2) + b, LinearContext(MODULE, x2, plain))
    assert _kinds(hints)[:1] == ["bias"] and f"a bias {MODULE} does not have" in hints[0].evidence


@pytest.mark.parametrize("granularity", ["tensor", "channel", "group"])
@pytest.mark.parametrize("mode", ["multiply", "divide"])
def test_fp32_scales_kept_in_fp16_name_fp16(granularity, mode):
    spec = TernarySpec(scale_granularity=granularity, group_size=16, scale_mode=mode)
    lin, x = _linear(spec, 64, 64, seed=12, rows=48, scale_dtype=torch.float32)
    s = lin.stored["scale"]
    if mode == "multiply":
        w, says = _decode_as(lin, scale=s.half().float()), "rounded to fp16"
    else:  # the kernel multiplies by 1/s, kept in fp16
        w = _decode_as(lin, scale=(1 / s.double()).half().float(), scale_mode="multiply")
        says = "rounded to fp16 as its reciprocal 1/s"
    hints = diagnose_tap(TAP, lin(x), _output(spec, w, x), LinearContext(MODULE, x, lin))
    assert hints and hints[0].kind == "scale_dtype" and says in hints[0].evidence, [h.evidence for h in hints]
    assert "float32" in hints[0].evidence and "bf16" not in hints[0].evidence.split(";")[0]


def _act(num: float, lo: int, per_token: bool = True):
    def quant(x):
        amax = x.abs().amax(dim=-1, keepdim=True) if per_token else x.abs().amax()
        s = num / amax
        return (x * s).round().clamp(lo, 127) / s  # dequantized
    return quant


@pytest.mark.parametrize("quant, says", [
    (_act(127.5, -128), "s = 127.5 / max|x| per token, clamped to [-128, 127]"),
    (_act(127.5, -127), "s = 127.5 / max|x| per token, clamped to [-127, 127]"),
    (_act(127.0, -128, per_token=False), "over the whole tensor (per-tensor, not per token)"),
    (lambda x: x, "not quantized at all"),
])
def test_another_activation_quantizer_is_named(quant, says):
    spec = PRESETS["hf-bitnet"]
    lin, x = _linear(spec, 64, 128, seed=13, rows=48)
    x = x * torch.linspace(0.2, 3.0, 48)[:, None]  # tokens of different sizes: per-tensor differs from per-token
    hints = diagnose_tap(TAP, lin(x), F.linear(quant(x), lin.weight()), LinearContext(MODULE, x, lin))
    assert hints and hints[0].kind == "activation_quant", [h.evidence for h in hints]
    assert says in hints[0].evidence and "instead of s = 127 / max|x| per token" in hints[0].evidence


def _ct_linear(weights: str):
    """A compressed-tensors projection with per-token dynamic activations: W8A8 int8 or FP8_DYNAMIC."""
    from vllm_parity.reference.formats import parse_quantization_config

    num = {"num_bits": 8, "symmetric": True, "strategy": "channel"}
    act = {"num_bits": 8, "type": "float" if weights == "fp8" else "int", "symmetric": True, "strategy": "token",
           "dynamic": True}
    fmt, typ = ("float-quantized", "float") if weights == "fp8" else ("int-quantized", "int")
    spec = parse_quantization_config({"quant_method": "compressed-tensors", "format": fmt, "ignore": ["lm_head"],
                                      "quantization_status": "compressed", "config_groups": {"group_0": {
                                          "targets": ["Linear"], "format": fmt, "weights": {**num, "type": typ},
                                          "input_activations": act}}})
    g = torch.Generator().manual_seed(21)
    n, k = 48, 128
    if weights == "fp8":
        codes = (torch.randn(n, k, generator=g) * 64).to(torch.float8_e4m3fn)
    else:
        codes = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    lin = ReferenceLinear(MODULE, spec, {"weight": codes, "weight_scale": torch.rand(n, 1, generator=g) * 0.01 + 1e-3},
                          n, k)
    return lin, torch.randn(40, k, generator=g) * torch.linspace(0.2, 3.0, 40)[:, None]


def _fp8_per_tensor(x):
    s = x.abs().amax() / 448.0
    return (x / s).clamp(-448, 448).to(torch.float8_e4m3fn).to(torch.float32) * s


@pytest.mark.parametrize("weights, quant, says", [
    ("int8", _act(127.5, -128), "s = 127.5 / max|x| per token, clamped to [-128, 127]"),
    ("int8", lambda x: x, "not quantized at all"),
    ("fp8", _fp8_per_tensor, "s = 448 / max|x| over the whole tensor (per-tensor fp8, not per token)"),
    ("fp8", lambda x: x, "not quantized at all"),
])
def test_another_activation_quantizer_of_compressed_tensors_is_named(weights, quant, says):
    lin, x = _ct_linear(weights)
    hints = diagnose_tap(TAP, lin(x), F.linear(quant(x), lin.weight()), LinearContext(MODULE, x, lin))
    assert hints and hints[0].kind == "activation_quant", [h.evidence for h in hints]
    assert says in hints[0].evidence and lin.activation_quant in hints[0].fix


@given(spec=ternary_specs(group_sizes=(4, 8, 16)), data=st.data())
def test_a_wrong_bias_is_named_for_any_format_variant_and_shape(spec, data):
    n, k = _shape(spec, data.draw)
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    b = torch.randn(n, generator=g) * data.draw(st.sampled_from([0.05, 1.0, 20.0]))
    lin, x = _linear(spec, n, k, data.draw(st.integers(0, 2**31 - 1)), rows=data.draw(st.integers(8, 40)), bias=b)
    product = lin(x) - b  # the product alone, as the candidate's kernel computes it
    fault = data.draw(st.sampled_from(["missing", "twice", "rolled"]))
    shift = data.draw(st.integers(1, n - 1))
    used = {"missing": torch.zeros(n), "twice": 2 * b, "rolled": b.roll(-shift)}[fault]
    def span(a, e):
        return f"{a}..{e}" if a != e else f"{a}"

    says = {"missing": "candidate ≡ reference − bias on every row", "twice": "added twice",
            "rolled": f"(channel ← bias of channel: {span(0, n - shift - 1)} ← {span(shift, n - 1)}, "
                      f"{span(n - shift, n - 1)} ← {span(0, shift - 1)})"}[fault]
    hints = diagnose_tap(TAP, lin(x), product + used, LinearContext(MODULE, x, lin))
    assert hints and hints[0].kind == "bias", [h.evidence for h in hints]
    assert says in hints[0].evidence, hints[0].evidence


@pytest.mark.parametrize("order, says", [
    ([3, 2, 1, 0], "groups 0 and 3 exchanged, groups 1 and 2 exchanged"),
    ([1, 2, 3, 3], "group g read the scale of group g+1 (shifted by 1 group, the last clamped to its own)"),
    ([2, 0, 3, 1], "group → scale it read: 0→2, 1→0, 2→3, 3→1"),
])
def test_compressed_tensors_group_scales_in_another_order(tmp_path, order, says):
    """W4A16 with zero points (the down projection's 128 inputs in 4 groups of 32): scales read in an order the
    format's own hypotheses (neighbour, pairs) do not name are found by the fitted order."""
    from vllm_parity.fixtures.compressed_tensors import make_ct_fixture
    from vllm_parity.reference.checkpoint import Checkpoint

    out = make_ct_fixture("ct-w4a16-asym", tmp_path / "m", dims=Dims(hidden=128, layers=1, heads=2, kv_heads=1,
                                                                     intermediate=128, vocab=256), dtype="float32")
    ckpt, module = Checkpoint(out), "model.layers.0.mlp.down_proj"
    n, k = ckpt.linear_shapes()[module]
    stored = ckpt.spec.read_stored(ckpt, module, n, k)
    lin = ReferenceLinear(module, ckpt.spec, stored, n, k)
    s = stored["weight_scale"].float()
    assert s.shape[1] == len(order)
    w = lin.weight() / s.repeat_interleave(32, dim=1) * s[:, order].repeat_interleave(32, dim=1)
    x = torch.randn(48, k, generator=torch.Generator().manual_seed(5))
    hints = diagnose_tap("layers.0.mlp.down", lin(x), x @ w.T, LinearContext(module, x, lin))
    assert hints and hints[0].kind == "scale_groups" and says in hints[0].evidence, [h.evidence for h in hints]


def _four_bit(method: str, act_order: bool = False):
    """An AutoAWQ or GPTQ projection (48 × 128, groups of 32) encoded from a random weight, and an input."""
    from vllm_parity.fixtures import awq as awq_fixture, gptq as gptq_fixture
    from vllm_parity.reference.formats.awq import AwqSpec
    from vllm_parity.reference.formats.gptq import GptqSpec

    g = torch.Generator().manual_seed(31)
    weight = torch.randn(48, 128, generator=g) * torch.exp(0.3 * torch.randn(48, 4, generator=g)).repeat_interleave(
        32, dim=1)  # group scales that differ
    if method == "awq":
        spec, stored = AwqSpec(group_size=32), awq_fixture.encode(weight, 32)
    else:
        spec, stored = GptqSpec(group_size=32, desc_act=act_order), gptq_fixture.encode(weight, 32, act_order)
    return ReferenceLinear(MODULE, spec, stored, 48, 128), torch.randn(40, 128, generator=g)


@pytest.mark.parametrize("method", ["awq", "gptq"])
@pytest.mark.parametrize("fault, kind, says", [
    ("clamped_shift", "scale_groups", "group g read the scale of group g+1 (shifted by 1 group, the last clamped"),
    ("exchange", "scale_groups", "groups 1 and 2 exchanged"),
    ("no_scale", "scale_missing", "without its group scales"),
    ("bf16", "scale_dtype", "float16 group scales rounded to bf16"),
])
def test_four_bit_group_scale_faults(method, fault, kind, says):
    lin, x = _four_bit(method)
    s = lin.stored["scales"]  # (groups, N)
    wrong = {"clamped_shift": s[[1, 2, 3, 3]], "exchange": s[[0, 2, 1, 3]], "no_scale": torch.ones_like(s),
             "bf16": s.to(torch.bfloat16).to(torch.float32)}[fault]
    w = lin.spec.decode({**lin.stored, "scales": wrong}, 48, 128, MODULE)
    hints = diagnose_tap(TAP, lin(x), F.linear(x, w), LinearContext(MODULE, x, lin))
    assert hints and hints[0].kind == kind and says in hints[0].evidence, [h.evidence for h in hints]


def test_gptq_with_activation_order_fits_no_group_order_but_still_names_a_missing_scale():
    lin, x = _four_bit("gptq", act_order=True)
    s = lin.stored["scales"]
    shifted = lin.spec.decode({**lin.stored, "scales": s[[1, 2, 3, 3]]}, 48, 128, MODULE)
    assert _kinds(diagnose_tap(TAP, lin(x), F.linear(x, shifted), LinearContext(MODULE, x, lin))) == ["undecided"]
    bare = lin.spec.decode({**lin.stored, "scales": torch.ones_like(s)}, 48, 128, MODULE)
    assert _kinds(diagnose_tap(TAP, lin(x), F.linear(x, bare), LinearContext(MODULE, x, lin)))[0] == "scale_missing"
