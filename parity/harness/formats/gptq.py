"""Weight hypotheses of the ``gptq`` format: the generic group ones (:mod:`.grouped`) over its codes and zero
points (stored less one), unpacked as the reference reads them; its words read in another nibble order; with a
``g_idx`` that is not ``input // group_size`` (activation order) the groups are not blocks of inputs, no group
order is fitted, and a kernel may read them by position."""

from __future__ import annotations

import torch

from vllm_parity.harness.formats.grouped import GroupedProjection, Packed, PackedWeight
from vllm_parity.reference.formats import gptq

SAID = "GPTQ's order"
PLAIN = tuple(range(8))


class Projection(GroupedProjection):
    def __init__(self, tap, ref, cand, ctx, noise):
        super().__init__(tap, ref, cand, ctx, noise)
        stored = ctx.linear.stored
        q = gptq.unpack(stored["qweight"].T).T  # (K, N)
        z = gptq.unpack(stored["qzeros"]) + 1  # (G, N)
        self.scale_stored = stored["scales"].T  # (N, G)
        size = self.k if self.spec.group_size == -1 else self.spec.group_size
        g_idx = stored.get("g_idx")
        self._set_weight(PackedWeight(
            q.T.contiguous(), z.T.contiguous(), torch.arange(self.k) // size if g_idx is None else g_idx.to(torch.int64),
            (Packed("qweight", "codes", "input", PLAIN, SAID), Packed("qzeros", "zeros", "output", PLAIN, SAID)),
            group_size=size))
