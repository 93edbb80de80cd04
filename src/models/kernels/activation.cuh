// The activations of a Linear's output that the own element-wise kernels apply in f32 (row_ops.cu,
// fp8.cu). Included inside their anonymous namespaces.

#pragma once

// 0.5 v (1 + tanh(sqrt(2 / pi) (v + 0.044715 v^3))) in f32, with one fma: what torch's bf16
// `gelu(approximate="tanh")` computes (f32 opmath) before its one rounding. candle's bf16 `gelu`
// rounds every step to bf16, which near x = -2 puts `1 + tanh(..)` ~9% off.
__device__ __forceinline__ float gelu_tanh(float v) {
  const float k = 0.7978845608028654f; // sqrt(2 / pi)
  const float inner = __fmaf_rn(v, __fmul_rn(v, __fmul_rn(v, 0.044715f)), v);
  return __fmul_rn(__fmul_rn(v, 0.5f), __fadd_rn(tanhf(__fmul_rn(inner, k)), 1.f));
}

// The activation `act` (0: none, 1: GELU tanh, 2: exact GELU) of a bf16 value, in f32.
__device__ __forceinline__ float activate(float v, int act) {
  if (act == 1) return gelu_tanh(v);
  if (act == 2) return __fmul_rn(v, normcdff(v));
  return v;
}
