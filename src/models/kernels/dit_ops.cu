// Fused element-wise and row-wise kernels shared by the DiT blocks (bf16 in, bf16 out, f32
// math): each replaces a chain of candle ops that stored one full-size temporary per op. Each
// computes what the candle composition it replaces computes, in the same order of operations and
// with the same bf16 roundings, so the results differ from it only where a reduction's summation
// order moves the last f32 bit; GELU is the exception (computed in f32 and rounded once, as torch
// does: see `gelu_tanh_bf16`).
//
// Rows are tokens of [rows, dim] contiguous storage; `row0` is the index of the first row in the
// whole [batch * seq, dim] tensor (chunks start later) and `seq` the tokens per batch entry, so a
// row's batch entry is (row0 + row) / seq and its position (row0 + row) % seq. Modulation
// vectors are bf16 rows `mod_stride` elements apart per batch entry; a joint sequence (text
// first) takes the `_text` rows at positions below `split` (0: no text part). With a `rows`
// table (u32 per row of the whole tensor, not null), row r takes table row `rows[r]` instead of
// its batch entry's (a packed sequence whose rows carry their own timesteps: MiniMax H3).

#include <cuda_bf16.h>
#include <stdint.h>

namespace {

constexpr int THREADS = 256;  // threads per row block
constexpr int MAX_PAIRS = 16; // bf16 pairs per thread held in registers: dim <= 2 * 16 * 256

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

__device__ __forceinline__ float round_bf16(float v) {
  return __bfloat162float(__float2bfloat16_rn(v));
}

// 1 / sqrt(mean + eps) as candle's `mean_keepdim` (sum times the f32 of 1/dim), `+ eps`,
// `sqrt` and `recip` compute it.
__device__ __forceinline__ float inv_rms(float sum_sq, float inv_dim, float eps) {
  return __frcp_rn(__fsqrt_rn(__fadd_rn(__fmul_rn(sum_sq, inv_dim), eps)));
}

// GELU (tanh approximation) in f32, rounded once: what torch's bf16 `gelu(approximate="tanh")`
// computes (f32 opmath). candle's bf16 `gelu` rounds every step to bf16, which near x = -2 puts
// `1 + tanh(..)` ~9% off; the fused path follows torch, the reference of correct.
__device__ __forceinline__ bf16 gelu_tanh_bf16(bf16 x) {
  const float v = __bfloat162float(x);
  const float inner = 0.7978845608028654f * (v + 0.044715f * v * v * v);
  return __float2bfloat16_rn(0.5f * v * (1.f + tanhf(inner)));
}

// Exact GELU in f32, rounded once (torch's bf16 `gelu`).
__device__ __forceinline__ bf16 gelu_erf_bf16(bf16 x) {
  const float v = __bfloat162float(x);
  return __float2bfloat16_rn(v * normcdff(v));
}

// Element offset of column c of the modulation row of whole-tensor row r (its batch entry's, or
// `rows[r]`'s), and whether it takes the text rows.
__device__ __forceinline__ long mod_at(long r, int c, long seq, long split, long mod_stride,
                                       const unsigned *rows, bool *text) {
  *text = rows == nullptr && r % seq < split;
  return (rows == nullptr ? r / seq : (long)rows[r]) * mod_stride + c;
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

} // namespace

// out = RMSNorm(x) [* w] then, when `scale` is not null, bf16(bf16(n * bf16(1 + scale)) + shift):
// the composite `rms_norm` (f32: x * recip(sqrt(mean(x^2) + eps)) [* w], rounded) followed by
// the bf16 `x * (1 + scale) + shift` modulation.
extern "C" __global__ void dit_rms_mod_bf16(const bf16 *__restrict__ x, bf16 *__restrict__ out,
                                            const bf16 *__restrict__ w,
                                            const bf16 *shift, const bf16 *scale,
                                            const bf16 *shift_text, const bf16 *scale_text,
                                            const unsigned *rows, int dim, long row0, long seq,
                                            long split,
                                            long mod_stride, float inv_dim, float eps) {
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
  const float inv = inv_rms(block_sum(sq, scratch), inv_dim, eps);
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

// out = LayerNorm(x) [* w + b], rounded, then the modulation of `dit_rms_mod_bf16`. With
// `two_pass` 0, as candle's fused `layer_norm` computes it (one pass: mean and E[x^2] - mean^2,
// rsqrtf, `(x - mean) * inv * w + b`); with 1, as the f32 composition without affine does
// (mean, then mean((x - mean)^2), each a sum times f32(1/dim); `(x - mean) / sqrt(var + eps)`).
extern "C" __global__ void dit_layer_norm_mod_bf16(
    const bf16 *__restrict__ x, bf16 *__restrict__ out, const bf16 *__restrict__ w,
    const bf16 *__restrict__ b, const bf16 *shift, const bf16 *scale, const bf16 *shift_text,
    const bf16 *scale_text, const unsigned *rows, int dim, long row0, long seq, long split,
    long mod_stride, int two_pass, float inv_dim, float eps) {
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
      sq += v[i].x * v[i].x + v[i].y * v[i].y;
    }
  }
  float mean, inv_std = 0.f, std = 0.f;
  if (two_pass) {
    mean = __fmul_rn(block_sum(sum, scratch), inv_dim);
    float sq_c = 0.f;
#pragma unroll
    for (int i = 0; i < MAX_PAIRS; ++i) {
      const int p = threadIdx.x + i * THREADS;
      if (p < pairs) {
        const float a = v[i].x - mean, c = v[i].y - mean;
        sq_c += a * a + c * c;
      }
    }
    std = __fsqrt_rn(__fadd_rn(__fmul_rn(block_sum(sq_c, scratch), inv_dim), eps));
  } else {
    mean = block_sum(sum, scratch) / dim;
    const float var = block_sum(sq, scratch) / dim - mean * mean;
    inv_std = rsqrtf(var + eps);
  }
  bf162 *outr = reinterpret_cast<bf162 *>(out + row * dim);
#pragma unroll
  for (int i = 0; i < MAX_PAIRS; ++i) {
    const int p = threadIdx.x + i * THREADS;
    if (p < pairs) {
      const int c = 2 * p;
      float y[2] = {v[i].x, v[i].y};
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        if (two_pass) {
          y[k] = __fdiv_rn(y[k] - mean, std);
        } else {
          y[k] = (y[k] - mean) * inv_std;
        }
        if (w != nullptr) y[k] = y[k] * __bfloat162float(w[c + k]) + __bfloat162float(b[c + k]);
        y[k] = round_bf16(y[k]);
        y[k] = modulate(y[k], c + k, row0, row, seq, split, mod_stride, shift, scale, shift_text,
                        scale_text, rows);
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
extern "C" __global__ void dit_head_norm_rope_bf16(bf16 *x, const bf16 *__restrict__ bias,
                                                   const bf16 *__restrict__ w,
                                                   const bf16 *__restrict__ b,
                                                   const float *__restrict__ cos,
                                                   const float *__restrict__ sin, long units,
                                                   int dim, int head_dim, long row0, long seq,
                                                   int rms, long rope_start, long rope_end,
                                                   int rotary, float eps) {
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
  const bool rotate = cos != nullptr && pos >= rope_start && pos < rope_end;
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
      if (rotate && rotary == 0) {
        const long j = (pos - rope_start) * half + p;
        const float cj = cos[j], sj = sin[j];
        const float r0 = y0 * cj - y1 * sj;
        const float r1 = y0 * sj + y1 * cj;
        y0 = r0;
        y1 = r1;
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
        if (rotate && e < rotary) {
          const long j = (pos - rope_start) * rhalf + e % rhalf;
          r[k] = e < rhalf ? y[e] * cos[j] - y[e + rhalf] * sin[j]
                           : y[e - rhalf] * sin[j] + y[e] * cos[j];
        }
      }
      xr[p] = __floats2bfloat162_rn(r[0], r[1]);
    }
  }
}

// In place on x [rows, dim]: x = bf16(x + bias) when `bias` is not null (a Linear's bias), then
// the composite RMSNorm over the whole row (all heads) with weight w, rounded; then, when `cos`
// is not null, the interleaved-pair RoPE (cos/sin [seq, head_dim / 2] f32, per head, math in
// f32 as candle's `rope_i`), rounded.
extern "C" __global__ void dit_rms_rope_bf16(bf16 *x, const bf16 *__restrict__ bias,
                                             const bf16 *__restrict__ w,
                                             const float *__restrict__ cos,
                                             const float *__restrict__ sin, int dim, int head_dim,
                                             long row0, long seq, float inv_dim, float eps) {
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
        v[i].x = round_bf16(v[i].x + __bfloat162float(bias[2 * p]));
        v[i].y = round_bf16(v[i].y + __bfloat162float(bias[2 * p + 1]));
      }
      sq += v[i].x * v[i].x + v[i].y * v[i].y;
    }
  }
  const float inv = inv_rms(block_sum(sq, scratch), inv_dim, eps);
  const long pos = (row0 + row) % seq;
  const int half = head_dim / 2;
#pragma unroll
  for (int i = 0; i < MAX_PAIRS; ++i) {
    const int p = threadIdx.x + i * THREADS;
    if (p < pairs) {
      const int c = 2 * p;
      float y0 = round_bf16(__fmul_rn(__fmul_rn(v[i].x, inv), __bfloat162float(w[c])));
      float y1 = round_bf16(__fmul_rn(__fmul_rn(v[i].y, inv), __bfloat162float(w[c + 1])));
      if (cos != nullptr) {
        const long j = pos * half + (c % head_dim) / 2;
        const float cj = cos[j], sj = sin[j];
        const float r0 = y0 * cj - y1 * sj;
        const float r1 = y0 * sj + y1 * cj;
        y0 = r0;
        y1 = r1;
      }
      xr[p] = __floats2bfloat162_rn(y0, y1);
    }
  }
}

// out = bf16(res + bf16(bf16(delta [+ bias]) [* gate[batch]])) element-wise over n elements of
// rows of `dim`: candle's bf16 `res + (linear_out).broadcast_mul(gate)`. `bias` and `gate`
// (bf16 rows `gate_stride` apart per batch entry, or per table row with `rows`; `gate_text`
// below position `split`) may be null. `out` may be `res` or `delta`
// (each element is read before it is written).
extern "C" __global__ void dit_residual_bf16(const bf16 *res, const bf16 *delta,
                                             const bf16 *__restrict__ bias,
                                             const bf16 *gate, const bf16 *gate_text,
                                             const unsigned *rows, bf16 *out, long n, int dim,
                                             long row0, long seq, long split, long gate_stride) {
  const long pairs = n / 2;
  for (long p = blockIdx.x * (long)blockDim.x + threadIdx.x; p < pairs;
       p += (long)gridDim.x * blockDim.x) {
    const long i = 2 * p;
    const int c = (int)(i % dim);
    const float2 r = __bfloat1622float2(reinterpret_cast<const bf162 *>(res)[p]);
    float2 d = __bfloat1622float2(reinterpret_cast<const bf162 *>(delta)[p]);
    if (bias != nullptr) {
      d.x = round_bf16(d.x + __bfloat162float(bias[c]));
      d.y = round_bf16(d.y + __bfloat162float(bias[c + 1]));
    }
    if (gate != nullptr) {
      bool text;
      const long at = mod_at(row0 + i / dim, c, seq, split, gate_stride, rows, &text);
      const bf16 *g = text ? gate_text : gate;
      d.x = round_bf16(__fmul_rn(d.x, __bfloat162float(g[at])));
      d.y = round_bf16(__fmul_rn(d.y, __bfloat162float(g[at + 1])));
    }
    reinterpret_cast<bf162 *>(out)[p] =
        __floats2bfloat162_rn(__fadd_rn(r.x, d.x), __fadd_rn(r.y, d.y));
  }
}

// In place on x [rows, dim]: x = bf16(x + bias) (a Linear's bias, as candle adds it), then
// `act` 1: GELU (tanh), 2: exact GELU, both in f32 and rounded once, 0: nothing.
extern "C" __global__ void dit_bias_act_bf16(bf16 *x, const bf16 *__restrict__ bias, long n,
                                             int dim, int act) {
  const long pairs = n / 2;
  for (long p = blockIdx.x * (long)blockDim.x + threadIdx.x; p < pairs;
       p += (long)gridDim.x * blockDim.x) {
    const int c = (int)((2 * p) % dim);
    const float2 f = __bfloat1622float2(reinterpret_cast<bf162 *>(x)[p]);
    bf16 v[2] = {__float2bfloat16_rn(f.x + __bfloat162float(bias[c])),
                 __float2bfloat16_rn(f.y + __bfloat162float(bias[c + 1]))};
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      if (act == 1) v[k] = gelu_tanh_bf16(v[k]);
      else if (act == 2) v[k] = gelu_erf_bf16(v[k]);
    }
    reinterpret_cast<bf162 *>(x)[p] = __halves2bfloat162(v[0], v[1]);
  }
}

// out [rows, inner] = bf16(value * bf16(silu(gate))) of h [rows, 2 * inner] = [value | gate]
// (diffusers' SwiGLU feed-forward, value first): SiLU in f32 and rounded once, as torch's bf16
// `silu` computes it, then the rounded product.
extern "C" __global__ void dit_swiglu_bf16(const bf16 *__restrict__ h, bf16 *__restrict__ out,
                                           long n, int inner) {
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
