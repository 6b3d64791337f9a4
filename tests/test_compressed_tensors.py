"""compressed-tensors checkpoints (llm-compressor's format) against vLLM's own methods: the reference decodes
with the compressed-tensors library and quantizes activations as vLLM serves them; fixtures are written by
compressed-tensors' compressors. Hand-worked bytes first, then the real engine."""

import hashlib
import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st
from safetensors.torch import save_file

from vllm_parity.errors import CheckpointError, DecodeError, EngineUnsupported, FormatError
from vllm_parity.fixtures.checkpoints import Dims
from vllm_parity.fixtures.compressed_tensors import SCHEMES, make_ct_fixture
from vllm_parity.reference.checkpoint import Checkpoint
from vllm_parity.reference.formats import parse_quantization_config
from vllm_parity.reference.linear import fp8_fake_quant

from tests.engine_runs import (checked_engine, doubled_channel_is_found, four_bit_checked, four_bit_refused,
                               four_bit_reloaded, four_bit_scales_changed, nibbles, session, stored, words)

SMALL = Dims(hidden=128, layers=3, heads=2, kv_heads=1, intermediate=256, vocab=1024)


def _config(fmt: str, weights: dict, activations: dict | None = None, **extra) -> dict:
    group = {"targets": ["Linear"], "weights": weights, "format": fmt}
    if activations is not None:
        group["input_activations"] = activations
    return {"quant_method": "compressed-tensors", "format": fmt, "config_groups": {"group_0": group},
            "ignore": ["lm_head"], "quantization_status": "compressed", **extra}


INT4 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 8}
TOKEN_FP8 = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True}


def _decode(config: dict, stored: dict, n: int, k: int, module: str = "model.layers.0.mlp.up_proj"):
    spec = parse_quantization_config(config)
    return spec.decode(stored, n, k, module)


# -- hand-worked bytes -------------------------------------------------------------------------------


def test_int4_symmetric_packing_hand_worked():
    # values 1..7, -8 stored as nibbles v + 8 = 9..15, 0, the first in the lowest bits: 0x0FEDCBA9
    w = _decode(_config("pack-quantized", INT4), {
        "weight_packed": torch.tensor([[0x0FEDCBA9]], dtype=torch.int32),
        "weight_scale": torch.tensor([[0.5]]), "weight_shape": torch.tensor([1, 8])}, 1, 8)
    assert w.tolist() == [[0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, -4.0]]


def test_int4_zero_points_hand_worked():
    # the zero point 2 is packed along the output axis: nibble 2 + 8 = 10 in the lowest bits of row 0
    asym = {**INT4, "symmetric": False}
    w = _decode(_config("pack-quantized", asym), {
        "weight_packed": torch.tensor([[0x0FEDCBA9]], dtype=torch.int32),
        "weight_scale": torch.tensor([[0.5]]), "weight_shape": torch.tensor([1, 8]),
        "weight_zero_point": torch.tensor([[10]], dtype=torch.int32)}, 1, 8)
    assert w.tolist() == [[-0.5, 0.0, 0.5, 1.0, 1.5, 2.0, 2.5, -5.0]]


def test_fp8_weights_hand_worked_and_a_nan_code_refused():
    fp8 = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"}
    config = _config("float-quantized", fp8, TOKEN_FP8)
    # e4m3: 0x38 = 1.0, 0x40 = 2.0, 0xB8 = -1.0, 0x7E = 448
    codes = torch.tensor([[0x38, 0x40, 0xB8, 0x7E]], dtype=torch.uint8).view(torch.float8_e4m3fn)
    w = _decode(config, {"weight": codes, "weight_scale": torch.tensor([[0.25]])}, 1, 4)
    assert w.tolist() == [[0.25, 0.5, -0.25, 112.0]]
    nan = torch.tensor([[0x38, 0x7F, 0x38, 0x38]], dtype=torch.uint8).view(torch.float8_e4m3fn)
    with pytest.raises(DecodeError, match="NaN or Inf"):
        _decode(config, {"weight": nan, "weight_scale": torch.tensor([[0.25]])}, 1, 4)


def test_the_spec_reads_schemes_and_activations():
    spec = parse_quantization_config(_config("float-quantized", {"num_bits": 8, "type": "float",
                                                                  "strategy": "channel"}, TOKEN_FP8))
    assert spec.activation_of("model.layers.0.self_attn.q_proj") == "per_token_absmax_fp8_e4m3"
    assert spec.is_ignored("lm_head") and not spec.is_ignored("model.layers.3.mlp.down_proj")
    regex = _config("pack-quantized", INT4)
    regex["config_groups"]["group_1"] = {"targets": ["re:.*down_proj$"], "format": "pack-quantized",
                                         "weights": {**INT4, "group_size": 16}}
    spec = parse_quantization_config(regex)
    assert spec.scheme_of("model.layers.0.mlp.down_proj").group_size == 16  # a regex wins over a class
    assert spec.scheme_of("model.layers.0.mlp.up_proj").group_size == 8


@pytest.mark.parametrize("change, match", [
    (lambda c: c["config_groups"]["group_0"].update(input_activations={**TOKEN_FP8, "strategy": "tensor", "dynamic": False}),
     "group 'group_0': input activations .*static.* not reproduced"),
    (lambda c: c["config_groups"]["group_0"].update(format="nvfp4-pack-quantized"),
     "format 'nvfp4-pack-quantized' is not decoded here; known"),
    (lambda c: c["config_groups"]["group_0"].update(weights={**{k: v for k, v in INT4.items() if k != "group_size"},
                                                             "strategy": "block", "block_structure": [8, 8]}),
     "weight strategy 'block' is not decoded here"),
    (lambda c: c.update(config_groups={}), "no config_groups"),
])
def test_what_the_reference_cannot_decode_is_refused_by_name(change, match):
    config = _config("pack-quantized", INT4)
    change(config)
    with pytest.raises(FormatError, match=match):
        parse_quantization_config(config)


def test_bad_tensors_name_the_tensor(tmp_path):
    out = make_ct_fixture("ct-w4a16", tmp_path / "m", dims=SMALL)
    module = "model.layers.0.mlp.down_proj"
    from safetensors.torch import load_file
    tensors = load_file(out / "model.safetensors")
    tensors[f"{module}.weight_packed"] = tensors[f"{module}.weight_packed"][:, :-1].contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    ckpt = Checkpoint(out)
    n, k = ckpt.linear_shapes()[module]
    with pytest.raises(CheckpointError, match=f"{module}.weight_packed' has shape"):
        ckpt.spec.read_stored(ckpt, module, n, k)


class _Tensors(dict):
    """Stored tensors read as a checkpoint reads them, with the same checks."""

    def expect(self, name, shape, dtypes):
        t = self[name]
        assert tuple(t.shape) == tuple(shape) and t.dtype in dtypes, (name, t.shape, t.dtype)
        return t


def test_group_indices_out_of_range_are_refused():
    spec = parse_quantization_config(_config("pack-quantized", {**INT4, "actorder": "group"}))
    m = "model.layers.0.mlp.up_proj"
    stored = _Tensors({f"{m}.weight_packed": torch.zeros(1, 2, dtype=torch.int32),
                       f"{m}.weight_scale": torch.ones(1, 2), f"{m}.weight_shape": torch.tensor([1, 16]),
                       f"{m}.weight_g_idx": torch.tensor([0] * 8 + [2] * 8, dtype=torch.int32)})
    with pytest.raises(DecodeError, match="weight_g_idx: group indices outside 0..1"):
        spec.read_stored(stored, m, 1, 16)
    stored[f"{m}.weight_g_idx"] = torch.tensor([1, 0] * 8, dtype=torch.int32)  # activation order: groups permuted
    w = spec.decode(spec.read_stored(stored, m, 1, 16), 1, 16, m)
    assert w.shape == (1, 16)


def test_fixtures_are_deterministic_and_written_by_compressed_tensors(tmp_path):
    digests = []
    for name in ("a", "b"):
        out = make_ct_fixture("ct-w8a8", tmp_path / name, dims=SMALL)
        digests.append(hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest())
    assert digests[0] == digests[1]
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors" and config["format"] == "int-quantized"
    assert config["config_groups"]["group_0"]["input_activations"]["dynamic"] is True


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 6), width=st.sampled_from([8, 64, 96]), scale=st.floats(1e-4, 1e4),
       seed=st.integers(0, 2**31 - 1))
def test_the_fp8_activation_quantizer_is_vllms(rows, width, scale, seed):
    """The reference's dynamic fp8 quantization rounds every value as vLLM's ``QuantFP8`` does (its codes
    and scales equal, bit for bit), zeros and exact ties included."""
    qfp8 = pytest.importorskip("vllm.model_executor.layers.quantization.input_quant_fp8")
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=g) * scale
    x[0, :2] = torch.tensor([0.0, -0.0])
    if width > 4:
        x[-1, 4] = x[-1].abs().max() * 1.0001  # a tie of the max
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):
        codes, vscale = qfp8.QuantFP8(static=False, group_shape=GroupShape.PER_TOKEN).forward_native(x)
    mine, inverse = fp8_fake_quant(x)
    assert torch.equal(mine, codes.to(torch.float32))
    assert torch.equal(inverse, vscale.reciprocal())


def test_a_saturating_int8_gemm_is_named_and_an_exact_one_is_not():
    from vllm_parity.harness.diagnosis import LinearContext, diagnose_tap
    from vllm_parity.reference.linear import ReferenceLinear, activation_fake_quant

    int8 = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
    spec = parse_quantization_config(_config("int-quantized", int8, {**TOKEN_FP8, "type": "int"}))
    module, n, k = "model.layers.0.mlp.up_proj", 48, 128
    g = torch.Generator().manual_seed(4)
    codes = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, 1, generator=g) * 0.01 + 0.001
    lin = ReferenceLinear(module, spec, {"weight": codes, "weight_scale": scale}, n, k)
    x = torch.randn(40, k, generator=g)
    ref = lin(x)
    # the u8·s8 pairs of each product summed in int16, saturating; +128 taken off after the int32 sum
    x_q, s_x = activation_fake_quant(x)
    u = (x_q.to(torch.int64) + 128).reshape(40, 1, k // 2, 2)
    pairs = (u * codes.to(torch.int64).reshape(1, n, k // 2, 2)).sum(-1).clamp(-32768, 32767)
    acc = pairs.sum(-1) - 128 * codes.to(torch.int64).sum(-1)
    cand = (acc.double() * scale.double().T / s_x.double()).float()
    assert (cand - ref).norm() > 1e-2 * ref.norm()  # this draw does saturate
    hints = diagnose_tap("layers.0.mlp.up", ref, cand, LinearContext(module, x, lin))
    assert hints and hints[0].kind == "int8_saturation", hints
    noisy = ref * (1 + 1e-3 * torch.randn(40, n, generator=g))
    assert all(h.kind != "int8_saturation" for h in diagnose_tap("layers.0.mlp.up", ref, noisy,
                                                                   LinearContext(module, x, lin)))


@pytest.mark.parametrize("name, stored, scheme", [
    ("ct-w4a16-asym", "pack-quantized", {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group",
                                         "group_size": 32, "actorder": None}),
    ("ct-fp8-dynamic", "float-quantized", {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel",
                                           "group_size": None, "actorder": None}),
])
def test_parity_inspect_names_the_method_and_scheme(tmp_path, name, stored, scheme):
    from vllm_parity.tools.inference import inspect_checkpoint

    out = make_ct_fixture(name, tmp_path / "m", dims=SMALL)
    rep = inspect_checkpoint(out)
    assert rep["format"] == "compressed-tensors" and rep["warnings"] == [], rep["warnings"]
    assert {m["stored"] for m in rep["matrices"]} == {stored}
    assert all(m["scheme"] == scheme for m in rep["matrices"])
    assert rep["key_sources"]["group_size"] == "inferred" and rep["key_sources"]["input_activations"] == "declared"
    # a declared group size that the scales' shape contradicts is said, with what vLLM would do
    config = json.loads((out / "config.json").read_text())
    weights = config["quantization_config"]["config_groups"]["group_0"]["weights"]
    if weights.get("group_size"):
        weights["group_size"] = 64
        (out / "config.json").write_text(json.dumps(config))
        warnings = inspect_checkpoint(out)["warnings"]
        assert any(w.startswith("group_size: config.json declares 64, but the tensors' shapes and names show 32: "
                                "vLLM applies each scale to the wrong inputs") for w in warnings), warnings


@pytest.mark.parametrize("fault, kind, says", [
    ("next_group", "scale_groups", "scaled with the next group's scales (groups shifted by +1)"),
    ("pairs", "scale_groups", "each pair of neighbouring groups exchanged"),
    ("zero_plus_one", "zero_point", "every zero point read +1 off its stored value"),
    ("no_scale", "scale_missing", "without its group scales"),
])
def test_group_scale_and_zero_point_faults_get_their_hint(tmp_path, fault, kind, says):
    """W4A16 with zero points: the candidate computed from the stored codes with one classic mistake (the
    prediction here made from the reference's weight and scales alone) is named by its kind."""
    from vllm_parity.harness.diagnosis import LinearContext, diagnose_tap
    from vllm_parity.reference.linear import ReferenceLinear

    out = make_ct_fixture("ct-w4a16-asym", tmp_path / "m", dims=SMALL, dtype="float32")
    ckpt, module = Checkpoint(out), "model.layers.0.mlp.down_proj"
    n, k = ckpt.linear_shapes()[module]
    stored = ckpt.spec.read_stored(ckpt, module, n, k)
    lin = ReferenceLinear(module, ckpt.spec, stored, n, k)
    w, s = lin.weight(), stored["weight_scale"].float()
    per_input = s.repeat_interleave(32, dim=1)
    groups = torch.arange(s.shape[1])
    wrong = {"next_group": lambda: w / per_input * s[:, (groups + 1) % len(groups)].repeat_interleave(32, dim=1),
             "pairs": lambda: w / per_input * s[:, groups.reshape(-1, 2).flip(1).reshape(-1)].repeat_interleave(32, 1),
             "zero_plus_one": lambda: w - per_input, "no_scale": lambda: w / per_input}[fault]()
    x = torch.randn(48, k, generator=torch.Generator().manual_seed(5))
    hints = diagnose_tap("layers.0.mlp.down", lin(x), x @ wrong.T, LinearContext(module, x, lin))
    assert hints and hints[0].kind == kind and says in hints[0].evidence, hints


# -- the real engine ---------------------------------------------------------------------------------


def _has_vnni() -> bool:
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return False
    return bool(flags & {"avx512_vnni", "avx_vnni", "amx_int8"})


def _every_level_passes(s):
    judgement = s.judgement()
    assert s.mode == "isolated" and "quantizes activations" in s.record().run["mode_reason"]
    failed = [(t.name, t.isolated.message) for t in judgement.taps if not t.verdict]
    assert not failed, failed
    for check in ("greedy", "topk", "logprobs"):
        assert s.check(check)["passed"], (check, s.check(check))


def _double_one_channel_scale(module: str, channel: int):
    def change(model):
        param = model.get_submodule(module).weight_scale
        param.data.view(-1)[channel] *= 2
        return True
    return change


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", pytest.param("qwen2", marks=pytest.mark.nightly)])  # qwen2: CI time
def test_fp8_dynamic_passes_and_a_doubled_scale_is_localized(tmp_path, arch):
    pytest.importorskip("vllm", reason="the candidate is the vLLM engine")
    model = make_ct_fixture("ct-fp8-dynamic", tmp_path / "fp8", dims=SMALL, arch=arch)
    llm = checked_engine(model, tmp_path, _every_level_passes, level="model")
    doubled_channel_is_found(llm, model, tmp_path, _double_one_channel_scale("model.layers.1.mlp.down_proj", 5))


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("dtype, arch", [("bfloat16", "llama"),  # float16: nightly (the CI time budget)
                                         pytest.param("float16", "llama", marks=pytest.mark.nightly),
                                         pytest.param("float16", "qwen2", marks=pytest.mark.nightly)])
def test_fp8_dynamic_served_in_half_precision_passes(tmp_path, dtype, arch):
    """The engine quantizes activations it holds in ``dtype``: the reference quantizes them rounded to it too, so
    that each projection fed the reference's input differs by the GEMM's rounding only (fp16: 32 u per token),
    not by the codes that rounding moves across a boundary (2-3 % of a token)."""
    pytest.importorskip("vllm", reason="the candidate is the vLLM engine")
    model = make_ct_fixture("ct-fp8-dynamic", tmp_path / "fp8", dims=SMALL, arch=arch)
    s = session(model, tmp_path, dtype, level="model", dtype=dtype)
    try:
        _every_level_passes(s)
        assert s.capture().candidate.entry("logits", 0)["dtype"] == dtype
        proj = [t.isolated.metrics.token_rel for t in s.judgement().taps if t.name.endswith((".q", ".mlp.down"))]
        assert max(proj) < 4 * torch.finfo(getattr(torch, dtype)).eps, proj
    finally:
        s.finish()


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", pytest.param("qwen2", marks=pytest.mark.nightly)])
def test_w8a8_int8_with_vnni_passes_in_bf16_and_in_fp32_where_vllm_serves_it(tmp_path, arch):
    """With VNNI vLLM's CPU int8 GEMM is exact: bf16 passes every level. In fp32 it depends on AMX, as vLLM's
    scaled_mm/cpu.py chooses: with AMX it takes its fused quantize-and-GEMM kernel, which reads bf16 or fp16 only,
    and the run is refused naming the dtype that runs; without AMX oneDNN's GEMM serves fp32, which passes."""
    pytest.importorskip("vllm", reason="the candidate is the vLLM engine")
    if not _has_vnni():
        pytest.skip("this CPU has no VNNI: vLLM's int8 GEMM saturates here (the next test names it)")
    model = make_ct_fixture("ct-w8a8", tmp_path / "w8a8", dims=SMALL, arch=arch)
    s = session(model, tmp_path, "w8a8", level="model", dtype="bfloat16")
    try:
        _every_level_passes(s)
    finally:
        s.finish()
    s = session(model, tmp_path, "w8a8-fp32", level="model")
    try:
        if torch.cpu._is_amx_tile_supported():
            with pytest.raises(EngineUnsupported, match=r"only in other dtypes than float32 here: run it with "
                                                        r"--parity-dtype=bfloat16 .*expect A to be bfloat16 or half"):
                s.judgement()
        else:
            _every_level_passes(s)
    finally:
        s.finish()


@pytest.mark.vllm
def test_w8a8_int8_in_float16_where_vllms_kernel_would_abort_is_refused_before_the_engine_starts(tmp_path):
    """With AMX vLLM's CPU W8A8 takes ``int8_scaled_mm_with_quant``, whose float16 path is a failed check inside
    an OpenMP region: the process aborts, uncatchable. The run refuses it, naming the dtype that runs."""
    pytest.importorskip("vllm", reason="the candidate is the vLLM engine")
    import torch

    if not torch.cpu._is_amx_tile_supported():
        pytest.skip("this CPU has no AMX: vLLM takes its oneDNN int8 GEMM, which does not abort in float16")
    model = make_ct_fixture("ct-w8a8", tmp_path / "w8a8", dims=SMALL)
    s = session(model, tmp_path, "w8a8-fp16", level="block", dtype="float16")
    try:
        with pytest.raises(EngineUnsupported, match=r"int8_scaled_mm_with_quant.*aborts the process in float16.*"
                                                    r"--parity-dtype=bfloat16"):
            s.judgement()
        assert s._llm is None  # refused before the engine started
    finally:
        s.finish()


@pytest.mark.vllm
@pytest.mark.slow
def test_w8a8_int8_without_vnni_its_saturating_gemm_is_named(tmp_path):
    """vLLM's CPU W8A8 runs oneDNN's int8 GEMM; without VNNI (AVX2) it adds each pair of u8·s8 products in
    16 bits, saturating, and every int8 projection differs: the harness localizes it and names it."""
    pytest.importorskip("vllm", reason="the candidate is the vLLM engine")
    if _has_vnni():
        pytest.skip("this CPU has VNNI: vLLM's int8 GEMM is exact here (the test before judges it)")
    model = make_ct_fixture("ct-w8a8", tmp_path / "w8a8", dims=SMALL)
    s = session(model, tmp_path, "w8a8", level="op")
    try:
        sources = [t.name for t in s.judgement().taps if t.role == "source"]
        assert sources[:3] == ["layers.0.attn.q", "layers.0.attn.k", "layers.0.attn.v"], sources
        hints = s.diagnosis().of("layers.0.attn.q")
        assert hints and hints[0].kind == "int8_saturation", s.diagnosis().hints
        assert "explained" in hints[0].evidence
    finally:
        s.finish()


def _zero_points_plus_one(model, module: str, dtype: str = "bfloat16"):
    """``module``'s stored tensors with every zero point + 1 (its nibble, packed along the output axis), for vLLM
    to repack: its W4A8 kernel folds zero points into a compensation computed at load."""
    t = {k: v for k, v in stored(model, module).items() if k != "weight_shape"}
    t["weight_zero_point"] = words((nibbles(t["weight_zero_point"], 0) + 1) & 15, 0)
    return four_bit_reloaded(module, t, dtype)


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("name, arch, dtype", [
    ("ct-w4a16", "llama", "bfloat16"), ("ct-w4a16-asym", "llama", "bfloat16"), ("ct-w4a16-asym", "qwen2", "bfloat16"),
    ("ct-w4a16-asym", "llama", "float16"),
    *(pytest.param(*case, marks=pytest.mark.nightly) for case in (
        ("ct-w4a16", "qwen2", "bfloat16"), ("ct-w4a16", "llama", "float16"), ("ct-w4a16", "qwen2", "float16"),
        ("ct-w4a16-asym", "qwen2", "float16")))])
def test_w4a16_in_half_precision_passes_and_planted_faults_are_localized(tmp_path, name, arch, dtype):
    """On one engine: every level passes; then a doubled channel scale, groups reading the next group's scales,
    neighbouring groups' scales exchanged and (asymmetric) zero points off by one, each in its own layer, are each
    the only source at their tap, with their hint first. vLLM takes its W4A8 kernel in bf16 with AMX, its W4A16
    kernel otherwise."""
    pytest.importorskip("vllm", reason="the candidate is the vLLM engine")
    model = make_ct_fixture(name, tmp_path / "w4", dims=SMALL, arch=arch)
    faults = {
        "layers.0.mlp.down": (four_bit_scales_changed("model.layers.0.mlp.down_proj", "channel"), "scale_wrong",
                              r"1 of 128 channel\(s\) × (1\.99\d*|2\.00\d*|2) \(channels 5\)"),
        "layers.1.mlp.down": (four_bit_scales_changed("model.layers.1.mlp.down_proj", "next_group"), "scale_groups",
                              r"scaled with the next group's scales \(groups shifted by \+1\)"),
        "layers.1.attn.o": (four_bit_scales_changed("model.layers.1.self_attn.o_proj", "pairs"), "scale_groups",
                            "the scales of each pair of neighbouring groups exchanged"),
    }
    if name == "ct-w4a16-asym":
        faults["layers.2.mlp.down"] = (_zero_points_plus_one(model, "model.layers.2.mlp.down_proj", dtype),
                                       "zero_point", r"every zero point read \+1 off its stored value")
    w4a8 = four_bit_checked(model, tmp_path, faults, dtype=dtype)
    # vLLM's W4A8 kernel where AMX is, in bf16 (its own test)
    assert set(w4a8) == {torch.cpu._is_amx_tile_supported() and dtype == "bfloat16"}


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.nightly
def test_w4a16_through_vllms_w4a16_kernel_too(tmp_path, monkeypatch):
    """With AMX vLLM serves 4-bit in bf16 through its W4A8 kernel; turned off (as on AVX-512 CPUs without AMX)
    it takes ``cpu_gemm_wna16``, scales and zero points in another layout: the same run and faults hold there."""
    pytest.importorskip("vllm", reason="the candidate is the vLLM engine")
    monkeypatch.setenv("VLLM_CPU_INT4_W4A8", "0")
    model = make_ct_fixture("ct-w4a16-asym", tmp_path / "w4", dims=SMALL)
    w4a8 = four_bit_checked(model, tmp_path, {
        "layers.0.mlp.down": (four_bit_scales_changed("model.layers.0.mlp.down_proj", "channel"), "scale_wrong",
                              r"1 of 128 channel\(s\) × (1\.99\d*|2\.00\d*|2) \(channels 5\)"),
        "layers.1.attn.o": (four_bit_scales_changed("model.layers.1.self_attn.o_proj", "pairs"), "scale_groups",
                            "the scales of each pair of neighbouring groups exchanged"),
        "layers.2.mlp.down": (_zero_points_plus_one(model, "model.layers.2.mlp.down_proj"), "zero_point",
                              r"every zero point read \+1 off its stored value"),
    })
    assert w4a8 == [False] * 3


@pytest.mark.vllm
@pytest.mark.slow
def test_w4a16_where_vllm_has_no_kernel_is_refused_with_the_reason(tmp_path):
    pytest.importorskip("vllm", reason="the candidate is the vLLM engine")
    four_bit_refused(make_ct_fixture("ct-w4a16", tmp_path / "w4", dims=SMALL), tmp_path, "compressed-tensors")


def test_every_scheme_has_a_fixture():
    assert set(SCHEMES) == {"ct-w4a16", "ct-w4a16-asym", "ct-w8a8", "ct-fp8-dynamic"}
