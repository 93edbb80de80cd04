// What the 8-bit attention's kernels (sage_attn.cu, sage_attn_sm90.cu) share: e4m3's range, the
// fast int32-to-float of the score sums, the packing of outputs and e4m3 codes, the value channels'
// mean and scale. Included inside their anonymous namespaces.

#pragma once

constexpr float E4M3_MAX = 448.f;
constexpr float LOG2_E4M3_MAX = 8.807354922057604f;  // log2(448): P times 448 inside the exponent
// An int32 below 2^22 in magnitude plus this, as a float, is 2^23 + 2^22 + the int: one integer
// add and one float subtract instead of a conversion (which issues at a quarter of the rate).
constexpr int MAGIC_INT = 0x4B400000;
constexpr float MAGIC_FLOAT = 12582912.f;

__device__ __forceinline__ uint32_t pack2(float lo, float hi, __nv_bfloat16) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t *>(&v);
}
__device__ __forceinline__ uint32_t pack2(float lo, float hi, __half) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t *>(&v);
}

// Four floats as e4m3 codes (round to nearest even, saturating), a in the lowest byte.
__device__ __forceinline__ uint32_t e4m3x4(float a, float b, float c, float d) {
  const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
  const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(c, d), __NV_SATFINITE, __NV_E4M3);
  return __byte_perm(lo, hi, 0x5410);
}

// Channel c's mean and scale of v from the statistics [4][D] of its (batch, head) over `len` keys.
__device__ __forceinline__ float2 v_channel(const float *stats, int D, int c, int len) {
  const float mean = stats[D + c] / static_cast<float>(len);
  const float spread = fmaxf(stats[2 * D + c] - mean, mean - stats[3 * D + c]);
  return make_float2(mean, spread / E4M3_MAX);
}
