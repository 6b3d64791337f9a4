"""Hypotheses of the ``compressed-tensors`` format: those of its scale per tensor or per output channel (the
generic ones), and for int8 weights with int8 activations, a GEMM whose pair sums saturate at int16.

The saturation is what x86 int8 kernels without VNNI compute (oneDNN's AVX2 path, vLLM's CPU W8A8 on such a
machine): ``vpmaddubsw`` multiplies unsigned activation bytes (the int8 code + 128) by signed weight bytes and
adds each pair of products in 16 bits, saturating, before the 32-bit sum; the +128 is subtracted afterwards.
"""

from __future__ import annotations

import torch

from vllm_parity.harness.diagnosis import CHUNK_ELEMS, WeightProjection, _Hyp

I16 = 32767


class Projection(WeightProjection):
    def __init__(self, tap, ref, cand, ctx, noise):
        super().__init__(tap, ref, cand, ctx, noise)
        stored, scheme = ctx.linear.stored, self.spec.scheme_of(ctx.linear.name)
        self.scheme = scheme
        scale = stored["weight_scale"]
        self.granularity = {"tensor": "tensor", "channel": "channel"}.get(scheme.strategy, "group")
        self.scale_stored = scale.reshape(-1) if self.granularity != "group" else scale
        self.codes = stored.get("weight") if scheme.format in ("int-quantized", "naive-quantized") else None

    def format_hypotheses(self, generic, idx, rsel):
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

