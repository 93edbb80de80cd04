// The row and element-wise kernels of every DiT block (bf16 in, bf16 out, f32 math): norms with
// modulation, q/k norms with RoPE, gated residuals, a Linear's bias with its activation, SwiGLU.
// Each replaces a chain of candle ops that stored one full-size temporary per op, and computes
// what that composition computes, in the same order of operations and with the same roundings,
// so the results differ from it only where a reduction's summation order moves the last f32 bit.
//
// Families round differently, so a kernel whose arithmetic depends on it comes in two roundings,
// named by its suffix (`Rounding` below):
//   _f32   Wan's f32 block: gates and modulation are f32 and applied unrounded (the product and
//          the sum rounded once), norm scales as candle's fused ops (x / dim, rsqrtf), each
//          product of a RoPE rotation rounded on its own. Mochi's f32 RMS norms times an f32
//          row (`rms_mul`) round the same way, their residual add after the cast back to bf16.
//   _bf16  candle's bf16 composition (LTX-Video, CogVideoX, HunyuanVideo, MiniMax H3): bf16 gates
//          and modulation, each product rounded; norms as the f32 composite computes them
//          (sum * f32(1 / dim), IEEE sqrt and reciprocal); RoPE with one fma per output.
// Row kernels reduce a row with one block (any even dim) or, where dim % 8 == 0, with a group of
// 32-128 threads holding 8-element vectors (rows of up to 8192).
// GELU (in f32, rounded once as torch computes it) and the Linear bias are the same in both.
//
// Rows are tokens of [rows, dim] contiguous storage; `row0` is the index of the first row in the
// whole [batch * seq, dim] tensor (chunks start later) and `seq` the tokens per batch entry, so a
// row's batch entry is (row0 + row) / seq and its position (row0 + row) % seq. Modulation and gate
// vectors are rows `mod_stride` elements apart per batch entry (0: one row for all); a joint
// sequence (text first) takes the `_text` rows at positions below `split` (0: no text part). With
// a `rows` table (u32 per row of the whole tensor, not null), row r takes table row `rows[r]`
// instead of its batch entry's (a packed sequence whose rows carry their own timesteps: MiniMax
// H3).
//
// Kernels come in a generic version (bf16 pairs, any even dim) and, where dim % 8 == 0, a vector
// version over 8-element vectors (16-byte accesses where every pointer is 16-byte aligned, else
// scalar ones) with the same arithmetic.

#include <cuda_bf16.h>
#include <stdint.h>

namespace {

#include "activation.cuh"
#include "e4m3.cuh"

constexpr int THREADS = 256;  // threads per block of the row kernels
constexpr int MAX_PAIRS = 16; // block-per-row kernels: bf16 pairs per thread, dim <= 2 * 16 * 256
constexpr int MAX_VECS = 8;   // grouped row kernels: 8-element vectors per thread, dim <= 64 * G
// The grouped modulated norms hold fewer, so that 4 blocks of them fit an SM without spilling
// (at 8 their 120 registers left 2, and the kernel waited on latency): dim <= 32 * G.
constexpr int NORM_VECS = 4;

typedef __nv_bfloat16 bf16;
typedef __nv_bfloat162 bf162;

enum class Rounding { F32, Bf16 };

// The gate and modulation element type of a rounding.
template <Rounding R> struct Mod;
template <> struct Mod<Rounding::F32> { typedef float T; };
template <> struct Mod<Rounding::Bf16> { typedef bf16 T; };

// Sum over the block; every thread gets the total. `scratch` holds one float per warp.
__device__ __forceinline__ float block_sum(float v, float *scratch) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads(); // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < THREADS / 32 ? scratch[lane] : 0.f;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sum over each group of G consecutive threads (a row's threads); every thread of the group gets
// the same total (a xor butterfly, then the group's warp partials added in one fixed order). For
// G > 32, `scratch` (one float per warp of the block) must not be used by another call of this
// kernel invocation, and every thread of the block must call this.
template <int G, typename Op>
__device__ __forceinline__ float group_reduce(float v, float *scratch, Op op) {
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  if constexpr (G == 32) {
    return v;
  } else {
    constexpr int W = G / 32;
    const int warp = threadIdx.x / 32;
    if (threadIdx.x % 32 == 0) scratch[warp] = v;
    __syncthreads();
    const float *s = scratch + warp / W * W;
    float t = s[0];
#pragma unroll
    for (int i = 1; i < W; ++i) t = op(t, s[i]);
    return t;
  }
}
template <int G> __device__ __forceinline__ float group_sum(float v, float *scratch) {
  return group_reduce<G>(v, scratch, [](float a, float b) { return a + b; });
}
// The largest over the group (fmaxf: NaN ignored, as the quantizers take it), as group_sum.
template <int G> __device__ __forceinline__ float group_max(float v, float *scratch) {
  return group_reduce<G>(v, scratch, [](float a, float b) { return fmaxf(a, b); });
}

__device__ __forceinline__ float round_bf16(float v) {
  return __bfloat162float(__float2bfloat16_rn(v));
}

// bf16(a + b): what candle's bf16 `broadcast_add` of a Linear bias gives.
__device__ __forceinline__ float add_rounded(float a, float b) { return round_bf16(__fadd_rn(a, b)); }

// The RMS scale of a row whose squares sum to `sum_sq`: rsqrtf(sum / dim + eps) as candle's
// fused `rms_norm` (F32), or 1 / sqrt(mean + eps) as the composite computes it, from the sum
// times f32(1 / dim), `+ eps`, `sqrt` and `recip` (Bf16).
template <Rounding R>
__device__ __forceinline__ float rms_scale(float sum_sq, int dim, float inv_dim, float eps) {
  if constexpr (R == Rounding::F32) {
    return rsqrtf(sum_sq / dim + eps);
  } else {
    return __frcp_rn(__fsqrt_rn(__fadd_rn(__fmul_rn(sum_sq, inv_dim), eps)));
  }
}

// The interleaved-pair rotation of (y0, y1) by (c, s) in f32: y1 c + y0 s with one fma in both
// roundings; y0 c - y1 s with its three roundings (F32) or one fma (Bf16).
template <Rounding R>
__device__ __forceinline__ float2 rotate(float y0, float y1, float c, float s) {
  const float r1 = __fmaf_rn(y1, c, __fmul_rn(y0, s));
  if constexpr (R == Rounding::F32) {
    return make_float2(__fsub_rn(__fmul_rn(y0, c), __fmul_rn(y1, s)), r1);
  } else {
    return make_float2(__fmaf_rn(y0, c, -__fmul_rn(y1, s)), r1);
  }
}

// Element offset of column c of the modulation row of whole-tensor row r (its batch entry's, or
// `rows[r]`'s), and whether it takes the text rows.
// I is long, or int for the vector kernels (whose callers check that every index fits).
template <typename I>
__device__ __forceinline__ I mod_at(I r, int c, I seq, I split, I mod_stride, const unsigned *rows,
                                    bool *text) {
  *text = rows == nullptr && r % seq < split;
  return (rows == nullptr ? r / seq : (I)rows[r]) * mod_stride + c;
}

// bf16(bf16(n * bf16(1 + scale)) + shift) of the normalised, rounded value n at column c,
// with the text or video rows of the row's batch entry (or table row); n when `shift` is null.
__device__ __forceinline__ float modulate(float n, int c, long row0, long row, long seq,
                                          long split, long mod_stride, const bf16 *shift,
                                          const bf16 *scale, const bf16 *shift_text,
                                          const bf16 *scale_text, const unsigned *rows) {
  if (shift == nullptr) return n;
  bool text;
  const long at = mod_at(row0 + row, c, seq, split, mod_stride, rows, &text);
  const float s1 = round_bf16(__bfloat162float((text ? scale_text : scale)[at]) + 1.f);
  return __fadd_rn(round_bf16(__fmul_rn(n, s1)), __bfloat162float((text ? shift_text : shift)[at]));
}

// delta * gate: unrounded with an f32 gate, rounded with a bf16 one (the dtype it is computed in).
__device__ __forceinline__ float gated(float d, float g) { return __fmul_rn(d, g); }
__device__ __forceinline__ float gated(float d, bf16 g) {
  return round_bf16(__fmul_rn(d, __bfloat162float(g)));
}

// ---- 8-element vectors: one 16-byte access when VEC (16-byte aligned), else scalar accesses ----

__device__ __forceinline__ float2 unpack(uint32_t u) {
  bf162 h;
  memcpy(&h, &u, 4);
  return __bfloat1622float2(h);
}

__device__ __forceinline__ uint32_t pack(float lo, float hi) {
  const bf162 h = __floats2bfloat162_rn(lo, hi);
  uint32_t u;
  memcpy(&u, &h, 4);
  return u;
}

__device__ __forceinline__ uint32_t word(const uint4 &v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

__device__ __forceinline__ void set_word(uint4 &v, int i, uint32_t u) {
  if (i == 0) v.x = u;
  else if (i == 1) v.y = u;
  else if (i == 2) v.z = u;
  else v.w = u;
}

__device__ __forceinline__ uint32_t join(unsigned short lo, unsigned short hi) {
  return (uint32_t)lo | ((uint32_t)hi << 16);
}

// 8 bf16 from storage that may be written by this kernel (no read-only cache).
template <bool VEC> __device__ __forceinline__ uint4 load8(const bf16 *p) {
  if constexpr (VEC) {
    return *reinterpret_cast<const uint4 *>(p);
  } else {
    const unsigned short *s = reinterpret_cast<const unsigned short *>(p);
    return make_uint4(join(s[0], s[1]), join(s[2], s[3]), join(s[4], s[5]), join(s[6], s[7]));
  }
}

// 8 bf16 from read-only storage.
template <bool VEC> __device__ __forceinline__ uint4 load8_ro(const bf16 *p) {
  if constexpr (VEC) {
    return __ldg(reinterpret_cast<const uint4 *>(p));
  } else {
    const unsigned short *s = reinterpret_cast<const unsigned short *>(p);
    return make_uint4(join(__ldg(s), __ldg(s + 1)), join(__ldg(s + 2), __ldg(s + 3)),
                      join(__ldg(s + 4), __ldg(s + 5)), join(__ldg(s + 6), __ldg(s + 7)));
  }
}

template <bool VEC> __device__ __forceinline__ void store8(bf16 *p, const uint4 &v) {
  if constexpr (VEC) {
    *reinterpret_cast<uint4 *>(p) = v;
  } else {
    unsigned short *s = reinterpret_cast<unsigned short *>(p);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      s[2 * i] = (unsigned short)(word(v, i) & 0xffffu);
      s[2 * i + 1] = (unsigned short)(word(v, i) >> 16);
    }
  }
}

// N (4 or 8) f32 from read-only storage.
template <bool VEC, int N> __device__ __forceinline__ void load_f32(const float *p, float *v) {
#pragma unroll
  for (int i = 0; i < N; i += 4) {
    if constexpr (VEC) {
      const float4 q = __ldg(reinterpret_cast<const float4 *>(p + i));
      v[i] = q.x;
      v[i + 1] = q.y;
      v[i + 2] = q.z;
      v[i + 3] = q.w;
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) v[i + j] = __ldg(p + i + j);
    }
  }
}

// 8 gate values (f32 or bf16) from read-only storage, as f32 or bf16 for `gated`.
template <bool VEC> __device__ __forceinline__ void load_gate8(const float *p, float (&g)[8]) {
  load_f32<VEC, 8>(p, g);
}
template <bool VEC> __device__ __forceinline__ void load_gate8(const bf16 *p, bf16 (&g)[8]) {
  const uint4 v = load8_ro<VEC>(p);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    bf162 h;
    const uint32_t u = word(v, j);
    memcpy(&h, &u, 4);
    g[2 * j] = h.x;
    g[2 * j + 1] = h.y;
  }
}

__device__ __forceinline__ bool aligned16(const void *p) {
  return (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}

// The vector's elements added to `sum`, pair by pair (the row sum's order in every kernel).
__device__ __forceinline__ void add_sum(uint4 v, float &sum) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 f = unpack(word(v, j));
    sum += f.x + f.y;
  }
}

// The squares of the vector's elements less `mean` added to `sq`, pair by pair.
__device__ __forceinline__ void add_centered_sq(uint4 v, float mean, float &sq) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 f = unpack(word(v, j));
    const float c0 = __fsub_rn(f.x, mean), c1 = __fsub_rn(f.y, mean);
    sq += c0 * c0 + c1 * c1;
  }
}

// x [+ bias] of 8 elements at `at` (row offset `c`), rounded; their sum of squares added to `sq`.
template <bool ALIGNED>
__device__ __forceinline__ uint4 biased8(const bf16 *at, const bf16 *__restrict__ bias, int c,
                                         float &sq) {
  uint4 v = load8<ALIGNED>(at);
  const uint4 bb = bias != nullptr ? load8_ro<ALIGNED>(bias + c) : make_uint4(0, 0, 0, 0);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    float2 f = unpack(word(v, j));
    if (bias != nullptr) {
      const float2 g = unpack(word(bb, j));
      f.x = add_rounded(f.x, g.x);
      f.y = add_rounded(f.y, g.y);
      set_word(v, j, pack(f.x, f.y)); // exact: f is bf16-rounded
    }
    sq += f.x * f.x + f.y * f.y;
  }
  return v;
}

// One vector of LayerNorm + f32 modulation: (v - mean) / std * w + b per element, rounded once.
__device__ __forceinline__ uint4 layer_norm_vec(uint4 v, float mean, float std, const float (&wv)[8],
                                                const float (&bv)[8]) {
  uint4 o;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 f = unpack(word(v, j));
    const float c0 = __fsub_rn(f.x, mean), c1 = __fsub_rn(f.y, mean);
    const float y0 = __fadd_rn(__fmul_rn(__fdiv_rn(c0, std), wv[2 * j]), bv[2 * j]);
    const float y1 = __fadd_rn(__fmul_rn(__fdiv_rn(c1, std), wv[2 * j + 1]), bv[2 * j + 1]);
    set_word(o, j, pack(y0, y1));
  }
  return o;
}

// One vector of RMSNorm (scale * v * w, rounded as candle's rms_norm), then, when `rope`, the
// rotation of its 4 pairs by (cj, sj) in the rounding R, rounded.
template <Rounding R>
__device__ __forceinline__ uint4 rms_rope_vec(uint4 v, uint4 wv, float scale, bool rope,
                                              const float (&cj)[4], const float (&sj)[4]) {
  uint4 o;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 f = unpack(word(v, j));
    const float2 g = unpack(word(wv, j));
    float y0 = round_bf16(__fmul_rn(__fmul_rn(scale, f.x), g.x));
    float y1 = round_bf16(__fmul_rn(__fmul_rn(scale, f.y), g.y));
    if (rope) {
      const float2 r = rotate<R>(y0, y1, cj[j], sj[j]);
      y0 = r.x;
      y1 = r.y;
    }
    set_word(o, j, pack(y0, y1));
  }
  return o;
}

// ---- grouped row kernels (F32 rounding): G threads per row, THREADS / G rows per block, each
// thread holding up to MAX_VECS 8-element vectors of its row (vector k of the row at thread
// k % G) ----

// `CODES`: the rows as an fp8 Linear's input instead (`out` unused): each output row, rounded to
// bf16 as the bf16 rows are stored, becomes e4m3 codes in `q` [rows, dim] with its scale in
// `q_scale` [rows] (e4m3.cuh), the bytes the quantizer makes of the stored bf16 rows; the bf16
// rows are never stored.
template <int G, bool CODES = false>
__device__ __forceinline__ void layer_norm_rows(const bf16 *__restrict__ x, bf16 *__restrict__ out,
                                                const float *__restrict__ w,
                                                const float *__restrict__ b, int rows, int dim,
                                                int row0, int seq, int wb_stride, float eps,
                                                float *s_mean, float *s_var,
                                                uint8_t *__restrict__ q = nullptr,
                                                float *__restrict__ q_scale = nullptr,
                                                float *s_max = nullptr) {
  const int lane = threadIdx.x % G;
  const int row = blockIdx.x * (THREADS / G) + threadIdx.x / G;
  const bool active = row < rows;
  if (G == 32 && !active) return; // no barrier in a warp's reduction
  const int vecs = dim / 8;
  const long base = (long)row * dim;
  uint4 v[MAX_VECS];
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < MAX_VECS; ++i) {
    const int k = lane + i * G;
    if (active && k < vecs) {
      v[i] = load8_ro<true>(x + base + 8 * k);
      add_sum(v[i], sum);
    }
  }
  const float mean = group_sum<G>(sum, s_mean) / dim;
  float sq = 0.f;
#pragma unroll
  for (int i = 0; i < MAX_VECS; ++i) {
    const int k = lane + i * G;
    if (active && k < vecs) add_centered_sq(v[i], mean, sq);
  }
  const float std = sqrtf(group_sum<G>(sq, s_var) / dim + eps);
  const long batch = (row0 + row) / seq;
  const float *wr = w + batch * wb_stride;
  const float *br = b + batch * wb_stride;
  if constexpr (CODES) {
    // The outputs held while the row's absmax is found (every thread of the block reduces).
    float m = 0.f;
#pragma unroll
    for (int i = 0; i < MAX_VECS; ++i) {
      const int k = lane + i * G;
      if (active && k < vecs) {
        float wv[8], bv[8];
        load_f32<true, 8>(wr + 8 * k, wv);
        load_f32<true, 8>(br + 8 * k, bv);
        v[i] = layer_norm_vec(v[i], mean, std, wv, bv);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float2 f = unpack(word(v[i], j));
          m = fmaxf(m, fmaxf(fabsf(f.x), fabsf(f.y)));
        }
      }
    }
    const float s = row_scale(group_max<G>(m, s_max)), inv = inverse(s);
    if (!active) return;
    if (lane == 0) q_scale[row] = s;
#pragma unroll
    for (int i = 0; i < MAX_VECS; ++i) {
      const int k = lane + i * G;
      if (k < vecs) {
        float f[8];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float2 p = unpack(word(v[i], j));
          f[2 * j] = p.x;
          f[2 * j + 1] = p.y;
        }
        store_codes(q + base + 8 * k, f, inv, s == 0.f);
      }
    }
  } else {
    if (!active) return;
#pragma unroll
    for (int i = 0; i < MAX_VECS; ++i) {
      const int k = lane + i * G;
      if (k < vecs) {
        float wv[8], bv[8];
        load_f32<true, 8>(wr + 8 * k, wv);
        load_f32<true, 8>(br + 8 * k, bv);
        store8<true>(out + base + 8 * k, layer_norm_vec(v[i], mean, std, wv, bv));
      }
    }
  }
}

template <Rounding R, int G>
__device__ __forceinline__ void rms_rope_rows(bf16 *x, const bf16 *__restrict__ bias,
                                              const bf16 *__restrict__ w,
                                              const float *__restrict__ cos,
                                              const float *__restrict__ sin, int rows, int dim,
                                              int head_dim, int row0, int seq, float inv_dim,
                                              float eps, float *s_sq) {
  const int lane = threadIdx.x % G;
  const int row = blockIdx.x * (THREADS / G) + threadIdx.x / G;
  const bool active = row < rows;
  if (G == 32 && !active) return;
  const int vecs = dim / 8;
  const long base = (long)row * dim;
  // x + bias, rounded to bf16 (so held exactly as bf16).
  uint4 v[MAX_VECS];
  float sq = 0.f;
#pragma unroll
  for (int i = 0; i < MAX_VECS; ++i) {
    const int k = lane + i * G;
    if (active && k < vecs) {
      v[i] = biased8<true>(x + base + 8 * k, bias, 8 * k, sq);
    }
  }
  const float scale = rms_scale<R>(group_sum<G>(sq, s_sq), dim, inv_dim, eps);
  if (!active) return;
  const int pos = (row0 + row) % seq;
  const int half = head_dim / 2;
#pragma unroll
  for (int i = 0; i < MAX_VECS; ++i) {
    const int k = lane + i * G;
    if (k < vecs) {
      const uint4 wv = load8_ro<true>(w + 8 * k);
      float cj[4], sj[4];
      if (cos != nullptr) {
        // head_dim % 8 == 0: the vector's 4 pairs are consecutive pairs of one head.
        const long j = (long)pos * half + (8 * k) % head_dim / 2;
        load_f32<true, 4>(cos + j, cj);
        load_f32<true, 4>(sin + j, sj);
      }
      store8<true>(x + base + 8 * k, rms_rope_vec<R>(v[i], wv, scale, cos != nullptr, cj, sj));
    }
  }
}

// The same rows through scalar accesses (a pointer not 16-byte aligned): nothing held in
// registers, each pass reads the row again (the same values), so the arithmetic is unchanged.
template <int G>
__device__ __forceinline__ void layer_norm_rows_scalar(const bf16 *__restrict__ x,
                                                       bf16 *__restrict__ out,
                                                       const float *__restrict__ w,
                                                       const float *__restrict__ b, int rows,
                                                       int dim, int row0, int seq, int wb_stride,
                                                       float eps, float *s_mean, float *s_var) {
  const int lane = threadIdx.x % G;
  const int row = blockIdx.x * (THREADS / G) + threadIdx.x / G;
  const bool active = row < rows;
  if (G == 32 && !active) return;
  const int vecs = active ? dim / 8 : 0;
  const long base = (long)row * dim;
  float sum = 0.f;
#pragma unroll 1
  for (int k = lane; k < vecs; k += G) {
    add_sum(load8_ro<false>(x + base + 8 * k), sum);
  }
  const float mean = group_sum<G>(sum, s_mean) / dim;
  float sq = 0.f;
#pragma unroll 1
  for (int k = lane; k < vecs; k += G) {
    add_centered_sq(load8_ro<false>(x + base + 8 * k), mean, sq);
  }
  const float std = sqrtf(group_sum<G>(sq, s_var) / dim + eps);
  if (!active) return;
  const long batch = (row0 + row) / seq;
  const float *wr = w + batch * wb_stride;
  const float *br = b + batch * wb_stride;
#pragma unroll 1
  for (int k = lane; k < vecs; k += G) {
    const uint4 v = load8_ro<false>(x + base + 8 * k);
    float wv[8], bv[8];
    load_f32<false, 8>(wr + 8 * k, wv);
    load_f32<false, 8>(br + 8 * k, bv);
    store8<false>(out + base + 8 * k, layer_norm_vec(v, mean, std, wv, bv));
  }
}

template <Rounding R, int G>
__device__ __forceinline__ void rms_rope_rows_scalar(bf16 *x, const bf16 *__restrict__ bias,
                                                     const bf16 *__restrict__ w,
                                                     const float *__restrict__ cos,
                                                     const float *__restrict__ sin, int rows,
                                                     int dim, int head_dim, int row0, int seq,
                                                     float inv_dim, float eps, float *s_sq) {
  const int lane = threadIdx.x % G;
  const int row = blockIdx.x * (THREADS / G) + threadIdx.x / G;
  const bool active = row < rows;
  if (G == 32 && !active) return;
  const int vecs = active ? dim / 8 : 0;
  const long base = (long)row * dim;
  float sq = 0.f;
#pragma unroll 1
  for (int k = lane; k < vecs; k += G) biased8<false>(x + base + 8 * k, bias, 8 * k, sq);
  const float scale = rms_scale<R>(group_sum<G>(sq, s_sq), dim, inv_dim, eps);
  if (!active) return;
  const int pos = (row0 + row) % seq;
  const int half = head_dim / 2;
#pragma unroll 1
  for (int k = lane; k < vecs; k += G) {
    float unused = 0.f;
    const uint4 v = biased8<false>(x + base + 8 * k, bias, 8 * k, unused);
    const uint4 wv = load8_ro<false>(w + 8 * k);
    float cj[4], sj[4];
    if (cos != nullptr) {
      const long j = (long)pos * half + (8 * k) % head_dim / 2;
      load_f32<false, 4>(cos + j, cj);
      load_f32<false, 4>(sin + j, sj);
    }
    store8<false>(x + base + 8 * k, rms_rope_vec<R>(v, wv, scale, cos != nullptr, cj, sj));
  }
}

// out = a norm of x, rounded, then the bf16 modulation, over rows of `dim` (dim % 8 == 0), G
// threads per row: the vector version of `layer_norm_mod_bf16` (`rms` 0) and `rms_mod_bf16`
// (`rms` 1), element by element the same arithmetic; only the reductions' summation order
// differs (up to NORM_VECS vectors of 8 per thread, then the group's butterfly). The modulation
// row is found once per row. VEC: 16-byte accesses (every pointer aligned, `mod_stride` % 8 ==
// 0), else scalar ones. 32-bit indices: row0 + rows, seq, split and every modulation offset fit.
template <int G, bool VEC>
__device__ __forceinline__ void norm_mod_rows(
    const bf16 *__restrict__ x, bf16 *__restrict__ out, const bf16 *__restrict__ w,
    const bf16 *__restrict__ b, const bf16 *shift, const bf16 *scale, const bf16 *shift_text,
    const bf16 *scale_text, const unsigned *table_rows, int rows, int dim, int row0, int seq,
    int split, int mod_stride, int rms, int two_pass, float inv_dim, float eps, float *s_a,
    float *s_b) {
  const int lane = threadIdx.x % G;
  const int row = blockIdx.x * (THREADS / G) + threadIdx.x / G;
  const bool active = row < rows;
  if (G == 32 && !active) return; // no barrier in a warp's reduction
  const int vecs = dim / 8;
  const long base = (long)row * dim;
  uint4 v[NORM_VECS];
  float sum = 0.f, sq = 0.f;
#pragma unroll
  for (int i = 0; i < NORM_VECS; ++i) {
    const int k = lane + i * G;
    if (active && k < vecs) {
      v[i] = load8<VEC>(x + base + 8 * k);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 f = unpack(word(v[i], j));
        sum += f.x + f.y;
        sq += f.x * f.x + f.y * f.y;
      }
    }
  }
  // The block kernels' statistics: see `layer_norm_mod_block` and `rms_mod_bf16`.
  float mean = 0.f, inv = 0.f, std = 0.f;
  if (rms) {
    inv = rms_scale<Rounding::Bf16>(group_sum<G>(sq, s_a), dim, inv_dim, eps);
  } else if (two_pass) {
    mean = __fmul_rn(group_sum<G>(sum, s_a), inv_dim);
    float sq_c = 0.f;
#pragma unroll
    for (int i = 0; i < NORM_VECS; ++i) {
      const int k = lane + i * G;
      if (active && k < vecs) add_centered_sq(v[i], mean, sq_c);
    }
    std = __fsqrt_rn(__fadd_rn(__fmul_rn(group_sum<G>(sq_c, s_b), inv_dim), eps));
  } else {
    mean = group_sum<G>(sum, s_a) / dim;
    const float var = group_sum<G>(sq, s_b) / dim - mean * mean;
    inv = rsqrtf(var + eps);
  }
  if (!active) return;
  const int r = row0 + row;
  const bool text = table_rows == nullptr && r % seq < split;
  const int mod_row = (table_rows == nullptr ? r / seq : (int)table_rows[r]) * mod_stride;
  const bf16 *shift_r = shift == nullptr ? nullptr : (text ? shift_text : shift) + mod_row;
  const bf16 *scale_r = shift == nullptr ? nullptr : (text ? scale_text : scale) + mod_row;
#pragma unroll
  for (int i = 0; i < NORM_VECS; ++i) {
    const int k = lane + i * G;
    if (k < vecs) {
      const int c = 8 * k;
      const uint4 wv = w != nullptr ? load8_ro<VEC>(w + c) : make_uint4(0, 0, 0, 0);
      const uint4 bv = b != nullptr ? load8_ro<VEC>(b + c) : make_uint4(0, 0, 0, 0);
      const uint4 shv = shift_r != nullptr ? load8_ro<VEC>(shift_r + c) : make_uint4(0, 0, 0, 0);
      const uint4 scv = shift_r != nullptr ? load8_ro<VEC>(scale_r + c) : make_uint4(0, 0, 0, 0);
      uint4 o;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 f = unpack(word(v[i], j));
        const float2 wf = unpack(word(wv, j)), bf = unpack(word(bv, j));
        const float2 sh = unpack(word(shv, j)), sc = unpack(word(scv, j));
        float y[2] = {f.x, f.y};
        const float wk[2] = {wf.x, wf.y}, bk[2] = {bf.x, bf.y};
        const float shk[2] = {sh.x, sh.y}, sck[2] = {sc.x, sc.y};
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          if (rms) {
            y[e] = __fmul_rn(y[e], inv);
            if (w != nullptr) y[e] = __fmul_rn(y[e], wk[e]);
          } else {
            if (two_pass) {
              y[e] = __fdiv_rn(y[e] - mean, std);
            } else {
              y[e] = (y[e] - mean) * inv;
            }
            if (w != nullptr) y[e] = y[e] * wk[e] + bk[e];
          }
          y[e] = round_bf16(y[e]);
          if (shift_r != nullptr) {
            const float s1 = round_bf16(sck[e] + 1.f);
            y[e] = __fadd_rn(round_bf16(__fmul_rn(y[e], s1)), shk[e]);
          }
        }
        set_word(o, j, pack(y[0], y[1]));
      }
      store8<VEC>(out + base + c, o);
    }
  }
}

// out = bf16(RMSNorm(x) * w), or with `res` bf16(res + bf16(RMSNorm(x) * w)), over rows of `dim`,
// G threads per row: candle's fused f32 `rms_norm` without a weight (x * rsqrtf(sum(x^2) / dim +
// eps)), times the f32 row of w of the row's batch entry (`w_stride` 0: one row for all), rounded
// once (`rms_norm` on an f32 copy, an f32 `broadcast_mul`, a cast back), then the bf16 residual
// add. `out` may be `x` (a row's group reads all of it before writing), not `res`. VEC: 16-byte
// accesses (every pointer aligned), else scalar ones, with the same arithmetic.
template <int G, bool VEC>
__device__ __forceinline__ void rms_mul_rows(const bf16 *x, const bf16 *__restrict__ res,
                                               bf16 *out, const float *__restrict__ w, long rows,
                                               int dim, long row0, long seq, long w_stride,
                                               float eps, float *s_sq) {
  const int lane = threadIdx.x % G;
  const long row = blockIdx.x * (long)(THREADS / G) + threadIdx.x / G;
  const bool active = row < rows;
  if (G == 32 && !active) return; // no barrier in a warp's reduction
  const int vecs = dim / 8;
  const long base = row * dim;
  uint4 v[MAX_VECS];
  float sq = 0.f;
#pragma unroll
  for (int i = 0; i < MAX_VECS; ++i) {
    const int k = lane + i * G;
    if (active && k < vecs) v[i] = biased8<VEC>(x + base + 8 * k, nullptr, 8 * k, sq);
  }
  const float scale = rsqrtf(group_sum<G>(sq, s_sq) / dim + eps);
  if (!active) return;
  const float *wr = w + (row0 + row) / seq * w_stride;
#pragma unroll
  for (int i = 0; i < MAX_VECS; ++i) {
    const int k = lane + i * G;
    if (k < vecs) {
      float wv[8];
      load_f32<VEC, 8>(wr + 8 * k, wv);
      const uint4 r = res != nullptr ? load8_ro<VEC>(res + base + 8 * k) : make_uint4(0, 0, 0, 0);
      uint4 o;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 f = unpack(word(v[i], j));
        float y0 = __fmul_rn(__fmul_rn(scale, f.x), wv[2 * j]);
        float y1 = __fmul_rn(__fmul_rn(scale, f.y), wv[2 * j + 1]);
        if (res != nullptr) {
          const float2 rr = unpack(word(r, j));
          y0 = __fadd_rn(rr.x, round_bf16(y0));
          y1 = __fadd_rn(rr.y, round_bf16(y1));
        }
        set_word(o, j, pack(y0, y1));
      }
      store8<VEC>(out + base + 8 * k, o);
    }
  }
}

// ---- block-per-row kernels: one block of THREADS per row, any even dim <= 2 * MAX_PAIRS *
// THREADS ----

// In place on x [rows, dim]: x = bf16(x + bias) when `bias` is not null (a Linear's bias), then
// RMSNorm over the whole row (all heads) with weight w, rounded; then, when `cos` is not null,
// the interleaved-pair RoPE of each head (cos/sin [seq, head_dim / 2] f32), rounded.
template <Rounding R>
__device__ __forceinline__ void rms_rope_block(bf16 *x, const bf16 *__restrict__ bias,
                                               const bf16 *__restrict__ w,
                                               const float *__restrict__ cos,
                                               const float *__restrict__ sin, int dim,
                                               int head_dim, long row0, long seq, float inv_dim,
                                               float eps) {
  __shared__ float scratch[THREADS / 32];
  const long row = blockIdx.x;
  bf162 *xr = reinterpret_cast<bf162 *>(x + row * dim);
  const int pairs = dim / 2;
  float2 v[MAX_PAIRS];
  float sq = 0.f;
#pragma unroll
  for (int i = 0; i < MAX_PAIRS; ++i) {
    const int p = threadIdx.x + i * THREADS;
    if (p < pairs) {
      v[i] = __bfloat1622float2(xr[p]);
      if (bias != nullptr) {
        v[i].x = add_rounded(v[i].x, __bfloat162float(bias[2 * p]));
        v[i].y = add_rounded(v[i].y, __bfloat162float(bias[2 * p + 1]));
      }
      sq += v[i].x * v[i].x + v[i].y * v[i].y;
    }
  }
  const float scale = rms_scale<R>(block_sum(sq, scratch), dim, inv_dim, eps);
  const long pos = (row0 + row) % seq;
  const int half = head_dim / 2;
#pragma unroll
  for (int i = 0; i < MAX_PAIRS; ++i) {
    const int p = threadIdx.x + i * THREADS;
    if (p < pairs) {
      const int c = 2 * p;
      float y0 = round_bf16(__fmul_rn(__fmul_rn(scale, v[i].x), __bfloat162float(w[c])));
      float y1 = round_bf16(__fmul_rn(__fmul_rn(scale, v[i].y), __bfloat162float(w[c + 1])));
      if (cos != nullptr) {
        const long j = pos * half + (c % head_dim) / 2;
        const float2 r = rotate<R>(y0, y1, cos[j], sin[j]);
        y0 = r.x;
        y1 = r.y;
      }
      xr[p] = __floats2bfloat162_rn(y0, y1);
    }
  }
}

// out = LayerNorm(x) then the rounding's modulation, over rows of `dim`:
// - F32: no affine, two-pass (mean = sum / dim, then the mean of the centred squares), y =
//   (x - mean) / sqrt(var + eps), then y * scale + shift with f32 `scale` (the caller's 1 +
//   scale) and `shift`, rounded once: `layer_norm_f32` then broadcast_mul/add in f32.
// - Bf16: with `two_pass` 0 as candle's fused `layer_norm(x, w, b)` computes it (one pass: mean
//   and E[x^2] - mean^2, rsqrtf, `(x - mean) * inv * w + b`), with 1 as the f32 composition
//   without affine does (each mean a sum times f32(1/dim); `(x - mean) / sqrt(var + eps)`);
//   rounded, then bf16(bf16(n * bf16(1 + scale)) + shift) when `shift` is not null.
template <Rounding R>
__device__ __forceinline__ void layer_norm_mod_block(
    const bf16 *__restrict__ x, bf16 *__restrict__ out, const bf16 *__restrict__ w,
    const bf16 *__restrict__ b, const typename Mod<R>::T *shift,
    const typename Mod<R>::T *scale, const typename Mod<R>::T *shift_text,
    const typename Mod<R>::T *scale_text, const unsigned *rows, int dim, long row0, long seq,
    long split, long mod_stride, int two_pass, float inv_dim, float eps) {
  __shared__ float scratch[THREADS / 32];
  const long row = blockIdx.x;
  const bf162 *xr = reinterpret_cast<const bf162 *>(x + row * dim);
  const int pairs = dim / 2;
  float2 v[MAX_PAIRS];
  float sum = 0.f, sq = 0.f;
#pragma unroll
  for (int i = 0; i < MAX_PAIRS; ++i) {
    const int p = threadIdx.x + i * THREADS;
    if (p < pairs) {
      v[i] = __bfloat1622float2(xr[p]);
      sum += v[i].x + v[i].y;
      if constexpr (R == Rounding::Bf16) sq += v[i].x * v[i].x + v[i].y * v[i].y;
    }
  }
  float mean, inv_std = 0.f, std = 0.f;
  if (R == Rounding::F32 || two_pass) {
    mean = R == Rounding::F32 ? block_sum(sum, scratch) / dim
                              : __fmul_rn(block_sum(sum, scratch), inv_dim);
    float sq_c = 0.f;
#pragma unroll
    for (int i = 0; i < MAX_PAIRS; ++i) {
      const int p = threadIdx.x + i * THREADS;
      if (p < pairs) {
        const float a = __fsub_rn(v[i].x, mean), c = __fsub_rn(v[i].y, mean);
        if constexpr (R == Rounding::F32) v[i] = make_float2(a, c);
        sq_c += a * a + c * c;
      }
    }
    std = R == Rounding::F32 ? sqrtf(block_sum(sq_c, scratch) / dim + eps)
                             : __fsqrt_rn(__fadd_rn(__fmul_rn(block_sum(sq_c, scratch), inv_dim), eps));
  } else {
    mean = block_sum(sum, scratch) / dim;
    const float var = block_sum(sq, scratch) / dim - mean * mean;
    inv_std = rsqrtf(var + eps);
  }
  bf162 *outr = reinterpret_cast<bf162 *>(out + row * dim);
  const long mod_row = (row0 + row) / seq * mod_stride; // F32: the batch entry's modulation
#pragma unroll
  for (int i = 0; i < MAX_PAIRS; ++i) {
    const int p = threadIdx.x + i * THREADS;
    if (p < pairs) {
      const int c = 2 * p;
      float y[2] = {v[i].x, v[i].y}; // F32: centred
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        if constexpr (R == Rounding::F32) {
          const long at = mod_row + c + k;
          y[k] = __fadd_rn(__fmul_rn(__fdiv_rn(y[k], std), scale[at]), shift[at]);
        } else {
          if (two_pass) {
            y[k] = __fdiv_rn(y[k] - mean, std);
          } else {
            y[k] = (y[k] - mean) * inv_std;
          }
          if (w != nullptr) y[k] = y[k] * __bfloat162float(w[c + k]) + __bfloat162float(b[c + k]);
          y[k] = modulate(round_bf16(y[k]), c + k, row0, row, seq, split, mod_stride, shift, scale,
                          shift_text, scale_text, rows);
        }
      }
      outr[p] = __floats2bfloat162_rn(y[0], y[1]);
    }
  }
}

// ---- element-wise kernels ----

// out = bf16(res + gated(bf16(delta [+ bias]), gate)) over n elements of rows of `dim`; `bias`
// and `gate` (with the text and row-table rules of the modulation) may be null. `out` may be
// `res` or `delta` (each element is read before it is written).
template <typename G>
__device__ __forceinline__ void residual_pairs(const bf16 *res, const bf16 *delta,
                                               const bf16 *__restrict__ bias, const G *gate,
                                               const G *gate_text, const unsigned *rows,
                                               bf16 *out, long n, int dim, long row0, long seq,
                                               long split, long gate_stride) {
  const long pairs = n / 2;
  for (long p = blockIdx.x * (long)blockDim.x + threadIdx.x; p < pairs;
       p += (long)gridDim.x * blockDim.x) {
    const long i = 2 * p;
    const int c = (int)(i % dim);
    const float2 r = __bfloat1622float2(reinterpret_cast<const bf162 *>(res)[p]);
    float2 d = __bfloat1622float2(reinterpret_cast<const bf162 *>(delta)[p]);
    if (bias != nullptr) {
      d.x = add_rounded(d.x, __bfloat162float(bias[c]));
      d.y = add_rounded(d.y, __bfloat162float(bias[c + 1]));
    }
    if (gate != nullptr) {
      bool text;
      const long at = mod_at(row0 + i / dim, c, seq, split, gate_stride, rows, &text);
      const G *g = text ? gate_text : gate;
      d.x = gated(d.x, g[at]);
      d.y = gated(d.y, g[at + 1]);
    }
    reinterpret_cast<bf162 *>(out)[p] =
        __floats2bfloat162_rn(__fadd_rn(r.x, d.x), __fadd_rn(r.y, d.y));
  }
}

// The same over `vecs` = n / 8 vectors (dim % 8 == 0: a vector lies in one row).
// 32-bit indices: n < 2^31, row0 + rows < 2^31, every gate offset < 2^31.
template <bool VEC, typename G>
__device__ __forceinline__ void residual_vecs(const bf16 *res, const bf16 *delta,
                                              const bf16 *__restrict__ bias, const G *gate,
                                              const G *gate_text, const unsigned *rows, bf16 *out,
                                              int vecs, int dim, int row0, int seq, int split,
                                              int gate_stride) {
  const int per_row = dim / 8;
  for (int p = blockIdx.x * blockDim.x + threadIdx.x; p < vecs; p += gridDim.x * blockDim.x) {
    const int row = p / per_row;
    const int c = 8 * (p - row * per_row);
    const uint4 r = load8<VEC>(res + 8 * p);
    const uint4 d = load8<VEC>(delta + 8 * p);
    float dv[8];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 f = unpack(word(d, j));
      dv[2 * j] = f.x;
      dv[2 * j + 1] = f.y;
    }
    if (bias != nullptr) {
      const uint4 bb = load8_ro<VEC>(bias + c);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 g = unpack(word(bb, j));
        dv[2 * j] = add_rounded(dv[2 * j], g.x);
        dv[2 * j + 1] = add_rounded(dv[2 * j + 1], g.y);
      }
    }
    if (gate != nullptr) {
      bool text;
      const int at = mod_at(row0 + row, c, seq, split, gate_stride, rows, &text);
      G g[8];
      load_gate8<VEC>((text ? gate_text : gate) + at, g);
#pragma unroll
      for (int j = 0; j < 8; ++j) dv[j] = gated(dv[j], g[j]);
    }
    uint4 o;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 f = unpack(word(r, j));
      set_word(o, j, pack(__fadd_rn(f.x, dv[2 * j]), __fadd_rn(f.y, dv[2 * j + 1])));
    }
    store8<VEC>(out + 8 * p, o);
  }
}

// 32-bit indices: n < 2^31.
template <bool VEC>
__device__ __forceinline__ void bias_act_vecs(bf16 *x, const bf16 *__restrict__ bias, int vecs,
                                              int dim, int act) {
  const int per_row = dim / 8;
  for (int p = blockIdx.x * blockDim.x + threadIdx.x; p < vecs; p += gridDim.x * blockDim.x) {
    const int c = 8 * (p % per_row);
    const uint4 v = load8<VEC>(x + 8 * p);
    const uint4 bb = load8_ro<VEC>(bias + c);
    uint4 o;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 f = unpack(word(v, j));
      const float2 g = unpack(word(bb, j));
      set_word(o, j, pack(activate(add_rounded(f.x, g.x), act), activate(add_rounded(f.y, g.y), act)));
    }
    store8<VEC>(x + 8 * p, o);
  }
}

} // namespace

// ---- q/k bias + RMSNorm across heads + RoPE ----

extern "C" __global__ void rms_rope_f32(bf16 *x, const bf16 *__restrict__ bias,
                                        const bf16 *__restrict__ w, const float *__restrict__ cos,
                                        const float *__restrict__ sin, int dim, int head_dim,
                                        long row0, long seq, float inv_dim, float eps) {
  rms_rope_block<Rounding::F32>(x, bias, w, cos, sin, dim, head_dim, row0, seq, inv_dim, eps);
}

extern "C" __global__ void rms_rope_bf16(bf16 *x, const bf16 *__restrict__ bias,
                                         const bf16 *__restrict__ w, const float *__restrict__ cos,
                                         const float *__restrict__ sin, int dim, int head_dim,
                                         long row0, long seq, float inv_dim, float eps) {
  rms_rope_block<Rounding::Bf16>(x, bias, w, cos, sin, dim, head_dim, row0, seq, inv_dim, eps);
}

// Grouped version in both roundings: dim % 8 == 0, dim <= 8 * MAX_VECS * G, and with RoPE
// head_dim % 8 == 0; blocks of THREADS threads, THREADS / G rows each (`rows` rows in all).
#define RMS_ROPE_GROUPED(G, R, SUFFIX)                                                            \
  extern "C" __global__ void __launch_bounds__(THREADS, 4) rms_rope_g##G##_##SUFFIX(             \
      bf16 *x, const bf16 *__restrict__ bias, const bf16 *__restrict__ w,                        \
      const float *__restrict__ cos, const float *__restrict__ sin, int rows, int dim,           \
      int head_dim, int row0, int seq, float inv_dim, float eps) {                               \
    __shared__ float s_sq[THREADS / 32];                                                         \
    if (aligned16(x) && aligned16(bias) && aligned16(w) && aligned16(cos) && aligned16(sin))     \
      rms_rope_rows<R, G>(x, bias, w, cos, sin, rows, dim, head_dim, row0, seq, inv_dim, eps,    \
                          s_sq);                                                                 \
    else                                                                                         \
      rms_rope_rows_scalar<R, G>(x, bias, w, cos, sin, rows, dim, head_dim, row0, seq, inv_dim,  \
                                 eps, s_sq);                                                     \
  }
RMS_ROPE_GROUPED(32, Rounding::F32, f32)
RMS_ROPE_GROUPED(64, Rounding::F32, f32)
RMS_ROPE_GROUPED(128, Rounding::F32, f32)
RMS_ROPE_GROUPED(32, Rounding::Bf16, bf16)
RMS_ROPE_GROUPED(64, Rounding::Bf16, bf16)
RMS_ROPE_GROUPED(128, Rounding::Bf16, bf16)

// ---- norms with modulation ----

extern "C" __global__ void layer_norm_mod_f32(const bf16 *__restrict__ x, bf16 *__restrict__ out,
                                              const float *shift, const float *scale, int dim,
                                              long row0, long seq, long mod_stride, float eps) {
  layer_norm_mod_block<Rounding::F32>(x, out, nullptr, nullptr, shift, scale, shift, scale, nullptr,
                                      dim, row0, seq, 0, mod_stride, 1, 0.f, eps);
}

extern "C" __global__ void layer_norm_mod_bf16(
    const bf16 *__restrict__ x, bf16 *__restrict__ out, const bf16 *__restrict__ w,
    const bf16 *__restrict__ b, const bf16 *shift, const bf16 *scale, const bf16 *shift_text,
    const bf16 *scale_text, const unsigned *rows, int dim, long row0, long seq, long split,
    long mod_stride, int two_pass, float inv_dim, float eps) {
  layer_norm_mod_block<Rounding::Bf16>(x, out, w, b, shift, scale, shift_text, scale_text, rows,
                                       dim, row0, seq, split, mod_stride, two_pass, inv_dim, eps);
}

// Grouped vector version of `layer_norm_mod_bf16` (`rms` 0) and `rms_mod_bf16` (`rms` 1; `b`
// null): dim % 8 == 0, dim <= 8 * NORM_VECS * G; blocks of THREADS threads, THREADS / G rows each.
// `_unaligned`: scalar accesses, for any pointer not 16-byte aligned or `mod_stride` % 8 != 0
// (the launch picks it: one path per kernel keeps the registers of the 16-byte one).
#define NORM_MOD_GROUPED(G, VEC, NAME)                                                           \
  extern "C" __global__ void __launch_bounds__(THREADS, 4) NAME(                                 \
      const bf16 *__restrict__ x, bf16 *__restrict__ out, const bf16 *__restrict__ w,            \
      const bf16 *__restrict__ b, const bf16 *shift, const bf16 *scale, const bf16 *shift_text,  \
      const bf16 *scale_text, const unsigned *table_rows, int rows, int dim, int row0, int seq,  \
      int split, int mod_stride, int rms, int two_pass, float inv_dim, float eps) {              \
    __shared__ float s_a[THREADS / 32], s_b[THREADS / 32];                                       \
    norm_mod_rows<G, VEC>(x, out, w, b, shift, scale, shift_text, scale_text, table_rows, rows,  \
                          dim, row0, seq, split, mod_stride, rms, two_pass, inv_dim, eps, s_a,   \
                          s_b);                                                                  \
  }
NORM_MOD_GROUPED(32, true, norm_mod_g32_bf16)
NORM_MOD_GROUPED(64, true, norm_mod_g64_bf16)
NORM_MOD_GROUPED(128, true, norm_mod_g128_bf16)
NORM_MOD_GROUPED(256, true, norm_mod_g256_bf16)
NORM_MOD_GROUPED(32, false, norm_mod_g32_unaligned_bf16)
NORM_MOD_GROUPED(64, false, norm_mod_g64_unaligned_bf16)
NORM_MOD_GROUPED(128, false, norm_mod_g128_unaligned_bf16)
NORM_MOD_GROUPED(256, false, norm_mod_g256_unaligned_bf16)

// Grouped F32 version of `layer_norm_mod_f32` (the same arithmetic): dim % 8 == 0, dim <= 8 *
// MAX_VECS * G; blocks of THREADS threads, THREADS / G rows each (`rows` rows in all). Capped at
// 64 registers (4 blocks per SM): ptxas then keeps a few scale/shift values in local memory
// (L1), which measured faster on an H200 than 80 registers and 3 blocks per SM (the kernel is
// bound by latency more than by bytes).
#define LAYER_NORM_GROUPED(G)                                                                    \
  extern "C" __global__ void __launch_bounds__(THREADS, 4) layer_norm_mod_g##G##_f32(            \
      const bf16 *__restrict__ x, bf16 *__restrict__ out, const float *__restrict__ shift,       \
      const float *__restrict__ scale, int rows, int dim, int row0, int seq, int mod_stride,     \
      float eps) {                                                                               \
    __shared__ float s_mean[THREADS / 32], s_var[THREADS / 32];                                  \
    if (aligned16(x) && aligned16(out) && aligned16(scale) && aligned16(shift))                  \
      layer_norm_rows<G>(x, out, scale, shift, rows, dim, row0, seq, mod_stride, eps, s_mean,    \
                         s_var);                                                                 \
    else                                                                                         \
      layer_norm_rows_scalar<G>(x, out, scale, shift, rows, dim, row0, seq, mod_stride, eps,     \
                                s_mean, s_var);                                                  \
  }
LAYER_NORM_GROUPED(32)
LAYER_NORM_GROUPED(64)
LAYER_NORM_GROUPED(128)

// LAYER_NORM_GROUPED's rows as an fp8 Linear's input (layer_norm_rows<G, true>): e4m3 codes `q`
// [rows, dim] and their scales [rows]. Every pointer 16-byte aligned, dim % 16 == 0 (the caller
// checks).
#define LAYER_NORM_CODES_GROUPED(G)                                                              \
  extern "C" __global__ void __launch_bounds__(THREADS, 4) layer_norm_mod_codes_g##G##_f32(      \
      const bf16 *__restrict__ x, uint8_t *__restrict__ q, float *__restrict__ q_scale,          \
      const float *__restrict__ shift, const float *__restrict__ scale, int rows, int dim,       \
      int row0, int seq, int mod_stride, float eps) {                                            \
    __shared__ float s_mean[THREADS / 32], s_var[THREADS / 32], s_max[THREADS / 32];             \
    layer_norm_rows<G, true>(x, nullptr, scale, shift, rows, dim, row0, seq, mod_stride, eps,    \
                             s_mean, s_var, q, q_scale, s_max);                                  \
  }
LAYER_NORM_CODES_GROUPED(32)
LAYER_NORM_CODES_GROUPED(64)
LAYER_NORM_CODES_GROUPED(128)

// `rms_mul_rows`: dim % 8 == 0, dim <= 8 * MAX_VECS * G; blocks of THREADS threads, THREADS / G
// rows each (`rows` rows in all).
#define RMS_MUL_GROUPED(G)                                                                       \
  extern "C" __global__ void __launch_bounds__(THREADS, 4) rms_mul_g##G##_f32(                   \
      const bf16 *x, const bf16 *__restrict__ res, bf16 *out, const float *__restrict__ w,       \
      long rows, int dim, long row0, long seq, long w_stride, float eps) {                       \
    __shared__ float s_sq[THREADS / 32];                                                         \
    if (aligned16(x) && aligned16(res) && aligned16(out) && aligned16(w) && w_stride % 4 == 0)   \
      rms_mul_rows<G, true>(x, res, out, w, rows, dim, row0, seq, w_stride, eps, s_sq);          \
    else                                                                                         \
      rms_mul_rows<G, false>(x, res, out, w, rows, dim, row0, seq, w_stride, eps, s_sq);         \
  }
RMS_MUL_GROUPED(32)
RMS_MUL_GROUPED(64)
RMS_MUL_GROUPED(128)

// out = RMSNorm(x) [* w] then, when `scale` is not null, bf16(bf16(n * bf16(1 + scale)) + shift):
// the composite `rms_norm` (f32: x * recip(sqrt(mean(x^2) + eps)) [* w], rounded) followed by
// the bf16 `x * (1 + scale) + shift` modulation.
extern "C" __global__ void rms_mod_bf16(const bf16 *__restrict__ x, bf16 *__restrict__ out,
                                        const bf16 *__restrict__ w, const bf16 *shift,
                                        const bf16 *scale, const bf16 *shift_text,
                                        const bf16 *scale_text, const unsigned *rows, int dim,
                                        long row0, long seq, long split, long mod_stride,
                                        float inv_dim, float eps) {
  __shared__ float scratch[THREADS / 32];
  const long row = blockIdx.x;
  const bf162 *xr = reinterpret_cast<const bf162 *>(x + row * dim);
  const int pairs = dim / 2;
  float2 v[MAX_PAIRS];
  float sq = 0.f;
#pragma unroll
  for (int i = 0; i < MAX_PAIRS; ++i) {
    const int p = threadIdx.x + i * THREADS;
    if (p < pairs) {
      v[i] = __bfloat1622float2(xr[p]);
      sq += v[i].x * v[i].x + v[i].y * v[i].y;
    }
  }
  const float inv = rms_scale<Rounding::Bf16>(block_sum(sq, scratch), dim, inv_dim, eps);
  bf162 *outr = reinterpret_cast<bf162 *>(out + row * dim);
#pragma unroll
  for (int i = 0; i < MAX_PAIRS; ++i) {
    const int p = threadIdx.x + i * THREADS;
    if (p < pairs) {
      const int c = 2 * p;
      float y[2] = {__fmul_rn(v[i].x, inv), __fmul_rn(v[i].y, inv)};
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        if (w != nullptr) y[k] = __fmul_rn(y[k], __bfloat162float(w[c + k]));
        y[k] = modulate(round_bf16(y[k]), c + k, row0, row, seq, split, mod_stride, shift, scale,
                        shift_text, scale_text, rows);
      }
      outr[p] = __floats2bfloat162_rn(y[0], y[1]);
    }
  }
}

// In place on x [rows, heads * head_dim], one warp per (row, head): x = bf16(x + bias) when
// `bias` is not null (a Linear's bias), then per head candle's fused `layer_norm` with w, b
// ([head_dim]) or, with `rms`, its fused `rms_norm` with w (rsqrtf(mean + eps) * x * w),
// rounded; then at positions in [rope_start, rope_end), when `cos` is not null, the
// interleaved-pair RoPE (cos/sin [rope_end - rope_start, head_dim / 2] f32, math in f32 as
// `rope_i`), rounded; or, with `rotary` > 0, the rotate-half RoPE of candle's `rope` on the
// leading `rotary` channels of each head (cos/sin [.., rotary / 2]; the rest pass through).
// head_dim <= 2 * 32 * MAX_HEAD_PAIRS.
extern "C" __global__ void head_norm_rope_bf16(bf16 *x, const bf16 *__restrict__ bias,
                                               const bf16 *__restrict__ w,
                                               const bf16 *__restrict__ b,
                                               const float *__restrict__ cos,
                                               const float *__restrict__ sin, long units, int dim,
                                               int head_dim, long row0, long seq, int rms,
                                               long rope_start, long rope_end, int rotary,
                                               float eps) {
  constexpr int MAX_HEAD_PAIRS = 4;
  constexpr int WARPS = THREADS / 32;
  // Rotate-half pairs channel e with e ± rotary / 2, held by another lane: the normalised head
  // goes through shared memory.
  __shared__ float normed[WARPS][2 * 32 * MAX_HEAD_PAIRS];
  const long unit = blockIdx.x * (long)(blockDim.x / 32) + threadIdx.x / 32;
  if (unit >= units) return; // whole warps leave together
  const int lane = threadIdx.x % 32;
  const int heads = dim / head_dim;
  const long row = unit / heads;
  const int c0 = (int)(unit % heads) * head_dim;
  bf162 *xr = reinterpret_cast<bf162 *>(x + row * dim + c0);
  const bf162 *biasr = bias == nullptr ? nullptr : reinterpret_cast<const bf162 *>(bias + c0);
  const int pairs = head_dim / 2;
  float2 v[MAX_HEAD_PAIRS];
  float sum = 0.f, sq = 0.f;
#pragma unroll
  for (int i = 0; i < MAX_HEAD_PAIRS; ++i) {
    const int p = lane + 32 * i;
    if (p < pairs) {
      v[i] = __bfloat1622float2(xr[p]);
      if (biasr != nullptr) {
        const float2 bb = __bfloat1622float2(biasr[p]);
        v[i].x = round_bf16(v[i].x + bb.x);
        v[i].y = round_bf16(v[i].y + bb.y);
      }
      sum += v[i].x + v[i].y;
      sq += v[i].x * v[i].x + v[i].y * v[i].y;
    }
  }
  for (int o = 16; o > 0; o >>= 1) {
    sum += __shfl_xor_sync(0xffffffffu, sum, o);
    sq += __shfl_xor_sync(0xffffffffu, sq, o);
  }
  const float mean = rms ? 0.f : sum / head_dim;
  const float inv_std = rms ? rsqrtf(sq / head_dim + eps) : rsqrtf(sq / head_dim - mean * mean + eps);
  const long pos = (row0 + row) % seq;
  const bool rotate_pairs = cos != nullptr && pos >= rope_start && pos < rope_end;
  const int half = head_dim / 2;
#pragma unroll
  for (int i = 0; i < MAX_HEAD_PAIRS; ++i) {
    const int p = lane + 32 * i;
    if (p < pairs) {
      const int c = 2 * p;
      float y0, y1;
      if (rms) {
        y0 = round_bf16(inv_std * v[i].x * __bfloat162float(w[c]));
        y1 = round_bf16(inv_std * v[i].y * __bfloat162float(w[c + 1]));
      } else {
        y0 = round_bf16((v[i].x - mean) * inv_std * __bfloat162float(w[c]) +
                        __bfloat162float(b[c]));
        y1 = round_bf16((v[i].y - mean) * inv_std * __bfloat162float(w[c + 1]) +
                        __bfloat162float(b[c + 1]));
      }
      if (rotate_pairs && rotary == 0) {
        const long j = (pos - rope_start) * half + p;
        const float2 r = rotate<Rounding::Bf16>(y0, y1, cos[j], sin[j]);
        y0 = r.x;
        y1 = r.y;
      }
      if (rotary > 0) {
        normed[threadIdx.x / 32][c] = y0;
        normed[threadIdx.x / 32][c + 1] = y1;
      } else {
        xr[p] = __floats2bfloat162_rn(y0, y1);
      }
    }
  }
  if (rotary == 0) return;
  __syncwarp();
  const float *y = normed[threadIdx.x / 32];
  const int rhalf = rotary / 2;
#pragma unroll
  for (int i = 0; i < MAX_HEAD_PAIRS; ++i) {
    const int p = lane + 32 * i;
    if (p < pairs) {
      float r[2];
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        const int e = 2 * p + k;
        r[k] = y[e];
        if (rotate_pairs && e < rotary) {
          const long j = (pos - rope_start) * rhalf + e % rhalf;
          r[k] = e < rhalf ? y[e] * cos[j] - y[e + rhalf] * sin[j]
                           : y[e - rhalf] * sin[j] + y[e] * cos[j];
        }
      }
      xr[p] = __floats2bfloat162_rn(r[0], r[1]);
    }
  }
}

// ---- gated residual ----

#define RESIDUAL(NAME, G)                                                                        \
  extern "C" __global__ void residual_##NAME(                                                    \
      const bf16 *res, const bf16 *delta, const bf16 *__restrict__ bias, const G *gate,          \
      const G *gate_text, const unsigned *rows, bf16 *out, long n, int dim, long row0, long seq, \
      long split, long gate_stride) {                                                            \
    residual_pairs(res, delta, bias, gate, gate_text, rows, out, n, dim, row0, seq, split,       \
                   gate_stride);                                                                 \
  }                                                                                              \
  extern "C" __global__ void residual_v8_##NAME(                                                 \
      const bf16 *res, const bf16 *delta, const bf16 *__restrict__ bias, const G *gate,          \
      const G *gate_text, const unsigned *rows, bf16 *out, int n, int dim, int row0, int seq,    \
      int split, int gate_stride) {                                                              \
    if (aligned16(res) && aligned16(delta) && aligned16(bias) && aligned16(gate) &&              \
        aligned16(gate_text) && aligned16(out) && gate_stride % 8 == 0)                          \
      residual_vecs<true>(res, delta, bias, gate, gate_text, rows, out, n / 8, dim, row0, seq,   \
                          split, gate_stride);                                                   \
    else                                                                                         \
      residual_vecs<false>(res, delta, bias, gate, gate_text, rows, out, n / 8, dim, row0, seq,  \
                           split, gate_stride);                                                  \
  }
RESIDUAL(f32, float)
RESIDUAL(bf16, bf16)

// ---- Linear bias + activation, SwiGLU ----

// In place on x [rows, dim]: x = bf16(x + bias) (a Linear's bias, as candle adds it), then `act`
// 1: GELU (tanh), 2: exact GELU, both in f32 and rounded once, 0: nothing.
extern "C" __global__ void bias_act(bf16 *x, const bf16 *__restrict__ bias, long n, int dim,
                                    int act) {
  const long pairs = n / 2;
  for (long p = blockIdx.x * (long)blockDim.x + threadIdx.x; p < pairs;
       p += (long)gridDim.x * blockDim.x) {
    const int c = (int)((2 * p) % dim);
    const float2 f = __bfloat1622float2(reinterpret_cast<bf162 *>(x)[p]);
    reinterpret_cast<bf162 *>(x)[p] =
        __floats2bfloat162_rn(activate(add_rounded(f.x, __bfloat162float(bias[c])), act),
                              activate(add_rounded(f.y, __bfloat162float(bias[c + 1])), act));
  }
}

// Vector version: dim % 8 == 0, n / 8 vectors, n < 2^31.
extern "C" __global__ void bias_act_v8(bf16 *x, const bf16 *__restrict__ bias, int n, int dim,
                                       int act) {
  if (aligned16(x) && aligned16(bias))
    bias_act_vecs<true>(x, bias, n / 8, dim, act);
  else
    bias_act_vecs<false>(x, bias, n / 8, dim, act);
}

// In place on x [rows, heads * head_dim]: each head split in sections of 2 * half channels, each
// rotated by half, x * cos + [-x2 | x1] * sin with cos and sin [seq, head_dim] f32 rows at the
// row's position (row0 + row) % seq, in f32 with each product and the sum rounded on their own and
// the result once (torch's `(x.float() * cos + rotated.float() * sin).to(bf16)`: Allegro's rotary
// embedding, a section per axis). One thread per rotated pair; pairs = rows * dim / 2.
extern "C" __global__ void rope_sections_bf16(bf16 *x, const float *__restrict__ cos,
                                              const float *__restrict__ sin, long pairs, int dim,
                                              int head_dim, int half, long row0, long seq) {
  const int row_pairs = dim / 2;
  for (long p = blockIdx.x * (long)blockDim.x + threadIdx.x; p < pairs;
       p += (long)gridDim.x * blockDim.x) {
    const long row = p / row_pairs;
    const int q = (int)(p % row_pairs);
    const int c = (q / half) * 2 * half + q % half; // the pair's first channel in the row
    const int hc = c % head_dim;                     // and in its head
    const long at = ((row0 + row) % seq) * head_dim;
    bf16 *r = x + row * dim;
    const float a = __bfloat162float(r[c]), b = __bfloat162float(r[c + half]);
    r[c] = __float2bfloat16_rn(__fadd_rn(__fmul_rn(a, cos[at + hc]), __fmul_rn(-b, sin[at + hc])));
    r[c + half] = __float2bfloat16_rn(
        __fadd_rn(__fmul_rn(b, cos[at + hc + half]), __fmul_rn(a, sin[at + hc + half])));
  }
}

// out [rows, inner] = bf16(value * bf16(silu(gate))) of h [rows, 2 * inner] = [value | gate]
// (diffusers' SwiGLU feed-forward, value first): SiLU in f32 and rounded once, as torch's bf16
// `silu` computes it, then the rounded product.
extern "C" __global__ void swiglu_bf16(const bf16 *__restrict__ h, bf16 *__restrict__ out, long n,
                                       int inner) {
  const long pairs = n / 2;
  for (long p = blockIdx.x * (long)blockDim.x + threadIdx.x; p < pairs;
       p += (long)gridDim.x * blockDim.x) {
    const long i = 2 * p, row = i / inner;
    const int c = (int)(i % inner);
    const bf162 *hr = reinterpret_cast<const bf162 *>(h + row * 2 * inner);
    const float2 v = __bfloat1622float2(hr[c / 2]);
    const float2 g = __bfloat1622float2(hr[(inner + c) / 2]);
    const float s0 = round_bf16(g.x / (1.f + expf(-g.x)));
    const float s1 = round_bf16(g.y / (1.f + expf(-g.y)));
    reinterpret_cast<bf162 *>(out)[p] = __floats2bfloat162_rn(v.x * s0, v.y * s1);
  }
}

// ---- an f32 residual stream beside bf16 layers (MiniMax H3's video decoder) ----

// Row blockIdx.x of x [rows, dim] f32: bf16(x * rsqrtf(sum(x^2) / dim + eps) * w), w f32 [dim]:
// candle's fused f32 `rms_norm`, then the cast to bf16 (torch's `RMSNorm(x.float()).to(bf16)`),
// in one pass. One block per row.
extern "C" __global__ void rms_norm_f32_to_bf16(const float *__restrict__ x,
                                                const float *__restrict__ w,
                                                bf16 *__restrict__ out, int dim, float eps) {
  __shared__ float scratch[THREADS / 32];
  const long base = (long)blockIdx.x * dim;
  float sq = 0.f;
  for (int c = threadIdx.x; c < dim; c += THREADS) {
    const float v = x[base + c];
    sq += v * v;
  }
  const float inv = rms_scale<Rounding::F32>(block_sum(sq, scratch), dim, 0.f, eps);
  for (int c = threadIdx.x; c < dim; c += THREADS)
    out[base + c] = __float2bfloat16_rn(__fmul_rn(__fmul_rn(x[base + c], inv), w[c]));
}

// In place on x [n / dim, dim] f32: x + f32(delta) * scale[c], delta bf16, scale f32 [dim]; the
// product and the sum each rounded to f32 (torch's `x + delta * scale`, the product promoted).
extern "C" __global__ void residual_scaled_f32(float *x, const bf16 *__restrict__ delta,
                                               const float *__restrict__ scale, int n, int dim) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    x[i] = __fadd_rn(x[i], __fmul_rn(__bfloat162float(delta[i]), scale[i % dim]));
}
