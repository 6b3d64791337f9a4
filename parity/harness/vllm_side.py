"""Dumping the taps of the real vLLM engine, aligned with the reference as (prompt, position, features).

Hooks are installed where the model lives, in every worker, through ``collective_rpc`` with the
module-level functions below (importable, so they reach spawned tensor-parallel workers and the
multiprocess engine as well as the in-process one). Each rank streams its taps to its own dump; the
parent then gathers the ranks: column-parallel outputs are concatenated along features, everything
else (replicated, or row-parallel and already reduced) is taken from rank 0.

vLLM flattens every scheduled token of a step into one batch. Rows are mapped back from the step's
own metadata, never from an assumed order: ``query_start_loc`` of the attention metadata splits the
batch into requests, the model runner's ``input_batch.req_ids`` names them (our request ids carry
the prompt index), and each request's positions are those the runner prepared for the forward (checked
against the first decoder layer's ``positions`` argument). Rows below the prompt's length are its prefill, one
row at ``len(prompt) + s`` its decode step ``s``. By default the engine runs with prefix caching and chunked
prefill off (``vllm_parity.harness.engine``) and each prefill must be one full forward (checked, not trusted);
with chunked prefill on, a prefill's chunks are held per tap until its last one and dumped whole; with prefix
caching on, a warming pass runs each prompt's prefill first, and the recorded pass's prefill, computing only the
positions the cache does not serve, is completed with the warming pass's rows for the served ones.

Scheduling: the requests run in waves (``plan_waves``), all at once unless another grouping of the prompts takes
a kernel branch the serving methods report (``kernel_for`` probed over row counts for each branch's rows) that one
batch leaves untaken; why any branch stays untaken is kept in the manifest (``kernel_untaken``).

Decode steps: step ``s``'s rows go to a dump of their own (``dumps.step_dir``), each prompt's one row at position
``len(prompt) + s``. The tokens the engine generated are kept in the
manifest (``decode``): the reference runs over them, and an isolated run is made to decode the same ones.

The ``logits`` tap: vLLM computes logits only for sampled positions, so the tap applies the model's
own ``compute_logits`` (logits processor + lm_head, the path vLLM samples from) to every position's
final hidden state inside the same forward.
"""

from __future__ import annotations

import pickle
import re
import shutil
from pathlib import Path
from typing import NamedTuple

import torch

from vllm_parity.harness.dumps import DumpReader, DumpWriter, key, step_dir
from vllm_parity.harness.recorder import Recorder
from vllm_parity.harness.schedule import kernel_ranges, merge, plan_waves, row_counts, splits, why_untaken
from vllm_parity.architectures import Architecture
from vllm_parity.harness.taps import expand, layer_of

REQUEST = re.compile(r"^parity-(\d+)(-warm)?(?:-|$)")  # ours; "-warm": the pass warming the prefix cache
WARM = "warm"  # the dump slot of the warming pass's rows
_ACTIVE: dict[str, dict] = {}  # per worker process: capture id -> its recorder and hooks


class _Span(NamedTuple):
    """One request's rows in the current forward."""

    prompt: int
    start: int  # its rows of the forward's batch
    end: int
    step: int | None  # decode step; None: the prefill, or a chunk of it
    first: int  # the position of its first row
    warm: bool  # the cache-warming pass (prefix caching): its rows fill the positions served from the cache later


class _StepRows:
    """Maps the token rows of the current forward to (prompt, positions) and the phase, from the step's metadata:
    rows at positions below the prompt's length are its prefill (the whole prompt, a chunk of it, or the part the
    prefix cache did not serve), one row at position ``len(prompt) + s`` is decode step s. ``forced``: per prompt,
    the token each decode step is made to run (an isolated run decodes the propagated run's tokens, whatever it
    sampled itself). ``chunked`` / ``cached``: whether the engine may split a prefill over forwards / serve a
    prompt's first blocks from its prefix cache (else each prefill must be one full forward)."""

    def __init__(self, runner, prompt_lens: list[int], forced: list[list[int]] | None = None,
                 chunked: bool = False, cached: bool = False):
        self.runner = runner
        self.prompt_lens = prompt_lens
        self.forced = forced
        self.chunked, self.cached = chunked, cached
        self.spans: list[_Span] | None = None
        self.tap: str | None = None  # the tap being captured (set by the recorder)
        self.next: dict[tuple[int, bool], int] = {}  # (prompt, warm) -> the position its next prefill row must have
        self.prefills: dict[int, int] = {}  # prompt -> complete prefills of the recorded pass
        self.decodes: dict[int, list[int]] = {}  # prompt -> decode steps run, in order
        self.first_computed: dict[int, int] = {}  # prompt -> first position its recorded prefill computed
        self.pieces: dict[int, int] = {}  # prompt -> forwards its recorded prefill ran in
        self.chunks: dict[tuple[str, int, bool], list[torch.Tensor]] = {}  # a prefill's rows so far, per tap

    def begin(self) -> None:
        """At the step's first module (the embedding): split rows by request from the metadata, each request's
        first position from the positions the runner prepared for this forward."""
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
        positions = self.runner.positions
        spans = []
        for r, rid in enumerate(req_ids):
            m = REQUEST.match(str(rid))
            if m is None:
                continue
            p, warm, s, e = int(m.group(1)), m.group(2) is not None, qsl[r], qsl[r + 1]
            pos = int(positions[s])
            length = self.prompt_lens[p]
            span = _Span(p, s, e, None if pos < length else pos - length, pos, warm)
            self._check(span)
            spans.append(span)
        self.spans = spans

    def _check(self, span: _Span) -> None:
        """The span continues its request as the engine's settings allow: a prefill whole (or in chunks, or after
        a cached prefix), then decode steps 0, 1, ... one row each."""
        p, n, length = span.prompt, span.end - span.start, self.prompt_lens[span.prompt]
        if span.step is not None:
            done = self.decodes.setdefault(p, [])
            if n != 1 or span.step != len(done) or span.warm:
                raise RuntimeError(f"prompt {p} was not run as decode step {len(done)} at position "
                                   f"{length + len(done)} ({n} rows from position {span.first}): speculative "
                                   f"decoding is on")
            done.append(span.step)
            return
        want = self.next.get((p, span.warm), 0)
        if span.warm and want == 0 and span.first > 0:
            raise RuntimeError(f"prompt {p}: the warming pass found its first {span.first} positions cached; "
                               f"with prefix caching on, prompts must not share a prefix of a whole KV block (the "
                               f"positions it serves are taken from the prompt's own warming pass)")
        resumed = span.first > want and want == 0 and self.cached and not span.warm
        if span.first != want and not resumed or (not self.chunked and span.first + n != length):
            what = "prefill" if span.warm else "one full prefill"
            allowed = [w for w, on in (("chunked prefill", self.chunked), ("prefix caching", self.cached)) if on]
            raise RuntimeError(
                f"prompt {p} was not run as {what} ({n} rows from position {span.first}, expected from {want}, of "
                f"{length} tokens): {' and '.join(allowed) or 'no engine feature'} on here, but the engine split "
                f"or skipped it otherwise (speculative decoding, or an engine setting the run did not make)")
        if not span.warm:
            self.pieces[p] = self.pieces.get(p, 0) + 1
        if want == 0 and not span.warm:
            self.first_computed[p] = span.first
        self.next[(p, span.warm)] = span.first + n
        if span.first + n == length and not span.warm:
            self.prefills[p] = self.prefills.get(p, 0) + 1

    def force(self, args: tuple):
        """The embedding's arguments with each decode row's token replaced by the forced one (None: unchanged)."""
        if not self.forced or not self.spans or not any(sp.step is not None for sp in self.spans):
            return None
        ids = args[0].clone()
        for sp in self.spans:
            if sp.step is not None:
                ids[sp.start:sp.end] = self.forced[sp.prompt][sp.step]
        return (ids, *args[1:])

    def check_positions(self, positions: torch.Tensor) -> None:
        """At the first decoder layer: the positions the rows ran at are those the spans were told."""
        for sp in self.spans or ():
            pos = positions[sp.start:sp.end].cpu()
            want = torch.arange(sp.first, sp.first + sp.end - sp.start, dtype=pos.dtype)
            if not torch.equal(pos, want):
                raise RuntimeError(f"prompt {sp.prompt}: rows ran at positions {pos[:3].tolist()}…, the runner "
                                   f"prepared {want[:3].tolist()}…")

    def __call__(self, t: torch.Tensor) -> dict[int | tuple, torch.Tensor]:
        """The rows of ``t`` by dump slot: a prompt (its prefill), (step, prompt) for a decode step, (WARM,
        prompt) for the warming pass. A prefill run in chunks is held until its last chunk, then given whole."""
        if not self.spans:
            return {}
        out = {}
        for sp in self.spans:
            rows = t[sp.start:sp.end]
            if sp.step is not None:
                out[(sp.step, sp.prompt)] = rows
                continue
            slot = (WARM, sp.prompt) if sp.warm else sp.prompt
            held = self.chunks.pop((self.tap, sp.prompt, sp.warm), [])
            if sp.first + len(rows) < self.prompt_lens[sp.prompt]:
                self.chunks[(self.tap, sp.prompt, sp.warm)] = [*held, rows.clone()]
            else:
                out[slot] = torch.cat([*held, rows]) if held else rows
        return out

    def reference_rows(self, ref: torch.Tensor, sp: _Span) -> torch.Tensor:
        """The rows of the reference's tensor (of the span's phase) the span computed."""
        return ref if sp.step is not None else ref[sp.first:sp.first + sp.end - sp.start]


class _TapRecorder(Recorder):
    """The recorder telling the row map which tap it captures (a chunk is held per tap)."""

    def _capture(self, tap: str, tensor: torch.Tensor) -> None:
        self.rows.tap = tap
        super()._capture(tap, tensor)


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


def _install_worker(worker, capture_id: str, arch: bytes, out: str, prompt_lens: list[int],
                    taps: list[str] | None, meta: dict, isolate_from: list[str] | None = None,
                    forced: list[list[int]] | None = None, features: tuple[bool, bool] = (False, False)) -> dict:
    """Runs in each worker: hook the model, stream this rank's taps to ``out/rank{r}`` (decode step s's to
    ``out/step{s}/rank{r}``, the cache-warming pass's to ``out/warm/rank{r}``).

    ``arch``: the architecture, pickled (vLLM's multiprocess engine sends arguments as msgpack, which turns a
    dataclass into a dict; a name would miss an architecture registered in the parent process only). With
    ``isolate_from`` (the reference's dump directories: the prefill's, then each decode step's) every decoder
    layer is fed the reference's input for that layer, so each layer's error is its own; ``forced``: the tokens
    its decode steps run; ``features``: (chunked prefill, prefix caching) on in the engine.
    """
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    arch: Architecture = pickle.loads(arch)
    rank = get_tensor_model_parallel_rank()
    runner = worker.model_runner
    model = runner.get_model()
    rows = _StepRows(runner, prompt_lens, forced, *features)
    writer = DumpWriter(Path(out) / f"rank{rank}", {**meta, "rank": rank})
    step_writers: dict[int | str, DumpWriter] = {}

    def step_writer(step: int | str) -> DumpWriter:
        if step not in step_writers:
            where, extra = (WARM, {}) if step == WARM else (f"step{step}", {"decode_step": step})
            step_writers[step] = DumpWriter(Path(out) / where / f"rank{rank}", {**meta, "rank": rank, **extra})
        return step_writers[step]
    wanted = set(taps) if taps is not None else None
    attn = model.model.layers[0].self_attn
    packed = dict(getattr(model, "packed_modules_mapping", {}))
    num_layers = model.config.num_hidden_layers
    points = arch.serving_points(packed)
    rec = _TapRecorder(model, points, num_layers, writer,
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
    kernels = _Kernels(model, rec.plan, rows, runner.dtype)
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

    def __init__(self, model, plan, rows: _StepRows, dtype: torch.dtype):
        self.modules, self.rows, self.dtype = dict(model.named_modules()), rows, dtype
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
                for step in {sp.step for sp in self.rows.spans}:  # the call's rows: every phase in this forward
                    for t in taps:
                        self.used.setdefault(step, {}).setdefault(t, set()).add(kernel)
                for t in taps:
                    if t not in self.possible:
                        self.possible[t] = list(method.kernels(mod, x.dtype) if hasattr(method, "kernels") else ())
            handles.append(self.modules[path].register_forward_pre_hook(pre))
        return handles

    def of(self, step: int | None) -> dict[str, list[str]]:
        return {t: sorted(k) for t, k in self.used.get(step, {}).items()}

    def probe(self) -> dict:
        """What the methods would choose: ``ranges``, per kernel the row counts (``[first, last]``, last None: no
        end) where some layer takes it; ``possible``, every kernel the methods list."""
        layers = [self.modules[path] for path in self.taps_of]
        possible: dict[str, None] = {}
        ranges: dict[str, list[list[int | None]]] = {}
        for mod in layers:
            method = mod.quant_method
            possible.update(dict.fromkeys(method.kernels(mod, self.dtype) if hasattr(method, "kernels") else ()))
            for k, first, last in kernel_ranges(lambda m: method.kernel_for(mod, m, self.dtype)):
                ranges.setdefault(k, []).append([first, last])
        return {"ranges": {k: merge(r) for k, r in ranges.items()}, "possible": list(possible)}


def _feed_reference(ref: _Phases, layer: int, rows: _StepRows):
    """A pre-hook giving decoder layer ``layer`` the reference's input, residual folded in (None)."""
    def hook(mod, args):
        positions, hidden = args[0], args[1]
        if not rows.spans:
            return None
        fed = (hidden if args[2] is None else hidden + args[2]).clone()
        for sp in rows.spans:
            fed[sp.start:sp.end] = rows.reference_rows(ref[sp.step].get(f"layers.{layer}.input", sp.prompt), sp).to(
                fed.dtype)
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
        for sp in rows.spans:
            r = rows.reference_rows(ref[sp.step].get(source, sp.prompt), sp)
            if rank is not None:
                width = r.shape[-1] // world
                r = r[..., rank * width:(rank + 1) * width]
            if tuple(r.shape) != tuple(fed[sp.start:sp.end].shape):
                return None
            fed[sp.start:sp.end] = r.to(fed.dtype)
        return (fed, *args[1:])
    return hook


def _probe_worker(worker, capture_id: str) -> dict:
    return _ACTIVE[capture_id]["kernels"].probe()


def _finish_worker(worker, capture_id: str) -> dict:
    """Unhook, close this rank's dumps; what ran, with plain keys (the multiprocess engine sends it as msgpack)."""
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
    rows: _StepRows = state["rows"]
    return {"seen": sorted(rec.seen), "planned": [t for t, _, _ in rec.plan],
            "prefills": [[p, n] for p, n in rows.prefills.items()],
            "decodes": [[p, d] for p, d in rows.decodes.items()],
            "first_computed": [[p, f] for p, f in rows.first_computed.items()],
            "pieces": [[p, n] for p, n in rows.pieces.items()],
            "held": sorted({f"{p}" for _, p, _ in rows.chunks}),
            "kernels": [[step, kernels.of(step)] for step in kernels.used], "kernel_branches": kernels.possible}


def capture(llm, arch: Architecture, prompts: list[list[int]], out: str | Path, meta: dict | None = None,
            taps: list[str] | None = None, isolate_from: list[DumpReader] | None = None, decode_steps: int = 0,
            forced: list[list[int]] | None = None) -> DumpReader:
    """Run every prompt through ``llm``, its prefill and ``decode_steps`` greedy decode steps, and dump its taps
    (``taps`` None: all of them); decode step s's dump is at ``dumps.step_dir(out, s)``, the generated tokens in
    the manifest's ``decode``. ``isolate_from``: the reference's dumps (the prefill's, then each step's), each
    decoder layer fed their input for it; ``forced``: the tokens the decode steps run (per prompt).

    The requests run in waves (``plan_waves``): all at once, unless another grouping takes a kernel branch of
    the serving methods that one batch leaves untaken (the manifest's ``waves``; ``kernel_untaken``: why each
    branch no forward took was not taken). With the engine's prefix caching on, every prompt first runs
    through a warming pass (its prefill only); the recorded pass then computes only what the cache does not
    serve, and its prefill's cached positions are taken from the warming pass (``prefix_cached``: how many); with
    chunked prefill on, a prefill run in several forwards is assembled (``prefill_chunks``: in how many)."""
    from vllm import SamplingParams

    out = Path(out)
    ranks_dir = out.parent / f".{out.name}.ranks"
    shutil.rmtree(ranks_dir, ignore_errors=True)
    capture_id = f"{out}"
    meta = dict(meta or {})
    iso = [str(r.root) for r in isolate_from] if isolate_from is not None else None
    if iso is not None and len(iso) < 1 + decode_steps:
        raise ValueError(f"isolating {decode_steps} decode steps needs the reference's dump of each")
    lens = [len(p) for p in prompts]
    config = llm.llm_engine.vllm_config
    chunked = bool(config.scheduler_config.enable_chunked_prefill)
    cached = bool(config.cache_config.enable_prefix_caching)
    chunk = int(config.scheduler_config.max_num_batched_tokens) if chunked else None
    infos = llm.collective_rpc(_install_worker, args=(capture_id, pickle.dumps(arch), str(ranks_dir), lens, taps, meta,
                                                      iso, forced, (chunked, cached)))
    world = len(infos)
    # with fewer kv heads than ranks, consecutive ranks hold the same kv head
    kv_step = max(1, world // max(1, infos[0]["total_kv_heads"]))
    tokens: dict[int, list[int]] = {}
    untaken: dict[str, str] = {}
    try:
        probe = llm.collective_rpc(_probe_worker, args=(capture_id,))[0]

        def kernels_at(m: int) -> set[str]:
            m = min(m, chunk) if chunk else m  # a step runs at most its token budget
            return {k for k, ranges in probe["ranges"].items()
                    if any(first <= m and (last is None or m <= last) for first, last in ranges)}
        waves, taken = plan_waves(lens, decode_steps, kernels_at, probe["possible"])
        missed = [k for k in probe["possible"] if k not in taken]
        if missed:
            counts = set().union(*(row_counts(w, lens, decode_steps) for w in splits(len(prompts), lens)))
            counts = {min(m, chunk) for m in counts} if chunk else counts
            untaken = {k: why_untaken(k, probe["ranges"].get(k, []), lens, decode_steps, counts, chunk) for k in missed}
        engine = llm.llm_engine
        if cached:  # the warming pass: every prompt's prefill, so that the recorded pass finds its blocks cached
            # computed by this capture (an earlier one's, or the propagated run's under an isolated one, are not)
            if not llm.reset_prefix_cache():
                raise RuntimeError("vLLM did not empty its prefix cache before the warming pass")
            warm = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, ignore_eos=True)
            for p, ids in enumerate(prompts):
                engine.add_request(f"parity-{p}-warm", {"prompt_token_ids": list(ids)}, warm)
            _drain(engine, {})
        # the last sampled token is never run: decode step s runs the token sampled after step s-1
        params = SamplingParams(max_tokens=1 + decode_steps, temperature=0.0, detokenize=False, ignore_eos=True)
        for wave in waves:
            for p in wave:
                engine.add_request(f"parity-{p}", {"prompt_token_ids": list(prompts[p])}, params)
            _drain(engine, tokens)
    finally:
        states = llm.collective_rpc(_finish_worker, args=(capture_id,))
    state = states[0]
    prefills, decodes = dict(map(tuple, state["prefills"])), dict(map(tuple, state["decodes"]))
    short = [p for p in range(len(prompts))
             if prefills.get(p, 0) != 1 or list(decodes.get(p, [])) != list(range(decode_steps))]
    if short:
        raise RuntimeError(f"prompts {short[:5]} ran {[prefills.get(p, 0) for p in short[:5]]} prefill(s) and decode "
                           f"steps {[list(decodes.get(p, [])) for p in short[:5]]}, not one prefill and "
                           f"{decode_steps} decode step(s)")
    if state["held"]:
        raise RuntimeError(f"prompts {state['held']}: a prefill's last chunk never ran")
    seen = set().union(*(set(s["seen"]) for s in states))
    planned = state["planned"] + ([] if taps is not None and "logits" not in taps else ["logits"])
    missing = [t for t in planned if t not in seen]
    if missing:
        raise RuntimeError(f"taps never fired in vLLM: {missing[:5]} (hooks need enforce_eager=True)")
    gathered = {**meta, "side": meta.get("side", "candidate"), "tensor_parallel_size": world,
                "parallel": infos[0]["parallel"], "fused": infos[0]["fused"], "waves": waves,
                "engine_features": {"chunked_prefill": chunk or 0, "prefix_caching": cached}}
    used = {step: k for step, k in state["kernels"]}  # every rank runs the same kernels
    if used:
        gathered["kernel_branches"] = state["kernel_branches"]
        gathered["kernel_untaken"] = untaken
    if decode_steps:
        gathered["decode"] = {"steps": decode_steps, "tokens": [tokens[p][:decode_steps] for p in range(len(prompts))]}
    if chunked:
        pieces = dict(map(tuple, state["pieces"]))
        gathered["prefill_chunks"] = [int(pieces.get(p, 0)) for p in range(len(prompts))]
    head = None
    if cached:
        first = dict(map(tuple, state["first_computed"]))
        gathered["prefix_cached"] = [int(first.get(p, 0)) for p in range(len(prompts))]
        _gather_ranks(ranks_dir / WARM, ranks_dir / "warm-gathered", world, kv_step, gathered)
        head = DumpReader(ranks_dir / "warm-gathered")
    _gather_ranks(ranks_dir, out, world, kv_step, {**gathered, **({"kernels": used[None]} if None in used else {})},
                  head=head, lens=lens)
    for s in range(decode_steps):
        _gather_ranks(ranks_dir / f"step{s}", step_dir(out, s), world, kv_step,
                      {**gathered, "decode_step": s, "first_positions": [len(ids) + s for ids in prompts],
                       **({"kernels": used[s]} if s in used else {})})
    shutil.rmtree(ranks_dir, ignore_errors=True)
    return DumpReader(out)


def _drain(engine, tokens: dict[int, list[int]]) -> None:
    """Step the engine until its requests finish; our requests' generated tokens into ``tokens``."""
    while engine.has_unfinished_requests():
        for o in engine.step():
            m = REQUEST.match(str(o.request_id))
            if m is not None and m.group(2) is None:
                tokens[int(m.group(1))] = list(o.outputs[0].token_ids)


def _gather_ranks(ranks_dir: Path, out: Path, world: int, kv_step: int, meta: dict, head: DumpReader | None = None,
                  lens: list[int] | None = None) -> None:
    """One dump from the ranks' dumps, a layer group at a time; ``head``: where a prompt's rows start after its
    first position (the prefix its cache served), those first rows are taken from it (``lens``: prompt lengths)."""
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
            if head is not None and t.shape[0] < lens[p]:
                t = torch.cat([head.get(tap, p)[:lens[p] - t.shape[0]], t])
            by_group.setdefault(group, {})[key(tap, p)] = t
        if len(by_group) > 1:  # a group is complete once the next one starts
            first = next(iter(by_group))
            writer.write(first, by_group.pop(first))
    for group, tensors in by_group.items():
        writer.write(group, tensors)
    writer.close()
