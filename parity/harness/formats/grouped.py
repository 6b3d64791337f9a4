"""What the 4-bit formats with a scale and zero point per group of inputs share (AutoAWQ, GPTQ): the weight
rebuilt from its codes less zero points under another scale, so that the generic group hypotheses (scale
missing, inverted, rounded; groups in another order) apply to them."""

from __future__ import annotations

import torch

from vllm_parity.harness.diagnosis import WeightProjection


class GroupedProjection(WeightProjection):
    """Set by a subclass: ``unscaled`` (N, K) float32, codes less zero points; ``scale_stored`` (N, G) as stored;
    ``group_index`` (K,) int64, the group of each input."""

    unscaled_rows: torch.Tensor
    group_index: torch.Tensor

    def __init__(self, tap, ref, cand, ctx, noise):
        super().__init__(tap, ref, cand, ctx, noise)
        self.scale_mode, self.granularity = "multiply", "group"

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

    def decodes_alike(self, idx, w):
        return torch.allclose(self._rows_fn()(idx), w, rtol=1e-5, atol=1e-7)
