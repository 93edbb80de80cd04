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

// Four floats as e4m3 codes (round to nearest even, saturating), a in the lowest byte: two
// conversions of a pair each, merged into one register (the intrinsic's 16-bit results cost a mask
// each and a byte permute: 48 more instructions per 128-key tile in sage_attn_sm90.cu).
__device__ __forceinline__ uint32_t e4m3x4(float a, float b, float c, float d) {
  uint32_t codes;
  asm("{\n.reg .b16 lo, hi;\n"
      "cvt.rn.satfinite.e4m3x2.f32 lo, %2, %1;\n"
      "cvt.rn.satfinite.e4m3x2.f32 hi, %4, %3;\n"
      "mov.b32 %0, {lo, hi};\n}\n"
      : "=r"(codes)
      : "f"(a), "f"(b), "f"(c), "f"(d));
  return codes;
}

// Channel c's mean and scale of v from the statistics [4][D] of its (batch, head) over `len` keys.
__device__ __forceinline__ float2 v_channel(const float *stats, int D, int c, int len) {
  const float mean = stats[D + c] / static_cast<float>(len);
  const float spread = fmaxf(stats[2 * D + c] - mean, mean - stats[3 * D + c]);
  return make_float2(mean, spread / E4M3_MAX);
}
