"""Hypotheses of the ``compressed-tensors`` format: those of its scale per tensor or per output channel (the
generic ones); for group scales, the weight rebuilt from its codes with the scales missing, inverted, rounded,
applied to the neighbouring group or to the groups in another order, and zero points off by one; for int8
weights with int8 activations, a GEMM whose pair sums saturate at int16.

The saturation is what x86 int8 kernels without VNNI compute (oneDNN's AVX2 path, vLLM's CPU W8A8 on such a
machine): ``vpmaddubsw`` multiplies unsigned activation bytes (the int8 code + 128) by signed weight bytes and
adds each pair of products in 16 bits, saturating, before the 32-bit sum; the +128 is subtracted afterwards.
"""

from __future__ import annotations

import torch

from vllm_parity.harness.diagnosis import CHUNK_ELEMS, WeightProjection, _Hyp

I16 = 32767


def _unpacked(stored: dict, scheme, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The codes ``(N, K)`` and zero points ``(N, G)`` of a pack-quantized weight, as compressed-tensors
    unpacks them (zero points 0 where symmetric)."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    q = unpack_from_int32(stored["weight_packed"], scheme.num_bits, torch.Size((n, k))).to(torch.int32)
    groups = stored["weight_scale"].shape[1]
    if "weight_zero_point" in stored:
        z = unpack_from_int32(stored["weight_zero_point"], scheme.num_bits, torch.Size((n, groups)), packed_dim=0)
    else:
        z = torch.zeros(n, groups)
    return q, z.to(torch.int32)


class Projection(WeightProjection):
    def __init__(self, tap, ref, cand, ctx, noise):
        super().__init__(tap, ref, cand, ctx, noise)
        stored, scheme = ctx.linear.stored, self.spec.scheme_of(ctx.linear.name)
        self.scheme = scheme
        scale = stored["weight_scale"]
        self.granularity = {"tensor": "tensor", "channel": "channel"}.get(scheme.strategy, "group")
        self.scale_stored = scale.reshape(-1) if self.granularity != "group" else scale
        self.codes = stored.get("weight") if scheme.format in ("int-quantized", "naive-quantized") else None
        if self.granularity == "group" and scheme.format == "pack-quantized" and "weight_g_idx" not in stored:
            self._rows_fn = self._group_rows  # the generic group hypotheses rebuild the weight through it
            self.q, self.zero = _unpacked(stored, scheme, self.n, self.k)

    # -- group scales: the weight rebuilt under a hypothesis --

    def _group_rows(self, perm=None, scale=None, mode="same", zero_shift=0):
        """Rows of the weight with the groups' scales taken in order ``perm`` (group g reads scale perm[g]),
        another ``scale`` tensor, the scale missing (mode None) or dividing, zero points moved by ``zero_shift``."""
        g = self.scheme.group_size
        s = (self.scale if scale is None else scale).to(torch.float32)

        def rows(idx):
            sc = s[idx] if perm is None else s[idx][:, perm]
            z = self.zero[idx] + zero_shift
            v = (self.q[idx] - z.repeat_interleave(g, dim=1)).to(torch.float32)
            if mode is None:
                return v
            full = sc.repeat_interleave(g, dim=1)
            return v / full if mode == "divide" else v * full
        return rows

    def _group_hyps(self) -> list[_Hyp]:
        groups = self.scale.shape[1]
        out = []
        self.known_orders = []  # orders named here: the fitted order (diagnosis' regrouped) does not repeat them
        if groups > 1:
            for shift, where in ((1, "the next"), (-1, "the previous")):
                perm = (torch.arange(groups) + shift) % groups
                self.known_orders.append(perm)
                out.append(_Hyp("scale_groups", f"each group of {self.scheme.group_size} inputs scaled with {where} "
                                f"group's scales (groups shifted by {shift:+d})",
                                f"index the scales of {self.module} with input // group_size "
                                f"({self.scheme.group_size}), as compressed-tensors' layout says",
                                rows=self._group_rows(perm=perm)))
            if groups % 2 == 0:
                perm = torch.arange(groups).reshape(-1, 2).flip(1).reshape(-1)
                self.known_orders.append(perm)
                out.append(_Hyp("scale_groups", "the scales of each pair of neighbouring groups exchanged",
                                f"index the scales of {self.module} with input // group_size", rows=self._group_rows(
                                    perm=perm)))
        if not self.scheme.symmetric:
            for shift in (1, -1):
                out.append(_Hyp("zero_point", f"every zero point read {shift:+d} off its stored value",
                                f"unpack {self.module}'s zero points as stored (packed along the output axis, "
                                f"{self.scheme.num_bits}-bit, no offset) and subtract them from the codes",
                                rows=self._group_rows(zero_shift=shift)))
        return out

    def _unscaled(self, idx: torch.Tensor) -> torch.Tensor | None:
        """The weight rows before their group scales: codes less zero points (None: not unpacked here)."""
        return self._group_rows(mode=None)(idx) if hasattr(self, "q") else None

    def decodes_alike(self, idx, w):
        return not hasattr(self, "q") or torch.allclose(self._group_rows()(idx), w, rtol=1e-5, atol=1e-7)

    def format_hypotheses(self, generic, idx, rsel):
        if hasattr(self, "q"):
            return generic + self._group_hyps()
        if self.codes is None or self.post is None or self.k % 2 or \
                getattr(self.lin, "activation_quant", None) != "per_token_absmax_int8":
            return generic
        return generic + [_Hyp(
            "int8_saturation",
            "the int8 GEMM summing each pair of u8·s8 products in 16 bits, saturating (activation code + 128 "
            "times the weight code, as x86 kernels without VNNI do with vpmaddubsw)",
            f"compute {self.module}'s int8 GEMM with 32-bit pair sums (a VNNI kernel, or s8·s8 products "
            f"widened to int32), or keep the activations' codes within ±64 so that no pair sum overflows",
            output=self._saturating)]

    def _saturating(self, idx: torch.Tensor, rsel: torch.Tensor) -> torch.Tensor:
        x = (self.x[rsel].to(torch.int64) + 128)  # (R, K) unsigned bytes
        w = self.codes[idx].to(torch.int64)  # (C, K)
        scale = self.scale_stored.to(torch.float64)
        s = scale.reshape(1).expand(self.n)[idx] if self.granularity == "tensor" else scale[idx]
        out = []
        step = max(1, CHUNK_ELEMS // max(1, x.shape[0] * self.k))
        for i in range(0, len(idx), step):
            wc = w[i:i + step]
            prod = x[:, None, :] * wc[None, :, :]
            pairs = (prod[..., 0::2] + prod[..., 1::2]).clamp(-I16 - 1, I16)
            acc = pairs.sum(-1) - 128 * wc.sum(-1)[None, :]
            out.append(acc.to(torch.float64) * s[i:i + step][None, :])
        return torch.cat(out, 1) / self.post[rsel].to(torch.float64)

