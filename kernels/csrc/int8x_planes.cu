// int8x in the planes layout (kernels/int8x_planes.py): fused decode-GEMV on the tensor cores, and decode to a
// dense weight.
//
// GEMV, y = x @ W^T for up to 16 rows of x per CTA row (grid.y slices larger M): a CTA owns `tpc` tiles of 16
// weight rows (1 unless the host asks for more), each tile `wpt` warps that split its 512-column chunks in equal
// runs; warp w of every tile walks the same chunks. Per chunk
//  * each warp puts its tile's fixup records for the chunk in flight to shared memory (cp.async, 16-byte vectors;
//    their table entries were read while the previous chunk was computed) and reads the next chunk's entries,
//  * the warps that walk it (one per tile) stage x[m0 .. m0 + M) over the chunk's columns once in shared memory,
//    with 16-byte loads; tokens past M stay zero, columns past K are zero. One token (M = 1): the row, and the
//    chunk again in B-fragment order, so that a lane reads 4 k-steps of B in two 16-byte loads, the token in every
//    column of B (no lane-dependent branch). More: transposed, [column][8 or 16 tokens] (xt_word), so that a fixup
//    record reads its column's tokens in 16-byte loads. With one tile per CTA the warp stages alone (__syncwarp),
//    else the tiles' warps meet at a named barrier (one per chunk run),
//  * per 256-column block (the next 1 or 2 in flight to shared memory by cp.async meanwhile) runs 16
//    mma.m16n8k16 (two per k-step for M > 8) with A decoded from the plane: a pair of codes c becomes
//    the fp16 / bf16 pair 32 + c with two lop3 (nibbles, bit 4 and the magic number 32.0), minus 48 in one
//    packed subtraction at M > 1; at M = 1 the CTA subtracts 48 * sum(x) once instead (exact: small integers).
//    B comes from the transposed x with ldmatrix .trans (an 8 x 8 matrix of 8 consecutive k x 8 tokens is b0,
//    the next 8 k b1; .x4 covers 16 tokens),
//  * then the records, landed by now: lane l walks those of row l % 16 with parity l / 16, adding
//    h * x[token][column] per token to fp32 registers.
// The warps' accumulators and 32 * fixup sums meet in shared memory; the CTA writes scale * sum in y's dtype.
// Split along K (compute capability 9): the chunk runs of a tile go to a cluster of CTAs along grid.z, each CTA its
// share of them, so that more tiles share a staged x at few tiles (N = 4096) and still fill the device; the
// cluster's CTAs add their partial sums through distributed shared memory, in rank order, each writing a share of
// the outputs.
// On compute capability 9 the GEMV is a programmatic dependent launch: the first blocks and record table entries are
// put in flight before griddepcontrol.wait, x is read and y written after it.
//
// Decode: one warp per (tile, step) block: its records go to shared memory by cp.async while the codes go to a
// shared [16][256] int8 tile; the records of its half of the chunk patch it, then the lanes write 16-byte vectors
// of q * scale row by row (rows past N and columns past K are not written).

#include <torch/extension.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cooperative_groups.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "cp_async.cuh"
#include "dtypes.cuh"
#include "launch.cuh"

namespace {

constexpr int TILE_ROWS = 16;
constexpr int STEP_COLS = 256;   // columns of a block of the plane
constexpr int CHUNK_COLS = 512;  // columns of a group of fixup records (two blocks)
constexpr int BLOCK_VEC = 160;   // 16-byte vectors per (tile, step) block: 640 words
constexpr int NIB_VEC = 128;     // the first 128 vectors hold nibbles, 32 per group of 4 k-steps
constexpr int REC_CAP = 1024;    // fixup records staged per warp at a time (a block has at most 4096)
constexpr uint32_t FULL = 0xffffffffu;

namespace cg = cooperative_groups;

using parity::cp_async16;
using parity::cp_async_commit;
using parity::cp_async_wait;
using parity::from_f;
using parity::pdl_launch_dependents;
using parity::pdl_wait;
using parity::smem_addr;
using parity::to_f;

struct Layout {
  const uint4* planes;
  const uint8_t* fx_pos;
  const uint8_t* fx_h;
  const int32_t* fx_base;
  const int16_t* fx_ends;
  int64_t n_rec;  // records: fx_pos bytes (fx_h holds (n_rec + 1) / 2)
  int n, k;
  int steps;  // K / 256 after padding to 512: even
};

// A code c (5 bits) in each 16-bit half becomes 32 + c = v5 + 48 exactly: the magic number 32.0 with c in the
// five mantissa bits of weight 1 (fp16: bits 5..9, ulp 1/32 at 32; bf16: bits 2..6, ulp 1/4 at 32).
template <typename T> struct Code;
template <> struct Code<__half> { static constexpr uint32_t MAGIC = 0x50005000u; static constexpr int LOW = 5; };
template <> struct Code<__nv_bfloat16> { static constexpr uint32_t MAGIC = 0x42004200u; static constexpr int LOW = 2; };

template <int SH>
__device__ __forceinline__ uint32_t shift(uint32_t v) {
  if constexpr (SH > 0)
    return v << SH;
  else if constexpr (SH < 0)
    return v >> -SH;
  else
    return v;
}

// (a & MASK) | c in one instruction (LUT 0xEA).
template <uint32_t MASK>
__device__ __forceinline__ uint32_t and_or(uint32_t a, uint32_t c) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(a), "n"(MASK), "r"(c));
  return r;
}

// v5 + 48 - 48 = v5, exact (bf16: fma with 1, the packed bf16 subtraction of sm_80).
__device__ __forceinline__ uint32_t unbias(uint32_t v, __half) {
  uint32_t r;
  asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(v), "r"(0x52005200u));
  return r;
}
__device__ __forceinline__ uint32_t unbias(uint32_t v, __nv_bfloat16) {
  uint32_t r;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(v), "r"(0x3F803F80u), "r"(0xC240C240u));
  return r;
}

// A fragment pair p of k-step s (of its group): nibbles at bits 4p (+16) of nw, bit 4 at bits 4s+p (+16) of hw;
// as v5 + 48 (BIASED: the caller subtracts 48 * sum(x)) or as v5. magic: Code<T>::MAGIC in a register.
template <typename T, int S, int P, bool BIASED>
__device__ __forceinline__ uint32_t pair(uint32_t nw, uint32_t hw, uint32_t magic) {
  constexpr int LOW = Code<T>::LOW, J = 4 * S + P;
  constexpr uint32_t NIB = 0xFu << LOW, HB = 0x10u << LOW;
  const uint32_t v = and_or<NIB | NIB << 16>(shift<LOW - 4 * P>(nw),
                                              and_or<HB | HB << 16>(shift<LOW + 4 - J>(hw), magic));
  return BIASED ? v : unbias(v, T());
}

template <typename T>
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same<T, __half>::value) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

__device__ __forceinline__ void ldsm_x2_trans(uint32_t addr, uint32_t& r0, uint32_t& r1) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];" : "=r"(r0), "=r"(r1) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2,
                                              uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

// Streamed once: keep the weight out of L1.
__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// Fixup code -> h in -4..-1, 1..4.
__device__ __forceinline__ int fixup_h(uint32_t code) { return (int)code - 4 + (int)(code >> 2); }

// -- fused GEMV -----------------------------------------------------------------------------------

constexpr int XSTRIDE = CHUNK_COLS + 8;  // elements per staged token row: 1040 bytes, 16 (mod 128)
// A warp's records, staged with 16-byte copies from the 16-byte boundary below the window's first byte: positions
// (REC_CAP + 15 bytes at most, 65 vectors), then codes (REC_CAP / 2 + 16 bytes at most, 33 vectors).
constexpr int REC_POS_BYTES = 65 * 16;
constexpr int REC_BYTES = REC_POS_BYTES + 33 * 16;
constexpr int MAX_CTA_WARPS = 16;

template <int MT>
struct XStage {
  static constexpr int XT = MT == 1 ? 1 : (MT <= 8 ? 8 : 16);  // staged tokens
  // One token: the row, then the chunk again in B-fragment order (xperm), so a lane reads 4 k-steps of B with
  // two 16-byte loads. More: transposed (xt_word), B read by ldmatrix .trans and a fixup record's column, its XT
  // tokens, with XT / 8 16-byte loads.
  static constexpr int BYTES = MT == 1 ? XSTRIDE * 2 + CHUNK_COLS * 2 : CHUNK_COLS * XT * 2;  // a multiple of 16
};

// The transposed x (XT > 1): column c's tokens 2 p and 2 p + 1 in one word, 8 tokens in a 16-byte granule g
// (column c, half h at 16 tokens: g = XT / 8 * c + h), granules placed at g ^ s(c) within their aligned group of 8
// so that the 8 consecutive columns of an ldmatrix, the stagers' stores (columns 8 v + e, pairs p) and the lanes
// reading random columns spread over the banks: s flips the low bits by column bits 2 .. 5. A column 64 on has
// the same s.
template <int XT>
__device__ __forceinline__ int xt_word(int c, int p) {
  if constexpr (XT == 16)
    return 4 * ((2 * c + (p >> 2)) ^ (((c >> 2) & 1) | (((c >> 3) & 3) << 1))) + (p & 3);
  else
    return 4 * (c ^ ((c >> 3) & 7)) + p;
}

// Records and blocks of one warp: the blocks of the plane in flight to shared memory (cp.async) are the one
// computed and the next ns - 1 (ns = 2 or 3 at one token, 2 for more).
__host__ __device__ constexpr int warp_bytes(int ns) { return REC_BYTES + ns * BLOCK_VEC * 16; }

// The reduction's floats: per warp its tile's rows x tokens and its sum of x, then the CTA's partial outputs
// (read by the other CTAs of a cluster).
template <int MT>
__host__ __device__ constexpr int64_t reduce_floats(int wpt, int tpc) {
  return (int64_t)wpt * tpc * (TILE_ROWS * MT + 1) + (int64_t)tpc * TILE_ROWS * MT;
}

// Shared memory of a CTA: wpt x slices, then per warp its records and its blocks; the reduction reuses it from
// the start.
template <int MT>
__host__ __device__ constexpr int64_t linear_smem(int wpt, int tpc, int ns) {
  const int64_t staged = (int64_t)wpt * XStage<MT>::BYTES + (int64_t)wpt * tpc * warp_bytes(ns);
  const int64_t reduce = reduce_floats<MT>(wpt, tpc) * 4;
  return staged > reduce ? staged : reduce;
}

// The threads that stage one x slice: a warp (one tile a CTA) or the tpc warps of one chunk run (named barrier
// 1 + run). Only the SHARED kernels name barriers: a barrier id known only at run time reserves all 16 of the CTA,
// which caps an SM at 4 CTAs.
template <bool SHARED>
__device__ __forceinline__ void run_sync(int run, int threads) {
  if constexpr (SHARED)
    asm volatile("bar.sync %0, %1;" ::"r"(run + 1), "r"(threads) : "memory");
  else
    __syncwarp();
}

// Records [r0, r0 + cnt) in flight to the warp's buffer as one cp.async group (empty for cnt = 0; the kernel waits
// for it before reading): the 16-byte vectors of fx_pos and fx_h that hold them (the host checks both tensors are
// 16-byte aligned), one loop over both so that a lane issues one or two copies for a typical group.
// Returns where record r0's position and code byte land: pos at rbuf[o.x + i], code byte at
// rbuf[REC_POS_BYTES + o.y + ((i + (r0 & 1)) >> 1)].
__device__ __forceinline__ int2 stage_records_async(const Layout& L, int64_t r0, int cnt, uint8_t* rbuf, int lane) {
  if (cnt == 0) {
    cp_async_commit();
    return make_int2(0, 0);
  }
  const uintptr_t p0 = reinterpret_cast<uintptr_t>(L.fx_pos + r0), pa = p0 & ~(uintptr_t)15;
  const uintptr_t h0 = reinterpret_cast<uintptr_t>(L.fx_h + (r0 >> 1)), ha = h0 & ~(uintptr_t)15;
  const int po = (int)(p0 - pa), ho = (int)(h0 - ha);
  const int npv = (po + cnt + 15) >> 4;
  const int nhv = (ho + (int)(((r0 + cnt + 1) >> 1) - (r0 >> 1)) + 15) >> 4;
  // Bytes from each aligned start to its tensor's end (a copy past it is zero-filled).
  const int64_t pleft = reinterpret_cast<uintptr_t>(L.fx_pos + L.n_rec) - pa;
  const int64_t hleft = reinterpret_cast<uintptr_t>(L.fx_h + ((L.n_rec + 1) >> 1)) - ha;
  for (int i = lane; i < npv + nhv; i += 32) {
    const bool pos = i < npv;
    const int j = pos ? i : i - npv;
    const int64_t left = (pos ? pleft : hleft) - 16 * j;
    cp_async16(smem_addr(rbuf + (pos ? 0 : REC_POS_BYTES) + 16 * j),
               reinterpret_cast<const void*>((pos ? pa : ha) + 16 * j),
               left < 16 ? (int)left : 16);
  }
  cp_async_commit();
  return make_int2(po, ho);
}

// Where token 0's column j (of a 512-column chunk) sits in the B-fragment copy: block j / 256, group G = k-step
// / 4, lane column t = (j % 8) / 2; per (G, t) 8 words: (b0, b1) of k-steps 4 G .. 4 G + 3.
__device__ __forceinline__ int xperm_word(int j) {
  const int cc = j & 255, ks = cc >> 4;
  return (j >> 8) * 128 + (((ks >> 2) * 4 + ((cc & 7) >> 1)) * 8 + 2 * (ks & 3) + ((cc >> 3) & 1));
}

// 8 values of a row of x from column k0: a 16-byte load where x allows (xvec: 16-byte aligned rows), else
// elementwise; columns >= K read as 0.
template <typename T>
__device__ __forceinline__ uint4 load_x8(const T* row, int K, int k0, bool xvec) {
  uint4 packed;
  if (xvec && k0 + 8 <= K) {
    packed = __ldg(reinterpret_cast<const uint4*>(row + k0));
  } else {
    T* p = reinterpret_cast<T*>(&packed);
#pragma unroll
    for (int j = 0; j < 8; ++j) p[j] = k0 + j < K ? row[k0 + j] : from_f<T>(0.f);
  }
  return packed;
}

// The sum of the 8 values of a vector, in fp32.
template <typename T>
__device__ __forceinline__ float sum8(const uint4& v) {
  const T* p = reinterpret_cast<const T*>(&v);
  float s = 0.f;
#pragma unroll
  for (int j = 0; j < 8; ++j) s += to_f(p[j]);
  return s;
}

// One token: a chunk of x is 64 vectors, at most two a thread (32 or more stagers). They are loaded a chunk
// ahead into registers (XAhead) and stored when the chunk starts, so no chunk waits for its x.
struct XAhead {
  uint4 v[2];
};

template <typename T>
__device__ __forceinline__ void load_x1(XAhead& a, const T* __restrict__ x, int K, int c0, bool xvec, int gl,
                                        int gsize) {
#pragma unroll
  for (int i = 0; i < 2; ++i)
    if (gl + i * gsize < CHUNK_COLS / 8) a.v[i] = load_x8(x, K, c0 + 8 * (gl + i * gsize), xvec);
}

// Stored as a row and in B-fragment order, and summed (the bias of A, block_mma).
template <typename T>
__device__ __forceinline__ void store_x1(T* xs, const XAhead& a, int gl, int gsize, float& xsum) {
  uint32_t* xp = reinterpret_cast<uint32_t*>(xs + XSTRIDE);
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int v = gl + i * gsize;
    if (v >= CHUNK_COLS / 8) break;
    const uint4 packed = a.v[i];
    xsum += sum8<T>(packed);
    *reinterpret_cast<uint4*>(xs + 8 * v) = packed;
    const int w = xperm_word(8 * v);  // the vector's words go to lane columns t = 0 .. 3: 8 words apart
    xp[w] = packed.x;
    xp[w + 8] = packed.y;
    xp[w + 16] = packed.z;
    xp[w + 24] = packed.w;
  }
}

// More tokens: loaded and stored transposed when the chunk starts. A thread takes the 8 columns of vector v of
// tokens 2 p and 2 p + 1 (zero past M) and writes their 8 words.
template <int MT, typename T>
__device__ __forceinline__ void stage_x(T* xs, const T* __restrict__ x, int64_t sxm, int mc, int K, int c0, bool xvec,
                                        int gl, int gsize) {
  constexpr int XT = XStage<MT>::XT;
  uint32_t* xt = reinterpret_cast<uint32_t*>(xs);
  const int np = (mc + 1) >> 1;  // token pairs
  for (int i = gl; i < np * (CHUNK_COLS / 8); i += gsize) {
    const int v = i / np, p = i - v * np, m = 2 * p;
    const uint4 a = load_x8(x + (int64_t)m * sxm, K, c0 + 8 * v, xvec);
    const uint4 b = m + 1 < mc ? load_x8(x + (int64_t)(m + 1) * sxm, K, c0 + 8 * v, xvec) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int j = 0; j < 4; ++j) {  // columns 8 v + 2 j and + 1: the low and the high halves of word j
      xt[xt_word<XT>(8 * v + 2 * j, p)] = __byte_perm(word(a, j), word(b, j), 0x5410);
      xt[xt_word<XT>(8 * v + 2 * j + 1, p)] = __byte_perm(word(a, j), word(b, j), 0x7632);
    }
  }
}

// The two values of a word of x (the lower first) in fp32.
__device__ __forceinline__ float2 unpack2(uint32_t w, __half) {
  return __half22float2(*reinterpret_cast<const __half2*>(&w));
}
__device__ __forceinline__ float2 unpack2(uint32_t w, __nv_bfloat16) {
  return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
}

// The four A fragments of k-step s (of its group): pairs P = 0 .. 3.
template <typename T, int S, bool BIASED>
__device__ __forceinline__ void kstep_a(uint32_t (&a)[4], uint32_t nw, uint32_t hw, uint32_t mg) {
  a[0] = pair<T, S, 0, BIASED>(nw, hw, mg);
  a[1] = pair<T, S, 1, BIASED>(nw, hw, mg);
  a[2] = pair<T, S, 2, BIASED>(nw, hw, mg);
  a[3] = pair<T, S, 3, BIASED>(nw, hw, mg);
}

// 16 k-steps of one 256-column block: A decoded from the plane, B from the staged x (MT = 1: xb, the block's
// B-fragment copy; more: xs, the transposed x from the block's first column).
template <int MT, typename T>
__device__ __forceinline__ void block_mma(float (&acc)[2][4], const uint4 (&nib)[4], const uint4& hib,
                                          const T* xs, const uint32_t* xb, int lane) {
  constexpr int NT = MT > 8 ? 2 : 1;
  constexpr bool B1 = MT == 1;  // one token: A biased by 48, 48 * sum(x) subtracted once at the end
  uint32_t mg;  // the magic number in a register, so that one instruction ORs it in with bit 4
  asm("mov.b32 %0, %1;" : "=r"(mg) : "n"(Code<T>::MAGIC));
  const int t = lane & 3;
  // ldmatrix .trans row addresses: lanes 8 i .. 8 i + 7 give matrix i's rows, columns 8 (i % 2) + (lane & 7) of
  // the k-step, each its 8 tokens 8 (i / 2) .. + 7 (.x4 only); k-step 4 G + s is at xs_off[s] + G 64 columns on.
  constexpr int XT = XStage<MT>::XT;
  const int col = ((lane >> 3) & 1) * 8 + (lane & 7);
  const uint32_t xs_base = smem_addr(xs);
  uint32_t xs_off[4];
#pragma unroll
  for (int s = 0; s < 4; ++s) xs_off[s] = 4u * (uint32_t)xt_word<XT>(col + 16 * s, NT == 2 ? (lane >> 4) * 4 : 0);
#pragma unroll
  for (int G = 0; G < 4; ++G) {
    const uint32_t hw = word(hib, G);
    uint4 bq0, bq1;  // MT = 1: B of k-steps 4 G .. 4 G + 3, token 0 in every column (column 0 is read)
    if constexpr (MT == 1) {
      bq0 = reinterpret_cast<const uint4*>(xb)[(G * 4 + t) * 2];
      bq1 = reinterpret_cast<const uint4*>(xb)[(G * 4 + t) * 2 + 1];
    }
    // k-step 4 G + s with its A fragments
    auto step = [&](int s, const uint32_t(&a)[4]) {
      if constexpr (MT == 1) {
        const uint4& bq = s < 2 ? bq0 : bq1;
        mma<T>(acc[s & 1], a, (s & 1) ? bq.z : bq.x, (s & 1) ? bq.w : bq.y);
      } else {
        const uint32_t addr = xs_base + xs_off[s] + (uint32_t)(64 * XT * 2 * G);
        if constexpr (NT == 1) {
          uint32_t b0, b1;
          ldsm_x2_trans(addr, b0, b1);
          mma<T>(acc[s & 1], a, b0, b1);
        } else {
          uint32_t b0, b1, b2, b3;
          ldsm_x4_trans(addr, b0, b1, b2, b3);
          mma<T>(acc[0], a, b0, b1);
          mma<T>(acc[NT - 1], a, b2, b3);
        }
      }
    };
    uint32_t a[4];
    kstep_a<T, 0, B1>(a, nib[G].x, hw, mg);
    step(0, a);
    kstep_a<T, 1, B1>(a, nib[G].y, hw, mg);
    step(1, a);
    kstep_a<T, 2, B1>(a, nib[G].z, hw, mg);
    step(2, a);
    kstep_a<T, 3, B1>(a, nib[G].w, hw, mg);
    step(3, a);
  }
}

// The records of the lane's row (lane % 16) and parity (lane / 16) among records [rec0, rec0 + nrec) of a group,
// each passed to f(column in the group, 4-bit code). Window 0 (the first REC_CAP records) was put in flight
// before, NEWER cp.async groups ahead of the newest; more windows (a group with more than REC_CAP records) are
// staged here. Shared by the GEMV and the decode.
template <int NEWER, typename F>
__device__ __forceinline__ void for_lane_records(const Layout& L, uint8_t* rbuf, int64_t rec0, int nrec,
                                                 int row_start, int row_end, int2 off, int lane, F&& f) {
  const int fpar = lane >> 4;
  for (int w0 = 0; w0 < nrec; w0 += REC_CAP) {
    const int cnt = min(REC_CAP, nrec - w0);
    if (w0) {
      __syncwarp();  // the previous window is no longer read
      off = stage_records_async(L, rec0 + w0, cnt, rbuf, lane);
      cp_async_wait<0>();
    } else {
      cp_async_wait<NEWER>();
    }
    __syncwarp();  // the records of every lane (and what the lanes wrote before)
    int e = max(row_start + fpar, w0);
    e += (e - row_start - fpar) & 1;  // keep the lane's parity
    // The lane's records are every second one: positions two bytes apart, codes in consecutive bytes at one nibble.
    const int i0 = e - w0, hi = i0 + (int)((rec0 + w0) & 1);
    const uint8_t* rpos = rbuf + off.x + i0;
    const uint8_t* rh = rbuf + REC_POS_BYTES + off.y + (hi >> 1);
    const int sh = (hi & 1) * 4;
#pragma unroll 1
    for (int n = (min(row_end, w0 + cnt) - e + 1) >> 1; n > 0; --n, rpos += 2, ++rh) {
      const uint32_t nb = ((uint32_t)*rh >> sh) & 15u;
      f((int)*rpos | (int)(nb >> 3) << 8, nb);
    }
  }
}

// The chunk's fixups: h * x[token][column] summed into fx (records in flight two block groups before); more
// tokens read the column from the transposed copy, 8 tokens a 16-byte load.
template <int MT, typename T>
__device__ __forceinline__ void apply_fixups(const Layout& L, float (&fx)[MT], const T* xs, uint8_t* rbuf,
                                             int64_t rec0, int nrec, int row_start, int row_end, int2 off, int lane) {
  constexpr int XT = XStage<MT>::XT;
  const uint32_t* xt = reinterpret_cast<const uint32_t*>(xs);
  for_lane_records<2>(L, rbuf, rec0, nrec, row_start, row_end, off, lane, [&](int col, uint32_t nb) {
    const float h = (float)fixup_h(nb & 7u);
    if constexpr (MT == 1) {
      fx[0] = fmaf(h, to_f(xs[col]), fx[0]);
    } else {
#pragma unroll
      for (int q = 0; q < MT / 8; ++q) {  // tokens 8 q .. 8 q + 7
        const uint4 w = *reinterpret_cast<const uint4*>(xt + xt_word<XT>(col, 4 * q));
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float2 v = unpack2(word(w, j), T());
          fx[8 * q + 2 * j] = fmaf(h, v.x, fx[8 * q + 2 * j]);
          fx[8 * q + 2 * j + 1] = fmaf(h, v.y, fx[8 * q + 2 * j + 1]);
        }
      }
    }
  });
}

// Launch bound: up to 512 threads a CTA (ptxas: no spills, 79-96 registers).
constexpr int MAX_THREADS = 512;

// Blocks go to shared memory by cp.async, NSTAGE - 1 ahead of the one computed, each lane copying (and later
// reading) its own five vectors. Per chunk, in order: the chunk's records put in flight (their table entries were
// read a chunk ahead), x staged, the two blocks' MMAs, then the records applied, by then landed. Every block and
// every chunk's records is one cp.async group, empty where there is nothing to copy, so the number of groups
// newer than the one awaited is fixed.
// MT = 8: without the minimum of one CTA an SM, ptxas caps the one-tile kernel at 64 registers and spills.
template <int MT, int NSTAGE, bool SHARED, typename T>
__global__ void __launch_bounds__(MAX_THREADS, MT == 8 ? 1 : 0)
    linear_kernel(Layout L, const T* __restrict__ x, int64_t sxm, bool xvec, T* __restrict__ y, int64_t sym,
                  int64_t syn, int M, int cpw, int tpc, const float* __restrict__ scale) {
  constexpr int NT = MT > 8 ? 2 : 1;
  extern __shared__ __align__(16) unsigned char smem[];
  pdl_launch_dependents();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int wpt = nwarps / tpc;                  // warps per tile
  const int tl = warp / wpt, run = warp - tl * wpt;  // the warp's tile in the CTA, its chunk run
  const int gl = tl * 32 + lane, gsize = tpc * 32;   // the warp's lanes among the run's stagers
  T* xs = reinterpret_cast<T*>(smem + run * XStage<MT>::BYTES);
  const uint32_t* xb = reinterpret_cast<const uint32_t*>(xs + XSTRIDE);  // MT = 1 only
  static_assert(NSTAGE == 2 || (NSTAGE == 3 && MT == 1), "blocks in flight: 2, or 3 at one token");
  uint8_t* rbuf = smem + (int64_t)wpt * XStage<MT>::BYTES + warp * warp_bytes(NSTAGE);
  uint4* pbuf = reinterpret_cast<uint4*>(rbuf + REC_BYTES);  // NSTAGE blocks of BLOCK_VEC vectors

  const int64_t tiles = (L.n + TILE_ROWS - 1) / TILE_ROWS;
  const int tile = blockIdx.x * tpc + tl;            // may pass the last tile in the last CTA: it reads that one
  const int64_t tile_r = min((int64_t)tile, tiles - 1);  // and writes nothing
  const int m0 = blockIdx.y * 16;
  const int mc = min(M - m0, MT);
  x += (int64_t)m0 * sxm;
  const int chunks = L.steps / 2;
  const int grun = blockIdx.z * wpt + run;  // the run among the tile's runs of the cluster
  const int b_begin = 2 * grun * cpw, b_end = 2 * min(chunks, grun * cpw + cpw);  // the run's blocks (maybe none)
  const int fr = lane & 15;

  // Up to 8 tokens: even and odd k-steps in two accumulators, two chains of dependent MMAs instead of one; more
  // tokens: one per 8 tokens.
  float acc[2][4];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j] = 0.f;
  float fx[MT];
#pragma unroll
  for (int m = 0; m < MT; ++m) fx[m] = 0.f;
  float xsum = 0.f;  // MT = 1: x summed over the columns this thread staged

  // Zero the slice once (tokens past M are never staged); the first chunk's barrier orders it before staging.
  for (int i = gl; i < XStage<MT>::BYTES / 16; i += gsize) reinterpret_cast<uint4*>(xs)[i] = make_uint4(0, 0, 0, 0);

  const uint4* blocks = L.planes + tile_r * L.steps * BLOCK_VEC;
  // Block B of the run (if there is one) in flight to its stage; one group either way.
  auto fetch = [&](int B) {
    if (B < b_end) {
      const uint4* b = blocks + (int64_t)B * BLOCK_VEC + lane;
      uint4* d = pbuf + (B % NSTAGE) * BLOCK_VEC + lane;
#pragma unroll
      for (int i = 0; i < 5; ++i) cp_async16(smem_addr(d + 32 * i), b + 32 * i, 16);
    }
    cp_async_commit();
  };
#pragma unroll
  for (int i = 0; i < NSTAGE - 1; ++i) fetch(b_begin + i);
  // The record table entries of the run's first chunk: rec0, its end, the lane row's end and start.
  int64_t rec0 = 0;
  int rec1 = 0, row_end = 0, row_start = 0;
  if (b_begin < b_end) {
    const int64_t grp = tile_r * chunks + (b_begin >> 1);
    rec0 = __ldg(L.fx_base + grp);
    rec1 = __ldg(L.fx_base + grp + 1);
    row_end = __ldg(L.fx_ends + grp * TILE_ROWS + fr);
    row_start = fr ? __ldg(L.fx_ends + grp * TILE_ROWS + fr - 1) : 0;
  }
  pdl_wait();  // the weight's first blocks and table entries are in flight; x and y only from here
  XAhead xa;  // MT = 1: the next chunk's x
  if constexpr (MT == 1)
    if (b_begin < b_end) load_x1(xa, x, L.k, b_begin * STEP_COLS, xvec, gl, gsize);
  int2 off = make_int2(0, 0);
  int nx_rec1 = 0, nx_row_end = 0, nx_row_start = 0;  // the next chunk's table entries
  for (int B = b_begin; B < b_end; ++B) {
    const int nrec = rec1 - (int)rec0;
    if ((B & 1) == 0) {  // a new chunk: its records in flight, the next chunk's entries read, its x staged
      run_sync<SHARED>(run, gsize);  // the previous chunk's x and records are no longer read
      off = stage_records_async(L, rec0, min(REC_CAP, nrec), rbuf, lane);
      if (B + 2 < b_end) {
        const int64_t grp = tile_r * chunks + (B >> 1) + 1;
        nx_rec1 = __ldg(L.fx_base + grp + 1);
        nx_row_end = __ldg(L.fx_ends + grp * TILE_ROWS + fr);
        nx_row_start = fr ? __ldg(L.fx_ends + grp * TILE_ROWS + fr - 1) : 0;
      }
      if constexpr (MT == 1) {
        store_x1(xs, xa, gl, gsize, xsum);
        if (B + 2 < b_end) load_x1(xa, x, L.k, (B + 2) * STEP_COLS, xvec, gl, gsize);
      } else {
        stage_x<MT>(xs, x, sxm, mc, L.k, B * STEP_COLS, xvec, gl, gsize);
      }
      run_sync<SHARED>(run, gsize);  // x staged by every thread of the run before anyone reads it
    }
    fetch(B + NSTAGE - 1);
    // Newer than block B's group: the NSTAGE - 1 blocks after it and the records of the chunks started since it
    // was fetched (NSTAGE = 3: one; NSTAGE = 2: this chunk's, where B starts it).
    if constexpr (NSTAGE == 3) {
      cp_async_wait<3>();
    } else {
      if (B & 1)
        cp_async_wait<1>();
      else
        cp_async_wait<2>();
    }
    const uint4* pb = pbuf + (B % NSTAGE) * BLOCK_VEC + lane;
    uint4 nib[4];
#pragma unroll
    for (int G = 0; G < 4; ++G) nib[G] = pb[32 * G];
    const uint4 hib = pb[NIB_VEC];
    block_mma<MT, T>(acc, nib, hib, xs + (B & 1) * STEP_COLS * XStage<MT>::XT, xb + (B & 1) * (STEP_COLS / 2),
                     lane);
    if (B & 1) {  // the chunk's last block: its records, landed by now
      if (nrec > 0) apply_fixups<MT, T>(L, fx, xs, rbuf, rec0, nrec, row_start, row_end, off, lane);
      rec0 = rec1;
      rec1 = nx_rec1;
      row_end = nx_row_end;
      row_start = nx_row_start;
    }
  }
  cp_async_wait<0>();  // nothing may land after the shared memory is reused below

  // Reduce: red[warp][row][token] in the (now free) shared memory; MT = 1: after it, each warp's sum of x.
  if constexpr (NT == 1)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[0][j] += acc[1][j];
  __syncthreads();
  if constexpr (MT == 1) {
#pragma unroll
    for (int o = 16; o; o >>= 1) xsum += __shfl_xor_sync(FULL, xsum, o);
    if (lane == 0) reinterpret_cast<float*>(smem)[nwarps * TILE_ROWS + warp] = xsum;
  }
  const int g = lane >> 2, t = lane & 3;
  float* red = reinterpret_cast<float*>(smem) + warp * TILE_ROWS * MT;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int tok = nt * 8 + 2 * t;
    if (tok < MT) {
      red[g * MT + tok] = acc[nt][0];
      red[(g + 8) * MT + tok] = acc[nt][2];
    }
    if (tok + 1 < MT) {
      red[g * MT + tok + 1] = acc[nt][1];
      red[(g + 8) * MT + tok + 1] = acc[nt][3];
    }
  }
#pragma unroll
  for (int m = 0; m < MT; ++m) fx[m] += __shfl_xor_sync(FULL, fx[m], 16);
  __syncwarp();
  if (lane < 16) {
#pragma unroll
    for (int m = 0; m < MT; ++m) red[lane * MT + m] += 32.f * fx[m];
  }
  __syncthreads();
  const float sc = __ldg(scale);
  float bias = 0.f;  // MT = 1: A held v5 + 48, so 48 * sum(x) over the CTA's columns (staged once) comes off
  if constexpr (MT == 1)
    for (int w = 0; w < nwarps; ++w) bias += reinterpret_cast<const float*>(smem)[nwarps * TILE_ROWS + w];
  const int outs = tpc * TILE_ROWS * MT;
  // Output i is tile tt's row r, token m: its place in y (-1 past N or M) and the CTA's partial sum of it.
  auto y_index = [&](int i) -> int64_t {
    const int tt = i / (TILE_ROWS * MT), j = i - tt * (TILE_ROWS * MT);
    const int r = j / MT, m = j - r * MT;
    const int64_t row = (int64_t)(blockIdx.x * tpc + tt) * TILE_ROWS + r;
    return row < L.n && m < mc ? (int64_t)(m0 + m) * sym + row * syn : -1;
  };
  auto partial = [&](int i) {
    const int tt = i / (TILE_ROWS * MT), j = i - tt * (TILE_ROWS * MT);
    const float* base = reinterpret_cast<const float*>(smem) + (int64_t)tt * wpt * TILE_ROWS * MT + j;
    float v = 0.f;
    for (int w = 0; w < wpt; ++w) v += base[w * TILE_ROWS * MT];
    return v - 48.f * bias;
  };
  if (gridDim.z == 1) {
    for (int i = threadIdx.x; i < outs; i += blockDim.x) {
      const int64_t yi = y_index(i);
      if (yi >= 0) y[yi] = from_f<T>(partial(i) * sc);
    }
    return;
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // Split along K: the partials to shared memory, then each CTA of the cluster adds every CTA's partials of its
  // share of the outputs, in rank order (the same sum whichever CTA writes).
  float* part = reinterpret_cast<float*>(smem) + reduce_floats<MT>(wpt, tpc) - outs;
  for (int i = threadIdx.x; i < outs; i += blockDim.x) part[i] = partial(i);
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();  // every CTA's partials written
  const int ranks = (int)cluster.num_blocks(), rank = (int)cluster.block_rank();
  for (int i = rank * blockDim.x + threadIdx.x; i < outs; i += ranks * blockDim.x) {
    const int64_t yi = y_index(i);
    if (yi < 0) continue;
    float v = 0.f;
    for (int q = 0; q < ranks; ++q) v += cluster.map_shared_rank(part, q)[i];
    y[yi] = from_f<T>(v * sc);
  }
  cluster.sync();  // no CTA leaves while another reads its shared memory
#endif
}

// -- decode ---------------------------------------------------------------------------------------

constexpr int DEC_WARPS = 8;
constexpr int DEC_ROW = STEP_COLS + 16;  // int8 staging row, padded
constexpr int DEC_WARP_BYTES = TILE_ROWS * DEC_ROW + REC_BYTES;

template <typename O>
__global__ void __launch_bounds__(DEC_WARPS * 32) decode_kernel(Layout L, O* __restrict__ out, bool ovec, int blocks,
                                                                const float* __restrict__ scale) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int blk = blockIdx.x * DEC_WARPS + warp;
  if (blk >= blocks) return;  // whole warp
  unsigned char* mine = smem + warp * DEC_WARP_BYTES;
  int8_t* qs = reinterpret_cast<int8_t*>(mine);
  uint8_t* rbuf = mine + TILE_ROWS * DEC_ROW;
  const int tile = blk / L.steps, S = blk - tile * L.steps;
  const int g = lane >> 2, t = lane & 3;
  // The block's half of a record group: its records in flight (cp.async) while the plane is decoded.
  const int64_t grp = (int64_t)tile * (L.steps / 2) + (S >> 1);
  const int fr = lane & 15;
  const uint4* b = L.planes + (int64_t)blk * BLOCK_VEC;
  uint4 nv[4];
#pragma unroll
  for (int G = 0; G < 4; ++G) nv[G] = ld_stream(b + G * 32 + lane);
  const uint4 hib = ld_stream(b + NIB_VEC + lane);
  const int64_t rec0 = __ldg(L.fx_base + grp);
  const int nrec = __ldg(L.fx_base + grp + 1) - (int)rec0;
  const int row_end = __ldg(L.fx_ends + grp * TILE_ROWS + fr);
  const int row_start = fr ? __ldg(L.fx_ends + grp * TILE_ROWS + fr - 1) : 0;
  int2 off = stage_records_async(L, rec0, min(REC_CAP, nrec), rbuf, lane);
#pragma unroll
  for (int G = 0; G < 4; ++G) {
    const uint32_t hw = word(hib, G);
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      const uint32_t nw = word(nv[G], s);
#pragma unroll
      for (int p = 0; p < 4; ++p) {  // the pair's two codes are neighbouring columns: one 2-byte store
        const uint32_t c0 = ((nw >> (4 * p)) & 15u) | (((hw >> (4 * s + p)) & 1u) << 4);
        const uint32_t c1 = ((nw >> (4 * p + 16)) & 15u) | (((hw >> (4 * s + p + 16)) & 1u) << 4);
        const int r = g + 8 * (p & 1), col = 16 * (4 * G + s) + 2 * t + 8 * (p >> 1);
        *reinterpret_cast<uint16_t*>(qs + r * DEC_ROW + col) = (uint16_t)(((c0 - 16) & 0xFFu) | ((c1 - 16) & 0xFFu) << 8);
      }
    }
  }
  for_lane_records<0>(L, rbuf, rec0, nrec, row_start, row_end, off, lane, [&](int col, uint32_t nb) {
    if ((col >> 8) != (S & 1)) return;  // the other block of the group
    int8_t* q = qs + fr * DEC_ROW + (col & 255);
    *q = (int8_t)(*q + 32 * fixup_h(nb & 7u));
  });
  __syncwarp();
  // Write: lane covers 8 columns of a row, 32 lanes a row of 256.
  const float sc = __ldg(scale);
  const int c0 = S * STEP_COLS + 8 * lane;
  for (int r = 0; r < TILE_ROWS; ++r) {
    const int row = tile * TILE_ROWS + r;
    if (row >= L.n) break;
    const uint2 raw = *reinterpret_cast<const uint2*>(qs + r * DEC_ROW + 8 * lane);
    const int8_t* q8 = reinterpret_cast<const int8_t*>(&raw);
    O* dst = out + (int64_t)row * L.k + c0;
    if (ovec && c0 + 8 <= L.k) {
      if constexpr (sizeof(O) == 4) {
        float4* p = reinterpret_cast<float4*>(dst);
        p[0] = make_float4(q8[0] * sc, q8[1] * sc, q8[2] * sc, q8[3] * sc);
        p[1] = make_float4(q8[4] * sc, q8[5] * sc, q8[6] * sc, q8[7] * sc);
      } else {
        uint4 v;
        O* o = reinterpret_cast<O*>(&v);
#pragma unroll
        for (int i = 0; i < 8; ++i) o[i] = from_f<O>((float)q8[i] * sc);
        *reinterpret_cast<uint4*>(dst) = v;
      }
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i)
        if (c0 + i < L.k) dst[i] = from_f<O>((float)q8[i] * sc);
    }
  }
}

// -- host -----------------------------------------------------------------------------------------

void check_tensor(const torch::Tensor& t, const char* name, torch::ScalarType dtype, int64_t dim,
                  const torch::Device& dev) {
  TORCH_CHECK(t.is_cuda(), "int8x planes cuda: ", name, " must be a CUDA tensor, got ", t.device());
  TORCH_CHECK(t.device() == dev, "int8x planes cuda: ", name, " is on ", t.device(), ", planes on ", dev);
  TORCH_CHECK(t.scalar_type() == dtype, "int8x planes cuda: ", name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.dim() == dim && t.is_contiguous(), "int8x planes cuda: ", name, " must be a contiguous ", dim,
              "-D tensor, got shape ", t.sizes(), " strides ", t.strides());
}

Layout make_layout(const torch::Tensor& planes, const torch::Tensor& fx_pos, const torch::Tensor& fx_h,
                   const torch::Tensor& fx_base, const torch::Tensor& fx_ends, const torch::Tensor& scale,
                   int64_t n_rows, int64_t n_cols) {
  TORCH_CHECK(n_rows > 0 && n_cols > 0 && n_rows < INT32_MAX && n_cols < INT32_MAX,
              "int8x planes cuda: n_rows and n_cols must be positive int32, got ", n_rows, ", ", n_cols);
  const auto dev = planes.device();
  check_tensor(planes, "planes", torch::kInt32, 3, dev);
  check_tensor(fx_pos, "fx_pos", torch::kUInt8, 1, dev);
  check_tensor(fx_h, "fx_h", torch::kUInt8, 1, dev);
  check_tensor(fx_base, "fx_base", torch::kInt32, 1, dev);
  check_tensor(fx_ends, "fx_ends", torch::kInt16, 1, dev);
  check_tensor(scale, "scale", torch::kFloat32, 1, dev);
  const int64_t tiles = (n_rows + TILE_ROWS - 1) / TILE_ROWS;
  const int64_t chunks = (n_cols + CHUNK_COLS - 1) / CHUNK_COLS, steps = 2 * chunks;
  TORCH_CHECK(planes.size(0) == tiles && planes.size(1) == steps && planes.size(2) == BLOCK_VEC * 4,
              "int8x planes cuda: planes must be (", tiles, ", ", steps, ", ", BLOCK_VEC * 4, ") for a (", n_rows,
              ", ", n_cols, ") weight, got ", planes.sizes());
  TORCH_CHECK(fx_base.numel() == tiles * chunks + 1, "int8x planes cuda: fx_base has ", fx_base.numel(),
              " entries, expected record groups + 1 = ", tiles * chunks + 1);
  TORCH_CHECK(fx_ends.numel() == tiles * chunks * TILE_ROWS, "int8x planes cuda: fx_ends has ", fx_ends.numel(),
              " entries, expected 16 * record groups = ", tiles * chunks * TILE_ROWS);
  TORCH_CHECK(fx_h.numel() == (fx_pos.numel() + 1) / 2, "int8x planes cuda: fx_h has ", fx_h.numel(),
              " bytes, expected ceil(records / 2) = ", (fx_pos.numel() + 1) / 2);
  TORCH_CHECK(scale.numel() == 1, "int8x planes cuda: scale must hold one number, got ", scale.numel());
  TORCH_CHECK(reinterpret_cast<uintptr_t>(fx_pos.data_ptr()) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(fx_h.data_ptr()) % 16 == 0,
              "int8x planes cuda: fx_pos and fx_h must start on a 16-byte boundary (the GEMV copies them in 16-byte "
              "vectors)");
  Layout L;
  L.planes = reinterpret_cast<const uint4*>(planes.data_ptr<int32_t>());
  L.fx_pos = fx_pos.data_ptr<uint8_t>();
  L.fx_h = fx_h.data_ptr<uint8_t>();
  L.fx_base = fx_base.data_ptr<int32_t>();
  L.fx_ends = fx_ends.data_ptr<int16_t>();
  L.n_rec = fx_pos.numel();
  L.n = (int)n_rows;
  L.k = (int)n_cols;
  L.steps = (int)steps;
  return L;
}

using parity::set_smem;

constexpr int MAX_SPLITS = 8;  // CTAs of a cluster (the portable most)

// A launch: a tile's chunks in runs of cpw whole chunks (as even as their number allows), wpt runs a CTA of a
// cluster of `splits` CTAs along K, tpc tiles per CTA.
struct LinearConfig {
  int wpt, cpw, tpc, splits;
};

// warps (the most warps per tile a CTA), tpc and splits as the host chose them (int8x_planes_cuda.default_config,
// or the caller's config).
template <int MT>
LinearConfig linear_config(int chunks, int64_t warps, int64_t tpc, int64_t splits, int ns,
                           const parity::DeviceInfo& dev) {
  LinearConfig c;
  TORCH_CHECK(warps >= 1 && warps <= MAX_CTA_WARPS, "int8x planes cuda linear: warps per tile must be 1 .. ",
              MAX_CTA_WARPS, ", got ", warps);
  TORCH_CHECK(splits >= 1 && splits <= MAX_SPLITS, "int8x planes cuda linear: splits must be 1 .. ", MAX_SPLITS,
              ", got ", splits);
  TORCH_CHECK(splits == 1 || dev.major >= 9, "int8x planes cuda linear: splits along K need compute capability 9 "
              "(clusters), the device has ", dev.major, ".", dev.minor);
  c.cpw = (int)((chunks + warps * splits - 1) / (warps * splits));
  const int runs = (chunks + c.cpw - 1) / c.cpw;
  c.wpt = (int)((runs + splits - 1) / splits);
  c.splits = (runs + c.wpt - 1) / c.wpt;
  TORCH_CHECK(tpc >= 1 && tpc <= MAX_CTA_WARPS, "int8x planes cuda linear: tiles per CTA must be 1 .. ",
              MAX_CTA_WARPS, ", got ", tpc);
  c.tpc = (int)tpc;
  TORCH_CHECK(c.wpt * c.tpc * 32 <= MAX_THREADS, "int8x planes cuda linear: ", c.wpt, " warps per tile x ", c.tpc,
              " tiles per CTA = ", c.wpt * c.tpc * 32, " threads, more than the launch bound of ", MAX_THREADS);
  TORCH_CHECK(c.tpc == 1 || c.wpt <= 15, "int8x planes cuda linear: with several tiles per CTA at most 15 warps "
              "per tile (named barriers), got ", c.wpt);
  const int64_t smem = linear_smem<MT>(c.wpt, c.tpc, ns);
  TORCH_CHECK(smem <= dev.smem_optin, "int8x planes cuda linear: ", c.wpt, " warps per tile x ", c.tpc,
              " tiles per CTA need ", smem, " bytes of shared memory, the device allows ", dev.smem_optin);
  return c;
}

// stages: blocks in flight per warp at one token (2 or 3); more tokens take 2.
template <int MT, typename T>
void launch_linear(const Layout& L, const torch::Tensor& x, bool xvec, torch::Tensor& out, int M, const float* sp,
                   cudaStream_t stream, const parity::DeviceInfo& dev, int64_t warps, int64_t tpc, int64_t stages,
                   int64_t splits) {
  TORCH_CHECK(stages == 2 || stages == 3, "int8x planes cuda linear: stages must be 2 or 3, got ", stages);
  const int ns = MT == 1 ? (int)stages : 2;
  const int64_t tiles = (L.n + TILE_ROWS - 1) / TILE_ROWS;
  const LinearConfig c = linear_config<MT>(L.steps / 2, warps, tpc, splits, ns, dev);
  const int64_t smem = linear_smem<MT>(c.wpt, c.tpc, ns);
  auto kernel = c.tpc > 1 ? linear_kernel<MT, 2, true, T> : linear_kernel<MT, 2, false, T>;
  if constexpr (MT == 1)
    if (ns == 3) kernel = c.tpc > 1 ? linear_kernel<MT, 3, true, T> : linear_kernel<MT, 3, false, T>;
  const dim3 grid((unsigned)((tiles + c.tpc - 1) / c.tpc), (unsigned)((M + 15) / 16), (unsigned)c.splits);
  // Programmatic dependent launch on compute capability 9: the call's first weight blocks load while the kernel
  // before it in the stream finishes.
  parity::launch_kernel_cluster(kernel, grid, c.splits, c.wpt * c.tpc * 32, (int)smem, dev.major >= 9, stream, L,
                        reinterpret_cast<const T*>(x.data_ptr()), x.stride(0), xvec,
                        reinterpret_cast<T*>(out.data_ptr()), out.stride(0), out.stride(1), M, c.cpw, c.tpc, sp);
}

template <typename T>
void linear_t(const Layout& L, const torch::Tensor& x, bool xvec, torch::Tensor& out, int M, const float* sp,
              cudaStream_t stream, const parity::DeviceInfo& dev, int64_t warps, int64_t tpc, int64_t stages,
              int64_t splits) {
  if (M == 1)
    launch_linear<1, T>(L, x, xvec, out, M, sp, stream, dev, warps, tpc, stages, splits);
  else if (M <= 8)
    launch_linear<8, T>(L, x, xvec, out, M, sp, stream, dev, warps, tpc, stages, splits);
  else
    launch_linear<16, T>(L, x, xvec, out, M, sp, stream, dev, warps, tpc, stages, splits);
}

void linear(torch::Tensor x, torch::Tensor planes, torch::Tensor fx_pos, torch::Tensor fx_h, torch::Tensor fx_base,
            torch::Tensor fx_ends, torch::Tensor scale, int64_t n_rows, int64_t n_cols, torch::Tensor out,
            int64_t warps, int64_t tiles_per_cta, int64_t stages, int64_t splits) {
  const Layout L = make_layout(planes, fx_pos, fx_h, fx_base, fx_ends, scale, n_rows, n_cols);
  TORCH_CHECK(x.is_cuda() && x.device() == planes.device(), "int8x planes cuda linear: x must be on ",
              planes.device(), ", got ", x.device());
  TORCH_CHECK(x.dim() == 2 && x.size(1) == n_cols, "int8x planes cuda linear: x must be (M, ", n_cols,
              "), got shape ", x.sizes());
  TORCH_CHECK(x.stride(1) == 1 || x.size(1) == 1, "int8x planes cuda linear: x must be contiguous along K, got "
              "strides ", x.strides());
  TORCH_CHECK(x.scalar_type() == torch::kFloat16 || x.scalar_type() == torch::kBFloat16,
              "int8x planes cuda linear: x must be fp16 or bf16, got ", x.scalar_type());
  TORCH_CHECK(out.is_cuda() && out.device() == planes.device() && out.scalar_type() == x.scalar_type(),
              "int8x planes cuda linear: out must be a ", x.scalar_type(), " tensor on ", planes.device(), ", got ",
              out.scalar_type(), " on ", out.device());
  TORCH_CHECK(out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) == n_rows,
              "int8x planes cuda linear: out must be (", x.size(0), ", ", n_rows, "), got shape ", out.sizes());
  TORCH_CHECK(x.size(0) <= 65535 * 16, "int8x planes cuda linear: x has ", x.size(0), " rows, at most ",
              65535 * 16, " (decode the weight and use a matmul for so many)");
  const int M = (int)x.size(0);
  if (M == 0) return;
  const c10::cuda::CUDAGuard guard(planes.device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  const parity::DeviceInfo dev = parity::device_info(planes.get_device());
  const bool xvec = reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 && (x.stride(0) * 2) % 16 == 0;
  const float* sp = scale.data_ptr<float>();
  if (x.scalar_type() == torch::kFloat16)
    linear_t<__half>(L, x, xvec, out, M, sp, stream, dev, warps, tiles_per_cta, stages, splits);
  else
    linear_t<__nv_bfloat16>(L, x, xvec, out, M, sp, stream, dev, warps, tiles_per_cta, stages, splits);
}

void decode(torch::Tensor planes, torch::Tensor fx_pos, torch::Tensor fx_h, torch::Tensor fx_base,
            torch::Tensor fx_ends, torch::Tensor scale, int64_t n_rows, int64_t n_cols, torch::Tensor out) {
  const Layout L = make_layout(planes, fx_pos, fx_h, fx_base, fx_ends, scale, n_rows, n_cols);
  TORCH_CHECK(out.is_cuda() && out.device() == planes.device(), "int8x planes cuda decode: out must be on ",
              planes.device(), ", got ", out.device());
  TORCH_CHECK(out.dim() == 2 && out.size(0) == n_rows && out.size(1) == n_cols && out.is_contiguous(),
              "int8x planes cuda decode: out must be contiguous (", n_rows, ", ", n_cols, "), got shape ",
              out.sizes(), " strides ", out.strides());
  const c10::cuda::CUDAGuard guard(planes.device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  const int blocks = (int)planes.size(0) * (int)planes.size(1);
  const bool ovec = reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0 && (n_cols * out.element_size()) % 16 == 0;
  const dim3 grid((unsigned)((blocks + DEC_WARPS - 1) / DEC_WARPS));
  const int64_t smem = (int64_t)DEC_WARPS * DEC_WARP_BYTES;
  const float* sp = scale.data_ptr<float>();
  switch (out.scalar_type()) {
    case torch::kFloat32:
      set_smem(decode_kernel<float>, smem);
      decode_kernel<float><<<grid, DEC_WARPS * 32, smem, stream>>>(L, out.data_ptr<float>(), ovec, blocks, sp);
      break;
    case torch::kFloat16:
      set_smem(decode_kernel<__half>, smem);
      decode_kernel<__half><<<grid, DEC_WARPS * 32, smem, stream>>>(
          L, reinterpret_cast<__half*>(out.data_ptr()), ovec, blocks, sp);
      break;
    case torch::kBFloat16:
      set_smem(decode_kernel<__nv_bfloat16>, smem);
      decode_kernel<__nv_bfloat16><<<grid, DEC_WARPS * 32, smem, stream>>>(
          L, reinterpret_cast<__nv_bfloat16*>(out.data_ptr()), ovec, blocks, sp);
      break;
    default:
      TORCH_CHECK(false, "int8x planes cuda decode: out must be fp32, fp16 or bf16, got ", out.scalar_type());
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &linear, "int8x planes fused decode-GEMV: out = x @ W^T", py::arg("x"), py::arg("planes"),
        py::arg("fx_pos"), py::arg("fx_h"), py::arg("fx_base"), py::arg("fx_ends"), py::arg("scale"),
        py::arg("n_rows"), py::arg("n_cols"), py::arg("out"), py::arg("warps"), py::arg("tiles_per_cta"),
        py::arg("stages"), py::arg("splits"));
  m.def("decode", &decode, "int8x planes decode into out (n_rows, n_cols)", py::arg("planes"), py::arg("fx_pos"),
        py::arg("fx_h"), py::arg("fx_base"), py::arg("fx_ends"), py::arg("scale"), py::arg("n_rows"),
        py::arg("n_cols"), py::arg("out"));
}
