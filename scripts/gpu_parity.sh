#!/usr/bin/env bash
# On a GPU machine: the kernels candidate's parity on CUDA (--parity-device=cuda): the GPU tests of
# tests/test_gpu_parity.py, then benchmarks/gpu_parity.py (block and model levels, prefill and decode steps, of the
# default model, the int8x fixture and the 1.2B fixture). Logs and JSON go to $OUT when set (else
# benchmarks/results). The project comes from PYTHONPATH when it imports there (scripts/gpu_suite.sh installs it),
# else it is built as a wheel from this checkout and installed (no dependencies) into a temporary directory.
#   bash scripts/gpu_parity.sh [arguments of benchmarks/gpu_parity.py]
# PARITY_GPU_PARITY_K: a pytest -k expression for the tests.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/results}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py="${PYTHON:-python3}"

if ! (cd /tmp && "$py" -c "import vllm_parity.harness.kernel_decode" 2>/dev/null); then
    site="$(mktemp -d)"
    "$py" -m pip wheel --quiet --no-deps --no-build-isolation . -w "$site/dist" 2>&1 | tee "$out/parity_wheel.log"
    "$py" -m pip install --quiet --no-deps --target "$site/lib" "$site"/dist/vllm_parity-*.whl 2>&1 \
        | tee -a "$out/parity_wheel.log"
    export PYTHONPATH="$site/lib${PYTHONPATH:+:$PYTHONPATH}"
fi

# A run's record draws report.html with plotly: carry its wheel where the machine lacks it.
"$py" -c "import plotly" 2>/dev/null || echo "gpu_parity: plotly is missing: every run fails writing its report" >&2

# The CUDA extensions side by side first (each is one nvcc run), so the tests find them ready.
"$py" scripts/build_cuda.py 2>&1 | tee "$out/parity_build.log"

"$py" -m pytest -p no:cacheprovider -m gpu -q -rs --durations=20 ${PARITY_GPU_PARITY_K:+-k "$PARITY_GPU_PARITY_K"} \
    --junitxml="$out/gpu_parity_tests.xml" tests/test_gpu_parity.py 2>&1 | tee "$out/gpu_parity_tests.log"
test_rc=${PIPESTATUS[0]}

"$py" benchmarks/gpu_parity.py --out "$out/gpu_parity_h200.json" "$@" 2>&1 | tee "$out/gpu_parity_h200.log"
bench_rc=${PIPESTATUS[0]}

echo "gpu parity tests exit $test_rc, parity runs exit $bench_rc"
[ "$test_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
