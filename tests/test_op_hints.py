"""Hints at norm, attention and router taps: each checked on candidates computed independently with the fault
(torch's own RMSNorm, transformers' rotary embedding and torch's attention), and on the real vLLM engine with
the faults planted in one engine, one layer each."""

import copy
import importlib.util

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_parity.harness import diagnosis
from vllm_parity.harness.op_hints import (AttentionContext, NormContext, norm_epsilon, rope_mismatch,
                                          routing_disagreement)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# -- a norm's epsilon ------------------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(8, 40), heads=st.sampled_from([1, 2, 4]), width=st.sampled_from([16, 32, 64]),
       eps=st.sampled_from([1e-6, 1e-5]), cand_eps=st.sampled_from([0.0, 1e-3, 1e-2, 0.1]),
       offset=st.sampled_from([0.0, 1.0]), from_input=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_another_epsilon_is_solved(rows, heads, width, eps, cand_eps, offset, from_input, seed):
    """Any row count, per-head or whole-row norms, Gemma's 1 + w: the candidate normalized with another epsilon
    (torch's rms_norm) is named, the epsilon solved within 1 %, from the norm's input or, without it, from the
    reference's output and the weight."""
    g = _gen(seed)
    x = torch.randn(rows, heads * width, generator=g, dtype=torch.float64) * \
        torch.rand(rows, 1, generator=g, dtype=torch.float64) * 0.2
    w = torch.rand(width, generator=g, dtype=torch.float64) + 0.5
    eff = w + offset

    def norm(e):
        return F.rms_norm(x.reshape(-1, width), (width,), eff, eps=e).reshape(rows, -1)

    ref, cand = norm(eps), norm(cand_eps)
    ctx = NormContext("model.layers.2.self_attn.q_norm", eps, "rms_norm_eps", eff, x if from_input else None)
    hint, _ = norm_epsilon("layers.2.attn.q_norm", ref, cand, ctx)
    assert hint is not None and hint.kind == "norm_epsilon"
    solved = float(hint.evidence.split("eps = ")[1].split(" ")[0])
    assert solved == pytest.approx(cand_eps, rel=1e-2, abs=1e-8), hint.evidence
    assert "rms_norm_eps = " in hint.fix and "model.layers.2.self_attn.q_norm" in hint.fix
    assert ("from the norm's input" in hint.evidence) == from_input


def test_a_reference_norm_off_the_config_is_told():
    """The reference's module normalizing with its class's default (1e-6) where the candidate follows the
    config (1e-5), as transformers builds MiniCPM3's latent norms: the hint says which side leaves the config."""
    g = _gen(2)
    x = torch.randn(48, 64, generator=g, dtype=torch.float64) * 0.01
    w = torch.rand(64, generator=g, dtype=torch.float64) + 0.5
    ref, cand = F.rms_norm(x, (64,), w, eps=1e-6), F.rms_norm(x, (64,), w, eps=1e-5)
    hint, _ = norm_epsilon("layers.0.attn.q_a_norm", ref, cand,
                           NormContext("model.layers.0.self_attn.q_a_layernorm", 1e-5, weight=w, x=x))
    assert hint is not None and "the reference's own epsilon, solved alike, 1e-06" in hint.evidence, hint
    assert hint.fix.startswith("the candidate normalizes model.layers.0.self_attn.q_a_layernorm with the configured "
                               "rms_norm_eps = 1e-05, the reference with 1e-06")


def test_a_norm_weight_off_is_not_an_epsilon():
    """A weight scaled on some features is a per-feature factor, not a per-row one: no epsilon explains it, and
    the check says what it solved and how little it explained."""
    g = _gen(1)
    x = torch.randn(64, 32, generator=g, dtype=torch.float64)
    w = torch.rand(32, generator=g, dtype=torch.float64) + 0.5
    wrong = w.clone()
    wrong[::2] *= 1.1
    ref, cand = F.rms_norm(x, (32,), w, eps=1e-5), F.rms_norm(x, (32,), wrong, eps=1e-5)
    hint, checked = norm_epsilon("layers.0.attn.norm", ref, cand, NormContext("m", 1e-5, weight=w, x=x))
    assert hint is None and checked.kind == "norm_epsilon" and checked.share > 0.5
    assert checked.note.startswith("another epsilon (solved ") and "rms_norm_eps 1e-05" in checked.note


# -- rope ------------------------------------------------------------------------------------------

LLAMA = dict(model_type="llama", hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
             max_position_embeddings=512, rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})


def _context(q, k, v, config):
    """transformers' rotary embedding of Llama and torch's causal attention: the context these q, k, v give."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    cfg = LlamaConfig(**config)
    h, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    t = q.shape[0]
    qh, kh, vh = (a.reshape(1, t, n, d).transpose(1, 2) for a, n in ((q, h), (k, kv), (v, kv)))
    cos, sin = LlamaRotaryEmbedding(cfg)(vh, torch.arange(t)[None])
    qh, kh = apply_rotary_pos_emb(qh, kh, cos, sin)
    out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
    return out.transpose(1, 2).reshape(t, h * d)


def _qkv(seed, prompts=2, tokens=48):
    g = _gen(seed)
    return [(torch.randn(tokens, 128, generator=g), torch.randn(tokens, 64, generator=g),
             torch.randn(tokens, 64, generator=g)) for _ in range(prompts)]


@settings(max_examples=6, deadline=None)
@given(theta=st.sampled_from([5e5, 1e6, 33000.0, 2.5e5]), seed=st.integers(0, 2**31 - 1))
def test_another_rope_base_is_named(theta, seed):
    """The candidate's rope with another base (transformers' Llama rotary embedding): named, with the base — a
    common one from the grid, or solved to three digits."""
    qkv = _qkv(seed)
    refs = [_context(*t, LLAMA) for t in qkv]
    cands = [_context(*t, {**LLAMA, "rope_parameters": {"rope_theta": theta, "rope_type": "default"}}) for t in qkv]
    attn = AttentionContext.of(LLAMA, 3, "model.layers.3.self_attn")
    hint, _ = rope_mismatch("layers.3.attn.context", qkv, refs, cands, attn)
    assert hint is not None and hint.kind == "rope"
    assert f"with rope_theta {theta:.6g}, no scaling" in hint.evidence, hint.evidence
    assert "relative error 0 at position 0" in hint.evidence
    assert "rope_theta 10000" in hint.fix and "model.layers.3.self_attn" in hint.fix


def test_dropped_rope_scaling_is_named():
    """The configured linear scaling not applied by the candidate."""
    scaled = {**LLAMA, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "linear", "factor": 4.0}}
    qkv = _qkv(2)
    refs = [_context(*t, scaled) for t in qkv]
    cands = [_context(*t, LLAMA) for t in qkv]
    hint, _ = rope_mismatch("layers.0.attn.context", qkv, refs, cands,
                            AttentionContext.of(scaled, 0, "model.layers.0.self_attn"))
    assert hint is not None and "rope_theta 10000, no scaling" in hint.evidence
    assert "in place of the configured rope_theta 10000, linear scaling (factor 4.0)" in hint.evidence


def test_gptj_pairs_are_named():
    """q and k rotated by adjacent pairs where the model rotates halves."""
    qkv = _qkv(3)
    refs = [_context(*t, LLAMA) for t in qkv]
    # rotating adjacent pairs (2i, 2i+1) is rotating halves (i, i + d/2) of the features regrouped so; the
    # scores do not see the regrouping, v is not rotated
    d = 32
    pairs = torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])

    def regrouped(a, n):
        return a.reshape(-1, n, d)[..., pairs].reshape(a.shape)

    cands = [_context(regrouped(q, 4), regrouped(k, 2), v, LLAMA) for q, k, v in qkv]
    hint, _ = rope_mismatch("layers.0.attn.context", qkv, refs, cands,
                            AttentionContext.of(LLAMA, 0, "model.layers.0.self_attn"))
    assert hint is not None and "gptj pairs in place of" in hint.evidence, hint and hint.evidence


def test_a_rope_error_of_no_known_kind_is_read_from_its_signature():
    """Frequencies each off by its own factor: no base, scaling or layout reproduces them, but the error is
    zero at position 0 and grows with position while q, k, v pass: named as a rope error, with what was tried."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    qkv = _qkv(5, tokens=64)
    refs = [_context(*t, LLAMA) for t in qkv]
    rot = LlamaRotaryEmbedding(LlamaConfig(**LLAMA))
    rot.inv_freq.mul_(1 + 0.5 * torch.rand(rot.inv_freq.shape, generator=_gen(6)))
    cands = []
    for q, k, v in qkv:
        t = q.shape[0]
        qh, kh, vh = (a.reshape(1, t, -1, 32).transpose(1, 2) for a in (q, k, v))
        cos, sin = rot(vh, torch.arange(t)[None])
        qh, kh = apply_rotary_pos_emb(qh, kh, cos, sin)
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
        cands.append(out.transpose(1, 2).reshape(t, 128))
    hint, checked = rope_mismatch("layers.0.attn.context", qkv, refs, cands,
                                  AttentionContext.of(LLAMA, 0, "model.layers.0.self_attn"))
    assert hint is not None and hint.kind == "rope", checked
    assert "position-dependent error in attention while q, k and v pass" in hint.evidence
    assert "not reproduced by any hypothesis tried" in hint.evidence and "rope_theta 1e+06 (residual" in hint.evidence
    assert checked.share > 0.1


def test_a_softmax_scale_error_is_no_rope_error():
    """Scores scaled by 1/head_dim: position 0 is untouched as under a rope error, but the scale reproduces it."""
    qkv = _qkv(7, tokens=64)
    refs = [_context(*t, LLAMA) for t in qkv]
    cands = [_context(q / 32 ** 0.5, k, v, LLAMA) for q, k, v in qkv]
    hint, checked = rope_mismatch("layers.0.attn.context", qkv, refs, cands,
                                  AttentionContext.of(LLAMA, 0, "model.layers.0.self_attn"))
    assert hint is None and "the softmax scale 1/head_dim in place of 1/√head_dim reproduces" in checked.note


def test_an_error_that_is_no_rope_is_not_named():
    """v's rows scaled after position 0 in the candidate: not reproduced by any rope, no rope signature (the
    error is there from position 1 on, flat): no rope hint, and the check lists what it tried."""
    qkv = _qkv(4)
    refs = [_context(*t, LLAMA) for t in qkv]
    cands = [_context(q, k, v * 1.05, LLAMA) for q, k, v in qkv]
    hint, checked = rope_mismatch("layers.0.attn.context", qkv, refs, cands,
                                  AttentionContext.of(LLAMA, 0, "model.layers.0.self_attn"))
    assert hint is None and checked.kind == "rope" and checked.share > 0.5
    assert "rope_theta 500000 (residual" in checked.note and "the other pair layout (gptj)" in checked.note
    assert "a rope signature (zero at position 0, growing with position): not seen" in checked.note


# -- routing ---------------------------------------------------------------------------------------


@settings(max_examples=20, deadline=None)
@given(experts=st.integers(3, 16), k=st.integers(1, 2), shift=st.integers(1, 15), seed=st.integers(0, 2**31 - 1))
def test_renumbered_experts_are_named(experts, k, shift, seed):
    """The router's columns rolled (the experts renumbered): which expert stands for which, on how many tokens."""
    shift %= experts
    if shift == 0:
        shift = 1
    r = torch.randn(128, experts, generator=_gen(seed))
    perm = torch.roll(torch.arange(experts), shift)
    hint, _ = routing_disagreement("layers.1.moe.router", r, r[:, perm], k, "model.layers.1.mlp.gate")
    assert hint is not None and hint.kind == "routing"
    assert "renumbered" in hint.evidence
    mapping = ", ".join(f"{j}←{int(perm[j])}" for j in range(experts))
    assert f"(candidate expert ← reference expert: {mapping};" in hint.evidence
    assert "chosen in place of" in hint.evidence and " of 128 tokens" in hint.evidence


def test_near_ties_are_told_from_a_fault():
    r = torch.tensor([[3.0, 2.0, 1.9999, 0.0], [0.0, 1.0, 2.0, 3.0]] * 8)
    cand = r.clone()
    cand[0::2, 2] += 2e-4  # the tie at the k-th place goes the other way
    hint, _ = routing_disagreement("layers.0.moe.router", r, cand, 2)
    assert hint is not None and "near-ties" in hint.evidence
    assert "expert 2 chosen in place of 1 on 8 of 16 tokens" in hint.evidence
    hint, checked = routing_disagreement("layers.0.moe.router", r, r * 1.01, 2)
    assert hint is None and "every token of 16 routes to the reference's top-2" in checked.note


def _decode_dumps(tmp_path, keys_scale: float = 1.0, decode_k_shift: float = 0.0):
    """A prefill of 6 positions and one decode step of one layer's q, k, v and attention output, both sides from
    the same q, k, v; the candidate's decode-step output from its prefill keys times ``keys_scale`` (what a
    corrupted cache holds), and its decode-step key tap off by ``decode_k_shift`` (its own projection wrong)."""
    from types import SimpleNamespace

    from vllm_parity.harness.dumps import DumpReader, DumpWriter

    config = {"model_type": "llama", "num_attention_heads": 2, "num_key_value_heads": 1, "hidden_size": 16,
              "rope_theta": 10000.0}
    attn = AttentionContext.of(config, 0, "model.layers.0.self_attn")
    g = _gen(3)
    q, k, v = (torch.randn(7, n, generator=g, dtype=torch.float64) for n in (16, 8, 8))
    ref = attn.context(q, k, v, attn.rope)
    k_read = torch.cat([k[:6] * keys_scale, k[6:]])
    k_tap = torch.cat([k[:6], k[6:] + decode_k_shift])
    cand = attn.context(q, k_read if decode_k_shift == 0 else k_tap, v, attn.rope)

    def dump(name, rows, k_rows, out):
        w = DumpWriter(tmp_path / name)
        for tap, t in (("q", q[rows]), ("k", k_rows[rows]), ("v", v[rows]), ("context", out[rows])):
            w.write(tap, {f"layers.0.attn.{tap}@0": t.float()})
        return DumpReader(w.close())
    prefill, step = slice(0, 6), slice(6, 7)
    refs = [dump("ref", prefill, k, ref), dump("ref0", step, k, ref)]
    cands = [dump("cand", prefill, k_tap, ref), dump("cand0", step, k_tap, cand)]
    return refs, cands, SimpleNamespace(config=config)


def test_the_kv_cache_is_named_where_the_decode_read_other_keys(tmp_path):
    from vllm_parity.architectures import lookup
    from vllm_parity.harness.op_hints import kv_cache

    refs, cands, ckpt = _decode_dumps(tmp_path, keys_scale=1.5)
    hint = kv_cache("layers.0.attn.context", 0, refs, cands, ckpt, lookup("llama"))
    assert hint.kind == "kv_cache" and "at decode step 0" in hint.evidence, hint
    assert "model.layers.0.self_attn" in hint.fix
    # the candidate's own decode-step key is wrong: its attention computed what its projections gave it
    refs, cands, ckpt = _decode_dumps(tmp_path / "own", decode_k_shift=0.5)
    hint = kv_cache("layers.0.attn.context", 0, refs, cands, ckpt, lookup("llama"))
    assert hint.kind == "undecided" and "not only in what the cache held" in hint.evidence, hint


# -- on the real engine ----------------------------------------------------------------------------

NEEDS_VLLM = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")


def _plant(model):
    """Layer 1's post-attention norm with epsilon 1e-2 (the checkpoint says 1e-5); layer 2's input norm weight
    10 % larger on every other feature; layer 3's rotary embedding built with base 500000 (config: 10000).
    vLLM shares one rotary embedding between the layers of the same parameters: layer 3 gets its own copy."""
    layers = model.model.layers
    layers[1].post_attention_layernorm.variance_epsilon = 1e-2
    layers[2].input_layernorm.weight.data[::2] *= 1.1
    attn = layers[3].self_attn
    rope = copy.deepcopy(attn.rotary_emb)
    rope.base = 500000.0
    rope.cos_sin_cache = rope._compute_cos_sin_cache().to(attn.rotary_emb.cos_sin_cache.dtype)
    attn.rotary_emb = rope
    return True


@pytest.mark.vllm
@pytest.mark.slow
@NEEDS_VLLM
def test_planted_norm_and_rope_faults_are_named(tmp_path):
    """One tiny Llama engine, isolated mode, a fault a layer: each is the only source of its layer, at its tap,
    with its hint first."""
    from tests.engine_runs import session
    from vllm_parity.fixtures.checkpoints import Dims, make_fixture

    model = make_fixture("fp", tmp_path / "m", dims=Dims(hidden=128, layers=4, heads=2, kv_heads=1, intermediate=256,
                                                        vocab=1024))
    s = session(model, tmp_path, "faults", level="op", mode="isolated")
    try:
        s.llm().apply_model(_plant)
        sources = [t.name for t in s.judgement().taps if t.role == "source"]
        hints = s.diagnosis()
    finally:
        s.finish()
    assert sources == ["layers.1.mlp.norm", "layers.2.attn.norm", "layers.3.attn.context"], sources
    norm = hints.of("layers.1.mlp.norm")[0]
    assert norm.kind == "norm_epsilon", norm
    solved = float(norm.evidence.split("eps = ")[1].split(" ")[0])
    assert solved == pytest.approx(1e-2, rel=0.02), norm.evidence
    assert "model.layers.1.post_attention_layernorm" in norm.fix
    rope = hints.of("layers.3.attn.context")[0]
    assert rope.kind == "rope" and "with rope_theta 500000, no scaling" in rope.evidence, rope
    print("\n".join(f"{h.tap} [{h.kind}] {h.evidence}\n    fix: {h.fix}" for h in hints.hints))
    (undecided,) = hints.of("layers.2.attn.norm")
    assert undecided.kind == "undecided" and "norm_epsilon" in undecided.evidence, undecided
    assert "another epsilon (solved " in undecided.evidence and "model.layers.2.input_layernorm" in undecided.evidence


def _plant_head_norm_and_pairs(model):
    """Layer 0's per-head q norm with epsilon 1e-2; layer 1's rotary embedding rotating adjacent pairs (gptj)
    where Qwen3 rotates halves."""
    layers = model.model.layers
    layers[0].self_attn.q_norm.variance_epsilon = 1e-2
    attn = layers[1].self_attn
    rope = copy.deepcopy(attn.rotary_emb)
    rope.is_neox_style = False
    attn.rotary_emb = rope
    return True


@pytest.mark.vllm
@pytest.mark.slow
@NEEDS_VLLM
def test_planted_head_norm_and_pair_layout_faults_are_named(tmp_path):
    """Qwen3's per-head q norm (each head's row normalized on its own) and its rope's pair layout, on one engine."""
    from tests.engine_runs import session
    from vllm_parity.fixtures.checkpoints import Dims, make_fixture

    model = make_fixture("fp", tmp_path / "m", arch="qwen3",
                         dims=Dims(hidden=128, layers=2, heads=2, kv_heads=1, intermediate=256, vocab=1024))
    s = session(model, tmp_path, "faults", level="op", mode="isolated")
    try:
        s.llm().apply_model(_plant_head_norm_and_pairs)
        sources = [t.name for t in s.judgement().taps if t.role == "source"]
        hints = s.diagnosis()
    finally:
        s.finish()
    assert sources == ["layers.0.attn.q_norm", "layers.1.attn.context"], sources
    norm = hints.of("layers.0.attn.q_norm")[0]
    assert norm.kind == "norm_epsilon" and "per row and head (2 heads of 64)" in norm.evidence, norm
    assert float(norm.evidence.split("eps = ")[1].split(" ")[0]) == pytest.approx(1e-2, rel=0.02), norm.evidence
    assert "model.layers.0.self_attn.q_norm" in norm.fix
    rope = hints.of("layers.1.attn.context")[0]
    assert rope.kind == "rope" and "gptj pairs in place of the configured rope_theta 10000, no scaling, neox" \
        in rope.evidence, rope
    print("\n".join(f"{h.tap} [{h.kind}] {h.evidence}\n    fix: {h.fix}" for h in hints.hints))
