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

// bf16(a + b): what candle's bf16 `broadcast_add` of a Linear bias gives.
__device__ __forceinline__ float add_rounded(float a, float b) {
  return __bfloat162float(__float2bfloat16_rn(a + b));
}

} // namespace

// out = LayerNorm(x) * w[batch] + b[batch] (no affine of its own, two-pass mean and variance,
// y = (x - mean) / sqrt(var + eps)), as `layer_norm_f32` then broadcast_mul/add. `wb_stride` is
// the distance between batch entries of w and b (0: one row shared by all).
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
      v[i].x -= mean;
      v[i].y -= mean;
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

// out = res + (delta [+ bias]) [* gate[batch]] element-wise over n elements of rows of `dim`;
// `bias` (bf16, rounded after the add like a Linear's) and `gate` (f32 [batch, dim]) may be null.
// `out` may be `res` or `delta` (each element is read before it is written).
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
    reinterpret_cast<bf162 *>(out)[p] = __floats2bfloat162_rn(__fadd_rn(r.x, d.x), __fadd_rn(r.y, d.y));
  }
}

// In place on x [rows, dim]: x = x [+ bias] (rounded), then RMSNorm over the whole row (all
// heads) with weight w, rounded as candle's rms_norm rounds; then, when `cos` is not null, the
// interleaved-pair RoPE of each head (cos/sin [seq, head_dim / 2] f32, math in f32), rounded.
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
      float y0 = __bfloat162float(__float2bfloat16_rn(scale * v[i].x * __bfloat162float(w[c])));
      float y1 =
          __bfloat162float(__float2bfloat16_rn(scale * v[i].y * __bfloat162float(w[c + 1])));
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

// In place on x [rows, dim]: x = bf16(x + bias) (a Linear's bias, as candle adds it), then when
// `gelu` is set x = gelu_tanh(x) with the GELU in f32.
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
      const float k = 0.7978845608028654f; // sqrt(2 / pi)
      v.x = 0.5f * v.x * (1.f + tanhf(k * (v.x + 0.044715f * v.x * v.x * v.x)));
      v.y = 0.5f * v.y * (1.f + tanhf(k * (v.y + 0.044715f * v.y * v.y * v.y)));
    }
    reinterpret_cast<bf162 *>(x)[p] = __floats2bfloat162_rn(v.x, v.y);
  }
}

// ---- Wan VAE (f32, activations [B, C, S] contiguous with S = frames * height * width) ----

// out[b, c, offset + s] = SiLU(((x / max(|x|_2, 1e-12)) * scale) * gamma[c]), the norm over the
// C channels of each pixel (diffusers' WanRMS_norm then SiLU), in the order of operations of
// ChannelNorm::forward and candle's silu. `out` has its own batch and channel strides (a
// convolution input buffer with cached frames in front), `offset` elements into each channel.
// One thread per pixel: a warp reads 32 consecutive pixels of one channel at a time.
extern "C" __global__ void wan_vae_rms_silu_f32(const float *__restrict__ x,
                                                float *__restrict__ out,
                                                const float *__restrict__ gamma, int channels,
                                                long spatial, long pixels, long out_bs,
                                                long out_cs, long offset, float scale) {
  for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < pixels;
       i += (long)gridDim.x * blockDim.x) {
    const long b = i / spatial, s = i % spatial;
    const float *xp = x + b * channels * spatial + s;
    float sq = 0.f;
    for (int c = 0; c < channels; ++c) {
      const float v = xp[c * spatial];
      sq = __fadd_rn(sq, __fmul_rn(v, v));
    }
    const float norm = fmaxf(__fsqrt_rn(sq), 1e-12f);
    float *op = out + b * out_bs + offset + s;
    for (int c = 0; c < channels; ++c) {
      const float y = __fmul_rn(__fmul_rn(__fdiv_rn(xp[c * spatial], norm), scale), gamma[c]);
      op[c * out_cs] = __fdiv_rn(y, __fadd_rn(1.f, expf(-y)));
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
