"""Per-tap tolerances: glob patterns over canonical tap names, the most specific pattern wins.

Read from ``[tool.parity.tolerances]`` of pyproject.toml or a TOML file (``--parity-tolerances``),
either at top level or under ``[tolerances]``::

    max_growth = 10.0
    [tolerances]
    "*" = { token_rtol = 1e-3, row_rtol = 1e-3, rtol = 1e-3 }
    "layers.*.mlp.down" = { row_rtol = 2e-3 }
    logits = { token_rtol = 2e-3, max_mismatch_frac = 0.001 }

Keys a pattern leaves out come from the next less specific matching pattern, then from the
dtype default. A tap whose matching rules set only ``atol`` / ``rtol`` (and ``max_mismatch_frac``,
``min_cosine``), as every table did before the per-token criteria, keeps that meaning: it is judged
elementwise, ``|c - r| <= atol + rtol |r|``, from the elementwise defaults of before.
"""

from __future__ import annotations

import fnmatch
import math
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import torch

from vllm_parity.harness.metrics import Tolerance

# Per-token and row-scaled criteria by the dtype of the compared tensors. fp32: measured on a real model
# (SmolLM2-135M, stock vLLM against stock transformers, 30 layers): the worst correct tap has a token
# relative error of 3e-5 and elements within 3.5e-5 (|r| + rms(row)); the defaults sit 28-33x above that,
# while one output channel off by 1 % exceeds them by 4x or more.
DTYPE_DEFAULTS = {
    torch.float64: Tolerance(rtol=1e-9, row_rtol=1e-9, token_rtol=1e-9),
    torch.float32: Tolerance(rtol=1e-3, row_rtol=1e-3, token_rtol=1e-3),
}
# fp16 / bf16, in units of the dtype's unit roundoff u (fp16 2^-11, bf16 2^-8), for a tap fed the reference's
# input (the isolated mode such a candidate is judged in): vLLM's CPU kernels on SmolLM2-135M and the default
# fixture, against the fp32 reference, reach 12u (fp16) and 11u (bf16) per token, 48u per element, and 74u
# (fp16) / 100u (bf16) per element where a tap multiplies two rounded values (the attention context, the
# gated activation). The defaults sit 2.7x above the token error and 2.6x above the element errors.
HALF_UNIT = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}
HALF_TOKEN_U, HALF_ELEMENT_U, HALF_PRODUCT_U = 32, 128, 256
PRODUCT_TAPS = ("*.attn.context", "*.mlp.act")  # taps formed as a product of two rounded tensors
# What the elementwise-only tables of before were resolved from.
ELEMENTWISE_DEFAULTS = {
    torch.float64: Tolerance(atol=1e-9, rtol=1e-9),
    torch.float32: Tolerance(atol=1e-4, rtol=1e-4),
    torch.float16: Tolerance(atol=1e-2, rtol=1e-2),
    torch.bfloat16: Tolerance(atol=5e-2, rtol=5e-2),
}
# Prompt log-probs (the model level's check against vLLM's own API) are compared absolutely, in nats:
# a log-prob's error is its logit's error less the log-sum-exp's, propagated through every layer. fp32: a
# correct int8x candidate of the real model differs by 6e-5 at most. fp16 / bf16: SmolLM2-135M served by
# vLLM differs from its fp32 reference by 0.046 / 0.35 at most (the default fixture 0.004 / 0.042).
LOGPROB_DEFAULTS = {
    torch.float64: Tolerance(atol=1e-9),
    torch.float32: Tolerance(atol=1e-3),
    torch.float16: Tolerance(atol=0.15),
    torch.bfloat16: Tolerance(atol=1.0),
}

# A format that quantizes activations flips a code wherever fp32 noise meets a rounding boundary, and the
# flips cascade: SmolLM2-135M in compressed-tensors FP8_DYNAMIC, served by vLLM in fp32, differs from its
# exact fp8 reference by 1.34 nats (the default fixture 0.013). Per-token int8 rounds as coarsely as bf16.
ACTIVATION_LOGPROB_DEFAULTS = {"per_token_absmax_fp8_e4m3": Tolerance(atol=2.0),
                               "per_token_absmax_int8": Tolerance(atol=1.0)}


def dtype_default(tap: str, dtype: torch.dtype) -> Tolerance:
    """The default tolerance of ``tap`` compared in ``dtype``: fp32 and fp64 as measured, half precision
    derived from its unit roundoff and the tap's kind."""
    if dtype in HALF_UNIT:
        u = HALF_UNIT[dtype]
        element = (HALF_PRODUCT_U if any(fnmatch.fnmatchcase(tap, p) for p in PRODUCT_TAPS) else HALF_ELEMENT_U) * u
        return Tolerance(rtol=element, row_rtol=element, token_rtol=HALF_TOKEN_U * u)
    return DTYPE_DEFAULTS.get(dtype, DTYPE_DEFAULTS[torch.float32])


ROW_KEYS = {"row_rtol", "token_rtol"}
KEYS = {f.name for f in fields(Tolerance)}


def specificity(pattern: str) -> tuple[int, int]:
    """More literal characters is more specific; then fewer wildcards."""
    wild = sum(pattern.count(c) for c in "*?[")
    return len(pattern) - wild, -wild


@dataclass
class ToleranceTable:
    rules: list[tuple[str, dict]] = field(default_factory=list)
    max_growth: float = 10.0
    source: str = "defaults"

    def resolve(self, tap: str, dtype: torch.dtype = torch.float32, activations: tuple[str, ...] = ()) -> Tolerance:
        """``activations``: the activation quantizers of the model's format (they loosen the log-probs default)."""
        matching = sorted((r for r in self.rules if fnmatch.fnmatchcase(tap, r[0])), key=lambda r: specificity(r[0]))
        keys = {k for _, values in matching for k in values}
        legacy = bool(keys & {"atol", "rtol"}) and not keys & ROW_KEYS
        if legacy or tap == "logprobs":
            defaults = ELEMENTWISE_DEFAULTS if legacy else LOGPROB_DEFAULTS
            tol = defaults.get(dtype, defaults[torch.float32])
            if not legacy:
                tol = max((tol, *(ACTIVATION_LOGPROB_DEFAULTS[q] for q in activations
                                  if q in ACTIVATION_LOGPROB_DEFAULTS)), key=lambda t: t.atol)
        else:
            tol = dtype_default(tap, dtype)
        for _, values in matching:  # least specific first, so the most specific is applied last
            tol = replace(tol, **values)
        return tol

    def pattern_for(self, tap: str) -> str | None:
        matching = [r[0] for r in self.rules if fnmatch.fnmatchcase(tap, r[0])]
        return max(matching, key=specificity) if matching else None

    def to_toml(self) -> str:
        lines = [f"max_growth = {self.max_growth!r}", "", "[tolerances]"]
        for pattern, values in self.rules:
            body = ", ".join(f"{k} = {_toml_float(v)}" for k, v in values.items())
            lines.append(f'"{pattern}" = {{ {body} }}')
        return "\n".join(lines) + "\n"


def _toml_float(v: float) -> str:
    return "inf" if math.isinf(v) else repr(float(v))


def parse(data: dict, source: str) -> ToleranceTable:
    section = data.get("tolerances", data)
    growth = data.get("max_growth", section.get("max_growth", 10.0))
    rules = []
    for pattern, values in section.items():
        if pattern == "max_growth":
            continue
        if not isinstance(values, dict):
            raise ValueError(f"{source}: tolerance for {pattern!r} must be a table like {{ atol = 1e-4 }}, got {values!r}")
        unknown = sorted(set(values) - KEYS)
        if unknown:
            raise ValueError(f"{source}: tolerance for {pattern!r} has unknown key(s) {unknown}; known: {sorted(KEYS)}")
        for k, v in values.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)) or (k != "min_cosine" and v < 0):
                raise ValueError(f"{source}: {pattern!r}.{k} must be a non-negative number, got {v!r}")
        rules.append((pattern, {k: float(v) for k, v in values.items()}))
    if isinstance(growth, bool) or not isinstance(growth, (int, float)) or growth <= 1:
        raise ValueError(f"{source}: max_growth must be a number above 1, got {growth!r}")
    return ToleranceTable(rules=rules, max_growth=float(growth), source=source)


def load(path: str | Path | None = None, pyproject: str | Path | None = None) -> ToleranceTable:
    """The table from ``path`` if given, else from pyproject's ``[tool.parity]``, else the defaults."""
    if path is not None:
        path = Path(path)
        try:
            return parse(tomllib.loads(path.read_text()), str(path))
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ValueError(f"{path}: cannot read tolerances: {exc}") from None
    if pyproject is not None and Path(pyproject).is_file():
        tool = tomllib.loads(Path(pyproject).read_text()).get("tool", {}).get("parity", {})
        if "tolerances" in tool:
            return parse(tool, f"{pyproject} [tool.parity]")
    return ToleranceTable()
