"""Building a vLLM engine for parity runs: deterministic, eager, small, quick to start.

Every prompt runs as one full forward (no prefix caching, no chunked prefill), in fp32, eagerly (so
forward hooks fire), from token ids (no tokenizer), with an explicitly sized KV cache (vLLM's CPU
default sizes it from free RAM and takes half a minute to start).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

DEFAULT_MAX_MODEL_LEN = 256
KV_CACHE_GIB = "1"


def engine_env(tensor_parallel_size: int = 1, multiprocessing: bool = False) -> dict[str, str]:
    """Environment for the engine: in-process unless asked, a 1 GiB CPU KV cache, CPU thread binding for TP."""
    env = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocessing else "0",
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", KV_CACHE_GIB),
    }
    if tensor_parallel_size > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        # The CPU default ("auto") asks for one NUMA node per rank and refuses to start on one node.
        cores = os.cpu_count() or 1
        env["VLLM_CPU_OMP_THREADS_BIND"] = (
            "|".join(str(i) for i in range(tensor_parallel_size)) if cores >= tensor_parallel_size else "nobind")
    return env


@contextlib.contextmanager
def patched_environ(values: Mapping[str, str]) -> Iterator[None]:
    """Set environment variables for the block, then restore them."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def make_llm(model: str | Path, *, tensor_parallel_size: int = 1, multiprocessing: bool = False,
             max_model_len: int = DEFAULT_MAX_MODEL_LEN, max_num_seqs: int = 16, seed: int = 0,
             **llm_kwargs: Any):
    """A ``vllm.LLM`` for ``model`` with the parity settings; ``llm_kwargs`` override any of them."""
    env = engine_env(tensor_parallel_size, multiprocessing)
    with patched_environ(env):
        import vllm.envs as envs
        from vllm import LLM

        # An in-process engine freezes vLLM's environment cache; a new engine must read it afresh.
        envs.disable_envs_cache()
        kwargs: dict[str, Any] = dict(
            model=str(model),
            tensor_parallel_size=tensor_parallel_size,
            skip_tokenizer_init=True,
            dtype="float32",
            enforce_eager=True,
            enable_prefix_caching=False,
            enable_chunked_prefill=False,
            max_model_len=max_model_len,
            # Without chunked prefill a whole batch of prompts must fit one step.
            max_num_batched_tokens=max_model_len * max_num_seqs,
            max_num_seqs=max_num_seqs,
            seed=seed,
        )
        kwargs.update(llm_kwargs)
        try:
            return LLM(**kwargs)
        except BaseException:
            # A failed start leaves the distributed state of an in-process engine behind.
            _cleanup()
            raise


def close_llm(llm) -> None:
    """Shut the engine down (worker processes included) and free its distributed state and memory."""
    engine = getattr(llm, "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()
    del llm, engine, core
    _cleanup()


def _cleanup() -> None:
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()


def generate(llm, prompts: list[list[int]], max_tokens: int = 8, logprobs: int | None = None,
             prompt_logprobs: int | None = None):
    """Greedy generation from token ids; returns vLLM's ``RequestOutput`` list in prompt order."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=logprobs,
                            prompt_logprobs=prompt_logprobs, detokenize=False, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
