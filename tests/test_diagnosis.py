"""Diagnosis hints: each planted fault is named first, with its numbers; clean or random candidates get none.

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


def _linear(spec, n: int, k: int, seed: int, rows: int = 32, scale_dtype=torch.float32):
    """A random ternary projection (25 % zeros, per-channel/group spread as in real models) and an input."""
    g = torch.Generator().manual_seed(seed)
    zero = torch.rand((n, k), generator=g) < 0.25
    values = torch.where(zero, 0, torch.where(torch.rand((n, k), generator=g) < 0.5, -1, 1)).to(torch.int8)
    scale = torch.exp(0.25 * torch.randn(spec.scale_shape(n, k), generator=g, dtype=torch.float64)) \
        / math.sqrt(0.75 * k)
    if spec.scale_mode == "divide":
        scale = 1 / scale
    stored = {"packed": ternary.pack_values(values, spec), "scale": scale.to(scale_dtype)}
    lin = ReferenceLinear(MODULE, spec, stored, n, k)
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


@given(spec=ternary_specs(group_sizes=(4, 8, 16)), data=st.data())
def test_random_noise_gets_no_hint(spec, data):
    n, k = _shape(spec, data.draw)
    lin, x = _linear(spec, n, k, data.draw(st.integers(0, 2**31 - 1)))
    ref = lin(x)
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    sigma = data.draw(st.sampled_from([1e-3, 1e-2, 0.1, 1.0])) * float(ref.std())
    cand = ref + sigma * torch.randn(ref.shape, generator=g)
    tp = data.draw(st.sampled_from([1, 2, 4]))
    assert diagnose_tap(TAP, ref, cand, LinearContext(MODULE, x, lin), tp_size=tp, parallel="row") == []


def test_an_inherited_error_is_not_blamed_on_the_weight():
    spec = TernarySpec()
    lin, x = _linear(spec, 32, 64, seed=4)
    cand = lin(x + 0.3 * torch.randn_like(x))  # the candidate's input differed: the weight is fine
    assert diagnose_tap(TAP, lin(x), cand, LinearContext(MODULE, x, lin)) == []


def test_an_output_never_written_is_not_a_code_table():
    spec = TernarySpec()
    lin, x = _linear(spec, 32, 64, seed=8)
    ref = lin(x)
    assert diagnose_tap(TAP, ref, torch.zeros_like(ref), LinearContext(MODULE, x, lin)) == []


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
    assert {"drift", "int8_saturation", "scale_wrong", "scale_groups", "zero_point"} <= set(KINDS) and len(KINDS) == 14
    with pytest.raises(ValueError, match="not one of"):
        Hint("t", "gremlins", "e", "f")


def test_shape_errors_are_reported():
    with pytest.raises(ValueError, match="differ in shape"):
        diagnose_tap("logits", torch.zeros(2, 3), torch.zeros(2, 4))
    spec = TernarySpec()
    lin, x = _linear(spec, 16, 32, seed=0)
    with pytest.raises(ValueError, match="ref_input has shape"):
        diagnose_tap(TAP, lin(x), lin(x), LinearContext(MODULE, x[:-1], lin))
