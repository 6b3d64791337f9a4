"""The house: every module imports only from its own floor or the floors below it, and the serving side
reads the checkpoint formats with its own decoders (from the reference it takes specs, never decoders)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest


# floor -> the floors it may import
FLOORS = {
    "vllm_parity.errors": set(),
    "vllm_parity.architectures": {"vllm_parity.errors"},
    "vllm_parity.reference": {"vllm_parity.errors", "vllm_parity.architectures"},
    "vllm_parity.serving": {"vllm_parity.errors", "vllm_parity.architectures", "vllm_parity.reference"},
    "vllm_parity.fixtures": {"vllm_parity.errors", "vllm_parity.architectures", "vllm_parity.reference"},
    "vllm_parity.harness": {"vllm_parity.errors", "vllm_parity.architectures", "vllm_parity.reference",
                            "vllm_parity.serving", "vllm_parity.fixtures"},
    "vllm_parity.tools": {"vllm_parity.errors", "vllm_parity.architectures", "vllm_parity.reference",
                          "vllm_parity.serving", "vllm_parity.fixtures", "vllm_parity.harness"},
}
# What the serving side may take from the reference: the format specs and the checkpoint's file index.
SERVING_MAY_TAKE = {"FormatSpec", "TernarySpec", "Int8xSpec", "PRESETS", "FLOAT_DTYPES", "parse_quantization_config",
                    "read_safetensors_header"}


def _modules():
    import importlib

    for floor in FLOORS:
        pkg = importlib.import_module(floor)
        files = [Path(pkg.__file__)] if not hasattr(pkg, "__path__") else \
            sorted(p for d in pkg.__path__ for p in Path(d).rglob("*.py"))
        for f in files:
            yield floor, f


def _floor_of(name: str) -> str | None:
    return next((f for f in sorted(FLOORS, key=len, reverse=True) if name == f or name.startswith(f + ".")), None)


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module, [a.name for a in node.names], node.lineno
        elif isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, [], node.lineno


MODULES = list(_modules())


def test_every_floor_is_found():
    assert {floor for floor, _ in MODULES} == set(FLOORS)
    assert len(MODULES) > 40


@pytest.mark.parametrize("floor, path", MODULES, ids=lambda v: str(v).split("vllm_parity/")[-1])
def test_imports_go_only_downward(floor, path):
    for module, names, line in _imports(path):
        if module == "vllm_parity":
            module = f"vllm_parity.{names[0]}" if names else module
        target = _floor_of(module)
        if target is None or target == floor:
            continue
        assert target in FLOORS[floor], f"{path.name}:{line}: {floor} imports {module}, a floor above it"
        if floor == "vllm_parity.serving" and target == "vllm_parity.reference":
            taken = set(names) - SERVING_MAY_TAKE
            assert names and not taken, (
                f"{path.name}:{line}: the serving side takes {sorted(taken) or module} from the reference; it "
                f"must decode with its own implementations (a bug shared by both is invisible to parity)")
