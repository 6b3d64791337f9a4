// Ternary GEMM on the tiled layout for many tokens (Hopper, sm_90a): y = x @ W^T (+ bias), the 2-bit tiles
// decoded inside the main loop into wgmma's register A operand, x read from shared memory as B; no dense weight.
//
// tiles int32 (NT, KC, 32, 4) (kernels/ternary_repack.py, pack_tiles): lane (g, t) of tile (nt, c) holds rows
// 16 nt + g, + 8 at inputs 128 c + 32 t .. + 31; step s (0..7) of its uint4 decodes (a shift and an AND a
// register, parity::tile_a) to the mma.m16n8k16 A fragment whose k16 columns 2 t, 2 t + 1 / 2 t + 8, 2 t + 9 are
// inputs 128 c + 32 t + 4 s, + 1 / + 2, + 3. wgmma m64nNk16 takes, from each warp w of a warpgroup, that same
// fragment for rows 16 w..: a warpgroup takes 4 consecutive row tiles as they are. B must follow the tiles' k
// order, so x is first copied (stage_x_kernel) to xs (M, Kp = 128 KC) with input 128 c + r at 128 c + tile_pos(r),
// zeros past K, quantized per token where the preset quantizes activations. A block of WG warpgroups (64 WG
// rows) x BN tokens walks its chunks of K through STAGES shared-memory stages filled by cp.async: x with the
// 128-byte swizzle wgmma reads (two 64-input halves of BN rows of 128 bytes), the block's weight tiles beside
// it. split > 1 cuts K across blocks: each writes its fp32 partial, finish_kernel adds them in order. Group
// scales (a multiple of 128 inputs) scale each chunk's sums, held apart, once its MMAs are done.
// gemm_ws_kernel (ws) instead decodes the tiles into shared memory in a producer warpgroup, so the consumers'
// MMAs (both operands from shared memory) stay in flight across chunks; one scale a row only.

#include <torch/extension.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include <type_traits>
#include <vector>

#include "cp_async.cuh"
#include "dtypes.cuh"
#include "launch.cuh"
#include "ternary_tiles.cuh"

namespace {

using parity::cp_async16;
using parity::cp_async_commit;
using parity::cp_async_wait;
using parity::from_f;
using parity::smem_addr;
using parity::to_f;

using parity::TILE_K;
using parity::TILE_N;

// Where input r (0..127) of a chunk sits in the tiles' k order: lane t = r / 32, step s = (r / 4) % 8, element
// e = r % 4 is column 2 t + e (e < 2) or 8 + 2 t + e - 2 of step s.
__host__ __device__ constexpr int tile_pos(int r) {
  return 16 * ((r >> 2) & 7) + ((r & 3) < 2 ? 2 * (r >> 5) + (r & 3) : 8 + 2 * (r >> 5) + (r & 3) - 2);
}

// Inputs k0 .. k0 + 7 of a row of x (one 16-byte load where x's rows allow it), zeros past K; with QUANT its int8
// levels at scale s (in x's dtype).
template <typename T, bool QUANT>
__device__ __forceinline__ void load_x8(const T* __restrict__ row, int64_t sxk, int k0, int K, bool vec, float s,
                                        T (&v)[8]) {
  if (vec && k0 + 8 <= K) {
    *reinterpret_cast<uint4*>(v) = __ldg(reinterpret_cast<const uint4*>(row + k0));
  } else {
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = k0 + e < K ? row[(int64_t)(k0 + e) * sxk] : from_f<T>(0.f);
  }
  if (QUANT) {
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = from_f<T>(parity::quant_level(to_f(v[e]), s));
  }
}

// x (M, K) (any strides) to xs in the tiles' k order, zeros past K; with QUANT the per-token int8 levels (in x's
// dtype) and their scales sx. BN = 0: xs (M, 128 KC), input 128 c + r of a token at 128 c + tile_pos(r). BN > 0, the
// warp-specialized GEMM's layout: per block of BN tokens and 64-input half of a chunk, the BN x 128 bytes wgmma reads
// with the 128-byte swizzle (row r's 16-byte vector q at (q ^ (r % 8)) * 16), contiguous so one bulk copy fills a
// stage; tokens past M are zeros. One block a token (of M rounded up to BN), a thread per 8 inputs, stored as 4 pairs:
// a pair stays adjacent (tile_pos(r + 1) = tile_pos(r) + 1, r even).
template <typename T, bool QUANT>
__global__ void stage_x_kernel(const T* __restrict__ x, int64_t sxm, int64_t sxk, T* __restrict__ xs,
                               float* __restrict__ sx, int M, int K, int KC, int BN, bool vec) {
  const int m = blockIdx.x, Kp = KC * TILE_K;
  const bool live = m < M;
  const T* row = x + (int64_t)min(m, M - 1) * sxm;
  float s = 1.f;
  if (QUANT && live) s = parity::row_quant_scale(row, sxk, K);
  for (int k0 = 8 * threadIdx.x; k0 < Kp; k0 += 8 * blockDim.x) {
    __align__(16) T v[8];
    load_x8<T, QUANT>(row, sxk, k0, live ? K : 0, vec, s, v);
    const int c = k0 >> 7;
#pragma unroll
    for (int e = 0; e < 8; e += 2) {
      const int p = tile_pos((k0 + e) & 127);
      T* dst;
      if (BN == 0) {
        dst = xs + (int64_t)m * Kp + TILE_K * c + p;
      } else {
        const int r = m % BN, q = (p & 63) >> 3;
        dst = xs + (((int64_t)(m / BN) * KC + c) * 2 + (p >> 6)) * BN * 64 + r * 64 + ((q ^ (r & 7)) << 3) + (p & 7);
      }
      *reinterpret_cast<uint32_t*>(dst) = *reinterpret_cast<const uint32_t*>(v + e);
    }
  }
  if (QUANT && live && threadIdx.x == 0) sx[m] = s;
}

// wgmma's matrix descriptor of a K-major operand in shared memory with the 128-byte swizzle: start address,
// leading byte offset 16 (unused within a swizzle row), 1024 bytes between groups of 8 rows.
__device__ __forceinline__ uint64_t swizzle128_desc(uint32_t addr) {
  return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)(16 >> 4) << 16) | ((uint64_t)(1024 >> 4) << 32) |
         ((uint64_t)1 << 62);
}

// d = A (64 x 16, registers) * B (16 x N, shared memory) (+ d where accumulate), fp32 accumulators, issued by a
// whole warpgroup.
template <typename T, int N> struct Wgmma;
// One specialization per (T, N): the accumulator registers are %0 .. %(N / 2 - 1), then A's four, the descriptor and
// the accumulate flag, numbered on from there (the PTX operand list has no arithmetic).
#define PARITY_F8(i)                                                                                          \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), \
      "+f"(d[i + 7])
#define PARITY_D32 PARITY_F8(0), PARITY_F8(8), PARITY_F8(16), PARITY_F8(24)
#define PARITY_D64 PARITY_D32, PARITY_F8(32), PARITY_F8(40), PARITY_F8(48), PARITY_F8(56)
#define PARITY_R32                                                                                      \
  "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27," \
  "%28,%29,%30,%31"
#define PARITY_R64                                                                                             \
  PARITY_R32 ",%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54," \
             "%55,%56,%57,%58,%59,%60,%61,%62,%63"
#define PARITY_WGMMA(T, PTX_T, N, DREGS, DOPS, A0, A1, A2, A3, DESC, ACC)                                   \
  template <> struct Wgmma<T, N> {                                                                          \
    static __device__ __forceinline__ void run(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc,    \
                                               int accumulate) {                                            \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #ACC ", 0;\n"                                       \
                   "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PTX_T "." PTX_T " "                    \
                   "{" DREGS "}, {%" #A0 ",%" #A1 ",%" #A2 ",%" #A3 "}, %" #DESC ", p, 1, 1, 0;\n}\n"       \
                   : DOPS                                                                                   \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(accumulate));               \
    }                                                                                                       \
  };
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
PARITY_WGMMA(__half, "f16", 64, PARITY_R32, PARITY_D32, 32, 33, 34, 35, 36, 37)
PARITY_WGMMA(__nv_bfloat16, "bf16", 64, PARITY_R32, PARITY_D32, 32, 33, 34, 35, 36, 37)
PARITY_WGMMA(__half, "f16", 128, PARITY_R64, PARITY_D64, 64, 65, 66, 67, 68, 69)
PARITY_WGMMA(__nv_bfloat16, "bf16", 128, PARITY_R64, PARITY_D64, 64, 65, 66, 67, 68, 69)
#endif
#undef PARITY_WGMMA
#define PARITY_D128 PARITY_D64, PARITY_F8(64), PARITY_F8(72), PARITY_F8(80), PARITY_F8(88), PARITY_F8(96), \
      PARITY_F8(104), PARITY_F8(112), PARITY_F8(120)
#define PARITY_R128 PARITY_R64 "," \
  "%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79," \
  "%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95," \
  "%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111," \
  "%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127"
// d += A (64 x 16) * B (16 x N), both in shared memory (K-major, 128-byte swizzle), fp32 accumulators.
template <typename T, int N> struct WgmmaSS;
#define PARITY_WGMMA_SS(T, PTX_T, N, DREGS, DOPS, DA, DB)                                                      \
  template <> struct WgmmaSS<T, N> {                                                                          \
    static __device__ __forceinline__ void run(float (&d)[N / 2], uint64_t da, uint64_t db) {                 \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"                                                 \
                   "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PTX_T "." PTX_T " "                      \
                   "{" DREGS "}, %" #DA ", %" #DB ", p, 1, 1, 0, 0;\n}\n"                                   \
                   : DOPS                                                                                     \
                   : "l"(da), "l"(db));                                                                       \
    }                                                                                                         \
  };
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
PARITY_WGMMA_SS(__half, "f16", 128, PARITY_R64, PARITY_D64, 64, 65)
PARITY_WGMMA_SS(__nv_bfloat16, "bf16", 128, PARITY_R64, PARITY_D64, 64, 65)
PARITY_WGMMA_SS(__half, "f16", 256, PARITY_R128, PARITY_D128, 128, 129)
PARITY_WGMMA_SS(__nv_bfloat16, "bf16", 256, PARITY_R128, PARITY_D128, 128, 129)
#endif
#undef PARITY_WGMMA_SS
#undef PARITY_R128
#undef PARITY_D128
#undef PARITY_R64
#undef PARITY_R32
#undef PARITY_D64
#undef PARITY_D32
#undef PARITY_F8

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keeps the compiler from moving accesses of v across the asynchronous MMAs that write it.
__device__ __forceinline__ void pin(float& v) { asm volatile("" : "+f"(v)::"memory"); }

// mbarriers (shared memory, 8 bytes each), the bulk copy that completes on one, and stmatrix.
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done)
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done) : "r"(bar), "r"(parity) : "memory");
}
__device__ __forceinline__ void bulk_copy(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
               ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
__device__ __forceinline__ void stmatrix4(uint32_t addr, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n"
               ::"r"(addr), "r"(a0), "r"(a1), "r"(a2), "r"(a3) : "memory");
}

// Shared memory of a stage: x (two halves of BN rows x 128 bytes, 1024-byte aligned), then the block's tiles.
template <int BN, int WG>
struct Stage {
  static constexpr int X = BN * 256, W = WG * 4 * 512, BYTES = X + W;
  static_assert(BN % 8 == 0 && BYTES % 1024 == 0, "stages must keep the 1024-byte alignment of the swizzle");
};

template <int BN, int WG, int STAGES>
constexpr int gemm_smem_bytes() {
  return STAGES * Stage<BN, WG>::BYTES + 1024;  // + the alignment of the dynamic shared memory
}

// An output from its sum: the decoded weights are +-2, then the row's scale (none where group scales were applied
// chunk by chunk), 1 / s_x where activations were quantized, the bias.
__device__ __forceinline__ float output_value(float v, const float* __restrict__ scale, const float* __restrict__ sx,
                                              const float* __restrict__ bias, int m, int n) {
  v *= 0.5f;
  if (scale) v *= scale[n];
  if (sx) v = __fdiv_rn(v, sx[m]);
  if (bias) v += bias[n];
  return v;
}

// A warp's wgmma accumulators to y (or to this split's fp32 partial): accumulator j of lane (g, t) is row n_lo (the
// warp's row 16 w + g) + 8 for j % 4 >= 2, token m_lo (2 t past the block's first) + 8 (j / 4) + j % 2.
template <typename T, int BN>
__device__ __forceinline__ void store_acc(const float (&acc)[BN / 2], int n_lo, int m_lo,
                                          const float* __restrict__ scale, const float* __restrict__ bias,
                                          const float* __restrict__ sx, T* __restrict__ y, float* __restrict__ part,
                                          int M, int N) {
#pragma unroll
  for (int j = 0; j < BN / 2; ++j) {
    const int n = n_lo + 8 * ((j >> 1) & 1), m = m_lo + 8 * (j >> 2) + (j & 1);
    if (n >= N || m >= M) continue;
    if (part)
      part[((int64_t)blockIdx.z * M + m) * N + n] = acc[j];
    else
      y[(int64_t)m * N + n] = from_f<T>(output_value(acc[j], scale, sx, bias, m, n));
  }
}

template <typename T, int BN, int WG, int STAGES, bool GROUP>
__global__ void __launch_bounds__(128 * WG, 1)
gemm_kernel(const T* __restrict__ xs, int Kp, const uint4* __restrict__ tiles, const float* __restrict__ scale,
            const float* __restrict__ bias, const float* __restrict__ sx, T* __restrict__ y, float* __restrict__ part,
            int M, int N, int NT, int KC, int G, int GS, int per_split) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using S = Stage<BN, WG>;
  static_assert(STAGES >= 2, "a stage is refilled a chunk after its MMAs finished");
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int nt0 = blockIdx.x * 4 * WG, m0 = blockIdx.y * BN;
  const int c0 = blockIdx.z * per_split, nch = min(KC, c0 + per_split) - c0;

  // Chunk i of this block into stage i % STAGES: x's BN rows x 16 vectors (vector q of row r at half q / 8,
  // position (q % 8) ^ (r % 8) of the row: the 128-byte swizzle), then a vector per thread of the tiles.
  auto load_stage = [&](int i) {
    uint8_t* st = smem + (i % STAGES) * S::BYTES;
    const int c = c0 + i;
    for (int u = tid; u < BN * 16; u += 128 * WG) {
      const int r = u >> 4, q = u & 15, m = m0 + r;
      const T* src = xs + (int64_t)min(m, M - 1) * Kp + (int64_t)c * TILE_K + q * 8;
      cp_async16(smem_addr(st + (q >> 3) * (BN * 128) + r * 128 + (((q & 7) ^ (r & 7)) << 4)), src, m < M ? 16 : 0);
    }
    const int nt = nt0 + (tid >> 5);
    cp_async16(smem_addr(st + S::X + tid * 16), tiles + ((int64_t)min(nt, NT - 1) * KC + c) * 32 + lane,
               nt < NT ? 16 : 0);
  };

  const int g = lane >> 2, t = lane & 3;
  const int n_lo = (nt0 + warp) * TILE_N + g;
  float acc[BN / 2];
  float chunk_acc[BN / 2];  // group scales: a chunk's sums, scaled into acc once it is done (unused else)
#pragma unroll
  for (int j = 0; j < BN / 2; ++j) acc[j] = 0.f;

#pragma unroll
  for (int i = 0; i < STAGES - 1; ++i) {
    if (i < nch) load_stage(i);
    cp_async_commit();
  }
  // Chunk i: wait for its stage, refill the stage of chunk i - 1 (every warpgroup waited for its MMAs before
  // this barrier), decode, issue the 8 MMAs and wait for them. ptxas serializes the MMAs of a warpgroup that
  // defines A registers while any of its MMAs is in flight, so a warpgroup decodes only between its chunks;
  // the tensor cores stay busy with the other blocks of the multiprocessor meanwhile.
  for (int i = 0; i < nch; ++i) {
    cp_async_wait<STAGES - 2>();
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // cp.async wrote what wgmma reads
    __syncthreads();
    if (i + STAGES - 1 < nch) load_stage(i + STAGES - 1);
    cp_async_commit();
    const uint8_t* st = smem + (i % STAGES) * S::BYTES;
    const uint4 wq = *reinterpret_cast<const uint4*>(st + S::X + tid * 16);
    const uint32_t xb = smem_addr(st);
    uint32_t a[8][4];
    uint64_t desc[8];
#pragma unroll
    for (int s = 0; s < 8; ++s) {
      parity::tile_a(wq, s, a[s][0], a[s][1], a[s][2], a[s][3]);
      desc[s] = swizzle128_desc(xb + (s >> 2) * (BN * 128) + (s & 3) * 32);
    }
    float s_lo = 0.f, s_hi = 0.f;
    if (GROUP) {  // one scale a row for the chunk: the group size is a multiple of it
      const int grp = (c0 + i) * TILE_K / GS;
      s_lo = __ldg(scale + (int64_t)min(n_lo, N - 1) * G + grp);
      s_hi = __ldg(scale + (int64_t)min(n_lo + 8, N - 1) * G + grp);
    }
    wgmma_fence();
#pragma unroll
    for (int s = 0; s < 8; ++s) {
      if constexpr (GROUP)
        Wgmma<T, BN>::run(chunk_acc, a[s], desc[s], s != 0);
      else
        Wgmma<T, BN>::run(acc, a[s], desc[s], 1);
    }
    wgmma_commit();
    wgmma_wait<0>();
    if (GROUP) {
#pragma unroll
      for (int j = 0; j < BN / 2; ++j) {
        pin(chunk_acc[j]);
        acc[j] = fmaf(chunk_acc[j], (j & 2) ? s_hi : s_lo, acc[j]);
      }
    }
  }
#pragma unroll
  for (int j = 0; j < BN / 2; ++j) pin(acc[j]);  // the loop waited for every chunk's MMAs

  store_acc<T, BN>(acc, n_lo, m0 + 2 * t, GROUP ? nullptr : scale, bias, sx, y, part, M, N);
#else
  __trap();  // built for another target than sm_90a: the host refuses before launching
#endif
}

// Warp-specialized GEMM, A through shared memory: a producer warpgroup decodes the block's tiles into wgmma's A
// layout (a lane's decoded registers are the mma fragment stmatrix stores: rows of 128 bytes, the 128-byte
// swizzle) and has the bulk copy engine bring x's matching inputs (stage_x_kernel) beside them; CWG
// consumer warpgroups (64 rows each) issue the MMAs from shared memory with the previous stage's still in flight.
// A stage is HPS 64-input halves of a chunk (two: half the mbarrier round trips, measured faster at 128 tokens),
// each half its own A and x region; full / empty mbarriers a stage hand it between the two sides.
template <int BN, int CWG, int HPS>
struct WsStage {
  static constexpr int A1 = 64 * CWG * 128, X1 = BN * 128, A = HPS * A1, X = HPS * X1, BYTES = A + X;
  static_assert(BN % 64 == 0 && BYTES % 1024 == 0, "stages must keep the 1024-byte alignment of the swizzle");
};

template <int BN, int CWG, int STAGES, int HPS>
constexpr int ws_smem_bytes() {
  return STAGES * WsStage<BN, CWG, HPS>::BYTES + 16 * STAGES + 1024;  // + the mbarriers, the alignment
}

template <typename T, int BN, int CWG, int STAGES, int HPS>
__global__ void __launch_bounds__(128 * (CWG + 1), 1)
gemm_ws_kernel(const T* __restrict__ xb, const uint4* __restrict__ tiles, const float* __restrict__ scale,
               const float* __restrict__ bias, const float* __restrict__ sx, T* __restrict__ y,
               float* __restrict__ part, int M, int N, int NT, int KC, int per_split) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using S = WsStage<BN, CWG, HPS>;
  constexpr int TPW = CWG, D = 8 / CWG;  // tiles a producer warp decodes a chunk; chunks of its tiles in flight
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const uint32_t base = smem_addr(smem), full = base + STAGES * S::BYTES, empty = full + 8 * STAGES;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = warp >> 2;
  const int nt0 = blockIdx.x * 4 * CWG, mb = blockIdx.y;
  const int c0 = blockIdx.z * per_split, nch = min(KC, c0 + per_split) - c0;
  if (tid == 0) {
    for (int st = 0; st < STAGES; ++st) {
      mbar_init(full + 8 * st, 128 + 1);  // the producer's threads, and the arrival that expects x's bytes
      mbar_init(empty + 8 * st, 128 * CWG);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  if (wg == CWG) {  // the producer
    // stmatrix: lanes 8 i .. 8 i + 7 give the rows of matrix i (a0 .. a3: rows + 8 for odd i, inputs + 8 for i >= 2)
    const int pw = warp & 3, r = lane & 7, hi = lane >> 4;
    uint32_t row_off[TPW];
#pragma unroll
    for (int jj = 0; jj < TPW; ++jj) row_off[jj] = (16 * (pw + 4 * jj) + r + 8 * ((lane >> 3) & 1)) * 128;
    auto load = [&](int i, uint4(&dst)[TPW]) {
#pragma unroll
      for (int jj = 0; jj < TPW; ++jj) {
        const int nt = nt0 + pw + 4 * jj;
        dst[jj] = i < nch && nt < NT ? __ldg(tiles + ((int64_t)nt * KC + c0 + i) * 32 + lane) : make_uint4(0, 0, 0, 0);
      }
    };
    uint4 q[D][TPW];
#pragma unroll
    for (int d = 0; d < D; ++d) load(d, q[d]);
    const T* xsrc = xb + ((int64_t)mb * KC + c0) * 2 * BN * 64;
    for (int i0 = 0; i0 < nch; i0 += D) {
#pragma unroll
      for (int d = 0; d < D; ++d) {
        const int i = i0 + d;
        if (i >= nch) break;
        uint4 cur[TPW];
#pragma unroll
        for (int jj = 0; jj < TPW; ++jj) cur[jj] = q[d][jj];
        load(i + D, q[d]);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int hu = 2 * i + h, u = hu / HPS, hh = hu % HPS, st = u % STAGES;  // half hu: half hh of stage u
          if (hh == 0 && u >= STAGES) mbar_wait(empty + 8 * st, (u / STAGES - 1) & 1);
          const uint32_t sa = base + st * S::BYTES;
          if (hh == 0 && tid == 128 * CWG) {  // x's halves of a stage are adjacent in xb: one copy
            mbar_arrive_expect_tx(full + 8 * st, S::X);
            bulk_copy(sa + S::A, xsrc + (int64_t)hu * BN * 64, S::X, full + 8 * st);
          }
#pragma unroll
          for (int jj = 0; jj < TPW; ++jj) {
#pragma unroll
            for (int ks = 0; ks < 4; ++ks) {
              uint32_t a0, a1, a2, a3;
              parity::tile_a(cur[jj], 4 * h + ks, a0, a1, a2, a3);
              stmatrix4(sa + hh * S::A1 + row_off[jj] + (((2 * ks + hi) ^ r) << 4), a0, a1, a2, a3);
            }
          }
          if (hh == HPS - 1) {
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // stmatrix wrote what wgmma reads
            mbar_arrive(full + 8 * st);
          }
        }
      }
    }
  } else {  // a consumer: rows 64 wg .. of the block
    float acc[BN / 2];
#pragma unroll
    for (int j = 0; j < BN / 2; ++j) acc[j] = 0.f;
    for (int u = 0; u < 2 * nch / HPS; ++u) {
      const int st = u % STAGES;
      mbar_wait(full + 8 * st, (u / STAGES) & 1);
      const uint32_t sa = base + st * S::BYTES;
      wgmma_fence();
#pragma unroll
      for (int hh = 0; hh < HPS; ++hh)
#pragma unroll
        for (int ks = 0; ks < 4; ++ks)
          WgmmaSS<T, BN>::run(acc, swizzle128_desc(sa + hh * S::A1 + wg * 64 * 128 + ks * 32),
                              swizzle128_desc(sa + S::A + hh * S::X1 + ks * 32));
      wgmma_commit();
      wgmma_wait<1>();  // the previous stage's MMAs are done: hand it back
      if (u > 0) mbar_arrive(empty + 8 * ((u - 1) % STAGES));
    }
    wgmma_wait<0>();
#pragma unroll
    for (int j = 0; j < BN / 2; ++j) pin(acc[j]);
    const int g = lane >> 2, t = lane & 3;
    store_acc<T, BN>(acc, (nt0 + 4 * wg + (warp & 3)) * TILE_N + g, mb * BN + 2 * t, scale, bias, sx, y, part, M, N);
  }
#else
  __trap();  // built for another target than sm_90a: the host refuses before launching
#endif
}

// y from the split partials, added in split order (deterministic); scale: one a row, or none.
template <typename T>
__global__ void finish_kernel(const float* __restrict__ part, int splits, const float* __restrict__ scale,
                              const float* __restrict__ bias, const float* __restrict__ sx, T* __restrict__ y, int M,
                              int N) {
  const int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= (int64_t)M * N) return;
  const int n = (int)(idx % N), m = (int)(idx / N);
  float v = 0.f;
  for (int z = 0; z < splits; ++z) v += part[(int64_t)z * M * N + idx];
  y[idx] = from_f<T>(output_value(v, scale, sx, bias, m, n));
}

template <typename T, int BN, int WG, int STAGES, bool GROUP>
void launch_gemm(const T* xs, int Kp, const torch::Tensor& tiles, const float* scale, const float* bias,
                 const float* sx, T* y, float* part, int M, int N, int G, int GS, int splits, int per_split,
                 cudaStream_t stream) {
  const int NT = tiles.size(0), KC = tiles.size(1);
  constexpr int smem = gemm_smem_bytes<BN, WG, STAGES>();
  auto kern = gemm_kernel<T, BN, WG, STAGES, GROUP>;
  parity::set_smem(kern, smem);
  dim3 grid((NT + 4 * WG - 1) / (4 * WG), (M + BN - 1) / BN, splits);
  kern<<<grid, 128 * WG, smem, stream>>>(xs, Kp, reinterpret_cast<const uint4*>(tiles.data_ptr<int32_t>()), scale,
                                         bias, sx, y, part, M, N, NT, KC, G, GS, per_split);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
void dispatch_gemm(int bn, int wg, int stages, bool group, const T* xs, int Kp, const torch::Tensor& tiles,
                   const float* scale, const float* bias, const float* sx, T* y, float* part, int M, int N, int G,
                   int GS, int splits, int per_split, cudaStream_t stream) {
#define PARITY_GEMM(BN_, WG_, ST_, GROUP_)                                                                     \
  if (bn == BN_ && wg == WG_ && stages == ST_ && group == GROUP_)                                            \
    return launch_gemm<T, BN_, WG_, ST_, GROUP_>(xs, Kp, tiles, scale, bias, sx, y, part, M, N, G, GS, splits, \
                                                 per_split, stream);
  // Shared memory: 64 x 1 x 4 75 KB (3 blocks a multiprocessor), 64 x 1 x 6 and 128 x {1, 2} x 3 112 KB (2),
  // 64 x 2 x 4 83 KB, 128 x 4 x 3 124 KB, 64 x 4 x 4 100 KB, 128 x 2 x 4 149 KB, 128 x 4 x 4 165 KB.
  PARITY_GEMM(64, 1, 4, false) PARITY_GEMM(64, 1, 6, false) PARITY_GEMM(64, 2, 4, false)
  PARITY_GEMM(64, 4, 4, false) PARITY_GEMM(128, 1, 3, false) PARITY_GEMM(128, 2, 3, false)
  PARITY_GEMM(128, 2, 4, false) PARITY_GEMM(128, 4, 3, false) PARITY_GEMM(128, 4, 4, false)
  // Group scales hold a second set of accumulators: at most 256 threads a block.
  PARITY_GEMM(64, 1, 4, true) PARITY_GEMM(64, 2, 4, true) PARITY_GEMM(128, 2, 3, true)
#undef PARITY_GEMM
  TORCH_CHECK(false, "ternary gemm: no instance for bn=", bn, " wg=", wg, " stages=", stages,
              group ? " with group scales" : "");
}

template <typename T, int BN, int CWG, int STAGES, int HPS>
void launch_gemm_ws(const T* xb, const torch::Tensor& tiles, const float* scale, const float* bias, const float* sx,
                    T* y, float* part, int M, int N, int splits, int per_split, cudaStream_t stream) {
  const int NT = tiles.size(0), KC = tiles.size(1);
  constexpr int smem = ws_smem_bytes<BN, CWG, STAGES, HPS>();
  auto kern = gemm_ws_kernel<T, BN, CWG, STAGES, HPS>;
  parity::set_smem(kern, smem);
  dim3 grid((NT + 4 * CWG - 1) / (4 * CWG), (M + BN - 1) / BN, splits);
  kern<<<grid, 128 * (CWG + 1), smem, stream>>>(xb, reinterpret_cast<const uint4*>(tiles.data_ptr<int32_t>()), scale,
                                                 bias, sx, y, part, M, N, NT, KC, per_split);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
void dispatch_gemm_ws(int bn, int wg, int stages, const T* xb, const torch::Tensor& tiles, const float* scale,
                      const float* bias, const float* sx, T* y, float* part, int M, int N, int splits, int per_split,
                      cudaStream_t stream) {
#define PARITY_GEMM_WS(BN_, WG_, ST_, HPS_)                                                                      \
  if (bn == BN_ && wg == WG_ && stages == ST_)                                                                 \
    return launch_gemm_ws<T, BN_, WG_, ST_, HPS_>(xb, tiles, scale, bias, sx, y, part, M, N, splits, per_split,  \
                                                  stream);
  // 192 KB of stages each: one block (a producer and 2 consumer warpgroups) a multiprocessor. 128 tokens in 3
  // stages of a whole chunk, 256 in 4 of a half (whole chunks, 2 stages, measured slower there).
  PARITY_GEMM_WS(128, 2, 3, 2) PARITY_GEMM_WS(256, 2, 4, 1)
#undef PARITY_GEMM_WS
  TORCH_CHECK(false, "ternary gemm (warp-specialized): no instance for bn=", bn, " wg=", wg, " stages=", stages);
}

// The GEMM on the tiles with an explicit launch: bn tokens and wg warpgroups (64 wg rows) a block, stages of
// the shared-memory pipeline, K split across split blocks.
torch::Tensor ternary_gemm(const torch::Tensor& x, const torch::Tensor& tiles, const torch::Tensor& scale,
                           const c10::optional<torch::Tensor>& bias, int64_t n, int64_t k, int64_t group_size,
                           bool act_quant, int64_t bn, int64_t wg, int64_t stages, int64_t split, bool ws) {
  TORCH_CHECK(x.is_cuda() && tiles.is_cuda() && scale.is_cuda(), "ternary gemm needs CUDA tensors");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k, "ternary gemm: x must be (M, K=", k, "), got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == torch::kFloat16 || x.scalar_type() == torch::kBFloat16,
              "ternary gemm: x must be fp16 or bf16, got ", x.scalar_type());
  parity::check_tiles(tiles, n, k, "ternary gemm");
  TORCH_CHECK(scale.scalar_type() == torch::kFloat32 && scale.is_contiguous() && scale.dim() == 2 &&
                  scale.size(0) == n,
              "ternary gemm: scale must be contiguous fp32 (N=", n, ", G)");
  const bool group = group_size > 0;
  TORCH_CHECK(group ? group_size % TILE_K == 0 && scale.size(1) == (k + group_size - 1) / group_size
                    : scale.size(1) == 1,
              "ternary gemm: group size ", group_size, " (a multiple of ", TILE_K, ", or 0) and scale ",
              scale.sizes(), " do not match K=", k);
  TORCH_CHECK(split >= 1, "ternary gemm: split must be >= 1");
  TORCH_CHECK(!(ws && group), "ternary gemm: the warp-specialized kernel takes one scale a row, not group scales");
  const c10::cuda::CUDAGuard guard(x.device());
  const parity::DeviceInfo dev = parity::device_info(x.get_device());
  TORCH_CHECK(dev.major == 9 && dev.minor == 0, "ternary gemm needs compute capability 9.0 (wgmma: the sm_90a build)");
  auto y = torch::empty({x.size(0), n}, x.options());
  const int M = x.size(0), N = (int)n, K = (int)k, KC = tiles.size(1), Kp = KC * TILE_K;
  if (M == 0 || N == 0) return y;
  auto stream = c10::cuda::getCurrentCUDAStream();
  torch::Tensor bias_f = bias.has_value() ? bias->to(torch::kFloat32).contiguous() : torch::Tensor();
  const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  const int Mp = ws ? (int)((M + bn - 1) / bn * bn) : M;  // the blocked copy holds whole blocks of tokens
  auto xs = torch::empty({Mp, Kp}, x.options());
  torch::Tensor sxt = act_quant ? torch::empty({M}, x.options().dtype(torch::kFloat32)) : torch::Tensor();
  float* sxp = act_quant ? sxt.data_ptr<float>() : nullptr;
  const int per_split = (int)((KC + split - 1) / split), splits = (KC + per_split - 1) / per_split;
  torch::Tensor part = splits > 1 ? torch::empty({splits, M, N}, x.options().dtype(torch::kFloat32)) : torch::Tensor();
  float* pp = splits > 1 ? part.data_ptr<float>() : nullptr;
  const float* sp = scale.data_ptr<float>();
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const T* xp = reinterpret_cast<const T*>(x.data_ptr());
    T* xsp = reinterpret_cast<T*>(xs.data_ptr());
    T* yp = reinterpret_cast<T*>(y.data_ptr());
    const bool vec = x.stride(1) == 1 && x.stride(0) % 8 == 0 && (reinterpret_cast<uintptr_t>(xp) & 15) == 0;
    const int sbn = ws ? (int)bn : 0;  // the blocked layout for ws
    if (act_quant)
      stage_x_kernel<T, true><<<Mp, 256, 0, stream>>>(xp, x.stride(0), x.stride(1), xsp, sxp, M, K, KC, sbn, vec);
    else
      stage_x_kernel<T, false><<<Mp, 256, 0, stream>>>(xp, x.stride(0), x.stride(1), xsp, sxp, M, K, KC, sbn, vec);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (ws)
      dispatch_gemm_ws<T>((int)bn, (int)wg, (int)stages, xsp, tiles, sp, bp, sxp, yp, pp, M, N, splits, per_split,
                          stream);
    else
      dispatch_gemm<T>((int)bn, (int)wg, (int)stages, group, xsp, Kp, tiles, sp, bp, sxp, yp, pp, M, N,
                       (int)scale.size(1), group ? (int)group_size : 1, splits, per_split, stream);
    if (splits > 1) {
      const int64_t total = (int64_t)M * N;
      finish_kernel<T><<<(unsigned)((total + 255) / 256), 256, 0, stream>>>(pp, splits, group ? nullptr : sp, bp,
                                                                            sxp, yp, M, N);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  };
  if (x.scalar_type() == torch::kFloat16)
    run(__half());
  else
    run(__nv_bfloat16());
  return y;
}

// The launch the op chooses (kernels/ternary_cuda.gemm_config is the same rule; tests compare them on the host and
// through the op on a GPU): one scale a row from WS_MIN_M tokens the warp-specialized kernel, blocks of 128 tokens x
// 128 rows up to 128 tokens; above, 128 or 256 tokens, whichever takes fewer waves of blocks x tokens a block /
// split, a 128-token block's token counted 1.25 times. Else up to 64 tokens blocks of 64 tokens x 256 rows (x 128
// with group scales), above 128 x 128. K split in two until the grid would pass the blocks a multiprocessor holds
// (2 of the register-A kernel's 128 x 128 without group scales, else 1), at most 8 ways and 8 chunks a split. From
// the sweeps in benchmarks/NOTES.md.
constexpr int64_t WS_MIN_M = 128;
std::vector<int64_t> gemm_auto_config(int64_t m, int64_t n, int64_t k, int64_t group_size) {
  const int64_t sms = parity::device_info(c10::cuda::current_device()).sms, kc = (k + TILE_K - 1) / TILE_K;
  const bool group = group_size > 0, ws = !group && m >= WS_MIN_M;
  auto split_of = [&](int64_t bn, int64_t wg, int64_t per_sm) {
    const int64_t blocks = ((n + 64 * wg - 1) / (64 * wg)) * ((m + bn - 1) / bn);
    int64_t split = 1;
    while (split < 8 && blocks * split * 2 <= per_sm * sms && kc / (split * 2) >= 8) split *= 2;
    return std::pair<int64_t, int64_t>(blocks * split, split);
  };
  if (ws) {
    const auto g128 = split_of(128, 2, 1), g256 = split_of(256, 2, 1);
    auto cost = [&](int64_t bn, std::pair<int64_t, int64_t> g) {  // in quarter tokens: 128 tokens' token is 5
      return (double)((g.first + sms - 1) / sms) * bn * (bn == 128 ? 5 : 4) / g.second;
    };
    const bool b128 = m <= 128 || cost(128, g128) < cost(256, g256);
    return {b128 ? 128 : 256, 2, b128 ? 3 : 4, (b128 ? g128 : g256).second, 1};
  }
  const int64_t bn = m <= 64 ? 64 : 128, wg = m <= 64 ? (group ? 2 : 4) : 2, stages = m <= 64 ? 4 : 3;
  return {bn, wg, stages, split_of(bn, wg, wg == 2 && bn == 128 && !group ? 2 : 1).second, 0};
}

// x (..., K) through the GEMM with the launch chosen here.
torch::Tensor gemm_op(const torch::Tensor& x, const torch::Tensor& tiles, const torch::Tensor& scale,
                      const c10::optional<torch::Tensor>& bias, int64_t n, int64_t k, int64_t group_size,
                      bool act_quant) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == k, "ternary gemm: x must be (..., K=", k, ")");
  const torch::Tensor x2 = x.dim() == 2 ? x : x.reshape({-1, k});
  const c10::cuda::CUDAGuard guard(x.device());
  const std::vector<int64_t> c = gemm_auto_config(x2.size(0), n, k, group_size);
  torch::Tensor y = ternary_gemm(x2, tiles, scale, bias, n, k, group_size, act_quant, c[0], c[1], c[2], c[3], c[4]);
  if (x.dim() == 2) return y;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
  shape.push_back(n);
  return y.view(shape);
}

}  // namespace

// parity_ternary::gemm beside the ops of csrc/ternary.cu, once this extension is loaded.
TORCH_LIBRARY_FRAGMENT(parity_ternary, m) {
  m.def("gemm(Tensor x, Tensor tiles, Tensor scale, Tensor? bias, int n, int k, int group_size, bool act_quant) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(parity_ternary, CUDA, m) { m.impl("gemm", &gemm_op); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemm_auto_config", &gemm_auto_config, "(bn, wg, stages, split, ws) the op chooses", py::arg("m"),
        py::arg("n"), py::arg("k"), py::arg("group_size"));
  m.def("gemm", &ternary_gemm, "ternary GEMM on the tiled layout (wgmma, sm_90a)", py::arg("x"), py::arg("tiles"),
        py::arg("scale"), py::arg("bias"), py::arg("n"), py::arg("k"), py::arg("group_size"), py::arg("act_quant"),
        py::arg("bn"),
        py::arg("wg"), py::arg("stages"), py::arg("split"), py::arg("ws") = false);
  m.def("tile_pos", [](int r) { return tile_pos(r); }, "where input r of a chunk sits in the tiles' k order",
        py::arg("r"));
}
