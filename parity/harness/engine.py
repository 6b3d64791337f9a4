"""Building a vLLM engine for parity runs: deterministic, eager, small, quick to start.

Every prompt runs as one full forward (no prefix caching, no chunked prefill, unless a run asks for them:
:func:`engine_features`), in fp32 unless asked, eagerly (so
forward hooks fire), from token ids (no tokenizer), with an explicitly sized KV cache (vLLM's CPU
default sizes it from free RAM and takes half a minute to start).
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from vllm_parity.errors import EngineUnsupported

DEFAULT_MAX_MODEL_LEN = 256
KV_CACHE_GIB = "1"
ALLOW_PICKLE = "VLLM_ALLOW_INSECURE_SERIALIZATION"


def engine_env(tensor_parallel_size: int = 1, multiprocessing: bool = False,
               kv_cache_bytes: int | None = None) -> dict[str, str | None]:
    """Environment for the engine: in-process unless asked, a 1 GiB CPU KV cache (or exactly
    ``kv_cache_bytes``, passed to the engine instead), CPU thread binding for TP."""
    env = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocessing else "0",

        # vLLM's CPU platform lets this variable override kv_cache_memory_bytes: None unsets it
        "VLLM_CPU_KVCACHE_SPACE": None if kv_cache_bytes else os.environ.get("VLLM_CPU_KVCACHE_SPACE", KV_CACHE_GIB),
    }
    if tensor_parallel_size > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        # The CPU default ("auto") asks for one NUMA node per rank and refuses to start on one node.
        cores = os.cpu_count() or 1
        env["VLLM_CPU_OMP_THREADS_BIND"] = (
            "|".join(str(i) for i in range(tensor_parallel_size)) if cores >= tensor_parallel_size else "nobind")
    return env


@contextlib.contextmanager
def patched_environ(values: Mapping[str, str | None]) -> Iterator[None]:
    """Set (or, for None, unset) environment variables for the block, then restore them."""
    old = {k: os.environ.get(k) for k in values}
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
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
             kv_cache_bytes: int | None = None, **llm_kwargs: Any):
    """A ``vllm.LLM`` for ``model`` with the parity settings; ``llm_kwargs`` override any of them."""
    env = engine_env(tensor_parallel_size, multiprocessing, kv_cache_bytes)
    if multiprocessing:
        # The harness's hooks are functions sent to the workers (collective_rpc); the multiprocess engine sends
        # them only with pickle allowed, read at every call: allowed for the rest of the process.
        os.environ[ALLOW_PICKLE] = "1"
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
        if kv_cache_bytes:
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_bytes)
        kwargs.update(llm_kwargs)
        try:
            llm = LLM(**kwargs)
            _trim_heap()
            return llm
        except BaseException:
            # A failed start leaves the distributed state of an in-process engine behind.
            _cleanup()
            raise


_MISSING_OP = re.compile(r"'_C' object has no attribute '(\w+)'")
_NO_DTYPE = re.compile(r'"(\w+)" not implemented for \'(\w+)\'')
_HALF_ONLY = re.compile(r"expect \w+ to be (bfloat16|half|float16)")  # a kernel taking half precision only
# vLLM's configuration check (pydantic) refusing the checkpoint's quantization, e.g. GPTQ with desc_act=True
_CONFIG_REFUSED = re.compile(r"for VllmConfig\s+Value error, (.+?)(?: \[type=|$)", re.S)
# vLLM's CPU kernels built only for some instruction sets (vllm-cpu 0.32 on x86: the AVX-512 build).
CPU_OP_BUILDS = {"cpu_gemm_wna16": "AVX-512 (x86), RVV or s390x", "int4_scaled_mm_cpu": "AMX"}


def explain(exc: BaseException, what: str, dtype: str) -> EngineUnsupported | None:
    """vLLM's error at a forward of ``what`` (format and method) in ``dtype``, said as why it cannot be served
    here and what would run; None for any other error."""
    text = str(exc)
    missing = _MISSING_OP.search(text)
    if missing:
        op = missing.group(1)
        built = CPU_OP_BUILDS.get(op, "other machines")
        flags = _cpu_flags()
        return EngineUnsupported(
            f"vLLM cannot serve {what} on this machine: its build here has no kernel {op!r} (built for {built}; "
            f"this CPU has {', '.join(flags) or 'none of avx2/avx512f/amx'}). Run it where vLLM has that kernel "
            f"(a GPU, or a CPU with {built}); vLLM's reason: {text}")
    refused = _CONFIG_REFUSED.search(text)
    if refused and type(exc).__name__ == "ValidationError":
        return EngineUnsupported(f"vLLM refuses to serve {what}: {refused.group(1)}")
    no_dtype = _NO_DTYPE.search(text) or _HALF_ONLY.search(text)
    if no_dtype or "not supported for quantization method" in text:
        other = [d for d in ("bfloat16", "float16") if d != dtype]
        return EngineUnsupported(f"vLLM serves {what} only in other dtypes than {dtype} here: run it with "
                                 f"--parity-dtype={other[0]} (or {other[1]}); vLLM's reason: {text}")
    return None


def aborts(config: Mapping[str, Any], what: str, dtype: str) -> EngineUnsupported | None:
    """A checkpoint whose vLLM CPU kernel would abort the process in ``dtype`` (a failed check inside an OpenMP
    region, which no ``except`` sees), said before the engine starts; None where nothing is known to abort."""
    import torch

    q = config.get("quantization_config") or {}
    if dtype != "float16" or q.get("quant_method") != "compressed-tensors" or not torch.cpu._is_amx_tile_supported():
        return None
    for group in (q.get("config_groups") or {}).values():
        w, a = group.get("weights") or {}, group.get("input_activations") or {}
        if (w.get("type"), w.get("num_bits"), a.get("type"), a.get("num_bits"), a.get("symmetric")) == \
                ("int", 8, "int", 8, True):
            # vLLM 0.32 (scaled_mm/cpu.py) takes the AMX kernel for every int8 weight with symmetric activations
            return EngineUnsupported(
                f"vLLM cannot serve {what} in float16 on this CPU: with AMX its W8A8 int8 kernel "
                f"(int8_scaled_mm_with_quant) has no float16 path and aborts the process in float16 "
                f"('scale_C: scalar path not implemented'); run it with --parity-dtype=bfloat16")
    return None


def _cpu_flags() -> list[str]:
    try:
        words = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return []
    return [f for f in ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_tile") if f in words]


def kv_cache_bytes(config: Mapping[str, Any], tokens: int) -> int:
    """Room for ``tokens`` tokens of the model of ``config`` (config.json), twice over, at least 64 MiB:
    not vLLM's default gibibyte."""
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    per_token = 2 * int(config["num_hidden_layers"]) * int(config.get("num_key_value_heads") or heads) * head_dim * 4
    return max(64 << 20, 2 * per_token * tokens)


PREFIX_BLOCK = 32  # the KV block size with prefix caching on: the smallest the CPU backend prefers
CPU_BLOCK = 128  # vLLM's CPU default KV block size


def engine_features(prefix_caching: bool = False, chunked_prefill: int = 0) -> dict[str, Any]:
    """The engine settings of optional features: prefix caching (in blocks of PREFIX_BLOCK tokens, so that prompts
    of a few dozen tokens share cached blocks: the CPU default is 128) and chunked prefill (``chunked_prefill``
    tokens a step at most, so that longer prompts are split); none for neither."""
    if chunked_prefill < 0:
        raise ValueError(f"chunked prefill of {chunked_prefill} tokens a step: a count of tokens, 0 (off) or more")
    out: dict[str, Any] = {}
    if prefix_caching:
        out.update(enable_prefix_caching=True, block_size=PREFIX_BLOCK)
    if chunked_prefill:
        out.update(enable_chunked_prefill=True, max_num_batched_tokens=chunked_prefill)
    return out


def make_run_llm(model: str | Path, config: Mapping[str, Any], prompts: list[list[int]], new_tokens: int, *,
                 tensor_parallel_size: int = 1, compiled: bool = False, dtype: str = "float32",
                 prefix_caching: bool = False, chunked_prefill: int = 0):
    """The engine of a parity run: every prompt at once, with room for ``new_tokens`` generated tokens;
    ``prefix_caching`` / ``chunked_prefill``: :func:`engine_features`."""
    refused = aborts(config, f"this checkpoint ({model})", dtype)
    if refused is not None:
        raise refused
    max_len = max(DEFAULT_MAX_MODEL_LEN, max(len(p) for p in prompts) + new_tokens + 8)
    seqs = max(4, len(prompts))
    features = engine_features(prefix_caching, chunked_prefill)
    if chunked_prefill and chunked_prefill < seqs:
        raise ValueError(f"chunked prefill of {chunked_prefill} tokens a step: vLLM needs at least one a sequence "
                         f"({seqs} here)")
    # Room for what the run holds at once: every prompt and its new tokens in whole KV blocks (with prefix caching
    # the warming pass's blocks stay cached beside the recorded pass's), and one request of max_model_len, which
    # vLLM checks at start. Sized to the max_model_len of every sequence, a 7B model's cache took 2 GiB.
    block = PREFIX_BLOCK if prefix_caching else CPU_BLOCK
    held = sum(-(-(len(p) + new_tokens) // block) * block for p in prompts) * (2 if prefix_caching else 1)
    room = max(max_len, held)
    return make_llm(model, max_model_len=max_len, max_num_seqs=seqs,
                    kv_cache_bytes=kv_cache_bytes(config, room), tensor_parallel_size=tensor_parallel_size,
                    enforce_eager=not compiled, dtype=dtype, **features)


def _trim_heap() -> None:
    """Give the C heap's free pages back: loading repacks every weight through temporaries that glibc keeps."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


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
