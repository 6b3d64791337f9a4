"""Running the ``kernels`` candidate and dumping its taps: each prompt's prefill, then greedy decode steps on a KV
cache, on the CPU or on CUDA, dumped as the vLLM side dumps the engine's.

Each prompt runs alone (batch 1). With decode steps its prefill fills a transformers ``StaticCache`` (fixed shapes;
the cache writes each forward's keys and values in place, at the length it keeps on the device), and decode step s
runs one row, the token sampled after step s-1 (or ``forced``), at position ``len(prompt) + s``, attending to the
cache through an explicit additive mask. Step s's taps go to ``dumps.step_dir(out, s)`` (manifest
``decode_step``, ``first_positions``), the tokens each step ran to the prefill manifest's ``decode``, so the
reference's forward over the prompt and those tokens is compared with them.

On CUDA the decode step is captured once in a CUDA graph, as vLLM captures its decode batches, and replayed for
every step of every prompt: the token, the position and (isolated) the reference's inputs are copied into the
graph's static input buffers before each replay; the tap hooks run Python only at capture, where each copies its
tensor into a buffer the graph keeps (a clone inside the captured region), read after each replay. Which kernel
computed each projection's tap is the kernel linear's own choice for the call's rows
(:func:`vllm_parity.harness.kernel_candidate.kernel_for`), the captured one for every replayed step.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from vllm_parity.architectures import Architecture
from vllm_parity.harness.dumps import DumpReader, DumpWriter, key, step_dir
from vllm_parity.harness.kernel_candidate import kernel_for, kernels_of
from vllm_parity.harness.recorder import Recorder
from vllm_parity.harness.taps import take_for

# Eager decode forwards before the capture: Triton compiles, CUDA extensions load, cuBLAS takes its workspace.
WARMUP_FORWARDS = 2
_CAPTURE = "capture"  # the kernel log's phase while the graph is captured
_WARMUP = "warmup"  # ... and while the cache is made and the step warmed up (not reported)


def capture(model: nn.Module, arch: Architecture, prompts: list[list[int]], out: str | Path, meta: dict | None = None,
            wanted: Callable[[str], bool] | None = None, decode_steps: int = 0,
            isolate_from: list[DumpReader] | None = None, forced: list[list[int]] | None = None,
            graph: bool | None = None) -> DumpReader:
    """Run each prompt's prefill and ``decode_steps`` greedy decode steps through ``model`` and dump its taps.

    ``isolate_from``: the reference's dumps (the prefill's, then each decode step's): every decoder layer is fed
    their input for it, every projection their input tap; ``forced``: per prompt, the token each decode step runs;
    ``graph``: replay the decode step from a CUDA graph (default: on CUDA)."""
    out = Path(out)
    device = next(model.parameters()).device
    graph = device.type == "cuda" if graph is None else graph
    if graph and device.type != "cuda":
        raise ValueError(f"a CUDA graph of the decode step needs the model on CUDA, not {device}")
    if decode_steps < 0:
        raise ValueError(f"decode_steps {decode_steps}: a count of steps, 0 or more")
    if isolate_from is not None and len(isolate_from) < 1 + decode_steps:
        raise ValueError(f"isolating {decode_steps} decode steps needs the reference's dump of the prefill and of "
                         f"each step, got {len(isolate_from)}")
    if forced is not None and (len(forced) != len(prompts) or any(len(f) < decode_steps for f in forced)):
        raise ValueError(f"forced tokens: {decode_steps} for each of {len(prompts)} prompts expected")
    meta = dict(meta or {})
    meta.setdefault("side", "candidate")
    writer = DumpWriter(out, meta)
    step_writers = [DumpWriter(step_dir(out, s), {**meta, "decode_step": s,
                                                  "first_positions": [len(ids) + s for ids in prompts]})
                    for s in range(decode_steps)]
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    num_layers = model.config.num_hidden_layers
    if prompts:
        # A process's first forward can take other library code paths (reference_side.capture discards one too).
        with torch.no_grad():
            model(torch.tensor([prompts[0]], dtype=torch.long, device=device), use_cache=False)

    feeds = _Feeds(model, arch, num_layers, isolate_from, dtype, device) if isolate_from is not None else None
    handles = feeds.install_layers() if feeds else []
    rec = Recorder(model, arch.taps, num_layers, writer, wanted=wanted).install()
    step_taps = _StepTaps(model, rec.plan)
    handles += step_taps.install()
    if feeds:  # after the recorder's hooks: a projection's input tap is the candidate's own
        handles += feeds.install_projections()
    kernels = _KernelLog(model, rec.plan)
    handles += kernels.install()
    tokens: list[list[int]] = [[] for _ in prompts]
    stepper = None
    seconds = {"prefill": 0.0, "decode": 0.0}  # each phase's forwards and dumping, for the run's timings
    try:
        if decode_steps and prompts:
            t0 = time.perf_counter()
            if feeds:
                feeds.load(0, 0)  # the decode buffers exist before a graph is captured reading them
            stepper = _Stepper(model, max(len(ids) for ids in prompts) + decode_steps, dtype, device, graph,
                               step_taps, kernels)
            seconds["graph_capture" if graph else "cache_setup"] = time.perf_counter() - t0
        for p, ids in enumerate(prompts):
            t0 = time.perf_counter()
            if feeds:
                feeds.load(None, p)
            kernels.phase = None
            rec.rows = lambda t, p=p: {p: t[0] if t.dim() == 3 else t}
            logits = stepper.prefill(ids) if stepper else _forward(model, ids, device)
            rec.flush()
            rec.rows = None
            nxt = int(logits.argmax())
            t1 = time.perf_counter()
            seconds["prefill"] += t1 - t0
            for s in range(decode_steps):
                tok = forced[p][s] if forced is not None else nxt
                tokens[p].append(tok)
                if feeds:
                    feeds.load(s, p)
                kernels.phase = s
                nxt = int(stepper.step(tok, len(ids) + s).argmax())
                step_taps.write(step_writers[s], p)
            seconds["decode"] += time.perf_counter() - t1
            if stepper:
                stepper.check_length(len(ids) + decode_steps, p)
    finally:
        rec.remove()
        for h in handles:
            h.remove()
        if stepper:
            stepper.close()
    missing = rec.missing() + (step_taps.missing() if decode_steps and prompts else [])
    if missing:
        raise RuntimeError(f"taps never fired on the kernels candidate: {missing[:5]}")
    if kernels.possible:
        writer.meta["kernel_branches"] = kernels.possible
    if None in kernels.used:
        writer.meta["kernels"] = kernels.of(None)
    if decode_steps:
        writer.meta["decode"] = {"steps": decode_steps, "tokens": tokens}
        writer.meta["decode_graph"] = bool(graph)
    writer.meta["seconds"] = seconds
    for s, w in enumerate(step_writers):
        w.meta.update({k: writer.meta[k] for k in ("decode", "decode_graph", "kernel_branches") if k in writer.meta})
        if kernels.of(s):
            w.meta["kernels"] = kernels.of(s)
        w.close()
    return DumpReader(writer.close())


def forwards(prompts: int, decode_steps: int, graph: bool) -> int:
    """The forwards :func:`capture` runs through the decoder layers' hooks (a progress count): a warm-up, each
    prompt's prefill, and the decode steps, eager, or on CUDA the forwards made to capture their graph (its
    replays run no hooks)."""
    if not decode_steps or not prompts:
        return 1 + prompts
    return 1 + prompts + (2 + WARMUP_FORWARDS if graph else prompts * decode_steps)


def greedy(model: nn.Module, ids: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """``n`` greedy tokens after ``ids`` from full forwards on the model's device, and the logits (fp32, on the
    CPU) each was chosen from."""
    device = next(model.parameters()).device
    x = torch.tensor([ids], dtype=torch.long, device=device)
    out, steps = [], []
    with torch.no_grad():
        for _ in range(n):
            row = model(x, use_cache=False).logits[0, -1].float().cpu()
            nxt = int(row.argmax())
            out.append(nxt)
            steps.append(row)
            x = torch.cat([x, torch.tensor([[nxt]], dtype=torch.long, device=device)], dim=1)
    return out, steps


def _forward(model: nn.Module, ids: list[int], device: torch.device) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids], dtype=torch.long, device=device), use_cache=False).logits[0, -1].float()


def _layer_types(config) -> tuple[list[str], int | None]:
    """Each decoder layer's attention type (``config.layer_types``, else sliding where the config sets a window,
    as transformers infers them) and the sliding window (None: no sliding layer)."""
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    types = list(getattr(config, "layer_types", None) or
                 ["sliding_attention" if window is not None else "full_attention"] * n)
    other = sorted(set(types) - {"full_attention", "sliding_attention"})
    if other:
        raise ValueError(f"decode steps on a static KV cache: layer types {other} are not supported (full and "
                         f"sliding attention are)")
    return types, window if "sliding_attention" in types else None


def why_no_static_decode(config: dict) -> str | None:
    """Why the kernels candidate cannot run decode steps on a static KV cache for this model config (None: it
    can)."""
    if config.get("kv_lora_rank"):
        return ("the kernels candidate's static KV cache holds latent attention's compressed keys and kv_b runs over "
                "every cached position, so its rows are not the forward's: its decode steps are not compared (the "
                "vllm candidate's are)")
    other = sorted(set(config.get("layer_types") or []) - {"full_attention", "sliding_attention"})
    if other:
        return f"the kernels candidate's static KV cache supports full and sliding attention layers, not {other}"
    return None


def _additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where a query may attend, the dtype's lowest value elsewhere (transformers' own masks' convention)."""
    return (~allowed).to(dtype) * torch.finfo(dtype).min


class _Stepper:
    """A prompt's prefill into a static KV cache, then its decode steps: eager forwards, or replays of one CUDA
    graph of the step, its inputs (token, position) in static buffers."""

    def __init__(self, model: nn.Module, max_len: int, dtype: torch.dtype, device: torch.device, graph: bool,
                 taps: "_StepTaps", kernels: "_KernelLog"):
        from transformers.cache_utils import Cache, StaticLayer

        self.model, self.device, self.dtype, self.max_len = model, device, dtype, max_len
        self.taps, self.kernels = taps, kernels
        self.layer_types, self.window = _layer_types(model.config.get_text_config(decoder=True))
        # Every layer's cache holds every position (a sliding layer's own static cache rolls by a host-side count,
        # which a captured graph would freeze): the sliding layers see their window through their mask.
        self.cache = Cache(layers=[StaticLayer(max_cache_len=max_len) for _ in self.layer_types])
        self.kv_index = torch.arange(max_len, device=device).view(1, 1, 1, max_len)
        self.ids = torch.zeros((1, 1), dtype=torch.long, device=device)
        self.pos = torch.zeros((1, 1), dtype=torch.long, device=device)
        self.graph = self.logits = None
        if graph:
            self._capture()

    def _masks(self, q_pos: torch.Tensor):
        """The additive mask of each layer type for queries at ``q_pos`` (broadcast over the cache's positions):
        one tensor where every layer has the same type, else a dict by type (as the models' own mask mappings)."""
        causal = self.kv_index <= q_pos
        masks = {"full_attention": causal}
        if self.window is not None:
            masks["sliding_attention"] = causal & (self.kv_index > q_pos - self.window)
        masks = {t: _additive_mask(m, self.dtype) for t, m in masks.items() if t in self.layer_types}
        return next(iter(masks.values())) if len(masks) == 1 else masks

    def _decode(self) -> torch.Tensor:
        out = self.model(input_ids=self.ids, position_ids=self.pos, attention_mask=self._masks(self.pos.view(1, 1, 1, 1)),
                         past_key_values=self.cache, use_cache=True)
        return out.logits[:, -1]

    def _capture(self) -> None:
        """Capture the decode step: the cache's tensors are made by a first forward, the step runs eagerly on a
        side stream first (as torch.cuda.graphs' own warm-up), and the cache is cleared after."""
        self.kernels.phase, self.taps.active = _WARMUP, None
        with torch.no_grad():
            self.pos.fill_(0)
            self._decode()  # the static cache allocates its tensors at its first update
            self.pos.fill_(1)
            self.taps.active = True
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(WARMUP_FORWARDS):
                    self._decode()
            torch.cuda.current_stream().wait_stream(side)
            self.kernels.phase = _CAPTURE
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.logits = self._decode()
        self.kernels.phase = self.taps.active = None
        self.cache.reset()

    def prefill(self, ids: list[int]) -> torch.Tensor:
        """The prompt's forward, its keys and values written to the cache from position 0; its last logits."""
        self.cache.reset()
        n = len(ids)
        if n + 1 > self.max_len:
            raise ValueError(f"a prompt of {n} tokens does not fit a cache of {self.max_len}")
        pos = torch.arange(n, device=self.device).view(1, n)
        with torch.no_grad():
            out = self.model(input_ids=torch.tensor([ids], dtype=torch.long, device=self.device), position_ids=pos,
                             attention_mask=self._masks(pos.view(1, 1, n, 1)), past_key_values=self.cache,
                             use_cache=True)
        self.check_length(n, None)
        return out.logits[0, -1].float()

    def step(self, token: int, position: int) -> torch.Tensor:
        """One decode step: ``token`` at ``position`` (the cache holding every earlier one); its logits."""
        self.ids.fill_(token)
        self.pos.fill_(position)
        if self.graph is not None:
            self.graph.replay()
            return self.logits[0].float()
        self.taps.active = True
        try:
            with torch.no_grad():
                return self._decode()[0].float()
        finally:
            self.taps.active = None

    def check_length(self, n: int, prompt: int | None) -> None:
        """That the cache holds ``n`` positions (what it writes the next keys after): the steps ran where the
        positions say."""
        held = int(self.cache.get_seq_length())
        if held != n:
            where = "after the prefill" if prompt is None else f"after prompt {prompt}'s decode steps"
            raise RuntimeError(f"the KV cache holds {held} positions {where}, expected {n}")

    def close(self) -> None:
        self.graph = self.logits = None
        self.cache = None


class _StepTaps:
    """The taps of a decode step, each kept as a copy of its one row: at a CUDA graph's capture the copy is part
    of the graph, so each replay refreshes it."""

    def __init__(self, model: nn.Module, plan: list[tuple[str, object, str]]):
        self.model, self.plan = model, plan
        self.active: bool | None = None
        self.buffers: dict[str, torch.Tensor] = {}

    def install(self) -> list:
        modules, handles = dict(self.model.named_modules()), []
        config = getattr(self.model, "config", None)
        for tap, point, path in self.plan:
            take = take_for(point.take, config)
            if point.hook == "input":
                def pre(mod, args, tap=tap, take=take):
                    self._keep(tap, take(args, mod))
                handles.append(modules[path].register_forward_pre_hook(pre))
            else:
                def post(mod, args, out, tap=tap, take=take):
                    self._keep(tap, take(out, mod))
                handles.append(modules[path].register_forward_hook(post))
        return handles

    def _keep(self, tap: str, t: torch.Tensor) -> None:
        if self.active:
            t = t.detach()
            self.buffers[tap] = (t[0] if t.dim() == 3 else t).clone()  # a later op may update t in place

    def write(self, writer: DumpWriter, prompt: int) -> None:
        writer.write(f"prompt{prompt}", {key(tap, prompt): self.buffers[tap].cpu()
                                         for tap, _, _ in self.plan if tap in self.buffers})

    def missing(self) -> list[str]:
        return [tap for tap, _, _ in self.plan if tap not in self.buffers]


class _KernelLog:
    """Which kernel computed each projection tap, by phase (None: the prefill; s: decode step s), from the kernel
    linear's choice for the rows of each call; a graph's steps take the choice made at its capture."""

    def __init__(self, model: nn.Module, plan: list[tuple[str, object, str]]):
        self.modules = dict(model.named_modules())
        self.taps_of: dict[str, list[str]] = {}
        for tap, point, path in plan:
            if point.hook == "output" and path in self.modules:
                self.taps_of.setdefault(path, []).append(tap)
        self.phase: int | str | None = None
        self.used: dict[int | str | None, dict[str, set[str]]] = {}
        self.possible: dict[str, list[str]] = {}

    def install(self) -> list:
        handles = []
        for path, taps in self.taps_of.items():
            def pre(mod, args, taps=taps):
                x = args[0]
                m = x.numel() // x.shape[-1] if x.shape[-1] else 0
                kernel = kernel_for(mod, m, x.dtype, x.device)
                if kernel is None:
                    return
                for t in taps:
                    self.used.setdefault(self.phase, {}).setdefault(t, set()).add(kernel)
                    if t not in self.possible:
                        self.possible[t] = kernels_of(mod, x.dtype, x.device)
            handles.append(self.modules[path].register_forward_pre_hook(pre))
        return handles

    def of(self, phase: int | None) -> dict[str, list[str]]:
        used = self.used.get(phase) or (self.used.get(_CAPTURE, {}) if phase is not None else {})
        return {t: sorted(k) for t, k in used.items()}


class _Feeds:
    """The reference's inputs fed to the candidate (an isolated run): every decoder layer gets the reference's
    ``layers.{i}.input``, every projection its one input tap (as ``reference_side`` feeds the prefill). The
    prefill's are loaded per forward; the decode steps' are copied into static buffers, which a captured graph
    reads."""

    def __init__(self, model: nn.Module, arch: Architecture, num_layers: int, phases: list[DumpReader],
                 dtype: torch.dtype, device: torch.device):
        self.model, self.arch, self.num_layers, self.phases = model, arch, num_layers, phases
        self.dtype, self.device = dtype, device
        self.values: dict[str, torch.Tensor] = {}
        self.static: dict[str, torch.Tensor] = {}
        self.sources: set[str] = set()

    def _hook(self, source: str):
        self.sources.add(source)

        def feed(mod, args):
            v = self.values.get(source)
            if v is None or v.numel() != args[0].numel():
                return None
            return (v.reshape(args[0].shape), *args[1:])
        return feed

    def install_layers(self) -> list:
        taps = set(self.phases[0].taps())
        return [layer.register_forward_pre_hook(self._hook(f"layers.{i}.input"))
                for i, layer in enumerate(self.model.model.layers) if f"layers.{i}.input" in taps]

    def install_projections(self) -> list:
        modules, handles, taps = dict(self.model.named_modules()), [], set(self.phases[0].taps())
        for point in self.arch.taps:
            if point.hook != "output" or not point.tap.startswith("layers.{i}.") or point.take != "first":
                continue
            inputs = self.arch.layer_inputs.get(point.tap.removeprefix("layers.{i}."), ())
            if len(inputs) != 1:
                continue
            for i in range(self.num_layers):
                mod, source = modules.get(point.module.format(i=i)), f"layers.{i}.{inputs[0]}"
                if mod is not None and source in taps and hasattr(mod, "in_features"):
                    handles.append(mod.register_forward_pre_hook(self._hook(source)))
        return handles

    def load(self, step: int | None, prompt: int) -> None:
        """The reference's inputs of ``prompt`` at ``step`` (None: the prefill) for the next forward."""
        reader = self.phases[0 if step is None else 1 + step]
        available = set(reader.taps())
        loaded = {s: reader.get(s, prompt).to(self.device, self.dtype) for s in self.sources if s in available}
        if step is None:
            self.values = loaded
            return
        for s, t in loaded.items():
            buf = self.static.get(s)
            if buf is None:
                self.static[s] = t.clone()
            elif buf.shape == t.shape:
                buf.copy_(t)
            else:
                raise RuntimeError(f"the reference's {s} at decode step {step} has shape {tuple(t.shape)}, "
                                   f"expected {tuple(buf.shape)} (one row)")
        self.values = self.static
