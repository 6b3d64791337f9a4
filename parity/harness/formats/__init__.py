"""What the diagnosis knows of each format, by ``quant_method``: a ``Projection`` (a subclass of
:class:`vllm_parity.harness.diagnosis.WeightProjection`) with the format's stored scale and its own weight
hypotheses. A built-in format's is ``Projection`` of ``vllm_parity.harness.formats.<quant_method>``;
another is made known with :func:`register`; a format with none gets no weight hypotheses.
"""

from __future__ import annotations

import importlib

_PROJECTIONS: dict[str, type | None] = {}


def register(quant_method: str, projection: type) -> type:
    _PROJECTIONS[quant_method] = projection
    return projection


def projection_for(quant_method: str) -> type | None:
    if quant_method not in _PROJECTIONS:
        try:
            module = importlib.import_module(f"{__name__}.{quant_method.replace('-', '_')}")
        except ModuleNotFoundError:
            module = None
        _PROJECTIONS[quant_method] = getattr(module, "Projection", None)
    return _PROJECTIONS[quant_method]
