// int8x (shared FORMATS.md section 2): decode to fp32/fp16/bf16 and fused decode-GEMV y = x @ W^T.
//
// A warp works on 32 consecutive b1 words (1024 elements of the row-major flattened weight) at a time,
// one word per lane:
//  * j0, the non-L1 index of the lane's first element, is the warp's entry count J plus the exclusive warp
//    scan of popc(word); the lane's c = popc(word) b2 flags are bits [j0, j0 + c) of b2 (two words at
//    most); their popc, scanned likewise, gives the L3 index i3; the L2 index is j0 - i3 and the L1 index
//    32 * word - j0.
//  * The warp stages in shared memory exactly the stream words its 1024 elements use (so nothing is read
//    past the end of a tensor): the L1 and L2 words, and the L3 bytes already converted to fp32.
//  * Each lane then decodes its 32 elements in order from 32-bit bit buffers: the next L1 (3-bit) and L2
//    (5-bit) fields at the bottom of h1 / h2, the lane's b2 flags at the top of hb (bit-reversed, so the
//    flag is the sign bit), the next L3 value at a shared address. A field becomes an exact float with one
//    lop3 into the mantissa of 1.5 * 2^23 (offset binary) and one subtraction; the element's level picks
//    the value and the buffer to advance through predicated instructions (no branch). h1 / h2 are refilled
//    at fixed elements (every 10 for L1, every 6 for L2: at most 30 bits are consumed in between), their
//    bit position recomputed from popc of the b1 word, so the per-element code has no refill test and the
//    unrolled loop keeps everything in registers (about 17 instructions per element at M = 1).
// The warp's entry counts come from the block tables at the block holding its first word, plus popcs of the
// b1 words and b2 bits between the block start and the warp start when they differ (block_size not a
// multiple of 1024, or rows not aligned on blocks). Along a GEMV row the counts are carried from one
// 1024-element step to the next.
//
// Element and stream indices are uint32 (n < 2^31: the int32 block tables); stream bit positions, which
// reach 5n, are formed in 64 bits once per warp step and kept relative (< 2^13) below that.

#include <torch/extension.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "dtypes.cuh"
#include "launch.cuh"

namespace {

constexpr uint32_t FULL = 0xffffffffu;
constexpr int WARPS = 8;            // warps per CTA (GEMV: one output row each)
constexpr int STEP_WORDS = 32;      // b1 words per warp step, one per lane
constexpr int STEP = 32 * STEP_WORDS;
// Staged words per warp: L3 floats (c3 of them), then L1 and L2 words, each stream followed by PAD words
// that lanes past the data may read (never use). With c1 + c2 + c3 <= 1024 elements in a step, the L1 and L2
// words number at most (31 + 3 c1) / 32 + 1 and (31 + 5 c2) / 32 + 1, so the total is at most
// 1024 + 4 + 1 + 2 * PAD = 1045.
constexpr int PAD = 8;
constexpr int WARP_SMEM = 1056;
// x of one GEMV step as fp32, per token: aligned rows (K % 32 == 0) pad 4 floats after every 32 so the
// lanes' 16-byte reads (lane stride 36 floats) hit distinct banks; unaligned rows stage 32 more columns
// in front (a row may start mid-word) without padding.
constexpr int XS_ALIGNED = STEP + STEP / 8;
constexpr int XS_GENERIC = STEP + 32;

constexpr uint32_t MAGIC = 0x4B400000u;  // 1.5 * 2^23: an integer OR-ed into its low mantissa is exact
constexpr float MAGIC_F = 12582912.0f;

enum DType : int { F32 = 0, F16 = 1, BF16 = 2 };

struct Streams {
  const uint32_t* b1;
  const uint32_t* b2;
  const uint32_t* l1;
  const uint32_t* l2;
  const uint8_t* l3;
  const int32_t* b1_blk;
  const int32_t* b2_blk;
  uint32_t n;      // elements
  uint32_t n_b1;   // words of b1 = ceil(n / 32)
  uint32_t n_l1;   // words of l1
  uint32_t n_l2;   // words of l2
  uint32_t block_size;
};

using parity::from_f;
using parity::to_f;

// Re-read at the end of a kernel rather than kept live through its main loop.
__device__ __forceinline__ uint32_t ctaid_x() {
  uint32_t v;
  asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(v));
  return v;
}
__device__ __forceinline__ uint32_t ctaid_y() {
  uint32_t v;
  asm volatile("mov.u32 %0, %%ctaid.y;" : "=r"(v));
  return v;
}
__device__ __forceinline__ uint32_t tid_x() {
  uint32_t v;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(v));
  return v;
}

__device__ __forceinline__ uint32_t warp_sum(uint32_t v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  return __reduce_add_sync(FULL, v);
#else
  for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
  return v;
#endif
}

__device__ __forceinline__ uint32_t warp_inclusive_scan(uint32_t v, uint32_t lane) {
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const uint32_t u = __shfl_up_sync(FULL, v, d);
    if (lane >= (uint32_t)d) v += u;
  }
  return v;
}

// Non-L1 count J and L3 count I3 before element 32 * w (w a b1 word index < n_b1), warp-uniform.
__device__ void entry_counts(const Streams& s, uint32_t w, uint32_t lane, uint32_t& J, uint32_t& I3) {
  const uint32_t blk = (w * 32u) / s.block_size;
  uint32_t j = (uint32_t)__ldg(s.b1_blk + blk);
  uint32_t i3 = (uint32_t)__ldg(s.b2_blk + blk);
  const uint32_t wb = blk * (s.block_size / 32u);  // the block's first word
  if (wb < w) {
    uint32_t cnt = 0;
    for (uint32_t k = wb + lane; k < w; k += 32) cnt += __popc(__ldg(s.b1 + k));
    const uint32_t j_end = j + warp_sum(cnt);
    // b2_blk counts the L3 flags before non-L1 index j; add those of [j, j_end).
    uint32_t c3 = 0;
    for (uint32_t q = (j >> 5) + lane; q * 32u < j_end; q += 32) {
      uint32_t word = __ldg(s.b2 + q);
      const uint32_t lo = q * 32u;
      if (lo < j) word &= FULL << (j - lo);                 // j - lo in 1..31
      if (j_end - lo < 32u) word &= (1u << (j_end - lo)) - 1u;  // j_end - lo in 1..31
      c3 += __popc(word);
    }
    i3 += warp_sum(c3);
    j = j_end;
  }
  J = j;
  I3 = i3;
}

// A lane's decoder state for one word (see the header). Shared memory is addressed by 32-bit byte address.
struct Lane {
  uint32_t w1;    // b1 word: bit t set = element t is not L1
  uint32_t hb;    // b2 flags of the lane's non-L1 elements, the next one at bit 31
  uint32_t h1;    // next L1 field at bit 0
  uint32_t h2;    // next L2 field at bit 0
  uint32_t a3;    // next L3 value (staged fp32)
  uint32_t s1;    // staged L1 words
  uint32_t rel1;  // the lane's first L1 bit in them
  uint32_t s2;    // same for L2
  uint32_t rel2;
};

__device__ __forceinline__ uint32_t smem_addr(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

// Loads from the staging area are volatile asm so that they stay after the __syncwarp that publishes it.
__device__ __forceinline__ uint32_t lds_u32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(addr));
  return v;
}

// 32 stream bits from bit `bit` of the staged words at `words`.
__device__ __forceinline__ uint32_t bits_at(uint32_t words, uint32_t bit) {
  const uint32_t p = words + ((bit >> 5) << 2);
  return __funnelshift_r(lds_u32(p), lds_u32(p + 4), bit);  // the shift is taken mod 32
}

// Element T of a lane's word: its value as fp32, advancing the buffers of the level it came from. Written in
// PTX so that the level tests stay three predicates and every update is a predicated instruction (in C++ the
// compiler rebuilt them as arithmetic, ~25 instructions). Not volatile, which spares register copies between
// consecutive elements; the "memory" clobber keeps its shared load between the warp's barriers.
// lop3 0x6a computes b ? (a ^ c) : c bitwise: with b = the field mask and c = MAGIC | the field's sign bit it
// gives the float bits of MAGIC + (field ^ sign) = MAGIC + value + 2^(width - 1) in one instruction.
template <int T>
__device__ __forceinline__ float element(uint32_t w1, uint32_t& hb, uint32_t& h1, uint32_t& h2, uint32_t& a3) {
  float f;
  asm(
      "{\n\t"
      ".reg .pred pn, p2, p3;\n\t"
      ".reg .b32 m, x1, x2;\n\t"
      "and.b32 m, %5, %6;\n\t"
      "setp.ne.b32 pn, m, 0;\n\t"            // not L1
      "setp.lt.and.s32 p3, %1, 0, pn;\n\t"   // L3: the flag is hb's sign bit
      "setp.ge.and.s32 p2, %1, 0, pn;\n\t"   // L2
      "lop3.b32 x1, %2, 7, %7, 0x6a;\n\t"    // MAGIC + v + 4
      "lop3.b32 x2, %3, 31, %8, 0x6a;\n\t"   // MAGIC + v + 16
      "sub.f32 %0, x1, 0f4B400004;\n\t"
      "@pn sub.f32 %0, x2, 0f4B400010;\n\t"
      "@p3 ld.shared.f32 %0, [%4];\n\t"
      "@!pn shr.b32 %2, %2, 3;\n\t"
      "@p2 shr.b32 %3, %3, 5;\n\t"
      "@p3 add.u32 %4, %4, 4;\n\t"
      "@pn shl.b32 %1, %1, 1;\n\t"
      "}"
      : "=&f"(f), "+r"(hb), "+r"(h1), "+r"(h2), "+r"(a3)
      : "r"(w1), "n"(1u << T), "r"(MAGIC | 0x4u), "r"(MAGIC | 0x10u)
      : "memory");
  return f;
}

// One warp step: words [w0, w0 + nv) (nv in 1..32, lanes >= nv idle) with entry counts J, I3 (advanced past
// the step on return). w1 is the lane's b1 word (0 for idle lanes). ws: the warp's WARP_SMEM staging words.
// Ends with __syncwarp(); the caller must synchronize the warp again before the next step reuses ws.
__device__ __forceinline__ Lane prepare(const Streams& s, uint32_t* ws, uint32_t w0, uint32_t nv, uint32_t lane,
                                        uint32_t w1, uint32_t& J, uint32_t& I3) {
  const uint32_t c = __popc(w1);
  const uint32_t cs = warp_inclusive_scan(c, lane);
  const uint32_t sum_c = __shfl_sync(FULL, cs, 31);
  const uint32_t j0 = J + cs - c;
  // The lane's b2 flags: bits [j0, j0 + c), read only where they exist.
  const uint32_t q = j0 >> 5, o = j0 & 31;
  const uint32_t lo = c ? __ldg(s.b2 + q) : 0u;
  const uint32_t hi = o + c > 32 ? __ldg(s.b2 + q + 1) : 0u;
  const uint32_t flags = __funnelshift_r(lo, hi, o) & (c == 32 ? FULL : (1u << c) - 1u);
  const uint32_t n3 = __popc(flags);
  const uint32_t cs3 = warp_inclusive_scan(n3, lane);
  const uint32_t sum3 = __shfl_sync(FULL, cs3, 31);
  const uint32_t i3 = I3 + cs3 - n3;
  // Idle lanes sit at the step's end: every position they form stays within the staged data + PAD.
  const uint32_t e0 = (w0 + min(lane, nv)) * 32u;
  const uint32_t i1 = e0 - j0, i2 = j0 - i3;
  // The step's L1 values [i1w, i1w + t1) and L2 values [i2w, i2w + t2). t1 includes the zero b1 bits past n in
  // the last word, which read as L1 values that do not exist: hence the clamp to the stream length.
  const uint32_t i1w = w0 * 32u - J, i2w = J - I3;
  const uint32_t t1 = nv * 32u - sum_c, t2 = sum_c - sum3;
  const uint64_t bit1 = 3ull * i1w, bit2 = 5ull * i2w;
  const uint32_t a1 = (uint32_t)(bit1 >> 5), a2 = (uint32_t)(bit2 >> 5);
  const uint32_t e1 = (uint32_t)min((3ull * (i1w + t1) + 31) >> 5, (unsigned long long)s.n_l1);
  const uint32_t e2 = (uint32_t)min((5ull * (i2w + t2) + 31) >> 5, (unsigned long long)s.n_l2);
  const uint32_t cnt1 = e1 > a1 ? e1 - a1 : 0u, cnt2 = e2 > a2 ? e2 - a2 : 0u;

  float* s3 = reinterpret_cast<float*>(ws);
  uint32_t* s1 = ws + sum3 + 1;
  uint32_t* s2 = s1 + cnt1 + PAD;
  for (uint32_t k = lane; k < sum3; k += 32) s3[k] = (float)(int8_t)__ldg(s.l3 + I3 + k);
  for (uint32_t k = lane; k < cnt1; k += 32) s1[k] = __ldg(s.l1 + a1 + k);
  for (uint32_t k = lane; k < cnt2; k += 32) s2[k] = __ldg(s.l2 + a2 + k);
  __syncwarp();

  Lane L;
  L.w1 = w1;
  L.hb = __brev(flags);
  L.s1 = smem_addr(s1);
  L.rel1 = 3u * (i1 - i1w) + (uint32_t)(bit1 & 31);
  L.s2 = smem_addr(s2);
  L.rel2 = 5u * (i2 - i2w) + (uint32_t)(bit2 & 31);
  L.h1 = bits_at(L.s1, L.rel1);
  L.h2 = bits_at(L.s2, L.rel2);
  L.a3 = smem_addr(s3 + (i3 - I3));
  J += sum_c;
  I3 += sum3;
  return L;
}

template <int T>
__device__ __forceinline__ void refill(Lane& L, uint32_t a3_start) {
  if constexpr (T != 0 && T % 10 == 0) {  // <= 10 L1 fields (30 bits) since the last fill
    const uint32_t n1 = __popc(~L.w1 & ((1u << T) - 1u));
    L.h1 = bits_at(L.s1, L.rel1 + 3u * n1);
  }
  if constexpr (T != 0 && T % 6 == 0) {  // <= 6 L2 fields (30 bits)
    const uint32_t n2 = __popc(L.w1 & ((1u << T) - 1u)) - ((L.a3 - a3_start) >> 2);
    L.h2 = bits_at(L.s2, L.rel2 + 5u * n2);
  }
}

template <int G, int g, int i>
__device__ __forceinline__ void elements(Lane& L, uint32_t a3_start, float (&f)[G]) {
  if constexpr (i < G) {
    refill<g + i>(L, a3_start);
    f[i] = element<g + i>(L.w1, L.hb, L.h1, L.h2, L.a3);
    elements<G, g, i + 1>(L, a3_start, f);
  }
}

// Decodes the lane's 32 elements in order, handing them to vis(g, f) in groups of G (element g + i = f[i]).
template <int G, int g = 0, class Vis>
__device__ __forceinline__ void decode_lane(Lane& L, Vis& vis, uint32_t a3_start) {
  if constexpr (g < 32) {
    float f[G];
    elements<G, g, 0>(L, a3_start, f);
    vis(g, f);
    decode_lane<G, g + G>(L, vis, a3_start);
  }
}

// -- decode ---------------------------------------------------------------------------------------

template <typename T>
struct StoreVis {
  T* out;        // the lane's first element
  float scale;
  bool full;     // all 32 elements exist: 16-byte stores
  uint32_t cnt;  // else the number that do (0 for idle lanes)

  __device__ __forceinline__ void operator()(int g, const float (&f)[8]) {
    if (full) {
      if constexpr (sizeof(T) == 4) {
        float4* p = reinterpret_cast<float4*>(out + g);
        p[0] = make_float4(f[0] * scale, f[1] * scale, f[2] * scale, f[3] * scale);
        p[1] = make_float4(f[4] * scale, f[5] * scale, f[6] * scale, f[7] * scale);
      } else {
        uint32_t w[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          T lo = from_f<T>(f[2 * i] * scale), hi = from_f<T>(f[2 * i + 1] * scale);
          w[i] = (uint32_t)reinterpret_cast<uint16_t&>(lo) | ((uint32_t)reinterpret_cast<uint16_t&>(hi) << 16);
        }
        *reinterpret_cast<uint4*>(out + g) = make_uint4(w[0], w[1], w[2], w[3]);
      }
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i)
        if ((uint32_t)(g + i) < cnt) out[g + i] = from_f<T>(f[i] * scale);
    }
  }
};

// One warp per 32 b1 words; out must be 16-byte aligned.
template <typename T>
__global__ void __launch_bounds__(WARPS * 32) decode_kernel(Streams s, T* __restrict__ out, const float* scale) {
  extern __shared__ uint32_t smem[];
  const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const uint32_t w0 = (blockIdx.x * WARPS + warp) * STEP_WORDS;
  if (w0 >= s.n_b1) return;  // whole warp
  const uint32_t nv = min((uint32_t)STEP_WORDS, s.n_b1 - w0);
  uint32_t J, I3;
  entry_counts(s, w0, lane, J, I3);
  const uint32_t w1 = lane < nv ? __ldg(s.b1 + w0 + lane) : 0u;
  Lane L = prepare(s, smem + warp * WARP_SMEM, w0, nv, lane, w1, J, I3);
  const uint32_t e0 = (w0 + lane) * 32u;
  StoreVis<T> vis{out + e0, __ldg(scale), lane < nv && e0 + 32u <= s.n, lane < nv ? min(32u, s.n - e0) : 0u};
  decode_lane<8>(L, vis, L.a3);
}

// -- fused GEMV -----------------------------------------------------------------------------------

template <int MT, bool ALIGNED>
struct DotVis {
  const float* x;  // the lane's fp32 x of this step (token stride XS)
  float acc[MT];
  static constexpr int XS = ALIGNED ? XS_ALIGNED : XS_GENERIC;

  __device__ __forceinline__ void operator()(int g, const float (&f)[4]) {
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      float4 xv;
      if constexpr (ALIGNED) {
        xv = *reinterpret_cast<const float4*>(x + m * XS + g);
      } else {
        const float* p = x + m * XS + g;
        xv = make_float4(p[0], p[1], p[2], p[3]);
      }
      float a = acc[m];
      a = fmaf(f[0], xv.x, a);
      a = fmaf(f[1], xv.y, a);
      a = fmaf(f[2], xv.z, a);
      a = fmaf(f[3], xv.w, a);
      acc[m] = a;
    }
  }
};

// x[m0 + m, k] for k in [kbase, kbase + NK) as fp32 into xs (zero outside the matrix).
template <int MT, bool ALIGNED, typename T>
__device__ void stage_x(float* xs, const T* __restrict__ x, int64_t sxm, int M, int m0, int K, int kbase,
                        bool xvec) {
  constexpr int XS = ALIGNED ? XS_ALIGNED : XS_GENERIC;
  constexpr int NK = ALIGNED ? STEP : XS_GENERIC;
  constexpr int VE = 16 / sizeof(T);  // elements of a 16-byte load
  constexpr int NV = NK / VE;
  for (int v = threadIdx.x; v < MT * NV; v += WARPS * 32) {
    const int m = v / NV, kl = (v - m * NV) * VE, k = kbase + kl;
    const bool mok = m0 + m < M;
    const T* row = x + (int64_t)(m0 + m) * sxm;
    float vals[VE];
    if (mok && xvec && k >= 0 && k + VE <= K) {
      const uint4 raw = *reinterpret_cast<const uint4*>(row + k);
      const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int i = 0; i < VE; ++i) vals[i] = to_f(e[i]);
    } else {
#pragma unroll
      for (int i = 0; i < VE; ++i) vals[i] = mok && k + i >= 0 && k + i < K ? to_f(row[k + i]) : 0.f;
    }
    float* dst = xs + m * XS + (ALIGNED ? kl + (kl >> 5) * 4 : kl);
#pragma unroll
    for (int i = 0; i < VE; i += 4)
      *reinterpret_cast<float4*>(dst + i) = make_float4(vals[i], vals[i + 1], vals[i + 2], vals[i + 3]);
  }
}

// CTA: WARPS output rows (one per warp), MT tokens (grid.y tiles larger M). Each step stages 1024 columns of x
// (as fp32, shared by the CTA's rows) and decodes the next 32 b1 words of every row. Rows start on a word when
// K % 32 == 0 (ALIGNED); otherwise a row's first and last words hold other rows' elements too, which meet the
// zeros staged around the row's columns.
template <int MT, bool ALIGNED>
__global__ void __launch_bounds__(WARPS * 32, MT <= 4 ? 4 : 2)
linear_kernel(Streams s, const void* __restrict__ x, int xdt, int64_t sxm, bool xvec, void* __restrict__ y, int ydt,
              int64_t sym, int64_t syn, int M, int N, int K, const float* scale) {
  constexpr int XS = ALIGNED ? XS_ALIGNED : XS_GENERIC;
  extern __shared__ uint32_t smem[];
  float* xs = reinterpret_cast<float*>(smem);
  const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  uint32_t* ws = smem + MT * XS + warp * WARP_SMEM;
  const int row = blockIdx.x * WARPS + warp;
  const int m0 = blockIdx.y * MT;
  const bool active = row < N;
  const uint64_t r0 = (uint64_t)row * (uint64_t)K;  // the row's first element
  const uint32_t wa = (uint32_t)(r0 >> 5);
  const uint32_t shift = (uint32_t)(r0 & 31);  // 0 when ALIGNED
  const uint32_t nw = active ? (uint32_t)((r0 + (uint64_t)K + 31) >> 5) - wa : 0u;
  const int steps = ALIGNED ? (K + STEP - 1) / STEP : ((K + 62) / 32 + STEP_WORDS - 1) / STEP_WORDS;

  uint32_t J = 0, I3 = 0;
  if (active) entry_counts(s, wa, lane, J, I3);
  DotVis<MT, ALIGNED> vis;
#pragma unroll
  for (int m = 0; m < MT; ++m) vis.acc[m] = 0.f;
  uint32_t w1_next = lane < nw ? __ldg(s.b1 + wa + lane) : 0u;

  for (int st = 0; st < steps; ++st) {
    __syncthreads();  // the previous step's x and staging are no longer read
    const int kbase = st * STEP - (ALIGNED ? 0 : 32);
    switch (xdt) {
      case F32: stage_x<MT, ALIGNED>(xs, static_cast<const float*>(x), sxm, M, m0, K, kbase, xvec); break;
      case F16: stage_x<MT, ALIGNED>(xs, static_cast<const __half*>(x), sxm, M, m0, K, kbase, xvec); break;
      default: stage_x<MT, ALIGNED>(xs, static_cast<const __nv_bfloat16*>(x), sxm, M, m0, K, kbase, xvec); break;
    }
    __syncthreads();
    const int left = (int)nw - st * STEP_WORDS;
    if (left > 0) {  // warp-uniform
      const uint32_t nv = (uint32_t)min(left, STEP_WORDS);
      const uint32_t w0 = wa + (uint32_t)st * STEP_WORDS;
      const uint32_t w1 = w1_next;
      w1_next = (int)lane < left - STEP_WORDS ? __ldg(s.b1 + w0 + STEP_WORDS + lane) : 0u;
      Lane L = prepare(s, ws, w0, nv, lane, w1, J, I3);
      // Element t of the lane is column st * STEP + 32 * lane + t - shift.
      vis.x = ALIGNED ? xs + lane * 36 : xs + 32 * (lane + 1) - shift;
      decode_lane<4>(L, vis, L.a3);
    }
  }

  const float sc = __ldg(scale);
  const uint32_t lane_out = tid_x() & 31;
  const int row_out = (int)(ctaid_x() * WARPS + (tid_x() >> 5));
  const int m0_out = (int)ctaid_y() * MT;
#pragma unroll
  for (int m = 0; m < MT; ++m) {
    float v = vis.acc[m];
#pragma unroll
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
    if (row_out < N && lane_out == (uint32_t)m && m0_out + m < M) {
      const int64_t at = (int64_t)(m0_out + m) * sym + (int64_t)row_out * syn;
      v *= sc;  // sum_k x * q * s = s * sum_k x * q
      switch (ydt) {
        case F32: static_cast<float*>(y)[at] = v; break;
        case F16: static_cast<__half*>(y)[at] = __float2half_rn(v); break;
        default: static_cast<__nv_bfloat16*>(y)[at] = __float2bfloat16_rn(v); break;
      }
    }
  }
}

// -- host -----------------------------------------------------------------------------------------

int dtype_code(const torch::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case torch::kFloat32: return F32;
    case torch::kFloat16: return F16;
    case torch::kBFloat16: return BF16;
    default: TORCH_CHECK(false, "int8x cuda: ", name, " must be fp32, fp16 or bf16, got ", t.scalar_type());
  }
  return F32;
}

void check_stream(const torch::Tensor& t, const char* name, torch::ScalarType dtype, const torch::Device& dev) {
  TORCH_CHECK(t.is_cuda(), "int8x cuda: ", name, " must be a CUDA tensor, got ", t.device());
  TORCH_CHECK(t.device() == dev, "int8x cuda: ", name, " is on ", t.device(), ", b1 on ", dev);
  TORCH_CHECK(t.scalar_type() == dtype, "int8x cuda: ", name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 1 && t.is_contiguous(), "int8x cuda: ", name, " must be a contiguous 1-D tensor, got shape ",
              t.sizes(), " strides ", t.strides());
}

Streams make_streams(const torch::Tensor& b1, const torch::Tensor& b2, const torch::Tensor& l1, const torch::Tensor& l2,
                     const torch::Tensor& l3, const torch::Tensor& b1_blk, const torch::Tensor& b2_blk,
                     const torch::Tensor& scale, int64_t n_rows, int64_t n_cols, int64_t block_size) {
  TORCH_CHECK(n_rows > 0 && n_cols > 0, "int8x cuda: n_rows and n_cols must be positive, got ", n_rows, ", ", n_cols);
  TORCH_CHECK(n_rows * n_cols <= INT32_MAX, "int8x cuda: ", n_rows, " x ", n_cols, " has more than 2^31 - 1 elements");
  TORCH_CHECK(block_size > 0 && block_size % 32 == 0 && block_size <= INT32_MAX,
              "int8x cuda: block_size must be a positive multiple of 32, got ", block_size);
  const auto dev = b1.device();
  check_stream(b1, "b1", torch::kInt32, dev);
  check_stream(b2, "b2", torch::kInt32, dev);
  check_stream(l1, "l1", torch::kInt32, dev);
  check_stream(l2, "l2", torch::kInt32, dev);
  check_stream(l3, "l3", torch::kUInt8, dev);
  check_stream(b1_blk, "b1_blk", torch::kInt32, dev);
  check_stream(b2_blk, "b2_blk", torch::kInt32, dev);
  check_stream(scale, "scale", torch::kFloat32, dev);
  const int64_t n = n_rows * n_cols;
  TORCH_CHECK(b1.numel() == (n + 31) / 32, "int8x cuda: b1 has ", b1.numel(), " words, expected ceil(n/32) = ",
              (n + 31) / 32, " for n = ", n);
  const int64_t nb = (n + block_size - 1) / block_size;
  TORCH_CHECK(b1_blk.numel() == nb && b2_blk.numel() == nb, "int8x cuda: b1_blk / b2_blk have ", b1_blk.numel(), " / ",
              b2_blk.numel(), " entries, expected ceil(n/block_size) = ", nb);
  TORCH_CHECK(scale.numel() >= 1, "int8x cuda: scale is empty");
  TORCH_CHECK(l1.numel() <= INT32_MAX && l2.numel() <= INT32_MAX, "int8x cuda: l1 / l2 too long");
  Streams s;
  s.b1 = reinterpret_cast<const uint32_t*>(b1.data_ptr<int32_t>());
  s.b2 = reinterpret_cast<const uint32_t*>(b2.data_ptr<int32_t>());
  s.l1 = reinterpret_cast<const uint32_t*>(l1.data_ptr<int32_t>());
  s.l2 = reinterpret_cast<const uint32_t*>(l2.data_ptr<int32_t>());
  s.l3 = l3.data_ptr<uint8_t>();
  s.b1_blk = b1_blk.data_ptr<int32_t>();
  s.b2_blk = b2_blk.data_ptr<int32_t>();
  s.n = (uint32_t)n;
  s.n_b1 = (uint32_t)b1.numel();
  s.n_l1 = (uint32_t)l1.numel();
  s.n_l2 = (uint32_t)l2.numel();
  s.block_size = (uint32_t)block_size;
  return s;
}

using parity::set_smem;

void decode(torch::Tensor b1, torch::Tensor b2, torch::Tensor l1, torch::Tensor l2, torch::Tensor l3,
            torch::Tensor b1_blk, torch::Tensor b2_blk, torch::Tensor scale, int64_t n_rows, int64_t n_cols,
            int64_t block_size, torch::Tensor out) {
  const Streams s = make_streams(b1, b2, l1, l2, l3, b1_blk, b2_blk, scale, n_rows, n_cols, block_size);
  TORCH_CHECK(out.is_cuda() && out.device() == b1.device(), "int8x cuda decode: out must be on ", b1.device(),
              ", got ", out.device());
  TORCH_CHECK(out.dim() == 2 && out.size(0) == n_rows && out.size(1) == n_cols && out.is_contiguous(),
              "int8x cuda decode: out must be contiguous (", n_rows, ", ", n_cols, "), got shape ", out.sizes(),
              " strides ", out.strides());
  TORCH_CHECK(reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0, "int8x cuda decode: out must be 16-byte aligned");
  const int odt = dtype_code(out, "out");
  const c10::cuda::CUDAGuard guard(b1.device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  const int64_t warps = (s.n_b1 + STEP_WORDS - 1) / STEP_WORDS;
  const dim3 grid((unsigned)((warps + WARPS - 1) / WARPS));
  const int64_t smem = (int64_t)WARPS * WARP_SMEM * 4;
  const float* sp = scale.data_ptr<float>();
  switch (odt) {
    case F32:
      set_smem(decode_kernel<float>, smem);
      decode_kernel<float><<<grid, WARPS * 32, smem, stream>>>(s, out.data_ptr<float>(), sp);
      break;
    case F16:
      set_smem(decode_kernel<__half>, smem);
      decode_kernel<__half><<<grid, WARPS * 32, smem, stream>>>(s, reinterpret_cast<__half*>(out.data_ptr()), sp);
      break;
    default:
      set_smem(decode_kernel<__nv_bfloat16>, smem);
      decode_kernel<__nv_bfloat16><<<grid, WARPS * 32, smem, stream>>>(
          s, reinterpret_cast<__nv_bfloat16*>(out.data_ptr()), sp);
      break;
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <int MT, bool ALIGNED>
void launch_linear(const Streams& s, const torch::Tensor& x, int xdt, bool xvec, torch::Tensor& out, int ydt, int M,
                   int N, int K, const float* sp, cudaStream_t stream) {
  constexpr int XS = ALIGNED ? XS_ALIGNED : XS_GENERIC;
  const int64_t smem = ((int64_t)MT * XS + (int64_t)WARPS * WARP_SMEM) * 4;
  auto kernel = linear_kernel<MT, ALIGNED>;
  set_smem(kernel, smem);
  const dim3 grid((unsigned)((N + WARPS - 1) / WARPS), (unsigned)((M + MT - 1) / MT));
  kernel<<<grid, WARPS * 32, smem, stream>>>(s, x.data_ptr(), xdt, x.stride(0), xvec, out.data_ptr(), ydt,
                                             out.stride(0), out.stride(1), M, N, K, sp);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void linear(torch::Tensor x, torch::Tensor b1, torch::Tensor b2, torch::Tensor l1, torch::Tensor l2, torch::Tensor l3,
            torch::Tensor b1_blk, torch::Tensor b2_blk, torch::Tensor scale, int64_t n_rows, int64_t n_cols,
            int64_t block_size, torch::Tensor out) {
  const Streams s = make_streams(b1, b2, l1, l2, l3, b1_blk, b2_blk, scale, n_rows, n_cols, block_size);
  TORCH_CHECK(x.is_cuda() && x.device() == b1.device(), "int8x cuda linear: x must be on ", b1.device(), ", got ",
              x.device());
  TORCH_CHECK(x.dim() == 2 && x.size(1) == n_cols, "int8x cuda linear: x must be (M, ", n_cols, "), got shape ",
              x.sizes());
  TORCH_CHECK(x.stride(1) == 1 || x.size(1) == 1, "int8x cuda linear: x must be contiguous along K, got strides ",
              x.strides());
  TORCH_CHECK(out.is_cuda() && out.device() == b1.device(), "int8x cuda linear: out must be on ", b1.device(),
              ", got ", out.device());
  TORCH_CHECK(out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) == n_rows,
              "int8x cuda linear: out must be (", x.size(0), ", ", n_rows, "), got shape ", out.sizes());
  TORCH_CHECK(x.size(0) <= 65535 * 16, "int8x cuda linear: x has ", x.size(0), " rows, at most ", 65535 * 16,
              " (decode the weight and use a matmul for so many)");
  const int xdt = dtype_code(x, "x"), ydt = dtype_code(out, "out");
  const int M = (int)x.size(0), N = (int)n_rows, K = (int)n_cols;
  if (M == 0) return;
  const c10::cuda::CUDAGuard guard(b1.device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  const int64_t esz = x.element_size();
  const bool xvec = reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 && (x.stride(0) * esz) % 16 == 0;
  const float* sp = scale.data_ptr<float>();
  if (K % 32 != 0) {
    launch_linear<4, false>(s, x, xdt, xvec, out, ydt, M, N, K, sp, stream);
  } else if (M == 1) {
    launch_linear<1, true>(s, x, xdt, xvec, out, ydt, M, N, K, sp, stream);
  } else if (M == 2) {
    launch_linear<2, true>(s, x, xdt, xvec, out, ydt, M, N, K, sp, stream);
  } else if (M <= 4) {
    launch_linear<4, true>(s, x, xdt, xvec, out, ydt, M, N, K, sp, stream);
  } else if (M <= 8) {
    launch_linear<8, true>(s, x, xdt, xvec, out, ydt, M, N, K, sp, stream);
  } else {
    launch_linear<16, true>(s, x, xdt, xvec, out, ydt, M, N, K, sp, stream);
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode", &decode, "int8x decode into out (n_rows, n_cols)", py::arg("b1"), py::arg("b2"), py::arg("l1"),
        py::arg("l2"), py::arg("l3"), py::arg("b1_blk"), py::arg("b2_blk"), py::arg("scale"), py::arg("n_rows"),
        py::arg("n_cols"), py::arg("block_size"), py::arg("out"));
  m.def("linear", &linear, "int8x fused decode-GEMV: out = x @ W^T", py::arg("x"), py::arg("b1"), py::arg("b2"),
        py::arg("l1"), py::arg("l2"), py::arg("l3"), py::arg("b1_blk"), py::arg("b2_blk"), py::arg("scale"),
        py::arg("n_rows"), py::arg("n_cols"), py::arg("block_size"), py::arg("out"));
}
