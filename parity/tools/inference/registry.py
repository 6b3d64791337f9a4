"""The formats ``parity inspect`` can recognize, registered by ``quant_method``, and what it asks each.

A format is one module of this package holding a :class:`Format` subclass decorated with :func:`register`
(the built-in ones, ``ternary`` and ``int8x``, are imported by the package; another format, a test's
included, registers itself the same way). The generic code (the scan, the inspection, the vLLM mapping)
iterates :func:`registered` and never names a format. What it asks one, in the order it asks:

1. :meth:`Format.scan`: do these tensors of one projection (names and headers only) look like you? If so,
   the :class:`~vllm_parity.tools.inference.layout.Matrix` saying how they are stored, and each tensor's role.
2. :meth:`Format.fit`: the ``quantization_config`` keys the scanned matrices show (with ``--against``, the
   float weights too); it sets ``insp.keys`` and calls ``insp.build_spec()`` once the keys are complete.
3. :meth:`Format.describe`: one matrix's entry of the report, its tensors read once through the pass (their
   statistics recorded there), and its check against the float weights.

The other methods have defaults that do nothing a format does not need: keys known only after the whole
pass, a diagnosis of a matrix that fails verification, how a declared value disagrees, the vLLM mapping,
its matrices' rows in the text report.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

from vllm_parity.tools.inference.text import pct, shape

if TYPE_CHECKING:
    from vllm_parity.reference.formats import FormatSpec
    from vllm_parity.tools.inference.inspection import Inspection, TensorPass
    from vllm_parity.tools.inference.layout import Matrix


class Format(ABC):
    """What the generic inspection asks of one format (a subclass per format, registered once)."""

    quant_method: ClassVar[str]
    looks_like: ClassVar[str]  # the tensors, as said when no format claims a projection ("int8x streams")
    specificity: ClassVar[int] = 0  # several formats claim one projection: the most specific one is asked first
    key_order: ClassVar[tuple[str, ...]] = ()  # its keys in the report's order (the partial config)
    weight_keys: ClassVar[tuple[str, ...]] = ()  # keys only the float weights show (the rest: shapes and names)
    consequences: ClassVar[dict[str, str]] = {}  # key -> what a loader following a wrong value gets wrong

    @abstractmethod
    def scan(self, module: str, n: int, k: int, entries: dict[str, str], info: dict[str, Any], declared: Any,
             roles: dict[str, str]) -> Matrix | None:
        """None when these tensors are not this format's; else how they are stored (``kind`` this
        ``quant_method``, or ``unknown`` with a problem) and, in ``roles``, each one's role.

        ``entries``: suffix -> checkpoint key; ``info``: suffix -> the tensor's header; ``declared``: the spec
        config.json declares (any format, or None).
        """

    @abstractmethod
    def fit(self, insp: Inspection) -> None:
        """Infer the keys before the tensor pass (``insp.keys``), then ``insp.build_spec()`` when complete."""

    @abstractmethod
    def build_spec(self, values: dict[str, Any]) -> FormatSpec:
        """The spec of the resolved keys; ParityInputError when they do not form a valid one."""

    def describe(self, insp: Inspection, m: Matrix, entry: dict[str, Any], tensor_pass: TensorPass) -> None:
        """Fill ``entry``, the matrix's row of the report, reading its tensors with ``tensor_pass.read``; with
        ``insp.fck`` and ``insp.spec``, append its verification to ``tensor_pass.checks``."""
        for key in m.keys.values():
            tensor_pass.read(key)

    def after_pass(self, insp: Inspection, entries: list[dict[str, Any]]) -> None:
        """Keys and report sections that need every matrix's statistics (the tensor pass is done)."""

    def diagnose(self, insp: Inspection, m: Matrix) -> dict[str, Any] | None:
        """Why a matrix fails verification (``module``, ``text``, ...), searched on its own; None: no diagnosis."""
        return None

    def disagrees(self, key: str, data: Any, said: Any, declared: Any) -> bool:
        """Whether config.json's value ``said`` of an inferred key contradicts the data's ``data``."""
        return data != said

    def stacked_row(self, row: dict[str, Any], m: Matrix, role: str, slot: int, values: dict[str, Any]) -> None:
        """Adjust the mapping row of a tensor merged into a fused vLLM layer (``slot``: its shard's index)."""

    def row_parallel_row(self, row: dict[str, Any], m: Matrix, role: str) -> None:
        """Adjust the mapping row of a tensor of a row-parallel layer (split along its input)."""

    def text_row(self, entry: dict[str, Any]) -> list[str]:
        """Its matrix's row of the text report's table: module, logical, stored, packed, scale, zero frac,
        codes | levels, bits/weight."""
        return [entry["module"], shape(entry["logical_shape"]), shape(entry["stored_shape"]), "-", "-",
                pct(entry.get("zero_fraction")), "-", "-"]


def decoded_entry(insp: Inspection, m: Matrix, entry: dict[str, Any], tensor_pass: TensorPass, spec_type: type) -> None:
    """Decode one matrix with the inspection's spec (when it is a ``spec_type``): its zero fraction in ``entry``,
    its check against the float weights; a matrix that does not decode is a warning and the entry's error."""
    from vllm_parity.errors import ParityInputError
    from vllm_parity.tools.inference.stats import compare

    spec = insp.spec if isinstance(insp.spec, spec_type) else None
    if spec is None or m.problems:
        return
    try:
        w = spec.decode(spec.read_stored(insp.ckpt, m.module, m.n, m.k), m.n, m.k, m.module)
    except ParityInputError as exc:
        insp.warnings.append(f"{m.module}: does not decode as {spec.quant_method}: {exc}")
        entry["error"] = str(exc)
        return
    entry["zero_fraction"] = float((w == 0).sum()) / w.numel()
    if insp.fck is not None:
        tensor_pass.checks.append({"module": m.module, **compare(w.double(), insp.fck.tensor(f"{m.module}.weight"))})


FORMATS: dict[str, Format] = {}  # registration order is the report's order (messages list formats in it)


def register(cls: type[Format]) -> type[Format]:
    """Make a format known under its ``quant_method`` (a class decorator)."""
    FORMATS[cls.quant_method] = cls()
    return cls


def registered() -> list[Format]:
    return list(FORMATS.values())


def get(kind: str | None) -> Format | None:
    """The format of a matrix's ``kind`` or a checkpoint's ``format``; None for float, mixed, unknown..."""
    return FORMATS.get(kind) if kind is not None else None


def by_specificity() -> list[Format]:
    """The order the scan asks formats in: the most specific claim first (ties: registration order)."""
    return sorted(registered(), key=lambda f: -f.specificity)
