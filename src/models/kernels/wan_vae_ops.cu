// Kernels of the Wan VAE (f32): the channel RMS norm + SiLU written into a convolution's input
// buffer, a convolution's per-channel bias (and residual) in place, and the up-sampling
// interleavings, each one pass computing what the candle composition in `vae/blocks.rs` computes.

#include <stdint.h>

namespace {

__device__ __forceinline__ bool aligned16(const void *p) {
  return (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}

} // namespace

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

// dst [B, T', H * fs, W * fs, Cout] = h (the same shape) + DupUp3D(src) channels last, src
// [B, T, H, W, Cin]: output channel o of cell (ti, j, k) (frame t' + skip = ft * t + ti, row
// fs * y + j, column fs * x + k) reads input channel ((o * ft + ti) * fs + j) * fs + k) / repeats
// of pixel (t, y, x); `skip` is the frames a first chunk drops (ft - 1), else 0. The same bits as
// the channels-first rearrangement and the add.
extern "C" __global__ void wan_vae_dup_up_add_cl_f32(const float *__restrict__ h,
                                                     const float *__restrict__ src,
                                                     float *__restrict__ dst, int c_in, int c_out,
                                                     int ft, int fs, int repeats, int skip,
                                                     long t_in, long t_out, long height,
                                                     long width, long n) {
  for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n;
       i += (long)gridDim.x * blockDim.x) {
    long r = i / c_out;
    const int o = (int)(i - r * c_out);
    const long xo = r % (width * fs);
    r /= width * fs;
    const long yo = r % (height * fs);
    r /= height * fs;
    const long to = r % t_out + skip;
    const long b = r / t_out;
    const long t = to / ft;
    const long cell = (((long)o * ft + to % ft) * fs + yo % fs) * fs + xo % fs;
    const long at = (((b * t_in + t) * height + yo / fs) * width + xo / fs) * c_in + cell / repeats;
    dst[i] = __fadd_rn(h[i], src[at]);
  }
}
