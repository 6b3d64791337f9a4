"""Weight hypotheses of the ``int8x`` format: those of its one per-tensor scale (the generic ones); its
codes are lossless, so no other reading of them is a likely fault."""

from __future__ import annotations

from vllm_parity.harness.diagnosis import WeightProjection


class Projection(WeightProjection):
    def __init__(self, tap, ref, cand, ctx, noise):
        super().__init__(tap, ref, cand, ctx, noise)
        self.scale_stored = ctx.linear.stored["weight_scale"]
