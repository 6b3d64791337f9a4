"""``parity inspect``: recovering a checkpoint's quantization_config from its tensors.

Quantized checkpoints come from the fixture generator; their float twins hold the weights decoded
by the reference decoder. Inference must not lean on config.json: the property test removes or
scrambles the declared config and still expects the true one back (plus a warning per wrong key).
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import ClassVar
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_parity.fixtures.checkpoints import Dims, make_fixture, write_checkpoint
from vllm_parity.tools import inference
from vllm_parity.tools.inference import int8x as int8x_inference, registry
from vllm_parity.tools.inference import ternary as ternary_inference
from vllm_parity.tools.inference.keys import Keys
from vllm_parity.tools.cli import main
from vllm_parity.reference.formats import int8x, ternary
from vllm_parity.reference.checkpoint import Checkpoint
from vllm_parity.reference.formats.ternary import PRESETS, TernarySpec
from vllm_parity.reference.formats.int8x import Int8xSpec

DIMS = Dims(hidden=64, layers=1, heads=2, kv_heads=1, intermediate=128, vocab=64)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Keys the tensors show: shapes and names without --against, the float weights for the rest.
SHAPE_KEYS = ("pack_axis", "scale_granularity", "weight_name", "scale_name")
WEIGHT_KEYS = ("pack_layout", "bit_order", "code_map", "scale_mode")


def _examples(n: int) -> int:
    """``n`` examples under hypothesis' stock profile (100), scaled by the active profile."""
    return max(1, round(n * settings().max_examples / 100))


def run_cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["inspect", *map(str, argv)])
    return rc, out.getvalue(), err.getvalue()


def inspect_json(*argv) -> tuple[int, dict, str]:
    rc, out, err = run_cli(*argv, "--json")
    assert rc in (0, 1), err
    return rc, json.loads(out), err


def quantized_keys(ckpt: Checkpoint) -> set[str]:
    spec = ckpt.spec
    return {name for m in ckpt.linear_shapes() if not spec.is_ignored(m) for name in spec.tensor_names(m).values()}


def float_twin(qdir: Path, out: Path, dtype: torch.dtype = torch.float32, edit=None) -> Path:
    """The float checkpoint of ``qdir``: every projection decoded by the reference decoder."""
    ck = Checkpoint(qdir)
    spec = ck.spec
    tensors = {k: ck.tensor(k) for k in ck.keys() if k not in quantized_keys(ck)}
    for module, (n, k) in ck.linear_shapes().items():
        if spec.is_ignored(module):
            continue
        names = spec.tensor_names(module)
        if isinstance(spec, Int8xSpec):
            w = int8x.decode({s: ck.tensor(names[s]) for s in names}, spec, module, dtype=dtype)
        else:
            w = ternary.decode(ck.tensor(names["weight"]), ck.tensor(names["scale"]), spec, n, k).to(dtype)
        tensors[f"{module}.weight"] = edit(module, w) if edit else w
    config = {k: v for k, v in ck.config.items() if k != "quantization_config"}
    return write_checkpoint(out, config, tensors)


def set_declared(ckpt: Path, qc: dict | None) -> None:
    cfg_path = ckpt / "config.json"
    cfg = json.loads(cfg_path.read_text())
    if qc is None:
        cfg.pop("quantization_config", None)
    else:
        cfg["quantization_config"] = qc
    cfg_path.write_text(json.dumps(cfg))


def make_pair(tmp: Path, fmt: str, spec=None, dims: Dims = DIMS, seed: int = 0, scale_dtype: str | None = None,
              float_dtype: torch.dtype = torch.float32) -> tuple[Path, Path]:
    q = make_fixture(fmt, tmp / "q", seed=seed, dims=dims, spec=spec, scale_dtype=scale_dtype)
    return q, float_twin(q, tmp / "fp", float_dtype)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("pairs")
    return {fmt: make_pair(root / fmt, fmt) for fmt in ("seed-article", "hf-bitnet")}


# -- recovering the config ----------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["seed-article", "hf-bitnet"])
def test_against_recovers_preset(pairs, preset):
    q, fp = pairs[preset]
    rc, report, err = inspect_json(q, "--against", fp)
    assert report["quantization_config"] == PRESETS[preset].to_config()
    assert rc == 0 and report["warnings"] == [], err
    for key in SHAPE_KEYS + WEIGHT_KEYS:
        assert report["key_sources"][key] == "inferred", key
    assert set(report["declared_keys"]) >= {"activation_quant", "ignore"}
    v = report["verification"]
    assert v["performed"] and v["passed"] and v["checked"] == 7 and v["max_abs_error"] == 0.0
    survivors = report["hypotheses"]["survivors"]
    assert [(s["pack_layout"], s["bit_order"]) for s in survivors] == \
        [(PRESETS[preset].pack_layout, PRESETS[preset].bit_order)]


NAMES = st.sampled_from(["weight_ternary", "weight", "qweight"])
SCALES = st.sampled_from(["weight_scale", "scale", "s"])


@st.composite
def ternary_specs(draw) -> TernarySpec:
    gran = draw(st.sampled_from(["tensor", "channel", "group"]))
    return TernarySpec(
        pack_axis=draw(st.sampled_from(["input", "output"])),
        pack_layout=draw(st.sampled_from(["interleaved", "blocked"])),
        bit_order=draw(st.sampled_from(["lsb", "msb"])),
        code_map=tuple(draw(st.permutations([-1, 0, 1, None]))),
        scale_granularity=gran,
        group_size=draw(st.sampled_from([32, 64])) if gran == "group" else 128,
        scale_mode=draw(st.sampled_from(["multiply", "divide"])),
        weight_name=draw(NAMES),
        scale_name=draw(SCALES),
        activation_quant=draw(st.sampled_from([None, "per_token_absmax_int8"])),
    )


@settings(max_examples=_examples(200), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(truth=ternary_specs(), said=ternary_specs(), declared=st.sampled_from(["true", "absent", "scrambled"]),
       scale_dtype=st.sampled_from(list(DTYPES)), float_dtype=st.sampled_from(list(DTYPES.values())),
       seed=st.integers(0, 2**16), screen=st.sampled_from([1 << 20, 200]))
def test_against_recovers_drawn_variants(truth, said, declared, scale_dtype, float_dtype, seed, screen):
    with tempfile.TemporaryDirectory() as tmp:
        q, fp = make_pair(Path(tmp), "ternary", truth, seed=seed, scale_dtype=scale_dtype, float_dtype=float_dtype)
        if declared == "absent":
            set_declared(q, None)
        elif declared == "scrambled":
            set_declared(q, said.to_config())
        # A tiny screening slice exercises the slice-then-full-matrix path on these small matrices.
        with mock.patch.object(ternary_inference, "SCREEN_ELEMENTS", screen):
            rc, report, _ = inspect_json(q, "--against", fp)

    # Keys the data cannot show come from config.json, or the defaults when it has none.
    source = {"true": truth, "absent": TernarySpec(), "scrambled": said}[declared]
    expected = replace(truth, activation_quant=source.activation_quant, ignore=source.ignore,
                       group_size=truth.group_size if truth.scale_granularity == "group" else source.group_size)
    assert report["quantization_config"] == expected.to_config()
    assert report["verification"]["passed"]
    assert all(report["key_sources"][k] == "inferred" for k in SHAPE_KEYS + WEIGHT_KEYS)

    wrong = set()
    if declared == "scrambled":
        wrong = {k for k in SHAPE_KEYS + WEIGHT_KEYS if getattr(truth, k) != getattr(said, k)}
        if truth.scale_granularity == said.scale_granularity == "group" and truth.group_size != said.group_size:
            wrong.add("group_size")
    elif declared == "absent":
        wrong = {"quant_method"}
    assert {d["key"] for d in report["disagreements"]} == wrong
    for key in wrong:
        assert any(w.startswith(f"{key}: ") for w in report["warnings"]), (key, report["warnings"])
    assert rc == (1 if wrong else 0)


# -- declared config vs data ----------------------------------------------------------------------


def test_declared_bit_order_disagreeing_with_data_warns_loudly(tmp_path, pairs):
    q, fp = pairs["seed-article"]
    bad = tmp_path / "bad"
    make_fixture("seed-article", bad, dims=DIMS)
    set_declared(bad, {**PRESETS["seed-article"].to_config(), "bit_order": "msb"})
    rc, report, err = inspect_json(bad, "--against", fp)
    assert rc == 1
    assert report["quantization_config"]["bit_order"] == "lsb"
    assert report["disagreements"] == [{"key": "bit_order", "declared": "msb", "data": "lsb", "explicit": True}]
    assert "bit_order: config.json declares 'msb'" in err
    rc, text, _ = run_cli(bad, "--against", fp)
    assert rc == 1
    assert re.search(r"^!!! bit_order: config\.json declares 'msb', but the float weights show 'lsb'", text, re.M)


def test_omitted_key_defaulting_wrongly_is_named(tmp_path, pairs):
    """hf-bitnet data with pack_layout omitted: the default (interleaved) is what a loader would use."""
    _, fp = pairs["hf-bitnet"]
    q = make_fixture("hf-bitnet", tmp_path / "q", dims=DIMS)
    qc = PRESETS["hf-bitnet"].to_config()
    del qc["pack_layout"]
    set_declared(q, qc)
    rc, report, _ = inspect_json(q, "--against", fp)
    assert rc == 1 and report["quantization_config"] == PRESETS["hf-bitnet"].to_config()
    assert report["disagreements"] == [{"key": "pack_layout", "declared": "interleaved", "data": "blocked",
                                        "explicit": False}]
    assert any("omits it, so it defaults to 'interleaved'" in w for w in report["warnings"])


def test_without_against_shapes_and_codes_expose_a_wrong_config(tmp_path):
    truth = replace(PRESETS["seed-article"], pack_axis="output", code_map=(None, 0, 1, -1))
    q = make_fixture("ternary", tmp_path / "q", dims=DIMS, spec=truth)
    set_declared(q, PRESETS["seed-article"].to_config())  # says input-packed, code 3 must not occur
    rc, report, _ = inspect_json(q)
    assert rc == 1
    assert {d["key"] for d in report["disagreements"]} == {"pack_axis"}
    assert any(w.startswith("pack_axis: config.json declares 'input'") for w in report["warnings"])
    assert any("marks code(s) [3] as must-not-occur" in w for w in report["warnings"])
    assert report["code_table"]["never_occurring_codes"] == [0]


@pytest.mark.parametrize("flipped", ["all", "k_proj"])
def test_no_hypothesis_reproduces_mixed_signs(tmp_path, pairs, flipped):
    q, _ = pairs["seed-article"]
    gen = torch.Generator().manual_seed(0)

    def flip(module, w):  # random signs: no code can carry a single sign
        if flipped == "all" or module.endswith(flipped):
            return w * (torch.randint(0, 2, w.shape, generator=gen) * 2 - 1)
        return w

    fp = float_twin(q, tmp_path / "fp", edit=flip)
    rc, report, _ = inspect_json(q, "--against", fp)
    assert rc == 1 and report["quantization_config"] is None
    assert report["hypotheses"]["survivors"] == []
    rejected = report["hypotheses"]["rejected"]
    assert len(rejected) == 4 and all("mixed signs per code" in r["reason"] for r in rejected)
    assert "no hypothesis reproduces" in report["failure"]
    assert report["verification"]["performed"] is False
    if flipped == "all":
        assert [r["fits"] for r in rejected] == [0, 0, 0, 0]
    else:  # the right hypothesis fits every other matrix: the report points at the odd one
        assert (rejected[0]["pack_layout"], rejected[0]["bit_order"], rejected[0]["fits"]) == ("interleaved", "lsb", 6)
        assert rejected[0]["fails_in"] == ["model.layers.0.self_attn.k_proj"]
    rc, text, _ = run_cli(q, "--against", fp)
    line = next(x for x in text.splitlines() if x.startswith("!!! no quantization_config reproduces"))
    assert ("fits 6 of 7 sampled matrices but not model.layers.0.self_attn.k_proj" in line) == (flipped == "k_proj")


def test_a_matrix_outside_the_sample_in_another_format_fails_verification(tmp_path):
    spec = PRESETS["seed-article"]
    q = make_fixture("seed-article", tmp_path / "q", dims=replace(DIMS, layers=2))
    fp = float_twin(q, tmp_path / "fp")
    # Re-pack one layer-1 matrix (outside the searched sample) with the other bit order.
    ck = Checkpoint(q)
    tensors = {k: ck.tensor(k) for k in ck.keys()}
    key = "model.layers.1.mlp.down_proj.weight_ternary"
    values = ternary.unpack_values(tensors[key], spec)
    tensors[key] = ternary.pack_values(values, replace(spec, bit_order="msb"))
    write_checkpoint(q, ck.config, tensors)
    rc, report, _ = inspect_json(q, "--against", fp)
    assert rc == 1
    assert report["quantization_config"] == spec.to_config()
    v = report["verification"]
    assert v["failed"] == ["model.layers.1.mlp.down_proj"] and v["checked"] == 14
    assert v["diagnoses"][0]["survivors"][0]["bit_order"] == "msb"
    assert any("fits pack_layout=interleaved, bit_order=msb" in w for w in report["warnings"])


# -- the report ---------------------------------------------------------------------------------


def test_text_output_has_the_mapping_rows(pairs):
    q, _ = pairs["hf-bitnet"]  # output-packed: merged shards also have packed row ranges
    rc, text, _ = run_cli(q)
    assert rc == 0
    rows = {line.split()[0]: line.split() for line in text.splitlines()
            if line.startswith("  model.") or line.startswith("  lm_head")}
    k = rows["model.layers.0.self_attn.k_proj.weight"]
    assert k[1:6] == ["model.layers.0.self_attn.qkv_proj.weight", "merge", "'k'", "64:96", "16:24"]
    up = rows["model.layers.0.mlp.up_proj.weight_scale"]
    assert up[1:4] == ["model.layers.0.mlp.gate_up_proj.weight_scale", "merge", "1"]
    o = rows["model.layers.0.self_attn.o_proj.weight"]
    assert o[1:4] == ["model.layers.0.self_attn.o_proj.weight", "as", "is"]
    assert rows["model.embed_tokens.weight"][1:4] == ["model.embed_tokens.weight", "as", "is"]
    assert "MAPPING: checkpoint key -> vLLM parameter" in text
    assert "decode per shard" in text  # blocked output packing cannot be decoded as one fused tensor


def test_json_schema(pairs):
    q, fp = pairs["seed-article"]
    _, report, _ = inspect_json(q, "--against", fp)
    assert {"schema", "checkpoint", "against", "format", "declared_config", "quantization_config", "key_sources",
            "inferred_keys", "declared_keys", "default_keys", "disagreements", "tensors", "matrices", "code_table",
            "hypotheses", "verification", "mapping", "warnings", "notes", "summary"} <= set(report)
    assert report["schema"] == "parity-inspect/1" and report["format"] == "ternary"
    assert list(report["quantization_config"]) == list(TernarySpec().to_config())
    ck = Checkpoint(q)
    assert [t["name"] for t in report["tensors"]] == inference.natural_sorted(ck.keys())
    for t in report["tensors"]:
        assert {"name", "shape", "dtype", "role", "min", "max", "distinct", "code_histogram"} <= set(t)
        assert tuple(t["shape"]) == ck.tensors[t["name"]].shape
    packed = next(t for t in report["tensors"] if t["name"].endswith("k_proj.weight_ternary"))
    assert packed["role"] == "packed weight" and packed["pack_axis"] == "input" and packed["pack_factor"] == 4
    codes = ternary.unpack_codes(ck.tensor(packed["name"]), PRESETS["seed-article"])
    assert packed["code_histogram"] == torch.bincount(codes.flatten().long(), minlength=4).tolist()
    for row in report["mapping"]:
        assert set(row) == {"checkpoint_key", "vllm_param", "op", "shard", "rows", "packed_rows", "slot",
                            "tp_split", "transpose", "note"}
    assert len(report["mapping"]) == len(ck.keys())


def test_zero_fraction_and_code_candidates(tmp_path):
    truth = replace(PRESETS["seed-article"], code_map=(1, None, 0, -1))
    q = make_fixture("ternary", tmp_path / "q", dims=DIMS, spec=truth)
    set_declared(q, None)
    _, report, _ = inspect_json(q)
    ck = Checkpoint(q)
    for m in report["matrices"]:
        values = ternary.unpack_values(ck.tensor(f"{m['module']}.weight_ternary"), truth)
        assert m["zero_fraction"] == pytest.approx(float((values == 0).float().mean()))
        assert m["zero_fraction_source"] == "guessed (code balance)"
    table = report["code_table"]
    assert table["never_occurring_codes"] == [1]
    plausible = [c["code_map"] for c in table["candidates"] if c["plausible"]]
    assert sorted(plausible, key=str) == sorted([[1, None, 0, -1], [-1, None, 0, 1]], key=str)
    assert len(table["candidates"]) == 6
    assert report["key_sources"]["code_map"] == "guessed"


def test_float_checkpoint_lists_few_distinct_values(pairs):
    _, fp = pairs["hf-bitnet"]  # per-tensor scale: each decoded matrix holds exactly {-s, 0, s}
    rc, report, _ = inspect_json(fp)
    assert rc == 0 and report["format"] == "float" and report["quantization_config"] is None
    w = next(t for t in report["tensors"] if t["name"] == "model.layers.0.self_attn.q_proj.weight")
    assert len(w["distinct"]) == 3 and w["distinct"][1] == 0.0 and w["distinct"][0] == -w["distinct"][2]
    assert next(t for t in report["tensors"] if t["name"] == "model.norm.weight")["distinct"] is None


def test_int8x_reports_levels_bits_and_block_size(tmp_path):
    spec = Int8xSpec(block_size=256)
    q = make_fixture("int8x", tmp_path / "q", dims=DIMS, spec=spec)
    fp = float_twin(q, tmp_path / "fp")
    set_declared(q, None)
    rc, report, _ = inspect_json(q, "--against", fp)
    assert report["format"] == "int8x"
    assert report["quantization_config"] == spec.to_config()
    assert report["key_sources"]["block_size"] == "inferred"
    assert report["verification"]["passed"] and report["verification"]["checked"] == 7
    assert rc == 1 and [d["key"] for d in report["disagreements"]] == ["quant_method"]
    ck = Checkpoint(q)
    for m in report["matrices"]:
        t = {s: ck.tensor(k) for s, k in spec.tensor_names(m["module"]).items()}
        levels = int8x.levels(int8x.decode_int8(t, spec))
        assert m["levels"] == {"l1": levels["l1"], "l2": levels["l2"], "l3": levels["l3"]}
        assert m["bits_per_weight"] == int8x.bits_per_weight(t)["bits_per_weight"]
    _, text, _ = run_cli(q)
    assert "L1/L2/L3" in text and "bits/weight" in text


def test_ignored_modules_against_the_declared_ignore(tmp_path):
    spec = replace(PRESETS["seed-article"], ignore=("lm_head", "down_proj"))
    q, fp = make_pair(tmp_path, "ternary", spec)
    rc, report, _ = inspect_json(q, "--against", fp)
    assert rc == 0 and report["quantization_config"] == spec.to_config()
    down = next(m for m in report["matrices"] if m["module"].endswith("down_proj"))
    assert down["kind"] == "float"
    set_declared(q, PRESETS["seed-article"].to_config())
    rc, report, _ = inspect_json(q, "--against", fp)
    assert rc == 1
    assert any(w.startswith("ignore: model.layers.0.mlp.down_proj is stored as float but not listed") for w in
               report["warnings"])


def test_tensor_stats_distinct_values_beyond_the_first_elements():
    few = torch.zeros(10_000)
    few[9_000:] = torch.arange(1000) % 16  # 16 distinct values, all after the first 4096 elements
    assert inference.tensor_stats(few)["distinct"] == [float(v) for v in range(16)]
    many = few.clone()
    many[-1] = 99.0
    assert inference.tensor_stats(many)["distinct"] is None
    stats = inference.tensor_stats(torch.tensor([1.0, float("nan"), -2.0]))
    assert (stats["min"], stats["max"], stats["nonfinite"]) == (-2.0, 1.0, 1)


# -- bad input ----------------------------------------------------------------------------------


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    rc, out, err = run_cli(tmp_path / "nope")
    assert rc == 2 and out == ""
    assert err.startswith("parity inspect: error: ") and "not a checkpoint directory" in err


def test_invalid_declared_config_is_a_clear_error(tmp_path):
    q = make_fixture("seed-article", tmp_path / "q", dims=DIMS)
    set_declared(q, {"quant_method": "ternary", "bit_order": "middle"})
    rc, _, err = run_cli(q)
    assert rc == 2 and "config.json: quantization_config: bit_order = 'middle' is not one of" in err


def test_truncated_safetensors_is_a_clear_error(tmp_path, pairs):
    q, _ = pairs["seed-article"]
    bad = tmp_path / "bad"
    make_fixture("seed-article", bad, dims=DIMS)
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    rc, _, err = run_cli(bad)
    assert rc == 2 and "parity inspect: error:" in err and "truncated" in err


def test_against_with_other_architecture_is_a_specific_error(tmp_path, pairs):
    q, _ = pairs["seed-article"]
    other = make_fixture("fp", tmp_path / "other", dims=replace(DIMS, intermediate=256))
    rc, _, err = run_cli(q, "--against", other)
    assert rc == 2
    assert "architecture does not match" in err and "model.layers.0.mlp.gate_proj is (256, 64) there but (128, 64)" in err


def test_against_missing_or_quantized_float_checkpoint(tmp_path, pairs):
    q, fp = pairs["seed-article"]
    ck = Checkpoint(fp)
    tensors = {k: ck.tensor(k) for k in ck.keys() if k != "model.layers.0.mlp.up_proj.weight"}
    partial = write_checkpoint(tmp_path / "partial", ck.config, tensors)
    rc, _, err = run_cli(q, "--against", partial)
    assert rc == 2 and "float weight 'model.layers.0.mlp.up_proj.weight' is missing" in err
    rc, _, err = run_cli(q, "--against", q)
    assert rc == 2 and "declares a quantization_config" in err


def test_console_script(pairs):
    q, _ = pairs["seed-article"]
    exe = Path(sys.executable).parent / "parity"
    proc = subprocess.run([str(exe), "inspect", str(q), "--json"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["quantization_config"] == PRESETS["seed-article"].to_config()


# -- formats: each one a file, registered ---------------------------------------------------------


def _projection(ck: Checkpoint, module: str) -> tuple[dict, dict]:
    """suffix -> key and suffix -> header of one projection's tensors, as the scan hands them to a format."""
    entries = {key.rpartition(".")[2]: key for key in ck.keys() if key.rpartition(".")[0] == module}
    return entries, {s: ck.tensors[key] for s, key in entries.items()}


def test_ternary_fit_on_its_own(pairs):
    """The ternary file alone: its scan reads the layout from the shapes, its search finds the format."""
    q, fp = pairs["hf-bitnet"]
    spec = PRESETS["hf-bitnet"]
    ck, fck = Checkpoint(q), Checkpoint(fp)
    for module, (n, k) in ck.linear_shapes().items():
        entries, info = _projection(ck, module)
        roles: dict[str, str] = {}
        assert int8x_inference.Int8xFormat().scan(module, n, k, entries, info, None, roles) is None
        m = ternary_inference.TernaryFormat().scan(module, n, k, entries, info, None, roles)
        assert (m.kind, m.problems, m.pack_axis, m.scale_granularity) == ("ternary", [], "output", "tensor")
        assert roles == {f"{module}.weight": "packed weight", f"{module}.weight_scale": "scale"}
        packed = ck.tensor(m.keys["weight"])
        fits = ternary_inference.fit_ternary(m, packed, ck.tensor(m.keys["scale"]), fck.tensor(f"{module}.weight"))
        survivors, rejected = ternary_inference.combine_fits({module: fits})
        occurs = torch.bincount(ternary.unpack_codes(packed, spec).flatten().long(), minlength=4) > 0
        assert survivors == [{"pack_layout": "blocked", "bit_order": "lsb",
                              "code_map": [v if occurs[c] else None for c, v in enumerate(spec.code_map)],
                              "scale_modes": ["divide"]}]
        assert len(rejected) == 3 and all(r["fits"] == 0 for r in rejected)


def test_int8x_fit_on_its_own(tmp_path):
    """The int8x file alone: its scan claims the streams, the block tables give the block size."""
    spec = Int8xSpec(block_size=256)
    ck = Checkpoint(make_fixture("int8x", tmp_path / "q", dims=DIMS, spec=spec))
    fmt = int8x_inference.Int8xFormat()
    assert fmt.specificity > ternary_inference.TernaryFormat.specificity  # its uint8 streams look packed, too
    for module, (n, k) in ck.linear_shapes().items():
        entries, info = _projection(ck, module)
        roles: dict[str, str] = {}
        m = fmt.scan(module, n, k, entries, info, None, roles)
        assert (m.kind, m.problems, m.keys) == ("int8x", [], spec.tensor_names(module))
        assert roles[f"{module}.weight_b1_blk"] == "int8x b1_blk" and len(roles) == len(Int8xSpec.suffixes)
        t = {s: ck.tensor(m.keys[s]) for s in ("weight_b1", "weight_b1_blk")}
        assert int8x_inference.int8x_block_sizes(t, n * k) == ({256}, 0)


@dataclass(frozen=True)
class _DummySpec:
    """A format no floor knows: int8 codes ``weight_q`` times one float scale ``weight_s`` per matrix."""

    ignore: tuple[str, ...] = ("lm_head",)
    quant_method: ClassVar[str] = "dummy"

    def to_config(self) -> dict:
        return {"quant_method": self.quant_method, "ignore": list(self.ignore)}

    def is_ignored(self, module: str) -> bool:
        return any(module == p or module.endswith("." + p) for p in self.ignore)


class _DummyFormat(inference.Format):
    quant_method = "dummy"
    looks_like = "int8 dummy codes"
    key_order = ("quant_method", "ignore")

    def scan(self, module, n, k, entries, info, declared, roles):
        if "weight_q" not in entries:
            return None
        m = inference.Matrix(module, n, k, "dummy", stored_shape=tuple(info["weight_q"].shape))
        for suffix, role in (("weight_q", "dummy codes"), ("weight_s", "dummy scale")):
            m.keys[suffix] = entries[suffix]
            roles[entries[suffix]] = role
        return m

    def fit(self, insp):
        keys = insp.keys = Keys(insp.declared_raw, insp.declared, _DummySpec())
        keys.set("quant_method", "dummy", "inferred")
        keys.take_fallback("ignore")
        insp.build_spec()

    def build_spec(self, values):
        return _DummySpec(ignore=tuple(values["ignore"]))

    def describe(self, insp, m, entry, tensor_pass):
        q = tensor_pass.read(m.keys["weight_q"]).to(torch.float64)
        s = tensor_pass.read(m.keys["weight_s"]).to(torch.float64)
        entry["zero_fraction"] = float((q == 0).double().mean())
        if insp.fck is not None:
            w = insp.fck.tensor(f"{m.module}.weight")
            tensor_pass.checks.append({"module": m.module, **inference.compare(q * s, w)})


def _dummy_pair(tmp: Path) -> tuple[Path, Path]:
    fck = Checkpoint(make_fixture("fp", tmp / "src", dims=DIMS))
    quant, floats = {k: fck.tensor(k) for k in fck.keys()}, {k: fck.tensor(k) for k in fck.keys()}
    for module in fck.linear_shapes():
        w = quant.pop(f"{module}.weight")
        s = (w.abs().max() / 127).reshape(1)
        quant[f"{module}.weight_q"] = torch.round(w / s).to(torch.int8)
        quant[f"{module}.weight_s"] = s
        floats[f"{module}.weight"] = (quant[f"{module}.weight_q"].double() * s.double()).float()
    return write_checkpoint(tmp / "q", fck.config, quant), write_checkpoint(tmp / "fp", fck.config, floats)


def test_a_registered_format_is_offered_without_editing_the_generic_code(tmp_path, monkeypatch):
    q, fp = _dummy_pair(tmp_path)
    _, report, _ = inspect_json(q)
    assert report["format"] == "unknown"  # not registered: no format claims the tensors
    assert any("neither a packed uint8 weight, int8x streams, compressed-tensors weights (weight_packed, or int8/fp8 weight + weight_scale), AWQ words (qweight (K, N/8), qzeros, scales), GPTQ words (qweight (K/8, N), qzeros, scales, g_idx), nor a float weight" in w
               for w in report["warnings"])

    monkeypatch.setattr(registry, "FORMATS", dict(registry.FORMATS))  # undone after the test
    inference.register(_DummyFormat)
    assert [f.quant_method for f in inference.registered()] == ["ternary", "int8x", "compressed-tensors", "awq", "gptq",
                                                                "dummy"]
    rc, report, err = inspect_json(q, "--against", fp)
    assert report["format"] == "dummy" and report["quantization_config"] == _DummySpec().to_config()
    assert report["key_sources"] == {"quant_method": "inferred", "ignore": "default"}
    assert {m["kind"] for m in report["matrices"]} == {"dummy"} and report["summary"]["quantized_matrices"] == 7
    v = report["verification"]
    assert v["performed"] and v["passed"] and v["checked"] == 7 and v["max_abs_error"] == 0.0
    roles = {t["name"]: t["role"] for t in report["tensors"]}
    assert roles["model.layers.0.mlp.up_proj.weight_q"] == "dummy codes"
    assert roles["model.layers.0.mlp.up_proj.weight_s"] == "dummy scale"
    # config.json declares nothing: the generic check names the format it found
    assert rc == 1 and report["disagreements"] == [{"key": "quant_method", "declared": None, "data": "dummy",
                                                    "explicit": False}]
    assert "stored as dummy" in err
    rc, text, _ = run_cli(q, "--against", fp)
    rows = [line.split() for line in text.split("QUANTIZED MATRICES")[1].split("\n\n")[0].splitlines()[3:]]
    assert [r[0] for r in rows] == list(Checkpoint(q).linear_shapes())

    ck = Checkpoint(q)  # a projection no format claims: the message lists every registered one
    tensors = {k: ck.tensor(k) for k in ck.keys() if not k.startswith("model.layers.0.mlp.down_proj.")}
    tensors["model.layers.0.mlp.down_proj.weight"] = torch.zeros(3, 5)
    _, report, _ = inspect_json(write_checkpoint(tmp_path / "odd", ck.config, tensors))
    assert report["format"] == "dummy"
    assert any("neither a packed uint8 weight, int8x streams, compressed-tensors weights (weight_packed, or int8/fp8 weight + weight_scale), AWQ words (qweight (K, N/8), qzeros, scales), GPTQ words (qweight (K/8, N), qzeros, scales, g_idx), int8 dummy codes, nor a "
               "float weight of shape (64, 128)" in w for w in report["warnings"])



@pytest.mark.parametrize("arch, own", [
    ("qwen3", {"model.layers.0.self_attn.q_norm.weight": "replicated"}),
    ("phi3", {"model.layers.0.self_attn.qkv_proj.weight_ternary": "dim 0",
              "model.layers.0.mlp.gate_up_proj.weight_scale": "dim 0"}),  # fused on disk too
])
def test_the_report_names_the_family_and_maps_its_own_keys(tmp_path, arch, own):
    path = make_fixture("seed-article", tmp_path / arch, dims=DIMS, arch=arch)
    _, report, _ = inspect_json(path)
    from vllm_parity.architectures import lookup

    assert report["architecture"] == {"model_type": arch, "known": True, "taps": [p.tap for p in lookup(arch).taps]}
    rows = {r["checkpoint_key"]: r for r in report["mapping"]}
    for key, split in own.items():
        assert rows[key]["note"] is None and rows[key]["vllm_param"] == key, rows[key]
        assert rows[key]["tp_split"] == split, rows[key]
    assert all(r["note"] is None for r in report["mapping"]), [r for r in report["mapping"] if r["note"]]
    rc, text, _ = run_cli(path)
    assert f"architecture: {arch} ({len(lookup(arch).taps)} tap rows)" in text


def test_an_unknown_family_is_named_with_the_known_ones(tmp_path):
    path = make_fixture("fp", tmp_path / "m", dims=DIMS)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "model_type": "gpt_neox"}))
    _, report, _ = inspect_json(path)
    assert report["architecture"]["model_type"] == "gpt_neox" and not report["architecture"]["known"]
    assert any("model_type 'gpt_neox' is not an architecture the harness knows" in w for w in report["warnings"])


@pytest.mark.parametrize("fmt", ["seed-article", "fp"])
def test_expert_keys_map_to_vllms_fused_expert_parameters(tmp_path, fmt):
    """One tensor per expert on disk; vLLM's FusedMoE holds w1 and w3 in ``w13_<suffix>`` and w2 in
    ``w2_<suffix>``, one slice per expert (vLLM's own expert mapping)."""
    path = make_fixture(fmt, tmp_path / fmt, dims=DIMS, arch="mixtral")
    _, report, _ = inspect_json(path)
    rows = {r["checkpoint_key"]: r for r in report["mapping"]}
    suffix = "weight_ternary" if fmt == "seed-article" else "weight"
    experts = "model.layers.0.block_sparse_moe.experts"
    for proj, param, shard in (("w1", "w13", "w1"), ("w3", "w13", "w3"), ("w2", "w2", "w2")):
        row = rows[f"{experts}.3.{proj}.{suffix}"]
        assert (row["vllm_param"], row["op"], row["shard"], row["note"]) == (f"{experts}.{param}_{suffix}", "merge",
                                                                             shard, "expert 3"), row
    assert rows[f"{experts}.0.w2.{suffix}"]["tp_split"] == ("dim 1" if fmt == "fp" else "dim 1 after decoding")
    assert rows[f"{experts}.0.w3.{suffix}"]["tp_split"] == ("dim 0" if fmt == "fp" else "dim 0 after decoding")
