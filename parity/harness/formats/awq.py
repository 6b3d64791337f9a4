"""Weight hypotheses of the ``awq`` format: the generic group ones (:mod:`.grouped`) over its codes and zero
points, unpacked as the reference reads them; its words (8 output channels each, AutoAWQ's interleave) read in
another nibble order."""

from __future__ import annotations

import torch

from vllm_parity.harness.formats.grouped import GroupedProjection, Packed, PackedWeight
from vllm_parity.reference.formats import awq

SAID = "AutoAWQ's interleave"


class Projection(GroupedProjection):
    def __init__(self, tap, ref, cand, ctx, noise):
        super().__init__(tap, ref, cand, ctx, noise)
        stored = ctx.linear.stored
        q, z = awq.unpack(stored["qweight"]), awq.unpack(stored["qzeros"])  # (K, N), (G, N)
        self.scale_stored = stored["scales"].T  # (N, G), in its stored dtype (fp16 as AutoAWQ writes it)
        size = self.spec.group_size
        self._set_weight(PackedWeight(
            q.T.contiguous(), z.T.contiguous(), torch.arange(self.k) // size,
            (Packed("qweight", "codes", "output", awq.ORDER, SAID), Packed("qzeros", "zeros", "output", awq.ORDER, SAID)),
            group_size=size))
