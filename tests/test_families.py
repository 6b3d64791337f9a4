"""Every dense family on the real engine, in process: stock vLLM against stock transformers (the fp
control), this project's formats served by its vLLM plugin, and two planted faults localized to their taps.

One engine serves a checkpoint's clean run and its faulty run: the faults are forward hooks planted after the
clean capture, each computing what a broken kernel or weight loader would.
"""

import dataclasses
import json
import os

import pytest
import torch

from vllm_parity.architectures import lookup
from vllm_parity.fixtures.checkpoints import Dims, make_fixture
from vllm_parity.harness.taps import canonical_order

from tests.engine_runs import checked_engine, other_bit_order, session

pytest.importorskip("vllm", reason="the candidate is the vLLM engine")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SMALL = Dims(hidden=128, layers=3, heads=2, kv_heads=1, intermediate=256, vocab=1024)
DENSE = ["mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "minicpm3"]
DIMS = {"minicpm3": dataclasses.replace(SMALL, kv_heads=SMALL.heads)}  # latent attention: a kv head per head
# what each family adds to Llama's taps
OWN_TAPS = {"qwen3": ["layers.0.attn.q_norm", "layers.0.attn.k_norm"],
            "gemma2": ["layers.0.attn.post_norm", "layers.0.mlp.post_norm"],
            "gemma3_text": ["layers.0.attn.q_norm", "layers.0.attn.post_norm", "layers.0.mlp.post_norm"],
            "minicpm3": ["layers.0.attn.q_a", "layers.0.attn.q_a_norm", "layers.0.attn.kv_a", "layers.0.attn.kv_a_norm",
                         "layers.0.attn.kv"]}
# every family has these two; MoE and BitNet families are judged here for the two classic faults too
O_PROJ, QKV = "model.layers.0.self_attn.o_proj", "model.layers.1.self_attn.qkv_proj"
DECODE_IN_CI = {"gemma3_text", "minicpm3", "mixtral"}  # sliding windows, latent attention, experts
FAULTED = DENSE + ["bitnet", "mixtral",
                                                pytest.param("qwen2_moe", marks=pytest.mark.nightly),
                                                pytest.param("qwen3_moe", marks=pytest.mark.nightly)]


def _every_level_passes(s, arch, decode_steps: int = 0):
    """Every tap of the prefill, in canonical order, and of each decode step, passes; so do the model checks."""
    judgement = s.judgement()
    taps = [t.name for t in judgement.taps if t.phase == "prefill"]
    assert taps == [t for t in canonical_order(SMALL.layers, lookup(arch), s.ckpt.config) if not t.endswith(".input")]
    for step in range(decode_steps):
        assert [t.name for t in judgement.taps if t.phase == "decode" and t.step == step] == taps, step
    assert len(judgement.taps) == len(taps) * (1 + decode_steps)
    assert set(OWN_TAPS.get(arch, [])) <= set(taps)
    failed = [(t.name, t.metrics.as_dict() if t.metrics else t.message) for t in judgement.taps if not t.passed]
    assert not failed, failed
    for check in ("greedy", "topk", "logprobs", *s.op_checks()):
        assert s.check(check)["passed"], (check, s.check(check))


@pytest.mark.parametrize("arch", ["llama", *DENSE])
def test_fp_control_at_every_level(tmp_path, arch):
    """No custom code on either side: proof the map, token alignment and residual handling are right."""
    model = make_fixture("fp", tmp_path / "fp", dims=DIMS.get(arch, SMALL), arch=arch)
    s = session(model, tmp_path, "fp", level="model")
    try:
        _every_level_passes(s, arch)
        assert s.record().run["architecture"] == arch and s.record().run["format"] == "fp"
        ref, cand = s.capture().reference, s.capture().candidate
        assert ref.entry("layers.2.output", 3)["shape"] == cand.entry("layers.2.output", 3)["shape"] == [64, 128]
        assert ref.manifest["prompts_sha256"] == cand.manifest["prompts_sha256"]
        assert ref.manifest["model_sha256"] == cand.manifest["model_sha256"]
    finally:
        s.finish()


# in CI gemma3_text (the most quirks: a norm offset, per-head norms, a tied output embedding) and phi3 (q/k/v
# and gate/up fused on disk, one int8x tensor each); the rest nightly
@pytest.mark.parametrize("arch", [a if a in ("gemma3_text", "phi3") else pytest.param(a, marks=pytest.mark.nightly)
                                  for a in ["llama", *DENSE]])
def test_int8x_at_every_level(tmp_path, arch):
    model = make_fixture("int8x", tmp_path / "int8x", dims=DIMS.get(arch, SMALL), arch=arch)
    s = session(model, tmp_path, "int8x", level="model")
    try:
        _every_level_passes(s, arch)
    finally:
        s.finish()


def _plant(model, flipped: torch.Tensor | None, kv: int):
    """Layer 0's o_proj decodes with the other bit order; layer 1's fused q/k/v output (where the family has
    one) has its k and v slices exchanged."""
    def o_proj(mod, args, out):
        y = args[0] @ flipped.to(args[0].dtype).T
        return (y, *out[1:]) if isinstance(out, tuple) else y

    def qkv(mod, args, out):
        y = out[0] if isinstance(out, tuple) else out
        q, k, v = y.split([y.shape[-1] - 2 * kv, kv, kv], dim=-1)
        y = torch.cat([q, v, k], dim=-1)
        return (y, *out[1:]) if isinstance(out, tuple) else y

    if flipped is not None:
        model.get_submodule(O_PROJ).register_forward_hook(o_proj)
    if QKV in dict(model.named_modules()):
        model.get_submodule(QKV).register_forward_hook(qkv)
    return True


def _faulty_run(model, tmp_path, llm, flipped, kv):
    """The sources and the (tap, kind) hints of an isolated run on ``llm`` with the faults planted."""
    llm.apply_model(lambda m: _plant(m, flipped, kv))
    faulty = session(model, tmp_path, "faulty", llm=llm, level="op", mode="isolated")
    try:
        return ([t.name for t in faulty.judgement().taps if t.role == "source"],
                {(h.tap, h.kind) for h in faulty.diagnosis().hints})
    finally:
        faulty.finish()


@pytest.mark.parametrize("arch", FAULTED)
def test_ternary_passes_and_planted_faults_are_localized(tmp_path, arch):
    dims = DIMS.get(arch, SMALL)
    model = make_fixture("seed-article", tmp_path / "t", dims=dims, arch=arch)
    # the clean run with two decode steps (each family's KV cache and one-row kernels, tap by tap): in CI for the
    # families whose attention or cache differs most, for every family in the nightly gate
    steps = 2 if arch in DECODE_IN_CI or os.environ.get("PARITY_NIGHTLY") == "1" else 0
    llm = checked_engine(model, tmp_path, lambda s: _every_level_passes(s, arch, decode_steps=steps), level="model",
                         decode_steps=steps)
    w = other_bit_order(model, O_PROJ)
    kv = dims.kv_heads * dims.hidden // dims.heads
    sources, hints = _faulty_run(model, tmp_path, llm, w, kv)
    assert ("layers.0.attn.o", "bit_order") in hints
    if arch == "minicpm3":  # latent attention: no fused q/k/v to misplace
        assert sources == ["layers.0.attn.o"]
        return
    assert sources == ["layers.0.attn.o", "layers.1.attn.k", "layers.1.attn.v"]
    assert ("layers.1.attn.k", "slices_swapped") in hints and ("layers.1.attn.v", "slices_swapped") in hints


def test_swapped_slices_of_a_projection_fused_on_disk_are_named(tmp_path):
    """Phi3 fuses q/k/v in transformers too: the harness splits both sides, so a k/v swap is still named."""
    model = make_fixture("fp", tmp_path / "phi3", dims=SMALL, arch="phi3")
    clean = session(model, tmp_path, "clean", level="op")
    try:
        llm = clean.hand_over()
    finally:
        clean.finish()
    sources, hints = _faulty_run(model, tmp_path, llm, None, SMALL.kv_heads * SMALL.hidden // SMALL.heads)
    assert sources == ["layers.1.attn.k", "layers.1.attn.v"]
    assert ("layers.1.attn.k", "slices_swapped") in hints and ("layers.1.attn.v", "slices_swapped") in hints


def test_minicpm3s_latent_norms_take_another_epsilon_in_transformers(tmp_path):
    """transformers builds MiniCPM3's q_a / kv_a norms with their class's default epsilon (1e-6), vLLM with
    the config's rms_norm_eps: on a config that says 1e-5 the harness finds them, and only them, as sources."""
    dims = DIMS["minicpm3"]
    model = make_fixture("fp", tmp_path / "m", dims=dims, arch="minicpm3")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}, indent=2, sort_keys=True))
    s = session(model, tmp_path, "eps", level="op", mode="isolated")
    try:
        sources = {t.name for t in s.judgement().taps if t.role == "source"}
        hints = {}
        for h in s.diagnosis().hints:
            hints.setdefault(h.tap, []).append(h)
    finally:
        s.finish()
    latent = {f"layers.{i}.attn.{n}" for i in range(dims.layers) for n in ("q_a_norm", "kv_a_norm")}
    assert latent <= sources
    for tap in latent:  # each named as an epsilon, the reference's solved as transformers' 1e-6
        first = hints[tap][0]
        assert first.kind == "norm_epsilon" and "1e-06" in first.evidence, (tap, first)
    assert not {t for t in sources if t.rsplit(".", 1)[-1] not in ("q_a_norm", "kv_a_norm", "gate", "up")}, sources


@pytest.mark.nightly
def test_tensor_parallel_of_ternary_tensors_fused_on_disk(tmp_path):
    """Phi3's ternary qkv_proj and gate_up_proj, one checkpoint tensor each: vLLM's loader splits each into its
    logical shards and every rank takes its rows of each; the gathered dumps equal one rank's."""
    from vllm_parity.fixtures.prompts import load_prompts

    from tests.engine_runs import assert_same_dumps, tensor_parallel_dumps

    model = make_fixture("seed-article", tmp_path / "phi3", dims=SMALL, arch="phi3")
    dumps = tensor_parallel_dumps(model, "phi3", load_prompts()[:2], tmp_path)
    assert {"layers.1.attn.k", "layers.1.mlp.up"} <= set(dumps[1].taps())
    assert_same_dumps(dumps[1], dumps[2])
