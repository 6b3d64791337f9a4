import dataclasses
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_parity.errors import FormatError
from vllm_parity.reference.formats.ternary import PRESETS, TernarySpec, preset
from vllm_parity.reference.formats.int8x import Int8xSpec
from vllm_parity.reference.formats import parse_quantization_config

from tests.strategies import ternary_specs


def test_every_key_defaults_to_the_seed_article_layout():
    spec = parse_quantization_config({"quant_method": "ternary"})
    assert spec == TernarySpec()
    assert spec.to_config() == {
        "quant_method": "ternary", "pack_axis": "input", "pack_layout": "interleaved", "bit_order": "lsb",
        "code_map": [0, 1, -1, None], "scale_granularity": "channel", "group_size": 128,
        "scale_mode": "multiply", "weight_name": "weight_ternary", "scale_name": "weight_scale",
        "activation_quant": None, "ignore": ["lm_head"],
    }
    assert PRESETS["seed-article"] == spec


def test_hf_bitnet_preset_matches_formats_md():
    cfg = preset("hf-bitnet").to_config()
    assert {k: cfg[k] for k in ("pack_axis", "pack_layout", "bit_order", "code_map", "scale_granularity",
                                "scale_mode", "weight_name", "scale_name", "activation_quant")} == {
        "pack_axis": "output", "pack_layout": "blocked", "bit_order": "lsb", "code_map": [-1, 0, 1, None],
        "scale_granularity": "tensor", "scale_mode": "divide", "weight_name": "weight",
        "scale_name": "weight_scale", "activation_quant": "per_token_absmax_int8",
    }


def test_quant_method_is_matched_case_insensitively_and_int8x_parses():
    assert parse_quantization_config({"quant_method": "TERNARY"}) == TernarySpec()
    spec = parse_quantization_config({"quant_method": "int8x", "levels": [3, 5, 8], "block_size": 64})
    assert spec == Int8xSpec(block_size=64)
    assert parse_quantization_config(None) is None


@given(ternary_specs())
def test_to_config_round_trips(spec):
    assert parse_quantization_config(spec.to_config()) == spec


@pytest.mark.parametrize("cfg, match", [
    ({"quant_method": "ternary", "pack_axis": "rows"}, "pack_axis = 'rows'"),
    ({"quant_method": "ternary", "pack_layout": "striped"}, "pack_layout"),
    ({"quant_method": "ternary", "bit_order": "big"}, "bit_order"),
    ({"quant_method": "ternary", "scale_granularity": "block"}, "scale_granularity"),
    ({"quant_method": "ternary", "scale_mode": "add"}, "scale_mode"),
    ({"quant_method": "ternary", "activation_quant": "fp8"}, "activation_quant"),
    ({"quant_method": "ternary", "code_map": [0, 1, -1]}, "4 entries"),
    ({"quant_method": "ternary", "code_map": [0, 1, 2, None]}, r"code_map\[2\] = 2"),
    ({"quant_method": "ternary", "code_map": [None] * 4}, "every code to null"),
    ({"quant_method": "ternary", "code_map": "0,1,-1"}, "must be a list"),
    ({"quant_method": "ternary", "group_size": 0}, "group_size"),
    ({"quant_method": "ternary", "weight_name": "a.b"}, "weight_name"),
    ({"quant_method": "ternary", "scale_name": "weight_ternary"}, "both"),
    ({"quant_method": "ternary", "packaxis": "input"}, r"unknown key\(s\) \['packaxis'\]"),
    ({"quant_method": "int8x", "levels": [2, 4, 8]}, r"\[3, 5, 8\]"),
    ({"quant_method": "int8x", "block_size": 100}, "multiple of 32"),
    ({"quant_method": "int8x", "bits": 3}, "unknown key"),
    ({"quant_method": "hqq"}, "unknown quant_method 'hqq': no reference decoder is installed for it"),
    ({"pack_axis": "input"}, "no quant_method"),
])
def test_invalid_configs_name_the_key(cfg, match):
    with pytest.raises(FormatError, match=match):
        parse_quantization_config(cfg)


def test_shape_checks():
    spec = TernarySpec()
    assert spec.packed_shape(8, 12) == (8, 3)
    assert TernarySpec(pack_axis="output").packed_shape(8, 12) == (2, 12)
    with pytest.raises(FormatError, match=r"q_proj: packed axis \(input, length 10\).*not divisible by 4"):
        spec.check_shape(8, 10, "q_proj")
    with pytest.raises(FormatError, match="length 6"):
        TernarySpec(pack_axis="output").packed_shape(6, 8)
    grouped = TernarySpec(scale_granularity="group", group_size=64)
    assert grouped.scale_shape(8, 128) == (8, 2)
    with pytest.raises(FormatError, match="K=96 is not divisible by group_size=64"):
        grouped.scale_shape(8, 96)
    assert TernarySpec(scale_granularity="tensor").scale_shape(8, 12) == (1,)


def test_ignore_matches_names_and_suffixes():
    spec = dataclasses.replace(TernarySpec(), ignore=("lm_head", "mlp.down_proj"))
    assert spec.is_ignored("lm_head")
    assert spec.is_ignored("model.layers.3.mlp.down_proj")
    assert not spec.is_ignored("model.layers.3.mlp.up_proj")
    assert not spec.is_ignored("model.my_lm_head")


@given(st.sampled_from(sorted(PRESETS)))
def test_presets_are_named_exactly(name):
    assert preset(name) is PRESETS[name]
    with pytest.raises(FormatError, match="unknown preset"):
        preset(name + "-x")


def _installed(tmp_path, monkeypatch, name: str, body: str, entry: str) -> None:
    """A package installed on sys.path (a module and its dist-info) declaring one vllm_parity.formats entry point."""
    (tmp_path / f"{name}.py").write_text(body)
    info = tmp_path / f"{name}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[vllm_parity.formats]\n{entry}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)


_USER_FORMAT = '''
from dataclasses import dataclass
import torch
from vllm_parity.reference.formats import FormatSpec


@dataclass(frozen=True)
class Spec(FormatSpec):
    ignore: tuple = ("lm_head",)
    quant_method = "{method}"

    @classmethod
    def from_config(cls, body):
        return cls(**body)

    def to_config(self):
        return {{"quant_method": self.quant_method, "ignore": list(self.ignore)}}

    def tensor_names(self, module):
        return {{"weight": module + ".qweight"}}

    def read_stored(self, ckpt, module, n, k):
        return {{"weight": ckpt.expect(module + ".qweight", (n, k), (torch.int8,))}}

    def decode(self, stored, n, k, name, dtype=torch.float32):
        return stored["weight"].to(dtype)

    def code_step(self, ckpt, module):
        return torch.ones(1, dtype=torch.float64)
'''


def test_a_format_from_another_package_is_found_through_its_entry_point(tmp_path, monkeypatch):
    _installed(tmp_path, monkeypatch, "user_fmt_a", _USER_FORMAT.format(method="user_fmt_a"),
               "user_fmt_a = user_fmt_a:Spec")
    spec = parse_quantization_config({"quant_method": "user_fmt_a", "ignore": ["lm_head", "gate"]})
    assert type(spec).__module__ == "user_fmt_a" and spec.ignore == ["lm_head", "gate"]
    from vllm_parity.reference.formats import known
    assert "user_fmt_a" in known()


@pytest.mark.parametrize("entry, match", [
    ("user_fmt_b = user_fmt_b:Missing", r"entry point 'user_fmt_b' \(user_fmt_b:Missing\) does not load: "
                                        r"AttributeError"),
    ("user_fmt_b = user_fmt_b:torch", r"entry point 'user_fmt_b' \(user_fmt_b:torch\) is not a FormatSpec subclass"),
    ("user_fmt_b = user_fmt_b:Spec", r"has quant_method 'other_name': name the entry point after it"),
])
def test_a_broken_entry_point_names_itself(tmp_path, monkeypatch, entry, match):
    _installed(tmp_path, monkeypatch, "user_fmt_b", _USER_FORMAT.format(method="other_name"), entry)
    with pytest.raises(FormatError, match=match):
        parse_quantization_config({"quant_method": "user_fmt_b"})
