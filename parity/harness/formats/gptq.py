"""Weight hypotheses of the ``gptq`` format: the generic group ones (:mod:`.grouped`) over its codes and zero
points (stored less one), unpacked as the reference reads them; with ``g_idx`` (activation order) the groups
are not blocks of inputs, and no group order is fitted."""

from __future__ import annotations

import torch

from vllm_parity.harness.formats.grouped import GroupedProjection
from vllm_parity.reference.formats import gptq


class Projection(GroupedProjection):
    def __init__(self, tap, ref, cand, ctx, noise):
        super().__init__(tap, ref, cand, ctx, noise)
        stored = ctx.linear.stored
        q = gptq.unpack(stored["qweight"].T).T  # (K, N)
        z = gptq.unpack(stored["qzeros"]) + 1  # (G, N)
        self.scale_stored = stored["scales"].T  # (N, G)
        size = self.k if self.spec.group_size == -1 else self.spec.group_size
        g_idx = stored.get("g_idx")
        self.group_index = torch.arange(self.k) // size if g_idx is None else g_idx.to(torch.int64)
        self.unscaled_rows = (q - z[self.group_index]).T.to(torch.float32).contiguous()
