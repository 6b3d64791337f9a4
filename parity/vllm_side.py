"""Dumping the taps of the real vLLM engine, aligned with the reference as (prompt, position, features).

vLLM flattens every scheduled token of a step into one batch. Rows are mapped back from the step's
own metadata, never from an assumed order: ``query_start_loc`` of the attention metadata splits the
batch into requests, the model runner's ``input_batch.req_ids`` names them (our request ids carry
the prompt index), and the positions come from the model's own ``positions`` argument. The engine
runs with prefix caching and chunked prefill off (``kernels.vllm_engine``), so each prompt is one
full forward, which is checked here rather than trusted.

The ``logits`` tap: vLLM computes logits only for sampled positions, so the tap applies the model's
own ``compute_logits`` (logits processor + lm_head, the path vLLM samples from) to every position's
final hidden state inside the same forward.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

import torch

from parity.dumps import DumpReader, DumpWriter
from parity.recorder import Recorder
from parity.taps import VLLM_LLAMA

REQUEST = re.compile(r"^parity-(\d+)(?:-|$)")


class _StepRows:
    """Maps the token rows of the current forward to (prompt, positions)."""

    def __init__(self, runner, prompt_lens: list[int]):
        self.runner = runner
        self.prompt_lens = prompt_lens
        self.positions: torch.Tensor | None = None
        self.spans: list[tuple[int, int, int]] | None = None  # (prompt, start row, end row)

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
            if m is None:
                continue  # not one of ours
            spans.append((int(m.group(1)), qsl[r], qsl[r + 1]))
        self.spans = spans

    def check_positions(self, positions: torch.Tensor) -> None:
        """At the first decoder layer: every prompt must be one full prefill, positions 0..T-1."""
        for prompt, start, end in self.spans or ():
            pos = positions[start:end].cpu()
            want = torch.arange(self.prompt_lens[prompt], dtype=pos.dtype)
            if end - start != len(want) or not torch.equal(pos, want):
                raise RuntimeError(
                    f"prompt {prompt} was not run as one full prefill (positions {pos[:3].tolist()}…, "
                    f"{end - start} rows for {len(want)} tokens): prefix caching or chunked prefill is on")

    def __call__(self, t: torch.Tensor) -> dict[int, torch.Tensor]:
        if not self.spans:
            return {}
        return {p: t[s:e] for p, s, e in self.spans}


def _q_kv_sizes(model) -> dict:
    attn = model.model.layers[0].self_attn
    return {"q": attn.q_size, "kv": attn.kv_size}


def capture(llm, prompts: list[list[int]], out: str | Path, meta: dict | None = None,
            wanted: Callable[[str], bool] | None = None) -> DumpReader:
    """Run every prompt once through ``llm`` (in-process engine) and dump its taps."""
    from vllm import SamplingParams

    writer = DumpWriter(out, meta)
    runner = llm.collective_rpc(_model_runner)[0]
    rows = _StepRows(runner, [len(p) for p in prompts])
    state: dict = {}

    def install(model):
        # The decorated LlamaModel is called around nn.Module.__call__, so its own hooks never fire:
        # the step starts at the embedding, and positions are the first decoder layer's first argument.
        handles = [model.model.embed_tokens.register_forward_pre_hook(lambda mod, args: rows.begin()),
                   model.model.layers[0].register_forward_pre_hook(
                       lambda mod, args: rows.check_positions(args[0]))]
        rec = Recorder(model, VLLM_LLAMA, model.config.num_hidden_layers, writer, sizes=_q_kv_sizes(model),
                       wanted=_without_logits(wanted))
        rec.rows = rows
        rec.install()
        if wanted is None or wanted("logits"):
            def logits(mod, args, out):
                hidden = out[0] if isinstance(out, tuple) else out
                if rows.spans:
                    rec._capture("logits", model.compute_logits(hidden))
            handles.append(model.model.norm.register_forward_hook(logits))
        state["rec"], state["handles"] = rec, handles
        return True

    llm.apply_model(install)
    rec: Recorder = state["rec"]
    try:
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        engine = llm.llm_engine
        for p, ids in enumerate(prompts):
            engine.add_request(f"parity-{p}", {"prompt_token_ids": list(ids)}, params)
        while engine.has_unfinished_requests():
            engine.step()
        rec.flush()
    finally:
        rec.remove()
        for h in state["handles"]:
            h.remove()
    expected = [t for t, _, _ in rec.plan] + ([] if wanted is not None and not wanted("logits") else ["logits"])
    missing = [t for t in expected if t not in rec.seen]
    if missing:
        raise RuntimeError(f"taps never fired in vLLM: {missing[:5]} (hooks need enforce_eager=True)")
    writer.meta["side"] = writer.meta.get("side", "candidate")
    return DumpReader(writer.close())


def _model_runner(worker):
    return worker.model_runner


def _without_logits(wanted):
    return lambda tap: tap != "logits" and (wanted is None or wanted(tap))
