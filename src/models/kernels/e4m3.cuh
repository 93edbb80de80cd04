// A row's e4m3 codes as models/fp8.rs defines them: the scale absmax / 448, each code the value
// times 1 / scale rounded to nearest even (saturating). Included inside the anonymous namespaces
// of the kernels that make codes (fp8.cu's quantizers, row_ops.cu's norms that feed an fp8
// Linear), so every one makes the same bytes.

#pragma once

#include <cuda_fp8.h>

constexpr float E4M3_MAX = 448.f;

__device__ __forceinline__ uint8_t e4m3(float v) {
  return __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
}
// Two codes in one conversion: a's in the low byte, b's in the high one.
__device__ __forceinline__ uint16_t e4m3x2(float a, float b) {
  return __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
}

// A row's scale, absmax / 448, where it is a normal float; 0 below (the row quantizes as a zero
// row: its 1 / scale would overflow).
__device__ __forceinline__ float row_scale(float absmax) {
  const float s = __fdiv_rn(absmax, E4M3_MAX);
  return s < 1.17549435e-38f ? 0.f : s;
}

// The factor a row's values are multiplied by before rounding to e4m3: 1 / scale, correctly
// rounded (the host's 1.0 / scale).
__device__ __forceinline__ float inverse(float scale) { return __frcp_rn(scale); }

// 8 e4m3 codes of v * inv (zeros where `zero`), converted in pairs, one 8-byte store to `q`.
__device__ __forceinline__ void store_codes(uint8_t *q, const float (&v)[8], float inv,
                                            bool zero) {
  uint2 out;
  uint16_t *pair = reinterpret_cast<uint16_t *>(&out);
#pragma unroll
  for (int i = 0; i < 4; ++i)
    pair[i] = zero ? 0 : e4m3x2(__fmul_rn(v[2 * i], inv), __fmul_rn(v[2 * i + 1], inv));
  *reinterpret_cast<uint2 *>(q) = out;
}
