"""What the 4-bit formats with a scale and zero point per group of inputs share (AutoAWQ, GPTQ): the weight
rebuilt from its codes less zero points under another scale, so that the generic group hypotheses (scale
missing, inverted, rounded; groups in another order) apply to them; and from its packed words read in another
field order, or with its group index ignored (:func:`packing_orders`, :func:`group_index_ignored`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_parity.harness.diagnosis import WeightProjection, _Hyp, _pct


class GroupedProjection(WeightProjection):
    """Set by a subclass through :meth:`_set_weight`: ``packed`` (codes, zero points, group of each input, how the
    words were packed) and ``scale_stored`` (N, G) as stored."""

    packed: PackedWeight
    unscaled_rows: torch.Tensor
    group_index: torch.Tensor

    def __init__(self, tap, ref, cand, ctx, noise):
        super().__init__(tap, ref, cand, ctx, noise)
        self.scale_mode, self.granularity = "multiply", "group"

    def _set_weight(self, packed: PackedWeight) -> None:
        self.packed, self.group_index = packed, packed.group_index
        v = packed.codes.to(torch.float32)
        self.unscaled_rows = (v - packed.zeros[:, packed.group_index].to(torch.float32)).contiguous()

    @property
    def contiguous_groups(self) -> bool:
        """Input k in group k // size (no activation order): the fitted group order reads groups as blocks."""
        size = self.k // self.scale_stored.shape[1]
        return torch.equal(self.group_index, torch.arange(self.k) // size)

    def _unscaled(self, idx: torch.Tensor) -> torch.Tensor | None:
        return self.unscaled_rows[idx] if self.contiguous_groups else None

    def _rows_fn(self, mode="same", scale=None):
        s = (self.scale if scale is None else scale).to(torch.float32)
        mode = self.scale_mode if mode == "same" else mode

        def rows(idx: torch.Tensor) -> torch.Tensor:
            v = self.unscaled_rows[idx]
            if mode is None:
                return v
            full = s[idx][:, self.group_index]
            return v * full if mode == "multiply" else v / full
        return rows

    def format_hypotheses(self, generic, idx, rsel):
        return generic + packing_orders(self) + group_index_ignored(self)

    def decodes_alike(self, idx, w):
        return torch.allclose(self._rows_fn()(idx), w, rtol=1e-5, atol=1e-7)


# -- packed words read in another field order; group indices ignored ---------------------------------


@dataclass(frozen=True)
class Packed:
    """One tensor of packed words: field ``i`` of word ``j`` holds element ``f·j + order[i]`` of ``axis``
    (f = fields per word)."""

    tensor: str  # its name within the module, e.g. "qweight"
    role: str  # "codes" (N, K) or "zeros" (N, G)
    axis: str  # "input" or "output": the axis a word's fields run along
    order: tuple[int, ...]
    said: str  # the order as the format's documentation names it, e.g. "AutoAWQ's interleave"


@dataclass
class PackedWeight:
    """A projection's weight as ``(codes[n, k] − zeros[n, group[k]]) · scale[n, group[k]]``, unpacked as the
    reference reads it, with how its words were packed; set by a format's projection as ``p.packed``."""

    codes: torch.Tensor  # (N, K) integers
    zeros: torch.Tensor | None  # (N, G) the zero points subtracted (None: no zero points)
    group_index: torch.Tensor  # (K,) int64: the group of each input
    packing: tuple[Packed, ...]
    group_size: int | None = None  # the inputs per group a kernel reading groups by position assumes

    def rows(self, p, codes_perm=None, zeros_perm=None, group_index=None):
        """Rows of the weight with the codes taken along ``codes_perm`` of their packed axis (``(axis, perm)``:
        element e reads true element perm[e]), the zero points along ``zeros_perm`` of the outputs, and another
        group index."""
        gi = self.group_index if group_index is None else group_index
        code_axis, cperm = codes_perm if codes_perm is not None else ("input", None)

        def rows(idx: torch.Tensor) -> torch.Tensor:
            q = self.codes[cperm[idx] if cperm is not None and code_axis == "output" else idx]
            if cperm is not None and code_axis == "input":
                q = q[:, cperm]
            v = q.to(torch.float32)
            if self.zeros is not None:
                v = v - self.zeros[idx if zeros_perm is None else zeros_perm[idx]][:, gi].to(torch.float32)
            s = p.scale.reshape(p.n, -1)[idx].to(torch.float32)
            return v * s[:, gi] if p.scale_mode == "multiply" else v / s[:, gi]
        return rows


def field_orders(fields: int) -> dict[str, tuple[int, ...]]:
    """The field orders a reader of a word plausibly assumes: in order, reversed, even fields first (AutoAWQ's
    interleave for 8 fields) and that interleave inverted."""
    plain = tuple(range(fields))
    inter = plain[0::2] + plain[1::2]
    return {"plain order": plain, "reversed order": plain[::-1], "the interleave (even fields first)": inter,
            "the interleave inverted": tuple(inter.index(e) for e in plain)}


def _read_perm(length: int, true: tuple[int, ...], read: tuple[int, ...]) -> torch.Tensor:
    """perm[e] = the true element a reader with field order ``read`` takes as element e."""
    f = len(true)
    perm = torch.empty(length, dtype=torch.int64)
    base = torch.arange(0, length, f)
    for i in range(f):
        perm[base + read[i]] = base + true[i]
    return perm


def packing_orders(p) -> list[_Hyp]:
    """The packed words read with another field order: the codes and zero points alike (one unpacking routine),
    the codes alone, the zero points alone; each order a reader plausibly assumes, where it changes the weight."""
    w = getattr(p, "packed", None)
    if w is None:
        return []
    codes = next((t for t in w.packing if t.role == "codes"), None)
    zeros = next((t for t in w.packing if t.role == "zeros" and w.zeros is not None), None)
    if codes is None or (zeros is not None and zeros.axis != "output"):
        return []
    f = len(codes.order)
    field = "nibble" if f == 8 else "field"
    bits = 32 // f
    out = []
    for name, read in field_orders(f).items():
        if read == codes.order:
            continue
        cperm = (codes.axis, _read_perm(p.k if codes.axis == "input" else p.n, codes.order, read))
        zperm = None
        if zeros is not None and len(zeros.order) == f and read != zeros.order:
            zperm = _read_perm(p.n, zeros.order, read)
            if torch.equal(w.zeros[zperm], w.zeros):
                zperm = None  # equal zero points within each word: their order changes nothing
        variants = [((codes,), cperm, None)]
        if zperm is not None:
            variants = [((codes, zeros), cperm, zperm)] + variants + [((zeros,), None, zperm)]
        for tensors, cp, zp in variants:
            names = " and ".join(t.tensor for t in tensors)
            right = "" if len(tensors) == 2 or zeros is None else \
                f" ({(zeros if tensors[0] is codes else codes).tensor} read right)"
            said = " / ".join(dict.fromkeys(f"{t.said} {t.order}" for t in tensors))
            alike: dict[tuple, list[str]] = {}  # tensors read the same way, named together
            for t in tensors:
                alike.setdefault((t.axis, t.order, t.said), []).append(t.tensor)
            where = "; ".join(f"of {' and '.join(n)} as {_element(a)} {f}j + {o}[i] ({sd})"
                              for (a, o, sd), n in alike.items())
            out.append(_Hyp(
                "packing_order",
                f"{names} read in {name} {read}: {field} i of word j taken as {_element(tensors[0].axis)} "
                f"{f}j + {read}[i], instead of {said}{right}",
                f"take {field} i (bits {bits}i..{bits}i+{bits - 1}) of word j {where}, in the loader or repack of "
                f"{p.module}",
                rows=w.rows(p, codes_perm=cp, zeros_perm=zp)))
    return out


def _element(axis: str) -> str:
    return "output channel" if axis == "output" else "input"


def group_index_ignored(p) -> list[_Hyp]:
    """A group index that is not ``input // group_size`` (activation order, relabelled groups) read as if it
    were: input k scaled (and offset) by group k // group_size."""
    w = getattr(p, "packed", None)
    if w is None or not w.group_size or p.k % w.group_size:
        return []
    positional = torch.arange(p.k) // w.group_size
    moved = int((positional != w.group_index).sum())
    if not moved:
        return []
    return [_Hyp("g_idx_ignored",
                 f"g_idx ignored: input k scaled{' and offset' if w.zeros is not None else ''} by group "
                 f"k // {w.group_size} (by position) instead of g_idx[k] ({_pct(moved, p.k)} inputs in "
                 f"another group)",
                 f"read each input's group from {p.module}.g_idx (scales[g_idx[k]], zero points alike) in the "
                 f"loader and kernel; a kernel without a group index needs the inputs permuted to group order "
                 f"first (as vLLM's desc_act path does)",
                 rows=w.rows(p, group_index=positional))]
