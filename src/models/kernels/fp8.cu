// fp8 matmuls (`--fp8-matmul`, models/fp8.rs defines the arithmetic): the row quantizer that
// turns a Linear's weight or its input into e4m3 codes with one f32 scale per row, and the
// epilogue that scales cuBLASLt's fp8 product back (times both rows' scales, plus the bias, then
// the activation). Built for compute_89 and up (e4m3 conversions in hardware; the products need
// sm_89+ anyway).
//
// Every product, quotient and sum is an explicit round-to-nearest float op, as the host
// definition computes it.

#include <cuda_bf16.h>
#include <stdint.h>

namespace {

#include "activation.cuh"
#include "e4m3.cuh"

constexpr int THREADS = 256; // threads per block of the scale pass: one block per row

__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f32(float v) { return v; }

template <typename T> __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ __nv_bfloat16 from_f32(float v) {
  return __float2bfloat16_rn(v);
}
template <> __device__ __forceinline__ float from_f32(float v) { return v; }

__device__ __forceinline__ bool aligned16(const void *p) {
  return (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}

// 8 consecutive values at a 16-byte aligned `p`, in f32 (one or two 16-byte loads).
__device__ __forceinline__ void load8(const __nv_bfloat16 *p, float (&v)[8]) {
  const uint4 u = *reinterpret_cast<const uint4 *>(p);
  const __nv_bfloat162 *h = reinterpret_cast<const __nv_bfloat162 *>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
}
__device__ __forceinline__ void load8(const float *p, float (&v)[8]) {
  const float4 a = reinterpret_cast<const float4 *>(p)[0];
  const float4 b = reinterpret_cast<const float4 *>(p)[1];
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}

// 8 values to a 16-byte aligned `p`, each rounded once.
__device__ __forceinline__ void store8(__nv_bfloat16 *p, const float (&v)[8]) {
  uint4 u;
  __nv_bfloat162 *h = reinterpret_cast<__nv_bfloat162 *>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
  *reinterpret_cast<uint4 *>(p) = u;
}
__device__ __forceinline__ void store8(float *p, const float (&v)[8]) {
  reinterpret_cast<float4 *>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
  reinterpret_cast<float4 *>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
}

// Largest of `v` over the warp (NaN ignored, as fmaxf and the host's f32::max do); every lane
// gets it.
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Rows of x [rows, k] into q [rows_pad, k_pad] (e4m3 codes) and scale [rows_pad], a warp per row
// (grid-stride): the scale is absmax / 448 (row_scale), the codes e4m3(x * (1 / scale)) rounded
// to nearest even (a
// zero row: scale 0, codes 0); columns from k to k_pad and rows from `rows` on (the padding
// cuBLASLt's fp8 layouts need) are zero codes with scale 0. Where k % 8 == 0 and x is 16-byte
// aligned, 8 values at a time (the same arithmetic). A warp reads its row twice: the second
// read finds it in cache.
template <typename T>
__device__ __forceinline__ void quantize_rows(const T *__restrict__ x, uint8_t *__restrict__ q,
                                              float *__restrict__ scale, int k, int k_pad,
                                              long rows, long rows_pad) {
  const int lane = threadIdx.x % 32;
  const long warps = (long)gridDim.x * blockDim.x / 32;
  const bool vec = k % 8 == 0 && aligned16(x) && aligned16(q);
  for (long row = ((long)blockIdx.x * blockDim.x + threadIdx.x) / 32; row < rows_pad;
       row += warps) {
    const bool real = row < rows;
    uint8_t *qr = q + row * k_pad;
    const T *xr = x + row * k;
    float m = 0.f;
    if (real && vec) {
#pragma unroll 4
      for (int c = 8 * lane; c < k; c += 8 * 32) {
        float v[8];
        load8(xr + c, v);
#pragma unroll
        for (int i = 0; i < 8; ++i) m = fmaxf(m, fabsf(v[i]));
      }
    } else if (real) {
      for (int c = lane; c < k; c += 32) m = fmaxf(m, fabsf(to_f32(xr[c])));
    }
    const float s = row_scale(warp_max(m)), inv = inverse(s);
    if (lane == 0) scale[row] = s;
    const bool codes = real && s > 0.f;
    if (vec) {
#pragma unroll 4
      for (int c = 8 * lane; c < k_pad; c += 8 * 32) {
        float v[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        if (codes && c < k) {
          load8(xr + c, v);
#pragma unroll
          for (int i = 0; i < 8; ++i) v[i] = __fmul_rn(v[i], inv);
        }
        uint2 out;
        uint8_t *b = reinterpret_cast<uint8_t *>(&out);
#pragma unroll
        for (int i = 0; i < 8; ++i) b[i] = e4m3(v[i]);
        *reinterpret_cast<uint2 *>(qr + c) = out;
      }
    } else {
      for (int c = lane; c < k_pad; c += 32) {
        const float v = (codes && c < k) ? __fmul_rn(to_f32(xr[c]), inv) : 0.f;
        qr[c] = e4m3(v);
      }
    }
  }
}

// 8 consecutive values of T, one 16-byte aligned load (two for f32).
template <typename T> struct alignas(16) Vec8 {
  T e[8];
};

// quantize_rows for rows that fit a block's registers (k % 8 == 0, x and q 16-byte aligned,
// k_pad <= 8 THREADS CHUNKS): a block per row (grid-stride) holds the row while it finds the
// absmax, so x is read once (the warp-per-row kernel reads each row twice). The same codes and
// scales: the absmax does not depend on the order of the fmaxf's.
template <typename T, int CHUNKS>
__device__ __forceinline__ void quantize_rows_held(const T *__restrict__ x,
                                                   uint8_t *__restrict__ q,
                                                   float *__restrict__ scale, int k, int k_pad,
                                                   long rows, long rows_pad) {
  __shared__ float warp_maxima[THREADS / 32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (long row = blockIdx.x; row < rows_pad; row += gridDim.x) {
    const bool real = row < rows;
    const T *xr = x + row * k;
    Vec8<T> held[CHUNKS];
#pragma unroll
    for (int i = 0; i < CHUNKS; ++i) {
      const int c = 8 * (threadIdx.x + i * THREADS);
      if (real && c < k) held[i] = *reinterpret_cast<const Vec8<T> *>(xr + c);
    }
    float m = 0.f;
#pragma unroll
    for (int i = 0; i < CHUNKS; ++i) {
      const int c = 8 * (threadIdx.x + i * THREADS);
      if (real && c < k)
#pragma unroll
        for (int e = 0; e < 8; ++e) m = fmaxf(m, fabsf(to_f32(held[i].e[e])));
    }
    m = warp_max(m);
    if (lane == 0) warp_maxima[warp] = m;
    __syncthreads();
#pragma unroll
    for (int w = 0; w < THREADS / 32; ++w) m = fmaxf(m, warp_maxima[w]);
    __syncthreads();  // every thread has read the maxima before the next row writes them
    const float s = row_scale(m), inv = inverse(s);
    if (threadIdx.x == 0) scale[row] = s;
    const bool zero = !real || s == 0.f;
    uint8_t *qr = q + row * k_pad;
#pragma unroll
    for (int i = 0; i < CHUNKS; ++i) {
      const int c = 8 * (threadIdx.x + i * THREADS);
      if (c < k_pad) {
        float v[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] = to_f32(held[i].e[e]);
        store_codes(qr + c, v, inv, zero || c >= k);
      }
    }
  }
}

// quantize_rows for bf16 rows that fit a warp's registers (k % 8 == 0, x and q 16-byte aligned,
// k_pad <= 256 CHUNKS): a warp per row (grid-stride) holds its row as loaded, all its loads in
// flight at once, and takes the absmax in bf16 pairs (the largest |x| of bf16 values is one of
// them: the same value as in f32); no block-wide reduction, so nothing waits for other warps.
template <int CHUNKS>
__device__ __forceinline__ void quantize_rows_warp_held(const __nv_bfloat16 *__restrict__ x,
                                                        uint8_t *__restrict__ q,
                                                        float *__restrict__ scale, int k,
                                                        int k_pad, long rows, long rows_pad) {
  const int lane = threadIdx.x % 32;
  const long warps = (long)gridDim.x * blockDim.x / 32;
  for (long row = ((long)blockIdx.x * blockDim.x + threadIdx.x) / 32; row < rows_pad;
       row += warps) {
    const bool real = row < rows;
    const __nv_bfloat16 *xr = x + row * k;
    uint4 held[CHUNKS];
#pragma unroll
    for (int i = 0; i < CHUNKS; ++i) {
      const int c = 8 * (lane + 32 * i);
      held[i] = real && c < k ? *reinterpret_cast<const uint4 *>(xr + c) : make_uint4(0, 0, 0, 0);
    }
    __nv_bfloat162 m2 = __float2bfloat162_rn(0.f);
#pragma unroll
    for (int i = 0; i < CHUNKS; ++i) {
      const __nv_bfloat162 *h = reinterpret_cast<const __nv_bfloat162 *>(&held[i]);
#pragma unroll
      for (int e = 0; e < 4; ++e) m2 = __hmax2(m2, __habs2(h[e]));
    }
    const float m = warp_max(fmaxf(__low2float(m2), __high2float(m2)));
    const float s = row_scale(m), inv = inverse(s);
    if (lane == 0) scale[row] = s;
    const bool zero = !real || s == 0.f;
    uint8_t *qr = q + row * k_pad;
#pragma unroll
    for (int i = 0; i < CHUNKS; ++i) {
      const int c = 8 * (lane + 32 * i);
      if (c < k_pad) {
        float v[8];
        load8(reinterpret_cast<const __nv_bfloat16 *>(&held[i]), v);
        store_codes(qr + c, v, inv, zero || c >= k);
      }
    }
  }
}

// act(acc * a * w + bias) in f32, as the host computes it.
__device__ __forceinline__ float scaled(float acc, float a, float w, const float *bias, int act) {
  float v = __fmul_rn(__fmul_rn(acc, a), w);
  if (bias != nullptr) v = __fadd_rn(v, *bias);
  return activate(v, act);
}

// Row `blockIdx.x` of out [rows, n] = act(acc * scale_a[row] * scale_w[col] + bias[col]) in f32,
// rounded once; acc [rows, ld] is the fp8 product as cuBLASLt stored it (it may be `out` itself
// when ld == n: each element is read before the same thread writes it). `bias` may be null.
// Where n and ld are multiples of 8 and every pointer is 16-byte aligned, 8 values at a time.
template <typename T>
__device__ __forceinline__ void scale_row(const T *acc, long ld, T *out,
                                          const float *__restrict__ scale_a,
                                          const float *__restrict__ scale_w,
                                          const T *__restrict__ bias, int n, int act) {
  const long row = blockIdx.x;
  const float a = scale_a[row];
  const T *ar = acc + row * ld;
  T *orow = out + row * n;
  const bool vec = n % 8 == 0 && ld % 8 == 0 && aligned16(acc) && aligned16(out) &&
                   aligned16(scale_w) && (bias == nullptr || aligned16(bias));
  if (vec) {
    for (int c = 8 * threadIdx.x; c < n; c += 8 * THREADS) {
      float v[8], w[8], b[8];
      load8(ar + c, v);
      load8(scale_w + c, w);
      if (bias != nullptr) load8(bias + c, b);
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = scaled(v[i], a, w[i], bias != nullptr ? &b[i] : nullptr, act);
      store8(orow + c, v);
    }
  } else {
    for (int c = threadIdx.x; c < n; c += THREADS) {
      const float b = bias != nullptr ? to_f32(bias[c]) : 0.f;
      orow[c] = from_f32<T>(scaled(to_f32(ar[c]), a, scale_w[c], bias != nullptr ? &b : nullptr, act));
    }
  }
}

} // namespace

// quantize_rows_held<T, CHUNKS> as its own kernel (each its own register budget).
#define QUANTIZE_HELD(NAME, T, CHUNKS)                                                           \
  extern "C" __global__ void __launch_bounds__(THREADS) quantize_rows_held##CHUNKS##_##NAME(     \
      const T *__restrict__ x, uint8_t *__restrict__ q, float *__restrict__ scale, int k,        \
      int k_pad, long rows, long rows_pad) {                                                    \
    quantize_rows_held<T, CHUNKS>(x, q, scale, k, k_pad, rows, rows_pad);                        \
  }
#define FP8_KERNELS(NAME, T)                                                                       \
  extern "C" __global__ void quantize_rows_##NAME(const T *__restrict__ x, uint8_t *__restrict__ q, \
                                                 float *__restrict__ scale, int k, int k_pad,     \
                                                 long rows, long rows_pad) {                      \
    quantize_rows<T>(x, q, scale, k, k_pad, rows, rows_pad);                                       \
  }                                                                                                \
  extern "C" __global__ void __launch_bounds__(THREADS)                                          \
      scale_rows_##NAME(const T *acc, long ld, T *out, const float *__restrict__ scale_a,          \
                        const float *__restrict__ scale_w, const T *__restrict__ bias, int n,      \
                        int act) {                                                                 \
    scale_row<T>(acc, ld, out, scale_a, scale_w, bias, n, act);                                    \
  }

FP8_KERNELS(bf16, __nv_bfloat16)
FP8_KERNELS(f32, float)
QUANTIZE_HELD(bf16, __nv_bfloat16, 4)
QUANTIZE_HELD(bf16, __nv_bfloat16, 8)
QUANTIZE_HELD(f32, float, 1)
QUANTIZE_HELD(f32, float, 2)
QUANTIZE_HELD(f32, float, 4)
QUANTIZE_HELD(f32, float, 8)

// quantize_rows_warp_held<CHUNKS> (bf16) as its own kernel.
#define QUANTIZE_WARP_HELD(CHUNKS)                                                               \
  extern "C" __global__ void __launch_bounds__(THREADS) quantize_rows_warp_held##CHUNKS##_bf16(  \
      const __nv_bfloat16 *__restrict__ x, uint8_t *__restrict__ q, float *__restrict__ scale,   \
      int k, int k_pad, long rows, long rows_pad) {                                              \
    quantize_rows_warp_held<CHUNKS>(x, q, scale, k, k_pad, rows, rows_pad);                      \
  }
QUANTIZE_WARP_HELD(8)
QUANTIZE_WARP_HELD(24)
