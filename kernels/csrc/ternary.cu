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

#include <cstdlib>
#include <string>
#include <vector>

#include "cp_async.cuh"
#include "dtypes.cuh"
#include "launch.cuh"
#include "ternary_tiles.cuh"

namespace {

using parity::from_f;
using parity::pair_bits;
using parity::to_f;

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

using parity::pdl_launch_dependents;
using parity::pdl_wait;
// The kernels read the weights before waiting (nothing in the stream writes them) and x, sx, y after.

// ---------------------------------------------------------------------------------------------
// Per-token absmax int8 fake quantization: one block per row.
template <typename T>
__global__ void act_quant_kernel(const T* __restrict__ x, int64_t sxm, int64_t sxk, T* __restrict__ xq,
                                 float* __restrict__ sx, int K) {
  pdl_launch_dependents();  // the linear kernel after it may start loading its weights now
  pdl_wait();
  const int m = blockIdx.x;
  const T* row = x + (int64_t)m * sxm;
  const float s = parity::row_quant_scale(row, sxk, K);
  for (int k = threadIdx.x; k < K; k += blockDim.x)
    xq[(int64_t)m * K + k] = from_f<T>(parity::quant_level(to_f(row[(int64_t)k * sxk]), s));
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
          // Padding past K has zero weights but no scale: read the last real one, never past the row.
          acc[r] = fmaf(field_f32(word[r], e) *
                            scale_at<MODE>(scale, min(n0 + r, N - 1), G, GS, min(kw * 16 + e, K - 1)),
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
    act_quant_kernel<T><<<M, 1024, 0, stream>>>(xp, sxm, sxk, reinterpret_cast<T*>(xq.data_ptr()),
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

// ---------------------------------------------------------------------------------------------
// Tensor-core kernel for small M on the tiled layout (kernels/ternary_repack.py, pack_tiles):
// tiles int32 (NT, KC, 32, 4); tile (nt, c) covers rows 16 nt.. and inputs 128 c.., one uint4 per
// lane, 512 contiguous bytes per warp. Or on the row layout itself (Src below): lane (g, t) reads words
// of rows 16 nt + g and + 8 that hold its own run of inputs, whose pairs of fields are the A registers as
// they are (one copy of the weight serves every M). A block owns TN consecutive row tiles and MB * 8
// tokens; its warps split the chunks of K (warp w takes c = w, w + W, ...) and add their partial sums in shared
// memory at the end. Lane (g, t) of a warp meets inputs 128 c + 32 t .. + 31 of tokens g (+ 8 mb),
// read as four 16-byte loads; each uint4 of weights decodes to the A registers of 8 k16 steps with a
// shift and an AND per register (+-2.0 / 0 half2), against an fp32 accumulator: one instruction per
// two weights besides the MMAs, so the kernel streams the 2-bit weights at memory speed.
using parity::TILE_K;
using parity::TILE_N;

// d += a * b for one m16n8k16 tile, fp32 accumulators; PTX_T names T in the instruction.
template <typename T> struct MmaOp;
#define PARITY_MMA_OP(T, PTX_T)                                                                             \
  template <> struct MmaOp<T> {                                                                             \
    static __device__ __forceinline__ void run(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,          \
                                               uint32_t a3, uint32_t b0, uint32_t b1) {                        \
      asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." PTX_T "." PTX_T ".f32 {%0,%1,%2,%3}, "           \
                   "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"                                                \
                   : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                                            \
                   : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));                                    \
    }                                                                                                         \
  };
PARITY_MMA_OP(__half, "f16")
PARITY_MMA_OP(__nv_bfloat16, "bf16")
#undef PARITY_MMA_OP

// Streamed once: no L1 allocation, and a 256-byte L2 fetch so DRAM sees whole bursts.
__device__ __forceinline__ uint4 load_stream(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ uint2 load_stream2(const uint32_t* p) {
  uint2 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v2.u32 {%0,%1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}

// Where the tensor-core kernel reads its weights: the tiles (a chunk is 128 inputs, a uint4 a lane per row
// tile), or the row layout (int32 (N, KW), words of 16 inputs) with 8-byte loads (ROWS8: chunks of 128 inputs,
// which group scales of 128 need) or 16-byte loads (ROWS16: chunks of 256 inputs, two uint4 a lane per tile).
enum : int { SRC_TILES = 0, SRC_ROWS8 = 1, SRC_ROWS16 = 2 };
template <int SRC>
struct Src {
  static constexpr int CK = SRC == SRC_ROWS16 ? 256 : 128;  // inputs of a chunk
  static constexpr int WPT = SRC == SRC_ROWS16 ? 2 : 1;      // weight uint4 of a lane per tile and chunk
  static constexpr int NQ = CK / 32;                         // x uint4 of a lane per token and chunk
};

// The weights of lane (g, t) of row tile nt for chunk c, zeros past N or K. Tiles: its uint4. ROWS8: words
// 8 c + 2 t, + 1 of row 16 nt + g in .x, .y and of row 16 nt + g + 8 in .z, .w. ROWS16: words 16 c + 4 t .. + 3
// of row 16 nt + g in wq[0] and of row 16 nt + g + 8 in wq[1]. One vector load a row where every row starts
// aligned to it (wvec), else a load a word.
template <int SRC>
__device__ __forceinline__ void load_weights(uint4 (&wq)[Src<SRC>::WPT], const void* __restrict__ w, int nt, int c,
                                             int lane, int NT, int KC, int N, int KW, bool wvec) {
  if constexpr (SRC == SRC_TILES) {
    wq[0] = c < KC && nt < NT ? load_stream(reinterpret_cast<const uint4*>(w) + ((int64_t)nt * KC + c) * 32 + lane)
                              : make_uint4(0, 0, 0, 0);
    return;
  }
  constexpr int WORDS = SRC == SRC_ROWS16 ? 4 : 2;  // words of a row a lane reads
  const uint32_t* qw = reinterpret_cast<const uint32_t*>(w);
  const int n = nt * TILE_N + (lane >> 2), word = WORDS * (4 * c + (lane & 3));
  uint32_t v[2][WORDS] = {};
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = n + 8 * h;
    if (row >= N) continue;
    const uint32_t* p = qw + (int64_t)row * KW + word;
    if (wvec) {
      if (word < KW) {
        if constexpr (SRC == SRC_ROWS16) {
          const uint4 u = load_stream(reinterpret_cast<const uint4*>(p));
          v[h][0] = u.x; v[h][1] = u.y; v[h][2] = u.z; v[h][3] = u.w;
        } else {
          const uint2 u = load_stream2(p);
          v[h][0] = u.x; v[h][1] = u.y;
        }
      }
    } else {
#pragma unroll
      for (int e = 0; e < WORDS; ++e)
        if (word + e < KW) v[h][e] = __ldg(p + e);
    }
  }
  if constexpr (SRC == SRC_ROWS16) {
    wq[0] = make_uint4(v[0][0], v[0][1], v[0][2], v[0][3]);
    wq[1] = make_uint4(v[1][0], v[1][1], v[1][2], v[1][3]);
  } else {
    wq[0] = make_uint4(v[0][0], v[0][1], v[1][0], v[1][1]);
  }
}

// The run of NQ * 8 activations of one lane for a chunk (zeros past K or past M).
template <typename T, int NQ>
__device__ __forceinline__ void load_x(uint4 (&xv)[NQ], const T* __restrict__ x, int64_t sxm, int m, int M, int K,
                                       int k0, bool vec) {
  if (m >= M) {
#pragma unroll
    for (int q = 0; q < NQ; ++q) xv[q] = make_uint4(0, 0, 0, 0);
    return;
  }
  const T* row = x + (int64_t)m * sxm;
  if (vec && k0 + 8 * NQ <= K) {
#pragma unroll
    for (int q = 0; q < NQ; ++q) xv[q] = __ldg(reinterpret_cast<const uint4*>(row + k0) + q);
    return;
  }
#pragma unroll
  for (int q = 0; q < NQ; ++q) {
    uint16_t h[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int k = k0 + 8 * q + i;
      h[i] = k < K ? __ldg(reinterpret_cast<const uint16_t*>(row) + k) : (uint16_t)0;
    }
    xv[q] = make_uint4(h[0] | (uint32_t)h[1] << 16, h[2] | (uint32_t)h[3] << 16, h[4] | (uint32_t)h[5] << 16,
                       h[6] | (uint32_t)h[7] << 16);
  }
}

// Rows: the A registers of a step from the words of rows g (lo) and g + 8 (hi), pairs 2 R and 2 R + 1 (a word's
// pair p holds its inputs 2 p and 2 p + 1 at bits 2 p and 16 + 2 p).
template <int R>
__device__ __forceinline__ void rows_a(uint32_t lo, uint32_t hi, uint32_t& a0, uint32_t& a1, uint32_t& a2,
                                       uint32_t& a3) {
  a0 = pair_bits<2 * R>(lo);
  a1 = pair_bits<2 * R>(hi);
  a2 = pair_bits<2 * R + 1>(lo);
  a3 = pair_bits<2 * R + 1>(hi);
}

__device__ __forceinline__ uint32_t word_of(const uint4& v, int j) {
  return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w;
}

// Step s of a chunk takes inputs CK c + (CK / 4) t + 4 s .. + 3 of lane (g, t): a0 / a2 its first / second two
// of row g, a1 / a3 those of row g + 8. Rows: word s / 4 of the lane's words of each row, pairs 2 (s % 4), + 1.
template <typename T, int TN, int MB, int SRC>
__device__ __forceinline__ void mma_chunk(float (&acc)[TN][MB][4], const uint4 (&wq)[TN][Src<SRC>::WPT],
                                          const uint4 (&xv)[MB][Src<SRC>::NQ]) {
#pragma unroll
  for (int s = 0; s < Src<SRC>::CK / 16; ++s) {
#pragma unroll
    for (int i = 0; i < TN; ++i) {
      uint32_t a0, a1, a2, a3;
      if constexpr (SRC == SRC_TILES) {
        parity::tile_a(wq[i][0], s, a0, a1, a2, a3);
      } else {
        const uint4& w_lo = wq[i][0];                  // ROWS16: row g; ROWS8: rows g (.x, .y) and g + 8
        const uint4& w_hi = wq[i][Src<SRC>::WPT - 1];  // ROWS16: row g + 8
        const uint32_t lo = SRC == SRC_ROWS16 ? word_of(w_lo, s >> 2) : s < 4 ? w_lo.x : w_lo.y;
        const uint32_t hi = SRC == SRC_ROWS16 ? word_of(w_hi, s >> 2) : s < 4 ? w_lo.z : w_lo.w;
        switch (s & 3) {
          case 0: rows_a<0>(lo, hi, a0, a1, a2, a3); break;
          case 1: rows_a<1>(lo, hi, a0, a1, a2, a3); break;
          case 2: rows_a<2>(lo, hi, a0, a1, a2, a3); break;
          default: rows_a<3>(lo, hi, a0, a1, a2, a3); break;
        }
      }
#pragma unroll
      for (int mb = 0; mb < MB; ++mb) {
        const uint4& q = xv[mb][s >> 1];
        const uint32_t b0 = (s & 1) ? q.z : q.x, b1 = (s & 1) ? q.w : q.y;
        MmaOp<T>::run(acc[i][mb], a0, a1, a2, a3, b0, b1);
      }
    }
  }
}

// The block's output tile: each warp's partial sums go through shared memory (red[warp][slot][lane],
// slot = (i * MB + mb) * 4 + r), then the block adds them and writes y with the scale, 1 / s_x and bias.
template <typename T, int TN, int MB, bool GROUP>
__device__ __forceinline__ void store_tile(const float (&acc)[TN][MB][4], float* red, const float* __restrict__ scale,
                                           const float* __restrict__ bias, const float* __restrict__ sx,
                                           T* __restrict__ y, int M, int N, int G, int nt0, int m0) {
  constexpr int SLOTS = TN * MB * 4;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
#pragma unroll
  for (int i = 0; i < TN; ++i)
#pragma unroll
    for (int mb = 0; mb < MB; ++mb)
#pragma unroll
      for (int r = 0; r < 4; ++r) red[((warp * SLOTS) + (i * MB + mb) * 4 + r) * 32 + lane] = acc[i][mb][r];
  __syncthreads();
  for (int idx = threadIdx.x; idx < SLOTS * 32; idx += blockDim.x) {
    float v = 0.f;
    for (int w = 0; w < nwarps; ++w) v += red[w * SLOTS * 32 + idx];
    // C fragment element r of lane l: row (l / 4) + 8 (r / 2), column 2 (l % 4) + r % 2; rows are n.
    const int slot = idx >> 5, l = idx & 31;
    const int r = slot & 3, mb = (slot >> 2) % MB, i = (slot >> 2) / MB;
    const int n = (nt0 + i) * TILE_N + (l >> 2) + 8 * (r >> 1), m = m0 + mb * 8 + 2 * (l & 3) + (r & 1);
    if (n >= N || m >= M) continue;
    v *= 0.5f;  // the decoded weights are +-2
    if (!GROUP) v *= scale[(int64_t)n * G];
    if (sx) v = __fdiv_rn(v, sx[m]);
    if (bias) v += bias[n];
    y[(int64_t)m * N + n] = from_f<T>(v);
  }
}

// The group scales of lane (g, t)'s rows 16 nt + g and + 8 for chunk c (zeros past N or K), CPG chunks a group:
// loaded with the chunk's weights, so their latency hides behind the weights' and not behind the chunk's MMAs.
// Groups of one chunk (128 inputs), the usual size, skip the division.
__device__ __forceinline__ void load_scales(float (&s)[2], const float* __restrict__ scale, int nt, int c, int lane,
                                            int N, int KC, int G, int CPG) {
  const int n_lo = nt * TILE_N + (lane >> 2), n_hi = n_lo + 8, grp = CPG == 1 ? c : c / CPG;
  s[0] = c < KC && n_lo < N ? __ldg(scale + (int64_t)n_lo * G + grp) : 0.f;
  s[1] = c < KC && n_hi < N ? __ldg(scale + (int64_t)n_hi * G + grp) : 0.f;
}

// One chunk (CK inputs of TN row tiles) into acc; with group scales the chunk's partial of tile i is scaled first
// by scales(i), lane (g, t)'s rows g and g + 8 (the group size is a multiple of the chunk, so a chunk shares one scale
// per row); asked a tile at a time, so that staged scales are read from shared memory only as each tile needs them.
template <typename T, int TN, int MB, bool GROUP, int SRC, typename Scales>
__device__ __forceinline__ void mma_chunk_scaled(float (&acc)[TN][MB][4], const uint4 (&wq)[TN][Src<SRC>::WPT],
                                                 const uint4 (&xv)[MB][Src<SRC>::NQ], Scales scales) {
  static_assert(!GROUP || Src<SRC>::CK == TILE_K, "group scales need chunks of 128 inputs");
  if (!GROUP) {
    mma_chunk<T, TN, MB, SRC>(acc, wq, xv);
    return;
  }
  using Tile = const uint4(&)[1][Src<SRC>::WPT];
#pragma unroll
  for (int i = 0; i < TN; ++i) {  // a tile at a time: the partial sums of one tile
    float part[1][MB][4] = {};
    mma_chunk<T, 1, MB, SRC>(part, reinterpret_cast<Tile>(wq[i]), xv);
    const float2 sc = scales(i);
#pragma unroll
    for (int mb = 0; mb < MB; ++mb)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[i][mb][r] = fmaf(part[0][mb][r], r < 2 ? sc.x : sc.y, acc[i][mb][r]);
  }
}

// Group scales staged in shared memory: each warp copies those of its own chunks (j-th chunk c = warp + j W) to
// its slots before its first chunk, by cp.async, so that no registers hold them while they arrive (with them held,
// the kernel took 84-100 registers at 4 tiles against the seed layout's 64). Slot ((j TN + i) 8 + g) 2 + h holds row
// 16 (nt0 + i) + g + 8 h: lane (g, t) reads its two rows of a tile as one float2, the 8 rows of a warp in 8 banks.
template <int TN>
__device__ __forceinline__ void stage_scales(float* slots, const float* __restrict__ scale, int nt0, int warp,
                                             int nwarps, int lane, int N, int KC, int G, int CPG) {
  const int chunks = warp < KC ? (KC - warp + nwarps - 1) / nwarps : 0;
  for (int e = lane; e < chunks * TN * TILE_N; e += 32) {
    const int j = e / (TN * TILE_N), i = (e >> 4) % TN, h = e & 1, g = (e >> 1) & 7;
    const int n = (nt0 + i) * TILE_N + g + 8 * h, c = warp + j * nwarps, grp = CPG == 1 ? c : c / CPG;
    parity::cp_async4(parity::smem_addr(slots + e), scale + (int64_t)min(n, N - 1) * G + grp, n < N ? 4 : 0);
  }
}

// Shared-memory floats of the staged scales: W warps, ceil(KC / W) chunks each.
__host__ __device__ constexpr int64_t staged_floats(int tn, int warps, int kc) {
  return (int64_t)warps * ((kc + warps - 1) / warps) * tn * TILE_N;
}

// Block of the tensor-core kernel: TN row tiles x MB * 8 tokens. Each iteration a warp requests L
// weight uint4 per lane (U = L / (TN * WPT) chunks of its TN tiles, L * 512 bytes per warp) before decoding
// the first; B fragments come from global memory (x is small and stays in L2).
template <typename T, int TN, int MB, int L, bool GROUP, int SRC, bool STAGE>
__global__ void __launch_bounds__(512)
mma_kernel(const T* __restrict__ x, int64_t sxm, const void* __restrict__ w, const float* __restrict__ scale,
           const float* __restrict__ bias, const float* __restrict__ sx, T* __restrict__ y, int M, int N, int K,
           int NT, int KC, int KW, int G, int CPG, bool xvec, bool wvec) {
  using S = Src<SRC>;
  extern __shared__ float red[];
  constexpr int U = L / (TN * S::WPT) > 0 ? L / (TN * S::WPT) : 1;  // chunks per iteration
  pdl_launch_dependents();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int nt0 = blockIdx.x * TN;
  const int m0 = blockIdx.y * MB * 8;
  float acc[TN][MB][4] = {};
  // STAGE: the warp's group scales, after the block's partial sums (red)
  float* slots = red + nwarps * TN * MB * 4 * 32 + (STAGE ? staged_floats(TN, nwarps, KC) / nwarps * warp : 0);
  if constexpr (STAGE) stage_scales<TN>(slots, scale, nt0, warp, nwarps, lane, N, KC, G, CPG);

  for (int c0 = warp, j0 = 0; c0 < KC; c0 += nwarps * U, j0 += U) {
    uint4 wq[U][TN][S::WPT];
    float sc[STAGE ? 1 : U][TN][2];  // loaded with the weights unless staged
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + u * nwarps;
#pragma unroll
      for (int i = 0; i < TN; ++i) {
        load_weights<SRC>(wq[u][i], w, nt0 + i, c, lane, NT, KC, N, KW, wvec);
        if constexpr (GROUP && !STAGE) load_scales(sc[u][i], scale, nt0 + i, c, lane, N, KC, G, CPG);
      }
    }
    pdl_wait();
    if constexpr (STAGE) {  // the first time: the copies above have landed and every lane's are visible
      parity::cp_async_wait<0>();
      __syncwarp();
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + u * nwarps;
      if (c >= KC) break;
      uint4 xv[MB][S::NQ];
#pragma unroll
      for (int mb = 0; mb < MB; ++mb)
        load_x<T, S::NQ>(xv[mb], x, sxm, m0 + mb * 8 + g, M, K, c * S::CK + (S::CK / 4) * t, xvec);
      mma_chunk_scaled<T, TN, MB, GROUP, SRC>(acc, wq[u], xv, [&](int i) {
        if constexpr (STAGE)
          return reinterpret_cast<const float2*>(slots)[((j0 + u) * TN + i) * 8 + g];
        else
          return make_float2(sc[u][i][0], sc[u][i][1]);
      });
    }
  }
  pdl_wait();  // warps without a chunk
  store_tile<T, TN, MB, GROUP>(acc, red, scale, bias, sx, y, M, N, G, nt0, blockIdx.y * MB * 8);
}

using parity::launch_kernel;

struct MmaArgs {
  int64_t sxm;
  const float* bias;
  const float* sx;
  int M, N, K, KW, G, CPG, warps;  // CPG: chunks (128 inputs) a scale group
  bool xvec, wvec, pdl;
  cudaStream_t stream;
};

// Group scales are staged in shared memory at one token fragment where they take at most this much (K up to 65536
// at 4 tiles); above, and at two fragments (where staging measured no faster), each chunk's are loaded with its
// weights.
constexpr int64_t STAGED_SCALES_MAX_BYTES = 64 * 1024;

template <typename T, int TN, int MB, int L, bool GROUP, int SRC>
void launch_mma_cfg(const T* xp, const torch::Tensor& w, const torch::Tensor& scale, T* yp, MmaArgs a) {
  const int NT = (a.N + TILE_N - 1) / TILE_N, KC = (a.K + Src<SRC>::CK - 1) / Src<SRC>::CK;
  dim3 grid((NT + TN - 1) / TN, (a.M + MB * 8 - 1) / (MB * 8));
  const int64_t red = (int64_t)a.warps * TN * MB * 4 * 32 * sizeof(float);
  const int64_t staged = GROUP ? staged_floats(TN, a.warps, KC) * (int64_t)sizeof(float) : 0;
  constexpr bool STAGE = GROUP && MB == 1;
  const bool stage = STAGE && staged <= STAGED_SCALES_MAX_BYTES;
  int64_t smem = red + (stage ? staged : 0);
  // Staged, the kernel takes 64 registers at 1 and 2 tiles and 80 at 4, so more blocks may share a multiprocessor
  // than the grid needs: at most as many as one even wave takes (the H100 A/B in benchmarks/NOTES.md).
  if (stage) {
    const parity::DeviceInfo info = parity::device_info(c10::cuda::current_device());
    const int64_t per_sm = ((int64_t)grid.x * grid.y + info.sms - 1) / info.sms;
    if (per_sm <= 3) smem = std::max(smem, parity::smem_for_blocks_per_sm(info, per_sm));
  }
  // The row layout: a vector load a row where every row starts aligned to it.
  const int vec_words = SRC == SRC_ROWS16 ? 4 : 2;
  a.wvec = SRC != SRC_TILES && a.KW % vec_words == 0 &&
           (reinterpret_cast<uintptr_t>(w.data_ptr()) & (4 * vec_words - 1)) == 0;
  auto kern = stage ? mma_kernel<T, TN, MB, L, GROUP, SRC, STAGE> : mma_kernel<T, TN, MB, L, GROUP, SRC, false>;
  launch_kernel(kern, grid, 32 * a.warps, (int)smem, a.pdl, a.stream, xp, a.sxm,
                (const void*)w.data_ptr<int32_t>(), (const float*)scale.data_ptr<float>(), a.bias, a.sx, yp, a.M, a.N,
                a.K, NT, KC, a.KW, a.G, a.CPG, a.xvec, a.wvec);
}

// The source of an instance on the row layout: 16-byte loads a row (chunks of 256 inputs) where the registers
// allow and there are no group scales, else 8-byte loads (chunks of 128 inputs).
constexpr int rows_src(int tn, int mb, bool group) { return group || tn * mb > 4 ? SRC_ROWS8 : SRC_ROWS16; }

template <typename T, bool ROWS>
void dispatch_mma(const T* xp, const torch::Tensor& w, const torch::Tensor& scale, T* yp, const MmaArgs& a, int tn,
                  int mb, int loads, bool group) {
#define PARITY_MMA(TN_, MB_, L_, GROUP_)                                                                        \
  if (group == GROUP_ && tn == TN_ && mb == MB_ && loads == L_)                                                 \
    return launch_mma_cfg<T, TN_, MB_, L_, GROUP_, ROWS ? rows_src(TN_, MB_, GROUP_) : SRC_TILES>(xp, w, scale, \
                                                                                                   yp, a);
  PARITY_MMA(1, 1, 4, false) PARITY_MMA(2, 1, 4, false) PARITY_MMA(4, 1, 4, false)
  PARITY_MMA(1, 1, 8, false) PARITY_MMA(2, 1, 8, false) PARITY_MMA(4, 1, 8, false)
  PARITY_MMA(1, 2, 4, false) PARITY_MMA(2, 2, 4, false) PARITY_MMA(4, 2, 4, false)
  // Group scales need a second accumulator: fewer instances, the registers allow no more.
  PARITY_MMA(1, 1, 4, true) PARITY_MMA(2, 1, 4, true) PARITY_MMA(4, 1, 4, true)
  PARITY_MMA(1, 2, 4, true) PARITY_MMA(2, 2, 4, true)
#undef PARITY_MMA
  TORCH_CHECK(false, "ternary mma kernel: no instance for tn=", tn, " mb=", mb, " loads=", loads,
              group ? " with group scales" : "");
}

// w: the tiles, or the row layout (rows).
template <typename T>
void launch_mma(const torch::Tensor& x, const torch::Tensor& w, bool rows, const torch::Tensor& scale,
                const float* bias, torch::Tensor& y, int N, int K, int group_size, bool act_quant, int tn, int mb,
                int warps, int loads, bool pdl) {
  MmaArgs a{};
  a.M = x.size(0);
  a.N = N;
  a.K = K;
  a.KW = rows ? (int)w.size(1) : 0;
  a.G = scale.size(1);
  a.warps = warps;
  a.bias = bias;
  a.pdl = pdl;
  a.stream = c10::cuda::getCurrentCUDAStream();
  const T* xp = reinterpret_cast<const T*>(x.data_ptr());
  a.sxm = x.stride(0);
  torch::Tensor xq, sxt;
  if (act_quant) {
    xq = torch::empty({a.M, K}, x.options());
    sxt = torch::empty({a.M}, x.options().dtype(torch::kFloat32));
    launch_kernel(act_quant_kernel<T>, dim3(a.M), 1024, 0, a.pdl, a.stream, xp, a.sxm, (int64_t)x.stride(1),
                  reinterpret_cast<T*>(xq.data_ptr()), sxt.data_ptr<float>(), K);
    xp = reinterpret_cast<const T*>(xq.data_ptr());
    a.sxm = K;
    a.sx = sxt.data_ptr<float>();
  }
  a.xvec = (reinterpret_cast<uintptr_t>(xp) & 15) == 0 && (a.sxm * (int64_t)sizeof(T)) % 16 == 0;
  const bool group = group_size > 0;
  a.CPG = group ? group_size / TILE_K : 1;
  T* yp = reinterpret_cast<T*>(y.data_ptr());
  if (rows)
    dispatch_mma<T, true>(xp, w, scale, yp, a, tn, mb, loads, group);
  else
    dispatch_mma<T, false>(xp, w, scale, yp, a, tn, mb, loads, group);
}

// The bias as contiguous fp32, which the kernels read; undefined when there is none.
torch::Tensor float_bias(const c10::optional<torch::Tensor>& bias) {
  return bias.has_value() ? bias->to(torch::kFloat32).contiguous() : torch::Tensor();
}

// The tensor-core kernel on the tiles, or on the row layout (rows: w is qweight, int32 (N, ceil(K / 16))).
torch::Tensor linear_mma(const torch::Tensor& x, const torch::Tensor& w, bool rows, const torch::Tensor& scale,
                         const c10::optional<torch::Tensor>& bias, int64_t n, int64_t k, int64_t group_size,
                         bool act_quant, int64_t tn, int64_t mb, int64_t warps, int64_t loads, bool pdl) {
  TORCH_CHECK(x.is_cuda() && w.is_cuda() && scale.is_cuda(), "ternary mma kernel needs CUDA tensors");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k && x.stride(1) == 1, "ternary mma kernel: x must be (M, K=", k,
              ") contiguous along K");
  TORCH_CHECK(x.scalar_type() == torch::kFloat16 || x.scalar_type() == torch::kBFloat16,
              "ternary mma kernel: x must be fp16 or bf16, got ", x.scalar_type());
  if (rows) {
    TORCH_CHECK(w.scalar_type() == torch::kInt32 && w.is_contiguous() && w.dim() == 2 && w.size(0) == n &&
                    w.size(1) == (k + 15) / 16,
                "ternary mma kernel: qweight must be contiguous int32 (N, ceil(K/16)) for N=", n, " K=", k);
  } else {
    parity::check_tiles(w, n, k, "ternary mma kernel");
  }
  TORCH_CHECK(scale.scalar_type() == torch::kFloat32 && scale.is_contiguous() && scale.dim() == 2 &&
                  scale.size(0) == n,
              "ternary mma kernel: scale must be contiguous fp32 (N, G)");
  TORCH_CHECK(group_size == 0 || group_size % TILE_K == 0, "ternary mma kernel: group size ", group_size,
              " is not a multiple of ", TILE_K);
  TORCH_CHECK(warps >= 1 && warps <= 16, "warps must be 1..16");
  const c10::cuda::CUDAGuard guard(x.device());
  const torch::Tensor bias_f = float_bias(bias);
  const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  auto y = torch::empty({x.size(0), n}, x.options());
  if (x.size(0) == 0 || n == 0) return y;
  if (x.scalar_type() == torch::kFloat16)
    launch_mma<__half>(x, w, rows, scale, bp, y, (int)n, (int)k, (int)group_size, act_quant, (int)tn, (int)mb,
                       (int)warps, (int)loads, pdl);
  else
    launch_mma<__nv_bfloat16>(x, w, rows, scale, bp, y, (int)n, (int)k, (int)group_size, act_quant, (int)tn,
                              (int)mb, (int)warps, (int)loads, pdl);
  return y;
}

torch::Tensor ternary_linear_mma(torch::Tensor x, torch::Tensor tiles, torch::Tensor scale,
                                 c10::optional<torch::Tensor> bias, int64_t n, int64_t k, int64_t group_size,
                                 bool act_quant, int64_t tn, int64_t mb, int64_t warps, int64_t loads, bool pdl) {
  return linear_mma(x, tiles, false, scale, bias, n, k, group_size, act_quant, tn, mb, warps, loads, pdl);
}

torch::Tensor ternary_linear_mma_rows(torch::Tensor x, torch::Tensor qweight, torch::Tensor scale,
                                      c10::optional<torch::Tensor> bias, int64_t n, int64_t k, int64_t group_size,
                                      bool act_quant, int64_t tn, int64_t mb, int64_t warps, int64_t loads,
                                      bool pdl) {
  return linear_mma(x, qweight, true, scale, bias, n, k, group_size, act_quant, tn, mb, warps, loads, pdl);
}

// ---------------------------------------------------------------------------------------------
// Dense weight in x's dtype from the row layout, scale folded in (for large M, where a tensor-core
// GEMM library on the dense weight outruns decoding inside the GEMM): a thread per word.
template <typename T>
__global__ void dequant_kernel(const int32_t* __restrict__ qw, const float* __restrict__ scale, T* __restrict__ w,
                               int N, int K, int KW, int G, int GS) {
  const int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= (int64_t)N * KW) return;
  const int n = (int)(idx / KW), kw = (int)(idx % KW);
  const uint32_t word = (uint32_t)__ldg(qw + idx);
  T* out = w + (int64_t)n * K + kw * 16;
  const int k0 = kw * 16;
  if (k0 + 16 <= K && (K % 8) == 0) {
    __align__(16) T v[16];
#pragma unroll
    for (int e = 0; e < 16; ++e) {
      const float s = scale[(int64_t)n * G + (G == 1 ? 0 : (k0 + e) / GS)];
      v[e] = from_f<T>(0.5f * field_f32(word, e) * s);
    }
    reinterpret_cast<uint4*>(out)[0] = reinterpret_cast<const uint4*>(v)[0];
    if (sizeof(T) == 2) reinterpret_cast<uint4*>(out)[1] = reinterpret_cast<const uint4*>(v)[1];
    else {
      reinterpret_cast<uint4*>(out)[1] = reinterpret_cast<const uint4*>(v)[1];
      reinterpret_cast<uint4*>(out)[2] = reinterpret_cast<const uint4*>(v)[2];
      reinterpret_cast<uint4*>(out)[3] = reinterpret_cast<const uint4*>(v)[3];
    }
    return;
  }
  for (int e = 0; e < 16 && k0 + e < K; ++e) {
    const float s = scale[(int64_t)n * G + (G == 1 ? 0 : (k0 + e) / GS)];
    out[e] = from_f<T>(0.5f * field_f32(word, e) * s);
  }
}

torch::Tensor ternary_dequant(torch::Tensor qweight, torch::Tensor scale, int64_t k, int64_t group_size,
                              torch::Tensor w) {
  TORCH_CHECK(qweight.is_cuda() && scale.is_cuda(), "ternary dequant needs CUDA tensors");
  TORCH_CHECK(qweight.scalar_type() == torch::kInt32 && qweight.dim() == 2 && qweight.is_contiguous() &&
                  qweight.size(1) == (k + 15) / 16,
              "qweight must be contiguous int32 (N, ceil(K/16))");
  TORCH_CHECK(scale.scalar_type() == torch::kFloat32 && scale.is_contiguous() && scale.size(0) == qweight.size(0),
              "scale must be contiguous fp32 (N, G)");
  const c10::cuda::CUDAGuard guard(qweight.device());
  const int N = qweight.size(0), KW = qweight.size(1), G = scale.size(1);
  TORCH_CHECK(w.is_cuda() && w.is_contiguous() && w.dim() == 2 && w.size(0) == N && w.size(1) == k,
              "dequant output must be contiguous (N, K)");
  const auto dtype = w.scalar_type();
  const int64_t total = (int64_t)N * KW;
  if (total == 0) return w;
  const int threads = 256;
  const int blocks = (int)((total + threads - 1) / threads);
  auto stream = c10::cuda::getCurrentCUDAStream();
  const int GS = group_size > 0 ? (int)group_size : 1;
  const int32_t* qp = qweight.data_ptr<int32_t>();
  const float* sp = scale.data_ptr<float>();
  switch (dtype) {
    case torch::kFloat16:
      dequant_kernel<__half><<<blocks, threads, 0, stream>>>(qp, sp, reinterpret_cast<__half*>(w.data_ptr()), N,
                                                              (int)k, KW, G, GS);
      break;
    case torch::kBFloat16:
      dequant_kernel<__nv_bfloat16><<<blocks, threads, 0, stream>>>(
          qp, sp, reinterpret_cast<__nv_bfloat16*>(w.data_ptr()), N, (int)k, KW, G, GS);
      break;
    case torch::kFloat32:
      dequant_kernel<float><<<blocks, threads, 0, stream>>>(qp, sp, w.data_ptr<float>(), N, (int)k, KW, G, GS);
      break;
    default: TORCH_CHECK(false, "dequant dtype must be fp16, bf16 or fp32, got ", dtype);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return w;
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
  const torch::Tensor bias_f = float_bias(bias);
  const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
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

// ---------------------------------------------------------------------------------------------
// Dense weight from the tiled layout (the one resident copy: the large-M path reads it too), scale
// folded in: a thread per int32 word of tiles. Word j of lane (g, t) of tile (nt, c) holds rows
// 16 nt + g and 16 nt + g + 8 at inputs 128 c + 32 t + 8 j .. + 7, so 16 consecutive threads (t, j)
// write 256 contiguous bytes of each of their two rows (one 16-byte store per row for fp16 / bf16).
// Field of input e (0..7) of row half rs: step s = 2 j + e / 4, register r = 2 ((e / 2) % 2) + rs,
// pair p = 4 (s % 2) + r, bit 2 p + 16 (e % 2) (ternary_repack._tile_index).
template <typename T>
__global__ void dequant_tiles_kernel(const uint32_t* __restrict__ tiles, const float* __restrict__ scale,
                                     T* __restrict__ w, int N, int K, int NT, int KC, int G, int GS, bool vec) {
  const int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= (int64_t)NT * KC * 128) return;
  const int j = (int)(idx & 3), lane = (int)((idx >> 2) & 31);
  const int64_t tc = idx >> 7;
  const int c = (int)(tc % KC), nt = (int)(tc / KC);
  const uint32_t word = __ldg(tiles + idx);
  const int g = lane >> 2, t = lane & 3;
  const int k0 = c * TILE_K + 32 * t + 8 * j;
#pragma unroll
  for (int rs = 0; rs < 2; ++rs) {
    const int n = nt * TILE_N + g + 8 * rs;
    if (n >= N) continue;
    const float* srow = scale + (int64_t)n * G;
    // The 8 inputs share a group where the group size is a multiple of 8: one scale (a division) for all.
    const bool one_scale = G == 1 || GS % 8 == 0;
    const float s8 = G == 1 ? srow[0] : srow[min(k0, K - 1) / GS];
    __align__(16) T v[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const int p = 4 * (e >> 2) + 2 * ((e >> 1) & 1) + rs, bit = 2 * p + 16 * (e & 1);
      const float f = __uint_as_float((word << (30 - bit)) & 0xC0000000u);  // +-2.0 or 0
      const int k = min(k0 + e, K - 1);  // padding past K: a zero weight, never a scale past the row
      v[e] = from_f<T>(0.5f * f * (one_scale ? s8 : srow[k / GS]));
    }
    T* out = w + (int64_t)n * K + k0;
    if (vec && k0 + 8 <= K) {
#pragma unroll
      for (int i = 0; i < (int)(8 * sizeof(T) / 16); ++i)
        reinterpret_cast<uint4*>(out)[i] = reinterpret_cast<const uint4*>(v)[i];
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e)
        if (k0 + e < K) out[e] = v[e];
    }
  }
}

torch::Tensor ternary_dequant_tiles(const torch::Tensor& tiles, const torch::Tensor& scale, int64_t n, int64_t k,
                                    int64_t group_size, c10::ScalarType dtype) {
  TORCH_CHECK(tiles.is_cuda() && scale.is_cuda(), "ternary dequant_tiles needs CUDA tensors");
  parity::check_tiles(tiles, n, k, "ternary dequant_tiles");
  TORCH_CHECK(scale.scalar_type() == torch::kFloat32 && scale.is_contiguous() && scale.dim() == 2 &&
                  scale.size(0) == n,
              "scale must be contiguous fp32 (N, G)");
  const int G = scale.size(1);
  TORCH_CHECK(G == 1 || (group_size > 0 && (int64_t)G * group_size == k), "scale has ", G,
              " groups, group size ", group_size, ", K=", k);
  const c10::cuda::CUDAGuard guard(tiles.device());
  auto w = torch::empty({n, k}, tiles.options().dtype(dtype));
  const int NT = tiles.size(0), KC = tiles.size(1);
  const int64_t total = (int64_t)NT * KC * 128;
  if (total == 0 || n == 0 || k == 0) return w;
  const int threads = 256;
  const int blocks = (int)((total + threads - 1) / threads);
  auto stream = c10::cuda::getCurrentCUDAStream();
  const int GS = group_size > 0 ? (int)group_size : 1;
  const uint32_t* tp = reinterpret_cast<const uint32_t*>(tiles.data_ptr<int32_t>());
  const float* sp = scale.data_ptr<float>();
  const bool vec = (k * (int64_t)c10::elementSize(dtype)) % 16 == 0;  // every row starts 16-byte aligned
  switch (dtype) {
    case torch::kFloat16:
      dequant_tiles_kernel<__half><<<blocks, threads, 0, stream>>>(tp, sp, reinterpret_cast<__half*>(w.data_ptr()),
                                                                    (int)n, (int)k, NT, KC, G, GS, vec);
      break;
    case torch::kBFloat16:
      dequant_tiles_kernel<__nv_bfloat16><<<blocks, threads, 0, stream>>>(
          tp, sp, reinterpret_cast<__nv_bfloat16*>(w.data_ptr()), (int)n, (int)k, NT, KC, G, GS, vec);
      break;
    case torch::kFloat32:
      dequant_tiles_kernel<float><<<blocks, threads, 0, stream>>>(tp, sp, w.data_ptr<float>(), (int)n, (int)k, NT,
                                                                   KC, G, GS, vec);
      break;
    default: TORCH_CHECK(false, "dequant_tiles dtype must be fp16, bf16 or fp32, got ", dtype);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return w;
}

// ---------------------------------------------------------------------------------------------
// The tensor-core kernel as a C++ op (TORCH_LIBRARY below): the configuration is chosen here, from
// the shape and the device's multiprocessor count (read once per device), so an eager call runs no
// Python between torch's dispatcher and the launch. Same rules as kernels/ternary_cuda.mma_config +
// _fit_instance (compared on the host by test_mma_cpp_rule_is_python_rule_on_the_host, through the op on a GPU).
struct MmaCfg {
  int tn, mb, warps, loads;
  bool pdl;
};

bool pdl_env_allows() {
  static const bool allowed = [] {
    const char* v = std::getenv("PARITY_MMA_PDL");
    return v == nullptr || std::string(v) != "0";
  }();
  return allowed;
}

MmaCfg mma_auto_config(int64_t m, int64_t n, int64_t k, int64_t group_size, int dev, bool rows) {
  const parity::DeviceInfo info = parity::device_info(dev);
  const int sms = info.sms;
  const int64_t nt = (n + TILE_N - 1) / TILE_N, kc = (k + TILE_K - 1) / TILE_K;
  auto tiles = [&](double min_blocks) {
    int tn = 4;
    while (tn > 1 && (double)((nt + tn - 1) / tn) < min_blocks) tn /= 2;
    return tn;
  };
  // One token fragment a block: ceil(M / 8) blocks along M, the row tiles shared out so that all of them together
  // leave the blocks a multiprocessor asked for.
  const int64_t mblocks = (m + 7) / 8;
  const int tn1 = tiles((m <= 4 ? 1.2 : 0.9) * sms / mblocks);
  const int64_t blocks1 = mblocks * ((nt + tn1 - 1) / tn1);
  MmaCfg c{};
  c.pdl = info.major >= 9 && pdl_env_allows();  // programmatic dependent launch: compute capability 9 on
  c.loads = 4;
  if (m <= 8 && rows) {
    c.tn = tiles(0.9 * sms);
    c.mb = 1;
    c.warps = (int)std::max<int64_t>(1, std::min<int64_t>(16, ((k + 255) / 256) / 2));
  } else if (m <= 8 || (m >= 12 && m <= 16 && !rows && !group_size && kc <= 48 && blocks1 <= 1.5 * sms)) {
    c.tn = tn1;
    c.mb = 1;
    c.warps = (int)std::max<int64_t>(1, std::min<int64_t>(16, kc));
    c.loads = blocks1 <= sms ? 8 : 4;
  } else if (m <= 16) {
    c.tn = rows ? 4 : tiles(0.9 * sms);
    c.mb = 2;
    if (rows || group_size)  // a warp for every four chunks
      c.warps = (int)std::max<int64_t>(1, std::min<int64_t>(16, kc / 4));
    else  // 16 warps where the blocks make one wave, else 8, a chunk a warp at least
      c.warps = (int)std::min<int64_t>((nt + c.tn - 1) / c.tn <= sms ? 16 : 8, kc);
  } else {
    c.tn = 4;
    c.mb = 2;
    c.warps = (int)std::max<int64_t>(1, std::min<int64_t>(8, kc / 4));
  }
  // Group scales at 4 tiles and one fragment take 80 registers (staged; 84-100 loaded with the weights): 8 warps, so
  // that two blocks share an SM.
  if (group_size && c.mb == 1 && c.tn == 4) c.warps = std::min(c.warps, 8);
  if (c.mb != 1 || group_size) c.loads = 4;
  if (group_size && c.mb == 2) c.tn = std::min(c.tn, 2);
  return c;
}

std::vector<int64_t> mma_auto_config_py(int64_t m, int64_t n, int64_t k, int64_t group_size, bool rows) {
  const MmaCfg c = mma_auto_config(m, n, k, group_size, c10::cuda::current_device(), rows);
  return {c.tn, c.mb, c.warps, c.loads, c.pdl ? 1 : 0};
}

// x (..., K) through the tensor-core kernel with the configuration chosen here, on the tiles or the rows.
torch::Tensor mma_op(const torch::Tensor& x, const torch::Tensor& w, bool rows, const torch::Tensor& scale,
                     const c10::optional<torch::Tensor>& bias, int64_t n, int64_t k, int64_t group_size,
                     bool act_quant) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == k, "x must be (..., K=", k, ")");
  torch::Tensor x2 = x.dim() == 2 ? x : x.reshape({-1, k});
  if (x2.stride(1) != 1) x2 = x2.contiguous();
  const MmaCfg c = mma_auto_config(x2.size(0), n, k, group_size, x.get_device(), rows);
  torch::Tensor y = linear_mma(x2, w, rows, scale, bias, n, k, group_size, act_quant, c.tn, c.mb, c.warps, c.loads,
                               c.pdl);
  if (x.dim() == 2) return y;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
  shape.push_back(n);
  return y.view(shape);
}

torch::Tensor ternary_mma_op(const torch::Tensor& x, const torch::Tensor& tiles, const torch::Tensor& scale,
                             const c10::optional<torch::Tensor>& bias, int64_t n, int64_t k, int64_t group_size,
                             bool act_quant) {
  return mma_op(x, tiles, false, scale, bias, n, k, group_size, act_quant);
}

torch::Tensor ternary_mma_rows_op(const torch::Tensor& x, const torch::Tensor& qweight, const torch::Tensor& scale,
                                  const c10::optional<torch::Tensor>& bias, int64_t n, int64_t k, int64_t group_size,
                                  bool act_quant) {
  return mma_op(x, qweight, true, scale, bias, n, k, group_size, act_quant);
}

}  // namespace

TORCH_LIBRARY(parity_ternary, m) {
  m.def("mma(Tensor x, Tensor tiles, Tensor scale, Tensor? bias, int n, int k, int group_size, bool act_quant) "
        "-> Tensor");
  m.def("mma_rows(Tensor x, Tensor qweight, Tensor scale, Tensor? bias, int n, int k, int group_size, "
        "bool act_quant) -> Tensor");
  m.def("dequant_tiles(Tensor tiles, Tensor scale, int n, int k, int group_size, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(parity_ternary, CUDA, m) {
  m.impl("mma", &ternary_mma_op);
  m.impl("mma_rows", &ternary_mma_rows_op);
  m.impl("dequant_tiles", &ternary_dequant_tiles);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("mma_auto_config", &mma_auto_config_py, "(tn, mb, warps, loads, pdl) the C++ op chooses",
        py::arg("m"), py::arg("n"), py::arg("k"), py::arg("group_size"), py::arg("rows"));
  m.def("ternary_linear", &ternary_linear, "ternary linear (naive or vectorized)", py::arg("x"), py::arg("qweight"),
        py::arg("scale"), py::arg("bias"), py::arg("k"), py::arg("group_size"), py::arg("act_quant"), py::arg("vec"));
  m.def("ternary_linear_mma", &ternary_linear_mma, "ternary linear on the tiled layout (tensor cores, small M)",
        py::arg("x"), py::arg("tiles"), py::arg("scale"), py::arg("bias"), py::arg("n"), py::arg("k"),
        py::arg("group_size"), py::arg("act_quant"), py::arg("tn"), py::arg("mb"), py::arg("warps"), py::arg("loads"),
        py::arg("pdl"));
  m.def("ternary_linear_mma_rows", &ternary_linear_mma_rows, "ternary linear on the row layout (tensor cores, small M)",
        py::arg("x"), py::arg("qweight"), py::arg("scale"), py::arg("bias"), py::arg("n"), py::arg("k"),
        py::arg("group_size"), py::arg("act_quant"), py::arg("tn"), py::arg("mb"), py::arg("warps"), py::arg("loads"),
        py::arg("pdl"));
  m.def("ternary_dequant", &ternary_dequant, "dense weight (scale folded) from the row layout", py::arg("qweight"),
        py::arg("scale"), py::arg("k"), py::arg("group_size"), py::arg("out"));
}
