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
        _warm_up(model, torch.tensor([prompts[0]], dtype=torch.long))
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


def capture_batch(model: nn.Module, arch: Architecture, prompts: list[list[int]], out: str | Path,
                  meta: dict | None = None, wanted: Callable[[str], bool] | None = None,
                  tokens: list[list[int]] | None = None) -> tuple[DumpReader, list[DumpReader]]:
    """Every prompt in one forward, and with ``tokens`` the decode steps in the same one: prompt p is followed by
    ``tokens[p]``, the tokens a candidate ran at its decode steps (``tokens[p][s]`` at step s; its own, so the
    comparison holds where they differ from the reference's greedy ones). A causal model's row at position
    ``len(prompt) + s`` is what decode step s computes from a KV cache; rows ``0..len(prompt)-1`` are the
    prefill's. Step s's rows go to ``dumps.step_dir(out, s)``.

    One forward decodes each projection's weight once, however many prompts and steps: a large model's
    reference decodes per forward. The prompts are right-padded and no mask is given: under the causal mask no
    real row sees a padded one, and every position is its own (no position ids to shift)."""
    steps = len(tokens[0]) if tokens else 0
    if tokens is not None and (len(tokens) != len(prompts) or any(len(t) != steps for t in tokens)):
        raise ValueError(f"decode tokens for {len(tokens)} prompts of {[len(t) for t in tokens][:5]} steps; "
                         f"expected {len(prompts)} prompts of {steps} steps each")
    seqs = [list(ids) + list(tokens[p] if tokens else ()) for p, ids in enumerate(prompts)]
    width = max(len(s) for s in seqs)
    device = next(model.parameters()).device
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    for p, s in enumerate(seqs):
        ids[p, :len(s)] = torch.tensor(s, dtype=torch.long)
    ids = ids.to(device)
    writer = DumpWriter(out, {**(meta or {}), **({"decode": {"steps": steps, "tokens": tokens}} if steps else {})})
    writers = [DumpWriter(step_dir(out, s), {**(meta or {}), "decode_step": s,
                                             "first_positions": [len(p) + s for p in prompts]})
               for s in range(steps)]
    _warm_up(model, ids)
    rec = Recorder(model, arch.taps, model.config.num_hidden_layers, writer, wanted=wanted,
                   step_writer=lambda s: writers[s]).install()

    def rows(t: torch.Tensor) -> dict:
        t = t.reshape(len(seqs), width, -1) if t.dim() == 2 else t  # (tokens of every prompt, features)
        out = {}
        for p, prompt in enumerate(prompts):
            n = len(prompt)
            out[p] = t[p, :n]
            out.update({(s, p): t[p, n + s: n + s + 1] for s in range(steps)})
        return out
    rec.rows = rows
    try:
        with torch.no_grad():
            model(ids, use_cache=False)
        rec.flush()
    finally:
        rec.remove()
    missing = rec.missing()
    if missing:
        raise RuntimeError(f"taps never fired on the reference: {missing[:5]}")
    readers = []
    for w in [writer, *writers]:
        w.meta.setdefault("side", "reference")
        readers.append(DumpReader(w.close()))
    return readers[0], readers[1:]


class _Stop(Exception):
    pass


def _warm_up(model: nn.Module, ids: torch.Tensor) -> None:
    """A process's first forward can take other library code paths: on two CPU threads, about one run in ten
    computed fp32 attention 3e-4 off its fp64 value for prompt 0 only. The embedding and the first decoder layer
    run once on the same input, discarded: every later layer takes the same shapes, and the rest of the model
    would cost a whole weight decode for nothing."""
    layers = list(getattr(getattr(model, "model", None), "layers", []))
    if not layers:
        with torch.no_grad():
            model(ids, use_cache=False)
        return

    def stop(mod, args, out):
        raise _Stop
    handle = layers[0].register_forward_hook(stop, prepend=True)  # before any step counter's hook
    try:
        with torch.no_grad():
            model(ids, use_cache=False)
    except _Stop:
        pass
    finally:
        handle.remove()


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
