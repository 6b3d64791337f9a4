// Host-side launch helpers shared by the extensions.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace parity {

// Dynamic shared memory beyond the default 48 KB must be allowed per kernel before its launch.
template <typename K>
void set_smem(K kernel, int64_t bytes) {
  if (bytes > 48 * 1024)
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
}

}  // namespace parity
