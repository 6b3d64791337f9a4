// Ternary linear y = x @ W^T (+ bias) on the native layout of kernels/ternary_repack.py.
//
// qweight: int32 (N, Kw), Kw = ceil(K / 16); weight (n, k) is the 2-bit field of word (n, k / 16)
// starting at bit FIELD_BIT(k % 16) = 2 * (e / 2) + 16 * (e % 2); low bit = nonzero, high bit =
// negative. scale: fp32 (N, G); group_size 0 means one scale per output channel.
// Activation quantization (per-token absmax int8) runs first in act_quant_kernel; its x_q is
// written in x's dtype (integers up to 128 are exact in fp16 and bf16) and the main kernels divide
// by s_x in the epilogue.

#include <torch/extension.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace {

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

__host__ __device__ constexpr int field_bit(int e) { return 2 * (e >> 1) + 16 * (e & 1); }

// Weight e of a word as fp32 +-2.0 or 0, branch-free: the field lands on the sign bit and the
// exponent MSB, every other bit cleared.
__device__ __forceinline__ float field_f32(uint32_t word, int e) {
  return __uint_as_float((word << (30 - field_bit(e))) & 0xC0000000u);
}

template <int MODE>
__device__ __forceinline__ float scale_at(const float* __restrict__ scale, int n, int G, int GS, int k) {
  return MODE == 0 ? 1.0f : scale[(int64_t)n * G + k / GS];
}

// ---------------------------------------------------------------------------------------------
// Per-token absmax int8 fake quantization: one block per row.
template <typename T>
__global__ void act_quant_kernel(const T* __restrict__ x, int64_t sxm, int64_t sxk, T* __restrict__ xq,
                                 float* __restrict__ sx, int K) {
  const int m = blockIdx.x;
  const T* row = x + (int64_t)m * sxm;
  float amax = 0.f;
  for (int k = threadIdx.x; k < K; k += blockDim.x) amax = fmaxf(amax, fabsf(to_f(row[(int64_t)k * sxk])));
  for (int o = 16; o; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  __shared__ float warp_max[32];
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = amax;
  __syncthreads();
  if (threadIdx.x < 32) {
    float v = threadIdx.x < (blockDim.x >> 5) ? warp_max[threadIdx.x] : 0.f;
    for (int o = 16; o; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (threadIdx.x == 0) warp_max[0] = v;
  }
  __syncthreads();
  const float s = __fdiv_rn(127.0f, fmaxf(warp_max[0], 1e-5f));
  for (int k = threadIdx.x; k < K; k += blockDim.x) {
    // __fmul_rn keeps x * s_x rounded to fp32 before rintf, as the fp32 reference does.
    float q = rintf(__fmul_rn(to_f(row[(int64_t)k * sxk]), s));
    q = fminf(fmaxf(q, -128.f), 127.f);
    xq[(int64_t)m * K + k] = from_f<T>(q);
  }
  if (threadIdx.x == 0) sx[m] = s;
}

// ---------------------------------------------------------------------------------------------
// Naive: one thread per output element, decoding each weight as it goes.
template <typename T, int MODE>
__global__ void naive_kernel(const T* __restrict__ x, int64_t sxm, int64_t sxk, const int32_t* __restrict__ qw,
                             const float* __restrict__ scale, const float* __restrict__ bias,
                             const float* __restrict__ sx, T* __restrict__ y, int M, int N, int K, int KW,
                             int G, int GS) {
  const int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= (int64_t)M * N) return;
  const int n = (int)(idx % N), m = (int)(idx / N);
  float acc = 0.f;
  for (int k = 0; k < K; ++k) {
    const uint32_t word = (uint32_t)qw[(int64_t)n * KW + (k >> 4)];
    const uint32_t f = (word >> field_bit(k & 15)) & 3u;
    const float v = (f & 1u) ? ((f & 2u) ? -1.f : 1.f) : 0.f;
    acc += to_f(x[(int64_t)m * sxm + (int64_t)k * sxk]) * (MODE == 0 ? v : v * scale_at<MODE>(scale, n, G, GS, k));
  }
  if (MODE == 0) acc *= scale[n];
  if (sx) acc = __fdiv_rn(acc, sx[m]);
  if (bias) acc += bias[n];
  y[(int64_t)m * N + n] = from_f<T>(acc);
}

// ---------------------------------------------------------------------------------------------
// Vectorized: a warp per output channel n (ROWS channels per warp), lanes stride over the words of
// the row with 32-bit loads (one coalesced 128-byte request per warp), the activation row staged
// in shared memory as fp32 halved (16-byte global loads), weights decoded branch-free.
// Shared memory holds x at a padded index (17 floats per 16) so the 32 lanes, which read 16
// consecutive activations each, hit 32 different banks.
constexpr int VEC_WARPS = 8;
constexpr int VEC_ROWS = 2;

__device__ __forceinline__ int xs_index(int k) { return k + (k >> 4); }

template <typename T, int MODE>
__global__ void __launch_bounds__(32 * VEC_WARPS)
vec_kernel(const T* __restrict__ x, int64_t sxm, const int32_t* __restrict__ qw, const float* __restrict__ scale,
           const float* __restrict__ bias, const float* __restrict__ sx, T* __restrict__ y, int M, int N, int K,
           int KW, int G, int GS) {
  extern __shared__ float xs[];
  const int m = blockIdx.y;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const T* xrow = x + (int64_t)m * sxm;
  const int kpad = KW * 16;
  // 16-byte loads of the activation row when its start is 16-byte aligned and K fills them.
  constexpr int V = 16 / sizeof(T);
  const bool vec_ok = ((reinterpret_cast<uintptr_t>(xrow) & 15) == 0);
  for (int k0 = threadIdx.x * V; k0 < kpad; k0 += blockDim.x * V) {
    if (vec_ok && k0 + V <= K) {
      const uint4 raw = *reinterpret_cast<const uint4*>(xrow + k0);
      const T* vals = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int i = 0; i < V; ++i) xs[xs_index(k0 + i)] = 0.5f * to_f(vals[i]);
    } else {
      for (int i = 0; i < V && k0 + i < kpad; ++i)
        xs[xs_index(k0 + i)] = k0 + i < K ? 0.5f * to_f(xrow[k0 + i]) : 0.f;
    }
  }
  __syncthreads();
  const int n0 = (blockIdx.x * VEC_WARPS + warp) * VEC_ROWS;
  float acc[VEC_ROWS];
#pragma unroll
  for (int r = 0; r < VEC_ROWS; ++r) acc[r] = 0.f;
#pragma unroll 4
  for (int kw = lane; kw < KW; kw += 32) {
    uint32_t word[VEC_ROWS];
#pragma unroll
    for (int r = 0; r < VEC_ROWS; ++r)
      word[r] = n0 + r < N ? (uint32_t)__ldg(qw + (int64_t)(n0 + r) * KW + kw) : 0u;
    const float* xv = xs + xs_index(kw * 16);
#pragma unroll
    for (int e = 0; e < 16; ++e) {
      const float xe = xv[e];
#pragma unroll
      for (int r = 0; r < VEC_ROWS; ++r) {
        if (MODE == 0)
          acc[r] = fmaf(field_f32(word[r], e), xe, acc[r]);
        else
          acc[r] = fmaf(field_f32(word[r], e) * scale_at<MODE>(scale, min(n0 + r, N - 1), G, GS, kw * 16 + e),
                        xe, acc[r]);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < VEC_ROWS; ++r) {
    float v = acc[r];
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int n = n0 + r;
    if (lane == 0 && n < N) {
      if (MODE == 0) v *= scale[n];
      if (sx) v = __fdiv_rn(v, sx[m]);
      if (bias) v += bias[n];
      y[(int64_t)m * N + n] = from_f<T>(v);
    }
  }
}

// Padded index of the first K_pad element past the row, i.e. the shared memory a row needs.
int64_t vec_smem_bytes(int kw) { return (int64_t)(kw * 16 + kw) * sizeof(float); }

template <typename T>
void launch(const torch::Tensor& x, const torch::Tensor& qw, const torch::Tensor& scale, const float* bias,
            torch::Tensor& y, int K, int group_size, bool act_quant, bool vec) {
  const int M = x.size(0), N = qw.size(0), KW = qw.size(1), G = scale.size(1);
  const int GS = group_size > 0 ? group_size : 1;
  const int mode = group_size == 0 ? 0 : 2;
  auto stream = c10::cuda::getCurrentCUDAStream();
  const T* xp = reinterpret_cast<const T*>(x.data_ptr());
  int64_t sxm = x.stride(0), sxk = x.stride(1);
  torch::Tensor xq, sxt;
  const float* sxp = nullptr;
  if (act_quant) {
    xq = torch::empty({M, K}, x.options());
    sxt = torch::empty({M}, x.options().dtype(torch::kFloat32));
    act_quant_kernel<T><<<M, 256, 0, stream>>>(xp, sxm, sxk, reinterpret_cast<T*>(xq.data_ptr()),
                                                sxt.data_ptr<float>(), K);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    xp = reinterpret_cast<const T*>(xq.data_ptr());
    sxm = K;
    sxk = 1;
    sxp = sxt.data_ptr<float>();
  }
  T* yp = reinterpret_cast<T*>(y.data_ptr());
  const int32_t* qp = qw.data_ptr<int32_t>();
  const float* sp = scale.data_ptr<float>();
  if (!vec) {
    const int64_t total = (int64_t)M * N;
    const int threads = 256;
    const int blocks = (int)((total + threads - 1) / threads);
    if (mode == 0)
      naive_kernel<T, 0><<<blocks, threads, 0, stream>>>(xp, sxm, sxk, qp, sp, bias, sxp, yp, M, N, K, KW, G, GS);
    else
      naive_kernel<T, 2><<<blocks, threads, 0, stream>>>(xp, sxm, sxk, qp, sp, bias, sxp, yp, M, N, K, KW, G, GS);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  TORCH_CHECK(sxk == 1, "ternary vec kernel: x must be contiguous along K");
  const int64_t smem = vec_smem_bytes(KW);
  TORCH_CHECK(smem <= 227 * 1024, "ternary vec kernel: K = ", K, " needs ", smem, " bytes of shared memory");
  dim3 grid((N + VEC_WARPS * VEC_ROWS - 1) / (VEC_WARPS * VEC_ROWS), M);
  auto kern = mode == 0 ? vec_kernel<T, 0> : vec_kernel<T, 2>;
  if (smem > 48 * 1024)
    C10_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  kern<<<grid, 32 * VEC_WARPS, smem, stream>>>(xp, sxm, qp, sp, bias, sxp, yp, M, N, K, KW, G, GS);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

torch::Tensor ternary_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor scale,
                             c10::optional<torch::Tensor> bias, int64_t k, int64_t group_size, bool act_quant,
                             bool vec) {
  TORCH_CHECK(x.is_cuda() && qweight.is_cuda() && scale.is_cuda(), "ternary cuda kernels need CUDA tensors");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k, "x must be (M, K=", k, ")");
  TORCH_CHECK(qweight.scalar_type() == torch::kInt32 && qweight.dim() == 2 && qweight.is_contiguous(),
              "qweight must be contiguous int32 (N, Kw)");
  TORCH_CHECK(qweight.size(1) == (k + 15) / 16, "qweight has ", qweight.size(1), " words per row, K=", k);
  TORCH_CHECK(scale.scalar_type() == torch::kFloat32 && scale.is_contiguous() && scale.size(0) == qweight.size(0),
              "scale must be contiguous fp32 (N, G)");
  const c10::cuda::CUDAGuard guard(x.device());
  torch::Tensor bias_f;
  const float* bp = nullptr;
  if (bias.has_value()) {
    bias_f = bias->to(torch::kFloat32).contiguous();
    bp = bias_f.data_ptr<float>();
  }
  auto y = torch::empty({x.size(0), qweight.size(0)}, x.options());
  if (x.size(0) == 0 || qweight.size(0) == 0) return y;
  switch (x.scalar_type()) {
    case torch::kFloat32: launch<float>(x, qweight, scale, bp, y, (int)k, (int)group_size, act_quant, vec); break;
    case torch::kFloat16: launch<__half>(x, qweight, scale, bp, y, (int)k, (int)group_size, act_quant, vec); break;
    case torch::kBFloat16:
      launch<__nv_bfloat16>(x, qweight, scale, bp, y, (int)k, (int)group_size, act_quant, vec);
      break;
    default: TORCH_CHECK(false, "x must be fp16, bf16 or fp32, got ", x.scalar_type());
  }
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("ternary_linear", &ternary_linear, "ternary linear (naive or vectorized)", py::arg("x"), py::arg("qweight"),
        py::arg("scale"), py::arg("bias"), py::arg("k"), py::arg("group_size"), py::arg("act_quant"), py::arg("vec"));
}
