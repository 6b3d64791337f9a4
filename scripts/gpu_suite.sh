#!/usr/bin/env bash
# On a GPU machine: the kernel op suite (gpu-marked and CPU tests of the kernel test files), the kernel
# benchmarks, then the kernels candidate's parity on CUDA (scripts/gpu_parity.sh), all on the project built as a
# wheel from this checkout and installed (no dependencies) into a temporary directory. Logs and JSON go to $OUT
# when set (else benchmarks/results).
#   bash scripts/gpu_suite.sh [--quick] [--sweep]     (extra arguments go to benchmarks/kernels.py)
# PARITY_GPU_TESTS: test files (default: the kernel files and the kernel choice); PARITY_GPU_K: a pytest -k expression.
# PARITY_GPU_BENCH: a script of benchmarks/ and its arguments, run in place of kernels.py (its --out:
# $out/<script>.json). PARITY_GPU_STEP_S: seconds each step may take (a kernel that hangs then costs its step, and
# the logs of the others come back). PARITY_GPU_TEST_S: seconds each kernel test may take (default 300).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/results}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
export TRITON_DEFAULT_FP_FUSION=1
py="${PYTHON:-python3}"
limit=()
[ -n "${PARITY_GPU_STEP_S:-}" ] && limit=(timeout "$PARITY_GPU_STEP_S")

# PARITY_WHEEL: a wheel of this checkout built elsewhere (where the GPU machine lacks setuptools)
site="$(mktemp -d)"
wheel="${PARITY_WHEEL:-}"
if [ -z "$wheel" ]; then
    "$py" -m pip wheel --quiet --no-deps --no-build-isolation . -w "$site/dist" 2>&1 | tee "$out/wheel.log"
    wheel="$(ls "$site"/dist/vllm_parity-*.whl 2>/dev/null)"
fi
[ -f "$wheel" ] || { echo "gpu_suite: no wheel of the project (see $out/wheel.log)" >&2; exit 1; }
"$py" -m pip install --quiet --no-deps --target "$site/lib" "$wheel" 2>&1 | tee -a "$out/wheel.log"
export PYTHONPATH="$site/lib${PYTHONPATH:+:$PYTHONPATH}"
"$py" -c "import vllm_parity.serving.cuda_build as b; print('csrc from the wheel:', b.CSRC, sorted(p.name for p in b.CSRC.iterdir()))" \
    2>&1 | tee -a "$out/wheel.log"

"$py" - <<'EOF' 2>&1 | tee "$out/env.log"
import torch, triton
print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)
print("device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
EOF

# Build the CUDA extensions side by side first (each is one nvcc run), so the tests find them ready.
"${limit[@]}" "$py" scripts/build_cuda.py 2>&1 | tee "$out/build.log"

# A test that crashes the process (a segmentation fault) or never returns (a kernel that hangs) costs itself, not
# the rest of the log: the tests run in a worker process that pytest-xdist starts again after a crash, each within
# PARITY_GPU_TEST_S seconds (pytest-timeout ends the worker), where both plugins are installed.
test_s="${PARITY_GPU_TEST_S:-300}"
isolate=(-n 1 --max-worker-restart 100 --timeout "$test_s" --timeout-method thread)
"$py" -c "import xdist, pytest_timeout" 2>/dev/null || isolate=()
tests=()
for f in ${PARITY_GPU_TESTS:-tests/test_ternary_kernels.py tests/test_int8x_kernels.py tests/test_int8x_native.py tests/test_int8x_planes.py tests/test_choose.py}; do
    [ -f "$f" ] && tests+=("$f")
done
"${limit[@]}" "$py" -m pytest -p no:cacheprovider -m "gpu or not vllm" -q -rs --durations=15 ${PARITY_GPU_K:+-k "$PARITY_GPU_K"} \
    "${isolate[@]}" --junitxml="$out/kernel_tests.xml" "${tests[@]}" 2>&1 | tee "$out/kernel_tests.log"
test_rc=${PIPESTATUS[0]}

bench=(benchmarks/kernels.py --out "$out/kernels_h200.json")
if [ -n "${PARITY_GPU_BENCH:-}" ]; then
    read -ra bench <<< "$PARITY_GPU_BENCH"
    bench+=(--out "$out/$(basename "${bench[0]}" .py).json")
fi
"${limit[@]}" "$py" "${bench[@]}" "$@" 2>&1 | tee "$out/bench.log"
bench_rc=${PIPESTATUS[0]}

# The kernels candidate's parity on CUDA, prefill and decode steps (PARITY_GPU_PARITY=0 skips it).
parity_rc=0
if [ "${PARITY_GPU_PARITY:-1}" != 0 ]; then
    OUT="$out" PYTHON="$py" bash scripts/gpu_parity.sh
    parity_rc=$?
fi

echo "kernel tests exit $test_rc, benchmarks exit $bench_rc, parity exit $parity_rc"
[ "$test_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ] && [ "$parity_rc" -eq 0 ]
