"""A format's ``quantization_config`` keys as the inspection resolves them, each with where it came from."""

from __future__ import annotations

from typing import Any

from vllm_parity.reference.formats import FormatSpec


class Keys:
    """Resolved config values with where each came from: inferred / declared / default / guessed."""

    def __init__(self, declared_raw: Any, declared: Any, default: FormatSpec):
        same = declared is not None and type(declared) is type(default)
        self.raw = declared_raw if same and isinstance(declared_raw, dict) else {}
        self.declared = declared if same else None
        self.default = default
        self.values: dict[str, Any] = {}
        self.sources: dict[str, str] = {}

    def set(self, key: str, value: Any, source: str) -> None:
        self.values[key], self.sources[key] = value, source

    def fallback(self, key: str) -> tuple[Any, str]:
        if self.declared is not None and key in self.raw:
            return getattr(self.declared, key), "declared"
        return getattr(self.default, key), "default"

    def take_fallback(self, key: str) -> None:
        self.set(key, *self.fallback(key))

    def choose(self, key: str, candidates: list) -> Any:
        """One data-inferred candidate; among several the data cannot tell apart, the declared/default one."""
        if len(candidates) == 1:
            self.set(key, candidates[0], "inferred")
            return candidates[0]
        value, source = self.fallback(key)
        if value in candidates:
            self.set(key, value, source)
        else:
            value = candidates[0]
            self.set(key, value, "inferred")
        return value
