"""Build the project's CUDA extensions side by side (each is one nvcc run), so the tests that follow find them
ready; one line per extension: built, or why not."""

import concurrent.futures
import importlib
import importlib.util
import time

# (module, its extension, the module's predicate that the extension builds and runs here)
EXTENSIONS = [("vllm_parity.serving.ternary_cuda", "extension", "available"),
              ("vllm_parity.serving.ternary_cuda", "gemm_extension", "gemm_supported"),
              ("vllm_parity.serving.int8x_cuda", "extension", "available"),
              ("vllm_parity.serving.int8x_planes_cuda", "extension", "available")]


def build(entry: tuple[str, str, str]) -> str:
    name, attr, ok = entry
    t = time.time()
    mod = importlib.import_module(name)
    if not getattr(mod, ok)():
        return f"{name}.{attr}: not here ({ok}() is false: no nvcc, no GPU or not its compute capability)"
    getattr(mod, attr)()
    return f"{name}.{attr}: built in {time.time() - t:.0f} s"


entries = [e for e in EXTENSIONS if importlib.util.find_spec(e[0])]
with concurrent.futures.ThreadPoolExecutor(len(entries)) as pool:
    for line in pool.map(build, entries):
        print(line, flush=True)
