"""Forward hooks that take canonical taps from a model and stream them to a dump.

The recorder is side-agnostic: an architecture's tap rows (:mod:`vllm_parity.architectures`) say where to hook, and a ``rows``
callback turns the token-major tensors of one forward into ``{prompt: (positions, features)}``; a key
``(step, prompt)`` puts those rows in decode step ``step``'s dump instead (``step_writer``).
Tensors are flushed to the dump whenever the forward moves on to the next decoder layer, so memory
holds one layer's taps at a time.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from vllm_parity.harness.dumps import DumpWriter, key
from vllm_parity.architectures import TapPoint
from vllm_parity.harness.taps import expand, layer_of, take_for

RowsFn = Callable[[torch.Tensor], dict[int | tuple[int, int], torch.Tensor]]


class Recorder:
    def __init__(self, model: nn.Module, points: tuple[TapPoint, ...], num_layers: int, writer: DumpWriter,
                 wanted: Callable[[str], bool] | None = None,
                 step_writer: Callable[[int], DumpWriter] | None = None):
        self.model, self.writer, self.step_writer = model, writer, step_writer
        self.rows: RowsFn | None = None
        self.handles: list = []
        self.pending: dict[int | None, dict[str, torch.Tensor]] = {}  # decode step (None: prefill) -> tensors
        self.group: str | None = None
        self.seen: set[str] = set()
        self.plan = [(tap, p, m) for tap, p, m in expand(points, num_layers, getattr(model, "config", None))
                     if wanted is None or wanted(tap)]

    def install(self) -> "Recorder":
        modules = dict(self.model.named_modules())
        for tap, point, path in self.plan:
            if path not in modules:
                raise KeyError(f"tap {tap!r}: module {path!r} not found in {type(self.model).__name__}")
            take = take_for(point.take, getattr(self.model, "config", None))
            if point.hook == "input":
                def pre(mod, args, tap=tap, take=take):
                    self._capture(tap, take(args, mod))
                self.handles.append(modules[path].register_forward_pre_hook(pre))
            else:
                def post(mod, args, out, tap=tap, take=take):
                    self._capture(tap, take(out, mod))
                self.handles.append(modules[path].register_forward_hook(post))
        return self

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def _capture(self, tap: str, tensor: torch.Tensor) -> None:
        if self.rows is None:
            return
        layer = layer_of(tap)
        group = f"layers.{layer}" if layer is not None else tap
        if group != self.group:
            self.flush()
            self.group = group
        # clone: a later fused op may update the captured tensor in place
        for slot, t in self.rows(tensor.detach()).items():
            step, prompt = slot if isinstance(slot, tuple) else (None, slot)
            self.pending.setdefault(step, {})[key(tap, prompt)] = t.clone()
            self.seen.add(tap)

    def flush(self) -> None:
        for step, tensors in self.pending.items():
            (self.writer if step is None else self.step_writer(step)).write(self.group or "misc", tensors)
        self.pending = {}
        self.group = None

    def missing(self) -> list[str]:
        return [tap for tap, _, _ in self.plan if tap not in self.seen]
