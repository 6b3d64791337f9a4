"""Running the reference (or a candidate built on the same modeling code) and dumping its taps."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from torch import nn

from parity.dumps import DumpReader, DumpWriter
from parity.recorder import Recorder
from parity.taps import HF_LLAMA


def capture(model: nn.Module, prompts: list[list[int]], out: str | Path, meta: dict | None = None,
            wanted: Callable[[str], bool] | None = None) -> DumpReader:
    """Run each prompt on its own (batch 1, no padding) and dump every tap."""
    writer = DumpWriter(out, meta)
    num_layers = model.config.num_hidden_layers
    rec = Recorder(model, HF_LLAMA, num_layers, writer, wanted=wanted).install()
    try:
        for p, ids in enumerate(prompts):
            rec.rows = lambda t, p=p: {p: t[0] if t.dim() == 3 else t}
            with torch.no_grad():
                model(torch.tensor([ids], dtype=torch.long), use_cache=False)
            rec.flush()
    finally:
        rec.remove()
    missing = rec.missing()
    if missing:
        raise RuntimeError(f"taps never fired on the reference: {missing[:5]}")
    writer.meta["side"] = writer.meta.get("side", "reference")
    return DumpReader(writer.close())
