"""Weight hypotheses of the ``awq`` format: the generic group ones (:mod:`.grouped`) over its codes and zero
points, unpacked as the reference reads them."""

from __future__ import annotations

import torch

from vllm_parity.harness.formats.grouped import GroupedProjection
from vllm_parity.reference.formats import awq


class Projection(GroupedProjection):
    def __init__(self, tap, ref, cand, ctx, noise):
        super().__init__(tap, ref, cand, ctx, noise)
        stored = ctx.linear.stored
        q, z = awq.unpack(stored["qweight"]), awq.unpack(stored["qzeros"])  # (K, N), (G, N)
        self.scale_stored = stored["scales"].T  # (N, G), in its stored dtype (fp16 as AutoAWQ writes it)
        self.group_index = torch.arange(self.k) // self.spec.group_size
        self.unscaled_rows = (q - z[self.group_index]).T.to(torch.float32).contiguous()
