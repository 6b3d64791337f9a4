// Helpers of the ternary kernels that read the tiled layout (ternary.cu, ternary_gemm.cu).
#pragma once

#include <torch/extension.h>
#include <stdint.h>

#include "dtypes.cuh"

namespace parity {

// A tile: 16 rows x 128 inputs (kernels/ternary_repack.py, pack_tiles).
constexpr int TILE_N = 16, TILE_K = 128;

// The tiles of an (N, K) weight as the kernels read them, else an error naming the op.
inline void check_tiles(const torch::Tensor& tiles, int64_t n, int64_t k, const char* op) {
  TORCH_CHECK(tiles.scalar_type() == torch::kInt32 && tiles.is_contiguous() && tiles.dim() == 4 &&
                  tiles.size(0) == (n + TILE_N - 1) / TILE_N && tiles.size(1) == (k + TILE_K - 1) / TILE_K &&
                  tiles.size(2) == 32 && tiles.size(3) == 4,
              op, ": tiles must be contiguous int32 (ceil(N/16), ceil(K/128), 32, 4) for N=", n, " K=", k);
  TORCH_CHECK(reinterpret_cast<uintptr_t>(tiles.data_ptr()) % 16 == 0, op,
              ": tiles must start 16-byte aligned (a lane's tile is one 16-byte load), got an address ",
              reinterpret_cast<uintptr_t>(tiles.data_ptr()) % 16, " bytes past");
}

// Pair P of a word (inputs 2 P and 2 P + 1 at bits 2 P and 16 + 2 P) as a half2 / bfloat162 register: each
// field on its half's sign bit and exponent MSB, +-2.0 or 0.
template <int P> __device__ __forceinline__ uint32_t pair_bits(uint32_t w) { return (w << (14 - 2 * P)) & 0xC000C000u; }

// The A registers of step s (0..7) of a lane's tile uint4: word s / 2, pairs 0-3 for even s, 4-7 for odd s
// (s a constant once the caller's loop is unrolled).
__device__ __forceinline__ void tile_a(const uint4& q, int s, uint32_t& a0, uint32_t& a1, uint32_t& a2,
                                       uint32_t& a3) {
  const uint32_t w = (s >> 1) == 0 ? q.x : (s >> 1) == 1 ? q.y : (s >> 1) == 2 ? q.z : q.w;
  if (s & 1) {
    a0 = pair_bits<4>(w); a1 = pair_bits<5>(w); a2 = pair_bits<6>(w); a3 = pair_bits<7>(w);
  } else {
    a0 = pair_bits<0>(w); a1 = pair_bits<1>(w); a2 = pair_bits<2>(w); a3 = pair_bits<3>(w);
  }
}

// Per-token absmax int8 quantization of one row (the whole block, any block size up to 1024): the scale
// s = 127 / max(|x|) (at least 1e-5 in the divisor), rounded as the fp32 reference does.
template <typename T>
__device__ __forceinline__ float row_quant_scale(const T* __restrict__ row, int64_t sxk, int K) {
  __shared__ float warp_max[32];
  float amax = 0.f;
  for (int k = threadIdx.x; k < K; k += blockDim.x) amax = fmaxf(amax, fabsf(to_f(row[(int64_t)k * sxk])));
  for (int o = 16; o; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = amax;
  __syncthreads();
  if (threadIdx.x < 32) {
    float v = threadIdx.x < (blockDim.x >> 5) ? warp_max[threadIdx.x] : 0.f;
    for (int o = 16; o; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (threadIdx.x == 0) warp_max[0] = v;
  }
  __syncthreads();
  return __fdiv_rn(127.0f, fmaxf(warp_max[0], 1e-5f));
}

// x * s as an int8 level (x * s rounded to fp32 before rintf, as the fp32 reference does).
__device__ __forceinline__ float quant_level(float x, float s) {
  return fminf(fmaxf(rintf(__fmul_rn(x, s)), -128.f), 127.f);
}

}  // namespace parity
