"""Build the project's CUDA extensions side by side (each is one nvcc run), so the tests that follow find them
ready; one line per extension: built, or why not."""

import concurrent.futures
import importlib
import importlib.util
import time


def build(name: str) -> str:
    t = time.time()
    mod = importlib.import_module(name)
    if not mod.available():
        return f"{name}: no nvcc or GPU"
    mod.extension()
    return f"{name}: built in {time.time() - t:.0f} s"


names = [n for n in ("vllm_parity.serving.ternary_cuda", "vllm_parity.serving.int8x_cuda",
                     "vllm_parity.serving.int8x_planes_cuda") if importlib.util.find_spec(n)]
with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
    for line in pool.map(build, names):
        print(line, flush=True)
