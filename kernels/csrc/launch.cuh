// Host-side launch helpers shared by the extensions.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <mutex>
#include <vector>

namespace parity {

// Dynamic shared memory beyond the default 48 KB must be allowed per kernel before its launch.
template <typename K>
void set_smem(K kernel, int64_t bytes) {
  if (bytes > 48 * 1024)
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
}

// A device's multiprocessors and compute capability, read once per device: an op's call path must not query the
// driver.
struct DeviceInfo {
  int sms = 0, major = 0, minor = 0;
};

inline DeviceInfo device_info(int dev) {
  static std::mutex mu;
  static std::vector<DeviceInfo> known;
  std::lock_guard<std::mutex> lock(mu);
  if ((int)known.size() <= dev) known.resize(dev + 1);
  if (known[dev].sms == 0) {
    cudaDeviceProp prop;
    C10_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
    known[dev] = DeviceInfo{prop.multiProcessorCount, prop.major, prop.minor};
  }
  return known[dev];
}

}  // namespace parity
