"""Running the reference (or a candidate built on the same modeling code) and dumping its taps."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from torch import nn

from vllm_parity.harness.dumps import DumpReader, DumpWriter, step_dir
from vllm_parity.harness.recorder import Recorder
from vllm_parity.architectures import Architecture


def capture(model: nn.Module, arch: Architecture, prompts: list[list[int]], out: str | Path, meta: dict | None = None,
            wanted: Callable[[str], bool] | None = None, isolate_from: DumpReader | None = None) -> DumpReader:
    """Run each prompt on its own (batch 1, no padding) and dump every tap; with ``isolate_from``
    every decoder layer is fed that dump's input for it."""
    writer = DumpWriter(out, meta)
    num_layers = model.config.num_hidden_layers
    if prompts:
        # A process's first forward can take other library code paths: on two CPU threads, about one run
        # in ten computed fp32 attention 3e-4 off its fp64 value for prompt 0 only. Discard one forward.
        with torch.no_grad():
            model(torch.tensor([prompts[0]], dtype=torch.long), use_cache=False)
    current = {"prompt": 0}
    feeds = []
    if isolate_from is not None:
        for i, layer in enumerate(model.model.layers):
            def feed(mod, args, i=i):
                ref = isolate_from.get(f"layers.{i}.input", current["prompt"]).to(args[0].dtype)
                return (ref.unsqueeze(0), *args[1:])
            feeds.append(layer.register_forward_pre_hook(feed))
    rec = Recorder(model, arch.taps, num_layers, writer, wanted=wanted).install()
    if isolate_from is not None:  # after the recorder's hooks: a projection's input tap is the candidate's own
        feeds += _feed_projections(model, arch, num_layers, isolate_from, current)
    try:
        for p, ids in enumerate(prompts):
            current["prompt"] = p
            rec.rows = lambda t, p=p: {p: t[0] if t.dim() == 3 else t}
            with torch.no_grad():
                model(torch.tensor([ids], dtype=torch.long), use_cache=False)
            rec.flush()
    finally:
        rec.remove()
        for h in feeds:
            h.remove()
    missing = rec.missing()
    if missing:
        raise RuntimeError(f"taps never fired on the reference: {missing[:5]}")
    writer.meta["side"] = writer.meta.get("side", "reference")
    return DumpReader(writer.close())


def capture_decode(model: nn.Module, arch: Architecture, prompts: list[list[int]], tokens: list[list[int]],
                   out: str | Path, meta: dict | None = None,
                   wanted: Callable[[str], bool] | None = None) -> list[DumpReader]:
    """The reference at a candidate's decode steps: one forward per prompt over the prompt and the tokens the
    candidate ran at its decode steps (``tokens[p][s]`` at step s; its own, so the comparison holds when they
    differ from the reference's greedy ones); step s's rows (position ``len(prompt) + s``) go to
    ``dumps.step_dir(out, s)``. A causal model's rows there are what a KV cache would give."""
    steps = len(tokens[0]) if tokens else 0
    writers = [DumpWriter(step_dir(out, s), {**(meta or {}), "decode_step": s,
                                             "first_positions": [len(ids) + s for ids in prompts]})
               for s in range(steps)]
    rec = Recorder(model, arch.taps, model.config.num_hidden_layers, writers[0] if writers else None,
                   wanted=wanted, step_writer=lambda s: writers[s]).install()
    try:
        for p, (ids, new) in enumerate(zip(prompts, tokens)):
            n = len(ids)
            rec.rows = lambda t, p=p, n=n: {(s, p): (t[0] if t.dim() == 3 else t)[n + s: n + s + 1]
                                            for s in range(steps)}
            with torch.no_grad():
                model(torch.tensor([list(ids) + list(new)], dtype=torch.long), use_cache=False)
            rec.flush()
    finally:
        rec.remove()
    out = []
    for w in writers:
        w.meta.setdefault("side", "reference")
        out.append(DumpReader(w.close()))
    return out


def _feed_projections(model: nn.Module, arch: Architecture, num_layers: int, ref: DumpReader, current: dict) -> list:
    """Pre-hooks giving every projection the reference's input for it (the one tap it reads): each op's error
    is its own (the vLLM side's isolation does the same)."""
    modules, handles = dict(model.named_modules()), []
    for point in arch.taps:
        if point.hook != "output" or not point.tap.startswith("layers.{i}."):
            continue
        inputs = arch.layer_inputs.get(point.tap.removeprefix("layers.{i}."), ())
        if len(inputs) != 1 or point.take != "first":
            continue
        for i in range(num_layers):
            mod, source = modules.get(point.module.format(i=i)), f"layers.{i}.{inputs[0]}"
            if mod is None or source not in ref.taps() or not hasattr(mod, "in_features"):
                continue

            def feed(mod, args, source=source):
                r = ref.get(source, current["prompt"]).to(args[0].dtype)
                return (r.reshape(args[0].shape), *args[1:]) if r.numel() == args[0].numel() else None
            handles.append(mod.register_forward_pre_hook(feed))
    return handles
