// The tensor-core kernel at one token on a tile layout whose fields are offset binary (benchmarks/ternary_cls_ab.py,
// pack_cls): field u = w + 1 of pair s of a word sits at bits 2 s (+ 16 for the high half), so the A registers of
// step s are the word under a mask (s < 6) or the word shifted by 12 under one (s = 6, 7), read as fp16
// subnormals u 2^(2 (s mod 6) - 24). The classes of scale are kept apart by the accumulator's columns: at one token
// only column 0 of the m16n8k16 is a token, so step s's x goes to column s (the lanes g = s), and the epilogue
// scales column s back by 2^(24 - 2 (s mod 6)) and takes sum(x) off for the offset.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_fp16.h>
#include <torch/extension.h>

#include "launch.cuh"

namespace {

constexpr int TILE_N = 16, TILE_K = 128;

__device__ __forceinline__ uint4 load_stream(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ void mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                    uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

template <int S>
__device__ __forceinline__ uint32_t cls_bits(uint32_t w) {
  if constexpr (S < 6)
    return w & (0x00030003u << (2 * S));
  else
    return (w >> 12) & (0x00030003u << (2 * (S - 6)));
}

template <int S>
__device__ __forceinline__ void step(float (&d)[4], const uint4& q, uint32_t b0, uint32_t b1) {
  mma(d, cls_bits<S>(q.x), cls_bits<S>(q.y), cls_bits<S>(q.z), cls_bits<S>(q.w), b0, b1);
}

// 2^(24 - 2 (s mod 6)): what column s of the accumulator is scaled back by.
__device__ __forceinline__ float col_scale(int s) { return __int_as_float((127 + 24 - 2 * (s % 6)) << 23); }

template <int TN, int L>
__global__ void __launch_bounds__(512)
cls_kernel(const __half* __restrict__ x, const uint4* __restrict__ tiles, const float* __restrict__ scale,
           __half* __restrict__ y, int N, int K, int NT, int KC) {
  extern __shared__ float red[];
  constexpr int U = L / TN > 0 ? L / TN : 1;
  parity::pdl_launch_dependents();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int g = lane >> 2, t = lane & 3, nt0 = blockIdx.x * TN;
  float acc[TN][4] = {};
  float xsum = 0.f;
  for (int c0 = warp; c0 < KC; c0 += nwarps * U) {
    uint4 wq[U][TN];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int i = 0; i < TN; ++i) {
        const int c = c0 + u * nwarps, nt = nt0 + i;
        wq[u][i] = c < KC && nt < NT ? load_stream(tiles + ((int64_t)nt * KC + c) * 32 + lane) : make_uint4(0, 0, 0, 0);
      }
    parity::pdl_wait();
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + u * nwarps;
      if (c >= KC) break;
      // lane (g, t): inputs 128 c + 16 g + 4 t .. + 3, B of step g (K is a multiple of 128 here)
      const uint2 xb = __ldg(reinterpret_cast<const uint2*>(x + (int64_t)c * TILE_K + 16 * g + 4 * t));
      const float2 f0 = __half22float2(*reinterpret_cast<const __half2*>(&xb.x));
      const float2 f1 = __half22float2(*reinterpret_cast<const __half2*>(&xb.y));
      xsum += (f0.x + f0.y) + (f1.x + f1.y);
#define PARITY_STEP(S)                                                    \
  {                                                                       \
    const uint32_t b0 = g == S ? xb.x : 0u, b1 = g == S ? xb.y : 0u;      \
    _Pragma("unroll") for (int i = 0; i < TN; ++i) step<S>(acc[i], wq[u][i], b0, b1); \
  }
      PARITY_STEP(0) PARITY_STEP(1) PARITY_STEP(2) PARITY_STEP(3)
      PARITY_STEP(4) PARITY_STEP(5) PARITY_STEP(6) PARITY_STEP(7)
#undef PARITY_STEP
    }
  }
  parity::pdl_wait();
  // rows g and g + 8 of each tile: columns 2 t and 2 t + 1 scaled back, then the 4 lanes of a row added
  const float s0 = col_scale(2 * t), s1 = col_scale(2 * t + 1);
  float* xs = red + nwarps * TN * TILE_N;
#pragma unroll
  for (int i = 0; i < TN; ++i) {
    float lo = acc[i][0] * s0 + acc[i][1] * s1, hi = acc[i][2] * s0 + acc[i][3] * s1;
    lo += __shfl_xor_sync(0xffffffffu, lo, 1);
    lo += __shfl_xor_sync(0xffffffffu, lo, 2);
    hi += __shfl_xor_sync(0xffffffffu, hi, 1);
    hi += __shfl_xor_sync(0xffffffffu, hi, 2);
    if (t == 0) {
      red[(warp * TN + i) * TILE_N + g] = lo;
      red[(warp * TN + i) * TILE_N + g + 8] = hi;
    }
  }
  for (int o = 16; o; o >>= 1) xsum += __shfl_xor_sync(0xffffffffu, xsum, o);
  if (lane == 0) xs[warp] = xsum;
  __syncthreads();
  if (threadIdx.x < TN * TILE_N) {
    float v = 0.f, sx = 0.f;
    for (int w = 0; w < nwarps; ++w) {
      v += red[w * TN * TILE_N + threadIdx.x];
      sx += xs[w];
    }
    const int n = nt0 * TILE_N + threadIdx.x;
    if (n < N) y[n] = __float2half_rn((v - sx) * scale[n]);
  }
}

template <int TN, int L>
void launch(const torch::Tensor& x, const torch::Tensor& tiles, const torch::Tensor& scale, torch::Tensor& y, int N,
            int K, int warps, bool pdl) {
  const int NT = (N + TILE_N - 1) / TILE_N, KC = K / TILE_K;
  const int smem = (warps * TN * TILE_N + warps) * (int)sizeof(float);
  parity::launch_kernel(cls_kernel<TN, L>, dim3((NT + TN - 1) / TN), 32 * warps, smem, pdl,
                        c10::cuda::getCurrentCUDAStream(), reinterpret_cast<const __half*>(x.data_ptr()),
                        reinterpret_cast<const uint4*>(tiles.data_ptr()), scale.data_ptr<float>(),
                        reinterpret_cast<__half*>(y.data_ptr()), N, K, NT, KC);
}

}  // namespace

// y (1, N) fp16 = x (1, K) fp16 @ W^T, W from the offset-binary tiles (NT, KC, 32, 4) and fp32 row scales (N,).
torch::Tensor cls_linear(torch::Tensor x, torch::Tensor tiles, torch::Tensor scale, int64_t n, int64_t k, int64_t tn,
                         int64_t warps, int64_t loads, bool pdl) {
  TORCH_CHECK(x.is_cuda() && x.scalar_type() == torch::kFloat16 && x.dim() == 2 && x.size(0) == 1 &&
                  x.size(1) == k && x.is_contiguous(),
              "cls_linear: x must be contiguous fp16 (1, K)");
  TORCH_CHECK(k % TILE_K == 0 && n % TILE_N == 0, "cls_linear: K a multiple of 128 and N of 16");
  TORCH_CHECK(tiles.scalar_type() == torch::kInt32 && tiles.is_contiguous() && tiles.size(0) == n / TILE_N &&
                  tiles.size(1) == k / TILE_K,
              "cls_linear: tiles (N/16, K/128, 32, 4)");
  TORCH_CHECK(scale.scalar_type() == torch::kFloat32 && scale.numel() == n, "cls_linear: fp32 row scales");
  TORCH_CHECK(warps >= 1 && warps <= 16, "cls_linear: warps 1..16");
  const c10::cuda::CUDAGuard guard(x.device());
  auto y = torch::empty({1, n}, x.options());
#define PARITY_CLS(TN_, L_) \
  if (tn == TN_ && loads == L_) return launch<TN_, L_>(x, tiles, scale, y, (int)n, (int)k, (int)warps, pdl), y;
  PARITY_CLS(1, 4) PARITY_CLS(2, 4) PARITY_CLS(4, 4) PARITY_CLS(1, 8) PARITY_CLS(2, 8) PARITY_CLS(4, 8)
#undef PARITY_CLS
  TORCH_CHECK(false, "cls_linear: no instance for tn=", tn, " loads=", loads);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("cls_linear", &cls_linear); }
