"""Weight hypotheses of the ``ternary`` format: the packed weight read with another bit order or layout,
another code table, scales indexed with another group size."""

from __future__ import annotations

import itertools
import math

import torch

from vllm_parity.harness.diagnosis import SCREEN, WeightProjection, _Hyp, _signed
from vllm_parity.reference.formats import ternary


class Projection(WeightProjection):
    def __init__(self, tap, ref, cand, ctx, noise):
        super().__init__(tap, ref, cand, ctx, noise)
        stored = ctx.linear.stored
        self.packed, self.scale_stored = stored["packed"], stored["scale"]
        self.scale_mode, self.granularity = self.spec.scale_mode, self.spec.scale_granularity
        self.lut = ternary.code_values(self.spec).to(torch.float32)

    def format_hypotheses(self, generic, idx, rsel):
        return self._layout_hyps() + generic + self._group_hyps() + self._code_table_hyps(idx, rsel)

    def decodes_alike(self, idx, w):
        return torch.allclose(self._rows_fn()(idx), w, rtol=1e-6, atol=0.0)

    def _unscaled(self, idx: torch.Tensor) -> torch.Tensor:
        """The weight rows before their scale: what a group's scale multiplies (or divides)."""
        return self._values(idx, None, self.lut)

    # -- decoding under a hypothesis --

    def _codes(self, idx: torch.Tensor, perm: torch.Tensor | None = None) -> torch.Tensor:
        """Codes (len(idx), K) of the given output channels, read along ``perm`` of the packed axis."""
        spec = self.spec
        if spec.pack_axis == "input":
            codes = ternary.unpack_codes(self.packed[idx], spec)
            return codes if perm is None else codes[:, perm]
        src = idx if perm is None else perm[idx]
        p = self.n // 4
        byte, field = (src // 4, src % 4) if spec.pack_layout == "interleaved" else (src % p, src // p)
        shift = (2 * field if spec.bit_order == "lsb" else 6 - 2 * field).to(torch.uint8)
        return (self.packed[byte] >> shift[:, None]) & 3

    def _values(self, idx: torch.Tensor, perm: torch.Tensor | None, table: torch.Tensor) -> torch.Tensor:
        """Decoded values of some channels; the screening sample's are kept, every hypothesis reads them."""
        key = (id(perm), id(table))
        if idx is self._sample_idx and key in self._sample_values:
            return self._sample_values[key]
        if perm is not None and self.spec.pack_axis == "input":
            v = self._values(idx, None, table)[:, perm]
        else:
            v = table[self._codes(idx, perm).long()]
        if idx is self._sample_idx:
            self._sample_values[key] = v
        return v

    def _scale_rows(self, idx: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        g = self.spec.scale_granularity
        if g == "tensor":
            return scale.reshape(1, 1).expand(len(idx), 1)
        if g == "channel":
            return scale[idx].unsqueeze(1)
        return scale[idx].repeat_interleave(self.spec.group_size, dim=1)

    def _rows_fn(self, perm=None, lut=None, scale=None, scale_fn=None, mode="same"):
        mode = self.spec.scale_mode if mode == "same" else mode
        table = self.lut if lut is None else lut
        scale = self.scale if scale is None else scale

        def rows(idx: torch.Tensor) -> torch.Tensor:
            v = self._values(idx, perm, table)
            if mode is None:
                return v
            s = scale_fn(idx) if scale_fn is not None else self._scale_rows(idx, scale)
            return v * s if mode == "multiply" else v / s
        return rows

    def _read_perm(self, layout: str, bit_order: str) -> torch.Tensor:
        """perm[e'] = the true element a reader with (layout, bit_order) takes as element e'."""
        spec = self.spec
        length = self.k if spec.pack_axis == "input" else self.n
        p = length // 4
        e = torch.arange(length)
        byte, field = (e // 4, e % 4) if layout == "interleaved" else (e % p, e // p)
        if bit_order != spec.bit_order:
            field = 3 - field
        return 4 * byte + field if spec.pack_layout == "interleaved" else field * p + byte

    # -- the hypotheses --

    def _layout_hyps(self) -> list[_Hyp]:
        spec = self.spec
        lay, bit = spec.pack_layout, spec.bit_order
        other_lay = "blocked" if lay == "interleaved" else "interleaved"
        other_bit = "msb" if bit == "lsb" else "lsb"
        axis = f"{spec.pack_axis} axis"
        field = "(byte >> 2f) & 3" if bit == "lsb" else "(byte >> (6 - 2f)) & 3"
        where = ("byte e // 4, field e % 4" if lay == "interleaved"
                 else "byte e % P, field e // P (P = packed length / 4)")
        options = [
            ("bit_order", lay, other_bit,
             f"the packed weight read with bit_order '{other_bit}' instead of '{bit}' (the 4 weights of "
             f"each byte reversed along the {axis})",
             f"read field f of a byte as {field} (bit_order '{bit}') in the unpacking of {self.module}"),
            ("pack_layout", other_lay, bit,
             f"the packed weight unpacked as '{other_lay}' instead of '{lay}' along the {axis}",
             f"unpack element e of the {axis} from {where} (pack_layout '{lay}') in {self.module}"),
            ("pack_layout", other_lay, other_bit,
             f"the packed weight unpacked as '{other_lay}' instead of '{lay}' and with bit_order "
             f"'{other_bit}' instead of '{bit}' along the {axis}",
             f"unpack element e from {where} (pack_layout '{lay}') and read field f as {field} "
             f"(bit_order '{bit}') in {self.module}"),
        ]
        out, seen = [], []
        ident = torch.arange(self.k if spec.pack_axis == "input" else self.n)
        for kind, layout, bit_order, what, fix in options:
            perm = self._read_perm(layout, bit_order)
            if torch.equal(perm, ident) or any(torch.equal(perm, q) for q in seen):
                continue  # a no-op (or the same reading as another) for this shape
            seen.append(perm)
            out.append(_Hyp(kind, what, fix, rows=self._rows_fn(perm=perm)))
        return out

    def _group_hyps(self) -> list[_Hyp]:
        spec = self.spec
        if spec.scale_granularity != "group":
            return []
        g, k = spec.group_size, self.k
        stride = k // g
        flat = self.scale.reshape(-1)
        total = flat.numel()
        sizes = sorted({2 ** i for i in range(2, k.bit_length()) if k % 2 ** i == 0} | {k})
        out = []
        for g2 in sizes:
            if g2 == g:
                continue
            for row_stride in dict.fromkeys((stride, k // g2)):
                def scale_fn(idx, g2=g2, row_stride=row_stride):
                    at = idx[:, None] * row_stride + (torch.arange(k) // g2)[None, :]
                    return torch.where(at < total, flat[at.clamp(max=total - 1)], torch.tensor(math.nan))
                how = (f"scale[n, k // {g2}]" if row_stride == stride
                       else f"the scale read as if shaped (N, {k // g2}) (flat index n·{k // g2} + k // {g2})")
                out.append(_Hyp(
                    "group_size",
                    f"the scale of input k taken as {how}, i.e. group size {g2} instead of {g} "
                    f"(scale shape {tuple(self.scale.shape)})",
                    f"index the scales with group_size {g} (scale[n, k // {g}], {stride} groups per row) "
                    f"in {self.module}",
                    rows=self._rows_fn(scale_fn=scale_fn)))
        return out

    def _code_table_hyps(self, idx: torch.Tensor, rsel: torch.Tensor) -> list[_Hyp]:
        """Every other value table for the codes in use, screened through one product per code."""
        spec = self.spec
        counts = torch.bincount(self.packed.reshape(-1).long(), minlength=256) > 0
        used = sorted(set(ternary.byte_fields(spec)[counts].reshape(-1).tolist()))
        if not used:
            return []
        true = [spec.code_map[c] for c in used]
        # an all-zero table is no decoding (an output never written would match it)
        maps = [m for m in itertools.product((-1, 0, 1), repeat=len(used)) if list(m) != true and any(m)]
        codes = self._codes(idx)
        s = self._scale_rows(idx, self.scale)
        parts = []
        for c in used:
            ind = (codes == c).to(torch.float32)
            ind = ind * s if spec.scale_mode == "multiply" else ind / s
            parts.append(self._product(rsel, ind))
        parts = torch.stack(parts)  # (codes, rows, channels)
        mats = torch.tensor(maps, dtype=torch.float64)
        preds = self._biased(torch.einsum("mu,urc->mrc", mats, parts), idx)
        c, r = self._sample_c, self._sample_r
        dev = (c - r).norm()
        if not float(dev) > 0:
            return []
        shares = (c.unsqueeze(0) - preds).flatten(1).norm(dim=1) / dev
        self.checked.append(("code_table", float(shares.min())))
        out = []
        for i in torch.argsort(shares)[:3].tolist():
            if not float(shares[i]) <= SCREEN:
                break
            alt = dict(zip(used, maps[i]))
            table = [alt.get(c, 0 if v is None else v) for c, v in enumerate(spec.code_map)]
            out.append(self._code_table_hyp(used, true, maps[i], table))
        return out

    def _code_table_hyp(self, used, true, alt, table) -> _Hyp:
        spec = self.spec
        changes = [(c, t, a) for c, t, a in zip(used, true, alt) if t != a]
        said = ", ".join(f"code {c} as {_signed(a)} instead of {_signed(t)}" for c, t, a in changes)
        flipped = all(a == -t for _, t, a in zip(used, true, alt))
        head = "every nonzero weight's sign flipped: " if flipped else ""
        fmt = ", ".join(f"{c}→{_signed(v)}" for c, v in enumerate(spec.code_map))
        listed = ", ".join("null" if v is None else str(v) for v in spec.code_map)
        return _Hyp("code_table", f"the weight decoded with another code table: {head}{said}",
                    f"decode the codes as code_map [{listed}] says ({fmt}) in the lookup table "
                    f"or sign handling of {self.module}",
                    rows=self._rows_fn(lut=torch.tensor(table, dtype=torch.float32)))
