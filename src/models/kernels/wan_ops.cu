// Fused element-wise and row-wise kernels of the Wan DiT block (bf16 in, bf16 out, f32 math), so
// that no f32 copy of a [tokens, dim] tensor is ever stored. Each computes what the candle
// composition in `transformer.rs` computes, in the same order of operations, so the results
// differ from it only where a reduction's summation order moves the last f32 bit.
//
// Rows are tokens of [rows, dim] contiguous storage; `row0` is the index of the first row in the
// whole [batch * seq, dim] tensor (chunks start later) and `seq` the tokens per batch entry, so a
// row's batch entry is (row0 + row) / seq and its position (row0 + row) % seq.

#include <cuda_bf16.h>
#include <stdint.h>

namespace {

constexpr int THREADS = 256;  // threads per block of the row kernels
constexpr int MAX_PAIRS = 16; // generic row kernels: bf16 pairs per thread, dim <= 2 * 16 * 256
constexpr int MAX_VECS = 8;   // grouped row kernels: 8-element vectors per thread, dim <= 64 * G

typedef __nv_bfloat16 bf16;
typedef __nv_bfloat162 bf162;

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
template <int G> __device__ __forceinline__ float group_sum(float v, float *scratch) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
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
    for (int i = 1; i < W; ++i) t += s[i];
    return t;
  }
}

// bf16(a + b): what candle's bf16 `broadcast_add` of a Linear bias gives.
__device__ __forceinline__ float add_rounded(float a, float b) {
  return __bfloat162float(__float2bfloat16_rn(__fadd_rn(a, b)));
}

// The interleaved-pair rotation of (y0, y1) by (c, s), in f32 with the roundings the first
// version of this kernel compiled to: y0 c - y1 s with three roundings, y1 c + y0 s with one fma.
__device__ __forceinline__ float2 rotate(float y0, float y1, float c, float s) {
  return make_float2(__fsub_rn(__fmul_rn(y0, c), __fmul_rn(y1, s)),
                     __fmaf_rn(y1, c, __fmul_rn(y0, s)));
}

// 0.5 v (1 + tanh(sqrt(2 / pi) (v + 0.044715 v^3))) in f32, in the order of operations (and the
// one fma) the first version of this kernel compiled to.
__device__ __forceinline__ float gelu_tanh(float v) {
  const float k = 0.7978845608028654f; // sqrt(2 / pi)
  const float inner = __fmaf_rn(v, __fmul_rn(v, __fmul_rn(v, 0.044715f)), v);
  return __fmul_rn(__fmul_rn(v, 0.5f), __fadd_rn(tanhf(__fmul_rn(inner, k)), 1.f));
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

// One vector of LayerNorm + modulation: (v - mean) / std * w + b per element, rounded once.
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
// rotation of its 4 pairs by (cj, sj), rounded.
__device__ __forceinline__ uint4 rms_rope_vec(uint4 v, uint4 wv, float scale, bool rope,
                                              const float (&cj)[4], const float (&sj)[4]) {
  uint4 o;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 f = unpack(word(v, j));
    const float2 g = unpack(word(wv, j));
    float y0 = __bfloat162float(__float2bfloat16_rn(__fmul_rn(__fmul_rn(scale, f.x), g.x)));
    float y1 = __bfloat162float(__float2bfloat16_rn(__fmul_rn(__fmul_rn(scale, f.y), g.y)));
    if (rope) {
      const float2 r = rotate(y0, y1, cj[j], sj[j]);
      y0 = r.x;
      y1 = r.y;
    }
    set_word(o, j, pack(y0, y1));
  }
  return o;
}

// ---- grouped row kernels: G threads per row, THREADS / G rows per block, each thread holding
// up to MAX_VECS 8-element vectors of its row (vector k of the row at thread k % G) ----

template <int G>
__device__ __forceinline__ void layer_norm_rows(const bf16 *__restrict__ x, bf16 *__restrict__ out,
                                                const float *__restrict__ w,
                                                const float *__restrict__ b, int rows, int dim,
                                                int row0, int seq, int wb_stride, float eps,
                                                float *s_mean, float *s_var) {
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
  if (!active) return;
  const long batch = (row0 + row) / seq;
  const float *wr = w + batch * wb_stride;
  const float *br = b + batch * wb_stride;
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

template <int G>
__device__ __forceinline__ void rms_rope_rows(bf16 *x, const bf16 *__restrict__ bias,
                                              const bf16 *__restrict__ w,
                                              const float *__restrict__ cos,
                                              const float *__restrict__ sin, int rows, int dim,
                                              int head_dim, int row0, int seq, float eps,
                                              float *s_sq) {
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
  const float scale = rsqrtf(group_sum<G>(sq, s_sq) / dim + eps);
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
      store8<true>(x + base + 8 * k, rms_rope_vec(v[i], wv, scale, cos != nullptr, cj, sj));
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


template <int G>
__device__ __forceinline__ void rms_rope_rows_scalar(bf16 *x, const bf16 *__restrict__ bias,
                                                     const bf16 *__restrict__ w,
                                                     const float *__restrict__ cos,
                                                     const float *__restrict__ sin, int rows,
                                                     int dim, int head_dim, int row0, int seq,
                                                     float eps, float *s_sq) {
  const int lane = threadIdx.x % G;
  const int row = blockIdx.x * (THREADS / G) + threadIdx.x / G;
  const bool active = row < rows;
  if (G == 32 && !active) return;
  const int vecs = active ? dim / 8 : 0;
  const long base = (long)row * dim;
  float sq = 0.f;
#pragma unroll 1
  for (int k = lane; k < vecs; k += G) biased8<false>(x + base + 8 * k, bias, 8 * k, sq);
  const float scale = rsqrtf(group_sum<G>(sq, s_sq) / dim + eps);
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
    store8<false>(x + base + 8 * k, rms_rope_vec(v, wv, scale, cos != nullptr, cj, sj));
  }
}

// ---- element-wise kernels over 8-element vectors (dim % 8 == 0: a vector lies in one row) ----

template <bool VEC>
__device__ __forceinline__ void residual_vecs(const bf16 *res, const bf16 *delta,
                                              const bf16 *__restrict__ bias,
                                              const float *__restrict__ gate, bf16 *out,
                                              int vecs, int dim, int row0, int seq) {
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
      float g[8];
      load_f32<VEC, 8>(gate + (row0 + row) / seq * dim + c, g);
#pragma unroll
      for (int j = 0; j < 8; ++j) dv[j] = __fmul_rn(dv[j], g[j]);
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

template <bool VEC>
__device__ __forceinline__ void bias_act_vecs(bf16 *x, const bf16 *__restrict__ bias, int vecs,
                                              int dim, int gelu) {
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
      float y0 = add_rounded(f.x, g.x);
      float y1 = add_rounded(f.y, g.y);
      if (gelu) {
        y0 = gelu_tanh(y0);
        y1 = gelu_tanh(y1);
      }
      set_word(o, j, pack(y0, y1));
    }
    store8<VEC>(x + 8 * p, o);
  }
}

} // namespace

// ---- LayerNorm with modulation ----

// out = LayerNorm(x) * w[batch] + b[batch] (no affine of its own, two-pass mean and variance,
// y = (x - mean) / sqrt(var + eps)), as `layer_norm_f32` then broadcast_mul/add. `wb_stride` is
// the distance between batch entries of w and b (0: one row shared by all).
// Generic version: one block of THREADS per row, any even dim <= 2 * MAX_PAIRS * THREADS.
extern "C" __global__ void wan_layer_norm_bf16(const bf16 *__restrict__ x, bf16 *__restrict__ out,
                                               const float *__restrict__ w,
                                               const float *__restrict__ b, int dim, long row0,
                                               long seq, long wb_stride, float eps) {
  __shared__ float scratch[THREADS / 32];
  const long row = blockIdx.x;
  const bf162 *xr = reinterpret_cast<const bf162 *>(x + row * dim);
  const long batch = (row0 + row) / seq;
  const float *wr = w + batch * wb_stride;
  const float *br = b + batch * wb_stride;
  const int pairs = dim / 2;
  float2 v[MAX_PAIRS];
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < MAX_PAIRS; ++i) {
    const int p = threadIdx.x + i * THREADS;
    if (p < pairs) {
      v[i] = __bfloat1622float2(xr[p]);
      sum += v[i].x + v[i].y;
    }
  }
  const float mean = block_sum(sum, scratch) / dim;
  float sq = 0.f;
#pragma unroll
  for (int i = 0; i < MAX_PAIRS; ++i) {
    const int p = threadIdx.x + i * THREADS;
    if (p < pairs) {
      v[i].x = __fsub_rn(v[i].x, mean);
      v[i].y = __fsub_rn(v[i].y, mean);
      sq += v[i].x * v[i].x + v[i].y * v[i].y;
    }
  }
  const float std = sqrtf(block_sum(sq, scratch) / dim + eps);
  bf162 *outr = reinterpret_cast<bf162 *>(out + row * dim);
#pragma unroll
  for (int i = 0; i < MAX_PAIRS; ++i) {
    const int p = threadIdx.x + i * THREADS;
    if (p < pairs) {
      const int c = 2 * p;
      const float y0 = __fadd_rn(__fmul_rn(__fdiv_rn(v[i].x, std), wr[c]), br[c]);
      const float y1 = __fadd_rn(__fmul_rn(__fdiv_rn(v[i].y, std), wr[c + 1]), br[c + 1]);
      outr[p] = __floats2bfloat162_rn(y0, y1);
    }
  }
}

// Grouped version (the same arithmetic): dim % 8 == 0, dim <= 8 * MAX_VECS * G; blocks of
// THREADS threads, THREADS / G rows each (`rows` rows in all); 16-byte accesses where x, out, w
// and b are 16-byte aligned, else scalar ones. Capped at 64 registers (4 blocks per SM): ptxas
// then keeps a few w/b values in local memory (L1), which measured faster on an H200 than 80
// registers and 3 blocks per SM (the kernel is bound by latency more than by bytes).
#define WAN_LAYER_NORM_GROUPED(G)                                                                \
  extern "C" __global__ void __launch_bounds__(THREADS, 4) wan_layer_norm_g##G##_bf16(           \
      const bf16 *__restrict__ x, bf16 *__restrict__ out, const float *__restrict__ w,           \
      const float *__restrict__ b, int rows, int dim, int row0, int seq, int wb_stride,          \
      float eps) {                                                                               \
    __shared__ float s_mean[THREADS / 32], s_var[THREADS / 32];                                  \
    if (aligned16(x) && aligned16(out) && aligned16(w) && aligned16(b))                          \
      layer_norm_rows<G>(x, out, w, b, rows, dim, row0, seq, wb_stride, eps, s_mean,       \
                               s_var);                                                           \
    else                                                                                         \
      layer_norm_rows_scalar<G>(x, out, w, b, rows, dim, row0, seq, wb_stride, eps, s_mean,      \
                                s_var);                                                          \
  }
WAN_LAYER_NORM_GROUPED(32)
WAN_LAYER_NORM_GROUPED(64)
WAN_LAYER_NORM_GROUPED(128)

// ---- gated residual ----

// out = res + (delta [+ bias]) [* gate[batch]] element-wise over n elements of rows of `dim`;
// `bias` (bf16, rounded after the add like a Linear's) and `gate` (f32 [batch, dim]) may be null.
// `out` may be `res` or `delta` (each element is read before it is written).
// Generic version: bf16 pairs, any even dim.
extern "C" __global__ void wan_residual_bf16(const bf16 *res, const bf16 *delta,
                                             const bf16 *__restrict__ bias,
                                             const float *__restrict__ gate, bf16 *out, long n,
                                             int dim, long row0, long seq) {
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
      const float *g = gate + ((row0 + i / dim) / seq) * dim;
      d.x = __fmul_rn(d.x, g[c]);
      d.y = __fmul_rn(d.y, g[c + 1]);
    }
    reinterpret_cast<bf162 *>(out)[p] =
        __floats2bfloat162_rn(__fadd_rn(r.x, d.x), __fadd_rn(r.y, d.y));
  }
}

// Vector version (the same arithmetic): dim % 8 == 0, `vecs` = n / 8 vectors of 8 elements,
// grid-stride, 32-bit indices (n < 2^31, row0 + rows < 2^31); 16-byte accesses where every
// pointer is 16-byte aligned, else scalar ones.
extern "C" __global__ void wan_residual_v8_bf16(const bf16 *res, const bf16 *delta,
                                                const bf16 *__restrict__ bias,
                                                const float *__restrict__ gate, bf16 *out,
                                                int vecs, int dim, int row0, int seq) {
  if (aligned16(res) && aligned16(delta) && aligned16(bias) && aligned16(gate) && aligned16(out))
    residual_vecs<true>(res, delta, bias, gate, out, vecs, dim, row0, seq);
  else
    residual_vecs<false>(res, delta, bias, gate, out, vecs, dim, row0, seq);
}

// ---- q/k bias + RMSNorm across heads + RoPE ----

// In place on x [rows, dim]: x = x [+ bias] (rounded), then RMSNorm over the whole row (all
// heads) with weight w, rounded as candle's rms_norm rounds; then, when `cos` is not null, the
// interleaved-pair RoPE of each head (cos/sin [seq, head_dim / 2] f32, math in f32), rounded.
// Generic version: one block of THREADS per row, any even dim <= 2 * MAX_PAIRS * THREADS.
extern "C" __global__ void wan_rms_rope_bf16(bf16 *x, const bf16 *__restrict__ bias,
                                             const bf16 *__restrict__ w,
                                             const float *__restrict__ cos,
                                             const float *__restrict__ sin, int dim, int head_dim,
                                             long row0, long seq, float eps) {
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
  const float scale = rsqrtf(block_sum(sq, scratch) / dim + eps);
  const long pos = (row0 + row) % seq;
  const int half = head_dim / 2;
#pragma unroll
  for (int i = 0; i < MAX_PAIRS; ++i) {
    const int p = threadIdx.x + i * THREADS;
    if (p < pairs) {
      const int c = 2 * p;
      float y0 = __bfloat162float(
          __float2bfloat16_rn(__fmul_rn(__fmul_rn(scale, v[i].x), __bfloat162float(w[c]))));
      float y1 = __bfloat162float(
          __float2bfloat16_rn(__fmul_rn(__fmul_rn(scale, v[i].y), __bfloat162float(w[c + 1]))));
      if (cos != nullptr) {
        const long j = pos * half + (c % head_dim) / 2;
        const float2 r = rotate(y0, y1, cos[j], sin[j]);
        y0 = r.x;
        y1 = r.y;
      }
      xr[p] = __floats2bfloat162_rn(y0, y1);
    }
  }
}

// Grouped version (the same arithmetic): dim % 8 == 0, dim <= 8 * MAX_VECS * G, and with RoPE
// head_dim % 8 == 0; blocks of THREADS threads, THREADS / G rows each (`rows` rows in all);
// 16-byte accesses where every pointer is 16-byte aligned, else scalar ones.
#define WAN_RMS_ROPE_GROUPED(G)                                                                  \
  extern "C" __global__ void __launch_bounds__(THREADS, 4) wan_rms_rope_g##G##_bf16(             \
      bf16 *x, const bf16 *__restrict__ bias, const bf16 *__restrict__ w,                        \
      const float *__restrict__ cos, const float *__restrict__ sin, int rows, int dim,           \
      int head_dim, int row0, int seq, float eps) {                                              \
    __shared__ float s_sq[THREADS / 32];                                                         \
    if (aligned16(x) && aligned16(bias) && aligned16(w) && aligned16(cos) && aligned16(sin))     \
      rms_rope_rows<G>(x, bias, w, cos, sin, rows, dim, head_dim, row0, seq, eps, s_sq);   \
    else                                                                                         \
      rms_rope_rows_scalar<G>(x, bias, w, cos, sin, rows, dim, head_dim, row0, seq, eps, s_sq);  \
  }
WAN_RMS_ROPE_GROUPED(32)
WAN_RMS_ROPE_GROUPED(64)
WAN_RMS_ROPE_GROUPED(128)

// ---- Linear bias (+ GELU) ----

// In place on x [rows, dim]: x = bf16(x + bias) (a Linear's bias, as candle adds it), then when
// `gelu` is set x = gelu_tanh(x) with the GELU in f32.
// Generic version: bf16 pairs, any even dim.
extern "C" __global__ void wan_bias_act_bf16(bf16 *x, const bf16 *__restrict__ bias, long n,
                                             int dim, int gelu) {
  const long pairs = n / 2;
  for (long p = blockIdx.x * (long)blockDim.x + threadIdx.x; p < pairs;
       p += (long)gridDim.x * blockDim.x) {
    const int c = (int)((2 * p) % dim);
    float2 v = __bfloat1622float2(reinterpret_cast<bf162 *>(x)[p]);
    v.x = add_rounded(v.x, __bfloat162float(bias[c]));
    v.y = add_rounded(v.y, __bfloat162float(bias[c + 1]));
    if (gelu) {
      v.x = gelu_tanh(v.x);
      v.y = gelu_tanh(v.y);
    }
    reinterpret_cast<bf162 *>(x)[p] = __floats2bfloat162_rn(v.x, v.y);
  }
}

// Vector version (the same arithmetic): dim % 8 == 0, `vecs` = n / 8, 32-bit indices
// (n < 2^31); 16-byte accesses where x and bias are 16-byte aligned, else scalar ones.
extern "C" __global__ void wan_bias_act_v8_bf16(bf16 *x, const bf16 *__restrict__ bias, int vecs,
                                                int dim, int gelu) {
  if (aligned16(x) && aligned16(bias))
    bias_act_vecs<true>(x, bias, vecs, dim, gelu);
  else
    bias_act_vecs<false>(x, bias, vecs, dim, gelu);
}

// ---- Wan VAE (f32, activations [B, C, S] contiguous with S = frames * height * width) ----

// a / b rounded to nearest, from r = RN(1 / b), for finite nonzero b: the product's remainder is
// exact by FMA and one correction rounds the quotient as IEEE division would (Markstein), a
// product and two FMAs instead of a full-range division (a quotient below the normal range may
// differ in its last subnormal bit).
__device__ __forceinline__ float div_rn_by(float a, float b, float r) {
  const float q = __fmul_rn(a, r);
  return __fmaf_rn(__fmaf_rn(-q, b, a), r, q);
}

// SiLU(((v / norm) * scale) * gamma), divisions rounded as IEEE division (ChannelNorm::forward
// and candle's silu: y / (1 + exp(-y))); rnorm = RN(1 / norm), norm >= 1e-12. An infinite norm or
// 1 + exp(-y) (y < -88) takes the full division.
__device__ __forceinline__ float norm_silu(float v, float norm, float rnorm, float scale,
                                           float gamma) {
  const float n = norm < INFINITY ? div_rn_by(v, norm, rnorm) : __fdiv_rn(v, norm);
  const float y = __fmul_rn(__fmul_rn(n, scale), gamma);
  const float d = __fadd_rn(1.f, expf(-y));
  return d < INFINITY ? div_rn_by(y, d, __frcp_rn(d)) : __fdiv_rn(y, d);
}

// out[b, c, offset + s] = SiLU(((x / max(|x|_2, 1e-12)) * scale) * gamma[c]), the norm over the
// C channels of each pixel (diffusers' WanRMS_norm then SiLU), in the order of operations of
// ChannelNorm::forward and candle's silu. `out` has its own batch and channel strides (a
// convolution input buffer with cached frames in front), `offset` elements into each channel.
// One thread per pixel: a warp reads 32 consecutive pixels of one channel at a time. With
// `in_bias` (nullable), x + in_bias[c] is normalised: the bias of the conv that produced x,
// whose only reader is this norm, added here instead of in a pass of its own.
extern "C" __global__ void wan_vae_rms_silu_f32(const float *__restrict__ x,
                                                float *__restrict__ out,
                                                const float *__restrict__ gamma,
                                                const float *__restrict__ in_bias, int channels,
                                                long spatial, long pixels, long out_bs,
                                                long out_cs, long offset, float scale) {
  for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < pixels;
       i += (long)gridDim.x * blockDim.x) {
    const long b = i / spatial, s = i % spatial;
    const float *xp = x + b * channels * spatial + s;
    float sq = 0.f;
    for (int c = 0; c < channels; ++c) {
      float v = xp[c * spatial];
      if (in_bias != nullptr) v = __fadd_rn(v, in_bias[c]);
      sq = __fadd_rn(sq, __fmul_rn(v, v));
    }
    const float norm = fmaxf(__fsqrt_rn(sq), 1e-12f), rnorm = __frcp_rn(norm);
    float *op = out + b * out_bs + offset + s;
    for (int c = 0; c < channels; ++c) {
      float v = xp[c * spatial];
      if (in_bias != nullptr) v = __fadd_rn(v, in_bias[c]);
      op[c * out_cs] = norm_silu(v, norm, rnorm, scale, gamma[c]);
    }
  }
}

// In place on y [B, C, S]: y = (y + bias[c]) [+ res], `res` (same shape) may be null.
extern "C" __global__ void wan_vae_bias_add_f32(float *y, const float *__restrict__ bias,
                                                const float *__restrict__ res, int channels,
                                                long spatial, long n) {
  for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n;
       i += (long)gridDim.x * blockDim.x) {
    float v = __fadd_rn(y[i], bias[(i / spatial) % channels]);
    if (res != nullptr) v = __fadd_rn(v, res[i]);
    y[i] = v;
  }
}

// dst [B, C, T, 2H, 2W] = the four parities of src [B, 4C, T, H + 1, W + 1] interleaved, plus
// bias[c]: dst(2i + a, 2j + b) = src[parity 2a + b](i + a, j + b) (a nearest x2 upsampling's
// 3x3 conv computed as 2x2 convs of the frame, see `subpixel_weight`).
extern "C" __global__ void wan_vae_subpixel_f32(const float *__restrict__ src,
                                                float *__restrict__ dst,
                                                const float *__restrict__ bias, int channels,
                                                long frames, long h, long w, long n) {
  for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n;
       i += (long)gridDim.x * blockDim.x) {
    long r = i;
    const long x = r % (2 * w);
    r /= 2 * w;
    const long y = r % (2 * h);
    r /= 2 * h;
    const long t = r % frames;
    r /= frames;
    const long c = r % channels;
    const long b = r / channels;
    const long a = y & 1, bb = x & 1;
    const long plane = b * 4 * channels + (2 * a + bb) * channels + c;
    const long at = ((plane * frames + t) * (h + 1) + (y >> 1) + a) * (w + 1) + (x >> 1) + bb;
    dst[i] = __fadd_rn(src[at], bias[c]);
  }
}

// ---- Wan VAE channels last (f32, activations [P, C] contiguous, P = batch * frames * pixels) ----

// out[offset + p * C + c] = SiLU(((x / max(|x|_2, 1e-12)) * scale) * gamma[c]) over the C
// channels of pixel p (as wan_vae_rms_silu_f32, channels contiguous): one warp per pixel, the
// sum of squares reduced across the warp (in_bias as in wan_vae_rms_silu_f32). VEC: C % 4 == 0
// and x, out + offset 16-byte aligned.
// Channels c.. of a pixel (4 with VEC, else 1) into v, plus in_bias where it is not null.
template <bool VEC>
__device__ __forceinline__ void load_biased(const float *__restrict__ xp,
                                            const float *__restrict__ in_bias, int c, float *v) {
  if (VEC) {
    const float4 q = *reinterpret_cast<const float4 *>(xp + c);
    v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
  } else {
    v[0] = xp[c];
  }
  if (in_bias != nullptr)
    for (int k = 0; k < (VEC ? 4 : 1); ++k) v[k] = __fadd_rn(v[k], in_bias[c + k]);
}

template <bool VEC>
__device__ __forceinline__ void vae_rms_silu_cl(const float *__restrict__ x,
                                                float *__restrict__ out,
                                                const float *__restrict__ gamma,
                                                const float *__restrict__ in_bias, int channels,
                                                long pixels, long offset, float scale) {
  const int lane = threadIdx.x & 31;
  const long warps = (long)gridDim.x * (blockDim.x >> 5);
  const int step = VEC ? 128 : 32;
  for (long p = (blockIdx.x * (long)blockDim.x + threadIdx.x) >> 5; p < pixels; p += warps) {
    const float *xp = x + p * channels;
    float sq = 0.f;
    for (int c = (VEC ? 4 : 1) * lane; c < channels; c += step) {
      float v[4];
      load_biased<VEC>(xp, in_bias, c, v);
      if (VEC)
        sq = __fadd_rn(sq, __fadd_rn(__fadd_rn(__fmul_rn(v[0], v[0]), __fmul_rn(v[1], v[1])),
                                     __fadd_rn(__fmul_rn(v[2], v[2]), __fmul_rn(v[3], v[3]))));
      else
        sq = __fadd_rn(sq, __fmul_rn(v[0], v[0]));
    }
    for (int o = 16; o > 0; o >>= 1) sq = __fadd_rn(sq, __shfl_xor_sync(0xffffffffu, sq, o));
    const float norm = fmaxf(__fsqrt_rn(sq), 1e-12f), rnorm = __frcp_rn(norm);
    float *op = out + offset + p * channels;
    for (int c = (VEC ? 4 : 1) * lane; c < channels; c += step) {
      const int n = VEC ? 4 : 1;
      float v[4], r[4];
      load_biased<VEC>(xp, in_bias, c, v);
#pragma unroll
      for (int k = 0; k < n; ++k) r[k] = norm_silu(v[k], norm, rnorm, scale, gamma[c + k]);
      if (VEC)
        *reinterpret_cast<float4 *>(op + c) = make_float4(r[0], r[1], r[2], r[3]);
      else
        op[c] = r[0];
    }
  }
}

// vae_rms_silu_cl<true> for C <= 128 * HELD: each lane keeps its float4s of the pixel in
// registers from the sum of squares to the output, so x is read once (the sums in the same order).
template <int HELD>
__device__ __forceinline__ void vae_rms_silu_cl_held(const float *__restrict__ x,
                                                     float *__restrict__ out,
                                                     const float *__restrict__ gamma,
                                                     const float *__restrict__ in_bias,
                                                     int channels, long pixels, long offset,
                                                     float scale) {
  const int lane = threadIdx.x & 31;
  const long warps = (long)gridDim.x * (blockDim.x >> 5);
  for (long p = (blockIdx.x * (long)blockDim.x + threadIdx.x) >> 5; p < pixels; p += warps) {
    const float *xp = x + p * channels;
    float v[HELD][4];
    float sq = 0.f;
#pragma unroll
    for (int j = 0; j < HELD; ++j) {
      const int c = 4 * lane + 128 * j;
      if (c < channels) {
        load_biased<true>(xp, in_bias, c, v[j]);
        sq = __fadd_rn(sq, __fadd_rn(__fadd_rn(__fmul_rn(v[j][0], v[j][0]),
                                               __fmul_rn(v[j][1], v[j][1])),
                                     __fadd_rn(__fmul_rn(v[j][2], v[j][2]),
                                               __fmul_rn(v[j][3], v[j][3]))));
      }
    }
    for (int o = 16; o > 0; o >>= 1) sq = __fadd_rn(sq, __shfl_xor_sync(0xffffffffu, sq, o));
    const float norm = fmaxf(__fsqrt_rn(sq), 1e-12f), rnorm = __frcp_rn(norm);
    float *op = out + offset + p * channels;
#pragma unroll
    for (int j = 0; j < HELD; ++j) {
      const int c = 4 * lane + 128 * j;
      if (c < channels) {
        const float4 g = *reinterpret_cast<const float4 *>(gamma + c);
        *reinterpret_cast<float4 *>(op + c) =
            make_float4(norm_silu(v[j][0], norm, rnorm, scale, g.x),
                        norm_silu(v[j][1], norm, rnorm, scale, g.y),
                        norm_silu(v[j][2], norm, rnorm, scale, g.z),
                        norm_silu(v[j][3], norm, rnorm, scale, g.w));
      }
    }
  }
}

extern "C" __global__ void wan_vae_rms_silu_cl_f32(const float *__restrict__ x,
                                                   float *__restrict__ out,
                                                   const float *__restrict__ gamma,
                                                   const float *__restrict__ in_bias,
                                                   int channels, long pixels, long offset,
                                                   float scale) {
  constexpr int HELD = 4;
  const bool vec = channels % 4 == 0 && aligned16(x) && aligned16(out + offset);
  if (vec && aligned16(gamma) && channels <= 128 * HELD)
    vae_rms_silu_cl_held<HELD>(x, out, gamma, in_bias, channels, pixels, offset, scale);
  else if (vec)
    vae_rms_silu_cl<true>(x, out, gamma, in_bias, channels, pixels, offset, scale);
  else
    vae_rms_silu_cl<false>(x, out, gamma, in_bias, channels, pixels, offset, scale);
}

// In place on y [P, C] (C % 4 == 0, y and res 16-byte aligned), as float4s: y = (y + bias[c])
// [+ res], `res` (same shape) may be null.
extern "C" __global__ void wan_vae_bias_add_cl_v4_f32(float4 *y, const float *__restrict__ bias,
                                                      const float4 *__restrict__ res,
                                                      int channels, long vecs) {
  for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < vecs;
       i += (long)gridDim.x * blockDim.x) {
    const int c = (int)((i * 4) % channels);
    float4 v = y[i];
    v.x = __fadd_rn(v.x, bias[c]);
    v.y = __fadd_rn(v.y, bias[c + 1]);
    v.z = __fadd_rn(v.z, bias[c + 2]);
    v.w = __fadd_rn(v.w, bias[c + 3]);
    if (res != nullptr) {
      const float4 r = res[i];
      v.x = __fadd_rn(v.x, r.x);
      v.y = __fadd_rn(v.y, r.y);
      v.z = __fadd_rn(v.z, r.z);
      v.w = __fadd_rn(v.w, r.w);
    }
    y[i] = v;
  }
}

// A temporal upsampler's frames, channels last: dst [N, 2, P, C] (N = batch * frames, each frame
// doubled) = src [N, P, 2C] (channels [0, C) the first of the two frames, [C, 2C) the second)
// plus bias[2C] (the time convolution's). VEC elements per thread (4: C % 4 == 0 and both
// pointers 16-byte aligned).
template <int VEC>
__device__ __forceinline__ void vae_time_interleave_cl(const float *__restrict__ src,
                                                       float *__restrict__ dst,
                                                       const float *__restrict__ bias,
                                                       int channels, long pixels, long items) {
  for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < items;
       i += (long)gridDim.x * blockDim.x) {
    const long e = i * VEC;
    long r = e / channels;
    const int c = (int)(e - r * channels);
    const long p = r % pixels;
    r /= pixels;
    const int k = (int)(r & 1);
    const long at = ((r >> 1) * pixels + p) * 2 * channels + k * channels + c;
    const float *b = bias + k * channels + c;
    if constexpr (VEC == 4) {
      float4 v = *reinterpret_cast<const float4 *>(src + at);
      v.x = __fadd_rn(v.x, b[0]);
      v.y = __fadd_rn(v.y, b[1]);
      v.z = __fadd_rn(v.z, b[2]);
      v.w = __fadd_rn(v.w, b[3]);
      *reinterpret_cast<float4 *>(dst + e) = v;
    } else {
      dst[e] = __fadd_rn(src[at], b[0]);
    }
  }
}

extern "C" __global__ void wan_vae_time_interleave_cl_v4_f32(const float *__restrict__ src,
                                                             float *__restrict__ dst,
                                                             const float *__restrict__ bias,
                                                             int channels, long pixels, long vecs) {
  vae_time_interleave_cl<4>(src, dst, bias, channels, pixels, vecs);
}

extern "C" __global__ void wan_vae_time_interleave_cl_f32(const float *__restrict__ src,
                                                          float *__restrict__ dst,
                                                          const float *__restrict__ bias,
                                                          int channels, long pixels, long n) {
  vae_time_interleave_cl<1>(src, dst, bias, channels, pixels, n);
}

// dst [N, 2H, 2W, C] (N = batch * frames) = the four parities of src [N, H + 1, W + 1, 4C]
// interleaved, plus bias[c] (wan_vae_subpixel_f32 channels last).
extern "C" __global__ void wan_vae_subpixel_cl_f32(const float *__restrict__ src,
                                                   float *__restrict__ dst,
                                                   const float *__restrict__ bias, int channels,
                                                   long h, long w, long n) {
  for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n;
       i += (long)gridDim.x * blockDim.x) {
    long r = i / channels;
    const int c = (int)(i - r * channels);
    const long x = r % (2 * w);
    r /= 2 * w;
    const long y = r % (2 * h);
    const long f = r / (2 * h);
    const long a = y & 1, bb = x & 1;
    const long at = ((f * (h + 1) + (y >> 1) + a) * (w + 1) + (x >> 1) + bb) * 4 * channels +
                    (2 * a + bb) * channels + c;
    dst[i] = __fadd_rn(src[at], bias[c]);
  }
}
