"""Dumping the taps of the real vLLM engine, aligned with the reference as (prompt, position, features).

Hooks are installed where the model lives, in every worker, through ``collective_rpc`` with the
module-level functions below (importable, so they reach spawned tensor-parallel workers and the
multiprocess engine as well as the in-process one). Each rank streams its taps to its own dump; the
parent then gathers the ranks: column-parallel outputs are concatenated along features, everything
else (replicated, or row-parallel and already reduced) is taken from rank 0.

vLLM flattens every scheduled token of a step into one batch. Rows are mapped back from the step's
own metadata, never from an assumed order: ``query_start_loc`` of the attention metadata splits the
batch into requests, the model runner's ``input_batch.req_ids`` names them (our request ids carry
the prompt index), and the positions are the first decoder layer's ``positions`` argument. The
engine runs with prefix caching and chunked prefill off (``vllm_parity.harness.engine``); that each prompt
ran as one full forward is checked, not trusted.

Decode steps: a request's first forward is its prefill, each later one a decode step (one row, read from the KV
cache). Step ``s``'s rows go to a dump of their own (``dumps.step_dir``), each prompt's one row at position
``len(prompt) + s``, checked as the prefill's positions are. The tokens the engine generated are kept in the
manifest (``decode``): the reference runs over them, and an isolated run is made to decode the same ones.

The ``logits`` tap: vLLM computes logits only for sampled positions, so the tap applies the model's
own ``compute_logits`` (logits processor + lm_head, the path vLLM samples from) to every position's
final hidden state inside the same forward.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import torch

from vllm_parity.harness.dumps import DumpReader, DumpWriter, key, step_dir
from vllm_parity.harness.recorder import Recorder
from vllm_parity.architectures import Architecture
from vllm_parity.harness.taps import expand, layer_of

REQUEST = re.compile(r"^parity-(\d+)(?:-|$)")
_ACTIVE: dict[str, dict] = {}  # per worker process: capture id -> its recorder and hooks


class _StepRows:
    """Maps the token rows of the current forward to (prompt, positions) and the phase: a request's first
    forward is its prefill, each later one a decode step. ``forced``: per prompt, the token each decode step
    is made to run (an isolated run decodes the propagated run's tokens, whatever it sampled itself)."""

    def __init__(self, runner, prompt_lens: list[int], forced: list[list[int]] | None = None):
        self.runner = runner
        self.prompt_lens = prompt_lens
        self.forced = forced
        self.forwards: dict[int, int] = {}  # prompt -> forwards that ran it
        self.spans: list[tuple[int, int, int, int | None]] | None = None  # (prompt, start, end, step; None: prefill)

    def begin(self) -> None:
        """At the step's first module (the embedding): split rows by request from the metadata."""
        from vllm.forward_context import get_forward_context, is_forward_context_available

        self.spans = None
        if not is_forward_context_available():
            return
        meta = get_forward_context().attn_metadata
        if not meta:
            return  # a dummy / profiling run
        first = next(iter(meta.values())) if isinstance(meta, dict) else meta
        qsl = first.query_start_loc.tolist()
        req_ids = list(self.runner.input_batch.req_ids)[: len(qsl) - 1]
        spans = []
        for r, rid in enumerate(req_ids):
            m = REQUEST.match(str(rid))
            if m is not None:
                p = int(m.group(1))
                n = self.forwards[p] = self.forwards.get(p, 0) + 1
                spans.append((p, qsl[r], qsl[r + 1], None if n == 1 else n - 2))
        self.spans = spans

    def force(self, args: tuple):
        """The embedding's arguments with each decode row's token replaced by the forced one (None: unchanged)."""
        if not self.forced or not self.spans or not any(step is not None for *_, step in self.spans):
            return None
        ids = args[0].clone()
        for p, start, end, step in self.spans:
            if step is not None:
                ids[start:end] = self.forced[p][step]
        return (ids, *args[1:])

    def check_positions(self, positions: torch.Tensor) -> None:
        """At the first decoder layer: a prefill is one full forward, positions 0..T-1; decode step s is one
        row at position T+s."""
        for prompt, start, end, step in self.spans or ():
            pos = positions[start:end].cpu()
            first, n = (0, self.prompt_lens[prompt]) if step is None else (self.prompt_lens[prompt] + step, 1)
            want = torch.arange(first, first + n, dtype=pos.dtype)
            if end - start != len(want) or not torch.equal(pos, want):
                what = "one full prefill" if step is None else f"decode step {step} at position {first}"
                raise RuntimeError(
                    f"prompt {prompt} was not run as {what} (positions {pos[:3].tolist()}…, {end - start} rows "
                    f"for {len(want)} tokens): prefix caching, chunked prefill or speculative decoding is on")

    def __call__(self, t: torch.Tensor) -> dict[int | tuple[int, int], torch.Tensor]:
        if not self.spans:
            return {}
        return {p if step is None else (step, p): t[s:e] for p, s, e, step in self.spans}


def _parallel(model, plan, arch: Architecture) -> dict[str, str]:
    """How each tap is spread over the ranks, from the module it is read at: the output of a column-parallel
    linear, or the input of a row-parallel one, is a shard of the features ("column"; "column_kv" for the
    k / v slices, which repeat when there are fewer kv heads than ranks); a row-parallel output is an
    all-reduced partial sum ("row"), or each rank's partial sum where the layer leaves the reduction to its
    caller ("partial": Qwen2-MoE's shared expert); the logits are gathered over the vocabulary ("vocab"). A tap read at
    any other module computed from one sharded tap alone (a per-head norm of q) is sharded as that one."""
    from vllm.model_executor.layers.linear import (ColumnParallelLinear, LinearBase, QKVParallelLinear,
                                                   RowParallelLinear)

    modules = dict(model.named_modules())
    kinds = {"logits": "vocab"}
    for tap, point, path in plan:
        mod = modules.get(path)
        if point.hook == "output" and isinstance(mod, ColumnParallelLinear) and not mod.gather_output:
            kinds[tap] = "column_kv" if isinstance(mod, QKVParallelLinear) and point.take != "part.0" else "column"
        elif point.hook == "input" and isinstance(mod, RowParallelLinear) and mod.input_is_parallel:
            kinds[tap] = "column"
        elif point.hook == "output" and isinstance(mod, RowParallelLinear):
            kinds[tap] = "row" if mod.reduce_results or mod.tp_size == 1 else "partial"
    for tap, point, path in plan:
        layer, inputs = layer_of(tap), None
        if layer is not None and tap not in kinds and not isinstance(modules.get(path), LinearBase):
            inputs = arch.layer_inputs.get(tap.split(".", 2)[2], ())
        if inputs and len(inputs) == 1 and kinds.get(f"layers.{layer}.{inputs[0]}", "").startswith("column"):
            kinds[tap] = kinds[f"layers.{layer}.{inputs[0]}"]
    return kinds


def _fused(arch: Architecture, packed: dict, num_layers: int) -> dict[str, list[str]]:
    """Each tap of a fused vLLM layer -> every tap of that layer, in the order of its output's slices."""
    out = {}
    for group in arch.fused_groups(packed):
        for i in range(num_layers):
            concrete = [t.format(i=i) for t in group]
            out.update({t: concrete for t in concrete})
    return out


def _install_worker(worker, capture_id: str, arch: Architecture, out: str, prompt_lens: list[int],
                    taps: list[str] | None, meta: dict, isolate_from: list[str] | None = None,
                    forced: list[list[int]] | None = None) -> dict:
    """Runs in each worker: hook the model, stream this rank's taps to ``out/rank{r}`` (decode step s's to
    ``out/step{s}/rank{r}``).

    With ``isolate_from`` (the reference's dump directories: the prefill's, then each decode step's) every
    decoder layer is fed the reference's input for that layer, so each layer's error is its own; ``forced``:
    the tokens its decode steps run.
    """
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    rank = get_tensor_model_parallel_rank()
    runner = worker.model_runner
    model = runner.get_model()
    rows = _StepRows(runner, prompt_lens, forced)
    writer = DumpWriter(Path(out) / f"rank{rank}", {**meta, "rank": rank})
    step_writers: dict[int, DumpWriter] = {}

    def step_writer(step: int) -> DumpWriter:
        if step not in step_writers:
            step_writers[step] = DumpWriter(Path(out) / f"step{step}" / f"rank{rank}",
                                            {**meta, "rank": rank, "decode_step": step})
        return step_writers[step]
    wanted = set(taps) if taps is not None else None
    attn = model.model.layers[0].self_attn
    packed = dict(getattr(model, "packed_modules_mapping", {}))
    num_layers = model.config.num_hidden_layers
    points = arch.serving_points(packed)
    rec = Recorder(model, points, num_layers, writer,
                   wanted=lambda t: t != "logits" and (wanted is None or t in wanted), step_writer=step_writer)
    rec.rows = rows

    def begin(mod, args):
        rows.begin()
        return rows.force(args)
    # The compiled-model decorator calls LlamaModel around nn.Module.__call__, so its own hooks never
    # fire: the step starts at the embedding, and positions are the first decoder layer's argument.
    handles = [model.model.embed_tokens.register_forward_pre_hook(begin),
               model.model.layers[0].register_forward_pre_hook(lambda mod, args: rows.check_positions(args[0]))]
    if isolate_from is not None:
        ref = _Phases(isolate_from)
        for i, layer in enumerate(model.model.layers):
            handles.append(layer.register_forward_pre_hook(_feed_reference(ref, i, rows)))
    rec.install()
    kernels = _Kernels(model, rec.plan, rows)
    handles += kernels.install()
    if isolate_from is not None:  # after the recorder's hooks: a projection's input tap is the candidate's own
        handles += _feed_projections(model, rec.plan, arch, ref, rows, rank, get_tensor_model_parallel_world_size())
    if wanted is None or "logits" in wanted:
        def logits(mod, args, out):
            if rows.spans:
                hidden = out[0] if isinstance(out, tuple) else out
                if arch.logits_divisor is not None:
                    hidden = hidden / getattr(model, arch.logits_divisor)
                full = model.compute_logits(hidden)
                if full is not None:  # ranks other than 0 may get None from the gather
                    rec._capture("logits", full)
        handles.append(model.model.norm.register_forward_hook(logits))
    _ACTIVE[capture_id] = {"rec": rec, "handles": handles, "writers": [writer, step_writers], "rows": rows,
                           "kernels": kernels}
    # kv heads of this rank, and of the model (MiniCPM3's latent attention has a kv head per head)
    kv_heads = getattr(attn, "num_kv_heads", None) or attn.attn.num_kv_heads
    total_kv_heads = getattr(attn, "total_num_kv_heads", None) or kv_heads * get_tensor_model_parallel_world_size()
    return {"rank": rank, "kv_heads": kv_heads, "total_kv_heads": total_kv_heads,
            "parallel": _parallel(model, expand(points, num_layers), arch), "fused": _fused(arch, packed, num_layers)}


class _Phases:
    """The reference's dumps by phase: ``[None]`` the prefill's, ``[s]`` decode step s's."""

    def __init__(self, roots: list[str]):
        self.readers = [DumpReader(r) for r in roots]

    def __getitem__(self, step: int | None) -> DumpReader:
        return self.readers[0 if step is None else 1 + step]

    def taps(self) -> list[str]:
        return self.readers[0].taps()


class _Kernels:
    """Which kernel computed each tap, by phase: the serving method's own choice for the rows of each call, where
    the method reports it (``quant_method.kernel_for(layer, rows, dtype)``; ``kernels(layer, dtype)``: every
    kernel it may choose)."""

    def __init__(self, model, plan, rows: _StepRows):
        self.modules, self.rows = dict(model.named_modules()), rows
        self.taps_of: dict[str, list[str]] = {}  # module -> the taps its output gives
        for tap, point, path in plan:
            method = getattr(self.modules.get(path), "quant_method", None)
            if point.hook == "output" and callable(getattr(method, "kernel_for", None)):
                self.taps_of.setdefault(path, []).append(tap)
        self.used: dict[int | None, dict[str, set[str]]] = {}  # decode step (None: prefill) -> tap -> kernels
        self.possible: dict[str, list[str]] = {}

    def install(self) -> list:
        handles = []
        for path, taps in self.taps_of.items():
            def pre(mod, args, taps=taps):
                if not self.rows.spans:
                    return
                x, method = args[0], mod.quant_method
                kernel = method.kernel_for(mod, x.reshape(-1, x.shape[-1]).shape[0], x.dtype)
                for step in {step for *_, step in self.rows.spans}:  # the call's rows: every phase in this forward
                    for t in taps:
                        self.used.setdefault(step, {}).setdefault(t, set()).add(kernel)
                for t in taps:
                    if t not in self.possible:
                        self.possible[t] = list(method.kernels(mod, x.dtype) if hasattr(method, "kernels") else ())
            handles.append(self.modules[path].register_forward_pre_hook(pre))
        return handles

    def of(self, step: int | None) -> dict[str, list[str]]:
        return {t: sorted(k) for t, k in self.used.get(step, {}).items()}


def _feed_reference(ref: _Phases, layer: int, rows: _StepRows):
    """A pre-hook giving decoder layer ``layer`` the reference's input, residual folded in (None)."""
    def hook(mod, args):
        positions, hidden = args[0], args[1]
        if not rows.spans:
            return None
        fed = (hidden if args[2] is None else hidden + args[2]).clone()
        for p, s, e, step in rows.spans:
            fed[s:e] = ref[step].get(f"layers.{layer}.input", p).to(fed.dtype)
        return (positions, fed, None, *args[3:])
    return hook


def _feed_projections(model, plan, arch: Architecture, ref: _Phases, rows: _StepRows, rank: int, world: int):
    """Pre-hooks giving every projection the reference's input for it (the one tap it reads), so that a format
    that quantizes activations quantizes the same values on both sides: each op's error is its own, not a
    code flipped by the error of the op before it."""
    from vllm.model_executor.layers.linear import LinearBase, RowParallelLinear

    modules, handles, done = dict(model.named_modules()), [], set()
    for tap, point, path in plan:
        mod, layer = modules.get(path), layer_of(tap)
        if point.hook != "output" or layer is None or path in done or not isinstance(mod, LinearBase):
            continue
        inputs = arch.layer_inputs.get(tap.split(".", 2)[2], ())
        source = f"layers.{layer}.{inputs[0]}" if len(inputs) == 1 else None
        if source is None or source not in ref.taps():
            continue
        done.add(path)
        sharded = isinstance(mod, RowParallelLinear) and mod.input_is_parallel and world > 1
        handles.append(mod.register_forward_pre_hook(_feed_input(ref, source, rows, rank if sharded else None,
                                                                 world)))
    return handles


def _feed_input(ref: _Phases, source: str, rows: _StepRows, rank: int | None, world: int):
    """A pre-hook replacing a projection's input rows with the reference's ``source`` tap (this rank's
    slice of its features when the projection's input is sharded); left alone where the shapes differ."""
    def hook(mod, args):
        if not rows.spans:
            return None
        x = args[0]
        fed = x.clone()
        for p, s, e, step in rows.spans:
            r = ref[step].get(source, p)
            if rank is not None:
                width = r.shape[-1] // world
                r = r[..., rank * width:(rank + 1) * width]
            if tuple(r.shape) != tuple(fed[s:e].shape):
                return None
            fed[s:e] = r.to(fed.dtype)
        return (fed, *args[1:])
    return hook


def _finish_worker(worker, capture_id: str) -> dict:
    state = _ACTIVE.pop(capture_id)
    rec: Recorder = state["rec"]
    rec.flush()
    rec.remove()
    for h in state["handles"]:
        h.remove()
    writer, step_writers = state["writers"]
    for w in [writer, *step_writers.values()]:
        w.close()
    kernels: _Kernels = state["kernels"]
    return {"seen": sorted(rec.seen), "planned": [t for t, _, _ in rec.plan], "forwards": state["rows"].forwards,
            "kernels": {step: kernels.of(step) for step in kernels.used}, "kernel_branches": kernels.possible}


def capture(llm, arch: Architecture, prompts: list[list[int]], out: str | Path, meta: dict | None = None,
            taps: list[str] | None = None, isolate_from: list[DumpReader] | None = None, decode_steps: int = 0,
            forced: list[list[int]] | None = None) -> DumpReader:
    """Run every prompt through ``llm``, its prefill and ``decode_steps`` greedy decode steps, and dump its taps
    (``taps`` None: all of them); decode step s's dump is at ``dumps.step_dir(out, s)``, the generated tokens in
    the manifest's ``decode``. ``isolate_from``: the reference's dumps (the prefill's, then each step's), each
    decoder layer fed their input for it; ``forced``: the tokens the decode steps run (per prompt)."""
    from vllm import SamplingParams

    out = Path(out)
    ranks_dir = out.parent / f".{out.name}.ranks"
    shutil.rmtree(ranks_dir, ignore_errors=True)
    capture_id = f"{out}"
    meta = dict(meta or {})
    iso = [str(r.root) for r in isolate_from] if isolate_from is not None else None
    if iso is not None and len(iso) < 1 + decode_steps:
        raise ValueError(f"isolating {decode_steps} decode steps needs the reference's dump of each")
    infos = llm.collective_rpc(_install_worker, args=(capture_id, arch, str(ranks_dir), [len(p) for p in prompts],
                                                      taps, meta, iso, forced))
    world = len(infos)
    # with fewer kv heads than ranks, consecutive ranks hold the same kv head
    kv_step = max(1, world // max(1, infos[0]["total_kv_heads"]))
    tokens: dict[int, list[int]] = {}
    try:
        # the last sampled token is never run: decode step s runs the token sampled after step s-1
        params = SamplingParams(max_tokens=1 + decode_steps, temperature=0.0, detokenize=False, ignore_eos=True)
        engine = llm.llm_engine
        for p, ids in enumerate(prompts):
            engine.add_request(f"parity-{p}", {"prompt_token_ids": list(ids)}, params)
        while engine.has_unfinished_requests():
            for o in engine.step():
                m = REQUEST.match(str(o.request_id))
                if m is not None:
                    tokens[int(m.group(1))] = list(o.outputs[0].token_ids)
    finally:
        states = llm.collective_rpc(_finish_worker, args=(capture_id,))
    ran = {int(p): n for p, n in states[0]["forwards"].items()}
    short = [p for p in range(len(prompts)) if ran.get(p, 0) != 1 + decode_steps]
    if short:
        raise RuntimeError(f"prompts {short[:5]} ran {[ran.get(p, 0) for p in short[:5]]} forwards, not the prefill "
                           f"and {decode_steps} decode step(s)")
    seen = set().union(*(set(s["seen"]) for s in states))
    planned = states[0]["planned"] + ([] if taps is not None and "logits" not in taps else ["logits"])
    missing = [t for t in planned if t not in seen]
    if missing:
        raise RuntimeError(f"taps never fired in vLLM: {missing[:5]} (hooks need enforce_eager=True)")
    gathered = {**meta, "side": meta.get("side", "candidate"), "tensor_parallel_size": world,
                "parallel": infos[0]["parallel"], "fused": infos[0]["fused"]}
    used = states[0]["kernels"]  # every rank runs the same kernels
    if used:
        gathered["kernel_branches"] = states[0]["kernel_branches"]
    if decode_steps:
        gathered["decode"] = {"steps": decode_steps, "tokens": [tokens[p][:decode_steps] for p in range(len(prompts))]}
    _gather_ranks(ranks_dir, out, world, kv_step, {**gathered, **({"kernels": used[None]} if None in used else {})})
    for s in range(decode_steps):
        _gather_ranks(ranks_dir / f"step{s}", step_dir(out, s), world, kv_step,
                      {**gathered, "decode_step": s, "first_positions": [len(ids) + s for ids in prompts],
                       **({"kernels": used[s]} if s in used else {})})
    shutil.rmtree(ranks_dir, ignore_errors=True)
    return DumpReader(out)


def _gather_ranks(ranks_dir: Path, out: Path, world: int, kv_step: int, meta: dict) -> None:
    """One dump from the ranks' dumps, a layer group at a time."""
    readers = [DumpReader(ranks_dir / f"rank{r}") for r in range(world)]
    writer = DumpWriter(out, meta)
    by_group: dict[str, dict[str, torch.Tensor]] = {}
    for tap in readers[0].taps():
        group = ".".join(tap.split(".")[:2]) if tap.startswith("layers.") else tap
        how = meta["parallel"].get(tap, "replicated")
        for p in readers[0].prompts(tap):
            if how.startswith("column") and world > 1:
                ranks = readers[::kv_step] if how == "column_kv" else readers
                t = torch.cat([r.get(tap, p) for r in ranks], dim=-1)
            elif how == "partial" and world > 1:
                t = torch.stack([r.get(tap, p) for r in readers]).sum(dim=0)
            else:
                t = readers[0].get(tap, p)
            by_group.setdefault(group, {})[key(tap, p)] = t
        if len(by_group) > 1:  # a group is complete once the next one starts
            first = next(iter(by_group))
            writer.write(first, by_group.pop(first))
    for group, tensors in by_group.items():
        writer.write(group, tensors)
    writer.close()
