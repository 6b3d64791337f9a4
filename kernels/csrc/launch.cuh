// Launch helpers shared by the extensions.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <algorithm>
#include <mutex>
#include <vector>

namespace parity {

// Dynamic shared memory beyond the default 48 KB must be allowed per kernel before its launch.
template <typename K>
void set_smem(K kernel, int64_t bytes) {
  if (bytes > 48 * 1024)
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
}

// A device's multiprocessors, compute capability and the shared memory a block may opt in to, read once per device:
// an op's call path must not query the driver.
struct DeviceInfo {
  int sms = 0, major = 0, minor = 0;
  int64_t smem_optin = 0, smem_per_sm = 0, smem_reserved = 0;  // a block's most; a multiprocessor's; kept a block
};

inline DeviceInfo device_info(int dev) {
  static std::mutex mu;
  static std::vector<DeviceInfo> known;
  std::lock_guard<std::mutex> lock(mu);
  if ((int)known.size() <= dev) known.resize(dev + 1);
  if (known[dev].sms == 0) {
    cudaDeviceProp prop;
    C10_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
    known[dev] = DeviceInfo{prop.multiProcessorCount, prop.major, prop.minor, (int64_t)prop.sharedMemPerBlockOptin,
                            (int64_t)prop.sharedMemPerMultiprocessor, (int64_t)prop.reservedSharedMemPerBlock};
  }
  return known[dev];
}

// Dynamic shared memory that keeps a kernel to at most `blocks` blocks a multiprocessor (where its registers would
// allow more): spread over every multiprocessor, a grid of up to `blocks` per multiprocessor runs in one even wave.
inline int64_t smem_for_blocks_per_sm(const DeviceInfo& info, int64_t blocks) {
  return std::min(info.smem_optin, info.smem_per_sm / (blocks + 1) - info.smem_reserved + 1);
}

// Programmatic dependent launch (sm_90): the next kernel in the stream may start once every block of this one has
// begun, and its own wait returns when this one has finished and its writes are visible. A kernel launched so
// reads only what nothing in the stream writes (its weights) before waiting, and writes nothing before.
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Launches kern with dynamic shared memory smem, as a programmatic dependent launch when pdl is set, in clusters of
// cluster_z CTAs along grid.z where it is more than 1 (compute capability 9: the CTAs of a cluster read each other's
// shared memory).
template <typename Kern, typename... Args>
void launch_kernel_cluster(Kern kern, dim3 grid, unsigned cluster_z, int threads, int smem, bool pdl,
                           cudaStream_t stream, Args... args) {
  set_smem(kern, smem);
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  int n = 0;
  if (pdl) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cluster_z > 1) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n].val.clusterDim.x = 1;
    attr[n].val.clusterDim.y = 1;
    attr[n++].val.clusterDim.z = cluster_z;
  }
  cfg.attrs = attr;
  cfg.numAttrs = n;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kern, args...));
}

template <typename Kern, typename... Args>
void launch_kernel(Kern kern, dim3 grid, int threads, int smem, bool pdl, cudaStream_t stream, Args... args) {
  launch_kernel_cluster(kern, grid, 1, threads, smem, pdl, stream, args...);
}

}  // namespace parity
