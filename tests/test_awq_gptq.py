"""AutoAWQ (GEMM) and GPTQ checkpoints: the reference's decoders by the documented layouts, checked on
hand-worked words, AWQ's against compressed-tensors' own AutoAWQ converter, and on the real engine where
vLLM's CPU build has its 4-bit kernel."""

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st

from vllm_parity.errors import DecodeError, EngineUnsupported, FormatError
from vllm_parity.fixtures.awq import encode as awq_encode, make_awq_fixture
from vllm_parity.fixtures.checkpoints import Dims
from vllm_parity.fixtures.gptq import encode as gptq_encode, make_gptq_fixture
from vllm_parity.reference.formats import awq, gptq, parse_quantization_config

from tests.engine_runs import (four_bit_checked, four_bit_refused, four_bit_reloaded,
                               four_bit_scales_changed, has_wna16, nibbles, session, stored, words)

SMALL = Dims(hidden=128, layers=3, heads=2, kv_heads=1, intermediate=256, vocab=1024)


def test_awq_words_hand_worked():
    # channels 0..7 holding codes 0..7: nibble i holds channel (0, 2, 4, 6, 1, 3, 5, 7)[i]
    assert int(awq.pack(torch.arange(8)[None])[0, 0]) == 0x75316420
    spec = awq.AwqSpec(group_size=2)
    stored = {"qweight": torch.tensor([[0x75316420], [0x75316420]], dtype=torch.int32),
              "qzeros": torch.tensor([[0x11111111]], dtype=torch.int32),  # zero point 1 everywhere
              "scales": torch.full((1, 8), 0.5, dtype=torch.float16)}
    w = spec.decode(stored, 8, 2, "m")
    assert w[:, 0].tolist() == [(c - 1) * 0.5 for c in range(8)] and torch.equal(w[:, 0], w[:, 1])


def test_gptq_words_hand_worked():
    # inputs 0..7 of one channel holding codes 0..7, in order from the lowest nibble: 0x76543210
    assert int(gptq.pack(torch.arange(8)[None])[0, 0]) == 0x76543210
    spec = gptq.GptqSpec(group_size=4)
    stored = {"qweight": torch.tensor([[0x76543210] * 8], dtype=torch.int32),  # (K/8, N) = (1, 8)
              "qzeros": torch.tensor([[0x77777777], [0x33333333]], dtype=torch.int32),  # zero points 8 and 4
              "scales": torch.tensor([[1.0] * 8, [0.25] * 8], dtype=torch.float16),
              "g_idx": torch.tensor([0, 0, 0, 0, 1, 1, 1, 1], dtype=torch.int32)}
    w = spec.decode(stored, 8, 8, "m")
    assert w[0].tolist() == [-8.0, -7.0, -6.0, -5.0, 0.0, 0.25, 0.5, 0.75]
    stored["g_idx"] = torch.tensor([1, 1, 1, 1, 0, 0, 0, 0], dtype=torch.int32)  # activation order
    assert spec.decode(stored, 8, 8, "m")[0].tolist() == [-1.0, -0.75, -0.5, -0.25, -4.0, -3.0, -2.0, -1.0]


@settings(max_examples=25, deadline=None)
@given(n=st.sampled_from([8, 16, 48]), groups=st.integers(1, 3), seed=st.integers(0, 2**31 - 1))
def test_awq_decodes_as_compressed_tensors_reads_the_same_words(n, groups, seed):
    """compressed-tensors' AutoAWQ converter (its own reading of the GEMM layout) and the reference's decoder
    give the same weight."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter

    k = 32 * groups
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    enc = awq_encode(weight, 32)
    mine = awq.AwqSpec(group_size=32).decode(enc, n, k, "m")
    converter = AutoAWQConverter(group_size=32)
    ct = converter.process({f"m.{key}": t.contiguous().clone() for key, t in enc.items()})
    scheme = converter.create_config().config_groups["config_group_0"]
    local = {key.removeprefix("m."): t for key, t in ct.items()}
    local["weight_scale"] = local["weight_scale"].to(torch.float32)
    local["weight_shape"] = [int(v) for v in local["weight_shape"]]
    theirs = PackedQuantizationCompressor.decompress(local, scheme)["weight"]
    torch.testing.assert_close(mine, theirs.to(torch.float32), rtol=0, atol=0)
    assert (mine - weight).abs().max() <= enc["scales"].float().max() * 0.51 + 1e-6  # round to nearest


@settings(max_examples=25, deadline=None)
@given(n=st.sampled_from([8, 24]), groups=st.integers(1, 3), act_order=st.booleans(), seed=st.integers(0, 99))
def test_gptq_round_trips_within_half_a_step(n, groups, act_order, seed):
    k = 32 * groups
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    enc = gptq_encode(weight, 32, act_order, seed)
    w = gptq.GptqSpec(group_size=32, desc_act=act_order).decode(enc, n, k, "m")
    step = enc["scales"].float()[enc["g_idx"].long()].T  # (N, K)
    assert bool(((w - weight).abs() <= 0.5 * step + 1e-6).all())


@pytest.mark.parametrize("config, match", [
    ({"quant_method": "awq", "bits": 8}, "GEMM layout packs 4-bit"),
    ({"quant_method": "awq", "version": "GEMV"}, "version = 'gemv'"),
    ({"quant_method": "gptq", "bits": 8}, "only 4-bit"),
    ({"quant_method": "gptq", "checkpoint_format": "gptq_v2"}, "checkpoint_format = 'gptq_v2'"),
    ({"quant_method": "gptq", "group_size": 0}, "group_size"),
])
def test_what_is_not_decoded_is_refused_by_name(config, match):
    with pytest.raises(FormatError, match=match):
        parse_quantization_config(config)


def test_configs_read_as_their_tools_write_them(tmp_path):
    spec = parse_quantization_config({"quant_method": "awq", "w_bit": 4, "q_group_size": 64, "zero_point": True,
                                      "version": "GEMM", "modules_to_not_convert": ["visual"]})
    assert spec.group_size == 64 and spec.is_ignored("model.visual.proj") and spec.is_ignored("lm_head")
    assert not spec.is_ignored("model.layers.0.mlp.up_proj")
    spec = parse_quantization_config({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True,
                                      "sym": True, "damp_percent": 0.01, "true_sequential": True})
    assert spec.desc_act and spec.to_config()["checkpoint_format"] == "gptq"


def test_group_indices_out_of_range_are_refused(tmp_path):
    from vllm_parity.reference.checkpoint import Checkpoint
    from safetensors.torch import load_file, save_file

    out = make_gptq_fixture(tmp_path / "g", dims=SMALL)
    module = "model.layers.0.mlp.up_proj"
    tensors = load_file(out / "model.safetensors")
    tensors[f"{module}.g_idx"][3] = 99
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    ckpt = Checkpoint(out)
    n, k = ckpt.linear_shapes()[module]
    with pytest.raises(DecodeError, match=f"{module}.g_idx: group indices outside 0..3"):
        ckpt.spec.read_stored(ckpt, module, n, k)


@pytest.mark.parametrize("method, make, keys", [
    ("awq", lambda d: make_awq_fixture(d, dims=SMALL), {"bits": 4, "group_size": 32, "zero_point": True}),
    ("gptq", lambda d: make_gptq_fixture(d, dims=SMALL, act_order=True), {"bits": 4, "group_size": 32,
                                                                           "desc_act": True, "sym": True}),
])
def test_parity_inspect_names_the_method_group_size_and_packing(tmp_path, method, make, keys):
    import json

    from vllm_parity.tools.inference import inspect_checkpoint

    out = make(tmp_path / method)
    rep = inspect_checkpoint(out)
    assert rep["format"] == method and rep["warnings"] == [], rep["warnings"]
    assert {k: rep["quantization_config"][k] for k in keys} == keys
    assert rep["key_sources"]["group_size"] == "inferred" and rep["matrices"][0]["group_size"] == 32
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["group_size"] = 64  # what the scales' rows contradict
    (out / "config.json").write_text(json.dumps(config))
    warnings = inspect_checkpoint(out)["warnings"]
    assert any(w.startswith("group_size: config.json declares 64, but the tensors' shapes and names show 32")
               for w in warnings), warnings


# -- the real engine: vLLM serves both through its 4-bit CPU kernel ---------------------------------------


MAKERS = {"awq": lambda d: make_awq_fixture(d, dims=SMALL),
          "gptq": lambda d: make_gptq_fixture(d, dims=SMALL)}


def _diagnosed(model, module: str, wrong_weight):
    """The hints of ``module``'s tap where the candidate computed ``x @ wrong_weight(stored)ᵀ`` instead."""
    from vllm_parity.harness.diagnosis import LinearContext, diagnose_tap
    from vllm_parity.reference.checkpoint import Checkpoint
    from vllm_parity.reference.linear import ReferenceLinear

    ckpt = Checkpoint(model)
    n, k = ckpt.linear_shapes()[module]
    lin = ReferenceLinear(module, ckpt.spec, ckpt.spec.read_stored(ckpt, module, n, k), n, k)
    x = torch.randn(48, k, generator=torch.Generator().manual_seed(5))
    return diagnose_tap(module.split("model.")[-1], lin(x), x @ wrong_weight(stored(model, module)).T,
                        LinearContext(module, x, lin))


def _grouped(codes, zeros, scales, group):
    """(N, K) weight from codes (N, K), zero points (N, G), scales (N, G) and the group of each input (K,)."""
    return (codes.float() - zeros[:, group].float()) * scales[:, group].float()


@pytest.mark.parametrize("which", ["both", "qweight"])
def test_awq_words_read_in_another_nibble_order_are_named(tmp_path, which):
    """AWQ's words read in plain nibble order (nibble i: channel 8j + i) instead of AutoAWQ's interleave, codes
    and zero points alike or the codes alone: the hint names the order, the tensors and the interleave."""
    model = make_awq_fixture(tmp_path / "awq", dims=SMALL)

    def wrong(t):
        q = nibbles(t["qweight"], 1).T  # (N, K), nibble i of word j as channel 8j + i
        z = nibbles(t["qzeros"], 1).T if which == "both" else awq.unpack(t["qzeros"]).T
        return _grouped(q, z, t["scales"].T, torch.arange(q.shape[1]) // 32)

    hints = _diagnosed(model, "model.layers.1.mlp.down_proj", wrong)
    assert hints and hints[0].kind == "packing_order", hints
    named = "qweight and qzeros" if which == "both" else "qweight read in plain order"
    assert named in hints[0].evidence and "AutoAWQ's interleave (0, 2, 4, 6, 1, 3, 5, 7)" in hints[0].evidence, \
        hints[0].evidence


def test_gptq_g_idx_ignored_is_named(tmp_path):
    """A GPTQ checkpoint with activation order read with groups by position (input k in group k // size)."""
    model = make_gptq_fixture(tmp_path / "gptq", dims=SMALL, act_order=True)

    def wrong(t):
        q, z = nibbles(t["qweight"], 0).T, nibbles(t["qzeros"], 1).T  # (N, K), (N, G): inputs, outputs in order
        return _grouped(q, z + 1, t["scales"].T, torch.arange(q.shape[1]) // 32)

    hints = _diagnosed(model, "model.layers.1.mlp.down_proj", wrong)
    assert hints and hints[0].kind == "g_idx_ignored", hints
    assert "instead of g_idx[k]" in hints[0].evidence, hints[0].evidence


def _awq_words_read_in_order(model, module: str, dtype: str):
    """``module``'s AWQ words read in plain nibble order (nibble i: output 8j + i) instead of AutoAWQ's
    interleave, codes and zero points alike, handed to vLLM's kernel as its AWQ method hands them over (GPTQ's
    layout: codes packed along the inputs, zero points along the outputs)."""
    t = stored(model, module)
    q, z = nibbles(t["qweight"], 1), nibbles(t["qzeros"], 1)  # (K, N), (G, N)
    return four_bit_reloaded(module, {"qweight": words(q, 0), "qzeros": words(z.T, 0), "scales": t["scales"]}, dtype)


def _gptq_groups_relabelled(model, out, module: str):
    """A copy of the GPTQ checkpoint ``model`` at ``out`` in which ``module``'s neighbouring groups exchange their
    scale rows and ``g_idx`` says so (the same weight, read through ``g_idx``), with desc_act still false: vLLM
    0.32 drops ``g_idx`` at load (its ``get_checkpoint_weight_mapper``) and its CPU kernel takes no group index, so
    it reads input i with the scales of row i // group_size."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(model, out)
    tensors = load_file(Path(out) / "model.safetensors")
    scales = tensors[f"{module}.scales"]
    pairs = torch.arange(scales.shape[0]).reshape(-1, 2).flip(1).reshape(-1)
    tensors[f"{module}.scales"] = scales[pairs].contiguous()
    tensors[f"{module}.g_idx"] = pairs[tensors[f"{module}.g_idx"].long()].to(torch.int32)
    save_file(tensors, str(Path(out) / "model.safetensors"), metadata={"format": "pt"})
    return out


SCALE_FAULTS = {
    "layers.0.mlp.down": (four_bit_scales_changed("model.layers.0.mlp.down_proj", "channel"), "scale_wrong",
                          r"1 of 128 channel\(s\) × (1\.99\d*|2\.00\d*|2) \(channels 5\)"),
    "layers.2.attn.o": (four_bit_scales_changed("model.layers.2.self_attn.o_proj", "pairs"), "scale_groups",
                        r"exchanged"),
}


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_awq_in_half_precision_passes_and_planted_faults_are_localized(tmp_path, dtype):
    """On one engine: every level passes; then a doubled channel scale, neighbouring groups' scales exchanged and
    AWQ's words read in plain nibble order are each the only source at their tap, with their hint."""
    pytest.importorskip("vllm", reason="the candidate is the vLLM engine")
    model = make_awq_fixture(tmp_path / "awq", dims=SMALL)
    module = "model.layers.1.mlp.down_proj"
    four_bit_checked(model, tmp_path, {
        **SCALE_FAULTS, "layers.1.mlp.down": (_awq_words_read_in_order(model, module, dtype), "packing_order",
                                              r"qweight and qzeros read in plain order")}, dtype=dtype)


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", pytest.param("float16", marks=pytest.mark.nightly)])
def test_gptq_in_half_precision_passes_and_planted_faults_are_localized(tmp_path, dtype):
    """On one engine: every level passes; then a doubled channel scale and neighbouring groups' scales exchanged
    are each the only source at their tap, and a checkpoint whose ``g_idx`` relabels one layer's groups (desc_act
    false) is read by vLLM without it: that layer, reloaded from it as vLLM loads it, is the only other source, its
    hint the group index ignored."""
    pytest.importorskip("vllm", reason="the candidate is the vLLM engine")
    model = make_gptq_fixture(tmp_path / "gptq", dims=SMALL)
    module = "model.layers.1.mlp.down_proj"
    relabelled = _gptq_groups_relabelled(model, tmp_path / "relabelled", module)
    t = stored(relabelled, module)
    reload = four_bit_reloaded(module, {k: t[k] for k in ("qweight", "scales")}, dtype)  # symmetric: no qzeros
    four_bit_checked(model, tmp_path, {**SCALE_FAULTS, "layers.1.mlp.down": (reload, "g_idx_ignored",
                                                                            r"instead of g_idx\[k\]")},
                     faulty_model=relabelled, dtype=dtype)


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.nightly
def test_gptq_g_idx_is_ignored_by_vllm_when_it_loads_the_checkpoint(tmp_path):
    """The engine loading the relabelled checkpoint itself: the layer whose ``g_idx`` matters is the only source."""
    pytest.importorskip("vllm", reason="the candidate is the vLLM engine")
    if not has_wna16():
        pytest.skip("vLLM's CPU build here has no cpu_gemm_wna16 (AVX-512 builds only)")
    model = _gptq_groups_relabelled(make_gptq_fixture(tmp_path / "gptq", dims=SMALL), tmp_path / "relabelled",
                                    "model.layers.1.mlp.down_proj")
    s = session(model, tmp_path, "w4", level="op", dtype="bfloat16")
    try:
        assert s.mode == "isolated"
        assert [t.name for t in s.judgement().taps if t.role == "source"] == ["layers.1.mlp.down"]
    finally:
        s.finish()


@settings(max_examples=25, deadline=None)
@given(rows=st.sampled_from([8, 16]), cols=st.sampled_from([8, 24]), dim=st.integers(0, 1), seed=st.integers(0, 99))
def test_the_engine_tests_nibble_packing_is_vllms(rows, cols, dim, seed):
    """The packing the engine tests plant faults with is vLLM's own (its ``pack_quantized_values_into_int32``)."""
    pytest.importorskip("vllm", reason="compared with vLLM's packer")
    from vllm.model_executor.layers.quantization.utils.quant_utils import pack_quantized_values_into_int32
    from vllm.scalar_type import scalar_types

    v = torch.randint(0, 16, (rows, cols), generator=torch.Generator().manual_seed(seed), dtype=torch.int32)
    packed = words(v, dim)
    assert torch.equal(packed, pack_quantized_values_into_int32(v, scalar_types.uint4, dim))
    assert torch.equal(nibbles(packed, dim), v)


@pytest.mark.vllm
@pytest.mark.slow
def test_gptq_with_activation_order_is_refused_with_vllms_reason(tmp_path):
    """vLLM 0.32 no longer serves GPTQ's desc_act=True: the run stops with its reason, before any engine."""
    pytest.importorskip("vllm", reason="the candidate is the vLLM engine")
    model = make_gptq_fixture(tmp_path / "act-order", dims=SMALL, act_order=True)
    s = session(model, tmp_path, "w4", level="block", dtype="bfloat16")
    try:
        with pytest.raises(EngineUnsupported, match=r"vLLM refuses to serve this gptq checkpoint .*desc_act=True"):
            s.judgement()
    finally:
        s.finish()


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_where_vllm_has_no_kernel_the_run_is_refused_with_the_reason(tmp_path, method):
    pytest.importorskip("vllm", reason="the candidate is the vLLM engine")
    four_bit_refused(MAKERS[method](tmp_path / method), tmp_path, method)
